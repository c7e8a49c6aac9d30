"""Block-scaled fp8 checkpoints (DeepSeek-V3's format, also the "-FP8" Qwen releases) imported as
fp32: each quantized weight is its fp8 values times its block's factor (`weight_scale_inv`).

A tiny random DeepSeek-V3 and a tiny Llama from transformers are quantized here as DeepSeek
publishes (blocks of 8 x 8 at this size, e4m3, one float32 factor a block: amax / 448; the
embedding, head, norms and router left in full precision). The reference is transformers' model
holding the dequantized weights; fivecut reads the fp8 folder itself. Logits at the import
tolerance (1e-5: the weights are equal, only the order of operations differs), in one process and
under ep=2 for the experts and tp=2 for the dense model's rows and columns (each rank dequantizes
only the blocks its slice overlaps).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_import import import_config, logits_of

from fivecut.launch import spawn

TOL = dict(rtol=1e-5, atol=1e-5)
BLOCK = (8, 8)
FP8_MAX = 448.0  # float8_e4m3fn's largest value
QUANTIZATION = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(BLOCK), "activation_scheme": "dynamic"}
TOKENS = torch.randint(0, 259, (2, 16), generator=torch.Generator().manual_seed(5))


def quantized(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 values, factors [ceil(out/8), ceil(in/8)]) of a 2-D weight, a factor a block."""
    rows, cols = (-(-n // b) for n, b in zip(w.shape, BLOCK))
    padded = torch.zeros(rows * BLOCK[0], cols * BLOCK[1])
    padded[: w.shape[0], : w.shape[1]] = w
    blocks = padded.view(rows, BLOCK[0], cols, BLOCK[1])
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX  # [rows, cols]
    q = (blocks / scale[:, None, :, None]).view_as(padded)[: w.shape[0], : w.shape[1]]
    return q.to(torch.float8_e4m3fn), scale


def kept_whole(name: str, t: torch.Tensor) -> bool:
    return t.dim() != 2 or any(k in name for k in ("embed_tokens", "lm_head", "norm", "mlp.gate.weight"))


def save_fp8(model, folder: Path) -> torch.Tensor:
    """`model` saved quantized into `folder`; its weights replaced by their dequantized values;
    returns transformers' logits of TOKENS from those."""
    from safetensors.torch import save_file

    model.save_pretrained(folder)
    tensors = {}
    with torch.no_grad():
        for name, p in model.state_dict().items():
            if kept_whole(name, p):
                tensors[name] = p.contiguous()
                continue
            q, scale = quantized(p)
            tensors[name], tensors[name + "_scale_inv"] = q, scale
            blocks = scale.repeat_interleave(BLOCK[0], 0).repeat_interleave(BLOCK[1], 1)
            p.copy_(q.float() * blocks[: p.shape[0], : p.shape[1]])
        logits = model(TOKENS).logits
    for f in folder.glob("model*.safetensors*"):
        f.unlink()
    save_file(tensors, str(folder / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"quantization_config": QUANTIZATION}))
    return logits


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, tuple[Path, torch.Tensor]]:
    transformers = pytest.importorskip("transformers")
    from test_hf_moe import hf_config

    root = tmp_path_factory.mktemp("fp8")
    torch.manual_seed(0)
    deepseek = transformers.DeepseekV3ForCausalLM(hf_config("deepseek_v3")).float().eval()
    shape = dict(vocab_size=259, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape, intermediate_size=100)).float().eval()
    return {  # intermediate 100: the last block of each MLP weight is cut short
        "deepseek": (root / "deepseek", save_fp8(deepseek, root / "deepseek")),
        "llama": (root / "llama", save_fp8(llama, root / "llama")),
    }


@pytest.mark.parametrize("kind", ["deepseek", "llama"])
def test_an_fp8_folder_gives_the_dequantized_model_s_logits(folders, kind):
    from fivecut.weights.load import single_model

    folder, reference = folders[kind]
    model, _ = single_model(init_from=f"hf:{folder}")
    with torch.no_grad():
        torch.testing.assert_close(model(TOKENS), reference, **TOL)


