"""Tensor parallelism (Megatron): cut the weight matrices; sequence parallelism: cut the
activations between them.

Inside a block, a column-parallel linear keeps rows of W (output features) and a
row-parallel linear keeps columns (input features), so a pair needs no communication in
between. Each pair is a *region* with one collective at each end:

    attention:  f -> wq, wk, wv (column: heads)  -> attention -> wo (row)  -> g
    MLP:        f -> w1, w3     (column: hidden) -> SwiGLU    -> w2 (row)  -> g

f is the identity forward and an all-reduce of the gradient backward; g is the reverse:
two all-reduces of b*s*h per block forward, two backward. With sequence parallelism the
residual stream and the norms between regions are cut along the sequence ([b, s/t, h]):
f becomes an all-gather (backward reduce-scatter) and g a reduce-scatter (backward
all-gather) -- the same bytes, and the activations outside the regions shrink by t.

The embedding and the head are cut by vocabulary (padded to a multiple of t; the
padding rows are never looked up and are masked out of the softmax), and the
cross-entropy is computed from the local logits: max, sum of exponentials and the
target's logit are reduced across t, the logits are never gathered.

Grouped-query attention: kv heads are split when t divides them; when t is a multiple
of the kv heads instead, each rank computes the one kv head its query heads use from the
full (replicated) wk and wv, whose gradients are summed over t.

Every parameter this cut shards carries `fivecut_tp = TPShard(dim, parts)`; `parallelize`
checks each one's local shape against the full shape divided along that dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fivecut import comm
from fivecut.comm import Group
from fivecut.model.transformer import RMSNorm
from fivecut.parallel.saved import SavedActivations


@dataclass(frozen=True)
class TPShard:
    """How a parameter is cut: along `dim` into `parts`; `full` is the unpadded full shape."""

    dim: int
    parts: int
    full: tuple[int, ...]


def is_tp_sharded(p: torch.Tensor) -> bool:
    return getattr(p, "fivecut_tp", None) is not None


def shard_param(full: torch.Tensor, dim: int, group: Group, padded_size: int | None = None) -> nn.Parameter:
    """This rank's slice of `full` along `dim` (zero-padded to `padded_size` first), as a marked Parameter."""
    if padded_size is not None and padded_size > full.shape[dim]:
        pad = [0, 0] * (full.dim() - 1 - dim) + [0, padded_size - full.shape[dim]]
        full = F.pad(full, pad)
    param = nn.Parameter(comm.my_slice(full.detach(), dim, group).clone())  # its own storage: the full weight is freed
    param.fivecut_tp = TPShard(dim, group.size, tuple(full.shape))
    return param


# ---------------------------------------------------------------- region boundaries


def enter_region(x: torch.Tensor, group: Group, sequence_parallel: bool) -> torch.Tensor:
    """f: [b, s, h] replicated -> same (grad all-reduced); SP: [b, s/t, h] -> [b, s, h] all-gathered."""
    if sequence_parallel:
        return comm.gather_along(x, 1, group, grad_reduce=True)
    return comm.copy_to(x, group)


def leave_region(y: torch.Tensor, group: Group, sequence_parallel: bool) -> torch.Tensor:
    """g: partial sums [b, s, h] -> all-reduced; SP: -> reduce-scattered [b, s/t, h]."""
    if sequence_parallel:
        return comm.reduce_scatter_along(y, 1, group)
    return comm.reduce_from(y, group)


def make_region(
    module: nn.Module, group: Group, sequence_parallel: bool, saved: SavedActivations, reduce_output=True
) -> None:
    """Put f before `module`'s first input and (unless `reduce_output` is false) g after its output.
    With SP, backward keeps only the local slice of the gathered input and gathers it again."""

    def before(_module, args):
        full = enter_region(args[0], group, sequence_parallel)
        if sequence_parallel:
            saved.keep_local(full, args[0], 1, group)
        return (full, *args[1:])

    def after(_module, _args, out):
        return leave_region(out, group, sequence_parallel)

    if sequence_parallel:
        saved.regathers = True
    module.register_forward_pre_hook(before)
    if reduce_output:
        module.register_forward_hook(after)


# ---------------------------------------------------------------- layers


def column_parallel(linear: nn.Linear, group: Group, padded_out: int | None = None) -> None:
    """Keep rows of the weight [out/t, in]: this rank computes out/t output features."""
    linear.weight = shard_param(linear.weight, 0, group, padded_out)
    linear.out_features = linear.weight.shape[0]


