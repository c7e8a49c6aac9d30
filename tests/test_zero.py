"""ZeRO-1/2/3 parity: sharded optimizer state, gradients and parameters reproduce
single-process training.

Tolerances (fp32), as for DDP: only the order of floating-point sums differs
(per-rank partial sums, then the reduce-scatter), so
  - logits: rtol 1e-5, atol 1e-6;
  - gradients (reassembled from the shards): rtol 1e-5, atol 1e-7;
  - losses over optimizer steps: rtol 1e-5.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from test_checkpoint import config as ckpt_config
from test_checkpoint import full_state, resave
from test_checkpoint import run as run_for_checkpoint
from test_ddp import (
    GRAD_TOL,
    LOGIT_TOL,
    TOKENS,
    assert_same_run,
    one_step_gradients,
    run_config,
    single_process_run,
    small_config,
)
from test_e2e import assert_every_cut_exact

from fivecut import comm
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


def sharded_step_gradients(stage: int, dp: int, accumulate: int, reshard: bool, param_dtype=None, reduce_dtype=None):
    """One step under ZeRO-`stage`: full gradients reassembled from every rank's shard, first logits
    (with `param_dtype`: ZeRO-3's gathers in it, the step under autocast, as the trainer runs bf16)."""
    mesh = Mesh(ParallelDims(dp=dp, zero=stage, reshard_after_forward=reshard), "cpu")
    model = build_model(get_preset("tiny"), seed=0)
    names = {id(p): name for name, p in model.named_parameters()}
    par = parallelize(
        model, mesh, ParallelizeOptions(bucket_mb=0.05, reduce_dtype=reduce_dtype, param_dtype=param_dtype)
    )  # buckets: 1/2
    sampler = BatchSampler(TOKENS, seq_len=32, global_batch=8, seed=3)
    batches = sampler.local_batches(1, mesh.coordinate("dp"), dp, accumulate)
    par.sync.zero_grad()
    first_logits = None
    for i, (inputs, targets) in enumerate(batches):
        with contextlib.nullcontext() if i == len(batches) - 1 else par.sync.no_sync(), autocast(param_dtype):
            logits = par.module(inputs)
            (token_loss_sum(logits, targets) / sampler.tokens_in_global_batch()).backward()
        first_logits = logits.detach() if first_logits is None else first_logits
    return reassemble(par.sync.shards, names, mesh.group("dp_cp")), first_logits


def autocast(dtype):
    return contextlib.nullcontext() if dtype is None else torch.autocast("cpu", dtype=dtype)


def reassemble(shards, names, group) -> dict[str, torch.Tensor]:
    """Gather every shard's gradient and cut the flat buffer back into named parameters."""
    grads = {}
    for shard in shards:
        flat = comm.all_gather(shard.grad, group)  # [padded]
        offset = 0
        for p, shape in zip(shard.params, shard.shapes):
            grads[names[id(p)]] = flat[offset : offset + shape.numel()].view(shape)
            offset += shape.numel()
    return grads


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("dp,accumulate", [(2, 1), (4, 1), (2, 2)])
def test_sharded_gradients_match_single_process(stage, dp, accumulate):
    ref_grads, ref_logits, _ = one_step_gradients(1, 1, 25.0)
    results = spawn(sharded_step_gradients, dp, stage, dp, accumulate, True)
    rows = ref_logits.shape[0] // (dp * accumulate)
    for rank, (grads, logits) in enumerate(results):
        assert grads.keys() == ref_grads.keys()
        for name in ref_grads:
            torch.testing.assert_close(grads[name], ref_grads[name], **GRAD_TOL, msg=lambda m, n=name: f"{n}: {m}")
        torch.testing.assert_close(logits, ref_logits[rank * rows : (rank + 1) * rows], **LOGIT_TOL)


def updated_then_forward(stage: int):
    """ZeRO-`stage` on 2 ranks in buckets of 0.05 MB: every rank adds 1 to its shards (an update),
    `after_step` launches the gathers; what is in flight then and after the next forward, and that
    forward's logits."""
    mesh = Mesh(ParallelDims(dp=2, zero=stage), "cpu")
    par = parallelize(build_model(get_preset("tiny"), seed=0), mesh, ParallelizeOptions(bucket_mb=0.05))
    for shard in par.sync.shards:
        shard.local.add_(1.0)
    par.sync.after_step()
    in_flight = len(par.sync.gathers)
    with torch.no_grad():
        logits = par.module(torch.as_tensor(TOKENS[:32].astype(np.int64)).view(1, 32))
    return in_flight, len(par.sync.shards), len(par.sync.gathers), logits


@pytest.mark.parametrize("stage", [1, 2])
def test_zero12_gathers_run_into_the_next_forward_which_waits_for_each(stage):
    """The gathers of the updated shards are not waited for in `after_step`: each unit's forward
    waits for its buckets', and computes on the updated parameters (those of one process + 1)."""
    model = build_model(get_preset("tiny"), seed=0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
        reference = model(torch.as_tensor(TOKENS[:32].astype(np.int64)).view(1, 32))
    for in_flight, buckets, left, logits in spawn(updated_then_forward, 2, stage):
        assert in_flight == buckets > 2 and left == 0
        torch.testing.assert_close(logits, reference, **LOGIT_TOL)


def test_zero3_without_resharding_after_forward():
    ref_grads, _, _ = one_step_gradients(1, 1, 25.0)
    grads, _ = spawn(sharded_step_gradients, 2, 3, 2, 1, False)[0]
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], **GRAD_TOL)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_losses_over_steps_with_accumulation_and_clipping(stage, byte_cache, tmp_path):
    # grad_clip=0.5 is below the gradient norm of every step here, so clipping is active throughout
    common = ("train.grad_clip=0.5", "train.accumulate=2", "train.steps=5")
    reference = single_process_run(byte_cache, *common)
    cfg = small_config(byte_cache, *common, "parallel.dp=2", f"parallel.zero={stage}", f'log.out_dir="{tmp_path}/z"')
    assert_same_run(cfg, reference, f"zero={stage}")


