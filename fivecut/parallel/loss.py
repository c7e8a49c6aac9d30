"""The output head and the cross-entropy together, in chunks of tokens: the loss without the logits.

The head's logits are the biggest activation of a step: [T, V] for T tokens and a vocabulary
of V, and the full path holds them three times (the matmul's output, its fp32 upcast for the
softmax and the fp32 gradient). `LossHead` computes the sum of token losses from the hidden
state [T, h] a chunk of C tokens at a time (`train.loss_chunk_tokens`), and in the same pass
each chunk's gradients, so that at most one chunk's logits [C, V] exist at any time:

    for each chunk c of C tokens:
        logits_c = hidden_c @ W^T            [C, V]  (bf16 under autocast, as the full path)
        loss_c   = lse(logits_c) - logits_c[target]          (fp32)
        dlogits_c = softmax(logits_c) - onehot(target)        written over the fp32 logits
        dhidden_c = dlogits_c @ W  ;  dW += dlogits_c^T hidden_c

The softmax and its gradient are one buffer (`cross_entropy_in_place`): the logits' fp32 copy
becomes the gradient, pass by pass, with no autograd inside the chunk and no [C, V] temporary
(torch's log-softmax and NLL keep the log-probabilities, a one-hot gradient and the gradient of
the log-softmax: three more, each fresh pages on the CPU). It is also closer to float64 than the
log-softmax path (max error of the gradient 1.9e-7 against 3.0e-6 on [128, 50,257] logits).
Under tensor parallelism the logits are cut by vocabulary (`VocabShard`): the rows' maxima and
sums of exponentials, and the target logits (on the rank whose shard holds them), are reduced
over tp, and each rank's gradient is its own columns'. Gemma 2's soft cap of the final logits,
cap tanh(logits / cap), is applied to the fp32 buffer first and its slope 1 - tanh^2 multiplies
the gradient after (`TokenLoss`): element by element, so on a vocabulary shard as on a row.

Backward (`_ChunkedHeadLoss.backward`) only scales the kept dhidden [T, h] and dW [V, h] (fp32)
by the incoming gradient: the head costs the same three matmuls as the full path, and its
weight is read only in the forward (ZeRO-3 gathers it once for all chunks). With `targets` absent
the head returns the logits (evaluation, generation).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fivecut import comm
from fivecut.comm import Group

IGNORE = -100  # torch's ignore_index: a target a loss mask leaves out (no loss, no gradient)


@dataclass(frozen=True)
class VocabShard:
    """Which columns of the vocabulary a rank's logits hold: [start, start + V/t) of `vocab_size`
    real entries (columns past it are padding); `group` reduces over the shards (None: one rank)."""

    start: int = 0
    vocab_size: int = 0  # 0: every column is a real entry
    group: Group | None = None

    def all_reduce(self, x: torch.Tensor, op=torch.distributed.ReduceOp.SUM) -> None:
        if self.group is not None:
            comm.all_reduce(x, self.group, op=op)


WHOLE = VocabShard()


def cross_entropy_in_place(
    work: torch.Tensor, targets: torch.Tensor, shard: VocabShard = WHOLE, stats: torch.Tensor | None = None
) -> torch.Tensor:
    """Each token's cross-entropy [C] (fp32) from its logits `work` [C, V/t] (fp32), which become
    d(sum of the losses)/d logits = softmax - onehot(target), row by row; a row whose target is
    negative (IGNORE) gets loss 0 and gradient 0, as F.cross_entropy's ignore_index. `stats` [3, C]
    fp32: where the rows' max, sum of exponentials and target logit go, the tensors tp's all-reduces
    read and write (a caller's buffer, alive across its chunks: a backend may hold a reduced tensor a
    moment after the call returns; None: made here)."""
    stats = torch.empty(3, work.shape[0], dtype=torch.float32, device=work.device) if stats is None else stats
    top, sums = stats[0], stats[1:]  # [C]; [2, C]: the sum of exponentials and the target logit, one all-reduce
    local = targets - shard.start  # [C] the target's column in this shard
    mine = (local >= 0) & (local < work.shape[-1])  # the target lies in this shard
    index = local.clamp(0, work.shape[-1] - 1).unsqueeze(-1)  # [C, 1]
    real = shard.vocab_size - shard.start  # this shard's columns before the padding
    if shard.vocab_size and real < work.shape[-1]:
        work[:, max(real, 0) :] = float("-inf")  # the vocabulary's padding columns: probability 0
    torch.amax(work, dim=-1, out=top)
    shard.all_reduce(top, op=torch.distributed.ReduceOp.MAX)
    work.sub_(top.unsqueeze(-1))  # [C, V/t] logits - max
    sums[1].copy_(work.gather(-1, index).squeeze(-1)).masked_fill_(~mine, 0.0)  # target logit - max
    work.exp_()
    torch.sum(work, dim=-1, out=sums[0])
    shard.all_reduce(sums)
    total, picked = sums[0], sums[1]
    kept = targets >= 0
    work.mul_((kept / total).unsqueeze(-1))  # softmax, 0 on an ignored row
    work.scatter_add_(-1, index, -(mine & kept).to(work.dtype).unsqueeze(-1))  # - onehot(target)
    return (total.log() - picked).masked_fill(~kept, 0.0)


def soft_cap_in_place(work: torch.Tensor, cap: float) -> torch.Tensor:
    """Gemma 2's final-logit soft-capping: `work` [C, V/t] (fp32) becomes cap tanh(work / cap); returns
    the cap's slope, d capped / d work = 1 - tanh^2 [C, V/t], for the gradient."""
    work.div_(cap).tanh_()
    slope = work.square().neg_().add_(1)
    work.mul_(cap)
    return slope


