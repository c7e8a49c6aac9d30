"""GLM-4.5 / GLM-4.5-Air / GLM-4.6 (`Glm4MoeForCausalLM`) in and out of Hugging Face: one
`moe_architectures.Architecture` record, registered by `fivecut.weights.architectures`.

GLM-4.5 is fivecut's grouped-query block with DeepSeek-V3's router; each mechanism is an existing
ModelArgs field, none new:

    GLM-4.5 (config.json)                  fivecut (ModelArgs)
    attention_bias (q, k, v; not o)        qkv_bias
    use_qk_norm (RMSNorm per head)         qk_norm
    head_dim                               attention_head_dim
    partial_rotary_factor (0.5 when the    rope_partial_dim: the first int(head_dim * factor)
      file has none, as transformers)        channels of each head turn, in rotate-half pairs
                                             (channel i with i + k/2), the rest pass -- transformers'
                                             layout for this class, Phi-3's in fivecut
    sigmoid router, e_score_correction_bias  gate="sigmoid", expert_bias (a buffer)
    n_group, topk_group                    expert_groups, route_group_limit (a group scored by
                                             the sum of its two best biased scores)
    norm_topk_prob, routed_scaling_factor  route_norm, route_scale
    n_shared_experts, moe_intermediate_size  n_shared_experts, moe_ffn_dim
    first_k_dense_replace (1 when absent)  first_dense_layers

Tensors: Llama's names (`fivecut.weights.names`) plus q/k/v_proj.bias, q_norm/k_norm, and for a MoE
layer DeepSeek-V3's (`mlp.gate.weight`, `mlp.gate.e_score_correction_bias`, `mlp.experts.e.*`,
`mlp.shared_experts.*`). The multi-token-prediction layers of the published checkpoints
(`num_nextn_predict_layers`: model.layers.N.* from N = num_hidden_layers on -- eh_proj, enorm,
hnorm, shared_head and a whole decoder layer) are built by neither transformers nor fivecut: left
unread on import, none written on export (num_nextn_predict_layers 0).

A config.json key transformers' Glm4MoeConfig does not have, or a value fivecut does not compute
(another activation, dropout, a RoPE type not built), is refused by name.
"""

from __future__ import annotations

from pathlib import Path

from fivecut.model.args import ModelArgs
from fivecut.weights import moe_architectures as moe
from fivecut.weights.source import optional

# Glm4MoeConfig's defaults of the keys that shape the model, for a config.json that leaves them out
DEFAULTS = {
    "num_key_value_heads": 8,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "first_k_dense_replace": 1,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 1408,
    "intermediate_size": 10944,
}
PARTIAL_ROTARY = 0.5  # Glm4MoeConfig's partial_rotary_factor where neither the file nor its RoPE table has one
THETA = 1e4

KEYS = moe.DEEPSEEK_MOE_KEYS | {"use_qk_norm", "head_dim"}  # DeepSeek-V3's feed-forward, its own attention


def glm4_moe_args(config: dict, path: Path) -> ModelArgs:
    moe._check_keys(config, path, KEYS)
    config = DEFAULTS | {k: v for k, v in config.items() if v is not None}
    if config.get("partial_rotary_factor") is None:
        config["partial_rotary_factor"] = PARTIAL_ROTARY  # a RoPE table's own factor still wins (`rope_table`)
    dim, heads = moe._need(config, "hidden_size", path), moe._need(config, "num_attention_heads", path)
    head_dim = moe._attention_head_dim(config, path)
    common = moe._common_args(config, path, THETA, head_dim or dim // max(heads, 1), biases=True)
    shared = optional(config, "n_shared_experts", 1, path)
    if shared < 1:
        moe._refuse(path, "n_shared_experts", shared, "transformers' GLM-4.5 always runs its shared experts")
    return ModelArgs(
        **common,
        **moe.deepseek_moe_args(config, path),
        attention_head_dim=head_dim,
        qkv_bias=optional(config, "attention_bias", False, path, bool),
        qk_norm=optional(config, "use_qk_norm", False, path, bool),
    )


def glm4_moe_config(args: ModelArgs) -> dict:
    config = moe._common_config(args)
    # written even when every channel turns (a file without it turns half: Glm4MoeConfig's default), in
    # rope_scaling too where there is one (transformers then reads it in place of rope_parameters)
    for table in (config["rope_parameters"], config["rope_scaling"] or {}):
        table["partial_rotary_factor"] = args.rope_dim / args.head_dim
    return (
        config
        | moe.deepseek_moe_config(args)
        | {
            "architectures": ["Glm4MoeForCausalLM"],
            "model_type": "glm4_moe",
            "head_dim": args.head_dim,
            "attention_bias": args.qkv_bias,
            "use_qk_norm": args.qk_norm,
        }
    )


def glm4_moe_holds(args: ModelArgs) -> str | None:
    """None when Glm4MoeForCausalLM holds a model of shape `args` exactly, else why not."""
    group_size = args.n_experts // args.expert_groups if args.is_moe else 0
    return moe._unmet(
        (args.is_moe, "it has no experts"),
        (not args.is_mla, "its attention is latent"),
        (args.gate == "sigmoid", "its router is not a sigmoid"),
        (args.n_shared_experts >= 1, "it has no shared expert"),
        (not args.has_window, "its attention has a sliding window"),
        (not args.qk_norm_whole, "its q/k norms span the whole projections"),
        (not args.norm_after, "its norms follow their sublayers"),
        (not args.nope_interval, "it has layers without RoPE"),
        (args.expert_groups == 1 or group_size >= 2, "its groups hold one expert (transformers scores the best two)"),
    )


BIASES = {f"attention.w{x}.bias": f"self_attn.{x}_proj.bias" for x in "qkv"}
QK_NORMS = {f"attention.{x}_norm.weight": f"self_attn.{x}_norm.weight" for x in "qk"}


def glm4_moe_tensors(args: ModelArgs, files: set[str]) -> dict[str, moe.Stored]:
    out = moe._global_tensors(args)
    own = (BIASES if args.qkv_bias else {}) | (QK_NORMS if args.qk_norm else {})
    for n in range(args.n_layers):
        out |= moe._plain_tensors(args, n)  # norms, q/k/v/o, and a dense layer's MLP
        out |= {f"layers.{n}.{ours}": moe.Same(f"model.layers.{n}.{theirs}") for ours, theirs in own.items()}
        if args.moe_layer(n):
            mlp = f"model.layers.{n}.mlp"
            out |= moe._moe_layer(args, n, mlp, moe.GATE_UP_DOWN, files) | moe._shared_experts(n, mlp)
    return out


GLM4_MOE = moe.Architecture(
    "Glm4MoeForCausalLM", "glm4_moe", glm4_moe_args, glm4_moe_config, glm4_moe_holds,
    lambda args, files, config: glm4_moe_tensors(args, files), moe.bias_buffers, frozenset(moe.COMMON | KEYS),
)  # fmt: skip
