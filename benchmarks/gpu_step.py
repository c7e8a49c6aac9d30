"""One GPU, one call: fivecut's bf16 training step beside Hugging Face transformers at the same
settings, and AdamW's fused and foreach kernels side by side.

Cases (each in its own process, so each peak is its own):
  fivecut-eager           `fivecut train`, bf16 autocast over fp32 masters, the chunked loss (default)
  fivecut-full-logits     the same with train.loss_chunk_tokens = 0 (the [tokens, vocab] logits whole)
  fivecut-compiled        train.compile = true
  hf-eager, hf-compiled   `LlamaForCausalLM` (SDPA) of the same shape: bf16 autocast over fp32
                          weights, torch's AdamW (the kernel fivecut picks, fused), clipping at 1.0
  fivecut-moe, hf-moe     the MoE shape of issue 33: the dense shape's first layer, then 32 routed
                          experts (top-4, hidden 512) and one shared expert a layer; transformers'
                          nearest class is `Qwen2MoeForCausalLM` (softmax top-k, renormalised), which
                          adds Q/K/V biases and a sigmoid gate on the shared expert (a rounding error
                          in FLOPs); MFU counts both by fivecut's active-parameter FLOPs
  fivecut-moe-compiled    the MoE shape with train.compile (its MoE blocks compiled whole at ep = 1)
  adamw                   AdamW's step over llama-1b's parameters: fused vs foreach (ms, medians)

Tokens/s and MFU are medians of the steps after the first third (allocation, autotuning,
compilation); MFU is 6N + 12·L·h·s FLOPs a token over the data-sheet peak (fivecut's own
figure, `fivecut.model.args.ModelArgs.flops_per_token`); peak is the allocator's peak in GiB.

    python benchmarks/gpu_step.py --out DIR [--cases a,b,...] [--steps N] [--smoke]
    --smoke: the tiny model on the CPU for a few steps (checks the script, not the figures)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from fivecut.model.args import ModelArgs  # noqa: E402
from fivecut.model.presets import PRESETS  # noqa: E402
from fivecut.train.metrics import peak_tflops  # noqa: E402
from fivecut.train.optim import build_optimizer  # noqa: E402
from fivecut.weights.hf import llama_config  # noqa: E402

MOE = {"n_experts": 32, "top_k": 4, "moe_ffn_dim": 512, "n_shared_experts": 1, "first_dense_layers": 1}
CASES = ("fivecut-eager", "fivecut-full-logits", "fivecut-compiled", "hf-eager", "hf-compiled", "fivecut-moe", "hf-moe")
FIVECUT_SETTINGS = {
    "fivecut-eager": [],
    "fivecut-full-logits": ["train.loss_chunk_tokens=0"],
    "fivecut-compiled": ["train.compile=true"],
    "fivecut-moe": [f"model.{k}={v}" for k, v in MOE.items()],
    "fivecut-moe-compiled": [f"model.{k}={v}" for k, v in MOE.items()] + ["train.compile=true"],
}


def shape(preset: str, moe: bool) -> ModelArgs:
    return dataclasses.replace(PRESETS[preset], **MOE) if moe else PRESETS[preset]


def median_after_warmup(values: list[float]) -> float:
    return statistics.median(values[len(values) // 3 :] or values)


# ---------------------------------------------------------------- fivecut: the CLI, as users run it


def fivecut_case(name: str, opts, work: Path) -> dict:
    out = work / name
    sets = [
        f'model.preset="{opts.model}"',
        'train.dtype="bf16"',
        f"train.steps={opts.steps}",
        f"train.seq_len={opts.seq}",
        f"train.global_batch={opts.batch}",
        "train.warmup=2",
        "train.eval_every=0",
        "log.progress=false",
        "log.plot=false",
        f"log.log_every={opts.steps}",
        f'log.out_dir="{out}"',
        f'data.source="{opts.corpus}"',
        'data.tokenizer="byte"',
        f'data.cache_dir="{work / "cache"}"',
        *FIVECUT_SETTINGS[name],
    ]
    command = [sys.executable, "-m", "fivecut", "train"] + [a for s in sets for a in ("--set", s)]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=opts.case_timeout)
    if result.returncode != 0:
        return {"error": (result.stdout + result.stderr)[-1500:]}
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "tokens_per_s" in r]
    return {
        "tokens_per_s": median_after_warmup([r["tokens_per_s"] for r in steps]),
        "mfu": median_after_warmup([r["mfu"] for r in steps]),
        "peak_gib": max((r.get("peak_allocated_gib", 0.0) for r in steps[1:]), default=0.0),
        "loss": f"{steps[0]['loss']:.3f} -> {steps[-1]['loss']:.3f}",
    }


# ---------------------------------------------------------------- transformers, in a worker process


def hf_model(args: ModelArgs, device):
    import transformers

    if args.is_moe:
        config = transformers.Qwen2MoeConfig(
            vocab_size=args.vocab_size,
            hidden_size=args.dim,
            intermediate_size=args.ffn_dim,
            num_hidden_layers=args.n_layers,
            num_attention_heads=args.n_heads,
            num_key_value_heads=args.n_kv_heads,
            max_position_embeddings=args.max_seq_len,
            rope_theta=args.rope_theta,
            rms_norm_eps=args.norm_eps,
            tie_word_embeddings=args.tie_embeddings,
            num_experts=args.n_experts,
            num_experts_per_tok=args.top_k,
            moe_intermediate_size=args.expert_dim,
            shared_expert_intermediate_size=args.expert_dim * args.n_shared_experts,
            norm_topk_prob=True,
            mlp_only_layers=list(range(args.first_dense_layers)),
            output_router_logits=False,
        )
        model = transformers.Qwen2MoeForCausalLM(config)
    else:
        config = transformers.LlamaConfig(**{k: v for k, v in llama_config(args).items() if k != "torch_dtype"})
        model = transformers.LlamaForCausalLM(config)
    model.config._attn_implementation = "sdpa"
    return model.to(device)


def hf_worker(opts) -> dict:
    """One transformers run in this process: steps timed with the device synchronised."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    args = shape(opts.model, opts.moe)
    torch.manual_seed(0)
    model = hf_model(args, device)
    if opts.compile:
        model = torch.compile(model)
    params = [p for p in model.parameters()]
    optimizer = torch.optim.AdamW(params, lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    dtype = torch.bfloat16
    tokens = torch.randint(0, 256, (opts.batch, opts.seq + 1), device=device)  # byte ids, as fivecut's runs
    times, losses = [], []
    for _ in range(opts.steps):
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=dtype):
            logits = model(input_ids=tokens[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))  # synchronises
        times.append(time.perf_counter() - start)
        del logits, loss
    step = median_after_warmup(times)
    peak = peak_tflops(device, "bf16").tflops
    tokens_per_s = opts.batch * opts.seq / step
    return {
        "tokens_per_s": tokens_per_s,
        "mfu": tokens_per_s * args.flops_per_token(opts.seq) / 1e12 / peak if peak else 0.0,
        "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0,
        "loss": f"{losses[0]:.3f} -> {losses[-1]:.3f}",
    }


