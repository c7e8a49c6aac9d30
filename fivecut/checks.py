"""Every check of a run, made before any process starts: options, model, layout, batch, MoE, folders.

Each record checks its own fields where it is defined (`ModelArgs.check`, `ParallelDims.problems`,
`MoEOptions.problems`); this file composes those with the checks that cross records (a layout
against a model, a batch, a world). It sits above training and weights and below the CLI, the
entry points that call it before `init_process_group` or a spawn (DESIGN.md, principle 11).
The CLI imports it at its top, so it imports no torch when loaded: the two modules it needs
that do (`weights.load` for a model's shape from `model.init_from`, `parallel.pipeline.split`)
are imported inside the functions that use them. Each refusal names the key and a fix:
`ConfigError` for options and inputs, `LayoutError` for a layout that cannot work (with the numbers).

    args = validate(cfg, world_size)       # options, model, layout, MoE; returns the ModelArgs
    check_folders(cfg, out_dir=True)       # cache_dir and out_dir writable, out_dir holds no earlier run
"""

from __future__ import annotations

import functools
import math
import os
import shutil
import tempfile
from fractions import Fraction
from pathlib import Path

import numpy as np

from fivecut.config import (
    ADAMW_KERNELS,
    Config,
    ConfigError,
    ModelConfig,
    model_label,
    nest,
    parse_override,
    preset_args,
)
from fivecut.data.chat import FORMATS
from fivecut.data.mixture import Mixture, normalised, weight_problem
from fivecut.data.sampler import ORDERS
from fivecut.data.sources import DataError, resolve_source
from fivecut.layout import COUNTS, MESH_DIMS, MoEOptions, ParallelDims
from fivecut.model.args import MLA_ONLY, MOE_ONLY, ModelArgs, divisors
from fivecut.model.presets import PRESETS, SHAPE_ONLY, runnable_presets
from fivecut.parallel.pipeline.schedule import NAMES as PP_SCHEDULES
from fivecut.parallel.pipeline.schedule import build_schedule, check
from fivecut.train.resume import flat
from fivecut.train.tokenizer import AUTO_TOKENIZER, TOKENIZERS

DTYPES = ("fp32", "bf16")
NONFINITE_POLICIES = ("stop", "skip")  # train.on_nonfinite
SAVE_ERROR_POLICIES = ("stop", "continue")  # checkpoint.on_error
ASYNC_MODES = ("off", "thread", "process")  # checkpoint.async_mode
RECOMPUTE_MODES = ("none", "full", "selective")  # train.recompute (fivecut.parallel.recompute)
RUN_FILES = ("metrics.jsonl", "config.json", "loss.png")  # what a training run leaves in log.out_dir


class LayoutError(ValueError):
    """A layout that cannot work; the message gives the numbers and a fix."""


def refuse(title: str, problems: list[str], kind: type[ValueError] = ConfigError) -> None:
    """Raise `kind` listing `problems` under `title`: one line for one problem, else one line each."""
    if len(problems) == 1:
        raise kind(f"{title}: {problems[0]}")
    if problems:
        raise kind(title + ":\n  - " + "\n  - ".join(problems))


# ---------------------------------------------------------------- the whole run


def validate(cfg: Config, world_size: int | None = None) -> ModelArgs:
    """Everything that can be refused before a process group exists; returns the ModelArgs."""
    if cfg.model.preset is not None:
        check_preset(cfg.model.preset)
    refuse("invalid options", option_problems(cfg))
    args = checked_model_args(cfg)
    resolve_microbatches(cfg)
    t = cfg.train
    validate_layout(cfg.parallel, args, t.seq_len, t.global_batch, t.accumulate, world_size)
    refuse("invalid [moe] options", moe_problems(cfg.moe, args, cfg.parallel))
    refuse("invalid [lora] options", lora_problems(cfg, args))
    return args


def quantize_problems(quantize: str | None) -> list[str]:
    """lora.quantize: "nf4" (QLoRA) with torchao importable, or unset."""
    if quantize is None:
        return []
    if quantize != "nf4":
        return [f'lora.quantize={quantize!r}; use "nf4" (QLoRA) or leave it unset']
    try:
        import torchao  # noqa: F401  (QLoRA's NF4Tensor)
    except ImportError:
        return ["lora.quantize='nf4' needs torchao: pip install --no-deps torchao==0.18.0 (--no-deps keeps torch)"]
    return []


def lora_problems(cfg: Config, args: ModelArgs) -> list[str]:
    """`[lora]`: its numbers, its targets against the model, and the layout it can run on."""
    lo, dims = cfg.lora, cfg.parallel
    if cfg.model.init_from is not None:
        from fivecut.weights.load import adapter_problem  # opens the file with torch

        problem = adapter_problem(cfg.model.init_from, lo)
        if problem is not None:
            return [problem]
    if lo.rank is None:
        given = [k for k in ("adapter", "quantize") if getattr(lo, k) is not None]
        return [f"lora.{given[0]} is set but lora.rank is not; set lora.rank"] if given else []
    problems = not_finite("lora", lo, ("alpha", "dropout"))
    if lo.rank < 1:
        problems.append(f"lora.rank={lo.rank} must be >= 1 (unset it to train every weight)")
    if lo.alpha <= 0:
        problems.append(f"lora.alpha={lo.alpha} must be > 0 (the update is scaled by alpha / rank)")
    if not 0 <= lo.dropout < 1:
        problems.append(f"lora.dropout={lo.dropout} must be in [0, 1)")
    problems += quantize_problems(lo.quantize)
    gpt_oss = [name for name in ("attention_sinks", "wo_bias", "moe_bias", "swiglu_limit") if getattr(args, name)]
    if gpt_oss:  # their adapters would meet a bias kept once under tp/etp and experts LoRA does not carry
        problems.append(
            f"[lora] on a model with GPT-OSS's {', '.join(gpt_oss)} is not built (adapters over its biased "
            "projections and clamped experts are not carried through the cuts); train every weight (unset lora.rank)"
        )
    if lo.quantize is not None and dims.tp > 1:  # NF4's blocks and its scales' mean span the whole weight
        problems.append(
            f"lora.quantize={lo.quantize!r} is not carried through tensor parallelism yet (a shard's NF4 is not the "
            "weight's); set parallel.tp=1, or leave lora.quantize unset"
        )
    if problems:
        return problems
    from fivecut.model.lora import target_problems  # builds the model on the meta device: torch

    problems = target_problems(lo.rank, lo.targets, lo.full, args, lo.quantize, dims.tp)
    if lo.adapter is None or problems:
        return problems
    from fivecut.weights.peft import lora_adapter_problems  # opens the folder with torch

    return lora_adapter_problems(lo, cfg.model.init_from, args)


