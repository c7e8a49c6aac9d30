"""Context parallelism parity (Ulysses and ring): each cp rank runs its chunks of every
sequence; the logits (put back in sequence order) and every gradient equal the single-device
model's, and losses over optimizer steps equal the single-process run's.

Tolerances (fp32): Ulysses attention sees exactly the same q, k, v (the all-to-alls only move
them); ring attention sums its blocks' softmax with log-sum-exps instead of one softmax; the
gradients are summed over the cp ranks in a different order, so
  - logits: rtol 1e-5, atol 1e-6;
  - gradients of the mean token loss: rtol 1e-5, atol 1e-7;
  - losses and gradient norms over optimizer steps: LAYOUT_RTOL, 4x the drift measured (see there).
The fused ring is also tested on its own (q, k, v of unit scale, s = 64 and 128, cp = 2 and 4):
its outputs and gradients against one device's SDPA (RING_TOL), and the bytes it keeps for
backward: exactly q, k, v, the output and the log-sum-exp of a rank's s/cp tokens.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_ddp import assert_same_run, run_config, single_process_run, small_config

from fivecut import comm
from fivecut.launch import spawn
from fivecut.layout import ParallelDims
from fivecut.mesh import Mesh
from fivecut.model.presets import get_preset
from fivecut.model.transformer import build_model
from fivecut.parallel.context import RingAttention, sequence_chunk, zigzag_positions
from fivecut.parallel.parallelize import parallelize, token_loss_sum
from fivecut.parallel.placement import gather_full

LOGIT_TOL = {"rtol": 1e-5, "atol": 1e-6}
GRAD_TOL = {"rtol": 1e-5, "atol": 1e-7}


def batch():
    tokens = torch.randint(0, 256, (4, 33), generator=torch.Generator().manual_seed(1))
    return tokens[:, :-1], tokens[:, 1:]


def reference():
    model = build_model(get_preset("tiny"), seed=0)
    inputs, targets = batch()
    logits = model(inputs)
    (token_loss_sum(logits, targets) / targets.numel()).backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def context_parallel_step(mode: str, cp: int, tp: int, sp: bool):
    """One forward + backward under cp (x tp) ranks: logits gathered to [b, s, V], full gradients."""
    mesh = Mesh(ParallelDims(cp=cp, cp_mode=mode, tp=tp, sp=sp), "cpu")
    model = build_model(get_preset("tiny"), seed=0)
    par = parallelize(model, mesh)
    inputs, targets = batch()
    total = targets.numel()
    inputs, targets, positions = sequence_chunk(inputs, targets, mesh.group("cp"), mode)
    with par.saved.forward():
        logits = par.module(inputs, positions)  # [b, s/cp, V/tp]
    (par.loss_sum(logits, targets) / total).backward()  # gradients summed over cp by the data cut
    logits = comm.all_gather(logits.detach(), mesh.group("cp"), dim=1)  # in the ranks' chunk order
    order = comm.all_gather(positions, mesh.group("cp"))
    logits = logits[:, torch.argsort(order)]  # [b, s, V/tp] in sequence order
    grads = {name: gather_full(pl, par.params[name].grad, mesh.groups).clone() for name, pl in par.placements.items()}
    if tp > 1:
        logits = comm.all_gather(logits, mesh.group("tp"), dim=-1)
    return logits, grads


@pytest.mark.multirank
@pytest.mark.parametrize(
    "mode,cp,tp,sp",
    [
        ("ulysses", 2, 1, False),
        ("ulysses", 4, 1, False),
        ("ulysses", 2, 2, True),
        ("ring", 2, 1, False),
        ("ring", 4, 1, False),
        ("ring", 2, 2, True),
    ],
)
def test_forward_and_gradients_match_single_device(mode, cp, tp, sp):
    # tiny: 4 heads, 2 kv heads; Ulysses at cp=4 repeats the kv heads, cp=2 x tp=2 leaves one head per rank
    ref_logits, ref_grads = reference()
    for logits, grads in spawn(context_parallel_step, cp * tp, mode, cp, tp, sp):
        torch.testing.assert_close(logits, ref_logits, **LOGIT_TOL)
        assert grads.keys() == ref_grads.keys()
        for name, g in grads.items():
            torch.testing.assert_close(g, ref_grads[name], **GRAD_TOL, msg=lambda m, n=name: f"{n}: {m}")


# test_losses_over_steps_with_dp_pp_and_experts's bound on the losses and gradient norms of 6 steps
# against one process. Measured here (Intel AVX-512, MKL 2024.2, torch 2.13, one thread a rank), largest
# relative drift over the steps: ring dp=2,cp=2,zero=3 5.5e-7 in the loss and 8.0e-6 in the gradient
# norm; Ulysses dp=2,cp=2,zero=1 and cp=2,pp=2 1.1e-7 and 2.2e-6; tiny-moe cp=2,ep=2 9.9e-8 and 2.4e-7
# (the norm of one process with accumulate 1 against 8, the same rows summed in another order: 2.2e-6).
# Each case repeated its bits exactly over 14 runs (in two sessions, under four hash seeds, beside a
# CPU-bound process): no race or thread count moves them here. The drift is rounding (ring attention's
# log-sum-exp merges, the cp and ZeRO-3 sums in another order), and the shared rtol 1e-5 sat at 1.25x
# the ring case's; one run failed at 1.44e-5 (issue 42, on a host not recorded), not reproduced here:
# likeliest another CPU whose kernels round otherwise. The bound is 4x the largest drift measured, as
# tests/test_cast_once.py derives bf16's from its measured drift.
LAYOUT_DRIFT = 8.0e-6  # measured, above
LAYOUT_RTOL = 4 * LAYOUT_DRIFT


def assert_close_run(cfg, reference: tuple[list[float], list[float]], name: str) -> None:
    """`cfg` on its ranks gives the reference's losses and gradient norms within LAYOUT_RTOL."""
    losses, norms = spawn(run_config, cfg.parallel.world_size, cfg)[0]
    np.testing.assert_allclose(losses, reference[0], rtol=LAYOUT_RTOL, err_msg=f"{name}: losses")
    np.testing.assert_allclose(norms, reference[1], rtol=LAYOUT_RTOL, err_msg=f"{name}: gradient norms")


