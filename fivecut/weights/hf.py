"""Hugging Face Llama folders: `config.json` <-> `ModelArgs`, and safetensors read by slices.

Reading needs no model class: the shape comes from `config.json`, the tensors from
`model.safetensors` or the shards named in `model.safetensors.index.json`, each box read with
`safe_open(...).get_slice`, so a rank touches only the bytes of its slices.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from fivecut.model.args import ModelArgs
from fivecut.train.tokenizer import TOKENIZERS, FileTokenizer, get_tokenizer
from fivecut.weights import moe_architectures as moe
from fivecut.weights.names import from_hf
from fivecut.weights.source import WeightsError

LLAMA_ARCHITECTURE = "LlamaForCausalLM"


def llama_config(args: ModelArgs, torch_dtype: str = "float32", bos: int | None = None, eos: int | None = None) -> dict:
    """The `config.json` of a `LlamaForCausalLM` with fivecut's dense shape `args`."""
    if args.is_moe:
        raise ValueError("a mixture-of-experts model has no Hugging Face Llama config; export it as fivecut tensors")
    return {
        "architectures": [LLAMA_ARCHITECTURE],
        "model_type": "llama",
        "vocab_size": args.vocab_size,
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": args.max_seq_len,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,  # transformers < 5
        "rope_parameters": {"rope_type": "default", "rope_theta": args.rope_theta},  # transformers >= 5
        "tie_word_embeddings": args.tie_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "initializer_range": args.init_std,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "torch_dtype": torch_dtype,
    }


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
    """fivecut's shape of the Llama that `config` (a parsed config.json at `path`) describes, or of
    the model a fivecut export's `config.json` records (its "fivecut" entry: every ModelArgs field)."""
    if is_fivecut(config):
        return fivecut_args(config, path)
    if moe.for_config(config) is not None:  # Mixtral, Qwen3-MoE, DeepSeek-V3
        return moe.for_config(config).args(config, path)
    check_llama(config, path)
    dim, heads = need(config, "hidden_size", path), need(config, "num_attention_heads", path)
    head_dim = optional(config, "head_dim", None, path) or dim // max(heads, 1)
    if head_dim * heads != dim:
        raise WeightsError(
            f"{path}: head_dim {head_dim} x {heads} heads != hidden_size {dim}; fivecut's attention needs "
            f"head_dim = hidden_size / num_attention_heads"
        )
    return ModelArgs(
        vocab_size=need(config, "vocab_size", path),
        dim=dim,
        n_layers=need(config, "num_hidden_layers", path),
        n_heads=heads,
        n_kv_heads=optional(config, "num_key_value_heads", None, path) or heads,
        ffn_dim=need(config, "intermediate_size", path),
        max_seq_len=optional(config, "max_position_embeddings", 2048, path),
        rope_theta=float(rope_theta(config, path)),
        norm_eps=float(optional(config, "rms_norm_eps", 1e-6, path, float)),
        tie_embeddings=optional(config, "tie_word_embeddings", False, path, bool),
        init_std=float(optional(config, "initializer_range", 0.02, path, float)),
    )


def fivecut_args(config: dict, path: Path) -> ModelArgs:
    fields = {f.name for f in dataclasses.fields(ModelArgs)}
    record = config.get(FIVECUT_TYPE)
    if not isinstance(record, dict) or not record.keys() <= fields:
        raise WeightsError(f"{path}: model_type {FIVECUT_TYPE!r} without a valid 'fivecut' record of ModelArgs fields")
    defaults = ModelArgs()
    return ModelArgs(**{k: optional(record, k, v, path, type(v)) for k, v in dataclasses.asdict(defaults).items()})


def check_llama(config: dict, path: Path) -> None:
    archs = config.get("architectures") or []
    model_type = config.get("model_type")
    if model_type != "llama" or (archs and LLAMA_ARCHITECTURE not in archs):
        found = ", ".join(archs) or f"model_type {model_type!r}"
        raise WeightsError(
            f"{path} describes {found}, not a Llama ({LLAMA_ARCHITECTURE}); fivecut imports Llama-architecture models"
        )
    for key, fine in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
        if config.get(key, fine) != fine:
            raise WeightsError(f"{path}: {key} is {config[key]!r}; fivecut's Llama has {fine!r}")


def need(config: dict, key: str, path: Path, kind: type = int):
    if key not in config:
        raise WeightsError(f"{path} has no {key!r}; it is not a complete Llama config")
    return optional(config, key, None, path, kind)


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


def rope_theta(config: dict, path: Path) -> float:
    """The RoPE base; only unscaled ("default") RoPE is fivecut's."""
    params = optional(config, "rope_parameters", None, path, dict) or optional(config, "rope_scaling", {}, path, dict)
    kind = params.get("rope_type", params.get("type", "default"))
    if kind != "default":
        raise WeightsError(f"{path}: rope scaling {kind!r} is not supported; fivecut implements unscaled RoPE")
    return optional(params, "rope_theta", None, path, float) or optional(config, "rope_theta", 10000.0, path, float)


