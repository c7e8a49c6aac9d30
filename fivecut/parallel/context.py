"""Context parallelism (CP): cut the sequence over `cp` ranks, everywhere but inside attention.

Each of the cp ranks of a group holds the same rows of the batch but only its chunk of the
sequence: tokens [c*s/cp, (c+1)*s/cp) for rank c, with their own RoPE positions. Every
layer except attention works token by token, so it runs on the chunk unchanged; the
gradients of all parameters are summed over dp x cp (the cp ranks saw different tokens).

Attention needs every earlier token. DeepSpeed-Ulysses trades the sequence cut for a head
cut around the attention core:

    q, k, v [b, H, s/cp, hd]  --all-to-all-->  [b, H/cp, s, hd]    (heads scattered, sequence gathered)
    causal attention over the whole sequence, for H/cp heads
    o [b, H/cp, s, hd]        --all-to-all-->  [b, H, s/cp, hd]

four all-to-alls per layer forward (q, k, v, o; each rank keeps 1/cp of every tensor and
sends the rest) and four backward. H must divide by cp; with grouped-query attention the
kv heads are split too when they divide by cp, and otherwise repeated up to the query heads
first. Under tensor parallelism H is a rank's local heads.

Ring attention keeps the sequence cut. Causal attention gives later tokens more work, so the
sequence is cut into 2*cp chunks and rank r holds chunks r and 2cp-1-r (load balance). Each
rank attends its queries to its own K/V block, then passes the block to the next rank of the
ring and receives the previous rank's, cp-1 times; the partial results are merged with their
log-sum-exps (online softmax), the causal mask taken from the blocks' positions. Backward
sends the K/V gradients the reverse way round the ring. Each pass moves one K/V block per
rank: 2*(cp-1) blocks sent and received per layer, forward and backward. The blocks are
computed with plain tensor ops (no fused kernel returns the log-sum-exp on CPU), so autograd
keeps each block's scores for backward: O(s^2/cp) per rank rather than a flash kernel's O(s).
"""

from __future__ import annotations

import torch
from torch import nn

from fivecut import comm
from fivecut.comm import Group
from fivecut.model.transformer import Attention