@dataclass(frozen=True)
class TokenLoss:
    """What turns a chunk's logits into token losses: the shard of the vocabulary they cover (tensor
    parallelism sets it) and the soft cap of Gemma 2's final logits (0: none)."""

    shard: VocabShard = WHOLE
    cap: float = 0.0

    def __call__(self, work: torch.Tensor, targets: torch.Tensor, stats: torch.Tensor | None = None) -> torch.Tensor:
        """Token losses [C] (fp32) of logits `work` [C, V/t] (fp32), which become d(their sum)/d logits;
        `stats`: `cross_entropy_in_place`'s."""
        slope = soft_cap_in_place(work, self.cap) if self.cap else None  # [C, V/t]
        losses = cross_entropy_in_place(work, targets, self.shard, stats)
        if slope is not None:
            work.mul_(slope)  # through the cap: d/d logits = d/d capped * (1 - tanh^2)
        return losses


def compute_weight(weight: torch.Tensor, device_type: str) -> torch.Tensor:
    """The weight the chunks' matmuls read: cast once to the autocast dtype (not once per chunk)."""
    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        return weight.to(torch.get_autocast_dtype(device_type))
    return weight


def chunk_bounds(tokens: int, chunk: int) -> list[tuple[int, int]]:
    return [(start, min(start + chunk, tokens)) for start in range(0, tokens, chunk)]


