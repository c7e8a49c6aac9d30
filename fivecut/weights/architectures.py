"""The Hugging Face classes fivecut reads and writes: one typed record per class.

An `Architecture` says, for one `...ForCausalLM` class, everything import and export need:

    hf_class, model_type     "Qwen2ForCausalLM", "qwen2": what config.json's `architectures` and
                             `model_type` hold
    to_args(HFConfig)        config.json -> ModelArgs. Every key of the file is either used,
                             checked to equal what fivecut implements (`HFConfig.expect`), known
                             to leave the math alone (`METADATA`), or refused by name
                             (`HFConfig.finish`): a field fivecut does not implement is never ignored
    to_config(ModelArgs)     ModelArgs -> config.json (the class reads it back to the same model)
    holds(ModelArgs)         None when the class holds a model of that shape, else the reason
    tensors(ModelArgs)       every parameter as a `TensorMap`: fivecut's logical name <-> the
                             Hugging Face tensor(s), with the transform between them
    keys                     the config.json keys `to_args` reads; with METADATA, every key
                             transformers' config class reads (tests/test_config_keys.py)

A `TensorMap` is general enough for mixture-of-experts layers: one fivecut tensor stacked over
experts [E, ...] is E Hugging Face tensors (`stacked`), each maybe the transpose of fivecut's
slice (`transposed`: fivecut's experts are [dim, hidden], a Hugging Face linear [hidden, dim]).

`ARCHITECTURES` lists the dense classes of this module, then the mixture-of-experts ones of
`fivecut.weights.moe_architectures` (Mixtral, Qwen3-MoE, DeepSeek-V3), added through `register`:
their records (`moe.Architecture`) place each tensor with records a `TensorMap` cannot express
(interleaved RoPE rows, fused experts, routing-bias buffers), and read their config.json
themselves. Import (`fivecut.weights.hf`) finds a folder's record by its config's class
(`for_config`: `architectures` and `model_type` must name the same one); export
(`fivecut.weights.export`) by name, by the class the model was imported from, or by the first
record that holds the checkpoint's shape (`for_args`): a MoE shape picks its MoE class, a shape
no class holds gets fivecut's own format.

    fivecut                               Hugging Face (Llama, Mistral, Qwen2, Qwen3, SmolLM3, OLMo 2, Phi-3)
    tok_embeddings.weight                 model.embed_tokens.weight
    layers.N.attention_norm.weight        model.layers.N.input_layernorm.weight
    layers.N.attention.wq.weight          model.layers.N.self_attn.q_proj.weight   (wk, wv, wo: k/v/o_proj)
    layers.N.attention.wq.bias            model.layers.N.self_attn.q_proj.bias     (Qwen2; wk, wv: k/v_proj)
    layers.N.attention.q_norm.weight      model.layers.N.self_attn.q_norm.weight   (Qwen3; k_norm)
    layers.N.ffn_norm.weight              model.layers.N.post_attention_layernorm.weight
    layers.N.feed_forward.w1.weight       model.layers.N.mlp.gate_proj.weight      (w3: up_proj, w2: down_proj)
    norm.weight                           model.norm.weight
    output.weight                         lm_head.weight   (absent when tie_word_embeddings)

Phi-3 fuses wq, wk, wv into self_attn.qkv_proj.weight and w1, w3 into mlp.gate_up_proj.weight: each
is a row block of the fused tensor (`TensorMap.rows`). OLMo 2's two norms follow their sublayers:
fivecut's attention_norm is its post_attention_layernorm, ffn_norm its post_feedforward_layernorm,
and its q_norm/k_norm span the whole projections.

The dense records are data and small functions of ModelArgs, free of torch (the MoE records import it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from fivecut.model.args import ModelArgs
from fivecut.weights import glm_architecture
from fivecut.weights import moe_architectures as moe
from fivecut.weights.gpt_oss import GPT_OSS
from fivecut.weights.longrope import longrope_config, phi3_rope_fields
from fivecut.weights.rope import CONFIG_KEYS, RopeError, rope_config, rope_fields


class ArchitectureError(ValueError):
    """A config.json fivecut cannot read as any of its classes; the message names the key and the file."""


@dataclass(frozen=True)
class TensorMap:
    """One fivecut tensor and the Hugging Face tensor(s) holding it."""

    ours: str  # fivecut's logical name, e.g. "layers.3.attention.wq.weight"
    theirs: tuple[str, ...]  # one Hugging Face name; with `stacked`, E names: theirs[e] holds ours[e]
    stacked: bool = False  # ours is [E, ...], stacked over experts
    transposed: bool = False  # each Hugging Face tensor is ours (ours[e]) with its last two dims swapped
    # (start, count, total): ours is rows start .. start+count of one Hugging Face tensor of `total` rows,
    # a fused projection (Phi-3's qkv_proj holds wq, wk, wv); the other rows are other fivecut tensors'
    rows: tuple[int, int, int] | None = None
    # ours = theirs + offset: Gemma's norms scale by (1 + w) and store w; fivecut's weight is the scale itself
    offset: float = 0.0

    def hf_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of each Hugging Face tensor, given fivecut's `shape`."""
        one = shape[1:] if self.stacked else shape
        if self.rows:
            return (self.rows[2], *one[1:])
        return (*one[:-2], one[-1], one[-2]) if self.transposed else tuple(one)


