"""Gemma 2 (`Gemma2ForCausalLM`) and Gemma 3's text model (`Gemma3ForCausalLM`) in and out of Hugging Face.

Both are Llama's block with Gemma's choices, each a `ModelArgs` field of fivecut's own model:

    GeGLU feed-forward (hidden_activation "gelu_pytorch_tanh")         ffn_activation = "gelu_tanh"
    norms before and after attention and the MLP (the sandwich)        sandwich_norms
    the embedding times sqrt(hidden_size)                               scale_embeddings
    scores times query_pre_attn_scalar ** -0.5                          query_scale_dim (0 when = head_dim)
    sliding layers interleaved with global ones (layer_types)          sliding_window, window_layers
    Gemma 2: attention and final-logit soft-capping                     attn_softcap, logit_softcap
    Gemma 3: per-head q/k norms, the sliding layers' own RoPE base      qk_norm, rope_local_theta
             (rope_parameters.sliding_attention), the global layers'
             RoPE with its scaling (rope_parameters.full_attention)

Gemma's RMSNorms scale by (1 + w) and store w (initialized at 0). fivecut's norm weight is the scale
itself, 1 + w: import adds 1 (`TensorMap.offset`), export subtracts it. The function is the same, and so
is every path that applies a norm (sequence parallelism, the planner, the memory check); fivecut's
ones-init is Gemma's zero-init; and weight decay, which fivecut never applies to a 1-D weight
(`fivecut.parallel.data.decays`), is not pulled towards a scale of 0 instead of 1. In fp32 the scale
equals Gemma's 1.0 + w.float() bit for bit. The w written back, fl(fl(1 + w) - 1), may differ from the
w read in bits below 2^-24 (6e-8 measured on a round trip through a checkpoint), but 1 + it is the same
fp32 scale again (the subtraction is exact), so transformers computes the same model.

    fivecut                                  Hugging Face
    layers.N.attention_norm.weight + ...     model.layers.N.input_layernorm.weight (+ 1)
    layers.N.attention_post_norm.weight      model.layers.N.post_attention_layernorm.weight (+ 1)
    layers.N.ffn_norm.weight                 model.layers.N.pre_feedforward_layernorm.weight (+ 1)
    layers.N.ffn_post_norm.weight            model.layers.N.post_feedforward_layernorm.weight (+ 1)
    layers.N.attention.q_norm.weight         model.layers.N.self_attn.q_norm.weight (+ 1; Gemma 3, k_norm alike)
    norm.weight                              model.norm.weight (+ 1)

The rest as Llama's (`fivecut.weights.architectures.DENSE_LAYER`). Refused by name: Gemma 3's multimodal
class (`Gemma3ForConditionalGeneration`, its vision_config), bidirectional attention, a layer_types entry
other than sliding_attention / full_attention, a RoPE on the sliding layers other than plain.
"""

from __future__ import annotations

import dataclasses

from fivecut.model.args import ModelArgs
from fivecut.weights.architectures import (
    DENSE_KEYS,
    DENSE_LAYER,
    GLOBAL,
    HEAD,
    QK_NORM,
    Architecture,
    ArchitectureError,
    HFConfig,
    TensorMap,
    dense_args,
    dense_config,
    dense_problem,
    register,
)
from fivecut.weights.rope import RopeError, rope_config, rope_fields

# hidden_activation -> ModelArgs.ffn_activation
ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh"}
SLIDING, FULL = "sliding_attention", "full_attention"


# ---------------------------------------------------------------- config.json -> ModelArgs


