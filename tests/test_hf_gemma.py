"""Gemma 2 and Gemma 3 (text) in and out of Hugging Face, one process and under the cuts.

Each model is a tiny random one built by `transformers` from its config class (no download), every
mechanism on: GeGLU, the four norms of a block (their w drawn at random, not at Gemma's zero init, so a
norm read without its + 1, or in another's place, changes the logits), the embedding scaled by
sqrt(64), query_pre_attn_scalar 24 (not the head's 16), layer 0 sliding with a window of 4 (13 tokens)
and layer 1 global. Gemma 3: per-head q/k norms, the global layer's RoPE at base 5e4 stretched by a
linear factor 2, the sliding layer's at base 1e3. Gemma 2: attention scores capped at 0.1 and logits
at 0.5, caps small enough to bend this tiny model's scores and logits (at Gemma 2's own 50 and 30 they
would not, and a missing cap would go unseen).

Tolerances as in tests/test_hf_dense.py: fp32 logits (values ~0.1-1), 1e-5 absolute and relative.
Under the cuts, `fivecut verify`'s own (rtol 1e-5 on the losses, gradients).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import test_hf_dense as dense
import torch
from test_hf_families import COMMON as FAMILIES_COMMON

RTOL = ATOL = 1e-5
VOCAB = 321
TOKENS = torch.randint(0, VOCAB, (2, 13), generator=torch.Generator().manual_seed(3))  # [b, s]; s > the window
COMMON = FAMILIES_COMMON | dict(  # the window, query_pre_attn_scalar and head size Gemma's own
    vocab_size=VOCAB,
    head_dim=16,
    sliding_window=4,
    query_pre_attn_scalar=24,
    layer_types=["sliding_attention", "full_attention"],
)
ROPES = {
    "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e4},
    "sliding_attention": {"rope_type": "default", "rope_theta": 1e3},
}
# class -> (config class, the architecture's own keys)
MODELS = {
    "Gemma3ForCausalLM": ("Gemma3TextConfig", dict(rope_parameters=ROPES)),
    "Gemma2ForCausalLM": ("Gemma2Config", dict(attn_logit_softcapping=0.1, final_logit_softcapping=0.5)),
}


def drawn_norm(weight: torch.Tensor) -> torch.Tensor:
    """A Gemma norm's w drawn away from its init (0): 1 + w scales by ~0.7 to 1.3."""
    return 0.3 * torch.randn_like(weight)


def hf_model(name: str, seed: int = 0):
    """A random `name` model of transformers, fp32, eval mode, its norms drawn (`drawn_norm`)."""
    return dense.random_hf_model(name, MODELS[name][0], COMMON | MODELS[name][1], drawn_norm, seed)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, tuple[Path, torch.Tensor]]:
    """class name -> (its folder, transformers' logits of TOKENS [b, s, V])."""
    return dense.save_each(tmp_path_factory.mktemp("hf-gemma"), hf_model, MODELS, TOKENS)


# ---------------------------------------------------------------- in: the logits of transformers


def test_each_config_becomes_gemma_fields(saved):
    from fivecut.weights.load import source_of

    for name, (folder, _) in saved.items():
        args = source_of(f"hf:{folder}").args
        assert args.ffn_activation == "gelu_tanh" and args.sandwich_norms and args.scale_embeddings, name
        assert args.query_scale_dim == 24 and args.head_dim == 16 and args.tie_embeddings, name
        assert [args.layer_window(i) for i in range(2)] == [4, 0] and args.window_layers == "sf", name
    gemma3 = source_of(f"hf:{saved['Gemma3ForCausalLM'][0]}").args
    assert gemma3.qk_norm and not gemma3.qk_norm_whole and gemma3.attn_softcap == gemma3.logit_softcap == 0
    assert (gemma3.rope_theta, gemma3.rope_scaling, gemma3.rope_factor, gemma3.rope_local_theta) == (
        5e4,
        "linear",
        2.0,
        1e3,
    )
    assert [gemma3.layer_local_rope(i) for i in range(2)] == [True, False]
    gemma2 = source_of(f"hf:{saved['Gemma2ForCausalLM'][0]}").args
    assert (gemma2.attn_softcap, gemma2.logit_softcap, gemma2.rope_local_theta, gemma2.qk_norm) == (0.1, 0.5, 0, False)


def test_each_gemma_gives_its_logits_in_one_process(saved):
    dense.assert_each_gives_its_logits(saved, TOKENS)


