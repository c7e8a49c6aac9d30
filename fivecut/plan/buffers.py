"""The buffers a data cut holds beside the model states, at their peak (`BufferPeak` measures them).

    DDP      a copy of the gradients in the reduce dtype, when it differs from theirs: Psi x r
    ZeRO-1   the reduced shards until the step's reductions are all done (Psi/n x r), and the copies
    ZeRO-2   one bucket of full gradients and its flat copy, while it is flattened (two buckets, each
             at most the whole 4 Psi); then the flat copy, its copy in the reduce dtype, its shard
    ZeRO-3   the root unit (embedding, final norm, head), gathered through forward and through
             backward; the block in use and the next one, prefetched; at a block's reduction its
             gradients, their flat copy in the reduce dtype and its reduced shard, while the head's
             gradients wait for the embedding's; at the end of backward the root's own gradients,
             their copy and its shard

r is the reduce dtype's bytes (train.reduce_dtype), c the compute dtype's (2 for ZeRO-3's bf16
units, else 4); a unit's flat buffers are padded to a multiple of their shard group. Inside a
pipeline a stage's full gradients are model states (`fivecut.plan.cost.rank_states`), so only
the units gathered, two at a time, and one reduction's copy and shard count here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from fivecut.parallel.data import padded
from fivecut.plan.volume import (
    composed_key,
    composition,
    group_counts,
    layout_key,
    plain_dims,
    reduce_group_sizes,
    remembered,
    shard_group_sizes,
)


def buffer_bytes(args, cfg, pp_rank: int = 0, records=None) -> float:
    """The most bytes the data cut of the rank at pipeline position `pp_rank` holds in buffers;
    once per model, layout (any microbatch count), the train fields it reads and position."""
    dims, t = cfg.parallel, cfg.train
    every = tuple(v for k, v in zip(vars(dims), layout_key(dims)) if k != "microbatches")
    key = (id(records), args, every, t.seq_len, t.dtype, t.reduce_dtype, t.bucket_mb, repr(cfg.moe), pp_rank)
    if key not in BUFFERS:
        remembered(BUFFERS, key, data_cut_buffers(args, cfg, counted(args, cfg, pp_rank, records)), COUNTED_KEPT)
    return BUFFERS[key]


BUFFERS: dict[tuple, float] = {}


def data_cut_buffers(args, cfg, units: Units) -> float:
    """The closed form of the module doc for the layout's data cut, from the rank's `Units`."""
    dims = cfg.parallel
    r = 2 if cfg.train.reduce_dtype == "bf16" else 4
    if dims.zero == 3:
        c = 2 if cfg.train.dtype == "bf16" else 4
        sizes = shard_group_sizes(cfg)
        if dims.pp > 1:
            return pipelined_zero3(units, sizes, c, r)
        return zero3(units, sizes, c, r, args.tie_embeddings, dims.reshard_after_forward)
    sizes = shard_group_sizes(cfg) if dims.zero else reduce_group_sizes(cfg)
    bucket = cfg.train.bucket_mb * 2**20
    return sum(
        bucketed(dims.zero, n, sizes[g], r, max(bucket, 4 * units.largest[g]), dims.pp > 1)
        for g, n in units.psi.items()
        if sizes[g] > 1
    )


def loss_moment_buffers(args, cfg, pp_rank: int = 0, records=None) -> float:
    """The data cut's buffers alive at the loss (`fivecut.plan.memory.step_moments`), before any
    backward has reduced a gradient: ZeRO-3's root unit (embedding, final norm, head), gathered
    through forward and backward (each block was resharded after its forward); inside a pipeline,
    where backwards run between forwards, all of `buffer_bytes`. The other data cuts reduce in
    backward: none yet."""
    dims = cfg.parallel
    if dims.zero != 3 or not dims.reshard_after_forward:
        return 0.0 if dims.zero != 3 else buffer_bytes(args, cfg, pp_rank, records)
    if dims.pp > 1:
        return buffer_bytes(args, cfg, pp_rank, records)
    units = counted(args, cfg, pp_rank, records)
    c = 2 if cfg.train.dtype == "bf16" else 4
    return full(merged(units.embedding, units.head), shard_group_sizes(cfg), c)


Parts = tuple[tuple[str, int], ...]  # a unit's local parameters by reduce group


@dataclass(frozen=True)
class Units:
    """What the buffers' closed forms read of a rank's parameters: each reduce group's count and
    largest parameter, ZeRO-3's units in the order they run (`units_of`) and, as sets, the
    pairs of neighbouring units that are gathered together (many blocks are alike)."""

    psi: dict[str, int]
    largest: dict[str, int]
    embedding: Parts
    head: Parts
    blocks: tuple[Parts, ...]
    with_next: frozenset  # (block, the block after it, or () after the last)
    with_before: frozenset  # (the block before it, or () before the first, block)
    stage_pairs: frozenset  # in a pipeline stage: (unit, the unit after it) over embedding, blocks, head
    stage_units: frozenset


def counted(args, cfg, pp_rank: int, records) -> Units:
    """`Units` of the rank at pipeline position `pp_rank`, once per model, layout without its data
    cut and microbatches (they change no parameter a rank holds), and position: from the screen's
    composition (one block of each kind, `fivecut.plan.volume.composition`), or from `records`."""
    key = (id(records), composed_key(args, cfg, pp_rank))  # the layout as its records see it
    if key not in COUNTED:
        plain = replace(cfg, parallel=plain_dims(cfg.parallel))
        units = units_of(*(held_units(records(args, plain, pp_rank)) if records else composed(args, plain, pp_rank)))
        remembered(COUNTED, key, units, COUNTED_KEPT)
    return COUNTED[key]


COUNTED: dict[tuple, Units] = {}
COUNTED_KEPT = 8192  # the oldest go first


def composed(args, cfg, pp_rank: int) -> tuple[list, list, list]:
    """(stage, unit, {group: count}) of the blocks and of the ends, and every distinct record, from
    the screen's one block of each kind: a block adds its kind's counts."""
    found = composition(args, cfg, pp_rank)
    kinds = [group_counts(r.values()) for r in found.kinds]
    blocks = [(stage, f"layers.{i}", kinds[k]) for stage, i, k in found.blocks]
    ends = [(stage, end_unit(pl.name, stage), group_counts([pl])) for pl, stage in found.outside]
    return blocks, ends, [pl for r in found.kinds for pl in r.values()] + [pl for pl, _ in found.outside]


def held_units(placements: dict) -> tuple[list, list, list]:
    """The same from a rank's records, one by one."""
    records = list(placements.values())
    blocks, ends = [], []
    for pl in records:
        if pl.name.startswith("layers."):
            blocks.append((pl.stage, unit_of(pl.name), group_counts([pl])))
        else:
            ends.append((pl.stage, end_unit(pl.name, pl.stage), group_counts([pl])))
    return blocks, ends, records


