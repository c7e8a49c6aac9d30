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

The attention core (`CausalSDPA`, F.scaled_dot_product_attention) already runs PyTorch's fused
flash kernel on CPU (`_scaled_dot_product_flash_attention_for_cpu`, GQA included) and keeps only
q, k, v, the output and one log-sum-exp per query, so Ulysses wraps it unchanged.

Ring attention keeps the sequence cut. Causal attention gives later tokens more work, so the
sequence is cut into 2*cp chunks and rank r holds chunks r and 2cp-1-r (zigzag, load balance).
Each rank attends its queries to its own K/V block, then passes the block to the next rank of
the ring and receives the previous rank's, cp-1 times (the next block is posted before the
current one is computed, so the pass overlaps the kernel). Every block pair runs the same fused
flash kernel, which returns the pair's output and log-sum-exp; the outputs are merged with
their log-sum-exps (online softmax). Which part of a pair is visible follows from the chunks'
places (`BlockPair`): the diagonal pair is causal, after it exactly half of each pair is
wholly visible and the other half wholly hidden, so every later step is half a diagonal's work.

One autograd Function spans the ring (`_Ring`): forward keeps q, k, v, the merged output and
its log-sum-exp for the rank's own chunk, O(s/cp) per rank like one device's flash attention,
and no block's scores. Backward passes the K/V blocks round the ring again (cp-1 passes) and
recomputes each pair's gradient with the fused backward from (q, k_j, v_j, out, lse, grad_out):
given the merged output and log-sum-exp, the kernel rebuilds each pair's share of the whole
row's softmax. Block j's dK/dV accumulator (fp32) travels with it, each rank adding its part,
and one last pass takes it home: cp passes. Per layer: cp-1 block passes forward, 2cp-1
backward, each sent and received.