def resolved_args(section: ModelConfig) -> ModelArgs:
    """The shape of the `[model]` section: a preset's, read here without torch, or its file's."""
    if section.init_from is None:
        return preset_args(section)
    from fivecut.weights.load import model_args  # opens the file with torch: only for model.init_from

    return model_args(section)


def checked_model_args(cfg: Config) -> ModelArgs:
    args = resolved_args(cfg.model)
    try:
        args.check()
    except ValueError as err:
        raise ConfigError(f"model {model_label(cfg.model)!r} with the model.* overrides: {err}") from None
    check_dense_keys(cfg, args)
    check_plain_attention_keys(cfg, args)
    check_longrope_documents(cfg, args)
    if cfg.train.seq_len > args.max_seq_len:
        raise ConfigError(
            f"train.seq_len={cfg.train.seq_len} exceeds model max_seq_len={args.max_seq_len}; lower it or set "
            "model.max_seq_len"
        )
    return args


def check_longrope_documents(cfg: Config, args: ModelArgs) -> None:
    """LongRoPE turns a run's sequences by the factors of train.seq_len; with documents apart, each
    restarting its positions, transformers would choose by the longest document instead: refused past
    the original context, where the two choices part."""
    if cfg.data.document_mask and args.rope_long(cfg.train.seq_len):
        raise ConfigError(
            f"data.document_mask=true with LongRoPE at train.seq_len={cfg.train.seq_len} > its original context "
            f"{args.rope_original_context} is not implemented: fivecut turns every document by the long factors, "
            "transformers by its longest document's; set data.document_mask=false or train.seq_len <= "
            f"{args.rope_original_context}"
        )


def check_dense_keys(cfg: Config, args: ModelArgs) -> None:
    """A key that shapes only MoE layers, given for a dense model, would change nothing: refused by name."""
    given = [f"model.{name}={getattr(cfg.model, name)!r}" for name in MOE_ONLY if getattr(cfg.model, name) is not None]
    if given and not args.is_moe:
        them = "them" if len(given) > 1 else "it"
        raise ConfigError(
            f"{', '.join(given)} shape{'' if len(given) > 1 else 's'} only mixture-of-experts layers, but model "
            f"{model_label(cfg.model)!r} is dense (n_experts=0); remove {them}, or set model.n_experts >= 1 "
            "(or model.preset='tiny-moe')"
        )


def check_plain_attention_keys(cfg: Config, args: ModelArgs) -> None:
    """A key that shapes only multi-head latent attention, given for plain attention, would change nothing."""
    given = [f"model.{name}={getattr(cfg.model, name)!r}" for name in MLA_ONLY if getattr(cfg.model, name) is not None]
    if given and not args.is_mla:
        raise ConfigError(
            f"{', '.join(given)} shape{'' if len(given) > 1 else 's'} only multi-head latent attention, but model "
            f"{model_label(cfg.model)!r} has plain attention (kv_lora_rank=0); remove "
            f"{'them' if len(given) > 1 else 'it'}, or set model.kv_lora_rank >= 1 (or model.preset='tiny-mla')"
        )


def check_preset(name: str, key: str = "model.preset") -> None:
    """A preset that exists and can be trained here (the shape-only ones are for planning)."""
    runnable = ", ".join(runnable_presets())
    if name not in PRESETS:
        raise ConfigError(f"{key}={name!r} is not a model preset; runnable presets: {runnable}")
    if name in SHAPE_ONLY:
        raise ConfigError(
            f"{key}={name!r} is a shape-only preset (for shapes and planning, never allocated); "
            f"train, verify and ledger run one of: {runnable}"
        )


# ---------------------------------------------------------------- options


def option_problems(cfg: Config) -> list[str]:
    sections = (
        train_problems(cfg.train) + compile_problems(cfg.train.compile) + data_problems(cfg) + log_problems(cfg.log)
    )
    return path_problems(cfg) + sections + checkpoint_problems(cfg.checkpoint) + launch_problems(cfg)


def launch_problems(cfg: Config) -> list[str]:
    """train.launch_steps ends a launch early with a checkpoint, so it needs somewhere to save."""
    n = cfg.train.launch_steps
    if n < 0:
        return [f"train.launch_steps={n} must be >= 0 (0: run to train.steps)"]
    if n and cfg.checkpoint.dir is None:
        return [f"train.launch_steps={n} stops the launch with a checkpoint, but checkpoint.dir is unset; set it"]
    return []


PATH_KEYS = ("data.source", "data.cache_dir", "log.out_dir", "checkpoint.dir")  # every key that names a file or folder


def path_problems(cfg: Config) -> list[str]:
    """An empty path would silently mean the current folder; it is refused, naming the key."""
    out = []
    for key in PATH_KEYS:
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if isinstance(value, list):  # data.source: several sources
            value = next((v for v in value if not v.strip()), "x")
        if value is not None and not value.strip():
            default = getattr(type(getattr(cfg, section))(), name)
            fix = f"leave {key} out (default {default!r})" if default is not None else f"leave {key} unset"
            out.append(f"{key}={value!r} is an empty path (it would mean the current folder); give a path, or {fix}")
    return out


def checkpoint_problems(c) -> list[str]:
    out = at_least("checkpoint", c, ("every",), 0) + at_least("checkpoint", c, ("keep", "max_failures"), 1)
    if c.on_error not in SAVE_ERROR_POLICIES:
        out.append(f"checkpoint.on_error={c.on_error!r}; choose {' or '.join(SAVE_ERROR_POLICIES)}")
    if c.async_mode not in ASYNC_MODES:
        out.append(f"checkpoint.async_mode={c.async_mode!r}; choose {', '.join(ASYNC_MODES)}")
    elif c.async_mode != "off" and c.dir is None:
        out.append(f"checkpoint.async_mode={c.async_mode!r} saves nowhere: set checkpoint.dir, or leave it 'off'")
    if c.every and c.dir is None:
        out.append(f"checkpoint.every={c.every} saves nowhere: set checkpoint.dir, or checkpoint.every=0")
    return out