LAYOUTS = {
    "tp=2,sp": ("parallel.tp=2", "parallel.sp=true"),
    "pp=2": ("parallel.pp=2", "parallel.microbatches=2"),
    "cp=2,ulysses": ("parallel.cp=2", 'parallel.cp_mode="ulysses"'),
}


@pytest.mark.multirank
@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_gemma_gives_its_logits_under_layout(saved, byte_cache, layout):
    """tp: the four norms on sequence slices, the capped logits of each vocabulary shard; pp: the sliding
    layer on stage 0, the global one (its own RoPE) on stage 1; cp: Ulysses' whole sequences per head."""
    dense.assert_each_gives_its_logits_under(saved, byte_cache, LAYOUTS[layout], TOKENS, layout)


# ---------------------------------------------------------------- fivecut verify under the cuts


@pytest.mark.multirank
@pytest.mark.parametrize(
    "name,layout",
    # Gemma 3 under ring attention: the sliding layer's band through the block pairs, the scores scaled by
    # query_pre_attn_scalar ** -0.5 in the ring's fused kernel
    [("Gemma2ForCausalLM", "tp=2,sp=true"), ("Gemma3ForCausalLM", "cp=2,cp_mode=ring")],
)
def test_verify_passes(saved, capsys, name, layout):
    """Gemma 2's capped attention and capped vocabulary-parallel loss; Gemma 3 under Ulysses."""
    dense.verify(capsys, saved[name][0], layout)


SWEEP = ["dp=2", "dp=2,zero=3", "tp=2", "tp=2,sp=true", "pp=2,microbatches=2", "cp=2,cp_mode=ulysses"]
SWEEP_RING = ["cp=2,cp_mode=ring", "cp=4,cp_mode=usp,cp_ulysses=2"]  # Gemma 3 only: Gemma 2's capped scores refused


@pytest.mark.sweep
@pytest.mark.multirank
@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("layout", SWEEP)
def test_verify_passes_on_each_gemma(saved, capsys, name, layout):
    dense.verify(capsys, saved[name][0], layout)


@pytest.mark.sweep
@pytest.mark.multirank
@pytest.mark.parametrize("layout", SWEEP_RING)
def test_verify_passes_on_gemma3_under_ring_attention(saved, capsys, layout):
    dense.verify(capsys, saved["Gemma3ForCausalLM"][0], layout)


@pytest.mark.sweep
@pytest.mark.multirank
@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_verify_passes_with_recomputation(saved, capsys, name, recompute):
    """Selective recomputation runs GeGLU's product again in backward (its GELU's own gradient)."""
    from fivecut.cli import main

    argv = ["verify", "--model", f"hf:{saved[name][0]}", "--layout", "tp=2,sp=true", "--steps", "2"]
    code = main([*argv, "--set", f'train.recompute="{recompute}"'])
    out = capsys.readouterr().out
    assert code == 0 and "PASS" in out, out


RATIOS = ("ratio", "memory_ratio", "activation_ratio", "loss_ratio")


SWEPT_LEDGER = [
    ("dp=2", ()), ("cp=2,cp_mode=ulysses", ()), ("tp=2", ('train.recompute="selective"',)),
    ("tp=2", ('train.recompute="full"',)), ("tp=2,sp=true", ('train.dtype="bf16"',)),
    ("tp=2", ("train.loss_chunk_tokens=0",)),
]  # fmt: skip


@pytest.mark.multirank
@pytest.mark.parametrize(
    "name,layout,sets",
    [("Gemma2ForCausalLM", "tp=2,sp=true", ())]
    + [pytest.param(name, layout, sets, marks=pytest.mark.sweep) for name in MODELS for layout, sets in SWEPT_LEDGER],
)
def test_ledger_measures_what_the_planner_predicts(saved, capsys, name, layout, sets):
    """Measured = predicted: the four norms' weights summed over tp, what the sandwich's second norms
    keep, Gemma 2's explicit capped core (its tanh, softmax and bool mask; no log-sum-exps) and capped
    loss chunk; Gemma 3's layer 1, the first to turn by the global RoPE tables, keeps them."""
    ratios = dense.ledger_ratios(capsys, saved[name][0], layout, *sets)
    assert {k: ratios.get(k) for k in RATIOS} == dict.fromkeys(RATIOS, "1.000"), ratios


# ---------------------------------------------------------------- out: trained, exported, read by transformers


def test_each_gemma_exports_to_itself_after_training(saved, byte_cache, tmp_path):
    """Each norm written back as Gemma's w (fivecut's scale less 1); the RoPE table per layer type."""
    dense.assert_each_exports_to_itself(saved, byte_cache, tmp_path, TOKENS)