def units_of(blocks: list, ends: list, records: list) -> Units:
    """ZeRO-3's units: outside a pipeline the root (`transformer_units`: embedding, final norm and
    head) and the blocks in order; in a stage its embedding, its blocks and its head (`stage_units`),
    one stage after another, each stage's units gathered apart from the next stage's."""
    by_unit: dict[tuple, dict[str, int]] = {}
    for stage, name, parts in blocks + ends:
        add_to(by_unit.setdefault((stage, name), {}), parts)
    embedding, head, psi = {}, {}, {}
    for (_, name), parts in by_unit.items():
        add_to(psi, parts)
        if name in ("embedding", "head"):
            add_to(embedding if name == "embedding" else head, parts)
    chain = tuple(frozen(parts) for (_, name), parts in by_unit.items() if name.startswith("layers."))
    order: list[Parts] = []
    for stage in dict.fromkeys(stage for stage, _, _ in blocks + ends):
        names = ["embedding"] + [n for s, n, _ in blocks if s == stage] + ["head"]
        order += [frozen(by_unit[(stage, n)]) for n in dict.fromkeys(names) if (stage, n) in by_unit] + [()]
    largest: dict[str, int] = {}
    for pl in records:
        largest[pl.reduce] = max(largest.get(pl.reduce, 0), pl.local_numel())
    return Units(
        psi,
        largest,
        frozen(embedding),
        frozen(head),
        chain,
        frozenset(zip(chain, chain[1:] + ((),))),
        frozenset(zip(((),) + chain[:-1], chain)),
        frozenset(zip(order, order[1:] + [()])),
        frozenset(u for u in order if u),
    )


