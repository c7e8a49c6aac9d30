"""SmolLM3 (NoPE layers), OLMo 2 (norms after the sublayers, q/k norms over the whole
projections) and Phi-3 (fused qkv_proj and gate_up_proj, partial rotary, a window on every layer)
in and out of Hugging Face, one process and under the cuts.

Each model is a tiny random one built by `transformers` from its config class (no download), its
norms drawn at random (ones would hide a norm applied in the wrong place or sliced wrongly), saved
in shards with an index. SmolLM3's no_rope_layer_interval is 2, so of its 2 layers the second has
no RoPE; OLMo 2's q norm [4 heads x 16] and k norm [2 kv heads x 16] are cut by tp=2 with wq and wk;
Phi-3's RoPE turns 8 of each head's 16 channels, and tp=2 reads each rank's rows of wq, wk, wv out of
qkv_proj and of w1, w3 out of gate_up_proj (export fuses them back).

Tolerances as in tests/test_hf_dense.py: fp32 logits of 2-layer models (values ~0.1-1); fivecut
and transformers differ only in the order of floating-point operations: 1e-5 absolute and
relative. Under the cuts, `fivecut verify`'s own tolerances (rtol 1e-5 on the losses, gradients).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_hf_dense import COMMON as DENSE_COMMON
from test_hf_dense import (
    assert_each_exports_to_itself,
    assert_each_gives_its_logits,
    assert_greedy_generation_equals_transformers,
    edited,
    random_hf_model,
    save_each,
    verify,
)
from test_import import import_config, logits_of

from fivecut.launch import spawn

RTOL = ATOL = 1e-5
VOCAB = DENSE_COMMON["vocab_size"]
TOKENS = torch.randint(0, VOCAB, (2, 13), generator=torch.Generator().manual_seed(2))  # [b, s]
# test_hf_dense's shape, with special ids inside the vocabulary (these classes' defaults lie outside 321)
COMMON = DENSE_COMMON | dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
# class -> (config class, the architecture's own keys)
MODELS = {
    "SmolLM3ForCausalLM": ("SmolLM3Config", dict(no_rope_layer_interval=2, rope_theta=5000.0)),
    "Olmo2ForCausalLM": ("Olmo2Config", dict(tie_word_embeddings=False)),
    # RoPE turns 8 of a head's 16 channels; a window of 6 on every layer (13 tokens)
    "Phi3ForCausalLM": ("Phi3Config", dict(partial_rotary_factor=0.5, sliding_window=6)),
}


def hf_model(name: str, seed: int = 0):
    """A random `name` model of transformers, fp32, eval mode, its norms not at their init."""
    config_class, own = MODELS[name]
    return random_hf_model(name, config_class, COMMON | own, lambda p: 1 + 0.2 * torch.randn_like(p), seed)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, tuple[Path, torch.Tensor]]:
    """class name -> (its folder, transformers' logits of TOKENS [b, s, V])."""
    return save_each(tmp_path_factory.mktemp("hf-families"), hf_model, MODELS, TOKENS)


# ---------------------------------------------------------------- in: the logits of transformers


def test_each_family_gives_its_logits_in_one_process(saved):
    assert_each_gives_its_logits(saved, TOKENS)


def test_the_config_becomes_the_right_fields(saved):
    from fivecut.weights.load import source_of

    smol = source_of(f"hf:{saved['SmolLM3ForCausalLM'][0]}").args
    assert smol.nope_interval == 2 and [smol.layer_rope(i) for i in range(2)] == [True, False]
    assert smol.tie_embeddings and smol.rope_theta == 5000.0 and not smol.norm_after
    olmo = source_of(f"hf:{saved['Olmo2ForCausalLM'][0]}").args
    assert olmo.norm_after and olmo.qk_norm and olmo.qk_norm_whole and not olmo.tie_embeddings
    assert olmo.nope_interval == 0
    phi = source_of(f"hf:{saved['Phi3ForCausalLM'][0]}").args
    assert phi.rope_partial_dim == 8 and phi.head_dim == 16 and phi.rope_dim == 8
    assert [phi.layer_window(i) for i in range(2)] == [6, 6] and not phi.qkv_bias


LAYOUTS = {
    "tp=2,sp": ("parallel.tp=2", "parallel.sp=true"),
    "pp=2": ("parallel.pp=2", "parallel.microbatches=2"),
}


@pytest.mark.multirank
@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_family_gives_its_logits_under_layout(saved, byte_cache, layout):
    """tp: each rank reads its rows of OLMo 2's q/k norms with wq's and wk's; pp: each stage its layers
    (SmolLM3's NoPE layer is the second stage's)."""
    configs = [import_config(byte_cache, folder, *LAYOUTS[layout]) for folder, _ in saved.values()]
    for rank, rank_logits in enumerate(spawn(logits_of, 2, configs, TOKENS)):
        for (name, (_, expected)), got in zip(saved.items(), rank_logits):
            torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL, msg=f"{layout} rank {rank}, {name}")


