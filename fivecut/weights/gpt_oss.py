"""OpenAI's GPT-OSS (`GptOssForCausalLM`) in and out of Hugging Face: a mixture-of-experts record
(`moe.Architecture`) registered beside Mixtral's, Qwen3-MoE's and DeepSeek-V3's.

What it adds to fivecut's blocks (`fivecut.model.args`, GPT-OSS's group of fields):

    attention sinks        self_attn.sinks [H]: a logit per head in the softmax's denominator   attention_sinks
    biases                 q, k, v and o projections (attention_bias), the router, the experts  qkv_bias, wo_bias,
                                                                                                moe_bias
    alternating windows    layer_types: sliding_attention / full_attention, one a layer         window_layers
    clamped SwiGLU         swiglu_limit, swiglu_alpha                                           swiglu_limit/alpha
    routing                top-k of the router's logits, softmax over the chosen k: fivecut's softmax over
                           every expert renormalized over the chosen (gate="softmax", route_norm); equal for
                           k >= 2 (a lone expert weighs 1 there, its probability here: k = 1 refused)
    YaRN                   with truncate = false (the ramp's ends not rounded)                  rope_truncate

Tensors (layer N; transformers' in-memory names, which save_pretrained writes):

    fivecut                                   GPT-OSS (model.layers.N.)
    attention.wq|wk|wv|wo.weight|bias         self_attn.q_proj|k_proj|v_proj|o_proj.weight|bias
    attention.sinks                           self_attn.sinks
    feed_forward.router.weight|bias           mlp.router.weight|bias
    feed_forward.experts.w1 [E, H, I]         mlp.experts.gate_up_proj [E, H, 2I], columns 0, 2, 4, ... (gate)
    feed_forward.experts.w3 [E, H, I]         mlp.experts.gate_up_proj, columns 1, 3, 5, ... (up)
    feed_forward.experts.b1|b3 [E, I]         mlp.experts.gate_up_proj_bias [E, 2I], even | odd columns
    feed_forward.experts.w2 [E, I, H]         mlp.experts.down_proj [E, I, H]
    feed_forward.experts.b2 [E, H]            mlp.experts.down_proj_bias [E, H]

The published checkpoints hold the experts' two weights in MXFP4 (`fivecut.weights.mxfp4`):
`gate_up_proj_blocks`/`_scales` and `down_proj_blocks`/`_scales`, dequantized on import, each rank
reading its experts and the blocks its box overlaps. Export writes the weights unquantized.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from fivecut.model.args import ModelArgs
from fivecut.weights import moe_architectures as moe
from fivecut.weights.moe_architectures import Box, Part, Same, SliceOf, Stored
from fivecut.weights.mxfp4 import BLOCKS, SCALES, Mxfp4Experts
from fivecut.weights.source import optional

# Mixtral's keys (experts, head_dim, sliding_window) without its router noise, and GPT-OSS's own
GPT_OSS_KEYS = (moe.MIXTRAL_KEYS - {"router_jitter_noise"}) | {"layer_types", "swiglu_alpha", "swiglu_limit"}
THETA = 150000.0  # GptOssConfig.default_theta
# transformers' RoPE of a GptOssConfig whose file has none
DEFAULT_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}
LAYER_TYPES = {"sliding_attention": "s", "full_attention": "f"}
GPT_OSS_FIELDS = {"attention_sinks": True, "moe_bias": True}  # what every GPT-OSS has


def gpt_oss_args(config: dict, path: Path) -> ModelArgs:
    moe._check_keys(config, path, GPT_OSS_KEYS)
    moe._equal(config, "attention_dropout", path, 0.0, "fivecut has no dropout")
    if config.get("rope_parameters") is None and config.get("rope_scaling") is None:
        config = config | {"rope_parameters": DEFAULT_ROPE}  # GptOssConfig's own, as transformers builds it
    heads = moe._need(config, "num_attention_heads", path)
    hidden = moe._need(config, "intermediate_size", path)
    bias = optional(config, "attention_bias", True, path, bool)
    return ModelArgs(
        vocab_size=moe._need(config, "vocab_size", path),
        dim=moe._need(config, "hidden_size", path),
        n_layers=moe._need(config, "num_hidden_layers", path),
        n_heads=heads,
        n_kv_heads=optional(config, "num_key_value_heads", heads, path),
        ffn_dim=hidden,
        max_seq_len=optional(config, "max_position_embeddings", 131072, path),
        **moe._rope(config, path, THETA),
        norm_eps=float(optional(config, "rms_norm_eps", 1e-5, path, float)),
        tie_embeddings=optional(config, "tie_word_embeddings", False, path, bool),
        init_std=float(optional(config, "initializer_range", 0.02, path, float)),
        n_experts=moe._experts_count(config, path, "num_local_experts", "num_experts"),
        top_k=moe._top_k(config, path, True),
        moe_ffn_dim=hidden,
        gate="softmax",
        route_norm=True,
        attention_head_dim=gpt_oss_head_dim(config, path),
        qkv_bias=bias,
        **windows(config, path),
        **GPT_OSS_FIELDS,
        wo_bias=bias,
        swiglu_limit=float(optional(config, "swiglu_limit", 7.0, path, float)),
        swiglu_alpha=float(optional(config, "swiglu_alpha", 1.702, path, float)),
    )


def gpt_oss_head_dim(config: dict, path: Path) -> int:
    """ModelArgs.attention_head_dim: GptOssConfig's head_dim (64 when absent), 0 when it is hidden / heads."""
    size = optional(config, "head_dim", 64, path)
    if size <= 0:
        moe._refuse(path, "head_dim", size, "a head needs channels")
    return 0 if size * config["num_attention_heads"] == config["hidden_size"] else size