@dataclass(frozen=True)
class Architecture:
    hf_class: str
    model_type: str
    to_args: Callable[[HFConfig], ModelArgs]
    to_config: Callable[[ModelArgs], dict]
    holds: Callable[[ModelArgs], str | None]
    tensors: Callable[[ModelArgs], list[TensorMap]]
    # the config.json keys `to_args` reads: each used, or checked to be what fivecut computes; any other
    # key is refused by name unless it is in METADATA (tests/test_config_keys.py holds them to transformers')
    keys: frozenset[str] = frozenset()
    # (key, why): keys of `keys` that carry no math in this class (METADATA's kind, for one class)
    no_math: tuple[tuple[str, str], ...] = ()


METADATA = moe.NO_MATH  # config.json keys without math, and why (shared with the mixture-of-experts readers)


@dataclass
class HFConfig:
    """A parsed config.json being read: each key read is marked; `finish` refuses the others by name.
    `defaults` are the class's values of keys a file may leave out (transformers' config class)."""

    raw: dict
    path: Path
    defaults: dict = field(default_factory=dict)
    seen: set = field(default_factory=set)

    def get(self, key: str, kind: type = int, default=None):
        """The value (the class default when absent or null), refused naming the key unless a `kind`."""
        self.seen.add(key)
        value = self.raw[key] if key in self.raw else self.defaults.get(key)  # written as null: null
        if value is None:
            return default
        kinds = (int, float) if kind is float else (kind,)
        if not isinstance(value, kinds) or (kind is not bool and isinstance(value, bool)):
            article = "an" if kind is int else "a"
            raise ArchitectureError(f"{self.path}: {key} is {value!r}, not {article} {kind.__name__}")
        return value

    def need(self, key: str, kind: type = int):
        value = self.get(key, kind)
        if value is None:
            kind = self.raw.get("model_type")
            raise ArchitectureError(f"{self.path} has no {key!r}; it is not a complete config of {kind!r}")
        return value

    def expect(self, key: str, fine, what: str) -> None:
        """The key, when set, must equal `fine`: the only value fivecut implements (`what` says why)."""
        self.seen.add(key)
        value = self.raw.get(key, self.defaults.get(key))
        if value is not None and value != fine:
            raise ArchitectureError(f"{self.path}: {key} = {value!r} is not implemented; fivecut's {what} has {fine!r}")

    def skip(self, *keys: str) -> None:
        self.seen.update(keys)

    def finish(self, hf_class: str) -> None:
        """Refuse the first key no reader of `hf_class` looked at."""
        rest = sorted(k for k in self.raw if k not in self.seen and k not in METADATA)
        if rest:
            more = f" (and {', '.join(rest[1:])})" if len(rest) > 1 else ""
            raise ArchitectureError(
                f"{self.path}: {rest[0]}{more} is not implemented by fivecut's {hf_class}; a model using it would "
                "compute something else, so it is refused rather than ignored"
            )