def gemma_args(cfg: HFConfig, pattern: int, **variant) -> ModelArgs:
    """The fields Gemma 2 and 3 share; `pattern`: the class's k of layer_types when the file has none
    (every k-th layer global)."""
    act = cfg.get("hidden_activation", str, "gelu_pytorch_tanh")
    if act not in ACTIVATIONS:
        raise ArchitectureError(
            f"{cfg.path}: hidden_activation = {act!r} is not implemented; fivecut's Gemma has GeGLU with GELU's tanh "
            "approximation ('gelu_pytorch_tanh')"
        )
    cfg.expect("attention_bias", False, "Gemma attention (no biases)")
    cfg.expect("use_bidirectional_attention", False, "Gemma attention (causal)")
    cfg.skip("cache_implementation")  # `GEMMA_NO_MATH`
    # transformers 5 reads hidden_activation only; an older file's hidden_act beside it changes nothing
    cfg.skip("hidden_act")
    cfg.raw = {k: v for k, v in cfg.raw.items() if k != "hidden_act"}  # (not the SwiGLU `dense_args` expects)
    args = dense_args(cfg, **window_fields(cfg, pattern), **variant)
    scalar = cfg.get("query_pre_attn_scalar", int, 256)
    return dataclasses.replace(
        args,
        ffn_activation=ACTIVATIONS[act],
        sandwich_norms=True,
        scale_embeddings=True,
        query_scale_dim=0 if scalar == args.head_dim else scalar,
        logit_softcap=float(cfg.get("final_logit_softcapping", float, 0.0)),
    )


def window_fields(cfg: HFConfig, pattern: int) -> dict:
    """sliding_window and window_layers of layer_types (a letter a layer: "s" slides, "f" attends fully);
    without layer_types, transformers' own pattern: every k-th layer global (k: the legacy
    sliding_window_pattern or the class's `pattern`)."""
    n_layers = cfg.need("num_hidden_layers")
    cfg.skip("sliding_window_pattern", "_sliding_window_pattern")
    every = cfg.raw.get("sliding_window_pattern", cfg.raw.get("_sliding_window_pattern", pattern))
    types = cfg.get("layer_types", list) or [FULL if (i + 1) % every == 0 else SLIDING for i in range(n_layers)]
    if len(types) < n_layers or set(types[:n_layers]) - {FULL, SLIDING}:
        raise ArchitectureError(
            f"{cfg.path}: layer_types {types} is not implemented; give each of the {n_layers} layers "
            f"{SLIDING!r} or {FULL!r}"
        )
    letters = "".join("s" if kind == SLIDING else "f" for kind in types[:n_layers])
    if "s" not in letters:  # every layer global: no window
        return {}
    window = cfg.get("sliding_window") or 0
    if not window:
        raise ArchitectureError(f"{cfg.path}: layer_types has sliding_attention layers but sliding_window is null")
    return {"sliding_window": window, "window_layers": letters}


def gemma2_args(cfg: HFConfig) -> ModelArgs:
    """Gemma 2: one RoPE for every layer, attention scores soft-capped (attn_logit_softcapping)."""
    args = gemma_args(cfg, 2)
    return dataclasses.replace(args, attn_softcap=float(cfg.get("attn_logit_softcapping", float, 0.0)))


def gemma3_args(cfg: HFConfig) -> ModelArgs:
    """Gemma 3's text model: per-head q/k norms; the global layers' RoPE (rope_parameters.full_attention,
    with its scaling), the sliding layers' own plain one (rope_parameters.sliding_attention)."""
    if cfg.raw.get("vision_config") is not None or cfg.raw.get("text_config") is not None:
        raise ArchitectureError(
            f"{cfg.path}: vision_config / text_config describe Gemma 3's multimodal model "
            "(Gemma3ForConditionalGeneration), which fivecut does not import; it reads the text model, "
            "Gemma3ForCausalLM (model_type 'gemma3_text')"
        )
    cfg.skip("attn_logit_softcapping")  # transformers' Gemma 3 attention never reads it (`GEMMA3_NO_MATH`)
    full, local = gemma3_rope_tables(cfg)
    global_view = HFConfig(
        cfg.raw | {"rope_parameters": full, "rope_scaling": None, "rope_theta": None}, cfg.path, cfg.defaults, cfg.seen
    )
    args = gemma_args(global_view, 6, qk_norm=True)
    return dataclasses.replace(args, rope_local_theta=local if args.sliding_window else 0.0)


