"""Gantt chart of a simulated schedule: ranks down, time across, one bar per compute action.

Color = microbatch (qualitative colormap); F solid, B darker and hatched, W pale with a
dotted edge. A prime after the number marks the rank's later stage (interleaved,
DualPipeV), as in the text timeline. The bubble (idle / (pp * makespan)) is in the title.
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.colors import to_rgb  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from fivecut.parallel.pipeline.simulate import Timeline, label  # noqa: E402

DPI = 120
STYLE = {  # kind -> how the bar is drawn: color shade (0 = as is, <0 darker, >0 paler), hatch, edge
    "F": dict(shade=0.0, hatch="", linestyle="-"),
    "B": dict(shade=-0.35, hatch="///", linestyle="-"),
    "W": dict(shade=0.6, hatch="", linestyle=":"),
}


def shade(rgb: tuple[float, float, float], amount: float) -> tuple[float, float, float]:
    """amount < 0 mixes towards black, > 0 towards white."""
    target = 0.0 if amount < 0 else 1.0
    return tuple(c + (target - c) * abs(amount) for c in rgb)


def microbatch_color(i: int, m: int) -> tuple[float, float, float]:
    cmap = plt.get_cmap("tab10" if m <= 10 else "tab20")
    return to_rgb(cmap(i % cmap.N))


def draw(timeline: Timeline, path, title: str) -> None:
    """Write the Gantt chart of `timeline` to `path` (PNG)."""
    sch = timeline.schedule
    width = min(max(8.0, timeline.makespan * 0.28), 30.0)
    fig, ax = plt.subplots(figsize=(width, 1.0 + 0.6 * sch.pp))
    px_per_time = width * DPI * 0.8 / max(timeline.makespan, 1e-9)  # the axes take about 80% of the width
    for rank, row in enumerate(timeline.rows):
        for a, start, end in row:
            if a.is_compute:
                bar(ax, rank, a, start, end, label(sch, a)[1:], sch.microbatches, px_per_time)
    ax.set_yticks(range(sch.pp), [f"rank {r}" for r in range(sch.pp)])
    ax.set_ylim(sch.pp - 0.5, -0.5)  # rank 0 on top
    ax.set_xlim(0, timeline.makespan)
    ax.set_xlabel(axis_label(timeline))
    ax.set_title(f"{title} — bubble {timeline.bubble:.4f}")
    ax.legend(handles=legend_handles(sch.split_backward), loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


def axis_label(timeline: Timeline) -> str:
    sch, costs = timeline.schedule, timeline.costs
    text = f"time (F = {costs['F']:g}, B = {costs['B']:g}" + (f", W = {costs['W']:g})" if sch.split_backward else ")")
    if sch.n_stages > sch.pp:
        text += "; a prime per later stage of the rank: 3' = microbatch 3 on the rank's 2nd stage"
    return text


def bar(ax, rank: int, a, start: float, end: float, text: str, m: int, px_per_time: float) -> None:
    style = STYLE[a.kind]
    color = shade(microbatch_color(a.microbatch, m), style["shade"])
    ax.barh(
        rank,
        end - start,
        left=start,
        height=0.8,
        color=color,
        hatch=style["hatch"],
        edgecolor="black",
        linewidth=0.6,
        linestyle=style["linestyle"],
    )
    if (end - start) * px_per_time >= 7 * len(text) + 4:  # the label (7 pt, ~7 px a character) fits
        ink = "white" if a.kind == "B" else "black"
        ax.text((start + end) / 2, rank, text, ha="center", va="center", fontsize=7, color=ink)


def legend_handles(split: bool) -> list[Patch]:
    gray = (0.6, 0.6, 0.6)
    names = {"F": "F forward", "B": "B input-grad" if split else "B backward", "W": "W weight-grad"}
    kinds = ("F", "B", "W") if split else ("F", "B")
    return [
        Patch(
            facecolor=shade(gray, STYLE[k]["shade"]),
            hatch=STYLE[k]["hatch"],
            edgecolor="black",
            linestyle=STYLE[k]["linestyle"],
            label=names[k],
        )
        for k in kinds
    ]