# ---------------------------------------------------------------- config.json -> ModelArgs


def rope(cfg: HFConfig, partial_of: int | None = None, reader: Callable = rope_fields) -> dict:
    """ModelArgs' RoPE fields: the base and a scaling fivecut implements (`fivecut.weights.rope`);
    with `partial_of` (a head's channels), the part of each head partial_rotary_factor turns (Phi-3);
    `reader`: the class's reader of them (`rope_fields`'s arguments; Phi-3's reads longrope too)."""
    theta = cfg.get("rope_theta", float, 10000.0)  # transformers < 5 (and beside rope_parameters in fivecut's exports)
    cfg.get("partial_rotary_factor", float)
    cfg.skip(*CONFIG_KEYS)  # rope_parameters, rope_scaling: read (and type-checked) by `rope_fields`
    positions = cfg.get("max_position_embeddings", default=2048)
    try:
        return reader(cfg.raw, cfg.path, theta, positions, partial_of)
    except RopeError as err:
        raise ArchitectureError(str(err)) from None


def head_dim(cfg: HFConfig, dim: int, heads: int) -> int:
    """ModelArgs.attention_head_dim: 0 when the head size is hidden_size / heads (the default)."""
    size = cfg.get("head_dim") or dim // max(heads, 1)
    return 0 if size * heads == dim else size


def dense_args(
    cfg: HFConfig, partial_rotary: bool = False, rope_reader: Callable = rope_fields, **variant
) -> ModelArgs:
    """The fields every dense class here shares (Llama's), plus `variant` (biases, norms, window);
    `partial_rotary`: the class reads partial_rotary_factor (Phi-3; the others refuse it); `rope_reader`:
    the class's reader of its RoPE (`rope`)."""
    cfg.expect("hidden_act", "silu", "SwiGLU feed-forward")
    cfg.expect("attention_dropout", 0.0, "attention (no dropout)")
    cfg.expect("mlp_bias", False, "feed-forward")
    cfg.expect("pretraining_tp", 1, "model (the plain matmuls)")
    dim, heads = cfg.need("hidden_size"), cfg.need("num_attention_heads")
    size = head_dim(cfg, dim, heads) or dim // heads
    return ModelArgs(
        vocab_size=cfg.need("vocab_size"),
        dim=dim,
        n_layers=cfg.need("num_hidden_layers"),
        n_heads=heads,
        n_kv_heads=cfg.get("num_key_value_heads") or heads,
        ffn_dim=cfg.need("intermediate_size"),
        max_seq_len=cfg.get("max_position_embeddings", default=2048),
        **rope(cfg, size if partial_rotary else None, rope_reader),
        norm_eps=float(cfg.get("rms_norm_eps", float, 1e-6)),
        tie_embeddings=cfg.get("tie_word_embeddings", bool, False),
        init_std=float(cfg.get("initializer_range", float, 0.02)),
        attention_head_dim=head_dim(cfg, dim, heads),
        **variant,
    )


def llama_args(cfg: HFConfig) -> ModelArgs:
    cfg.expect("attention_bias", False, "Llama attention (no biases)")
    return dense_args(cfg)


def mistral_args(cfg: HFConfig) -> ModelArgs:
    """Mistral: Llama with a sliding window on every layer (v0.1's 4096; null in later versions)."""
    return dense_args(cfg, sliding_window=cfg.get("sliding_window") or 0)


def qwen_window(cfg: HFConfig) -> dict:
    """Qwen2/Qwen3's window: with use_sliding_window, the layers from max_window_layers on slide
    (transformers' `layer_types`; a file's own layer_types must be that pattern)."""
    use = cfg.get("use_sliding_window", bool, False)
    window = cfg.get("sliding_window") if use else cfg.skip("sliding_window")  # read by transformers only if used
    n_layers = cfg.need("num_hidden_layers")
    first = min(cfg.get("max_window_layers", default=n_layers), n_layers)
    derived = ["sliding_attention" if window and i >= first else "full_attention" for i in range(n_layers)]
    types = cfg.get("layer_types", list) or derived
    full = types.count("full_attention")
    pattern = ["full_attention"] * full + ["sliding_attention"] * (n_layers - full)
    if types != pattern or len(types) != n_layers or (full < n_layers and not window):
        raise ArchitectureError(
            f"{cfg.path}: layer_types {types} is not implemented; fivecut's window covers the layers after the "
            "first max_window_layers (full attention first, then sliding), with use_sliding_window and "
            "sliding_window set"
        )
    if full == n_layers:
        return {}
    return {"sliding_window": window, "full_attention_layers": full}


