"""Collectives with accounting, and the autograd primitives the cuts are built from.

Every collective in fivecut goes through this module. Each call takes a `Group` (a
process group plus the name of the cut it serves and the ledger it reports to) and
writes one record to that ledger. A group of size 1 communicates nothing and records
nothing.

Autograd primitives (Megatron's names in brackets):
    copy_to(x, g)              [f] forward identity,       backward all-reduce
    reduce_from(x, g)          [g] forward all-reduce,     backward identity
    scatter_along(x, d, g)         forward keep my slice,  backward all-gather
    gather_along(x, d, g)          forward all-gather,     backward keep my slice
    gather_along(x, d, g, grad_reduce=True)
                                   forward all-gather,     backward reduce-scatter (sequence parallel)
    reduce_scatter_along(x, d, g)  forward reduce-scatter, backward all-gather (sequence parallel)
    all_to_all(x, g, ...)          forward all-to-all,     backward the reverse all-to-all
"""

from __future__ import annotations

import contextlib
import math
import re
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist

from fivecut.ledger import Ledger

_FakeWork = getattr(getattr(torch._C, "_distributed_c10d", None), "FakeWork", ())  # the fake process group's Work
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(eq=False)
class Group:
    """A process group as one cut sees it. `pg` is None when the group has one rank."""

    cut: str
    ranks: tuple[int, ...]  # global ranks, in group order
    pg: dist.ProcessGroup | None
    ledger: Ledger
    index: int | None = None  # this process's place in `ranks`; None: looked up from the global rank
    # runs each call on the group in place of torch.distributed: transport(name, call, *args) (None:
    # the call itself); the tests put NCCL's in-order point-to-point semantics on gloo here
    transport: object | None = None

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def rank(self) -> int:
        """This process's index inside the group."""
        if self.index is not None:
            return self.index
        return self.ranks.index(dist.get_rank()) if self.size > 1 else 0

    def global_rank(self, group_rank: int) -> int:
        return self.ranks[group_rank]


class CollectiveError(RuntimeError):
    """A collective failed or timed out; the message says which rank, op, cut and group."""


def _run(name: str, group: Group, call, /, *args, **kwargs):
    """Issue `call`; a failure (gloo/NCCL error, timeout) is re-raised naming rank, op and cut."""
    try:
        if group.transport is not None:
            return group.transport(name, call, *args, **kwargs)
        return call(*args, **kwargs)
    except RuntimeError as err:
        raise CollectiveError(failure_message(name, group, err)) from err


def failure_message(name: str, group: Group, err: Exception) -> str:
    """One line: who failed, in which op and cut, among which ranks, and the backend's reason."""
    me = dist.get_rank()
    reason = backend_reason(err)
    text = f"rank {me}: {name} on the {group.cut} group (ranks {list(group.ranks)}) failed: {reason}"
    if "timed out" in reason.lower() or "timeout" in reason.lower():
        text = f"rank {me}: {name} on the {group.cut} group (ranks {list(group.ranks)}) timed out ({reason})"
        text += "; " + missing_ranks(group, me)
    return text


def backend_reason(err: Exception) -> str:
    """The first line of the backend's message, without its source-file prefix."""
    line = (str(err).strip().splitlines() or [type(err).__name__])[0]
    return re.sub(r"^\[[^\]]*\]\s*", "", line)


def missing_ranks(group: Group, me: int) -> str:
    """Gloo does not say which peer never arrived; in a group of two it can only be the other."""
    others = [r for r in group.ranks if r != me]
    if len(others) == 1:
        return f"rank {others[0]} did not arrive"
    return f"one of ranks {others} did not arrive (gloo does not say which)"


# ---------------------------------------------------------------- plain collectives


def opaque(fn):
    """A collective is opaque to torch.compile (train.compile): Dynamo ends its graph at the call and
    runs it, and its ledger record, eagerly; a TP/CP/EP autograd Function around it runs eagerly too."""
    return torch.compiler.disable(fn, recursive=True)


