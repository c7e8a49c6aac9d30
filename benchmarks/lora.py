"""LoRA on one process: fivecut beside transformers + peft, the same model and settings.

The model is a random `LlamaForCausalLM` of SmolLM2-135M's shape (30 layers, hidden 576, 9 heads /
3 kv heads, MLP 1536, vocabulary 49,152), built by transformers and saved once. Both sides load
it, put rank-r adapters (alpha 2r, no dropout) on every attention and MLP projection, freeze the
rest, and train the adapters with AdamW (lr 1e-3, no weight decay, clipping at 1.0) on the same
batch shape in fp32, one thread:

  fivecut   `fivecut train` with model.init_from = hf:FOLDER and [lora]; its own per-step times
            (metrics.jsonl `step_time`)
  hf-peft   `peft.get_peft_model` over the transformers model, a plain PyTorch loop (forward with
            labels, backward, clip, step, zero_grad), each step timed

Each side runs in its own process, so that each peak is its own; the peak is the process's resident
high-water mark (VmHWM) at the end, the model's load included on both sides. Steps after the first
`--warmup` are timed; the sides alternate (fivecut, hf, hf, fivecut, ...) over `--repeats`.
The model-state bytes of LoRA against full fine-tuning come from `fivecut ledger` on the same shape
(its measured params + grads + optimizer).

    python benchmarks/lora.py [--rank 16] [--batch 4] [--seq 256] [--steps 6] [--warmup 2] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.common import load_average, machine  # noqa: E402

SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
             num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
             tie_word_embeddings=True, rms_norm_eps=1e-5, rope_theta=100000.0)  # fmt: skip
MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_model(folder: Path) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE)).save_pretrained(folder)


def hf_peft(folder: str, opts: dict) -> dict:
    """The transformers + peft side, in this process: step times and the process's peak."""
    import peft
    import torch
    import transformers

    torch.set_num_threads(1)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    r = opts["rank"]
    model = peft.get_peft_model(model, peft.LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0, target_modules=MODULES))
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0)
    g = torch.Generator().manual_seed(1)
    times = []
    for _ in range(opts["warmup"] + opts["steps"]):
        ids = torch.randint(0, SHAPE["vocab_size"], (opts["batch"], opts["seq"]), generator=g)
        start = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    return {"times": times[opts["warmup"] :], "peak": peak_rss(), "trained": sum(p.numel() for p in params)}


def peak_rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def fivecut_run(folder: Path, opts: dict, out: Path) -> dict:
    r = opts["rank"]
    sets = [
        f'model.init_from="hf:{folder}"', 'data.tokenizer="byte"', f'data.cache_dir="{out / "cache"}"',
        f"train.seq_len={opts['seq']}", f"train.global_batch={opts['batch']}",
        f"train.steps={opts['warmup'] + opts['steps']}", "train.warmup=0", 'train.dtype="fp32"', "train.lr=1e-3",
        "train.weight_decay=0.0", "train.grad_clip=1.0", "train.eval_every=0", f'log.out_dir="{out / "log"}"',
        "log.log_every=1", "log.progress=false", "log.plot=false", f"lora.rank={r}", f"lora.alpha={2.0 * r}",
        'lora.targets=["attention", "mlp"]',
    ]  # fmt: skip
    code = (
        "import sys, torch; torch.set_num_threads(1); from fivecut.cli import main; r = main(sys.argv[1:]); "
        "print('PEAK', next(int(l.split()[1]) * 1024 for l in open('/proc/self/status') if l.startswith('VmHWM:'))); "
        "sys.exit(r)"
    )
    argv = [sys.executable, "-c", code, "train", *[x for s in sets for x in ("--set", s)]]
    done = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, check=False)
    if done.returncode:
        raise RuntimeError(done.stdout[-2000:] + done.stderr[-3000:])
    peak = int(next(line.split()[1] for line in done.stdout.splitlines() if line.startswith("PEAK")))
    steps = [json.loads(line) for line in (out / "log" / "metrics.jsonl").read_text().splitlines()]
    times = [s["step_time"] for s in steps if "step_time" in s][opts["warmup"] :]
    return {"times": times, "peak": peak}


