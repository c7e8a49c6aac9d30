"""Mixtral, Qwen3-MoE and DeepSeek-V3 in and out of Hugging Face: a tiny random model of each,
built by `transformers` from its config class (no download), saved in shards, imported by fivecut
under a layout, trained two steps, exported back to its class and loaded by `transformers`.

Routing ties: the routers' weights are drawn with std 1 (logit gaps of order 1), so that the top-k
choice is the same whatever the order of the floating-point sums of a layout; DeepSeek-V3's
correction biases are random, so that selection (biased) and weights (unbiased) are told apart.

Tolerances: fp32 logits of 2-layer models, ~1 in size; fivecut and transformers differ in the
order of sums and in the attention kernel: 1e-5 absolute and relative, as tests/test_import.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from fivecut.config import load_config
from fivecut.launch import spawn

RTOL = ATOL = 1e-5
VOCAB = 259  # >= 256 for the byte tokenizer the runs read Shakespeare with; odd: tensor parallelism pads it
# [b, s]: s divides by tp (the MoE layers of a tp rank run on its slice of the sequence)
TOKENS = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
KINDS = ("mixtral", "qwen3_moe", "deepseek_v3")
CLASSES = {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}


# what every tiny MoE config here shares (test_hf_glm's too)
TINY = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_attention_heads=4,
    max_position_embeddings=128,
    tie_word_embeddings=False,
)


def hf_config(kind: str):
    """A tiny config of `kind`: 2 layers, 4 or 8 experts, top-2; Mixtral with a sliding window of 5;
    Qwen3-MoE and DeepSeek-V3 with a first dense layer, Qwen3-MoE with heads wider than hidden /
    heads, DeepSeek-V3 with 4 groups of which 2 are chosen and interleaved RoPE rows."""
    import transformers

    common = TINY | dict(num_hidden_layers=2)
    if kind == "mixtral":
        window = dict(sliding_window=5)  # each position sees itself and the 4 before it, on every layer
        return transformers.MixtralConfig(
            **common, **window, num_key_value_heads=2, num_local_experts=4, rms_norm_eps=1e-5
        )
    if kind == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            **common,
            num_key_value_heads=2,
            head_dim=16,  # wider than hidden / heads = 8, as Qwen3-30B-A3B's 128 x 32 heads > 2048
            moe_intermediate_size=24,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=False,
            mlp_only_layers=[0],
        )
    return transformers.DeepseekV3Config(
        **common,
        num_key_value_heads=4,
        moe_intermediate_size=16,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        first_k_dense_replace=1,
        n_shared_experts=1,
        routed_scaling_factor=2.5,
        kv_lora_rank=16,
        q_lora_rank=24,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=12,
    )


def hf_class(kind: str):
    import transformers

    return getattr(transformers, CLASSES[kind])


def randomized(model):
    """Every parameter and correction bias of a transformers model drawn away from its init, the routers'
    with std 1 (see the module's note on ties); returns the model."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # norms of ones would hide two norms swapped
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0, 1.0 if name.endswith("mlp.gate.weight") else 0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.rand_like(b))
    return model


def save_hf(kind: str, folder: Path) -> torch.Tensor:
    """A random model of `kind` saved in shards of 20 KB (with the index); returns its logits of TOKENS."""
    torch.manual_seed(0)
    model = randomized(hf_class(kind)(hf_config(kind)).float().eval())
    model.save_pretrained(folder, max_shard_size="20KB")
    with torch.no_grad():
        return model(TOKENS).logits


@pytest.fixture(scope="module")
def hf_moes(tmp_path_factory):
    """kind -> (folder, transformers' logits of TOKENS)."""
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("hf_moe")
    return {kind: (root / kind, save_hf(kind, root / kind)) for kind in KINDS}


def test_each_class_is_saved_per_expert_with_an_index(hf_moes):
    """What the readers expect of transformers 5: one tensor per expert and projection, sharded."""
    folder = hf_moes["mixtral"][0]
    names = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in names
    assert (
        "model.layers.1.mlp.experts.7.down_proj.weight"
        in json.loads((hf_moes["deepseek_v3"][0] / "model.safetensors.index.json").read_text())["weight_map"]
    )


