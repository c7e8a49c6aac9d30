"""Hugging Face model folders: `config.json` -> `ModelArgs` through the registry of classes
(`fivecut.weights.architectures`), and safetensors read by slices.

Reading needs no model class: the shape comes from `config.json`, the tensors from
`model.safetensors` or the shards named in `model.safetensors.index.json`, each box read by
positioned reads of whole rows in bounded blocks (`fivecut.weights.safetensors_file`), so a rank
keeps only its slices.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import torch

from fivecut.model.args import ModelArgs
from fivecut.train.tokenizer import TOKENIZERS, FileTokenizer, get_tokenizer
from fivecut.weights import gemma  # noqa: F401  (registers Gemma 2 and Gemma 3)
from fivecut.weights import moe_architectures as moe
from fivecut.weights.architectures import LLAMA, AnyArchitecture, ArchitectureError, TensorMap, read_args
from fivecut.weights.fp8 import SCALE, BlockScaled, fp8_blocks, split_scales
from fivecut.weights.mxfp4 import is_mxfp4
from fivecut.weights.safetensors_file import NotSafetensors, StoredTensor, read_header
from fivecut.weights.source import Request, WeightsError, expected_shapes, fill_each, optional

INDEX = "model.safetensors.index.json"


def llama_config(args: ModelArgs, torch_dtype: str = "float32", bos: int | None = None, eos: int | None = None) -> dict:
    """The `config.json` of a `LlamaForCausalLM` with fivecut's dense shape `args`."""
    problem = LLAMA.holds(args)
    if problem:
        raise ValueError(f"this model has no Hugging Face Llama config: {problem}")
    return hf_config(LLAMA, args, torch_dtype, bos, eos)


def hf_config(architecture: AnyArchitecture, args: ModelArgs, dtype: str, bos: int | None, eos: int | None) -> dict:
    """`architecture`'s config.json of a model of shape `args`, with its dtype and special token ids."""
    to_config = architecture.config if isinstance(architecture, moe.Architecture) else architecture.to_config
    return to_config(args) | {"bos_token_id": bos, "eos_token_id": eos, "torch_dtype": dtype}


def read_config(folder: Path) -> dict:
    path = folder / "config.json"
    if not path.is_file():
        raise WeightsError(f"{folder} has no config.json; give a Hugging Face model folder (save_pretrained's output)")
    return read_json(path)


