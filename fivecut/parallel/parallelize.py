"""`parallelize`: apply the cuts to a single-device model, in a fixed order.

    EP -> TP/SP -> CP -> PP split -> activation checkpointing -> DP/ZeRO

The model code never changes; each cut rewrites or wraps modules from outside and
receives the process group it uses from the `Mesh`. This version cuts the experts over
the ep group (and installs the MoE runtime: capacity, balancing, statistics), applies
tensor (and sequence) parallelism over the tp group, Ulysses attention over the cp group
(the trainer feeds each cp rank its chunk of the sequence), splits the layers into pipeline
stages, then the data cut -- DDP (zero=0) or ZeRO-1/2/3 -- sums each gradient over the
group its parameter is replicated on: dp x cp for most, `expert_dp` for experts,
dp x cp x tp for the router and shared experts under tp. `ParallelDims.validate`
refuses the cuts that are not built yet.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from fivecut import comm
from fivecut.comm import Group
from fivecut.mesh import Mesh
from fivecut.model import build_model
from fivecut.parallel.context import apply_context_parallel
from fivecut.parallel.data import DataParallel, Piece, param_kind, reduce_group
from fivecut.parallel.expert import ExpertBalancer, MoEOptions, apply_expert_parallel
from fivecut.parallel.pipeline.schedule import Schedule, build_schedule, check
from fivecut.parallel.pipeline.split import build_stage, stage_layers, tied_weight
from fivecut.parallel.saved import SavedActivations
from fivecut.parallel.tensor import (
    apply_tensor_parallel,
    check_shards,
    vocab_parallel_loss_sum,
)
from fivecut.parallel.zero import FullyShardedDataParallel, ZeroDataParallel

GradSync = "DataParallel | ZeroDataParallel | FullyShardedDataParallel | SyncSet"


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
    pipeline: Pipeline | None = None  # pipeline parallelism: the schedule and this rank's stages
    experts: ExpertBalancer | None = None  # MoE models: load statistics, balancing, EPLB

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
    moe: MoEOptions | None = None,
    global_batch: int = 1,
) -> Parallelized:
    """Apply every cut of `mesh.dims` to `model` (built whole from the seed); `moe` and
    `global_batch` (sequences per optimizer step) matter for MoE models only."""
    dims = mesh.dims
    unimplemented = dims.unimplemented()
    if unimplemented:
        raise ValueError("parallelize: " + "; ".join(unimplemented))
    experts = expert_parallel(model, model.args, mesh, moe, global_batch)
    saved = SavedActivations()
    loss_sum = tensor_parallel(model, mesh, saved)
    context_parallel(model, mesh)
    sync, pieces = data_parallel(model, mesh, bucket_mb, reduce_dtype)
    return Parallelized(model, sync, pieces, loss_sum, norm_groups(mesh), saved, experts=experts)


def expert_parallel(
    model: nn.Module, args, mesh: Mesh, moe: MoEOptions | None, global_batch: int
) -> ExpertBalancer | None:
    """EP over the ep group for MoE models (with ep=1: the runtime for capacity, balancing and statistics)."""
    if not args.is_moe:
        return None
    dims = mesh.dims
    ep = mesh.group("ep")
    stats = mesh.group("dp_cp_tp") if dims.tp > 1 else mesh.group("dp_cp")
    groups = [dataclasses.replace(stats, cut="ep")] + (
        [dataclasses.replace(mesh.group("pp"), cut="ep")] if dims.pp > 1 else []
    )
    device = next(model.parameters()).device
    return apply_expert_parallel(
        model, args, moe or MoEOptions(), ep, mesh.group("tp"), dims.sp, global_batch, groups, device, mesh.group("cp")
    )


def tensor_parallel(model: nn.Module, mesh: Mesh, saved: SavedActivations):
    """TP/SP over the tp group (when tp > 1); returns the loss function that fits the model's logits."""
    dims, tp_group = mesh.dims, mesh.group("tp")
    saved.track_layers(model.layers)
    if dims.tp == 1:
        return token_loss_sum
    apply_tensor_parallel(model, tp_group, dims.sp, saved)
    check_shards(model, model.args, dims.tp)
    vocab = model.args.vocab_size
    return lambda logits, targets: vocab_parallel_loss_sum(logits, targets, tp_group, vocab)


def context_parallel(model: nn.Module, mesh: Mesh) -> None:
    """Ulysses or ring attention over the cp group (when cp > 1); the trainer feeds each rank its chunks."""
    if mesh.dims.cp > 1:
        apply_context_parallel(model, mesh.group("cp"), mesh.dims.cp_mode)


def norm_groups(mesh: Mesh) -> list[Group]:
    """Where squared gradient norms are summed: over shards (ZeRO), expert-parallel ranks (their
    experts differ; without ZeRO), tensor and pipeline ranks."""
    dims = mesh.dims
    on = (("dp_cp", dims.zero > 0), ("ep", dims.zero == 0 and dims.ep > 1), ("tp", dims.tp > 1), ("pp", dims.pp > 1))
    return [mesh.group(name) for name, wanted in on if wanted]


def build_parallel(args, mesh: Mesh, device, seed: int, train, moe: MoEOptions | None = None) -> Parallelized:
    """Build this rank's part of the model from the seed and apply every cut of `mesh.dims`."""
    dtype = torch.bfloat16 if train.reduce_dtype == "bf16" else None
    if mesh.dims.pp == 1:
        model = build_model(args, device=device, seed=seed)
        return parallelize(model, mesh, train.bucket_mb, dtype, moe, train.global_batch)
    return pipeline_parallelize(args, mesh, device, seed, train, dtype, moe)


