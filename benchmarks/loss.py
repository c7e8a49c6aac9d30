"""The head and the loss: fivecut's chunked `LossHead` against PyTorch's own full-logits path
(`F.linear` then `F.cross_entropy`), side by side in one run: time of a forward + backward and
the peak memory of the tensors it creates, in fp32 and under bf16 autocast.

    python benchmarks/loss.py                      # small preset (V = 50,257), 8 x 512 tokens
    python benchmarks/loss.py --preset llama-1b --batch 4 --seq 4096 --device cuda

Both sides start from the same hidden state [b, s, h] (requiring grad) and head weight [V, h]
and end with their gradients; the loss's peak is what the step adds on top of those inputs:
on the CPU the live bytes of every tensor it creates (`LiveTensorBytes`), on CUDA
`torch.cuda.max_memory_allocated` above what was allocated before. Time: the median of
`--repeats` steps of each, interleaved (one of each per repeat, alternating which goes first).
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
from torch import nn  # noqa: E402

from fivecut.config import TrainConfig  # noqa: E402
from fivecut.model.presets import get_preset  # noqa: E402
from fivecut.parallel.loss import LossHead  # noqa: E402
from fivecut.parallel.parallelize import token_loss_sum  # noqa: E402
from fivecut.train.memory import LiveTensorBytes, format_bytes  # noqa: E402


def inputs(vocab: int, dim: int, tokens: tuple[int, int], device: str):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(*tokens, dim, generator=g).to(device).requires_grad_()  # [b, s, h]
    head = nn.Linear(dim, vocab, bias=False).to(device)
    head.weight.data.normal_(0, 0.02, generator=None)
    targets = torch.randint(0, vocab, tokens, generator=g).to(device)  # [b, s]
    return hidden, head, targets


def full_step(hidden, head, targets) -> None:
    token_loss_sum(head(hidden), targets).backward()


def chunked_step(hidden, head: LossHead, targets) -> None:
    head(hidden, targets).backward()


def autocast(device: str, dtype: str):
    if dtype == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device, dtype=torch.bfloat16)


def peak_bytes(step, hidden, head, targets, device: str, dtype: str) -> int:
    """What one forward + backward adds, at its peak, to the inputs and weights."""
    hidden.grad, head.weight.grad = None, None
    if device == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        with autocast(device, dtype):
            step(hidden, head, targets)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    with LiveTensorBytes() as live, autocast(device, dtype):
        step(hidden, head, targets)
    return live.peak


def seconds(step, hidden, head, targets, device: str, dtype: str) -> float:
    hidden.grad, head.weight.grad = None, None
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    with autocast(device, dtype):
        step(hidden, head, targets)
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def measure(args, dtype: str) -> dict[str, tuple[float, int]]:
    """(median seconds, peak bytes) of each side."""
    model = get_preset(args.preset)
    hidden, linear, targets = inputs(model.vocab_size, model.dim, (args.batch, args.seq), args.device)
    sides = {"full (PyTorch)": (full_step, linear), "chunked": (chunked_step, LossHead(linear, args.chunk))}
    times = {name: [] for name in sides}
    for step, head in sides.values():  # warm-up
        step(hidden, head, targets)
    for r in range(args.repeats):
        for name in list(sides)[:: 1 if r % 2 == 0 else -1]:
            step, head = sides[name]
            times[name].append(seconds(step, hidden, head, targets, args.device, dtype))
    peaks = {name: peak_bytes(step, hidden, head, targets, args.device, dtype) for name, (step, head) in sides.items()}
    return {name: (statistics.median(times[name]), peaks[name]) for name in sides}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--chunk", type=int, default=TrainConfig.loss_chunk_tokens, help="tokens per chunk")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", choices=("fp32", "bf16", "both"), default="both")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    print(f"{args.preset}: {args.batch} x {args.seq} tokens, chunk {args.chunk} tokens, {args.device}, "
          f"{torch.get_num_threads()} threads, median of {args.repeats}")  # fmt: skip
    print(f"{'dtype':6} {'side':16} {'time':>10} {'peak':>12} {'peak ratio':>11} {'time ratio':>11}")
    for dtype in ("fp32", "bf16") if args.dtype == "both" else (args.dtype,):
        result = measure(args, dtype)
        base_s, base_peak = result["full (PyTorch)"]
        for name, (s, peak) in result.items():
            print(f"{dtype:6} {name:16} {s * 1e3:8.1f}ms {format_bytes(peak):>12} "
                  f"{peak / base_peak:11.3f} {s / base_s:11.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
