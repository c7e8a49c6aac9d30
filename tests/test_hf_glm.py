"""GLM-4.5 MoE (`Glm4MoeForCausalLM`) in and out of Hugging Face: a tiny random model built by
`transformers` from `Glm4MoeConfig` (3 layers, the first dense; 8 experts in 2 groups of which 1 is
chosen, top-2, a shared expert, routed_scaling_factor 2.5; partial rotary over half of each 16-channel
head; q/k/v biases; q/k norms; norms, biases and correction biases drawn at random, not at their init),
saved in shards, imported under each cut, trained two steps, exported and read back by transformers.

Routing ties: the router's weights are drawn with std 1 and the correction biases at random, as in
tests/test_hf_moe.py (whose helpers run the layouts). Tolerances: fp32 logits ~1 in size, 1e-5
absolute and relative.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from test_hf_moe import (
    ATOL,
    RTOL,
    TINY,
    TOKENS,
    eval_exit,
    import_config,
    logits_of,
    randomized,
    train_each,
    verify,
    with_config,
)  # fmt: skip

from fivecut.launch import spawn

CLASS = "Glm4MoeForCausalLM"


def glm_config(**changes):
    import transformers

    fields = TINY | dict(
        num_hidden_layers=3,
        num_key_value_heads=2,
        head_dim=16,  # wider than hidden / heads = 8, as GLM-4.5's 128 x 96 heads > 5120
        moe_intermediate_size=16,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        attention_bias=True,
        use_qk_norm=True,
        rms_norm_eps=1e-5,
    )
    return transformers.Glm4MoeConfig(**fields | changes)  # partial_rotary_factor: Glm4MoeConfig's 0.5 unless given


def save_glm(folder: Path, **changes) -> torch.Tensor:
    """The random model saved in shards of 20 KB; returns its logits of TOKENS."""
    import transformers

    torch.manual_seed(0)
    model = randomized(transformers.Glm4MoeForCausalLM(glm_config(**changes)).float().eval())
    model.save_pretrained(folder, max_shard_size="20KB")
    with torch.no_grad():
        return model(TOKENS).logits


@pytest.fixture(scope="module")
def glm(tmp_path_factory) -> tuple[Path, torch.Tensor]:
    pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp("hf_glm") / "glm"
    return folder, save_glm(folder)


def test_the_config_becomes_the_right_fields(glm):
    from fivecut.weights.load import source_args

    args = source_args(f"hf:{glm[0]}")
    assert (args.rope_partial_dim, args.head_dim, args.qkv_bias, args.qk_norm) == (8, 16, True, True)
    assert (args.gate, args.expert_groups, args.route_group_limit, args.route_scale) == ("sigmoid", 2, 1, 2.5)
    assert (args.n_experts, args.top_k, args.n_shared_experts, args.first_dense_layers) == (8, 2, 1, 1)


def test_a_file_without_partial_rotary_factor_turns_half_of_each_head(glm, tmp_path):
    """Glm4MoeConfig's default (0.5) where neither the file nor its RoPE table gives one."""
    from fivecut.weights.load import source_args

    bare = with_config(glm[0], tmp_path / "bare", rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    assert source_args(f"hf:{bare}").rope_partial_dim == 8


def test_logits_equal_transformers_in_one_process(glm):
    from fivecut.weights.load import single_model

    folder, expected = glm
    model, _ = single_model(init_from=f"hf:{folder}")
    with torch.no_grad():
        torch.testing.assert_close(model(TOKENS), expected, rtol=RTOL, atol=ATOL)


def test_every_channel_turning_and_no_biases_or_norms_import_too(tmp_path):
    """partial_rotary_factor 1.0 (written, or GLM's 0.5 applies), no attention bias, no q/k norms, no dense layer."""
    from fivecut.weights.load import single_model

    changes = dict(partial_rotary_factor=1.0, attention_bias=False, use_qk_norm=False, first_k_dense_replace=0)
    expected = save_glm(tmp_path / "m", **changes)
    model, _ = single_model(init_from=f"hf:{tmp_path / 'm'}")
    assert model.args.rope_dim == 16 and not model.args.qkv_bias and model.args.first_dense_layers == 0
    with torch.no_grad():
        torch.testing.assert_close(model(TOKENS), expected, rtol=RTOL, atol=ATOL)


def test_an_export_turning_every_channel_says_so_to_transformers(glm):
    """Glm4MoeConfig turns half of each head unless told: the written config.json says 1.0, in the table
    transformers reads (rope_scaling when there is one)."""
    import dataclasses

    import transformers

    from fivecut.weights.glm_architecture import glm4_moe_config
    from fivecut.weights.load import source_args

    args = source_args(f"hf:{glm[0]}")
    yarn = dict(rope_scaling="yarn", rope_factor=4.0, rope_original_context=32)
    for shape in (dataclasses.replace(args, rope_partial_dim=0), dataclasses.replace(args, rope_partial_dim=0, **yarn)):
        read = transformers.Glm4MoeConfig.from_dict(glm4_moe_config(shape)).rope_parameters
        assert read["partial_rotary_factor"] == 1.0, read


def test_multi_token_prediction_layers_are_left_unread(glm, tmp_path, capsys):
    """The published checkpoints hold num_nextn_predict_layers extra layers after the last one
    (model.layers.3.* here: eh_proj, enorm, hnorm, a decoder layer); transformers builds none and
    skips them, fivecut too; without num_nextn_predict_layers they are refused by name."""
    from safetensors.torch import save_file

    from fivecut.weights.load import single_model

    folder, expected = glm
    mtp = tmp_path / "mtp"
    shutil.copytree(folder, mtp)
    extra = {"model.layers.3.eh_proj.weight": torch.randn(32, 64), "model.layers.3.enorm.weight": torch.ones(32)}
    save_file(extra, str(mtp / "mtp.safetensors"), metadata={"format": "pt"})
    index = json.loads((mtp / "model.safetensors.index.json").read_text())
    index["weight_map"] |= dict.fromkeys(extra, "mtp.safetensors")
    (mtp / "model.safetensors.index.json").write_text(json.dumps(index))
    assert json.loads((mtp / "config.json").read_text())["num_nextn_predict_layers"] == 1
    model, _ = single_model(init_from=f"hf:{mtp}")
    with torch.no_grad():
        torch.testing.assert_close(model(TOKENS), expected, rtol=RTOL, atol=ATOL)
    code, err = eval_exit(capsys, with_config(mtp, tmp_path / "none", num_nextn_predict_layers=0))
    assert code == 2 and "tensor model.layers.3.eh_proj.weight has no place in a Glm4MoeForCausalLM" in err, err


LAYOUTS = {
    "dp=2,ep=2": ("parallel.dp=2", "parallel.ep=2"),
    "tp=2,etp=2": ("parallel.tp=2", "parallel.etp=2"),
    "tp=2": ("parallel.tp=2",),
    "pp=2": ("parallel.pp=2", "parallel.microbatches=2"),
    "cp=2,ulysses": ("parallel.cp=2", 'parallel.cp_mode="ulysses"'),
}
SWEEP_LAYOUTS = ("tp=2,etp=2", "tp=2", "pp=2", "cp=2,ulysses")  # ep=2 in the default suite (verify: tp=2,etp=2)


@pytest.mark.multirank
@pytest.mark.parametrize(
    "layout", [pytest.param(k, marks=pytest.mark.sweep) if k in SWEEP_LAYOUTS else k for k in LAYOUTS]
)
def test_logits_equal_transformers_under_layout(glm, byte_cache, layout):
    folder, expected = glm
    cfg = import_config(byte_cache, folder, *LAYOUTS[layout])
    for rank, (got,) in enumerate(spawn(logits_of, cfg.parallel.world_size, [cfg], TOKENS)):
        torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL, msg=f"{layout} rank {rank}")


