"""The mixture-of-experts classes of Hugging Face: `MixtralForCausalLM`, `Qwen3MoeForCausalLM` and
`DeepseekV3ForCausalLM`, each as one `Architecture` record: its `config.json` <-> `ModelArgs`
(every key used, checked to equal what fivecut computes, or refused by name), and where each
fivecut tensor lies among the Hugging Face tensors (`Stored`).

How transformers 5 keeps and saves experts: in memory one fused tensor per layer
(`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I]), on disk -- what
`save_pretrained` writes and what the published checkpoints hold -- one [out, in] matrix per
expert and projection (Mixtral: `block_sparse_moe.experts.N.w1|w3|w2.weight`; Qwen3-MoE and
DeepSeek-V3: `mlp.experts.N.gate_proj|up_proj|down_proj.weight`). fivecut stacks each projection
of all experts as one [E, in, out] tensor (`GroupedExperts`), so expert e of w1 is the transpose
of expert e's gate_proj. Import reads either form (per expert, or fused); export writes per expert.

    fivecut (layer N)                      Mixtral (model.layers.N.)           Qwen3-MoE, DeepSeek-V3 (model.layers.N.)
    feed_forward.router.weight             block_sparse_moe.gate.weight        mlp.gate.weight
    feed_forward.experts.w1 [E, H, I]      block_sparse_moe.experts.e.w1^T     mlp.experts.e.gate_proj.weight^T
    feed_forward.experts.w3 [E, H, I]      block_sparse_moe.experts.e.w3^T     mlp.experts.e.up_proj.weight^T
    feed_forward.experts.w2 [E, I, H]      block_sparse_moe.experts.e.w2^T     mlp.experts.e.down_proj.weight^T
    feed_forward.shared.w1|w3|w2.weight    -                                   mlp.shared_experts.gate|up|down_proj (V3)
    feed_forward.expert_bias (buffer)      -                                   mlp.gate.e_score_correction_bias (V3)
    attention.q_norm|k_norm.weight         -                                   self_attn.q_norm|k_norm.weight (Qwen3)

DeepSeek-V3's latent attention: wq_a/q_norm/wq_b (or wq) <-> self_attn.q_a_proj/q_a_layernorm/
q_b_proj (or q_proj), wkv_a/kv_norm/wkv_b <-> kv_a_proj_with_mqa/kv_a_layernorm/kv_b_proj, wo <->
o_proj. With `rope_interleave` (its default) the RoPE channels of each query head and of the
shared key come in interleaved pairs; fivecut rotates halves, so those rows are permuted (even
channels first, then odd) on import and back on export (`RopeRows`): the product q.k is the same.
The other tensors are Llama's (`fivecut.weights.names`).

The routings (`fivecut.model.transformer.MoE.route`):
    Mixtral     softmax over the experts, top-k, renormalized             gate="softmax"
    Qwen3-MoE   softmax, top-k, renormalized iff norm_topk_prob           gate="softmax", route_norm
    DeepSeek-V3 sigmoid; selection on score + e_score_correction_bias within the topk_group best
                of n_group groups (a group's score: the sum of its two best biased scores);
                weights: unbiased scores, renormalized iff norm_topk_prob, x routed_scaling_factor
                                                                          gate="sigmoid", expert_bias,
                                                                          expert_groups, route_group_limit,
                                                                          route_norm, route_scale
One difference from transformers is kept on purpose: a single softmax-chosen expert (top-1) weighs
its probability in fivecut (so the router learns) but 1 in transformers; such configs are refused.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from fivecut.model.args import ModelArgs
from fivecut.weights.names import GLOBAL, LAYER
from fivecut.weights.rope import CONFIG_KEYS, RopeError, rope_config, rope_fields
from fivecut.weights.source import WeightsError, optional

SAFETENSORS = "model.safetensors"
INDEX = "model.safetensors.index.json"
SliceOf = Callable[[str], object]  # Hugging Face tensor name -> its safetensors slice (get_slice)
Box = tuple[slice, ...]

# ---------------------------------------------------------------- where a fivecut tensor lies


@dataclass(frozen=True)
class Part:
    """One Hugging Face tensor of an export: the box of a fivecut tensor it is made of, and how."""

    hf_name: str
    offsets: tuple[int, ...]  # where the box starts in the fivecut tensor
    sizes: tuple[int, ...]  # the box's sizes
    transform: Callable[[torch.Tensor], torch.Tensor]  # box -> the Hugging Face tensor
    # GPT-OSS's gate_up_proj: this part is the even (0) or odd (1) columns of hf_name's last dimension, another
    # part of the same hf_name the others (`fivecut.weights.export.write_shard` interleaves them)
    interleave: int | None = None

    @property
    def hf_shape(self) -> tuple[int, ...]:
        return tuple(self.transform(torch.empty(self.sizes, device="meta")).shape)


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t


def _expert(t: torch.Tensor) -> torch.Tensor:
    return t[0].T  # [1, in, out] -> [out, in]


def _box_of(shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return (0,) * len(shape), tuple(shape)


@dataclass(frozen=True)
class Same:
    """One Hugging Face tensor with fivecut's layout."""

    name: str

    def hf_names(self) -> list[str]:
        return [self.name]

    def shape(self, slice_of: SliceOf) -> tuple[int, ...]:
        return tuple(slice_of(self.name).get_shape())

    def read(self, slice_of: SliceOf, box: Box) -> torch.Tensor:
        return slice_of(self.name)[box]

    def parts(self, shape: tuple[int, ...]) -> list[Part]:
        return [Part(self.name, *_box_of(shape), _whole)]


