"""Llama-style decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU) with an
optional DeepSeek-style mixture-of-experts feed-forward and optional DeepSeek multi-head
latent attention (MLA) in place of grouped-query attention.

Plain single-device PyTorch: the parallel cuts are applied from outside
(``fivecut.parallel``), so this file keeps a few promises they rely on:

* forward passes derive head counts and hidden sizes from the weight shapes,
  never from ``ModelArgs``, so tensor/expert parallelism can shrink weights;
* attention's core (``Attention.core``, ``LatentAttention.core``) is a replaceable module (context
  parallelism swaps it); MoE routing, permutation, experts and combine are
  separate functions (expert parallelism puts all-to-alls between them);
* ``tok_embeddings``, ``norm``, ``output`` may be None and layers may be
  deleted from ``layers`` (pipeline stages keep their part);
* ``init_weights(seed)`` draws every parameter from a generator seeded by its
  name, so any subset of the model gets the same weights as the whole.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from fivecut.model.args import ModelArgs, yarn_mscale
from fivecut.model.documents import Documents

Rope = tuple[torch.Tensor, torch.Tensor]  # (cos, sin), each [s, head_dim] or [b, s, head_dim]


# ----------------------------------------------------------------------------
# building blocks
# ----------------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension, alike on every device. Where x and the weight share a
    dtype below fp32 (ZeRO-3's bf16 units) it runs outside autocast: CUDA's autocast runs
    `rms_norm` in fp32 (its fp32 list; the CPU's has no such entry), which would return fp32, keep
    an fp32 copy of x for backward and leave each linear after it to cast and keep its own bf16
    copy; the kernels compute in fp32 inside either way."""
    shape, device = (x.shape[-1],), x.device.type
    low = x.dtype == weight.dtype != torch.float32
    if low and torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device):
        with torch.autocast(device, enabled=False):
            return F.rms_norm(x, shape, weight, eps)
    return F.rms_norm(x, shape, weight, eps)


def rope_tables(args: ModelArgs, local: bool = False, long: bool = False) -> Rope:
    """cos/sin tables [max_seq_len, rope_dim] in fp32, in the rotate-half layout: channel i and
    channel i + rope_dim/2 form one rotated pair, at frequency theta^(-2i/rope_dim), stretched
    by `args.rope_scaling` (`rope_frequencies`); YaRN multiplies both tables by its attention
    factor. Computed in float64 on the CPU so that every device gets bitwise the same tables.
    `local`: the sliding layers' tables (Gemma 3), plain RoPE at base `rope_local_theta`; `long`:
    LongRoPE's long factors (`ModelArgs.rope_long`), else its short ones."""
    if local:
        args = dataclasses.replace(args, rope_theta=args.rope_local_theta, rope_scaling="none")
    inv_freq, factor = rope_frequencies(args, long)  # [rope_dim/2]
    t = torch.arange(args.max_seq_len, dtype=torch.float64)
    angles = torch.outer(t, inv_freq)  # [S, rope_dim/2]
    angles = torch.cat([angles, angles], dim=-1)  # [S, rope_dim]
    return (angles.cos() * factor).float(), (angles.sin() * factor).float()


def rope_frequencies(args: ModelArgs, long: bool = False) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [rope_dim/2] float64, the factor on cos and sin) of `args`'s RoPE:
    plain, or scaled for a longer context (linear, Llama 3.1's, YaRN, LongRoPE's short or `long`
    factors), as transformers defines them."""
    dim, theta = args.rope_dim, args.rope_theta
    inv_freq = theta ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)  # [dim/2]
    kind, factor = args.rope_scaling, args.rope_factor
    if kind == "linear":
        return inv_freq / factor, 1.0
    if kind == "llama3":
        return llama3_frequencies(inv_freq, args), 1.0
    if kind == "yarn":
        return yarn_frequencies(inv_freq, args), yarn_attention_factor(args)
    if kind == "longrope":
        factors = args.rope_long_factors if long else args.rope_short_factors
        return inv_freq / torch.tensor(factors, dtype=torch.float64), longrope_attention_factor(args)
    return inv_freq, 1.0


def longrope_attention_factor(args: ModelArgs) -> float:
    """What LongRoPE multiplies cos and sin by: rope_attention_factor, or when unset
    sqrt(1 + ln(factor) / ln(original context)) (1 for a factor <= 1)."""
    if args.rope_attention_factor:
        return args.rope_attention_factor
    if args.rope_factor <= 1:
        return 1.0
    return math.sqrt(1 + math.log(args.rope_factor) / math.log(args.rope_original_context))


def llama3_frequencies(inv_freq: torch.Tensor, args: ModelArgs) -> torch.Tensor:
    """Llama 3.1's RoPE: wavelengths past original/low_freq_factor are stretched by the factor,
    those under original/high_freq_factor kept, those between blended linearly in original/wavelength."""
    context, factor = args.rope_original_context, args.rope_factor
    low, high = args.rope_low_freq_factor, args.rope_high_freq_factor
    wavelength = 2 * math.pi / inv_freq
    smooth = (context / wavelength - low) / (high - low)  # 0 at the long end of the band, 1 at the short
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelength > context / low, inv_freq / factor, inv_freq)
    between = (wavelength >= context / high) & (wavelength <= context / low)
    return torch.where(between, blended, out)


def yarn_frequencies(inv_freq: torch.Tensor, args: ModelArgs) -> torch.Tensor:
    """YaRN's frequencies: channels that turn more than beta_fast times over the original context
    keep theirs, those turning fewer than beta_slow times are interpolated (divided by the
    factor), a linear ramp between (the band's ends floored and ceiled to whole channels)."""
    dim, theta, context = args.rope_dim, args.rope_theta, args.rope_original_context

    def channel(rotations: float) -> float:  # the channel pair that turns `rotations` times in the context
        return dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = channel(args.rope_beta_fast), channel(args.rope_beta_slow)
    if args.rope_truncate:  # whole channels (GPT-OSS keeps the fractional ends: truncate = false)
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)  # [dim/2]
    keep = 1 - ramp  # 1: the original frequency (extrapolation), 0: interpolated
    return inv_freq / args.rope_factor * (1 - keep) + inv_freq * keep


