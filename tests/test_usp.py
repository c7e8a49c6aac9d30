"""USP (cp_mode="usp"): Ulysses over groups of U consecutive cp ranks around the fused ring
across the R = cp/U groups. Parity against one process from the same seed, fp32:
  - the token order: after Ulysses' all-to-all a group holds exactly its ring position's
    zigzag pair, in the ring's order; the mesh's cp_ulysses and cp_ring groups (no processes);
  - one forward + backward at cp=4, U=2 (x tp=2, sweep): logits put back in sequence order and
    every gradient equal the single-device model's (LOGIT_TOL, GRAD_TOL of test_context);
  - `fivecut verify` over 5 steps (losses rtol 1e-5, first gradient norm 1e-5) at cp=4, U=2;
    sweep: with dp=2 (8 processes), tp=2 with SP, selective and full recomputation;
  - sweep: `fivecut ledger` ratio=1.000 and activation_ratio=1.000 (plain, recomputed, tp=2);
    `full_logits` (padding to USP's multiple, logits back in position order);
  - refusals before any process starts (exit 2), each problem once.
"""

from __future__ import annotations

import pytest
import torch
from test_bad_input import layout_argv, refused
from test_context import GRAD_TOL, LENGTHS, LOGIT_TOL, batch, reference, whole_logits_under
from test_ddp import small_config
from test_e2e import assert_activations_exact, assert_every_cut_exact, assert_memory_exact

from fivecut import comm
from fivecut.cli import main
from fivecut.launch import spawn
from fivecut.layout import ParallelDims
from fivecut.mesh import Mesh
from fivecut.model.presets import get_preset
from fivecut.model.transformer import build_model
from fivecut.parallel.context import chunk_positions, sequence_chunk, zigzag_positions
from fivecut.parallel.parallelize import parallelize
from fivecut.parallel.placement import gather_full


