"""What `fivecut plan` writes: plan.json (each costed layout's memory, time, traffic and the link
bandwidth that traffic needs to hide behind compute) and plan.png (per layout, memory and step
time as stacked bars, the device's memory as a line)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from fivecut.config import Config  # noqa: E402
from fivecut.plan.cluster import Cluster  # noqa: E402
from fivecut.plan.cost import LayoutCost  # noqa: E402
from fivecut.plan.memory import ALIVE, TERMS, peak_moment, term_at  # noqa: E402
from fivecut.plan.search import time_terms  # noqa: E402

MEMORY_TERMS = TERMS  # each bar stacks the terms alive at the layout's peak moment (`ALIVE`)
GIB = 1 << 30


def plan_record(cfg: Config, cost: LayoutCost) -> dict:
    """One layout as plan.json holds it: the `--layout` text, the train fields the search set,
    memory in bytes, times in seconds (and by term), throughput, traffic per link class."""
    return {
        "layout": cfg.parallel.settings(),
        "parallel": dataclasses.asdict(cfg.parallel),
        "recompute": cfg.train.recompute,
        "accumulate": cfg.train.accumulate,
        "fits": cost.fits,
        "memory_bytes": cost.memory,
        "memory_rank": cost.memory_rank,
        "host_staging_bytes": cost.staging,
        "step_s": cost.step,
        "time_s": time_terms(cost),
        "bubble": cost.bubble,
        "mfu": cost.mfu,
        "tokens_per_s": cost.tokens_per_s,
        "traffic_bytes": cost.traffic,
        "hiding_gbps": hiding_bandwidth(cost),
        "cuts": [dataclasses.asdict(c) for c in cost.cuts],
    }


def hiding_bandwidth(cost: LayoutCost) -> dict[str, float]:
    """Per link class, the GB/s per rank that would carry the step's traffic in the time of its
    compute: the bandwidth a network needs for that traffic to hide behind the work."""
    if cost.compute <= 0:
        return {}
    return {link: wire / cost.compute / 1e9 for link, wire in sorted(cost.traffic.items())}


def plot_plan(costed: list[tuple[Config, LayoutCost]], cluster: Cluster, path: Path) -> Path:
    """Left: memory per rank by term (GiB) against the device's memory; right: step time by term."""
    names = [f"#{i} {cfg.parallel.describe()}\n{cfg.train.recompute}" for i, (cfg, _) in enumerate(costed, 1)]
    fig, (mem, time) = plt.subplots(1, 2, figsize=(max(8, 2.2 * len(costed) + 4), 4.5))
    stacked(mem, names, [alive_at_peak(cost.memory) for _, cost in costed])
    mem.axhline(cluster.device.memory_gb * 1e9 / GIB, color="black", linestyle="--", label="device memory")
    mem.set_ylabel("GiB per rank (fullest pipeline position)")
    mem.legend(fontsize=7)
    stacked(time, names, [{k: v * 1e3 for k, v in time_terms(cost).items()} for _, cost in costed])
    time.set_ylabel("ms per step")
    time.legend(fontsize=7)
    fig.suptitle(f"fivecut plan on {cluster.describe().split(':')[0]}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def alive_at_peak(memory: dict[str, float]) -> dict[str, float]:
    """GiB of each term alive at the step's peak moment (the bar's height is the peak)."""
    moment = peak_moment(memory)
    return {k: term_at(memory, k, moment) / GIB if k in ALIVE[moment] else 0.0 for k in MEMORY_TERMS}


def stacked(ax, names: list[str], bars: list[dict[str, float]]) -> None:
    terms = list(dict.fromkeys(k for bar in bars for k in bar))
    bottom = [0.0] * len(bars)
    for term in terms:
        values = [bar.get(term, 0.0) for bar in bars]
        ax.bar(range(len(bars)), values, bottom=bottom, label=term)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_xticks(range(len(bars)), names, fontsize=7)
    ax.grid(axis="y", alpha=0.3)
