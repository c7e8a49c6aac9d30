"""Hybrid sharding (`parallel.zero_shard`): ZeRO over groups of S consecutive dp x cp ranks,
replicated across the groups, reproduces single-process training.

Tolerances (fp32) as for ZeRO (`test_zero`): only the order of floating-point sums differs (a
reduce-scatter inside the shard group, then an all-reduce of the shard across the replicas):
gradients rtol 1e-5, atol 1e-7; logits rtol 1e-5, atol 1e-6; losses rtol 1e-5.
"""

from __future__ import annotations

import contextlib
import copy

import numpy as np
import pytest
import torch
from test_checkpoint import config as ckpt_config
from test_checkpoint import full_state, resave
from test_checkpoint import run as run_for_checkpoint
from test_ddp import GRAD_TOL, LOGIT_TOL, TOKENS, assert_same_run, one_step_gradients, single_process_run, small_config
from test_e2e import assert_every_cut_exact, assert_memory_exact
from test_zero import reassemble

from fivecut.cli import main
from fivecut.launch import spawn
from fivecut.layout import ParallelDims
from fivecut.mesh import Mesh
from fivecut.model.presets import get_preset
from fivecut.model.transformer import build_model
from fivecut.parallel.parallelize import ParallelizeOptions, parallelize, token_loss_sum
from fivecut.train import checkpoint
from fivecut.train.data import BatchSampler

pytestmark = pytest.mark.multirank


# ---------------------------------------------------------------- the groups (no processes)


def test_shard_groups_are_consecutive_dp_ranks_and_replicas_share_a_position():
    dims = ParallelDims(dp=4, tp=2, zero=3, zero_shard=2)  # ranks [dp, tp]: dp i holds 2i, 2i+1
    groups = {r: Mesh.virtual(dims, rank=r).zero_groups["dp_cp"] for r in range(8)}
    assert groups[0].shard.ranks == (0, 2) and groups[0].replicate.ranks == (0, 4)
    assert groups[5].shard.ranks == (5, 7) and groups[5].replicate.ranks == (1, 5)
    alone = Mesh.virtual(ParallelDims(dp=4, zero=3), rank=1).zero_groups["dp_cp"]
    assert alone.shard.ranks == (0, 1, 2, 3) and alone.replicate.size == 1  # unset: today's ZeRO


def test_expert_groups_are_cut_inside_the_shard_block():
    dims = ParallelDims(dp=8, ep=2, zero=1, zero_shard=4)
    groups = Mesh.virtual(dims, rank=5, moe=True).zero_groups
    assert groups["expert_dp"].shard.ranks == (5, 7)  # this block's ranks with the same experts
    assert groups["expert_dp"].replicate.ranks == (1, 5) == groups["dp_cp"].replicate.ranks


@pytest.mark.parametrize(
    "fields, key",
    [
        (dict(dp=4, zero=1, zero_shard=3), "must divide dp*cp=4"),
        (dict(dp=4, zero_shard=2), "zero=0"),
        (dict(dp=4, zero=1, zero_shard=0), "must be >= 1"),
        (dict(dp=8, ep=4, zero=1, zero_shard=2), "multiple of ep=4"),
    ],
)
def test_bad_zero_shard_is_one_problem_naming_the_key(fields, key):
    problems = ParallelDims(**fields).problems()
    assert len(problems) == 1 and "parallel.zero_shard" in problems[0] and key in problems[0]