def pipeline_parallelize(
    args, mesh: Mesh, device, seed: int, train, reduce_dtype, moe: MoEOptions | None = None
) -> Parallelized:
    """PP split -> TP inside each stage -> DP over all of this rank's stages."""
    dims = mesh.dims
    schedule = build_schedule(dims.pp_schedule, dims.pp, dims.microbatches, dims.pp_virtual)
    check(schedule)
    layers = stage_layers(args, schedule.n_stages, train.seq_len, dims.pp_layers)
    mine = schedule.stages_of(mesh.coordinate("pp"))
    last = schedule.n_stages - 1
    stages = {s: build_stage(args, layers[s], s == 0, s == last, device, seed) for s in mine}
    module = nn.ModuleDict({str(s): stage for s, stage in stages.items()})
    experts = expert_parallel(module, args, mesh, moe, train.global_batch)
    saved = SavedActivations()
    loss_sum = token_loss_sum
    for stage in stages.values():
        loss_sum = tensor_parallel(stage, mesh, saved)
        context_parallel(stage, mesh)
    tie_pipeline_ends(stages, last, mesh)
    sync, pieces = data_parallel(module, mesh, train.bucket_mb, reduce_dtype)
    ends_apart = schedule.stage_rank[0] != schedule.stage_rank[last]
    tied = next((tied_weight(stages[s]) for s in (0, last) if s in stages), None) if ends_apart else None
    pipeline = Pipeline(schedule, stages, mesh.group("pp_ends"), tied)
    return Parallelized(module, sync, pieces, loss_sum, norm_groups(mesh), saved, pipeline, experts)


def tie_pipeline_ends(stages: dict[int, nn.Module], last: int, mesh: Mesh) -> None:
    """Tied embeddings: one Parameter when the first and last stage share a rank; otherwise each
    end keeps a copy (gradients summed over `pp_ends`) that counts half in the global norm."""
    if 0 in stages and last in stages:
        weight = stages[0].tok_embeddings.weight
        if stages[last].args.tie_embeddings:
            stages[last].output.weight = weight
        return
    for s in (0, last):
        if s in stages and stages[s].args.tie_embeddings and mesh.dims.pp > 1:
            tied_weight(stages[s]).fivecut_norm_share = 0.5


@dataclass
class Pipeline:
    schedule: Schedule
    stages: dict[int, nn.Module]
    ends: Group  # the first and the last pipeline rank (tied embeddings)
    tied: nn.Parameter | None  # this rank's copy of a tied embedding held on both ends

    def sum_tied_grads(self) -> None:
        if self.tied is not None and self.ends.size > 1 and self.tied.grad is not None:
            comm.all_reduce(self.tied.grad, self.ends)


def data_parallel(model: nn.Module, mesh: Mesh, bucket_mb: float, reduce_dtype) -> tuple[GradSync, list[Piece]]:
    """One gradient reduction per group that parameters are replicated on (see the module doc)."""
    by_group: dict[str, list[nn.Parameter]] = {}
    for p in model.parameters():
        if p.requires_grad:
            by_group.setdefault(reduce_group(p), []).append(p)
    if mesh.dims.zero == 3:  # units of modules, each part sharded over its own group
        others = {name: mesh.group(name) for name in by_group if name != "dp_cp"}
        sync = FullyShardedDataParallel(
            model, mesh.group("dp_cp"), mesh.dims.reshard_after_forward, reduce_dtype, mesh.dims.tp, others
        )
        return sync, sync.optimizer_pieces()
    made = [reduce_over(model, params, mesh, name, bucket_mb, reduce_dtype) for name, params in by_group.items()]
    if len(made) == 1:
        return made[0]
    return SyncSet([sync for sync, _ in made]), [piece for _, pieces in made for piece in pieces]


def reduce_over(model, params, mesh: Mesh, name: str, bucket_mb: float, reduce_dtype) -> tuple[GradSync, list[Piece]]:
    """DDP or ZeRO-1/2 of `params` over the mesh group `name`. A group that spans tp holds no
    tensor-parallel replicas in its shards (each tp rank computed on its own tokens)."""
    dims, group = mesh.dims, mesh.group(name)
    tp_in_shards = dims.tp if name == "dp_cp" else 1
    if dims.zero == 0 or group.size == 1:
        sync = DataParallel(model, group, bucket_mb=bucket_mb, reduce_dtype=reduce_dtype, params=params)
        ep_share = 1.0 if name == "expert_dp" or dims.zero > 0 else 1.0 / dims.ep  # replicated over ep: counted once
        return sync, [Piece(p, d, r, share * ep_share) for p in sync.params for d, r, share in [param_kind(p, dims.tp)]]
    sync = ZeroDataParallel(
        model, group, dims.zero, bucket_mb=bucket_mb, reduce_dtype=reduce_dtype, tp=tp_in_shards, params=params
    )
    return sync, sync.optimizer_pieces()


class SyncSet:
    """Several gradient reductions (one per group) driven as one."""

    def __init__(self, syncs: list):
        self.syncs = syncs

    @contextlib.contextmanager
    def no_sync(self):
        with contextlib.ExitStack() as stack:
            for sync in self.syncs:
                stack.enter_context(sync.no_sync())
            yield

    def zero_grad(self) -> None:
        for sync in self.syncs:
            sync.zero_grad()

    def after_step(self) -> None:
        for sync in self.syncs:
            sync.after_step()

    def reduce_all(self) -> None:
        for sync in self.syncs:
            sync.reduce_all()