# every new field at once: NoPE on layer 1, norms after the sublayers, whole-projection q/k norms
VARIANTS = dict(vocab_size=VOCAB, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, max_seq_len=64)
VARIANTS |= dict(qk_norm=True, qk_norm_whole=True, norm_after=True, nope_interval=2)


@pytest.mark.multirank
def test_forward_and_every_gradient_match_single_device_under_tp_sp():
    """The whole-projection norms' sums of squares all-reduced over tp forward, their gradients backward;
    the norm weights cut with wq's and wk's rows; the norms after the sublayers on SP's sequence slices."""
    from test_tensor import assert_tp_step_matches_one_process

    from fivecut.model.args import ModelArgs

    assert_tp_step_matches_one_process(ModelArgs(**VARIANTS), 2, True)


# ---------------------------------------------------------------- fivecut verify under the cuts


@pytest.mark.multirank
@pytest.mark.parametrize(
    "name,layout",
    [
        ("Olmo2ForCausalLM", "tp=2,sp=true"),
        ("SmolLM3ForCausalLM", "cp=2,cp_mode=ring"),
        ("Phi3ForCausalLM", "cp=2,cp_mode=ulysses"),
    ],
)
def test_verify_passes(saved, capsys, name, layout):
    verify(capsys, saved[name][0], layout)


SWEEP = ["dp=2", "dp=2,zero=3", "tp=2", "tp=2,sp=true", "pp=2,microbatches=2", "cp=2,cp_mode=ulysses"]


@pytest.mark.sweep
@pytest.mark.multirank
@pytest.mark.parametrize(
    "name,layout",
    [(name, layout) for name in MODELS for layout in SWEEP]
    + [(name, "cp=2,cp_mode=ring") for name in MODELS if name != "Phi3ForCausalLM"],  # Phi-3's window: ring refused
)
def test_verify_passes_on_each_family(saved, capsys, name, layout):
    verify(capsys, saved[name][0], layout)


RATIOS = ("ratio", "memory_ratio", "activation_ratio")


@pytest.mark.multirank
def test_ledger_counts_olmo2_s_norm_sums_as_the_planner_predicts(saved, capsys):
    """The q and k sums of squares all-reduced over tp (forward, and their gradients backward), and what
    the whole-projection norms keep for backward (one rstd per token each, no head-merge copy): measured
    = predicted under tp=2 with SP."""
    from test_hf_dense import ledger_ratios

    ratios = ledger_ratios(capsys, saved["Olmo2ForCausalLM"][0], "tp=2,sp=true")
    assert {k: ratios.get(k) for k in RATIOS} == dict.fromkeys(RATIOS, "1.000"), ratios


@pytest.mark.sweep
@pytest.mark.multirank
@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize(
    "layout,recompute",
    [("dp=2", "none"), ("tp=2,sp=true", "none"), ("cp=2,cp_mode=ulysses", "none"), ("tp=2,sp=true", "full"),
     ("tp=2", "full"), ("tp=2,sp=true", "selective")],
)  # fmt: skip
def test_ledger_measures_what_the_planner_predicts(saved, capsys, name, layout, recompute):
    """Phi-3's partial rotary lays q out by heads (the head-merge copy wo keeps, unless the core is
    recomputed); SmolLM3's NoPE layer 1; OLMo 2's recomputed blocks run their last g again (the last
    norm keeps its output) and their norm sums."""
    import re

    from fivecut.cli import main

    argv = ["ledger", "--model", f"hf:{saved[name][0]}", "--layout", layout, "--steps", "1"]
    code = main([*argv, "--set", f'train.recompute="{recompute}"'])
    out = capsys.readouterr().out
    ratios = dict(re.findall(r"^(\w*ratio)=(\S+)$", out, re.M))
    assert code == 0 and {k: ratios.get(k) for k in RATIOS} == dict.fromkeys(RATIOS, "1.000"), out


