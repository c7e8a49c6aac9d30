"""Closed-form communication volume per step, per cut: what `fivecut ledger` checks against.

Wire bytes per rank, with the ring factors of `fivecut.ledger`.
"""

from __future__ import annotations

from fivecut.ledger import ring_factor

FP32 = 4


def predict(args, cfg) -> dict[str, tuple[float, str]]:
    """{cut: (wire bytes per rank per optimizer step, the formula in words)} for `cfg`'s layout."""
    dims = cfg.parallel
    out: dict[str, tuple[float, str]] = {}
    n = dims.dp * dims.cp
    if n > 1:
        phi = args.num_params()
        out["dp"] = (ring_factor("all_reduce", n) * FP32 * phi, f"all-reduce of all gradients: 2(n-1)/n x 4 x Phi, n={n}, Phi={phi:,}")
        out["metrics"] = (ring_factor("all_reduce", n) * FP32, "all-reduce of the step's loss (one fp32)")
    return out
