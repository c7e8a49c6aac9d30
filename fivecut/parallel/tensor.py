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

Multi-head latent attention (MLA): wq_b (or wq) and wkv_b are column-parallel by heads, wo
row-parallel; the down projections wq_a and wkv_a and the latent norms are replicated, and
since each rank back-propagates only its heads into the latents, their weights' gradients are
summed over t (f on the weight, as for the norms under SP). The shared RoPE key head comes
from wkv_a, so every rank has it.

Grouped-query attention: kv heads are split when t divides them; when t is a multiple
of the kv heads instead, each rank computes the one kv head its query heads use from the
full (replicated) wk and wv, whose gradients are summed over t.

`apply_tensor_parallel` returns a `Change` per parameter it touched (the slice it keeps, or
the tp sum autograd does for a replicated weight); `parallelize` folds them into the
parameters' placement records and checks every local shape against them.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F
from torch import nn

from fivecut import comm
from fivecut.comm import Group
from fivecut.model.lora import LoRALinear
from fivecut.model.transformer import RMSNorm, rms_norm
from fivecut.parallel.loss import LossHead, VocabShard, cross_entropy_in_place
from fivecut.parallel.pipeline.wgrad import DeferredEmbedding, deferred_lookup
from fivecut.parallel.placement import Change, Slice
from fivecut.parallel.saved import SavedActivations

Changes = dict[str, Change]  # parameter path in the module -> what the cut did to it


def shard_param(
    full: torch.Tensor, dim: int, group: Group, padded_size: int | None = None
) -> tuple[nn.Parameter, Slice]:
    """This rank's slice of `full` along `dim` (zero-padded to `padded_size` first), and where it sits."""
    padded_size = max(padded_size or 0, full.shape[dim])
    if padded_size > full.shape[dim]:
        pad = [0, 0] * (full.dim() - 1 - dim) + [0, padded_size - full.shape[dim]]
        full = F.pad(full, pad)
    param = nn.Parameter(  # its own storage: the full weight is freed; a frozen one ([lora]) stays frozen
        comm.my_slice(full.detach(), dim, group).clone(), requires_grad=full.requires_grad
    )
    length = param.shape[dim]
    return param, Slice("tp", dim, group.rank * length, length, padded_size)


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


def column_parallel(linear: nn.Linear, group: Group, padded_out: int | None = None) -> Change:
    """Keep rows of the weight [out/t, in]: this rank computes out/t output features. A bias
    [out] is cut with its rows (`column_bias` gives its change)."""
    linear.weight, where = shard_param(linear.weight, 0, group, padded_out)
    linear.out_features = linear.weight.shape[0]
    if getattr(linear, "bias", None) is not None:  # (the head may be a LossHead: no bias)
        linear.bias, _ = shard_param(linear.bias, 0, group, padded_out)  # [out/t]
    return Change(slice=where)


def column_changes(linear: nn.Module, name: str, change: Change) -> Changes:
    """`name.weight`'s change, and `name.bias`'s when the linear has a bias (the same rows, 1-D)."""
    changes = {f"{name}.weight": change}
    if getattr(linear, "bias", None) is not None:
        where = change.slice
        bias_slice = dataclasses.replace(where, dim=0) if where is not None else None  # rows of W are entries of b
        changes[f"{name}.bias"] = dataclasses.replace(change, slice=bias_slice)
    return changes


def row_parallel(linear: nn.Linear, group: Group) -> Change:
    """Keep columns of the weight [out, in/t]: this rank's partial sum over in/t input features."""
    linear.weight, where = shard_param(linear.weight, 1, group)
    linear.in_features = linear.weight.shape[1]
    return Change(slice=where)


def cut(linear: nn.Linear, name: str, group: Group, row: bool) -> Changes:
    """`name` cut column-parallel (rows of its weight, and of its bias) or, `row`, row-parallel
    (columns), with its adapters when it has them (`cut_adapters`)."""
    if row:
        changes = {f"{name}.weight": row_parallel(linear, group)}
    else:
        changes = column_changes(linear, name, column_parallel(linear, group))
    return changes | cut_adapters(linear, name, changes[f"{name}.weight"].slice, group, row)


