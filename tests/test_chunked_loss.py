"""The head and loss in chunks of tokens (`fivecut.parallel.loss`) against the full logits.

Tolerances (fp32): each token's loss is the full path's to rounding (fivecut's max, exp and sum
against torch's log-softmax, both within 1e-6 of float64), so the loss matches to rtol 1e-6; the
gradients differ only in rounding and the order of sums (dW summed chunk by chunk, the 1/N scale
applied after the matmuls instead of before): rtol 1e-5, atol 1e-7. Over optimizer steps, on every
layout: losses and gradient norms rtol 1e-5 (`assert_same_run`).
bf16 autocast: the chunked path rounds like the full one (bf16 matmuls, fp32 softmax); its dW
is summed in fp32 over chunks instead of one bf16 matmul, and the 1/N scale meets bf16 gradients
after their rounding instead of before: loss rtol 1e-3, each gradient within 2% of its norm.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_bad_input import refused, train_argv
from test_ddp import assert_same_run, single_process_run, small_config

from fivecut.launch import spawn
from fivecut.layout import ParallelDims
from fivecut.mesh import Mesh
from fivecut.model.presets import get_preset
from fivecut.model.transformer import build_model
from fivecut.parallel.loss import LossHead, install_loss_head
from fivecut.parallel.parallelize import ParallelizeOptions, parallelize, token_loss_sum
from fivecut.train.memory import LiveTensorBytes

GRAD_TOL = dict(rtol=1e-5, atol=1e-7)
CHUNK = 48  # tokens: uneven on every layout below (256, 128 and 64 tokens per rank and microbatch)
FULL = "train.loss_chunk_tokens=0"


def batch(vocab: int, rows: int = 3, seq: int = 17, masked: bool = False):
    """inputs, targets [rows, seq - 1]; `masked`: every third target left out (-100, as a loss mask leaves it)."""
    tokens = torch.randint(0, vocab, (rows, seq), generator=torch.Generator().manual_seed(1))
    targets = tokens[:, 1:].clone()
    if masked:
        targets[:, ::3] = -100
    return tokens[:, :-1], targets


def loss_and_grads(model, inputs, targets, chunked: bool):
    loss = (model(inputs, None, targets) if chunked else token_loss_sum(model(inputs), targets)) / targets.numel()
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


# tiny-gpt2: the head tied to the embedding; masked: rows left out get no loss and no gradient
@pytest.mark.parametrize("preset, masked", [("tiny", False), ("tiny-gpt2", False), ("tiny", True)])
def test_loss_and_every_gradient_match_the_full_logits(preset, masked):
    args = get_preset(preset)
    full, chunked = build_model(args, seed=0), build_model(args, seed=0)
    install_loss_head(chunked, 7)  # 48 tokens: six chunks of 7 and one of 6
    inputs, targets = batch(args.vocab_size, masked=masked)
    ref_loss, ref_grads = loss_and_grads(full, inputs, targets, chunked=False)
    loss, grads = loss_and_grads(chunked, inputs, targets, chunked=True)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    assert grads.keys() == ref_grads.keys()
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, **GRAD_TOL, msg=lambda m, n=name: f"{n}: {m}")
    with torch.no_grad():  # evaluation: the same loss, no gradients kept; without targets, the logits
        torch.testing.assert_close(chunked(inputs, None, targets) / targets.numel(), ref_loss, rtol=1e-6, atol=0)
        torch.testing.assert_close(chunked(inputs), full(inputs), rtol=0, atol=0)


def test_bf16_autocast_rounds_like_the_full_path():
    args = get_preset("tiny")
    full, chunked = build_model(args, seed=0), build_model(args, seed=0)
    install_loss_head(chunked, 7)
    inputs, targets = batch(args.vocab_size)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_loss, ref_grads = loss_and_grads(full, inputs, targets, chunked=False)
        loss, grads = loss_and_grads(chunked, inputs, targets, chunked=True)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-3, atol=0)
    for name, g in ref_grads.items():
        assert grads[name].dtype == torch.float32
        assert (grads[name] - g).norm() <= 2e-2 * g.norm(), name


def test_the_loss_peak_is_under_a_quarter_of_the_full_logits():
    """The `small` preset (V = 50,257) at 8 x 512 tokens, at the default chunk: the peak of the
    tensors one forward + backward of the head and loss creates, on the meta device (real shapes:
    the same tensors and lifetimes as on the CPU, which benchmarks/loss.py measures)."""
    args = get_preset("small")
    hidden = torch.empty(8, 512, args.dim, device="meta", requires_grad=True)  # [b, s, h]
    head = torch.nn.Linear(args.dim, args.vocab_size, bias=False, device="meta")
    targets = torch.zeros(8, 512, dtype=torch.long, device="meta")
    with LiveTensorBytes() as live:
        token_loss_sum(head(hidden), targets).backward()
    full = live.peak
    chunk = 512  # an eighth of the tokens (the default, 2048, is sized for a GPU's FLOP-to-byte ratio)
    with LiveTensorBytes() as live:
        LossHead(head, chunk)(hidden, targets).backward()
    assert full > 3 * 4096 * args.vocab_size * 4  # logits, their softmax and gradient, fp32
    assert live.peak <= full / 4, (live.peak, full)


# ---------------------------------------------------------------- ZeRO-3: one gather for all chunks


def zero3_gathers(chunk: int):
    mesh = Mesh(ParallelDims(dp=2, zero=3), "cpu")
    par = parallelize(build_model(get_preset("tiny"), device="meta"), mesh, ParallelizeOptions(loss_chunk_tokens=chunk))
    inputs, targets = batch(get_preset("tiny").vocab_size)
    par.forward_loss(inputs, None, targets).backward()
    par.sync.reduce()
    return [dataclasses.astuple(r)[1:] for r in mesh.ledger.records], [g.clone() for g in par.grads]


@pytest.mark.multirank
def test_zero3_gathers_the_head_once_not_once_per_chunk():
    full = spawn(zero3_gathers, 2, 0)
    for (records, grads), (ref_records, ref_grads) in zip(spawn(zero3_gathers, 2, 7), full):
        assert records == ref_records  # every collective, its bytes and phase: the same as the full path's
        for g, ref in zip(grads, ref_grads):  # summed in another order: an element far below the tensor's
            scale = ref.abs().max().item()  # scale may move by more than 1e-7 (1.7e-7 in 32,704 seen on an EPYC)
            torch.testing.assert_close(g, ref, rtol=GRAD_TOL["rtol"], atol=GRAD_TOL["rtol"] * scale)


# ---------------------------------------------------------------- layouts, over optimizer steps

LAYOUTS = {
    "one process": (),
    "tp=2": ("parallel.tp=2",),
    "tp=2,sp": ("parallel.tp=2", "parallel.sp=true"),
    "cp=2": ("parallel.cp=2",),
    "dp=2,zero=3": ("parallel.dp=2", "parallel.zero=3"),
}


@pytest.mark.multirank
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_losses_over_steps(name, byte_cache, tmp_path):
    cfg = small_config(byte_cache, f"train.loss_chunk_tokens={CHUNK}", *LAYOUTS[name], f'log.out_dir="{tmp_path}/l"')
    assert_same_run(cfg, single_process_run(byte_cache, FULL), name)


@pytest.mark.multirank
@pytest.mark.parametrize("schedule", ['"1f1b"', '"dualpipev"'])
def test_pipeline_with_a_tied_head(schedule, byte_cache, tmp_path):
    """tiny-gpt2: the head is the embedding; 1F1B holds it on both ends (its gradient summed over
    them), DualPipeV on rank 0, where the loss head's gradient reaches the embedding's Parameter."""
    gpt2 = ('model.preset="tiny-gpt2"', "model.n_layers=4", 'data.tokenizer="gpt2"', "train.steps=3")
    cfg = small_config(
        byte_cache, *gpt2, f"train.loss_chunk_tokens={CHUNK}", "parallel.pp=2",
        f"parallel.pp_schedule={schedule}", "parallel.microbatches=4", f'log.out_dir="{tmp_path}/p"',
    )  # fmt: skip
    assert_same_run(cfg, single_process_run(byte_cache, *gpt2, FULL), schedule)


def test_a_negative_chunk_is_refused(capsys, tmp_path, monkeypatch):
    import fivecut.launch

    def started(*args, **kwargs):
        raise AssertionError("a process was started for a bad input")

    monkeypatch.setattr(fivecut.launch, "spawn", started)
    err = refused(capsys, train_argv(tmp_path, "train.loss_chunk_tokens=-1"))
    assert err.count("\n") == 1 and "train.loss_chunk_tokens=-1" in err
    assert not (tmp_path / "run").exists()
