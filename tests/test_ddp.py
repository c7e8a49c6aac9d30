"""DDP parity: data-parallel ranks reproduce single-process training.

Tolerances (fp32): the only difference from the reference is the order in which
floating-point sums are taken (per-rank partial sums, then the all-reduce), so
  - logits: rtol 1e-5, atol 1e-6 (a matmul over fewer rows may block differently);
  - gradients: rtol 1e-5, atol 1e-7 (gradient entries are ~1e-4..1e-2);
  - losses over optimizer steps: rtol 1e-5 (the project's bar for every cut);
  - the gradient norm before clipping at every step: rtol 1e-5 (AdamW's update barely depends
    on the gradient's scale, so the loss alone would miss a gradient off by a constant factor).
"""

from __future__ import annotations

import contextlib
import functools

import numpy as np
import pytest
import torch
from torch import nn

from fivecut.config import Config, load_config
from fivecut.launch import spawn
from fivecut.layout import ParallelDims
from fivecut.mesh import Mesh
from fivecut.model.presets import get_preset
from fivecut.model.transformer import build_model
from fivecut.parallel.data import DataParallel, plan_buckets
from fivecut.parallel.parallelize import token_loss_sum
from fivecut.train.data import BatchSampler
from fivecut.train.trainer import train

LOSS_RTOL = 1e-5
GRAD_NORM_RTOL = 1e-5
GRAD_TOL = dict(rtol=1e-5, atol=1e-7)
LOGIT_TOL = dict(rtol=1e-5, atol=1e-6)

TOKENS = np.random.default_rng(0).integers(0, 256, size=20_000).astype(np.uint16)


def sampler() -> BatchSampler:
    return BatchSampler(TOKENS, seq_len=32, global_batch=8, seed=3)


def one_step_gradients(dp: int, accumulate: int, bucket_mb: float):
    """Gradients of one step (all micro-steps), the first micro-step's logits, the loss share."""
    model = build_model(get_preset("tiny"), seed=0)
    rank, sync = 0, None
    if dp > 1:
        mesh = Mesh(ParallelDims(dp=dp), "cpu")
        rank = mesh.coordinate("dp")
        sync = DataParallel(model, mesh.group("dp_cp"), bucket_mb=bucket_mb)
    s = sampler()
    batches = s.local_batches(step=1, dp_rank=rank, dp_size=dp, accumulate=accumulate)
    first_logits, loss_share = None, 0.0
    for i, (inputs, targets) in enumerate(batches):
        accumulating = sync is not None and i < len(batches) - 1
        with sync.no_sync() if accumulating else contextlib.nullcontext():
            logits = model(inputs)
            loss = token_loss_sum(logits, targets) / s.tokens_in_global_batch()
            loss.backward()
        first_logits = logits.detach() if first_logits is None else first_logits
        loss_share += float(loss.detach())
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return grads, first_logits, loss_share


@pytest.mark.multirank
@pytest.mark.parametrize("dp,accumulate,bucket_mb", [(2, 1, 25.0), (4, 1, 0.05), (2, 2, 0.05)])
def test_gradients_and_logits_match_single_process(dp, accumulate, bucket_mb):
    ref_grads, ref_logits, ref_loss = one_step_gradients(1, 1, bucket_mb)
    results = spawn(one_step_gradients, dp, dp, accumulate, bucket_mb)
    for grads, _, _ in results:
        assert grads.keys() == ref_grads.keys()
        for name in ref_grads:
            torch.testing.assert_close(grads[name], ref_grads[name], **GRAD_TOL, msg=lambda m, n=name: f"{n}: {m}")
    rows = ref_logits.shape[0] // (dp * accumulate)
    for rank, (_, logits, _) in enumerate(results):
        torch.testing.assert_close(logits, ref_logits[rank * rows : (rank + 1) * rows], **LOGIT_TOL)
    assert sum(r[2] for r in results) == pytest.approx(ref_loss, rel=LOSS_RTOL)


def test_buckets_follow_order_and_size():
    params = [nn.Parameter(torch.zeros(n)) for n in (10, 20, 30, 5)]
    buckets = plan_buckets(params, bucket_bytes=4 * 30)
    assert [[p.numel() for p in b] for b in buckets] == [[10, 20], [30], [5]]


def unused_parameter_step():
    mesh = Mesh(ParallelDims(dp=2), "cpu")
    torch.manual_seed(0)
    model = nn.ModuleDict({"used": nn.Linear(4, 4), "unused": nn.Linear(4, 4)})
    _sync = DataParallel(model, mesh.group("dp_cp"), bucket_mb=1e-5)  # one bucket per parameter
    x = torch.full((2, 4), float(mesh.coordinate("dp") + 1))
    model["used"](x).sum().backward()
    return model["used"].weight.grad.clone(), model["unused"].weight.grad.clone()


