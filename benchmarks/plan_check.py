"""The planner (`fivecut plan`) against this machine: for each layout, `fivecut ledger`'s
measurement of a real step and a timed run, next to `cost_layout` with this machine's
calibrated cluster (`fivecut plan calibrate` with the layout's number of ranks).

    PYTHONPATH=. python benchmarks/plan_check.py [--steps 12] [--only SUBSTRING] [--out plan_check.md]
        [--cluster cluster-2.toml --cluster cluster-4.toml]   # else calibrated first, per world size

Per layout (seq 64, global batch 8, fp32, as `fivecut ledger` runs):

    comm         wire bytes per cut on rank 0, the ledger's last step vs the planner (ratio)
    states       model-state bytes of rank 0 (params + grads + optimizer) measured vs planned
    activations  bytes saved for backward, summed over rank 0's layers (step 1, one microbatch)
                 vs the planner's (only without a pipeline: there the planner gives the peak
                 over microbatches in flight, the ledger one microbatch)
    step         measured: the median of rank 0's step times (the trainer's metrics.jsonl,
                 `step_time`) over the steps after the first `WARMUP`, of one run of `--steps`
                 steps; planned: `cost_layout`'s step
    ranking      the share of layout pairs of the same world size whose planned order of step
                 time is the measured order
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import statistics
import tempfile
from pathlib import Path

from fivecut.cli import build_parser, layout_config, spawned
from fivecut.config import preset_args
from fivecut.plan.calibrate import calibrate
from fivecut.plan.cluster import cluster_toml, parse_cluster
from fivecut.plan.cost import cost_layout

LAYOUTS = [  # (model, layout): every cut and schedule, worlds of 2 and 4
    ("tiny", "dp=2"),
    ("tiny", "dp=2,zero=1"),
    ("tiny", "dp=2,zero=2"),
    ("tiny", "dp=2,zero=3"),
    ("tiny", "tp=2"),
    ("tiny", "tp=2,sp=true"),
    ("tiny", "pp=2,microbatches=4,pp_schedule=1f1b"),
    ("tiny", "pp=2,microbatches=4,pp_schedule=gpipe"),
    ("tiny", "pp=2,microbatches=4,pp_schedule=interleaved,pp_virtual=2"),
    ("tiny", "pp=2,microbatches=4,pp_schedule=zb1p"),
    ("tiny", "pp=2,microbatches=4,pp_schedule=dualpipev"),
    ("tiny", "cp=2,cp_mode=ring"),
    ("tiny", "cp=2,cp_mode=ulysses"),
    ("tiny", "cp=4,cp_mode=usp,cp_ulysses=2"),
    ("tiny", "dp=2,tp=2"),
    ("tiny", 'dp=2 --set train.recompute="full"'),
    ("tiny-moe", "dp=2,ep=2"),
    ("tiny-moe", "dp=2,ep=2,etp=2,tp=2"),
    ("small", "dp=2"),
    ("small", "dp=2,pp=2,microbatches=2"),
]


def run_config(model: str, layout: str, steps: int):
    layout, *sets = layout.split(" --set ")  # a layout may carry train settings (recomputation)
    flags = [f for s in sets for f in ("--set", s)]
    ns = build_parser().parse_args(["ledger", "--model", model, "--layout", layout, "--steps", str(steps), *flags])
    return layout_config(ns)


WARMUP = 2  # steps left out of the median (allocator, first calls of each collective)


def train_logged(cfg, measure: bool):
    """One rank's training with rank 0's metrics.jsonl written (the quiet runs write none)."""
    from fivecut.train.trainer import train

    return train(cfg, quiet=False, measure_activations=measure)


def timed_run(cfg):
    """Rank 0's RunResult and the median of its step times after `WARMUP` steps."""
    from fivecut.train.run import run_tokens

    run_tokens(cfg)
    with tempfile.TemporaryDirectory(prefix="fivecut-plan-check-") as out:
        cfg = copy.deepcopy(cfg)
        cfg.log.out_dir = out
        result = spawned(
            "plan_check",
            train_logged,
            cfg.parallel.world_size,
            cfg,
            True,
            timeout_s=600.0,
            collective_timeout_s=min(600.0, cfg.train.collective_timeout),
        )[0]
        lines = (Path(out) / "metrics.jsonl").read_text().splitlines()
    times = [r["step_time"] for r in map(json.loads, lines) if "step_time" in r]
    return result, statistics.median(times[WARMUP:])