def windows(config: dict, path: Path) -> dict:
    """sliding_window and window_layers of GPT-OSS's layer_types (absent: even layers slide, as transformers)."""
    n_layers = config["num_hidden_layers"]
    types = config.get("layer_types") or [
        "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers)
    ]
    if not isinstance(types, list) or len(types) < n_layers or set(types[:n_layers]) - set(LAYER_TYPES):
        moe._refuse(path, "layer_types", types, f"one of {', '.join(LAYER_TYPES)} for each of the {n_layers} layers")
    pattern = "".join(LAYER_TYPES[t] for t in types[:n_layers])
    window = optional(config, "sliding_window", 128, path)
    if "s" not in pattern:
        return {}
    if not window or window <= 0:
        moe._refuse(path, "sliding_window", window, "its sliding_attention layers need a window > 0")
    return {"sliding_window": window, "window_layers": pattern}


def gpt_oss_config(args: ModelArgs) -> dict:
    config = moe._common_config(args) | {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "intermediate_size": args.expert_dim,
        "head_dim": args.head_dim,
        "num_local_experts": args.n_experts,
        "num_experts_per_tok": args.top_k,
        "sliding_window": args.sliding_window or None,
        "layer_types": [
            "sliding_attention" if args.layer_window(i) else "full_attention" for i in range(args.n_layers)
        ],
        "attention_bias": args.qkv_bias,
        "swiglu_limit": args.swiglu_limit,
        "swiglu_alpha": args.swiglu_alpha,
    }
    del config["hidden_act"]  # GPT-OSS's experts compute the clamped SwiGLU whatever it says
    return config


def gpt_oss_holds(args: ModelArgs) -> str | None:
    """None when GptOssForCausalLM holds a model of shape `args` exactly, else why not."""
    return moe._unmet(
        (args.is_moe, "it has no experts"),
        (args.attention_sinks and args.moe_bias, "its attention has no sinks or its experts no biases"),
        (args.qkv_bias == args.wo_bias, "its q/k/v projections and its o projection differ in having biases"),
        (args.swiglu_limit > 0, "its experts' SwiGLU is not clamped"),
        (not args.is_mla, "its attention is latent"),
        (not (args.qk_norm or args.nope_interval or args.norm_after or args.rope_partial_dim), "its blocks vary"),
        (args.gate == "softmax" and args.route_norm and args.top_k > 1, "its router is not GPT-OSS's top-k softmax"),
        (args.route_scale == 1.0, f"its routing weights are scaled by {args.route_scale}"),
        (args.expert_groups == 1, "its routing is group-limited"),
        (args.n_shared_experts == 0, "it has shared experts"),
        (args.first_dense_layers == 0, "its first layers are dense"),
        (args.moe_ffn_dim in (0, args.ffn_dim), "its dense and expert hidden sizes differ"),
    )


