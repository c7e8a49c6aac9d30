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
from fivecut.plan.volume import layout_key, plain_dims, reduce_group_sizes, screened_placements, shard_group_sizes


def buffer_bytes(args, cfg, pp_rank: int = 0, records=None) -> float:
    """The most bytes the data cut of the rank at pipeline position `pp_rank` holds in buffers;
    once per model, layout (any microbatch count), the train fields it reads and position."""
    dims, t = cfg.parallel, cfg.train
    every = tuple(v for k, v in zip(vars(dims), layout_key(dims)) if k != "microbatches")
    key = (id(records), args, every, t.seq_len, t.dtype, t.reduce_dtype, t.bucket_mb, repr(cfg.moe), pp_rank)
    if key not in BUFFERS:
        BUFFERS[key] = data_cut_buffers(args, cfg, counted(args, cfg, pp_rank, records))
    return BUFFERS[key]


BUFFERS: dict[tuple, float] = {}


def data_cut_buffers(args, cfg, units: Units) -> float:
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


Parts = tuple[tuple[str, int], ...]  # a unit's local parameters by reduce group


@dataclass(frozen=True)
class Units:
    """What the buffers' closed forms read of a rank's parameters: each reduce group's count and
    largest parameter, ZeRO-3's units in the order they run (`unit_sizes`) and, as sets, the
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
    cut and microbatches (they change no parameter a rank holds), and position."""
    plain = plain_dims(cfg.parallel)
    key = (id(records), args, layout_key(plain), cfg.train.seq_len, repr(cfg.moe), pp_rank)
    if key not in COUNTED:
        placements = (records or screened_placements)(args, replace(cfg, parallel=plain), pp_rank)
        psi: dict[str, int] = {}
        largest: dict[str, int] = {}
        for pl in placements.values():
            psi[pl.reduce] = psi.get(pl.reduce, 0) + pl.local_numel()
            largest[pl.reduce] = max(largest.get(pl.reduce, 0), pl.local_numel())
        COUNTED[key] = units_of(unit_sizes(placements), psi, largest)
    return COUNTED[key]


COUNTED: dict[tuple, Units] = {}


def units_of(sizes: dict[str, dict[str, int]], psi: dict, largest: dict) -> Units:
    frozen = {name: tuple(sorted(parts.items())) for name, parts in sizes.items()}
    embedding, head = frozen.pop("embedding"), frozen.pop("head")
    blocks = tuple(frozen.values())
    order = [u for u in (embedding, *blocks, head) if u]
    return Units(
        psi,
        largest,
        embedding,
        head,
        blocks,
        frozenset(zip(blocks, blocks[1:] + ((),))),
        frozenset(zip(((),) + blocks[:-1], blocks)),
        frozenset(zip(order, order[1:] + [()])),
        frozenset(order),
    )


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


def unit_sizes(placements: dict) -> dict[str, dict[str, int]]:
    """ZeRO-3's units as {unit: {reduce group: local parameters}}: the blocks in the order they run,
    and the ends (`embedding`; `head`, the final norm and the output) as one root unit outside a
    pipeline (`fivecut.parallel.zero.transformer_units`) or as units of their own in a stage."""
    units: dict[str, dict[str, int]] = {"embedding": {}, "head": {}}
    for pl in placements.values():
        name = unit_of(pl.name)
        units.setdefault(name, {})
        units[name][pl.reduce] = units[name].get(pl.reduce, 0) + pl.local_numel()
    return units


def unit_of(name: str) -> str:
    if name.startswith("layers."):
        return ".".join(name.split(".")[:2])
    return "embedding" if name.startswith("tok_embeddings") else "head"


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