VERIFY = ("dp=2,ep=2", "tp=2,etp=2", "tp=2", "pp=2,microbatches=2", "cp=2,cp_mode=ulysses", "cp=2,cp_mode=ring")


@pytest.mark.multirank
@pytest.mark.parametrize(
    "layout", [layout if layout == "tp=2,etp=2" else pytest.param(layout, marks=pytest.mark.sweep) for layout in VERIFY]
)
def test_verify_passes(glm, layout, capsys):
    code, out = verify(capsys, glm[0], layout)
    assert code == 0 and "PASS" in out, out


# ---------------------------------------------------------------- out: trained, exported, read by transformers


EXPORT_RUNS = {  # (layout of the two training steps, processes writing the export's shards)
    "one process": ((), 1),
    "dp=2,ep=2": (("parallel.dp=2", "parallel.ep=2"), 2),  # the experts' checkpoint written by two ranks
}


@pytest.mark.multirank
@pytest.mark.parametrize(
    "run", [k if k == "one process" else pytest.param(k, marks=pytest.mark.sweep) for k in EXPORT_RUNS]
)
def test_an_export_after_training_gives_fivecut_logits_in_transformers(glm, tmp_path_factory, run):
    """Trained two steps, exported as its own class (picked from the shape) in shards, read by transformers."""
    import transformers

    from fivecut.weights.export import export
    from fivecut.weights.load import single_model

    folder, before = glm
    layout, workers = EXPORT_RUNS[run]
    root = tmp_path_factory.mktemp("hf_glm_trained")
    cache = str(tmp_path_factory.getbasetemp() / "token-cache")
    steps = ("train.steps=2", "train.warmup=1", *layout)
    cfg = import_config(cache, folder, *steps, f'checkpoint.dir="{root}/ck"', f'log.out_dir="{root}"')
    spawn(train_each, cfg.parallel.world_size, [cfg])
    out = export(Path(cfg.checkpoint.dir), root / "hf", max_shard_bytes=30_000, workers=workers)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [CLASS] and config["rope_parameters"]["partial_rotary_factor"] == 0.5
    ours, _ = single_model(checkpoint=cfg.checkpoint.dir)
    theirs = transformers.Glm4MoeForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = ours(TOKENS)
        torch.testing.assert_close(theirs(TOKENS).logits, expected, rtol=RTOL, atol=ATOL)
    assert not torch.allclose(expected, before, atol=1e-3)  # trained: not the imported model
    again, _ = single_model(init_from=f"hf:{out}")  # and back in: the same model
    with torch.no_grad():
        torch.testing.assert_close(again(TOKENS), expected, rtol=RTOL, atol=ATOL)


