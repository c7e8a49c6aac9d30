"""LoRA (`fivecut.model.lora`, `[lora]`): adapters on a published model's linear layers, the rest
frozen, in and out of `peft`.

A tiny random Llama built by `transformers` is imported, fine-tuned with adapters for a few steps
in fp32, and exported both ways: as a peft adapter folder, which `peft` loads onto the same
transformers model, and merged into the weights, which transformers loads alone. Both give the
logits of fivecut's own model, continued from the run's checkpoint (fp32; the differences are the
order of floating-point operations: 1e-5 as in tests/test_hf_dense.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_hf_dense import TOKENS, hf_model
from test_hf_moe import TOKENS as MOE_TOKENS
from test_hf_moe import save_hf as save_moe
from test_import import import_config, logits_of

from fivecut.cli import main
from fivecut.launch import spawn
from fivecut.plan.memory import step_moments

RTOL = ATOL = 1e-5
LORA = ("lora.rank=4", "lora.alpha=8.0")


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("lora") / "llama"
    hf_model("LlamaForCausalLM").save_pretrained(folder)
    return folder


def run_sets(byte_cache: str, folder: Path, out: Path, *extra: str) -> list[str]:
    """A 3-step fp32 fine-tune of `folder`'s model with adapters, saved under `out`."""
    return [
        f'model.init_from="hf:{folder}"', 'data.tokenizer="byte"', f'data.cache_dir="{byte_cache}"',
        "train.seq_len=32", "train.global_batch=8", "train.eval_every=0", "train.steps=3", "train.warmup=1",
        'train.dtype="fp32"', "train.lr=0.01", "log.progress=false", "log.plot=false", *LORA,
        f'checkpoint.dir="{out / "ckpt"}"', f'log.out_dir="{out / "log"}"', *extra,
    ]  # fmt: skip


def train(sets: list[str]) -> None:
    assert main(["train", *[x for s in sets for x in ("--set", s)]]) == 0


def fivecut_logits(byte_cache: str, folder: Path, out: Path, *extra: str, tokens=TOKENS) -> torch.Tensor:
    """fivecut's model with the run's adapters: its checkpoint as model.init_from, [lora] as the run's."""
    ckpt = next((out / "ckpt").glob("step-*"))
    cfg = import_config(byte_cache, folder, *LORA, f'model.init_from="dcp:{ckpt}"', 'train.dtype="fp32"', *extra)
    (logits,) = spawn(logits_of, 1, [cfg], tokens)
    return logits[0]


DENSE = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
         "mistral": "MistralForCausalLM"}  # fmt: skip
