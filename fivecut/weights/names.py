"""How fivecut's parameter names map onto Hugging Face Llama's and llama.cpp's (GGUF).

fivecut's model is a Llama with rotate-half RoPE, the layout Hugging Face checkpoints use, so a
Hugging Face tensor is fivecut's under another name with the same [out, in] shape. llama.cpp
stores the rows of wq and wk permuted (pairs interleaved, as Meta's original checkpoints) and
lists every shape innermost-first; `fivecut.weights.gguf` undoes both.

    fivecut                               Hugging Face                              GGUF
    tok_embeddings.weight                 model.embed_tokens.weight                 token_embd.weight
    layers.N.attention_norm.weight        model.layers.N.input_layernorm.weight     blk.N.attn_norm.weight
    layers.N.attention.wq.weight          model.layers.N.self_attn.q_proj.weight    blk.N.attn_q.weight
    layers.N.attention.wk.weight          model.layers.N.self_attn.k_proj.weight    blk.N.attn_k.weight
    layers.N.attention.wv.weight          model.layers.N.self_attn.v_proj.weight    blk.N.attn_v.weight
    layers.N.attention.wo.weight          model.layers.N.self_attn.o_proj.weight    blk.N.attn_output.weight
    layers.N.ffn_norm.weight              model.layers.N.post_attention_layernorm.weight  blk.N.ffn_norm.weight
    layers.N.feed_forward.w1.weight       model.layers.N.mlp.gate_proj.weight       blk.N.ffn_gate.weight
    layers.N.feed_forward.w3.weight       model.layers.N.mlp.up_proj.weight         blk.N.ffn_up.weight
    layers.N.feed_forward.w2.weight       model.layers.N.mlp.down_proj.weight       blk.N.ffn_down.weight
    norm.weight                           model.norm.weight                         output_norm.weight
    output.weight                         lm_head.weight                            output.weight

With tied embeddings the head is the embedding: fivecut's logical name is `tok_embeddings.weight`
and no `lm_head.weight` / `output.weight` is stored.
"""

from __future__ import annotations

import re

# per-layer suffixes: fivecut -> (Hugging Face, GGUF)
LAYER = {
    "attention_norm.weight": ("input_layernorm.weight", "attn_norm.weight"),
    "attention.wq.weight": ("self_attn.q_proj.weight", "attn_q.weight"),
    "attention.wk.weight": ("self_attn.k_proj.weight", "attn_k.weight"),
    "attention.wv.weight": ("self_attn.v_proj.weight", "attn_v.weight"),
    "attention.wo.weight": ("self_attn.o_proj.weight", "attn_output.weight"),
    "ffn_norm.weight": ("post_attention_layernorm.weight", "ffn_norm.weight"),
    "feed_forward.w1.weight": ("mlp.gate_proj.weight", "ffn_gate.weight"),
    "feed_forward.w3.weight": ("mlp.up_proj.weight", "ffn_up.weight"),
    "feed_forward.w2.weight": ("mlp.down_proj.weight", "ffn_down.weight"),
}
# outside the layers: fivecut -> (Hugging Face, GGUF)
GLOBAL = {
    "tok_embeddings.weight": ("model.embed_tokens.weight", "token_embd.weight"),
    "norm.weight": ("model.norm.weight", "output_norm.weight"),
    "output.weight": ("lm_head.weight", "output.weight"),
}
_FIVECUT_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_GGUF_LAYER = re.compile(r"blk\.(\d+)\.(.+)")


def to_hf(name: str) -> str:
    """The Hugging Face name of fivecut's `name` (KeyError for a tensor Llama has not: MoE)."""
    return _to(name, 0, "model.layers")


def to_gguf(name: str) -> str:
    return _to(name, 1, "blk")


def from_hf(name: str) -> str | None:
    """fivecut's name of a Hugging Face Llama tensor; None for one fivecut has no place for."""
    return _from(name, _HF_LAYER, 0)


def from_gguf(name: str) -> str | None:
    return _from(name, _GGUF_LAYER, 1)


def _to(name: str, which: int, layer_prefix: str) -> str:
    if name in GLOBAL:
        return GLOBAL[name][which]
    match = _FIVECUT_LAYER.fullmatch(name)
    if match is None or match[2] not in LAYER:
        raise KeyError(name)
    return f"{layer_prefix}.{match[1]}.{LAYER[match[2]][which]}"


def _from(name: str, layer: re.Pattern, which: int) -> str | None:
    for ours, theirs in GLOBAL.items():
        if theirs[which] == name:
            return ours
    match = layer.fullmatch(name)
    if match is None:
        return None
    for ours, theirs in LAYER.items():
        if theirs[which] == match[2]:
            return f"layers.{match[1]}.{ours}"
    return None
