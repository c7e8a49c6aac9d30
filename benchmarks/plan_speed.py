"""How long `fivecut plan`'s search takes, and whether a change kept its ranking to the float.

    PYTHONPATH=. python benchmarks/plan_speed.py 70b --out before.json     # before a change
    PYTHONPATH=. python benchmarks/plan_speed.py 70b --against before.json  # after it

`70b`: llama3-70b on 32x8xH100, seq 8192, 4M tokens a step (256 GPUs); `8b`: llama3-8b on
1x8xH100. Prints the search's wall and CPU seconds (the search alone, imports aside; its
pool's processes counted) and its top layouts; `--out` writes every ranked layout's cost
(floats as `repr`), the counts and the layout needing least memory; `--against` says whether
they are the same as a file's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict

from fivecut.cli import PLAN_TOP, build_parser, plan_config
from fivecut.plan.cluster import parse_cluster
from fivecut.plan.search import search

SEARCHES = {
    "70b": ["--model", "llama3-70b", "--cluster", "32x8xH100", "--seq", "8192", "--global-batch-tokens", "4M"],
    "8b": ["--model", "llama3-8b", "--cluster", "1x8xH100"],
}


def candidate_record(c) -> dict:
    return {
        "layout": c.layout,
        "recompute": c.recompute,
        "accumulate": c.cfg.train.accumulate,
        "cost": repr(asdict(c.cost)),
    }


def cpu_seconds() -> float:
    """CPU seconds of this process and of its children that have ended (a search's pool)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("search", choices=sorted(SEARCHES))
    parser.add_argument("--out", help="write the ranking here (JSON)")
    parser.add_argument("--against", help="compare the ranking with this file's")
    ns = parser.parse_args()
    plan = build_parser().parse_args(["plan", *SEARCHES[ns.search]])
    cluster = parse_cluster(plan.cluster)
    cfg, args = plan_config(plan, cluster.world_size)
    wall, cpu = time.perf_counter(), cpu_seconds()
    result = search(args, cfg, cluster, max(PLAN_TOP if plan.top is None else plan.top, 1))
    wall, cpu = time.perf_counter() - wall, cpu_seconds() - cpu
    record = {
        "counts": [result.tried, result.invalid, result.too_big],
        "smallest": candidate_record(result.smallest) if result.smallest else None,
        "ranked": [candidate_record(c) for c in result.ranked],
    }
    print(f"{ns.search}: search {wall:.1f} s wall, {cpu:.1f} s CPU; {result.tried} layouts costed")
    for c in result.ranked[:10]:
        print(f"  {c.layout:<70} {c.recompute:<9} step {c.cost.step!r} memory {c.cost.memory['total']!r}")
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump(record, f, indent=0)
    if ns.against:
        with open(ns.against) as f:
            same = json.load(f) == record
        print("the same ranking, costs and counts as " + ns.against if same else "DIFFERENT from " + ns.against)
        return 0 if same else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
