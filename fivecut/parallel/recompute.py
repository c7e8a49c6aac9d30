"""Activation recomputation: keep less for backward, compute it again there.

Two modes, applied from outside to the blocks a layer-id rule picks (`recomputed`):

* full: a block keeps only its inputs (the residual stream x [b, s(/t under SP), h] and the
  RoPE tables); its whole forward runs again in backward (`torch.utils.checkpoint`,
  non-reentrant). Everything inside runs again, collectives included: TP/SP regions,
  Ulysses' all-to-alls, ring passes, MoE dispatch and combine.
* selective (Korthikanti et al., "Reducing Activation Recomputation in Large Transformer
  Models"): the outputs of the matmuls are kept, the cheap-to-recompute parts between them
  are not: the attention core (SDPA; for Ulysses the inner core between the all-to-alls)
  keeps only q, k, v and runs again in backward, and the SwiGLU product silu(w1 x) * w3 x
  (dense MLPs, shared experts and routed experts) keeps w1 x and w3 x, not the product
  nor silu(w1 x). No collective runs again.

A block is chosen when `layer_id % every == 0` (layer ids of the whole model, so a pipeline
stage recomputes the same blocks the single-device model would). Ring attention's core is left
as it is under `selective`: its backward is its own.

A recomputed MoE forward repeats its all-to-alls, but marks its runtime `replaying`, so the
load statistics (and with them the aux-free bias update and EPLB's window) count each token once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from fivecut.model.transformer import GATE_ACTIVATIONS, Attention, CausalSDPA, FeedForward, LatentAttention, MoE
from fivecut.parallel.saved import SavedActivations
from fivecut.plan.activations import recomputed


def apply_recompute(stage: nn.Module, mode: str, every: int, saved: SavedActivations) -> tuple[list[str], list[str]]:
    """Recompute the chosen blocks of `stage` (a model or a pipeline stage) in `mode`.
    Returns (the block paths changed, the block paths expected to change)."""
    if mode == "none":
        return [], []
    expected = [f"layers.{n}" for n, block in stage.layers.items() if recomputed(block.layer_id, every)]
    done = []
    for name, block in stage.layers.items():
        if recomputed(block.layer_id, every):
            (recompute_block if mode == "full" else recompute_selectively)(block, saved)
            done.append(f"layers.{name}")
    return done, expected


# ---------------------------------------------------------------- full


@dataclass
class BlockCheckpoint:
    """Stands in for a block's `forward`: runs it under a checkpoint that keeps its inputs only.
    The block's module hooks (ZeRO-3's gather, the layer tracking) stay outside: they fire once,
    and ZeRO-3 gathers the unit for backward before the recomputation reads its parameters."""

    forward: object  # the block's own forward (x [b, s, h], rope) -> [b, s, h]
    saved: SavedActivations
    runtimes: list = field(default_factory=list)  # the MoE runtimes inside: marked while replaying

    def __call__(self, x: torch.Tensor, rope, documents=None) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return self.forward(x, rope, documents)
        self.saved.count_kept(x, *rope)  # what the checkpoint holds, by closure
        calls = []

        def run(x, rope, documents):
            calls.append(None)
            for rt in self.runtimes:
                rt.replaying = len(calls) > 1
            try:
                return self.forward(x, rope, documents)
            finally:
                for rt in self.runtimes:
                    rt.replaying = False

        # no randomness in the forward (no dropout): the RNG state need not be kept
        return checkpoint(run, x, rope, documents, use_reentrant=False, preserve_rng_state=False)


def recompute_block(block: nn.Module, saved: SavedActivations) -> None:
    runtimes = [m.runtime for m in block.modules() if isinstance(m, MoE) and m.runtime is not None]
    block.forward = BlockCheckpoint(block.forward, saved, runtimes)


# ---------------------------------------------------------------- selective


class RecomputedCore(nn.Module):
    """An attention core that keeps q, k, v [b, heads, s, hd] only (no output, no log-sum-exp)."""

    def __init__(self, inner: nn.Module, saved: SavedActivations):
        super().__init__()
        self.inner = inner
        self.saved = saved

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents=None, *sinks) -> torch.Tensor:
        """`sinks`: GPT-OSS's [H], when the attention has them, handed to the inner core."""
        if not torch.is_grad_enabled():
            return self.inner(q, k, v, documents, *sinks)
        self.saved.count_kept(q, k, v)
        return checkpoint(self.inner, q, k, v, documents, *sinks, use_reentrant=False, preserve_rng_state=False)


