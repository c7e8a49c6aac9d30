"""`fivecut train | eval | generate | export | convert | check-import | verify | ledger | schedule | checkpoint info`.

The top of the floors (DESIGN.md, principle 11): it imports everything below it. What imports torch
(or matplotlib) is imported inside the command that runs it, so that `fivecut --help`, `schedule` and
every refusal of an input start without torch; what is free of torch is imported here at the top
(`tests/test_layout_of_code.py` holds both to that).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import io
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

from fivecut import checks
from fivecut.checks import PP_SCHEDULES, LayoutError
from fivecut.config import (
    Config,
    ConfigError,
    ModelConfig,
    apply_table,
    load_config,
    model_label,
    nest,
    parse_override,
    preset_args,
    settle_min_lr,
)
from fivecut.layout import MoEOptions, ParallelDims
from fivecut.ledger import format_rows
from fivecut.model.args import MLA_ONLY, MOE_ONLY
from fivecut.model.presets import PRESETS, SHAPE_ONLY, runnable_presets
from fivecut.parallel.pipeline.schedule import peak_in_flight
from fivecut.parallel.pipeline.simulate import simulate, text
from fivecut.plan.activations import activation_bytes_per_layer, layer_mode, loss_peak_bytes, precision_of
from fivecut.plan.cluster import SPELLING, cluster_toml, parse_cluster
from fivecut.plan.memory import check_lines, formula, gib, kernels_of, model_state_bytes, moment_lines
from fivecut.train.resume import check_data_position, resume_changes

# verify's tolerances, each the largest relative difference from the single process accepted at a step, by the
# dtype both runs compute in (train.dtype). The gradient norm before clipping is compared because AdamW hides a
# scaled gradient from the loss, not from it.
LOSS_RTOL = 1e-5  # the loss, every step: layouts differ only in the order of floating-point sums (DESIGN.md)
FIRST_GRAD_NORM_RTOL = 1e-5  # step 1's gradient norm: identical weights, only the order of sums differs
# steps after the first: AdamW's first update is about lr * sign(g) per entry, so an entry whose gradient is zero
# up to rounding moves by +-lr either way, and later gradients differ by more than rounding: dp=4 at seq_len 32
# moved the norm by 3e-4 from rounding alone, while a gradient halved on any one cut moves it by 8.5e-2 or more
LATER_GRAD_NORM_RTOL = 1e-3
VAL_LOSS_RTOL = 1e-5  # the validation loss: a forward with the trained weights, same bar as the training loss

# bf16 (autocast, fp32 masters): each matmul's output is rounded to 8 significant bits, so a change in the order of
# sums (the batch split otherwise) moves a value by far more than in fp32. Measured, not guessed: the largest drift
# of two single-process bf16 runs of verify's own run (10 steps) that differ only in the split of the batch
# (train.accumulate 1 against 2 and 4), over tiny, tiny-moe and tiny-mla on the CPU:
#     python benchmarks/verify_drift.py --dtype bf16   (benchmarks/results/verify.md)
# loss 1.1e-4, validation loss 1.0e-4, step 1's gradient norm 3.9e-5, later gradient norms 3.3e-2. Each tolerance
# sits 5x or more above that; the first three at 1e-3 also cover ZeRO-3, whose bf16 gathers round parameters and
# gradients where autocast keeps fp32 (dp=2,zero=3 measured 3.2e-4 loss, 2.9e-4 step 1's norm), and stay under one
# bf16 rounding (2^-8 = 3.9e-3), while a gradient doubled on one of two ranks moves step 1's norm by ~0.5.
BF16_LOSS_RTOL = 1e-3
BF16_FIRST_GRAD_NORM_RTOL = 1e-3
BF16_LATER_GRAD_NORM_RTOL = 2e-1  # 6x the 3.3e-2 of a split batch (AdamW's sign(g) moves, see above); cp=2 5.8e-2
BF16_VAL_LOSS_RTOL = 1e-3


@dataclasses.dataclass(frozen=True)
class Tolerances:
    """verify's bar for each compared quantity: a relative difference from the single process."""

    loss: float  # the training loss, every step (--rtol)
    val_loss: float  # the validation loss (--rtol)
    first_grad_norm: float  # the gradient norm before clipping at step 1 (--grad-rtol)
    later_grad_norm: float  # ... at steps 2 on (--later-grad-rtol)

    def at(self, name: str, step: int) -> float:
        """The tolerance of quantity `name` (a key of `verify_series`) at `step`."""
        if name == "grad_norm":
            return self.first_grad_norm if step == 1 else self.later_grad_norm
        return self.loss if name == "loss" else self.val_loss


TOLERANCES = {  # train.dtype -> verify's default tolerances
    "fp32": Tolerances(LOSS_RTOL, VAL_LOSS_RTOL, FIRST_GRAD_NORM_RTOL, LATER_GRAD_NORM_RTOL),
    "bf16": Tolerances(BF16_LOSS_RTOL, BF16_VAL_LOSS_RTOL, BF16_FIRST_GRAD_NORM_RTOL, BF16_LATER_GRAD_NORM_RTOL),
}
TOLERANCE_FLAGS = {  # verify's flag -> the fields of `Tolerances` it sets, and what they are
    "--rtol": (("loss", "val_loss"), "loss and validation loss"),
    "--grad-rtol": (("first_grad_norm",), "gradient norm at step 1"),
    "--later-grad-rtol": (("later_grad_norm",), "gradient norm at steps 2 on"),
}

INPUT_REFUSED = 2  # exit status of an input refused before anything runs
FAILED = 1  # exit status of a FAIL, and of a run that did not complete (a rank raised, died or ran out of time)
NOTHING_FITS = 1  # exit status of a plan search in which no layout fits the devices (an answer, not a bad input)
PLAN_TOP = 5  # layouts a plan search prints and plots unless --top says


class RunFailed(RuntimeError):
    """A spawned run that did not complete; the message is one line for the terminal."""


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    with contextlib.nullcontext() if says_errors() else contextlib.redirect_stderr(io.StringIO()):
        ns = parser.parse_args(argv)  # a bad flag: argparse's usage and error, exit 2
    try:
        check_path_flags(ns)
        return ns.func(ns)
    except (ConfigError, LayoutError, ValueError, FileNotFoundError) as err:
        print_error(f"error: {err}")
        tell_torchrun(f"error: {err}")
        return INPUT_REFUSED
    except RunFailed as err:
        print_error(f"error: {err}")
        return FAILED


PATH_FLAGS = {  # argparse dest -> (flag, what to give), for every option that names a file or folder
    "config": ("--config", "a TOML file"),
    "resume": ("--resume", "auto, never or a checkpoint's path"),
    "checkpoint": ("--checkpoint", "a checkpoint or a checkpoint.dir"),
    "init_from": ("--init-from", "hf:FOLDER, gguf:FILE or dcp:CHECKPOINT"),
    "data": ("--data", "'shakespeare', a text, JSONL or Parquet file, a folder, a glob or a saved dataset"),
    "out": ("--out", "a path"),
    "dir": ("the checkpoint folder (DIR)", "a checkpoint or a checkpoint.dir"),
}


def check_path_flags(ns) -> None:
    """An empty path would silently mean the current folder: refused, naming the flag."""
    for dest, (flag, choices) in PATH_FLAGS.items():
        value = getattr(ns, dest, None)
        if dest == "init_from" and value is not None and ":" in value:
            value = value.partition(":")[2]  # the path after hf: or gguf: (a bare path is refused by open_source)
        if value is not None and not value.strip():
            raise ConfigError(f"{flag} is empty (it would mean the current folder); give {choices}")


def says_errors() -> bool:
    """Whether this process reports input errors: under torchrun every rank finds the same
    mistake, and rank 0 alone says it (the others exit with the same status, quietly)."""
    return os.environ.get("RANK", "0") == "0"


