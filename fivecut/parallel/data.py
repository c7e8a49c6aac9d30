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

Besides the model states a data cut holds buffers for a while: copies in the reduce dtype,
ZeRO's reduced shards before they are added, ZeRO-2's gradients before their bucket is sent,
ZeRO-3's gathered units. `BufferPeak` keeps the most bytes they took at once, sampled where
they peak (each launch, each gather); `fivecut ledger` prints it next to the planner's figure.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

from fivecut import comm
from fivecut.comm import Group
from fivecut.parallel.placement import FlatSlot, ParamKind


def decays(p: torch.Tensor) -> bool:
    """Weight decay applies to matrices (embeddings, projections, experts), not to norm weights."""
    return p.dim() >= 2


Kinds = Mapping[nn.Parameter, ParamKind]  # what the data cut knows of each parameter (from its placement)


def plain_kinds(params: list[nn.Parameter]) -> dict[nn.Parameter, ParamKind]:
    """Parameters of an uncut model: summed over dp x cp, no copies elsewhere."""
    return {p: ParamKind(decays(p)) for p in params}


def flat_order(kind: ParamKind) -> tuple[bool, bool]:
    """Sort key inside flat buffers: decayed first, then tensor-parallel shards before replicas,
    so that a ZeRO shard splits into few homogeneous optimizer pieces."""
    return (not kind.decays, not kind.sliced)


@dataclass(eq=False)
class Piece:
    """What an optimizer updates: a parameter or a slice of a ZeRO shard, `.grad` set."""

    tensor: torch.Tensor
    decays: bool
    norm_weight: float = 1.0  # its squared gradient norm counts this much (1 / copies across the norm's ranks)


@dataclass
class Held:
    """Where a run of a parameter's flat elements lives on this rank (`GradSync.held`):
    values     (flat tensor, at): the tensor holds the parameter's elements [at, at + its numel)
    optimized  (optimizer tensor, lo, hi, at): the tensor's elements [lo, hi), whose optimizer
               state (Adam's moments) is the parameter's elements [at, at + hi - lo)."""

    values: list[tuple[torch.Tensor, int]] = field(default_factory=list)
    optimized: list[tuple[torch.Tensor, int, int, int]] = field(default_factory=list)

    def __add__(self, other: Held) -> Held:
        return Held(self.values + other.values, self.optimized + other.optimized)


class GradSync(Protocol):
    """The interface of every data cut (DDP, ZeRO-1/2/3, several of them over different groups)."""

    def no_sync(self) -> AbstractContextManager: ...  # accumulate locally: no communication
    def zero_grad(self) -> None: ...
    def reduce(self) -> None: ...  # reduce every gradient now (after a pipeline schedule's backwards)
    def after_step(self) -> None: ...  # after the optimizer step (ZeRO-1/2 launch the parameters' gathers)
    def settle(self) -> None: ...  # every parameter whole now (before a checkpoint or any read outside forward)
    def pieces(self) -> list[Piece]: ...  # what this rank's optimizer updates
    def held(self, param: nn.Parameter, lo: int, hi: int) -> Held: ...  # flat elements [lo, hi) of `param`
    def flat_slots(self) -> dict[nn.Parameter, FlatSlot]: ...  # ZeRO: each parameter's place in a flat shard
    def buffer_peak(self) -> int: ...  # the most bytes its buffers held at once (`BufferPeak`)


@dataclass
class BufferPeak:
    """The most bytes a data cut's buffers held at once (distinct storages, as allocated)."""

    bytes: int = 0

    def sample(self, tensors: list[torch.Tensor | None]) -> None:
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t is not None}
        self.bytes = max(self.bytes, sum(storages.values()))


@dataclass(eq=False)
class Bucket:
    params: list[nn.Parameter]  # in flat-buffer order: decayed parameters first
    flat: torch.Tensor | None = None  # [padded numel] gradients of `params`, when kept in one buffer
    ready: int = 0
    work: object | None = None
    wire: torch.Tensor | None = None  # what is on the wire when it differs from `flat` (reduce dtype)
    out: torch.Tensor | None = None  # the reduction's result when it is not written in place
    settled: bool = False  # its reduction of this backward was waited for and consumed