def at_least(section: str, obj, names: tuple[str, ...], low: float) -> list[str]:
    out = []
    for name in names:
        value = getattr(obj, name)
        if not value >= low:
            out.append(f"{section}.{name}={value} must be >= {low:g}; set {section}.{name} >= {low:g}")
    return out


def not_finite(section: str, obj, names: tuple[str, ...]) -> list[str]:
    bad = [n for n in names if not math.isfinite(getattr(obj, n))]
    return [f"{section}.{n}={getattr(obj, n)} must be a finite number" for n in bad]


def train_problems(t) -> list[str]:
    floats = ("lr", "min_lr", "weight_decay", "beta1", "beta2", "eps", "grad_clip", "bucket_mb", "collective_timeout")
    out = not_finite("train", t, given(t, floats))
    if out:
        return out
    out += at_least("train", t, ("steps", "global_batch", "seq_len", "accumulate", "recompute_every"), 1)
    out += at_least(
        "train", t, given(t, ("lr", "min_lr", "warmup", "weight_decay", "grad_clip", "seed", "eval_every")), 0
    )
    if t.loss_chunk_tokens < 0:
        out.append(
            f"train.loss_chunk_tokens={t.loss_chunk_tokens} must be >= 0 (tokens per chunk of the head and loss); "
            "set it to e.g. 512, or 0 for the full logits"
        )
    out += schedule_of_lr_problems(t) + adam_problems(t)
    if t.eval_every > 0 and t.eval_batches < 1:
        out.append(
            f"train.eval_batches={t.eval_batches} with evaluation on (train.eval_every={t.eval_every}); set "
            "train.eval_batches >= 1, or train.eval_every=0 to turn evaluation off"
        )
    if not t.bucket_mb > 0:
        out.append(f"train.bucket_mb={t.bucket_mb} must be > 0 (the DDP gradient bucket size in MB)")
    for key in ("dtype", "reduce_dtype"):
        if getattr(t, key) not in DTYPES:
            out.append(f"train.{key}={getattr(t, key)!r}; choose fp32 or bf16")
    if t.recompute not in RECOMPUTE_MODES:
        out.append(f"train.recompute={t.recompute!r}; choose {', '.join(RECOMPUTE_MODES)}")
    elif t.recompute == "none" and t.recompute_every > 1:
        out.append(
            f"train.recompute_every={t.recompute_every} picks the blocks train.recompute recomputes, but "
            "train.recompute='none'; set train.recompute='full' or 'selective', or remove train.recompute_every"
        )
    if t.adamw not in ADAMW_KERNELS:
        out.append(f"train.adamw={t.adamw!r}; choose {', '.join(ADAMW_KERNELS)}")
    return out + fault_problems(t)


def fault_problems(t) -> list[str]:
    """The keys of fault handling: a positive collective timeout, a known non-finite policy."""
    out = []
    if not t.collective_timeout > 0:
        out.append(
            f"train.collective_timeout={t.collective_timeout} must be > 0 (seconds a collective waits), e.g. 300"
        )
    if t.on_nonfinite not in NONFINITE_POLICIES:
        out.append(f"train.on_nonfinite={t.on_nonfinite!r}; choose {' or '.join(NONFINITE_POLICIES)}")
    out += at_least("train", t, ("max_skipped",), 1)
    return out


def given(obj, names: tuple[str, ...]) -> tuple[str, ...]:
    """The `names` set on `obj`: an optional key left None is derived, not checked (`train.min_lr`)."""
    return tuple(n for n in names if getattr(obj, n) is not None)


def schedule_of_lr_problems(t) -> list[str]:
    out = []
    if t.min_lr is not None and t.min_lr > t.lr:
        out.append(f"train.min_lr={t.min_lr} exceeds train.lr={t.lr}; set train.min_lr <= train.lr")
    if t.warmup > t.steps >= 1:
        out.append(f"train.warmup={t.warmup} exceeds train.steps={t.steps}; set train.warmup <= {t.steps}")
    return out


def adam_problems(t) -> list[str]:
    out = [f"train.{k}={getattr(t, k)} must be in [0, 1)" for k in ("beta1", "beta2") if not 0 <= getattr(t, k) < 1]
    if not t.eps > 0:
        out.append(f"train.eps={t.eps} must be > 0 (it keeps Adam's division finite), e.g. 1e-8")
    return out


def compile_problems(compile: bool, path: str | None = None, dynamo_check=None) -> list[str]:
    """train.compile where torch cannot compile: no C++ compiler on `path` (default $PATH) for the code
    inductor writes (it looks for $CXX, else g++: torch._inductor.config.cpp.cxx), or a Python that
    Dynamo does not run on. `dynamo_check` raises with Dynamo's reason (default: torch's own check;
    torch is imported here, only when compile is asked for)."""
    if not compile:
        return []
    out = []
    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx, path=path) is None:
        out.append(
            f"train.compile=true needs a C++ compiler for inductor's code and {cxx!r} is not on PATH; "
            "install g++ (or point CXX at a C++ compiler), or set train.compile=false"
        )
    if dynamo_check is None:
        from torch._dynamo.eval_frame import check_if_dynamo_supported as dynamo_check
    try:
        dynamo_check()
    except RuntimeError as err:
        out.append(f"train.compile=true but torch.compile cannot run here: {err}; set train.compile=false")
    return out