def qwen2_args(cfg: HFConfig) -> ModelArgs:
    """Qwen2/2.5: biases on q, k and v (always: the class has them, no config key turns them off)."""
    return dense_args(cfg, qkv_bias=True, **qwen_window(cfg))


def qwen3_args(cfg: HFConfig) -> ModelArgs:
    """Qwen3: per-head RMSNorm of q and k, its own head_dim (128 when absent), no biases."""
    cfg.expect("attention_bias", False, "Qwen3 attention (no biases)")
    return dense_args(cfg, qk_norm=True, **qwen_window(cfg))


def smollm3_args(cfg: HFConfig) -> ModelArgs:
    """SmolLM3: Llama with no RoPE on every no_rope_layer_interval-th layer (its NoPE layers), tied embeddings."""
    cfg.expect("attention_bias", False, "SmolLM3 attention (no biases)")
    cfg.expect("use_sliding_window", False, "SmolLM3 attention (full causal attention on every layer)")
    window = cfg.get("sliding_window")  # transformers keeps it (and may mask with it) even without use_sliding_window
    if window is not None:
        raise ArchitectureError(
            f"{cfg.path}: sliding_window = {window} is not implemented; fivecut's SmolLM3 attends fully on every "
            "layer: set sliding_window to null"
        )
    n_layers = cfg.need("num_hidden_layers")
    types = cfg.get("layer_types", list)
    if types and set(types[:n_layers]) != {"full_attention"}:
        raise ArchitectureError(
            f"{cfg.path}: layer_types {types} is not implemented; fivecut's SmolLM3 attends fully on every layer "
            "(a sliding_attention layer gets a window mask): drop layer_types or make each 'full_attention'"
        )
    return dense_args(cfg, nope_interval=nope_interval(cfg, n_layers))


def nope_interval(cfg: HFConfig, n_layers: int) -> int:
    """ModelArgs.nope_interval of SmolLM3's no_rope_layers (layer i rotates where it holds 1; transformers
    derives it from no_rope_layer_interval k when absent: 0 on layers k-1, 2k-1, ...)."""
    interval = cfg.get("no_rope_layer_interval", default=4)
    flags = cfg.get("no_rope_layers", list)
    if flags is None:
        flags = [int((i + 1) % interval != 0) for i in range(n_layers)]
    flags = flags[:n_layers]  # transformers reads the first n_layers entries
    k = flags.index(0) + 1 if 0 in flags else 0
    if len(flags) < n_layers or flags != [int(not k or (i + 1) % k != 0) for i in range(n_layers)]:
        raise ArchitectureError(
            f"{cfg.path}: no_rope_layers {flags} is not implemented; fivecut's NoPE layers are every k-th layer "
            f"(k-1, 2k-1, ...; SmolLM3's pattern) over all {n_layers} layers: write that pattern, or drop "
            "no_rope_layers and set no_rope_layer_interval"
        )
    return k


def olmo2_args(cfg: HFConfig) -> ModelArgs:
    """OLMo 2: each block's norms after attention and after the MLP (on the sublayer's output, before the
    residual add), RMSNorms over the whole q and k projections; no biases."""
    cfg.expect("attention_bias", False, "OLMo 2 attention (no biases)")
    return dense_args(cfg, qk_norm=True, qk_norm_whole=True, norm_after=True)


# the keys Phi-3 reads that carry no math in fivecut's Phi-3, and why (`Architecture.no_math`)
PHI3_NO_MATH = (
    (
        "original_max_position_embeddings",
        "longrope's pretraining context (read with the longrope table, `fivecut.weights.longrope`); without "
        "longrope transformers reads it only to drop a generation cache once past it, which changes no logit",
    ),
)


