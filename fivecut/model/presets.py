"""Named model sizes.

``tiny*`` and ``small`` are trained in tests and examples; the presets in
``SHAPE_ONLY`` are real-world shapes for the planner and are only ever built
on the meta device.
"""

from __future__ import annotations

import difflib

from fivecut.model.args import ModelArgs

GPT2_VOCAB = 50257
LLAMA3_VOCAB = 128256

PRESETS: dict[str, ModelArgs] = {
    # byte-level vocabulary, ~0.85M parameters; the workhorse of the tests
    "tiny": ModelArgs(),
    # tiny with a DeepSeek-style MoE from layer 1 on
    "tiny-moe": ModelArgs(n_experts=8, top_k=2, n_shared_experts=1, moe_ffn_dim=128, first_dense_layers=1),
    # tiny with DeepSeek's multi-head latent attention (query and key/value latents, decoupled
    # RoPE, a value head narrower than the query/key head) and a MoE from layer 1 on
    "tiny-mla": ModelArgs(
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=4,
        ffn_dim=192,
        n_experts=4,
        top_k=2,
        n_shared_experts=1,
        moe_ffn_dim=64,
        first_dense_layers=1,
        q_lora_rank=48,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=12,
    ),
    # the GPT-2 tokenizer's awkward vocabulary size (odd, not a multiple of anything)
    "tiny-gpt2": ModelArgs(
        vocab_size=GPT2_VOCAB, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=192, tie_embeddings=True
    ),
    # ~17.6M parameters (12.9M of them the tied embedding)
    "small": ModelArgs(
        vocab_size=GPT2_VOCAB,
        dim=256,
        n_layers=6,
        n_heads=8,
        n_kv_heads=4,
        ffn_dim=768,
        tie_embeddings=True,
        max_seq_len=512,
    ),
    # Llama 3.2 1B's shape (~1.24B parameters, 263M of them the tied embedding); trained by
    # scripts/gpu_check.sh for throughput and MFU on one GPU
    "llama-1b": ModelArgs(
        vocab_size=LLAMA3_VOCAB,
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=8192,
        tie_embeddings=True,
        max_seq_len=2048,
        rope_theta=500000.0,
    ),
    "llama3-8b": ModelArgs(
        vocab_size=LLAMA3_VOCAB,
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=14336,
        max_seq_len=8192,
        rope_theta=500000.0,
    ),
    "llama3-70b": ModelArgs(
        vocab_size=LLAMA3_VOCAB,
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        ffn_dim=28672,
        max_seq_len=8192,
        rope_theta=500000.0,
    ),
    # Llama 3.1 405B (Llama 3 paper, table 3): 126 layers, dim 16,384, FFN 53,248, 128 heads, 8 kv heads
    "llama3-405b": ModelArgs(
        vocab_size=LLAMA3_VOCAB,
        dim=16384,
        n_layers=126,
        n_heads=128,
        n_kv_heads=8,
        ffn_dim=53248,
        max_seq_len=8192,
        rope_theta=500000.0,
    ),
    # DeepSeek-V3 (technical report, section 4.2): 61 layers, dim 7168, multi-head latent
    # attention with 128 heads (query latent 1536, key/value latent 512, per head 128 + 64
    # rotated query/key channels and 128 value channels), MoE from layer 3 on (256 routed + 1
    # shared expert of 2048, top-8, sigmoid gate, scale 2.5, node-limited routing: 8 groups,
    # at most 4). The multi-token prediction module (14B) is left out, as in the published 671B
    # total / 37B activated; the vocabulary is 129,280.
    "deepseek-v3": ModelArgs(
        vocab_size=129280,
        dim=7168,
        n_layers=61,
        n_heads=128,
        n_kv_heads=128,
        ffn_dim=18432,
        max_seq_len=4096,
        n_experts=256,
        top_k=8,
        n_shared_experts=1,
        moe_ffn_dim=2048,
        first_dense_layers=3,
        gate="sigmoid",
        route_scale=2.5,
        expert_groups=8,
        route_group_limit=4,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
    ),
}

# Real-world shapes: the planner and shape tests use them; train, verify and ledger refuse them.
SHAPE_ONLY = {"llama3-8b", "llama3-70b", "llama3-405b", "deepseek-v3"}


def runnable_presets() -> list[str]:
    """The presets small enough to build and train here, in PRESETS order."""
    return [name for name in PRESETS if name not in SHAPE_ONLY]


def get_preset(name: str) -> ModelArgs:
    if name in PRESETS:
        return PRESETS[name]
    closest = difflib.get_close_matches(name, PRESETS, n=1, cutoff=0.0)
    hint = f"; did you mean {closest[0]!r}?" if closest else ""
    raise ValueError(f"unknown model preset {name!r}; valid presets: {', '.join(PRESETS)}{hint}")