@pytest.mark.multirank
def test_losses_over_steps_with_dp_pp_and_experts(byte_cache, tmp_path):
    ulysses = ("parallel.cp=2", 'parallel.cp_mode="ulysses"')
    reference = single_process_run(byte_cache)
    for name, extra in {
        "ulysses dp=2,cp=2,zero=1": (*ulysses, "parallel.dp=2", "parallel.zero=1"),
        "ulysses cp=2,pp=2": (*ulysses, "parallel.pp=2", "parallel.microbatches=2"),
        "ring dp=2,cp=2,zero=3": ("parallel.cp=2", "parallel.dp=2", "parallel.zero=3"),
    }.items():
        cfg = small_config(byte_cache, *extra, f'log.out_dir="{tmp_path}/{name}"')
        assert_close_run(cfg, reference, name)
    # capacity and the auxiliary loss need each sequence's slots from both cp chunks; the bias rule is
    # left out: its sign(load - mean) turns a one-token routing flip (fp rounding differs under
    # Ulysses) into a different bias, and the runs separate after a few steps (benchmarks/results/moe.md)
    moe = ('model.preset="tiny-moe"', "moe.capacity_factor=1.0", "moe.aux_loss_coef=0.01")
    reference = single_process_run(byte_cache, *moe)
    cfg = small_config(byte_cache, *moe, *ulysses, "parallel.ep=2", f'log.out_dir="{tmp_path}/moe"')
    assert_close_run(cfg, reference, "tiny-moe cp=2,ep=2")


@pytest.mark.multirank
def test_moe_capacity_with_ulysses_tensor_and_expert_parallel(byte_cache, tmp_path):
    """Capacity counts each sequence's slots over both cp chunks, while tp splits attention and the
    dense layers and ep the experts: world 4 (cp=2 x tp=2, ep=2 over the cp ranks)."""
    moe = ('model.preset="tiny-moe"', "moe.capacity_factor=1.0", "moe.aux_loss_coef=0.01")
    layout = ("parallel.cp=2", 'parallel.cp_mode="ulysses"', "parallel.tp=2", "parallel.ep=2")
    cfg = small_config(byte_cache, *moe, *layout, f'log.out_dir="{tmp_path}"')
    assert_same_run(cfg, single_process_run(byte_cache, *moe), "tiny-moe cp=2,tp=2,ep=2 capacity")


# ---------------------------------------------------------------- the fused ring on its own

RING_SHAPE = {"b": 2, "heads": 4, "kv_heads": 2, "head_dim": 8}  # grouped-query: 2 query heads per kv head
RING_SEQS = (64, 128)
# unit-normal inputs: gradients are O(1) sums over up to s keys, added block by block in another
# order than one kernel's, so elements near zero differ by a few ulps of O(1) (measured 4e-7)
RING_TOL = {"rtol": 1e-5, "atol": 2e-6}


