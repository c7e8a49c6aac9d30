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

import hashlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from fivecut.model.args import ModelArgs

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
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def rope_tables(head_dim: int, max_seq_len: int, theta: float) -> Rope:
    """cos/sin tables [max_seq_len, head_dim] in fp32, in the rotate-half layout:
    channel i and channel i + head_dim/2 form one rotated pair, at frequency
    theta^(-2i/head_dim). Computed in float64 on the CPU so that every device
    gets bitwise the same tables."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)  # [hd/2]
    t = torch.arange(max_seq_len, dtype=torch.float64)
    angles = torch.outer(t, inv_freq)  # [S, hd/2]
    angles = torch.cat([angles, angles], dim=-1)  # [S, hd]
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [b, heads, s, hd] by position (rotate-half form, as in Hugging
    Face Llama checkpoints; Meta's original checkpoints use interleaved pairs
    and need a permutation of wq/wk rows on import). Computed in fp32."""
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
    CPU falls back to the unfused path, which keeps the s x s probabilities for backward)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        gqa = q.shape[1] != k.shape[1]
        narrow = q.shape[-1] - v.shape[-1]
        if narrow == 0:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        o = F.scaled_dot_product_attention(q, k, F.pad(v, (0, narrow)), is_causal=True, enable_gqa=gqa)
        return o[..., : v.shape[-1]]  # [b, n_heads, s, hd_v]


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)
        # Replaceable by any module with the same signature (context parallelism).
        self.core: nn.Module = CausalSDPA()

    def _heads(self, y: torch.Tensor) -> torch.Tensor:
        b, s, _ = y.shape
        # number of (local) heads from the projection's width, not from args
        return y.view(b, s, -1, self.head_dim).transpose(1, 2)  # [b, heads, s, hd]

    def forward(self, x: torch.Tensor, rope: Rope) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self._heads(self.wq(x)), self._heads(self.wk(x)), self._heads(self.wv(x))
        cos, sin = rope
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o = self.core(q, k, v)  # [b, n_heads, s, hd]
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
            self.q_norm = RMSNorm(args.q_lora_rank, args.norm_eps)
            self.wq_b = nn.Linear(args.q_lora_rank, heads * qk, bias=False)
        else:
            self.wq = nn.Linear(args.dim, heads * qk, bias=False)
        self.wkv_a = nn.Linear(args.dim, args.kv_lora_rank + self.rope_dim, bias=False)
        self.kv_norm = RMSNorm(args.kv_lora_rank, args.norm_eps)
        self.wkv_b = nn.Linear(args.kv_lora_rank, heads * (self.nope + self.v_dim), bias=False)
        self.wo = nn.Linear(heads * self.v_dim, args.dim, bias=False)
        # Replaceable by any module with the same signature (recomputation wraps it).
        self.core: nn.Module = CausalSDPA()

    def queries(self, x: torch.Tensor) -> torch.Tensor:
        """x [b, s, dim] -> [b, s, H * (nope + rope)]."""
        if self.compressed_q:
            return self.wq_b(self.q_norm(self.wq_a(x)))
        return self.wq(x)

    def forward(self, x: torch.Tensor, rope: Rope) -> torch.Tensor:
        b, s, _ = x.shape
        o = self.core(*self.qkv(x, rope))  # [b, H, s, v_dim]
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
        k = torch.cat([k_nope, k_rope], dim=-1)  # [b, H, s, nope + rope]
        return q, k, v


def make_attention(args: ModelArgs) -> nn.Module:
    """Latent attention when the arguments give a key/value latent (kv_lora_rank > 0), else GQA."""
    return LatentAttention(args) if args.is_mla else Attention(args)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)  # gate
        self.w3 = nn.Linear(dim, hidden, bias=False)  # up
        self.w2 = nn.Linear(hidden, dim, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


# ----------------------------------------------------------------------------
# mixture of experts
# ----------------------------------------------------------------------------


class GroupedExperts(nn.Module):
    """E SwiGLU experts stored as stacked weights. The number of experts is
    read from the weights, so an expert-parallel rank can hold a slice."""

    def __init__(self, n_experts: int, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, dim, hidden))  # gate
        self.w3 = nn.Parameter(torch.empty(n_experts, dim, hidden))  # up
        self.w2 = nn.Parameter(torch.empty(n_experts, hidden, dim))  # down

    def forward(self, x_sorted: torch.Tensor, counts: list[int] | torch.Tensor) -> torch.Tensor:
        """x_sorted [T_sorted, dim], grouped by expert: rows of expert e are the
        counts[e] rows after those of experts < e. Returns [T_sorted, dim].
        Every expert runs, even on zero rows, so each weight gets a gradient."""
        if isinstance(counts, torch.Tensor):
            counts = counts.tolist()
        if len(counts) != self.w1.shape[0]:
            raise ValueError(f"got {len(counts)} token counts for {self.w1.shape[0]} local experts")
        chunks = torch.split(x_sorted, counts)  # E tensors [counts[e], dim]
        outs = [self._expert(e, xe) for e, xe in enumerate(chunks)]
        return torch.cat(outs)  # [T_sorted, dim]

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        return swiglu_expert(x, self.w1[e], self.w3[e], self.w2[e])


