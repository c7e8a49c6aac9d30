"""The training loop, the same for every layout: steps (`fivecut.train.run`), the optimizer,
non-finite values and signals, checkpoints, and rank 0's log."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch.distributed as dist

from fivecut.config import Config, lr_floor, model_label, settle_min_lr
from fivecut.ledger import Row
from fivecut.train import checkpoint
from fivecut.train.faults import NonFiniteGuard, SignalFlag, TrainingStopped, Verdict, agree, signal_stop
from fivecut.train.infer import greedy_sample
from fivecut.train.memory import format_bytes, model_state_bytes, step_peak_bytes
from fivecut.train.metrics import MetricsSink, peak_tflops, plot_losses
from fivecut.train.optim import clip_gradients, lr_at, set_lr
from fivecut.train.resume import check_data_position, frozen_base, resume_changes
from fivecut.train.run import Context, evaluate, forward_backward, global_mean, measuring_loss_peak, setup
from fivecut.train.saving import Saves
from fivecut.weights.load import model_args


@dataclass
class RunResult:
    losses: list[float] = field(default_factory=list)  # training loss per step
    val_losses: dict[int, float] = field(default_factory=dict)  # step -> validation loss
    grad_norms: list[float] = field(default_factory=list)
    ledger_rows: list[Row] = field(default_factory=list)  # the last step's communication
    memory: dict[str, int] = field(default_factory=dict)  # model-state bytes on this rank
    buffers: int = 0  # the most bytes the data cut's buffers held at once in step 1 (`BufferPeak`)
    activations: dict[str, int] = field(default_factory=dict)  # layer -> bytes saved for backward (step 1)
    loss_peak: int | None = None  # the head and loss's peak in step 1 (`LossPeak`), on the rank holding the head
    loss_plot: str | None = None
    moe: list[dict] = field(default_factory=list)  # MoE models: per step, expert loads and balance
    compile: dict = field(default_factory=dict)  # train.compile: graphs and graph breaks after step 1


def balance_experts(ctx: Context, step: int) -> dict | None:
    """MoE models: sum the step's expert loads over the ranks, move the balancing biases,
    re-place EPLB copies; returns the step's MoE metrics."""
    if ctx.par.experts is None:
        return None
    with ctx.mesh.ledger.phase("optimizer"):
        return ctx.par.experts.end_step(step)


def clip(ctx: Context) -> float:
    """The global gradient norm (before clipping), clipping the gradients in place."""
    with ctx.mesh.ledger.phase("optimizer"):
        return clip_gradients(ctx.par.pieces, ctx.cfg.train.grad_clip, ctx.par.norm_groups)


def optimizer_step(ctx: Context, step: int, moe: dict | None = None) -> None:
    """Step at the schedule's `step`, gather ZeRO shards; then EPLB moves experts (their elements
    sent go to `moe`); the masters changed, so the bf16 compute copies go (the next forward casts
    them again). A skipped step calls none of this, on every rank alike."""
    t = ctx.cfg.train
    with ctx.mesh.ledger.phase("optimizer"):
        set_lr(ctx.optimizer, lr_at(step, t.lr, lr_floor(t), t.warmup, t.steps))
        ctx.optimizer.step()
        ctx.par.sync.after_step()  # ZeRO-1/2: the gathers go on into the next forward
        if ctx.par.experts is not None:
            ctx.par.sync.settle()  # EPLB moves whole experts
            for layer, elements in ctx.par.move_experts(ctx.optimizer).items():
                moe["local"][layer]["moved_elements"] = elements
        ctx.par.compute.invalidate()