def read_json(path: Path) -> dict:
    """The JSON object in the file `path`; WeightsError naming it when it is not one."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise WeightsError(f"{path} cannot be read as JSON: {err}") from None
    if not isinstance(value, dict):
        raise WeightsError(f"{path} holds a JSON {type(value).__name__}, not an object of keys; is it the right file?")
    return value


FIVECUT_TYPE = "fivecut"  # model_type of fivecut's own export of a model no Hugging Face class reads (MoE)
BIAS = "expert_bias"  # `layers.N.feed_forward.expert_bias` in a fivecut export: MoE routing biases (buffers)


def is_fivecut(config: dict) -> bool:
    return config.get("model_type") == FIVECUT_TYPE


def args_from_config(config: dict, path: Path) -> ModelArgs:
    """fivecut's shape of the model that `config` (a parsed config.json at `path`) describes: a class
    of the registry (`fivecut.weights.architectures`), or a fivecut export's own record (its
    "fivecut" entry: every ModelArgs field)."""
    if is_fivecut(config):
        return fivecut_args(config, path)
    return architecture_args(config, path)[1]


def architecture_args(config: dict, path: Path) -> tuple[AnyArchitecture, ModelArgs]:
    try:
        return read_args(config, path)
    except ArchitectureError as err:
        raise WeightsError(str(err)) from None


def fivecut_args(config: dict, path: Path) -> ModelArgs:
    fields = {f.name for f in dataclasses.fields(ModelArgs)}
    record = config.get(FIVECUT_TYPE)
    if not isinstance(record, dict) or not record.keys() <= fields:
        raise WeightsError(f"{path}: model_type {FIVECUT_TYPE!r} without a valid 'fivecut' record of ModelArgs fields")
    defaults = ModelArgs()
    values = dataclasses.asdict(defaults)
    kinds = {k: list if isinstance(v, tuple) else type(v) for k, v in values.items()}  # JSON writes tuples as lists
    return ModelArgs(**{k: optional(record, k, v, path, kinds[k]) for k, v in values.items()})


class HFSource:
    """A Hugging Face model folder as a `WeightSource` (see `fivecut.weights.source`): a class of the
    registry (`fivecut.weights.architectures`) or a fivecut export of a shape no class holds."""

    def __init__(self, folder: Path):
        if not folder.is_dir():
            raise WeightsError(f"{folder} is not a folder; hf:PATH names a Hugging Face model folder")
        self.path = folder
        config = read_config(folder)
        self.tokenizer_name = config.get("fivecut_tokenizer")  # a fivecut export with no tokenizer files
        self.files = weight_files(folder)  # Hugging Face name -> the safetensors file holding it
        # MXFP4 experts (GPT-OSS): their readers dequantize them (`fivecut.weights.mxfp4`)
        if is_mxfp4(config, folder / "config.json"):
            config = {k: v for k, v in config.items() if k != "quantization_config"}
        self.fp8_block = fp8_blocks(config, folder / "config.json")  # block-scaled fp8 weights (`fivecut.weights.fp8`)
        self.scales: dict[str, str] = {}  # a quantized weight's name -> its scale tensor's
        if self.fp8_block is not None:
            self.files, self.scales = split_scales(self.files)
            config = {k: v for k, v in config.items() if k != "quantization_config"}
        self._handles: dict[Path, dict[str, StoredTensor]] = {}  # file -> its tensors (`read_header`)
        # a mixture-of-experts class's tensors and routing biases: fivecut name -> `moe.Stored`
        self.stored: dict[str, moe.Stored] = {}
        self.stored_buffers: dict[str, moe.Stored] = {}
        self.maps: dict[str, TensorMap] = {}
        self.buffers: dict[str, str] = {}
        if is_fivecut(config):  # fivecut's names already; the routing biases are buffers, not parameters
            self.architecture, self.args = None, fivecut_args(config, folder / "config.json")
            self.maps = {n: TensorMap(n, (n,)) for n in self.files if not n.endswith(BIAS)}
            self.buffers = {n: n for n in self.files if n.endswith(BIAS)}
        else:
            self.architecture, self.args = architecture_args(config, folder / "config.json")
            if isinstance(self.architecture, moe.Architecture):  # every tensor's place checked by its layout
                layout = moe.layout(self.architecture, self.args, config, self.files, folder)
                self.stored, self.stored_buffers = layout
            else:
                self.maps = {m.ours: m for m in self.architecture.tensors(self.args)}  # fivecut name -> its tensors
                check_tensors(self, expected_shapes(self.args))
        self._shapes: dict[str, tuple[int, ...]] | None = None
        self._tokenizer = None

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """fivecut name -> global shape, from the Hugging Face tensors' shapes (stacked over experts)."""
        if self._shapes is None and self.stored:
            self._shapes = {ours: stored.shape(self._slice) for ours, stored in self.stored.items()}
        if self._shapes is None:
            self._shapes = {ours: self.fivecut_shape(m) for ours, m in self.maps.items()}
        return self._shapes

    def fivecut_shape(self, m: TensorMap) -> tuple[int, ...]:
        one = tuple(self._slice(m.theirs[0]).get_shape())
        if m.rows:  # a row block of a fused projection
            return (m.rows[1], *one[1:])
        one = (*one[:-2], one[-1], one[-2]) if m.transposed else one
        return (len(m.theirs), *one) if m.stacked else one

    def buffer_shapes(self) -> dict[str, tuple[int, ...]]:
        """Buffers the file holds besides the parameters (MoE routing biases)."""
        if self.stored_buffers:
            return {ours: stored.shape(self._slice) for ours, stored in self.stored_buffers.items()}
        return {name: tuple(self._slice(name).get_shape()) for name in self.buffers}

    def fill(self, requests: list[Request]) -> None:
        fill_each(self, requests)

    def read(self, name: str, box) -> torch.Tensor:
        if name in self.buffers:
            return self._slice(name)[box].float()
        m = self.maps.get(name)
        if m is None:  # a mixture-of-experts class's tensor or routing bias
            stored = self.stored.get(name) or self.stored_buffers[name]
            return stored.read(self._slice, box).float()
        if m.rows:  # the box's rows of ours, inside the fused tensor: only those are read
            first, last, _ = box[0].indices(m.rows[1])
            box = (slice(m.rows[0] + first, m.rows[0] + last), *box[1:])
        if not m.stacked:
            return self._read_one(m.theirs[0], box, m.transposed) + m.offset  # offset: Gemma's (1 + w) norms
        experts = range(*box[0].indices(len(m.theirs)))  # only the experts in the box are opened
        return torch.stack([self._read_one(m.theirs[e], box[1:], m.transposed) for e in experts])

    def _read_one(self, hf_name: str, box, transposed: bool) -> torch.Tensor:
        if not transposed:
            return self._slice(hf_name)[box].float()
        swapped = (*box[:-2], box[-1], box[-2])  # the box of the stored [.., in, out]-swapped tensor
        return self._slice(hf_name)[swapped].float().transpose(-1, -2)

    def where(self, hf_name: str) -> str:
        return f"{hf_name} in {self.files[hf_name].name}"

    def _slice(self, hf_name: str) -> StoredTensor | BlockScaled:
        tensor = self._stored(hf_name, self.files)
        if hf_name not in self.scales:
            if tensor.dtype.itemsize == 1 and tensor.dtype.is_floating_point:
                raise WeightsError(
                    f"{self.files[hf_name]}: tensor {hf_name} is fp8 without a {hf_name}{SCALE} beside it (and a "
                    "quantization_config); its values would be read unscaled"
                )
            return tensor
        scaled = BlockScaled(tensor, self._stored(self.scales[hf_name], self.scale_files), self.fp8_block)
        scaled.check(hf_name)
        return scaled

    def _stored(self, hf_name: str, files: dict[str, Path]) -> StoredTensor:
        tensor = self._open(files[hf_name]).get(hf_name)
        if tensor is None:
            raise WeightsError(f"{files[hf_name]} holds no tensor {hf_name}, which its index names")
        return tensor

    @functools.cached_property
    def scale_files(self) -> dict[str, Path]:
        return {name: file for name, file in weight_files(self.path).items() if name in set(self.scales.values())}

    def _open(self, file: Path) -> dict[str, StoredTensor]:
        """Each file's header read once, kept for the source's life (no file stays open)."""
        if file not in self._handles:
            self._handles[file] = tensor_header(file)
        return self._handles[file]

    def tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = folder_tokenizer(self.path)
        if self._tokenizer is None and self.tokenizer_name in TOKENIZERS:
            self._tokenizer = get_tokenizer(self.tokenizer_name)
        return self._tokenizer


