"""The SwiGLU MLP: fivecut's `FeedForward` (its `swiglu` keeps w1 x and w3 x, and computes
silu(w1 x) again in backward) against PyTorch autograd's own ops, `w2(F.silu(w1 x) * w3 x)`,
which also keep silu(w1 x). Side by side in one run, on a stack of `--layers` residual MLPs (as
in a model, where what each layer keeps adds up): time of a forward + backward, the bytes kept
for backward at the end of the forward, and the peak, in fp32 and under bf16 autocast.

    python benchmarks/swiglu.py                     # llama-1b's MLP (2048 -> 8192), 4 layers, 1 x 512 tokens
    python benchmarks/swiglu.py --batch 8 --seq 2048 --layers 16 --device cuda

Both sides share the weights and the input [b, s, h] (requiring grad). Memory: on the CPU the
live bytes of every tensor the step creates (`LiveTensorBytes`), on CUDA the allocator's, above
what was allocated before. Time: the median of `--repeats` steps of each, alternating which goes
first.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from fivecut.model.presets import get_preset  # noqa: E402
from fivecut.model.transformer import FeedForward  # noqa: E402
from fivecut.train.memory import LiveTensorBytes, format_bytes  # noqa: E402


def autograd_mlp(mlp: FeedForward, x: torch.Tensor) -> torch.Tensor:
    return mlp.w2(F.silu(mlp.w1(x)) * mlp.w3(x))  # autograd keeps w1 x, silu(w1 x), w3 x, the product


SIDES = {"autograd (PyTorch)": autograd_mlp, "fivecut swiglu": FeedForward.forward}


def forward(side, mlps: torch.nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
    for mlp in mlps:
        x = x + side(mlp, x)  # [b, s, h]
    return x


def autocast(device: str, dtype: str):
    return contextlib.nullcontext() if dtype == "fp32" else torch.autocast(device, dtype=torch.bfloat16)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def step(side, mlp, x: torch.Tensor, device: str, dtype: str, after_forward=lambda: None) -> None:
    x.grad = None
    mlp.zero_grad(set_to_none=True)
    with autocast(device, dtype):
        out = forward(side, mlp, x)  # [b, s, h]
    after_forward()
    out.float().square().mean().backward()


def memory(side, mlp, x, device: str, dtype: str) -> tuple[int, int]:
    """(bytes kept at the end of the forward, the peak), above what existed before."""
    kept = []
    if device == "cuda":
        sync(device)
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step(side, mlp, x, device, dtype, lambda: kept.append(torch.cuda.memory_allocated()))
        sync(device)
        return kept[0] - before, torch.cuda.max_memory_allocated() - before
    with LiveTensorBytes() as live:
        step(side, mlp, x, device, dtype, lambda: kept.append(live.now))
    return kept[0], live.peak


def seconds(side, mlp, x, device: str, dtype: str) -> float:
    sync(device)
    start = time.perf_counter()
    step(side, mlp, x, device, dtype)
    sync(device)
    return time.perf_counter() - start


def measure(args, dtype: str) -> dict[str, tuple[float, tuple[int, int]]]:
    """(median seconds, (kept, peak) bytes) of each side; says whether their gradients agree."""
    shape = get_preset(args.preset)
    torch.manual_seed(0)
    mlp = torch.nn.ModuleList(FeedForward(shape.dim, shape.ffn_dim) for _ in range(args.layers)).to(args.device)
    x = torch.randn(args.batch, args.seq, shape.dim, device=args.device, requires_grad=True)
    grads = {}
    for name, side in SIDES.items():  # warm-up, and the gradients to compare
        step(side, mlp, x, args.device, dtype)
        grads[name] = [x.grad.clone(), *(p.grad.clone() for p in mlp.parameters())]
    equal = all(torch.equal(a, b) for a, b in zip(*grads.values()))
    times = {name: [] for name in SIDES}
    for r in range(args.repeats):
        for name in list(SIDES)[:: 1 if r % 2 == 0 else -1]:
            times[name].append(seconds(SIDES[name], mlp, x, args.device, dtype))
    peaks = {name: memory(side, mlp, x, args.device, dtype) for name, side in SIDES.items()}
    print(f"{dtype}: gradients bitwise equal: {equal}")
    return {name: (statistics.median(times[name]), peaks[name]) for name in SIDES}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="llama-1b")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", choices=("fp32", "bf16", "both"), default="both")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    print(f"{args.preset} MLP x {args.layers} layers: {args.batch} x {args.seq} tokens, {args.device}, "
          f"{torch.get_num_threads()} threads, median of {args.repeats}")  # fmt: skip
    print(f"| dtype | side | time | kept | peak | kept ratio | peak ratio | time ratio |\n|{' --- |' * 8}")
    for dtype in ("fp32", "bf16") if args.dtype == "both" else (args.dtype,):
        result = measure(args, dtype)
        base_s, (base_kept, base_peak) = result["autograd (PyTorch)"]
        for name, (s, (kept, peak)) in result.items():
            print(f"| {dtype} | {name} | {s * 1e3:.1f} ms | {format_bytes(kept)} | {format_bytes(peak)} | "
                  f"{kept / base_kept:.3f} | {peak / base_peak:.3f} | {s / base_s:.3f} |")  # fmt: skip


if __name__ == "__main__":
    main()