@pytest.mark.multirank
@pytest.mark.parametrize(("kind", "layout"), [("deepseek", "parallel.ep=2"), ("llama", "parallel.tp=2")])
def test_each_rank_dequantizes_its_slice(folders, byte_cache, kind, layout):
    folder, reference = folders[kind]
    extra = ["parallel.dp=2"] if "ep" in layout else []
    cfg = import_config(byte_cache, folder, layout, *extra)
    logits = spawn(logits_of, 2, [cfg], TOKENS, timeout_s=240)[0][0]
    torch.testing.assert_close(logits, reference, **TOL)


def test_what_fivecut_cannot_dequantize_is_refused_naming_it(folders, tmp_path, capsys):
    import shutil

    from fivecut.cli import main

    source = folders["llama"][0]
    cases = {
        "quantization_config.quant_method = 'awq' is not implemented": {"quant_method": "awq"},
        "quantization_config.weight_block_size is [128]": {"weight_block_size": [128]},
        "quantization_config.ignored_layers is not implemented": {"ignored_layers": ["lm_head"]},
        "weight_scale_inv has shape (8, 8); blocks of [4, 8]": {"weight_block_size": [4, 8]},
    }
    for i, (needle, change) in enumerate(cases.items()):
        folder = tmp_path / str(i)
        shutil.copytree(source, folder)
        path = folder / "config.json"
        config = json.loads(path.read_text())
        path.write_text(json.dumps(config | {"quantization_config": config["quantization_config"] | change}))
        code = main(["eval", "--init-from", f"hf:{folder}", "--set", 'data.tokenizer="byte"'])
        err = capsys.readouterr().err
        assert code == 2 and needle in err and err.count("\n") == 1 and "Traceback" not in err, (needle, err)
    unscaled = tmp_path / "unscaled"
    shutil.copytree(source, unscaled)
    config = json.loads((unscaled / "config.json").read_text())
    del config["quantization_config"]
    (unscaled / "config.json").write_text(json.dumps(config))
    code = main(["eval", "--init-from", f"hf:{unscaled}", "--set", 'data.tokenizer="byte"'])
    err = capsys.readouterr().err
    assert code == 2 and "_scale_inv" in err and "Traceback" not in err, err


# DeepSeek-V3's published config.json (deepseek-ai/DeepSeek-V3), key for key
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config"}, "aux_loss_alpha": 0.001,
    "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 3, "hidden_act": "silu",
    "hidden_size": 7168, "initializer_range": 0.02, "intermediate_size": 18432, "kv_lora_rank": 512,
    "max_position_embeddings": 163840, "model_type": "deepseek_v3", "moe_intermediate_size": 2048, "moe_layer_freq": 1,
    "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1,
    "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06, "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                                            "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                                            "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
    "transformers_version": "4.33.1", "use_cache": True, "v_head_dim": 128, "vocab_size": 129280,
}  # fmt: skip


def test_deepseek_v3_s_published_config_is_read_whole():
    """Nothing in it is refused any more: its 671B parameters, YaRN over 4,096 -> 163,840 positions
    (latent attention's scores times mscale(40)^2), fp8 in 128 x 128 blocks."""
    from fivecut.weights.fp8 import fp8_blocks
    from fivecut.weights.moe_architectures import deepseek_v3_args

    path = Path("config.json")
    assert fp8_blocks(DEEPSEEK_V3, path) == (128, 128)
    args = deepseek_v3_args({k: v for k, v in DEEPSEEK_V3.items() if k != "quantization_config"}, path)
    assert round(args.num_params() / 1e9) == 671 and args.n_experts == 256 and args.first_dense_layers == 3
    assert (args.rope_scaling, args.rope_factor, args.rope_original_context) == ("yarn", 40, 4096)
    assert args.score_scale == pytest.approx((0.1 * torch.log(torch.tensor(40.0)).item() + 1) ** 2)