def yarn_attention_factor(args: ModelArgs) -> float:
    """What YaRN multiplies cos and sin by: 0.1 ln(factor) + 1, or with mscale and mscale_all_dim
    both set the ratio of their two such factors (1 when they are equal: DeepSeek-V3 scales its
    scores instead, `ModelArgs.score_scale`)."""
    if args.rope_mscale and args.rope_mscale_all_dim:
        return yarn_mscale(args.rope_factor, args.rope_mscale) / yarn_mscale(args.rope_factor, args.rope_mscale_all_dim)
    return yarn_mscale(args.rope_factor)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [b, heads, s, hd] by position (rotate-half form, as in Hugging
    Face Llama checkpoints; Meta's original checkpoints use interleaved pairs
    and need a permutation of wq/wk rows on import). Computed in fp32. Tables
    narrower than hd (partial rotary, Phi-3) turn the first channels, the rest pass."""
    turned = cos.shape[-1]
    if turned < x.shape[-1]:
        return torch.cat([apply_rope(x[..., :turned], cos, sin), x[..., turned:]], dim=-1)  # [b, heads, s, hd]
    cos, sin = cos.unsqueeze(-3), sin.unsqueeze(-3)  # [1, s, hd] or [b, 1, s, hd]
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)  # [b, heads, s, hd/2] each
    rotated = torch.cat([-x2, x1], dim=-1)  # [b, heads, s, hd]
    return (xf * cos + rotated * sin).to(x.dtype)


class CausalSDPA(nn.Module):
    """Default attention core: causal softmax attention over the local sequence.
    q/k [b, n_heads or n_kv_heads, s, hd], v [b, n_kv_heads, s, hd_v] -> [b, n_heads, s, hd_v].

    A value head narrower than the query/key head (latent attention) is zero-padded to hd
    and the output cut back: the fused kernels want one head size (without the padding the
    CPU falls back to the unfused path, which keeps the s x s probabilities for backward).
    With a sliding `window` w the query at position i sees positions i-w+1 .. i only: the band
    is handed to the same fused kernel as a boolean mask [s, s] (measured against FlexAttention
    in benchmarks/sliding_window.py). The sequence given must start at position 0 and be whole
    (one device, Ulysses' whole sequence per head; ring attention is refused in fivecut.checks).
    With `documents` (the whole sequence's) causal within each document only: a boolean mask
    [b, 1, s, s] instead of is_causal (and the band within it).
    `scale`: what the scores q.k are multiplied by (None: 1/sqrt(hd)); `softcap` c > 0 (Gemma 2):
    each scaled score becomes c tanh(score / c), which no fused kernel computes, so those layers
    run `capped_attention`'s explicit math (the s x s probabilities kept for backward)."""

    def __init__(self, window: int = 0, scale: float | None = None, softcap: float = 0.0):
        super().__init__()
        self.window, self.scale, self.softcap = window, scale, softcap

    def forward(self, q, k, v, documents: Documents | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """`sinks` [n_heads] (GPT-OSS): each head's sink logit in the softmax's denominator (`sink_attention`)."""
        gqa = q.shape[1] != k.shape[1]
        narrow = q.shape[-1] - v.shape[-1]
        s = q.shape[2]
        mask = band_mask(s, s, 0, self.window, q.device) if 0 < self.window < s or self.softcap else None  # [s, s]
        if documents is not None:
            at = torch.arange(s, device=q.device)
            inside = documents.visible(at, at)  # [b, 1, s, s]
            mask = inside if mask is None else inside & mask
        if sinks is not None:
            return sink_attention(q, k, v, mask, sinks)
        if self.softcap:
            return capped_attention(q, k, v, mask, self.scale, self.softcap)
        v = F.pad(v, (0, narrow)) if narrow else v
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=gqa, scale=self.scale
        )
        return o[..., : o.shape[-1] - narrow]  # [b, n_heads, s, hd_v]


def sink_attention(q, k, v, mask: torch.Tensor | None, sinks: torch.Tensor) -> torch.Tensor:
    """Softmax attention whose denominator holds one more logit per head, its sink (a key every query sees, of
    value 0): q [b, H, s, hd], k/v [b, KV, s, hd], `mask` bool [.., s, s] (which keys each query sees; None:
    causal), sinks [H] -> [b, H, s, hd]. With the rows' log-sum-exp L of the scores, the sink keeps the share
    sigmoid(L - sink) of the plain output. On the CPU one fused kernel gives both (`SinkFlash`); elsewhere the
    scores are written out (`sink_attention_scores`)."""
    if q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16) and q.shape[-1] == v.shape[-1]:
        if mask is None:
            return SinkFlash.apply(q, k, v, None, sinks)
        bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
        return SinkFlash.apply(q, k, v, bias.expand(q.shape[0], 1, *mask.shape[-2:]), sinks)  # [b, 1, s, s]
    s = q.shape[2]
    return sink_attention_scores(q, k, v, band_mask(s, s, 0, 0, q.device) if mask is None else mask, sinks)


def sink_attention_scores(q, k, v, mask: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """`sink_attention` with its scores [b, H, s, sk] written out (any device; decoding, where s is small)."""
    if k.shape[1] != q.shape[1]:  # grouped-query attention: each kv head serves H/KV query heads
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    scores = (q @ k.transpose(-1, -2)).float() / math.sqrt(q.shape[-1])  # [b, H, s, sk]
    scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)  # [b, H, s, 1]
    probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]  # the sink's share dropped
    return (probs.to(v.dtype) @ v).to(q.dtype)


class SinkFlash(torch.autograd.Function):
    """`sink_attention` on the CPU's fused flash kernel, which returns each row's log-sum-exp L [b, H, s]
    beside its output o. The sink is one more block of keys merged by log-sum-exp (a block of value 0 and
    log-sum-exp `sink`): L' = logaddexp(L, sink), o' = o exp(L - L'). Backward is the kernel's backward given
    (o', L'): it rebuilds the probabilities exp(score - L') of the whole row, sink included, so dq, dk, dv
    are exact; the sink's own gradient is -sum over rows of exp(sink - L') (dO' . o')."""

    @staticmethod
    def forward(ctx, q, k, v, bias, sinks):
        """`bias`: an additive mask [b, 1, s, s] (0 or -inf), or None: causal."""
        causal = bias is None
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=bias)
        merged = torch.logaddexp(lse, sinks.float().view(1, -1, 1))  # [b, H, s]
        out = (out.float() * (lse - merged).exp().unsqueeze(-1)).to(q.dtype)  # [b, H, s, hd]
        ctx.save_for_backward(q, k, v, bias, sinks, out, merged)
        ctx.causal = causal
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, bias, sinks, out, merged = ctx.saved_tensors
        grad = grad.contiguous()
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad, q, k, v, out, merged, 0.0, ctx.causal, attn_mask=bias
        )
        return dq, dk, dv, None, sink_grad(grad, out, merged, sinks)