def tell_torchrun(line: str) -> None:
    """Under torchrun, the agent's report of failed ranks shows each rank's error file, if it wrote
    one, in place of a link to torchrun's documentation: there it names the refusal too."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        with contextlib.suppress(OSError):
            record = {"message": line, "extraInfo": {"timestamp": str(int(time.time()))}}  # torch's ErrorHandler's form
            Path(path).write_text(json.dumps({"message": record}))


def print_error(line: str) -> None:
    if says_errors():
        say(line)


def say(line: str) -> None:
    """One line on stderr in one write: the lines of ranks sharing a terminal never interleave."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fivecut",
        description="Train transformer LMs cut five ways.",
        epilog=f"exit status: 0 done (verify: PASS); {FAILED} verify's FAIL, or a run that did not complete (a rank "
        f"raised, died or passed --timeout), or a plan search in which no layout fits; {INPUT_REFUSED} an input "
        "refused before anything ran",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train a model (one process, or under torchrun)")
    train.add_argument("--config", help="TOML file; defaults apply to missing keys")
    train.add_argument(
        "--resume",
        default="auto",
        help="auto (default: the newest complete checkpoint in checkpoint.dir, if any), never, or a checkpoint path",
    )
    train.add_argument(
        "--override",
        dest="accept",
        action="append",
        default=[],
        metavar="KEY",
        help="resume although config KEY (e.g. train.lr) changes the run against the checkpoint's (repeatable)",
    )
    add_overrides(train)
    train.set_defaults(func=cmd_train)

    ckpt = sub.add_parser("checkpoint", help="inspect checkpoints")
    ckpt_sub = ckpt.add_subparsers(dest="action", required=True)
    info = ckpt_sub.add_parser("info", help="step, tokens, layout, model, size, and whether it is complete and intact")
    info.add_argument("dir", help="a checkpoint, or a checkpoint.dir (its newest complete checkpoint)")
    info.set_defaults(func=cmd_checkpoint_info)

    add_export_parser(sub)
    add_convert_parser(sub)
    add_check_import_parser(sub)
    add_eval_parser(sub)
    add_generate_parser(sub)
    add_data_parser(sub)

    verify = sub.add_parser("verify", help="compare a layout's losses with a single-process run")
    add_layout_arguments(verify, steps=10)
    add_tolerance_arguments(verify)
    verify.set_defaults(func=cmd_verify)

    ledger = sub.add_parser("ledger", help="one step under a layout: communication measured vs predicted")
    add_layout_arguments(ledger, steps=1)
    ledger.set_defaults(func=cmd_ledger)

    schedule = sub.add_parser(
        "schedule", help="a pipeline schedule: action lists, simulated timeline, bubble, Gantt PNG"
    )
    schedule.add_argument("--schedule", required=True, choices=PP_SCHEDULES)
    schedule.add_argument("--pp", type=int, required=True, help="pipeline ranks")
    schedule.add_argument("--microbatches", type=int, required=True)
    schedule.add_argument("--virtual", type=int, default=1, help="stages per rank (interleaved)")
    schedule.add_argument("--cost-f", type=float, default=1.0, help="forward time per stage")
    schedule.add_argument("--cost-b", type=float, default=None, help="backward time (default 2, or 1 when B/W split)")
    schedule.add_argument(
        "--cost-w", type=float, default=None, help="weight-gradient time (zb1p, dualpipev: B/W split; default 1)"
    )
    schedule.add_argument("--cost-comm", type=float, default=0.0, help="send-to-receive latency")
    schedule.add_argument("--out", help="write the Gantt chart to this PNG")
    schedule.set_defaults(func=cmd_schedule)

    plan = sub.add_parser(
        "plan", help="what a layout costs on a cluster: memory, communication, time (calibrate: this machine)"
    )
    plan.add_argument("--layout", help="cost this layout only, e.g. dp=16,tp=4,pp=4 (keys are parallel.* fields)")
    plan.add_argument(
        "--model",
        default="tiny",
        help="a preset (shape-only ones included: llama3-70b, ...), a config TOML (its [model]) or an HF config.json",
    )
    plan.add_argument("--cluster", help="NODESxGPUSxDEVICE (e.g. 32x8xH100) or a cluster TOML file")
    plan.add_argument("--seq", type=int, default=None, help="sequence length (default: the model's)")
    batch = plan.add_mutually_exclusive_group()
    batch.add_argument("--global-batch", type=int, default=None, help="sequences per optimizer step (default: world)")
    batch.add_argument(
        "--global-batch-tokens", default=None, help="tokens per optimizer step (4M, 512K or a number); seq divides it"
    )
    plan.add_argument(
        "--top", type=int, default=None, help=f"layouts the search prints and plots (default {PLAN_TOP}; no --layout)"
    )
    plan.add_argument("--out", default="plan", help="folder for plan.json and plan.png (default ./plan)")
    plan.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="train.dtype (default bf16)")
    plan.add_argument(
        "--check",
        action="store_true",
        help="with --layout: also run one real training step of the layout on fake tensors, as the rank that "
        "peaks (no memory allocated), and print its memory beside the plan's",
    )
    add_overrides(plan)
    plan.set_defaults(func=cmd_plan)
    plan_sub = plan.add_subparsers(dest="action")
    calibrate = plan_sub.add_parser(
        "calibrate", help="measure this machine's matmul rate and gloo/NCCL link; write it as a cluster TOML"
    )
    calibrate.add_argument(
        "--ranks", type=int, default=2, help="ranks to measure at once (default 2; at most the GPUs, or 2 a CPU core)"
    )
    calibrate.add_argument("--out", default="cluster-local.toml", help="the cluster file to write (a new file)")
    calibrate.add_argument("--force", action="store_true", help="replace --out if it exists")
    calibrate.add_argument(
        "--device", choices=("auto", "cpu", "cuda"), default="auto", help="what to measure (auto: the GPUs if any)"
    )
    calibrate.add_argument(
        "--model", default=None, help="size a GPU's probes to this model (as plan's --model; default llama-1b)"
    )
    calibrate.add_argument("--seq", type=int, default=None, help="the run's sequence length (a GPU's attention probe)")
    calibrate.set_defaults(func=cmd_plan_calibrate)
    return parser


def add_overrides(parser: argparse.ArgumentParser) -> None:
    sections = ", ".join(f.name for f in dataclasses.fields(Config))
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help=f"override one config key (repeatable); sections: {sections}",
    )


def add_layout_arguments(parser: argparse.ArgumentParser, steps: int) -> None:
    parser.add_argument("--layout", required=True, help="e.g. dp=2 or dp=2,zero=1; keys are parallel.* fields")
    parser.add_argument(
        "--model",
        default="tiny",
        help=f"model preset: {', '.join(runnable_presets())} (the shape-only {', '.join(sorted(SHAPE_ONLY))} "
        "are for planning), or a model's weights, hf:FOLDER, gguf:FILE or dcp:CHECKPOINT (its tokenizer or bytes)",
    )
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds before a hung run is reported")
    add_overrides(parser)


def add_tolerance_arguments(parser: argparse.ArgumentParser) -> None:
    """verify's tolerances, each defaulting to the run's dtype's (`TOLERANCES`)."""
    fp32, bf16 = TOLERANCES["fp32"], TOLERANCES["bf16"]
    for flag, (fields, what) in TOLERANCE_FLAGS.items():
        parser.add_argument(
            flag,
            type=float,
            help=f"largest relative difference of the {what} accepted (default: {getattr(fp32, fields[0]):g} under "
            f"fp32, {getattr(bf16, fields[0]):g} under bf16)",
        )


# ---------------------------------------------------------------- train


def cmd_train(ns) -> int:
    from fivecut.launch import init_from_environment
    from fivecut.train import checkpoint
    from fivecut.train.run import run_tokens

    cfg = load_config(ns.config, ns.overrides)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    planned = auto_layout(cfg, world) if cfg.parallel.layout == "auto" else None
    cfg = planned.cfg if planned is not None else cfg
    checks.validate(cfg, world)
    path = checkpoint.to_resume(cfg.checkpoint.dir, ns.resume)
    meta = checkpoint.read_meta(path) if path else None
    settle_min_lr(cfg.train, meta and meta["config"])  # the floor: the checkpoint's, else a tenth of train.lr
    checkpoint.refuse_other_run(cfg.checkpoint.dir, ns.resume, cfg)  # one run per checkpoint.dir
    resume_changes(path, meta, cfg, ns.accept)  # a changed run: refused here
    resuming = path is not None
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0  # torchrun's new attempt of this run
    checks.check_folders(cfg, out_dir=True, resuming=resuming or restarted)  # a new run never overwrites an earlier one
    if not (resuming or restarted):
        hint_check_import(cfg.model.init_from, cfg.train.dtype)
    # the token stores built (once per node) and checked: bad data, and a split too small for train.eval_*, refused here
    sampler = run_tokens(cfg, evaluation_keys=True)
    if path is not None:
        saved = checkpoint.read_meta(path)
        check_data_position(saved, sampler.position(saved["step"]), ns.accept)
    init_from_environment(cfg.train.collective_timeout)
    if planned is not None:
        same_layout_everywhere(planned.cfg)
    return train_to_the_end(cfg, ns.resume, ns.accept)


def hint_check_import(init_from: str | None, dtype: str = "fp32") -> None:
    """A new run from a Hugging Face folder: one line (rank 0) on proving the import before the run is long,
    in the run's precision (`--dtype bf16` for a bf16 run)."""
    if init_from and init_from.startswith("hf:") and int(os.environ.get("RANK", "0")) == 0:
        precision = " --dtype bf16" if dtype == "bf16" else ""
        print(
            f"hint: `fivecut check-import {init_from}{precision}` compares this import with transformers' model on "
            "this machine (logits, PASS/FAIL) before a long run",
            flush=True,
        )