def data_problems(cfg: Config) -> list[str]:
    d, out = cfg.data, []
    if d.tokenizer not in (*TOKENIZERS, AUTO_TOKENIZER):
        out.append(
            f"data.tokenizer={d.tokenizer!r}; choose one of {', '.join(TOKENIZERS)} or {AUTO_TOKENIZER} "
            "(the imported model's own)"
        )

    if d.document_mask and (d.tokenizer == "byte" or (d.tokenizer == AUTO_TOKENIZER and cfg.model.init_from is None)):
        out.append(
            f"data.document_mask=true keeps documents apart at the end-of-text id, but tokenizer "
            f"{'byte' if d.tokenizer == 'byte' else 'auto (byte, without model.init_from)'} has none; set "
            "data.tokenizer='gpt2' (with a model of its vocabulary, e.g. --model tiny-gpt2) or import a model's own"
        )
    if not (math.isfinite(d.val_fraction) and 0 < d.val_fraction < 1):
        out.append(f"data.val_fraction={d.val_fraction} must be in (0, 1), e.g. 0.05")
    return out + store_problems(d)


def store_problems(d) -> list[str]:
    """The sources exist (a glob matches files), the weights weigh them, the store's options make sense."""
    sources = [d.source] if isinstance(d.source, str) else d.source
    out = [] if sources else ["data.source is an empty list; give at least one source"]
    for source in sources:
        if source.strip():
            try:
                resolve_source(source)
            except DataError as err:
                out.append(str(err))
    problem = weight_problem(d.weights, len(sources))
    out += [problem] if problem else []
    if d.order not in ORDERS:
        out.append(f"data.order={d.order!r}; choose one of {', '.join(ORDERS)}")
    if not d.text_field:
        out.append('data.text_field is empty; give the JSONL field or column that holds the text, e.g. "text"')
    out += chat_problems(d)
    return out + at_least("data", d, ("shard_tokens",), 1) + at_least("data", d, ("workers",), 0)


def chat_problems(d) -> list[str]:
    """data.format and data.chat_template agree (the template itself is read with the tokenizer)."""
    if d.format not in FORMATS:
        return [f"data.format={d.format!r}; choose one of {', '.join(FORMATS)}"]
    if d.chat_template is not None and d.format != "chat":
        return ['data.chat_template is set but data.format is "text"; set data.format="chat" or drop it']
    if d.chat_template is not None and not Path(d.chat_template).expanduser().is_file():
        return [f"data.chat_template={d.chat_template!r} is not a file; give the path of a Jinja template"]
    return []


def log_problems(log) -> list[str]:
    out = at_least("log", log, ("log_every", "sample_tokens"), 1)
    if log.sample_prompt is not None and not log.sample_prompt:
        out.append("log.sample_prompt='' gives the model nothing to continue; give some text, or leave it unset")
    if not (math.isfinite(log.peak_tflops) and log.peak_tflops >= 0):
        out.append(f"log.peak_tflops={log.peak_tflops} must be >= 0 (0 = look it up or measure it)")
    return out


# ---------------------------------------------------------------- the validation split


def check_eval_split(cfg: Config, sources: list) -> None:
    """Periodic evaluation's windows fit each source's validation split (`sources`: the run's
    `TokenSplits`, their stores opened before any process starts). The evaluation takes
    train.eval_batches x train.global_batch windows of seq_len + 1 tokens, dealt to the sources by
    their weights and spaced evenly over each split (`fivecut.train.data.eval_batches`, which would
    refuse it inside the ranks): a source given w windows needs w * seq_len + 1 tokens."""
    t, d = cfg.train, cfg.data
    if t.eval_every < 1:
        return
    lengths = [len(s.val) for s in sources]
    windows = eval_windows(d.weights, len(sources), t.eval_batches * t.global_batch)
    short = [k for k, (length, w) in enumerate(zip(lengths, windows)) if not fits(length, w, t.seq_len)]
    if not short:
        return
    k, names = short[0], [d.source] if isinstance(d.source, str) else d.source
    share = f" ({windows[k]} of them from this source)" if len(sources) > 1 else ""
    raise ConfigError(
        f"train.eval_batches={t.eval_batches} x train.global_batch={t.global_batch} validation windows of "
        f"{t.seq_len + 1} tokens{share} need {windows[k] * t.seq_len + 1:,} tokens, but the validation split of "
        f"{names[k]!r} holds {lengths[k]:,} (data.val_fraction={d.val_fraction} of its {sources[k].n_tokens:,}); "
        + ", or ".join(eval_fixes(cfg, sources, lengths, windows))
    )


def eval_windows(weights: list[float] | None, n_sources: int, count: int) -> list[int]:
    """How many of `count` validation windows each source gives, dealt as `eval_batches` deals them."""
    if n_sources == 1:
        return [count]
    labels = np.resize(Mixture.of(normalised(weights, n_sources)[0]).labels, count)
    return np.bincount(labels, minlength=n_sources).tolist()


def fits(length: int, windows: int, seq_len: int) -> bool:
    """`windows` windows of seq_len + 1 tokens, evenly spaced and targets never shared, in `length` tokens."""
    return windows == 0 or length >= windows * seq_len + 1


def eval_fixes(cfg: Config, sources: list, lengths: list[int], windows: list[int]) -> list[str]:
    """The most train.eval_batches that fit, the least data.val_fraction that fits, and evaluation off."""
    t, d = cfg.train, cfg.data

    def fit(n: int) -> bool:
        dealt = eval_windows(d.weights, len(sources), n * t.global_batch)
        return all(fits(length, w, t.seq_len) for length, w in zip(lengths, dealt))

    low, high = 0, t.eval_batches  # fit(low) holds (no windows), fit(high) does not: bisect
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fit(mid) else (low, mid)
    out = [f"set train.eval_batches={low}"] if low else []
    needed = max(Fraction(w * t.seq_len + 1, s.n_tokens) for w, s in zip(windows, sources))
    fraction = Fraction(math.ceil(needed * 1000), 1000)  # in thousandths, rounded up
    if all(math.ceil(fraction * s.n_tokens) <= s.n_tokens - t.seq_len - 1 for s in sources):  # a training row left
        out.append(f"raise data.val_fraction to {float(fraction):g}")
    return out + ["set train.eval_every=0 to turn evaluation off"]


# ---------------------------------------------------------------- folders


