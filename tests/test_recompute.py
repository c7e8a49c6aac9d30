"""Activation recomputation (train.recompute = "full" | "selective", train.recompute_every = k)
against the single-process fp32 model without recomputation, under each cut.

Recomputation changes what is kept, not what is computed: the recomputed forward repeats the
same operations in the same order, so one process matches to the last bit; under the cuts the
bars are the project's (losses rtol 1e-5, first gradient norm rtol 1e-5, later 1e-3 as in
`fivecut verify`; gradients of one step rtol 1e-5, atol 1e-6 as in tests/test_tensor.py). What
a block keeps is counted by `SavedActivations.measure` (integer bytes, no arithmetic).
"""

from __future__ import annotations

import pytest
import torch
from test_ddp import assert_same_run, single_process_run, small_config
from test_expert import MOE, run_moe_with_biases
from test_tensor import batch, reference

from fivecut.launch import spawn
from fivecut.layout import ParallelDims
from fivecut.mesh import Mesh
from fivecut.model.presets import get_preset
from fivecut.model.transformer import build_model
from fivecut.parallel.parallelize import ParallelizeOptions, parallelize
from fivecut.parallel.placement import gather_full
from fivecut.plan.activations import activation_bytes_per_layer, recomputed, stage_activation_bytes

TOL = dict(rtol=1e-5, atol=1e-6)


def recomputed_step(preset: str, dims: ParallelDims, mode: str, every: int = 1):
    """One forward + backward with recomputation; every gradient gathered to full shape, and
    the bytes each layer kept for backward."""
    mesh = Mesh(dims, "cpu")
    model = build_model(get_preset(preset), seed=0)
    par = parallelize(model, mesh, ParallelizeOptions(recompute=mode, recompute_every=every))
    inputs, targets = batch(model.args.vocab_size)
    with par.saved.forward(), par.saved.measure() as kept:
        logits = par.module(inputs)
    (par.loss_sum(logits, targets) / targets.numel()).backward()
    grads = {name: gather_full(pl, par.params[name].grad, mesh.groups) for name, pl in par.placements.items()}
    return grads, dict(kept)


def recomputed_steps(preset: str, dims: ParallelDims, runs: list[tuple[str, int]]):
    """`recomputed_step` for each (mode, every), on the same ranks (one spawn)."""
    return [recomputed_step(preset, dims, mode, every) for mode, every in runs]


def one_process(*runs: tuple[str, int]):
    return spawn(recomputed_steps, 1, "tiny", ParallelDims(), list(runs))[0]


def assert_grads_match(grads, ref_grads, exact=False):
    assert grads.keys() == ref_grads.keys()
    for name, g in ref_grads.items():
        tol = dict(rtol=0, atol=0) if exact else TOL
        torch.testing.assert_close(grads[name], g, **tol, msg=lambda m, n=name: f"{n}: {m}")


def test_one_process_full_and_selective_match_and_keep_less():
    """Also every 2nd block (ids 0 and 2 recomputed, 1 and 3 keep the old formula's bytes)."""
    args = get_preset("tiny")
    _, ref_grads = reference("tiny")
    b, s = batch(args.vocab_size)[0].shape
    (_, kept_none), *runs, (grads2, kept2) = one_process(("none", 1), ("full", 1), ("selective", 1), ("full", 2))
    for mode, (grads, kept) in zip(("full", "selective"), runs):
        assert_grads_match(grads, ref_grads, exact=True)  # the same operations, in the same order
        for layer in ("1", "2", "3"):  # layer 0 also holds the RoPE tables every layer shares
            assert kept[layer] == activation_bytes_per_layer(args, b, s, 1, False, recompute=mode)
            assert kept[layer] < kept_none[layer]
        if mode == "full":
            assert kept["1"] == 4 * b * s * args.dim  # the input only
    assert_grads_match(grads2, ref_grads, exact=True)
    assert [recomputed(i, 2) for i in range(4)] == [True, False, True, False]
    assert kept2["2"] == 4 * b * s * args.dim
    assert kept2["3"] == kept_none["3"] == activation_bytes_per_layer(args, b, s, 1, False)


def test_planner_memory_follows_the_mode():
    """Full recomputation keeps the block inputs and adds one block's activations in backward."""
    args = get_preset("small")
    none, full, half = (
        stage_activation_bytes(args, range(args.n_layers), 4, 512, recompute=mode, every=every)
        for mode, every in (("none", 1), ("full", 1), ("full", 2))
    )
    one = activation_bytes_per_layer(args, 4, 512, 1, False)
    assert none == {"kept": args.n_layers * one, "transient": 0.0, "peak": args.n_layers * one}
    assert full["kept"] == args.n_layers * 4 * 4 * 512 * args.dim
    assert full["transient"] == one - 4 * 4 * 512 * args.dim
    assert full["peak"] < half["peak"] < none["peak"]


