"""GPT-OSS (`GptOssForCausalLM`) in and out of Hugging Face: a tiny random model built by `transformers`
from `GptOssConfig` (no download) with every mechanism switched on -- attention sinks, a sliding layer
(window 5, shorter than the 16 tokens) and a full one, biases on q/k/v/o, the router and the experts, the
clamped SwiGLU (a limit of 1, which the products cross), YaRN with truncate = false -- saved in shards,
imported by fivecut under a layout, trained two steps, exported back and loaded by `transformers`; and its
experts quantized to MXFP4 in the published layout, imported equal to the dequantized model.

Routing ties: the router's weights are drawn with std 1 (logit gaps of order 1), as in test_hf_moe.
Sinks and biases are drawn at random (zeros would hide a missing one), norms away from ones.

Tolerances: fp32 logits (~1 in size) of a 2-layer model; fivecut and transformers differ in the order of
sums and in the attention kernel: 1e-5 absolute and relative, as tests/test_hf_moe.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from test_hf_dense import assert_greedy_generation_equals_transformers, ledger_ratios
from test_hf_moe import import_config, logits_of, train_each, verify

from fivecut.launch import spawn

RTOL = ATOL = 1e-5
VOCAB = 259  # >= 256 for the byte tokenizer; odd: tensor parallelism pads it
TOKENS = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))  # [b, s]; s > the window
ROPE = {
    "rope_type": "yarn",
    "rope_theta": 150000.0,
    "factor": 4.0,
    "beta_fast": 8.0,
    "beta_slow": 1.0,
    "truncate": False,  # GPT-OSS's: the ramp's ends at fractional channels
    "original_max_position_embeddings": 32,
}


def hf_config():
    import transformers

    return transformers.GptOssConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=32,  # a multiple of 32: the MXFP4 blocks of down_proj's rows
        num_hidden_layers=2,  # layer_types' default: layer 0 slides, layer 1 attends fully
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=5,
        max_position_embeddings=128,
        swiglu_limit=1.0,
        rope_parameters=ROPE,
    )


def hf_model():
    import transformers

    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(hf_config()).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif "router" in name:
                p.normal_(0, 1.0)
            else:
                p.normal_(0, 0.3 if name.endswith(("sinks", "bias")) else 0.1)
    return model


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory) -> tuple[Path, torch.Tensor]:
    """(the saved folder in 20 KB shards, transformers' logits of TOKENS)."""
    pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp("gpt_oss") / "hf"
    model = hf_model()
    model.save_pretrained(folder, max_shard_size="20KB")
    with torch.no_grad():
        return folder, model(TOKENS).logits


# ---------------------------------------------------------------- in


def test_the_config_becomes_gpt_oss_s_fields(gpt_oss):
    from fivecut.weights.load import source_args

    args = source_args(f"hf:{gpt_oss[0]}")
    assert (args.attention_sinks, args.qkv_bias, args.wo_bias, args.moe_bias) == (True,) * 4
    assert (args.window_layers, args.sliding_window, args.swiglu_limit) == ("sf", 5, 1.0)
    assert (args.rope_scaling, args.rope_truncate, args.gate, args.route_norm) == ("yarn", False, "softmax", True)


def test_gpt_oss_gives_transformers_logits_in_one_process(gpt_oss):
    from fivecut.weights.load import single_model

    folder, expected = gpt_oss
    model, _ = single_model(init_from=f"hf:{folder}")
    with torch.no_grad():
        torch.testing.assert_close(model(TOKENS), expected, rtol=RTOL, atol=ATOL)


def test_the_counts_are_the_module_s(gpt_oss):
    from fivecut.model.transformer import Transformer
    from fivecut.weights.load import source_args

    args = source_args(f"hf:{gpt_oss[0]}")
    with torch.device("meta"):
        model = Transformer(args)
    assert args.num_params() == sum(p.numel() for p in model.parameters())


def test_yarn_without_truncation_is_transformers_s(tmp_path):
    """GPT-OSS's published RoPE (YaRN, factor 32 over 4096 positions, truncate = false, 64-channel heads):
    fivecut's frequencies and attention factor are transformers', and rounding the ramp's ends (truncate
    true) would give others."""
    import dataclasses

    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from fivecut.model.transformer import rope_frequencies
    from fivecut.weights.hf import args_from_config

    config = transformers.GptOssConfig(num_hidden_layers=2, hidden_size=256, num_attention_heads=8, head_dim=64)
    raw = config.to_dict() | {"architectures": ["GptOssForCausalLM"]}
    args = args_from_config(raw, tmp_path / "config.json")
    theirs, factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    ours, our_factor = rope_frequencies(args)
    torch.testing.assert_close(ours.float(), theirs, rtol=1e-6, atol=0)
    assert our_factor == pytest.approx(factor)
    truncated, _ = rope_frequencies(dataclasses.replace(args, rope_truncate=True))
    assert not torch.allclose(truncated.float(), theirs, rtol=1e-4)


@pytest.mark.parametrize("masked", ["causal", "window", "documents"])
def test_sinks_on_the_fused_kernel_equal_the_written_out_scores(masked):
    """`SinkFlash` (the CPU's fused kernel and its log-sum-exp) against the scores written out, forward and
    every gradient, the sinks' included; grouped-query heads, causal, a window of 4, or documents kept apart."""
    from fivecut.model.documents import Documents
    from fivecut.model.transformer import CausalSDPA, band_mask, sink_attention_scores

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 12, 8, generator=g).requires_grad_() for h in (4, 2, 2))
    sinks = torch.randn(4, generator=g).requires_grad_()
    documents = Documents.of(torch.randint(0, 4, (2, 12), generator=g), 0) if masked == "documents" else None
    window = 4 if masked == "window" else 0
    at = torch.arange(12)
    mask = band_mask(12, 12, 0, window) if documents is None else documents.visible(at, at)  # [.., s, s]
    fused, written = CausalSDPA(window)(q, k, v, documents, sinks), sink_attention_scores(q, k, v, mask, sinks)
    torch.testing.assert_close(fused, written, rtol=1e-5, atol=1e-6)
    grad = torch.randn(fused.shape, generator=g)
    for a, b in zip(
        torch.autograd.grad(fused, (q, k, v, sinks), grad), torch.autograd.grad(written, (q, k, v, sinks), grad)
    ):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


