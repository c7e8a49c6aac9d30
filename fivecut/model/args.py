"""Model hyper-parameters, the check of their own values, and the analytic counts derived from them.

`ModelArgs.check()` refuses arguments that describe no model (naming the numbers and a fix);
`build_model` calls it, and `fivecut.checks` calls it when it composes a run's checks.

The counts (parameters, active parameters, FLOPs per token) are what the planner uses for
models too large to build, so they must equal what the real module holds; tests check that
for every preset. Free of torch: the CLI reads these before a run starts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

GATES = ("softmax", "sigmoid")
# how RoPE's frequencies are stretched past the pretraining context (transformers' rope_type)
ROPE_SCALINGS = ("none", "linear", "llama3", "yarn", "longrope")
# the gate's activation of the dense feed-forward: SwiGLU's silu, or GeGLU's tanh-approximated GELU (Gemma)
FFN_ACTIVATIONS = ("silu", "gelu_tanh")
# the fields that shape only mixture-of-experts layers: a dense model (n_experts == 0) has no use for them
MOE_ONLY = (
    "top_k",
    "n_shared_experts",
    "moe_ffn_dim",
    "first_dense_layers",
    "gate",
    "route_scale",
    "route_norm",
    "expert_groups",
    "route_group_limit",
    "moe_bias",
    "swiglu_limit",
)

POSITIVE = (
    "vocab_size",
    "dim",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "ffn_dim",
    "max_seq_len",
    "rope_theta",
    "norm_eps",
    "init_std",
    "top_k",
    "route_scale",
    "expert_groups",
    "route_group_limit",
)
NON_NEGATIVE = ("n_experts", "n_shared_experts", "moe_ffn_dim", "first_dense_layers", "q_lora_rank", "kv_lora_rank",
                "attention_head_dim", "sliding_window", "full_attention_layers", "latent_norm_eps",
                "nope_interval", "rope_partial_dim", "swiglu_limit", "rope_local_theta",
                "query_scale_dim", "attn_softcap", "logit_softcap")  # fmt: skip
# the fields of plain (grouped-query) attention's published variants: latent attention has none of them
GQA_ONLY = ("attention_head_dim", "qkv_bias", "qk_norm", "qk_norm_whole", "sliding_window", "nope_interval",
            "rope_partial_dim", "attention_sinks", "wo_bias", "window_layers", "query_scale_dim",
            "attn_softcap")  # fmt: skip
# the fields that shape only multi-head latent attention: plain attention (kv_lora_rank == 0) ignores them
MLA_ONLY = ("q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
MLA_POSITIVE = ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature: 0.1 mscale ln(factor) + 1 (1 for a factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def nearest_divisor(n: int, near: int) -> int:
    """The divisor of n closest to ``near`` (for suggestions in errors)."""
    return min(divisors(n), key=lambda d: (abs(d - near), d))


@dataclass(frozen=True)
class ModelArgs:
    vocab_size: int = 256
    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2  # grouped-query attention; == n_heads means MHA
    ffn_dim: int = 384  # SwiGLU hidden size of the dense feed-forward
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02
    # mixture of experts (DeepSeek style); n_experts == 0 means a dense model
    n_experts: int = 0  # routed experts
    top_k: int = 2
    n_shared_experts: int = 0  # always-on experts, computed alongside
    moe_ffn_dim: int = 0  # hidden size of each expert (0 -> ffn_dim)
    first_dense_layers: int = 0  # the first k layers use the dense feed-forward
    gate: str = "softmax"  # "softmax" | "sigmoid" scoring of the router
    route_scale: float = 1.0  # multiplies the normalized top-k weights
    # divide the chosen experts' scores by their sum (Mixtral; Qwen3-MoE's and DeepSeek-V3's
    # norm_topk_prob); false keeps the raw scores. A single softmax-chosen expert keeps its
    # probability either way, so that the router still learns.
    route_norm: bool = True
    # group-limited routing (DeepSeek-V3's node-limited routing): the experts are cut into
    # `expert_groups` contiguous groups (with expert parallelism, groups of ranks: nodes)
    # and each token chooses its experts from its best `route_group_limit` groups only
    expert_groups: int = 1
    route_group_limit: int = 1
    # multi-head latent attention (DeepSeek-V2/V3's MLA); kv_lora_rank == 0 means plain attention.
    # Keys and values come from one compressed latent of kv_lora_rank channels per token (normed,
    # then expanded per head to qk_nope_head_dim key and v_head_dim value channels); the queries
    # from a latent of q_lora_rank channels (0: straight from the hidden state). Each head's
    # query and key end in qk_rope_head_dim channels rotated by RoPE, the key's shared by every
    # head (decoupled RoPE). With MLA, n_kv_heads must equal n_heads and dim // n_heads is unused.
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # the eps of the latent norms (q_norm over q_lora_rank, kv_norm over kv_lora_rank); 0: norm_eps.
    # transformers' DeepSeek-V3 builds them with 1e-6 whatever its rms_norm_eps (the other norms' eps)
    latent_norm_eps: float = 0.0
    # variants of grouped-query attention in published dense models (Qwen2/2.5, Qwen3, Mistral)
    attention_head_dim: int = 0  # channels of one head; 0: dim // n_heads (Qwen3 sets its own)
    qkv_bias: bool = False  # biases on the q, k, v projections, not on wo (Qwen2/2.5)
    qk_norm: bool = False  # RMSNorm over each query and each key head, before RoPE (Qwen3)
    # with qk_norm: one RMSNorm over the whole query projection [n_heads * hd] and one over the whole key
    # projection [n_kv_heads * hd], each with a weight of that size, instead of one per head (OLMo 2)
    qk_norm_whole: bool = False
    # partial rotary (Phi-3's partial_rotary_factor): RoPE turns the first k channels of each query and key
    # head and passes the others through; 0: every channel turns
    rope_partial_dim: int = 0
    # layers without RoPE (SmolLM3's NoPE layers): with k > 0, every k-th layer (k-1, 2k-1, ...) rotates no
    # channel of its queries and keys; 0: every layer rotates
    nope_interval: int = 0
    # the block's two norms take each sublayer's output, before the residual add (OLMo 2):
    # h = x + norm(attention(x)); false: its input (pre-norm, Llama: h = x + attention(norm(x)))
    norm_after: bool = False
    # sliding-window attention (Mistral v0.1, Qwen2's use_sliding_window): 0 is full causal attention;
    # w > 0: the query at position i sees positions i-w+1 .. i (itself and the w-1 before it)
    sliding_window: int = 0
    full_attention_layers: int = 0  # with a window: the first k layers attend fully (Qwen2's max_window_layers)
    # RoPE scaling for contexts past pretraining (transformers' rope_parameters): "linear" divides every
    # frequency by rope_factor (position interpolation); "llama3" (Llama 3.1+) divides the low
    # frequencies, whose wavelength exceeds rope_original_context / rope_low_freq_factor, keeps the high
    # ones (wavelength under rope_original_context / rope_high_freq_factor) and blends between; "yarn"
    # (YaRN: Qwen2.5's long contexts, DeepSeek-V3) blends interpolated and original frequencies over the
    # channels between beta_fast and beta_slow rotations in rope_original_context, and multiplies cos and
    # sin by 0.1 ln(factor) + 1 (with rope_mscale and rope_mscale_all_dim: the ratio of the two such
    # factors; latent attention's scores then scale by the square of the second, as DeepSeek-V3's do)
    rope_scaling: str = "none"
    rope_factor: float = 1.0
    rope_original_context: int = 0  # original_max_position_embeddings (llama3, yarn)
    rope_low_freq_factor: float = 1.0  # llama3
    rope_high_freq_factor: float = 4.0  # llama3
    rope_beta_fast: float = 32.0  # yarn
    rope_beta_slow: float = 1.0  # yarn
    rope_mscale: float = 0.0  # yarn; 0: unset
    rope_mscale_all_dim: float = 0.0  # yarn; 0: unset
    # GPT-OSS (GptOssForCausalLM): attention sinks, a window on some layers, biases everywhere, the clamped SwiGLU.
    # attention_sinks: one learned logit per query head in each softmax's denominator (a key every query sees,
    # whose value is 0): softmax over [scores, sink], the sink's share dropped
    attention_sinks: bool = False
    wo_bias: bool = False  # a bias on attention's output projection (qkv_bias: on q, k, v)
    # the window's layers one by one: "s" slides (sliding_window), "f" attends fully, one letter a layer
    # (transformers' layer_types), repeated past its end ("sf": the even layers slide, GPT-OSS's default and
    # Gemma 2's; "sssssf": Gemma 3's 5:1; a model cut to fewer layers keeps its first layers' kinds); "": the
    # layers from full_attention_layers on slide
    window_layers: str = ""
    moe_bias: bool = False  # biases on the router's logits and on each routed expert's w1, w3 and w2
    # the experts' clamped SwiGLU (GPT-OSS) when > 0: g = min(w1 x, limit), u = clamp(w3 x, -limit, limit),
    # h = (u + 1) * g * sigmoid(swiglu_alpha * g); 0: silu(w1 x) * w3 x
    swiglu_limit: float = 0.0
    swiglu_alpha: float = 1.702
    rope_truncate: bool = True  # yarn: the ramp's ends floored and ceiled to whole channels (false: GPT-OSS)
    # ----- Gemma 2 / Gemma 3 -----
    # the feed-forward's gate activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU: GELU's tanh approximation)
    ffn_activation: str = "silu"
    # a second norm on each sublayer's output, before the residual add (Gemma's sandwich):
    # h = x + post(attention(pre(x))), the same around the feed-forward; pre is attention_norm / ffn_norm
    sandwich_norms: bool = False
    scale_embeddings: bool = False  # the embedding's output times sqrt(dim), cast to its dtype first (Gemma)
    # the sliding layers' own RoPE base, unscaled (Gemma 3's local layers); 0: every layer turns as rope_theta
    # (and rope_scaling) say
    rope_local_theta: float = 0.0
    query_scale_dim: int = 0  # the scores times query_scale_dim ** -0.5 (Gemma's query_pre_attn_scalar); 0: head_dim
    # soft-capping, cap * tanh(x / cap) (Gemma 2): of each attention score (after the scale, before the mask) and of
    # each output logit; 0: none
    attn_softcap: float = 0.0
    logit_softcap: float = 0.0
    # ----- LongRoPE (rope_scaling = "longrope": Phi-3.5, Phi-4-mini, the 128k Phi-3s) -----
    # channel pair i turns at 1 / (f_i * rope_theta^(2i/rope_dim)), f the short factors for a sequence of at most
    # rope_original_context positions and the long ones past it (`rope_long`: transformers chooses by the length a
    # forward sees); cos and sin times rope_attention_factor, or 0: sqrt(1 + ln(rope_factor) / ln(rope_original_
    # context)) (1 for rope_factor 1). Tuples of rope_dim/2 numbers each
    rope_short_factors: tuple[float, ...] = ()
    rope_long_factors: tuple[float, ...] = ()
    rope_attention_factor: float = 0.0

    def __post_init__(self):  # a checkpoint's JSON gives the factors back as lists
        for name in ("rope_short_factors", "rope_long_factors"):
            object.__setattr__(self, name, tuple(getattr(self, name)))

    # ----- the check of the values ---------------------------------------

    def check(self) -> ModelArgs:
        """Raise ValueError naming the numbers and a fix; return self if these arguments describe a model.
        One problem at a time (unlike the layout's `problems()` lists): each check divides by what the
        ones before it proved positive."""
        self._check_signs()
        if self.dim % self.n_heads and not self.attention_head_dim:
            raise ValueError(
                f"dim ({self.dim}) is not divisible by n_heads ({self.n_heads}); "
                f"choose n_heads among the divisors of dim, e.g. {nearest_divisor(self.dim, self.n_heads)}"
            )
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads ({self.n_heads}) is not divisible by n_kv_heads ({self.n_kv_heads}); "
                f"choose n_kv_heads dividing n_heads, e.g. {nearest_divisor(self.n_heads, self.n_kv_heads)}"
            )
        if self.is_mla:
            self._check_mla()
        elif self.head_dim % 2:
            raise ValueError(
                f"head_dim = dim // n_heads = {self.dim} // {self.n_heads} = {self.head_dim} is odd, "
                "but RoPE rotates pairs of channels; pick dim and n_heads giving an even head_dim"
            )
        self._check_gate_and_layers()
        self._check_window()
        self._check_variants()
        self._check_gemma()
        self._check_rope_scaling()
        if self.is_moe:
            self._check_groups()
        if self.is_moe and self.top_k > self.n_experts:
            raise ValueError(
                f"top_k ({self.top_k}) exceeds n_experts ({self.n_experts}); set top_k <= {self.n_experts} or add "
                "experts"
            )
        return self

    def _check_signs(self) -> None:
        for name in POSITIVE:
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"{name} must be positive, got {value}; set {name} > 0")
        for name in NON_NEGATIVE:
            value = getattr(self, name)
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}; set {name} >= 0 (0 disables it)")

    def _check_mla(self) -> None:
        for name in MLA_POSITIVE:
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(
                    f"{name} must be positive with multi-head latent attention (kv_lora_rank={self.kv_lora_rank}), "
                    f"got {value}; set {name} > 0, or kv_lora_rank = 0 for plain attention"
                )
        if self.qk_rope_head_dim % 2:
            raise ValueError(
                f"qk_rope_head_dim ({self.qk_rope_head_dim}) is odd, but RoPE rotates pairs of channels; make it even"
            )
        if self.v_head_dim > self.qk_head_dim:
            raise ValueError(
                f"v_head_dim ({self.v_head_dim}) exceeds qk_nope_head_dim + qk_rope_head_dim ({self.qk_head_dim}); "
                "the attention core pads values up to the query/key head size, never down: lower v_head_dim"
            )
        if self.n_kv_heads != self.n_heads:
            raise ValueError(
                f"n_kv_heads ({self.n_kv_heads}) != n_heads ({self.n_heads}); multi-head latent attention expands "
                f"keys and values for every head: set n_kv_heads = {self.n_heads}"
            )
        for name in GQA_ONLY:
            if getattr(self, name):
                raise ValueError(
                    f"{name} ({getattr(self, name)!r}) shapes grouped-query attention, not multi-head latent "
                    f"attention (kv_lora_rank={self.kv_lora_rank}); unset {name}"
                )

    def _check_variants(self) -> None:
        if self.qk_norm_whole and not self.qk_norm:
            raise ValueError("qk_norm_whole says how wide the q/k norms are, but qk_norm is false; set qk_norm = true")
        if self.rope_partial_dim % 2 or self.rope_partial_dim > self.head_dim:
            raise ValueError(
                f"rope_partial_dim ({self.rope_partial_dim}) must be even (RoPE turns pairs of channels) and at most "
                f"head_dim ({self.head_dim}); 0 turns every channel"
            )

    def _check_gemma(self) -> None:
        if self.ffn_activation not in FFN_ACTIVATIONS:
            raise ValueError(f"ffn_activation {self.ffn_activation!r} is not one of {', '.join(FFN_ACTIVATIONS)}")
        if self.is_moe and self.ffn_activation != "silu":
            raise ValueError(
                f"ffn_activation {self.ffn_activation!r} with experts: the experts' grouped kernels are SwiGLU; "
                "set ffn_activation = 'silu' or n_experts = 0"
            )
        if self.rope_local_theta and not self.sliding_window:
            raise ValueError(
                f"rope_local_theta ({self.rope_local_theta}) turns the sliding layers, but sliding_window is 0"
            )
        if self.norm_after and self.sandwich_norms:
            raise ValueError("norm_after moves the one norm after each sublayer, sandwich_norms adds one: set one")

    def _check_window(self) -> None:
        if self.window_layers:
            self._check_window_layers()
        if self.full_attention_layers and not self.sliding_window:
            raise ValueError(
                f"full_attention_layers ({self.full_attention_layers}) needs a sliding_window for the other layers; "
                "set sliding_window > 0, or full_attention_layers = 0"
            )
        if self.full_attention_layers > self.n_layers:
            raise ValueError(
                f"full_attention_layers ({self.full_attention_layers}) exceeds n_layers ({self.n_layers}); "
                f"set full_attention_layers <= {self.n_layers}"
            )

    def _check_window_layers(self) -> None:
        pattern = self.window_layers
        if set(pattern) - {"s", "f"}:
            raise ValueError(
                f"window_layers {pattern!r} must give each layer a letter: 's' slides, 'f' attends fully "
                "(repeated past its end)"
            )
        if self.full_attention_layers or ("s" in pattern and not self.sliding_window):
            raise ValueError(
                f"window_layers {pattern!r} says which layers slide: it needs sliding_window > 0 for its 's' "
                f"layers (got {self.sliding_window}) and full_attention_layers = 0 (got {self.full_attention_layers})"
            )

    def _check_rope_scaling(self) -> None:
        if self.rope_scaling not in ROPE_SCALINGS:
            raise ValueError(f"rope_scaling {self.rope_scaling!r} is not one of {', '.join(ROPE_SCALINGS)}")
        if self.rope_scaling == "none":
            return
        if not self.rope_factor >= 1:
            raise ValueError(f"rope_factor ({self.rope_factor}) stretches RoPE; it must be >= 1")
        if self.rope_scaling in ("llama3", "yarn", "longrope") and self.rope_original_context <= 0:
            raise ValueError(
                f"rope_scaling {self.rope_scaling!r} needs rope_original_context, the pretraining context "
                f"(original_max_position_embeddings), > 0; got {self.rope_original_context}"
            )
        if self.rope_scaling == "longrope":
            self._check_longrope()
        if self.rope_scaling == "llama3" and not self.rope_high_freq_factor > self.rope_low_freq_factor > 0:
            raise ValueError(
                f"llama3 RoPE needs rope_high_freq_factor ({self.rope_high_freq_factor}) > rope_low_freq_factor "
                f"({self.rope_low_freq_factor}) > 0"
            )

    def _check_longrope(self) -> None:
        pairs = self.rope_dim // 2
        for name in ("rope_short_factors", "rope_long_factors"):
            factors = getattr(self, name)
            if len(factors) != pairs or not all(f > 0 for f in factors):
                raise ValueError(
                    f"longrope RoPE needs {name} of {pairs} positive numbers (one per rotated channel pair, "
                    f"rope_dim {self.rope_dim} / 2); got {len(factors)}: {factors[:4]}"
                )
        if self.rope_attention_factor < 0:
            raise ValueError(f"rope_attention_factor ({self.rope_attention_factor}) must be >= 0 (0: derived)")

    def rope_long(self, length: int) -> bool:
        """Whether a sequence of `length` positions turns by LongRoPE's long factors (past the original
        context, as transformers decides from the positions it sees); false for every other RoPE."""
        return self.rope_scaling == "longrope" and length > self.rope_original_context

    def _check_gate_and_layers(self) -> None:
        if self.gate not in GATES:
            raise ValueError(f"gate {self.gate!r} is not one of {GATES}")
        if self.first_dense_layers > self.n_layers:
            raise ValueError(
                f"first_dense_layers ({self.first_dense_layers}) exceeds n_layers ({self.n_layers}); "
                f"set first_dense_layers <= {self.n_layers}"
            )

    def _check_groups(self) -> None:
        g, limit = self.expert_groups, self.route_group_limit
        if self.n_experts % g:
            raise ValueError(
                f"n_experts ({self.n_experts}) is not divisible by expert_groups ({g}); "
                f"choose expert_groups among {divisors(self.n_experts)}"
            )
        if g == 1 and limit != 1:
            raise ValueError(
                f"route_group_limit ({limit}) needs expert_groups > 1 to choose groups from; set expert_groups"
            )
        if limit > g:
            raise ValueError(f"route_group_limit ({limit}) exceeds expert_groups ({g}); set route_group_limit <= {g}")
        if g > 1 and self.top_k > limit * (self.n_experts // g):
            raise ValueError(
                f"top_k ({self.top_k}) exceeds the {limit * (self.n_experts // g)} experts in "
                f"route_group_limit={limit} groups of {self.n_experts // g}; raise route_group_limit"
            )

    # ----- derived sizes -------------------------------------------------

    @property
    def head_dim(self) -> int:
        return self.attention_head_dim or self.dim // self.n_heads

    def layer_window(self, i: int) -> int:
        """The sliding window of layer i's attention; 0: full causal attention."""
        if self.window_layers:
            return self.sliding_window if self.window_layers[i % len(self.window_layers)] == "s" else 0
        return self.sliding_window if i >= self.full_attention_layers else 0

    def layer_local_rope(self, i: int) -> bool:
        """Whether layer i turns by the sliding layers' own RoPE (`rope_local_theta`) rather than the global one."""
        return bool(self.rope_local_theta and self.layer_window(i))

    def layer_rope(self, i: int) -> bool:
        """Whether layer i rotates its queries and keys (false on the NoPE layers of `nope_interval`)."""
        return not (self.nope_interval and (i + 1) % self.nope_interval == 0)

    @property
    def has_window(self) -> bool:
        return any(self.layer_window(i) for i in range(self.n_layers))

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def latent_eps(self) -> float:
        """The eps of latent attention's q and kv norms: latent_norm_eps, or norm_eps when unset."""
        return self.latent_norm_eps or self.norm_eps

    @property
    def score_scale(self) -> float:
        """What latent attention multiplies its scores by beyond 1/sqrt(head): under YaRN with
        rope_mscale_all_dim, that dimension's factor squared (DeepSeek-V3), else 1."""
        if self.rope_scaling != "yarn" or not self.rope_mscale_all_dim or not self.is_mla:
            return 1.0
        return yarn_mscale(self.rope_factor, self.rope_mscale_all_dim) ** 2

    @property
    def rope_dim(self) -> int:
        """Channels RoPE rotates in each query and key head: the decoupled part under MLA, else all."""
        return self.qk_rope_head_dim if self.is_mla else self.rope_partial_dim or self.head_dim

    @property
    def qk_head_dim(self) -> int:
        """Channels of one query (and key) head, over which the scores are summed."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.is_mla else self.head_dim

    @property
    def value_head_dim(self) -> int:
        return self.v_head_dim if self.is_mla else self.head_dim

    @property
    def attention_width(self) -> int:
        """Mean of the score (q.k) and value widths over all heads: the causal attention core does
        2 * s * attention_width multiply-adds per token forward (half of s x s masked): dim for plain
        attention, n_heads * (qk_head_dim + v_head_dim) / 2 under MLA."""
        return self.n_heads * (self.qk_head_dim + self.value_head_dim) // 2

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    @property
    def expert_dim(self) -> int:
        """Hidden size of one routed (or shared) expert."""
        return self.moe_ffn_dim or self.ffn_dim

    def moe_layer(self, i: int) -> bool:
        return self.is_moe and i >= self.first_dense_layers

    @property
    def n_moe_layers(self) -> int:
        return sum(self.moe_layer(i) for i in range(self.n_layers))

    # ----- parameter counts ----------------------------------------------

    def attention_matmul_params(self) -> int:
        """Weights of one block's attention projections (its latent norms left out)."""
        if self.is_mla:
            return sum(self.mla_shapes().values()) - self.q_lora_rank - self.kv_lora_rank
        hd = self.head_dim
        q_and_o = 2 * self.dim * self.n_heads * hd  # wq, wo
        k_and_v = 2 * self.dim * self.n_kv_heads * hd  # wk, wv
        return q_and_o + k_and_v

    def mla_shapes(self) -> dict[str, int]:
        """Elements of each parameter of one MLA block's attention, by name (`LatentAttention`)."""
        h, heads, qk = self.dim, self.n_heads, self.qk_head_dim
        kv_b = heads * (self.qk_nope_head_dim + self.v_head_dim)
        if self.q_lora_rank:
            q = {"wq_a": self.q_lora_rank * h, "q_norm": self.q_lora_rank, "wq_b": heads * qk * self.q_lora_rank}
        else:
            q = {"wq": heads * qk * h}
        latent = self.kv_lora_rank + self.qk_rope_head_dim
        kv = {"wkv_a": latent * h, "kv_norm": self.kv_lora_rank, "wkv_b": kv_b * self.kv_lora_rank}
        return q | kv | {"wo": h * heads * self.v_head_dim}

    def _attention_params(self) -> int:
        latent_norms = self.q_lora_rank + self.kv_lora_rank if self.is_mla else 0
        biases = (self.n_heads + 2 * self.n_kv_heads) * self.head_dim if self.qkv_bias else 0
        biases += self.dim * self.wo_bias + self.n_heads * self.attention_sinks  # GPT-OSS's wo bias and sinks
        return self.attention_matmul_params() + latent_norms + biases + self.qk_norm_params()

    def qk_norm_params(self) -> int:
        """Elements of one block's q and k norm weights: a head's size each, or the projections' (qk_norm_whole)."""
        if not self.qk_norm:
            return 0
        return (self.n_heads + self.n_kv_heads) * self.head_dim if self.qk_norm_whole else 2 * self.head_dim

    def _ffn_params(self, hidden: int) -> int:
        return 3 * self.dim * hidden  # w1, w3, w2

    def _moe_params(self, experts_counted: int) -> int:
        router = (self.dim + self.moe_bias) * self.n_experts
        expert_biases = (2 * self.expert_dim + self.dim) * self.moe_bias  # b1, b3, b2 of one expert
        routed = experts_counted * (self._ffn_params(self.expert_dim) + expert_biases)
        shared = self._ffn_params(self.expert_dim * self.n_shared_experts)
        return router + routed + shared

    @property
    def block_norms(self) -> int:
        """RMSNorms [dim] of one block: before attention and the feed-forward, and after each (sandwich_norms)."""
        return 4 if self.sandwich_norms else 2

    def _layer_params(self, i: int, experts_counted: int) -> int:
        norms = self.block_norms * self.dim
        if self.moe_layer(i):
            ffn = self._moe_params(experts_counted)
        else:
            ffn = self._ffn_params(self.ffn_dim)
        return norms + self._attention_params() + ffn

    def _count(self, embedding: bool, experts_counted: int) -> int:
        layers = sum(self._layer_params(i, experts_counted) for i in range(self.n_layers))
        table = self.vocab_size * self.dim
        # The output head is always counted; with tied embeddings it is the
        # same matrix as the token embedding, counted once (as the head).
        head_and_embedding = table if self.tie_embeddings else (2 * table if embedding else table)
        return layers + self.dim + head_and_embedding  # + final norm

    def num_params(self, embedding: bool = True) -> int:
        """Parameters of the model. ``embedding=False`` leaves out the token
        embedding table, except when it is tied to the output head (then the
        shared matrix is a head, and counted)."""
        return self._count(embedding, self.n_experts)

    def num_active_params(self, embedding: bool = True) -> int:
        """Parameters one token passes through: MoE layers count only their
        router, top_k routed experts and the shared experts."""
        return self._count(embedding, self.top_k if self.is_moe else 0)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward): 6·N + 12·L·w·s, with
        N the active parameters without the token embedding (the output head
        included), L layers, w = `attention_width` (dim for plain attention),
        s = seq_len (the attention scores)."""
        n = self.num_active_params(embedding=False)
        return float(6 * n + 12 * self.n_layers * self.attention_width * seq_len)