# ---------------------------------------------------------------- tensors


@dataclass(frozen=True)
class Interleaved:
    """One of two fivecut tensors interleaved along the last dimension of a Hugging Face tensor (GPT-OSS's
    gate_up_proj [E, H, 2I] and its bias [E, 2I]: gate in the even columns, up in the odd): fivecut's
    column c is their column 2c + `half`."""

    name: str
    half: int

    def hf_names(self) -> list[str]:
        return [self.name]

    def shape(self, slice_of: SliceOf) -> tuple[int, ...]:
        *lead, width = slice_of(self.name).get_shape()
        return (*lead, width // 2)

    def read(self, slice_of: SliceOf, box: Box) -> torch.Tensor:
        *lead, cols = box
        first, last, _ = cols.indices(self.shape(slice_of)[-1])
        pairs = slice_of(self.name)[(*lead, slice(2 * first, 2 * last))]  # [..., 2 * (last - first)]
        return pairs[..., self.half :: 2]

    def parts(self, shape: tuple[int, ...]) -> list[Part]:
        return [Part(self.name, (0,) * len(shape), tuple(shape), moe._whole, interleave=self.half)]


def gpt_oss_tensors(args: ModelArgs, files: set[str], config: dict) -> dict[str, Stored]:
    out = moe._global_tensors(args)
    for n in range(args.n_layers):
        out |= moe._plain_tensors(args, n)
        out |= attention_extras(args, n) | moe_layer(n, files)
    return out


def attention_extras(args: ModelArgs, n: int) -> dict[str, Stored]:
    ours, theirs = f"layers.{n}.attention", f"model.layers.{n}.self_attn"
    out = {f"{ours}.sinks": Same(f"{theirs}.sinks")}
    if args.qkv_bias:
        out |= {f"{ours}.w{x}.bias": Same(f"{theirs}.{x}_proj.bias") for x in "qkvo"}
    return out


def moe_layer(n: int, files: set[str]) -> dict[str, Stored]:
    """Layer n's router and experts: the experts' weights plain or, where the folder holds their blocks
    and scales, in MXFP4."""
    ours, mlp = f"layers.{n}.feed_forward", f"model.layers.{n}.mlp"
    experts = f"{mlp}.experts"
    weights: dict[str, Stored] = {
        "w1": Interleaved(f"{experts}.gate_up_proj", 0),
        "w3": Interleaved(f"{experts}.gate_up_proj", 1),
        "w2": Same(f"{experts}.down_proj"),
    }
    if f"{experts}.gate_up_proj{BLOCKS}" in files or f"{experts}.gate_up_proj{SCALES}" in files:
        weights = {
            "w1": Mxfp4Experts(f"{experts}.gate_up_proj", 0),
            "w3": Mxfp4Experts(f"{experts}.gate_up_proj", 1),
            "w2": Mxfp4Experts(f"{experts}.down_proj", None),
        }
    biases = {
        "b1": Interleaved(f"{experts}.gate_up_proj_bias", 0),
        "b3": Interleaved(f"{experts}.gate_up_proj_bias", 1),
        "b2": Same(f"{experts}.down_proj_bias"),
    }
    router = {f"{ours}.router.{k}": Same(f"{mlp}.router.{k}") for k in ("weight", "bias")}
    return router | {f"{ours}.experts.{k}": stored for k, stored in (weights | biases).items()}


GPT_OSS = moe.Architecture(
    "GptOssForCausalLM", "gpt_oss", gpt_oss_args, gpt_oss_config, gpt_oss_holds, gpt_oss_tensors, moe.no_buffers,
    frozenset(moe.COMMON | GPT_OSS_KEYS),
)  # fmt: skip