def auto_layout(cfg: Config, world: int):
    """parallel.layout = "auto": the planner's layout for `world` ranks (torchrun's ranks per node),
    said by rank 0; refused beside cuts given by hand, before any process group exists."""
    from fivecut.plan.auto import auto_problems, planned_layout

    checks.refuse("invalid options", auto_problems(cfg) + checks.option_problems(cfg))
    args = checks.checked_model_args(cfg)
    planned = planned_layout(cfg, args, world, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    if int(os.environ.get("RANK", "0")) == 0:
        print("\n".join(planned.lines()), flush=True)
    return planned


def same_layout_everywhere(cfg: Config) -> None:
    """Every rank planned alone; a rank that reached another plan (another cluster file on its node)
    would hang the first collective, or accumulate another number of micro-steps, so the plans (the
    cuts, `train.accumulate`, `train.recompute`) are compared once, here."""
    import torch.distributed as dist

    from fivecut.plan.auto import plan_line

    if dist.get_world_size() == 1:
        return
    mine = plan_line(cfg)
    plans = [None] * dist.get_world_size()
    dist.all_gather_object(plans, mine)
    others = sorted({(rank, plan) for rank, plan in enumerate(plans) if plan != plans[0]})
    if others:
        rank, plan = others[0]
        dist.destroy_process_group()  # every rank refuses here: nothing more goes over the group
        raise ConfigError(
            f"parallel.layout='auto' reached {plans[0]} on rank 0 but {plan} on rank {rank}; give every node "
            "the same parallel.cluster file"
        )


def train_to_the_end(cfg: Config, resume: str, accept: list[str] = ()) -> int:
    """Run `train`; an early stop or a failed collective ends in one line and an exit status
    (see `fivecut.train.faults`): each rank for a signal or its own failure, rank 0 for non-finite values."""
    import torch.distributed as dist

    from fivecut.comm import CollectiveError
    from fivecut.train.faults import COLLECTIVE_EXIT, TrainingStopped
    from fivecut.train.trainer import train

    try:
        train(cfg, resume=resume, accept=accept)
        return 0
    except TrainingStopped as stop:
        rank = dist.get_rank()
        if rank == 0 or stop.every_rank:
            who = f"rank {rank}: " if dist.get_world_size() > 1 else ""
            say(f"fivecut: {who}{stop.message}")
        return stop.code
    except CollectiveError as err:
        sys.stdout.flush()
        say(f"fivecut: {err}")
        os._exit(COLLECTIVE_EXIT)  # the process group cannot be torn down while a peer is gone
    finally:  # also when a bad checkpoint is refused (main prints it, exit 2)
        dist.destroy_process_group()


def cmd_checkpoint_info(ns) -> int:
    from fivecut.train import checkpoint

    lines = checkpoint.info(ns.dir)
    print("\n".join(lines))
    return 0 if lines[-1] == "complete and intact" else 2


def add_export_parser(sub) -> None:
    export = sub.add_parser("export", help="a checkpoint as a Hugging Face folder (safetensors, config, tokenizer)")
    export.add_argument("--checkpoint", required=True, help="a checkpoint, or a checkpoint.dir (its newest one)")
    export.add_argument("--out", required=True, help="the folder to write; must not exist or be empty")
    export.add_argument("--step", type=int, help="with a checkpoint.dir: the step to export instead of the newest")
    export.add_argument("--max-shard-size", default="5GiB", help="largest safetensors file, e.g. 5GB, 500MB, 2GiB")
    export.add_argument("--dtype", default="fp32", help="fp32 (as trained), bf16 or fp16")
    export.add_argument(
        "--architecture",
        help="the Hugging Face class to write, e.g. Qwen2ForCausalLM (default: the first that holds the model)",
    )
    export.add_argument(
        "--workers", type=int, default=1, help="processes writing the shards, each reading only its own"
    )
    export.add_argument(
        "--adapter",
        action="store_true",
        help="a [lora] run: write its adapters as a peft folder (without it: the model with the adapters merged)",
    )
    export.set_defaults(func=cmd_export)


def cmd_export(ns) -> int:
    from fivecut.weights.export import export, parse_size

    if ns.adapter:
        from fivecut.weights.peft import export_adapter

        given = [f for f, v in (("--max-shard-size", ns.max_shard_size != "5GiB"), ("--dtype", ns.dtype != "fp32"),
                                ("--workers", ns.workers != 1)) if v]  # fmt: skip
        if given:
            raise ConfigError(f"{given[0]} shapes the merged model's files; the adapter folder has one fp32 file")
        export_adapter(ns.checkpoint, ns.out, ns.step, ns.architecture)
        return 0
    export(ns.checkpoint, ns.out, ns.step, parse_size(ns.max_shard_size), ns.dtype, ns.architecture, ns.workers)
    return 0


# ---------------------------------------------------------------- convert

# convert's flags of one direction each, with their defaults: to a checkpoint, to Hugging Face (export's)
TO_CHECKPOINT = {"--layout": None, "--timeout": 3600.0, "--set": []}
TO_HF = {"--max-shard-size": "5GiB", "--dtype": "fp32", "--architecture": None, "--workers": 1}


def flag_dest(flag: str) -> str:
    return "overrides" if flag == "--set" else flag[2:].replace("-", "_")


def add_convert_parser(sub) -> None:
    convert = sub.add_parser(
        "convert",
        help="a published model (hf:, gguf:) as a fivecut checkpoint written by a layout's ranks, each reading only "
        "its slices; or a checkpoint (dcp:) as a Hugging Face folder",
    )
    convert.add_argument("--from", dest="source", required=True, help="hf:FOLDER, gguf:FILE or dcp:CHECKPOINT")
    convert.add_argument("--to", required=True, help="a folder for the checkpoint, or hf:FOLDER; absent or empty")
    convert.add_argument("--layout", help="to a checkpoint: the ranks that read and write it (default: one process)")
    convert.add_argument("--timeout", type=float, help="to a checkpoint: seconds before a hung rank is reported")
    for flag in TO_HF:
        convert.add_argument(flag, type=int if flag == "--workers" else str, help="to hf: as in fivecut export")
    add_overrides(convert)
    convert.set_defaults(func=cmd_convert)


def cmd_convert(ns) -> int:
    from fivecut.weights.convert import conversion, to_hugging_face
    from fivecut.weights.export import ExportError, parse_size

    c = conversion(ns.source, ns.to)
    own, other = (TO_CHECKPOINT, TO_HF) if c.to_checkpoint else (TO_HF, TO_CHECKPOINT)
    given = [flag for flag in other if getattr(ns, flag_dest(flag))]
    if given:
        raise ExportError(f"{given[0]} does not apply to converting {ns.source} to {ns.to}; drop it")
    o = {flag_dest(flag): getattr(ns, flag_dest(flag)) or default for flag, default in own.items()}
    if not c.to_checkpoint:
        to_hugging_face(c, parse_size(o["max_shard_size"]), o["dtype"], o["architecture"], o["workers"])
        return 0
    return convert_to_checkpoint(c, o["layout"], o["overrides"], o["timeout"])


def convert_to_checkpoint(c, layout: str | None, overrides: list[str], timeout: float) -> int:
    """Published -> DCP on the layout's ranks: torchrun's when under it, else spawned here."""
    from fivecut.weights.convert import convert_rank

    cfg = load_config(None, [f"model.init_from={c.source!r}".replace("'", '"'), 'data.tokenizer="auto"'])
    cfg = with_layout(cfg, layout, overrides, {"model.init_from": "--from"})
    world = int(os.environ.get("WORLD_SIZE", "0"))
    total = checks.validate(cfg, world or cfg.parallel.world_size).num_params()
    if world:
        held, rank = in_process(convert_rank, cfg, c.out)
        results = [(held, rank)]
    else:
        results = spawned("convert", convert_rank, cfg.parallel.world_size, cfg, c.out, timeout_s=timeout)
    if results[0][1] == 0:
        print(
            f"converted {c.source} to {c.out / 'step-00000000'} under layout {cfg.parallel.describe()} "
            f"({cfg.parallel.world_size} ranks; rank 0 held {results[0][0]:,} of the model's {total:,} elements); "
            f"start a run from it with model.init_from = 'dcp:{c.out}'"
        )
    return 0


# ---------------------------------------------------------------- check-import


def add_check_import_parser(sub) -> None:
    check = sub.add_parser(
        "check-import",
        help="build a Hugging Face folder's model both ways (fivecut's import, transformers') on this CPU and compare "
        "their logits on a random batch: PASS or FAIL",
    )
    check.add_argument("folder", help="hf:FOLDER, or the folder's path")
    check.add_argument("--batch", type=int, default=2, help="sequences in the random batch (default 2)")
    check.add_argument(
        "--seq", type=int, default=32, help="tokens a sequence (default 32; at most the model's context)"
    )
    check.add_argument("--seed", type=int, default=0, help="the seed of the random token ids")
    check.add_argument(
        "--dtype",
        choices=("fp32", "bf16"),
        default="fp32",
        help="fp32 (default), or bf16: fivecut under autocast over fp32 weights as training runs, transformers with "
        "bf16 weights, against bf16's tolerance for the model's depth, 4 * 2^-8 * sqrt(2 * layers)",
    )
    check.add_argument(
        "--rtol",
        type=float,
        default=None,
        help="largest relative logit difference (max |fivecut - transformers| / max |transformers|) that passes "
        "(default: fp32 1e-5, bf16 4 * 2^-8 * sqrt(2 * layers)); a decoder layer whose output differs by more is named",
    )
    check.add_argument(
        "--layer-by-layer",
        action="store_true",
        help="compare one decoder layer of each kind alone, each read alone from the safetensors, on a random hidden "
        "state (chosen by itself when both whole models would not fit in host memory)",
    )
    check.set_defaults(func=cmd_check_import)


def cmd_check_import(ns) -> int:
    for flag, value in (("--batch", ns.batch), ("--seq", ns.seq)):
        if value < 1:
            raise ConfigError(f"{flag} is {value}; give a positive number")
    if ns.rtol is not None and not ns.rtol > 0:
        raise ConfigError(f"--rtol is {ns.rtol}; give a positive tolerance, e.g. 1e-5")
    from fivecut.weights.import_check import compare, hf_folder, too_large

    folder = hf_folder(ns.folder)  # refused in one line before anything is read
    why = "asked for (--layer-by-layer)" if ns.layer_by_layer else too_large(f"hf:{folder}", ns.dtype)
    if why is not None:
        return check_import_layers(ns, why)
    c = compare(ns.folder, ns.batch, ns.seq, ns.seed, ns.dtype)
    print_import_comparison(ns, c)
    return import_verdict(ns, c)


def print_import_comparison(ns, c) -> None:
    """The whole models' comparison: each layer, the logits, KL; in bf16 the distances from fp32 and the tolerance."""
    print(f"{ns.folder}: {c.hf_class}, {c.n_layers} layers, {c.dtype}, random tokens [{c.tokens[0]}, {c.tokens[1]}]")
    if c.dtype == "bf16":
        print("  fivecut under bf16 autocast over fp32 weights (as training runs), transformers with bf16 weights")
    for i, rel in enumerate(c.layers):
        tolerance = c.tolerance(i + 1, ns.rtol)
        print(f"  layer {i}: output's largest relative difference {rel:.2e} (tolerance {tolerance:.2g})")
    print(f"logits: largest absolute difference {c.max_abs:.2e}, largest relative difference {c.max_rel:.2e}")
    print(f"KL(transformers || fivecut) per token: mean {c.kl_mean:.2e}, max {c.kl_max:.2e}")
    if c.from_fp32 is None:
        return
    ours, theirs = c.from_fp32
    print(f"from transformers' fp32 logits: fivecut's bf16 {ours:.2e}, transformers' bf16 {theirs:.2e}")
    if ns.rtol is None:
        print(
            f"bf16 tolerance after {c.n_layers} layers: 4 u sqrt(2 * {c.n_layers}) = {c.tolerance(c.n_layers):.2g}, "
            "u = 2^-8 (bf16 keeps 8 significant bits), one rounding a residual branch, adding up as a random walk"
        )


def import_verdict(ns, c) -> int:
    """PASS (0), or FAIL (1) naming the first layer over the tolerance."""
    rtol = c.tolerance(c.n_layers, ns.rtol)
    if c.passed(ns.rtol) and c.max_rel <= rtol and c.first_layer_over(ns.rtol) is None:
        print(f"PASS: largest relative difference {c.max_rel:.2e} <= {rtol:g}")
        return 0
    if c.passed(ns.rtol):
        print(
            f"PASS: fivecut's bf16 logits lie within {c.from_fp32[0]:.2e} <= {rtol:g} of transformers' fp32 ones; "
            f"transformers' bf16 drifts further ({c.from_fp32[1]:.2e})"
        )
        return 0
    first = c.first_layer_over(ns.rtol)
    where = f"; the first layer that differs is layer {first} ({c.layers[first]:.2e})" if first is not None else ""
    print(f"FAIL: largest relative difference {c.max_rel:.2e} > {rtol:g}{where}")
    return FAILED


def check_import_layers(ns, why: str) -> int:
    """`check-import` one decoder layer of each kind at a time: PASS, or FAIL naming the first that differs."""
    from fivecut.weights.import_check import check_layers, layer_passes, tolerance

    hf_class, n_layers, results = check_layers(ns.folder, ns.batch, ns.seq, ns.seed, ns.dtype)
    print(f"{ns.folder}: {hf_class}, {n_layers} layers, {ns.dtype}, layer by layer: {why}")
    print(f"  one layer of each kind alone, on a random hidden state [{ns.batch}, {ns.seq}, hidden]")
    rtol = tolerance(ns.dtype, 1, ns.rtol)
    for r in results:
        fp32 = f", {r.from_fp32:.2e} from transformers' fp32 layer" if r.from_fp32 is not None else ""
        print(f"  layer {r.index} ({r.kind}): output's largest relative difference {r.rel:.2e}{fp32}")
    failed = next((r for r in results if not layer_passes(r, ns.dtype, ns.rtol)), None)
    if failed is None:
        other = " of transformers' bf16 layer or of its fp32 one" if ns.dtype == "bf16" else ""
        nearest = max(min(r.rel, r.from_fp32 if r.from_fp32 is not None else r.rel) for r in results)
        print(f"PASS: every kind of layer within {rtol:g}{other} (largest {nearest:.2e})")
        return 0
    print(f"FAIL: layer {failed.index} ({failed.kind}) differs: {failed.rel:.2e} > {rtol:g}")
    return FAILED


# ---------------------------------------------------------------- eval


def add_eval_parser(sub) -> None:
    ev = sub.add_parser("eval", help="loss and perplexity of a model or checkpoint on a corpus's validation split")
    add_model_choice(ev)
    ev.add_argument(
        "--data",
        default="shakespeare",
        help="'shakespeare', a text, JSONL or Parquet file, a folder, a glob, or a saved Hugging Face dataset",
    )
    ev.add_argument("--layout", help="e.g. tp=2 or pp=2,microbatches=2 (default: one process)")
    ev.add_argument("--batches", type=int, default=8, help="validation batches")
    ev.add_argument("--batch-size", type=int, default=8, help="sequences per batch")
    ev.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    ev.add_argument("--timeout", type=float, default=1800.0, help="seconds before a hung run is reported")
    add_overrides(ev)
    ev.set_defaults(func=cmd_eval)


def add_data_parser(sub) -> None:
    data = sub.add_parser("data", help="training data: the token stores a run reads")
    data_sub = data.add_subparsers(dest="action", required=True)
    build = data_sub.add_parser(
        "build",
        help="tokenize every source of data.source into its token store ahead of a run (one per node; later runs "
        "and every rank reuse it); an interrupted build goes on from its finished shards",
    )
    build.add_argument("--config", help="TOML file; its [data] and model.init_from (for its tokenizer) are used")
    add_overrides(build)
    build.set_defaults(func=cmd_data_build)


def cmd_data_build(ns) -> int:
    from fivecut.train.data import load_sources, sources_of
    from fivecut.weights.load import run_tokenizer

    cfg = load_config(ns.config, ns.overrides)
    checks.refuse("invalid data options", checks.path_problems(cfg) + checks.data_problems(cfg))
    checks.check_writable("data.cache_dir", cfg.data.cache_dir)  # refused by name, as train refuses it
    tokenizer = run_tokenizer(cfg.data.tokenizer, cfg.model.init_from)
    for source, splits in zip(sources_of(cfg.data.source), load_sources(cfg.data, tokenizer)):
        print(
            f"{source}: {splits.n_tokens:,} tokens, {splits.n_docs:,} documents in {splits.cache_path} "
            f"(content {splits.content[:16]})",
            flush=True,
        )
    return 0


def add_model_choice(parser) -> None:
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--init-from", help="a model's weights: hf:FOLDER, gguf:FILE or dcp:CHECKPOINT")
    which.add_argument("--checkpoint", help="a fivecut checkpoint, or a checkpoint.dir (its newest one)")
    parser.add_argument("--step", type=int, help="with a checkpoint.dir: this step's checkpoint")


def add_generate_parser(sub) -> None:
    gen = sub.add_parser("generate", help="continue a prompt with a trained or imported model (KV cache, streamed)")
    add_model_choice(gen)
    gen.add_argument("--prompt", required=True, metavar="TEXT")
    gen.add_argument("--max-new-tokens", type=int, default=32, metavar="N")
    gen.add_argument("--temperature", type=float, default=0.8, metavar="T", help="0: greedy")
    gen.add_argument("--top-k", type=int, default=50, metavar="K", help="0: the whole vocabulary")
    gen.add_argument("--seed", type=int, default=0, metavar="S", help="the sampling generator's seed")
    gen.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N")
    gen.set_defaults(func=cmd_generate)


def cmd_generate(ns) -> int:
    from fivecut.generate import cmd_generate as run

    return run(ns)


def cmd_eval(ns) -> int:
    from fivecut.train.infer import evaluate_on_rank

    cfg, path = eval_config(ns)
    if cfg.parallel.world_size == 1 or "WORLD_SIZE" in os.environ:
        result = in_process(evaluate_on_rank, cfg, path)
    else:
        result = spawned("eval", evaluate_on_rank, cfg.parallel.world_size, cfg, path, timeout_s=ns.timeout)[0]
    print(
        f"eval: {model_label(cfg.model)}, layout {cfg.parallel.settings()}, {result['tokens']:,} tokens of "
        f"{cfg.data.source!r} (validation split): loss {result['loss']:.4f}, perplexity {result['perplexity']:.2f}"
    )
    return 0


def eval_config(ns) -> tuple[Config, str | None]:
    """The run `fivecut eval` makes: the model from --init-from or the checkpoint's config, a
    validation set of --batches x --batch-size x --seq-len tokens, the layout of --layout."""
    checks.check_eval_arguments(ns.batches, ns.batch_size, ns.seq_len, ns.timeout)
    base, path = Config(), None
    if ns.checkpoint is not None:
        from fivecut.train.checkpoint import find_checkpoint, read_meta

        path = find_checkpoint(Path(ns.checkpoint).expanduser(), ns.step)
        saved = read_meta(path)["config"]
        apply_table(base, {"model": saved["model"], "data": {"tokenizer": saved["data"]["tokenizer"]}}, str(path))
    elif ns.step is not None:
        raise ConfigError("--step chooses one of a checkpoint.dir's checkpoints; give --checkpoint too")
    else:
        base.model.init_from = ns.init_from
    base.data.source = ns.data
    run = [f"train.eval_batches={ns.batches}", f"train.global_batch={ns.batch_size}", f"train.seq_len={ns.seq_len}"]
    cfg = apply_overrides(base, run + ["train.eval_every=1", "log.progress=false"])
    cfg = with_layout(cfg, ns.layout, ns.overrides, EVAL_FLAGS, CHECKPOINT_MODEL if path else {})
    checks.resolve_microbatches(cfg)
    checks.check_eval_shape(cfg)
    checks.validate(cfg, cfg.parallel.world_size)
    checks.check_folders(cfg, out_dir=False)
    return cfg, None if path is None else str(path)


# the keys a flag of `eval` sets (a key ending in "." stands for its whole section), which --set may not set again
EVAL_FLAGS = {
    "train.eval_batches": "--batches",
    "train.global_batch": "--batch-size",
    "train.seq_len": "--seq-len",
    "data.source": "--data",
}
CHECKPOINT_MODEL = {"model.": "the model is the checkpoint's"}  # with --init-from, model.* keys must match the file


def with_layout(
    cfg: Config, layout: str | None, overrides: list[str], owned: dict, unused: dict | None = None
) -> Config:
    """`cfg` under the `--layout` text (none: as it is), then the `--set` overrides, each applied: a key
    that --layout or another flag already sets (`owned`), or that the command cannot take (`unused`),
    is refused, never replaced (see `checks.check_owned_keys`)."""
    table = dict(parse_override(item) for item in checks.layout_items(layout)) if layout is not None else {}
    checks.check_owned_keys(overrides, owned | {f"parallel.{key}": "--layout" for key in table}, unused)
    apply_table(cfg, {"parallel": table}, origin=f"--layout {layout}")
    return apply_overrides(cfg, overrides)


def apply_overrides(cfg: Config, overrides: list[str]) -> Config:
    for item in overrides:
        key, value = parse_override(item)
        apply_table(cfg, nest(key, value), origin=f"--set {item}")
    return cfg


def in_process(fn, cfg: Config, *args):
    """`fn(cfg, *args)` in this process: under torchrun as its rank, else as a world of one."""
    import torch.distributed as dist

    from fivecut.launch import init_from_environment

    init_from_environment(cfg.train.collective_timeout)
    try:
        return fn(cfg, *args)
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------- verify / ledger


# the keys a flag of `verify` and `ledger` sets, and those their runs cannot take, which --set may not set
LAYOUT_FLAGS = {"train.steps": "--steps", "model.preset": "--model"}
LAYOUT_UNUSED = {
    "log.out_dir": "the runs write to a fresh temporary folder",
    "checkpoint.": "the runs start from the seed and save no checkpoint",
}


def layout_model(model: str) -> tuple[str, str]:
    """The [model] key of `--model` (a preset, or hf:/gguf: a published model) and the tokenizer its
    runs read Shakespeare with: bytes for a vocabulary that holds them, else GPT-2's, and a published
    model's own when its file has one."""
    if model.startswith(("hf:", "gguf:", "dcp:")):
        from fivecut.weights.load import source_args, source_of

        source_args(model)  # the folder and its tensors checked here, before any rank starts
        return f"model.init_from={model!r}", "auto" if source_of(model).tokenizer() is not None else "byte"
    checks.check_preset(model, key="--model")
    args = preset_args(ModelConfig(preset=model))
    return f"model.preset={model!r}", "byte" if args.vocab_size <= 256 else "gpt2"


def layout_config(ns) -> Config:
    """A small, quiet run of `ns.model` on Shakespeare, under the layout of `ns.layout` and every --set."""
    checks.check_run_arguments(ns.steps, ns.timeout, tolerance_flags(ns))
    model_key, tokenizer = layout_model(ns.model)
    base = [
        model_key,
        f"data.tokenizer={tokenizer!r}",
        f"train.steps={ns.steps}",
        "train.seq_len=64",
        "train.global_batch=8",
        f"train.warmup={min(2, ns.steps)}",  # warmup may not outlast the run
        "train.eval_every=0",
        "log.progress=false",
        "log.plot=false",
    ]
    cfg = with_layout(
        load_config(None, [o.replace("'", '"') for o in base]), ns.layout, ns.overrides, LAYOUT_FLAGS, LAYOUT_UNUSED
    )
    checks.validate(cfg, cfg.parallel.world_size)
    checks.check_folders(cfg, out_dir=False)  # the runs write to a fresh temporary folder
    return cfg


def reference_of(cfg: Config) -> Config:
    """The single-process run `cfg` must reproduce: eager, without recomputation or EPLB copies
    (copies need ranks; none of the three changes a number)."""
    ref = copy.deepcopy(cfg)
    ref.parallel = ParallelDims()
    ref.train = dataclasses.replace(ref.train, recompute="none", recompute_every=1, compile=False)
    ref.moe = dataclasses.replace(
        ref.moe,
        eplb_slots=0,
        eplb_move=False,
        eplb_interval=MoEOptions.eplb_interval,
        eplb_window=MoEOptions.eplb_window,
    )
    return ref


def run_spawned(cfg: Config, timeout: float, measure_activations: bool = False, device: str = "auto", what="run"):
    """Tokenize once here, then run `cfg` on its own ranks (`device`: see launch.choose_backend);
    returns every rank's RunResult. `what` names the run if it fails (`spawned`)."""
    from fivecut.train.run import run_tokens

    run_tokens(cfg)
    with tempfile.TemporaryDirectory(prefix="fivecut-run-") as out:
        cfg = copy.deepcopy(cfg)
        cfg.log.out_dir = out
        return spawned(
            what,
            train_quietly,
            cfg.parallel.world_size,
            cfg,
            measure_activations,
            timeout_s=timeout,
            collective_timeout_s=min(timeout, cfg.train.collective_timeout),
            device=device,
        )


def spawned(what: str, fn, world_size: int, *args, timeout_s: float, **options) -> list:
    """`launch.spawn(fn, world_size, *args)`; a rank that raised, died or ran out of time becomes a
    `RunFailed` of one line naming `what` and the ranks, every rank's full report in a file."""
    from fivecut.launch import RankFailure, spawn

    try:
        return spawn(fn, world_size, *args, timeout_s=timeout_s, **options)
    except RankFailure as err:
        with tempfile.NamedTemporaryFile("w", prefix="fivecut-ranks-", suffix=".txt", delete=False) as report:
            report.write(f"{what}\n{err}\n")
        hint = " (raise --timeout)" if "did not finish" in err.summary else ""
        raise RunFailed(f"{what}: {err.summary}{hint}; every rank's report: {report.name}") from None


def train_quietly(cfg: Config, measure_activations: bool = False):
    from fivecut.train.trainer import train

    return train(cfg, quiet=True, measure_activations=measure_activations)


def cmd_verify(ns) -> int:
    cfg = verify_config(ns)
    backend, device = verify_device(cfg)
    layout = cfg.parallel.settings()
    tolerances = verify_tolerances(cfg.train.dtype, tolerance_flags(ns))
    print(
        f"verify: {model_label(cfg.model)}, layout {layout} vs single process, {cfg.train.steps} steps, "
        f"{precision_of_runs(cfg)} on {device} ({backend}), {execution_of_runs(cfg)}; loss, gradient norm before "
        f"clipping, validation loss at step {cfg.train.eval_every}"
    )
    print(tolerance_line(cfg.train.steps, tolerances, cfg.train.dtype))
    reference = run_spawned(reference_of(cfg), ns.timeout, device=device, what="verify, the single process")[0]
    result = run_spawned(cfg, ns.timeout, device=device, what=f"verify, layout {layout}")[0]
    diffs = print_comparison(verify_series(reference), verify_series(result))
    return verdict(diffs, tolerances)


def tolerance_flags(ns) -> dict[str, float | None]:
    """verify's tolerance flags as given (None: not given); `ledger` has none."""
    return {flag: getattr(ns, flag[2:].replace("-", "_"), None) for flag in TOLERANCE_FLAGS}


def verify_tolerances(dtype: str, flags: dict[str, float | None]) -> Tolerances:
    """The dtype's tolerances, each flag given replacing the fields it sets."""
    given = {field: value for flag, value in flags.items() if value is not None for field in TOLERANCE_FLAGS[flag][0]}
    return dataclasses.replace(TOLERANCES[dtype], **given)


def precision_of_runs(cfg: Config) -> str:
    """The dtype both runs compute in, and the layout's gradient reductions when they are not fp32."""
    reduced = ", the layout's gradients reduced in bf16" if cfg.train.reduce_dtype == "bf16" else ""
    return f"both runs {cfg.train.dtype}{reduced}"


def execution_of_runs(cfg: Config) -> str:
    """Whether the layout is compiled (`reference_of` keeps the single process eager)."""
    return "the layout compiled (train.compile), the single process eager" if cfg.train.compile else "both eager"


def rtol_text(rtol: float) -> str:
    """1e-05 as 1e-05 (one digit when that is exact), 2.5e-4 as 0.00025."""
    short = f"{rtol:.0e}"
    return short if float(short) == rtol else f"{rtol:g}"


def tolerance_line(steps: int, tolerances: Tolerances, dtype: str) -> str:
    later = f", {rtol_text(tolerances.later_grad_norm)} at steps 2-{steps}" if steps > 1 else ""
    return (
        f"tolerances ({dtype}; relative difference): loss {rtol_text(tolerances.loss)} at every step; gradient norm "
        f"{rtol_text(tolerances.first_grad_norm)} at step 1{later}; validation loss {rtol_text(tolerances.val_loss)}"
    )


def verify_config(ns) -> Config:
    """`layout_config`, plus validation on a couple of batches at the last step (unless asked otherwise)."""
    cfg = layout_config(ns)
    if not cfg.train.eval_every:
        cfg.train.eval_every = cfg.train.steps
        cfg.train.eval_batches = 2
    return cfg


def verify_device(cfg: Config) -> tuple[str, str]:
    """Both runs on one kind of device, the one the layout's ranks get (a GPU each, else the cpu):
    a CUDA reference against a CPU layout would differ by more than the order of sums."""
    import torch

    from fivecut.launch import choose_backend

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return choose_backend("auto", cfg.parallel.world_size, gpus)


def verify_series(result) -> dict[str, dict[int, float]]:
    """What verify compares, each as step -> value."""
    return {
        "loss": dict(enumerate(result.losses, start=1)),
        "grad_norm": dict(enumerate(result.grad_norms, start=1)),
        "val_loss": dict(result.val_losses),
    }


def print_comparison(reference: dict, layout: dict) -> dict[str, dict[int, float]]:
    """One row per step: each quantity of the single process and its relative difference under the
    layout (a value missing on one side counts as infinitely different); returns those differences."""
    diffs: dict[str, dict[int, float]] = {name: {} for name in reference}
    header = "".join(f" {name:>12} {'rel diff':>9}" for name in reference)
    print(f"{'step':>4}{header}")
    for step in sorted(set().union(*reference.values(), *layout.values())):
        cells = []
        for name in reference:
            a, b = reference[name].get(step), layout[name].get(step)
            if a is None and b is None:
                cells.append(f" {'':>12} {'':>9}")
                continue
            rel = abs(a - b) / abs(a) if a is not None and b is not None else float("inf")
            diffs[name][step] = rel
            cells.append(f" {a if a is not None else float('nan'):>12.7f} {rel:>9.2e}")
        print(f"{step:>4}{''.join(cells)}")
    return diffs


def verdict(diffs: dict[str, dict[int, float]], tolerances: Tolerances) -> int:
    """The PASS/FAIL line: the largest relative difference of each quantity (`worst_differences`);
    FAIL names each step over its tolerance."""
    over = [
        f"{name} at step {step} {rel:.3e} > {tolerances.at(name, step):g}"
        for name, by_step in diffs.items()
        for step, rel in by_step.items()
        if not rel <= tolerances.at(name, step)
    ]
    summary = " ".join(f"max_rel_{label}_diff={value:.3e}" for label, value in worst_differences(diffs).items())
    if over:
        print(f"FAIL {summary} (exceeded: {'; '.join(over)})")
        return FAILED
    print(f"PASS {summary}")
    return 0


def worst_differences(diffs: dict[str, dict[int, float]]) -> dict[str, float]:
    """The largest relative difference of each quantity, the gradient norm's of step 1 (`grad_norm`)
    and of later steps (`later_grad_norm`) apart, as their tolerances differ."""
    worst: dict[str, float] = {}
    for name, by_step in diffs.items():
        for step, rel in by_step.items():
            label = "later_grad_norm" if name == "grad_norm" and step > 1 else name
            worst[label] = max(worst.get(label, 0.0), rel)
    return worst


def print_memory(measured: dict[str, int], cfg: Config) -> None:
    from fivecut.plan.volume import frozen_bytes, local_param_counts, shard_group_sizes
    from fivecut.train.memory import format_bytes

    dims, args = cfg.parallel, checks.resolved_args(cfg.model)
    counts = local_param_counts(args, cfg)  # {reduce group: Psi}, the trained parameters
    sizes = shard_group_sizes(cfg)  # hybrid sharding: model states cut over zero_shard ranks
    parts = [model_state_bytes(psi, dims.zero, sizes[name]) for name, psi in counts.items()]
    predicted = {key: sum(part[key] for part in parts) for key in parts[0]}
    frozen = frozen_bytes(args, cfg)  # [lora]: the frozen weights, in their dtype
    predicted["params"] += frozen
    predicted["total"] += frozen
    groups = ", ".join(f"{name}: n={sizes[name]}, Psi={psi:,}" for name, psi in counts.items())
    groups += f"; frozen weights {frozen:,} B" if cfg.lora.rank is not None else ""
    print(
        f"\nmodel-state memory per rank (ZeRO-{dims.zero}: {formula(dims.zero)} per gradient group; {groups} on "
        f"this rank)"
    )
    print(f"{'':<10} {'measured':>12} {'predicted':>12} {'measured B':>16} {'predicted B':>16}")
    for key in ("params", "grads", "optimizer", "total"):
        print(
            f"{key:<10} {format_bytes(measured[key]):>12} {format_bytes(predicted[key]):>12} "
            f"{measured[key]:>16,} {predicted[key]:>16,.0f}"
        )
    print(f"memory_ratio={measured['total'] / predicted['total']:.3f}")


def print_buffers(measured: int, cfg: Config) -> None:
    """The data cut's buffers at their peak (gathered units, reduction copies), against the plan's."""
    from fivecut.plan.buffers import buffer_bytes
    from fivecut.train.memory import format_bytes

    predicted = buffer_bytes(checks.resolved_args(cfg.model), cfg)
    ratio = f"{measured / predicted:.3f}" if predicted else ("1.000" if not measured else "inf")
    print(f"data-cut buffers at their peak: measured {format_bytes(measured)}, predicted {format_bytes(predicted)}")
    print(f"buffers_ratio={ratio}")


def print_activations(measured: dict[str, int], cfg: Config, moe_rows: tuple[int, int] | None = None) -> None:
    """Bytes a layer keeps for backward (step 1, first micro-step), measured vs the formula."""
    from fivecut.train.memory import format_bytes

    args, dims, t = checks.resolved_args(cfg.model), cfg.parallel, cfg.train
    rows = t.global_batch // (dims.dp * t.accumulate * (dims.microbatches if dims.pp > 1 else 1))  # one (micro)batch
    seq = t.seq_len // dims.cp  # this rank's chunk of each sequence
    layer = max(measured, key=int)  # a stage's first layer also holds what all its layers share (RoPE tables)
    if dims.pp > 1 and layer in first_layers_of_stages(args, cfg):
        print(
            f"\nactivations: rank 0 holds only its stages' first layers ({layer}); they also keep what the stage shares"
        )
        return
    last, moe = measured[layer], args.moe_layer(int(layer))
    mode = layer_mode(int(layer), t.recompute, t.recompute_every)  # full: the block keeps its input, whatever is in it
    if (
        moe
        and mode != "full"
        and (moe_rows is None or cfg.moe.capacity_factor is not None or cfg.moe.aux_loss_coef > 0)
    ):
        print(
            f"\nactivations saved for backward by layer {layer} (MoE, b={rows}, s={t.seq_len}): {format_bytes(last)} "
            f"({last:,} B); the closed form covers dropless MoE layers without the auxiliary loss"
        )
        return
    precision = precision_of(t.dtype, dims.zero)
    predicted = activation_bytes_per_layer(
        args,
        rows,
        seq,
        dims.tp,
        dims.sp,
        precision,
        moe_rows=moe_rows if moe else None,
        cp=dims.cp,
        recompute=mode,
        cp_mode=dims.cp_mode,
        cp_ulysses=dims.cp_ulysses,
        etp=dims.etp,
        ep=dims.ep,
        eplb_slots=cfg.moe.eplb_slots,
        documents=cfg.data.document_mask,
        layer=int(layer),
    )
    if args.rope_local_theta and first_of_its_rope(args, cfg, int(layer)):  # Gemma 3: the stage's other tables
        predicted += 2 * 4 * seq * args.rope_dim  # cos and sin [s, rope_dim], fp32
    if moe:
        print(f"\nMoE block: this rank sent {moe_rows[0]:,} rows and received {moe_rows[1]:,} in its first forward")
    print(
        f"\nactivations saved for backward by layer {layer} (b={rows}, s={seq}, tp={dims.tp}, sp={dims.sp}, "
        f"cp={dims.cp}{cp_label(dims)}, recompute={mode}):"
    )
    print(f"measured {format_bytes(last)} ({last:,} B), predicted {format_bytes(predicted)} ({predicted:,.0f} B)")
    if dims.tp > 1:
        without, single = (
            activation_bytes_per_layer(
                args, rows, seq, dims.tp, sp, precision, cp=dims.cp, cp_mode=dims.cp_mode, cp_ulysses=dims.cp_ulysses
            )
            for sp in (False, True)
        )
        print(
            f"at tp={dims.tp} the formula gives {format_bytes(without)} without SP, {format_bytes(single)} with SP: "
            f"SP cuts activations by {without / single:.3f}x"
        )
    print(f"activation_ratio={last / predicted:.3f}")


def print_loss_peak(every_rank: list, cfg: Config) -> None:
    """The head and cross-entropy's peak (step 1, first (micro)batch) on the rank that holds the
    head, measured vs `loss_peak_bytes`."""
    from fivecut.train.memory import format_bytes

    rank, measured = next((r, result.loss_peak) for r, result in enumerate(every_rank) if result.loss_peak is not None)
    args, dims, t = checks.resolved_args(cfg.model), cfg.parallel, cfg.train
    rows = t.global_batch // (dims.dp * t.accumulate * (dims.microbatches if dims.pp > 1 else 1))  # one (micro)batch
    tokens = rows * t.seq_len // dims.cp
    chunk = t.loss_chunk_tokens
    predicted = loss_peak_bytes(args, tokens, dims.tp, precision_of(t.dtype, dims.zero), chunk, sp=dims.sp)
    path = f"chunks of {chunk} tokens" if chunk else "full logits"
    print(f"\nloss peak on rank {rank} (head and cross-entropy, {path}, {tokens} tokens, tp={dims.tp}, {t.dtype}):")
    both = (
        f"measured {format_bytes(measured)} ({measured:,} B), predicted {format_bytes(predicted)} ({predicted:,.0f} B)"
    )
    print(f"loss peak: {both}")
    print(f"loss_ratio={measured / predicted:.3f}")


def cp_label(dims) -> str:
    if dims.cp == 1 or dims.cp_mode == "ulysses":
        return ""
    return ", ring" if dims.cp_mode == "ring" else f", usp U={dims.cp_ulysses}"


def first_forward_rows(result) -> tuple[int, int] | None:
    """(sent, received) rows of the dispatch of the layer `print_activations` compares (the
    highest on rank 0) in step 1's first forward (MoE models)."""
    if not result.moe or not result.activations:
        return None
    rows = result.moe[0]["local"].get(max(int(layer) for layer in result.activations))
    return tuple(rows["first_forward_rows"]) if rows and rows["first_forward_rows"] else None


def first_layers_of_stages(args, cfg) -> set[str]:
    from fivecut.plan.volume import pipeline_plan

    _, layers = pipeline_plan(args, cfg)
    return {str(stage_layers[0]) for stage_layers in layers if len(stage_layers)}


def first_of_its_rope(args, cfg, layer: int) -> bool:
    """Whether block `layer` is the first of its stage to turn by its RoPE tables (Gemma 3's sliding
    layers have their own): it then keeps them, as a stage's first block keeps what the stage shares."""
    from fivecut.plan.volume import pipeline_plan

    stages = pipeline_plan(args, cfg)[1] if cfg.parallel.pp > 1 else [range(args.n_layers)]
    stage = next(s for s in stages if layer in s)
    return all(args.layer_local_rope(i) != args.layer_local_rope(layer) for i in stage if i < layer)


def cmd_ledger(ns) -> int:
    from fivecut.plan.volume import predict

    cfg = layout_config(ns)
    layout = cfg.parallel.settings()
    every_rank = run_spawned(cfg, ns.timeout, measure_activations=True, what=f"ledger, layout {layout}")
    mine = every_rank[0]
    print(f"ledger: {model_label(cfg.model)}, layout {layout}, step {cfg.train.steps}, rank 0")
    print(format_rows(mine.ledger_rows))
    print()
    print_memory(mine.memory, cfg)
    print_buffers(mine.buffers, cfg)
    print_activations(mine.activations, cfg, first_forward_rows(mine))
    print_loss_peak(every_rank, cfg)
    predicted = predict(checks.resolved_args(cfg.model), cfg, mine.moe[-1]["local"] if mine.moe else None)
    measured_total = predicted_total = 0.0
    print(f"\n{'cut':<8} {'measured':>16} {'predicted':>16} {'ratio':>7}   formula")
    for cut, (volume, closed_form) in predicted.items():
        measured = sum(r.wire_bytes for r in mine.ledger_rows if r.cut == cut)
        measured_total += measured
        predicted_total += volume
        print(
            f"{cut:<8} {measured:>16,.0f} {volume:>16,.0f} "
            f"{measured / volume if volume else float('nan'):>7.3f}   {closed_form}"
        )
    unpredicted = {r.cut for r in mine.ledger_rows} - set(predicted)
    if unpredicted:
        print(f"no closed form for: {', '.join(sorted(unpredicted))}")
    print(f"ratio={measured_total / predicted_total:.3f}" if predicted_total else "ratio=nan (nothing predicted)")
    return 0


# ---------------------------------------------------------------- plan


def cmd_plan(ns) -> int:
    if ns.cluster is None:
        raise ConfigError("fivecut plan needs --cluster (e.g. --cluster 32x8xH100, or a cluster TOML file)")
    check_plan_flags(ns)
    cluster = parse_cluster(ns.cluster)
    if ns.check and ns.layout is None:
        raise ConfigError("--check runs one layout's step: give --layout (e.g. --layout dp=8,zero=3)")
    if ns.layout is None:
        return plan_search(ns, cluster)
    from fivecut.plan.cost import cost_layout

    cfg, args = plan_config(ns, cluster.world_size)
    if cfg.parallel.world_size != cluster.world_size:
        raise ConfigError(
            f"--layout {ns.layout} uses {cfg.parallel.world_size} ranks but --cluster {ns.cluster} has "
            f"{cluster.world_size} GPUs; change dp (or another cut) so that the product is {cluster.world_size}"
        )
    if ns.check:
        check_checkable(cfg)
    cost = cost_layout(args, cfg, cluster)
    print_plan(cost, cfg, cluster)
    written = write_plan(ns.out, [(cfg, cost)], cluster, plan_header(ns, cfg, cluster))
    print(f"\nwrote {', '.join(written)}")
    if ns.check:
        print_check(args, cfg, cluster, cost)
    return 0 if cost.fits else NOTHING_FITS  # the layout's plan, said and written, is an answer: it does not fit


def check_checkable(cfg: Config) -> None:
    """What `plan --check` cannot run, refused before the plan: the compiled step (the check runs
    eager: Dynamo's graphs on fake tensors are not the step's memory)."""
    if cfg.train.compile:
        raise ConfigError("--check runs the eager step; drop train.compile=true (the plan models the eager step)")


def print_check(args, cfg: Config, cluster, cost) -> None:
    """`fivecut plan --check`: one step of the layout on fake tensors beside the plan."""
    from fivecut.train.memory_check import step_memory

    kernels = kernels_of(cluster)
    started = time.perf_counter()
    check = step_memory(args, cfg, cost.memory_rank, kernels=kernels)
    print(
        f"\ncheck: one step on fake {check.device.upper()} tensors as rank {check.rank} (pipeline position "
        f"{cost.memory_rank}), {kernels.upper()} kernels' saved tensors, counted by torch's MemTracker "
        f"({time.perf_counter() - started:.1f} s):"
    )
    print("\n".join(check_lines(cost.memory, check)))


def plan_search(ns, cluster) -> int:
    from fivecut.plan.search import search, why

    cfg, args = plan_config(ns, cluster.world_size)
    shown = PLAN_TOP if ns.top is None else ns.top
    result = search(args, cfg, cluster, shown)
    head = plan_header(ns, cfg, cluster)
    print(f"search: {ns.model}, seq {cfg.train.seq_len}, global batch {cfg.train.global_batch} sequences, "
          f"{cfg.train.dtype}; {cluster.describe()}")  # fmt: skip
    print(f"{result.tried} layouts costed, {result.too_big} too big, {result.invalid} refused by the layout checks")
    if not result.ranked:
        print(f"no layout fits in {cluster.device.memory_gb:g} GB{least_memory(result)}")
        print(grown_line(ns, args, cluster))
        return NOTHING_FITS
    top = result.ranked[:shown]
    print_ranking(top, cluster)
    print("\n" + why(result.ranked[0], result.ranked[1:]))
    print("\nthe best layout in full:")
    print_plan(top[0].cost, top[0].cfg, cluster)
    written = write_plan(ns.out, [(c.cfg, c.cost) for c in top], cluster, head | {"rules": result.rules})
    print(f"\nwrote {', '.join(written)}")
    return 0


def least_memory(result) -> str:
    """What the layout needing least memory would need a device, and its largest term (or, where
    every layout's model states alone were too big, the least of those)."""
    smallest, states = result.smallest, result.least_states
    if smallest is None and states is None:
        return " (the layout checks refused every layout of this world)"
    if smallest is None:
        return (
            f"; the one needing least, {states.cfg.parallel.settings()}, needs more than {states.states / 1e9:.1f} GB "
            "a device for its model states alone (parameters, gradients, optimizer state)"
        )
    m = smallest.cost.memory
    largest = max((k for k in m if k != "total"), key=m.get)
    return (
        f"; the one needing least, {smallest.layout} with recompute {smallest.recompute}, needs "
        f"{m['total'] / 1e9:.1f} GB, most of it {largest} ({m[largest] / 1e9:.1f} GB)"
    )


def grown_line(ns, args, cluster) -> str:
    """On how many devices of this kind the model would fit: the planner's search of larger clusters
    of the same nodes (`grown_cluster`), and how to plan there."""
    from fivecut.plan.search import MOST_DEVICES, STATE_BYTES, grown_cluster

    grown = grown_cluster(args, cluster, lambda world: plan_config(ns, world)[0])
    nodes = f"nodes of {cluster.gpus_per_node} {cluster.device.name}"
    if grown is None:
        return (
            f"nor on any cluster of 2, 4, 8, ... times its {nodes} up to {MOST_DEVICES:,} devices with this global "
            f"batch; give a larger --global-batch (the data and pipeline cuts of more devices need more sequences)"
        )
    c, fit = grown.cluster, grown.fitting
    preset = SPELLING.match(ns.cluster.strip()) is not None
    where = f"--cluster {c.nodes}x{c.gpus_per_node}x{c.device.name}" if preset else f"nodes = {c.nodes} in {ns.cluster}"
    fewer = f"; on {', '.join(map(str, grown.searched[:-1]))} nodes none fits" if len(grown.searched) > 1 else ""
    return (
        f"it fits on {c.world_size:,} devices ({c.nodes:,} {nodes}; the first of 2, 4, 8, ... times the cluster's "
        f"nodes on which a layout fits: fewer than {grown.least_devices:,} devices cannot hold the model states, "
        f"{STATE_BYTES} bytes a parameter{fewer}): {fit.layout} with recompute {fit.recompute} needs "
        f"{fit.cost.memory['total'] / 1e9:.1f} GB a device; plan it with {where}"
    )


def print_ranking(top, cluster) -> None:
    from fivecut.plan.search import time_terms
    from fivecut.train.memory import format_bytes

    print(f"\n{'#':>2} {'layout':<58} {'recompute':<9} {'memory':>10} {'step':>10} {'MFU':>6}   time by term")
    for i, c in enumerate(top, 1):
        terms = ", ".join(f"{k} {v * 1e3:.0f}" for k, v in time_terms(c.cost).items() if v > 0)
        print(
            f"{i:>2} {c.layout:<58} {c.recompute:<9} {format_bytes(c.cost.memory['total']):>10} "
            f"{c.cost.step * 1e3:>8.1f}ms {c.cost.mfu:>6.1%}   {terms} (ms)"
        )


def plan_header(ns, cfg: Config, cluster) -> dict:
    t = cfg.train
    return {
        "written_by": "fivecut plan",
        "model": ns.model,
        "seq_len": t.seq_len,
        "global_batch": t.global_batch,
        "dtype": t.dtype,
        "cluster": cluster_toml(cluster, "the cluster planned for"),
    }


def write_plan(folder: str, costed: list, cluster, head: dict) -> list[str]:
    """plan.json (every costed layout's memory and time terms) and plan.png (their stacked bars)."""
    from fivecut.plan.report import plan_record, plot_plan

    out = Path(folder)
    check_plan_folder(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "plan.json").write_text(json.dumps(head | {"layouts": [plan_record(c, k) for c, k in costed]}, indent=1))
    plot_plan(costed, cluster, out / "plan.png")
    return [str(out / "plan.json"), str(out / "plan.png")]


PLAN_COUNTS = {"top": "layouts to print and plot", "seq": "tokens a sequence", "global_batch": "sequences a step"}


def check_plan_flags(ns) -> None:
    """The plan's numbers and its folder, before a model is read or a layout searched."""
    for dest, meaning in PLAN_COUNTS.items():
        value = getattr(ns, dest)
        if value is not None and value < 1:
            raise ConfigError(f"--{dest.replace('_', '-')} {value}: give the {meaning}, a whole number >= 1")
    if ns.global_batch_tokens is not None:
        token_count(ns.global_batch_tokens)
    if ns.top is not None and ns.layout is not None:
        raise ConfigError(
            f"--top {ns.top} ranks a search's layouts, but --layout {ns.layout} costs that one layout; "
            "drop --top, or drop --layout to search"
        )
    check_plan_folder(Path(ns.out))


def check_plan_folder(out: Path) -> None:
    """--out: a folder that exists or can be made, and written; it may hold an earlier plan
    (replaced) but nothing else of the same names."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file; give a folder for plan.json and plan.png")
    existing = next(p for p in (out, *out.parents) if p.exists())
    if not existing.is_dir():
        raise ConfigError(f"--out {out}: {existing} is a file, not a folder; give a folder path for the plan")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"--out {out}: the folder {existing} cannot be written; give a folder you can write")
    old = out / "plan.json"
    if old.exists():
        try:
            mine = json.loads(old.read_text()).get("written_by") == "fivecut plan"
        except (OSError, ValueError, AttributeError):
            mine = False
        if not mine:
            raise ConfigError(f"{old} exists and is not a plan fivecut wrote; give another --out folder")


def plan_config(ns, world: int | None = None) -> tuple[Config, object]:
    """The run `ns` describes, for planning: any model, the sequence, the batch, the dtype; `world`:
    the cluster's GPUs (default: the layout's ranks)."""
    cfg = load_config(None, ["train.warmup=0", f"train.dtype={ns.dtype!r}".replace("'", '"')])
    cfg.model = plan_model(ns.model)
    args = checks.resolved_args(cfg.model)
    cfg.train.seq_len = ns.seq if ns.seq is not None else args.max_seq_len
    cfg = with_layout(cfg, ns.layout, ns.overrides, {})
    args = checks.checked_model_args(cfg)
    if ns.layout is not None:  # the default batch divides by tp: its sizes first
        checks.refuse(f"invalid layout {ns.layout}", cfg.parallel.problems(), LayoutError)
    cfg.train.global_batch = plan_batch(ns, cfg, world or cfg.parallel.world_size)
    checks.resolve_microbatches(cfg)
    checks.refuse("invalid options", checks.option_problems(cfg))
    if ns.layout is not None:
        t = cfg.train
        checks.validate_layout(cfg.parallel, args, t.seq_len, t.global_batch, t.accumulate, cfg.parallel.world_size)
    return cfg, args


def plan_model(model: str):
    """--model: a preset's name, a config TOML (its [model] section) or a Hugging Face config.json."""
    if model in PRESETS:
        return load_config(None, [f'model.preset="{model}"']).model
    path = Path(model)
    if path.suffix == ".toml" and path.is_file():
        section = load_config(path).model
        if section.init_from is not None:
            raise ConfigError(f"--model {model}: model.init_from needs the weights; give the shape's keys instead")
        return section
    if path.name == "config.json" or (path.is_dir() and (path / "config.json").is_file()):
        return hf_model_section(path if path.name == "config.json" else path / "config.json")
    raise ConfigError(
        f"--model {model!r} is not a model preset, a config TOML or a Hugging Face config.json; presets: "
        f"{', '.join(PRESETS)}"
    )