@pytest.mark.multirank
def test_unused_parameters_do_not_hang():
    results = spawn(unused_parameter_step, 2, timeout_s=60)
    used, unused = results[0]
    torch.testing.assert_close(used, results[1][0])
    assert torch.all(used == 3 * 2)  # rows of 1s and 2s from the two ranks, 2 rows each, summed
    assert torch.all(unused == 0)


def run_config(cfg: Config) -> tuple[list[float], list[float]]:
    """Losses and gradient norms (before clipping) per step."""
    result = train(cfg, quiet=True)
    return result.losses, result.grad_norms


@functools.cache
def single_process_run(cache_dir: str, *overrides: str) -> tuple[list[float], list[float]]:
    """The reference run for `small_config(cache_dir, *overrides)`, computed once per session
    (a quiet run writes no files, so its out_dir does not matter)."""
    return spawn(run_config, 1, small_config(cache_dir, *overrides))[0]


def assert_same_run(cfg: Config, reference: tuple[list[float], list[float]], name: str = "") -> None:
    """`cfg` on its ranks gives the reference's losses and gradient norms at every step."""
    losses, norms = spawn(run_config, cfg.parallel.world_size, cfg)[0]
    np.testing.assert_allclose(losses, reference[0], rtol=LOSS_RTOL, err_msg=f"{name}: losses")
    np.testing.assert_allclose(norms, reference[1], rtol=GRAD_NORM_RTOL, err_msg=f"{name}: gradient norms")


def small_config(cache_dir: str, *overrides: str) -> Config:
    base = [
        "train.steps=6",
        "train.seq_len=32",
        "train.global_batch=8",
        "train.warmup=2",
        "train.eval_every=0",
        f'data.cache_dir="{cache_dir}"',
        "log.progress=false",
        "log.plot=false",
    ]
    return load_config(None, base + list(overrides))


@pytest.mark.multirank
def test_losses_over_steps_match_for_dp_and_accumulation(byte_cache, tmp_path):
    reference = single_process_run(byte_cache)
    layouts = {
        "dp=2": ("parallel.dp=2",),
        "accumulate=4": ("train.accumulate=4",),
        "dp=2,accumulate=2": ("parallel.dp=2", "train.accumulate=2"),
        # 0.01 MB is 2,621 fp32 elements: each of the 39 parameters of `tiny` gets a bucket of its own
        "dp=2,many buckets": ("parallel.dp=2", "train.bucket_mb=0.01"),
    }
    for i, (name, extra) in enumerate(layouts.items()):
        assert_same_run(small_config(byte_cache, *extra, f'log.out_dir="{tmp_path}/{i}"'), reference, name)
    assert reference[0][-1] < reference[0][0]  # it is actually training


def evaluate_run(cfg: Config) -> dict[int, float]:
    return train(cfg, quiet=True).val_losses


@pytest.mark.multirank
def test_validation_losses_match_under_dp(byte_cache, tmp_path):
    """Evaluation shards the validation batches over dp ranks; the mean is the single process's."""
    evals = ("train.steps=3", "train.eval_every=2", "train.eval_batches=2")
    reference = spawn(evaluate_run, 1, small_config(byte_cache, *evals))[0]
    cfg = small_config(byte_cache, *evals, "parallel.dp=2", f'log.out_dir="{tmp_path}"')
    got = spawn(evaluate_run, 2, cfg)[0]
    assert sorted(reference) == sorted(got) == [2, 3]
    np.testing.assert_allclose([got[s] for s in (2, 3)], [reference[s] for s in (2, 3)], rtol=LOSS_RTOL)


def step_after_set_to_none():
    mesh = Mesh(ParallelDims(dp=2), "cpu")
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    _sync = DataParallel(model, mesh.group("dp_cp"))
    torch.optim.SGD(model.parameters(), lr=0.1).zero_grad(set_to_none=True)  # detaches .grad from the bucket
    model(torch.full((1, 4), float(mesh.coordinate("dp") + 1))).sum().backward()
    return model.weight.grad.clone()


@pytest.mark.multirank
def test_gradients_still_synchronized_after_optimizer_zero_grad():
    first, second = spawn(step_after_set_to_none, 2, timeout_s=60)
    torch.testing.assert_close(first, second)
    assert torch.all(first == 1 + 2)
