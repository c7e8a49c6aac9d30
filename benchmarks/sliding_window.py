"""Sliding-window attention's kernel: fivecut's core (`CausalSDPA` with a window: PyTorch's fused
scaled_dot_product_attention given the band as a boolean mask) against FlexAttention with a
sliding-window block mask (eager, and with --compile compiled by torch.compile), and the plain
causal kernel (no window: what the band costs over full attention). One attention core on q, k, v
[b, H, s, hd] (GQA: H / kv_heads query heads per key head): the forward, and the forward +
backward where the kernel has a backward (FlexAttention has none on the CPU in torch 2.13: it
raises NotImplementedError, so it cannot train there, whatever its forward speed).

    python benchmarks/sliding_window.py                           # CPU, 1 x 8 heads x 1024 tokens, window 256
    python benchmarks/sliding_window.py --compile --seq 2048      # FlexAttention compiled too
    python benchmarks/sliding_window.py --device cuda --seq 8192 --window 4096 --compile

Outputs (and input gradients where there is a backward) of every candidate are checked against
fivecut's (fp32: 2e-5 absolute). Time: the median over --repeats of each candidate's median step,
the candidates interleaved (the order rotated every repeat). The last line is the forward ratio of
the faster FlexAttention over fivecut's SDPA (> 1: the SDPA mask is faster).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # noqa: E402

from fivecut.model.transformer import CausalSDPA  # noqa: E402


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--device", default="cpu")
    p.add_argument("--compile", action="store_true", help="also FlexAttention compiled by torch.compile")
    p.add_argument("--steps", type=int, default=3, help="timed steps of each candidate per repeat")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    return p.parse_args(argv)


def flex_candidate(ns, compiled: bool):
    """FlexAttention with the window as a block mask (blocks wholly outside the band are skipped)."""
    window = ns.window

    def band(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (kv_idx > q_idx - window)

    mask = create_block_mask(band, None, None, ns.seq, ns.seq, device=ns.device)
    kernel = torch.compile(flex_attention, dynamic=False) if compiled else flex_attention
    return lambda q, k, v: kernel(q, k, v, block_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


def candidates(ns) -> dict:
    out = {
        "fivecut: SDPA + band mask": CausalSDPA(ns.window),
        "FlexAttention (eager)": flex_candidate(ns, compiled=False),
    }
    if ns.compile:
        out["FlexAttention (compiled)"] = flex_candidate(ns, compiled=True)
    out["causal SDPA, no window (reference cost)"] = CausalSDPA(0)
    return out


def inputs(ns):
    g = torch.Generator().manual_seed(0)
    shape = lambda heads: (ns.batch, heads, ns.seq, ns.head_dim)  # noqa: E731
    q, k, v = (torch.randn(shape(h), generator=g) for h in (ns.heads, ns.kv_heads, ns.kv_heads))
    grad = torch.randn(shape(ns.heads), generator=g)
    return [t.to(ns.device).requires_grad_() for t in (q, k, v)], grad.to(ns.device)


def has_backward(name: str, device: str) -> bool:
    return not (name.startswith("FlexAttention") and device == "cpu")


def step(core, qkv, grad, backward: bool):
    for t in qkv:
        t.grad = None
    if not backward:
        with torch.no_grad():
            return core(*(t.detach() for t in qkv))
    out = core(*qkv)
    out.backward(grad)
    return out


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def check(cores: dict, qkv, grad, device: str) -> None:
    """Every windowed candidate's output (and input gradients) against fivecut's: the same band."""
    first = None
    for name, core in cores.items():
        if "no window" in name:
            continue
        backward = has_backward(name, device)
        got = [step(core, qkv, grad, backward).detach()] + ([t.grad.clone() for t in qkv] if backward else [])
        first = first or got
        for a, b in zip(got, first):
            torch.testing.assert_close(a, b, rtol=0, atol=2e-5, msg=name)


def timed(core, qkv, grad, backward: bool, ns) -> float:
    for _ in range(ns.warmup):
        step(core, qkv, grad, backward)
    times = []
    for _ in range(ns.steps):
        sync(ns.device)
        t0 = time.perf_counter()
        step(core, qkv, grad, backward)
        sync(ns.device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None) -> int:
    ns = parse(argv)
    torch.manual_seed(0)
    cores = candidates(ns)
    qkv, grad = inputs(ns)
    check(cores, qkv, grad, ns.device)
    runs = [(name, False) for name in cores] + [(name, True) for name in cores if has_backward(name, ns.device)]
    times = {run: [] for run in runs}
    for r in range(ns.repeats):
        for name, backward in runs[r % len(runs) :] + runs[: r % len(runs)]:
            times[name, backward].append(timed(cores[name], qkv, grad, backward, ns))
        print(f"repeat {r + 1}/{ns.repeats} done", file=sys.stderr)
    medians = {run: statistics.median(t) for run, t in times.items()}
    shape = f"q [{ns.batch}, {ns.heads}, {ns.seq}, {ns.head_dim}], {ns.kv_heads} kv heads, window {ns.window}"
    print(f"sliding-window attention, {shape}, {ns.device}, torch {torch.__version__}")
    print("| kernel | forward ms | forward + backward ms |")
    print("|---|---|---|")
    for name in cores:
        both = medians.get((name, True))
        print(
            f"| {name} | {medians[name, False] * 1e3:.2f} | {'no backward' if both is None else f'{both * 1e3:.2f}'} |"
        )
    best_flex = min(v for (name, backward), v in medians.items() if name.startswith("FlexAttention") and not backward)
    print(f"ratio_flex_sdpa={best_flex / medians[next(iter(cores)), False]:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
