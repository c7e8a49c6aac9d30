"""Data parallelism (DDP): cut the batch, sum the gradients.

Every rank holds the whole model and a slice of the global batch. Because the loss is
already divided by the token count of the *global* batch, the gradients are summed (not
averaged) over the data-parallel group.

Gradients live in flat buckets (one contiguous buffer per ~`bucket_mb` of parameters,
in the reverse order of the parameters, which is roughly the order backward produces
them); each parameter's `.grad` is a view into its bucket, so autograd accumulates
straight into the buffer that is communicated. A post-accumulate-grad hook counts the
gradients that are ready; a full bucket is reduced asynchronously while backward
carries on with earlier layers. Buckets are launched strictly in index order so that
every rank issues the same collectives in the same order. At the end of backward a
queued callback launches whatever is left (unused parameters) and waits for all.

`GradReducer` is that machinery without the choice of collective; DDP all-reduces,
ZeRO-1/2 (`fivecut.parallel.zero`) reduce-scatter.

Communication per optimizer step: one all-reduce of every gradient, 2(n-1)/n x 4Phi bytes
on the wire per rank in fp32 (Phi = number of parameters).
"""

from __future__ import annotations

import abc
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from fivecut import comm
from fivecut.comm import Group


def decays(p: torch.Tensor) -> bool:
    """Weight decay applies to matrices (embeddings, projections, experts), not to norm weights."""
    return p.dim() >= 2


def tp_replicated(p: torch.Tensor, tp: int) -> bool:
    """Whether `p` holds the same values on every tensor-parallel rank (not cut by tensor parallelism)."""
    return tp > 1 and getattr(p, "fivecut_tp", None) is None


def norm_share(p: torch.Tensor) -> float:
    """The part of `p`'s squared norm this copy contributes: 1, or 1/k for one of k copies kept on
    different pipeline ranks (tied embeddings on the first and the last stage)."""
    return getattr(p, "fivecut_norm_share", 1.0)


def reduce_group(p: torch.Tensor) -> str:
    """The mesh group over which `p`'s gradient is summed: dp x cp unless the parameter says otherwise
    (MoE experts: `expert_dp`; the router and shared experts under tp: `dp_cp_tp`)."""
    return getattr(p, "fivecut_reduce", "dp_cp")


def param_kind(p: torch.Tensor, tp: int) -> tuple[bool, bool, float]:
    return decays(p), tp_replicated(p, tp), norm_share(p)


def flat_order(p: torch.Tensor) -> tuple[bool, bool]:
    """Sort key inside flat buffers: decayed first, then tensor-parallel shards before replicas,
    so that a ZeRO shard splits into few homogeneous optimizer pieces."""
    return (not decays(p), getattr(p, "fivecut_tp", None) is None)


@dataclass(eq=False)
class Piece:
    """What an optimizer updates: a parameter or a slice of a ZeRO shard, `.grad` set."""

    tensor: torch.Tensor
    decays: bool
    tp_replicated: bool  # identical on every tensor-parallel rank: counted once in the global norm
    norm_share: float = 1.0  # see `norm_share`


@dataclass(eq=False)
class Bucket:
    params: list[nn.Parameter]  # in flat-buffer order: decayed parameters first
    flat: torch.Tensor | None = None  # [padded numel] gradients of `params`, when kept in one buffer
    ready: int = 0
    work: object | None = None
    wire: torch.Tensor | None = None  # what is on the wire when it differs from `flat` (reduce dtype)
    out: torch.Tensor | None = None  # the reduction's result when it is not written in place


def plan_buckets(params: list[nn.Parameter], bucket_bytes: int) -> list[list[nn.Parameter]]:
    """Group parameters (in the given order) into runs of about `bucket_bytes`, one dtype per run,
    each run sorted by `flat_order`."""
    buckets: list[list[nn.Parameter]] = []
    size = 0
    for p in params:
        fresh = not buckets or size + p.numel() * p.element_size() > bucket_bytes or buckets[-1][-1].dtype != p.dtype
        if fresh:
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += p.numel() * p.element_size()
    return [sorted(b, key=flat_order) for b in buckets]