def hf_model_section(path: Path):
    from fivecut.weights.hf import args_from_config, read_json

    args = args_from_config(read_json(path), path)
    section = load_config(None, []).model
    unused = (MOE_ONLY if not args.is_moe else ()) + (MLA_ONLY + ("kv_lora_rank",) if not args.is_mla else ())
    for f in dataclasses.fields(section):
        if hasattr(args, f.name) and f.name not in unused:
            setattr(section, f.name, getattr(args, f.name))
    return section


def plan_batch(ns, cfg: Config, world: int) -> int:
    """Sequences per optimizer step: --global-batch, or --global-batch-tokens over the sequence."""
    seq = cfg.train.seq_len
    if ns.global_batch is not None:
        return ns.global_batch
    if ns.global_batch_tokens is None:
        return world // cfg.parallel.tp if ns.layout is not None else world
    tokens = token_count(ns.global_batch_tokens)
    if tokens % seq:
        raise ConfigError(
            f"--global-batch-tokens {ns.global_batch_tokens} = {tokens:,} tokens is not a whole number of sequences of "
            f"{seq}; give a multiple of {seq} (e.g. {max(tokens // seq, 1) * seq:,})"
        )
    return tokens // seq


def token_count(text: str) -> int:
    """4M -> 4 x 2^20, 512K -> 512 x 2^10, 1000 -> 1000."""
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:].upper(), 1)
    digits = text[:-1] if scale > 1 else text
    try:
        value = float(digits) * scale
    except ValueError:
        raise ConfigError(f"--global-batch-tokens {text!r} is not a token count; write e.g. 4M or 512K") from None
    if not math.isfinite(value):
        raise ConfigError(f"--global-batch-tokens {text!r} is not a finite number; write a token count, e.g. 4M")
    if value < 1 or value != int(value):
        raise ConfigError(f"--global-batch-tokens {text!r} must be a whole number of tokens >= 1")
    return int(value)