@pytest.mark.parametrize("cp,u,seq", [(4, 2, 32), (8, 2, 64), (8, 4, 64), (6, 3, 36), (4, 1, 32), (4, 4, 32)])
def test_ulysses_groups_gather_their_ring_positions_zigzag_pair(cp, u, seq):
    """Rank c = g*U + u holds piece u of ring position g's pair; the U pieces of group g, one
    after the other (as Ulysses' all-to-all lays them), are chunks g and 2R-1-g; every position once."""
    ring = cp // u
    held = [chunk_positions(rank, cp, seq, u) for rank in range(cp)]
    for g in range(ring):
        gathered = torch.cat(held[g * u : (g + 1) * u])
        expected = zigzag_positions(g, ring, seq // ring) if ring > 1 else torch.arange(seq)
        assert torch.equal(gathered, expected), (cp, u, g)
    assert torch.equal(torch.cat(held).sort().values, torch.arange(seq))


def test_usp_groups_are_consecutive_ulysses_ranks_and_rings_across_them():
    # grid [pp, dp, cp, tp] = [1, 2, 4, 2]: global rank = 8 dp + 2 cp + tp; rank 11 is dp=1, cp=1, tp=1
    mesh = Mesh.virtual(ParallelDims(dp=2, cp=4, tp=2, cp_mode="usp", cp_ulysses=2), rank=11)
    assert mesh.group("cp").ranks == (9, 11, 13, 15)
    assert mesh.group("cp_ulysses").ranks == (9, 11) and mesh.group("cp_ulysses").rank == 1  # u = 1
    assert mesh.group("cp_ring").ranks == (11, 15) and mesh.group("cp_ring").rank == 0  # ring position g = 0
    assert {mesh.group(n).cut for n in ("cp_ulysses", "cp_ring")} == {"cp"}  # the ledger counts them as cp
    assert "cp_ring" not in Mesh.virtual(ParallelDims(dp=2, cp=4, tp=2, cp_mode="ring"), rank=11).groups


def usp_step(cp: int, u: int, tp: int):
    """One forward + backward under cp (x tp) ranks, USP of degree u: logits [b, s, V], full gradients."""
    dims = ParallelDims(cp=cp, cp_mode="usp", cp_ulysses=u, tp=tp, sp=tp > 1)
    mesh = Mesh(dims, "cpu")
    par = parallelize(build_model(get_preset("tiny"), seed=0), mesh)
    inputs, targets = batch()
    total = targets.numel()
    inputs, targets, positions = sequence_chunk(inputs, targets, mesh.group("cp"), "usp", u)
    with par.saved.forward():
        logits = par.module(inputs, positions)  # [b, s/cp, V/tp]
    (par.loss_sum(logits, targets) / total).backward()
    logits = comm.all_gather(logits.detach(), mesh.group("cp"), dim=1)  # [b, s, V/tp] in the ranks' order
    logits = logits[:, torch.argsort(comm.all_gather(positions, mesh.group("cp")))]  # in sequence order
    grads = {name: gather_full(pl, par.params[name].grad, mesh.groups).clone() for name, pl in par.placements.items()}
    if tp > 1:
        logits = comm.all_gather(logits, mesh.group("tp"), dim=-1)
    sizes = (mesh.group("cp_ulysses").size, mesh.group("cp_ring").size)
    return logits, grads, sizes


@pytest.mark.multirank
@pytest.mark.parametrize("cp,u,tp", [(4, 2, 1), pytest.param(4, 2, 2, marks=pytest.mark.sweep)])
def test_usp_forward_and_gradients_match_single_device(cp, u, tp):
    # tiny: 4 heads, 2 kv heads. U=2: 2 heads and 1 kv head per Ulysses rank, a GQA ring of R=2;
    # with tp=2 (and SP): 1 head per rank, the single kv head repeated before the all-to-all
    ref_logits, ref_grads = reference()
    for logits, grads, sizes in spawn(usp_step, cp * tp, cp, u, tp):
        assert sizes == (u, cp // u)
        torch.testing.assert_close(logits, ref_logits, **LOGIT_TOL)
        assert grads.keys() == ref_grads.keys()
        for name, g in grads.items():
            torch.testing.assert_close(g, ref_grads[name], **GRAD_TOL, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.multirank
@pytest.mark.sweep
def test_full_logits_under_usp_equal_one_process(byte_cache, tmp_path):
    """`full_logits` pads to USP's multiple (lcm(2R, cp) = 4 at cp=4, U=2: 13 -> 16), runs each
    rank's piece and puts the logits back in position order: the single-device model's."""
    tokens = [torch.randint(0, 256, (2, s), generator=torch.Generator().manual_seed(s)) for s in LENGTHS]
    layout = ("parallel.cp=4", 'parallel.cp_mode="usp"', "parallel.cp_ulysses=2", f'log.out_dir="{tmp_path}"')
    cfg = small_config(byte_cache, *layout)
    model = build_model(get_preset("tiny"), seed=cfg.train.seed)
    with torch.no_grad():
        expected = [model(t) for t in tokens]  # [b, s, V]
    for rank, (logits,) in enumerate(spawn(whole_logits_under, 4, [cfg], tokens)):
        for got, want in zip(logits, expected):
            assert got.shape == want.shape, f"rank {rank}"
            torch.testing.assert_close(got, want, **LOGIT_TOL, msg=lambda m, r=rank: f"rank {r}: {m}")


def verify(capsys, byte_cache, layout: str, *sets: str) -> str:
    argv = ["verify", "--model", "tiny", "--layout", layout, "--steps", "5", "--set", f'data.cache_dir="{byte_cache}"']
    for s in sets:
        argv += ["--set", s]
    code = main(argv)
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert code == 0 and last.startswith("PASS"), last
    return last


@pytest.mark.multirank
@pytest.mark.parametrize(
    "layout,sets",
    [
        ("cp=4,cp_mode=usp,cp_ulysses=2", ()),
        pytest.param("cp=4,cp_mode=usp,cp_ulysses=2", ('train.recompute="selective"',), marks=pytest.mark.sweep),
        pytest.param("dp=2,cp=4,cp_mode=usp,cp_ulysses=2", (), marks=pytest.mark.sweep),
        pytest.param("cp=4,cp_mode=usp,cp_ulysses=2,tp=2,sp=true", (), marks=pytest.mark.sweep),
        pytest.param("cp=4,cp_mode=usp,cp_ulysses=2", ('train.recompute="full"',), marks=pytest.mark.sweep),
    ],
)
def test_verify_usp_passes(capsys, byte_cache, layout, sets):
    print(layout, *sets, verify(capsys, byte_cache, layout, *sets))


@pytest.mark.multirank
@pytest.mark.sweep
@pytest.mark.parametrize(
    "layout,sets",
    [
        ("cp=4,cp_mode=usp,cp_ulysses=2", ()),
        ("cp=4,cp_mode=usp,cp_ulysses=2", ('train.recompute="selective"',)),
        ("cp=4,cp_mode=usp,cp_ulysses=2", ('train.recompute="full"',)),
        ("cp=4,cp_mode=usp,cp_ulysses=2,tp=2,sp=true", ()),
    ],
)
def test_ledger_counts_usp_exactly(capsys, byte_cache, layout, sets):
    """Both parts of USP's communication (all-to-alls over U, ring passes over R) and its saved
    activations equal the closed forms (`fivecut ledger`: ratio=1.000, activation_ratio=1.000)."""
    argv = ["ledger", "--model", "tiny", "--layout", layout, "--set", f'data.cache_dir="{byte_cache}"']
    for s in sets:
        argv += ["--set", s]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert_every_cut_exact(out)
    lines = out.strip().splitlines()
    assert_activations_exact(out)
    assert_memory_exact(out)
    assert any(line.startswith("cp ") and "(usp)" in line for line in lines)


@pytest.mark.multirank
def test_a_window_under_the_ring_keeps_no_band(capsys, byte_cache):
    """A sliding window of 8 over 32 tokens under cp=2 ring attention: each block pair masked by the band
    (`fivecut.parallel.context.PairMask`), rebuilt in backward, so the layer keeps no [s, s] band as the
    one-device core does (`fivecut ledger`: activation_ratio 1.000). Its parity: tests/test_hf_dense.py's
    Mistral under the ring."""
    window = "model.sliding_window=8"
    argv = ["ledger", "--model", "tiny", "--layout", "cp=2,cp_mode=ring", "--set", f'data.cache_dir="{byte_cache}"']
    assert main([*argv, "--set", window]) == 0
    out = capsys.readouterr().out
    assert_activations_exact(out)
    assert_memory_exact(out)


USP_REFUSED = [
    ("cp=4,cp_mode=usp,cp_ulysses=3", "parallel.cp_ulysses=3 must divide cp=4"),
    ("cp=4,cp_ulysses=2", "cp_ulysses=2 is the Ulysses degree of cp_mode='usp'"),
    ("cp=4,cp_mode=usp,cp_ulysses=0", "parallel.cp_ulysses=0 must be >= 1"),
    ("cp=4,tp=2,cp_mode=usp,cp_ulysses=4", "USP cuts each tp rank's 2 query heads over cp_ulysses=4"),
    ("cp=4,cp_mode=usp,cp_ulysses=2 --set train.seq_len=34", "seq_len=34 must divide by 4 (under USP"),
    ("cp=4,cp_mode=usp --set train.seq_len=36", "seq_len=36 must divide by 8 (under USP"),  # U=1: the ring's 2cp
    (
        "cp=4,cp_mode=usp,cp_ulysses=2 --model tiny-moe --set moe.capacity_factor=1.0",
        "moe.capacity_factor with cp_mode='usp'",
    ),
]


@pytest.mark.parametrize("layout,message", USP_REFUSED)
def test_usp_refused_before_spawn(capsys, tmp_path, layout, message):
    layout, *sets = layout.split(" ")
    err = refused(capsys, layout_argv("verify", tmp_path, "--layout", layout, *sets))
    assert message in err and err.count("\n  - ") == 0, err  # one problem, one line
