"""The plan's memory against one real step on fake tensors (`fivecut plan --check`), at the
shapes of issue 34's acceptance: each case planned for its GPU cluster (`cost_layout`: the step's
moments, the peak), then one step of fivecut itself run as the rank that peaks, on fake tensors
with CUDA's kernels' saved tensors (`fivecut.train.memory_check`), counted by torch's MemTracker.

    PYTHONPATH=. python benchmarks/memory_check.py [--cases llama-1b-b8,moe-32x4] [--out memory_check.md]
    PYTHONPATH=. python benchmarks/memory_check.py --smallest      # one tiny case (the suite's smoke run)

A table row: the case, its layout, the plan's peak and moment, the check's peak and moment, their
ratio (issue 34's bar: within 5%), each side's other moments, and the check's seconds.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field

from fivecut.cli import plan_config
from fivecut.plan.cluster import parse_cluster
from fivecut.plan.cost import cost_layout
from fivecut.plan.memory import GIB, kernels_of, step_moments
from fivecut.train.memory_check import step_memory

MOE_32X4 = (
    "model.n_experts=32",
    "model.top_k=4",
    "model.moe_ffn_dim=512",
    "model.n_shared_experts=1",
    "model.first_dense_layers=1",
)
V3_MINI_MOE = ("moe.eplb_slots=1", "moe.aux_loss_coef=0.0001", "moe.bias_update_rate=0.01")


@dataclass(frozen=True)
class Case:
    name: str
    model: str
    cluster: str
    layout: str
    seq: int
    batch: int
    sets: tuple[str, ...] = field(default=())


CASES = [
    Case("llama-1b-b8-full-logits", "llama-1b", "1x1xH200", "dp=1", 2048, 8, ("train.loss_chunk_tokens=0",)),
    Case("llama-1b-b8-chunked", "llama-1b", "1x1xH200", "dp=1", 2048, 8),
    Case(
        "llama-1b-b16-recompute-full-logits",
        "llama-1b",
        "1x1xH200",
        "dp=1",
        2048,
        16,
        ("train.loss_chunk_tokens=0", 'train.recompute="full"'),
    ),
    Case("llama-1b-b16-recompute-chunked", "llama-1b", "1x1xH200", "dp=1", 2048, 16, ('train.recompute="full"',)),
    Case("llama3-8b-dp8-zero3", "llama3-8b", "1x8xH100", "dp=8,zero=3", 8192, 16),
    Case("llama3-8b-tp8-sp", "llama3-8b", "1x8xH100", "tp=8,sp=true", 8192, 2),
    Case("llama3-8b-pp4-1f1b", "llama3-8b", "1x4xH100", "pp=4,pp_schedule=1f1b,microbatches=8", 8192, 8),
    Case("llama3-8b-pp4-zb1p", "llama3-8b", "1x4xH100", "pp=4,pp_schedule=zb1p,microbatches=8", 8192, 8),
    Case("llama3-8b-pp4-1f1b-m32", "llama3-8b", "1x4xH100", "pp=4,pp_schedule=1f1b,microbatches=32", 8192, 32),
    Case("llama3-8b-pp4-zb1p-m32", "llama3-8b", "1x4xH100", "pp=4,pp_schedule=zb1p,microbatches=32", 8192, 32),
    Case(
        "deepseek-v3-mini",
        "configs/deepseek-v3-mini.toml",
        "1x8xH100",
        "pp=2,pp_schedule=dualpipev,microbatches=4,dp=4,ep=2,zero=1",
        128,
        16,
        V3_MINI_MOE,
    ),
    Case("moe-32x4", "llama-1b", "1x1xH200", "dp=1", 2048, 8, MOE_32X4),
]
SMALLEST = Case("tiny", "tiny", "1x2xH100", "pp=2,microbatches=2", 64, 4)


def run(case: Case) -> dict:
    cluster = parse_cluster(case.cluster)
    ns = argparse.Namespace(
        model=case.model,
        layout=case.layout,
        seq=case.seq,
        global_batch=case.batch,
        global_batch_tokens=None,
        dtype="bf16",
        overrides=list(case.sets),
    )
    cfg, args = plan_config(ns, cluster.world_size)
    cost = cost_layout(args, cfg, cluster)
    planned = step_moments(cost.memory)
    started = time.perf_counter()
    check = step_memory(args, cfg, cost.memory_rank, kernels=kernels_of(cluster))
    return {
        "case": case,
        "plan": cost.memory["total"],
        "plan_moment": max(planned, key=planned.get),
        "planned": planned,
        "check": check,
        "seconds": time.perf_counter() - started,
    }


def row(r: dict) -> str:
    c, check = r["case"], r["check"]
    unit, scale = ("GiB", GIB) if r["plan"] >= GIB else ("MiB", 2**20)
    plan_moments = ", ".join(f"{k} {v / scale:.2f}" for k, v in r["planned"].items())
    check_moments = ", ".join(f"{k} {v / scale:.2f}" for k, v in check.moments.items())
    return (
        f"| {c.name} | {c.cluster} {c.layout}, seq {c.seq}, batch {c.batch}"
        f"{' ' + ' '.join(c.sets) if c.sets else ''} | {r['plan'] / scale:.2f} {unit} ({r['plan_moment']}) | "
        f"{check.peak / scale:.2f} {unit} ({check.moment}) | {check.peak / r['plan']:.3f} | {plan_moments} | "
        f"{check_moments} | {r['seconds']:.0f} |"
    )


HEADER = (
    "| case | layout | plan (moment) | check (moment) | check/plan | plan's moments | check's moments | s |\n"
    "|---|---|---|---|---|---|---|---|"
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default=None, help="comma-separated case names (default: all)")
    parser.add_argument("--smallest", action="store_true", help="one tiny case only (the test suite's smoke run)")
    parser.add_argument("--out", default=None, help="also write the table to this markdown file")
    ns = parser.parse_args()
    cases = [SMALLEST] if ns.smallest else CASES
    if ns.cases:
        wanted = ns.cases.split(",")
        unknown = [w for w in wanted if w not in {c.name for c in CASES}]
        if unknown:
            parser.error(f"unknown case {unknown[0]!r}; cases: {', '.join(c.name for c in CASES)}")
        cases = [c for c in CASES if c.name in wanted]
    lines = [HEADER]
    print(HEADER, flush=True)
    for case in cases:
        lines.append(row(run(case)))
        print(lines[-1], flush=True)
    if ns.out:
        with open(ns.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
