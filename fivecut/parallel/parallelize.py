"""`parallelize`: apply the cuts to a single-device model, in a fixed order.

    EP -> TP/SP -> CP -> PP split -> activation checkpointing -> DP/ZeRO

The model code never changes; each cut rewrites or wraps modules from outside and
receives the process group it uses from the `Mesh`. This version applies tensor (and
sequence) parallelism over the tp group, then the data cut -- DDP (zero=0) or
ZeRO-1/2/3 -- over the dp x cp group; `ParallelDims.validate` refuses the cuts that are
not built yet.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from fivecut.comm import Group
from fivecut.mesh import Mesh
from fivecut.parallel.data import DataParallel, Piece, decays, tp_replicated
from fivecut.parallel.saved import SavedActivations
from fivecut.parallel.tensor import apply_tensor_parallel, check_shards, vocab_parallel_loss_sum
from fivecut.parallel.zero import FullyShardedDataParallel, ZeroDataParallel

GradSync = DataParallel | ZeroDataParallel | FullyShardedDataParallel


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum of per-token cross-entropy, in fp32.  logits [b, s, V], targets [b, s]."""
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")


@dataclass
class Parallelized:
    module: nn.Module  # what the trainer calls forward on
    sync: GradSync  # no_sync() for accumulation micro-steps, zero_grad(), after_step()
    pieces: list[Piece]  # what this rank's optimizer updates
    loss_sum: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (logits, targets) -> sum of token losses
    norm_groups: list[Group]  # groups over which squared gradient norms are summed
    saved: SavedActivations  # wrap each forward in `saved.forward()`

    @property
    def grads(self) -> list[torch.Tensor]:
        """The gradients this rank's optimizer reads (shards under ZeRO)."""
        return [piece.tensor.grad for piece in self.pieces]

    def state_tensors(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Parameters and gradients this rank holds, for memory accounting (storages may repeat)."""
        params = list(self.module.parameters()) + [piece.tensor for piece in self.pieces]
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
    tp_group = mesh.group("tp")
    loss_sum = token_loss_sum
    saved = SavedActivations()
    saved.track_layers(model.layers)
    if dims.tp > 1:
        apply_tensor_parallel(model, tp_group, dims.sp, saved)
        check_shards(model, model.args, dims.tp)
        vocab = model.args.vocab_size
        loss_sum = lambda logits, targets: vocab_parallel_loss_sum(logits, targets, tp_group, vocab)  # noqa: E731
    sync, pieces = data_parallel(model, mesh, bucket_mb, reduce_dtype)
    groups = ([mesh.group("dp_cp")] if dims.zero else []) + ([tp_group] if dims.tp > 1 else [])
    return Parallelized(model, sync, pieces, loss_sum, groups, saved)


def data_parallel(model: nn.Module, mesh: Mesh, bucket_mb: float, reduce_dtype) -> tuple[GradSync, list[Piece]]:
    dims, group = mesh.dims, mesh.group("dp_cp")
    if dims.zero == 0:
        sync = DataParallel(model, group, bucket_mb=bucket_mb, reduce_dtype=reduce_dtype)
        return sync, [Piece(p, decays(p), tp_replicated(p, dims.tp)) for p in sync.params]
    if dims.zero in (1, 2):
        sync = ZeroDataParallel(model, group, dims.zero, bucket_mb=bucket_mb, reduce_dtype=reduce_dtype, tp=dims.tp)
    else:
        sync = FullyShardedDataParallel(model, group, dims.reshard_after_forward, reduce_dtype=reduce_dtype, tp=dims.tp)
    return sync, sync.optimizer_pieces()