@pytest.mark.multirank
def test_tensor_and_sequence_parallel_regions_recompute():
    """tp=2, sp: the recomputed forward gathers its regions again; the checkpoint's hook is the
    innermost one, so the measure counts the block's local input slice [b, s/t, h] only."""
    args = get_preset("tiny")
    _, ref_grads = reference("tiny")
    b, s = batch(args.vocab_size)[0].shape
    modes = ("full", "selective")
    for runs in spawn(recomputed_steps, 2, "tiny", ParallelDims(tp=2, sp=True), [(m, 1) for m in modes]):
        for mode, (grads, kept) in zip(modes, runs):
            assert_grads_match(grads, ref_grads)
            assert kept["3"] == activation_bytes_per_layer(args, b, s, 2, True, recompute=mode)


@pytest.mark.multirank
def test_zero3_gathers_each_unit_once_for_the_recomputed_forward(byte_cache, tmp_path):
    """ZeRO-3's pre-forward hook sits on the block, outside the checkpoint: the recomputation reads
    the unit gathered for backward (gathering twice or freeing early would fail or mismatch)."""
    layout = ("parallel.dp=2", "parallel.zero=3", 'train.recompute="full"')  # selective: in the sweep
    cfg = small_config(byte_cache, *layout, f'log.out_dir="{tmp_path}"')
    assert_same_run(cfg, single_process_run(byte_cache), ",".join(layout))


def balanced_moe_runs(byte_cache, tmp_path, mode: str):
    """tiny-moe dp=2, ep=2 with aux-free balancing for 4 steps, recomputed in `mode` and not:
    each rank's (losses, norms, MoE statistics, biases per step), for both runs."""
    short = ("train.steps=4", "train.global_batch=4", "train.lr=3e-4", "train.min_lr=3e-5")
    balance = (*MOE, "moe.bias_update_rate=0.01", *short, "parallel.dp=2", "parallel.ep=2")
    plain = spawn(run_moe_with_biases, 2, small_config(byte_cache, *balance, f'log.out_dir="{tmp_path}/a"'))
    recomputed = small_config(byte_cache, *balance, f'train.recompute="{mode}"', f'log.out_dir="{tmp_path}/b"')
    return spawn(run_moe_with_biases, 2, recomputed), plain


@pytest.mark.multirank
def test_recomputed_moe_counts_each_token_once(byte_cache, tmp_path):
    """tiny-moe dp=2, ep=2, aux-free balancing: a recomputed MoE forward repeats its all-to-alls
    but not its load statistics, so the loads and the bias trajectory are exactly those of the
    run without recomputation (and the losses those of one process)."""
    again, plain = balanced_moe_runs(byte_cache, tmp_path, "full")
    for (losses, norms, moe, biases), (losses0, norms0, moe0, biases0) in zip(again, plain):
        assert losses == losses0 and norms == norms0
        assert moe == moe0  # loads, rows sent and received per rank, slot rows, copies: every statistic
        for got, want in zip(biases, biases0, strict=True):
            assert all(torch.equal(got[layer], want[layer]) for layer in want)
    assert any(float(b.abs().sum()) > 0 for b in plain[0][3][-1].values())  # the biases did move


SWEEP = [
    ("parallel.dp=2", "parallel.zero=3"),
    ("parallel.pp=2", "parallel.microbatches=2", 'parallel.pp_schedule="1f1b"'),
    ("parallel.pp=2", "parallel.microbatches=2", 'parallel.pp_schedule="zb1p"'),
    ("parallel.cp=2", 'parallel.cp_mode="ring"'),
    ("parallel.cp=2", 'parallel.cp_mode="ulysses"'),
    ("parallel.tp=2", "parallel.sp=true"),
    ("parallel.dp=2", "parallel.zero=3", "train.recompute_every=2"),
    ("parallel.tp=2", "parallel.dp=2", "parallel.zero=3"),
]


@pytest.mark.sweep
@pytest.mark.multirank
@pytest.mark.parametrize("mode", ["full", "selective"])
@pytest.mark.parametrize("layout", SWEEP, ids=lambda layout: ",".join(layout))
def test_losses_over_steps_under_each_cut(layout, mode, byte_cache, tmp_path):
    cfg = small_config(byte_cache, *layout, f'train.recompute="{mode}"', f'log.out_dir="{tmp_path}/l"')
    assert_same_run(cfg, single_process_run(byte_cache), ",".join(layout))


@pytest.mark.sweep
@pytest.mark.multirank
def test_selective_moe_keeps_the_bias_trajectory(byte_cache, tmp_path):
    again, plain = balanced_moe_runs(byte_cache, tmp_path, "selective")
    for (losses, _, moe, biases), (losses0, _, moe0, biases0) in zip(again, plain):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(losses0), rtol=1e-5, atol=0)
        assert moe == moe0
        for got, want in zip(biases, biases0, strict=True):
            assert all(torch.equal(got[layer], want[layer]) for layer in want)
