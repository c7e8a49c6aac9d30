"""`parallelize`: apply the cuts to a single-device model, in one fixed order.

    1. pipeline split      this rank's stages of the model (without a pipeline: one stage, the model);
                           the last stage's head becomes a loss head computing the loss in chunks of
                           tokens (`fivecut.parallel.loss`; train.loss_chunk_tokens = 0: full logits);
                           a split-backward schedule (zb1p, dualpipev) defers the linear layers'
                           weight gradients to W (`pipeline.wgrad`; the loss head's are computed in F)
    then on each stage, in this order:
    2. EP                  experts over the ep group, and the MoE runtime (capacity, balancing, statistics)
    3. TP / SP             column / row / vocabulary cuts over the tp group (sequence parallel norms);
                           ETP: the routed experts' hidden size over the etp ranks of the tp group
    4. materialize         a stage built on the meta device gets storage for this rank's part alone,
                           filled from `options.weights` (a published model's file, a checkpoint) or the
                           seed's initial weights, box by box: no rank holds more than its part and the
                           one tensor being cut (the Parameter objects stay those the cuts above hold)
    5. CP                  Ulysses or ring attention over the cp group (the trainer feeds each rank its chunks)
    6. recomputation       full or selective activation recomputation of every k-th block
                           (fivecut.parallel.recompute), around what the cuts above put in a block
    7. compile             train.compile: torch.compile of the forward of each block as the steps above left it
                           (`fivecut.parallel.compile`; graph breaks at collectives; a MoE that communicates eager)
    then over all of this rank's stages:
    8. DP / ZeRO           each gradient summed over the group its parameter is replicated on: dp x cp
                           for most, `expert_dp` for experts, dp x cp x tp for the router and shared
                           experts under tp; DDP (zero=0) or ZeRO-1/2/3
    9. compute weights     train.dtype = "bf16" (not ZeRO-3, whose units are gathered in bf16): each matmul
                           weight read as one bf16 copy a step, made after the update and ZeRO-1/2's
                           gather (`fivecut.parallel.precision`)

The model code never changes; each step rewrites or wraps modules from outside, receives the
process group it uses from the `Mesh`, and returns what it changed. A step that was asked for
and matched nothing it should have is an error. The changes are folded into one `Placement`
per parameter (`fivecut.parallel.placement`), and after the last step every parameter's local
shape is checked against its record.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from fivecut import comm
from fivecut.comm import Group
from fivecut.layout import MoEOptions
from fivecut.mesh import Mesh
from fivecut.model.lora import AdapterWeights, add_adapters, quantize_frozen
from fivecut.model.transformer import Attention, LatentAttention, MoE, SeedWeights, build_model
from fivecut.parallel.compile import CompileRecord, compile_blocks, start_record
from fivecut.parallel.context import apply_context_parallel
from fivecut.parallel.data import DataParallel, GradSync, Kinds, Piece, SyncSet
from fivecut.parallel.expert import (
    ExpertBalancer,
    ExpertParallelMoE,
    SlotMap,
    apply_expert_parallel,
    apply_expert_tensor_parallel,
    expert_slice,
)
from fivecut.parallel.loss import install_loss_head
from fivecut.parallel.pipeline.schedule import Schedule, build_schedule, check
from fivecut.parallel.pipeline.split import cut_stage, stage_layers
from fivecut.parallel.pipeline.wgrad import WeightGrads, defer_weight_grads
from fivecut.parallel.placement import (
    Change,
    FlatSlot,
    Placement,
    check_local_shapes,
    initial_placements,
    logical_name,
    params_by_name,
)
from fivecut.parallel.precision import ComputeWeights, cast_names, cast_once
from fivecut.parallel.recompute import apply_recompute
from fivecut.parallel.saved import SavedActivations
from fivecut.parallel.tensor import apply_tensor_parallel, vocab_parallel_loss_sum
from fivecut.parallel.zero import FullyShardedDataParallel, ZeroDataParallel
from fivecut.parallel.zero_pipeline import StagedSync
from fivecut.train.checkpoint import global_chunks

# the order, as applied below
STEPS = ("pipeline", "expert", "tensor", "materialize", "context", "recompute", "compile", "data", "precision")

# parameters tensor parallelism must cut (by path suffix), outside MoE layers; kv projections
# only when tp divides the kv heads (otherwise they are replicated: `ReplicatedKV`)
TP_CUT = ("attention.wq.weight", "attention.wo.weight", "feed_forward.w1.weight", "feed_forward.w2.weight",
          "feed_forward.w3.weight", "tok_embeddings.weight", "attention.wq.bias")  # fmt: skip
TP_CUT_SINKS = ("attention.sinks",)  # GPT-OSS's sinks [n_heads]: with their heads
TP_CUT_KV = ("attention.wk.weight", "attention.wv.weight", "attention.wk.bias", "attention.wv.bias")
TP_CUT_MLA = ("attention.wq_b.weight", "attention.wkv_b.weight")  # latent attention's up projections
TP_CUT_WHOLE_NORMS = ("attention.q_norm.weight", "attention.k_norm.weight")  # over whole projections (OLMo 2)


class ParallelizeError(RuntimeError):
    """A cut that was asked for did not apply where it should have."""


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum of per-token cross-entropy, in fp32.  logits [b, s, V], targets [b, s]."""
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")


