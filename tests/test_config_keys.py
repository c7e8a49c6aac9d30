"""Every config.json key transformers reads is one fivecut reads, or one it declares to carry no math.

For each Hugging Face class fivecut imports, the keys transformers' config class consumes -- its
fields, its `attribute_map`'s other names, the RoPE keys its config loading moves into
`rope_parameters`, what its modeling code reads with `getattr(config, ...)` -- are compared with the
keys the class's record reads (`Architecture.keys`) and the keys without math (`METADATA`, each with
its reason). Then each key is changed in a full config.json of a tiny model, as transformers writes
it: wherever transformers' own config changes, fivecut's model must change too, or the file must be
refused naming a key; a key fivecut passes over while transformers acts on it fails the test.
No weights: configs only (transformers' config classes, fivecut's readers).
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import inspect
import logging
import re
from pathlib import Path

import pytest

from fivecut.weights.architectures import ARCHITECTURES, METADATA, HFConfig
from fivecut.weights.hf import args_from_config
from fivecut.weights.moe_architectures import TENSOR_KEYS
from fivecut.weights.source import WeightsError

transformers = pytest.importorskip("transformers")

PATH = Path("/models/tiny/config.json")
TINY = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
# class -> (transformers' config class, its own tiny keys)
CLASSES = {
    "LlamaForCausalLM": ("LlamaConfig", {}),
    "MistralForCausalLM": ("MistralConfig", {}),
    "Qwen2ForCausalLM": ("Qwen2Config", {}),
    "Qwen3ForCausalLM": ("Qwen3Config", {"head_dim": 16}),
    "SmolLM3ForCausalLM": ("SmolLM3Config", {"no_rope_layer_interval": 2, "pad_token_id": 0}),
    "Olmo2ForCausalLM": ("Olmo2Config", {"pad_token_id": 0}),
    "Phi3ForCausalLM": ("Phi3Config", {"pad_token_id": 0, "partial_rotary_factor": 0.5}),
    "Gemma2ForCausalLM": ("Gemma2Config", {"head_dim": 16}),
    "Gemma3ForCausalLM": ("Gemma3TextConfig", {"head_dim": 16}),
    "MixtralForCausalLM": ("MixtralConfig", {"num_local_experts": 4}),
    "Qwen3MoeForCausalLM": ("Qwen3MoeConfig", {"num_experts": 8, "moe_intermediate_size": 32, "head_dim": 16}),
    "DeepseekV3ForCausalLM": ("DeepseekV3Config", dict(
        n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, moe_intermediate_size=32,
        kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
        num_key_value_heads=4, first_k_dense_replace=1,
    )),
    "Glm4MoeForCausalLM": ("Glm4MoeConfig", dict(
        n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, moe_intermediate_size=32, head_dim=32,
        attention_bias=True, use_qk_norm=True,
    )),
    "GptOssForCausalLM": ("GptOssConfig", {"num_local_experts": 4, "head_dim": 16, "sliding_window": 8}),
}  # fmt: skip
# the legacy RoPE keys transformers' config loading reads into rope_parameters (`convert_rope_params_to_dict`)
ROPE_KEYS = {"rope_scaling", "rope_theta", "partial_rotary_factor"}


def config_class(name: str):
    return getattr(transformers, CLASSES[name][0])


def modeling(name: str) -> str:
    return inspect.getsource(importlib.import_module(getattr(transformers, name).__module__))


def consumed(name: str) -> set[str]:
    """The config.json keys transformers reads for class `name`."""
    cls = config_class(name)
    read = set(re.findall(r'getattr\((?:self\.)?config, "(\w+)"', modeling(name)))
    fields = {f.name for f in dataclasses.fields(cls)}
    return fields | set(cls.attribute_map) | ROPE_KEYS | read | set(cls().to_dict())


def acted_on(name: str) -> set[str]:
    """The attributes of its config that transformers' modeling code of class `name` reads."""
    source = modeling(name)
    return set(re.findall(r"config\.(\w+)", source)) | set(re.findall(r'getattr\((?:self\.)?config, "(\w+)"', source))


def full_config(name: str) -> dict:
    """A tiny model's config.json with every key transformers knows (`to_dict`, not only the changed ones)."""
    config_cls, own = CLASSES[name]
    config = getattr(transformers, config_cls)(**(TINY | own)).to_dict()
    return config | {"architectures": [name], "dtype": "float32"}


def transformers_reads(name: str, raw: dict) -> dict | None:
    """What transformers' model of class `name` reads of the config `raw` (standardized: RoPE, defaults),
    or None when transformers refuses the file."""
    logging.disable(logging.WARNING)
    try:
        config = config_class(name).from_dict(copy.deepcopy(raw))  # it fills nested tables in place
    except Exception:  # transformers' strict dataclasses refuse a value of another type, in their own ways
        return None
    finally:
        logging.disable(logging.NOTSET)
    values = {attr: getattr(config, attr, None) for attr in acted_on(name)}
    return {attr: v for attr, v in values.items() if not callable(v)}  # a method (get_text_config) is no value