def print_plan(cost, cfg: Config, cluster) -> None:
    from fivecut.plan.report import hiding_bandwidth
    from fivecut.train.memory import format_bytes

    t = cfg.train
    print(f"plan: {cfg.model.preset}, layout {cfg.parallel.settings()}, seq {t.seq_len}, global batch "
          f"{t.global_batch} sequences, {t.dtype}")  # fmt: skip
    print(cluster.describe())
    m = cost.memory
    print(f"\nmemory per rank (pipeline position {cost.memory_rank}, the fullest), at each moment of the step:")
    print("\n".join(moment_lines(m)))
    verdict = (
        "fits" if cost.fits else f"does NOT fit; the largest term is {max(m, key=lambda k: m[k] * (k != 'total'))}"
    )
    print(f"  device       {cluster.device.memory_gb:>9g} GB: {verdict}")
    print(staging_line(cost, cfg))
    print(f"\n{'cut':<6} {'wire bytes/step':>16} {'link':>6} {'time':>10} {'exposed':>10}   overlap")
    for c in cost.cuts:
        times = f"{c.seconds * 1e3:>8.2f}ms {c.exposed * 1e3:>8.2f}ms"
        print(f"{c.cut:<6} {c.wire_bytes:>16,.0f} {c.link:>6} {times}   {c.rule}")
    pipeline = f"pipeline makespan {cost.makespan * 1e3:.2f} ms (bubble {cost.bubble:.3f})"
    print(f"\ncompute {cost.compute * 1e3:.2f} ms, {pipeline}")
    terms = ", ".join(f"{name} {seconds * 1e3:.2f}" for name, seconds in cost.compute_terms.items() if seconds > 0)
    print(f"  compute by term (ms): {terms}")
    tail = "tail after backward (clipping, AdamW, weight casts, the step's small all-reduces)"
    print(f"{tail} {cost.optimizer * 1e3:.2f} ms")
    needed = hiding_bandwidth(cost)
    traffic = ", ".join(
        f"{link} {format_bytes(b)} (hidden behind the compute at {needed[link]:.3g} GB/s, the link has "
        f"{(cluster.intra if link == 'intra' else cluster.inter).bandwidth_gbps:.3g})"
        for link, b in sorted(cost.traffic.items())
    )
    print(f"traffic per rank per step: {traffic or 'none'}")
    print(f"step {cost.step * 1e3:.2f} ms, {cost.tokens_per_s:,.0f} tokens/s, MFU {cost.mfu:.1%}")