def gemma3_rope_tables(cfg: HFConfig) -> tuple[dict, float]:
    """(the global layers' RoPE table, the sliding layers' base), as Gemma 3's config loading makes them:
    rope_parameters by layer type; an older file's rope_scaling extends the global one, rope_theta
    (default 1e6) is its base and rope_local_base_freq (default 1e4) the sliding one's."""
    cfg.skip("rope_parameters", "rope_scaling", "rope_theta", "rope_local_base_freq")
    params = cfg.raw.get("rope_parameters") or {}
    if not isinstance(params, dict) or set(params) - {FULL, SLIDING}:
        raise ArchitectureError(
            f"{cfg.path}: rope_parameters {params!r} is not Gemma 3's table of one RoPE per layer type "
            f"({FULL!r}, {SLIDING!r})"
        )
    full = dict(params.get(FULL) or {"rope_type": "default"}) | (cfg.raw.get("rope_scaling") or {})
    full.setdefault("rope_theta", cfg.raw.get("rope_theta") or 1e6)
    local = dict(params.get(SLIDING) or {"rope_type": "default"})
    local.setdefault("rope_theta", cfg.raw.get("rope_local_base_freq") or 1e4)
    positions = cfg.get("max_position_embeddings", default=131072)
    layer_type_rope(cfg, full, FULL, positions)  # a RoPE not built refused here, naming its table
    local_fields = layer_type_rope(cfg, local, SLIDING, positions)
    if set(local_fields) != {"rope_theta"}:
        raise ArchitectureError(
            f"{cfg.path}: rope_parameters.{SLIDING}.rope_type = {local['rope_type']!r} is not implemented; "
            "fivecut's Gemma 3 turns its sliding layers by plain RoPE (rope_type 'default')"
        )
    return full, local_fields["rope_theta"]


def layer_type_rope(cfg: HFConfig, table: dict, kind: str, positions: int) -> dict:
    """ModelArgs' RoPE fields of one layer type's table, refused naming the table when not built."""
    try:
        return rope_fields({"rope_parameters": table}, cfg.path, table["rope_theta"], positions)
    except RopeError as err:
        raise ArchitectureError(f"{err} (Gemma 3's rope_parameters.{kind})") from None


# ---------------------------------------------------------------- ModelArgs -> config.json


def gemma_config(args: ModelArgs, hf_class: str, model_type: str) -> dict:
    out = {k: v for k, v in dense_config(args, hf_class, model_type).items() if k != "hidden_act"}
    kinds = [SLIDING if args.layer_window(i) else FULL for i in range(args.n_layers)]
    return out | {
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": args.query_scale_dim or args.head_dim,
        "sliding_window": args.sliding_window or None,
        "layer_types": kinds,
        "final_logit_softcapping": args.logit_softcap or None,
        "attention_bias": False,
        "use_bidirectional_attention": False,
        "pad_token_id": None,  # fivecut trains no padding row (Gemma's embedding would keep row 0's gradient 0)
    }


def gemma2_config(args: ModelArgs) -> dict:
    return gemma_config(args, "Gemma2ForCausalLM", "gemma2") | {"attn_logit_softcapping": args.attn_softcap or None}


def gemma3_config(args: ModelArgs) -> dict:
    full = rope_config(args)["rope_parameters"]
    local = {"rope_type": "default", "rope_theta": args.rope_local_theta or args.rope_theta}
    out = {k: v for k, v in gemma_config(args, "Gemma3ForCausalLM", "gemma3_text").items() if k != "rope_scaling"}
    return out | {"rope_parameters": {FULL: full, SLIDING: local}, "rope_theta": None, "attn_logit_softcapping": None}


# ---------------------------------------------------------------- which shapes each class holds

# the Gemma fields, and the block variants no Gemma has
GEMMA_OWN = ("sandwich_norms", "scale_embeddings", "window_layers", "query_scale_dim", "logit_softcap",
             "ffn_activation")  # fmt: skip


def gemma_problem(args: ModelArgs, name: str, own: tuple[str, ...] = ()) -> str | None:
    shape = (args.ffn_activation == "gelu_tanh", args.sandwich_norms, args.scale_embeddings)
    if not all(shape) or args.qkv_bias or args.full_attention_layers:
        return f"{name} has GeGLU, norms around each sublayer and a scaled embedding, no biases, windows by layer_types"
    return dense_problem(args, own=GEMMA_OWN + own)


