"""How far verify's run drifts when only the order of its sums changes: the measurement behind verify's tolerances.

    python benchmarks/verify_drift.py --dtype bf16
    python benchmarks/verify_drift.py --dtype fp32 --models tiny --splits 2

For each model, verify's own run (`fivecut.cli.verify_config`: Shakespeare, 8 x 64 tokens a step,
validation on 2 batches at the last step) in one process, once with the whole batch at a time and
once per split (train.accumulate = 2, 4: the same tokens, their losses and gradients summed in
another order). Every split is compared with the whole batch exactly as verify compares a layout
with its single process (`print_comparison`, `worst_differences`). The table gives, per model and
split, the largest relative difference of each quantity; the last row the largest of all. verify's
tolerances for the dtype (`fivecut.cli.TOLERANCES`) must sit above that row, with margin.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fivecut import cli  # noqa: E402

QUANTITIES = ("loss", "grad_norm", "later_grad_norm", "val_loss")  # the labels of `cli.worst_differences`


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--models", nargs="+", default=["tiny", "tiny-moe", "tiny-mla"])
    parser.add_argument("--splits", nargs="+", type=int, default=[2, 4], help="train.accumulate values to compare")
    parser.add_argument("--steps", type=int, default=10, help="verify's default")
    parser.add_argument("--cache", default="~/.cache/fivecut", help="data.cache_dir")
    parser.add_argument("--timeout", type=float, default=600.0)
    return parser.parse_args()


def series(model: str, accumulate: int, opts: argparse.Namespace) -> dict[str, dict[int, float]]:
    """verify's single-process run of `model` in `opts.dtype`, the batch in `accumulate` parts."""
    sets = [f'train.dtype="{opts.dtype}"', f"train.accumulate={accumulate}", f'data.cache_dir="{opts.cache}"']
    ns = SimpleNamespace(model=model, layout="dp=1", steps=opts.steps, timeout=opts.timeout, overrides=sets)
    cfg = cli.verify_config(ns)
    _, device = cli.verify_device(cfg)
    return cli.verify_series(cli.run_spawned(cfg, opts.timeout, device=device, what=f"{model} {accumulate}")[0])


def main() -> None:
    opts = parse()
    print(f"| model | accumulate | {' | '.join(QUANTITIES)} |")
    print(f"|---|---|{'---|' * len(QUANTITIES)}")
    largest = dict.fromkeys(QUANTITIES, 0.0)
    for model in opts.models:
        whole = series(model, 1, opts)
        for split in opts.splits:
            with contextlib.redirect_stdout(io.StringIO()):  # verify's table of steps
                worst = cli.worst_differences(cli.print_comparison(whole, series(model, split, opts)))
            largest = {name: max(largest[name], worst[name]) for name in QUANTITIES}
            print(f"| {model} | 1 vs {split} | {' | '.join(f'{worst[name]:.2e}' for name in QUANTITIES)} |", flush=True)
    print(f"| largest | | {' | '.join(f'{largest[name]:.2e}' for name in QUANTITIES)} |")


if __name__ == "__main__":
    main()