def test_the_cli_refuses_a_zero_shard_that_does_not_divide(capsys, monkeypatch):
    import fivecut.launch

    monkeypatch.setattr(fivecut.launch, "spawn", lambda *a, **k: pytest.fail("a process was started"))
    assert main(["verify", "--model", "tiny", "--layout", "dp=4,zero=3,zero_shard=3", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("parallel.zero_shard=3") == 1


# ---------------------------------------------------------------- parity with one process


def hybrid_step_gradients(stage: int, accumulate: int):
    """One step at dp=4 under ZeRO-`stage` with zero_shard=2: the full gradients reassembled from
    the shard group's shards (each replica must hold the same), and the first logits."""
    mesh = Mesh(ParallelDims(dp=4, zero=stage, zero_shard=2), "cpu")
    model = build_model(get_preset("tiny"), seed=0)
    names = {id(p): name for name, p in model.named_parameters()}
    par = parallelize(model, mesh, ParallelizeOptions(bucket_mb=0.05))  # several buckets
    sampler = BatchSampler(TOKENS, seq_len=32, global_batch=8, seed=3)
    batches = sampler.local_batches(1, mesh.coordinate("dp"), 4, accumulate)
    par.sync.zero_grad()
    first_logits = None
    for i, (inputs, targets) in enumerate(batches):
        with contextlib.nullcontext() if i == len(batches) - 1 else par.sync.no_sync():
            logits = par.module(inputs)
            (token_loss_sum(logits, targets) / sampler.tokens_in_global_batch()).backward()
        first_logits = logits.detach() if first_logits is None else first_logits
    return reassemble(par.sync.shards, names, mesh.group("zero_shard")), first_logits


def every_stage_gradients(accumulate: int) -> dict:
    """ZeRO-1, -2 and -3 one after the other in the same four processes (one start, not three)."""
    return {stage: hybrid_step_gradients(stage, accumulate) for stage in (1, 2, 3)}


def test_hybrid_gradients_match_single_process():
    accumulate = 2  # the replicas are summed once, after the step's last micro-step
    ref_grads, ref_logits, _ = one_step_gradients(1, 1, 25.0)
    results = spawn(every_stage_gradients, 4, accumulate)
    rows = ref_logits.shape[0] // (4 * accumulate)
    for rank, by_stage in enumerate(results):
        for stage, (grads, logits) in by_stage.items():
            assert grads.keys() == ref_grads.keys()
            for name in ref_grads:
                torch.testing.assert_close(
                    grads[name], ref_grads[name], **GRAD_TOL, msg=lambda m, n=name, z=stage: f"zero={z} {n}: {m}"
                )
            torch.testing.assert_close(logits, ref_logits[rank * rows : (rank + 1) * rows], **LOGIT_TOL)


@pytest.mark.parametrize("stage", [pytest.param(1, marks=pytest.mark.sweep), 3])
def test_hybrid_losses_and_norms_over_steps(stage, byte_cache, tmp_path):
    """Clipping active: the norm sums one shard group's squares, not the replicas' again."""
    common = ("train.grad_clip=0.5", "train.accumulate=2", "train.steps=4")
    reference = single_process_run(byte_cache, *common)
    layout = ("parallel.dp=4", f"parallel.zero={stage}", "parallel.zero_shard=2")
    cfg = small_config(byte_cache, *common, *layout, f'log.out_dir="{tmp_path}/h"')
    assert_same_run(cfg, reference, f"zero={stage},zero_shard=2")


@pytest.mark.sweep
def test_hybrid_inside_a_pipeline_verifies(capsys):
    """dp=4,zero=1,zero_shard=2,pp=2 (1f1b needs microbatches >= pp): eight processes."""
    assert (
        main(["verify", "--model", "tiny", "--layout", "dp=4,zero=1,zero_shard=2,pp=2,microbatches=2", "--steps", "5"])
        == 0
    )
    assert "PASS" in capsys.readouterr().out


# ---------------------------------------------------------------- the ledger


@pytest.mark.parametrize(
    "layout", ["dp=4,zero=3,zero_shard=2", pytest.param("dp=4,zero=2,zero_shard=2", marks=pytest.mark.sweep)]
)
def test_ledger_counts_the_two_level_reduction(layout, capsys, byte_cache):
    assert main(["ledger", "--model", "tiny", "--layout", layout, "--set", f'data.cache_dir="{byte_cache}"']) == 0
    out = capsys.readouterr().out
    assert "replicas" in out
    assert_every_cut_exact(out)
    assert_memory_exact(out)


# ---------------------------------------------------------------- checkpoints reshard


def moved_bitwise(byte_cache, tmp_path, saved_under: tuple[str, ...], loaded_into: tuple[str, ...], resume=False):
    """Train under A and save at step 2; load into B and save again: the same tensors, bit for bit
    (weights and Adam's moments, each rank's shard of them placed by its flat slots); `resume`: B
    also resumes from A's checkpoint and continues A's run."""
    a = ckpt_config(byte_cache, tmp_path, saved_under, steps=4 if resume else 2, dir=str(tmp_path / "a"), every=2)
    b = ckpt_config(byte_cache, tmp_path, loaded_into, steps=4)
    under_a = spawn(run_for_checkpoint, a.parallel.world_size, a)[0]
    source = checkpoint.step_dir(tmp_path / "a", 2)
    spawn(resave, b.parallel.world_size, copy.deepcopy(b), str(source), str(tmp_path / "b"))
    saved = full_state(source, tmp_path / "a.pt")
    loaded = full_state(checkpoint.step_dir(tmp_path / "b", 2), tmp_path / "b.pt")
    assert saved.keys() == loaded.keys() and any(key.startswith("optim.") for key in saved)
    for key in saved:
        assert torch.equal(saved[key], loaded[key]), f"{key} changed in the move"
    if resume:
        resumed = spawn(run_for_checkpoint, b.parallel.world_size, b, str(source))[0]
        np.testing.assert_allclose(resumed[0], under_a[0][2:], rtol=1e-5)


def test_zero3_checkpoint_loads_under_hybrid_sharding(byte_cache, tmp_path):
    moved_bitwise(
        byte_cache,
        tmp_path,
        ("parallel.dp=2", "parallel.zero=3"),
        ("parallel.dp=4", "parallel.zero=3", "parallel.zero_shard=2"),
    )


@pytest.mark.sweep
def test_hybrid_zero1_checkpoint_loads_under_plain_zero1(byte_cache, tmp_path):
    moved_bitwise(
        byte_cache,
        tmp_path,
        ("parallel.dp=4", "parallel.zero=1", "parallel.zero_shard=2"),
        ("parallel.dp=2", "parallel.zero=1"),
        resume=True,
    )


@pytest.mark.sweep
def test_pipelined_zero3_checkpoint_loads_under_hybrid_sharding(byte_cache, tmp_path):
    moved_bitwise(
        byte_cache,
        tmp_path,
        ("parallel.dp=2", "parallel.pp=2", "parallel.microbatches=2", "parallel.zero=3"),
        ("parallel.dp=4", "parallel.zero=3", "parallel.zero_shard=2"),
        resume=True,
    )