def row_parallel(linear: nn.Linear, group: Group) -> None:
    """Keep columns of the weight [out, in/t]: this rank's partial sum over in/t input features."""
    linear.weight = shard_param(linear.weight, 1, group)
    linear.in_features = linear.weight.shape[1]


class ReplicatedKV(nn.Module):
    """k or v projection when t > n_kv_heads: the full weight on every rank, this rank's kv head
    selected; the weight's gradient (nonzero only in this rank's head rows) is summed over t."""

    def __init__(self, linear: nn.Linear, head: int, head_dim: int, group: Group):
        super().__init__()
        self.weight = linear.weight  # [n_kv * hd, h], same Parameter: replicated
        self.rows = slice(head * head_dim, (head + 1) * head_dim)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = comm.copy_to(self.weight, self.group)[self.rows]  # [hd, h]
        return F.linear(x, weight)  # [b, s, hd]: one kv head


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + V/t) of the (padded) embedding; the other ranks' tokens give zeros,
    and the partial embeddings are summed (all-reduce, or reduce-scatter along s with SP)."""

    def __init__(self, embedding: nn.Embedding, group: Group, padded_vocab: int, sequence_parallel: bool):
        super().__init__()
        self.weight = shard_param(embedding.weight, 0, group, padded_vocab)  # [V/t, h]
        self.start = group.rank * self.weight.shape[0]
        self.group = group
        self.sequence_parallel = sequence_parallel

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        local = tokens - self.start  # [b, s]
        outside = (local < 0) | (local >= self.weight.shape[0])
        h = F.embedding(local.masked_fill(outside, 0), self.weight)  # [b, s, h]
        h = h.masked_fill(outside.unsqueeze(-1), 0.0)
        return leave_region(h, self.group, self.sequence_parallel)


class SequenceParallelRMSNorm(nn.Module):
    """RMSNorm on a sequence slice [b, s/t, h]: the weight is replicated and each rank sees
    only its tokens, so the weight's gradient is summed over t (f on the weight)."""

    def __init__(self, norm: RMSNorm, group: Group):
        super().__init__()
        self.weight = norm.weight
        self.eps = norm.eps
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), comm.copy_to(self.weight, self.group), self.eps)


