"""The output head and the cross-entropy together, in chunks of tokens: the loss without the logits.

The head's logits are the biggest activation of a step: [T, V] for T tokens and a vocabulary
of V, and the full path holds them three times (the matmul's output, its fp32 upcast for the
softmax and the fp32 gradient). `LossHead` computes the sum of token losses from the hidden
state [T, h] a chunk of C tokens at a time (`train.loss_chunk_tokens`), and in the same pass
each chunk's gradients, so that at most one chunk's logits [C, V] exist at any time:

    for each chunk c of C tokens:
        logits_c = hidden_c @ W^T            [C, V]  (bf16 under autocast, as the full path)
        loss_c   = token losses (fp32)       [C]
        dhidden_c, dW += d(sum loss_c) / d(hidden_c, W)   (autograd on the chunk, then freed)

Backward (`_ChunkedHeadLoss.backward`) only scales the kept dhidden [T, h] and dW [V, h] (fp32)
by the incoming gradient: the head costs the same three matmuls as the full path, and its
weight is read only in the forward (ZeRO-3 gathers it once for all chunks). The per-chunk
gradients come from PyTorch's own kernels on the same operations as the full path, so in fp32
the token losses are those of the full path and the gradients match to rounding.

The token losses of a chunk come from a function of (logits [C, V/t], targets [C]): the plain
cross-entropy on one rank, the vocabulary-parallel one under tensor parallelism
(`fivecut.parallel.tensor.vocab_parallel_token_losses`, which reduces max and sum-exp over tp
for each chunk). With `targets` absent the head returns the logits (evaluation, generation).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from fivecut.model.transformer import softcap

TokenLosses = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (logits [C, V/t], targets [C]) -> [C] fp32


def cross_entropy_per_token(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Each token's cross-entropy in fp32: logits [C, V], targets [C] -> [C]."""
    return F.cross_entropy(logits.float(), targets, reduction="none")


def compute_weight(weight: torch.Tensor, device_type: str) -> torch.Tensor:
    """The weight the chunks' matmuls read: cast once to the autocast dtype (not once per chunk)."""
    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        return weight.to(torch.get_autocast_dtype(device_type))
    return weight


def own_saved_tensors():
    """A chunk's graph lives and dies inside the forward: its saved tensors stay as they are, out of
    reach of an outer saved-tensors hook (sequence parallelism's re-gather, the activation count)."""
    return torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)


def chunk_bounds(tokens: int, chunk: int) -> list[tuple[int, int]]:
    return [(start, min(start + chunk, tokens)) for start in range(0, tokens, chunk)]