@dataclass
class Pipeline:
    schedule: Schedule
    stages: dict[int, nn.Module]
    ends: Group  # the first and the last pipeline rank (tied embeddings)
    tied: nn.Parameter | None  # this rank's copy of a tied embedding held on both ends
    weight_grads: WeightGrads | None = None  # split backward: the weight gradients B defers to W
    # ZeRO-2/3: the executor calls it after a stage's last B (or W) of the schedule; its gradients
    # are then reduce-scattered, once per accumulation step (`fivecut.parallel.zero_pipeline`)
    stage_done: Callable[[int], None] | None = None

    def sum_tied_grads(self) -> None:
        if self.tied is not None and self.ends.size > 1 and self.tied.grad is not None:
            comm.all_reduce(self.tied.grad, self.ends)


@dataclass
class Parallelized:
    module: nn.Module  # what the trainer calls forward on (the model, or a ModuleDict of stages)
    sync: GradSync  # the data cut: no_sync() for accumulation micro-steps, zero_grad(), reduce(), after_step()
    pieces: list[Piece]  # what this rank's optimizer updates
    loss_sum: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (logits, targets) -> sum of token losses
    norm_groups: list[Group]  # groups over which squared gradient norms are summed
    saved: SavedActivations  # wrap each forward in `saved.forward()`
    placements: dict[str, Placement]  # logical name -> where this rank's part of it lives
    params: dict[str, nn.Parameter]  # logical name -> this rank's tensor
    pipeline: Pipeline | None = None  # pipeline parallelism: the schedule and this rank's stages
    experts: ExpertBalancer | None = None  # MoE models: load statistics, balancing, EPLB
    compiled: CompileRecord | None = None  # train.compile: the blocks compiled, Dynamo's counts
    loss_in_head: bool = False  # the head is a `LossHead`: given targets, it returns the loss, chunk by chunk
    # train.dtype = "bf16": the weights read as one bf16 copy a step (`invalidate` after each update)
    compute: ComputeWeights = dataclasses.field(default_factory=ComputeWeights)

    def forward_loss(self, inputs: torch.Tensor, positions: torch.Tensor | None, targets: torch.Tensor, documents=None):
        """The sum of token losses of one forward (no pipeline): computed in the head a chunk of
        tokens at a time, or (train.loss_chunk_tokens = 0) from the full logits. `documents`: the
        batch's `Documents` under data.document_mask."""
        if self.loss_in_head:
            return self.module(inputs, positions, targets, documents=documents)
        return self.loss_sum(self.module(inputs, positions, documents=documents), targets)

    @property
    def grads(self) -> list[torch.Tensor]:
        """The gradients this rank's optimizer reads (shards under ZeRO)."""
        return [piece.tensor.grad for piece in self.pieces]

    def state_tensors(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Parameters and gradients this rank holds, for memory accounting (storages may repeat)."""
        params = list(self.module.parameters()) + [piece.tensor for piece in self.pieces]
        return params, [p.grad for p in params]

    def move_experts(self, optimizer: torch.optim.Optimizer) -> dict[int, int]:
        """EPLB: move the experts whose owner changed (see `ExpertBalancer.apply_moves`) and
        record their new slices; returns the elements this rank sent, per layer."""
        moved = self.experts.apply_moves(optimizer, self.sync)
        for layer in moved:
            self._record_experts(layer)
        return moved

    def restore_slots(self, layer: int, expert: list[list[int]], share: list[list[float]]) -> None:
        """Put a saved EPLB placement back (before the weights are loaded into it)."""
        runtime = self.experts.runtimes[layer]
        slots = SlotMap(
            runtime.n_experts,
            runtime.ep.size,
            runtime.placement.extra,
            [r[: runtime.placement.n_local] for r in expert],
        )
        slots.expert, slots.share = [list(r) for r in expert], [list(r) for r in share]
        runtime.set_placement(slots)
        self._record_experts(layer)

    def _record_experts(self, layer: int) -> None:
        """The experts' records follow the layer's placement: the logical experts this rank owns."""
        runtime = self.experts.runtimes[layer]
        cut = expert_slice(runtime.n_experts, runtime.ep.size, runtime.placement.owned()[runtime.ep.rank])
        experts = runtime.moe.experts
        for name in (f"layers.{layer}.feed_forward.experts.{w}" for w in experts.EXPERT_TENSORS):
            pl = self.placements[name]
            self.placements[name] = dataclasses.replace(
                pl, slices=tuple(cut if s.group == "ep" else s for s in pl.slices)
            )


@dataclass(frozen=True)
class ParallelizeOptions:
    """What `parallelize` needs besides the model and the mesh (`from_train`: as a run sets it)."""

    bucket_mb: float = 25.0  # DDP / ZeRO-1/2 gradient buckets
    reduce_dtype: torch.dtype | None = None  # gradient reduction dtype (None: the gradients' own)
    moe: MoEOptions = dataclasses.field(default_factory=MoEOptions)  # MoE models only
    global_batch: int = 1  # sequences per optimizer step (MoE capacity and statistics)
    seq_len: int | None = None  # balances the pipeline stages (None: the model's max_seq_len)
    seed: int = 0  # initializes a model built on the meta device
    device: torch.device | str = "cpu"  # where a meta model's part is materialized
    # a meta model's initial weights: a `fivecut.weights.source.WeightSource` (model.init_from), else the seed's
    weights: object | None = None
    recompute: str = "none"  # "none" | "full" | "selective"
    recompute_every: int = 1  # recompute the blocks whose layer id is a multiple of this
    param_dtype: torch.dtype | None = None  # bf16 under train.dtype = "bf16": what ZeRO-3 gathers
    compile: bool = False  # torch.compile each block (`fivecut.parallel.compile`)
    loss_chunk_tokens: int = 2048  # tokens per chunk of the head and loss (`fivecut.parallel.loss`); 0: full logits
    lora: object | None = None  # a `fivecut.config.LoraConfig` with rank > 0: adapters, the rest frozen

    @classmethod
    def from_train(
        cls, train, moe: MoEOptions | None, seed: int, device, weights=None, lora=None
    ) -> ParallelizeOptions:
        """The options a run's `[train]` table gives (bf16 ZeRO-3 gathers under train.dtype = "bf16");
        `weights`: the source of the initial weights (None: the seed's); `lora`: the run's `[lora]`."""
        return cls(
            bucket_mb=train.bucket_mb,
            reduce_dtype=torch.bfloat16 if train.reduce_dtype == "bf16" else None,
            moe=moe or MoEOptions(),
            global_batch=train.global_batch,
            seq_len=train.seq_len,
            seed=seed,
            device=device,
            recompute=train.recompute,
            recompute_every=train.recompute_every,
            param_dtype=torch.bfloat16 if train.dtype == "bf16" else None,
            compile=train.compile,
            loss_chunk_tokens=train.loss_chunk_tokens,
            weights=weights,
            lora=lora if lora is not None and lora.rank is not None else None,
        )


def parallelize(model: nn.Module, mesh: Mesh, options: ParallelizeOptions | None = None) -> Parallelized:
    """Apply every cut of `mesh.dims` to `model`, a single-device model: real, or on the meta
    device (then this rank's part is materialized on `options.device` and filled from
    `options.weights`, or initialized from `options.seed`). `options.param_dtype`: what ZeRO-3
    gathers and computes in, from fp32 master shards; other layouts keep fp32 parameters."""
    o = options or ParallelizeOptions()
    dims, args = mesh.dims, model.args
    weights = adapted(model, o)
    schedule, stages = split_pipeline(model, mesh, o.seq_len or args.max_seq_len)
    for stage in stages.values():  # LongRoPE: the factors of the length the run trains at, on every rank
        stage.fit_rope(o.seq_len or args.max_seq_len)
    loss_in_head = loss_heads(stages, o.loss_chunk_tokens)
    weight_grads = split_backward(schedule, stages)
    placements = initial_records(stages, schedule)
    saved, runtimes, compiled = SavedActivations(), {}, start_record() if o.compile else None
    recompute_options = (o.recompute, o.recompute_every)
    quantize = quantize_frozen if o.lora is not None and o.lora.quantize == "nf4" else None  # QLoRA
    fill = functools.partial(
        materialize, placements=placements, weights=weights, device=o.device, runtimes=runtimes, quantize=quantize
    )
    for stage in stages.values():
        saved.track_layers(stage.layers)
        steps = stage_steps(mesh, saved, o.moe, o.global_batch, runtimes, recompute_options, compiled, fill)
        for _step_name, step in steps:
            fold(placements, stage, step(stage))
    module = stages[0] if schedule is None else nn.ModuleDict({str(s): st for s, st in stages.items()})
    params = params_by_name(module, args.tie_embeddings, prefixed=schedule is not None)
    pipeline = tie_pipeline_ends(schedule, stages, mesh, placements, params, weight_grads)
    kinds = {params[name]: pl.kind(dims.tp, dims.ep, dims.zero) for name, pl in placements.items()}
    if pipeline is not None and dims.zero >= 2:
        sync = staged_data_parallel(stages, pipeline, mesh, kinds, o)
        pipeline.stage_done = sync.stage_done
    else:
        sync = data_parallel(module, mesh, kinds, o.bucket_mb, o.reduce_dtype, o.param_dtype)
    record_flat_slots(placements, params, sync.flat_slots())
    check_local_shapes(placements, params)
    experts = expert_balancer(args, mesh, o.moe, runtimes, module)
    loss = token_loss_sum if dims.tp == 1 else vocab_loss(mesh.group("tp"), args.vocab_size)
    compute = compute_weights(module, mesh, o.param_dtype, saved)
    return Parallelized(
        module, sync, sync.pieces(), loss, norm_groups(mesh), saved, placements, params, pipeline, experts, compiled,
        loss_in_head, compute,
    )  # fmt: skip


# ---------------------------------------------------------------- 0. adapters


def adapted(model: nn.Module, o: ParallelizeOptions):
    """Under `[lora]`: the target linears of the whole (meta) model get adapters and every other
    weight is frozen (bf16 under train.dtype = "bf16"); returns the source of the initial weights
    (`o.weights`, else the seed's; the adapters' from the seed)."""
    weights = o.weights or SeedWeights(model.args, o.seed)
    if o.lora is None:
        return weights
    lo = o.lora
    shapes = add_adapters(model, lo.rank, lo.alpha, lo.dropout, lo.targets, lo.full, o.param_dtype)
    source = AdapterWeights(weights, shapes, o.seed)
    with torch.no_grad():  # a real model's adapters now (a meta one's are filled with its other weights)
        for name, p in model.named_parameters():
            if name in shapes and not p.is_meta:
                p.copy_(source.read(name, tuple(slice(None) for _ in p.shape)))
    return source


# ---------------------------------------------------------------- 1. the pipeline split


def split_pipeline(model, mesh: Mesh, seq_len: int) -> tuple[Schedule | None, dict[int, nn.Module]]:
    """This rank's stages of `model` (still on the meta device where it was); without a pipeline,
    the model as one stage."""
    dims = mesh.dims
    if dims.pp == 1:
        return None, {0: model}
    schedule = build_schedule(dims.pp_schedule, dims.pp, dims.microbatches, dims.pp_virtual)
    check(schedule)
    layers = stage_layers(model.args, schedule.n_stages, seq_len, dims.pp_layers)
    last = schedule.n_stages - 1
    mine = schedule.stages_of(mesh.coordinate("pp"))
    return schedule, {s: cut_stage(model, layers[s], s == 0, s == last) for s in mine}


def loss_heads(stages: dict[int, nn.Module], chunk_tokens: int) -> bool:
    """The head of the stage that holds it computes the loss in chunks of `chunk_tokens` (0: the
    full logits, and the head stays a linear layer); whether the heads do."""
    if chunk_tokens == 0:
        return False
    for stage in stages.values():
        install_loss_head(stage, chunk_tokens)
    return True


def split_backward(schedule: Schedule | None, stages: dict[int, nn.Module]) -> WeightGrads | None:
    """Zero-bubble schedules: every linear layer of this rank's stages leaves its weight gradient to W."""
    if schedule is None or not schedule.split_backward:
        return None
    grads = WeightGrads()
    for stage in stages.values():
        defer_weight_grads(stage, grads)
    plain = [s for s in sorted(stages) if not any(type(m) is nn.Linear for m in stages[s].modules())]
    require("pipeline", plain, sorted(stages))  # every linear defers its dW, or is adapted ([lora]: frozen)
    return grads


def initial_records(stages: dict[int, nn.Module], schedule: Schedule | None) -> dict[str, Placement]:
    """One record per logical parameter, before any cut; a tied embedding belongs to its first stage."""
    out: dict[str, Placement] = {}
    for s in sorted(stages):
        for name, pl in initial_placements(stages[s], s if schedule is not None else None).items():
            out.setdefault(name, pl)
    return out


# ---------------------------------------------------------------- 2-6. the cuts of each stage

StepResult = dict[str, Change]  # parameter path in the stage -> what the step did to it
Step = Callable[[nn.Module], StepResult]


def stage_steps(
    mesh: Mesh,
    saved: SavedActivations,
    moe: MoEOptions,
    global_batch: int,
    runtimes: dict,
    recompute: tuple[str, int] = ("none", 1),
    compiled: CompileRecord | None = None,
    fill: Step = lambda stage: {},
) -> list:
    """The ordered cuts applied to each stage (see the module doc); `recompute`: (mode, every);
    `compiled`: the record of train.compile (None: no compilation); `fill`: the materialize step."""
    mode, every = recompute
    return [
        ("expert", lambda stage: expert_parallel(stage, mesh, moe, global_batch, runtimes)),
        ("tensor", lambda stage: tensor_parallel(stage, mesh, saved)),
        ("materialize", fill),
        ("context", lambda stage: context_parallel(stage, mesh)),
        ("recompute", lambda stage: recompute_blocks(stage, saved, mode, every)),
        ("compile", lambda stage: compile_stage(stage, compiled)),
    ]


@torch.no_grad()
def materialize(
    stage: nn.Module, placements: dict[str, Placement], weights, device, runtimes: dict, quantize=None
) -> StepResult:
    """4. A stage still on the meta device gets storage on `device` for what the cuts left it --
    a new Parameter in each module's place (one for each meta one: a tied head stays its
    embedding; the cuts before hold modules, not Parameters) -- then its values, box by box, from `weights`
    (`fivecut.weights.source.WeightSource.fill`; padding rows stay zero); the buffers are recomputed.
    One block at a time, then the rest: `quantize` (QLoRA, `fivecut.model.lora.quantize_frozen`)
    turns each block's frozen weights to 4 bits before the next block exists in full precision.
    With `device` meta (the planner's records of a layout) the stage stays shapes only."""
    if torch.device(device).type == "meta" or not any(p.is_meta for p in stage.parameters()):
        return {}
    made: dict[int, nn.Parameter] = {}  # id of a meta Parameter -> its replacement (a tied one shares it)
    tied = stage.args.tie_embeddings
    for prefix, modules in fill_groups(stage):
        paths = {}
        for mname, module in modules:
            for pname, p in list(module.named_parameters(recurse=False)):
                if p.is_meta:  # from the shape alone: a meta tensor given to an op under a fake tensor mode is memoized
                    if id(p) not in made:
                        made[id(p)] = nn.Parameter(torch.zeros(p.shape, dtype=p.dtype, device=device), p.requires_grad)
                        paths[f"{mname}.{pname}" if mname else pname] = made[id(p)]
                    setattr(module, pname, made[id(p)])
        requests = [
            (name, chunk_box(chunk), chunk.view)
            for path, p in paths.items()
            for name in [logical_name(path, tied)]
            for chunk in global_chunks(placements[name], p.detach().view(-1), 0)
        ]
        weights.fill(requests)
        if quantize is not None and prefix:
            quantize(stage.get_submodule(prefix))
    for module in stage.modules():
        for bname, b in module.named_buffers(recurse=False):
            if b.is_meta:
                setattr(module, bname, torch.zeros(b.shape, dtype=b.dtype, device=device))
    stage.init_buffers()
    for runtime in runtimes.values():
        runtime.on_device()
    return {}


def fill_groups(stage: nn.Module) -> list[tuple[str, list[tuple[str, nn.Module]]]]:
    """The stage's modules (by path) in the groups `materialize` fills: each block, then the rest."""
    blocks = [f"layers.{k}" for k in stage.layers] if getattr(stage, "layers", None) is not None else []
    inside = tuple(f"{b}." for b in blocks)
    groups = [(b, list(stage.get_submodule(b).named_modules(prefix=b))) for b in blocks]
    rest = [(n, m) for n, m in stage.named_modules() if n not in blocks and not n.startswith(inside)]
    return [*groups, ("", rest)]


def chunk_box(chunk) -> tuple[slice, ...]:
    """The box of the global tensor a checkpoint chunk covers."""
    return tuple(slice(o, o + n) for o, n in zip(chunk.offsets, chunk.view.shape))


def fold(placements: dict[str, Placement], stage: nn.Module, changes: StepResult) -> None:
    for path, change in changes.items():
        name = logical_name(path, stage.args.tie_embeddings)
        placements[name] = placements[name].apply(change)


def expert_parallel(stage: nn.Module, mesh: Mesh, moe: MoEOptions, global_batch: int, runtimes: dict) -> StepResult:
    """EP over the ep group for the MoE layers of `stage` (with ep=1: the MoE runtime alone)."""
    args = stage.args
    expected = sorted(block.layer_id for block in stage.layers.values() if args.moe_layer(block.layer_id))
    if not expected:
        return {}
    made, changes = apply_expert_parallel(
        stage, moe, mesh.group("ep"), mesh.group("tp"), mesh.dims.sp, global_batch, mesh.group("cp"), mesh.group("etp")
    )
    require("expert", sorted(made), expected)
    runtimes.update(made)
    return changes


def tensor_parallel(stage: nn.Module, mesh: Mesh, saved: SavedActivations) -> StepResult:
    """TP/SP over the tp group (when tp > 1)."""
    dims, args = mesh.dims, stage.args
    if dims.tp == 1:
        return {}
    changes = apply_tensor_parallel(stage, mesh.group("tp"), dims.sp, saved)
    if dims.etp > 1:
        changes |= apply_expert_tensor_parallel(stage, mesh.group("etp"))
    suffixes = TP_CUT + (TP_CUT_KV if args.n_kv_heads % dims.tp == 0 else ()) + TP_CUT_MLA + TP_CUT_SINKS
    suffixes += TP_CUT_WHOLE_NORMS if args.qk_norm_whole else ()
    expected = [path for path, _ in stage.named_parameters() if path.endswith(suffixes) and ".experts." not in path]
    expected += [path for path in expert_cuts(stage) if dims.etp > 1]
    expected += adapter_cuts(stage, expected)
    if stage.output is not None and not (args.tie_embeddings and stage.tok_embeddings is not None):
        expected.append("output.weight")
    require("tensor", sorted(p for p, c in changes.items() if c.slice is not None), sorted(expected))
    return changes


def expert_cuts(stage: nn.Module) -> list[str]:
    """The routed experts' tensors expert TP cuts along the hidden size (`GroupedExperts.EXPERT_TENSORS`)."""
    return [
        f"layers.{path}.feed_forward.experts.{name}"
        for path, block in stage.layers.items()
        if isinstance(block.feed_forward, MoE)
        for name, dim in block.feed_forward.experts.EXPERT_TENSORS.items()
        if dim is not None
    ]


def adapter_cuts(stage: nn.Module, cut: list[str]) -> list[str]:
    """[lora]: the adapter tensor each cut weight's cut takes (`tensor.cut_adapters`): a
    row-parallel weight's A, a column-parallel one's B."""
    params = dict(stage.named_parameters())
    rows = ("attention.wo.weight", "feed_forward.w2.weight")
    return [
        f"{path.removesuffix('.weight')}.lora_{'a' if path.endswith(rows) else 'b'}"
        for path in cut
        if path.endswith(".weight") and f"{path.removesuffix('.weight')}.lora_a" in params
    ]


def context_parallel(stage: nn.Module, mesh: Mesh) -> StepResult:
    """Ulysses, ring attention or both (USP) over the cp group (when cp > 1); no parameter changes."""
    if mesh.dims.cp == 1:
        return {}
    # latent attention is expected too, and left uncut by the context cut: an error, not a silent skip
    expected = [path for path, m in stage.named_modules() if isinstance(m, (Attention, LatentAttention))]
    require("context", apply_context_parallel(stage, mesh.groups, mesh.dims.cp_mode), expected)
    return {}


def recompute_blocks(stage: nn.Module, saved: SavedActivations, mode: str, every: int) -> StepResult:
    """Full or selective recomputation of the stage's blocks with layer id % every == 0 (a stage
    may hold none of them); no parameter changes."""
    done, expected = apply_recompute(stage, mode, every, saved)
    if expected:
        require("recompute", done, expected)
    return {}


def compile_stage(stage: nn.Module, compiled: CompileRecord | None) -> StepResult:
    """torch.compile of each block's forward (train.compile); no parameter changes."""
    if compiled is None or not stage.layers:  # a pipeline stage may hold no block
        return {}
    done = len(compiled.blocks)
    compile_blocks(stage, compiled)
    require("compile", compiled.blocks[done:], [f"layers.{name}" for name in stage.layers])
    return {}


def require(step: str, applied: list, expected: list) -> None:
    if applied != expected or not expected:
        raise ParallelizeError(f"parallelize: the {step} cut applied to {applied}, expected {expected}")


# ---------------------------------------------------------------- tying and the data cut


def tie_pipeline_ends(schedule, stages, mesh: Mesh, placements, params, weight_grads=None) -> Pipeline | None:
    """Tied embeddings: one Parameter when the first and the last stage share a rank; otherwise each
    end keeps a copy, gradients summed over `pp_ends` (its record says `ends`: it counts half in the norm)."""
    if schedule is None:
        return None
    last = schedule.n_stages - 1
    if 0 in stages and last in stages and stages[last].args.tie_embeddings:
        stages[last].output.weight = stages[0].tok_embeddings.weight
        params["tok_embeddings.weight"] = stages[0].tok_embeddings.weight
    apart = schedule.stage_rank[0] != schedule.stage_rank[last]
    tied = None
    if apart and "tok_embeddings.weight" in params and placements["tok_embeddings.weight"].aliases:
        placements["tok_embeddings.weight"] = dataclasses.replace(placements["tok_embeddings.weight"], ends=True)
        tied = params["tok_embeddings.weight"]
    return Pipeline(schedule, stages, mesh.group("pp_ends"), tied, weight_grads)


def data_parallel(
    module: nn.Module, mesh: Mesh, kinds: Kinds, bucket_mb: float, reduce_dtype, param_dtype=None
) -> GradSync:
    """One gradient reduction per group that parameters are replicated on (see the module doc)."""
    by_group: dict[str, list[nn.Parameter]] = {}
    for p in unique_params(module):
        by_group.setdefault(kinds[p].reduce, []).append(p)
    dims = mesh.dims
    if dims.zero == 3:  # units of modules, each part sharded over its own group (hybrid: a block of it)
        shard = {name: mesh.zero_groups[name].shard for name in by_group}
        others = {name: group for name, group in shard.items() if name != "dp_cp"}
        main = shard.get("dp_cp", mesh.zero_groups["dp_cp"].shard)
        replicate = mesh.zero_groups["dp_cp"].replicate  # the same ranks for every reduce group
        return FullyShardedDataParallel(
            module, main, dims.reshard_after_forward, reduce_dtype, kinds, others, param_dtype, replicate
        )
    syncs = [
        reduce_over(module, params, mesh, name, kinds, bucket_mb, reduce_dtype) for name, params in by_group.items()
    ]
    return syncs[0] if len(syncs) == 1 else SyncSet(syncs)


def staged_data_parallel(stages, pipeline: Pipeline, mesh: Mesh, kinds: Kinds, o: ParallelizeOptions) -> StagedSync:
    """ZeRO-2/3 in a pipeline: one data cut per stage (and gradient group), reduced after the stage's
    last backward or W; a parameter two stages share (a tied embedding on one rank) belongs to the
    first. The ends holding a tied embedding wait for its sum (see `fivecut.parallel.zero_pipeline`)."""
    dims, owned, cuts = mesh.dims, {}, {}
    for s in sorted(stages):
        params = [p for p in unique_params(stages[s]) if p not in owned]
        if dims.zero == 3:
            shared = {p: owned[p] for p in unique_params(stages[s]) if p in owned}  # dict: by identity
            cut = stage_fsdp(stages[s], mesh, kinds, o, shared)
            owned.update(cut.unit_of)
            cuts[s] = [cut]
            continue
        owned.update(dict.fromkeys(params))
        by_group: dict[str, list[nn.Parameter]] = {}
        for p in params:
            by_group.setdefault(kinds[p].reduce, []).append(p)
        cuts[s] = [
            reduce_over(stages[s], ps, mesh, name, kinds, o.bucket_mb, o.reduce_dtype, pipelined=True)
            for name, ps in by_group.items()
        ]
    ends = {0, pipeline.schedule.n_stages - 1} if stages[min(stages)].args.tie_embeddings else set()
    return StagedSync(cuts, ends & set(stages))


def stage_fsdp(stage: nn.Module, mesh: Mesh, kinds: Kinds, o: ParallelizeOptions, borrowed) -> FullyShardedDataParallel:
    """ZeRO-3 over one stage's units; `borrowed`: its parameters that an earlier stage's units own."""
    others = {kinds[p].reduce for p in unique_params(stage)} - {"dp_cp"}
    groups = {name: mesh.zero_groups[name].shard for name in others}  # hybrid sharding: a block of each
    cut = mesh.zero_groups["dp_cp"]
    return FullyShardedDataParallel(
        stage, cut.shard, mesh.dims.reshard_after_forward, o.reduce_dtype, kinds, groups, o.param_dtype,
        cut.replicate, pipelined=True, borrowed=borrowed,
    )  # fmt: skip


def unique_params(module: nn.Module) -> list[nn.Parameter]:
    return [p for p in module.parameters() if p.requires_grad]


def reduce_over(
    module, params, mesh: Mesh, name: str, kinds: Kinds, bucket_mb: float, reduce_dtype, pipelined: bool = False
) -> GradSync:
    """DDP or ZeRO-1/2 of `params` over the mesh group `name` (hybrid sharding: sharded over a block
    of it, `Mesh.zero_groups`; `pipelined`: one pipeline stage's)."""
    group = mesh.group(name)
    if mesh.dims.zero == 0 or group.size == 1:
        return DataParallel(module, group, bucket_mb, reduce_dtype, params, kinds)
    cut = mesh.zero_groups[name]
    return ZeroDataParallel(
        module, cut.shard, mesh.dims.zero, bucket_mb, reduce_dtype, params, kinds, cut.replicate, pipelined
    )


def record_flat_slots(placements: dict[str, Placement], params, slots: dict[nn.Parameter, FlatSlot]) -> None:
    for name, pl in placements.items():
        if params[name] in slots:
            placements[name] = dataclasses.replace(pl, flat=slots[params[name]])


# ---------------------------------------------------------------- 8. compute weights


def compute_weights(module: nn.Module, mesh: Mesh, dtype, saved: SavedActivations) -> ComputeWeights:
    """Under bf16 (`param_dtype`) outside ZeRO-3: every matmul weight of this rank cast once a step;
    what backward keeps of the copies is a weight, not an activation (`SavedActivations.copies`)."""
    if dtype is None or mesh.dims.zero == 3:  # fp32; or ZeRO-3's units, gathered in bf16 already
        return ComputeWeights()
    expected = [type(m).__name__ for m in module.modules() if cast_names(m)]
    compute = cast_once(module, dtype)
    require("precision", [type(m).__name__ for m in compute.modules], expected)
    saved.copies = compute
    return compute


# ---------------------------------------------------------------- the rest of what a rank needs


def vocab_loss(tp_group: Group, vocab: int):
    def loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_loss_sum(logits, targets, tp_group, vocab)

    return loss_sum


def expert_balancer(args, mesh: Mesh, moe: MoEOptions, runtimes: dict[int, ExpertParallelMoE], module):
    """MoE models: the load statistics are summed over dp x cp (x tp) and, with a pipeline, over pp."""
    layer_ids = [i for i in range(args.n_layers) if args.moe_layer(i)]
    if not layer_ids:
        return None
    dims = mesh.dims
    stats = mesh.group("dp_cp_tp") if dims.tp > 1 else mesh.group("dp_cp")
    groups = [dataclasses.replace(stats, cut="ep")]
    if dims.pp > 1:
        groups.append(dataclasses.replace(mesh.group("pp"), cut="ep"))
    device = next(module.parameters()).device
    return ExpertBalancer(runtimes, moe, layer_ids, groups, args.n_experts, dims.ep, device)


def norm_groups(mesh: Mesh) -> list[Group]:
    """Where squared gradient norms are summed: over shards (ZeRO; hybrid sharding: one shard group,
    not its replicas), expert-parallel ranks (their experts differ; without ZeRO), tensor and pipeline ranks."""
    dims = mesh.dims
    shards = "zero_shard" if dims.hybrid else "dp_cp"
    on = ((shards, dims.zero > 0), ("ep", dims.zero == 0 and dims.ep > 1), ("tp", dims.tp > 1), ("pp", dims.pp > 1))
    return [mesh.group(name) for name, wanted in on if wanted]


def build_parallel(
    args, mesh: Mesh, device, seed: int, train, moe: MoEOptions | None = None, weights=None, lora=None
) -> Parallelized:
    """This rank's part of the model `args`, every cut of `mesh.dims` applied, filled from
    `weights` (a `fivecut.weights.source.WeightSource`: model.init_from) or the seed's; `lora`:
    the run's `[lora]` (adapters when its rank is set)."""
    options = ParallelizeOptions.from_train(train, moe, seed, device, weights, lora)
    return parallelize(build_model(args, device="meta"), mesh, options)