FAMILIES = {"smollm3": "SmolLM3ForCausalLM", "olmo2": "Olmo2ForCausalLM"}  # tests/test_hf_families.py's
GEMMA = {"gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}  # tests/test_hf_gemma.py's
# every kind of weight a class has, adapted
# (the dense MLP and shared experts of DeepSeek-V3: `test_an_adapter_peft_would_misread_is_not_exported`)
TARGETS = {"qwen3_moe": '["attention", "experts"]', "mixtral": '["attention", "experts"]',
           "deepseek_v3": '["attention", "experts"]'}  # fmt: skip
ZOO = [
    "llama",
    "qwen3_moe",
    *(
        pytest.param(kind, marks=pytest.mark.sweep)
        for kind in ("qwen2", "qwen3", "mistral", "smollm3", "olmo2", "gemma2", "gemma3", "mixtral", "deepseek_v3")
    ),
]


def zoo_model(kind: str, folder: Path) -> tuple[Path, torch.Tensor]:
    """A tiny random transformers model of `kind` saved to `folder`; the tokens to compare logits on."""
    if kind in DENSE:
        hf_model(DENSE[kind]).save_pretrained(folder)
        return folder, TOKENS
    if kind in FAMILIES:
        from test_hf_families import TOKENS as FAMILY_TOKENS
        from test_hf_families import hf_model as family_model

        family_model(FAMILIES[kind]).save_pretrained(folder)
        return folder, FAMILY_TOKENS
    if kind in GEMMA:
        import test_hf_gemma

        test_hf_gemma.hf_model(GEMMA[kind]).save_pretrained(folder)
        return folder, test_hf_gemma.TOKENS
    save_moe(kind, folder)
    return folder, MOE_TOKENS


@pytest.mark.parametrize("kind", ZOO)
def test_the_adapters_peft_loads_and_the_merged_model_give_fivecuts_logits(kind, byte_cache, tmp_path, capsys):
    """Every weight a class has adapted (attention with MLA's projections, dense MLPs, the routed
    experts through peft's target_parameters, the shared experts), 3 steps, out both ways."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    folder, tokens = zoo_model(kind, tmp_path / "hf")
    targets = "lora.targets=" + TARGETS.get(kind, '["attention", "mlp"]')
    train(run_sets(byte_cache, folder, tmp_path, targets))
    ours = fivecut_logits(byte_cache, folder, tmp_path, targets, tokens=tokens)
    base = transformers.AutoModelForCausalLM.from_pretrained(folder).float().eval()
    with torch.no_grad():
        before = base(tokens).logits
    assert (ours - before).abs().max() > 1e-3  # the adapters trained
    ckpt = str(tmp_path / "ckpt")
    assert main(["export", "--checkpoint", ckpt, "--out", str(tmp_path / "adapter"), "--adapter"]) == 0
    assert main(["export", "--checkpoint", ckpt, "--out", str(tmp_path / "merged")]) == 0
    adapted = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").float().eval()
    with torch.no_grad():
        torch.testing.assert_close(adapted(tokens).logits, ours, rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(merged(tokens).logits, ours, rtol=RTOL, atol=ATOL)


# ---------------------------------------------------------------- every cut carried, proven against one process


@pytest.mark.multirank
@pytest.mark.parametrize(
    "layout",
    [
        "dp=2",
        "dp=2,zero=1",
        "tp=2,sp=true",
        pytest.param("tp=2", marks=pytest.mark.sweep),
        pytest.param("dp=2,tp=2,zero=1", marks=pytest.mark.sweep),
        "pp=2,pp_schedule=zb1p,microbatches=4",
        pytest.param("pp=2,pp_schedule=1f1b,microbatches=2", marks=pytest.mark.sweep),
        pytest.param("pp=2,pp_schedule=dualpipev,microbatches=4", marks=pytest.mark.sweep),
        pytest.param("pp=2,pp_schedule=interleaved,pp_virtual=2,microbatches=2", marks=pytest.mark.sweep),
        pytest.param("dp=2,zero=2", marks=pytest.mark.sweep),
        pytest.param("dp=2,zero=3", marks=pytest.mark.sweep),
        pytest.param("cp=2,cp_mode=ring", marks=pytest.mark.sweep),
        pytest.param("dp=2,cp=2,cp_mode=ulysses,zero=2", marks=pytest.mark.sweep),
    ],
)
def test_verify_passes_with_adapters(layout, capsys):
    """fp32: losses and gradient norms of the adapters equal one process's (rtol 1e-5)."""
    assert (
        main(["verify", "--layout", layout, "--steps", "3", "--set", "lora.rank=4", "--set", 'train.dtype="fp32"']) == 0
    )
    assert "PASS" in capsys.readouterr().out


@pytest.mark.multirank
@pytest.mark.parametrize(
    "layout, dtype",
    [
        ("dp=2,zero=1", "fp32"),
        ("dp=2,zero=1", "bf16"),
        ("tp=2,sp=true", "fp32"),
        ("dp=2,tp=2", "bf16"),
        ("dp=2,zero=3", "bf16"),
        ("pp=2,tp=2,microbatches=2", "fp32"),  # each stage reduces its own blocks' adapters
        ("tp=2,etp=2 moe", "bf16"),  # the expert adapters' halves all-reduced over etp; the MoE output gathered in bf16
        pytest.param("dp=2,ep=2 moe", "bf16", marks=pytest.mark.sweep),
    ],
)
def test_the_ledger_counts_the_adapters_gradients_and_the_frozen_weights(layout, dtype, capsys):
    """Only the adapters' gradients are reduced (under tp the whole half of each, in its copy's
    dtype; a frozen embedding's region and frozen norms reduce nothing), and the model states are
    the adapters' (fp32 masters, gradients, Adam) plus the frozen weights in their dtype: the
    plan's exactly."""
    layout, _, moe = layout.partition(" ")
    sets = ["--set", "lora.rank=4", "--set", f'train.dtype="{dtype}"']
    if moe:
        sets += ["--model", "tiny-moe", "--set", 'lora.targets=["attention", "experts"]']
    assert main(["ledger", "--layout", layout, "--steps", "1", *sets]) == 0
    out = capsys.readouterr().out
    assert "\nratio=1.000" in out and "memory_ratio=1.000" in out, out


def adapted_and_plain(tokens: torch.Tensor) -> dict:
    """On one rank: tiny with adapters on attention and w2 under bf16, and without; what to check."""
    from fivecut.config import load_config
    from fivecut.layout import ParallelDims
    from fivecut.mesh import Mesh
    from fivecut.model.presets import get_preset
    from fivecut.parallel.parallelize import build_parallel

    cfg = load_config(None, ["lora.rank=4", 'lora.targets=["attention", "w2"]', 'train.dtype="bf16"'])
    mesh = Mesh(ParallelDims(), "cpu")
    plain = build_parallel(get_preset("tiny"), mesh, "cpu", 0, cfg.train)
    adapted = build_parallel(get_preset("tiny"), mesh, "cpu", 0, cfg.train, lora=cfg.lora)
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        logits = adapted.module(tokens), plain.module(tokens)
    params = dict(adapted.module.named_parameters())
    return {
        "logits": logits,
        "trained": sorted(n for n, p in params.items() if p.requires_grad),
        "frozen dtypes": {
            n.rsplit(".", 1)[0].split(".")[-1]: p.dtype for n, p in params.items() if not p.requires_grad
        },
        "optimized": all(piece.tensor.requires_grad for piece in adapted.pieces) and len(adapted.pieces) > 0,
    }


@pytest.mark.multirank
def test_adapters_start_as_the_model_and_only_they_train():
    """B starts at zero (the adapted model is the published one, here under bf16 autocast), the
    frozen weights have no gradient and stay out of the optimizer, the matmuls' held in bf16."""
    (got,) = spawn(adapted_and_plain, 1, torch.randint(0, 256, (2, 16)))
    torch.testing.assert_close(*got["logits"])
    assert got["trained"] and all(n.endswith(("lora_a", "lora_b")) for n in got["trained"])
    assert {n.rsplit(".", 2)[-2] for n in got["trained"]} == {"wq", "wk", "wv", "wo", "w2"}
    dtypes = got["frozen dtypes"]  # the matmuls' weights in bf16; norms and the embedding fp32
    assert {dtypes[m] for m in ("wq", "w1", "output")} == {torch.bfloat16} and got["optimized"]
    assert {dtypes[m] for m in ("attention_norm", "tok_embeddings")} == {torch.float32}


# ---------------------------------------------------------------- bad input: one line, exit 2, before any process


@pytest.mark.parametrize(
    "sets, said",
    [
        (["lora.rank=0"], "lora.rank=0 must be >= 1"),
        (["lora.rank=4", 'lora.targets=["qkv"]'], "lora.targets has 'qkv', neither a group"),
        (["lora.rank=4", 'lora.targets=["shared_experts"]'], "'shared_experts', which matches no weight"),
        (["lora.rank=500"], "lora.rank=500 exceeds the smaller side of"),
        (["lora.rank=4", 'lora.full=["bias"]'], "lora.full has 'bias'"),
        (["lora.rank=4", "lora.dropout=1.0"], "lora.dropout=1.0 must be in [0, 1)"),
        (["lora.rank=4", 'lora.targets=["experts"]'], "'experts', which matches no weight"),  # tiny is dense
        (
            ["lora.rank=4", 'lora.targets=["experts"]', 'lora.quantize="nf4"', 'model.preset="tiny-moe"'],
            "lora.quantize='nf4' quantizes linear layers, not the routed experts",
        ),
        (
            ["lora.rank=200", 'lora.targets=["experts"]', 'model.preset="tiny-moe"'],
            "lora.rank=200 exceeds the smaller side of layers.1.feed_forward.experts.w2",
        ),
    ],
)
def test_bad_lora_options_are_refused_in_one_line(sets, said, capsys):
    argv = ["train", *[x for s in ["train.steps=1", "train.warmup=0", *sets] for x in ("--set", s)]]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert said in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize(
    "layout, sets, said",
    [("tp=4", (), "lora on layers.0.attention.wk is not carried through tensor parallelism yet"),
     ("tp=2", ("lora.quantize=\"nf4\"",), "lora.quantize='nf4' is not carried through tensor parallelism yet")],
)  # fmt: skip
def test_a_layout_adapters_are_not_carried_through_yet_is_refused_by_name(layout, sets, said, capsys):
    """tp=4 with tiny's 2 kv heads keeps k and v whole on every rank."""
    flags = [x for s in ("lora.rank=4", *sets) for x in ("--set", s)]
    assert main(["verify", "--layout", layout, *flags]) == 2
    err = capsys.readouterr().err
    assert said in err and len(err.strip().splitlines()) == 1, err


EPLB = ("moe.eplb_slots=1", "moe.eplb_move=true", "moe.eplb_interval=2", "moe.eplb_window=2")


@pytest.mark.multirank
@pytest.mark.parametrize(
    "layout, extra",
    [
        ("dp=2,ep=2", ()),
        ("tp=2,etp=2", ()),
        pytest.param("dp=2,ep=2", EPLB, marks=pytest.mark.sweep),
        pytest.param("dp=2,ep=2,zero=3", (), marks=pytest.mark.sweep),
        pytest.param("dp=2,tp=2,sp=true,ep=2,etp=2", (), marks=pytest.mark.sweep),
        pytest.param("pp=2,pp_schedule=zb1p,microbatches=4", (), marks=pytest.mark.sweep),
    ],
)
def test_a_moe_models_adapters_under_its_expert_cuts(layout, extra, capsys):
    """Adapters on every expert (sliced with it by EP, cut on the hidden side by expert TP with the
    other half's gradient summed over etp -- caught: without the sum, grad norms off by 1e-3 --,
    sent with the EPLB copies -- caught: copies without them, losses off by 6e-4 from step 3 --)
    and on attention: losses and gradient norms equal one process's; the experts stay frozen."""
    sets = ["lora.rank=4", 'lora.targets=["attention", "experts"]', 'train.dtype="fp32"', *extra]
    steps = "6" if extra else "3"  # EPLB places copies after step 2
    flags = [x for s in sets for x in ("--set", s)]
    assert main(["verify", "--model", "tiny-moe", "--layout", layout, "--steps", steps, *flags]) == 0
    assert "PASS" in capsys.readouterr().out


@pytest.mark.parametrize(
    "model, layout, cluster",
    [("small", "dp=1", "1x1xH100"), ("tiny", "dp=2,zero=1", "1x2xH100"), ("tiny", "tp=2,sp=true", "1x2xH100"),
     ("small q v", "dp=1", "1x1xH100"), ("tiny-moe", "dp=2,ep=2", "1x2xH100"),
     ("tiny", "pp=2,microbatches=4", "1x2xH100"),
     pytest.param("tiny-moe experts", "dp=2,ep=2", "1x2xH100", marks=pytest.mark.sweep),
     pytest.param("tiny q v", "tp=2,sp=true", "1x2xH100", marks=pytest.mark.sweep)],
)  # fmt: skip
def test_the_plan_of_a_lora_run_is_its_steps_memory(model, layout, cluster):
    """The plan knows the frozen weights (their dtype, no gradient, no state, no bf16 copy), the
    adapters' states and copies, the frozen head's missing dW, and that a frozen linear without an
    adapter keeps no input (wq and wv only: 0.975 before, 0.999 after; tiny-moe's frozen router
    and shared experts: 0.925 before, 1.002 after; with expert adapters 1.009): the step on fake tensors agrees
    at the peak (1.000, 1.006, 1.026 when recorded; llama3-8b at 2 x 2048 tokens 0.999, and 1.000
    and 1.001 at the end of backward and the optimizer step), and one process's other moments
    (1.002, 1.002: the data cut's own moments differ at this size with or without adapters)."""
    from test_memory_check import planned_and_checked

    model, _, targets = model.partition(" ")
    sets = {"": (), "q v": ('lora.targets=["wq", "wv"]',), "experts": ('lora.targets=["attention", "experts"]',)}
    cost, check, _ = planned_and_checked(model, layout, cluster, 256, 4, "lora.rank=8", *sets[targets])
    within = 0.05 if layout.startswith("pp") else 0.03  # tiny at pp=2 reads 1.04 fully trained too
    assert check.peak == pytest.approx(cost.memory["total"], rel=within)
    if layout in ("dp=1", "pp=2,microbatches=4"):  # pp: the check read a frozen weight's meta shell, 0.62x
        planned = step_moments(cost.memory)
        moment = 0.05 if layout.startswith("pp") else 0.01
        assert all(check.moments[m] == pytest.approx(planned[m], rel=moment) for m in ("backward", "optimizer"))


def test_a_lora_checkpoint_is_refused_without_its_lora_and_exported_as_an_adapter_only_with_one(
    llama, byte_cache, tmp_path, capsys
):
    train(run_sets(byte_cache, llama, tmp_path))
    ckpt = next((tmp_path / "ckpt").glob("step-*"))
    sets = run_sets(byte_cache, llama, tmp_path / "again")[1:]  # the same run, from the checkpoint, without [lora]
    sets = [s for s in sets if not s.startswith("lora.")] + [f'model.init_from="dcp:{ckpt}"']
    assert main(["train", *[x for s in sets for x in ("--set", s)]]) == 2
    assert "holds adapters of rank 4" in capsys.readouterr().err
    plain = tmp_path / "plain"
    train([s for s in run_sets(byte_cache, llama, plain) if not s.startswith("lora.")])
    assert main(["export", "--checkpoint", str(plain / "ckpt"), "--out", str(tmp_path / "x"), "--adapter"]) == 2
    assert "holds no adapters" in capsys.readouterr().err


@pytest.mark.e2e
def test_the_smollm2_lora_chat_config_trains_adapters_and_exports_them_for_peft(tmp_path, monkeypatch):
    """configs/smollm2-lora-chat.toml as a user runs it (one step here), then `fivecut export
    --adapter`: rank 8 on the 7 projections of each of SmolLM2's 30 layers, the only tensors saved."""
    import json

    from test_chat import instruction_set, write_jsonl

    config = Path(__file__).resolve().parents[1] / "configs" / "smollm2-lora-chat.toml"
    monkeypatch.chdir(tmp_path)
    (tmp_path / "instructions").mkdir()
    write_jsonl(tmp_path / "instructions" / "chats.jsonl", instruction_set(400))
    sets = [f'data.cache_dir="{tmp_path / "cache"}"', "train.steps=1", "train.seq_len=64", "train.global_batch=2"]
    sets += ["train.eval_every=0", "train.warmup=0", "log.progress=false", "log.plot=false"]
    assert main(["train", "--config", str(config)] + [a for s in sets for a in ("--set", s)]) == 0
    ckpt = tmp_path / "runs" / "smollm2-lora-chat" / "checkpoints"
    assert main(["export", "--checkpoint", str(ckpt), "--out", str(tmp_path / "adapter"), "--adapter"]) == 0
    adapter = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert adapter["r"] == 8 and adapter["peft_type"] == "LORA" and len(adapter["target_modules"]) == 30 * 7
    assert "model.layers.29.mlp.down_proj" in adapter["target_modules"]


# ---------------------------------------------------------------- in: an adapter peft made


def peft_adapter(folder: Path, base: Path, tokens=TOKENS, **config) -> Path:
    """An adapter made by peft on `base`'s transformers model: A and B random (not peft's zero B),
    then a step of plain PyTorch, saved to `folder`."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(base).float()
    modules = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    settings = dict(r=4, lora_alpha=8, target_modules=modules, init_lora_weights=False) | config
    torch.manual_seed(3)
    adapted = peft.get_peft_model(model, peft.LoraConfig(**settings))
    optimizer = torch.optim.AdamW([p for p in adapted.parameters() if p.requires_grad], lr=1e-2)
    adapted(tokens, labels=tokens).loss.backward()
    optimizer.step()
    adapted.save_pretrained(folder)
    return folder


def test_an_adapter_peft_made_gives_pefts_logits_in_fivecut(llama, byte_cache, tmp_path):
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    folder = peft_adapter(tmp_path / "adapter", llama)
    cfg = import_config(byte_cache, llama, *LORA, f'lora.adapter="{folder}"', 'train.dtype="fp32"')
    (ours,) = spawn(logits_of, 1, [cfg], TOKENS)
    base = transformers.AutoModelForCausalLM.from_pretrained(llama).float()
    with torch.no_grad():
        theirs = peft.PeftModel.from_pretrained(base, folder).eval()(TOKENS).logits
    torch.testing.assert_close(ours[0], theirs, rtol=RTOL, atol=ATOL)


def test_an_adapter_peft_would_misread_is_not_exported(byte_cache, tmp_path, capsys):
    """peft 0.21 takes a DeepSeek-V3's `mlp.gate_proj` for a transformers-4 expert projection: the
    adapter export is refused in one line naming the module; the merged export still goes out."""
    folder, tokens = zoo_model("deepseek_v3", tmp_path / "hf")
    train(run_sets(byte_cache, folder, tmp_path, 'lora.targets=["attention", "mlp", "experts", "shared_experts"]'))
    ckpt = str(tmp_path / "ckpt")
    capsys.readouterr()
    assert main(["export", "--checkpoint", ckpt, "--out", str(tmp_path / "adapter"), "--adapter"]) == 2
    err = capsys.readouterr().err
    assert "peft takes model.layers.0.mlp.down_proj" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "adapter").exists()
    assert main(["export", "--checkpoint", ckpt, "--out", str(tmp_path / "merged")]) == 0


def test_a_moe_adapter_peft_made_on_the_experts_gives_pefts_logits_in_fivecut(byte_cache, tmp_path):
    """peft's target_parameters on the fused 3-D experts (gate_up_proj, down_proj; nested wrappers)
    read into fivecut's per-expert stacks: the logits peft's model gives."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    folder, tokens = zoo_model("qwen3_moe", tmp_path / "hf")
    experts = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    adapter = peft_adapter(tmp_path / "adapter", folder, MOE_TOKENS, target_modules=["q_proj", "o_proj"],
                           target_parameters=experts)  # fmt: skip
    targets = 'lora.targets=["wq", "wo", "experts"]'
    cfg = import_config(byte_cache, folder, *LORA, targets, f'lora.adapter="{adapter}"', 'train.dtype="fp32"')
    (ours,) = spawn(logits_of, 1, [cfg], tokens)
    base = transformers.AutoModelForCausalLM.from_pretrained(folder).float()
    with torch.no_grad():
        theirs = peft.PeftModel.from_pretrained(base, adapter).eval()(tokens).logits
    torch.testing.assert_close(ours[0], theirs, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize(
    "config, sets, said",
    [
        (dict(use_dora=True), (), "use_dora=True is not plain LoRA"),
        (dict(bias="all"), (), "bias='all' is not plain LoRA"),
        (dict(rank_pattern={"q_proj": 8}), (), "rank_pattern="),
        (dict(r=8), (), "r=8, lora_alpha=8; this run has lora.rank=4"),
        (dict(target_modules=["q_proj"]), (), "its target modules and lora.targets differ"),
        ({}, ("model.init_from=OTHER",), "an adapter for another model?"),
    ],
)
def test_an_adapter_fivecut_cannot_use_is_refused_in_one_line(config, sets, said, llama, byte_cache, tmp_path, capsys):
    folder = peft_adapter(tmp_path / "adapter", llama, **config)
    other = tmp_path / "qwen"
    if sets:  # the same adapter on another model: Qwen2 of another width
        transformers = pytest.importorskip("transformers")
        cfg = transformers.Qwen2Config(vocab_size=321, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
        transformers.Qwen2ForCausalLM(cfg).save_pretrained(other)
        sets = (f'model.init_from="hf:{other}"',)
    run = [s for s in run_sets(byte_cache, llama, tmp_path) if "init_from" not in s or not sets] + list(sets)
    run += [f'lora.adapter="{folder}"']
    capsys.readouterr()  # what making the adapter printed
    assert main(["train", *[x for s in run for x in ("--set", s)]]) == 2
    err = capsys.readouterr().err
    assert said in err and len(err.strip().splitlines()) == 1, err


# ---------------------------------------------------------------- QLoRA: the frozen base in NF4


@pytest.mark.multirank
def test_qlora_trains_the_same_on_two_ranks_as_on_one(capsys):
    """The adapted layers' frozen weights in NF4 (torchao), the adapters fp32: dp=2 gives one
    process's losses and gradient norms (fp32 compute over the dequantized weights)."""
    sets = ["--set", "lora.rank=4", "--set", 'lora.quantize="nf4"', "--set", 'train.dtype="fp32"']
    assert main(["verify", "--layout", "dp=2,zero=1", "--steps", "3", *sets]) == 0
    assert "PASS" in capsys.readouterr().out


@pytest.mark.multirank
def test_qlora_holds_its_base_in_about_a_quarter_of_bf16(capsys):
    """The ledger's measured model states equal the plan's with the NF4 weights counted exactly
    (`nf4_bytes`), and those weights take at most 0.3 of their bf16 bytes."""
    from fivecut.model.lora import nf4_bytes

    sets = ["--set", "lora.rank=4", "--set", 'lora.quantize="nf4"']
    assert main(["ledger", "--layout", "dp=2", "--steps", "1", *sets]) == 0
    out = capsys.readouterr().out
    assert "memory_ratio=1.000" in out, out
    assert nf4_bytes(576 * 1536) <= 0.3 * 2 * 576 * 1536  # SmolLM2's MLP weight


def test_a_resume_over_another_base_model_is_refused_naming_both(llama, byte_cache, tmp_path, capsys):
    """The checkpoint holds the adapters only and records its base's fingerprint: the same folder
    saved again with other weights is another model, and the resume says so before it starts."""
    folder = tmp_path / "base"
    hf_model("LlamaForCausalLM").save_pretrained(folder)
    sets = run_sets(byte_cache, folder, tmp_path)
    train(sets)
    train([s for s in sets if not s.startswith("train.steps")] + ["train.steps=4"])  # the same base: resumed
    hf_model("LlamaForCausalLM", seed=1).save_pretrained(folder)  # another model in the same place
    capsys.readouterr()
    longer = [s for s in sets if not s.startswith("train.steps")] + ["train.steps=5"]
    assert main(["train", *[x for s in longer for x in ("--set", s)]]) == 2
    err = capsys.readouterr().err
    assert "its adapters trained over hf:" in err and "is another model now" in err, err


# ---------------------------------------------------------------- weights trained whole: peft's modules_to_save


@pytest.fixture(scope="module")
def untied(tmp_path_factory) -> Path:
    """A tiny Llama whose head is its own weight (peft cannot keep a tied head's copy)."""
    transformers = pytest.importorskip("transformers")
    from test_hf_dense import COMMON

    folder = tmp_path_factory.mktemp("lora-untied") / "llama"
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON, tie_word_embeddings=False)).save_pretrained(folder)
    return folder


def test_weights_trained_whole_go_out_and_in_as_pefts_modules_to_save(untied, byte_cache, tmp_path):
    """lora.full = ["norms", "head"]: the export lists each norm and the head by its full path in
    modules_to_save with its trained weight; peft's model gives fivecut's logits; the folder read
    back as lora.adapter gives them again."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    full = 'lora.full=["norms", "head"]'
    train(run_sets(byte_cache, untied, tmp_path, full))
    ours = fivecut_logits(byte_cache, untied, tmp_path, full)
    assert main(["export", "--checkpoint", str(tmp_path / "ckpt"), "--out", str(tmp_path / "a"), "--adapter"]) == 0
    base = transformers.AutoModelForCausalLM.from_pretrained(untied).float()
    with torch.no_grad():
        theirs = peft.PeftModel.from_pretrained(base, tmp_path / "a").eval()(TOKENS).logits
    torch.testing.assert_close(theirs, ours, rtol=RTOL, atol=ATOL)
    cfg = import_config(byte_cache, untied, *LORA, full, f'lora.adapter="{tmp_path / "a"}"', 'train.dtype="fp32"')
    (again,) = spawn(logits_of, 1, [cfg], TOKENS)
    torch.testing.assert_close(again[0], ours, rtol=RTOL, atol=ATOL)


@pytest.mark.multirank
@pytest.mark.sweep
def test_expert_adapters_reshard_between_expert_layouts(byte_cache, tmp_path):
    """A checkpoint of adapters on every expert saved under dp=2 x ep=2 x tp=2 x etp=2 (stacks cut
    by expert and by hidden size) loads into one process and saves again bit for bit, and the run
    continues from it as under the first layout."""
    import copy

    import numpy as np
    from test_checkpoint import RTOL, config, full_state, resave, run, world

    from fivecut.train import checkpoint

    lora = ("lora.rank=4", 'lora.targets=["attention", "experts"]', 'train.dtype="fp32"')
    saved_under = ("parallel.dp=2", "parallel.ep=2", "parallel.tp=2", "parallel.etp=2", "parallel.sp=true", *lora)
    a = config(byte_cache, tmp_path, saved_under, "tiny-moe", steps=8, dir=str(tmp_path / "a"), every=4)
    b = config(byte_cache, tmp_path, lora, "tiny-moe", steps=8)
    under_a = spawn(run, world(a), a)[0]
    source = checkpoint.step_dir(tmp_path / "a", 4)
    spawn(resave, 1, copy.deepcopy(b), str(source), str(tmp_path / "b"))
    saved, loaded = (
        full_state(source, tmp_path / "a.pt"),
        full_state(checkpoint.step_dir(tmp_path / "b", 4), tmp_path / "b.pt"),
    )
    assert saved.keys() == loaded.keys() and any(k.endswith("experts.w13_lora_a") for k in saved)
    for key in saved:
        assert torch.equal(saved[key], loaded[key]), key
    resumed = spawn(run, 1, b, str(source))[0]
    np.testing.assert_allclose(resumed[0], under_a[0][4:], rtol=RTOL)