def wrap_core(attention: Attention | LatentAttention, saved: SavedActivations) -> None:
    """Wrap the innermost plain core (CausalSDPA; inside Ulysses, the one between the all-to-alls)."""
    holder, name = attention, "core"
    while hasattr(getattr(holder, name), "inner"):
        holder, name = getattr(holder, name), "inner"
    if isinstance(getattr(holder, name), CausalSDPA):
        setattr(holder, name, RecomputedCore(getattr(holder, name), saved))


def gate_backward(grad: torch.Tensor, a: torch.Tensor, activation: str) -> torch.Tensor:
    """d/da of activation(a) given d/d(activation(a)): silu's, or GELU's tanh approximation's (GeGLU)."""
    if activation == "gelu_tanh":
        return torch.ops.aten.gelu_backward(grad, a, approximate="tanh")
    return torch.ops.aten.silu_backward(grad, a)


class _SwiGLUDown(torch.autograd.Function):
    """out = linear(act(a) * b, weight) (act: silu, or GeGLU's GELU): keeps a, b [..., F] and weight [h, F]
    (the matmul outputs w1 x, w3 x and the down projection); the product is computed again in backward."""

    @staticmethod
    def forward(ctx, a, b, weight, activation: str):
        ctx.save_for_backward(a, b, weight)
        ctx.activation = activation
        return F.linear(GATE_ACTIVATIONS[activation](a) * b, weight)  # [..., h]

    @staticmethod
    def backward(ctx, grad):  # grad [..., h]
        a, b, weight = ctx.saved_tensors
        gate = GATE_ACTIVATIONS[ctx.activation](a)
        product = gate * b  # [..., F]
        grad_product = grad @ weight  # [..., F]
        grad_weight = grad.flatten(0, -2).t() @ product.flatten(0, -2)  # [h, F]
        grad_a = gate_backward(grad_product * b, a, ctx.activation)
        return grad_a, grad_product * gate, grad_weight, None


def swiglu_down(a: torch.Tensor, b: torch.Tensor, weight: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """linear(act(a) * b, weight), the product recomputed in backward (under autocast: in its dtype)."""
    dtype = torch.get_autocast_dtype(a.device.type) if torch.is_autocast_enabled(a.device.type) else None
    if dtype is not None:
        a, b, weight = a.to(dtype), b.to(dtype), weight.to(dtype)
    with torch.autocast(a.device.type, enabled=False):
        return _SwiGLUDown.apply(a, b, weight, activation)


@dataclass
class SelectiveSwiGLU:
    """Stands in for a `FeedForward`'s forward: w2(act(w1 x) * w3 x) with the product recomputed."""

    mlp: FeedForward

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        mlp = self.mlp
        return swiglu_down(mlp.w1(x), mlp.w3(x), mlp.w2.weight, mlp.activation)


def recompute_selectively(block: nn.Module, saved: SavedActivations) -> None:
    wrap_core(block.attention, saved)
    for module in block.modules():
        if isinstance(module, FeedForward):  # the dense MLP, or a MoE layer's shared experts
            module.forward = SelectiveSwiGLU(module)
        if isinstance(module, MoE) and module.runtime is not None:
            module.runtime.recompute_product = True  # the routed experts' grouped SwiGLU
