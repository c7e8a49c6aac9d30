"""Typed configuration: dataclass sections, TOML files, `--set section.key=value` overrides.

Every key is checked: an unknown key or a value of the wrong type is a `ConfigError`
that names the key and, for a misspelling, the closest valid one.

Free of torch: it stands on the layout records and the model's arguments and presets only, and
never opens a weights file; the shape `model.init_from` names is read above it
(`fivecut.weights.load.model_args`).
"""

from __future__ import annotations

import dataclasses
import difflib
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

from fivecut.layout import MoEOptions, ParallelDims
from fivecut.model.args import ModelArgs
from fivecut.model.presets import get_preset


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names the key and the fix."""


@dataclass
class ModelConfig:
    """The architecture: a preset (default "tiny"), then any field of `ModelArgs` overridden by name;
    or `init_from`, a model's weights ("hf:FOLDER", "gguf:FILE" or a fivecut checkpoint's,
    "dcp:CHECKPOINT") whose file gives the shape and the weights (a field set here must then agree
    with the file)."""

    preset: str | None = None
    init_from: str | None = None
    vocab_size: int | None = None
    dim: int | None = None
    n_layers: int | None = None
    n_heads: int | None = None
    n_kv_heads: int | None = None
    ffn_dim: int | None = None
    max_seq_len: int | None = None
    rope_theta: float | None = None
    norm_eps: float | None = None
    tie_embeddings: bool | None = None
    init_std: float | None = None
    n_experts: int | None = None
    top_k: int | None = None
    n_shared_experts: int | None = None
    moe_ffn_dim: int | None = None
    first_dense_layers: int | None = None
    gate: str | None = None
    route_scale: float | None = None
    expert_groups: int | None = None
    route_group_limit: int | None = None
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None
    v_head_dim: int | None = None
    attention_head_dim: int | None = None
    qkv_bias: bool | None = None
    qk_norm: bool | None = None
    qk_norm_whole: bool | None = None
    nope_interval: int | None = None
    rope_partial_dim: int | None = None
    norm_after: bool | None = None
    sliding_window: int | None = None
    full_attention_layers: int | None = None
    route_norm: bool | None = None
    rope_scaling: str | None = None
    rope_factor: float | None = None
    rope_original_context: int | None = None
    rope_low_freq_factor: float | None = None
    rope_high_freq_factor: float | None = None
    rope_beta_fast: float | None = None
    rope_beta_slow: float | None = None
    rope_mscale: float | None = None
    rope_mscale_all_dim: float | None = None
    # GPT-OSS (`ModelArgs`' group of the same names)
    attention_sinks: bool | None = None
    wo_bias: bool | None = None
    window_layers: str | None = None
    moe_bias: bool | None = None
    swiglu_limit: float | None = None
    swiglu_alpha: float | None = None
    rope_truncate: bool | None = None
    ffn_activation: str | None = None
    sandwich_norms: bool | None = None
    scale_embeddings: bool | None = None
    rope_local_theta: float | None = None
    query_scale_dim: int | None = None
    attn_softcap: float | None = None
    logit_softcap: float | None = None


ADAMW_KERNELS = ("auto", "fused", "foreach")  # train.adamw (`fivecut.train.optim.adamw_kernel`)
SHAKESPEARE = "shakespeare"  # the built-in corpus data.source can name (`fivecut.train.data` reads it)


@dataclass
class DataConfig:
    # "shakespeare", a text/JSONL(.gz|.zst)/Parquet file, a folder, a glob, a saved HF dataset; or a list of them
    source: str | list[str] = SHAKESPEARE
    tokenizer: str = "auto"  # "auto" (model.init_from's own, else "byte") | "gpt2" | "byte"
    cache_dir: str = "~/.cache/fivecut"
    val_fraction: float = 0.05
    document_mask: bool = False  # attention stays inside each end-of-text-separated document; RoPE restarts at each
    text_field: str = "text"  # the JSONL field / Parquet or dataset column that holds each document
    weights: list[float] | None = None  # one per source (a list source); normalised; None: equal
    order: str = "random"  # "random": windows with replacement | "epoch": every token once per pass, shuffled
    shard_tokens: int = 1 << 28  # ids per shard of the token store (`fivecut.data.store`)
    workers: int = 0  # processes that build the token store; 0: one per core
    record_ids: bool = False  # each rank writes the token ids it trains on to log.out_dir/data-ids-rank<R>.jsonl
    # "text": documents | "chat": JSONL conversations ({"messages": [{"role", "content"}, ...]}) rendered with the
    # tokenizer's chat template, the loss on the assistant's replies only (`fivecut.data.chat`)
    format: str = "text"
    chat_template: str | None = None  # with format "chat": a Jinja template file used instead of the tokenizer's


@dataclass
class TrainConfig:
    steps: int = 100
    launch_steps: int = 0  # steps one launch runs at most, then it saves and exits 0 (a resume goes on); 0: all
    global_batch: int = 8  # sequences per optimizer step, over all ranks and micro-steps
    seq_len: int = 128
    accumulate: int = 1  # gradient-accumulation micro-steps per optimizer step
    lr: float = 3e-3
    # the cosine schedule's floor. Unset: MIN_LR_FRACTION (a tenth) of train.lr for a new run, so a lowered lr
    # (fine-tuning) lowers its floor too (3e-4 at the default lr); a resume keeps its checkpoint's floor (a new
    # lr accepted with --override moves no floor). A value given is kept, and must be <= train.lr
    min_lr: float | None = None
    warmup: int = 10
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # global gradient-norm clip; 0 disables
    adamw: str = "auto"  # AdamW's kernel: "auto" (fused wherever torch has one), "fused" or "foreach"
    dtype: str = "fp32"  # "fp32" | "bf16" (autocast compute, fp32 master weights and optimizer state)
    reduce_dtype: str = "fp32"  # dtype of gradient reductions: "fp32" | "bf16"
    recompute: str = "none"  # activation recomputation: "none" | "full" (a block keeps its input) | "selective"
    recompute_every: int = 1  # recompute every k-th transformer block (1: all of them)
    compile: bool = False  # torch.compile each transformer block
    # tokens per chunk of the head and cross-entropy computed together (`fivecut.parallel.loss`); 0: the full
    # logits. Each chunk adds its [V, h] weight gradient into the fp32 one: on an H200 (790 TFLOP/s, 4.3 TB/s)
    # that pass costs about 920/C of the chunk's dW matmul, so 512 made llama-1b's step 10% slower than the
    # full logits, and 2048 a quarter of that (benchmarks/results/gpu.md); a chunk's logits are C*V*10 bytes
    loss_chunk_tokens: int = 2048
    seed: int = 0
    eval_every: int = 50  # 0 disables periodic validation
    eval_batches: int = 8
    bucket_mb: float = 25.0  # DDP gradient bucket size
    collective_timeout: float = 300.0  # seconds one collective waits before the run fails naming it
    on_nonfinite: str = "stop"  # a non-finite loss or gradient norm: "stop" the run, or "skip" the update
    max_skipped: int = 10  # with "skip": stop after this many skipped steps in a row


MIN_LR_FRACTION = 0.1  # train.min_lr left unset: this fraction of train.lr (for a new run)


def lr_floor(t: TrainConfig) -> float:
    """The learning rate the schedule decays to: `t.min_lr` if set, else `MIN_LR_FRACTION` of `t.lr` to 15
    digits (the number a user would write: 3e-4 at lr=3e-3, not the product's 3.0000000000000003e-4)."""
    return float(f"{t.lr * MIN_LR_FRACTION:.15g}") if t.min_lr is None else t.min_lr


def settle_min_lr(t: TrainConfig, saved: dict | None) -> None:
    """Write the floor the run uses into an unset `t.min_lr`: the checkpoint's when resuming (`saved`, its
    config: a resume goes on with its schedule), else `lr_floor`'s; so the run, the config it saves and
    a later resume's comparison all see one number. A checkpoint saved with the floor unset (by code that
    trains without this step: a benchmark's own loop) kept it following its rate: so does the resume. A
    kept floor above a lowered train.lr is refused."""
    if t.min_lr is not None:
        return
    if saved is None:
        t.min_lr = lr_floor(t)
        return
    t.min_lr = saved.get("train", {}).get("min_lr")
    if t.min_lr is None:
        return
    if t.min_lr > t.lr:
        raise ConfigError(
            f"train.lr={t.lr} is below train.min_lr={t.min_lr}, the schedule's floor kept from the checkpoint; "
            f"set train.min_lr <= train.lr too (e.g. train.min_lr={t.lr * MIN_LR_FRACTION:g}) and accept it "
            "with --override train.min_lr"
        )


@dataclass
class LogConfig:
    out_dir: str = "runs/latest"
    progress: bool = True  # progress bar on rank 0
    log_every: int = 10  # a text line in the log every N steps
    peak_tflops: float = 0.0  # per-device peak for MFU; 0 = look it up / measure it
    plot: bool = True  # loss-curve PNG at the end
    sample_prompt: str | None = None  # at the end, print the model's greedy continuation of this text
    sample_tokens: int = 32  # tokens in that sample


@dataclass
class CheckpointConfig:
    """Where and how often the training state is saved; a run resumes from the newest complete one."""

    dir: str | None = None  # None: no checkpoints
    every: int = 0  # save every N steps (0: only at the end of the run)
    keep: int = 2  # complete checkpoints kept (the newest; never fewer than 1, and never the newest verified one)
    verify: bool = True  # re-read a finished save's files against their sha256 before older ones are deleted
    on_error: str = "stop"  # a save that fails on any rank: "stop" the run (exit 2), or "continue" without it
    max_failures: int = 3  # on_error="continue": this many failed saves in a row stop the run (exit 2)
    async_mode: str = "off"  # "off": a save blocks the step; "thread" / "process": written in the background


@dataclass
class LoraConfig:
    """Low-rank adapters (`fivecut.model.lora`): the model's weights frozen, small matrices trained."""

    rank: int | None = None  # the adapters' rank r; unset: no adapters, every weight trains
    alpha: float = 16.0  # the update is scaled by alpha / rank
    dropout: float = 0.0  # dropout on the adapters' input
    targets: list[str] = field(default_factory=lambda: ["attention", "mlp"])  # groups, or weight names (wq, w2...)
    full: list[str] = field(default_factory=list)  # trained whole beside them: "embeddings", "head", "norms"
    adapter: str | None = None  # a peft LoRA folder whose adapters the run starts from (continues)
    quantize: str | None = None  # "nf4": QLoRA, the adapted layers' frozen weights in 4 bits (torchao)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelDims = field(default_factory=ParallelDims)
    moe: MoEOptions = field(default_factory=MoEOptions)
    log: LogConfig = field(default_factory=LogConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> Config:
    """Build a `Config` from defaults, then a TOML file, then `section.key=value` overrides."""
    cfg = Config()
    if path is not None:
        apply_table(cfg, read_toml(Path(path)), origin=str(path))
    for item in overrides:
        key, value = parse_override(item)
        apply_table(cfg, nest(key, value), origin=f"--set {item}")
    return cfg


def read_toml(path: Path) -> dict:
    if path.is_dir():
        raise ConfigError(f"config file {path} is a directory; give a TOML file")
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        return tomllib.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as err:
        raise ConfigError(f"config file {path} is not UTF-8 text ({err}); save it as UTF-8") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path} is not valid TOML: {err}") from None
    except OSError as err:
        raise ConfigError(f"config file {path} cannot be read ({err.strerror or err})") from None


def parse_override(item: str) -> tuple[str, object]:
    """`a.b=3` -> ("a.b", 3); the value is read as a TOML literal, else kept as a string."""
    key, sep, text = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {item!r} is not of the form section.key=value")
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        value = text.strip()
    return key.strip(), value


def nest(dotted: str, value: object) -> dict:
    table: object = value
    for part in reversed(dotted.split(".")):
        table = {part: table}
    return table  # type: ignore[return-value]


def apply_table(obj: object, table: dict, origin: str, prefix: str = "") -> None:
    """Write a (nested) TOML table onto a dataclass tree, checking every key and type."""
    names = [f.name for f in dataclasses.fields(obj)]
    hints = typing.get_type_hints(type(obj))
    for key, value in table.items():
        dotted = f"{prefix}{key}"
        if key not in names:
            raise ConfigError(unknown_key_message(dotted, prefix, names, origin))
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise ConfigError(f"{dotted} is a section; give keys like {dotted}.{names_of(current)[0]} ({origin})")
            apply_table(current, value, origin, prefix=f"{dotted}.")
        else:
            setattr(obj, key, checked_value(dotted, value, hints[key], origin))


def names_of(obj: object) -> list[str]:
    return [f.name for f in dataclasses.fields(obj)]


def unknown_key_message(dotted: str, prefix: str, names: list[str], origin: str) -> str:
    close = closest(dotted.rsplit(".", 1)[-1], names)
    hint = (
        f"; did you mean {' or '.join(prefix + c for c in close)}?"
        if close
        else f"; valid keys: {', '.join(prefix + n for n in names)}"
    )
    return f"unknown config key {dotted} ({origin}){hint}"


def closest(word: str, names: list[str]) -> list[str]:
    """The valid names most similar to `word` (all of them when tied), best first."""
    scored = [(difflib.SequenceMatcher(None, word, n).ratio(), n) for n in names]
    best = max((score for score, _ in scored), default=0.0)
    return [n for score, n in scored if score >= 0.6 and score == best]


def checked_value(dotted: str, value: object, hint: object, origin: str) -> object:
    allowed = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    for kind in allowed:
        if kind is type(None) and value is None:
            return None
        if typing.get_origin(kind) is list:
            (item,) = typing.get_args(kind)
            if isinstance(value, list) and all(type(v) is item for v in value):
                return value
            if item is float and isinstance(value, list) and all(type(v) in (int, float) for v in value):
                return [float(v) for v in value]  # data.weights = [3, 1]
            continue
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if isinstance(kind, type) and type(value) is kind:
            return value
    wanted = " or ".join(k.__name__ if isinstance(k, type) else str(k) for k in allowed if k is not type(None))
    raise ConfigError(f"config key {dotted} wants {wanted}, got {value!r} ({type(value).__name__}) from {origin}")


DEFAULT_PRESET = "tiny"


def preset_args(section: ModelConfig) -> ModelArgs:
    """The preset named by `section.preset`, with every field that is set overriding it. A section
    with `init_from` takes its shape from the file, which is read above the config
    (`fivecut.weights.load.model_args`)."""
    return dataclasses.replace(get_preset(section.preset or DEFAULT_PRESET), **set_fields(section))


MODEL_SOURCES = ("preset", "init_from")


def set_fields(section: ModelConfig) -> dict:
    """The `ModelArgs` fields the section sets, by name."""
    changes = {f.name: getattr(section, f.name) for f in dataclasses.fields(section) if f.name not in MODEL_SOURCES}
    return {k: v for k, v in changes.items() if v is not None}


def model_label(section: ModelConfig) -> str:
    """How logs name the model: its preset or the file it came from."""
    return section.init_from or section.preset or DEFAULT_PRESET