USP (unified sequence parallelism) runs both: cp = U x R ranks, cp rank c = g*U + u. Ulysses'
all-to-alls run inside each group of U consecutive ranks (`cp_ulysses`, g fixed), the ring
across the R groups (`cp_ring`, u fixed: ring position g):

    q, k, v [b, H, s/cp, hd]  --all-to-all over U-->  [b, H/U, s/R, hd]   (ring position g's tokens)
    ring attention over R for H/U heads: R-1 K/V passes forward, 2R-1 backward
    o [b, H/U, s/R, hd]       --all-to-all over U-->  [b, H, s/cp, hd]

The ring balances causal work with its zigzag: position g holds chunks g and 2R-1-g of 2R.
Ulysses' all-to-all puts its U ranks' tokens one after the other in rank order, so rank u of
Ulysses group g is fed the u-th of U equal contiguous pieces of that pair (chunk g, then chunk
2R-1-g): after the all-to-all each rank of the group holds exactly the pair the ring expects,
in the ring's order, with no copy besides the all-to-all's own. U = 1 is ring attention over
cp; U = cp is Ulysses around the fused kernel (a ring of one: no passes, contiguous chunks).

Multi-head latent attention (MLA) has value heads (v_head_dim) narrower than its query/key heads
(nope + rope). Ulysses moves each tensor at its own width; a ring pass carries K and V side by
side ([b, KV, s/c, hd + hd_v], one message), and only the kernel sees V zero-padded to hd (the
fused kernels take one head size); the padding is cut off the merged output before it is kept.

Documents kept apart (data.document_mask, `Documents`: ids of the whole sequence on every rank):
Ulysses' inner core sees whole sequences, so the one-device mask applies; each ring block pair
takes the mask of its queries' and keys' places in the whole sequence (`PairMask`, rebuilt in
backward), a pair wholly in other documents is skipped, and a query that sees no key of a block
gets log-sum-exp -inf, so the merge leaves it as it was.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from fivecut import comm
from fivecut.comm import Group
from fivecut.model.documents import Documents
from fivecut.model.transformer import Attention, LatentAttention, sink_grad


def sequence_chunk(inputs: torch.Tensor, targets: torch.Tensor, group: Group, mode: str = "ulysses", ulysses: int = 1):
    """This cp rank's part of a batch [b, s] -> inputs, targets [b, s/cp] and their positions
    [s/cp]: one contiguous chunk (Ulysses), chunks r and 2cp-1-r of 2cp (ring), or under USP
    (Ulysses degree `ulysses`) its piece of its ring position's pair of chunks (`chunk_positions`)."""
    degree = {"ring": 1, "ulysses": group.size}.get(mode, ulysses)
    positions = chunk_positions(group.rank, group.size, inputs.shape[1], degree, inputs.device)
    return inputs[:, positions], targets[:, positions], positions


def chunk_positions(rank: int, cp: int, seq: int, ulysses: int, device=None) -> torch.Tensor:
    """Positions [s/cp] of cp rank `rank` = g*U + u (U = `ulysses`, R = cp/U ring positions):
    piece u of U of ring position g's zigzag pair (chunks g and 2R-1-g of 2R). U = 1: the ring's
    zigzag pair; U = cp: the contiguous chunk `rank` (Ulysses)."""
    ring, (g, u) = cp // ulysses, divmod(rank, ulysses)
    local = seq // cp
    if ring == 1:  # no zigzag: seq need not be even
        return torch.arange(rank * local, (rank + 1) * local, device=device)
    return zigzag_positions(g, ring, seq // ring, device)[u * local : (u + 1) * local]


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

    def forward(self, q, k, v, documents: Documents | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """`sinks` [H] (GPT-OSS): cut with the heads, this rank's H/c to the inner core."""
        if k.shape[1] % self.group.size:  # too few kv heads to split: one per query head
            repeat = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        q, k, v = (heads_to_sequence(t, self.group) for t in (q, k, v))  # [b, heads/c, s, hd]
        mine = () if sinks is None else (sinks.view(self.group.size, -1)[self.group.rank],)  # [H/c]
        # the inner core sees whole sequences (of some heads): the documents' mask applies as on one device
        return sequence_to_heads(self.inner(q, k, v, documents, *mine), self.group)  # [b, H, s/c, hd]


@dataclass
class FlashKernel:
    """PyTorch's fused attention for one device: forward returns the output [b, H, sq, hd]
    (laid out [b, sq, H, hd]) and its log-sum-exp [b, H, sq] (fp32) without keeping the
    scores; backward recomputes them from (q, k, v, out, lse). k, v may have fewer heads
    than q (grouped-query attention: each kv head serves H/KV query heads)."""

    device: str
    scale: float | None = None  # the scores' factor (None: 1/sqrt(hd); Gemma's query_pre_attn_scalar ** -0.5)
    cuda_state: tuple = ()  # CUDA: what the first forward returned besides (out, lse), given back to backward

    def forward(self, q, k, v, causal: bool, mask=None) -> tuple[torch.Tensor, torch.Tensor]:
        """`mask`: an additive [b, 1, sq, sk] (0 or -inf, q's dtype), CPU only; a query row that
        sees no key gets out 0 and lse 0 from the CPU kernel (`_Ring` sets its lse to -inf)."""
        if self.device == "cpu":
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q, k, v, 0.0, causal, attn_mask=mask, scale=self.scale
            )
        if mask is not None:
            raise RuntimeError(
                "document masks and sliding windows under ring attention run on the CPU's fused kernel only "
                "(CUDA's flash kernel takes no mask): set parallel.cp_mode='ulysses', or data.document_mask=false "
                "on a model without a window"
            )
        out, lse, *state = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, scale=self.scale)
        # (cum_seq_q, cum_seq_k, max_q, max_k, rng_state, unused, debug mask): dense inputs, no dropout
        self.cuda_state = self.cuda_state or tuple(state[:6])
        return out, lse

    def backward(self, grad, q, k, v, out, lse, causal: bool, mask=None) -> tuple[torch.Tensor, ...]:
        """dq [b, H, sq, hd], dk and dv [b, KV, sk, hd] of one block pair, given the final
        (merged) output and log-sum-exp: the softmax it rebuilds is the whole row's."""
        if self.device == "cpu":
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                grad, q, k, v, out, lse, 0.0, causal, attn_mask=mask, scale=self.scale
            )
        cum_q, cum_k, max_q, max_k, seed, offset = self.cuda_state
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            grad, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, causal, seed, offset, scale=self.scale
        )


def flash_kernel(q: torch.Tensor, scale: float | None = None) -> FlashKernel:
    """The fused kernel for q's device and dtype; a clear error where PyTorch has none."""
    if q.device.type == "cuda" and q.dtype not in (torch.float16, torch.bfloat16):
        raise RuntimeError(
            f"ring attention on CUDA runs PyTorch's flash kernel, which needs bf16 or fp16, not {q.dtype}: "
            "set train.dtype='bf16' or parallel.cp_mode='ulysses'"
        )
    if q.device.type not in ("cpu", "cuda"):
        raise RuntimeError(f"ring attention has no fused kernel on {q.device.type}: use parallel.cp_mode='ulysses'")
    return FlashKernel(q.device.type, scale)


