"""`fivecut export`: a checkpoint as a folder that Hugging Face `from_pretrained` reads.

The checkpoint's weights are read whole in one process (`checkpoint.full_state`: DCP's global,
single-device tensors, whatever layout saved them), checked against the shapes the model's
`ModelArgs` imply, and written with `safetensors`:

    config.json                    LlamaForCausalLM's config (dense), or fivecut's own (MoE)
    generation_config.json         the tokenizer's bos/eos ids
    model.safetensors              or model-0000K-of-0000N.safetensors + model.safetensors.index.json
    tokenizer.json, tokenizer_config.json, special_tokens_map.json   when the run's tokenizer has a form
                                   Hugging Face reads (GPT-2's BPE; a model's own tokenizer.json)

A dense model's tensors take Hugging Face Llama's names (`fivecut.weights.names`):

    fivecut                               Hugging Face
    tok_embeddings.weight                 model.embed_tokens.weight
    layers.N.attention_norm.weight        model.layers.N.input_layernorm.weight
    layers.N.attention.wq.weight          model.layers.N.self_attn.q_proj.weight   (wk, wv, wo: k/v/o_proj)
    layers.N.ffn_norm.weight              model.layers.N.post_attention_layernorm.weight
    layers.N.feed_forward.w1.weight       model.layers.N.mlp.gate_proj.weight
    layers.N.feed_forward.w3.weight       model.layers.N.mlp.up_proj.weight
    layers.N.feed_forward.w2.weight       model.layers.N.mlp.down_proj.weight
    norm.weight                           model.norm.weight
    output.weight                         lm_head.weight   (absent when tied: tie_word_embeddings true)

fivecut's model and Hugging Face's Llama share the rotate-half RoPE and the [out, in] layout of
every linear weight, so no tensor is permuted or transposed. The vocabulary is never padded: a
checkpoint holds global tensors, however a layout padded them for its cuts.

A mixture-of-experts model matches no Hugging Face class. It is written under fivecut's own names
(the list above, plus `layers.N.feed_forward.router.weight`, the stacked experts
`layers.N.feed_forward.experts.w1|w3|w2` [E, dim, hidden] / [E, hidden, dim], the shared experts
`layers.N.feed_forward.shared.w1|w3|w2.weight`, and the auxiliary-loss-free routing biases
`layers.N.feed_forward.expert_bias` that expert selection adds), with a config.json whose
"fivecut" entry holds every ModelArgs field.

The folder appears whole or not at all: it is written next to `out` under a temporary name and
renamed at the end; an `out` that exists and is not empty is refused, never overwritten.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch

from fivecut.model.args import ModelArgs
from fivecut.train import checkpoint as ckpt
from fivecut.train.checkpoint import CheckpointError
from fivecut.train.tokenizer import FileTokenizer, GPT2Tokenizer, gpt2_files
from fivecut.weights import moe_architectures as moe
from fivecut.weights import names
from fivecut.weights.hf import LLAMA_ARCHITECTURE, llama_config
from fivecut.weights.load import run_tokenizer as resolve_tokenizer
from fivecut.weights.source import expected_shapes

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DEFAULT_SHARD_BYTES = 5 * 2**30
MOE_ARCHITECTURE = "FivecutMoEForCausalLM"
SAFETENSORS = "model.safetensors"
INDEX = "model.safetensors.index.json"
GPT2_SPECIAL = "<|endoftext|>"
UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
UNITS |= {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


class ExportError(ValueError):
    """An export that cannot be done as asked; the message names the path or flag and a fix."""


def export(
    checkpoint: Path,
    out: Path,
    step: int | None = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    dtype: str = "fp32",
) -> Path:
    """Write the checkpoint `checkpoint` (a step-N folder, or a checkpoint.dir: its newest complete
    checkpoint, or step `step`) as a Hugging Face folder `out`; returns `out`."""
    out = Path(out).expanduser()
    check_out(out)
    check_options(max_shard_bytes, dtype)
    source = ckpt.find_checkpoint(Path(checkpoint).expanduser(), step)
    meta = ckpt.read_meta(source)
    args = model_args(source, meta)
    tokenizer = run_tokenizer(meta.get("config", {}))
    spelled = str(DTYPES[dtype]).removeprefix("torch.")  # "float32", as config.json spells it
    arch = moe_class(source, args)
    if arch is not None:  # a MoE class of Hugging Face: written shard by shard from the checkpoint
        written = write_atomically(
            out, lambda tmp: write_moe_folder(tmp, source, arch, args, spelled, tokenizer, max_shard_bytes)
        )
    else:
        tensors = checkpoint_tensors(source, args, DTYPES[dtype])
        written = write_atomically(
            out, lambda tmp: write_folder(tmp, args, spelled, tensors, tokenizer, max_shard_bytes)
        )
    for file in written:
        print(f"wrote {out / file}")
    kind = arch.hf_class if arch is not None else MOE_ARCHITECTURE if own_names(args) else LLAMA_ARCHITECTURE
    print(f"exported {meta.get('preset')!r} step {meta['step']} ({kind}, {dtype}) from {source} to {out}")
    return out


# ---------------------------------------------------------------- what to read, where to write


def check_out(out: Path) -> None:
    """`out` can become the export's folder: absent or empty, under folders that are folders and writable."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        what = "is a file" if not out.is_dir() else "is not empty"
        raise ExportError(
            f"--out {out} {what}; export never overwrites: choose another folder, or empty this one first"
        )
    existing = next(p for p in out.absolute().parents if p.exists())
    if not existing.is_dir():
        raise ExportError(f"--out {out}: {existing} is a file, so no folder can be made under it; choose another path")
    if not os.access(existing, os.W_OK):
        raise ExportError(f"--out {out}: {existing} cannot be written; choose a folder you can write")


