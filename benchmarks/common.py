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

The set-up every benchmark shares lives here too: its common options (`benchmark_parser`,
`add_common_arguments`, `parse_options`), its launch (`run`), the AdamW settings of both sides
(`ADAMW`), the random-token batch (`token_batch`), the gradient check (`check_gradients`), the
two-candidate timing loop with progress lines (`interleave_pair`) and the timing table's cells
(`timing_cells`, `ratio_cells`).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from fivecut.launch import spawn

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
    candidates: dict[str, Callable[[], object]],
    steps: int,
    repeats: int,
    warmup: int = 2,
    group=None,
    on_repeat: Callable[[int, list[str], dict[str, list[list[float]]]], object] | None = None,
) -> dict[str, list[list[float]]]:
    """Time every candidate `repeats` times, rotating which one goes first each repeat, and call
    `on_repeat(r, order, runs)` after repeat r if given.
    Returns {name: [per-step seconds of repeat 0, of repeat 1, ...]}."""
    names = list(candidates)
    runs: dict[str, list[list[float]]] = {name: [] for name in names}
    for r in range(repeats):
        shift = r % len(names)
        order = names[shift:] + names[:shift]
        for name in order:
            runs[name].append(time_steps(candidates[name], steps, warmup, group))
        if on_repeat is not None:
            on_repeat(r, order, runs)
    return runs


def interleave_pair(
    candidates: dict[str, Callable[[], object]], opts: dict, prefix: str = ""
) -> dict[str, list[list[float]]]:
    """`interleave` fivecut's and torch's step (in that order) over opts' repeats; rank 0 prints each repeat."""
    ours, theirs = list(candidates)
    started = time.perf_counter()

    def progress(r: int, order: list[str], runs: dict[str, list[list[float]]]) -> None:
        if dist.is_initialized() and dist.get_rank() != 0:
            return
        a, b = median(runs[ours][-1]), median(runs[theirs][-1])
        print(
            f"  {prefix}repeat {r + 1}/{opts['repeats']} ({' then '.join(order)}): "
            f"fivecut {format_seconds(a)}, torch {format_seconds(b)}, "
            f"ratio {format_ratio(a / b)}  [{time.perf_counter() - started:.0f} s]",
            flush=True,
        )

    return interleave(candidates, opts["steps"], opts["repeats"], opts["warmup"], on_repeat=progress)


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


TIMING_COLUMNS = ["median step", "fastest step", "repeat medians (min .. max)"]  # of `timing_cells`


def timing_cells(runs: list[list[float]], tokens: int, unit: str | None = "tok/s") -> list[str]:
    """A candidate's median and fastest step, its repeats' medians (min .. max), and tokens/s at its median."""
    steps, medians = all_steps(runs), [median(run) for run in runs]
    rate = tokens / median(steps)
    return [
        format_seconds(median(steps)),
        format_seconds(min(steps)),
        f"{format_seconds(min(medians))} .. {format_seconds(max(medians))}",
        format_rate(rate, unit) if unit else f"{rate:,.0f}",
    ]


def ratio_cells(runs: dict[str, list[list[float]]], a: str, b: str) -> list[str]:
    """a / b: the median of per-repeat ratios, the ratio of fastest steps, and the per-repeat min .. max."""
    cmp = compare(runs, a, b)
    lo, hi = cmp.spread
    fastest = min(all_steps(runs[a])) / min(all_steps(runs[b]))
    return [format_ratio(cmp.ratio), format_ratio(fastest), f"{format_ratio(lo)} .. {format_ratio(hi)}"]


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


# ---------------------------------------------------------------- set-up shared by the benchmarks

ADAMW = dict(lr=3e-4, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)  # both sides' AdamW, every benchmark
MODEL_HELP = "fivecut preset: tiny (default), tiny-gpt2, small, ..."


