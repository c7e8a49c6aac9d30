"""The planner's bytes equal the ledger's: `cost_layout`'s communication per cut and model-state
memory are those `fivecut ledger` measures on a real step (tiny, 2 ranks), its activations
a block's to the byte, and its collective calls per cut and op (what each call's latency multiplies) are
the ledger's (timing is not asserted: benchmarks/plan_check.py puts it in benchmarks/results/planner.md)."""

from __future__ import annotations

import pytest

from fivecut.cli import build_parser, layout_config, run_spawned
from fivecut.config import preset_args
from fivecut.plan.cluster import preset_cluster
from fivecut.plan.cost import cost_layout, layout_memory


@pytest.mark.parametrize(
    "layout",
    [
        "dp=2,zero=3",
        "tp=2,sp=true",
        "cp=2,cp_mode=ring",
        pytest.param("cp=4,cp_mode=usp,cp_ulysses=2", marks=pytest.mark.sweep),  # the planner passes U
    ],
)
def test_planned_bytes_are_the_measured_ones(layout):
    cfg = layout_config(build_parser().parse_args(["ledger", "--model", "tiny", "--layout", layout, "--steps", "1"]))
    measured = run_spawned(cfg, 120.0, measure_activations=True, what=f"ledger {layout}")[0]
    plan = cost_layout(preset_args(cfg.model), cfg, preset_cluster(1, cfg.parallel.world_size, "H100"))
    for cut in plan.cuts:
        assert cut.wire_bytes == sum(r.wire_bytes for r in measured.ledger_rows if r.cut == cut.cut), cut.cut
    assert {c.cut for c in plan.cuts} >= {r.cut for r in measured.ledger_rows if r.wire_bytes} - {"metrics", "control"}
    for key in ("params", "grads", "optimizer"):
        assert plan.memory[key] == measured.memory[key], key
    # the activations to the byte: every block of tiny is alike, the planner holds n_layers of it;
    # the first block measured also keeps what all share (the RoPE tables), so it is left out
    first, *others = (measured.activations[k] for k in sorted(measured.activations, key=int))
    assert others and set(others) == {others[0]} and first > others[0]
    cpu = layout_memory(preset_args(cfg.model), cfg, "cpu")  # measured here: the CPU's norms
    assert cpu["activations"] == len(measured.activations) * others[0]
    assert planned_calls(plan) == measured_calls(measured.ledger_rows)


def measured_calls(rows) -> dict[tuple[str, str], float]:
    """The ledger's calls by (cut, op), without the step's tail (loss, stop flags, the gradient
    norm's all-reduces: `fivecut.plan.calls.step_calls` counts those by group size)."""
    out: dict[tuple[str, str], float] = {}
    for r in rows:
        if r.cut in ("metrics", "control") or (r.phase == "optimizer" and r.op == "all_reduce"):
            continue
        out[r.cut, r.op] = out.get((r.cut, r.op), 0) + r.calls
    return out


def planned_calls(plan) -> dict[tuple[str, str], float]:
    return {(cut, op): n for cut, ops in plan.calls.items() for op, n in ops.items()}


@pytest.mark.parametrize(
    "model, layout",
    [
        ("tiny", "dp=2,zero=1"),
        ("tiny", "dp=2,zero=2 --set train.bucket_mb=0.5"),  # a reduce-scatter and a gather a bucket
        ("tiny", "tp=2"),
        ("tiny", "cp=2,cp_mode=ulysses"),
        ("tiny", "pp=2,microbatches=4,pp_schedule=interleaved,pp_virtual=2"),
        ("tiny-moe", "dp=2,ep=2,etp=2,tp=2"),
    ],
)
def test_planned_calls_are_the_ledgers(model, layout):
    layout, *sets = layout.split(" --set ")
    flags = [f for s in sets for f in ("--set", s)]
    cfg = layout_config(
        build_parser().parse_args(["ledger", "--model", model, "--layout", layout, "--steps", "1", *flags])
    )
    measured = run_spawned(cfg, 120.0, what=f"ledger {layout}")[0]
    plan = cost_layout(preset_args(cfg.model), cfg, preset_cluster(1, cfg.parallel.world_size, "H100"))
    assert planned_calls(plan) == measured_calls(measured.ledger_rows)