def phi3_args(cfg: HFConfig) -> ModelArgs:
    """Phi-3 / Phi-4: Llama with q, k, v fused in one projection and gate and up in another (their rows
    are fivecut's wq, wk, wv and w1, w3), partial rotary (partial_rotary_factor), a window on every
    layer when sliding_window is set, LongRoPE (rope_type longrope, or 'su' and 'yarn', which the class
    reads as longrope: `fivecut.weights.longrope`)."""
    for key in ("resid_pdrop", "embd_pdrop"):
        cfg.expect(key, 0.0, "Phi-3 (no dropout)")
    cfg.skip(*dict(PHI3_NO_MATH))
    return dense_args(cfg, True, phi3_rope_fields, sliding_window=cfg.get("sliding_window") or 0)


# ---------------------------------------------------------------- ModelArgs -> config.json


def dense_config(args: ModelArgs, hf_class: str, model_type: str) -> dict:
    return {
        "architectures": [hf_class],
        "model_type": model_type,
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
        **rope_config(args),  # rope_parameters (transformers >= 5), rope_theta and rope_scaling (older)
        "tie_word_embeddings": args.tie_embeddings,
        "attention_dropout": 0.0,
        "initializer_range": args.init_std,
    }


def llama_config(args: ModelArgs) -> dict:
    return dense_config(args, "LlamaForCausalLM", "llama") | {"attention_bias": False, "mlp_bias": False}


def mistral_config(args: ModelArgs) -> dict:
    return dense_config(args, "MistralForCausalLM", "mistral") | {"sliding_window": args.sliding_window or None}


def qwen_window_config(args: ModelArgs) -> dict:
    window = args.has_window
    kinds = ["sliding_attention" if args.layer_window(i) else "full_attention" for i in range(args.n_layers)]
    return {
        "use_sliding_window": window,
        "sliding_window": args.sliding_window if window else None,
        "max_window_layers": args.full_attention_layers if window else args.n_layers,
        "layer_types": kinds,
    }


def qwen2_config(args: ModelArgs) -> dict:
    return dense_config(args, "Qwen2ForCausalLM", "qwen2") | qwen_window_config(args)


def qwen3_config(args: ModelArgs) -> dict:
    return dense_config(args, "Qwen3ForCausalLM", "qwen3") | {"attention_bias": False} | qwen_window_config(args)


# the class's default pad id (SmolLM3's 128004, OLMo 2's 1) names no row of a smaller vocabulary, and
# transformers then refuses to build the embedding; fivecut trains no padding row, so none is named
NO_PAD = None


def smollm3_config(args: ModelArgs) -> dict:
    flags = [int(args.layer_rope(i)) for i in range(args.n_layers)]
    return dense_config(args, "SmolLM3ForCausalLM", "smollm3") | {
        "attention_bias": False,
        "mlp_bias": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "no_rope_layers": flags,  # 1: the layer rotates
        "no_rope_layer_interval": args.nope_interval or args.n_layers + 1,  # (no_rope_layers says it all)
        "layer_types": ["full_attention"] * args.n_layers,
        "pad_token_id": NO_PAD,
    }


def olmo2_config(args: ModelArgs) -> dict:
    return dense_config(args, "Olmo2ForCausalLM", "olmo2") | {"attention_bias": False, "pad_token_id": NO_PAD}


def phi3_config(args: ModelArgs) -> dict:
    return (
        dense_config(args, "Phi3ForCausalLM", "phi3")
        | {
            "sliding_window": args.sliding_window or None,
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "original_max_position_embeddings": args.max_seq_len,
            "pad_token_id": NO_PAD,
        }
        | longrope_config(args)
    )


# ---------------------------------------------------------------- which shapes each class holds

# the block variants a class holds only where its `holds` says so (`dense_problem`'s `own`)
VARIANTS = ("qk_norm_whole", "nope_interval", "norm_after", "rope_partial_dim", *moe.GPT_OSS_ONLY, "sandwich_norms",
            "scale_embeddings", "rope_local_theta", "query_scale_dim", "attn_softcap",
            "logit_softcap", "rope_long_factors")  # fmt: skip