def check_options(max_shard_bytes: int, dtype: str) -> None:
    if max_shard_bytes <= 0:
        raise ExportError(f"--max-shard-size {max_shard_bytes} is not positive; give e.g. 5GB or 500MB")
    if dtype not in DTYPES:
        raise ExportError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}")


def parse_size(text: str) -> int:
    """A size in bytes: 2000000, 500MB, 5GB (powers of 10), 2GiB (powers of 2), as Hugging Face reads them."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = match[2].lower() if match else None
    if unit not in UNITS or float(match[1]) * UNITS[unit] < 1:
        raise ExportError(f"--max-shard-size {text!r} is not a size; write e.g. 5GB, 500MB, 2GiB or 2000000 (bytes)")
    return int(float(match[1]) * UNITS[unit])


def model_args(path: Path, meta: dict) -> ModelArgs:
    if meta.get("version") != ckpt.VERSION:
        version = meta.get("version")
        raise CheckpointError(f"{path / ckpt.META}: format version {version}, this fivecut reads {ckpt.VERSION}")
    try:
        return ModelArgs(**meta["model"])
    except (KeyError, TypeError) as err:
        raise CheckpointError(f"{path / ckpt.META} has no model shape fivecut knows ({err})") from None


def write_atomically(out: Path, write) -> list[str]:
    """`write(tmp)` into a fresh folder next to `out`, then rename it to `out`; on any failure nothing stays."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        written = write(tmp)
        for path in (tmp, *tmp.iterdir()):  # mkdtemp's folder is private to its owner; a model folder is not
            path.chmod(0o755 if path.is_dir() else 0o644)
        tmp.replace(out)  # an empty `out` folder is replaced too
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return written


# ---------------------------------------------------------------- tensors