def changes(key: str, value) -> list:
    """Other values of `key`'s kind (what a user might write instead); several for a number, so that
    one of them makes a model fivecut can build (a head count that divides, a layer count in range)."""
    if key in ("rope_scaling", "rope_parameters"):
        return [{"type": "linear", "factor": 2.0}]
    if isinstance(value, bool):
        return [not value]
    if isinstance(value, (int, float)):
        return [value * 2, value // 2 if isinstance(value, int) else value / 2, value * 2 + 1]
    if isinstance(value, str):
        return [value + "x"]
    if isinstance(value, list):
        return [value[::-1] + value[:1] if value else [1]]
    return [2, 3]


def fivecut_reads(raw: dict):
    """fivecut's ModelArgs of `raw`, or the refusal's text."""
    try:
        return args_from_config(raw, PATH)
    except WeightsError as err:
        return str(err)


@pytest.mark.parametrize("name", CLASSES)
def test_every_key_transformers_reads_is_read_or_declared_without_math(name):
    assert set(CLASSES) == set(ARCHITECTURES)  # a class registered without a case here fails
    undeclared = sorted(consumed(name) - ARCHITECTURES[name].keys - set(METADATA) - set(TENSOR_KEYS))
    assert not undeclared, f"{name}: transformers reads {undeclared}, which fivecut neither reads nor declares"


@pytest.mark.parametrize("name", CLASSES)
def test_a_key_transformers_acts_on_changes_the_model_or_is_refused(name):
    """Each key of a full config.json changed in turn: where transformers' config changes, fivecut's
    model changes or the file is refused naming the key's file."""
    raw = full_config(name)
    base, theirs = fivecut_reads(raw), transformers_reads(name, raw)
    assert not isinstance(base, str), base
    silent = []
    own_no_math = set(dict(getattr(ARCHITECTURES[name], "no_math", ())))  # each with its reason in the record
    for key in sorted(consumed(name) - set(METADATA) - set(TENSOR_KEYS) - own_no_math):
        for value in changes(key, raw.get(key)):
            other = raw | {key: value}
            if transformers_reads(name, other) in (None, theirs):  # refused by transformers, or no change there
                continue
            ours = fivecut_reads(other)
            if isinstance(ours, str):
                assert str(PATH) in ours and "\n" not in ours, ours
            elif ours == base:
                silent.append(f"{key}={value!r}")
    assert not silent, f"{name}: transformers acts on {silent}; fivecut's model is unchanged"


@pytest.mark.parametrize("name", [name for name, arch in ARCHITECTURES.items() if hasattr(arch, "to_args")])
def test_a_dense_reader_reads_only_the_keys_its_record_declares(name):
    arch = ARCHITECTURES[name]
    cfg = HFConfig(full_config(name), PATH)
    arch.to_args(cfg)
    assert cfg.seen <= arch.keys, sorted(cfg.seen - arch.keys)


def test_the_tensor_keys_place_tensors():
    """rope_interleave and the multi-token-prediction layers change no shape: they place tensors."""
    from fivecut.weights.moe_architectures import _skipped

    arch = ARCHITECTURES["DeepseekV3ForCausalLM"]
    raw = full_config("DeepseekV3ForCausalLM")
    args = args_from_config(raw, PATH)
    paired, plain = (arch.tensors(args, set(), raw | {"rope_interleave": v}) for v in (True, False))
    assert paired != plain
    extra = f"model.layers.{args.n_layers}.mlp.gate.weight"
    assert _skipped(extra, args, raw | {"num_nextn_predict_layers": 1})
    assert not _skipped(extra, args, raw | {"num_nextn_predict_layers": 0, "num_mtp_layers": None})
    assert set(TENSOR_KEYS) <= arch.keys


@pytest.mark.parametrize("name", ["MixtralForCausalLM", "DeepseekV3ForCausalLM"])
def test_transformers_other_name_of_the_expert_count_is_read(name):
    """transformers' attribute_map: Mixtral's num_experts is its num_local_experts, DeepSeek-V3's
    num_local_experts its n_routed_experts; both set to different counts is refused naming both."""
    key, alias = {
        "MixtralForCausalLM": ("num_local_experts", "num_experts"),
        "DeepseekV3ForCausalLM": ("n_routed_experts", "num_local_experts"),
    }[name]
    raw = full_config(name)
    renamed = {k: v for k, v in raw.items() if k != key} | {alias: raw[key]}
    assert args_from_config(renamed, PATH) == args_from_config(raw, PATH)
    with pytest.raises(WeightsError, match=f"{key} = {raw[key]} and {alias} = {raw[key] * 2} name one count"):
        args_from_config(raw | {alias: raw[key] * 2}, PATH)


def test_mixtral_s_default_rope_base_is_transformers():
    """A Mixtral config.json without rope_theta (nor rope_parameters) rotates by MixtralConfig's 1e6."""
    raw = {k: v for k, v in full_config("MixtralForCausalLM").items() if k not in ("rope_parameters", "rope_theta")}
    assert transformers_reads("MixtralForCausalLM", raw)["rope_parameters"]["rope_theta"] == 1e6
    assert args_from_config(raw, PATH).rope_theta == 1e6