def attention_inputs(seq: int):
    """q [b, H, s, hd], k, v [b, KV, s, hd] and an output gradient, from one seed."""
    g = torch.Generator().manual_seed(seq)
    b, h, kv, d = RING_SHAPE.values()
    shapes = ((b, h, seq, d), (b, kv, seq, d), (b, kv, seq, d), (b, h, seq, d))
    return [torch.randn(shape, generator=g) for shape in shapes]


def saved_bytes(run):
    """`run()` and the bytes autograd kept for backward while it ran (each storage once)."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    return out, sum(storages.values())


def ring_attention_run(cp: int):
    """On each rank, for each sequence length: its positions, the ring's output and the gradients of
    its q, k, v chunks, and the bytes autograd keeps for backward."""
    group = Mesh(ParallelDims(cp=cp, cp_mode="ring"), "cpu").group("cp")
    results = []
    for seq in RING_SEQS:
        positions = zigzag_positions(group.rank, cp, seq // cp)
        q, k, v = (t[:, :, positions].clone().requires_grad_() for t in attention_inputs(seq)[:3])
        out, saved = saved_bytes(lambda: RingAttention(group)(q, k, v))  # noqa: B023 (called at once)
        out.backward(attention_inputs(seq)[3][:, :, positions])
        results.append((positions, out.detach(), q.grad, k.grad, v.grad, saved))
    return results


@pytest.mark.multirank
@pytest.mark.parametrize("cp", [2, 4])
def test_fused_ring_equals_one_device_and_keeps_only_its_chunk(cp):
    """The ring (zigzag chunks, fused flash blocks, backward passing K/V again) gives each rank's
    output and q, k, v gradients as single-device SDPA does (LOGIT_TOL, RING_TOL), and keeps for
    backward only q, k, v, the output and the log-sum-exp of its s/cp tokens: no s^2/cp term."""
    b, h, kv, d = RING_SHAPE.values()
    expected = {}
    for seq in RING_SEQS:
        q, k, v, grad = attention_inputs(seq)
        q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        out.backward(grad)
        expected[seq] = (out.detach(), q.grad, k.grad, v.grad)
    for rank, per_seq in enumerate(spawn(ring_attention_run, cp, cp)):
        for seq, (positions, *got, saved) in zip(RING_SEQS, per_seq):
            for name, a, want in zip(("out", "dq", "dk", "dv"), got, expected[seq]):
                tol = LOGIT_TOL if name == "out" else RING_TOL
                msg = lambda m, n=name, r=rank, s=seq: f"cp={cp} rank {r} s={s} {n}: {m}"  # noqa: E731
                torch.testing.assert_close(a, want[:, :, positions], **tol, msg=msg)
            local = seq // cp
            assert saved == 4 * (2 * b * h * local * d + 2 * b * kv * local * d + b * h * local), (cp, seq, rank)


# ---------------------------------------------------------------- whole logits (fivecut.train.infer)

# 13 positions: ring cp=2 runs multiples of 4 and Ulysses of 2, so both pad (to 16 and 14); 32: no padding
LENGTHS = (13, 32)


def whole_logits_under(configs, tokens: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """On each rank: `full_logits` of every token batch, under each config's layout."""
    from fivecut.train.infer import full_logits
    from fivecut.train.run import setup

    return [[full_logits(ctx, t) for t in tokens] for ctx in map(setup, configs)]


@pytest.mark.multirank
def test_full_logits_under_ring_and_ulysses_equal_one_process(byte_cache, tmp_path):
    """`full_logits` pads the sequence to the layout's multiple, runs the cp ranks' chunks and puts
    the logits back in position order, on every rank: the single-device model's (LOGIT_TOL)."""
    tokens = [torch.randint(0, 256, (2, s), generator=torch.Generator().manual_seed(s)) for s in LENGTHS]
    modes = ("ring", "ulysses")
    out = f'log.out_dir="{tmp_path}"'
    configs = [small_config(byte_cache, "parallel.cp=2", f'parallel.cp_mode="{m}"', out) for m in modes]
    model = build_model(get_preset("tiny"), seed=configs[0].train.seed)
    with torch.no_grad():
        expected = [model(t) for t in tokens]  # [b, s, V]
    for rank, per_mode in enumerate(spawn(whole_logits_under, 2, configs, tokens)):
        for mode, logits in zip(modes, per_mode):
            for got, want in zip(logits, expected):
                assert got.shape == want.shape, f"{mode} rank {rank}"
                torch.testing.assert_close(got, want, **LOGIT_TOL, msg=lambda m, r=rank, c=mode: f"{c} rank {r}: {m}")
