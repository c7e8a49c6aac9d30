"""MoE load balance on Shakespeare: the same model and data, trained under each balancing method.

    python benchmarks/moe_balance.py [--steps 300] [--dp 4] [--ep 4] [--window 50] [--only TEXT]
    python benchmarks/moe_balance.py --steps 11 --dp 2 --ep 2 --window 1 --only "moves + 1"   # a quick check

Each variant trains `tiny-moe` (8 routed experts, top-2, one shared expert; byte tokens;
16 x 128 tokens a step) from the same seed on dp x ep ranks, one after the other, and
reports over the last `--window` steps, averaged over the MoE layers:
    experts max/mean   the busiest expert's slots over the mean (1.0 = perfectly even)
    ranks max/mean     the busiest ep rank's rows over the mean, as computed
    without EPLB       the same steps' routing on the initial placement (no copies, no moves)
    dropped            fraction of (token, expert) slots dropped by the capacity factor
and the final validation loss, and the elements sent to move experts between ranks. These
are routing statistics, not timings: they do not
depend on the machine's load.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fivecut.config import TrainConfig, load_config
from fivecut.launch import spawn
from fivecut.train.data import load_tokens
from fivecut.train.trainer import train

VARIANTS = {
    "unbalanced router": [],
    "auxiliary loss (alpha 0.01)": ["moe.aux_loss_coef=0.01"],
    "aux-loss-free (gamma 0.01)": ["moe.bias_update_rate=0.01"],
    "aux-loss-free + EPLB (1 extra slot per rank)": ["moe.bias_update_rate=0.01", "moe.eplb_slots=1"],
    "aux-loss-free + EPLB moves (no extra slots)": ["moe.bias_update_rate=0.01", "moe.eplb_move=true"],
    "unbalanced + EPLB (1 extra slot per rank)": ["moe.eplb_slots=1"],
    "unbalanced + EPLB moves + 1 extra slot": ["moe.eplb_slots=1", "moe.eplb_move=true"],
    "aux-loss-free, capacity factor 1.0": ["moe.bias_update_rate=0.01", "moe.capacity_factor=1.0"],
}


def run(cfg):
    result = train(cfg, quiet=True)
    return result.moe, result.val_losses


def summarize(moe: list[dict], window: int) -> dict[str, float]:
    last = moe[-window:]
    out = {
        key: statistics.mean(step[key] for step in last)
        for key in ("max_mean", "rank_max_mean", "rank_max_mean_no_eplb", "dropped")
    }
    out["moved"] = sum(layer["moved_elements"] for step in moe for layer in step["local"].values())  # rank 0, whole run
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--steps", type=int, default=300, help="training steps per variant (fewer than 10: a shorter lr warm-up)"
    )
    parser.add_argument("--dp", type=int, default=4, help="ranks")
    parser.add_argument("--ep", type=int, default=4, help="expert-parallel ranks (divides --dp)")
    parser.add_argument("--window", type=int, default=50, help="the last steps the statistics average over")
    parser.add_argument("--only", help="run only the variants whose name contains this text")
    ns = parser.parse_args()
    base = [
        'model.preset="tiny-moe"',
        'data.tokenizer="byte"',
        f"train.steps={ns.steps}",
        f"train.warmup={min(ns.steps, TrainConfig().warmup)}",  # the default, unless the run is shorter
        "train.seq_len=128",
        "train.global_batch=16",
        "train.eval_every=100",
        "log.progress=false",
        "log.plot=false",
        f"parallel.dp={ns.dp}",
        f"parallel.ep={ns.ep}",  # EPLB variants re-plan every 10 steps from 10 (the defaults)
    ]
    cfg0 = load_config(None, base)
    load_tokens(cfg0.data.source, cfg0.data.tokenizer, Path(cfg0.data.cache_dir).expanduser(), cfg0.data.val_fraction)
    print(
        f"tiny-moe on Shakespeare, dp={ns.dp}, ep={ns.ep}, {ns.steps} steps; averages over the last {ns.window} steps\n"
    )
    print("| variant | experts max/mean | ranks max/mean | without EPLB | dropped | val loss | moved by rank 0 |")
    print("|---|---|---|---|---|---|---|")
    for name, extra in VARIANTS.items():
        if ns.only and ns.only not in name:
            continue
        with tempfile.TemporaryDirectory() as out:
            cfg = load_config(None, base + extra + [f'log.out_dir="{out}"'])
            moe, val = spawn(run, ns.dp, cfg, timeout_s=3600)[0]
        s = summarize(moe, ns.window)
        print(
            f"| {name} | {s['max_mean']:.3f} | {s['rank_max_mean']:.3f} | {s['rank_max_mean_no_eplb']:.3f} | "
            f"{100 * s['dropped']:.2f}% | {val[max(val)]:.4f} | {4 * s['moved'] / 2**20:.1f} MiB |",
            flush=True,
        )


if __name__ == "__main__":
    main()