def test_each_class_gives_transformers_logits_in_one_process(hf_moes):
    from fivecut.weights.load import single_model

    for kind, (folder, expected) in hf_moes.items():
        model, _ = single_model(init_from=f"hf:{folder}")
        with torch.no_grad():
            torch.testing.assert_close(model(TOKENS), expected, rtol=RTOL, atol=ATOL, msg=kind)


def test_a_fused_expert_folder_reads_the_same(hf_moes, tmp_path):
    """The in-memory form (gate_up_proj [E, 2I, H], down_proj [E, H, I]) read in place of experts one by one."""
    from safetensors.torch import save_file

    from fivecut.weights.load import single_model

    source, expected = hf_moes["qwen3_moe"]
    model = hf_class("qwen3_moe").from_pretrained(source, dtype=torch.float32)
    folder = tmp_path / "fused"
    folder.mkdir()
    shutil.copy(source / "config.json", folder / "config.json")
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / "model.safetensors"))
    got, _ = single_model(init_from=f"hf:{folder}")
    with torch.no_grad():
        torch.testing.assert_close(got(TOKENS), expected, rtol=RTOL, atol=ATOL)


def import_config(cache: str, folder, *overrides: str):
    base = [
        f'model.init_from="hf:{folder}"',
        'data.tokenizer="byte"',
        f'data.cache_dir="{cache}"',
        "train.seq_len=32",
        "train.global_batch=4",
        "train.eval_every=0",
        "log.progress=false",
        "log.plot=false",
    ]
    return load_config(None, base + list(overrides))


def logits_of(configs, tokens) -> list[torch.Tensor]:
    from fivecut.train.infer import full_logits
    from fivecut.train.run import setup

    return [full_logits(setup(cfg), tokens) for cfg in configs]


LAYOUTS = {
    "dp=2,ep=2": ("parallel.dp=2", "parallel.ep=2"),
    "tp=2,etp=2": ("parallel.tp=2", "parallel.etp=2"),
    "tp=2": ("parallel.tp=2",),
    "pp=2": ("parallel.pp=2", "parallel.microbatches=2"),
}
SWEEP_LAYOUTS = ("tp=2", "pp=2")  # the expert cuts run in the default suite


@pytest.mark.multirank
@pytest.mark.parametrize(
    "layout", [pytest.param(k, marks=pytest.mark.sweep) if k in SWEEP_LAYOUTS else k for k in LAYOUTS]
)
def test_each_class_gives_transformers_logits_under_layout(hf_moes, byte_cache, layout):
    configs = [import_config(byte_cache, folder, *LAYOUTS[layout]) for folder, _ in hf_moes.values()]
    for rank, rank_logits in enumerate(spawn(logits_of, configs[0].parallel.world_size, configs, TOKENS)):
        for (kind, (_, expected)), got in zip(hf_moes.items(), rank_logits):
            torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL, msg=f"{layout} rank {rank}, {kind}")


def verify(capsys, folder: Path, layout: str) -> tuple[int, str]:
    from fivecut.cli import main

    argv = ["verify", "--model", f"hf:{folder}", "--layout", layout, "--steps", "2", "--set", "train.seq_len=32"]
    code = main(argv)
    return code, capsys.readouterr().out


DEFAULT_VERIFY = ("deepseek_v3", "dp=2,ep=2")
VERIFY_CASES = [
    DEFAULT_VERIFY,
    *[
        pytest.param(kind, layout, marks=pytest.mark.sweep)
        for kind in KINDS
        for layout in LAYOUTS
        if (kind, layout) != DEFAULT_VERIFY
    ],
]


@pytest.mark.multirank
@pytest.mark.parametrize(("kind", "layout"), VERIFY_CASES)
def test_verify_passes_on_an_imported_model(hf_moes, kind, layout, capsys):
    code, out = verify(capsys, hf_moes[kind][0], layout)
    assert code == 0 and "PASS" in out, out


# ---------------------------------------------------------------- out: trained, exported, read by transformers


def train_each(configs) -> None:
    from fivecut.train.trainer import train

    for cfg in configs:
        train(cfg, quiet=True, resume="never")