def dense_problem(args: ModelArgs, own: tuple[str, ...] = ()) -> str | None:
    if args.is_moe:
        return "it has mixture-of-experts layers"
    if args.is_mla:
        return "it has multi-head latent attention"
    extra = [name for name in VARIANTS if getattr(args, name) and name not in own]
    extra += ["ffn_activation"] if args.ffn_activation != "silu" and "ffn_activation" not in own else []
    return f"it has {', '.join(extra)}" if extra else None


def holds_llama(args: ModelArgs) -> str | None:
    extra = [n for n in ("qkv_bias", "qk_norm") if getattr(args, n)] + (["sliding_window"] if args.has_window else [])
    return dense_problem(args) or (f"Llama has no {', '.join(extra)}" if extra else None)


def holds_mistral(args: ModelArgs) -> str | None:
    if args.qkv_bias or args.qk_norm:
        return "Mistral has no q/k/v biases or q/k norms"
    if args.full_attention_layers:
        return "Mistral's window covers every layer (full_attention_layers > 0)"
    return dense_problem(args)


def holds_qwen2(args: ModelArgs) -> str | None:
    if not args.qkv_bias or args.qk_norm:
        return "Qwen2 has q/k/v biases and no q/k norms"
    return dense_problem(args)


def holds_qwen3(args: ModelArgs) -> str | None:
    if args.qkv_bias or not args.qk_norm:
        return "Qwen3 has q/k norms and no q/k/v biases"
    return dense_problem(args)


def holds_smollm3(args: ModelArgs) -> str | None:
    if args.qkv_bias or args.qk_norm or args.has_window:
        return "SmolLM3 has no q/k/v biases, q/k norms or sliding window"
    return dense_problem(args, own=("nope_interval",))


def holds_olmo2(args: ModelArgs) -> str | None:
    if not (args.norm_after and args.qk_norm_whole) or args.qkv_bias or args.has_window:
        return "OLMo 2 has norms after each sublayer, q/k norms over the whole projections, no biases or window"
    return dense_problem(args, own=("qk_norm_whole", "norm_after"))


def holds_phi3(args: ModelArgs) -> str | None:
    if args.qkv_bias or args.qk_norm or args.full_attention_layers:
        return "Phi-3 has no q/k/v biases or q/k norms, and its window covers every layer"
    return dense_problem(args, own=("rope_partial_dim", "rope_long_factors"))


# ---------------------------------------------------------------- tensor names

# per-layer suffixes, fivecut -> Hugging Face, of every dense class here
DENSE_LAYER = {
    "attention_norm.weight": "input_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
}
QKV_BIAS = {f"attention.w{x}.bias": f"self_attn.{x}_proj.bias" for x in "qkv"}
QK_NORM = {f"attention.{x}_norm.weight": f"self_attn.{x}_norm.weight" for x in "qk"}
GLOBAL = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
HEAD = {"output.weight": "lm_head.weight"}


def global_tensors(args: ModelArgs) -> list[TensorMap]:
    """The embedding, the final norm and (untied) the head."""
    names = GLOBAL | ({} if args.tie_embeddings else HEAD)
    return [TensorMap(ours, (theirs,)) for ours, theirs in names.items()]


def layer_tensors(args: ModelArgs, suffixes: dict[str, str]) -> list[TensorMap]:
    """`suffixes` (fivecut -> Hugging Face, inside one layer) in every layer."""
    return [
        TensorMap(f"layers.{i}.{ours}", (f"model.layers.{i}.{theirs}",))
        for i in range(args.n_layers)
        for ours, theirs in suffixes.items()
    ]


def dense_tensors(args: ModelArgs) -> list[TensorMap]:
    suffixes = DENSE_LAYER | (QKV_BIAS if args.qkv_bias else {}) | (QK_NORM if args.qk_norm else {})
    return global_tensors(args) + layer_tensors(args, suffixes)


