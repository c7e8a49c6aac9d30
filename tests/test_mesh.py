"""Layout validation (before any process exists) and the Mesh's named groups on real ranks."""

import dataclasses

import pytest

from fivecut.checks import LayoutError, validate_layout
from fivecut.launch import spawn
from fivecut.layout import ParallelDims
from fivecut.model.args import divisors
from fivecut.model.presets import get_preset

TINY = get_preset("tiny")  # 4 layers, 4 heads, 2 kv heads, dense
TINY_MOE = get_preset("tiny-moe")  # 8 experts


def refusal(dims: ParallelDims, model=TINY, seq_len=128, global_batch=8, accumulate=1, world_size=None) -> str:
    with pytest.raises(LayoutError) as info:
        validate_layout(dims, model, seq_len, global_batch, accumulate, world_size)
    return str(info.value)


def problems(dims: ParallelDims, **kw) -> str:
    """The refusal of a layout that cannot work."""
    msg = refusal(dims, **kw)
    assert msg.startswith("invalid layout"), msg
    return msg


# ---------------------------------------------------------------- refusals


def test_tp_not_dividing_heads():
    msg = problems(ParallelDims(tp=3))
    assert "n_heads=4" in msg and "tp=3" in msg
    assert "choose tp from [1, 2, 4]" in msg
    assert "n_kv_heads=2" in msg  # 2 kv heads can neither be split nor replicated over 3


def test_kv_heads_replicated_when_tp_exceeds_them():
    # tp=4 > n_kv_heads=2 but divisible: kv heads are replicated, so the layout is accepted
    validate_layout(ParallelDims(tp=4), TINY, 128, 8, 1, 4)


def test_product_differs_from_world_size():
    msg = problems(ParallelDims(dp=2, tp=2), world_size=8)
    assert "pp*dp*cp*tp = 1*2*1*2 = 4" in msg and "8 processes" in msg
    assert "parallel.dp=4" in msg  # the fix that makes the product 8


def test_product_differs_from_world_size_dp_only():
    msg = problems(ParallelDims(dp=2), world_size=3)
    assert "= 2 but 3 processes" in msg and "parallel.dp=3" in msg


def test_global_batch_indivisible():
    msg = problems(ParallelDims(dp=4), global_batch=10, world_size=4)
    assert "global_batch=10" in msg and "dp*accumulate*microbatches=4" in msg
    assert "train.global_batch=8" in msg


def test_global_batch_counts_accumulation():
    msg = problems(ParallelDims(dp=2), global_batch=8, accumulate=3, world_size=2)
    assert "global_batch=8" in msg and "=6" in msg and "train.global_batch=6" in msg


def test_global_batch_counts_microbatches_only_with_pp():
    msg = problems(ParallelDims(pp=2, microbatches=4), global_batch=6, world_size=2)
    assert "dp*accumulate*microbatches=4" in msg
    # without pp the microbatch count does not divide the batch: dp=2 with 6 sequences is fine
    validate_layout(ParallelDims(dp=2, microbatches=4), TINY, 128, 6, 1, 2)


def test_ep_without_experts():
    msg = problems(ParallelDims(dp=2, ep=2), world_size=2)
    assert "ep=2" in msg and "n_experts=0" in msg and "mixture-of-experts" in msg


def test_ep_not_dividing_dp_cp():
    msg = problems(ParallelDims(dp=2, ep=4), model=TINY_MOE, world_size=2)
    assert "ep=4 must divide dp*cp=2" in msg
    assert "n_experts" not in msg  # 8 experts do divide by 4


def test_ep_not_dividing_experts():
    msg = problems(ParallelDims(dp=3, ep=3), model=TINY_MOE, global_batch=9, world_size=3)
    assert "n_experts=8 not divisible by ep=3" in msg and "[1, 2, 4, 8]" in msg


def test_seq_len_not_divisible_by_2cp():
    msg = problems(ParallelDims(cp=2), seq_len=130, world_size=2)
    assert "seq_len=130" in msg and "2*cp=4" in msg