def test_greedy_generation_equals_transformers_generate(glm):
    import transformers

    from fivecut.generate import generate_ids
    from fivecut.weights.load import single_model

    folder, _ = glm
    prompt = TOKENS[0, :5]
    model, _ = single_model(init_from=f"hf:{folder}")
    ours = generate_ids(model, prompt.tolist(), 10).new_ids
    theirs = transformers.Glm4MoeForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    theirs.generation_config.eos_token_id = None  # ten tokens whatever they are
    with torch.no_grad():
        out = theirs.generate(prompt.unsqueeze(0), max_new_tokens=10, do_sample=False, pad_token_id=0)
    assert ours == out[0, 5:].tolist()


def test_check_import_passes(glm, capsys):
    from fivecut.cli import main

    code = main(["check-import", f"hf:{glm[0]}"])
    out = capsys.readouterr().out
    assert code == 0 and CLASS in out and out.splitlines()[-1].startswith("PASS"), out


# ---------------------------------------------------------------- bad input: one line naming it, exit 2


CONFIG_CASES = {  # config changes, what the error names
    "another activation": ({"hidden_act": "gelu"}, "hidden_act = 'gelu' is not implemented"),
    "an unknown key": ({"sliding_window": 4}, "sliding_window = 4 is not implemented"),
    "no shared expert": ({"n_shared_experts": 0}, "n_shared_experts = 0 is not implemented"),
    "one expert a group": ({"n_group": 8, "topk_group": 2}, "n_group = 8 is not implemented"),
    "a rope not built": ({"rope_parameters": {"rope_type": "dynamic"}}, "rope_type = 'dynamic'"),
    "an odd partial rotary": (
        {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.0625}},
        "partial_rotary_factor = 0.0625 turns 1",
    ),
}


@pytest.mark.parametrize("case", CONFIG_CASES)
def test_a_config_key_fivecut_does_not_implement_is_refused_by_name(glm, tmp_path, capsys, case):
    changes, needle = CONFIG_CASES[case]
    code, err = eval_exit(capsys, with_config(glm[0], tmp_path / "m", **changes))
    assert code == 2 and needle in err and "config.json" in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_glm_s_shape_exports_as_glm_and_glm_holds_no_other_shape(glm):
    import dataclasses

    from fivecut.weights.architectures import ARCHITECTURES, for_args
    from fivecut.weights.load import source_args

    args = source_args(f"hf:{glm[0]}")
    assert for_args(args).hf_class == CLASS
    holds = ARCHITECTURES[CLASS].holds
    assert holds(dataclasses.replace(args, gate="softmax")) == "its router is not a sigmoid"
    assert holds(dataclasses.replace(args, n_shared_experts=0)) == "it has no shared expert"
    assert holds(dataclasses.replace(args, sliding_window=4)) == "its attention has a sliding window"


def test_check_import_layer_by_layer_reads_only_the_layers_it_checks(glm, capsys, monkeypatch):
    """A dense and a MoE layer (0 and 1) are checked; layer 2, a second MoE layer, is never read, by
    fivecut's reader or by transformers' loading, nor is the embedding or the head."""
    import transformers.core_model_loading as loading

    from fivecut.cli import main
    from fivecut.weights.hf import HFSource

    ours, theirs = [], []
    read, load = HFSource.read, loading.convert_and_load_state_dict_in_model

    def reading(self, name, box):
        ours.append(name)
        return read(self, name, box)

    def loading_layer(model, state_dict, load_config):
        theirs.extend(state_dict)
        return load(model=model, state_dict=state_dict, load_config=load_config)

    monkeypatch.setattr(HFSource, "read", reading)
    monkeypatch.setattr(loading, "convert_and_load_state_dict_in_model", loading_layer)
    code = main(["check-import", f"hf:{glm[0]}", "--layer-by-layer"])
    out = capsys.readouterr().out
    assert code == 0 and "layer 0 (dense, global attention)" in out and "layer 1 (MoE, global attention)" in out
    assert {name.split(".")[1] for name in ours} == {"0", "1"}, sorted(ours)
    assert {name.split(".")[2] for name in theirs} == {"0", "1"}, sorted(theirs)
    assert "layers.1.feed_forward.expert_bias" in ours and "model.layers.1.mlp.gate.e_score_correction_bias" in theirs


