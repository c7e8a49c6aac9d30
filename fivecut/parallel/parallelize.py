"""`parallelize`: apply the cuts to a single-device model, in a fixed order.

    EP -> TP/SP -> CP -> PP split -> activation checkpointing -> DP/ZeRO

The model code never changes; each cut rewrites or wraps modules from outside and
receives the process group it uses from the `Mesh`. This version applies the data cut:
DDP (zero=0) or ZeRO-1/2/3 over the dp x cp group; `ParallelDims.validate` refuses the
cuts that are not built yet.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from fivecut.comm import Group
from fivecut.mesh import Mesh
from fivecut.parallel.data import DataParallel, decays
from fivecut.parallel.zero import FullyShardedDataParallel, ZeroDataParallel

GradSync = DataParallel | ZeroDataParallel | FullyShardedDataParallel


@dataclass
class Parallelized:
    module: nn.Module  # what the trainer calls forward on
    sync: GradSync  # no_sync() for accumulation micro-steps, zero_grad(), after_step()
    pieces: list[tuple[torch.Tensor, bool]]  # what this rank's optimizer updates, and whether it decays
    grad_shard_group: Group | None  # sums squared gradient norms when gradients are sharded; None if replicated

    @property
    def grads(self) -> list[torch.Tensor]:
        """The gradients this rank's optimizer reads (shards under ZeRO)."""
        return [t.grad for t, _ in self.pieces]

    def state_tensors(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Parameters and gradients this rank holds, for memory accounting (storages may repeat)."""
        params = list(self.module.parameters()) + [t for t, _ in self.pieces]
        return params, [p.grad for p in params]


def parallelize(
    model: nn.Module,
    mesh: Mesh,
    bucket_mb: float = 25.0,
    reduce_dtype: torch.dtype | None = None,
) -> Parallelized:
    dims = mesh.dims
    unimplemented = dims.unimplemented()
    if unimplemented:
        raise ValueError("parallelize: " + "; ".join(unimplemented))
    group = mesh.group("dp_cp")
    if dims.zero == 0:
        sync = DataParallel(model, group, bucket_mb=bucket_mb, reduce_dtype=reduce_dtype)
        return Parallelized(model, sync, [(p, decays(p)) for p in sync.params], grad_shard_group=None)
    if dims.zero in (1, 2):
        sync = ZeroDataParallel(model, group, dims.zero, bucket_mb=bucket_mb, reduce_dtype=reduce_dtype)
    else:
        sync = FullyShardedDataParallel(model, group, dims.reshard_after_forward, reduce_dtype=reduce_dtype)
    return Parallelized(model, sync, sync.optimizer_pieces(), grad_shard_group=group)