def test_greedy_generation_equals_transformers(saved):
    """Through the KV cache: 14 positions, past the window of 4; the capped scores and logits."""
    dense.assert_greedy_generation_equals_transformers(saved, TOKENS[0, :6].tolist())


def test_check_import_passes(saved, capsys):
    from fivecut.cli import main

    for name, (folder, _) in saved.items():
        code = main(["check-import", f"hf:{folder}"])
        out = capsys.readouterr().out
        assert code == 0 and out.splitlines()[-1].startswith("PASS") and name in out, out


# ---------------------------------------------------------------- bad input: one line, exit 2, before any rank


def test_what_gemma_cannot_carry_is_refused_in_one_line(saved, tmp_path, capsys):
    from fivecut.cli import main

    gemma3, gemma2 = saved["Gemma3ForCausalLM"][0], saved["Gemma2ForCausalLM"][0]
    local_linear = ROPES | {"sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e3}}
    cases = {
        "describe Gemma 3's multimodal model (Gemma3ForConditionalGeneration)": dense.edited(
            gemma3, tmp_path / "vision", {"vision_config": {"model_type": "siglip_vision_model"}}
        ),
        "rope_parameters.sliding_attention.rope_type = 'linear' is not implemented": dense.edited(
            gemma3, tmp_path / "local-rope", {"rope_parameters": local_linear}
        ),
        "rope_type = 'dynamic' is not implemented; fivecut's RoPE is one of default, linear, llama3, yarn (Gemma 3's "
        "rope_parameters.full_attention)": dense.edited(
            gemma3, tmp_path / "dynamic", {"rope_parameters": ROPES | {"full_attention": {"rope_type": "dynamic"}}}
        ),
        "use_bidirectional_attention = True is not implemented": dense.edited(
            gemma3, tmp_path / "bidirectional", {"use_bidirectional_attention": True}
        ),
        "layer_types ['chunked_attention', 'full_attention'] is not implemented": dense.edited(
            gemma2, tmp_path / "types", {"layer_types": ["chunked_attention", "full_attention"]}
        ),
        "hidden_activation = 'gelu' is not implemented": dense.edited(
            gemma2, tmp_path / "gelu", {"hidden_activation": "gelu"}
        ),
        "rope_parameters.rope_type = 'longrope' is not implemented": dense.edited(
            gemma2, tmp_path / "longrope", {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}
        ),
    }
    dense.assert_refused_in_one_line(capsys, cases)
    for mode in ("ring", "usp"):
        code = main(["verify", "--model", f"hf:{gemma2}", "--layout", f"cp=2,cp_mode={mode}"])
        err = capsys.readouterr().err
        assert code == 2 and "attn_softcap=0.1" in err and "cannot soft-cap" in err, err


def test_other_classes_do_not_hold_gemma_fields(saved):
    from fivecut.model.args import ModelArgs
    from fivecut.model.transformer import build_model
    from fivecut.weights.architectures import ARCHITECTURES, for_args
    from fivecut.weights.load import source_of

    for name, (folder, _) in saved.items():
        args = source_of(f"hf:{folder}").args
        assert for_args(args).hf_class == name
        assert all(a.holds(args) is not None for n, a in ARCHITECTURES.items() if n != name), name
        model = build_model(args, "meta")  # the planner's count holds the four norms a block
        assert args.num_params() == sum(p.numel() for p in model.parameters()), name
    with pytest.raises(ValueError, match="ffn_activation 'gelu_tanh' with experts"):
        ModelArgs(n_experts=4, ffn_activation="gelu_tanh").check()
    with pytest.raises(ValueError, match=r"rope_local_theta \(1000.0\) turns the sliding layers"):
        ModelArgs(rope_local_theta=1e3).check()


def test_the_training_loss_is_transformers_loss(saved):
    """The loss head's chunks (5 tokens each) soft-cap their logits before the cross-entropy, as Gemma 2's
    logits are capped before transformers' loss: fivecut's mean token loss = transformers' `loss`."""
    import transformers

    from fivecut.parallel.loss import install_loss_head
    from fivecut.weights.load import single_model

    for name, (folder, _) in saved.items():
        theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        ours, _ = single_model(init_from=f"hf:{folder}")
        install_loss_head(ours, 5)
        with torch.no_grad():
            expected = theirs(TOKENS, labels=TOKENS).loss
            total = ours(TOKENS[:, :-1], targets=TOKENS[:, 1:])
        torch.testing.assert_close(total / TOKENS[:, 1:].numel(), expected, rtol=RTOL, atol=ATOL, msg=name)