@pytest.fixture(scope="module")
def exports(hf_moes, tmp_path_factory):
    """kind -> (checkpoint folder, export folder): each model trained two steps under dp=2,ep=2
    (its checkpoint's experts written by two ranks), then exported to its own class, the class
    picked from the model's shape."""
    from fivecut.weights.export import export

    root = tmp_path_factory.mktemp("hf_moe_trained")
    cache = str(tmp_path_factory.getbasetemp() / "token-cache")
    steps = ("train.steps=2", "train.warmup=1", "parallel.dp=2", "parallel.ep=2")
    configs = {
        kind: import_config(cache, folder, *steps, f'checkpoint.dir="{root / kind}/ck"', f'log.out_dir="{root / kind}"')
        for kind, (folder, _) in hf_moes.items()
    }
    spawn(train_each, 2, list(configs.values()))
    checkpoints = {kind: Path(cfg.checkpoint.dir) for kind, cfg in configs.items()}
    workers = {"deepseek_v3": 2}  # its shards written by two processes
    return {
        kind: (ck, export(ck, root / kind / "hf", max_shard_bytes=30_000, workers=workers.get(kind, 1)))
        for kind, ck in checkpoints.items()
    }


@pytest.mark.multirank
def test_an_export_after_training_gives_fivecut_logits_in_transformers(exports):
    from fivecut.weights.load import single_model

    for kind, (checkpoint, folder) in exports.items():
        config = json.loads((folder / "config.json").read_text())
        assert config["architectures"] == [CLASSES[kind]], config
        assert (folder / "model.safetensors.index.json").is_file()  # sharded at 30 KB
        ours, _ = single_model(checkpoint=str(checkpoint))
        theirs = hf_class(kind).from_pretrained(folder, dtype=torch.float32).eval()
        with torch.no_grad():
            expected = ours(TOKENS)
            torch.testing.assert_close(theirs(TOKENS).logits, expected, rtol=RTOL, atol=ATOL, msg=kind)
        again, _ = single_model(init_from=f"hf:{folder}")  # and back in: the same model
        with torch.no_grad():
            torch.testing.assert_close(again(TOKENS), expected, rtol=RTOL, atol=ATOL, msg=f"{kind} re-imported")


def test_greedy_generation_equals_transformers_generate(hf_moes):
    from fivecut.generate import generate_ids
    from fivecut.weights.load import single_model

    prompt = TOKENS[0, :5]
    for kind, (folder, _) in hf_moes.items():
        model, _ = single_model(init_from=f"hf:{folder}")
        ours = generate_ids(model, prompt.tolist(), 10).new_ids
        theirs = hf_class(kind).from_pretrained(folder, dtype=torch.float32).eval()
        theirs.generation_config.eos_token_id = None  # ten tokens whatever they are
        with torch.no_grad():
            out = theirs.generate(prompt.unsqueeze(0), max_new_tokens=10, do_sample=False, pad_token_id=0)
        assert ours == out[0, 5:].tolist(), kind


# ---------------------------------------------------------------- bad input: one line naming it, exit 2


def eval_exit(capsys, folder: Path) -> tuple[int, str]:
    from fivecut.cli import main

    code = main(["eval", "--init-from", f"hf:{folder}", "--set", 'data.tokenizer="byte"'])
    return code, capsys.readouterr().err


def with_config(src: Path, dst: Path, **changes) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(config | changes))
    return dst