def staging_line(cost, cfg: Config) -> str:
    """The host memory a background save holds a rank (`fivecut.plan.cost.staging_bytes`)."""
    mode = cfg.checkpoint.async_mode
    if mode == "off":
        return '  host memory  none for checkpoints (checkpoint.async_mode = "off": a save blocks the step)'
    kind = "shared memory for the writer process" if mode == "process" else "host memory"
    return (
        f"  host memory  {gib(cost.staging)} per rank staged by a background save (checkpoint.async_mode = "
        f'"{mode}"): its share of the checkpoint in {kind}, pinned beside a GPU, kept between saves'
    )


def cmd_plan_calibrate(ns) -> int:
    if ns.ranks < 1:
        raise ConfigError(f"--ranks {ns.ranks}: give at least 1 rank")
    checks.check_new_file("--out", ns.out, ".toml")
    if Path(ns.out).exists() and not ns.force:
        raise ConfigError(f"--out {ns.out} exists; give another file name, or --force to replace it")
    from fivecut.plan.calibrate import CalibrationError, calibrate, rank_room

    room, machine = rank_room(ns.device)
    if ns.ranks > room:
        raise ConfigError(f"--ranks {ns.ranks}: this machine has {machine}; give --ranks {room} or fewer")
    if ns.seq is not None and ns.seq < 1:
        raise ConfigError(f"--seq {ns.seq}: give a sequence length >= 1")
    model = checks.resolved_args(plan_model(ns.model)) if ns.model is not None else None
    try:
        cluster, raw = calibrate(ns.ranks, device=ns.device, model=model, seq=ns.seq)
    except CalibrationError as err:
        raise ConfigError(str(err)) from None
    Path(ns.out).write_text(cluster_toml(cluster, f"written by fivecut plan calibrate --ranks {ns.ranks}"))
    rates = ", ".join(f"{f / 1e9:.1f}" for f in raw["flops"])
    print(f"matmul GFLOP/s per rank: {rates} (the slowest is the device's)")
    times = ", ".join(f"{size:,} B {t * 1e6:.0f} us" for size, t in raw["all_reduce_s"].items())
    print(f"all-reduce over {ns.ranks} ranks: {times}")
    print(cluster.describe())
    print(f"wrote {ns.out}")
    return 0