def checkpoint_tensors(path: Path, args: ModelArgs, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The model's tensors under the names they are exported with, cast to `dtype`."""
    weights = ckpt.full_state(path)
    check_shapes(path, weights, expected_shapes(args))
    cast = {name: t.to(dtype).contiguous() for name, t in weights.items()}
    if not own_names(args):
        return {names.to_hf(name): t for name, t in cast.items()}
    if not args.is_moe:
        return cast
    biases = ckpt.full_state(path, "moe.")  # "<layer>.expert_bias", kept in fp32 as the router uses them
    return cast | {f"layers.{key.split('.')[0]}.feed_forward.expert_bias": t for key, t in biases.items()}


def own_names(args: ModelArgs) -> bool:
    """Whether the export keeps fivecut's tensor names and records ModelArgs (no Hugging Face Llama
    class reads the model: mixture-of-experts layers, or multi-head latent attention)."""
    return args.is_moe or args.is_mla


def check_shapes(path: Path, weights: dict[str, torch.Tensor], expected: dict[str, tuple[int, ...]]) -> None:
    got = {name: tuple(t.shape) for name, t in weights.items()}
    if got != expected:
        wrong = sorted(set(got) ^ set(expected)) or [n for n in expected if got[n] != expected[n]]
        raise CheckpointError(f"checkpoint {path} does not hold its model's tensors: {', '.join(wrong[:5])}")


def shards(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    """The tensors in order, cut into runs of at most `max_bytes` (a larger tensor alone), as Hugging Face does."""
    out: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if out[-1] and size + nbytes > max_bytes:
            out.append({})
            size = 0
        out[-1][name] = t
        size += nbytes
    return out


def write_weights(folder: Path, tensors: dict[str, torch.Tensor], max_bytes: int) -> list[str]:
    from safetensors.torch import save_file

    parts = shards(tensors, max_bytes)
    if len(parts) == 1:
        save_file(parts[0], str(folder / SAFETENSORS), metadata={"format": "pt"})
        return [SAFETENSORS]
    files = [f"model-{k:05d}-of-{len(parts):05d}.safetensors" for k in range(1, len(parts) + 1)]
    for file, part in zip(files, parts):
        save_file(part, str(folder / file), metadata={"format": "pt"})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    weight_map = {name: file for file, part in zip(files, parts) for name in part}
    write_json(folder / INDEX, {"metadata": {"total_size": total}, "weight_map": weight_map})
    return [*files, INDEX]


# ---------------------------------------------------------------- configs


def write_folder(folder: Path, args: ModelArgs, dtype: str, tensors: dict, tokenizer, max_bytes: int) -> list[str]:
    """Every file of the export of a model of shape `args` (weights `tensors`, in `dtype`) into `folder`."""
    bos, eos = special_ids(tokenizer)
    if own_names(args):
        config = moe_config(args, dtype, bos, eos)
    else:  # transformers >= 5 reads "dtype", older ones "torch_dtype"
        config = llama_config(args, dtype, bos, eos) | {"dtype": dtype}
    tokenizer_files = write_tokenizer(folder, tokenizer, args.max_seq_len)
    if not tokenizer_files:  # e.g. the byte tokenizer: named, so that an import of the folder finds it again
        config["fivecut_tokenizer"] = tokenizer.name
    write_json(folder / "config.json", config)
    write_json(folder / "generation_config.json", {"bos_token_id": bos, "eos_token_id": eos})
    weights = write_weights(folder, tensors, max_bytes)
    return ["config.json", "generation_config.json", *weights, *tokenizer_files]


def moe_config(args: ModelArgs, dtype: str, bos: int | None, eos: int | None) -> dict:
    return {
        "architectures": [MOE_ARCHITECTURE],
        "model_type": "fivecut",
        "note": "a fivecut model (mixture of experts or latent attention): no Hugging Face class reads it; the "
        "tensor names are "
        "fivecut's own (see the README section 'Weights in and out' and fivecut/weights/export.py)",
        "fivecut": dataclasses.asdict(args),
        "vocab_size": args.vocab_size,
        "tie_word_embeddings": args.tie_embeddings,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "torch_dtype": dtype,
        "dtype": dtype,
    }


def moe_class(path: Path, args: ModelArgs) -> moe.Architecture | None:
    """The Hugging Face MoE class that holds the checkpoint's model exactly (`moe.for_args`), or None.
    Routing biases that balancing moved (moe.bias_update_rate) change which experts a token picks:
    a class without them (Mixtral, Qwen3-MoE) cannot hold such a model, fivecut's own export can."""
    arch = moe.for_args(args)
    if arch is None:
        if args.is_moe:  # why each class does not hold it, for a user who expected one
            reasons = "; ".join(f"{a.hf_class}: {a.holds(args)}" for a in moe.ARCHITECTURES)
            print(f"note: no Hugging Face MoE class holds this model ({reasons}); fivecut's own names are written")
        return None
    biases = ckpt.full_state(path, "moe.")  # "<layer>.expert_bias", [E] each; every file checked against its sha256
    if not arch.buffers(args) and any(bool(b.any()) for b in biases.values()):
        print(
            f"note: routing biases are not zero (auxiliary-loss-free balancing); {arch.hf_class} has none: "
            "exported as fivecut's own MoE model"
        )
        return None
    return arch


def write_moe_folder(folder: Path, source: Path, arch, args: ModelArgs, dtype: str, tokenizer, max_bytes: int):
    """Every file of the export of the checkpoint `source` as the Hugging Face class `arch`."""
    bos, eos = special_ids(tokenizer)
    config = arch.config(args) | {"bos_token_id": bos, "eos_token_id": eos, "torch_dtype": dtype, "dtype": dtype}
    tokenizer_files = write_tokenizer(folder, tokenizer, args.max_seq_len)
    if not tokenizer_files:  # e.g. the byte tokenizer: named, so that an import of the folder finds it again
        config["fivecut_tokenizer"] = tokenizer.name
    write_json(folder / "config.json", config)
    write_json(folder / "generation_config.json", {"bos_token_id": bos, "eos_token_id": eos})
    weights = moe.write_weights(folder, source, arch, args, getattr(torch, dtype), max_bytes)
    return ["config.json", "generation_config.json", *weights, *tokenizer_files]


def write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n")


# ---------------------------------------------------------------- tokenizer


def run_tokenizer(config: dict):
    """The tokenizer the run trained with (`data.tokenizer` of its config, "auto": its imported model's)."""
    return resolve_tokenizer(config.get("data", {}).get("tokenizer", "byte"), config.get("model", {}).get("init_from"))


def special_ids(tokenizer) -> tuple[int | None, int | None]:
    """(bos, eos): GPT-2 uses its one special token for both; other tokenizers name only an end-of-text id."""
    if isinstance(tokenizer, GPT2Tokenizer):
        return tokenizer.eot_id, tokenizer.eot_id
    return None, tokenizer.eot_id


def write_tokenizer(folder: Path, tokenizer, max_length: int | None = None) -> list[str]:
    """The Hugging Face files of `tokenizer` (a `fivecut.train.tokenizer.Tokenizer`) in `folder`; their names."""
    if isinstance(tokenizer, GPT2Tokenizer):
        (folder / "tokenizer.json").write_text(gpt2_tokenizer().to_str())
        special = dict.fromkeys(("bos_token", "eos_token", "unk_token"), GPT2_SPECIAL)
        return ["tokenizer.json", *tokenizer_configs(folder, "GPT2Tokenizer", special, max_length)]
    if isinstance(tokenizer, FileTokenizer):
        (folder / "tokenizer.json").write_text(tokenizer.json)
        eot = tokenizer.eot_id
        special = {"eos_token": tokenizer.tokenizer.id_to_token(eot)} if eot is not None else {}
        return ["tokenizer.json", *tokenizer_configs(folder, "PreTrainedTokenizerFast", special, max_length)]
    if tokenizer.name == "byte":
        print("note: the byte-level model has no Hugging Face tokenizer (its ids are UTF-8 bytes); none written")
    else:
        print(f"note: tokenizer {tokenizer.name!r} has no Hugging Face form here; no tokenizer files written")
    return []


def tokenizer_configs(folder: Path, cls: str, special: dict[str, str], max_length: int | None) -> list[str]:
    config = {"tokenizer_class": cls, **special, "add_bos_token": False, "clean_up_tokenization_spaces": False}
    if max_length is not None:
        config["model_max_length"] = max_length
    write_json(folder / "tokenizer_config.json", config)
    write_json(folder / "special_tokens_map.json", special)
    return ["tokenizer_config.json", "special_tokens_map.json"]


def gpt2_tokenizer():
    """GPT-2's byte-level BPE as a `tokenizers.Tokenizer`, built from the published encoder.json and vocab.bpe."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    vocab_bpe, encoder_json = gpt2_files()
    vocab = json.loads(encoder_json.read_text(encoding="utf-8"))
    lines = vocab_bpe.read_text(encoding="utf-8").splitlines()[1:]  # the first line is a version comment
    merges = [tuple(line.split()) for line in lines if line.strip()]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens([AddedToken(GPT2_SPECIAL, special=True)])
    return tok