def add_to(total: dict[str, int], parts: dict[str, int]) -> None:
    for g, n in parts.items():
        total[g] = total.get(g, 0) + n


def frozen(parts: dict[str, int]) -> Parts:
    return tuple(sorted(parts.items()))


def end_unit(name: str, stage: int | None) -> str:
    """The unit of a parameter outside the blocks: the embedding, or the head (final norm, output,
    and on a later stage of a pipeline the tied embedding's copy, which the output uses)."""
    return "embedding" if name.startswith("tok_embeddings") and not stage else "head"


def bucketed(zero: int, psi: int, n: int, r: int, bucket_bytes: float, pipelined: bool) -> float:
    """DDP and ZeRO-1/2 over a group of `n` ranks for `psi` parameters (fp32 gradients); a bucket
    holds up to `bucket_bytes` (train.bucket_mb, or a parameter larger than that alone)."""
    copies = psi * r if r != 4 else 0.0  # every bucket's copy lives until the end of backward
    if zero == 0:
        return copies
    if zero == 1:
        return copies + padded(psi, n) // n * r
    bucket = min(4 * psi, bucket_bytes)  # ZeRO-2: one bucket in flight
    filling = 0.0 if pipelined else bucket  # in a stage the full gradients are model states
    sent = bucket + (bucket * r / 4 if r != 4 else 0.0) + bucket / 4 / n * r  # its flat copy, wire and shard
    return max(filling + bucket, sent)  # while its gradients are flattened; once they are freed


def unit_of(name: str) -> str:
    """A block's ZeRO-3 unit: `layers.N`."""
    return ".".join(name.split(".")[:2])


def full(parts: Parts, sizes: dict[str, int], dtype_bytes: int) -> float:
    """A unit's flat buffers, padded to a multiple of each part's shard group."""
    return sum(padded(n, sizes[g]) * dtype_bytes for g, n in parts)


def reduction(parts: Parts, sizes: dict[str, int], c: int, r: int) -> float:
    """A unit's gradients (compute dtype), their flat copy on the wire and the reduced shard."""
    grads = sum(n * c for _, n in parts)
    return grads + full(parts, sizes, r) + sum(padded(n, sizes[g]) // sizes[g] * r for g, n in parts)


def merged(a: Parts, b: Parts) -> Parts:
    """Two units' parts as one (ZeRO-3's root: the embedding and the head)."""
    out = dict(a)
    for g, n in b:
        out[g] = out.get(g, 0) + n
    return tuple(sorted(out.items()))


def zero3(units: Units, sizes: dict, c: int, r: int, tied: bool, reshard: bool = True) -> float:
    """The largest of: forward (the root, a block and the next), a block's reduction in backward
    (the root, the head's waiting gradients, the block and the one before it, its reduction), and
    the root's own reduction at the end. Without `reshard` (reshard_after_forward = false) every
    block stays gathered from its forward to its reduction."""
    root = merged(units.embedding, units.head)
    held = full(root, sizes, c)
    waiting = sum(n for _, n in (root if tied else units.head)) * c  # a tied head's gradient is the embedding's
    if reshard:  # the block in use and the one prefetched (the next in forward, the one before in backward)
        pairs = [full(a, sizes, c) + full(b, sizes, c) for a, b in units.with_next]
        reductions = [full(a, sizes, c) + full(b, sizes, c) + reduction(b, sizes, c, r) for a, b in units.with_before]
    else:  # every block gathered until its reduction, which runs from the last block back
        blocks = [full(b, sizes, c) for b in units.blocks]
        pairs = [sum(blocks)]
        reductions = [sum(blocks[: i + 1]) + reduction(b, sizes, c, r) for i, b in enumerate(units.blocks)]
    forward = held + max(pairs, default=0.0)
    backward = held + waiting + max(reductions, default=0.0)
    return max(forward, backward, held + reduction(root, sizes, c, r))


def pipelined_zero3(units: Units, sizes: dict, c: int, r: int) -> float:
    """A stage: two consecutive units gathered, or one unit's copy on the wire and its shard."""
    pairs = [full(a, sizes, c) + full(b, sizes, c) for a, b in units.stage_pairs]
    return max(pairs + [reduction(u, sizes, 0, r) for u in units.stage_units], default=0.0)