def test_fewer_layers_than_stages():
    msg = problems(ParallelDims(pp=8, microbatches=8), world_size=8)
    assert "4 layers cannot fill 8 pipeline stages; lower pp" in msg and msg.count("pipeline stages") == 1  # said once


def test_dualpipev_counts_two_stages_per_rank():
    msg = problems(
        ParallelDims(pp=2, pp_schedule="dualpipev", microbatches=4), model=dataclasses.replace(TINY, n_layers=3)
    )
    assert "3 layers cannot fill 4 pipeline stages" in msg and msg.count("pipeline stages") == 1
    validate_layout(
        ParallelDims(pp=2, pp_schedule="dualpipev", microbatches=4), TINY, 128, 8, 1, 2
    )  # 4 layers fill 4 stages


def test_microbatches_fewer_than_stages():
    msg = problems(ParallelDims(pp=2, microbatches=1), world_size=2)
    assert "1f1b with pp=2 needs microbatches >= pp; got 1" in msg
    # gpipe has no such rule
    validate_layout(ParallelDims(pp=2, microbatches=1, pp_schedule="gpipe"), TINY, 128, 8, 1, 2)


@pytest.mark.parametrize("microbatches", [1, 3])
def test_dualpipev_needs_twice_the_stages_in_microbatches_said_once(microbatches):
    msg = problems(ParallelDims(pp=2, pp_schedule="dualpipev", microbatches=microbatches))
    assert f"dualpipev with pp=2 needs microbatches >= 2*pp (the V fills with 2*pp); got {microbatches}" in msg
    assert msg.count("needs microbatches") == 1 and "the V needs" not in msg  # the rule, not the build, says it


def test_virtual_stages_need_an_interleaved_schedule():
    msg = problems(ParallelDims(pp=2, microbatches=2, pp_virtual=2))
    assert "pp_virtual=2" in msg and "1f1b" in msg


def test_sp_without_tp():
    msg = problems(ParallelDims(sp=True))
    assert "parallel.sp=true" in msg and "parallel.tp >= 2" in msg


def test_sp_needs_seq_len_divisible_by_tp():
    msg = problems(ParallelDims(tp=4, sp=True), seq_len=130)
    assert "seq_len=130" in msg and "tp=4" in msg


def test_zero_without_dp():
    msg = problems(ParallelDims(zero=2))
    assert "parallel.zero=2" in msg and "dp=1" in msg and "parallel.dp >= 2" in msg


def test_zero_stage_out_of_range():
    msg = problems(ParallelDims(dp=2, zero=4), world_size=2)
    assert "parallel.zero=4" in msg and "0, 1, 2, 3" in msg


def test_unknown_pp_schedule():
    msg = problems(ParallelDims(pp_schedule="gpipe2"))
    assert "'gpipe2'" in msg and "1f1b" in msg and "dualpipev" in msg


def test_unknown_cp_mode():
    msg = problems(ParallelDims(cp_mode="rings"))
    assert "'rings'" in msg and "ring" in msg and "ulysses" in msg


def test_negative_dim_is_refused():
    msg = problems(ParallelDims(tp=-1, pp=-2))
    assert "parallel.tp=-1 must be >= 1" in msg and "parallel.pp=-2 must be >= 1" in msg


def test_all_problems_listed_at_once():
    msg = problems(ParallelDims(dp=2, sp=True, cp_mode="x"), global_batch=7, world_size=3)
    lines = [line for line in msg.splitlines() if line.startswith("  - ")]
    assert len(lines) == 4, msg  # sp without tp, cp_mode, global batch, world size


# ---------------------------------------------------------------- implemented or not


def test_data_parallel_passes():
    validate_layout(ParallelDims(dp=4), TINY, 128, 8, 1, 4)
    validate_layout(ParallelDims(dp=2), TINY, 128, 8, 2, 2)
    validate_layout(ParallelDims(), TINY, 128, 8, 1, 1)
    validate_layout(ParallelDims(), TINY, 128, 8, 1)  # world size not known yet


