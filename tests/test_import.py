"""Published weights in: a Hugging Face Llama (random weights from `transformers`, GQA, tied and
untied, sharded and not) loads into fivecut under a layout and gives Hugging Face's logits.

Tolerances: fp32 logits of a 2-layer model, whose values are ~0.1; layouts differ from the single
process only in the order of floating-point sums, and fivecut from `transformers` in the
attention kernel and RoPE rounding: 1e-5 absolute and relative.
"""

from __future__ import annotations

import pytest
import torch

from fivecut.config import load_config
from fivecut.launch import spawn

RTOL = ATOL = 1e-5
VOCAB = 321  # odd: tensor parallelism pads it


TOKENS = torch.randint(0, VOCAB, (2, 13), generator=torch.Generator().manual_seed(0))  # [b, s]


def save_llama(folder, tied: bool, shard: bool = False, seed: int = 0) -> torch.Tensor:
    """A random `LlamaForCausalLM` saved with save_pretrained; returns its logits of TOKENS [b, s, V].
    (transformers is imported here, not at the top: spawned ranks import this module.)"""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rope_theta=5000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).float().eval()
    with torch.no_grad():  # norms of ones would hide two norms swapped
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
    model.save_pretrained(folder, max_shard_size="40KB" if shard else "5GB")
    with torch.no_grad():
        return model(TOKENS).logits


def import_config(cache: str, folder, *overrides: str):
    base = [
        f'model.init_from="hf:{folder}"',
        'data.tokenizer="byte"',
        f'data.cache_dir="{cache}"',
        "train.seq_len=32",
        "train.global_batch=8",
        "train.eval_every=0",
        "log.progress=false",
        "log.plot=false",
    ]
    return load_config(None, base + list(overrides))


def logits_of(configs, tokens) -> list[torch.Tensor]:
    """On each rank: the whole logits of each imported model."""
    from fivecut.train.infer import full_logits
    from fivecut.train.trainer import setup

    return [full_logits(setup(cfg), tokens) for cfg in configs]


@pytest.fixture(scope="module")
def llamas(tmp_path_factory):
    """(folder, Hugging Face logits) for a tied sharded Llama and an untied one."""
    root = tmp_path_factory.mktemp("llamas")
    out = []
    for tied, shard in ((True, True), (False, False)):
        folder = root / f"tied{tied}"
        out.append((folder, save_llama(folder, tied, shard, seed=int(tied))))
    return out


LAYOUTS = {
    "single": (),
    "tp=2": ("parallel.tp=2",),
    "pp=2": ("parallel.pp=2", "parallel.microbatches=2"),
    "dp=2,zero=3": ("parallel.dp=2", "parallel.zero=3"),
    "tp=2,pp=2": ("parallel.tp=2", "parallel.pp=2", "parallel.microbatches=2"),
    "tp=2,sp,cp=2 ring": ("parallel.tp=2", "parallel.sp=true", "parallel.cp=2", 'parallel.cp_mode="ring"'),
}


@pytest.mark.multirank
@pytest.mark.parametrize("layout", LAYOUTS)
def test_hf_llama_gives_hf_logits_under_layout(llamas, byte_cache, layout):
    configs = [import_config(byte_cache, folder, *LAYOUTS[layout]) for folder, _ in llamas]
    for rank, rank_logits in enumerate(spawn(logits_of, configs[0].parallel.world_size, configs, TOKENS)):
        for (folder, expected), got in zip(llamas, rank_logits):
            torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL, msg=f"{layout} rank {rank}, {folder.name}")