def check_folders(cfg: Config, out_dir: bool, resuming: bool = False) -> None:
    """data.cache_dir (and, for a training run, log.out_dir) can be written; out_dir holds no earlier
    run unless this one resumes it (its metrics are appended to)."""
    check_writable("data.cache_dir", cfg.data.cache_dir)
    if cfg.checkpoint.dir is not None:
        check_writable("checkpoint.dir", cfg.checkpoint.dir)
    if out_dir:
        if not resuming:
            check_fresh_out_dir(cfg.log.out_dir)
        check_writable("log.out_dir", cfg.log.out_dir)


def check_writable(key: str, folder: str) -> None:
    """Create `folder` if needed and write a probe file into it; refuse naming `key` if that fails."""
    path = Path(folder).expanduser()
    fix = f"give {key} a folder you can write"
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{key}={folder!r} is a file, not a folder; {fix}")
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path, prefix=".fivecut-probe-"):
            pass
    except OSError as err:
        raise ConfigError(f"{key}={folder!r} cannot be created or written ({err.strerror or err}); {fix}") from None


def check_new_file(flag: str, file: str, suffix: str) -> None:
    """A file a command will write: named `*suffix`, not a folder, in a folder that exists and can be written."""
    path = Path(file).expanduser()
    folder = path.parent
    if path.is_dir():
        raise ConfigError(f"{flag} {file} is a folder; give a file name in it, e.g. {path / ('out' + suffix)}")
    if path.suffix.lower() != suffix:
        raise ConfigError(f"{flag} {file}: the file is written as {suffix[1:].upper()}; give a name ending in {suffix}")
    existing = next(p for p in (folder, *folder.parents) if p.exists())
    if not existing.is_dir():
        raise ConfigError(f"{flag} {file}: {existing} is a file, not a folder; give a path in a folder")
    if existing != folder:
        raise ConfigError(f"{flag} {file}: the folder {folder} does not exist; create it first (mkdir -p {folder})")
    if not os.access(folder, os.W_OK):
        raise ConfigError(
            f"{flag} {file}: the folder {folder} cannot be written; give a path in a folder you can write"
        )


def check_fresh_out_dir(folder: str) -> None:
    """A new run does not overwrite an earlier one's metrics, config and loss curve."""
    path = Path(folder).expanduser()
    found = [name for name in RUN_FILES if (path / name).exists()]
    if found:
        raise ConfigError(
            f"log.out_dir={folder!r} holds an earlier run ({', '.join(found)}); give another folder "
            f"(--set log.out_dir=...) or remove {path} first"
        )


# ---------------------------------------------------------------- layout


def validate_layout(
    dims: ParallelDims, model, seq_len: int, global_batch: int, accumulate: int, world_size: int | None = None
) -> None:
    """Refuse a layout that cannot work for `model` (a ModelArgs), naming the numbers and a fix."""
    if dims.layout == "auto":  # `fivecut train` resolves it before it gets here
        raise LayoutError(
            "parallel.layout='auto' is chosen by `fivecut train` for the world it starts with; here give the cuts "
            "(`fivecut plan --model M --cluster C` searches them)"
        )
    problems = structural_problems(dims)
    if accumulate < 1:
        problems.append(f"train.accumulate={accumulate} must be >= 1")
    sizes = [getattr(dims, n) for n in MESH_DIMS + COUNTS if getattr(dims, n) is not None] + [accumulate]
    if min(sizes) < 1:  # the checks below divide by these numbers
        refuse("invalid layout " + dims.settings(), problems, LayoutError)
    problems += (
        pipeline_problems(dims, model, seq_len)
        + model_layout_problems(dims, model)
        + sequence_problems(dims, model, seq_len)
        + batch_problems(dims, global_batch, accumulate)
        + world_problems(dims, world_size)
    )
    refuse("invalid layout " + dims.settings(), problems, LayoutError)


def structural_problems(dims: ParallelDims) -> list[str]:
    """The layout's own fields, then the pipeline schedule's rules."""
    microbatches = 1 if dims.microbatches is None else dims.microbatches  # None: no pipeline to cut for
    return dims.problems() + schedule_rule_problems(dims.pp_schedule, dims.pp, microbatches, dims.pp_virtual)


def schedule_rule_problems(name: str, pp: int, microbatches: int, virtual: int) -> list[str]:
    """The pipeline rules every caller shares: `train` (parallel.*) and `fivecut schedule`. Each
    problem once: an unknown schedule has no rules yet, and a count under 1 is its caller's to name."""
    if name not in PP_SCHEDULES:
        return [f"parallel.pp_schedule={name!r}; choose one of {', '.join(PP_SCHEDULES)}"]
    out = []
    if min(pp, microbatches, virtual) < 1:
        return out
    if pp > 1 and name == "dualpipev" and microbatches < 2 * pp:
        out.append(f"dualpipev with pp={pp} needs microbatches >= 2*pp (the V fills with 2*pp); got {microbatches}")
    elif pp > 1 and microbatches < pp and name != "gpipe":
        out.append(f"{name} with pp={pp} needs microbatches >= pp; got {microbatches}")
    if virtual > 1 and name not in ("interleaved", "dualpipev"):
        out.append(f"pp_virtual={virtual} only applies to interleaved or dualpipev, not {name}")
    return out


def fewest_microbatches(name: str, pp: int) -> int:
    """The fewest microbatches with which every rank of schedule `name` works at once: DualPipeV
    fills its V with 2*pp; 1F1B, ZB-H1 and interleaved 1F1B (in groups of pp) need pp; GPipe runs
    on fewer, but then its stages only wait for each other, so pp as well."""
    return 2 * pp if name == "dualpipev" else pp