def benchmark_parser(doc: str, model_help: str = MODEL_HELP) -> argparse.ArgumentParser:
    """A parser described by the first paragraph of `doc`, with --model (a fivecut preset, default tiny)."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--model", default="tiny", help=model_help)
    return parser


def add_common_arguments(
    parser: argparse.ArgumentParser, *, steps: int, repeats: int = 5, batch_help: str = "sequences per rank"
) -> None:
    """Add --steps, --repeats, --warmup (how long each candidate is timed) and --batch, --seq (its batch)."""
    parser.add_argument("--steps", type=int, default=steps, help="timed steps per candidate per repeat")
    parser.add_argument("--repeats", type=int, default=repeats)
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before each timed block")
    parser.add_argument("--batch", type=int, default=8, help=batch_help)
    parser.add_argument("--seq", type=int, default=128)


def parse_options(parser: argparse.ArgumentParser, argv=None) -> dict:
    """Add --timeout (every benchmark's last option) and parse `argv` into a dict of options."""
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds before the ranks are declared stuck")
    return vars(parser.parse_args(argv))


def run(name: str, rank_main: Callable[[dict], object], report: Callable[..., str], opts: dict, world: int) -> None:
    """Print the command line, run `rank_main(opts)` on `world` spawned ranks, print `report` of their results."""
    print(f"{name} {' '.join(sys.argv[1:])}".rstrip(), flush=True)
    before = machine()
    started = time.perf_counter()
    results = spawn(rank_main, world, opts, timeout_s=opts["timeout"])
    print(report(opts, results, time.perf_counter() - started, before), flush=True)


def token_batch(vocab_size: int, batch: int, seq: int, seed: int = 1234) -> tuple[torch.Tensor, torch.Tensor]:
    """Random tokens drawn from `seed`: inputs [batch, seq] and their next-token targets [batch, seq]."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab_size, (batch, seq + 1), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def max_rel_diff(xs, ys) -> float:
    """Largest |x - y| / max|y| over pairs of tensors (0 when identical)."""
    worst = 0.0
    for x, y in zip(xs, ys, strict=True):
        scale = y.abs().max().item() or 1.0
        worst = max(worst, (x - y).abs().max().item() / scale)
    return worst


def check_gradients(params_a, params_b, rtol: float) -> tuple[float, bool]:
    """fivecut's (a) and torch's (b) gradients: max_rel_diff and whether bitwise equal; raises above `rtol`."""
    grad_diff = max_rel_diff([p.grad for p in params_a], [p.grad for p in params_b])
    grad_bitwise = all(torch.equal(a.grad, b.grad) for a, b in zip(params_a, params_b))
    if grad_diff > rtol:
        rank = dist.get_rank() if dist.is_initialized() else 0
        raise AssertionError(f"rank {rank}: fivecut and torch gradients differ by {grad_diff:.3g} (> {rtol})")
    return grad_diff, grad_bitwise


# ---------------------------------------------------------------- memory inside a rank (CPU)
#
# On CPU there is no torch.cuda.max_memory_allocated. Two measurements stand in for it:
#   - tensor bytes: the profiler's memory events (profile_memory=True) carry the net bytes
#     allocated since the profiler started ("Total Allocated"); its maximum over a region is
#     that region's peak of live tensor memory above what was live when it began. Frees of
#     tensors allocated *before* the profiler started are not seen (the figure can only err high).
#   - resident set: Linux's VmHWM (peak RSS) can be reset per process by writing 5 to
#     /proc/self/clear_refs, unlike getrusage's ru_maxrss, which only ever grows. After
#     malloc_trim(0) hands freed heap pages back, VmHWM - VmRSS measures one region's peak.


def _proc_status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def rss_bytes() -> int | None:
    """Current resident set size of this process (None where /proc is not available)."""
    kib = _proc_status_kib("VmRSS")
    return None if kib is None else kib * 1024


def peak_rss_bytes() -> int | None:
    """Peak resident set size since the process started or since `reset_peak_rss()`."""
    kib = _proc_status_kib("VmHWM")
    return None if kib is None else kib * 1024


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def release_free_memory() -> None:
    """Collect garbage and return freed heap pages to the OS (glibc malloc_trim), if possible."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def peak_rss_delta(fn: Callable[[], object]) -> int | None:
    """Peak RSS while running `fn`, above the RSS just before it (after releasing free memory);
    None where the peak cannot be reset (then only the monotonic ru_maxrss would be left)."""
    release_free_memory()
    base = rss_bytes()
    if base is None or not reset_peak_rss():
        return None
    fn()
    return max(0, peak_rss_bytes() - base)


def profile_tensor_memory(fn: Callable[[], object]) -> dict:
    """Run `fn` under the profiler with memory events. Returns the peak of live tensor bytes
    above the start ("peak_bytes"), the count of each c10d collective op ("collectives"), and
    the profiler itself ("profiler", for key_averages())."""
    import json
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        trace = json.load(open(f.name))
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    memory = sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: e["ts"])
    peak = max((e["args"]["Total Allocated"] for e in memory), default=0)
    collectives: dict[str, int] = {}
    for e in events:
        name = e.get("name", "")
        if e.get("cat") == "cpu_op" and name.startswith("c10d::"):
            collectives[name] = collectives.get(name, 0) + 1
    return {"peak_bytes": max(0, peak), "collectives": collectives, "profiler": prof}


def format_bytes(n: float | None) -> str:
    if n is None:
        return "n/a"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"