def sequence_chunk(inputs: torch.Tensor, targets: torch.Tensor, group: Group, mode: str = "ulysses"):
    """This cp rank's part of a batch [b, s] -> inputs, targets [b, s/cp] and their positions
    [s/cp]: one contiguous chunk (Ulysses) or chunks r and 2cp-1-r of 2cp (ring)."""
    s = inputs.shape[1]
    if mode == "ring":
        positions = zigzag_positions(group.rank, group.size, s // group.size, inputs.device)
    else:
        size = s // group.size
        positions = torch.arange(group.rank * size, (group.rank + 1) * size, device=inputs.device)
    return inputs[:, positions], targets[:, positions], positions


def zigzag_positions(rank: int, cp: int, local: int, device=None) -> torch.Tensor:
    """Positions held by ring rank `rank`: chunks rank and 2cp-1-rank, `local` // 2 tokens each."""
    half = local // 2
    first, second = rank * half, (2 * cp - 1 - rank) * half
    return torch.cat([torch.arange(first, first + half), torch.arange(second, second + half)]).to(device)


def heads_to_sequence(x: torch.Tensor, group: Group) -> torch.Tensor:
    """[b, H, s/c, hd] (all heads, my chunk) -> [b, H/c, s, hd] (my heads, the whole sequence)."""
    b, h, s, d = x.shape
    c = group.size
    x = x.reshape(b, c, h // c, s, d).transpose(0, 1).contiguous()  # [c, b, H/c, s/c, hd]: head group i goes to rank i
    y = comm.all_to_all(x, group)  # [c, b, H/c, s/c, hd]: from rank j, its sequence chunk j
    return y.permute(1, 2, 0, 3, 4).reshape(b, h // c, c * s, d)


def sequence_to_heads(y: torch.Tensor, group: Group) -> torch.Tensor:
    """The inverse: [b, H/c, s, hd] -> [b, H, s/c, hd], laid out in memory as [b, s/c, H, hd]
    (as attention's output is), so that merging the heads afterwards is a view, not a copy."""
    b, hc, s, d = y.shape
    c = group.size
    y = y.reshape(b, hc, c, s // c, d).permute(2, 0, 1, 3, 4).contiguous()  # [c, b, H/c, s/c, hd]: chunk j to rank j
    x = comm.all_to_all(y, group)  # [c, b, H/c, s/c, hd]: from rank i, its head group i of my chunk
    return x.permute(1, 3, 0, 2, 4).reshape(b, s // c, c * hc, d).transpose(1, 2)  # [b, H, s/c, hd]


class UlyssesAttention(nn.Module):
    """Wraps an attention core (q, k, v -> o, causal over the sequence it is given)."""

    def __init__(self, inner: nn.Module, group: Group):
        super().__init__()
        self.inner = inner
        self.group = group

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if k.shape[1] % self.group.size:  # too few kv heads to split: one per query head
            repeat = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        q, k, v = (heads_to_sequence(t, self.group) for t in (q, k, v))  # [b, heads/c, s, hd]
        return sequence_to_heads(self.inner(q, k, v), self.group)  # [b, H, s/c, hd]


class _RingPass(torch.autograd.Function):
    """Send x to the next rank of the ring, return the previous rank's; backward: the reverse."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _shift(x, group, 1)

    @staticmethod
    def backward(ctx, grad):
        return _shift(grad, ctx.group, -1), None


def _shift(x: torch.Tensor, group: Group, step: int) -> torch.Tensor:
    out = torch.empty_like(x)
    to, frm = (group.rank + step) % group.size, (group.rank - step) % group.size
    for work in comm.batch_send_recv([(x.contiguous(), to)], [(out, frm)], group):
        comm.wait(work, "send/recv", group)
    return out


def block_attention(q, k, v, pos_q, pos_k) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of q [b, H, sq, hd] to one K/V block [b, KV, sk, hd] at positions pos_q,
    pos_k: the block's output [b, H, sq, hd] and log-sum-exp [b, H, sq]. A query that sees no
    key of the block gets a log-sum-exp near the dtype's minimum: its output weighs nothing."""
    if k.shape[1] != q.shape[1]:  # grouped-query attention: each kv head serves H/KV query heads
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5  # [b, H, sq, sk]
    visible = pos_q.unsqueeze(1) >= pos_k.unsqueeze(0)  # [sq, sk]
    scores = scores.masked_fill(~visible, torch.finfo(scores.dtype).min)
    return scores.softmax(-1) @ v, scores.logsumexp(-1)


def merge(o, lse, o_block, lse_block):
    """Online softmax: combine two partial attentions over disjoint key sets."""
    if o is None:
        return o_block, lse_block
    total = torch.logaddexp(lse, lse_block)  # [b, H, sq]
    return o * (lse - total).exp().unsqueeze(-1) + o_block * (lse_block - total).exp().unsqueeze(-1), total


class RingAttention(nn.Module):
    """Causal attention over the whole sequence, K/V blocks passed around the cp ring."""

    def __init__(self, group: Group):
        super().__init__()
        self.group = group

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        c, r, local = self.group.size, self.group.rank, q.shape[2]
        pos_q = zigzag_positions(r, c, local, q.device)
        kv = torch.stack([k, v])  # [2, b, KV, s/cp, hd]: one message per pass
        o = lse = None
        for step in range(c):
            if step > 0:
                kv = _RingPass.apply(kv, self.group)  # now the block of rank r - step
            pos_k = zigzag_positions((r - step) % c, c, local, q.device)
            o, lse = merge(o, lse, *block_attention(q, kv[0], kv[1], pos_q, pos_k))
        return o  # [b, H, s/cp, hd]


def apply_context_parallel(model: nn.Module, group: Group, mode: str = "ulysses") -> list[str]:
    """Ulysses around, or ring attention instead of, every attention core of `model` (a model or
    a pipeline stage). Returns the paths of the attention modules changed."""
    changed = []
    for path, attention in model.named_modules():
        if isinstance(attention, Attention):
            attention.core = UlyssesAttention(attention.core, group) if mode == "ulysses" else RingAttention(group)
            changed.append(path)
    return changed
