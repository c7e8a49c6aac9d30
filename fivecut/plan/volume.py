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
FP32 = 4  # activations in these forms are fp32 (train.dtype = "fp32"), as `fivecut ledger` runs
PARAM_BYTES = FP32  # parameters are kept (and gathered) in fp32


def predict(args, cfg) -> dict[str, tuple[float, str]]:
    """{cut: (wire bytes per rank per optimizer step, the formula in words)} for `cfg`'s layout."""
    dims = cfg.parallel
    out = {}
    n = dims.dp * dims.cp
    if n > 1:
        out["dp"] = data_parallel_volume(args, cfg, n)
        out["metrics"] = (ring_factor("all_reduce", n) * 4, "all-reduce of the step's loss (one fp32)")
    if dims.tp > 1:
        out["tp"] = tensor_parallel_volume(args, cfg)
    return out


def tensor_parallel_volume(args, cfg) -> tuple[float, str]:
    """Per micro-step, E = b*s*h activations (b = rows per rank), L blocks, fp32:
    no SP: all-reduce of E after the embedding and after each region (1 + 2L, forward), of the
           gradient of E before each region and the head (2L + 1, backward);
    SP:    the same E as reduce-scatters and all-gathers, plus one all-gather of E in backward
           per region and head (the saved inputs, kept as slices) and an all-reduce of each
           norm weight's gradient (2L + 1 of h);
    both:  the vocab-parallel loss (max, then sum-exp and target logit: 3*b*s all-reduced),
           replicated k/v weights' gradients when t > kv heads, and the clip norm (1 element)."""
    dims, train = cfg.parallel, cfg.train
    t, L, h = dims.tp, args.n_layers, args.dim
    ar, ag = ring_factor("all_reduce", t), ring_factor("all_gather", t)
    b = train.global_batch // (dims.dp * train.accumulate)
    e = b * train.seq_len * h
    loss = 3 * b * train.seq_len
    kv = 2 * L * args.n_kv_heads * args.head_dim * h if args.n_kv_heads % t else 0
    if dims.sp:
        gathered = (1 + 2 * L) * 2 + (2 * L + 1) * 2 + (2 * L + 1)  # RS+AG forward/backward, regathers
        per_micro = ag * FP32 * gathered * e + ar * FP32 * (loss + (2 * L + 1) * h + kv)
        how = f"SP: ({gathered} x E all-gather/reduce-scatter) x (t-1)/t + all-reduces (loss 3bs, norms, kv)"
    else:
        per_micro = ar * FP32 * ((1 + 2 * L) * e + (2 * L + 1) * e + loss + kv)
        how = f"all-reduce of (4L + 2) x E + 3bs (loss){' + kv grads' if kv else ''}, x 2(t-1)/t"
    clip = ar * FP32 if train.grad_clip > 0 else 0.0
    total = train.accumulate * per_micro + clip
    return total, f"{train.accumulate} micro-steps x [{how}], E = b*s*h = {b}*{train.seq_len}*{h}, t={t}"


def data_parallel_volume(args, cfg, n: int) -> tuple[float, str]:
    dims, train = cfg.parallel, cfg.train
    g = BYTES[train.reduce_dtype]
    model = meta_model(args, dims.tp, dims.sp)
    phi = sum(p.numel() for p in meta_params(model))  # this rank's parameters (TP shards when tp > 1)
    ar, ag, rs = ring_factor("all_reduce", n), ring_factor("all_gather", n), ring_factor("reduce_scatter", n)
    clip = ar * 4 if train.grad_clip > 0 else 0.0  # squared shard norms, one fp32 (ZeRO only)
    if dims.zero == 0:
        return ar * g * phi, f"all-reduce of every gradient: 2(n-1)/n x {g}B x Phi, n={n}, Phi={phi:,}"
    acc = train.accumulate
    if dims.zero in (1, 2):
        plan = plan_buckets(meta_params(model)[::-1], int(train.bucket_mb * 2**20))
        flat = sum(padded(sum(p.numel() for p in b), n) for b in plan)
        sends = acc if dims.zero == 2 else 1
        volume = sends * rs * g * flat + ag * PARAM_BYTES * flat + clip
        how = f"{sends} x reduce-scatter + all-gather of Phi'={flat:,} (Phi={phi:,} padded per bucket) x (n-1)/n, n={n}"
        return volume, how + (" + clip-norm all-reduce" if clip else "")
    flat = sum(padded(sum(p.numel() for p in unique_params(mods)), n) for _, mods in transformer_units(model))
    gathers = 2 if dims.reshard_after_forward else 1
    volume = acc * (gathers * ag * PARAM_BYTES * flat + rs * g * flat) + clip
    how = f"{acc} x ({gathers} all-gathers + 1 reduce-scatter) of Phi'={flat:,} (Phi={phi:,} padded per unit) x (n-1)/n, n={n}"
    return volume, how + (" + clip-norm all-reduce" if clip else "")


def meta_model(args, tp: int = 1, sp: bool = False):
    """The model on the meta device, cut as rank 0 of `tp` tensor-parallel ranks would hold it."""
    from fivecut.comm import Group
    from fivecut.ledger import Ledger
    from fivecut.model import build_model
    from fivecut.parallel.saved import SavedActivations
    from fivecut.parallel.tensor import apply_tensor_parallel

    model = build_model(args, device="meta")
    if tp > 1:
        apply_tensor_parallel(model, Group("tp", tuple(range(tp)), None, Ledger(), index=0), sp, SavedActivations())
    return model


def meta_params(model) -> list:
    return [p for p in model.parameters() if p.requires_grad]