def hf_case(name: str, opts) -> dict:
    flags = ["--model", opts.model, "--seq", str(opts.seq), "--batch", str(opts.batch), "--steps", str(opts.steps)]
    flags += ["--compile"] * (name == "hf-compiled") + ["--moe"] * (name == "hf-moe")
    command = [sys.executable, __file__, "--worker", "hf", *flags]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=opts.case_timeout)
    if result.returncode != 0:
        return {"error": (result.stdout + result.stderr)[-1500:]}
    return json.loads(result.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------- AdamW's kernels


def adamw_case(opts) -> dict:
    """AdamW over the dense shape's parameters (fp32), each kernel's step timed, medians in ms."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    from fivecut.model.transformer import build_model
    from fivecut.parallel.data import Piece

    model = build_model(shape(opts.model, moe=False), device=device, seed=0)
    pieces = [Piece(p, decays=p.dim() > 1) for p in model.parameters()]
    for piece in pieces:
        piece.tensor.grad = torch.randn_like(piece.tensor) * 1e-3
    out = {"parameters": sum(p.tensor.numel() for p in pieces)}
    for kernel in ("fused", "foreach"):
        optimizer = build_optimizer(pieces, lr=3e-4, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, kernel=kernel)
        times = []
        for _ in range(8):
            sync(device)
            start = time.perf_counter()
            optimizer.step()
            sync(device)
            times.append(time.perf_counter() - start)
        out[f"{kernel}_ms"] = 1e3 * median_after_warmup(times)
        del optimizer
    return out


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------- the table


def row(name: str, got: dict) -> str:
    if "error" in got:
        return f"| {name} | ERROR | | | |"
    return f"| {name} | {got['tokens_per_s']:,.0f} | {100 * got['mfu']:.1f}% | {got['peak_gib']:.1f} | {got['loss']} |"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("gpu-step"))
    parser.add_argument("--cases", default=",".join(CASES) + ",adamw")
    parser.add_argument("--model", default="llama-1b")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--corpus", type=Path, default=None, help="a text file (default: generated)")
    parser.add_argument("--case-timeout", type=int, default=150, help="seconds each case may run")
    parser.add_argument("--smoke", action="store_true", help="the tiny model on the CPU, a few steps")
    parser.add_argument("--worker", choices=("hf",), help=argparse.SUPPRESS)
    parser.add_argument("--compile", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--moe", action="store_true", help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    if opts.worker:
        print(json.dumps(hf_worker(opts)))
        return 0
    if opts.smoke:
        opts.model, opts.seq, opts.batch, opts.steps = "tiny", 32, 2, 3
    opts.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpu-step-"))  # the runs' folders and token cache; --out gets the table
    opts.corpus = opts.corpus or generated_corpus(work / "corpus.txt")
    results = {}
    lines = ["| run | tokens/s | MFU | peak GiB | loss |", "|---|---|---|---|---|"]
    for name in opts.cases.split(","):
        started = time.perf_counter()
        if name == "adamw":
            results[name] = adamw_case(opts)
        elif name.startswith("hf"):
            results[name] = hf_case(name, opts)
        else:
            results[name] = fivecut_case(name, opts, work)
        took = time.perf_counter() - started
        print(f"{name}: {json.dumps(results[name])[:1500]} ({took:.0f} s)", flush=True)
        if name != "adamw":
            lines.append(row(name, results[name]))
    print("\n".join(lines))
    if "adamw" in results:
        a = results["adamw"]
        print(
            f"AdamW over {a['parameters'] / 1e9:.2f}B parameters: fused {a['fused_ms']:.1f} ms, "
            f"foreach {a['foreach_ms']:.1f} ms"
        )
    (opts.out / "gpu_step.json").write_text(json.dumps(results, indent=1))
    return 1 if any("error" in r for r in results.values()) else 0


def generated_corpus(path: Path) -> Path:
    """About 4 MB of pseudo-English from a fixed seed (the byte tokenizer needs no files)."""
    import random

    rng = random.Random(0)
    words = "the of and to in is was he for it with as his on be at by had are but from or have an they".split()
    lines = (" ".join(rng.choice(words) for _ in range(rng.randint(4, 16))).capitalize() + "." for _ in range(120_000))
    path.write_text("\n".join(lines))
    return path


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