LAYOUTS = {
    "dp=2,ep=2": ("parallel.dp=2", "parallel.ep=2"),
    "tp=2,etp=2": ("parallel.tp=2", "parallel.etp=2"),
    "tp=2": ("parallel.tp=2",),
    "pp=2": ("parallel.pp=2", "parallel.microbatches=2"),
    "cp=2": ("parallel.cp=2", 'parallel.cp_mode="ulysses"'),
}
RING = {"ring": ('parallel.cp_mode="ring"',), "usp": ('parallel.cp_mode="usp"', "parallel.cp_ulysses=2")}


@pytest.mark.multirank
def test_each_cut_gives_transformers_logits_in_one_spawn(gpt_oss, mxfp4, byte_cache):
    """The default suite's layouts, two ranks each, one spawn for all: experts cut (ep=2), expert and attention
    TP (tp=2,etp=2: the sinks cut with the heads, wo's bias added once, the down bias once over etp), Ulysses
    (the sinks cut with its heads); the MXFP4 checkpoint under ep=2; the sinks and the sliding layer's window
    under ring attention."""
    cases = {
        "dp=2,ep=2": (gpt_oss, LAYOUTS["dp=2,ep=2"]),
        "tp=2,etp=2": (gpt_oss, LAYOUTS["tp=2,etp=2"]),
        "cp=2 Ulysses": (gpt_oss, LAYOUTS["cp=2"]),
        "MXFP4 dp=2,ep=2": (mxfp4, LAYOUTS["dp=2,ep=2"]),
        "cp=2 ring": (gpt_oss, ("parallel.cp=2", *RING["ring"])),
    }
    configs = [import_config(byte_cache, folder, *layout) for (folder, _), layout in cases.values()]
    for rank, rank_logits in enumerate(spawn(logits_of, 2, configs, TOKENS)):
        for (name, ((_, expected), _)), got in zip(cases.items(), rank_logits):
            torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL, msg=f"{name} rank {rank}")


@pytest.mark.sweep
@pytest.mark.multirank
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gpt_oss_gives_transformers_logits_under_layout(gpt_oss, byte_cache, layout):
    folder, expected = gpt_oss
    cfg = import_config(byte_cache, folder, *LAYOUTS[layout])
    for rank, (got,) in enumerate(spawn(logits_of, cfg.parallel.world_size, [cfg], TOKENS)):
        torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL, msg=f"{layout} rank {rank}")


SWEEP_VERIFY = ("cp=2,cp_mode=ulysses", "dp=2,ep=2", "tp=2", "pp=2,microbatches=2")


@pytest.mark.multirank
@pytest.mark.parametrize(
    "layout", ["tp=2,etp=2", "cp=2,cp_mode=ring", *(pytest.param(k, marks=pytest.mark.sweep) for k in SWEEP_VERIFY)]
)
def test_verify_passes_on_gpt_oss(gpt_oss, layout, capsys):
    code, out = verify(capsys, gpt_oss[0], layout)
    assert code == 0 and "PASS" in out, out


