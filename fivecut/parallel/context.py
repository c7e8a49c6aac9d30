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

Ring attention (K/V blocks passed around a ring, load-balanced causal chunks) is not in this
version: `ParallelDims.validate` refuses `cp_mode="ring"`.
"""

from __future__ import annotations

import torch
from torch import nn

from fivecut import comm
from fivecut.comm import Group


def sequence_chunk(inputs: torch.Tensor, targets: torch.Tensor, group: Group):
    """This cp rank's chunk of a batch [b, s] -> inputs, targets [b, s/cp] and positions [s/cp]."""
    s = inputs.shape[1]
    size = s // group.size
    lo = group.rank * size
    positions = torch.arange(lo, lo + size, device=inputs.device)
    return inputs[:, lo : lo + size], targets[:, lo : lo + size], positions


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


def apply_context_parallel(model: nn.Module, group: Group) -> None:
    """Ulysses around every attention core of `model` (a model or pipeline stages)."""
    from fivecut.model.transformer import Attention

    for attention in (m for m in model.modules() if isinstance(m, Attention)):
        attention.core = UlyssesAttention(attention.core, group)