@dataclass(frozen=True)
class PerExpert:
    """fivecut's [E, in, out] stack of one projection: expert e is Hugging Face's [out, in] `names[e]`."""

    names: tuple[str, ...]

    def hf_names(self) -> list[str]:
        return list(self.names)

    def shape(self, slice_of: SliceOf) -> tuple[int, ...]:
        shapes = {name: tuple(slice_of(name).get_shape()) for name in self.names}
        first = shapes[self.names[0]]
        for name, shape in shapes.items():
            if shape != first or len(shape) != 2:
                raise WeightsError(f"expert tensor {name} has shape {shape}, {self.names[0]} has {first}")
        return (len(self.names), first[1], first[0])

    def read(self, slice_of: SliceOf, box: Box) -> torch.Tensor:
        experts, rows, cols = box  # over fivecut's [E, in, out]
        return torch.stack([slice_of(self.names[e])[cols, rows].T for e in range(experts.start, experts.stop)])

    def parts(self, shape: tuple[int, ...]) -> list[Part]:
        return [Part(name, (e, 0, 0), (1, *shape[1:]), _expert) for e, name in enumerate(self.names)]


@dataclass(frozen=True)
class Fused:
    """One projection of every expert inside a fused Hugging Face tensor (transformers' in-memory
    form, read when a folder holds it): `gate_up_proj` [E, 2I, H] (half 0: gate, 1: up) or
    `down_proj` [E, H, I] (half None); fivecut's is [E, H, I] or [E, I, H]: the last two swapped."""

    name: str
    half: int | None

    def hf_names(self) -> list[str]:
        return [self.name]

    def shape(self, slice_of: SliceOf) -> tuple[int, ...]:
        e, rows, cols = slice_of(self.name).get_shape()
        return (e, cols, rows // 2 if self.half is not None else rows)

    def read(self, slice_of: SliceOf, box: Box) -> torch.Tensor:
        experts, rows, cols = box
        if self.half is not None:
            width = self.shape(slice_of)[2]
            cols = slice(cols.start + self.half * width, cols.stop + self.half * width)
        return slice_of(self.name)[experts, cols, rows].transpose(1, 2)

    def parts(self, shape: tuple[int, ...]) -> list[Part]:
        raise NotImplementedError("exports write experts one by one (PerExpert)")


@dataclass(frozen=True)
class RopeRows:
    """A projection whose rows come in blocks of `width` (one per head) ending in `rope` RoPE
    channels, stored by Hugging Face in interleaved pairs (DeepSeek's rope_interleave); fivecut
    rotates halves, so its row j of those channels is their row `order[j]` (evens, then odds)."""

    name: str
    width: int
    rope: int

    def hf_names(self) -> list[str]:
        return [self.name]

    def shape(self, slice_of: SliceOf) -> tuple[int, ...]:
        return tuple(slice_of(self.name).get_shape())

    def order(self, rows: int) -> torch.Tensor:
        """[rows]: the Hugging Face row of each fivecut row."""
        nope = self.width - self.rope
        within = torch.cat(
            [torch.arange(nope), nope + torch.arange(0, self.rope, 2), nope + torch.arange(1, self.rope, 2)]
        )
        return (torch.arange(0, rows, self.width).unsqueeze(1) + within).reshape(-1)

    def read(self, slice_of: SliceOf, box: Box) -> torch.Tensor:
        rows = self.order(self.shape(slice_of)[0])[box[0]]  # the Hugging Face rows of the box's rows
        lo, hi = int(rows.min()), int(rows.max()) + 1  # within one block when the box is a head's
        return slice_of(self.name)[(slice(lo, hi), *box[1:])][rows - lo]

    def parts(self, shape: tuple[int, ...]) -> list[Part]:
        return [Part(self.name, *_box_of(shape), Interleave(self.order(shape[0])))]


@dataclass(frozen=True, eq=False)
class Interleave:
    """fivecut's rows -> Hugging Face's interleaved RoPE rows: row j goes to row `order[j]` (a plain
    object, not a closure, so that export's worker processes receive it)."""

    order: torch.Tensor  # [rows]

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(t)
        out[self.order] = t
        return out


Stored = Same | PerExpert | Fused | RopeRows

# ---------------------------------------------------------------- config.json checks


def _need(config: dict, key: str, path: Path, kind: type = int):
    if config.get(key) is None:
        raise WeightsError(f"{path} has no {key!r}; it is not a complete {config.get('model_type')} config")
    return optional(config, key, None, path, kind)


def _refuse(path: Path, key: str, value, why: str):
    raise WeightsError(f"{path}: {key} = {value!r} is not implemented by fivecut ({why}); no import of this model")


def _equal(config: dict, key: str, path: Path, implemented, why: str, absent_ok: bool = True) -> None:
    """config[key] must be what fivecut implements (absent or null counts as it when `absent_ok`)."""
    value = config.get(key)
    if value is None and absent_ok:
        return
    if value != implemented:
        _refuse(path, key, value, why)


def _either(config: dict, path: Path, key: str, alias: str):
    """config[key], or config[alias]: the name transformers' `attribute_map` reads as `key`; both set
    to different values is refused naming both (which one transformers keeps depends on its version)."""
    value, other = config.get(key), config.get(alias)
    if value is not None and other is not None and value != other:
        raise WeightsError(f"{path}: {key} = {value!r} and {alias} = {other!r} name one count; keep one of them")
    return value if value is not None else other


# config.json keys that change nothing transformers or fivecut computes in a forward pass, and why;
# every class's reader (and the dense ones, `fivecut.weights.architectures`) passes them over
NO_MATH: dict[str, str] = {
    **dict.fromkeys(
        ("architectures", "model_type"), "the class: `architectures.for_config` holds the two to each other"
    ),
    **dict.fromkeys(("transformers_version", "_name_or_path", "auto_map"), "who wrote the file, and where from"),
    **dict.fromkeys(("dtype", "torch_dtype"), "the dtype the weights are stored in: import reads them in fp32"),
    **dict.fromkeys(("bos_token_id", "eos_token_id"), "token ids for generation: the tokenizer's files carry them"),
    "pad_token_id": "the embedding's padding row: transformers zeroes its gradient, no forward pass reads it",
    "fivecut_tokenizer": "a fivecut export's tokenizer with no Hugging Face files (e.g. byte)",
    **dict.fromkeys(
        ("use_cache", "output_attentions", "output_hidden_states", "return_dict"), "what transformers returns"
    ),
    **dict.fromkeys(
        ("id2label", "label2id", "problem_type", "chunk_size_feed_forward", "is_encoder_decoder"),
        "PreTrainedConfig's fields of other tasks (classification heads, encoder-decoders, chunked feed-forwards "
        "that compute the same numbers)",
    ),
    "output_router_logits": "returns the router logits for transformers' auxiliary loss",
    "router_aux_loss_coef": "that loss's weight: fivecut's is moe.aux_loss_coef, a training choice",
    "aux_loss_alpha": "DeepSeek's auxiliary loss weight: a training choice (moe.aux_loss_coef)",
    "seq_aux": "DeepSeek's per-sequence auxiliary loss: a training choice",
    "ep_size": "DeepSeek's inference code's expert-parallel degree: fivecut's is parallel.ep",
}
# config.json keys that shape no ModelArgs field but say where tensors lie (the record's `tensors`, `_skipped`)
TENSOR_KEYS: dict[str, str] = {
    "rope_interleave": "DeepSeek-V3's RoPE rows in interleaved pairs, permuted on import and export (`RopeRows`)",
    "num_nextn_predict_layers": "DeepSeek-V3's multi-token-prediction layers: transformers builds none, fivecut "
    "neither; their tensors are left unread",
    "num_mtp_layers": "transformers' name of num_nextn_predict_layers",
}
# the keys fivecut reads into the shape every class shares (`_common_args`)
COMMON = {
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "max_position_embeddings",
    *CONFIG_KEYS,  # rope_parameters, rope_scaling, rope_theta, partial_rotary_factor (`fivecut.weights.rope`)
    "rms_norm_eps",
    "tie_word_embeddings",
    "initializer_range",
    "hidden_act",
    "attention_dropout",
    "attention_bias",
}


def _check_keys(config: dict, path: Path, known: set[str]) -> None:
    unknown = sorted(set(config) - set(NO_MATH) - COMMON - known)
    if unknown:
        _refuse(path, unknown[0], config[unknown[0]], f"{config.get('model_type')} has no such key that fivecut knows")


def _rope(config: dict, path: Path, theta: float, partial_of: int | None = None) -> dict:
    """ModelArgs' RoPE fields (`fivecut.weights.rope`; `theta`: the class's default rope_theta),
    refused by name where fivecut has no such RoPE; with `partial_of` (a head's channels), the part
    of each head partial_rotary_factor turns (GLM-4.5)."""
    theta = optional(config, "rope_theta", theta, path, float)
    positions = optional(config, "max_position_embeddings", 2048, path)
    try:
        return rope_fields(config, path, theta, positions, partial_of)
    except RopeError as err:
        raise WeightsError(str(err)) from None


def _common_args(
    config: dict, path: Path, theta: float = 1e4, partial_of: int | None = None, biases: bool = False
) -> dict:
    """ModelArgs fields every class gives the same way (`theta`: the class's default rope_theta;
    `partial_of`: a head's channels, of which partial_rotary_factor turns a part, `_rope`;
    `biases`: the class reads attention_bias itself, else it must be false)."""
    _equal(config, "hidden_act", path, "silu", "fivecut's feed-forward is SwiGLU")
    _equal(config, "attention_dropout", path, 0.0, "fivecut has no dropout")
    if not biases:
        _equal(config, "attention_bias", path, False, "fivecut's projections have no biases")
    heads = _need(config, "num_attention_heads", path)
    return dict(
        vocab_size=_need(config, "vocab_size", path),
        dim=_need(config, "hidden_size", path),
        n_layers=_need(config, "num_hidden_layers", path),
        n_heads=heads,
        n_kv_heads=optional(config, "num_key_value_heads", heads, path),
        max_seq_len=optional(config, "max_position_embeddings", 2048, path),
        **_rope(config, path, theta, partial_of),
        norm_eps=float(optional(config, "rms_norm_eps", 1e-6, path, float)),
        tie_embeddings=optional(config, "tie_word_embeddings", False, path, bool),
        init_std=float(optional(config, "initializer_range", 0.02, path, float)),
    )


def _attention_head_dim(config: dict, path: Path) -> int:
    """Plain attention's ModelArgs.attention_head_dim: the config's head_dim, 0 when it is
    hidden_size / num_attention_heads (or absent)."""
    dim, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = optional(config, "head_dim", None, path)
    if head_dim is not None and head_dim <= 0:
        _refuse(path, "head_dim", head_dim, "a head needs channels")
    return 0 if head_dim is None or head_dim * heads == dim else head_dim


def _top_k(config: dict, path: Path, normalized: bool) -> int:
    k = _need(config, "num_experts_per_tok", path)
    if k == 1 and normalized:
        _refuse(
            path, "num_experts_per_tok", k, "a lone softmax-chosen expert weighs its probability in fivecut, 1 here"
        )
    return k


def _common_config(args: ModelArgs) -> dict:
    return {
        "vocab_size": args.vocab_size,
        "hidden_size": args.dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "hidden_act": "silu",
        "max_position_embeddings": args.max_seq_len,
        "rms_norm_eps": args.norm_eps,
        **rope_config(args),  # rope_parameters (transformers >= 5), rope_theta and rope_scaling (older)
        "tie_word_embeddings": args.tie_embeddings,
        "initializer_range": args.init_std,
        "attention_dropout": 0.0,
    }


# ---------------------------------------------------------------- the three classes


MIXTRAL_KEYS = {
    "intermediate_size",
    "num_local_experts",
    "num_experts",  # transformers' attribute_map: num_local_experts
    "num_experts_per_tok",
    "head_dim",
    "sliding_window",
    "router_jitter_noise",
}
MIXTRAL_THETA = 1e6  # transformers' MixtralConfig.default_theta: a file without rope_theta has this base


def mixtral_args(config: dict, path: Path) -> ModelArgs:
    _check_keys(config, path, MIXTRAL_KEYS)
    _equal(config, "router_jitter_noise", path, 0.0, "fivecut routes without noise")
    hidden = _need(config, "intermediate_size", path)
    return ModelArgs(
        **_common_args(config, path, MIXTRAL_THETA),
        ffn_dim=hidden,
        n_experts=_experts_count(config, path, "num_local_experts", "num_experts"),
        top_k=_top_k(config, path, True),
        moe_ffn_dim=hidden,
        gate="softmax",
        route_norm=True,
        attention_head_dim=_attention_head_dim(config, path),
        sliding_window=optional(config, "sliding_window", 0, path),  # on every layer, as Mistral's; null: none
    )


def mixtral_config(args: ModelArgs) -> dict:
    return _common_config(args) | {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "intermediate_size": args.expert_dim,
        "head_dim": args.head_dim,
        "num_local_experts": args.n_experts,
        "num_experts_per_tok": args.top_k,
        "sliding_window": args.sliding_window or None,
        "router_jitter_noise": 0.0,
    }


# GPT-OSS's fields (`fivecut.weights.gpt_oss`): the other classes hold none of them
GPT_OSS_ONLY = ("attention_sinks", "wo_bias", "window_layers", "moe_bias", "swiglu_limit")


def gpt_oss_fields(args: ModelArgs) -> tuple[bool, str]:
    """(holds, why not) of a class without GPT-OSS's fields."""
    found = [name for name in GPT_OSS_ONLY if getattr(args, name)]
    return not found, f"it has GPT-OSS's {', '.join(found)}"


def mixtral_holds(args: ModelArgs) -> str | None:
    """None when MixtralForCausalLM holds a model of shape `args` exactly, else why not."""
    return _unmet(
        (args.is_moe, "it has no experts"),
        gpt_oss_fields(args),
        (not args.qkv_bias, "its q/k/v projections have biases"),
        (not args.full_attention_layers, "its window covers every layer (full_attention_layers > 0)"),
        (not args.is_mla, "its attention is latent"),
        (not args.qk_norm, "its query and key heads are normed"),
        (args.gate == "softmax" and args.route_norm, "its router is not a renormalized softmax"),
        (args.top_k > 1, "it routes each token to one expert"),
        (args.route_scale == 1.0, f"its routing weights are scaled by {args.route_scale}"),
        (args.expert_groups == 1, "its routing is group-limited"),
        (args.n_shared_experts == 0, "it has shared experts"),
        (args.first_dense_layers == 0, "its first layers are dense"),
    )


def _experts_count(config: dict, path: Path, key: str, alias: str) -> int:
    """The routed experts' count, under `key` or its `alias` (`_either`)."""
    experts = _either(config, path, key, alias)
    if not isinstance(experts, int) or isinstance(experts, bool) or experts <= 0:
        _refuse(path, key, experts, f"a {config.get('model_type')} needs experts")
    return experts


def _group_count(config: dict, path: Path, experts: int) -> int:
    """n_group of a DeepSeek-style group-limited router (DeepSeek-V3, GLM-4.5), refused where a
    group holds one expert: transformers scores a group by the sum of its two best."""
    groups = optional(config, "n_group", 1, path)
    if groups > 1 and experts // groups < 2:
        _refuse(path, "n_group", groups, "transformers scores a group by its two best experts: give >= 2 per group")
    return groups


def _unmet(*conditions: tuple[bool, str]) -> str | None:
    """The reason of the first condition that fails, or None."""
    return next((why for holds, why in conditions if not holds), None)


QWEN3_MOE_KEYS = {
    "intermediate_size",
    "moe_intermediate_size",
    "num_experts",
    "num_local_experts",  # transformers 5 writes num_experts under this name
    "num_experts_per_tok",
    "norm_topk_prob",
    "decoder_sparse_step",
    "mlp_only_layers",
    "use_sliding_window",
    "sliding_window",
    "max_window_layers",
    "head_dim",
}


def qwen3_moe_args(config: dict, path: Path) -> ModelArgs:
    _check_keys(config, path, QWEN3_MOE_KEYS)
    _equal(config, "use_sliding_window", path, False, "fivecut's attention is causal over the whole sequence")
    experts = _experts_count(config, path, "num_experts", "num_local_experts")
    norm = optional(config, "norm_topk_prob", False, path, bool)
    return ModelArgs(
        **_common_args(config, path),
        ffn_dim=_need(config, "intermediate_size", path),
        n_experts=experts,
        top_k=_top_k(config, path, norm),
        moe_ffn_dim=_need(config, "moe_intermediate_size", path),
        first_dense_layers=_qwen3_dense_layers(config, path),
        gate="softmax",
        route_norm=norm,
        qk_norm=True,
        attention_head_dim=_attention_head_dim(config, path),
    )


def _qwen3_dense_layers(config: dict, path: Path) -> int:
    """Qwen3-MoE's dense layers as fivecut's first_dense_layers: `mlp_only_layers` must be the first
    k layers, and `decoder_sparse_step` 1 (every other layer a MoE one)."""
    _equal(config, "decoder_sparse_step", path, 1, "fivecut's MoE layers are all layers from first_dense_layers on")
    dense = config.get("mlp_only_layers") or []
    if not isinstance(dense, list) or dense != list(range(len(dense))):
        _refuse(path, "mlp_only_layers", dense, "fivecut's dense layers are the first k: give [0, ..., k-1]")
    return len(dense)


def qwen3_moe_config(args: ModelArgs) -> dict:
    return _common_config(args) | {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "intermediate_size": args.ffn_dim,
        "moe_intermediate_size": args.expert_dim,
        "head_dim": args.head_dim,
        "num_experts": args.n_experts,
        "num_experts_per_tok": args.top_k,
        "norm_topk_prob": args.route_norm,
        "decoder_sparse_step": 1,
        "mlp_only_layers": list(range(args.first_dense_layers)),
        "use_sliding_window": False,
        "sliding_window": None,
        "attention_bias": False,
    }


def qwen3_moe_holds(args: ModelArgs) -> str | None:
    """None when Qwen3MoeForCausalLM holds a model of shape `args` exactly, else why not."""
    return _unmet(
        (args.is_moe, "it has no experts"),
        gpt_oss_fields(args),
        (not args.qkv_bias, "its q/k/v projections have biases"),
        (not args.has_window, "its attention has a sliding window"),
        (not args.is_mla, "its attention is latent"),
        (args.qk_norm, "its query and key heads are not normed"),
        (args.gate == "softmax", "its router is not a softmax"),
        (args.top_k > 1 or not args.route_norm, "a lone softmax expert weighs 1 there, its probability here"),
        (args.route_scale == 1.0, f"its routing weights are scaled by {args.route_scale}"),
        (args.expert_groups == 1, "its routing is group-limited"),
        (args.n_shared_experts == 0, "it has shared experts"),
    )


# the config.json keys of DeepSeek-V3's feed-forward (its router, experts, first dense layers) and of its
# multi-token-prediction layers: GLM-4.5's too (`fivecut.weights.glm_architecture`)
DEEPSEEK_MOE_KEYS = {
    "intermediate_size",
    "moe_intermediate_size",
    "n_routed_experts",
    "num_local_experts",  # transformers' attribute_map: n_routed_experts
    "n_shared_experts",
    "num_experts_per_tok",
    "n_group",
    "topk_group",
    "routed_scaling_factor",
    "norm_topk_prob",
    "first_k_dense_replace",
    "num_nextn_predict_layers",  # multi-token prediction layers: transformers builds none (nor does fivecut)
    "num_mtp_layers",
}
DEEPSEEK_V3_KEYS = DEEPSEEK_MOE_KEYS | {
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "qk_head_dim",  # derived: nope + rope
    "head_dim",  # the channels transformers' RoPE rotates: checked to be qk_rope_head_dim
    "rope_interleave",
    "pretraining_tp",
    # DeepSeek's own config.json: checked to be the routing fivecut computes, or without effect
    "scoring_func",
    "topk_method",
    "moe_layer_freq",
    "ep_size",
    "aux_loss_alpha",
    "seq_aux",
}
DEEPSEEK_LATENT_EPS = 1e-6  # transformers builds the latent norms (q_a_layernorm, kv_a_layernorm) with eps 1e-6


def deepseek_v3_args(config: dict, path: Path) -> ModelArgs:
    _check_keys(config, path, DEEPSEEK_V3_KEYS)
    _equal(config, "pretraining_tp", path, 1, "fivecut computes each projection whole")
    _equal(config, "scoring_func", path, "sigmoid", "DeepSeek-V3's router is sigmoid")
    _equal(config, "topk_method", path, "noaux_tc", "fivecut's group-limited selection is DeepSeek-V3's noaux_tc")
    _equal(config, "moe_layer_freq", path, 1, "fivecut's MoE layers are all layers from first_dense_layers on")
    common = _common_args(config, path)
    nope, rope = _need(config, "qk_nope_head_dim", path), _need(config, "qk_rope_head_dim", path)
    _equal(config, "qk_head_dim", path, nope + rope, "it is qk_nope_head_dim + qk_rope_head_dim")
    _equal(config, "head_dim", path, rope, "transformers' RoPE rotates head_dim channels: give qk_rope_head_dim")
    return ModelArgs(
        **common,
        **deepseek_moe_args(config, path),
        q_lora_rank=optional(config, "q_lora_rank", 0, path),
        kv_lora_rank=_need(config, "kv_lora_rank", path),
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope,
        v_head_dim=_need(config, "v_head_dim", path),
        latent_norm_eps=0.0 if common["norm_eps"] == DEEPSEEK_LATENT_EPS else DEEPSEEK_LATENT_EPS,
    )


def deepseek_moe_args(config: dict, path: Path) -> dict:
    """ModelArgs' feed-forward fields of DeepSeek-V3's keys (`DEEPSEEK_MOE_KEYS`; GLM-4.5's too): the
    sigmoid router with correction biases, group limits, renormalization and scale; shared experts."""
    experts = _experts_count(config, path, "n_routed_experts", "num_local_experts")
    return dict(
        ffn_dim=_need(config, "intermediate_size", path),
        n_experts=experts,
        top_k=_need(config, "num_experts_per_tok", path),
        n_shared_experts=optional(config, "n_shared_experts", 0, path),
        moe_ffn_dim=_need(config, "moe_intermediate_size", path),
        first_dense_layers=optional(config, "first_k_dense_replace", 0, path),
        gate="sigmoid",
        route_scale=float(optional(config, "routed_scaling_factor", 1.0, path, float)),
        route_norm=optional(config, "norm_topk_prob", True, path, bool),
        expert_groups=_group_count(config, path, experts),
        route_group_limit=optional(config, "topk_group", 1, path),
    )


def deepseek_moe_config(args: ModelArgs) -> dict:
    """The config.json keys of `deepseek_moe_args`, from the model's shape."""
    return {
        "intermediate_size": args.ffn_dim,
        "moe_intermediate_size": args.expert_dim,
        "n_routed_experts": args.n_experts,
        "n_shared_experts": args.n_shared_experts,
        "num_experts_per_tok": args.top_k,
        "n_group": args.expert_groups,
        "topk_group": args.route_group_limit,
        "routed_scaling_factor": args.route_scale,
        "norm_topk_prob": args.route_norm,
        "first_k_dense_replace": args.first_dense_layers,
        "num_nextn_predict_layers": 0,
    }


def deepseek_v3_config(args: ModelArgs) -> dict:
    return (
        _common_config(args)
        | deepseek_moe_config(args)
        | {
            "architectures": ["DeepseekV3ForCausalLM"],
            "model_type": "deepseek_v3",
            "q_lora_rank": args.q_lora_rank or None,
            "kv_lora_rank": args.kv_lora_rank,
            "qk_nope_head_dim": args.qk_nope_head_dim,
            "qk_rope_head_dim": args.qk_rope_head_dim,
            "v_head_dim": args.v_head_dim,
            "rope_interleave": True,  # as DeepSeek publishes: the RoPE rows in pairs (`RopeRows`)
            "attention_bias": False,
            "pretraining_tp": 1,
        }
    )


def deepseek_v3_holds(args: ModelArgs) -> str | None:
    """None when DeepseekV3ForCausalLM holds a model of shape `args` exactly, else why not."""
    group_size = args.n_experts // args.expert_groups if args.is_moe else 0
    return _unmet(
        (args.is_moe, "it has no experts"),
        gpt_oss_fields(args),
        (not args.qkv_bias, "its q/k/v projections have biases"),
        (not args.has_window, "its attention has a sliding window"),
        (args.is_mla, "its attention is not latent"),
        (args.gate == "sigmoid", "its router is not a sigmoid"),
        (args.n_shared_experts >= 1, "it has no shared expert"),
        (args.latent_eps == DEEPSEEK_LATENT_EPS, f"its latent norms' eps is {args.latent_eps}, not 1e-6"),
        (args.expert_groups == 1 or group_size >= 2, "its groups hold one expert (transformers scores the best two)"),
    )


# ---------------------------------------------------------------- tensors


def _layer_names(layer: str) -> dict[str, str]:
    """fivecut -> Hugging Face names of a layer's Llama-shaped tensors (attention, norms, dense MLP)."""
    return {f"layers.{layer}.{ours}": f"model.layers.{layer}.{theirs}" for ours, (theirs, _) in LAYER.items()}


def _experts(prefix: str, n: int, projections: tuple[str, str, str], files: set[str]) -> dict[str, Stored]:
    """fivecut's w1, w3, w2 of a layer's experts (`prefix` ends in `.experts`), per expert or fused."""
    if f"{prefix}.gate_up_proj" in files:
        return {"w1": Fused(f"{prefix}.gate_up_proj", 0), "w3": Fused(f"{prefix}.gate_up_proj", 1)} | {
            "w2": Fused(f"{prefix}.down_proj", None)
        }
    return {
        ours: PerExpert(tuple(f"{prefix}.{e}.{theirs}.weight" for e in range(n)))
        for ours, theirs in zip(("w1", "w3", "w2"), projections)
    }


def _moe_layer(args: ModelArgs, n: int, moe: str, projections: tuple[str, str, str], files: set[str]) -> dict:
    """A MoE layer's router and experts (`moe`: its Hugging Face module, e.g. model.layers.3.mlp)."""
    ours = f"layers.{n}.feed_forward"
    experts = _experts(f"{moe}.experts", args.n_experts, projections, files)
    return {f"{ours}.router.weight": Same(f"{moe}.gate.weight")} | {
        f"{ours}.experts.{k}": stored for k, stored in experts.items()
    }


def _plain_tensors(args: ModelArgs, layer: int) -> dict[str, Stored]:
    names = _layer_names(str(layer))
    if not args.moe_layer(layer):
        return {ours: Same(theirs) for ours, theirs in names.items()}
    return {ours: Same(theirs) for ours, theirs in names.items() if ".feed_forward." not in ours}


def mixtral_tensors(args: ModelArgs, files: set[str]) -> dict[str, Stored]:
    out = _global_tensors(args)
    for n in range(args.n_layers):
        out |= _plain_tensors(args, n)
        out |= _moe_layer(args, n, f"model.layers.{n}.block_sparse_moe", ("w1", "w3", "w2"), files)
    return out


GATE_UP_DOWN = ("gate_proj", "up_proj", "down_proj")


def qwen3_moe_tensors(args: ModelArgs, files: set[str]) -> dict[str, Stored]:
    out = _global_tensors(args)
    for n in range(args.n_layers):
        out |= _plain_tensors(args, n)
        attention = f"model.layers.{n}.self_attn"
        out |= {f"layers.{n}.attention.{k}.weight": Same(f"{attention}.{k}.weight") for k in ("q_norm", "k_norm")}
        if args.moe_layer(n):
            out |= _moe_layer(args, n, f"model.layers.{n}.mlp", GATE_UP_DOWN, files)
    return out


def deepseek_v3_tensors(args: ModelArgs, files: set[str], interleaved: bool) -> dict[str, Stored]:
    out = _global_tensors(args)
    for n in range(args.n_layers):
        names = _layer_names(str(n))
        norms = ("attention_norm.weight", "ffn_norm.weight")
        out |= {f"layers.{n}.{k}": Same(names[f"layers.{n}.{k}"]) for k in norms}
        out |= _latent_attention(args, n, interleaved)
        mlp = f"model.layers.{n}.mlp"
        if not args.moe_layer(n):
            out |= {ours: Same(theirs) for ours, theirs in names.items() if ".feed_forward." in ours}
            continue
        out |= _moe_layer(args, n, mlp, GATE_UP_DOWN, files) | _shared_experts(n, mlp)
    return out


def _shared_experts(n: int, mlp: str) -> dict[str, Stored]:
    """Layer n's shared experts (DeepSeek-V3, GLM-4.5: one SwiGLU, `mlp`.shared_experts.*)."""
    shared = f"layers.{n}.feed_forward.shared"
    pairs = zip(("w1", "w3", "w2"), GATE_UP_DOWN)
    return {f"{shared}.{k}.weight": Same(f"{mlp}.shared_experts.{p}.weight") for k, p in pairs}


def _latent_attention(args: ModelArgs, n: int, interleaved: bool) -> dict[str, Stored]:
    ours, theirs = f"layers.{n}.attention", f"model.layers.{n}.self_attn"
    qk, rope = args.qk_head_dim, args.qk_rope_head_dim

    def rotated(name: str, width: int) -> Stored:
        return RopeRows(name, width, rope) if interleaved else Same(name)

    out = {
        f"{ours}.wkv_a.weight": rotated(f"{theirs}.kv_a_proj_with_mqa.weight", args.kv_lora_rank + rope),
        f"{ours}.kv_norm.weight": Same(f"{theirs}.kv_a_layernorm.weight"),
        f"{ours}.wkv_b.weight": Same(f"{theirs}.kv_b_proj.weight"),
        f"{ours}.wo.weight": Same(f"{theirs}.o_proj.weight"),
    }
    if args.q_lora_rank:
        return out | {
            f"{ours}.wq_a.weight": Same(f"{theirs}.q_a_proj.weight"),
            f"{ours}.q_norm.weight": Same(f"{theirs}.q_a_layernorm.weight"),
            f"{ours}.wq_b.weight": rotated(f"{theirs}.q_b_proj.weight", qk),
        }
    return out | {f"{ours}.wq.weight": rotated(f"{theirs}.q_proj.weight", qk)}


def _global_tensors(args: ModelArgs) -> dict[str, Stored]:
    tied = {"output.weight"} if args.tie_embeddings else set()
    return {ours: Same(theirs) for ours, (theirs, _) in GLOBAL.items() if ours not in tied}


def bias_buffers(args: ModelArgs) -> dict[str, Stored]:
    """DeepSeek-V3's e_score_correction_bias of each MoE layer: fivecut's routing bias buffer."""
    return {
        f"layers.{n}.feed_forward.expert_bias": Same(f"model.layers.{n}.mlp.gate.e_score_correction_bias")
        for n in range(args.n_layers)
        if args.moe_layer(n)
    }


def no_buffers(args: ModelArgs) -> dict[str, Stored]:
    return {}


# ---------------------------------------------------------------- the records


@dataclass(frozen=True)
class Architecture:
    """One Hugging Face class fivecut reads and writes."""

    hf_class: str
    model_type: str
    args: Callable[[dict, Path], ModelArgs]  # config.json (parsed) at a path -> the model's shape
    config: Callable[[ModelArgs], dict]  # the shape -> config.json (without dtype and token ids)
    holds: Callable[[ModelArgs], str | None]  # None when this class holds a model of the shape exactly, else why not
    tensors: Callable[[ModelArgs, set[str], dict], dict[str, Stored]]  # (shape, file's names, config) -> parameters
    buffers: Callable[[ModelArgs], dict[str, Stored]]  # the routing biases the class stores, if any
    # the config.json keys `args` reads: each used, or checked to be what fivecut computes; any other
    # key is refused by name unless it is in NO_MATH (tests/test_config_keys.py holds them to transformers')
    keys: frozenset[str] = frozenset()


ARCHITECTURES = (
    Architecture(
        "MixtralForCausalLM", "mixtral", mixtral_args, mixtral_config, mixtral_holds,
        lambda args, files, config: mixtral_tensors(args, files), no_buffers, frozenset(COMMON | MIXTRAL_KEYS),
    ),
    Architecture(
        "Qwen3MoeForCausalLM", "qwen3_moe", qwen3_moe_args, qwen3_moe_config, qwen3_moe_holds,
        lambda args, files, config: qwen3_moe_tensors(args, files), no_buffers, frozenset(COMMON | QWEN3_MOE_KEYS),
    ),
    Architecture(
        "DeepseekV3ForCausalLM", "deepseek_v3", deepseek_v3_args, deepseek_v3_config, deepseek_v3_holds,
        lambda args, files, config: deepseek_v3_tensors(args, files, config.get("rope_interleave", True) is not False),
        bias_buffers, frozenset(COMMON | DEEPSEEK_V3_KEYS),
    ),
)  # fmt: skip


# ---------------------------------------------------------------- a folder's tensors, checked


def layout(arch: Architecture, args: ModelArgs, config: dict, files: dict[str, Path], folder: Path):
    """(parameters, buffers): fivecut name -> `Stored`, after checking that the folder holds every
    Hugging Face tensor they need and no tensor they do not (one line naming it and its file)."""
    params = arch.tensors(args, set(files), config)
    buffers = arch.buffers(args)
    needed = {name for stored in (*params.values(), *buffers.values()) for name in stored.hf_names()}
    missing = sorted(needed - set(files), key=_natural)
    if missing:
        raise WeightsError(f"{folder} lacks tensor {missing[0]} of its {arch.hf_class} (and {len(missing) - 1} more)")
    extra = sorted((n for n in set(files) - needed if not _skipped(n, args, config)), key=_natural)
    if extra:
        raise WeightsError(f"{files[extra[0]]}: tensor {extra[0]} has no place in a {arch.hf_class}")
    return params, buffers


def _skipped(name: str, args: ModelArgs, config: dict) -> bool:
    """A tensor transformers leaves unread as well: a stored copy of a tied head, and DeepSeek's
    multi-token-prediction layers (numbered from num_hidden_layers on)."""
    if name == "lm_head.weight" and args.tie_embeddings:
        return True
    mtp = config.get("num_nextn_predict_layers") or config.get("num_mtp_layers") or 0
    parts = name.split(".")
    return bool(mtp) and len(parts) > 2 and parts[:2] == ["model", "layers"] and int(parts[2]) >= args.n_layers


def _natural(name: str) -> list:
    return [int(p) if p.isdigit() else p for p in name.split(".")]


# ---------------------------------------------------------------- export parts


def export_parts(arch: Architecture, args: ModelArgs, shapes: dict[str, tuple[int, ...]]) -> list[tuple[str, Part]]:
    """(checkpoint key, Part) of every Hugging Face tensor of the export, in the file's order:
    parameters ("model.<name>") and routing biases ("moe.<layer>.expert_bias")."""
    out = []
    for name, stored in arch.tensors(args, set(), arch.config(args)).items():
        out += [(f"model.{name}", part) for part in stored.parts(shapes[f"model.{name}"])]
    for name, stored in arch.buffers(args).items():
        key = f"moe.{name.split('.')[1]}.expert_bias"
        out += [(key, part) for part in stored.parts(shapes[key])]
    return out