def sink_grad(grad: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """d loss / d sinks [H] from the output's gradient and the output [b, H, s, hd] of attention with sinks and
    its rows' log-sum-exp lse [b, H, s] (sink included): -sum over b, s of exp(sink - lse) (grad . out)."""
    share = (sinks.float().view(1, -1, 1) - lse).exp()  # [b, H, s]: the sink's probability
    return -(share * (grad.float() * out.float()).sum(-1)).sum((0, 2)).to(sinks.dtype)


def capped_attention(q, k, v, mask: torch.Tensor, scale: float | None, cap: float) -> torch.Tensor:
    """Softmax attention with soft-capped scores, computed explicitly: q [b, H, sq, hd], k [b, KV, sk, hd],
    v [b, KV, sk, hd_v], mask [.., sq, sk] bool (true: seen) -> [b, H, sq, hd_v]. The softmax in fp32."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)  # [b, H, sk, hd(_v)]
    scores = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)  # [b, H, sq, sk]
    scores = torch.tanh(scores / cap) * cap
    probs = scores.masked_fill(~mask, float("-inf")).float().softmax(dim=-1).to(q.dtype)
    return probs @ v


def band_mask(s_q: int, s_k: int, start: int, window: int, device=None) -> torch.Tensor:
    """Which keys each query sees: [s_q, s_k] bool, query r at position start + r, key c at c;
    causal (c <= position), and with a window w > 0 only the last w positions (c > position - w)."""
    rows = torch.arange(start, start + s_q, device=device).unsqueeze(1)  # [s_q, 1]
    cols = torch.arange(s_k, device=device)  # [s_k]
    seen = cols <= rows
    return seen & (cols > rows - window) if window else seen


class Attention(nn.Module):
    """Grouped-query attention with the published variants: biases on q, k, v (Qwen2), an
    RMSNorm over each query and key head before RoPE (Qwen3) or over the whole q and k projections
    (OLMo 2), a sliding window (Mistral), no RoPE on some layers (SmolLM3's NoPE layers)."""

    def __init__(self, args: ModelArgs, layer_id: int = 0):
        super().__init__()
        self.head_dim = args.head_dim
        bias = args.qkv_bias
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=bias)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=bias)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=bias)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=args.wo_bias)
        # GPT-OSS's sinks [n_heads]: a logit per head in its softmax's denominator (cut with the heads)
        self.sinks = nn.Parameter(torch.empty(args.n_heads)) if args.attention_sinks else None
        # q/k norms: per head [hd], shared by the heads (and so by the tensor-parallel ranks); or, with
        # qk_norm_whole, over the whole projection [heads * hd] (tensor parallelism cuts them with wq, wk)
        self.whole_qk_norm = args.qk_norm_whole
        q_size, k_size = (args.n_heads, args.n_kv_heads) if self.whole_qk_norm else (1, 1)
        self.q_norm = RMSNorm(q_size * self.head_dim, args.norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(k_size * self.head_dim, args.norm_eps) if args.qk_norm else None
        self.rotates = args.layer_rope(layer_id)  # false on a NoPE layer
        # Replaceable by any module with the same signature (context parallelism).
        self.window = args.layer_window(layer_id)
        scale = args.query_scale_dim**-0.5 if args.query_scale_dim else None  # Gemma's query_pre_attn_scalar
        self.core: nn.Module = CausalSDPA(self.window, scale, args.attn_softcap)

    def _heads(self, y: torch.Tensor) -> torch.Tensor:
        b, s, _ = y.shape
        # number of (local) heads from the projection's width, not from args
        return y.view(b, s, -1, self.head_dim).transpose(1, 2)  # [b, heads, s, hd]

    def qkv(self, x: torch.Tensor, rope: Rope) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [b, s, dim] -> q [b, heads, s, hd], k, v [b, kv_heads, s, hd]; q and k normed and rotated."""
        q, k = self.wq(x), self.wk(x)  # [b, s, heads * hd], [b, s, kv_heads * hd]
        if self.whole_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)  # over all heads at once
        q, k, v = self._heads(q), self._heads(k), self._heads(self.wv(x))
        if self.q_norm is not None and not self.whole_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)  # over hd, each head alone
        if not self.rotates:
            return q, k, v
        cos, sin = rope
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward(self, x: torch.Tensor, rope: Rope, documents: Documents | None = None) -> torch.Tensor:
        b, s, _ = x.shape
        sinks = () if self.sinks is None else (self.sinks,)  # a core without sinks keeps its signature
        o = self.core(*self.qkv(x, rope), documents, *sinks)  # [b, n_heads, s, hd]
        o = o.transpose(1, 2).reshape(b, s, -1)  # [b, s, n_heads * hd]
        return self.wo(o)


class LatentAttention(nn.Module):
    """Multi-head latent attention (DeepSeek-V2/V3). Per token, with H heads:

        queries  q = wq_b(q_norm(wq_a(x)))  (or wq(x) without a query latent)  [H, nope + rope]
        latent   wkv_a(x) = [c, k_rope]: c [kv_lora_rank], k_rope [rope], ONE key head for RoPE
        keys     k = [k_nope, rotated k_rope repeated to every head]            [H, nope + rope]
        values   [k_nope, v] = wkv_b(kv_norm(c))                                 [H, nope], [H, v_dim]

    The scores run over nope + rope channels (SDPA's scale 1/sqrt(nope + rope)); the output
    [H, v_dim] goes through wo. Head counts come from wq_b's (or wq's) and wkv_b's widths, so
    tensor parallelism may cut them; the latents stay whole."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.nope, self.rope_dim, self.v_dim = args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim
        heads, qk = args.n_heads, args.qk_head_dim
        self.compressed_q = args.q_lora_rank > 0
        if self.compressed_q:
            self.wq_a = nn.Linear(args.dim, args.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(args.q_lora_rank, args.latent_eps)
            self.wq_b = nn.Linear(args.q_lora_rank, heads * qk, bias=False)
        else:
            self.wq = nn.Linear(args.dim, heads * qk, bias=False)
        self.wkv_a = nn.Linear(args.dim, args.kv_lora_rank + self.rope_dim, bias=False)
        self.kv_norm = RMSNorm(args.kv_lora_rank, args.latent_eps)
        self.wkv_b = nn.Linear(args.kv_lora_rank, heads * (self.nope + self.v_dim), bias=False)
        self.wo = nn.Linear(heads * self.v_dim, args.dim, bias=False)
        # Replaceable by any module with the same signature (recomputation wraps it).
        self.core: nn.Module = CausalSDPA()
        self.score_scale = args.score_scale  # YaRN's mscale_all_dim, squared (DeepSeek-V3); else 1

    def queries(self, x: torch.Tensor) -> torch.Tensor:
        """x [b, s, dim] -> [b, s, H * (nope + rope)]."""
        if self.compressed_q:
            return self.wq_b(self.q_norm(self.wq_a(x)))
        return self.wq(x)

    def forward(self, x: torch.Tensor, rope: Rope, documents: Documents | None = None) -> torch.Tensor:
        b, s, _ = x.shape
        o = self.core(*self.qkv(x, rope), documents)  # [b, H, s, v_dim]
        return self.wo(o.transpose(1, 2).reshape(b, s, -1))  # [b, s, dim]

    def qkv(self, x: torch.Tensor, rope: Rope) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [b, s, dim] -> q, k [b, H, s, nope + rope] (rotated), v [b, H, s, v_dim]."""
        b, s, _ = x.shape
        cos, sin = rope
        q = self.queries(x).view(b, s, -1, self.nope + self.rope_dim).transpose(1, 2)  # [b, H, s, nope + rope]
        q_nope, q_rope = q.split([self.nope, self.rope_dim], dim=-1)
        c, k_rope = self.wkv_a(x).split([self.kv_norm.weight.shape[0], self.rope_dim], dim=-1)  # [b, s, kv], [b, s, r]
        kv = self.wkv_b(self.kv_norm(c)).view(b, s, -1, self.nope + self.v_dim).transpose(1, 2)  # [b, H, s, nope + v]
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        heads = q.shape[1]
        k_rope = apply_rope(k_rope.unsqueeze(1), cos, sin).expand(b, heads, s, self.rope_dim)  # [b, H, s, rope]
        q = torch.cat([q_nope, apply_rope(q_rope, cos, sin)], dim=-1)  # [b, H, s, nope + rope]
        if self.score_scale != 1.0:  # the scores q.k / sqrt(nope + rope) times score_scale
            q = q * self.score_scale
        k = torch.cat([k_nope, k_rope], dim=-1)  # [b, H, s, nope + rope]
        return q, k, v


def make_attention(args: ModelArgs, layer_id: int = 0) -> nn.Module:
    """Latent attention when the arguments give a key/value latent (kv_lora_rank > 0), else GQA."""
    return LatentAttention(args) if args.is_mla else Attention(args, layer_id)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


# ModelArgs.ffn_activation -> the gate's activation
GATE_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"silu": F.silu, "gelu_tanh": gelu_tanh}


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x); or GeGLU (activation "gelu_tanh", Gemma): GELU in silu's place."""

    def __init__(self, dim: int, hidden: int, activation: str = "silu"):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)  # gate
        self.w3 = nn.Linear(dim, hidden, bias=False)  # up
        self.w2 = nn.Linear(hidden, dim, bias=False)  # down
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(GATE_ACTIVATIONS[self.activation](self.w1(x)) * self.w3(x))


# ----------------------------------------------------------------------------
# mixture of experts
# ----------------------------------------------------------------------------

# A grouped matrix product: x [N, K] whose rows come in E groups (group e: rows ends[e-1]
# to ends[e], ends [E] int32 on x's device) times w [E, K, M] -> [N, M], group e times w[e].
# Rows past ends[-1] give unspecified values (a caller with such rows masks them). Every
# kernel reads the offsets on the device: none waits for the host (no .tolist, no .item).
GroupedMM = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def group_ends(counts: torch.Tensor) -> torch.Tensor:
    """Rows per group [E] -> the groups' end offsets [E] int32 (the grouped GEMM's `offs`)."""
    return counts.cumsum(0, dtype=torch.int32)


def count_ids(ids: torch.Tensor, n: int) -> torch.Tensor:
    """How often each of 0..n-1 occurs in `ids` (any shape) -> [n] int64. Unlike bincount,
    whose output size depends on the data (a host sync on a GPU), the size here is n."""
    flat = ids.reshape(-1)
    return torch.zeros(n, dtype=torch.long, device=ids.device).scatter_add_(0, flat, torch.ones_like(flat))


@torch.library.custom_op("fivecut::grouped_mm_cpu", mutates_args=())
def grouped_mm_cpu(a: torch.Tensor, b: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """torch._grouped_mm on the CPU, where its kernel takes fp32 as well as bf16 but its shape
    function (used by torch.compile) admits bf16 only: an opaque op with its own shapes.
    a [N, K] x b [E, K, M] -> [N, M]; or, for a weight gradient, a [K, N] x b [N, M] -> [E, K, M]
    (the N rows cut into groups by `ends`)."""
    return torch._grouped_mm(a, b, offs=ends)


@grouped_mm_cpu.register_fake
def _(a: torch.Tensor, b: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    if b.dim() == 3:
        return a.new_empty(a.shape[0], b.shape[2])
    return a.new_empty(ends.shape[0], a.shape[0], b.shape[1])


def _grouped_mm_cpu_backward(ctx, grad: torch.Tensor):
    a, b, ends = ctx.saved_tensors
    grad = grad.contiguous()  # [N, M]; a summed output hands back a zero-stride gradient
    grad_a = grouped_mm_cpu(grad, b.transpose(1, 2), ends)  # [N, K]
    grad_b = grouped_mm_cpu(a.t(), grad, ends)  # [E, K, M]: the rows of group e only
    return grad_a, grad_b, None


def _grouped_mm_cpu_save(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


grouped_mm_cpu.register_autograd(_grouped_mm_cpu_backward, setup_context=_grouped_mm_cpu_save)


def grouped_mm_cuda(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """torch._grouped_mm (bf16, Hopper or newer: one CUTLASS kernel for all the groups)."""
    return torch._grouped_mm(x, w, offs=ends)


def padded_grouped_mm(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """The grouped product as one batched matmul over blocks of rows, for any device and dtype.
    Each group is cut into blocks of `block` rows (its last block padded with zero rows), each
    block multiplied by its group's weights. The number of blocks is bounded without reading
    the counts -- sum_e ceil(n_e / block) <= N // block + E -- so no shape waits for the host."""
    n, e = x.shape[0], w.shape[0]
    block = max(16, -(-n // (4 * e)))  # about 4 blocks a group on average: at most ~5E weight copies
    n_blocks = n // block + e
    ends = ends.long()
    counts = torch.diff(ends, prepend=ends.new_zeros(1))  # [E]
    blocks = (counts + block - 1) // block  # [E] blocks of each group
    block_ends = blocks.cumsum(0)  # [E]
    group = torch.searchsorted(block_ends, torch.arange(n_blocks, device=x.device), right=True)  # [B]; E: unused
    g = group.clamp(max=e - 1)
    first_row = ends[g] - counts[g] + (torch.arange(n_blocks, device=x.device) - block_ends[g] + blocks[g]) * block
    src = first_row.unsqueeze(1) + torch.arange(block, device=x.device)  # [B, block] source rows
    real = (src < ends[g].unsqueeze(1)) & (group < e).unsqueeze(1)
    x_blocks = torch.cat([x, x.new_zeros(1, x.shape[1])])[torch.where(real, src, n)]  # [B, block, K]
    y_blocks = torch.bmm(x_blocks, w[g]).flatten(0, 1)  # [B*block, M]
    rows = torch.arange(n, device=x.device)
    row_group = torch.searchsorted(ends, rows, right=True).clamp(max=e - 1)  # [N]
    row_block = block_ends[row_group] - blocks[row_group] + (rows - ends[row_group] + counts[row_group]) // block
    slot = torch.where(rows < ends[-1], row_block * block + (rows - ends[row_group] + counts[row_group]) % block, -1)
    return torch.cat([y_blocks, y_blocks.new_zeros(1, y_blocks.shape[1])])[slot]  # [N, M]; past the end: 0


@functools.cache
def _hopper_or_newer(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) >= (9, 0)


def grouped_kernel(device: torch.device, dtype: torch.dtype, sizes: tuple[int, ...]) -> GroupedMM:
    """The one place a grouped GEMM is chosen, by device and dtype. The fast kernels want the
    rows of x, w and the output 16-byte aligned (every size in `sizes` times the element size
    a multiple of 16); otherwise, and on a GPU without torch._grouped_mm's kernel (before
    Hopper, or not bf16), the padded batched matmul."""
    aligned = all(size * dtype.itemsize % 16 == 0 for size in sizes)
    if aligned and device.type == "cpu" and dtype in (torch.float32, torch.bfloat16):
        return grouped_mm_cpu
    if aligned and device.type == "cuda" and dtype == torch.bfloat16 and _hopper_or_newer(device):
        return grouped_mm_cuda
    return padded_grouped_mm


@dataclass
class ExpertLowRank:
    """Low-rank updates of E experts' three weights (LoRA on the routed experts): the gate and up
    projections share one A, as Hugging Face's fused `gate_up_proj` is one weight, each has its B;
    down has its own A and B. Update of expert e: scale * dropout(x) A_e B_e."""

    gate_up_a: torch.Tensor  # [E, dim, r]
    gate_b: torch.Tensor  # [E, r, hidden]
    up_b: torch.Tensor  # [E, r, hidden]
    down_a: torch.Tensor  # [E, hidden, r]
    down_b: torch.Tensor  # [E, r, dim]
    scale: float
    dropout: Callable[[torch.Tensor], torch.Tensor]

    def to(self, dtype: torch.dtype) -> ExpertLowRank:
        a, gb, ub, da, db = (t.to(dtype) for t in (self.gate_up_a, self.gate_b, self.up_b, self.down_a, self.down_b))
        return ExpertLowRank(a, gb, ub, da, db, self.scale, self.dropout)


@dataclass(frozen=True)
class ExpertBiases:
    """GPT-OSS's expert biases, stacked over the experts: b1, b3 [E, hidden] (gate, up), b2 [E, dim] (down;
    under expert TP given by one etp rank only, as the shards' partial sums are added)."""

    b1: torch.Tensor
    b3: torch.Tensor
    b2: torch.Tensor

    def rows(self, ends: torch.Tensor, n: int) -> torch.Tensor:
        """The expert of each of n grouped rows [n] (rows past ends[-1]: the last expert's, unused)."""
        return torch.searchsorted(ends, torch.arange(n, device=ends.device), right=True).clamp(max=ends.shape[0] - 1)


@dataclass(frozen=True)
class ClampedGLU:
    """GPT-OSS's clamped SwiGLU: h = (u + 1) * g * sigmoid(alpha * g), g = min(gate, limit), u = up
    clamped to [-limit, limit]."""

    limit: float
    alpha: float

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
        return (up + 1) * gate * torch.sigmoid(self.alpha * gate)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def grouped_swiglu(
    x: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    ends: torch.Tensor,
    recompute_product: bool = False,
    low_rank: ExpertLowRank | None = None,
    biases: ExpertBiases | None = None,
    glu: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = swiglu,
) -> torch.Tensor:
    """E SwiGLU experts on grouped rows: x [N, dim] (group e: rows ends[e-1]..ends[e]),
    w1/w3 [E, dim, hidden], w2 [E, hidden, dim] -> [N, dim], w2 e(silu(w1 e x) * w3 e x) for
    each group; rows past ends[-1] unspecified. `recompute_product`: keep the two matmul
    outputs only and compute the SwiGLU product (and the down projection) again in backward.
    `low_rank`: each weight's LoRA update added to its product. `biases`: each expert's biases added
    to its three products; `glu`: the product of gate and up (GPT-OSS's `ClampedGLU`)."""
    if torch.is_autocast_enabled(x.device.type):  # autocast does not cover the grouped kernels
        dtype = torch.get_autocast_dtype(x.device.type)
        x, w1, w3, w2 = x.to(dtype), w1.to(dtype), w3.to(dtype), w2.to(dtype)
        low_rank = low_rank.to(dtype) if low_rank is not None else None
        biases = ExpertBiases(*(t.to(dtype) for t in (biases.b1, biases.b3, biases.b2))) if biases else None
    mm = grouped_kernel(x.device, x.dtype, (w1.shape[1], w1.shape[2]))
    a, b = mm(x, w1, ends), mm(x, w3, ends)  # [N, hidden] each
    if biases is not None:
        expert = biases.rows(ends, x.shape[0])  # [N]
        a, b = a + biases.b1[expert], b + biases.b3[expert]
    if low_rank is not None:
        lr = low_rank
        low = grouped_kernel(x.device, x.dtype, lr.gate_up_a.shape[1:])(lr.dropout(x), lr.gate_up_a, ends)  # [N, r]
        up = grouped_kernel(x.device, x.dtype, lr.gate_b.shape[1:])
        a, b = a + lr.scale * up(low, lr.gate_b, ends), b + lr.scale * up(low, lr.up_b, ends)  # [N, hidden]
    if recompute_product:  # a dropout mask drawn again in backward must be the same one
        keep_rng = low_rank is not None and isinstance(low_rank.dropout, nn.Dropout)
        y = checkpoint(
            _swiglu_down, mm, a, b, w2, ends, low_rank, glu, use_reentrant=False, preserve_rng_state=keep_rng
        )
    else:
        y = _swiglu_down(mm, a, b, w2, ends, low_rank, glu)
    return y if biases is None else y + biases.b2[expert]  # [N, dim]


def _swiglu_down(mm: GroupedMM, a: torch.Tensor, b: torch.Tensor, w2: torch.Tensor, ends: torch.Tensor,
                 low_rank: ExpertLowRank | None = None, glu: Callable = swiglu):  # fmt: skip
    h = glu(a, b)  # [N, hidden]
    y = mm(h, w2, ends)  # [N, dim]
    if low_rank is None:
        return y
    lr = low_rank
    low = grouped_kernel(h.device, h.dtype, lr.down_a.shape[1:])(lr.dropout(h), lr.down_a, ends)  # [N, r]
    return y + lr.scale * grouped_kernel(h.device, h.dtype, lr.down_b.shape[1:])(low, lr.down_b, ends)


class GroupedExperts(nn.Module):
    """E SwiGLU experts stored as stacked weights, computed as grouped GEMMs. The number of
    experts is read from the weights, so an expert-parallel rank can hold a slice."""

    # every tensor held per expert ([E, ...]: the expert cuts slice, move and copy them alike) and
    # the dimension expert tensor parallelism cuts it along (the hidden size); None: kept whole
    EXPERT_TENSORS = {"w1": 2, "w3": 2, "w2": 1}

    def __init__(self, n_experts: int, dim: int, hidden: int, glu: Callable = swiglu):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, dim, hidden))  # gate
        self.w3 = nn.Parameter(torch.empty(n_experts, dim, hidden))  # up
        self.w2 = nn.Parameter(torch.empty(n_experts, hidden, dim))  # down
        self.glu = glu  # the product of gate and up: SwiGLU, or GPT-OSS's `ClampedGLU`

    def forward(self, x_sorted: torch.Tensor, counts: list[int] | torch.Tensor) -> torch.Tensor:
        """x_sorted [T_sorted, dim], grouped by expert: rows of expert e are the
        counts[e] rows after those of experts < e (all rows belong to an expert). Returns
        [T_sorted, dim]. An expert with no rows gets a zero gradient."""
        counts = torch.as_tensor(counts, device=x_sorted.device)  # a tensor stays on its device
        if counts.shape[0] != self.w1.shape[0]:
            raise ValueError(f"got {counts.shape[0]} token counts for {self.w1.shape[0]} local experts")
        return self.run(x_sorted, self.expert_tensors(), group_ends(counts))

    def expert_tensors(self) -> dict[str, torch.Tensor]:
        """Every per-expert tensor by name, as the matmuls read it (a cast module: its copy)."""
        return {name: getattr(self, name) for name in self.EXPERT_TENSORS}

    def run(self, x: torch.Tensor, tensors: dict[str, torch.Tensor], ends: torch.Tensor,
            recompute_product: bool = False) -> torch.Tensor:  # fmt: skip
        """The experts whose tensors are `tensors` (this module's, or those of the slots an expert
        parallel rank computes) on grouped rows x [N, dim] -> [N, dim]."""
        return grouped_swiglu(x, tensors["w1"], tensors["w3"], tensors["w2"], ends, recompute_product, glu=self.glu)


class BiasedExperts(GroupedExperts):
    """GPT-OSS's experts: `GroupedExperts` with a bias on each product, stacked over the experts like the
    weights (so the expert cuts slice, move and copy them alike): b1, b3 [E, hidden] cut by expert TP with
    the hidden size; b2 [E, dim] kept whole there and added by one etp rank (`adds_down_bias`), its
    gradient summed over etp (`grad_summed`, set by `fivecut.parallel.expert.cut_expert_hidden`)."""

    EXPERT_TENSORS = GroupedExperts.EXPERT_TENSORS | {"b1": 1, "b3": 1, "b2": None}

    def __init__(self, n_experts: int, dim: int, hidden: int, glu: Callable = swiglu):
        super().__init__(n_experts, dim, hidden, glu)
        self.b1 = nn.Parameter(torch.empty(n_experts, hidden))
        self.b3 = nn.Parameter(torch.empty(n_experts, hidden))
        self.b2 = nn.Parameter(torch.empty(n_experts, dim))
        self.adds_down_bias = True  # false on the etp ranks but the first
        self.grad_summed: Callable | None = None

    def run(self, x: torch.Tensor, tensors: dict[str, torch.Tensor], ends: torch.Tensor,
            recompute_product: bool = False) -> torch.Tensor:  # fmt: skip
        b2 = tensors["b2"] if self.grad_summed is None else self.grad_summed(tensors["b2"])
        biases = ExpertBiases(tensors["b1"], tensors["b3"], b2 if self.adds_down_bias else b2 * 0)
        w1, w3, w2 = tensors["w1"], tensors["w3"], tensors["w2"]
        return grouped_swiglu(x, w1, w3, w2, ends, recompute_product, biases=biases, glu=self.glu)


def limit_to_groups(scores: torch.Tensor, groups: int, limit: int) -> torch.Tensor:
    """Group-limited routing: scores [T, E] with the experts outside each token's best `limit`
    of `groups` contiguous groups set to -inf. A group's score is the sum of its two best
    experts' scores (DeepSeek-V3; the best one when a group has a single expert)."""
    t, e = scores.shape
    per_group = scores.view(t, groups, e // groups)  # [T, G, E/G]
    group_score = per_group.topk(min(2, e // groups), dim=-1).values.sum(-1)  # [T, G]
    chosen = group_score.topk(limit, dim=-1).indices  # [T, limit]
    allowed = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, chosen, True)  # [T, G]
    return per_group.masked_fill(~allowed.unsqueeze(-1), float("-inf")).view(t, e)


def permute(x_flat: torch.Tensor, topk_idx: torch.Tensor, n_experts: int):
    """Group the (token, slot) pairs by expert.

    x_flat [T, dim], topk_idx [T, k] -> x_sorted [T·k, dim], order [T·k] (the
    flat slot index t·k + j of each sorted row), counts [n_experts]."""
    k = topk_idx.shape[1]
    flat_idx = topk_idx.reshape(-1)  # [T·k]
    order = torch.argsort(flat_idx, stable=True)  # [T·k]
    x_sorted = x_flat[order // k]  # [T·k, dim]
    counts = count_ids(flat_idx, n_experts)  # [E]
    return x_sorted, order, counts


def unpermute(y_sorted: torch.Tensor, order: torch.Tensor, topk_weight: torch.Tensor) -> torch.Tensor:
    """Inverse of ``permute`` and weighted combine: y_sorted [T·k, dim] ->
    out [T, dim] = sum_j topk_weight[t, j] · y(t, j).

    Rows are scattered back to their slots (each slot is written once), then
    summed over the k slots in slot order: no atomics, so the result is
    bitwise reproducible and independent of the order the experts ran in."""
    t, k = topk_weight.shape
    y_slots = y_sorted.new_zeros(t * k, y_sorted.shape[-1])
    y_slots[order] = y_sorted  # [T·k, dim] in (token, slot) order
    y_slots = y_slots.view(t, k, -1)  # [T, k, dim]
    w = topk_weight.to(y_slots.dtype).unsqueeze(-1)  # [T, k, 1]
    return (y_slots * w).sum(dim=1)  # [T, dim]


class MoE(nn.Module):
    """DeepSeek-style MoE: top-k routed experts (dropless) + shared experts."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.top_k = args.top_k
        self.gate = args.gate
        self.route_scale = args.route_scale
        self.route_norm = args.route_norm
        self.expert_groups, self.route_group_limit = args.expert_groups, args.route_group_limit
        # Training-time behaviour (expert parallelism, capacity, balancing) is installed from
        # outside by `fivecut.parallel.expert`; without it this is the plain dropless layer.
        self.runtime = None
        hidden = args.expert_dim
        self.router = nn.Linear(args.dim, args.n_experts, bias=args.moe_bias)
        glu = ClampedGLU(args.swiglu_limit, args.swiglu_alpha) if args.swiglu_limit else swiglu
        experts = BiasedExperts if args.moe_bias else GroupedExperts
        self.experts = experts(args.n_experts, args.dim, hidden, glu)
        self.shared = FeedForward(args.dim, hidden * args.n_shared_experts) if args.n_shared_experts else None
        # Added to the scores only to *select* experts (auxiliary-loss-free
        # balancing, DeepSeek-V3); the combine weights use the raw scores.
        self.register_buffer("expert_bias", torch.zeros(args.n_experts), persistent=False)
        # Tokens each expert received in the last forward (load metrics).
        self.register_buffer("tokens_per_expert", torch.zeros(args.n_experts, dtype=torch.long), persistent=False)

    def reset_buffers(self) -> None:
        device = self.expert_bias.device
        self.expert_bias = torch.zeros(self.expert_bias.shape, dtype=torch.float32, device=device)
        self.tokens_per_expert = torch.zeros(self.expert_bias.shape, dtype=torch.long, device=device)

    def route(self, x_flat: torch.Tensor):
        """x_flat [T, dim] -> topk_idx [T, k], topk_weight [T, k] (fp32), scores [T, E] (fp32).

        softmax gate: softmax over experts, top-k (Mixtral, Qwen3-MoE).
        sigmoid gate: independent sigmoid scores, top-k (DeepSeek-V3).
        Both: selection on scores + expert_bias (DeepSeek-V3's e_score_correction_bias), within
        the best groups when grouped; the weights are the unbiased scores of the chosen experts,
        renormalized to sum 1 with route_norm (but a lone softmax expert keeps its probability),
        times route_scale (routed_scaling_factor)."""
        logits = self.router(x_flat).float()  # [T, E]
        scores = logits.softmax(dim=-1) if self.gate == "softmax" else logits.sigmoid()
        biased = scores + self.expert_bias.float()  # [T, E] for selection only
        if self.expert_groups > 1:
            biased = limit_to_groups(biased, self.expert_groups, self.route_group_limit)
        topk_idx = biased.topk(self.top_k, dim=-1).indices  # [T, k]
        topk_weight = scores.gather(-1, topk_idx)  # [T, k]
        if self.route_norm and (self.gate == "sigmoid" or self.top_k > 1):
            topk_weight = topk_weight / topk_weight.sum(dim=-1, keepdim=True)
        return topk_idx, topk_weight * self.route_scale, scores

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.runtime is not None:
            return self.runtime(x)
        b, s, dim = x.shape
        x_flat = x.reshape(b * s, dim)  # [T, dim]
        topk_idx, topk_weight, _ = self.route(x_flat)
        x_sorted, order, counts = permute(x_flat, topk_idx, self.router.weight.shape[0])
        self.tokens_per_expert.copy_(counts.detach())
        y_sorted = self.experts(x_sorted, counts)  # [T·k, dim]
        out = unpermute(y_sorted, order, topk_weight)  # [T, dim]
        if self.shared is not None:
            out = out + self.shared(x_flat)
        return out.view(b, s, dim)


# ----------------------------------------------------------------------------
# the model
# ----------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = make_attention(args, layer_id)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        moe = args.moe_layer(layer_id)
        self.feed_forward = MoE(args) if moe else FeedForward(args.dim, args.ffn_dim, args.ffn_activation)
        self.norm_after = args.norm_after  # OLMo 2: each norm takes its sublayer's output
        # Gemma's sandwich: a second norm on each sublayer's output (post_attention / post_feedforward_layernorm)
        self.attention_post_norm = RMSNorm(args.dim, args.norm_eps) if args.sandwich_norms else None
        self.ffn_post_norm = RMSNorm(args.dim, args.norm_eps) if args.sandwich_norms else None

    def forward(self, x: torch.Tensor, rope: Rope, documents: Documents | None = None) -> torch.Tensor:
        post = self.attention_post_norm
        h = x + self.branch(self.attention_norm, lambda y: self.attention(y, rope, documents), x, post)
        # the feed-forward called here, not through `branch`: a MoE layer kept eager under torch.compile
        # breaks the block's graph once here; called through `branch`, Dynamo reports that break twice
        if self.norm_after:
            return h + self.ffn_norm(self.feed_forward(h))
        y = self.feed_forward(self.ffn_norm(h))
        return h + (y if self.ffn_post_norm is None else self.ffn_post_norm(y))

    def branch(self, norm: nn.Module, sublayer: Callable, x: torch.Tensor, post: nn.Module | None = None):
        """One residual branch, [b, s, dim] -> [b, s, dim]: sublayer(norm(x)), then `post` of it when given
        (sandwich_norms); or norm(sublayer(x)) with `norm_after` (the residual add is the caller's)."""
        if self.norm_after:
            return norm(sublayer(x))
        y = sublayer(norm(x))
        return y if post is None else post(y)


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): Block(i, args) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.tie_weights()
        self.register_buffer("rope_cos", torch.empty(args.max_seq_len, args.rope_dim), persistent=False)
        self.register_buffer("rope_sin", torch.empty(args.max_seq_len, args.rope_dim), persistent=False)
        # the sliding layers' own RoPE (rope_local_theta, Gemma 3): their names, and their tables
        self.local_rope_layers = frozenset(str(i) for i in range(args.n_layers) if args.layer_local_rope(i))
        if self.local_rope_layers:
            self.register_buffer("rope_local_cos", torch.empty(args.max_seq_len, args.rope_dim), persistent=False)
            self.register_buffer("rope_local_sin", torch.empty(args.max_seq_len, args.rope_dim), persistent=False)
        self.rope_long = False  # LongRoPE: the tables turn by its long factors (`fit_rope`), else its short ones
        self.init_rope()

    def tie_weights(self) -> None:
        """With tie_embeddings, make output.weight the embedding's Parameter.
        Needed again after ``to_empty``, which unties shared parameters."""
        if self.args.tie_embeddings and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight

    def init_rope(self) -> None:
        """(Re)compute the RoPE tables in fp32 on the buffers' current device."""
        device = self.rope_cos.device
        cos, sin = rope_tables(self.args, long=self.rope_long)
        self.rope_cos, self.rope_sin = cos.to(device), sin.to(device)
        if self.local_rope_layers:
            cos, sin = rope_tables(self.args, local=True)
            self.rope_local_cos, self.rope_local_sin = cos.to(device), sin.to(device)

    def fit_rope(self, length: int) -> bool:
        """Make the RoPE tables those of a sequence of `length` positions (LongRoPE: its long factors past
        the original context, its short ones up to it; no other RoPE depends on the length); whether
        they changed."""
        long = self.args.rope_long(length)
        if long == self.rope_long:
            return False
        self.rope_long = long
        if not self.rope_cos.is_meta:
            self.init_rope()
        return True

    def ropes(self, positions: torch.Tensor) -> dict[str, Rope]:
        """Each layer's (cos, sin) at `positions` ([s] or [b, s] -> [(b,) s, rope_dim] each), by layer name."""
        rope = (self.rope_cos[positions], self.rope_sin[positions])
        local = (self.rope_local_cos[positions], self.rope_local_sin[positions]) if self.local_rope_layers else rope
        return {name: local if name in self.local_rope_layers else rope for name in map(str, range(self.args.n_layers))}

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [b, s] -> [b, s, dim]; times sqrt(dim) in the embedding's dtype with scale_embeddings (Gemma)."""
        h = self.tok_embeddings(tokens)
        if not self.args.scale_embeddings:
            return h
        return h * torch.tensor(self.args.dim**0.5).to(device=h.device, dtype=h.dtype)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """The head's logits of the normed h [b, s, dim] -> [b, s, V], soft-capped with logit_softcap (Gemma 2)."""
        return softcap(self.output(h), self.args.logit_softcap)

    def init_buffers(self) -> None:
        """Recompute every non-persistent buffer (garbage after ``to_empty``)."""
        self.init_rope()
        for module in self.modules():
            if isinstance(module, MoE):
                module.reset_buffers()

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Initialize the parameters present and all buffers, deterministically.

        Each parameter is drawn on the CPU in fp32 from its own generator,
        seeded by (seed, canonical name), then copied to its device/dtype: the
        result does not depend on which modules exist, their order, or the
        device (`initial_tensor`). Also re-ties embeddings and recomputes
        buffers, so this is the one call needed after ``to_empty``."""
        self.tie_weights()
        for module_name, module in self.named_modules():
            for pname, p in module.named_parameters(recurse=False):
                name = _canonical_name(f"{module_name}.{pname}" if module_name else pname, self.args)
                p.copy_(initial_tensor(name, tuple(p.shape), init_std(self.args, module, module_name, pname), seed))
        self.init_buffers()

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        targets: torch.Tensor | None = None,
        documents: Documents | None = None,
    ) -> torch.Tensor:
        """tokens [b, s] (or hidden [b, s, dim] when this stage has no
        embedding); positions [s] or [b, s], default arange(s) -- pass them when
        the hidden input is a sequence-parallel slice.
        Returns logits [b, s, vocab] (or hidden [b, s, dim] without output).
        With targets [b, s] the head must be a loss head (`fivecut.parallel.loss.LossHead`,
        installed by `parallelize`): it returns the sum of token losses, the logits never whole.
        With `documents` (data.document_mask) attention stays inside each document and the RoPE
        positions are the documents' own (`documents.positions` replaces `positions`)."""
        if documents is not None:
            positions = documents.positions  # [b, s]
        if positions is None:  # from the input, not from h: sequence parallelism may cut h along s
            positions = torch.arange(tokens.shape[1], device=tokens.device)
            self.fit_rope(tokens.shape[1])  # the whole sequence: its length chooses (LongRoPE)
        h = self.embed(tokens) if self.tok_embeddings is not None else tokens
        ropes = self.ropes(positions)  # [s, hd] each
        for name, layer in self.layers.items() if self.layers is not None else ():
            h = layer(h, ropes[name], documents)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            h = self.logits(h) if targets is None else self.output(h, targets)
        return h


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(x / cap) (Gemma 2's soft-capping); x itself when cap is 0."""
    return torch.tanh(x / cap) * cap if cap else x


_WRAPPER_PREFIXES = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")


def _canonical_name(name: str, args: ModelArgs) -> str:
    """Parameter name as in the plain single-device model: wrapper modules
    (compile, activation checkpointing) dropped; a tied head is the embedding."""
    name = ".".join(part for part in name.split(".") if part not in _WRAPPER_PREFIXES)
    if args.tie_embeddings and name == "output.weight":
        return "tok_embeddings.weight"
    return name


def init_std(args: ModelArgs, module: nn.Module, module_name: str, pname: str) -> float | None:
    """The standard deviation a parameter is drawn with (None: an RMSNorm weight, all ones): the
    residual branches' output projections (wo, w2) are scaled down by sqrt(2 * layers) (GPT-2)."""
    if isinstance(module, RMSNorm):
        return None
    leaf = module_name.rsplit(".", 1)[-1] if pname == "weight" else pname
    return args.init_std / math.sqrt(2 * args.n_layers) if leaf in ("wo", "w2") else args.init_std


def initial_tensor(name: str, shape: tuple[int, ...], std: float | None, seed: int) -> torch.Tensor:
    """The seed's value of the whole parameter `name`, fp32 on the CPU (ones where `std` is None)."""
    if std is None:
        return torch.ones(shape)
    g = torch.Generator().manual_seed(_name_seed(seed, name))
    return torch.randn(shape, generator=g, dtype=torch.float32) * std


class SeedWeights:
    """The seed's initial weights as a weight source (`fivecut.weights.source.WeightSource`'s
    `read`): any box of any parameter, by its canonical name, equal to what `init_weights` gives
    the whole model, so that a rank built on the meta device initializes only its part. The last
    whole tensor drawn is kept, for the other boxes of the same parameter."""

    def __init__(self, args: ModelArgs, seed: int):
        self.args, self.seed = args, seed
        self._last: tuple[str, torch.Tensor] | None = None

    @functools.cached_property
    def rules(self) -> dict[str, tuple[tuple[int, ...], float | None]]:
        """Canonical name -> (global shape, std), from the whole model on the meta device."""
        with torch.device("meta"):
            model = Transformer(self.args)
        out = {}
        for mname, m in model.named_modules():
            for pname, p in m.named_parameters(recurse=False):
                name = _canonical_name(f"{mname}.{pname}" if mname else pname, self.args)
                out[name] = (tuple(p.shape), init_std(self.args, m, mname, pname))
        return out

    def read(self, name: str, box: tuple[slice, ...]) -> torch.Tensor:
        if self._last is None or self._last[0] != name:
            shape, std = self.rules[name]
            self._last = (name, initial_tensor(name, shape, std, self.seed))
        return self._last[1][box]

    def fill(self, requests: list[tuple[str, tuple[slice, ...], torch.Tensor]]) -> None:
        """Each (name, box, view): the box's values into the view."""
        for name, box, view in requests:
            view.copy_(self.read(name, box))
        self._last = None


def _name_seed(seed: int, name: str) -> int:
    """A stable 63-bit seed from (seed, name); Python's hash() is salted."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def build_model(
    args: ModelArgs, device: str | torch.device = "cpu", seed: int = 0, dtype: torch.dtype = torch.float32
) -> Transformer:
    """Validate, construct on the meta device, materialize on ``device`` and
    initialize from ``seed``. ``device="meta"`` gives a shape-only model."""
    args.check()
    with torch.device("meta"):
        model = Transformer(args)
    model.to(dtype)
    if torch.device(device).type == "meta":
        return model
    model.to_empty(device=device)
    model.init_weights(seed)
    return model
