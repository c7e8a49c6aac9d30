"""Published weights into a model of any layout, and whole models for inference.

A run's ranks build their parts on the meta device and `parallelize`'s materialize step fills
what each holds from the `WeightSource` that `source_of(model.init_from)` opens -- read off its
placement records, exactly the chunks a checkpoint load would ask for
(`fivecut.train.checkpoint.global_chunks`), one box per chunk: a TP rank reads its rows or
columns, an EP rank its experts, a pipeline stage its layers. Before that, `check_source` holds
the file against the model: every tensor the model needs is there with its shape, and every
tensor in the file is used; `load_routing_biases` adds the buffers a MoE export carries.

It sits above the formats: `open_source` dispatches `model.init_from` to `hf.py` or `gguf.py`,
and `model_args` resolves a `[model]` section into its shape, a preset's (`fivecut.config`) or
the file's, so that the config below never opens a weights file.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from fivecut.config import ConfigError, ModelConfig, preset_args, set_fields
from fivecut.model.args import ModelArgs
from fivecut.model.lora import is_adapter
from fivecut.model.transformer import SeedWeights, build_model
from fivecut.train import checkpoint as ckpt
from fivecut.train.tokenizer import AUTO_TOKENIZER, get_tokenizer
from fivecut.weights.dcp import DCPSource
from fivecut.weights.gguf import GGUFSource
from fivecut.weights.hf import HFSource
from fivecut.weights.source import WeightsError, WeightSource, expected_shapes, resolve_path

SCHEMES = {"hf": HFSource, "gguf": GGUFSource, "dcp": DCPSource}


def open_source(spec: str) -> WeightSource:
    """`hf:PATH` (a Hugging Face folder), `gguf:PATH` (a llama.cpp file) or `dcp:PATH` (a fivecut
    checkpoint: its weights); PATH may be `pkg:MODULE/FILE`, a file shipped inside an installed
    package (`resolve_path`)."""
    scheme, sep, rest = spec.partition(":")
    if not sep or scheme not in SCHEMES or not rest:
        raise WeightsError(f"model.init_from {spec!r} is not hf:PATH, gguf:PATH or dcp:PATH (e.g. hf:./my-llama)")
    path = resolve_path(rest)
    if not path.exists():
        raise WeightsError(f"model.init_from {spec!r}: {path} does not exist")
    source = SCHEMES[scheme](path)
    base = frozen_base(source)
    return source if base is None else LayeredSource(source, base)


def frozen_base(source):
    """Where a [lora] run's checkpoint keeps its frozen weights (it holds the trained tensors only):
    its run's model.init_from, or the seed's model; None for any other source."""
    config = source.meta.get("config", {}) if isinstance(source, DCPSource) else {}
    if not (config.get("lora") or {}).get("rank"):
        return None
    init_from = config.get("model", {}).get("init_from")
    if init_from is not None:
        return source_of(init_from)
    return SeedWeights(source.args, config.get("train", {}).get("seed", 0))


class LayeredSource:
    """A [lora] checkpoint over the model its run started from: the checkpoint's tensors (adapters,
    weights trained whole) from it, every other one from `base`."""

    def __init__(self, top, base):
        self.top, self.base, self.path, self.args = top, base, top.path, top.args

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return expected_shapes(self.args) | self.top.shapes()

    def buffer_shapes(self) -> dict[str, tuple[int, ...]]:
        return self.top.buffer_shapes()

    def read(self, name: str, box) -> torch.Tensor:
        held = name in self.top.shapes() or name in self.top.buffer_shapes()  # a routing bias: the run's
        return (self.top if held else self.base).read(name, box)

    def fill(self, requests) -> None:
        mine = self.top.shapes()
        self.top.fill([r for r in requests if r[0] in mine])
        self.base.fill([r for r in requests if r[0] not in mine])

    def tokenizer(self):
        return self.top.tokenizer() or getattr(self.base, "tokenizer", lambda: None)()


@functools.lru_cache(maxsize=8)
def _opened(spec: str, stamp: tuple) -> WeightSource:
    return open_source(spec)


def source_of(spec: str) -> WeightSource:
    """The source `spec` names, opened once per process while its file is unchanged."""
    scheme, _, rest = spec.partition(":")
    try:
        path = resolve_path(rest)
    except ModuleNotFoundError as err:
        raise WeightsError(f"model.init_from {spec!r}: {err}") from None
    stamp = (path.stat().st_mtime_ns, path.stat().st_size) if path.exists() else None
    return _opened(spec, stamp)


def model_args(section: ModelConfig) -> ModelArgs:
    """The model a `[model]` section describes: its preset with every field that is set overriding it
    (`fivecut.config.preset_args`); with `init_from`, the shape its file implies (a field set to
    another value is a ConfigError)."""
    if section.init_from is None:
        return preset_args(section)
    if section.preset is not None:
        raise ConfigError(
            f"model.preset={section.preset!r} and model.init_from={section.init_from!r} are both set; the shape comes "
            "from the file, so drop model.preset"
        )
    return file_args(section.init_from, set_fields(section))


def file_args(init_from: str, changes: dict) -> ModelArgs:
    """The shape of the model `init_from` names, checked against the fields set explicitly."""
    args = source_args(init_from)
    differ = [
        f"model.{k}={v!r} but the file has {getattr(args, k)!r}" for k, v in changes.items() if v != getattr(args, k)
    ]
    if differ:
        raise ConfigError(
            f"model.init_from={init_from!r}: " + "; ".join(differ) + " (the shape comes from the file; drop these keys)"
        )
    return args


def source_args(spec: str) -> ModelArgs:
    """The model shape `model.init_from = spec` implies (checked against the file's tensors)."""
    source = source_of(spec)
    check_source(source, source.args)
    return source.args


def check_source(source: WeightSource, args: ModelArgs) -> None:
    """Every tensor of a model of shape `args` is in the file with its shape, and nothing else is."""
    want, have = expected_shapes(args), source.shapes()
    missing = sorted(want.keys() - have.keys())
    if missing:
        raise WeightsError(f"{source.path} lacks tensor {missing[0]} (and {len(missing) - 1} more) of the model")
    unused = sorted(n for n in have.keys() - want.keys() if not is_adapter(n))  # adapters: `adapter_problem`
    if unused:
        raise WeightsError(f"{source.path} holds tensor {unused[0]}, which this model has no place for")
    for name, shape in want.items():
        if tuple(have[name]) != shape:
            raise WeightsError(
                f"{source.path}: tensor {name} has shape {tuple(have[name])}, the model's config implies {shape}"
            )


def adapter_problem(spec: str, lora) -> str | None:
    """A source holding adapters (a [lora] run's checkpoint) used without [lora], or with another
    rank: its adapters would be dropped or misread."""
    source = source_of(spec)
    held = {n: s for n, s in source.shapes().items() if is_adapter(n)}
    if not held:
        return None
    rank = next(s[0] for n, s in held.items() if n.endswith("lora_a"))
    if lora.rank != rank:
        return (
            f"model.init_from {spec!r} holds adapters of rank {rank} (a [lora] run's); set lora.rank={rank} to "
            "continue them, or export the model merged (`fivecut export`) and start from that"
        )
    return None


def load_routing_biases(par, source: WeightSource) -> int:
    """A fivecut MoE export's routing biases into each MoE layer this rank runs (the same everywhere)."""
    buffers, read = source.buffer_shapes(), 0
    for layer, runtime in par.experts.runtimes.items() if par.experts is not None else ():
        name = f"layers.{layer}.feed_forward.expert_bias"
        if name in buffers:
            runtime.moe.expert_bias.copy_(source.read(name, full_box(buffers[name])))
            read += buffers[name][0]
    return read


def run_tokenizer(data_tokenizer: str, init_from: str | None):
    """The tokenizer a run reads its data with: data.tokenizer, where "auto" is the imported
    model's own (an error when its file has none) or, without an import, "byte"."""
    if data_tokenizer != AUTO_TOKENIZER:
        return get_tokenizer(data_tokenizer)
    if init_from is None:
        return get_tokenizer("byte")
    tok = source_of(init_from).tokenizer()
    if tok is None:
        raise WeightsError(
            f"model.init_from={init_from!r} has no tokenizer (no tokenizer.json); set data.tokenizer to gpt2 or byte"
        )
    return tok


def single_model(
    init_from: str | None = None, checkpoint: str | None = None, step: int | None = None, device: str = "cpu"
):
    """A whole model on one device for inference, with its tokenizer (None if a published model's
    file has none): from a published model
    (`init_from`) or from a fivecut checkpoint (a checkpoint folder or a checkpoint.dir, `step`
    choosing one of the latter's)."""
    if (init_from is None) == (checkpoint is None):
        raise ValueError("give exactly one of --init-from and --checkpoint")
    if init_from is not None:
        source = source_of(init_from)
        args = source_args(init_from)
        shapes = expected_shapes(args) | source.buffer_shapes()
        tensors = {name: source.read(name, full_box(shape)) for name, shape in shapes.items()}
        tokenizer = source.tokenizer()  # None when the file has none
    else:
        args, tensors, tokenizer = checkpoint_model(Path(checkpoint).expanduser(), step)
    model = build_model(args, device="meta")
    model.to_empty(device=device)
    model.init_buffers()
    model.tie_weights()
    fill(model, tensors)
    return model.eval(), tokenizer


def checkpoint_model(path: Path, step: int | None):
    """(ModelArgs, full tensors by name, tokenizer) of the checkpoint at `path`."""
    path = ckpt.find_checkpoint(path, step)
    meta = ckpt.read_meta(path)
    args = ModelArgs(**meta["model"])
    data, model = meta["config"]["data"], meta["config"]["model"]
    tensors = ckpt.full_state(path)
    if args.is_moe:  # the routing biases of auxiliary-loss-free balancing: selection depends on them
        biases = ckpt.full_state(path, "moe.")  # "<layer>.expert_bias"
        tensors |= {f"layers.{key.split('.')[0]}.feed_forward.expert_bias": t for key, t in biases.items()}
    return args, tensors, run_tokenizer(data["tokenizer"], model.get("init_from"))


def full_box(shape: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(0, n) for n in shape)


@torch.no_grad()
def fill(model, tensors: dict[str, torch.Tensor]) -> None:
    """Every parameter of `model` from `tensors` (by logical name; a tied head is its embedding)."""
    for name, p in model.named_parameters():
        if name not in tensors:
            raise WeightsError(f"no tensor {name} for the model")
        p.copy_(tensors[name])
    for name, buffer in model.named_buffers():
        if name in tensors:  # MoE routing biases
            buffer.copy_(tensors[name])
