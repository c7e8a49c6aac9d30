"""Tensor and sequence parallelism parity: forward output and every parameter's gradient
(shards gathered back to full shape) against the single-device model, then losses over
optimizer steps.

Tolerances (fp32): a row-parallel matmul sums its partial products over ranks in a
different order than one matmul does, so
  - logits: rtol 1e-5, atol 1e-6;
  - gradients of the mean token loss: rtol 1e-5, atol 1e-6 (entries up to ~1e-2);
  - losses over optimizer steps: rtol 1e-5.
"""

from __future__ import annotations

import pytest
import torch
from test_ddp import assert_same_run, single_process_run, small_config

from fivecut import comm
from fivecut.launch import spawn
from fivecut.layout import ParallelDims
from fivecut.mesh import Mesh
from fivecut.model.args import ModelArgs
from fivecut.model.presets import get_preset
from fivecut.model.transformer import build_model
from fivecut.parallel.parallelize import ParallelizeError, ParallelizeOptions, parallelize, token_loss_sum
from fivecut.parallel.placement import gather_full

TOL = dict(rtol=1e-5, atol=1e-6)


def batch(vocab: int):
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (4, 33), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def model_args(preset: str | ModelArgs) -> ModelArgs:
    return get_preset(preset) if isinstance(preset, str) else preset


def reference(preset: str | ModelArgs):
    model = build_model(model_args(preset), seed=0)
    inputs, targets = batch(model.args.vocab_size)
    logits = model(inputs)
    (token_loss_sum(logits, targets) / targets.numel()).backward()
    return logits.detach(), {n: p.grad for n, p in model.named_parameters()}


def tensor_parallel_step(preset: str | ModelArgs, tp: int, sp: bool):
    """Forward + backward under tp ranks (a dense model: a MoE layer's router gradients are summed
    by the data cut, which this step leaves out); logits and gradients gathered to full shape."""
    mesh = Mesh(ParallelDims(tp=tp, sp=sp), "cpu")
    model = build_model(model_args(preset), seed=0)
    par = parallelize(model, mesh)
    group, vocab = mesh.group("tp"), model.args.vocab_size
    inputs, targets = batch(vocab)
    with par.saved.forward():
        logits = par.module(inputs)  # [b, s, V_pad / t]
    (par.loss_sum(logits, targets) / targets.numel()).backward()
    full_logits = comm.all_gather(logits.detach(), group, dim=-1)[..., :vocab]
    grads = {name: gather_full(pl, par.params[name].grad, mesh.groups) for name, pl in par.placements.items()}
    return full_logits, grads


@pytest.mark.multirank
@pytest.mark.parametrize(
    "preset,tp,sp",
    [
        ("tiny", 2, False),
        ("tiny", 4, False),
        ("tiny", 2, True),
        ("tiny", 4, True),
        ("tiny-gpt2", 2, True),
        ("tiny-gpt2", 4, False),
    ],
)
def test_forward_and_every_gradient_match_single_device(preset, tp, sp):
    # tiny: 4 heads, 2 kv heads -> tp=4 replicates kv heads; tiny-gpt2: vocab 50257 padded to 50258 / 50260
    assert_tp_step_matches_one_process(preset, tp, sp)


@pytest.mark.multirank
@pytest.mark.parametrize(
    "layout",
    [
        ("parallel.tp=2",),
        ("parallel.tp=2", "parallel.sp=true", "parallel.dp=2"),
        ("parallel.tp=2", "parallel.dp=2", "parallel.zero=3"),
    ],
)
def test_losses_over_steps(layout, byte_cache, tmp_path):
    cfg = small_config(byte_cache, *layout, f'log.out_dir="{tmp_path}/l"')
    assert_same_run(cfg, single_process_run(byte_cache), ",".join(layout))


@pytest.mark.multirank
def test_replicated_norm_weights_count_once_in_the_clip_norm(byte_cache, tmp_path):
    """Under tp=2 with SP the norm weights are replicated on both ranks (their gradients summed over
    tp); the global norm counts them once, and with clipping active (default clip 1.0 below every
    step's norm) a wrong norm would scale every gradient wrongly."""
    reference = single_process_run(byte_cache)
    assert min(reference[1]) > small_config(byte_cache).train.grad_clip  # the clip scales every step
    cfg = small_config(byte_cache, "parallel.tp=2", "parallel.sp=true", f'log.out_dir="{tmp_path}"')
    assert_same_run(cfg, reference, "tp=2,sp")


LOGITS = torch.randn(3, 5, 12, generator=torch.Generator().manual_seed(0))  # 11 real columns + 1 of padding
TARGETS = torch.tensor([[0, 10, 5, 6, 3], [7, 7, -100, 9, 2], [4, 8, 10, 0, 5]])  # -100: left out by a loss mask


def vocab_parallel_loss(tp: int):
    from fivecut.parallel.tensor import vocab_parallel_loss_sum

    group = Mesh(ParallelDims(tp=tp), "cpu").group("tp")
    local = comm.my_slice(LOGITS, -1, group).requires_grad_()  # [3, 5, 12/t]
    loss = vocab_parallel_loss_sum(local, TARGETS, group, vocab_size=11)
    loss.backward()
    return float(loss), local.grad


@pytest.mark.multirank
def test_vocab_parallel_cross_entropy_matches_and_ignores_padding_and_masked_targets():
    full = LOGITS[..., :11].clone().requires_grad_()
    ref = torch.nn.functional.cross_entropy(full.reshape(-1, 11), TARGETS.flatten(), reduction="sum")
    ref.backward()
    results = spawn(vocab_parallel_loss, 2, 2)
    for loss, _ in results:
        assert loss == pytest.approx(float(ref.detach()), rel=1e-6)
    grads = torch.cat([g for _, g in results], dim=-1)  # [3, 5, 12]
    torch.testing.assert_close(grads[..., :11], full.grad, rtol=1e-6, atol=1e-7)
    assert torch.all(grads[..., 11] == 0)  # the padding column gets no gradient


def test_parallelize_refuses_a_layer_tensor_parallelism_missed(monkeypatch):
    """A silent fallback to an unsharded layer is an error: here the MLP of layer 1 is left whole."""
    import fivecut.parallel.tensor as tensor

    real = tensor.parallelize_mlp

    def skip_layer_1(mlp, group):
        return {} if mlp is model.layers["1"].feed_forward else real(mlp, group)

    monkeypatch.setattr(tensor, "parallelize_mlp", skip_layer_1)
    model = build_model(get_preset("tiny"), device="meta")
    with pytest.raises(ParallelizeError, match="layers.1.feed_forward.w1.weight"):
        parallelize(model, Mesh.virtual(ParallelDims(tp=2)), ParallelizeOptions(device="meta"))


def assert_tp_step_matches_one_process(args, tp: int, sp: bool) -> None:
    """`tensor_parallel_step` of `args` (a preset's name or a `ModelArgs`) on `tp` ranks, with SP or
    not: each rank's logits and every gradient equal one process's (`reference`)."""
    ref_logits, ref_grads = reference(args)
    for logits, grads in spawn(tensor_parallel_step, tp, args, tp, sp):
        torch.testing.assert_close(logits, ref_logits, **TOL)
        assert grads.keys() == ref_grads.keys()
        for name, g in ref_grads.items():
            torch.testing.assert_close(grads[name], g, **TOL, msg=lambda m, n=name: f"{n}: {m}")