def cut_adapters(linear: nn.Linear, name: str, where: Slice, group: Group, row: bool) -> Changes:
    """[lora]: a column-parallel weight's B [out, r] is cut by rows like its output, A [r, in] stays
    whole; a row-parallel weight's A is cut by columns like its input, B stays whole. The whole
    half gets a partial gradient on each rank (the rows of dy it sees, or the partial sum x_t A_t^T
    its product is made of): autograd sums it over t (`LoRALinear.grad_summed`). The row-parallel
    update adds into the partial sums the region's all-reduce (or reduce-scatter) already sums."""
    if not isinstance(linear, LoRALinear):
        return {}
    summed = functools.partial(comm.copy_to, group=group)
    if row:
        linear.lora_a, a_where = shard_param(linear.lora_a, 1, group)  # [r, in/t]
        linear.grad_summed = ("lora_b", summed)
        return {f"{name}.lora_a": Change(slice=a_where), f"{name}.lora_b": Change(summed_over="tp")}
    linear.lora_b, b_where = shard_param(linear.lora_b, 0, group, where.padded)  # [out/t, r]
    linear.grad_summed = ("lora_a", summed)
    return {f"{name}.lora_b": Change(slice=b_where), f"{name}.lora_a": Change(summed_over="tp")}


class ReplicatedKV(nn.Module):
    """k or v projection when t > n_kv_heads: the full weight (and bias) on every rank, this rank's
    kv head selected; the gradient (nonzero only in this rank's head rows) is summed over t."""

    def __init__(self, linear: nn.Linear, head: int, head_dim: int, group: Group):
        super().__init__()
        self.weight = linear.weight  # [n_kv * hd, h], same Parameter: replicated
        self.bias = linear.bias  # [n_kv * hd] or None
        self.rows = slice(head * head_dim, (head + 1) * head_dim)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = comm.copy_to(self.weight, self.group)[self.rows]  # [hd, h]
        bias = comm.copy_to(self.bias, self.group)[self.rows] if self.bias is not None else None  # [hd]
        return F.linear(x, weight, bias)  # [b, s, hd]: one kv head


class RowParallelBias(nn.Module):
    """A row-parallel linear with a bias (GPT-OSS's wo): each rank's product is a partial sum that the
    region's g adds over t, so the whole bias [out] is added by the first rank only; every rank's output
    gradient is the whole one, so the first rank's bias gradient is the whole gradient, summed over t (f on
    the bias) for every rank to hold it."""

    def __init__(self, linear: nn.Linear, group: Group):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias  # [out, in/t], [out]: the same Parameters
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = comm.copy_to(self.bias, self.group)
        return F.linear(x, self.weight, bias if self.group.rank == 0 else bias * 0)  # [b, s, out]: a partial sum