def holds_gemma2(args: ModelArgs) -> str | None:
    if args.qk_norm or args.rope_local_theta:
        return "Gemma 2 has no q/k norms and one RoPE for every layer"
    return gemma_problem(args, "Gemma 2", ("attn_softcap",))


def holds_gemma3(args: ModelArgs) -> str | None:
    if not args.qk_norm or args.qk_norm_whole or args.attn_softcap:
        return "Gemma 3 has per-head q/k norms and no attention soft-capping"
    return gemma_problem(args, "Gemma 3", ("rope_local_theta",))


# ---------------------------------------------------------------- tensor names

GEMMA_NORMS = {
    "attention_norm.weight": "input_layernorm.weight",
    "attention_post_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "ffn_post_norm.weight": "post_feedforward_layernorm.weight",
}


def gemma_tensors(args: ModelArgs) -> list[TensorMap]:
    """Llama's names, Gemma's four norms a block; every norm read as 1 + w."""
    norms = GEMMA_NORMS | (QK_NORM if args.qk_norm else {})
    plain = {ours: theirs for ours, theirs in DENSE_LAYER.items() if ours not in norms}
    named = GLOBAL | ({} if args.tie_embeddings else HEAD)
    out = [TensorMap(ours, (theirs,), offset=1.0 if ours == "norm.weight" else 0.0) for ours, theirs in named.items()]
    for i in range(args.n_layers):
        out += [TensorMap(f"layers.{i}.{o}", (f"model.layers.{i}.{t}",)) for o, t in plain.items()]
        out += [TensorMap(f"layers.{i}.{o}", (f"model.layers.{i}.{t}",), offset=1.0) for o, t in norms.items()]
    return out


# ---------------------------------------------------------------- the records

GEMMA_KEYS = DENSE_KEYS | {
    "hidden_activation", "attention_bias", "use_bidirectional_attention", "query_pre_attn_scalar", "sliding_window",
    "layer_types", "final_logit_softcapping", "attn_logit_softcapping", "sliding_window_pattern",
    "_sliding_window_pattern", "hidden_act", "cache_implementation",
}  # fmt: skip
# the keys Gemma's files carry that change no logit, and why (`Architecture.no_math`)
GEMMA_NO_MATH = (
    (
        "cache_implementation",
        "the KV cache transformers' generate builds ('hybrid': the sliding layers' caches keep their window); "
        "fivecut's cache keeps every position and masks the window, the same logits",
    ),
)
GEMMA3_NO_MATH = GEMMA_NO_MATH + (
    (
        "attn_logit_softcapping",
        "transformers' Gemma 3 attention never passes it to its attention function: no score is capped",
    ),
)
GEMMA2 = Architecture(
    "Gemma2ForCausalLM", "gemma2", gemma2_args, gemma2_config, holds_gemma2, gemma_tensors,
    GEMMA_KEYS, GEMMA_NO_MATH,
)  # fmt: skip
GEMMA3 = Architecture(
    "Gemma3ForCausalLM", "gemma3_text", gemma3_args, gemma3_config, holds_gemma3, gemma_tensors,
    GEMMA_KEYS | {"rope_local_base_freq"}, GEMMA3_NO_MATH,
)  # fmt: skip

# transformers' defaults for keys a file may leave out (Gemma2Config's, Gemma3TextConfig's)
SHARED_DEFAULTS = {"rms_norm_eps": 1e-6, "tie_word_embeddings": True, "head_dim": 256, "query_pre_attn_scalar": 256,
                   "sliding_window": 4096, "hidden_activation": "gelu_pytorch_tanh"}  # fmt: skip
register(GEMMA2, SHARED_DEFAULTS | {"max_position_embeddings": 8192, "final_logit_softcapping": 30.0,
                                    "attn_logit_softcapping": 50.0})  # fmt: skip
register(GEMMA3, SHARED_DEFAULTS | {"max_position_embeddings": 131072})