def test_glm_4_5_air_s_published_config_gives_its_published_sizes(tmp_path):
    """`fivecut plan --model config.json` reads GLM-4.5-Air's config.json as published (transformers 4.54's
    keys: a top-level partial_rotary_factor and rope_theta, num_nextn_predict_layers): 106B parameters,
    12B active besides the embedding and the head, half of each 128-channel head rotated."""
    from fivecut.weights.hf import args_from_config

    config = {
        "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "attention_bias": True,
        "attention_dropout": 0.0, "pad_token_id": 151329, "eos_token_id": [151329, 151336, 151338], "head_dim": 128,
        "hidden_act": "silu", "hidden_size": 4096, "partial_rotary_factor": 0.5, "initializer_range": 0.02,
        "intermediate_size": 10944, "max_position_embeddings": 131072, "num_attention_heads": 96,
        "num_hidden_layers": 46, "moe_intermediate_size": 1408, "norm_topk_prob": True, "num_experts_per_tok": 8,
        "n_group": 1, "n_shared_experts": 1, "n_routed_experts": 128, "routed_scaling_factor": 1.0, "topk_group": 1,
        "first_k_dense_replace": 1, "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_scaling": None,
        "rope_theta": 1000000, "num_nextn_predict_layers": 1, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "transformers_version": "4.54.0", "use_cache": True, "use_qk_norm": False, "vocab_size": 151552,
    }  # fmt: skip
    args = args_from_config(config, tmp_path / "config.json")
    tables = 2 * args.vocab_size * args.dim
    assert int(args.num_params() / 1e9) == 106 and int((args.num_active_params() - tables) / 1e9) == 12
    assert (args.rope_partial_dim, args.head_dim, args.rope_theta, args.qkv_bias) == (64, 128, 1e6, True)


@pytest.mark.sweep
def test_adapters_on_attention_and_experts_go_out_to_peft_and_merged(glm, byte_cache, tmp_path):
    """LoRA on the attention (biased q/k/v, wo) and on the routed experts, 3 steps, out as a peft adapter
    (peft loads it onto Glm4MoeForCausalLM) and merged: both give fivecut's logits (test_lora's helpers)."""
    import peft
    import transformers
    from test_lora import fivecut_logits, run_sets, train

    from fivecut.cli import main

    folder = glm[0]
    targets = 'lora.targets=["attention", "experts"]'
    train(run_sets(byte_cache, folder, tmp_path, targets))
    ours = fivecut_logits(byte_cache, folder, tmp_path, targets, tokens=TOKENS)
    ckpt = str(tmp_path / "ckpt")
    assert main(["export", "--checkpoint", ckpt, "--out", str(tmp_path / "adapter"), "--adapter"]) == 0
    assert main(["export", "--checkpoint", ckpt, "--out", str(tmp_path / "merged")]) == 0
    base = transformers.Glm4MoeForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        assert (ours - base(TOKENS).logits).abs().max() > 1e-3  # the adapters trained
    adapted = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    merged = transformers.Glm4MoeForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(adapted(TOKENS).logits, ours, rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(merged(TOKENS).logits, ours, rtol=RTOL, atol=ATOL)


@pytest.mark.sweep
def test_adapters_peft_would_misread_are_not_exported(glm, byte_cache, tmp_path, capsys):
    """peft 0.21 converts a GLM-4.5 adapter as transformers' qwen2_moe one, taking `mlp.gate_proj` (the dense
    layer's, the shared experts') for an expert's projection: an adapter on them loaded by peft gave logits
    0.88 away from fivecut's (measured with the refusal lifted), so the adapter export is refused naming the
    module; the merged export goes out."""
    from test_lora import run_sets, train

    from fivecut.cli import main

    train(run_sets(byte_cache, glm[0], tmp_path, 'lora.targets=["mlp", "shared_experts"]'))
    ckpt = str(tmp_path / "ckpt")
    capsys.readouterr()
    assert main(["export", "--checkpoint", ckpt, "--out", str(tmp_path / "adapter"), "--adapter"]) == 2
    err = capsys.readouterr().err
    assert "peft takes model.layers.0.mlp.down_proj of a glm4_moe model" in err, err
    assert main(["export", "--checkpoint", ckpt, "--out", str(tmp_path / "merged")]) == 0