def test_context_parallel_modes_are_accepted():
    validate_layout(ParallelDims(cp=2), TINY, 128, 8, 1, 2)  # ring
    validate_layout(ParallelDims(cp=8), TINY, 128, 8, 1, 8)  # ring does not cut heads
    validate_layout(ParallelDims(cp=2, cp_mode="ulysses"), TINY, 128, 8, 1, 2)


def test_ulysses_needs_heads_divisible_by_cp():
    msg = problems(ParallelDims(cp=8, cp_mode="ulysses"), world_size=8)  # tiny: 4 heads
    assert "cp=8" in msg and "[1, 2, 4]" in msg


def test_expert_parallel_is_accepted_with_every_zero_stage():
    for zero in (0, 1, 2, 3):
        validate_layout(ParallelDims(dp=2, ep=2, zero=zero), TINY_MOE, 64, 8, 1, world_size=2)


def test_an_invalid_layout_is_reported_as_invalid():
    msg = refusal(ParallelDims(tp=3))
    assert msg.startswith("invalid layout") and "tp=3" in msg


# ---------------------------------------------------------------- small helpers


def test_describe():
    assert ParallelDims().describe() == "single"
    assert ParallelDims(dp=4).describe() == "dp=4"
    assert ParallelDims(pp=2, dp=2, cp=2, tp=2, ep=2).describe() == "pp=2,dp=2,cp=2,tp=2,ep=2"
    assert ParallelDims(dp=2, zero=3, tp=2, sp=True).describe() == "dp=2,tp=2,zero=3,sp=true"


def test_shape_and_world_size():
    dims = ParallelDims(pp=2, dp=3, cp=5, tp=7)
    assert dims.shape == (2, 3, 5, 7) and dims.world_size == 210


def test_divisors():
    assert divisors(1) == [1] and divisors(12) == [1, 2, 3, 4, 6, 12] and divisors(7) == [1, 7]


# ---------------------------------------------------------------- the Mesh on real ranks


def mesh_layouts():
    """On each of 4 ranks, build three meshes and report every group as this rank sees it."""
    import torch
    import torch.distributed as dist

    from fivecut.ledger import Ledger
    from fivecut.mesh import Mesh

    out = {"rank": dist.get_rank()}
    for label, dims in (("dp2tp2", ParallelDims(dp=2, tp=2)), ("pp2dp2", ParallelDims(pp=2, dp=2))):
        ledger = Ledger()
        mesh = Mesh(dims, "cpu", ledger)
        groups = {}
        for name, g in mesh.groups.items():
            groups[name] = {
                "cut": g.cut,
                "ranks": g.ranks,
                "size": g.size,
                "rank": g.rank,
                "global": [g.global_rank(i) for i in range(g.size)],
                "has_pg": g.pg is not None,
                "same_ledger": g.ledger is ledger,
            }
        # the groups really communicate among the ranks they name
        sums = {}
        for name in ("pp", "dp", "tp", "dp_cp"):
            g = mesh.group(name)
            if g.pg is not None:
                t = torch.tensor([float(dist.get_rank())])
                dist.all_reduce(t, group=g.pg)
                sums[name] = t.item()
        out[label] = {
            "coords": dict(mesh.coords),
            "coordinate_tp": mesh.coordinate("tp"),
            "groups": groups,
            "sums": sums,
            "mesh_ledger": mesh.ledger is ledger,
        }
    # dp=2, cp=2: dp_cp is the whole world, a group over two mesh dims
    mesh = Mesh(ParallelDims(dp=2, cp=2), "cpu")
    g = mesh.group("dp_cp")
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t, group=g.pg)
    out["dp2cp2"] = (mesh.group("cp").ranks, mesh.group("dp").ranks, g.ranks, g.rank, t.item())
    return out