def phi3_tensors(args: ModelArgs) -> list[TensorMap]:
    """Llama's names, but q, k, v as row blocks of qkv_proj and gate, up as row blocks of gate_up_proj."""
    q, kv, ffn = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim, args.ffn_dim
    fused = {
        "attention.wq.weight": ("self_attn.qkv_proj.weight", (0, q, q + 2 * kv)),
        "attention.wk.weight": ("self_attn.qkv_proj.weight", (q, kv, q + 2 * kv)),
        "attention.wv.weight": ("self_attn.qkv_proj.weight", (q + kv, kv, q + 2 * kv)),
        "feed_forward.w1.weight": ("mlp.gate_up_proj.weight", (0, ffn, 2 * ffn)),
        "feed_forward.w3.weight": ("mlp.gate_up_proj.weight", (ffn, ffn, 2 * ffn)),
    }
    plain = {ours: theirs for ours, theirs in DENSE_LAYER.items() if ours not in fused}
    rows = [
        TensorMap(f"layers.{i}.{ours}", (f"model.layers.{i}.{theirs}",), rows=where)
        for i in range(args.n_layers)
        for ours, (theirs, where) in fused.items()
    ]
    return global_tensors(args) + layer_tensors(args, plain) + rows


# OLMo 2's norms sit after their sublayers: fivecut's attention_norm and ffn_norm under their names
OLMO2_NORMS = {
    "attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "post_feedforward_layernorm.weight",
}


def olmo2_tensors(args: ModelArgs) -> list[TensorMap]:
    return global_tensors(args) + layer_tensors(args, DENSE_LAYER | QK_NORM | OLMO2_NORMS)


# ---------------------------------------------------------------- the registry

# the config.json keys every dense reader reads (`dense_args`), and each class's own
DENSE_KEYS = frozenset({
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
    "initializer_range", "hidden_act", "attention_dropout", "mlp_bias", "pretraining_tp", *CONFIG_KEYS,
})  # fmt: skip
QWEN_WINDOW_KEYS = frozenset({"use_sliding_window", "sliding_window", "max_window_layers", "layer_types"})

LLAMA = Architecture(
    "LlamaForCausalLM", "llama", llama_args, llama_config, holds_llama, dense_tensors, DENSE_KEYS | {"attention_bias"}
)
MISTRAL = Architecture(
    "MistralForCausalLM", "mistral", mistral_args, mistral_config, holds_mistral, dense_tensors,
    DENSE_KEYS | {"sliding_window"},
)  # fmt: skip
QWEN2 = Architecture(
    "Qwen2ForCausalLM", "qwen2", qwen2_args, qwen2_config, holds_qwen2, dense_tensors, DENSE_KEYS | QWEN_WINDOW_KEYS
)
QWEN3 = Architecture(
    "Qwen3ForCausalLM", "qwen3", qwen3_args, qwen3_config, holds_qwen3, dense_tensors,
    DENSE_KEYS | QWEN_WINDOW_KEYS | {"attention_bias"},
)  # fmt: skip
SMOLLM3 = Architecture(
    "SmolLM3ForCausalLM", "smollm3", smollm3_args, smollm3_config, holds_smollm3, dense_tensors,
    DENSE_KEYS | {"attention_bias", "use_sliding_window", "sliding_window", "layer_types", "no_rope_layers",
                  "no_rope_layer_interval"},
)  # fmt: skip
PHI3 = Architecture(
    "Phi3ForCausalLM", "phi3", phi3_args, phi3_config, holds_phi3, phi3_tensors,
    DENSE_KEYS | {"sliding_window", "resid_pdrop", "embd_pdrop", *dict(PHI3_NO_MATH)}, PHI3_NO_MATH,
)  # fmt: skip
OLMO2 = Architecture(
    "Olmo2ForCausalLM", "olmo2", olmo2_args, olmo2_config, holds_olmo2, olmo2_tensors, DENSE_KEYS | {"attention_bias"}
)

