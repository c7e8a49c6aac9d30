"""The planner against fivecut's measured steps on one GPU: `benchmarks/gpu_step.py`'s tokens/s
beside `fivecut plan`'s for the same model, sequence, batch and settings, with a calibrated
cluster file (`fivecut plan calibrate --device cuda` on that GPU) and with the device's preset.

    python benchmarks/plan_gpu.py --steps OUT/gpu_step.json --cluster cluster-gpu.toml [--preset-too]
        [--model llama-1b --seq 2048 --batch 8] [--tolerance 0.10]

`scripts/gpu_check.sh --calibrate` runs it after the step measurements. Each fivecut case of
gpu_step.py (eager with the chunked loss, the full logits, compiled, the MoE shape) is planned
as eager (the planner has no model of `torch.compile`: its compiled row is a reading, not a
check). The last line counts the eager cases whose plan is within `--tolerance` of the measured
step, for each cluster.
"""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path

from fivecut.cli import build_parser, plan_config
from fivecut.plan.calibrate import data_sheet_peak
from fivecut.plan.cluster import DEVICES, parse_cluster
from fivecut.plan.cost import cost_layout

MOE = "n_experts=32 top_k=4 moe_ffn_dim=512 n_shared_experts=1 first_dense_layers=1"  # gpu_step.py's MOE
SETTINGS = {  # gpu_step.py's fivecut cases as `fivecut plan --set` flags
    "fivecut-eager": [],
    "fivecut-full-logits": ["train.loss_chunk_tokens=0"],
    "fivecut-compiled": [],
    "fivecut-moe": [f"model.{kv}" for kv in MOE.split()],
}


def planned(model: str, seq: int, batch: int, settings: list[str], cluster: str) -> float:
    """Tokens/s that `fivecut plan` predicts for one rank of `cluster` running `settings`."""
    flags = ["--model", model, "--cluster", cluster, "--seq", str(seq), "--global-batch", str(batch)]
    flags += ["--layout", "dp=1", *(x for s in ['train.dtype="bf16"', *settings] for x in ("--set", s))]
    ns = build_parser().parse_args(["plan", *flags])
    parsed = parse_cluster(cluster)
    cfg, args = plan_config(ns, parsed.world_size)
    return cost_layout(args, cfg, parsed).tokens_per_s


def preset_of(cluster_file: str) -> str | None:
    """The preset cluster (`1x1xH200`) of the GPU a calibrated file names (`NVIDIA H200`)."""
    name = parse_cluster(cluster_file).device.name.upper()
    found = [key for key in DEVICES if key in name]
    return f"1x1x{max(found, key=len)}" if found and data_sheet_peak(name) else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=Path, required=True, help="gpu_step.py's gpu_step.json")
    parser.add_argument("--cluster", action="append", required=True, help="a cluster file or preset (repeatable)")
    parser.add_argument("--preset-too", action="store_true", help="also plan with the calibrated GPU's preset")
    parser.add_argument("--model", default="llama-1b")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tolerance", type=float, default=0.10)
    opts = parser.parse_args()
    measured = json.loads(opts.steps.read_text())
    clusters = list(opts.cluster)
    if opts.preset_too:
        clusters += [p for p in (preset_of(c) for c in opts.cluster if c.endswith(".toml")) if p]
    cases = [name for name in SETTINGS if "tokens_per_s" in measured.get(name, {})]
    print(f"| case | measured tokens/s | {' | '.join(f'planned, {c}' for c in clusters)} |")
    print(f"|---|---:|{'---:|' * len(clusters)}")
    within = dict.fromkeys(clusters, 0)
    for name in cases:
        got = measured[name]["tokens_per_s"]
        cells = []
        for cluster in clusters:
            plan = planned(opts.model, opts.seq, opts.batch, SETTINGS[name], cluster)
            cells.append(f"{plan:,.0f} ({plan / got:.2f}x)")
            within[cluster] += name != "fivecut-compiled" and abs(plan / got - 1) <= opts.tolerance
        print(f"| {name} | {got:,.0f} | {' | '.join(cells)} |")
    checked = sum(name != "fivecut-compiled" for name in cases)
    print(" ".join(f"within_{opts.tolerance:.0%}[{shlex.quote(c)}]={within[c]}/{checked}" for c in clusters))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