def train(
    cfg: Config, quiet: bool = False, measure_activations: bool = False, resume: str = "auto", accept: list[str] = ()
) -> RunResult:
    """Train under the layout of `cfg.parallel`; the process group must already exist.
    `measure_activations` records the bytes each layer saves for backward in step 1 and the loss's
    peak (`fivecut ledger`). `resume`:
    "auto" (the newest complete checkpoint in checkpoint.dir, if any), "never", or a checkpoint path;
    `accept`: the config keys that may differ from the checkpoint's although they change the run
    (`fivecut.train.resume`). An early stop (signal, non-finite values) raises `TrainingStopped`;
    see `fivecut.train.faults`."""
    ctx = setup(cfg)
    guard = NonFiniteGuard(cfg.train.on_nonfinite, cfg.train.max_skipped)
    start = resume_from(ctx, resume, guard, accept)
    log = Logger(ctx, quiet, resumed=start > 0)
    saves = Saves(cfg.checkpoint, log.report, cfg.train.collective_timeout)
    log.record(ctx.start.record())
    result = RunResult()
    if start == 0 and ctx.val_batches and cfg.model.init_from is not None:  # fine-tuning: where it starts
        result.val_losses[0] = evaluate(ctx)
        log.before_training(result.val_losses[0])
    try:
        run_steps(ctx, start, result, log, guard, measure_activations, saves)
    except BaseException:
        log.abort()
        raise
    ctx.par.sync.settle()  # the trained parameters whole for whatever reads them next
    result.ledger_rows = ctx.mesh.ledger.rows()  # the training step's, not the sample's
    if cfg.log.sample_prompt:
        log.print(sample_line(ctx, cfg.log.sample_prompt, cfg.log.sample_tokens))
    result.loss_plot = log.close()
    return result


def run_steps(ctx: Context, start: int, result: RunResult, log, guard: NonFiniteGuard, measure, saves: Saves) -> None:
    """This launch's steps after `start`; a save still writing in the background is finished
    before it returns, and before an early stop leaves."""
    cfg = ctx.cfg
    try:
        with SignalFlag() as signals:
            last = launch_end(cfg, start)
            for step in range(start + 1, last + 1):
                run_step(ctx, step, result, log, guard, signals, measure, saves)
        if last < cfg.train.steps:
            end_launch(ctx, last, guard, log, saves)
    except TrainingStopped:  # every rank stops after the same step: the save in flight completes
        saves.close()
        raise
    saves.close()


def launch_end(cfg: Config, start: int) -> int:
    """The last step this launch runs: train.steps, or train.launch_steps after where it started."""
    t = cfg.train
    return min(t.steps, start + t.launch_steps) if t.launch_steps else t.steps


def end_launch(ctx: Context, step: int, guard: NonFiniteGuard, log, saves: Saves | None = None) -> None:
    """train.launch_steps are done: the checkpoint at `step` (when not saved already) and one line."""
    if not checkpoint_due(ctx.cfg, step):
        save_checkpoint(ctx, step, guard, saves)
    t = ctx.cfg.train
    log.print(
        f"fivecut: this launch ran its train.launch_steps={t.launch_steps} steps and stopped at step {step} of "
        f"{t.steps}, checkpoint saved; start it again to go on"
    )


def sample_line(ctx: Context, prompt: str, tokens: int) -> str:
    """What the trained model writes after `prompt` (greedy; every rank takes part)."""

    with ctx.mesh.ledger.phase("metrics"):
        text = greedy_sample(ctx, ctx.tokenizer, prompt, tokens)
    return f"sample: {prompt}{text}"