@pytest.mark.sweep
@pytest.mark.multirank
@pytest.mark.parametrize("layout", ["tp=2,etp=2", "cp=2,cp_mode=ulysses"])
def test_ledger_measures_what_the_planner_predicts(gpt_oss, capsys, layout):
    """The wo bias's and the down bias's gradients all-reduced over tp and etp, the clamped SwiGLU's and the
    bias indices' activations, layer 1 (the one measured) full: no band kept. Exact."""
    ratios = ledger_ratios(capsys, gpt_oss[0], layout)
    assert ratios["ratio"] == ratios["memory_ratio"] == ratios["activation_ratio"] == "1.000", ratios


# ---------------------------------------------------------------- out


@pytest.mark.multirank
def test_an_export_after_training_gives_fivecut_logits_in_transformers(gpt_oss, tmp_path):
    """Two steps under dp=2,ep=2 (the experts written by two ranks), exported to GptOssForCausalLM (gate and up
    interleaved again), read by transformers with fivecut's logits, and back in."""
    import transformers

    from fivecut.weights.export import export
    from fivecut.weights.load import single_model

    steps = ("train.steps=2", "train.warmup=1", "parallel.dp=2", "parallel.ep=2")
    cfg = import_config(str(tmp_path / "cache"), gpt_oss[0], *steps, f'checkpoint.dir="{tmp_path}/ck"',
                        f'log.out_dir="{tmp_path}/out"')  # fmt: skip
    spawn(train_each, 2, [cfg])
    folder = export(tmp_path / "ck", tmp_path / "hf", max_shard_bytes=30_000)
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["GptOssForCausalLM"]
    ours, _ = single_model(checkpoint=str(tmp_path / "ck"))
    theirs = transformers.GptOssForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = ours(TOKENS)
        torch.testing.assert_close(theirs(TOKENS).logits, expected, rtol=RTOL, atol=ATOL)
        assert not torch.allclose(expected, gpt_oss[1], atol=1e-3)  # the weights moved
    again, _ = single_model(init_from=f"hf:{folder}")
    with torch.no_grad():
        torch.testing.assert_close(again(TOKENS), expected, rtol=RTOL, atol=ATOL)


def test_greedy_generation_equals_transformers_generate(gpt_oss):
    """14 positions through the cache, past the sliding layer's window of 5."""
    assert_greedy_generation_equals_transformers({"GptOssForCausalLM": gpt_oss}, TOKENS[0, :6].tolist())


# ---------------------------------------------------------------- MXFP4


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight [E, out, in] (the published layout's orientation) to MXFP4: blocks [E, out, in/32, 16] uint8
    and scales [E, out, in/32] uint8, each block's values rounded to the nearest FP4 code times 2^(scale-127),
    the scale the block's largest magnitude over 6 rounded up to a power of two."""
    from fivecut.weights.mxfp4 import FP4

    table = torch.tensor(FP4)
    e, out, width = weight.shape
    block = weight.reshape(e, out, width // 32, 32)
    exponent = torch.ceil(torch.log2(block.abs().amax(-1).clamp(min=1e-30) / 6)).clamp(-127, 127)  # [E, out, G]
    scaled = block / torch.exp2(exponent).unsqueeze(-1)  # [E, out, G, 32] within +-6
    codes = (scaled.unsqueeze(-1) - table).abs().argmin(-1).to(torch.uint8)  # [E, out, G, 32]
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)  # the low nibble first
    return blocks, (exponent + 127).to(torch.uint8)


@pytest.fixture(scope="module")
def mxfp4(tmp_path_factory) -> tuple[Path, torch.Tensor]:
    """The model's experts quantized into the published layout (config.json's quantization_config, the
    experts' `_blocks` and `_scales`), and the logits of transformers' model holding the dequantized weights
    (transformers' own dequantizer, `convert_moe_packed_tensors`)."""
    from safetensors.torch import save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    folder = tmp_path_factory.mktemp("gpt_oss_mxfp4") / "hf"
    model = hf_model()
    tensors = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("gate_up_proj", "down_proj")):
                blocks, scales = quantize(p.transpose(1, 2))  # [E, out, in]
                p.copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))  # [E, in, out]
                tensors |= {f"{name}_blocks": blocks, f"{name}_scales": scales}
            else:
                tensors[name] = p.detach().clone()
        expected = model(TOKENS).logits
    folder.mkdir()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = hf_config().to_dict() | {"architectures": ["GptOssForCausalLM"]}
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    (folder / "config.json").write_text(json.dumps(config))
    return folder, expected


