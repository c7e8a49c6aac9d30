"""Data parallelism (DDP): cut the batch, sum the gradients.

Every rank holds the whole model and a slice of the global batch. Because the loss is
already divided by the token count of the *global* batch, the gradients are summed (not
averaged) over the data-parallel group.

Gradients live in flat buckets (one contiguous buffer per ~`bucket_mb` of parameters,
in the reverse order of the parameters, which is roughly the order backward produces
them); each parameter's `.grad` is a view into its bucket, so autograd accumulates
straight into the buffer that is communicated. A post-accumulate-grad hook counts the
gradients that are ready; a full bucket is all-reduced asynchronously while backward
carries on with earlier layers. Buckets are launched strictly in index order so that
every rank issues the same collectives in the same order. At the end of backward a
queued callback launches whatever is left (unused parameters) and waits for all.

Communication per optimizer step: one all-reduce of every gradient, 2(n-1)/n x 4Phi bytes
on the wire per rank in fp32 (Phi = number of parameters).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from fivecut import comm
from fivecut.comm import Group


@dataclass(eq=False)
class Bucket:
    params: list[nn.Parameter]
    flat: torch.Tensor  # [sum of numel] gradient storage of these params
    ready: int = 0
    work: object | None = None


def plan_buckets(params: list[nn.Parameter], bucket_bytes: int) -> list[list[nn.Parameter]]:
    """Group parameters (in the given order) into runs of about `bucket_bytes`, one dtype per run."""
    buckets: list[list[nn.Parameter]] = []
    size = 0
    for p in params:
        fresh = not buckets or size + p.numel() * p.element_size() > bucket_bytes or buckets[-1][-1].dtype != p.dtype
        if fresh:
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += p.numel() * p.element_size()
    return buckets


def bucket_views(params: list[nn.Parameter]) -> Bucket:
    """Allocate one flat gradient buffer for `params` and point each `.grad` into it."""
    total = sum(p.numel() for p in params)
    flat = torch.zeros(total, dtype=params[0].dtype, device=params[0].device)
    offset = 0
    for p in params:
        p.grad = flat[offset : offset + p.numel()].view_as(p)
        offset += p.numel()
    return Bucket(params, flat)


class DataParallel:
    """Bucketed, overlapped gradient all-reduce over `group` for the parameters of `module`."""

    def __init__(self, module: nn.Module, group: Group, bucket_mb: float = 25.0):
        self.module = module
        self.group = group
        self.params = [p for p in module.parameters() if p.requires_grad]
        backward_order = list(reversed(self.params))
        self.buckets = [bucket_views(ps) for ps in plan_buckets(backward_order, int(bucket_mb * 2**20))]
        self.bucket_of = {p: b for b in self.buckets for p in b.params}
        self.view_of = {p: p.grad for p in self.params}  # each .grad's place in its bucket
        self.sync = True
        self._callback_queued = False
        self._next = 0  # index of the next bucket to launch
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._on_grad_ready)

    @contextmanager
    def no_sync(self):
        """Accumulate gradients locally (gradient-accumulation micro-steps): no communication."""
        previous, self.sync = self.sync, False
        try:
            yield
        finally:
            self.sync = previous

    def zero_grad(self) -> None:
        for bucket in self.buckets:
            bucket.flat.zero_()
        for p, view in self.view_of.items():
            p.grad = view

    def _into_bucket(self, param: nn.Parameter) -> None:
        """If `.grad` was replaced (e.g. optimizer.zero_grad(set_to_none=True)), move it back into the bucket."""
        view = self.view_of[param]
        if param.grad is not view:
            view.copy_(param.grad)
            param.grad = view

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        self._into_bucket(param)
        if not self.sync or self.group.size == 1:
            return
        if not self._callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            self._callback_queued = True
        bucket = self.bucket_of[param]
        bucket.ready += 1
        while self._next < len(self.buckets) and self.buckets[self._next].ready == len(self.buckets[self._next].params):
            self._launch(self.buckets[self._next])

    def _launch(self, bucket: Bucket) -> None:
        bucket.work = comm.all_reduce(bucket.flat, self.group, async_op=True)
        self._next += 1

    def _finish(self) -> None:
        """End of backward: launch what is left (parameters without gradient), wait for all."""
        while self._next < len(self.buckets):
            self._launch(self.buckets[self._next])
        for bucket in self.buckets:
            comm.wait(bucket.work, "all_reduce", self.group)
            bucket.work, bucket.ready = None, 0
        self._next = 0
        self._callback_queued = False