@pytest.mark.multirank
def test_mesh_groups_on_four_ranks():
    results = spawn(mesh_layouts, 4, timeout_s=120)
    assert [r["rank"] for r in results] == [0, 1, 2, 3]

    # ---- dp=2, tp=2: tp innermost, so tp groups are neighbours
    tp_groups = {0: (0, 1), 1: (0, 1), 2: (2, 3), 3: (2, 3)}
    dp_groups = {0: (0, 2), 1: (1, 3), 2: (0, 2), 3: (1, 3)}
    for rank, res in enumerate(results):
        m = res["dp2tp2"]
        g = m["groups"]
        assert m["coords"] == {"pp": 0, "dp": rank // 2, "cp": 0, "tp": rank % 2}
        assert m["coordinate_tp"] == rank % 2
        assert g["tp"]["ranks"] == tp_groups[rank] and g["tp"]["rank"] == rank % 2
        assert g["dp"]["ranks"] == dp_groups[rank] and g["dp"]["rank"] == rank // 2
        assert g["dp_cp"]["ranks"] == dp_groups[rank] and g["dp_cp"]["rank"] == rank // 2
        assert g["dp_cp"]["cut"] == "dp"  # gradient reduction is accounted to the dp cut
        assert g["tp"]["global"] == list(tp_groups[rank])
        for name in ("pp", "cp"):
            assert g[name]["ranks"] == (rank,) and g[name]["size"] == 1 and g[name]["rank"] == 0
            assert not g[name]["has_pg"]
        for name in ("dp", "tp", "dp_cp"):
            assert g[name]["size"] == 2 and g[name]["has_pg"] and g[name]["cut"] == name.split("_")[0]
        assert all(x["same_ledger"] for x in g.values()) and m["mesh_ledger"]
        assert m["sums"] == {
            "tp": float(sum(tp_groups[rank])),
            "dp": float(sum(dp_groups[rank])),
            "dp_cp": float(sum(dp_groups[rank])),
        }

    # ---- pp=2, dp=2: pp outermost, so a pipeline group spans the two halves
    pp_groups = {0: (0, 2), 1: (1, 3), 2: (0, 2), 3: (1, 3)}
    dp_groups = {0: (0, 1), 1: (0, 1), 2: (2, 3), 3: (2, 3)}
    for rank, res in enumerate(results):
        m = res["pp2dp2"]
        g = m["groups"]
        assert m["coords"] == {"pp": rank // 2, "dp": rank % 2, "cp": 0, "tp": 0}
        assert g["pp"]["ranks"] == pp_groups[rank] and g["pp"]["rank"] == rank // 2
        assert g["pp"]["global"] == list(pp_groups[rank])
        assert g["dp"]["ranks"] == dp_groups[rank] and g["dp"]["rank"] == rank % 2
        assert g["dp_cp"]["ranks"] == dp_groups[rank]
        assert g["tp"]["size"] == 1 and g["cp"]["size"] == 1
        assert m["sums"] == {
            "pp": float(sum(pp_groups[rank])),
            "dp": float(sum(dp_groups[rank])),
            "dp_cp": float(sum(dp_groups[rank])),
        }

    # ---- dp=2, cp=2: cp inside dp, dp_cp is all four ranks
    for rank, res in enumerate(results):
        cp, dp, dp_cp, dp_cp_rank, total = res["dp2cp2"]
        assert cp == ((0, 1) if rank < 2 else (2, 3))
        assert dp == ((0, 2) if rank % 2 == 0 else (1, 3))
        assert dp_cp == (0, 1, 2, 3) and dp_cp_rank == rank
        assert total == 10.0


# ---------------------------------------------------------------- regressions


@pytest.mark.parametrize("dims,accumulate", [(ParallelDims(tp=0), 1), (ParallelDims(dp=0), 1), (ParallelDims(), 0)])
def test_zero_sizes_are_refused_not_divided_by(dims, accumulate):
    with pytest.raises(LayoutError, match="must be >= 1"):
        validate_layout(dims, TINY, 128, 8, accumulate)


def test_world_size_fix_is_only_offered_when_it_exists():
    assert "parallel.dp=2" in problems(ParallelDims(tp=2), world_size=4)
    msg = problems(ParallelDims(tp=4), world_size=2)
    assert "pp*cp*tp = 4 must divide 2" in msg and "parallel.dp=" not in msg