def grad_norms(cfg):
    from fivecut.train.trainer import train

    return train(cfg, quiet=True).grad_norms


def test_clipping_sees_the_global_norm(byte_cache, tmp_path):
    """The norm computed from shards (one all-reduce of squared norms) equals the full one."""
    reference = spawn(grad_norms, 1, small_config(byte_cache, "train.steps=3", f'log.out_dir="{tmp_path}/r"'))[0]
    sharded = spawn(
        grad_norms,
        4,
        small_config(byte_cache, "train.steps=3", "parallel.dp=4", "parallel.zero=3", f'log.out_dir="{tmp_path}/s"'),
    )
    assert min(reference) > 0.5  # the default clip (1.0) or the test above is active at these norms
    for norms in sharded:
        np.testing.assert_allclose(norms, reference, rtol=1e-5)


def test_bf16_reduction_stays_close(byte_cache, tmp_path):
    """Gradients reduced in bf16 lose precision (8-bit mantissa): close, not identical."""
    reference = single_process_run(byte_cache)[0]
    cfg = small_config(
        byte_cache, "parallel.dp=2", "parallel.zero=2", 'train.reduce_dtype="bf16"', f'log.out_dir="{tmp_path}/b"'
    )
    losses = spawn(run_config, 2, cfg)[0][0]
    np.testing.assert_allclose(losses, reference, rtol=1e-2)
    assert losses != reference  # the reduction really was in bf16


# ---------------------------------------------------------------- ZeRO-3 under train.dtype = "bf16"
#
# The reference is one process that keeps fp32 masters and computes on a bf16 copy of its
# parameters (what ZeRO-3 gathers; buffers such as the RoPE tables stay fp32, as they do there),
# under autocast as the trainer runs. Each rank's rows then see exactly the reference's forward
# and backward of the same rows; what differs is where each weight gradient is rounded to bf16:
# a rank rounds the sum over its own rows (a), the reference the sum over all rows (a + b), each
# rounding off by at most 2^-9 (half the bf16 epsilon). So |error| <= 2^-9 (|a| + |b| + |a + b|)
# per element, and we bound each tensor's error norm by 2^-8 of its gradient norm (rows that
# cancel could exceed it in a few elements, not in norm). A bf16 reduce-scatter rounds the
# halves once more and their sum once: 2^-7. Measured at these shapes: 2.5e-3 (fp32 reduce),
# 3.4e-3 (bf16); against fp32 masters under autocast (the wrong reference) 1.3e-2, outside.
# Logits: identical rows, identical ops, so one bf16 rounding apart at most (rtol 2^-8).
BF16_GRAD_NORM_RTOL = {None: 2.0**-8, torch.bfloat16: 2.0**-7}  # by reduce dtype
BF16_LOGIT_TOL = dict(rtol=2.0**-8, atol=0.0)


