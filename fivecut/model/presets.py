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
    # DeepSeek-V3's multi-head latent attention (MLA) is modelled as plain
    # multi-head attention with 128 heads of dim 7168/128; its group-limited
    # routing and multi-token prediction are left out. The MoE part (256
    # routed + 1 shared expert, top-8, sigmoid gate, scale 2.5, 3 dense
    # layers first) is as published.
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
