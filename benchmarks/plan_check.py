"""The planner (`fivecut plan`) against this machine: for each layout, `fivecut ledger`'s
measurement of a real step and a timed run, next to `cost_layout` with this machine's
calibrated cluster (`fivecut plan calibrate` with the layout's number of ranks).

    PYTHONPATH=. python benchmarks/plan_check.py [--steps 12] [--runs 5] [--only SUBSTRING] [--out plan_check.md]
        [--cluster cluster-2.toml --cluster cluster-4.toml]   # else calibrated first, per world size

Per layout (seq 64, global batch 8, fp32, as `fivecut ledger` runs):

    comm         wire bytes per cut on rank 0, the ledger's last step vs the planner (ratio)
    states       model-state bytes (params + grads + optimizer) measured vs planned, on the rank
                 the plan says holds the most (its pipeline position, other coordinates 0)
    activations  bytes saved for backward, summed over a rank's layers (step 1, one microbatch),
                 the mean over the ranks (a MoE layer's rows per rank follow its routing: the
                 planner assumes it uniform, which is what the mean over EP ranks receives),
                 vs the planner's (only without a pipeline: there the planner gives the peak
                 over microbatches in flight, the ledger one microbatch)
    step         measured: the median of rank 0's step times (the trainer's metrics.jsonl,
                 `step_time`) over the steps after the first `WARMUP` of a run of `--steps` steps;
                 of `--runs` such runs (in passes over the layouts, minutes apart) the median.
                 Planned: `cost_layout`'s step with the calibration of the layout's world size
                 (`--runs` calibrations, one a pass, each figure their median; or the --cluster
                 files given): the machine's load by others drifts, both sides see the same
    ranking      the share of layout pairs of the same world size whose planned order of step
                 time is the measured order
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import pickle
import statistics
import tempfile
from dataclasses import replace
from pathlib import Path

from fivecut.cli import build_parser, layout_config, spawned
from fivecut.config import preset_args
from fivecut.plan.calibrate import calibrate
from fivecut.plan.cluster import Link, cluster_toml, parse_cluster
from fivecut.plan.cost import cost_layout
from fivecut.train.memory_check import global_rank

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
    """Every rank's RunResult and the median of rank 0's step times after `WARMUP` steps."""
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
        )
        lines = (Path(out) / "metrics.jsonl").read_text().splitlines()
    times = [r["step_time"] for r in map(json.loads, lines) if "step_time" in r]
    return result, statistics.median(times[WARMUP:])


def measure(model: str, layout: str, steps: int) -> dict:
    """One timed run of a layout: its ranks' ledgers, memory, activations and rank 0's median step time."""
    cfg = run_config(model, layout, steps)
    results, step = timed_run(cfg)
    return {"model": model, "layout": layout, "cfg": cfg, "result": results[0], "results": results, "steps": [step]}


def compare(run: dict, cluster) -> dict:
    """A layout's measurements (the median of its runs' medians) next to its plan."""
    cfg, mine = run["cfg"], run["result"]
    plan = cost_layout(preset_args(cfg.model), cfg, cluster)
    comm = {}
    for c in plan.cuts:
        measured = sum(r.wire_bytes for r in mine.ledger_rows if r.cut == c.cut)
        comm[c.cut] = (measured, c.wire_bytes)
    fullest = run["results"][global_rank(cfg, plan.memory_rank)]
    states = sum(fullest.memory[k] for k in ("params", "grads", "optimizer"))
    planned_states = sum(plan.memory[k] for k in ("params", "grads", "optimizer"))
    acts = None
    if cfg.parallel.pp == 1:  # the mean over ranks: a MoE layer's tokens per rank follow the routing
        acts = statistics.mean(sum(r.activations.values()) for r in run["results"])
    return {
        "model": run["model"],
        "layout": run["layout"],
        "world": cfg.parallel.world_size,
        "comm": comm,
        "states": (states, planned_states),
        "acts": (acts, plan.memory["activations"]),
        "step": (statistics.median(run["steps"]), plan.step),
        "parts": (plan.makespan, sum(c.exposed for c in plan.cuts if c.cut != "pp"), plan.optimizer),
    }


def typical(clusters: list):
    """Calibrations of the same machine (one a pass) as one: each figure's median over them."""
    first = clusters[0]
    med = statistics.median
    device = replace(
        first.device,
        **{k: med(getattr(c.device, k) for c in clusters) for k in DEVICE_FIGURES},
    )
    ops = [op for op, _ in first.intra.op_latency_us]
    rated = [op for op, _ in first.intra.op_bandwidth_gbps]
    link = Link(
        med(c.intra.bandwidth_gbps for c in clusters),
        med(c.intra.latency_us for c in clusters),
        tuple((op, med(dict(c.intra.op_latency_us)[op] for c in clusters)) for op in ops),
        tuple((op, med(dict(c.intra.op_bandwidth_gbps)[op] for c in clusters)) for op in rated),
    )
    return replace(first, device=device, intra=link, inter=link)


