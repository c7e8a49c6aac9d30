"""Timing helpers shared by the side-by-side benchmarks (fivecut vs PyTorch's own).

A benchmark compares candidates that do the same work (checked once, separately) on the
same ranks, at the same time, on the same (possibly busy) machine. To keep load from
other processes from favouring one side, the candidates are *interleaved*: every repeat
runs each candidate for a block of steps, alternating which goes first, and the ratio is
taken inside each repeat before taking the median over repeats:

    for repeat r:  A then B (r even) or B then A (r odd), each: warm-up, then `steps` timed steps
    per repeat:    median step time of A / median step time of B
    reported:      median of those per-repeat ratios (and their min..max as the spread)

Step times are measured on every rank between a barrier before the step and the end of
the step; a step's time is the slowest rank's (one all-reduce MAX per block, outside the
timed region). Outside `torch.distributed` (no process group) the barrier is skipped.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

# ---------------------------------------------------------------- timing inside a rank


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def barrier(group=None) -> None:
    if _distributed():
        dist.barrier(group=group)


def time_steps(step: Callable[[], object], steps: int, warmup: int = 2, group=None) -> list[float]:
    """Run `step` `warmup` times untimed, then `steps` times timed; return each timed step's
    seconds, the slowest rank's when distributed. Every rank must call this collectively."""
    for _ in range(warmup):
        step()
    barrier(group)
    times = []
    for _ in range(steps):
        barrier(group)
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    barrier(group)
    if _distributed():
        slowest = torch.tensor(times, dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
        times = slowest.tolist()
    return times


def interleave(
    candidates: dict[str, Callable[[], object]], steps: int, repeats: int, warmup: int = 2, group=None
) -> dict[str, list[list[float]]]:
    """Time every candidate `repeats` times, rotating which one goes first each repeat.
    Returns {name: [per-step seconds of repeat 0, of repeat 1, ...]}."""
    names = list(candidates)
    runs: dict[str, list[list[float]]] = {name: [] for name in names}
    for r in range(repeats):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            runs[name].append(time_steps(candidates[name], steps, warmup, group))
    return runs


# ---------------------------------------------------------------- statistics


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def all_steps(runs: list[list[float]]) -> list[float]:
    return [t for run in runs for t in run]


@dataclass
class Comparison:
    """`a` against `b` over interleaved repeats (`a` is usually fivecut, `b` PyTorch)."""

    a: str
    b: str
    ratios: list[float] = field(default_factory=list)  # per repeat: median(a) / median(b)

    @property
    def ratio(self) -> float:
        return median(self.ratios)

    @property
    def spread(self) -> tuple[float, float]:
        return min(self.ratios), max(self.ratios)


def compare(runs: dict[str, list[list[float]]], a: str, b: str) -> Comparison:
    """Median over repeats of the per-repeat ratio of median step times, a / b."""
    ratios = [median(ra) / median(rb) for ra, rb in zip(runs[a], runs[b], strict=True)]
    return Comparison(a, b, ratios)


# ---------------------------------------------------------------- formatting


def format_seconds(s: float) -> str:
    if s >= 1.0:
        return f"{s:.3f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.1f} ms"
    return f"{s * 1e6:.0f} us"


def format_ratio(x: float) -> str:
    return f"{x:.3f}x"


def format_rate(x: float, unit: str = "tok/s") -> str:
    return f"{x:,.0f} {unit}"


def markdown_row(cells: Sequence[object]) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]], align: str | None = None) -> str:
    """A GitHub markdown table; `align` is one letter per column, l or r (default: first l, rest r)."""
    align = align or "l" + "r" * (len(header) - 1)
    rule = ["---:" if a == "r" else "---" for a in align]
    return "\n".join([markdown_row(header), markdown_row(rule), *(markdown_row(r) for r in rows)])


def load_average() -> str:
    """1/5/15-minute load averages (the benchmark's own ranks count in them once running)."""
    return "/".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"


def machine() -> str:
    """One line about where the numbers come from, load included (they are noisy otherwise)."""
    return (
        f"{os.cpu_count()} CPUs ({platform.processor() or platform.machine()}), {platform.system()}, "
        f"torch {torch.__version__}, python {platform.python_version()}, load average {load_average()}"
    )