def padded(numel: int, parts: int) -> int:
    return -(-numel // parts) * parts


def point_grads_into(params: list[nn.Parameter], pad_to: int = 1) -> torch.Tensor:
    """Allocate one flat gradient buffer (padded to a multiple of `pad_to`) and point each `.grad` into it."""
    total = padded(sum(p.numel() for p in params), pad_to)
    flat = torch.zeros(total, dtype=params[0].dtype, device=params[0].device)
    offset = 0
    for p in params:
        p.grad = flat[offset : offset + p.numel()].view_as(p)
        offset += p.numel()
    return flat


class GradReducer(abc.ABC):
    """Launch a reduction of each bucket as soon as backward has produced all its gradients."""

    def __init__(self, buckets: list[Bucket], group: Group, reduce_dtype: torch.dtype | None = None):
        self.group = group
        self.buckets = buckets
        self.reduce_dtype = reduce_dtype  # None: reduce in the gradients' own dtype
        self.bucket_of = {p: b for b in buckets for p in b.params}
        self.sync = True
        self._callback_queued = False
        self._next = 0  # index of the next bucket to launch
        for p in self.bucket_of:
            p.register_post_accumulate_grad_hook(self._on_grad_ready)

    @contextmanager
    def no_sync(self):
        """Accumulate gradients locally (gradient-accumulation micro-steps): no communication."""
        previous, self.sync = self.sync, False
        try:
            yield
        finally:
            self.sync = previous

    def reducing(self) -> bool:
        """Whether this backward pass communicates."""
        return self.sync and self.group.size > 1

    def after_step(self) -> None:
        """Called after the optimizer step (ZeRO gathers the updated parameters here)."""

    def reduce_all(self) -> None:
        """Reduce every bucket now (after a pipeline schedule ran its backwards under `no_sync`)."""
        if self.group.size > 1:
            self._next = 0
            self._finish()

    def grad_arrived(self, param: nn.Parameter) -> None:
        """A gradient was accumulated into `param.grad` (subclasses keep it in place)."""

    @abc.abstractmethod
    def launch(self, bucket: Bucket) -> object:
        """Start reducing `bucket`; return the asynchronous work."""

    def complete(self, bucket: Bucket) -> None:
        """The reduction of `bucket` finished (subclasses consume its result)."""

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        self.grad_arrived(param)
        if not self.reducing():
            return
        if not self._callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            self._callback_queued = True
        self.bucket_of[param].ready += 1
        while self._next < len(self.buckets) and self.buckets[self._next].ready == len(self.buckets[self._next].params):
            self._launch_next()

    def _launch_next(self) -> None:
        bucket = self.buckets[self._next]
        bucket.work = self.launch(bucket)
        self._next += 1

    def _finish(self) -> None:
        """End of backward: launch what is left (parameters without gradient), wait for all."""
        while self._next < len(self.buckets):
            self._launch_next()
        for bucket in self.buckets:
            comm.wait(bucket.work, "reduction", self.group)
            self.complete(bucket)
            bucket.work, bucket.ready, bucket.wire = None, 0, None
        self._next = 0
        self._callback_queued = False

    def to_wire(self, flat: torch.Tensor) -> torch.Tensor:
        """The tensor to communicate: `flat` itself, or a copy in the reduce dtype."""
        if self.reduce_dtype is None or self.reduce_dtype == flat.dtype:
            return flat
        return flat.to(self.reduce_dtype)


class DataParallel(GradReducer):
    """Bucketed, overlapped gradient all-reduce over `group` for the parameters of `module`
    (or the subset `params` of them)."""

    def __init__(
        self,
        module: nn.Module,
        group: Group,
        bucket_mb: float = 25.0,
        reduce_dtype: torch.dtype | None = None,
        params: list[nn.Parameter] | None = None,
    ):
        self.module = module
        self.params = params if params is not None else [p for p in module.parameters() if p.requires_grad]
        plan = plan_buckets(list(reversed(self.params)), int(bucket_mb * 2**20))
        buckets = [Bucket(ps, point_grads_into(ps, pad_to=self.pad_to(group))) for ps in plan]
        super().__init__(buckets, group, reduce_dtype)
        self.view_of = {p: p.grad for p in self.params}  # each .grad's place in its bucket

    def pad_to(self, group: Group) -> int:
        return 1

    def zero_grad(self) -> None:
        for bucket in self.buckets:
            bucket.flat.zero_()
        for p, view in self.view_of.items():
            p.grad = view

    def grad_arrived(self, param: nn.Parameter) -> None:
        """If `.grad` was replaced (e.g. optimizer.zero_grad(set_to_none=True)), move it back into the bucket."""
        view = self.view_of[param]
        if param.grad is not view:
            view.copy_(param.grad)
            param.grad = view

    def launch(self, bucket: Bucket) -> object:
        bucket.wire = self.to_wire(bucket.flat)
        return comm.all_reduce(bucket.wire, self.group, async_op=True)

    def complete(self, bucket: Bucket) -> None:
        if bucket.wire is not bucket.flat:
            bucket.flat.copy_(bucket.wire)