# transformers' defaults for keys a config.json may leave out, by model_type (where they differ from
# the readers' own: Qwen3's head_dim is its own, Mistral v0.1's window is the class default)
DEFAULTS = {
    "mistral": {"sliding_window": 4096},
    "qwen2": {"max_window_layers": 28, "sliding_window": 4096},
    "qwen3": {"head_dim": 128, "max_window_layers": 28, "sliding_window": 4096},
    "smollm3": {"rope_theta": 2e6, "tie_word_embeddings": True},
    "olmo2": {"rms_norm_eps": 1e-5},
    "phi3": {"rms_norm_eps": 1e-5, "max_position_embeddings": 4096},
}

AnyArchitecture = Architecture | moe.Architecture
DENSE = (LLAMA, MISTRAL, QWEN2, QWEN3, SMOLLM3, OLMO2, PHI3)
ARCHITECTURES: dict[str, AnyArchitecture] = {a.hf_class: a for a in DENSE}


def register(architecture: AnyArchitecture, defaults: dict | None = None) -> None:
    """Add a class: a dense `Architecture`, or a mixture-of-experts `moe.Architecture`."""
    ARCHITECTURES[architecture.hf_class] = architecture
    if defaults:
        DEFAULTS[architecture.model_type] = defaults


for _moe_class in (*moe.ARCHITECTURES, GPT_OSS):  # Mixtral, Qwen3-MoE, DeepSeek-V3, GPT-OSS
    register(_moe_class)
register(glm_architecture.GLM4_MOE)  # GLM-4.5: DeepSeek-V3's router on grouped-query attention


def for_config(raw: dict, path: Path) -> AnyArchitecture:
    """The record of the class a parsed config.json (at `path`) names; refused naming it when none,
    or naming both keys when its `architectures` and `model_type` name different classes."""
    archs = raw.get("architectures") or []
    model_type = raw.get("model_type")
    known = [ARCHITECTURES[a] for a in archs if a in ARCHITECTURES]
    if not known:  # no class named: by model_type
        known = [a for a in ARCHITECTURES.values() if a.model_type == model_type and not archs]
    if known and known[0].model_type != model_type:
        raise ArchitectureError(contradiction(known[0], model_type, path))
    if not known:
        found = ", ".join(archs) or f"model_type {model_type!r}"
        raise ArchitectureError(
            f"{path} describes {found}, which fivecut does not import; it reads {', '.join(ARCHITECTURES)}"
        )
    return known[0]


def contradiction(named: AnyArchitecture, model_type, path: Path) -> str:
    """The line refusing a config.json whose `architectures` names `named` but whose `model_type` is another's."""
    typed = next((a.hf_class for a in ARCHITECTURES.values() if a.model_type == model_type), None)
    other = f", or architectures to [{typed!r}]" if typed else ""
    return (
        f"{path}: architectures names {named.hf_class} but model_type is {model_type!r} ({named.hf_class}'s is "
        f"{named.model_type!r}); transformers builds its class from model_type, so make the two agree: set "
        f"model_type to {named.model_type!r}{other}"
    )


def read_args(raw: dict, path: Path) -> tuple[AnyArchitecture, ModelArgs]:
    """The class and fivecut's shape of the model a parsed config.json describes, every key accounted for."""
    architecture = for_config(raw, path)
    if isinstance(architecture, moe.Architecture):  # its reader refuses the keys it does not know itself
        args = architecture.args(raw, path)
    else:
        cfg = HFConfig(raw, path, DEFAULTS.get(architecture.model_type, {}))
        args = architecture.to_args(cfg)
        cfg.finish(architecture.hf_class)
    try:
        return architecture, args.check()
    except ValueError as err:
        raise ArchitectureError(f"{path}: {err}") from None


def for_args(args: ModelArgs, name: str | None = None) -> AnyArchitecture | None:
    """The class to export a model of shape `args` as: `name`'s (refused with the reason when it
    cannot hold the shape), else the first that holds it, else None (fivecut's own format)."""
    if name is not None:
        if name not in ARCHITECTURES:
            raise ArchitectureError(f"--architecture {name!r} is not one of {', '.join(ARCHITECTURES)}")
        problem = ARCHITECTURES[name].holds(args)
        if problem:
            raise ArchitectureError(f"--architecture {name} cannot hold this model: {problem}")
        return ARCHITECTURES[name]
    return next((a for a in ARCHITECTURES.values() if a.holds(args) is None), None)
