"""`parallelize`: apply the cuts to a single-device model, in a fixed order.

    EP -> TP/SP -> CP -> PP split -> activation checkpointing -> DP/ZeRO

The model code never changes; each cut rewrites or wraps modules from outside and
receives the process group it uses from the `Mesh`. This version applies DP (DDP over
the dp x cp group); `ParallelDims.validate` refuses the cuts that are not built yet.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from fivecut.comm import Group
from fivecut.mesh import Mesh
from fivecut.parallel.data import DataParallel


@dataclass
class Parallelized:
    module: nn.Module  # what the trainer calls forward on
    grad_sync: DataParallel  # no_sync() for accumulation micro-steps, zero_grad()
    params: list[nn.Parameter]  # what this rank's optimizer updates
    grad_shard_group: Group | None  # sums squared gradient norms when grads are sharded; None if replicated


def parallelize(model: nn.Module, mesh: Mesh, bucket_mb: float = 25.0) -> Parallelized:
    dims = mesh.dims
    unimplemented = dims.unimplemented()
    if unimplemented:
        raise ValueError("parallelize: " + "; ".join(unimplemented))
    sync = DataParallel(model, mesh.group("dp_cp"), bucket_mb=bucket_mb)
    return Parallelized(model, sync, sync.params, grad_shard_group=None)