def test_an_mxfp4_checkpoint_gives_its_dequantized_logits_in_one_process(mxfp4):
    from fivecut.weights.load import single_model

    folder, expected = mxfp4
    model, _ = single_model(init_from=f"hf:{folder}")
    with torch.no_grad():
        torch.testing.assert_close(model(TOKENS), expected, rtol=RTOL, atol=ATOL)


def test_an_mxfp4_box_reads_only_its_experts_rows_and_blocks():
    """A rank's box of gate (the even out rows) asks the files for its experts, its rows and the blocks of 32
    its in rows overlap, and dequantizes them as transformers does."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from fivecut.weights.mxfp4 import Mxfp4Experts

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (4, 12, 3, 16), dtype=torch.uint8, generator=g)  # [E, 2I, H/32, 16]
    scales = torch.randint(120, 130, (4, 12, 3), dtype=torch.uint8, generator=g)
    whole = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, H=96, 2I=12]
    asked = []

    def slice_of(name):
        tensor = blocks if name.endswith("_blocks") else scales

        class Recorded:
            def get_shape(self):
                return list(tensor.shape)

            def __getitem__(self, box):
                asked.append((name, box))
                return tensor[box]

        return Recorded()

    gate = Mxfp4Experts("gate_up_proj", 0)
    assert gate.shape(slice_of) == (4, 96, 6)
    box = gate.read(slice_of, (slice(2, 4), slice(40, 70), slice(1, 3)))
    torch.testing.assert_close(box, whole[2:4, 40:70, 2:6:2], rtol=0, atol=0)
    assert asked[-1] == ("gate_up_proj_scales", (slice(2, 4), slice(2, 6), slice(1, 3)))


# ---------------------------------------------------------------- bad input


def eval_exit(capsys, folder: Path) -> tuple[int, str]:
    from fivecut.cli import main

    code = main(["eval", "--init-from", f"hf:{folder}", "--set", 'data.tokenizer="byte"'])
    return code, capsys.readouterr().err


CONFIG_CASES = {  # config changes, what the error names
    "a lone expert": ({"num_experts_per_tok": 1}, "num_experts_per_tok = 1"),
    "a layer type not built": ({"layer_types": ["chunked_attention", "full_attention"]}, "layer_types"),
    "another quantization": ({"quantization_config": {"quant_method": "mxfp4", "swizzle": True}}, "swizzle"),
    "an unknown key": ({"attn_logit_softcapping": 30.0}, "attn_logit_softcapping = 30.0 is not implemented"),
}


@pytest.mark.parametrize("case", CONFIG_CASES)
def test_a_config_key_fivecut_does_not_implement_is_refused_by_name(gpt_oss, tmp_path, capsys, case):
    changes, needle = CONFIG_CASES[case]
    folder = tmp_path / "m"
    shutil.copytree(gpt_oss[0], folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | changes))
    code, err = eval_exit(capsys, folder)
    assert code == 2 and needle in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_check_import_passes(gpt_oss, mxfp4, capsys):
    """`fivecut check-import` on the folder and on its MXFP4 form (transformers dequantizes on its CPU)."""
    from fivecut.cli import main

    for folder, _ in (gpt_oss, mxfp4):
        code = main(["check-import", f"hf:{folder}"])
        out = capsys.readouterr().out
        assert code == 0 and "PASS" in out, out


# ---------------------------------------------------------------- sinks and windows under ring attention


@pytest.mark.sweep
@pytest.mark.multirank
@pytest.mark.parametrize("mode", ["ring", "usp"])
def test_sinks_under_ring_attention_give_transformers_logits(gpt_oss, byte_cache, mode):
    """The sink merged once after the ring's blocks, by log-sum-exp (USP: its heads cut by Ulysses first); the
    sliding layer's band cut through the block pairs."""
    folder, expected = gpt_oss
    cp = 2 if mode == "ring" else 4
    cfg = import_config(byte_cache, folder, f"parallel.cp={cp}", *RING[mode])
    for rank, (got,) in enumerate(spawn(logits_of, cp, [cfg], TOKENS)):
        torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL, msg=f"{mode} rank {rank}")


@pytest.mark.sweep
@pytest.mark.multirank
@pytest.mark.parametrize("layout", ["cp=2,cp_mode=ring", "cp=4,cp_mode=usp,cp_ulysses=2"])
def test_verify_passes_with_sinks_under_ring_attention(gpt_oss, layout, capsys):
    code, out = verify(capsys, gpt_oss[0], layout)
    assert code == 0 and "PASS" in out, out