def resume_from(ctx: Context, resume: str, guard: NonFiniteGuard | None = None, accept: list[str] = ()) -> int:
    """Load the checkpoint `resume` names into this layout, its config compared with this one (a
    changed run is refused unless `accept` names each key); returns its step (0: a fresh start)."""
    root = ctx.cfg.checkpoint.dir
    if root is not None and ctx.is_logger:
        checkpoint.clean_partial(Path(root).expanduser())  # what a killed save left behind
    path = checkpoint.to_resume(root, resume, hashed=True)  # "auto": damaged newer ones set aside
    saved = checkpoint.read_meta(path) if path is not None else None
    settle_min_lr(ctx.cfg.train, saved and saved["config"])
    ctx.start = resume_changes(path, saved, ctx.cfg, accept)
    if saved is not None:
        check_data_position(saved, ctx.sampler.position(saved["step"]), list(accept))
    if path is None:
        print_lines(ctx, ctx.start.lines())
        return 0
    model = dataclasses.asdict(model_args(ctx.cfg.model))
    meta = checkpoint.load(path, ctx.par, ctx.optimizer, model, {c.key for c in ctx.start.accepted}, resume == "auto")
    if guard is not None:  # the learning rate counts applied updates: step - skipped
        guard.total = meta.get("skipped_total", 0)
    ctx.overrides = meta.get("overrides", []) + ([ctx.start.record()] if ctx.start.accepted else [])
    resumed = (
        f"fivecut: resumed at step {meta['step']} from {path} (saved under layout {meta['layout']}, "
        f"loaded into {ctx.mesh.dims.describe()})"
    )
    print_lines(ctx, [resumed, *ctx.start.lines()])
    return meta["step"]


def print_lines(ctx: Context, lines: list[str]) -> None:
    if ctx.is_logger:
        for line in lines:
            print(line, flush=True)


def checkpoint_due(cfg: Config, step: int) -> bool:
    c = cfg.checkpoint
    return c.dir is not None and (step == cfg.train.steps or (c.every > 0 and step % c.every == 0))


def save_checkpoint(
    ctx: Context, step: int, guard: NonFiniteGuard | None = None, saves: Saves | None = None
) -> Path | None:
    """Every rank writes its part of the state at `step` (see `fivecut.train.checkpoint`), when a
    checkpoint.dir is set: blocking, returning its folder; or through the run's `saves`
    (`fivecut.train.saving`: in the background, a failed save per checkpoint.on_error), returning None."""
    cfg = ctx.cfg
    if cfg.checkpoint.dir is None:
        return None
    ctx.par.sync.settle()
    meta = {
        "skipped_total": guard.total if guard is not None else 0,
        "layout": ctx.mesh.dims.describe(),
        "world_size": dist.get_world_size(),
        "tokens": step * cfg.train.global_batch * cfg.train.seq_len,
        "preset": model_label(cfg.model),
        "model": dataclasses.asdict(model_args(cfg.model)),
        "config": cfg.to_dict(),
        "overrides": ctx.overrides,
        "data": ctx.sampler.position(step),  # (epoch, index) and the stores read: compared on resume
        "base": frozen_base(cfg),  # [lora]: the frozen weights the checkpoint does not hold, compared on resume
    }
    c, root = cfg.checkpoint, Path(cfg.checkpoint.dir).expanduser()
    if saves is None:
        return checkpoint.save(root, step, ctx.par, ctx.optimizer, meta, c.keep, c.verify)
    saves.save(root, step, ctx.par, ctx.optimizer, meta)
    return None