@dataclass(frozen=True)
class BlockPair:
    """Which part of my queries sees which part of the K/V block held `step` ranks back.

    Rank r holds chunks r and 2c-1-r of the 2c chunks; the block of rank j = r - step holds
    chunks j and 2c-1-j. Step 0 (j = r): my own block, causal on the pair (the positions of
    the two chunks increase, so causal in index order is causal in position order). j < r:
    chunk j is before both of mine, chunk 2c-1-j after both: all my queries see the first
    half of the block. j > r: chunk r sees nothing of the block, chunk 2c-1-r (> c-1 >= j,
    and > 2c-1-j) sees all of it: the second half of my queries sees the whole block.
    After step 0 each pair is half the work of the diagonal."""

    causal: bool
    queries: slice  # [sq] rows of my queries (and of out, lse, grad_out)
    keys: slice  # [sk] rows of the block

    @staticmethod
    def at(rank: int, step: int, size: int, local: int) -> BlockPair:
        every, first, second = slice(0, local), slice(0, local // 2), slice(local // 2, local)
        owner = (rank - step) % size
        if step == 0:
            return BlockPair(True, every, every)
        return BlockPair(False, every, first) if owner < rank else BlockPair(False, second, every)


def _post_shift(x: torch.Tensor, group: Group, tag: int) -> tuple[torch.Tensor, list]:
    """Post: send x to the next rank of the ring, receive the previous rank's into a new
    buffer. Returns (buffer, works); the buffer is valid after `_finish`."""
    received = torch.empty_like(x)
    nxt, prev = (group.rank + 1) % group.size, (group.rank - 1) % group.size
    return received, comm.batch_send_recv([(x, nxt)], [(received, prev)], group, tag=tag)


def _finish(works: list, group: Group) -> None:
    for work in works:
        comm.wait(work, "send/recv", group)


KV_TAG, GRAD_TAG = 0, 1  # the K/V blocks and their gradients travel as separate messages


class _Ring(torch.autograd.Function):
    """Causal attention of my queries [b, H, s/c, hd] to every K/V block of the ring.

    forward   c steps; at each, the next block is posted (sent on, the previous rank's
              received) before this block's pair is computed, and the pair's output is
              merged into the running one with the log-sum-exps (online softmax, in fp32).
              Saved: q, k, v, out, lse of my chunk only: O(s/c) per rank.
    backward  the K/V blocks go round again (c-1 passes) and each pair's gradient is
              recomputed by the fused backward from (q, k_j, v_j, out, lse, grad_out); the
              dK/dV of block j is an fp32 accumulator that follows the block round the ring,
              each rank adding its part, and one last pass brings it home to rank j:
              c passes of the gradients."""

    @staticmethod
    def forward(ctx, q, k, v, group, documents, sinks, window: int, scale: float | None):
        kernel, c, r, local = flash_kernel(q, scale), group.size, group.rank, q.shape[2]
        kv = torch.cat([k, v], dim=-1)  # [b, KV, s/c, hd + hd_v]: one message per pass
        out = lse = None
        for step in range(c):
            nxt, works = _post_shift(kv, group, KV_TAG) if step < c - 1 else (None, [])
            pair = BlockPair.at(r, step, c, local)
            mask = PairMask.of(documents, window, pair, r, step, c, local, q)
            if mask is None or mask.any_seen:  # a pair whose every query sees none of its keys: no work
                qs, ks = pair.queries, pair.keys
                o_blk, lse_blk = kernel.forward(
                    q[:, :, qs], *key_value(kv[:, :, ks], q), *PairMask.kernel_args(mask, pair)
                )
                if mask is not None:  # rows that see no key of the block add nothing to the merge
                    o_blk, lse_blk = mask.hide_unseen(o_blk, lse_blk)
                if out is None:  # step 0: every query sees at least itself
                    out, lse = o_blk.float(), lse_blk.float()  # out [b, H, s/c, hd] laid out [b, s/c, H, hd]
                else:
                    merge_into(out[:, :, qs], lse[:, :, qs], o_blk, lse_blk)
            _finish(works, group)
            kv = nxt
        if sinks is not None:  # GPT-OSS: the sink is one more block, of value 0 and log-sum-exp `sink`
            merge_into(out, lse, torch.zeros_like(out), sinks.float().view(1, -1, 1).expand_as(lse))
        out = value_width(out, v.shape[-1]).to(q.dtype)  # [b, H, s/c, hd_v] laid out [b, s/c, H, hd_v]
        ctx.group, ctx.kernel, ctx.documents, ctx.window = group, kernel, documents, window
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        group, kernel = ctx.group, ctx.kernel
        sink = None if sinks is None else sink_grad(grad_out, out, lse, sinks)  # [H]
        c, r, local = group.size, group.rank, q.shape[2]
        hd, hd_v = k.shape[-1], v.shape[-1]
        grad_out, out = pad_value(grad_out, hd), pad_value(out, hd)  # [b, H, s/c, hd]
        dq = torch.zeros_like(q, dtype=torch.float32)
        kv = torch.cat([k, v], dim=-1)  # [b, KV, s/c, hd + hd_v]
        dkv = None  # [b, KV, s/c, hd + hd_v] fp32: the gradient of the block I hold, from the ranks before me
        for step in range(c):
            nxt, works = _post_shift(kv, group, KV_TAG) if step < c - 1 else (None, [])
            arriving, grad_works = _post_shift(dkv, group, GRAD_TAG) if step > 0 else (None, [])
            pair = BlockPair.at(r, step, c, local)
            rows, keys = pair.queries, pair.keys
            mask = PairMask.of(ctx.documents, ctx.window, pair, r, step, c, local, q)
            blk = None
            if mask is None or mask.any_seen:
                blk = kernel.backward(
                    grad_out[:, :, rows],
                    q[:, :, rows],
                    *key_value(kv[:, :, keys], q),
                    out[:, :, rows],
                    lse[:, :, rows],
                    *PairMask.kernel_args(mask, pair),
                )  # dq, dk, dv of the pair
                dq[:, :, rows] += blk[0]
            _finish(works + grad_works, group)
            dkv = torch.zeros_like(kv, dtype=torch.float32) if arriving is None else arriving
            if blk is not None:
                dkv[:, :, keys, :hd] += blk[1]
                dkv[:, :, keys, hd:] += blk[2][..., :hd_v]
            kv = nxt
        home, works = _post_shift(dkv, group, GRAD_TAG)  # the block of rank r+1, complete: to its owner
        _finish(works, group)
        return dq.to(q.dtype), home[..., :hd].to(k.dtype), home[..., hd:].to(v.dtype), None, None, sink, None, None


@dataclass(frozen=True)
class PairMask:
    """The mask of one block pair: my queries of the pair against the keys of the block held `step`
    ranks back, both at their places in the whole sequence (each ring rank's zigzag chunks), causal
    by place, within one document (data.document_mask) and within a sliding window w (key > query - w).
    A window leaves many pairs wholly hidden (`any_seen` false): those run no kernel at all."""

    bias: torch.Tensor  # [b, 1, sq, sk] additive: 0 where seen, -inf where hidden (the kernel's dtype)
    seen: torch.Tensor  # [b, 1, sq] bool: the queries that see at least one key of the block
    any_seen: bool

    @staticmethod
    def of(documents: Documents | None, window: int, pair: BlockPair, rank: int, step: int, size: int, local: int, q):
        """None when nothing but causality masks (the kernel's causal flag does); the bias in q's dtype."""
        if documents is None and not window:
            return None
        mine = zigzag_positions(rank, size, local, q.device)[pair.queries]  # [sq]
        theirs = zigzag_positions((rank - step) % size, size, local, q.device)[pair.keys]  # [sk]
        visible = theirs <= mine.unsqueeze(-1) if documents is None else documents.visible(mine, theirs)
        if window:  # [sq, sk] or [b, 1, sq, sk]
            visible = visible & (theirs > mine.unsqueeze(-1) - window)
        visible = visible.expand(q.shape[0], 1, *visible.shape[-2:])  # [b, 1, sq, sk]
        bias = torch.zeros(visible.shape, dtype=q.dtype, device=q.device).masked_fill_(~visible, float("-inf"))
        seen = visible.any(-1)
        return PairMask(bias, seen, bool(seen.any()))

    @staticmethod
    def kernel_args(mask: PairMask | None, pair: BlockPair) -> tuple[bool, torch.Tensor | None]:
        """(causal, additive mask) for the kernel: the pair's own causality, or the mask (which holds it)."""
        return (pair.causal, None) if mask is None else (False, mask.bias)

    def hide_unseen(self, o_blk: torch.Tensor, lse_blk: torch.Tensor):
        """A query that sees none of the block: output 0 and log-sum-exp -inf, so that the online
        softmax merge leaves its running result unchanged (no NaN: its weight exp(-inf) is 0)."""
        unseen = ~self.seen  # [b, 1, sq]; in place: o_blk keeps the kernel's [b, sq, H, hd] layout
        return o_blk.masked_fill_(unseen.unsqueeze(-1), 0.0), lse_blk.masked_fill_(unseen, float("-inf"))


def key_value(kv: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A K/V block [b, KV, sk, hd + hd_v] -> k [b, KV, sk, hd] and v [b, KV, sk, hd]: a value head
    narrower than the query/key head (latent attention: hd_v = v_head_dim < hd = nope + rope) is
    zero-padded to hd for the fused kernel, which takes one head size; the padded columns of the
    output are zero and are cut off (`value_width`), and their gradients dropped."""
    hd = q.shape[-1]
    k, v = kv.split([hd, kv.shape[-1] - hd], dim=-1)
    return k, pad_value(v, hd)


def pad_value(x: torch.Tensor, hd: int) -> torch.Tensor:
    """[..., hd_v] -> [..., hd], zeros appended (a view when hd_v = hd)."""
    return x if x.shape[-1] == hd else torch.nn.functional.pad(x, (0, hd - x.shape[-1]))


def value_width(out: torch.Tensor, hd_v: int) -> torch.Tensor:
    """The merged output [b, H, s, hd] laid out [b, s, H, hd] -> its first hd_v channels, a copy
    laid out [b, s, H, hd_v] when narrower (the padding is not kept for backward)."""
    if out.shape[-1] == hd_v:
        return out
    return out.transpose(1, 2)[..., :hd_v].contiguous().transpose(1, 2)


def merge_into(out, lse, o_blk, lse_blk) -> None:
    """Online softmax, in place: `out`, `lse` [b, H, sq(, hd)] (views of the running result)
    become the attention over their keys and the block's, which are disjoint."""
    total = torch.logaddexp(lse, lse_blk)
    out.mul_((lse - total).exp().unsqueeze(-1)).add_(o_blk * (lse_blk - total).exp().unsqueeze(-1))
    lse.copy_(total)


class RingAttention(nn.Module):
    """Causal attention over the whole sequence, K/V blocks passed around the cp ring (`_Ring`).
    Under autocast q, k, v are cast as autocast casts scaled_dot_product_attention's."""

    def __init__(self, group: Group, window: int = 0, scale: float | None = None):
        super().__init__()
        self.group, self.window = group, window  # window: the core's sliding window (0: none)
        self.scale = scale  # the core's factor of the scores (None: 1/sqrt(hd))

    def forward(self, q, k, v, documents: Documents | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """`sinks` [H] (GPT-OSS): merged once after the ring's blocks (`_Ring`)."""
        if torch.is_autocast_enabled(q.device.type):
            dtype = torch.get_autocast_dtype(q.device.type)
            q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        return _Ring.apply(q, k, v, self.group, documents, sinks, self.window, self.scale)  # [b, H, s/cp, hd]


def apply_context_parallel(model: nn.Module, groups: dict[str, Group], mode: str = "ulysses") -> list[str]:
    """Ulysses around, ring attention instead of, or (USP) Ulysses around ring attention instead
    of, every attention core of `model` (a model or a pipeline stage); `groups`: the mesh's
    (cp; under USP cp_ulysses and cp_ring). Returns the paths of the attention modules changed."""
    changed = []
    for path, attention in model.named_modules():
        if isinstance(attention, (Attention, LatentAttention)):
            attention.core = context_core(attention.core, groups, mode)
            changed.append(path)
    return changed


def context_core(core: nn.Module, groups: dict[str, Group], mode: str) -> nn.Module:
    # a sliding window (a band through the ring's block pairs) and the scores' factor, as the core has them
    window, scale = getattr(core, "window", 0), getattr(core, "scale", None)
    if mode == "ulysses":
        return UlyssesAttention(core, groups["cp"])
    if mode == "ring":
        return RingAttention(groups["cp"], window, scale)
    ring = RingAttention(groups["cp_ring"], window, scale)  # usp; with U = 1, the ring alone
    return ring if groups["cp_ulysses"].size == 1 else UlyssesAttention(ring, groups["cp_ulysses"])
