"""Routed experts: fivecut's grouped GEMMs against a loop of per-expert matmuls, in one run.

    python benchmarks/moe_experts.py [--steps 10] [--repeats 5]

Both sides compute the experts' SwiGLU, forward and backward (gradients of x and the stacked
weights), on the same rows routed unevenly (one expert gets none) and the same weights:
    loop      split the rows by `counts.tolist()` and run three matmuls per expert (how fivecut
              ran them before; the host waits for the counts)
    grouped   `grouped_swiglu`: the kernel `grouped_kernel` picks for the device and dtype
              (torch._grouped_mm on the CPU and on a Hopper GPU in bf16), offsets on the device
On the CPU (fp32) the shapes are tiny-moe's and a wider MoE; on a GPU (bf16) also one at the
scale of a large fine-grained MoE. Before timing, each shape checks that the two agree and, on a
GPU, that the grouped side runs under torch.cuda.set_sync_debug_mode("error"). Medians of
interleaved repeats (benchmarks/common.py); ratio = grouped / loop, lower is better.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import format_ratio, format_seconds, interleave, machine, median
from fivecut.model.transformer import group_ends, grouped_kernel, grouped_swiglu

# (name, experts, dim, hidden, routed rows)
CPU_SHAPES = [("tiny-moe", 8, 128, 128, 2048), ("wide", 32, 256, 128, 4096)]
GPU_SHAPES = CPU_SHAPES + [("large", 32, 2048, 512, 65536)]


def loop_swiglu(x, w1, w3, w2, counts: torch.Tensor) -> torch.Tensor:
    chunks = torch.split(x, counts.tolist())
    return torch.cat([(F.silu(xe @ w1[e]) * (xe @ w3[e])) @ w2[e] for e, xe in enumerate(chunks)])


def routed(experts: int, dim: int, hidden: int, rows: int, device, dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, dim, generator=g)
    w1, w3 = (torch.randn(experts, dim, hidden, generator=g) / dim**0.5 for _ in range(2))
    w2 = torch.randn(experts, hidden, dim, generator=g) / hidden**0.5
    expert = torch.randint(1, experts, (rows,), generator=g)  # expert 0 gets no rows
    counts = torch.bincount(expert, minlength=experts)
    tensors = [t.to(device, dtype).requires_grad_() for t in (x, w1, w3, w2)]
    return tensors, counts.to(device), torch.randn(rows, dim, generator=g).to(device, dtype)


def step(fn, tensors, counts, grad):
    def run():
        for t in tensors:
            t.grad = None
        fn(*tensors, counts).backward(grad)
        if grad.is_cuda:
            torch.cuda.synchronize()

    return run


def grouped(x, w1, w3, w2, counts):
    return grouped_swiglu(x, w1, w3, w2, group_ends(counts))


def check(tensors, counts, grad) -> str:
    """Max |grouped - loop| over the output and the gradients; on a GPU, the grouped side run
    with host syncs made errors."""
    results = []
    for fn in (loop_swiglu, grouped):
        for t in tensors:
            t.grad = None
        if fn is grouped and grad.is_cuda:
            torch.cuda.set_sync_debug_mode("error")
        out = fn(*tensors, counts)
        out.backward(grad)
        torch.cuda.set_sync_debug_mode("default") if grad.is_cuda else None
        results.append([out.detach()] + [t.grad.clone() for t in tensors])
    diffs = [(a.float() - b.float()).abs().max().item() for a, b in zip(*results)]
    return "max |diff| out {:.2e}, grads x/w1/w3/w2 {:.2e} {:.2e} {:.2e} {:.2e}".format(*diffs)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (torch.set_num_threads)")
    opts = parser.parse_args(argv)
    torch.set_num_threads(opts.threads)
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    print(f"{machine()}; {device} {dtype}")
    print("| shape | experts x dim x hidden, rows | kernel | loop | grouped | grouped / loop |")
    print("| --- | --- | --- | ---: | ---: | ---: |")
    for name, experts, dim, hidden, rows in GPU_SHAPES if cuda else CPU_SHAPES:
        tensors, counts, grad = routed(experts, dim, hidden, rows, device, dtype)
        note = check(tensors, counts, grad)
        runs = interleave(
            {"loop": step(loop_swiglu, tensors, counts, grad), "grouped": step(grouped, tensors, counts, grad)},
            opts.steps,
            opts.repeats,
        )
        ratios = [median(g) / median(lp) for g, lp in zip(runs["grouped"], runs["loop"])]
        loop_t, grouped_t = median([median(r) for r in runs["loop"]]), median([median(r) for r in runs["grouped"]])
        kernel = grouped_kernel(torch.device(device), dtype, (dim, hidden))
        kernel_name = getattr(kernel, "__name__", None) or str(kernel).split("::")[-1].rstrip(")>")
        print(
            f"| {name} | {experts} x {dim} x {hidden}, {rows} | {kernel_name} | {format_seconds(loop_t)} | "
            f"{format_seconds(grouped_t)} | {format_ratio(median(ratios))} |"
        )
        print(f"  {note}; per-repeat ratios {', '.join(f'{r:.3f}' for r in ratios)}")


if __name__ == "__main__":
    main()
