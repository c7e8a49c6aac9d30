"""Incremental decoding with a key/value cache, on the model's own modules.

    cache = new_cache(model, batch=1, max_len=64)
    logits = decode(model, prompt, cache)   # prefill: [b, s, vocab], positions 0 .. s-1
    logits = decode(model, next_ids, cache)  # one step: [b, 1, vocab], position s

`decode` runs what `Transformer.forward` runs (embedding, each block's norms, projections,
RoPE and feed-forward, the final norm and the head), except that each attention writes its
new keys and values into the cache and attends over every position filled so far. The model
is not changed and nothing is stored on its modules: the cache is a separate record.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fivecut.model.transformer import (
    Attention,
    Block,
    CausalSDPA,
    LatentAttention,
    Rope,
    Transformer,
    band_mask,
    capped_attention,
    sink_attention_scores,
)


@dataclass
class KVCache:
    """Keys and values of the positions decoded so far, preallocated per layer."""

    keys: list[torch.Tensor]  # per layer [b, n_kv, max_len, hd], rotated by RoPE
    values: list[torch.Tensor]  # per layer [b, n_kv, max_len, hd_v]
    # (latent attention caches its expanded keys and values, [b, H, max_len, nope + rope] and
    # [b, H, max_len, v_dim]: plain, not the compressed latent DeepSeek caches)
    length: int = 0  # positions 0 .. length-1 are filled

    @property
    def max_len(self) -> int:
        return self.keys[0].shape[2]

    @property
    def batch(self) -> int:
        return self.keys[0].shape[0]


@torch.inference_mode()
def new_cache(model: Transformer, batch: int = 1, max_len: int | None = None) -> KVCache:
    """An empty cache for `batch` sequences of up to `max_len` positions (default max_seq_len),
    on the model's device and in its dtype."""
    if model.tok_embeddings is None or model.output is None or model.norm is None:
        raise ValueError("decoding needs the whole model (embedding, layers, norm, head), not a pipeline stage")
    limit = model.args.max_seq_len
    max_len = limit if max_len is None else max_len
    if not 1 <= max_len <= limit:
        raise ValueError(f"a cache of {max_len} positions does not fit the model's max_seq_len {limit}")
    shapes = [_kv_shapes(block.attention, batch, max_len) for block in model.layers.values()]
    weight = model.tok_embeddings.weight
    keys = [weight.new_zeros(k) for k, _ in shapes]
    return KVCache(keys, [weight.new_zeros(v) for _, v in shapes])


def _kv_shapes(attention: Attention | LatentAttention, batch: int, max_len: int):
    """Shapes of a layer's key and value caches: [b, n_kv, max_len, hd] each, the head count read
    from wk's width (as the forward does); latent attention: its heads' keys and values."""
    if isinstance(attention, LatentAttention):
        heads = attention.wo.weight.shape[1] // attention.v_dim
        qk = attention.nope + attention.rope_dim
        return (batch, heads, max_len, qk), (batch, heads, max_len, attention.v_dim)
    n_kv = attention.wk.weight.shape[0] // attention.head_dim
    shape = (batch, n_kv, max_len, attention.head_dim)
    return shape, shape


@torch.inference_mode()
def decode(model: Transformer, tokens: torch.Tensor, cache: KVCache, last_only: bool = False) -> torch.Tensor:
    """tokens [b, s] at positions cache.length .. cache.length+s-1 -> logits [b, s, vocab]
    ([b, 1, vocab] with `last_only`: the head, often the largest matrix, runs on the last
    position alone). Writes their keys and values into `cache` and advances cache.length by s."""
    start, s = cache.length, tokens.shape[1]
    if start + s > cache.max_len:
        raise ValueError(
            f"{start} cached + {s} new positions = {start + s} exceed the cache's {cache.max_len} "
            f"(the model's max_seq_len is {model.args.max_seq_len})"
        )
    ropes = model.ropes(torch.arange(start, start + s, device=tokens.device))  # [s, hd] each, by layer
    h = model.embed(tokens)  # [b, s, dim]
    for (name, block), k_cache, v_cache in zip(model.layers.items(), cache.keys, cache.values, strict=True):
        h = _block(block, h, ropes[name], k_cache, v_cache, start)
    cache.length = start + s
    if last_only:
        h = h[:, -1:]  # [b, 1, dim]
    return model.logits(model.norm(h))  # [b, s or 1, vocab]


def _block(block: Block, x: torch.Tensor, rope: Rope, k_cache: torch.Tensor, v_cache: torch.Tensor, start: int):
    """Block.forward with cached attention: x [b, s, dim] -> [b, s, dim]."""
    attend = functools.partial(_attention, block.attention, rope=rope, k_cache=k_cache, v_cache=v_cache, start=start)
    h = x + block.branch(block.attention_norm, attend, x, block.attention_post_norm)
    return h + block.branch(block.ffn_norm, block.feed_forward, h, block.ffn_post_norm)


def _attention(
    attn: Attention | LatentAttention, x: torch.Tensor, rope: Rope, k_cache, v_cache, start: int
) -> torch.Tensor:
    """Attention.forward over the cached prefix and the s new positions: x [b, s, dim] -> [b, s, dim]."""
    b, s, _ = x.shape
    q, k, v = attn.qkv(x, rope)  # [b, heads, s, hd] (latent attention: [b, H, s, nope + rope], v_dim for v)
    end = start + s
    k_cache[:, :, start:end] = k
    v_cache[:, :, start:end] = v
    keys, values = k_cache[:, :, :end], v_cache[:, :, :end]  # [b, n_kv, end, hd]
    if getattr(attn, "sinks", None) is not None:  # GPT-OSS: each head's sink in its softmax's denominator
        mask = band_mask(s, end, start, attn.core.window, q.device)  # [s, end]
        o = sink_attention_scores(q, keys, values, mask, attn.sinks)
    else:
        o = _sdpa(q, keys, values, start, attn.core)  # [b, n_heads, s, hd]
    return attn.wo(o.transpose(1, 2).reshape(b, s, -1))


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, core: CausalSDPA) -> torch.Tensor:
    """Softmax attention of q [b, h, s, hd] over k/v [b, n_kv, start+s, hd]: new position i sees
    every cached position and the new ones up to itself (with the core's sliding window w, only the
    last w), its scores scaled and soft-capped as the core's are."""
    gqa = q.shape[1] != k.shape[1]
    s, window, scale = q.shape[2], core.window, core.scale
    windowed = 0 < window < start + s
    if core.softcap:
        return capped_attention(q, k, v, band_mask(s, start + s, start, window, q.device), scale, core.softcap)
    if s == 1 and not windowed:  # one new position sees everything
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa, scale=scale)
    if start == 0 and not windowed:  # plain causal prefill, as the full forward computes it
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa, scale=scale)
    mask = band_mask(s, start + s, start, window, q.device)  # [s, start+s]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa, scale=scale)