def swiglu_expert(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """One expert: x [n, dim], w1/w3 [dim, hidden], w2 [hidden, dim] -> [n, dim]."""
    return (F.silu(x @ w1) * (x @ w3)) @ w2


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
    counts = torch.bincount(flat_idx, minlength=n_experts)  # [E]
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
        self.expert_groups, self.route_group_limit = args.expert_groups, args.route_group_limit
        # Training-time behaviour (expert parallelism, capacity, balancing) is installed from
        # outside by `fivecut.parallel.expert`; without it this is the plain dropless layer.
        self.runtime = None
        hidden = args.expert_dim
        self.router = nn.Linear(args.dim, args.n_experts, bias=False)
        self.experts = GroupedExperts(args.n_experts, args.dim, hidden)
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

        softmax gate: softmax over experts, top-k, renormalized when k > 1.
        sigmoid gate: independent sigmoid scores, top-k, always renormalized.
        Both: selection on scores + expert_bias, weights times route_scale."""
        logits = self.router(x_flat).float()  # [T, E]
        scores = logits.softmax(dim=-1) if self.gate == "softmax" else logits.sigmoid()
        biased = scores + self.expert_bias.float()  # [T, E] for selection only
        if self.expert_groups > 1:
            biased = limit_to_groups(biased, self.expert_groups, self.route_group_limit)
        topk_idx = biased.topk(self.top_k, dim=-1).indices  # [T, k]
        topk_weight = scores.gather(-1, topk_idx)  # [T, k]
        if self.gate == "sigmoid" or self.top_k > 1:
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
        self.attention = make_attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = MoE(args) if args.moe_layer(layer_id) else FeedForward(args.dim, args.ffn_dim)

    def forward(self, x: torch.Tensor, rope: Rope) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope)
        return h + self.feed_forward(self.ffn_norm(h))


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
        self.init_rope()

    def tie_weights(self) -> None:
        """With tie_embeddings, make output.weight the embedding's Parameter.
        Needed again after ``to_empty``, which unties shared parameters."""
        if self.args.tie_embeddings and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight

    def init_rope(self) -> None:
        """(Re)compute the RoPE tables in fp32 on the buffers' current device."""
        device = self.rope_cos.device
        cos, sin = rope_tables(self.args.rope_dim, self.args.max_seq_len, self.args.rope_theta)
        self.rope_cos, self.rope_sin = cos.to(device), sin.to(device)

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
        device. Also re-ties embeddings and recomputes buffers, so this is the
        one call needed after ``to_empty``."""
        self.tie_weights()
        std_out = self.args.init_std / math.sqrt(2 * self.args.n_layers)
        for module_name, module in self.named_modules():
            for pname, p in module.named_parameters(recurse=False):
                name = _canonical_name(f"{module_name}.{pname}" if module_name else pname, self.args)
                if isinstance(module, RMSNorm):
                    p.fill_(1.0)
                    continue
                leaf = module_name.rsplit(".", 1)[-1] if pname == "weight" else pname
                std = std_out if leaf in ("wo", "w2") else self.args.init_std
                g = torch.Generator().manual_seed(_name_seed(seed, name))
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32) * std)
        self.init_buffers()

    def forward(
        self, tokens: torch.Tensor, positions: torch.Tensor | None = None, targets: torch.Tensor | None = None
    ) -> torch.Tensor:
        """tokens [b, s] (or hidden [b, s, dim] when this stage has no
        embedding); positions [s] or [b, s], default arange(s) -- pass them when
        the hidden input is a sequence-parallel slice.
        Returns logits [b, s, vocab] (or hidden [b, s, dim] without output).
        With targets [b, s] the head must be a loss head (`fivecut.parallel.loss.LossHead`,
        installed by `parallelize`): it returns the sum of token losses, the logits never whole."""
        if positions is None:  # from the input, not from h: sequence parallelism may cut h along s
            positions = torch.arange(tokens.shape[1], device=tokens.device)
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        rope = (self.rope_cos[positions], self.rope_sin[positions])  # [s, hd] each
        for layer in self.layers.values() if self.layers is not None else ():
            h = layer(h, rope)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            h = self.output(h) if targets is None else self.output(h, targets)
        return h


_WRAPPER_PREFIXES = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")


def _canonical_name(name: str, args: ModelArgs) -> str:
    """Parameter name as in the plain single-device model: wrapper modules
    (compile, activation checkpointing) dropped; a tied head is the embedding."""
    name = ".".join(part for part in name.split(".") if part not in _WRAPPER_PREFIXES)
    if args.tie_embeddings and name == "output.weight":
        return "tok_embeddings.weight"
    return name


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