@opaque
def all_reduce(x: torch.Tensor, group: Group, op=dist.ReduceOp.SUM, async_op: bool = False):
    """In-place all-reduce of `x`; returns the Work when `async_op`."""
    if group.size == 1:
        return None
    group.ledger.record("all_reduce", group.cut, group.size, x.numel(), x.element_size())
    return _run("all_reduce", group, dist.all_reduce, x, op=op, group=group.pg, async_op=async_op)


@opaque
def all_gather_into(out: torch.Tensor, x: torch.Tensor, group: Group, async_op: bool = False):
    """`out` [n * x.shape[0], ...] receives every rank's `x`, stacked along dim 0."""
    if group.size == 1:
        out.copy_(x)
        return None
    group.ledger.record("all_gather", group.cut, group.size, out.numel(), out.element_size())
    return _run("all_gather", group, _all_gather_single, out, x, group=group.pg, async_op=async_op)


@opaque
def reduce_scatter_into(out: torch.Tensor, x: torch.Tensor, group: Group, op=dist.ReduceOp.SUM, async_op: bool = False):
    """`out` [x.shape[0] / n, ...] receives this rank's slice (dim 0) of the sum of every rank's `x`."""
    if group.size == 1:
        out.copy_(x)
        return None
    group.ledger.record("reduce_scatter", group.cut, group.size, x.numel(), x.element_size())
    return _run("reduce_scatter", group, _reduce_scatter_single, out, x, op=op, group=group.pg, async_op=async_op)