# ---------------------------------------------------------------- loss


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy from vocabulary-sharded logits [T, V/t]; returns [T] losses."""

    @staticmethod
    def forward(ctx, logits, targets, start, vocab_size, group):
        logits = logits.float()
        local_v = logits.shape[-1]
        columns = torch.arange(start, start + local_v, device=logits.device)
        logits = logits.masked_fill(columns >= vocab_size, float("-inf"))  # vocabulary padding
        top = logits.max(dim=-1).values  # [T]
        comm.all_reduce(top, group, op=torch.distributed.ReduceOp.MAX)
        shifted = logits - top.unsqueeze(-1)  # [T, V/t]
        exp = shifted.exp()
        total = exp.sum(dim=-1)  # [T]
        local_target = targets - start
        mine = (local_target >= 0) & (local_target < local_v)
        picked = shifted.gather(-1, local_target.clamp(0, local_v - 1).unsqueeze(-1)).squeeze(-1)
        target_logit = torch.where(mine, picked, torch.zeros_like(picked))  # [T]
        both = torch.stack([total, target_logit])  # one all-reduce for the two sums: [2, T]
        comm.all_reduce(both, group)
        total, target_logit = both[0], both[1]
        ctx.save_for_backward(exp / total.unsqueeze(-1), local_target, mine)
        return total.log() - target_logit

    @staticmethod
    def backward(ctx, grad):
        softmax, local_target, mine = ctx.saved_tensors  # [T, V/t], [T], [T]
        g = softmax.clone()  # d loss / d logits = softmax - one-hot(target), the one-hot only where the target is local
        index = local_target.clamp(0, g.shape[-1] - 1).unsqueeze(-1)
        g.scatter_add_(-1, index, -mine.to(g.dtype).unsqueeze(-1))
        return g * grad.unsqueeze(-1), None, None, None, None


def vocab_parallel_loss_sum(logits: torch.Tensor, targets: torch.Tensor, group: Group, vocab_size: int) -> torch.Tensor:
    """Sum of token losses from logits [b, s, V_pad/t] cut by vocabulary over `group`."""
    start = group.rank * logits.shape[-1]
    losses = _VocabParallelCrossEntropy.apply(logits.flatten(0, 1), targets.flatten(), start, vocab_size, group)
    return losses.sum()


# ---------------------------------------------------------------- applying the plan


def padded_vocab(vocab_size: int, tp: int) -> int:
    return -(-vocab_size // tp) * tp


def apply_tensor_parallel(model: nn.Module, group: Group, sequence_parallel: bool, saved: SavedActivations) -> None:
    """Cut a `Transformer` in place over `group` (t ranks); Megatron's layout, SP optional."""
    args = model.args
    vocab = padded_vocab(args.vocab_size, group.size)
    if model.tok_embeddings is not None:
        model.tok_embeddings = VocabParallelEmbedding(model.tok_embeddings, group, vocab, sequence_parallel)
    for block in model.layers.values():
        parallelize_attention(block.attention, args, group)
        make_region(block.attention, group, sequence_parallel, saved)
        if not args.moe_layer(block.layer_id):  # a MoE layer runs on each tp rank's tokens (fivecut.parallel.expert)
            parallelize_mlp(block.feed_forward, group)
            make_region(block.feed_forward, group, sequence_parallel, saved)
        if sequence_parallel:
            block.attention_norm = SequenceParallelRMSNorm(block.attention_norm, group)
            block.ffn_norm = SequenceParallelRMSNorm(block.ffn_norm, group)
    if model.norm is not None and sequence_parallel:
        model.norm = SequenceParallelRMSNorm(model.norm, group)
    if model.output is not None:
        if args.tie_embeddings and model.tok_embeddings is not None:
            model.output.weight = model.tok_embeddings.weight  # the same vocabulary shard
            model.output.out_features = model.output.weight.shape[0]
        else:
            column_parallel(model.output, group, padded_out=vocab)
        make_region(model.output, group, sequence_parallel, saved, reduce_output=False)  # logits stay cut by vocabulary


def parallelize_attention(attention: nn.Module, args, group: Group) -> None:
    t, hd = group.size, args.head_dim
    column_parallel(attention.wq, group)
    if args.n_kv_heads % t == 0:
        column_parallel(attention.wk, group)
        column_parallel(attention.wv, group)
    else:  # t is a multiple of n_kv_heads: one kv head per rank, replicated weights
        head = (group.rank * args.n_heads // t) // (args.n_heads // args.n_kv_heads)
        attention.wk = ReplicatedKV(attention.wk, head, hd, group)
        attention.wv = ReplicatedKV(attention.wv, head, hd, group)
    row_parallel(attention.wo, group)


def parallelize_mlp(mlp: nn.Module, group: Group) -> None:
    column_parallel(mlp.w1, group)
    column_parallel(mlp.w3, group)
    row_parallel(mlp.w2, group)


def check_shards(model: nn.Module, args, tp: int) -> None:
    """After the cut, every parameter marked as sharded must have the full shape divided by t."""
    expected = {
        "attention.wq.weight": (args.n_heads * args.head_dim // tp, args.dim),
        "attention.wo.weight": (args.dim, args.n_heads * args.head_dim // tp),
        "feed_forward.w1.weight": (args.ffn_dim // tp, args.dim),
        "feed_forward.w3.weight": (args.ffn_dim // tp, args.dim),
        "feed_forward.w2.weight": (args.dim, args.ffn_dim // tp),
    }
    if args.n_kv_heads % tp == 0:
        kv = (args.n_kv_heads * args.head_dim // tp, args.dim)
        expected |= {"attention.wk.weight": kv, "attention.wv.weight": kv}
    for name, p in model.named_parameters():
        suffix = next((s for s in expected if name.endswith(s)), None)
        if suffix is not None and (tuple(p.shape) != expected[suffix] or not is_tp_sharded(p)):
            raise RuntimeError(
                f"tensor parallelism left {name} with shape {tuple(p.shape)}; expected {expected[suffix]}"
            )
        if is_tp_sharded(p):
            shard = p.fivecut_tp
            if p.shape[shard.dim] * shard.parts != shard.full[shard.dim]:
                raise RuntimeError(
                    f"{name}: local {tuple(p.shape)} x {shard.parts} along dim {shard.dim} != full {shard.full}"
                )