class _ChunkedHeadLoss(torch.autograd.Function):
    """sum over tokens of the cross-entropy of hidden @ W^T, chunk by chunk; hidden [T, h],
    weight [V/t, h], targets [T]. The forward keeps d/dhidden [T, h] and d/dW [V/t, h] (fp32)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk: int, loss: TokenLoss):
        w = compute_weight(weight.detach(), hidden.device.type)
        losses = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)  # [T]
        grad_hidden = torch.empty_like(hidden)  # [T, h]
        grad_weight = None  # a frozen head ([lora]) has no d/dW to make
        if weight.requires_grad:
            grad_weight = torch.empty(weight.shape, dtype=torch.float32, device=weight.device)  # [V/t, h]
        # the chunks' statistics (max, sum of exponentials, target logit): one buffer for all, [3, C] each
        stats = torch.empty(3 * min(chunk, hidden.shape[0]), dtype=torch.float32, device=hidden.device)
        for i, (start, end) in enumerate(chunk_bounds(hidden.shape[0], chunk)):
            rows = slice(start, end)
            out = ChunkOut(losses[rows], grad_hidden[rows], stats[: 3 * (end - start)].view(3, end - start))
            run_chunk(hidden[rows].detach(), w, targets[rows], loss, out, grad_weight, i == 0)
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        return losses.sum()

    @staticmethod
    def backward(ctx, grad):
        grad_hidden, grad_weight = ctx.saved_tensors
        # both scaled in place: this graph runs backward once, and fresh [T, h] and [V/t, h] would be
        # memory the step's peak may meet, and on the CPU new pages each time (mapped afresh when large)
        dw = grad_weight.mul_(grad).to(ctx.weight_dtype) if grad_weight is not None else None
        return grad_hidden.mul_(grad), dw, None, None, None


@dataclass
class ChunkOut:
    """Where one chunk of C tokens writes: its token losses [C], d/dhidden [C, h] (views of the whole
    step's buffers) and its statistics [3, C] (`cross_entropy_in_place`)."""

    losses: torch.Tensor
    grad_hidden: torch.Tensor
    stats: torch.Tensor


def run_chunk(hidden, w, targets, loss: TokenLoss, out: ChunkOut, grad_weight, first: bool) -> None:
    """One chunk of C tokens: its token losses and d/dhidden into `out`, d/dW written (`first`) or added
    into `grad_weight` [V/t, h] (fp32; None: a frozen head). Its logits' gradient [C, V/t] dies on
    return, before the next chunk makes its own."""
    x = hidden.to(w.dtype)  # [C, h]
    grad_logits = chunk_gradient(x, w, targets, loss, out)  # [C, V/t]
    out.grad_hidden.copy_(grad_logits @ w)  # back in the hidden state's dtype
    if grad_weight is not None:
        add_weight_gradient(grad_weight, x, grad_logits, first)


def chunk_gradient(x: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, loss: TokenLoss, out: ChunkOut):
    """One chunk of C tokens: its token losses written into `out.losses` [C]; returns d(their sum)/d logits
    [C, V/t] in the matmuls' dtype (w's). The chunk's logits and their gradient are one buffer."""
    work = F.linear(x, w).float()  # [C, V/t]: the matmul's own output in fp32, an fp32 copy under bf16
    out.losses.copy_(loss(work, targets, out.stats))
    return work.to(w.dtype)


def add_weight_gradient(grad_weight: torch.Tensor, x: torch.Tensor, grad_logits: torch.Tensor, first: bool) -> None:
    """d/dW = (x^T dlogits)^T, written (`first`) or added into `grad_weight` [V/t, h] (fp32): no [V/t, h]
    zeros, no temporary in fp32; bf16 products are summed in fp32."""
    into = grad_weight.t()  # [h, V/t], where x^T dlogits lands
    if grad_logits.dtype != torch.float32:
        into.copy_(x.t() @ grad_logits) if first else into.add_(x.t() @ grad_logits)
    elif first:
        torch.mm(x.t(), grad_logits, out=into)
    else:
        into.addmm_(x.t(), grad_logits)


def chunked_loss_sum(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int, loss: TokenLoss | None = None
) -> torch.Tensor:
    """Sum of token losses of the head `weight` [V/t, h] over hidden [T, h], `chunk` tokens at a time."""
    loss = loss or TokenLoss()
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return _ChunkedHeadLoss.apply(hidden, weight, targets, chunk, loss)
    w = compute_weight(weight, hidden.device.type)
    bounds = chunk_bounds(hidden.shape[0], chunk)
    return sum(loss(F.linear(hidden[a:b], w).float(), targets[a:b]).sum() for a, b in bounds)


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
        self.chunk = chunk
        self.loss = TokenLoss(cap=cap)  # tensor parallelism sets this rank's shard of the vocabulary

    def forward(self, hidden: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        if targets is None:
            return F.linear(hidden, self.weight)  # [b, s, V(/t)]
        flat = hidden.flatten(0, 1)  # [b*s, h]
        return chunked_loss_sum(flat, self.weight, targets.flatten(), self.chunk, self.loss)


def install_loss_head(stage: nn.Module, chunk: int) -> None:
    """Replace the head of a model (or pipeline stage; one without a head is left as it is) by a
    `LossHead` of `chunk` tokens, soft-capped as the model's logits are (`ModelArgs.logit_softcap`)."""
    if stage.output is not None:
        stage.output = LossHead(stage.output, chunk, stage.args.logit_softcap)