def weight_files(folder: Path) -> dict[str, Path]:
    """Hugging Face tensor name -> the safetensors file that holds it (sharded or not)."""
    index = folder / INDEX
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise WeightsError(f"{index} is not a safetensors index: no weight_map of tensor name -> file name")
        files = {name: folder / file for name, file in weight_map.items()}
    elif (folder / "model.safetensors").is_file():
        files = {name: folder / "model.safetensors" for name in tensor_names(folder / "model.safetensors")}
    else:
        raise WeightsError(f"{folder} holds neither model.safetensors nor model.safetensors.index.json")
    for name, file in files.items():
        if not file.is_file():
            raise WeightsError(f"{index}: tensor {name} is in {file.name}, which does not exist")
    return files


def tensor_header(file: Path) -> dict[str, StoredTensor]:
    try:
        return read_header(file)
    except NotSafetensors as err:
        raise WeightsError(str(err)) from None


def tensor_names(file: Path) -> list[str]:
    return list(tensor_header(file))


def check_tensors(source: HFSource, expected: dict[str, tuple[int, ...]]) -> None:
    """Every tensor the class has for this config is in the folder with its shape, and nothing else
    is (a stored copy of a tied head, `lm_head.weight`, is left unread): one line naming the tensor
    and its file (WeightsError), before any rank opens a weight."""
    index = INDEX if (source.path / INDEX).is_file() else "model.safetensors"
    wanted = {theirs for m in source.maps.values() for theirs in m.theirs}
    for m in source.maps.values():
        for theirs in m.theirs:
            if theirs not in source.files:
                raise WeightsError(f"{source.path}: tensor {theirs} (fivecut's {m.ours}) is missing from {index}")
            shape = tuple(source._slice(theirs).get_shape())
            if shape != m.hf_shape(expected[m.ours]):
                raise WeightsError(
                    f"{source.path}: tensor {source.where(theirs)} has shape {shape}, but config.json implies "
                    f"{m.hf_shape(expected[m.ours])}"
                )
    tied_copy = {"lm_head.weight"} if source.args.tie_embeddings else set()
    unknown = sorted(n for n in source.files if n not in wanted | tied_copy)
    if unknown:
        raise WeightsError(
            f"{source.path}: tensor {source.where(unknown[0])} has no place in fivecut's {source.architecture.hf_class}"
        )


def folder_tokenizer(folder: Path):
    """The folder's `tokenizer.json` as a `FileTokenizer`, or None when it has none."""
    path = folder / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as err:  # tokenizers raises its own exception type
        raise WeightsError(f"{path} cannot be read by the tokenizers library: {err}") from None
    return FileTokenizer(tok, eos_id(folder, tok), str(path), chat_template(folder), special_tokens(folder))


def special_tokens(folder: Path) -> dict[str, str]:
    """tokenizer_config.json's bos_token and eos_token (a string, or an added token's record with its
    "content"): the names chat templates write them by (`{{ bos_token }}`)."""
    config = folder / "tokenizer_config.json"
    table = read_json(config) if config.is_file() else {}
    found = {}
    for name in ("bos_token", "eos_token"):
        value = table.get(name)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            found[name] = value
    return found


def chat_template(folder: Path) -> str | None:
    """The folder's chat template: `chat_template.jinja` (transformers >= 4.43 writes it), else
    tokenizer_config.json's "chat_template" (a string, or a list of named templates: "default")."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    config = folder / "tokenizer_config.json"
    template = read_json(config).get("chat_template") if config.is_file() else None
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is not None and not isinstance(template, str):
        raise WeightsError(f"{config}: chat_template is {type(template).__name__}, not a Jinja string")
    return template


def eos_id(folder: Path, tok) -> int | None:
    """The end-of-text id: generation_config.json's or config.json's eos_token_id, else none."""
    for name in ("generation_config.json", "config.json"):
        if not (folder / name).is_file():
            continue
        eos = read_json(folder / name).get("eos_token_id")
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        if isinstance(eos, int):
            return eos
    return None