CONFIG_CASES = {  # kind, config changes, what the error names
    "an unknown key": ("mixtral", {"attn_logit_softcapping": 30.0}, "attn_logit_softcapping = 30.0 is not implemented"),
    "scaled rope": ("deepseek_v3", {"rope_parameters": {"rope_type": "dynamic"}}, "rope_type = 'dynamic'"),
    "a sliding window": ("qwen3_moe", {"use_sliding_window": True}, "use_sliding_window = True"),
    "sparse steps": ("qwen3_moe", {"decoder_sparse_step": 2}, "decoder_sparse_step = 2"),
    "dense layers not first": ("qwen3_moe", {"mlp_only_layers": [1]}, "mlp_only_layers = [1]"),
    "a lone softmax expert": ("mixtral", {"num_experts_per_tok": 1}, "num_experts_per_tok = 1"),
    "another score": ("deepseek_v3", {"scoring_func": "softmax"}, "scoring_func = 'softmax'"),
    "fp8 weights": ("deepseek_v3", {"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
}


@pytest.mark.parametrize("case", CONFIG_CASES)
def test_a_config_key_fivecut_does_not_implement_is_refused_by_name(hf_moes, tmp_path, capsys, case):
    kind, changes, needle = CONFIG_CASES[case]
    code, err = eval_exit(capsys, with_config(hf_moes[kind][0], tmp_path / "m", **changes))
    assert code == 2 and needle in err and "config.json" in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_a_missing_tensor_or_shard_is_refused_naming_it(hf_moes, tmp_path, capsys):
    source = hf_moes["deepseek_v3"][0]
    index = json.loads((source / "model.safetensors.index.json").read_text())
    shard = index["weight_map"]["model.layers.1.mlp.experts.5.up_proj.weight"]
    gone = tmp_path / "gone"
    shutil.copytree(source, gone)
    (gone / shard).unlink()
    code, err = eval_exit(capsys, gone)
    assert code == 2 and f"is in {shard}, which does not exist" in err, err
    lacking = tmp_path / "lacking"
    shutil.copytree(source, lacking)
    del index["weight_map"]["model.layers.1.mlp.experts.5.up_proj.weight"]
    (lacking / "model.safetensors.index.json").write_text(json.dumps(index))
    code, err = eval_exit(capsys, lacking)
    assert code == 2 and "lacks tensor model.layers.1.mlp.experts.5.up_proj.weight of its DeepseekV3" in err, err


def test_an_expert_of_another_shape_is_refused_naming_it(hf_moes, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "odd"
    shutil.copytree(hf_moes["mixtral"][0], folder)
    name = "model.layers.0.block_sparse_moe.experts.2.w1.weight"
    file = folder / json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"][name]
    tensors = load_file(file)
    tensors[name] = tensors[name][:-1]
    save_file(tensors, str(file), metadata={"format": "pt"})
    code, err = eval_exit(capsys, folder)
    assert code == 2 and f"expert tensor {name} has shape (47, 32)" in err, err


def test_an_expert_parallel_rank_reads_only_its_experts():
    """The reader of stacked experts asks the files for the experts of the box only."""
    from fivecut.weights.moe_architectures import PerExpert

    asked = []

    def slice_of(name):
        asked.append(name)
        return torch.full((6, 4), float(name[-1]))  # [out, in] of expert int(name[-1])

    stored = PerExpert(tuple(f"w.{e}" for e in range(8)))
    box = stored.read(slice_of, (slice(4, 8), slice(0, 4), slice(0, 3)))  # the second of 2 ep ranks
    assert asked == ["w.4", "w.5", "w.6", "w.7"] and box.shape == (4, 4, 3)
    assert box[:, 0, 0].tolist() == [4.0, 5.0, 6.0, 7.0]


def test_the_counts_of_each_imported_shape_are_its_modules(hf_moes):
    """The planner's analytic counts hold for the new fields too (qk_norm's two norms per layer)."""
    from fivecut.model.transformer import Transformer
    from fivecut.weights.load import source_args

    for kind, (folder, _) in hf_moes.items():
        args = source_args(f"hf:{folder}")
        with torch.device("meta"):
            model = Transformer(args)
        assert args.num_params() == sum(p.numel() for p in model.parameters()), kind
        assert args.qk_norm == (kind == "qwen3_moe") and args.route_norm == (kind != "qwen3_moe"), kind


@pytest.mark.multirank
def test_routing_biases_moved_by_balancing_keep_fivecut_s_own_export(hf_moes, byte_cache, tmp_path, capsys):
    """Mixtral has no routing biases: a model trained with auxiliary-loss-free balancing is not one
    (written as fivecut's own; naming the class is refused with the reason)."""
    from fivecut.weights.export import ExportError, export

    steps = ("train.steps=2", "train.warmup=1", "moe.bias_update_rate=0.01")
    cfg = import_config(byte_cache, hf_moes["mixtral"][0], *steps, f'checkpoint.dir="{tmp_path}/ck"')
    spawn(train_each, 1, [cfg])
    folder = export(tmp_path / "ck", tmp_path / "hf")
    assert json.loads((folder / "config.json").read_text())["model_type"] == "fivecut"
    assert "MixtralForCausalLM has none: exported as fivecut's own MoE model" in capsys.readouterr().out
    with pytest.raises(ExportError, match="--architecture MixtralForCausalLM cannot hold this model: routing biases"):
        export(tmp_path / "ck", tmp_path / "named", architecture="MixtralForCausalLM")
    assert not (tmp_path / "named").exists()


def experts_read(cfg) -> list[str]:
    """On a rank: the Hugging Face expert tensors its import opened."""
    from fivecut.train.run import setup
    from fivecut.weights import moe_architectures

    asked, read = [], moe_architectures.PerExpert.read

    def recording(self, slice_of, box):
        asked.extend(self.names[box[0]])
        return read(self, slice_of, box)

    moe_architectures.PerExpert.read = recording
    setup(cfg)
    return sorted(set(asked))


@pytest.mark.multirank
def test_under_expert_parallelism_each_rank_reads_only_its_experts(hf_moes, byte_cache):
    cfg = import_config(byte_cache, hf_moes["qwen3_moe"][0], "parallel.dp=2", "parallel.ep=2")
    for rank, names in enumerate(spawn(experts_read, 2, cfg)):
        experts = {int(name.split(".")[5]) for name in names}
        assert experts == set(range(4 * rank, 4 * rank + 4)) and len(names) == 4 * 3, (rank, names)


def test_mixtral_8x7b_s_config_gives_its_published_sizes(tmp_path):
    """`fivecut plan --model config.json` reads MoE configs: Mixtral-8x7B-v0.1, 46.7B parameters, 12.9B active."""
    from fivecut.weights.hf import args_from_config

    config = {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "attention_dropout": 0.0, "bos_token_id": 1,
        "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
        "intermediate_size": 14336, "max_position_embeddings": 32768, "num_attention_heads": 32,
        "num_experts_per_tok": 2, "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8,
        "output_router_logits": False, "rms_norm_eps": 1e-05, "rope_theta": 1e6, "router_aux_loss_coef": 0.02,
        "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "transformers_version": "4.36.0.dev0", "use_cache": True, "vocab_size": 32000,
    }  # fmt: skip
    args = args_from_config(config, tmp_path / "config.json")
    assert round(args.num_params() / 1e9, 1) == 46.7 and round(args.num_active_params() / 1e9, 1) == 12.9


def test_a_deepseek_v3_whose_norms_eps_is_not_the_latent_norms_imports_and_exports(tmp_path):
    """transformers builds DeepSeek-V3's latent norms (q_a, kv_a) with eps 1e-6 whatever rms_norm_eps
    says; fivecut carries the two apart (ModelArgs.latent_norm_eps). A large rms_norm_eps (0.05) makes
    a mix-up of the two visible far above the tolerance. The export's config.json, read back by
    transformers with the same tensors, is the same model."""
    from fivecut.weights.architectures import for_args
    from fivecut.weights.hf import hf_config as fivecut_config
    from fivecut.weights.load import single_model

    config = hf_config("deepseek_v3")
    config.rms_norm_eps = 0.05
    torch.manual_seed(0)
    model = hf_class("deepseek_v3")(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
        expected = model(TOKENS).logits
    model.save_pretrained(tmp_path / "in")
    ours, _ = single_model(init_from=f"hf:{tmp_path / 'in'}")
    assert ours.args.norm_eps == 0.05 and ours.args.latent_eps == 1e-6
    with torch.no_grad():
        torch.testing.assert_close(ours(TOKENS), expected, rtol=RTOL, atol=ATOL)
    arch = for_args(ours.args)
    assert arch.hf_class == "DeepseekV3ForCausalLM"
    shutil.copytree(tmp_path / "in", tmp_path / "out")
    written = fivecut_config(arch, ours.args, "float32", None, None)
    (tmp_path / "out" / "config.json").write_text(json.dumps(written))
    assert written["rms_norm_eps"] == 0.05
    back = hf_class("deepseek_v3").from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(back(TOKENS).logits, expected, rtol=RTOL, atol=ATOL)
