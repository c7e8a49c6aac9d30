"""Placement records: every parameter's slices, assembled from all ranks by their records, cover
the single-device tensor exactly -- each element held by the expected number of ranks, with the
single-device value -- for the layouts of the parity tests, and the records the real ranks build
equal those of the planner's virtual mesh.

Exact comparisons: every layout initializes from the same seed, element by element.
"""

from __future__ import annotations

import pytest
import torch

from fivecut.launch import spawn
from fivecut.layout import ParallelDims
from fivecut.mesh import Mesh
from fivecut.model.presets import get_preset
from fivecut.model.transformer import build_model
from fivecut.parallel.parallelize import ParallelizeOptions, parallelize
from fivecut.parallel.placement import ParamKind


def dims_of(layout: str) -> ParallelDims:
    kwargs = dict(item.split("=") for item in layout.split(","))
    typed = {
        k: (v == "true") if k == "sp" else (v if k in ("pp_schedule", "cp_mode") else int(v)) for k, v in kwargs.items()
    }
    return ParallelDims(**typed)


# (preset, layout): the layouts of test_ddp, test_zero, test_tensor, test_context, test_pipeline, test_expert
LAYOUTS = [
    ("tiny", "dp=2"),
    ("tiny", "dp=4"),
    ("tiny", "dp=2,zero=1"),
    ("tiny", "dp=4,zero=2"),
    ("tiny", "dp=4,zero=3"),
    ("tiny", "tp=2"),
    ("tiny", "tp=4,sp=true"),
    ("tiny-gpt2", "tp=4"),  # vocabulary padding; tied embeddings
    ("tiny-gpt2", "tp=2,sp=true,dp=2,zero=3"),
    ("tiny", "cp=2,cp_mode=ring,tp=2,sp=true"),
    ("tiny", "cp=2,cp_mode=ulysses,dp=2,zero=1"),
    ("tiny", "pp=2,microbatches=2"),
    ("tiny", "pp=2,microbatches=4,pp_schedule=interleaved,pp_virtual=2"),
    ("tiny", "pp=2,microbatches=4,pp_schedule=dualpipev,tp=2"),
    ("tiny-gpt2", "pp=2,microbatches=2,pp_schedule=zb1p,dp=2,zero=1"),  # tied across the pipeline ends
    ("tiny-moe", "dp=2,ep=2"),
    ("tiny-moe", "dp=4,ep=2,zero=3"),
    ("tiny-moe", "dp=2,tp=2,sp=true,ep=2"),
    ("tiny-moe", "dp=2,ep=2,pp=2,microbatches=2"),
]


def rank_view(preset: str, dims: ParallelDims, rank: int) -> dict:
    """What rank `rank` holds of each logical parameter: {name: (global flat indices, values)}."""
    args = get_preset(preset)
    mesh = Mesh.virtual(dims, rank, moe=args.is_moe)
    par = parallelize(build_model(args, device="meta"), mesh, ParallelizeOptions(bucket_mb=0.05, global_batch=8))
    out = {}
    for name, pl in par.placements.items():
        index = pl.global_index().flatten()
        if dims.zero == 3:  # only the owned part of the flat shard is kept between steps
            lo, hi = pl.flat.owned()
            held = par.sync.held(par.params[name], lo, hi).values if hi > lo else []
            values, index = torch.cat([v for v, _ in held]) if held else torch.zeros(0), index[lo:hi]
        else:
            values = par.params[name].detach().flatten()
        keep = index >= 0
        out[name] = (index[keep], values[keep])
    return out, par.placements


def expected_holders(pl, dims: ParallelDims) -> int:
    """Ranks that hold each element: the ranks of its pipeline position(s), less each cut."""
    holders = dims.world_size // dims.pp * (2 if pl.ends else 1)
    for s in pl.slices:
        holders //= dims.tp if s.group == "tp" else dims.ep
    if dims.zero == 3:
        shard_ranks = {"dp_cp": dims.dp * dims.cp, "expert_dp": dims.dp * dims.cp // dims.ep * dims.tp}
        holders //= shard_ranks.get(pl.reduce, dims.dp * dims.cp * dims.tp)
    return holders


@pytest.mark.parametrize("preset,layout", LAYOUTS)
def test_slices_cover_the_single_device_tensors(preset, layout):
    dims = dims_of(layout)
    full = build_model(get_preset(preset), seed=0).state_dict()
    counts = {name: torch.zeros(t.numel(), dtype=torch.long) for name, t in full.items()}
    records = {}
    for rank in range(dims.world_size):
        view, placements = rank_view(preset, dims, rank)
        records.update(placements)
        for name, (index, values) in view.items():
            counts[name].index_add_(0, index, torch.ones_like(index))
            assert torch.equal(values, full[name].flatten()[index]), f"rank {rank} {name}"
    tied = {alias for pl in records.values() for alias in pl.aliases}
    assert records.keys() == full.keys() - tied  # every logical tensor has one record (a tied head: an alias)
    for name, count in counts.items():
        if name in tied:
            continue
        want = expected_holders(records[name], dims)
        assert want >= 1 and torch.all(count == want), (
            f"{layout} {name}: held {count.unique().tolist()} times, want {want}"
        )


def real_placements(preset: str, layout: str):
    args = get_preset(preset)
    mesh = Mesh(dims_of(layout), "cpu", moe=args.is_moe)
    return parallelize(
        build_model(args, device="meta"), mesh, ParallelizeOptions(bucket_mb=0.05, global_batch=8)
    ).placements


@pytest.mark.multirank
@pytest.mark.parametrize("preset,layout", [("tiny-gpt2", "pp=2,microbatches=2,tp=2"), ("tiny-moe", "dp=2,ep=2,zero=3")])
def test_real_ranks_build_the_virtual_meshs_records(preset, layout):
    dims = dims_of(layout)
    for rank, placements in enumerate(spawn(real_placements, dims.world_size, preset, layout)):
        assert placements == rank_view(preset, dims, rank)[1]


def test_records_name_the_cuts():
    dims = dims_of("dp=2,tp=2,ep=2,zero=1")
    _, placements = rank_view("tiny-moe", dims, 3)  # dp 1, tp 1
    wq = placements["layers.0.attention.wq.weight"]
    assert wq.slice_over("tp").start == wq.local_shape()[0]
    # what the data cut reads: a TP shard, summed over dp_cp, one copy among the clip norm's ranks
    assert wq.kind(2, 2, 1) == ParamKind(decays=True, reduce="dp_cp", sliced=True, norm_weight=1.0)
    expert = placements["layers.1.feed_forward.experts.w1"]
    assert expert.slice_over("ep").experts == (4, 5, 6, 7) and expert.reduce == "expert_dp"
    assert placements["layers.1.feed_forward.router.weight"].reduce == "dp_cp_tp"
    # replicated over tp: summed over dp_cp only, and each of its 2 copies counts half in the norm
    assert placements["norm.weight"].kind(2, 2, 1) == ParamKind(decays=False, reduce="dp_cp", norm_weight=0.5)
    assert placements["tok_embeddings.weight"].flat is not None  # ZeRO-1: its place in a flat shard