class HFSource:
    """A Hugging Face Llama folder as a `WeightSource` (see `fivecut.weights.source`)."""

    def __init__(self, folder: Path):
        if not folder.is_dir():
            raise WeightsError(f"{folder} is not a folder; hf:PATH names a Hugging Face model folder")
        self.path = folder
        config = read_config(folder)
        self.tokenizer_name = config.get("fivecut_tokenizer")  # a fivecut export with no tokenizer files
        # a mixture-of-experts class (fivecut.weights.moe_architectures): its tensors are `Stored` records
        self.architecture, self.stored, self.stored_buffers = moe.for_config(config), {}, {}
        self.args = args_from_config(config, folder / "config.json")
        self.files = weight_files(folder)  # Hugging Face name -> the safetensors file holding it
        if self.architecture is not None:
            layout = moe.layout(self.architecture, self.args, config, self.files, folder)
            self.stored, self.stored_buffers = layout
            self.names, self.buffers = dict.fromkeys(self.stored), dict.fromkeys(self.stored_buffers)
        elif is_fivecut(config):  # fivecut's names already; the routing biases are buffers, not parameters
            self.names = {n: n for n in self.files if not n.endswith(BIAS)}
            self.buffers = {n: n for n in self.files if n.endswith(BIAS)}
        else:
            self.names = fivecut_names(self.files, self.args, folder)  # fivecut name -> Hugging Face name
            self.buffers = {}
        self._shapes: dict[str, tuple[int, ...]] | None = None
        self._tokenizer = None
        self._handles: dict[Path, object] = {}

    def shapes(self) -> dict[str, tuple[int, ...]]:
        if self._shapes is None and self.stored:
            self._shapes = {ours: stored.shape(self._slice) for ours, stored in self.stored.items()}
        if self._shapes is None:
            self._shapes = {ours: self._slice(theirs).get_shape() for ours, theirs in self.names.items()}
            self._shapes = {k: tuple(v) for k, v in self._shapes.items()}
        return self._shapes

    def buffer_shapes(self) -> dict[str, tuple[int, ...]]:
        """Buffers the file holds besides the parameters (MoE routing biases)."""
        if self.stored_buffers:
            return {ours: stored.shape(self._slice) for ours, stored in self.stored_buffers.items()}
        return {name: tuple(self._slice(name).get_shape()) for name in self.buffers}

    def read(self, name: str, box) -> torch.Tensor:
        stored = self.stored.get(name) or self.stored_buffers.get(name)
        if stored is not None:
            return stored.read(self._slice, box).float()
        return self._slice(self.names.get(name) or self.buffers[name])[box].float()

    def _slice(self, hf_name: str):
        return self._open(self.files[hf_name]).get_slice(hf_name)

    def _open(self, file: Path):
        """One open handle per file, kept for the source's life."""
        if file not in self._handles:
            from safetensors import SafetensorError, safe_open

            try:
                self._handles[file] = safe_open(str(file), framework="pt")
            except (SafetensorError, OSError) as err:
                raise WeightsError(f"{file} is not a safetensors file: {err}") from None
        return self._handles[file]

    def tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = folder_tokenizer(self.path)
        if self._tokenizer is None and self.tokenizer_name in TOKENIZERS:
            self._tokenizer = get_tokenizer(self.tokenizer_name)
        return self._tokenizer


def weight_files(folder: Path) -> dict[str, Path]:
    """Hugging Face tensor name -> the safetensors file that holds it (sharded or not)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise WeightsError(f"{index} is not a safetensors index: no weight_map of tensor name -> file name")
        files = {name: folder / file for name, file in weight_map.items()}
    elif (folder / "model.safetensors").is_file():
        files = {name: folder / "model.safetensors" for name in tensor_names(folder / "model.safetensors")}
    else:
        raise WeightsError(f"{folder} holds neither model.safetensors nor model.safetensors.index.json")
    for file in set(files.values()):
        if not file.is_file():
            raise WeightsError(f"{file} is named in {index.name} but does not exist")
    return files


def tensor_names(file: Path) -> list[str]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(file), framework="pt") as f:
            return list(f.keys())
    except (SafetensorError, OSError) as err:
        raise WeightsError(f"{file} is not a safetensors file: {err}") from None


def fivecut_names(files: dict[str, Path], args: ModelArgs, folder: Path) -> dict[str, str]:
    """fivecut name -> Hugging Face name. A tensor fivecut has no place for is an error; a stored
    copy of a tied head (`lm_head.weight` beside a tied embedding) is left unread."""
    out, unknown = {}, []
    for theirs in files:
        ours = from_hf(theirs)
        if ours == "output.weight" and args.tie_embeddings:
            continue
        if ours is None:
            unknown.append(theirs)
        else:
            out[ours] = theirs
    if unknown:
        raise WeightsError(f"{folder}: tensors {', '.join(sorted(unknown)[:5])} have no place in a Llama model")
    return out


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
    return FileTokenizer(tok, eos_id(folder, tok), str(path))


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