def bf16_compute_step(param_dtype=torch.bfloat16):
    """One step in one process on a `param_dtype` copy of fp32 masters, under bf16 autocast:
    the gradients (upcast to fp32) and the logits."""
    compute = build_model(get_preset("tiny"), seed=0)
    for p in compute.parameters():  # the parameters only: buffers stay fp32, as under ZeRO-3
        p.data = p.data.to(param_dtype)
    sampler = BatchSampler(TOKENS, seq_len=32, global_batch=8, seed=3)
    ((inputs, targets),) = sampler.local_batches(1, 0, 1, 1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = compute(inputs)
        (token_loss_sum(logits, targets) / sampler.tokens_in_global_batch()).backward()
    return {name: p.grad.float() for name, p in compute.named_parameters()}, logits.detach()


@pytest.mark.parametrize("reduce_dtype", [None, torch.bfloat16])
def test_zero3_bf16_gathers_match_a_bf16_compute_copy(reduce_dtype):
    ref_grads, ref_logits = bf16_compute_step()
    results = spawn(sharded_step_gradients, 2, 3, 2, 1, True, torch.bfloat16, reduce_dtype)
    rows = ref_logits.shape[0] // 2
    for rank, (grads, logits) in enumerate(results):
        assert logits.dtype == torch.bfloat16  # the head ran on bf16 parameters
        torch.testing.assert_close(logits, ref_logits[rank * rows : (rank + 1) * rows], **BF16_LOGIT_TOL)
        for name, ref in ref_grads.items():
            assert grads[name].dtype == torch.float32  # the shards' gradients stay fp32
            rel = float((grads[name] - ref).norm() / ref.norm())
            assert rel <= BF16_GRAD_NORM_RTOL[reduce_dtype], f"{name}: relative error {rel:.2e}"


def gathered_bytes(capsys, byte_cache: str, dtype: str) -> int:
    """`fivecut ledger --layout dp=2,zero=3` under train.dtype: all-gather wire bytes; every cut's
    bytes equal the closed form's (which follows the gather dtype)."""
    assert main(["ledger", "--layout", "dp=2,zero=3", "--set", f'train.dtype="{dtype}"', "--set",
                 f'data.cache_dir="{byte_cache}"']) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert_every_cut_exact(out)
    gathers = [line.split() for line in out.splitlines() if line.split()[:2] == ["dp", "all_gather"]]
    return sum(int(row[-1].replace(",", "")) for row in gathers)


def test_ledger_zero3_bf16_gathers_half_the_bytes(capsys, byte_cache):
    fp32, bf16 = gathered_bytes(capsys, byte_cache, "fp32"), gathered_bytes(capsys, byte_cache, "bf16")
    assert bf16 * 2 == fp32 > 0


def test_a_bf16_zero3_checkpoint_holds_fp32_masters_and_loads_under_zero1(byte_cache, tmp_path):
    """The masters are saved (fp32), not the bf16 compute copy, and another layout loads them bitwise."""
    bf16 = ('train.dtype="bf16"',)
    a = ckpt_config(byte_cache, tmp_path, ("parallel.dp=2", "parallel.zero=3", *bf16), steps=3, dir=str(tmp_path / "a"))
    b = ckpt_config(byte_cache, tmp_path, ("parallel.dp=2", "parallel.zero=1", *bf16), steps=3)
    spawn(run_for_checkpoint, 2, a)
    source = checkpoint.step_dir(tmp_path / "a", 3)
    spawn(resave, 2, b, str(source), str(tmp_path / "b"))
    saved = full_state(source, tmp_path / "a.pt")
    loaded = full_state(checkpoint.step_dir(tmp_path / "b", 3), tmp_path / "b.pt")
    floats = [key for key, value in saved.items() if torch.is_tensor(value) and value.is_floating_point()]
    assert any(key.startswith("model") for key in floats)
    for key in floats:
        assert saved[key].dtype == torch.float32, key
        assert torch.equal(saved[key], loaded[key]), f"{key} changed in the move"


def test_zero3_bf16_losses_stay_within_bf16_of_one_process(byte_cache, tmp_path):
    """Over steps, against one process under bf16 autocast (fp32 parameters: another rounding of
    the same model), the losses agree to bf16 precision, as for a bf16 reduction (above)."""
    bf16 = ('train.dtype="bf16"',)
    reference = single_process_run(byte_cache, *bf16)[0]
    cfg = small_config(byte_cache, *bf16, "parallel.dp=2", "parallel.zero=3", f'log.out_dir="{tmp_path}/z"')
    losses = spawn(run_config, 2, cfg)[0][0]
    np.testing.assert_allclose(losses, reference, rtol=1e-2)