def resolve_microbatches(cfg: Config) -> None:
    """parallel.microbatches left unset under a pipeline: the fewest the schedule needs that also
    divides the rows each rank runs per accumulation step (global_batch / (dp * accumulate)),
    written into `cfg` so that every reader (the run, verify, ledger, the planner) sees the count.
    A count given by hand is kept, and refused by `validate_layout` if it cannot work."""
    dims, t = cfg.parallel, cfg.train
    if dims.microbatches is not None or dims.pp <= 1:
        return
    least = fewest_microbatches(dims.pp_schedule, dims.pp)
    dims.microbatches = least  # what `validate_layout` refuses, naming the cause, when nothing below fits
    if not schedule_runs(dims.pp_schedule, dims.pp, least, dims.pp_virtual) or min(dims.dp, t.accumulate) < 1:
        return
    split = dims.dp * t.accumulate
    rows = t.global_batch // split
    if t.global_batch % split:  # `batch_problems` names global_batch
        return
    fits = [
        m
        for m in range(least, rows + 1)
        if rows % m == 0 and schedule_runs(dims.pp_schedule, dims.pp, m, dims.pp_virtual)
    ]
    if not fits:
        raise LayoutError(
            f"parallel.microbatches is unset and no count fits: {dims.pp_schedule} with pp={dims.pp} needs at "
            f"least {least} microbatches, and each rank runs {rows} rows per step (train.global_batch="
            f"{t.global_batch} / dp*accumulate={split}); set train.global_batch={least * split}, or give "
            "parallel.microbatches"
        )
    dims.microbatches = fits[0]


def schedule_runs(name: str, pp: int, microbatches: int, virtual: int) -> bool:
    """The schedule's rules and its built form both accept these counts."""
    if name not in PP_SCHEDULES or min(pp, virtual) < 1 or schedule_rule_problems(name, pp, microbatches, virtual):
        return False
    return not schedule_problem(name, pp, microbatches, virtual)


def built_schedule(name: str, pp: int, microbatches: int, virtual: int):
    """The schedule, built and checked for deadlock; ValueError if it cannot run."""
    schedule = build_schedule(name, pp, microbatches, virtual)
    check(schedule)
    return schedule


@functools.cache
def schedule_problem(name: str, pp: int, microbatches: int, virtual: int) -> tuple[str, ...]:
    """`built_schedule`'s refusal, once per arguments (the schedule is a function of them alone;
    a search over layouts checks the same one for every other cut)."""
    try:
        built_schedule(name, pp, microbatches, virtual)
    except ValueError as err:
        return (str(err),)
    return ()


def pipeline_problems(dims: ParallelDims, model, seq_len: int) -> list[str]:
    """Build the schedule (unless a rule of `schedule_rule_problems` already refused it) and the
    stage split now, so that a bad pipeline never starts; each problem is said once."""
    if dims.pp == 1:
        return []
    from fivecut.parallel.pipeline.split import stage_layers  # imports torch: only for a pipeline

    out = []
    if not schedule_rule_problems(dims.pp_schedule, dims.pp, dims.microbatches, dims.pp_virtual):
        out += schedule_problem(dims.pp_schedule, dims.pp, dims.microbatches, dims.pp_virtual)
    stages = dims.pp * stages_per_rank(dims.pp_schedule, dims.pp_virtual)
    if model.n_layers < stages:
        return out + [stage_count_problem(dims, model.n_layers, stages)]
    try:
        stage_layers(model, stages, seq_len, dims.pp_layers)
    except ValueError as err:
        out.append(str(err))
    return out


def stage_count_problem(dims: ParallelDims, n_layers: int, stages: int) -> str:
    """Too few layers for the stages: each fix offered is one that can be followed (a pipeline
    keeps pp >= 2; interleaved keeps pp_virtual >= 2)."""
    per = stages // dims.pp
    fixes = []
    if 2 <= n_layers // per < dims.pp:
        fixes.append(f"lower pp to {n_layers // per} (parallel.pp={n_layers // per})")
    if per > 1 and n_layers >= dims.pp:
        if dims.pp_schedule == "interleaved" and n_layers // dims.pp >= 2:
            fixes.append(f"set parallel.pp_virtual={n_layers // dims.pp}")
        fixes.append("use a schedule of one stage per rank (parallel.pp_schedule='1f1b' or 'zb1p')")
    fixes.append(f"use a model of at least {stages} layers (model.n_layers)")
    where = f" ({per} per rank under {dims.pp_schedule})" if per > 1 else ""
    return f"{n_layers} layers cannot fill {stages} pipeline stages{where}; " + ", or ".join(fixes)


def stages_per_rank(name: str, virtual: int) -> int:
    """Model chunks a pipeline rank holds: DualPipeV two (its V), interleaved `virtual`, the others one
    (a pp_virtual they do not use is refused by `schedule_rule_problems`, not counted again here)."""
    return {"dualpipev": 2, "interleaved": virtual}.get(name, 1)