def run_step(
    ctx, step: int, result: RunResult, log, guard: NonFiniteGuard, signals: SignalFlag, measure, saves=None
) -> None:
    """One optimizer step, logged (and saved when due); raises `TrainingStopped` when every rank agreed to stop here."""
    cfg = ctx.cfg
    ctx.mesh.ledger.begin_step(step)
    started = time.perf_counter()
    ctx.par.sync.zero_grad()
    measuring = measure and step == 1
    with measuring_loss_peak(ctx) if measuring else contextlib.nullcontext() as meter:
        local = forward_backward(ctx, step, result.activations if measuring else None)
    if meter is not None:
        result.loss_peak = meter.peak
    if saves is not None:  # a background save's copy of the state complete before anything changes it
        saves.before_update()
    moe = balance_experts(ctx, step)
    loss = global_mean(ctx, local)
    norm = clip(ctx)
    with ctx.mesh.ledger.phase("optimizer"):
        verdict = agree(ctx.control_group, signals.received, loss, norm, saves is not None and saves.writing())
    skipped = guard.skips(step, verdict.nonfinite, loss, norm)
    if not skipped:
        optimizer_step(ctx, step - guard.total, moe)
    elapsed = time.perf_counter() - started
    result.losses.append(loss)
    result.grad_norms.append(norm)
    record = {"step": step, "loss": loss, "lr": ctx.optimizer.param_groups[0]["lr"], "grad_norm": norm}
    record.update(skipped=skipped, skipped_total=guard.total)
    peak = step_peak_bytes(ctx.device)  # a GPU's allocator: the step's peak, every byte it held
    if peak is not None:
        record["peak_allocated_gib"] = peak / 2**30
    if moe is not None:
        result.moe.append(moe)
        record["moe"] = moe
    if step == 1:
        result.memory = model_state_bytes(*ctx.par.state_tensors(), ctx.optimizer)
        result.buffers = ctx.par.sync.buffer_peak()
        log.memory(result.memory)
    if step == 1 and ctx.par.compiled is not None:  # Dynamo's counts once step 1 has compiled every graph
        record["compile"] = result.compile = ctx.par.compiled.counts()
        log.print(ctx.par.compiled.line())
    if ctx.val_batches and (step % cfg.train.eval_every == 0 or step == cfg.train.steps):
        record["val_loss"] = result.val_losses[step] = evaluate(ctx)
    log.step(record, elapsed)
    stop_after(ctx, step, verdict, guard, saves)


def stop_after(ctx: Context, step: int, verdict: Verdict, guard: NonFiniteGuard, saves=None) -> None:
    """A background save that no rank is writing any more: checked and put in place. Then a signal:
    save (when a checkpoint.dir is set), then stop; too many skipped steps: stop without saving;
    otherwise save when due."""
    if saves is not None and not verdict.writing:
        saves.finish()
    if verdict.signal:
        save_checkpoint(ctx, step, guard, saves)
        raise signal_stop(verdict.signal, step)
    exhausted = guard.exhausted(step)
    if exhausted is not None:
        raise exhausted
    if checkpoint_due(ctx.cfg, step):
        save_checkpoint(ctx, step, guard, saves)