def plan_buckets(params: list[nn.Parameter], bucket_bytes: int, kinds: Kinds | None = None) -> list[list[nn.Parameter]]:
    """Group parameters (in the given order) into runs of about `bucket_bytes`, one dtype per run,
    each run sorted by `flat_order` (of an uncut model's parameters, without `kinds`)."""
    kinds = kinds if kinds is not None else plain_kinds(params)
    buckets: list[list[nn.Parameter]] = []
    size = 0
    for p in params:
        fresh = not buckets or size + p.numel() * p.element_size() > bucket_bytes or buckets[-1][-1].dtype != p.dtype
        if fresh:
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += p.numel() * p.element_size()
    return [sorted(b, key=lambda p: flat_order(kinds[p])) for b in buckets]


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
        self.buffers = BufferPeak()
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
        """Called after the optimizer step (ZeRO-1/2 launch the updated parameters' gathers here)."""

    def settle(self) -> None:
        """Every parameter is whole and final (ZeRO-1/2: their gathers waited for)."""

    def reduce(self) -> None:
        """Reduce every bucket now (after a pipeline schedule ran its backwards under `no_sync`)."""
        if self.group.size > 1:
            self._next = 0
            self._finish()

    def start_reduce(self) -> None:
        """A pipeline stage's last backward is done (`zero_pipeline`); here nothing starts early:
        `reduce` does it all (ZeRO-2 starts its buckets)."""

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
        self.buffers.sample(self.held_buffers())

    def _settle(self, bucket: Bucket) -> None:
        """Wait for `bucket`'s reduction and consume it, once a backward."""
        if not bucket.settled:
            comm.wait(bucket.work, "reduction", self.group)
            self.complete(bucket)
            bucket.work, bucket.wire, bucket.settled = None, None, True

    def _finish(self) -> None:
        """End of backward: launch what is left (parameters without gradient), wait for all."""
        while self._next < len(self.buckets):
            self._launch_next()
        for bucket in self.buckets:
            self._settle(bucket)
            bucket.ready, bucket.settled = 0, False
        self._next = 0
        self._callback_queued = False

    def held_buffers(self) -> list[torch.Tensor | None]:
        """What this cut holds now beyond its model states: copies on the wire, reduced shards."""
        wires = [b.wire for b in self.buckets if b.wire is not b.flat]
        return wires + [b.out for b in self.buckets]

    def buffer_peak(self) -> int:
        return self.buffers.bytes

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
        kinds: Kinds | None = None,
    ):
        self.module = module
        self.params = params if params is not None else [p for p in module.parameters() if p.requires_grad]
        self.kinds = kinds if kinds is not None else plain_kinds(self.params)
        plan = plan_buckets(list(reversed(self.params)), int(bucket_mb * 2**20), self.kinds)
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

    def pieces(self) -> list[Piece]:
        return [Piece(p, self.kinds[p].decays, self.kinds[p].norm_weight) for p in self.params]

    def held(self, param: nn.Parameter, lo: int, hi: int) -> Held:
        if param not in self.bucket_of:
            return Held()
        return Held([(param.data.view(-1)[lo:hi], lo)], [(param, lo, hi, lo)])

    def flat_slots(self) -> dict[nn.Parameter, FlatSlot]:
        return {}  # DDP keeps whole parameters; its buckets hold gradients only

    def launch(self, bucket: Bucket) -> object:
        bucket.wire = self.to_wire(bucket.flat)
        return comm.all_reduce(bucket.wire, self.group, async_op=True)

    def complete(self, bucket: Bucket) -> None:
        if bucket.wire is not bucket.flat:
            bucket.flat.copy_(bucket.wire)


class SyncSet:
    """Several gradient reductions (one per group) driven as one."""

    def __init__(self, syncs: list[GradSync]):
        self.syncs = syncs

    @contextmanager
    def no_sync(self):
        with ExitStack() as stack:
            for sync in self.syncs:
                stack.enter_context(sync.no_sync())
            yield

    def zero_grad(self) -> None:
        for sync in self.syncs:
            sync.zero_grad()

    def reduce(self) -> None:
        for sync in self.syncs:
            sync.reduce()

    def after_step(self) -> None:
        for sync in self.syncs:
            sync.after_step()

    def settle(self) -> None:
        for sync in self.syncs:
            sync.settle()

    def pieces(self) -> list[Piece]:
        return [piece for sync in self.syncs for piece in sync.pieces()]

    def held(self, param: nn.Parameter, lo: int, hi: int) -> Held:
        return sum((sync.held(param, lo, hi) for sync in self.syncs), Held())

    def flat_slots(self) -> dict[nn.Parameter, FlatSlot]:
        return {p: slot for sync in self.syncs for p, slot in sync.flat_slots().items()}

    def buffer_peak(self) -> int:
        """The cuts' peaks added: they may coincide (one backward drives them all)."""
        return sum(sync.buffer_peak() for sync in self.syncs)