def check(model: str, layout: str, steps: int, clusters: dict) -> dict:
    cfg = run_config(model, layout, steps)
    args = preset_args(cfg.model)
    world = cfg.parallel.world_size
    if world not in clusters:
        clusters[world] = calibrate(world)[0]
    mine, measured_step = timed_run(cfg)
    plan = cost_layout(args, cfg, clusters[world])
    comm = {}
    for c in plan.cuts:
        measured = sum(r.wire_bytes for r in mine.ledger_rows if r.cut == c.cut)
        comm[c.cut] = (measured, c.wire_bytes)
    states = sum(mine.memory[k] for k in ("params", "grads", "optimizer"))
    planned_states = sum(plan.memory[k] for k in ("params", "grads", "optimizer"))
    acts = sum(mine.activations.values()) if cfg.parallel.pp == 1 else None
    return {
        "model": model,
        "layout": layout,
        "world": world,
        "comm": comm,
        "states": (states, planned_states),
        "acts": (acts, plan.memory["activations"]),
        "step": (measured_step, plan.step),
        "parts": (plan.makespan, sum(c.exposed for c in plan.cuts if c.cut != "pp"), plan.optimizer),
    }


def ranking(rows: list[dict]) -> tuple[int, int]:
    agree = total = 0
    for a, b in itertools.combinations(rows, 2):
        if a["world"] != b["world"]:
            continue
        total += 1
        agree += (a["step"][0] < b["step"][0]) == (a["step"][1] < b["step"][1])
    return agree, total


def ratio(m, p) -> str:
    return f"{m / p:.3f}" if p else ("1.000" if not m else "inf")


def table(rows: list[dict]) -> str:
    lines = [
        "| model | layout | comm per cut: measured / planned (ratio) | model states (ratio) | activations (diff) "
        "| step measured | step planned | planned: pipeline + exposed comm + tail | ratio |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        comm = ", ".join(f"{cut} {m:,.0f}/{p:,.0f} ({ratio(m, p)})" for cut, (m, p) in r["comm"].items()) or "none"
        m_acts, p_acts = r["acts"]
        acts = "pipeline" if m_acts is None else f"{(p_acts - m_acts) / m_acts:+.1%}"
        sm, sp = r["step"]
        parts = " + ".join(f"{x * 1e3:.1f}" for x in r["parts"])
        lines.append(
            f"| {r['model']} | {r['layout']} | {comm} | {ratio(*r['states'])} | {acts} "
            f"| {sm * 1e3:.1f} ms | {sp * 1e3:.1f} ms | {parts} | {sp / sm:.2f} |"
        )
    agree, total = ranking(rows)
    within = sum(0.75 <= r["step"][1] / r["step"][0] <= 1.25 for r in rows)
    lines.append(f"\nplanned step within 25% of the measured median: {within}/{len(rows)}")
    lines.append(f"pairwise ranking agreement (same world size): {agree}/{total} = {agree / max(total, 1):.0%}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--only", default=None, help="keep the layouts whose 'model layout' contains this")
    parser.add_argument("--out", default=None, help="the table; the calibrations used go next to it")
    parser.add_argument(
        "--calibrate-each",
        action="store_true",
        help="calibrate again just before each layout's run (the machine's load drifts between runs)",
    )
    parser.add_argument(
        "--cluster",
        action="append",
        default=[],
        help="a `fivecut plan calibrate --ranks N` file to plan N-rank layouts with (else calibrated here)",
    )
    ns = parser.parse_args()
    if ns.steps <= WARMUP:
        parser.error(f"--steps must be more than {WARMUP} (the first {WARMUP} are left out of the median)")
    clusters = {c.world_size: c for c in map(parse_cluster, ns.cluster)}
    rows = []
    for model, layout in LAYOUTS:
        if ns.only and ns.only not in f"{model} {layout}":
            continue
        if ns.calibrate_each:
            clusters = {}
        rows.append(check(model, layout, ns.steps, clusters))
        print(table(rows[-1:]).splitlines()[2], flush=True)
    text = table(rows)
    print(text)
    if ns.out:
        with open(ns.out, "w") as f:
            f.write(text + "\n")
        for world, cluster in clusters.items():  # the (last) calibrations the table was planned with
            Path(ns.out).with_suffix(f".cluster{world}.toml").write_text(
                cluster_toml(cluster, f"fivecut plan calibrate --ranks {world}, by benchmarks/plan_check.py")
            )


if __name__ == "__main__":
    main()
