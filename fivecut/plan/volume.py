"""Closed-form communication volume per step, per cut: what `fivecut ledger` checks against.

Wire bytes per rank per optimizer step, with the ring factors of `fivecut.ledger`. The
sizes of flat buffers (ZeRO buckets and units, padded to a multiple of the group size)
come from the model built on the meta device: no memory, exact shapes.
"""

from __future__ import annotations

from fivecut.ledger import ring_factor
from fivecut.parallel.data import padded, plan_buckets
from fivecut.parallel.zero import transformer_units, unique_params

BYTES = {"fp32": 4, "bf16": 2}
PARAM_BYTES = 4  # parameters are kept (and gathered) in fp32


def predict(args, cfg) -> dict[str, tuple[float, str]]:
    """{cut: (wire bytes per rank per optimizer step, the formula in words)} for `cfg`'s layout."""
    dims, train = cfg.parallel, cfg.train
    n = dims.dp * dims.cp
    if n == 1:
        return {}
    return {
        "dp": data_parallel_volume(args, cfg, n),
        "metrics": (ring_factor("all_reduce", n) * 4, "all-reduce of the step's loss (one fp32)"),
    }


def data_parallel_volume(args, cfg, n: int) -> tuple[float, str]:
    dims, train = cfg.parallel, cfg.train
    g = BYTES[train.reduce_dtype]
    phi = args.num_params()
    ar, ag, rs = ring_factor("all_reduce", n), ring_factor("all_gather", n), ring_factor("reduce_scatter", n)
    clip = ar * 4 if train.grad_clip > 0 else 0.0  # squared shard norms, one fp32
    if dims.zero == 0:
        return ar * g * phi, f"all-reduce of every gradient: 2(n-1)/n x {g}B x Phi, n={n}, Phi={phi:,}"
    acc = train.accumulate
    if dims.zero in (1, 2):
        flat = sum(padded(sum(p.numel() for p in b), n) for b in plan_buckets(meta_params(args)[::-1], int(train.bucket_mb * 2**20)))
        sends = acc if dims.zero == 2 else 1
        volume = sends * rs * g * flat + ag * PARAM_BYTES * flat + clip
        how = f"{sends} x reduce-scatter + all-gather of Phi'={flat:,} (Phi={phi:,} padded per bucket) x (n-1)/n, n={n}"
        return volume, how + (" + clip-norm all-reduce" if clip else "")
    flat = sum(padded(sum(p.numel() for p in unique_params(mods)), n) for _, mods in transformer_units(meta_model(args)))
    gathers = 2 if dims.reshard_after_forward else 1
    volume = acc * (gathers * ag * PARAM_BYTES * flat + rs * g * flat) + clip
    how = f"{acc} x ({gathers} all-gathers + 1 reduce-scatter) of Phi'={flat:,} (Phi={phi:,} padded per unit) x (n-1)/n, n={n}"
    return volume, how + (" + clip-norm all-reduce" if clip else "")


def meta_model(args):
    from fivecut.model import build_model

    return build_model(args, device="meta")


def meta_params(args) -> list:
    return [p for p in meta_model(args).parameters() if p.requires_grad]
