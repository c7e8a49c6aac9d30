"""One rank's run: the context `setup` builds, one step's forward and backward, and evaluation.

The loss of a step is the sum of token losses over the global batch divided by the number of
tokens in the global batch, so any split into ranks, accumulation micro-steps or pipeline
microbatches adds up to the same number and the same gradient. The training loop
(`fivecut.train.trainer`) and whole-model inference (`fivecut.train.infer`) both stand on this.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from fivecut import checks, comm
from fivecut.config import Config
from fivecut.launch import local_device
from fivecut.mesh import Mesh
from fivecut.model.args import ModelArgs
from fivecut.model.documents import Documents
from fivecut.parallel.context import sequence_chunk
from fivecut.parallel.parallelize import Parallelized, build_parallel
from fivecut.parallel.pipeline.executor import PipelineStep
from fivecut.train.data import (
    BatchSampler,
    IdsRecord,
    counted_targets,
    eval_batches,
    load_sources,
    local_rows,
    shard_batch,
    sources_of,
)
from fivecut.train.memory import LossPeak
from fivecut.train.optim import adamw_kernel, build_optimizer
from fivecut.train.resume import Resume
from fivecut.weights.load import load_routing_biases, model_args, run_tokenizer, source_of
from fivecut.weights.peft import with_adapter


@dataclass
class Context:
    """What one rank needs during training, built once by `setup`."""

    cfg: Config
    mesh: Mesh
    device: torch.device
    par: Parallelized
    optimizer: torch.optim.Optimizer
    sampler: BatchSampler
    val_batches: list
    metrics_group: comm.Group
    control_group: comm.Group  # every rank: the per-step stop flags (`fivecut.train.faults.agree`)
    flops_per_token: float
    args: ModelArgs | None = None  # the model's shape
    tokenizer: object = None  # the run's tokenizer (`fivecut.train.tokenizer.Tokenizer`)
    start: Resume = field(default_factory=Resume)  # the step it starts after, its config against the checkpoint's
    overrides: list[dict] = field(default_factory=list)  # config changes accepted by --override, oldest first (saved)
    ids_record: IdsRecord | None = None  # data.record_ids: the token ids each step trains on, written per rank

    @property
    def is_logger(self) -> bool:
        return dist.get_rank() == 0

    def autocast(self):
        """bf16: autocast over fp32 masters; the matmul weights it reads are already the step's bf16
        copies (`fivecut.parallel.precision`), so it casts only activations."""
        if self.cfg.train.dtype == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()


def setup(cfg: Config) -> Context:
    args = checks.validate(cfg, dist.get_world_size())  # again, now that the world size is known
    device = local_device()
    timeout = timedelta(seconds=cfg.train.collective_timeout)
    mesh = Mesh(cfg.parallel, device.type, moe=args.is_moe, timeout=timeout)
    tokenizer = run_tokenizer(cfg.data.tokenizer, cfg.model.init_from)
    sources = load_sources(cfg.data, tokenizer, verify=False)  # run_tokens checked them; each shard again on first read
    vocab = sources[0].vocab_size
    if vocab > args.vocab_size:
        raise ValueError(
            f"tokenizer {cfg.data.tokenizer!r} has {vocab} tokens but the model's vocab_size is {args.vocab_size}; "
            f"set model.vocab_size >= {vocab} or use a preset made for this tokenizer"
        )
    if cfg.data.document_mask and tokenizer.eot_id is None:
        raise ValueError(
            f"data.document_mask=true needs an end-of-text id between documents, but tokenizer {tokenizer.name!r} "
            "has none; set data.tokenizer='gpt2' or data.document_mask=false"
        )
    t = cfg.train
    published = source_of(cfg.model.init_from) if cfg.model.init_from is not None else None
    if cfg.lora.adapter is not None:  # a peft folder's adapters over the model (checked by `checks`)
        published = with_adapter(cfg.lora, cfg.model.init_from, args, published, t.seed)
    par = build_parallel(
        args, mesh, device, t.seed, t, cfg.moe, published, cfg.lora
    )  # published weights, or the seed's
    if published is not None:
        load_routing_biases(par, published)
    kernel, note = adamw_kernel(t.adamw, device)
    if note and dist.get_rank() == 0:
        print(f"fivecut: {note}", flush=True)
    optimizer = build_optimizer(par.pieces, t.lr, t.weight_decay, (t.beta1, t.beta2), t.eps, kernel)
    sampler = run_sampler(cfg, sources)
    vals, val_masks = [s.val for s in sources], [s.val_mask for s in sources]
    weights = cfg.data.weights
    val = eval_batches(vals, t.seq_len, t.global_batch, t.eval_batches, weights, val_masks) if t.eval_every else []
    metrics_group = dataclasses.replace(mesh.group("dp_cp"), cut="metrics")
    control = control_group(mesh)
    return Context(
        cfg,
        mesh,
        device,
        par,
        optimizer,
        sampler,
        val,
        metrics_group,
        control,
        args.flops_per_token(t.seq_len),
        args,
        tokenizer,
        ids_record=IdsRecord(cfg.log.out_dir, dist.get_rank()) if cfg.data.record_ids else None,
    )


def run_sampler(cfg: Config, sources: list) -> BatchSampler:
    """The run's rows: its sources' training splits, mixed by data.weights, in data.order."""
    t, d = cfg.train, cfg.data
    trains, content = [s.train for s in sources], tuple(s.content for s in sources)
    masks = [s.train_mask for s in sources]  # chat data: the loss masks
    return BatchSampler(
        trains, t.seq_len, t.global_batch, t.seed, order=d.order, weights=d.weights, content=content, masks=masks
    )


def run_tokens(cfg: Config, evaluation_keys: bool = False) -> BatchSampler:
    """The run's sources, tokenized (once) into their stores with the run's tokenizer (`data.tokenizer`,
    "auto": the model's own) and checked against their sha256s; returns the run's sampler, whose
    construction refuses a split too short for a row. Called before any process group exists, so
    bad data is refused with exit 2 there. `evaluation_keys`: train.eval_* are the user's (`fivecut
    train`; verify and ledger set their own), and a validation split too small for them is refused
    here too (`checks.check_eval_split`), not by the ranks."""
    tokenizer = run_tokenizer(cfg.data.tokenizer, cfg.model.init_from)
    sources = load_sources(cfg.data, tokenizer)
    sampler = run_sampler(cfg, sources)
    if evaluation_keys:
        checks.check_eval_split(cfg, sources)
    if int(os.environ.get("RANK", "0")) == 0:
        for line in sampler.lines(sources_of(cfg.data.source)):
            print(f"fivecut: {line}", flush=True)
    return sampler


def control_group(mesh: Mesh) -> comm.Group:
    """All ranks, on the default process group (it carries `train.collective_timeout`)."""
    world = dist.get_world_size()
    return comm.Group("control", tuple(range(world)), dist.group.WORLD if world > 1 else None, mesh.ledger)


def forward_backward(ctx: Context, step: int, activations: dict | None = None) -> torch.Tensor:
    """Run every accumulation micro-step of `step`; return this rank's share of the loss.
    With `activations`, the bytes each layer saves for backward in the first micro-step go there."""
    cut = ctx.mesh
    dp, accumulate = cut.coordinate("dp"), ctx.cfg.train.accumulate
    batches = ctx.sampler.local_batches(step, dp, cut.dims.dp, accumulate)
    if ctx.ids_record is not None:
        ctx.ids_record.write(step, local_rows(ctx.cfg.train.global_batch, dp, cut.dims.dp, accumulate), batches)
    denominator = ctx.sampler.tokens_in_global_batch(step)  # chat data: the unmasked targets of the global batch
    total = torch.zeros((), device=ctx.device)
    if ctx.par.pipeline is not None:
        return pipeline_forward_backward(ctx, batches, denominator, activations)
    for i, (inputs, targets) in enumerate(batches):
        last = i == len(batches) - 1
        sync = contextlib.nullcontext() if last else ctx.par.sync.no_sync()
        with sync:
            measuring = ctx.par.saved.measure() if activations is not None and i == 0 else contextlib.nullcontext()
            with ctx.mesh.ledger.phase("forward"), ctx.par.saved.forward(), measuring, ctx.autocast():
                inputs, targets, positions, documents = local_batch(ctx, inputs, targets)
                loss = ctx.par.forward_loss(inputs, positions, targets, documents) / denominator
            if activations is not None and i == 0:
                activations.update(ctx.par.saved.bytes_per_layer)
            with ctx.mesh.ledger.phase("backward"):
                loss.backward()
        total += loss.detach()
    return total


def pipeline_forward_backward(ctx: Context, batches, denominator: int, activations: dict | None = None) -> torch.Tensor:
    """Each accumulation micro-step's rows cut into microbatches and run through the schedule;
    gradients reduced over dp once, after the last (tied embeddings first summed over the two ends);
    under ZeRO-2/3 after each (each stage's starts when its last backward is done, during the run).
    With `activations`, the bytes each layer of this rank saves for microbatch 0 go there."""
    pipe, dims = ctx.par.pipeline, ctx.mesh.dims
    total = torch.zeros((), device=ctx.device)
    for i, (inputs, targets) in enumerate(batches):
        inputs, targets, positions, documents = local_batch(ctx, inputs, targets)
        micro = microbatches(inputs, targets, documents, dims.microbatches)
        measuring = activations is not None and i == 0
        if measuring:
            with ctx.par.saved.measure():  # start a fresh count
                pass
        with ctx.par.sync.no_sync():
            total += pipeline_step(ctx, micro[0][0].shape[0], positions, measuring).run(
                micro, denominator, ctx.mesh.ledger
            )
        if measuring:
            activations.update(ctx.par.saved.bytes_per_layer)
        last = i == len(batches) - 1
        if pipe.stage_done is not None or last:  # before the step's last: no sum over ZeRO's replicas
            with ctx.mesh.ledger.phase("backward"), contextlib.nullcontext() if last else ctx.par.sync.no_sync():
                pipe.sum_tied_grads()
                ctx.par.sync.reduce()
    return total


def local_tokens(ctx: Context, inputs: torch.Tensor, targets: torch.Tensor):
    """A batch on this rank's device: with context parallelism only this cp rank's chunk of each
    sequence, and the chunk's positions (None: the whole sequence, from 0)."""
    inputs, targets = inputs.to(ctx.device), targets.to(ctx.device)
    if ctx.mesh.dims.cp == 1:
        return inputs, targets, None
    dims = ctx.mesh.dims
    return sequence_chunk(inputs, targets, ctx.mesh.group("cp"), dims.cp_mode, dims.cp_ulysses)


def local_batch(ctx: Context, inputs: torch.Tensor, targets: torch.Tensor):
    """`local_tokens`, and with data.document_mask the batch's documents (`Documents`): ids of the
    whole sequences (from the inputs and the tokenizer's end-of-text id, before any cut) and the
    RoPE positions of this rank's tokens; else None."""
    documents = None
    if ctx.cfg.data.document_mask:
        documents = Documents.of(inputs.to(ctx.device), ctx.tokenizer.eot_id)  # [b, s]
    inputs, targets, positions = local_tokens(ctx, inputs, targets)
    if documents is not None and positions is not None:
        documents = documents.chunk(positions)  # [b, s/cp] positions of the cp rank's tokens
    return inputs, targets, positions, documents


def microbatches(inputs: torch.Tensor, targets: torch.Tensor, documents: Documents | None, n: int) -> list[tuple]:
    """The rows cut into n pipeline microbatches: (inputs, targets) or (inputs, targets, documents)."""
    if documents is None:
        return list(zip(inputs.chunk(n), targets.chunk(n)))
    return list(zip(inputs.chunk(n), targets.chunk(n), documents.split(n)))


def pipeline_step(
    ctx: Context,
    rows: int,
    positions: torch.Tensor | None = None,
    measure_first: bool = False,
    seq: int | None = None,
    loss_sum=None,
) -> PipelineStep:
    """An executor for this rank's stages, for microbatches of `rows` sequences of `seq` tokens
    (default train.seq_len) at `positions` (default: the whole sequence); `measure_first` counts
    what microbatch 0's forwards save; `loss_sum` (logits, targets) replaces the model's loss on the
    last stage (otherwise a loss head computes it in chunks, when the run has one)."""
    dims, seq = ctx.mesh.dims, seq or ctx.cfg.train.seq_len
    return PipelineStep(
        ctx.par.pipeline.schedule,
        ctx.par.pipeline.stages,
        ctx.mesh.group("pp"),
        loss_sum or ctx.par.loss_sum,
        hidden_shape=(rows, seq // dims.cp // (dims.tp if dims.sp else 1), model_args(ctx.cfg.model).dim),
        positions=positions if positions is not None else torch.arange(seq, device=ctx.device),
        forward_context=lambda microbatch: _forward_context(ctx, measure_first and microbatch == 0),
        # ZeRO-3 under bf16 computes on bf16 units: the residual stream a stage sends is bf16
        dtype=torch.bfloat16 if ctx.cfg.train.dtype == "bf16" and dims.zero == 3 else torch.float32,
        weight_grads=ctx.par.pipeline.weight_grads,
        stage_done=ctx.par.pipeline.stage_done,
        loss_in_head=loss_sum is None and ctx.par.loss_in_head,
    )


@contextlib.contextmanager
def _forward_context(ctx: Context, measuring: bool = False):
    measure = ctx.par.saved.measure(reset=False) if measuring else contextlib.nullcontext()
    with ctx.par.saved.forward(), measure, ctx.autocast():
        yield


@contextlib.contextmanager
def measuring_loss_peak(ctx: Context):
    """The ledger's measurement of the loss's peak (`LossPeak`) through the forward and backward
    inside it, on the rank that holds the head; yields the meter (None on the other ranks)."""
    stages = ctx.par.pipeline.stages.values() if ctx.par.pipeline is not None else [ctx.par.module]
    head = next((stage.output for stage in stages if stage.output is not None), None)
    if head is None:
        yield None
        return
    loss_sum = ctx.par.loss_sum
    with LossPeak(head, ctx.par.loss_in_head) as meter:
        ctx.par.loss_sum = meter.wrap(loss_sum)
        try:
            yield meter
        finally:
            ctx.par.loss_sum = loss_sum


def global_mean(ctx: Context, value: torch.Tensor) -> float:
    """Sum a per-rank share (already divided by global tokens) over the data-parallel ranks."""
    value = value.detach().clone()
    with ctx.mesh.ledger.phase("metrics"):
        comm.all_reduce(value, ctx.metrics_group)
        if ctx.mesh.dims.pp > 1:  # the loss lives on the last stage
            comm.all_reduce(value, dataclasses.replace(ctx.mesh.group("pp"), cut="metrics"))
    return float(value)


@torch.no_grad()
def evaluate(ctx: Context) -> float:
    dp, rank = ctx.mesh.dims.dp, ctx.mesh.coordinate("dp")
    total = torch.zeros((), device=ctx.device)
    tokens = 0
    for batch in ctx.val_batches:
        tokens += counted_targets(batch[1])  # the whole batch's (every rank holds it): chat data, replies only
        inputs, targets, positions, documents = local_batch(ctx, *shard_batch(batch, rank, dp))
        if ctx.par.pipeline is not None:
            total += pipeline_step(ctx, inputs.shape[0], positions).forward_only(
                microbatches(inputs, targets, documents, 1), 1
            )
            continue
        with ctx.autocast():
            total += ctx.par.forward_loss(inputs, positions, targets, documents)
    return global_mean(ctx, total / tokens)
