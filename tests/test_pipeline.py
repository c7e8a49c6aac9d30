"""Pipeline parallelism parity: every schedule's gradients and losses against the single
process, on the real ranks, plus compositions with DP, ZeRO-1 and TP.

Tolerances (fp32): microbatches sum their token losses in a different order than one
batch does, so gradients rtol 1e-5, atol 1e-7 and losses over steps rtol 1e-5.
"""

from __future__ import annotations

import functools

import pytest
import torch
from test_ddp import GRAD_TOL, assert_same_run, single_process_run, small_config

from fivecut.launch import spawn
from fivecut.train.run import forward_backward, setup

pytestmark = pytest.mark.multirank


def step_gradients(cfg):
    """Gradients of step 1 by parameter name (stage prefixes removed), on this rank."""
    ctx = setup(cfg)
    ctx.par.sync.zero_grad()
    forward_backward(ctx, 1)
    grads = {}
    for name, p in ctx.par.module.named_parameters():
        if ctx.par.pipeline is not None:
            name = name.split(".", 1)[1]  # "3.layers.3.attention..." -> "layers.3.attention..."
        grads[name] = p.grad.clone()
    return grads


def gradients(cfg, world: int) -> dict[str, torch.Tensor]:
    merged: dict[str, torch.Tensor] = {}
    for grads in spawn(step_gradients, world, cfg):
        merged.update(grads)
    return merged


@functools.cache
def single_process_gradients(cache_dir: str) -> dict[str, torch.Tensor]:
    return gradients(small_config(cache_dir), 1)


@pytest.mark.parametrize(
    "schedule",
    [
        ('pp_schedule="gpipe"', "microbatches=4"),
        ('pp_schedule="1f1b"', "microbatches=4"),
        ('pp_schedule="interleaved"', "pp_virtual=2", "microbatches=4"),
        ('pp_schedule="zb1p"', "microbatches=4"),
        ('pp_schedule="dualpipev"', "microbatches=4"),
    ],
)
def test_every_schedule_reproduces_single_process_gradients(schedule, byte_cache, tmp_path):
    reference = single_process_gradients(byte_cache)
    cfg = small_config(
        byte_cache, "parallel.pp=2", *(f"parallel.{item}" for item in schedule), f'log.out_dir="{tmp_path}/p"'
    )
    pipelined = gradients(cfg, 2)
    assert pipelined.keys() == reference.keys()
    for name, g in reference.items():
        torch.testing.assert_close(pipelined[name], g, **GRAD_TOL, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize(
    "layout",
    [
        ("parallel.pp=4", "parallel.microbatches=8", "train.global_batch=8"),
        ("parallel.pp=2", "parallel.dp=2", "parallel.microbatches=2"),
        ("parallel.pp=2", "parallel.dp=2", "parallel.zero=1", "parallel.microbatches=2", "train.accumulate=2"),
        ("parallel.pp=2", "parallel.tp=2", "parallel.sp=true", "parallel.microbatches=2"),
        ("parallel.pp=2", 'parallel.pp_schedule="zb1p"', "parallel.microbatches=4", "parallel.pp_layers=[1,3]"),
    ],
)
def test_losses_over_steps(layout, byte_cache, tmp_path):
    cfg = small_config(byte_cache, *layout, f'log.out_dir="{tmp_path}/p"')
    assert_same_run(cfg, single_process_run(byte_cache), ",".join(layout))


@pytest.mark.parametrize("schedule", ['"1f1b"', '"dualpipev"'])
def test_tied_embeddings_across_or_on_one_rank(schedule, tmp_path, byte_cache):
    """GPT-2 vocabulary, tied embedding: 1F1B keeps a copy on each end (gradients summed over the
    two ranks, counted once in the clip norm); DualPipeV puts both ends on rank 0 (one Parameter)."""
    gpt2 = (
        'model.preset="tiny-gpt2"',
        "model.n_layers=4",
        'data.tokenizer="gpt2"',
        "train.steps=3",
        "train.grad_clip=0.5",
    )
    reference = single_process_run(byte_cache, *gpt2)
    cfg = small_config(
        byte_cache,
        *gpt2,
        "parallel.pp=2",
        f"parallel.pp_schedule={schedule}",
        "parallel.microbatches=4",
        f'log.out_dir="{tmp_path}/p"',
    )
    assert min(reference[1]) > 0.5  # the clip is active at every step
    assert_same_run(cfg, reference, schedule)