def hf_run(folder: Path, opts: dict) -> dict:
    code = f"import json, sys; sys.path.insert(0, {str(REPO)!r}); from benchmarks.lora import hf_peft; "
    code += f"print('RESULT', json.dumps(hf_peft({str(folder)!r}, {opts!r})))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=False)
    if done.returncode:
        raise RuntimeError(done.stderr[-3000:])
    return json.loads(next(line[7:] for line in done.stdout.splitlines() if line.startswith("RESULT ")))


def model_states(model: str, rank: int | None, dtype: str, quantize: bool = False) -> int:
    """`fivecut ledger`'s measured model states (params + grads + optimizer) of `model`."""
    sets = ["--set", f'train.dtype="{dtype}"'] + (["--set", f"lora.rank={rank}"] if rank else [])
    sets += ["--set", 'lora.quantize="nf4"'] if quantize else []
    argv = [sys.executable, "-m", "fivecut", "ledger", "--model", model, "--layout", "dp=1", "--steps", "1", *sets]
    argv += ["--set", "train.seq_len=64", "--set", "train.global_batch=1"]
    out = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, check=True).stdout
    line = next(x for x in out.splitlines() if x.startswith("total "))
    return int(line.split()[-2].replace(",", ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--states-only", action="store_true", help="only the model-state table (fivecut ledger)")
    opts = vars(parser.parse_args())
    print(f"benchmarks/lora.py {' '.join(sys.argv[1:])}\nmachine: {machine()}, load {load_average()} before")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "model"
        make_model(folder)
        if not opts.pop("states_only"):
            side_by_side(folder, opts, Path(tmp))
        states(folder, opts["rank"])
    print(f"load {load_average()} after")


def side_by_side(folder: Path, opts: dict, tmp: Path) -> None:
    """fivecut and transformers + peft, alternating, each run in its own process."""
    runs: dict[str, list[dict]] = {"fivecut": [], "hf-peft": []}
    for r in range(opts["repeats"]):
        order = ["fivecut", "hf-peft"] if r % 2 == 0 else ["hf-peft", "fivecut"]
        for side in order:
            got = fivecut_run(folder, opts, tmp / f"run{r}") if side == "fivecut" else hf_run(folder, opts)
            runs[side].append(got)
            print(f"  repeat {r + 1} {side}: median step {statistics.median(got['times']):.3f} s, "
                  f"peak {got['peak'] / 2**20:,.0f} MiB", flush=True)  # fmt: skip
    tokens = opts["batch"] * opts["seq"]
    step = {s: statistics.median(t for run in rs for t in run["times"]) for s, rs in runs.items()}
    peak = {s: max(run["peak"] for run in rs) for s, rs in runs.items()}
    print(f"\nSmolLM2-135M's shape, rank {opts['rank']} on the 7 projections, {opts['batch']} x {opts['seq']} "
          "tokens, fp32")  # fmt: skip
    print("| side | median step | tokens/s | peak RSS |\n|---|---:|---:|---:|")
    for s in runs:
        print(f"| {s} | {step[s]:.3f} s | {tokens / step[s]:,.0f} | {peak[s] / 2**20:,.0f} MiB |")
    print(f"\nstep time fivecut / hf-peft: {step['fivecut'] / step['hf-peft']:.3f}x; "
          f"peak fivecut / hf-peft: {peak['fivecut'] / peak['hf-peft']:.3f}x")  # fmt: skip


def states(folder: Path, rank: int) -> None:
    """Model states of full fine-tuning, LoRA and QLoRA, measured by `fivecut ledger`."""
    print("\n| model | train.dtype | full fine-tuning | LoRA | LoRA / full | QLoRA | QLoRA / full |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for name, model in (("small (17.6M)", "small"), ("SmolLM2-135M's shape", f"hf:{folder}")):
        for dtype in ("fp32", "bf16"):
            full, lora = model_states(model, None, dtype), model_states(model, rank, dtype)
            qlora = model_states(model, rank, dtype, quantize=True)
            print(f"| {name} | {dtype} | {full:,} B | {lora:,} B | {lora / full:.3f} | {qlora:,} B | "
                  f"{qlora / full:.3f} |")  # fmt: skip


if __name__ == "__main__":
    main()