def model_layout_problems(dims: ParallelDims, model) -> list[str]:
    out = tp_head_problems(dims.tp, model)
    if not out and dims.cp > 1 and dims.cp_mode == "ulysses" and (model.n_heads // dims.tp) % dims.cp:
        out.append(
            f"Ulysses cuts each tp rank's {model.n_heads // dims.tp} heads over cp={dims.cp}; choose cp from "
            + f"{divisors(model.n_heads // dims.tp)}"
        )
    return out + usp_head_problems(dims, model) + expert_layout_problems(dims, model) + score_ring_problems(dims, model)


def score_ring_problems(dims: ParallelDims, model) -> list[str]:
    """Gemma 2's soft-capped scores under ring attention (and USP, which runs the ring's kernel): every
    block pair runs the fused flash kernel, which cannot soft-cap a score (attn_softcap); refused. Ulysses
    gives the one-device core whole sequences, so the cap is exact there."""
    if dims.cp > 1 and dims.cp_mode != "ulysses" and model.attn_softcap:
        return [
            f"cp={dims.cp} with cp_mode={dims.cp_mode!r} and attn_softcap={model.attn_softcap}: ring attention runs "
            "the fused flash kernel on each K/V block pair, which cannot soft-cap a score; set "
            "parallel.cp_mode='ulysses' (whole sequences per head, the one-device attention exact)"
        ]
    return []


def usp_head_problems(dims: ParallelDims, model) -> list[str]:
    """USP cuts each tp rank's query heads over its Ulysses group; kv heads too few to cut are
    repeated to one per query head first, as under Ulysses alone (counted by the ledger)."""
    if dims.cp_mode != "usp" or dims.cp % dims.cp_ulysses or model.n_heads % dims.tp:  # said once elsewhere
        return []
    heads, u = model.n_heads // dims.tp, dims.cp_ulysses
    if heads % u:
        return [
            f"USP cuts each tp rank's {heads} query heads over cp_ulysses={u}; choose cp_ulysses from "
            f"{[d for d in divisors(heads) if dims.cp % d == 0]}"
        ]
    return []


def tp_head_problems(tp: int, model) -> list[str]:
    """tp cuts the query heads and splits or replicates the kv heads: one line when tp fits neither."""
    kv = model.n_kv_heads
    fits = [t for t in divisors(model.n_heads) if kv % t == 0 or t % kv == 0]
    if tp in fits and model.qk_norm_whole and kv % tp:
        return [
            f"tp={tp} with q/k norms over the whole projections (qk_norm_whole, OLMo 2): each rank's k norm covers its "
            f"kv heads, so tp must divide n_kv_heads={kv} (replicated kv heads are not built); choose tp from "
            f"{[t for t in fits if kv % t == 0]}"
        ]
    if tp in fits:
        return []
    return [
        f"tp={tp} must divide n_heads={model.n_heads}, and divide or be a multiple of n_kv_heads={kv} (kv heads "
        f"are split or replicated); choose tp from {fits}"
    ]


def expert_layout_problems(dims: ParallelDims, model) -> list[str]:
    if dims.ep > 1 and not model.n_experts:
        return [f"ep={dims.ep} needs a mixture-of-experts model; this one is dense (n_experts=0)"]
    if dims.ep > 1 and model.n_experts % dims.ep:
        return [
            f"n_experts={model.n_experts} not divisible by ep={dims.ep}; choose ep from {divisors(model.n_experts)}"
        ] + expert_tensor_problems(dims, model)
    return expert_tensor_problems(dims, model)


def expert_tensor_problems(dims: ParallelDims, model) -> list[str]:
    """parallel.etp cuts each routed expert's hidden size (moe_ffn_dim) over etp ranks of the tp group."""
    if dims.etp <= 1 or dims.tp % dims.etp:  # etp not dividing tp: `ParallelDims.problems` says so
        return []
    if not model.n_experts:
        return [
            f"parallel.etp={dims.etp} cuts routed experts, but the model is dense (n_experts=0); set parallel.etp=1 "
            "(tp cuts the dense MLPs already)"
        ]
    if model.expert_dim % dims.etp:
        return [
            f"parallel.etp={dims.etp} must divide the experts' hidden size moe_ffn_dim={model.expert_dim}; choose "
            f"etp from {[d for d in divisors(model.expert_dim) if dims.tp % d == 0]}"
        ]
    return []


def sequence_cuts(dims: ParallelDims, model) -> list[tuple[int, str]]:
    """Each cut of a sequence, as a number its length must divide by and the cut that asks it."""
    cp, tp = dims.cp, dims.tp
    out = []
    if cp > 1:
        out.append(context_cut(dims))
    if dims.sp:
        out.append((cp * tp, (f"cp={cp} x " if cp > 1 else "") + f"tp={tp} for sequence parallelism"))
    elif model.n_experts and tp > 1:  # under tp a MoE layer runs on each tp rank's slice of its cp chunk
        out.append((cp * tp, (f"cp={cp} x " if cp > 1 else "") + f"tp={tp}: a MoE layer cuts its tokens over tp"))
    return out


def context_cut(dims: ParallelDims) -> tuple[int, str]:
    """What context parallelism asks of a sequence length: ring 2*cp zigzag chunks; USP 2*R zigzag
    chunks for its ring of R = cp/cp_ulysses, each in cp pieces; Ulysses cp chunks."""
    cp, ring = dims.cp, dims.cp_ring
    if dims.cp_mode == "ring":
        return 2 * cp, f"2*cp={2 * cp} load-balanced causal chunks"
    if dims.cp_mode == "usp" and cp % dims.cp_ulysses == 0 and ring > 1:
        return math.lcm(2 * ring, cp), f"under USP: 2*{ring} zigzag chunks for the ring (cp/cp_ulysses), {cp} pieces"
    return cp, f"cp={cp} chunks"


def sequence_problems(dims: ParallelDims, model, seq_len: int) -> list[str]:
    """One line for a sequence length that some cuts of the sequence do not divide, naming each of them."""
    cuts = sequence_cuts(dims, model)
    unmet = [why for n, why in cuts if seq_len % n]
    if not unmet:
        return []
    need = math.lcm(*(n for n, _ in cuts))
    return [
        f"seq_len={seq_len} must divide by {need} ({'; '.join(unmet)}); try train.seq_len="
        f"{max(need, seq_len // need * need)}"
    ]


def batch_problems(dims: ParallelDims, global_batch: int, accumulate: int) -> list[str]:
    out = []
    per_rank = dims.dp * accumulate * (dims.microbatches if dims.pp > 1 else 1)
    if global_batch % per_rank:
        good = per_rank * max(1, round(global_batch / per_rank))
        out.append(
            f"global_batch={global_batch} must divide by dp*accumulate*microbatches={per_rank}; try "
            f"train.global_batch={good}"
        )
    return out


def world_problems(dims: ParallelDims, world_size: int | None) -> list[str]:
    if world_size is None or world_size == dims.world_size:
        return []
    rest = dims.world_size // dims.dp  # pp*cp*tp
    fix = (
        f"e.g. parallel.dp={world_size // rest}"
        if world_size % rest == 0
        else f"pp*cp*tp = {rest} must divide {world_size}"
    )
    return [
        f"pp*dp*cp*tp = {dims.pp}*{dims.dp}*{dims.cp}*{dims.tp} = {dims.world_size} but {world_size} processes "
        f"were started; make the product {world_size} ({fix})"
    ]


# ---------------------------------------------------------------- MoE options


def moe_problems(opts: MoEOptions, args: ModelArgs, dims: ParallelDims) -> list[str]:
    """What cannot work with model `args` under the layout `dims`."""
    if not args.is_moe:
        given = [f"moe.{name}" for name in opts.changed()]
        if not given:
            return []
        return [
            f"{', '.join(given)} set{'' if len(given) > 1 else 's'} how MoE layers train, but the model is dense "
            f"(n_experts=0); remove {'them' if len(given) > 1 else 'it'}, or pick a MoE model (model.n_experts >= 1)"
        ]
    out = opts.problems() + eplb_problems(opts, args, dims.ep)
    if opts.capacity_factor is not None and dims.cp_ring > 1:  # ring, or USP with a ring of 2 or more
        out.append(
            f"moe.capacity_factor with cp_mode={dims.cp_mode!r} is not in this version (ring ranks hold two chunks "
            + "of a sequence out of order); use cp_mode='ulysses' or leave the capacity unset"
        )
    return out


def eplb_problems(opts: MoEOptions, args: ModelArgs, ep: int) -> list[str]:
    """EPLB against the expert-parallel ranks and the model's experts."""
    out = []
    if opts.eplb and ep == 1:
        out.append(
            "EPLB (moe.eplb_slots, moe.eplb_move) places experts over expert-parallel ranks, but ep=1; "
            + "set parallel.ep >= 2 or turn EPLB off"
        )
    foreign = args.n_experts - args.n_experts // max(ep, 1)
    if ep > 1 and opts.eplb_slots > foreign:
        out.append(
            f"moe.eplb_slots={opts.eplb_slots}: a rank can hold copies of at most the {foreign} experts it does not own"
        )
    return out


# ---------------------------------------------------------------- command-line arguments


def check_run_arguments(steps: int, timeout: float, tolerances: dict[str, float | None] | None = None) -> None:
    """`verify` / `ledger`: a run that compares something, a timeout, the tolerances given ({flag: value})."""
    problems = timeout_problems(timeout)
    if steps < 1:
        problems.insert(0, f"--steps={steps} compares nothing; give --steps >= 1")
    for flag, rtol in (tolerances or {}).items():
        if rtol is not None and not (math.isfinite(rtol) and rtol > 0):
            problems.append(f"{flag}={rtol} must be > 0 (the largest relative difference accepted), e.g. 1e-5")
    refuse("invalid arguments", problems)


def timeout_problems(timeout: float) -> list[str]:
    if math.isfinite(timeout) and timeout > 0:
        return []
    return [f"--timeout={timeout} must be a positive number of seconds"]


def check_eval_arguments(batches: int, batch_size: int, seq_len: int, timeout: float) -> None:
    """`eval`'s flags, named as they were typed (the run receives them as train.* keys)."""
    counts = {"--batches": batches, "--batch-size": batch_size, "--seq-len": seq_len}
    problems = [f"{flag}={value} must be at least 1; give {flag} >= 1" for flag, value in counts.items() if value < 1]
    refuse("invalid arguments", problems + timeout_problems(timeout))


def check_eval_shape(cfg: Config) -> None:
    """`eval`'s --seq-len against the model, --batch-size against the layout's split of a batch."""
    t, dims, args = cfg.train, cfg.parallel, resolved_args(cfg.model)
    if t.seq_len > args.max_seq_len:
        raise ConfigError(
            f"--seq-len={t.seq_len} exceeds the model's max_seq_len={args.max_seq_len}; give --seq-len <= "
            f"{args.max_seq_len}"
        )
    split = dims.dp * (dims.microbatches if dims.pp > 1 else 1)  # under 1: validate_layout names the key
    if split >= 1 and t.global_batch % split:
        raise ConfigError(
            f"--batch-size={t.global_batch} must divide by dp*microbatches={split} of layout {dims.settings()}; "
            f"try --batch-size={split * max(1, round(t.global_batch / split))}"
        )


def check_owned_keys(overrides: list[str], owned: dict[str, str], unused: dict[str, str] | None = None) -> None:
    """Refuse a `--set` of a key that a flag of the command sets (`owned`: key -> flag) or that the
    command cannot take (`unused`: key -> why), so that no setting is silently replaced or dropped;
    a key ending in "." stands for its whole section."""
    for item in overrides:
        for key in flat(nest(*parse_override(item))):
            flag, why = matching(key, owned), matching(key, unused or {})
            if flag is not None:
                raise ConfigError(f"--set {item} sets {key}, which {flag} sets here; give it once, with {flag}")
            if why is not None:
                raise ConfigError(f"--set {item}: {key} is not used here ({why}); remove it")


def matching(key: str, table: dict[str, str]) -> str | None:
    return next((value for k, value in table.items() if key == k or (k.endswith(".") and key.startswith(k))), None)


def layout_items(text: str) -> list[str]:
    """The `key=value` items of `--layout` (commas inside [...] kept), refusing empty, malformed, repeated."""
    import re

    hint = "keys are parallel.* fields, e.g. --layout dp=2,zero=1"
    if not text.strip():
        raise ConfigError(f"--layout is empty; give key=value pairs ({hint})")
    items = [part.strip() for part in re.split(r",(?![^\[]*\])", text)]
    for item in items:
        if "=" not in item or not item.split("=", 1)[0].strip():
            raise ConfigError(f"--layout {text!r}: item {item!r} is not key=value; write e.g. dp=2 ({hint})")
    keys = [item.split("=", 1)[0].strip() for item in items]
    repeated = sorted({k for k in keys if keys.count(k) > 1})
    if repeated:
        raise ConfigError(f"--layout {text!r} sets {', '.join(repeated)} more than once; give each key once")
    return items


def check_schedule_command(name: str, pp: int, microbatches: int, virtual: int, costs: dict):
    """`fivecut schedule`: the rules `train` applies to parallel.*, then the built schedule; returns it."""
    counts = {"pp": pp, "microbatches": microbatches, "virtual": virtual}
    problems = [f"--{k}={v} must be >= 1" for k, v in counts.items() if v < 1]
    problems += [
        f"--cost-{k}={v} must be a finite number >= 0"
        for k, v in costs.items()
        if v is not None and not (math.isfinite(v) and v >= 0)
    ]
    title = f"schedule {name}, pp={pp}, {microbatches} microbatches"
    refuse(title + " cannot run", problems + schedule_rule_problems(name, pp, microbatches, virtual), LayoutError)
    try:
        schedule = built_schedule(name, pp, microbatches, virtual)
    except ValueError as err:
        raise LayoutError(str(err)) from None  # the schedule's own message names the numbers
    if costs.get("w") is not None and not schedule.split_backward:
        raise LayoutError(
            f"--cost-w applies only to schedules that split the backward into B and W (zb1p, dualpipev); {name} "
            "does not: drop --cost-w or choose one of those"
        )
    return schedule