# ---------------------------------------------------------------- schedule


def cmd_schedule(ns) -> int:
    from fivecut.parallel.pipeline.draw import draw

    given = {"f": ns.cost_f, "b": ns.cost_b, "w": ns.cost_w, "comm": ns.cost_comm}
    sch = checks.check_schedule_command(ns.schedule, ns.pp, ns.microbatches, ns.virtual, given)
    if ns.out is not None:
        checks.check_new_file("--out", ns.out, ".png")
    tl = simulate(sch, ns.cost_f, ns.cost_b, ns.cost_w, ns.cost_comm)
    costs = ", ".join(f"{k}={v:g}" for k, v in tl.costs.items() if k != "W" or sch.split_backward)
    print(f"schedule: {sch.name}, pp={sch.pp}, {sch.n_stages} stages, {sch.microbatches} microbatches, {costs}")
    print("\nactions per rank (F/B/W stage.microbatch; sF/rF send/receive activations, sB/rB gradients):")
    for rank, actions in enumerate(sch.actions):
        print(f"rank {rank} (stages {', '.join(map(str, sch.stages_of(rank)))}): {' '.join(map(str, actions))}")
    print("\ntimeline (one cell per time unit, '.' idle, ' marks a rank's later stage):")
    print(text(tl))
    print(f"\npeak in flight (microbatch-stages holding activations): {peak_in_flight(sch)}")
    print(f"idle per rank: {', '.join(f'{tl.idle_fraction(r):.4f}' for r in range(sch.pp))}; makespan {tl.makespan:g}")
    closed = closed_form_bubble(sch.name, sch.pp, sch.microbatches, sch.n_stages // sch.pp, tl.costs)
    if closed:
        print(f"closed form {closed[0]} = {closed[1]:.4f}")
    if ns.out:
        draw(
            tl,
            ns.out,
            f"{sch.name}, pp={sch.pp}, m={sch.microbatches}" + (f", v={ns.virtual}" if ns.virtual > 1 else ""),
        )
        print(f"wrote {ns.out}")
    print(f"bubble={tl.bubble:.4f}")
    return 0


def closed_form_bubble(name: str, pp: int, m: int, virtual: int, costs: dict[str, float]) -> tuple[str, float] | None:
    """The bubble fraction in closed form, where one holds for these costs (none with communication latency)."""
    if costs["comm"]:
        return None
    if name in ("gpipe", "1f1b"):
        return "(P-1)/(M+P-1)", (pp - 1) / (m + pp - 1)
    if name == "interleaved":
        return "(P-1)/(V*M+P-1)", (pp - 1) / (virtual * m + pp - 1)
    if costs["F"] == costs["B"] == costs["W"] and name == "zb1p" and m >= pp:
        return "ZB-H1 (P-1)(F+B-W) idle per rank, F=B=W: (P-1)/(3M+P-1)", (pp - 1) / (3 * m + pp - 1)
    if costs["F"] == costs["B"] == costs["W"] and name == "dualpipev":
        return "DualPipeV, F=B=W, only the last rank's first wait: (P-1)/(6M+P-1)", (pp - 1) / (6 * m + pp - 1)
    return None


if __name__ == "__main__":
    sys.exit(main())