class Logger:
    """Rank 0's view of the run: progress bar, text lines, JSONL metrics, the loss curve."""

    def __init__(self, ctx: Context, quiet: bool, resumed: bool = False):
        self.ctx, self.cfg = ctx, ctx.cfg
        self.active = ctx.is_logger and not quiet
        self.records: list[dict] = []
        self.bar = None
        if not self.active:
            return
        out = Path(self.cfg.log.out_dir)
        self.sink = MetricsSink(out, append=resumed)  # a resumed run continues its metrics
        (out / "config.json").write_text(json.dumps(self.cfg.to_dict(), indent=2))
        self.peak = peak_tflops(ctx.device, self.cfg.train.dtype, self.cfg.log.peak_tflops)
        n_params = model_args(self.cfg.model).num_params()
        self.print(
            f"fivecut: {model_label(self.cfg.model)} model, {n_params / 1e6:.2f}M parameters, layout "
            f"{run_layout(self.cfg.parallel)} ({dist.get_world_size()} ranks, {ctx.device.type}), "
            f"{self.cfg.train.global_batch}x{self.cfg.train.seq_len} tokens per step; peak {self.peak.tflops:.3g} "
            f"TFLOP/s ({self.peak.source})"
        )
        if self.cfg.log.progress:
            from tqdm import tqdm

            self.bar = tqdm(total=self.cfg.train.steps, desc="train", unit="step", dynamic_ncols=True)

    def print(self, text: str) -> None:
        if not self.active:
            return
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def record(self, record: dict | None) -> None:
        """A record of metrics.jsonl that is not a step's (the config changes a resume accepted)."""
        if self.active and record is not None:
            self.sink.write(record)

    def report(self, line: str | None, record: dict) -> None:
        """A line for the log (None: none) and a record for metrics.jsonl (a failed save's)."""
        if line is not None:
            self.print(line)
        self.record(record)

    def before_training(self, val_loss: float) -> None:
        """The imported model's validation loss, as step 0 (in the log and metrics.jsonl)."""
        if self.active:
            self.sink.write({"step": 0, "val_loss": val_loss})
            self.print(f"step     0/{self.cfg.train.steps}  val {val_loss:.4f} (the imported weights, before training)")

    def memory(self, parts: dict[str, int]) -> None:
        self.print(
            "model-state memory on rank 0: "
            + ", ".join(f"{k} {format_bytes(v)}" for k, v in parts.items() if k != "total")
            + f" = {format_bytes(parts['total'])}"
        )

    def step(self, record: dict, elapsed: float) -> None:
        if not self.active:
            return
        t = self.cfg.train
        tokens_per_s = t.global_batch * t.seq_len / elapsed
        achieved = tokens_per_s * self.ctx.flops_per_token / dist.get_world_size() / 1e12  # TFLOP/s per device
        exceeded = self.peak.observe(achieved, record["step"])
        if exceeded is not None:
            self.print(exceeded)
        record.update(tokens_per_s=tokens_per_s, mfu=self.peak.mfu(achieved), step_time=elapsed)
        self.records.append(record)
        self.sink.write(record)
        text = f"loss {record['loss']:.4f}  {tokens_per_s:,.0f} tok/s  MFU {100 * record['mfu']:.1f}%"
        if self.bar is not None:
            self.bar.set_postfix_str(text, refresh=False)
            self.bar.update(1)
        if record["step"] % self.cfg.log.log_every == 0 or "val_loss" in record or record["step"] == t.steps:
            val = f"  val {record['val_loss']:.4f}" if "val_loss" in record else ""
            self.print(
                f"step {record['step']:>5}/{t.steps}  {text}  lr {record['lr']:.2e}  |g| {record['grad_norm']:.3f}{val}"
                + moe_summary(record.get("moe"))
                + (f"  skipped (non-finite; {record['skipped_total']} so far)" if record["skipped"] else "")
            )

    def abort(self) -> None:
        """An early stop: close the files, print nothing (the caller prints the one line)."""
        if self.active:
            if self.bar is not None:
                self.bar.close()
            self.sink.close()

    def close(self) -> str | None:
        if not self.active:
            return None
        if self.bar is not None:
            self.bar.close()
        self.sink.close()
        self.print(f"metrics: {self.sink.path}")
        if not self.cfg.log.plot or not self.records:
            return None
        path = plot_losses(
            self.records,
            Path(self.cfg.log.out_dir) / "loss.png",
            f"fivecut {model_label(self.cfg.model)}, {self.cfg.parallel.describe()}",
        )
        self.print(f"loss curve: {path}")
        return str(path)


def run_layout(dims) -> str:
    """The cuts, and under a pipeline its microbatches (given, or the count `checks` chose)."""
    return dims.describe() + (f",microbatches={dims.microbatches}" if dims.pp > 1 else "")


def moe_summary(moe: dict | None) -> str:
    """The step's MoE balance for the log line: max/mean expert load (average, then per layer),
    max/mean rank load, dropped slots, auxiliary loss; metrics.jsonl has every expert's load."""
    if moe is None:
        return ""
    per_layer = " ".join(f"L{layer}:{v['max_mean']:.2f}" for layer, v in moe["layers"].items())
    text = f"  experts max/mean {moe['max_mean']:.2f} ({per_layer})  ranks max/mean {moe['rank_max_mean']:.2f}"
    if moe["rank_max_mean"] != moe["rank_max_mean_no_eplb"]:
        text += f" (without EPLB {moe['rank_max_mean_no_eplb']:.2f})"
    if moe["dropped"]:
        text += f"  dropped {100 * moe['dropped']:.2f}%"
    if moe["aux_loss"]:
        text += f"  aux {moe['aux_loss']:.4f}"
    return text