class _ChunkedHeadLoss(torch.autograd.Function):
    """sum over tokens of token_losses(hidden @ W^T, targets), chunk by chunk; hidden [T, h],
    weight [V/t, h], targets [T]. The forward keeps d/dhidden [T, h] and d/dW [V/t, h] (fp32)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk: int, token_losses: TokenLosses):
        w = compute_weight(weight.detach(), hidden.device.type).requires_grad_()
        losses = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)  # [T]
        grad_hidden = torch.empty_like(hidden)  # [T, h]
        grad_weight = None  # a frozen head ([lora]) has no d/dW to make
        if weight.requires_grad:
            grad_weight = torch.empty(weight.shape, dtype=torch.float32, device=weight.device)  # [V/t, h]
        for i, (start, end) in enumerate(chunk_bounds(hidden.shape[0], chunk)):
            accumulate_chunk(
                hidden[start:end],
                w,
                targets[start:end],
                token_losses,
                losses[start:end],
                grad_hidden[start:end],
                grad_weight,
                first=i == 0,
            )
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        return losses.sum()

    @staticmethod
    def backward(ctx, grad):
        grad_hidden, grad_weight = ctx.saved_tensors
        # d/dW scaled in place: this graph runs backward once, and a fresh [V/t, h] would cost its
        # page faults again (the CPU maps a tensor that large afresh each time)
        dw = grad_weight.mul_(grad).to(ctx.weight_dtype) if grad_weight is not None else None
        return grad_hidden * grad, dw, None, None, None


def accumulate_chunk(
    hidden, w, targets, token_losses: TokenLosses, losses, grad_hidden, grad_weight, first: bool
) -> None:
    """One chunk of C tokens: its token losses into `losses` [C], d/dhidden into `grad_hidden` [C, h],
    d/dW written (`first`) or added to `grad_weight` [V/t, h] (fp32; None: a frozen head). Its logits [C, V/t] and
    gradients die on return, before the next chunk makes its own. Autograd gives d/dhidden and,
    on the way, d/dlogits; dW is autograd's own product for a linear layer ((x^T dlogits)^T),
    written straight into `grad_weight` in fp32: no [V/t, h] zeros, no temporary."""
    # x cast to w's dtype here, not by autocast, whose cache would keep each chunk's cast of this
    # tensor to the end of the autocast region: [T, h] in bf16 by the last chunk
    x = hidden.detach().to(w.dtype).requires_grad_()  # [C, h]
    seen: list[torch.Tensor] = []  # d/dlogits [C, V/t], as backward passes it
    with torch.enable_grad(), own_saved_tensors():
        logits = F.linear(x, w.detach())  # [C, V/t]
        logits.register_hook(seen.append)
        chunk_losses = token_losses(logits, targets)  # [C]
        del logits  # freed once the cross-entropy has what it keeps
        (grad_x,) = torch.autograd.grad(chunk_losses.sum(), x)
    losses.copy_(chunk_losses.detach())
    grad_hidden.copy_(grad_x)  # back in the hidden state's dtype
    grad_logits = seen.pop()
    if grad_weight is None:
        return
    into = grad_weight.t()  # [h, V/t], where x^T dlogits lands
    if grad_logits.dtype != torch.float32:  # bf16 products, summed in fp32
        into.copy_(x.detach().t() @ grad_logits) if first else into.add_(x.detach().t() @ grad_logits)
    elif first:
        torch.mm(x.detach().t(), grad_logits, out=into)
    else:
        into.addmm_(x.detach().t(), grad_logits)


def chunked_loss_sum(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int, token_losses: TokenLosses
) -> torch.Tensor:
    """Sum of token losses of the head `weight` [V/t, h] over hidden [T, h], `chunk` tokens at a time."""
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return _ChunkedHeadLoss.apply(hidden, weight, targets, chunk, token_losses)
    w = compute_weight(weight, hidden.device.type)
    bounds = chunk_bounds(hidden.shape[0], chunk)
    return sum(token_losses(F.linear(hidden[a:b], w), targets[a:b]).sum() for a, b in bounds)


class LossHead(nn.Module):
    """The output projection [V(/t), h] that, given targets, returns the sum of token losses computed
    in chunks of `chunk` tokens (never the whole logits); without targets, the logits [b, s, V(/t)].
    Keeps the head's parameter path (`output.weight`) and a tied embedding's Parameter. With `cap` > 0
    (Gemma 2's final_logit_softcapping) each chunk's logits are soft-capped, cap tanh(logits / cap),
    before its token losses: element by element, so on a vocabulary shard as on the whole row. (The
    logits without targets are capped by the model, `Transformer.logits`.)"""

    def __init__(self, linear: nn.Linear, chunk: int, cap: float = 0.0):
        super().__init__()
        self.weight = linear.weight  # [V, h], the same Parameter
        self.out_features = linear.out_features
        self.chunk, self.cap = chunk, cap
        self.token_losses: TokenLosses = cross_entropy_per_token  # tensor parallelism sets the vocab-parallel one

    def forward(self, hidden: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        if targets is None:
            return F.linear(hidden, self.weight)  # [b, s, V(/t)]
        flat = hidden.flatten(0, 1)  # [b*s, h]
        return chunked_loss_sum(flat, self.weight, targets.flatten(), self.chunk, self.capped_token_losses)

    def capped_token_losses(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """`token_losses` of the soft-capped logits [C, V/t] (of the logits themselves without a cap)."""
        return self.token_losses(softcap(logits, self.cap), targets)


def install_loss_head(stage: nn.Module, chunk: int) -> None:
    """Replace the head of a model (or pipeline stage; one without a head is left as it is) by a
    `LossHead` of `chunk` tokens, soft-capped as the model's logits are (`ModelArgs.logit_softcap`)."""
    if stage.output is not None:
        stage.output = LossHead(stage.output, chunk, stage.args.logit_softcap)