class ReplicatedLinear(nn.Module):
    """A linear whose full weight every rank holds and applies to the full input, inside a region
    whose ranks each back-propagate only part of the output's gradient: the weight's gradient is
    summed over t (MLA's down projections wq_a and wkv_a)."""

    def __init__(self, linear: nn.Linear, group: Group):
        super().__init__()
        self.weight = linear.weight  # [out, in], the same Parameter: replicated
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, comm.copy_to(self.weight, self.group))


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + V/t) of the (padded) embedding; the other ranks' tokens give zeros,
    and the partial embeddings are summed (all-reduce, or reduce-scatter along s with SP)."""

    def __init__(self, embedding: nn.Embedding, group: Group, padded_vocab: int, sequence_parallel: bool):
        super().__init__()
        self.weight, self.slice = shard_param(embedding.weight, 0, group, padded_vocab)  # [V/t, h]
        self.start = self.slice.start
        self.group = group
        self.sequence_parallel = sequence_parallel
        # a zero-bubble schedule's B leaves the rows' gradient to W (`wgrad.DeferredEmbedding`)
        self.weight_grads = embedding.grads if isinstance(embedding, DeferredEmbedding) else None

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        local = tokens - self.start  # [b, s]
        outside = (local < 0) | (local >= self.weight.shape[0])
        local = local.masked_fill(outside, 0)
        if self.weight_grads is None:
            h = F.embedding(local, self.weight)  # [b, s, h]
        else:
            h = deferred_lookup(local, self, self.weight_grads)  # [b, s, h]
        h = h.masked_fill(outside.unsqueeze(-1), 0.0)
        return leave_region(h, self.group, self.sequence_parallel)


class ProjectionRMSNorm(nn.Module):
    """An RMSNorm over a whole projection whose heads tp cuts (OLMo 2's q and k norms): this rank
    holds the weight's slice [width/t] and its heads' channels; the sum of squares over the whole
    width is all-reduced over t in forward, and so is its gradient in backward (every rank's
    channels are divided by the one sum: each rank's gradient of it is its channels' share)."""

    def __init__(self, norm: RMSNorm, group: Group):
        super().__init__()
        self.width = norm.weight.shape[0]  # the whole projection's channels
        self.weight, self.where = shard_param(norm.weight, 0, group)
        self.eps, self.group = norm.eps, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()  # [b, s, width/t]
        squares = xf.square().sum(-1, keepdim=True)  # [b, s, 1]: this rank's channels
        total = comm.copy_to(comm.reduce_from(squares, self.group), self.group)  # [b, s, 1]: all channels
        return (xf * torch.rsqrt(total / self.width + self.eps) * self.weight.float()).to(x.dtype)


class SequenceParallelRMSNorm(nn.Module):
    """RMSNorm on a sequence slice [b, s/t, h]: the weight is replicated and each rank sees
    only its tokens, so the weight's gradient is summed over t (f on the weight). The same
    stands for MLA's latent norms, which see every token but pass back only this rank's heads'
    share of the gradient."""

    def __init__(self, norm: RMSNorm, group: Group):
        super().__init__()
        self.weight = norm.weight
        self.eps = norm.eps
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, comm.copy_to(self.weight, self.group), self.eps)


# ---------------------------------------------------------------- loss


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy from vocabulary-sharded logits [T, V/t]; returns [T] losses. The
    forward computes the gradient too (`cross_entropy_in_place` on an fp32 copy) and keeps it."""

    @staticmethod
    def forward(ctx, logits, targets, shard: VocabShard):
        work = logits.to(torch.float32, copy=True)  # [T, V/t], becomes d(sum of losses)/d logits
        losses = cross_entropy_in_place(work, targets, shard)
        ctx.save_for_backward(work)
        return losses

    @staticmethod
    def backward(ctx, grad):
        (work,) = ctx.saved_tensors
        return work.mul_(grad.unsqueeze(-1)), None, None  # this graph runs backward once


def vocab_shard(local: int, group: Group, vocab_size: int) -> VocabShard:
    """The shard of the vocabulary this rank's V_pad/t = `local` columns of logits hold."""
    return VocabShard(group.rank * local, vocab_size, group)


def vocab_parallel_token_losses(logits: torch.Tensor, targets: torch.Tensor, group: Group, vocab_size: int):
    """Each token's loss from logits [T, V_pad/t] cut by vocabulary over `group`: [T] fp32. A negative
    target (-100, torch's ignore_index: a token a loss mask leaves out) gives 0 and no gradient, as
    `F.cross_entropy` does on one rank."""
    return _VocabParallelCrossEntropy.apply(logits, targets, vocab_shard(logits.shape[-1], group, vocab_size))


def vocab_parallel_loss_sum(logits: torch.Tensor, targets: torch.Tensor, group: Group, vocab_size: int) -> torch.Tensor:
    """Sum of token losses from logits [b, s, V_pad/t] cut by vocabulary over `group`."""
    return vocab_parallel_token_losses(logits.flatten(0, 1), targets.flatten(), group, vocab_size).sum()


# ---------------------------------------------------------------- applying the plan


def padded_vocab(vocab_size: int, tp: int) -> int:
    return -(-vocab_size // tp) * tp


def apply_tensor_parallel(model: nn.Module, group: Group, sequence_parallel: bool, saved: SavedActivations) -> Changes:
    """Cut a `Transformer` (or a pipeline stage of one) in place over `group` (t ranks); Megatron's
    layout, SP optional. Returns what it did to each parameter, by path."""
    args, changes = model.args, {}
    vocab = padded_vocab(args.vocab_size, group.size)
    if model.tok_embeddings is not None:
        model.tok_embeddings = VocabParallelEmbedding(model.tok_embeddings, group, vocab, sequence_parallel)
        changes["tok_embeddings.weight"] = Change(slice=model.tok_embeddings.slice)
    for name, block in model.layers.items():
        changes |= prefixed(f"layers.{name}.", parallelize_block(block, args, group, sequence_parallel, saved))
    if model.norm is not None and sequence_parallel:
        model.norm = SequenceParallelRMSNorm(model.norm, group)
        changes["norm.weight"] = Change(summed_over="tp")
    if model.output is not None:
        changes |= parallelize_head(model, group, vocab, sequence_parallel, saved)
    return changes


def prefixed(prefix: str, changes: Changes) -> Changes:
    return {prefix + path: change for path, change in changes.items()}


def parallelize_block(
    block: nn.Module, args, group: Group, sequence_parallel: bool, saved: SavedActivations
) -> Changes:
    changes = prefixed("attention.", parallelize_attention(block.attention, args, group))
    make_region(block.attention, group, sequence_parallel, saved)
    if not args.moe_layer(block.layer_id):  # a MoE layer runs on each tp rank's tokens (fivecut.parallel.expert)
        changes |= prefixed("feed_forward.", parallelize_mlp(block.feed_forward, group))
        make_region(block.feed_forward, group, sequence_parallel, saved)
    if sequence_parallel:  # the block's norms (and Gemma's second ones, on the sublayers' outputs) on s/t tokens
        for name in BLOCK_NORMS:
            if getattr(block, name, None) is not None:
                setattr(block, name, SequenceParallelRMSNorm(getattr(block, name), group))
                changes[f"{name}.weight"] = Change(summed_over="tp")
    return changes


BLOCK_NORMS = ("attention_norm", "ffn_norm", "attention_post_norm", "ffn_post_norm")


def parallelize_head(model: nn.Module, group: Group, vocab: int, sequence_parallel: bool, saved) -> Changes:
    """The output projection cut by vocabulary (the embedding's shard when tied); logits stay cut.
    A loss head (`LossHead`) computes each chunk's token losses from its logits [C, V_pad/t] with
    the vocabulary-parallel cross-entropy. With SP the head's input is gathered to [b, s, h] first."""
    changes = {}
    if model.args.tie_embeddings and model.tok_embeddings is not None:
        model.output.weight = model.tok_embeddings.weight  # the same vocabulary shard
        model.output.out_features = model.output.weight.shape[0]
    else:
        changes["output.weight"] = column_parallel(model.output, group, padded_out=vocab)
    if isinstance(model.output, LossHead):
        shard = vocab_shard(model.output.weight.shape[0], group, model.args.vocab_size)
        model.output.loss = dataclasses.replace(model.output.loss, shard=shard)
    make_region(model.output, group, sequence_parallel, saved, reduce_output=False)
    return changes


def parallelize_attention(attention: nn.Module, args, group: Group) -> Changes:
    if args.is_mla:
        return parallelize_latent_attention(attention, group)
    t, hd = group.size, args.head_dim
    changes = cut(attention.wq, "wq", group, row=False)
    for name in ("wk", "wv"):
        linear = getattr(attention, name)
        if args.n_kv_heads % t == 0:
            changes |= cut(linear, name, group, row=False)
        else:  # t is a multiple of n_kv_heads: one kv head per rank, replicated weights
            head = (group.rank * args.n_heads // t) // (args.n_heads // args.n_kv_heads)
            changes |= column_changes(linear, name, Change(summed_over="tp"))
            setattr(attention, name, ReplicatedKV(linear, head, hd, group))
    changes |= cut(attention.wo, "wo", group, row=True)
    if attention.wo.bias is not None:  # GPT-OSS: the bias added once to the partial sums g adds
        attention.wo = RowParallelBias(attention.wo, group)
        changes["wo.bias"] = Change(summed_over="tp")
    if attention.sinks is not None:  # GPT-OSS: each head's sink logit, cut with the heads
        attention.sinks, where = shard_param(attention.sinks, 0, group)  # [H/t]
        changes["sinks"] = Change(slice=where)
    return changes | parallelize_head_norms(attention, group)


def parallelize_head_norms(attention: nn.Module, group: Group) -> Changes:
    """Qwen3's per-head q and k norms [hd]: every rank applies the whole weight to its own heads,
    so each rank's gradient is its heads' share and the weight's gradient is summed over t.
    OLMo 2's norms over the whole projections [heads * hd]: cut with wq's and wk's rows
    (`ProjectionRMSNorm`; fivecut.checks refuses a t that does not divide the kv heads)."""
    changes = {}
    for name in ("q_norm", "k_norm"):
        norm = getattr(attention, name)
        if norm is None:
            continue
        if attention.whole_qk_norm:
            wrapped = ProjectionRMSNorm(norm, group)
            changes[f"{name}.weight"] = Change(slice=wrapped.where)
        else:
            wrapped = SequenceParallelRMSNorm(norm, group)
            changes[f"{name}.weight"] = Change(summed_over="tp")
        setattr(attention, name, wrapped)
    return changes


def parallelize_latent_attention(attention: nn.Module, group: Group) -> Changes:
    """MLA: heads cut (wq_b or wq, wkv_b by rows, wo by columns), latents replicated (tp-summed)."""
    changes = cut(attention.wkv_b, "wkv_b", group, row=False) | cut(attention.wo, "wo", group, row=True)
    replicated = ["wkv_a", "kv_norm"]
    if attention.compressed_q:
        changes |= cut(attention.wq_b, "wq_b", group, row=False)
        replicated += ["wq_a", "q_norm"]
    else:
        changes |= cut(attention.wq, "wq", group, row=False)
    for name in replicated:
        module = getattr(attention, name)
        wrapped = (
            SequenceParallelRMSNorm(module, group) if isinstance(module, RMSNorm) else ReplicatedLinear(module, group)
        )
        setattr(attention, name, wrapped)
        changes[f"{name}.weight"] = Change(summed_over="tp")
    return changes


def parallelize_mlp(mlp: nn.Module, group: Group) -> Changes:
    return (
        cut(mlp.w1, "w1", group, row=False) | cut(mlp.w3, "w3", group, row=False) | cut(mlp.w2, "w2", group, row=True)
    )
