"""The zero-bubble split of a stage's backward into B and W (Qi et al., "Zero Bubble Pipeline
Parallelism"), done at the linear layers.

For a linear layer y = x W^T the backward has two independent products:

    B   dx = dy @ W             [..., in]    on the critical path: the previous stage waits for it
    W   dW = dy^T @ x           [out, in]    no one waits for it: it fills the bubbles

While a split-backward schedule runs, every `nn.Linear` of the stage (the attention and MLP
projections, TP-cut or not, the head, the router) computes through `DeferredLinear`, whose
backward returns dx and, when a `WeightGrads.collecting` block is open, keeps (W, x, dy) in
that (stage, microbatch)'s record instead of computing dW. The executor's B is then one plain
backward of the stage: every collective inside it (TP's all-reduces and re-gathers, CP's, EP's
all-to-alls) runs exactly once, and the graph is freed. W pops the record and computes the
deferred products; nothing is walked again.

The embedding is deferred the same way (`DeferredEmbedding`: B keeps the ids and dy, W scatters
dy into its rows; on the first stage B then computes no [V, h] gradient at all, and W adds only
the rows the microbatch looked up once `.grad` exists). Parameters
that are neither get their gradients in B, as in a full backward: norm weights, the
replicated kv projections of `ReplicatedKV` (their gradient passes through a tp all-reduce),
and the experts of a MoE layer (`GroupedExperts` computes its grouped matmuls itself). All
are cheap next to the projections, or would need their own collective in W.

W accumulates with `torch.autograd.backward(weights, dWs)` on the leaves: autograd adds into
`.grad` exactly as a full backward would (the data cut's flat bucket views stay in place) and
the post-accumulate-grad hooks of DDP / ZeRO-1 fire. The pipeline runs under `no_sync`; the
gradients are reduced after the schedule, i.e. after every microbatch's W.

On the CPU, a dW that autograd will add into an existing dense `.grad` is computed into a buffer
W keeps per shape (`WeightGrads.scratch`: one [out, in] tensor per distinct weight shape, about
one layer's weights and the head) instead of a fresh tensor each time. A fresh CPU tensor as
large as the head's [V, h] dW is new pages from the kernel every W (glibc maps it afresh above
32 MiB), and the page faults that fill it cost half as much again as the product and the add
(`small`'s head: 52 ms against 33 ms on one CPU thread). The product is the same `mm` into the
same row-major layout, so dW and `.grad` are bitwise the same.

Mixed precision: under autocast the forward casts x and W to the autocast dtype; backward
(which autocast does not cover) computes dx and dW in the dtype of dy and returns them in
the dtypes of x and W.
"""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class Deferred:
    """What one linear layer's weight gradient needs, kept by B for W."""

    weight: nn.Parameter  # [out, in]
    input: torch.Tensor  # x  [..., in]
    grad_output: torch.Tensor  # dy [..., out]

    def weight_grad(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """dW = dy^T @ x, over every token: [out, in], in the weight's dtype; written into `out`
        ([out, in], contiguous, dy's dtype = the weight's) when given."""
        dy = self.grad_output.reshape(-1, self.grad_output.shape[-1])  # [T, out]
        x = self.input.reshape(-1, self.input.shape[-1]).to(dy.dtype)  # [T, in]
        if out is not None:
            return torch.mm(dy.t(), x, out=out)
        return (dy.t() @ x).to(self.weight.dtype)


@dataclass
class DeferredLookup:
    """What an embedding's weight gradient needs, kept by B for W: the ids and dy."""

    weight: nn.Parameter  # [V, h] (under TP: this rank's rows)
    ids: torch.Tensor  # [b, s] row of each token
    grad_output: torch.Tensor  # dy [b, s, h]

    def weight_grad(self) -> torch.Tensor:
        """dW[v] = sum of dy over the tokens looked up at row v: [V, h], the op autograd's own
        embedding backward runs (the same sums in the same order)."""
        rows = self.weight.shape[0]
        dw = torch.ops.aten.embedding_dense_backward(self.grad_output, self.ids, rows, -1, False)
        return dw.to(self.weight.dtype)

    def sparse_weight_grad(self) -> torch.Tensor:
        """The same dW as a coalesced sparse [V, h] tensor holding only the rows looked up: adding
        it into an existing dense `.grad` touches T rows instead of writing V (each row's tokens
        are summed first, in token order, as the dense op sums them)."""
        h = self.grad_output.shape[-1]
        values = self.grad_output.reshape(-1, h).to(self.weight.dtype)  # [T, h]
        rows = self.ids.reshape(1, -1)  # [1, T], in range by construction (TP: masked to its rows)
        dw = torch.sparse_coo_tensor(rows, values, tuple(self.weight.shape), check_invariants=False)
        return dw.coalesce()


@dataclass
class WeightGrads:
    """The deferred weight gradients of this rank's stages, one record per (stage, microbatch)."""

    pending: dict[tuple[int, int], list[Deferred | DeferredLookup]] = field(default_factory=dict)
    current: list[Deferred | DeferredLookup] | None = None  # the record the running B appends to
    scratch: dict[tuple[torch.Size, torch.dtype], torch.Tensor] = field(default_factory=dict)  # CPU dW buffers

    @contextmanager
    def collecting(self, stage: int, microbatch: int):
        """B of (stage, microbatch): the linear layers' backward keeps (W, x, dy) here."""
        if (stage, microbatch) in self.pending:
            raise RuntimeError(f"B of stage {stage}, microbatch {microbatch} ran twice before its W")
        self.current = self.pending[(stage, microbatch)] = []
        try:
            yield
        finally:
            self.current = None

    @torch.no_grad()  # the products need no graph (and `mm(out=...)` refuses to record one)
    def apply(self, stage: int, microbatch: int) -> None:
        """W of (stage, microbatch): every deferred dW, accumulated into `.grad` (hooks fire)."""
        record = self.pending.pop((stage, microbatch))
        uses = Counter(d.weight for d in record)
        grads: dict[nn.Parameter, torch.Tensor] = {}
        for d in record:  # a weight used twice (tied) gets one summed gradient
            if uses[d.weight] == 1 and self.reusable(d):  # added into .grad now, before the buffer's next use
                torch.autograd.backward([d.weight], [d.weight_grad(out=self.buffer(d.weight))])
                continue
            dw = d.sparse_weight_grad() if sparse_lookup(d, record) else d.weight_grad()
            grads[d.weight] = grads[d.weight] + dw if d.weight in grads else dw
        if grads:
            torch.autograd.backward(list(grads), list(grads.values()))

    @staticmethod
    def reusable(d: Deferred | DeferredLookup) -> bool:
        """Whether d's dW can go through a kept buffer: a linear layer's on the CPU, in the weight's
        dtype, that autograd adds into an existing dense `.grad` in place (and so keeps no reference).
        A weight that is a step's bf16 compute copy (`fivecut.parallel.precision`) is no leaf: its
        dW flows on to the master, and it has no `.grad` to read."""
        grad = d.weight.grad if d.weight.is_leaf else None
        return (
            isinstance(d, Deferred)
            and d.weight.device.type == "cpu"
            and d.grad_output.dtype == d.weight.dtype
            and grad is not None
            and not grad.is_sparse
        )

    def buffer(self, weight: nn.Parameter) -> torch.Tensor:
        """The kept [out, in] buffer for dWs of this weight's shape and dtype."""
        key = (weight.shape, weight.dtype)
        if key not in self.scratch:
            self.scratch[key] = torch.empty(weight.shape, dtype=weight.dtype, device=weight.device)
        return self.scratch[key]

    def clear(self) -> None:
        """Drop what an interrupted step left (nothing is left after a complete one)."""
        self.pending.clear()
        self.current = None


def sparse_lookup(d: Deferred | DeferredLookup, record: list) -> bool:
    """Whether W adds an embedding's gradient as sparse rows: when its weight already has a dense
    `.grad` (a later microbatch, or a data cut's bucket view), which autograd then adds into in
    place, and no other layer of the record (a tied head) gives the same weight a dense one."""
    if not isinstance(d, DeferredLookup) or d.weight.grad is None or d.weight.grad.is_sparse:
        return False
    return all(other.weight is not d.weight for other in record if other is not d)


class _DeferredLinearFn(torch.autograd.Function):
    """y = x W^T whose backward returns dx and leaves dW to W (when a record is open).

    The weight is reached through its layer, not passed as an input: autograd then has no edge
    to the weight, so B neither accumulates into its `.grad` nor fires its post-accumulate hooks
    (which fire on an edge even when the returned gradient is None). It is held as the Parameter
    itself, not saved: what comes back from the saved-tensor hooks (sequence parallelism's)
    may be another Tensor object, into which W would accumulate in vain."""

    @staticmethod
    def forward(ctx, x, layer, grads):
        ctx.grads, ctx.weight = grads, layer.weight  # the Parameter itself: W accumulates into it
        ctx.save_for_backward(x)
        return F.linear(x, layer.weight)  # [..., out]; autocast (if on) casts inside

    @staticmethod
    def backward(ctx, dy):
        (x,), weight = ctx.saved_tensors, ctx.weight
        dx = (dy @ weight.to(dy.dtype)).to(x.dtype) if ctx.needs_input_grad[0] else None  # [..., in]
        keep_or_apply(Deferred(weight, x, dy), ctx.grads)
        return dx, None, None


class DeferredLinear(nn.Linear):
    """An `nn.Linear` (same Parameters, same hooks' place) whose weight gradient W computes."""

    def __init__(self, linear: nn.Linear, grads: WeightGrads):
        nn.Module.__init__(self)  # no new weight: the layer's own Parameters move over
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.register_parameter("bias", linear.bias)
        self.grads = grads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (x.requires_grad and self.weight.requires_grad and torch.is_grad_enabled()):
            return F.linear(x, self.weight, self.bias)  # nothing to defer (or no edge to carry dW)
        y = _DeferredLinearFn.apply(x, self, self.grads)
        return y if self.bias is None else y + self.bias  # the bias's gradient (a sum) comes in B


def keep_or_apply(record: Deferred | DeferredLookup, grads: WeightGrads) -> None:
    """Inside a split B: keep `record` for W; in any other backward: accumulate its dW now."""
    if grads.current is None:
        torch.autograd.backward([record.weight], [record.weight_grad()])
    else:
        grads.current.append(record)


class _DeferredLookupFn(torch.autograd.Function):
    """h = W[ids] whose backward leaves dW to W. The ids carry no gradient, so the output
    would not require one: `anchor`, an empty leaf that requires grad, gives it one (and
    receives none); the weight is reached through its holder, as in `_DeferredLinearFn`."""

    @staticmethod
    def forward(ctx, ids, anchor, holder, weight_grads):
        ctx.weight_grads, ctx.weight = weight_grads, holder.weight
        ctx.save_for_backward(ids)
        return F.embedding(ids, holder.weight)  # [b, s, h]

    @staticmethod
    def backward(ctx, dy):
        (ids,) = ctx.saved_tensors
        keep_or_apply(DeferredLookup(ctx.weight, ids, dy), ctx.weight_grads)
        return None, None, None, None


def deferred_lookup(ids: torch.Tensor, holder: nn.Module, weight_grads: WeightGrads) -> torch.Tensor:
    """`F.embedding(ids, holder.weight)`, its weight gradient left to W when autograd is recording."""
    if not (holder.weight.requires_grad and torch.is_grad_enabled()):
        return F.embedding(ids, holder.weight)
    anchor = torch.empty(0, device=ids.device, requires_grad=True)
    return _DeferredLookupFn.apply(ids, anchor, holder, weight_grads)


class DeferredEmbedding(nn.Embedding):
    """An `nn.Embedding` (same Parameter) whose weight gradient W computes; tensor parallelism's
    vocabulary cut keeps the deferral (`VocabParallelEmbedding` looks its rows up through it)."""

    def __init__(self, embedding: nn.Embedding, grads: WeightGrads):
        nn.Module.__init__(self)
        self.num_embeddings, self.embedding_dim = embedding.num_embeddings, embedding.embedding_dim
        self.padding_idx, self.max_norm, self.sparse = None, None, False
        self.weight = embedding.weight
        self.grads = grads

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return deferred_lookup(ids, self, self.grads)


def defer_weight_grads(stage: nn.Module, grads: WeightGrads) -> int:
    """Replace every plain `nn.Linear` of `stage` by a `DeferredLinear` and every plain
    `nn.Embedding` by a `DeferredEmbedding`, on `grads`; returns how many. An adapted linear
    ([lora], `LoRALinear`) stays as it is: its weight is frozen (no dW to defer) and its adapters'
    gradients, two small products, come in B like a norm's."""
    found = [
        (parent, name, child)
        for parent in stage.modules()
        for name, child in parent.named_children()
        if (type(child) is nn.Linear) or type(child) is nn.Embedding  # not an adapted one ([lora]): see below
    ]
    for parent, name, child in found:
        deferred = DeferredLinear if isinstance(child, nn.Linear) else DeferredEmbedding
        setattr(parent, name, deferred(child, grads))
    return len(found)