# ---------------------------------------------------------------- out: trained, exported, read by transformers


def test_each_family_exports_to_itself_after_training(saved, byte_cache, tmp_path):
    assert_each_exports_to_itself(saved, byte_cache, tmp_path, TOKENS)


def test_greedy_generation_equals_transformers(saved):
    """Through the KV cache: NoPE layers unrotated there too, the norms after the sublayers."""
    assert_greedy_generation_equals_transformers(saved, TOKENS[0, :6].tolist())


# ---------------------------------------------------------------- bad input: one line, exit 2, before any rank


def test_what_the_families_cannot_carry_is_refused_in_one_line(saved, tmp_path, capsys):
    from fivecut.cli import main

    smol, olmo = saved["SmolLM3ForCausalLM"][0], saved["Olmo2ForCausalLM"][0]
    cases = {
        "no_rope_layers [1, 0, 1, 1] is not implemented": edited(
            smol, tmp_path / "nope", {"no_rope_layers": [1, 0, 1, 1], "num_hidden_layers": 4}
        ),
        "use_sliding_window = True is not implemented": edited(
            smol, tmp_path / "window", {"use_sliding_window": True, "sliding_window": 4}
        ),
        "layer_types ['sliding_attention', 'full_attention'] is not implemented": edited(
            smol, tmp_path / "types", {"layer_types": ["sliding_attention", "full_attention"]}
        ),
        "attention_bias = True is not implemented; fivecut's OLMo 2": edited(
            olmo, tmp_path / "bias", {"attention_bias": True}
        ),
    }
    phi = saved["Phi3ForCausalLM"][0]
    cases |= {  # Phi-3 reads 'yarn' as longrope (tests/test_longrope.py), which needs its factors
        "rope_scaling.short_factor is None; longrope needs a list of 4 numbers": edited(
            phi, tmp_path / "yarn", {"rope_scaling": {"type": "yarn", "factor": 2.0}, "rope_parameters": None}
        ),
        "resid_pdrop = 0.1 is not implemented; fivecut's Phi-3 (no dropout)": edited(
            phi, tmp_path / "dropout", {"resid_pdrop": 0.1}
        ),
        "partial_rotary_factor = 0.2 turns 3 of a head's 16 channels": edited(
            phi, tmp_path / "odd", {"partial_rotary_factor": 0.2, "rope_parameters": {"rope_theta": 1e4}}
        ),
    }
    for needle, spec in cases.items():
        code = main(["eval", "--init-from", spec, "--set", 'data.tokenizer="byte"'])
        err = capsys.readouterr().err
        assert code == 2 and needle in err and err.count("\n") == 1 and "Traceback" not in err, (needle, err)
    code = main(["verify", "--model", f"hf:{olmo}", "--layout", "tp=4"])
    err = capsys.readouterr().err
    assert code == 2 and "qk_norm_whole" in err and "tp must divide n_kv_heads=2" in err, err


def test_other_classes_do_not_hold_the_new_fields():
    from fivecut.model.args import ModelArgs
    from fivecut.weights.architectures import ARCHITECTURES, for_args

    nope = ModelArgs(nope_interval=4)
    olmo = ModelArgs(qk_norm=True, qk_norm_whole=True, norm_after=True)
    assert for_args(nope).hf_class == "SmolLM3ForCausalLM" and for_args(olmo).hf_class == "Olmo2ForCausalLM"
    assert "nope_interval" in ARCHITECTURES["LlamaForCausalLM"].holds(nope)
    assert ARCHITECTURES["Qwen3ForCausalLM"].holds(olmo) is not None
    assert for_args(ModelArgs(norm_after=True)) is None  # no class has post-norms without OLMo 2's q/k norms
    with pytest.raises(ValueError, match="qk_norm_whole says how wide the q/k norms are, but qk_norm is false"):
        ModelArgs(qk_norm_whole=True).check()