DEVICE_FIGURES = (
    "peak_tflops",
    "kernel_us",
    "memory_gbps",
    "tensor_us",
    "overlap",
    "attention_tflops",
    "activation_gbps",
    "loss_gbps",
    "recompute_us",
    "action_us",
)


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


def measured(chosen: list, passes: int, steps: int, given: dict) -> tuple[dict, dict]:
    """Each layout's timed runs, `passes` passes over them (each layout's runs minutes apart), and
    a calibration of each world size a pass (but those `given`)."""
    calibrations: dict[int, list] = {}
    runs: dict[tuple[str, str], dict] = {}
    for done in range(passes):
        for model, layout in chosen:
            world = run_config(model, layout, 2).parallel.world_size
            if world not in given and len(calibrations.get(world, [])) <= done:
                calibrations.setdefault(world, []).append(calibrate(world)[0])
            run = measure(model, layout, steps)
            if (model, layout) in runs:
                runs[model, layout]["steps"] += run["steps"]
            else:
                runs[model, layout] = run
            print(f"{model} {layout}: {run['steps'][0] * 1e3:.1f} ms", flush=True)
    return runs, calibrations


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--only", default=None, help="keep the layouts whose 'model layout' contains this")
    parser.add_argument("--out", default=None, help="the table; the calibrations used go next to it")
    parser.add_argument(
        "--runs",
        type=int,
        default=5,
        help="timed runs of each layout and calibrations of each world, in passes; each figure's median counts",
    )
    parser.add_argument(
        "--cluster",
        action="append",
        default=[],
        help="a `fivecut plan calibrate --ranks N` file to plan N-rank layouts with (else calibrated here)",
    )
    parser.add_argument(
        "--keep",
        default=None,
        help="a file to pickle the runs and calibrations into; if it exists, they are read from it "
        "instead of measured (a changed time model re-planned against the same measurements)",
    )
    ns = parser.parse_args()
    if ns.steps <= WARMUP:
        parser.error(f"--steps must be more than {WARMUP} (the first {WARMUP} are left out of the median)")
    if ns.runs < 1:
        parser.error("--runs must be at least 1")
    given = {c.world_size: c for c in map(parse_cluster, ns.cluster)}
    chosen = [(m, lay) for m, lay in LAYOUTS if not ns.only or ns.only in f"{m} {lay}"]
    if ns.keep and Path(ns.keep).exists():
        runs, calibrations = pickle.loads(Path(ns.keep).read_bytes())
        chosen = [key for key in chosen if key in runs]
    else:
        runs, calibrations = measured(chosen, ns.runs, ns.steps, given)
        if ns.keep:
            Path(ns.keep).write_bytes(pickle.dumps((runs, calibrations)))
    clusters = {**{w: typical(cs) for w, cs in calibrations.items()}, **given}
    rows = [compare(runs[key], clusters[runs[key]["cfg"].parallel.world_size]) for key in chosen]
    text = table(rows)
    print(text)
    if ns.out:
        with open(ns.out, "w") as f:
            f.write(text + "\n")
        for world, cluster in clusters.items():  # the calibrations the table was planned with
            Path(ns.out).with_suffix(f".cluster{world}.toml").write_text(
                cluster_toml(cluster, f"fivecut plan calibrate --ranks {world}, by benchmarks/plan_check.py")
            )


if __name__ == "__main__":
    main()