@opaque
def all_gather(x: torch.Tensor, group: Group, dim: int = 0) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim` (one copy when dim > 0, none for dim 0)."""
    if group.size == 1:
        return x
    x, dim = x.contiguous(), dim % x.dim()
    out = x.new_empty((group.size, *x.shape))  # [n, ...] rank-major
    all_gather_into(out.flatten(0, 1), x, group)
    return out.movedim(0, dim).flatten(dim, dim + 1)


@opaque
def reduce_scatter(x: torch.Tensor, group: Group, dim: int = 0) -> torch.Tensor:
    """Sum `x` over the group and keep this rank's slice along `dim` (one copy when dim > 0)."""
    if group.size == 1:
        return x
    n, dim = group.size, dim % x.dim()
    if x.shape[dim] % n:
        raise ValueError(f"reduce_scatter: dim {dim} of size {x.shape[dim]} does not divide by group size {n}")
    chunks = x.unflatten(dim, (n, x.shape[dim] // n)).movedim(dim, 0).contiguous()  # [n, ...] rank-major
    out = chunks.new_empty(chunks.shape[1:])
    reduce_scatter_into(out, chunks.flatten(0, 1), group)
    return out


@opaque
def all_to_all_single(
    x: torch.Tensor, group: Group, out_splits: list[int] | None = None, in_splits: list[int] | None = None
) -> torch.Tensor:
    """Exchange slices of dim 0: slice i of `x` (sizes `in_splits`) goes to rank i."""
    if group.size == 1:
        return x
    row = math.prod(x.shape[1:])  # elements per row (x may have no rows)
    rows_out = sum(out_splits) if out_splits is not None else x.shape[0]
    out = x.new_empty((rows_out, *x.shape[1:]))
    sent_rows = (
        (sum(in_splits) - in_splits[group.rank])
        if in_splits is not None
        else x.shape[0] * (group.size - 1) / group.size
    )
    group.ledger.record(
        "all_to_all", group.cut, group.size, x.numel(), x.element_size(), wire_bytes=sent_rows * row * x.element_size()
    )
    _run("all_to_all", group, dist.all_to_all_single, out, x.contiguous(), out_splits, in_splits, group=group.pg)
    return out


def completed(work) -> bool:
    """Whether an asynchronous op has completed (a fake process group's, the memory check's, at
    once: nothing is sent, though its Works never say so)."""
    return isinstance(work, _FakeWork) or work.is_completed()


@opaque
def wait(work, op: str, group: Group) -> None:
    """Wait for an asynchronous collective, naming it if it fails or times out."""
    if work is not None:
        _run(op, group, work.wait)


class P2P(NamedTuple):
    """One message of `batch_send_recv`; a plain (tensor, peer) pair reads as one."""

    tensor: torch.Tensor
    peer: int  # a group rank
    tag: int | None = None  # None: the call's tag (NCCL ignores tags: nothing may rely on them)
    phase: str | None = None  # the ledger phase its record goes to; None: the current one


@opaque
def batch_send_recv(sends: list, recvs: list, group: Group, tag: int = 0):
    """Post point-to-point sends and receives (`P2P`s, or (tensor, peer) pairs) as one batch; returns
    the Works: one per message on gloo, one for the whole batch on NCCL (it runs the batch together)."""
    if group.size == 1:  # a rank talking to itself: copy, nothing on the wire
        for (sent, *_), (received, *_) in zip(sends, recvs):
            received.copy_(sent)
        return []
    ops = []
    for op, entries, kind in ((dist.isend, sends, "send"), (dist.irecv, recvs, "recv")):
        for entry in entries:
            message = P2P(*entry)
            t = message.tensor
            with group.ledger.phase(message.phase) if message.phase else contextlib.nullcontext():
                group.ledger.record(kind, group.cut, group.size, t.numel(), t.element_size())
            peer = group.global_rank(message.peer)
            ops.append(dist.P2POp(op, t, peer, group=group.pg, tag=tag if message.tag is None else message.tag))
    return _run("send/recv", group, dist.batch_isend_irecv, ops) if ops else []


# ---------------------------------------------------------------- autograd primitives


def my_slice(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    if x.shape[dim] % group.size:
        raise ValueError(f"dim {dim} of size {x.shape[dim]} does not divide by group size {group.size} ({group.cut})")
    return x.chunk(group.size, dim=dim)[group.rank].contiguous()


class _CopyTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        all_reduce(grad, ctx.group)
        return grad, None


class _ReduceFrom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        out = x.contiguous().clone()
        all_reduce(out, group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return my_slice(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather(grad.contiguous(), ctx.group, ctx.dim), None, None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group, grad_reduce):
        ctx.dim, ctx.group, ctx.grad_reduce = dim, group, grad_reduce
        return all_gather(x.contiguous(), group, dim)

    @staticmethod
    def backward(ctx, grad):
        if ctx.grad_reduce:
            return reduce_scatter(grad, ctx.group, ctx.dim), None, None, None
        return my_slice(grad, ctx.dim, ctx.group), None, None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return reduce_scatter(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return all_gather(grad.contiguous(), ctx.group, ctx.dim), None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, out_splits, in_splits):
        ctx.group, ctx.out_splits, ctx.in_splits = group, out_splits, in_splits
        return all_to_all_single(x, group, out_splits, in_splits)

    @staticmethod
    def backward(ctx, grad):
        back = all_to_all_single(grad.contiguous(), ctx.group, ctx.in_splits, ctx.out_splits)
        return back, None, None, None


def copy_to(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Megatron's f: enter a parallel region (identity forward, all-reduce of the gradient)."""
    return x if group.size == 1 else _CopyTo.apply(x, group)


def reduce_from(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Megatron's g: leave a parallel region (all-reduce forward, identity backward)."""
    return x if group.size == 1 else _ReduceFrom.apply(x, group)


def scatter_along(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    return x if group.size == 1 else _Scatter.apply(x, dim, group)


def gather_along(x: torch.Tensor, dim: int, group: Group, grad_reduce: bool = False) -> torch.Tensor:
    """All-gather along `dim`; the gradient is sliced, or reduce-scattered when `grad_reduce`."""
    return x if group.size == 1 else _Gather.apply(x, dim, group, grad_reduce)


def reduce_scatter_along(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    return x if group.size == 1 else _ReduceScatter.apply(x, dim, group)


def all_to_all(x: torch.Tensor, group: Group, out_splits: list[int] | None = None, in_splits: list[int] | None = None):
    """Differentiable all-to-all along dim 0; the backward sends gradients the reverse way."""
    return x if group.size == 1 else _AllToAll.apply(x, group, out_splits, in_splits)
