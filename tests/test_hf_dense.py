"""The dense Hugging Face classes in and out: Llama, Mistral (sliding window), Qwen2 (q/k/v biases,
a window on the later layers), Qwen3 (per-head q/k norms, its own head_dim).

Each model is a tiny random one built by `transformers` from its config class (no download), its
norms and biases drawn at random (ones and zeros would hide a swap or a missing bias), saved in
several safetensors shards with an index. Sequences are longer than the windows, so a window that
is wrong or missing changes the logits.

Tolerances: fp32 logits of a 2-layer model (values ~0.1-1); fivecut and transformers differ only
in the order of floating-point operations (attention kernel, RoPE, norms): 1e-5 absolute and
relative, as in tests/test_import.py.
"""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path

import pytest
import torch
from test_import import import_config, logits_of

from fivecut.launch import spawn

RTOL = ATOL = 1e-5
VOCAB = 321  # odd: tensor parallelism pads it; >= 256: the byte tokenizer's ids fit
TOKENS = torch.randint(0, VOCAB, (2, 13), generator=torch.Generator().manual_seed(1))  # [b, s]; s > the windows
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
)
# class -> (config class, the architecture's own keys)
MODELS = {
    "LlamaForCausalLM": ("LlamaConfig", dict(tie_word_embeddings=True)),
    "MistralForCausalLM": ("MistralConfig", dict(sliding_window=5)),
    "Qwen2ForCausalLM": ("Qwen2Config", dict(use_sliding_window=True, sliding_window=4, max_window_layers=1)),
    "Qwen3ForCausalLM": ("Qwen3Config", dict(head_dim=24)),  # 4 x 24 != 64: a head size of its own
}


def hf_model(name: str, seed: int = 0):
    """A random `name` model of transformers, fp32, eval mode, norms and biases not at their init.
    (transformers is imported here, not at the top: spawned ranks import this module.)"""
    transformers = pytest.importorskip("transformers")
    config_class, own = MODELS[name]
    config = getattr(transformers, config_class)(**COMMON, **own)
    torch.manual_seed(seed)
    model = getattr(transformers, name)(config).float().eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif pname.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
    return model


def save_hf(folder: Path, name: str) -> torch.Tensor:
    """A random `name` model saved in shards with an index; returns its logits of TOKENS [b, s, V]."""
    model = hf_model(name)
    model.save_pretrained(folder, max_shard_size="60KB")
    assert (folder / "model.safetensors.index.json").is_file()
    with torch.no_grad():
        return model(TOKENS).logits


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, tuple[Path, torch.Tensor]]:
    """class name -> (its folder, transformers' logits of TOKENS)."""
    root = tmp_path_factory.mktemp("hf-dense")
    return {name: (root / name, save_hf(root / name, name)) for name in MODELS}


# ---------------------------------------------------------------- in: the logits of transformers


def test_each_class_gives_its_logits_in_one_process(saved):
    assert_each_gives_its_logits(saved, TOKENS)


def assert_each_gives_its_logits(saved: dict, tokens: torch.Tensor) -> None:
    """fivecut's import of each saved folder, one process: transformers' logits of `tokens` (fp32, 1e-5)."""
    from fivecut.weights.load import single_model

    for name, (folder, expected) in saved.items():
        model, _ = single_model(init_from=f"hf:{folder}")
        with torch.no_grad():
            torch.testing.assert_close(model(tokens), expected, rtol=RTOL, atol=ATOL, msg=name)


def test_the_config_becomes_the_right_fields(saved):
    from fivecut.weights.load import source_of

    args = {name: source_of(f"hf:{folder}").args for name, (folder, _) in saved.items()}
    assert args["LlamaForCausalLM"].tie_embeddings and not args["LlamaForCausalLM"].has_window
    assert [args["MistralForCausalLM"].layer_window(i) for i in range(2)] == [5, 5]
    qwen2 = args["Qwen2ForCausalLM"]
    assert qwen2.qkv_bias and [qwen2.layer_window(i) for i in range(2)] == [0, 4]
    qwen3 = args["Qwen3ForCausalLM"]
    assert qwen3.qk_norm and qwen3.head_dim == 24 and not qwen3.qkv_bias


LAYOUTS = {
    "tp=2": ("parallel.tp=2",),
    "pp=2": ("parallel.pp=2", "parallel.microbatches=2"),
}


@pytest.mark.multirank
@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_class_gives_its_logits_under_layout(saved, byte_cache, layout):
    """Each rank reads its slices (tp: rows of q/k/v, their biases, columns of o; pp: its layers)."""
    configs = [import_config(byte_cache, folder, *LAYOUTS[layout]) for folder, _ in saved.values()]
    for rank, rank_logits in enumerate(spawn(logits_of, 2, configs, TOKENS)):
        for (name, (_, expected)), got in zip(saved.items(), rank_logits):
            torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL, msg=f"{layout} rank {rank}, {name}")


# ---------------------------------------------------------------- the fields under tensor parallelism

# every new field at once: q/k/v biases, q/k norms, a head size of its own, a window on layer 1 (of 32 tokens)
VARIANTS = dict(vocab_size=VOCAB, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, max_seq_len=64)
VARIANTS |= dict(qkv_bias=True, qk_norm=True, attention_head_dim=24, sliding_window=6, full_attention_layers=1)


@pytest.mark.multirank
@pytest.mark.parametrize("tp,sp", [(2, True), (4, False)])  # tp=4 > 2 kv heads: k, v (and their biases) replicated
def test_forward_and_every_gradient_match_single_device(tp, sp):
    """Biases cut with their rows (or replicated with the kv heads), q/k norm weights' gradients summed over tp."""
    from test_tensor import assert_tp_step_matches_one_process

    from fivecut.model.args import ModelArgs

    assert_tp_step_matches_one_process(ModelArgs(**VARIANTS), tp, sp)


# ---------------------------------------------------------------- verify on imported models


def verify(capsys, folder: Path, layout: str) -> str:
    from fivecut.cli import main

    code = main(["verify", "--model", f"hf:{folder}", "--layout", layout, "--steps", "2"])
    out = capsys.readouterr().out
    assert code == 0 and "PASS" in out, out
    return out


@pytest.mark.multirank
def test_verify_passes_on_qwen3_under_tp(saved, capsys):
    """The per-head q/k norms: each tp rank applies them to its heads, their gradients summed over tp."""
    verify(capsys, saved["Qwen3ForCausalLM"][0], "tp=2")


@pytest.mark.sweep
@pytest.mark.multirank
@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("layout", ["tp=2", "pp=2,microbatches=2", "tp=2,sp=true", "cp=2,cp_mode=ulysses"])
def test_verify_passes_on_each_class(saved, capsys, name, layout):
    verify(capsys, saved[name][0], layout)


def ledger_ratios(capsys, folder: Path, layout: str, *sets: str) -> dict[str, str]:
    """`fivecut ledger`'s ratios (name -> its printed value) of the folder's model under `layout`, each
    of `sets` (SECTION.KEY=VALUE) set."""
    from fivecut.cli import main

    argv = ["ledger", "--model", f"hf:{folder}", "--layout", layout, "--steps", "1"]
    code = main([*argv, *(arg for s in sets for arg in ("--set", s))])
    out = capsys.readouterr().out
    assert code == 0, out
    return dict(
        re.fullmatch(r"(\w*ratio)=(\S+)", line).groups()
        for line in out.splitlines()
        if re.fullmatch(r"\w*ratio=\S+", line)
    )


@pytest.mark.multirank
def test_ledger_measures_what_the_planner_predicts_for_qwen2(saved, capsys):
    """Bytes of every cut, model state and the activations a block keeps (q/k/v biases, the window's
    mask on layer 1, the one the ledger measures), measured = predicted under tp=2 with SP."""
    ratios = ledger_ratios(capsys, saved["Qwen2ForCausalLM"][0], "tp=2,sp=true")
    assert {k: ratios.get(k) for k in ("ratio", "memory_ratio", "activation_ratio")} == dict.fromkeys(
        ("ratio", "memory_ratio", "activation_ratio"), "1.000"
    ), ratios


@pytest.mark.sweep
@pytest.mark.multirank
@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("layout", ["dp=2", "tp=2", "cp=2,cp_mode=ulysses"])
def test_ledger_measures_what_the_planner_predicts(saved, capsys, name, layout):
    ratios = ledger_ratios(capsys, saved[name][0], layout)
    assert ratios["ratio"] == ratios["memory_ratio"] == ratios["activation_ratio"] == "1.000", ratios


@pytest.mark.multirank
def test_ring_attention_cuts_the_window_s_band_through_its_block_pairs(saved, capsys):
    """Mistral's window of 5 under cp=2 ring attention: each K/V block pair masked by the band (`PairMask`)."""
    from fivecut.cli import main

    code = main(["verify", "--model", f"hf:{saved['MistralForCausalLM'][0]}", "--layout", "cp=2,cp_mode=ring"])
    out = capsys.readouterr().out
    assert code == 0 and "PASS" in out, out


# ---------------------------------------------------------------- out: trained, exported, read by transformers


@contextlib.contextmanager
def one_rank():
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def train_two_steps(cache: str, folder: Path, work: Path) -> Path:
    """Two optimizer steps from the imported model; its checkpoint.dir."""
    from fivecut.train.trainer import train

    cfg = import_config(
        cache,
        folder,
        "train.steps=2",
        "train.warmup=1",
        "train.global_batch=2",
        "checkpoint.every=2",
        f'checkpoint.dir="{work / "ck"}"',
        f'log.out_dir="{work / "out"}"',
    )
    torch.set_num_threads(1)
    with one_rank():
        train(cfg, quiet=True, resume="never")
    return work / "ck"


def test_each_class_exports_to_itself_after_training(saved, byte_cache, tmp_path):
    """The export is read by the class it came from, and gives the trained model's logits; the weights
    moved (the export is not the import)."""
    assert_each_exports_to_itself(saved, byte_cache, tmp_path, TOKENS)


def test_a_mistral_without_a_window_goes_back_out_a_mistral(byte_cache, tmp_path, capsys):
    """Llama holds its shape too, but the class it was imported from is the one written; when that
    class cannot be read any more (its folder gone), the first class that holds it, said in a note."""
    import shutil

    import transformers

    from fivecut.weights import export as ex
    from fivecut.weights.load import single_model

    folder = tmp_path / "mistral"
    config = transformers.MistralConfig(**COMMON, sliding_window=None)
    torch.manual_seed(0)
    transformers.MistralForCausalLM(config).float().eval().save_pretrained(folder)
    ck = train_two_steps(byte_cache, folder, tmp_path / "run")
    out = ex.export(ck, tmp_path / "hf")
    assert json.loads((out / "config.json").read_text())["architectures"] == ["MistralForCausalLM"]
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(theirs).__name__ == "MistralForCausalLM" and theirs.config.sliding_window is None
    ours, _ = single_model(checkpoint=str(ck))
    with torch.no_grad():
        difference = (theirs(TOKENS).logits - ours(TOKENS)).abs().max().item()
    assert difference < ATOL, difference
    shutil.rmtree(folder)
    capsys.readouterr()
    again = ex.export(ck, tmp_path / "hf-again")
    assert json.loads((again / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    note = capsys.readouterr().out
    assert f"note: the class of model.init_from 'hf:{folder}' is unknown" in note and "--architecture" in note, note


@pytest.mark.sweep
def test_shards_written_by_two_processes_are_the_same_files(saved, byte_cache, tmp_path):
    """--workers 2: each process reads only its shards' tensors from DCP; the folder is byte for byte
    the one process's."""
    from fivecut.weights import export as ex

    ck = train_two_steps(byte_cache, saved["Qwen2ForCausalLM"][0], tmp_path)
    one = ex.export(ck, tmp_path / "hf-1", max_shard_bytes=100_000)
    two = ex.export(ck, tmp_path / "hf-2", max_shard_bytes=100_000, workers=2)
    files = sorted(p.name for p in one.iterdir())
    assert files == sorted(p.name for p in two.iterdir()) and len(files) > 5
    assert all((one / f).read_bytes() == (two / f).read_bytes() for f in files)


# ---------------------------------------------------------------- greedy generation


def test_greedy_generation_equals_transformers(saved):
    """14 positions through the cache: past the windows of Mistral (5) and Qwen2's layer 1 (4)."""
    assert_greedy_generation_equals_transformers(saved, TOKENS[0, :6].tolist())


def assert_greedy_generation_equals_transformers(saved: dict, prompt: list[int]) -> None:
    """8 greedy tokens after `prompt` from each saved folder: fivecut's KV cache = transformers' generate."""
    import transformers

    from fivecut.generate import Sampling, generate_ids
    from fivecut.weights.load import single_model

    for name, (folder, _) in saved.items():
        ours, _ = single_model(init_from=f"hf:{folder}")
        theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        expected = theirs.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None)
        got = generate_ids(ours, prompt, 8, Sampling(temperature=0.0), eot_id=None).new_ids
        assert got == expected[0, len(prompt) :].tolist(), name


# ---------------------------------------------------------------- the tokenizer and its chat template


def test_the_tokenizer_carries_its_chat_template(saved, tmp_path):
    import shutil

    from tokenizers import Tokenizer, models

    from fivecut.weights.load import source_of

    folder = tmp_path / "with-tokenizer"
    shutil.copytree(saved["Qwen2ForCausalLM"][0], folder)
    Tokenizer(models.WordLevel({"[UNK]": 0, "hi": 1}, unk_token="[UNK]")).save(str(folder / "tokenizer.json"))
    template = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    assert source_of(f"hf:{folder}").tokenizer().chat_template == template


# ---------------------------------------------------------------- bad input: one line, exit 2, before any rank


def edited(src: Path, dst: Path, config: dict | None = None, drop: str | None = None) -> str:
    """A copy of the folder `src` with `config` merged into its config.json, or tensor `drop` dropped from its index."""
    import shutil

    shutil.copytree(src, dst)
    if config is not None:
        path = dst / "config.json"
        path.write_text(json.dumps(json.loads(path.read_text()) | config))
    if drop is not None:
        path = dst / "model.safetensors.index.json"
        index = json.loads(path.read_text())
        del index["weight_map"][drop]
        path.write_text(json.dumps(index))
    return f"hf:{dst}"


def test_bad_folders_are_refused_in_one_line(saved, tmp_path, capsys):
    from fivecut.cli import main

    qwen2, qwen3 = saved["Qwen2ForCausalLM"][0], saved["Qwen3ForCausalLM"][0]
    index = json.loads((qwen2 / "model.safetensors.index.json").read_text())["weight_map"]
    bias = "model.layers.1.self_attn.k_proj.bias"
    missing_shard = tmp_path / "no-shard"
    edited(qwen2, missing_shard)
    (missing_shard / index["model.norm.weight"]).unlink()
    cases = {
        "rope_parameters.rope_type = 'longrope' is not implemented": edited(
            qwen3, tmp_path / "longrope", {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}
        ),
        "final_logit_softcapping is not implemented by fivecut's Qwen3ForCausalLM": edited(
            qwen3, tmp_path / "cap", {"final_logit_softcapping": 30.0}
        ),
        "attention_bias = True is not implemented": edited(qwen3, tmp_path / "bias", {"attention_bias": True}),
        "hidden_act = 'gelu' is not implemented": edited(qwen2, tmp_path / "gelu", {"hidden_act": "gelu"}),
        f"tensor {bias} (fivecut's layers.1.attention.wk.bias) is missing from model.safetensors.index.json": edited(
            qwen2, tmp_path / "no-bias", drop=bias
        ),
        f"is in {index['model.norm.weight']}, which does not exist": f"hf:{missing_shard}",
        f"tensor model.embed_tokens.weight in {index['model.embed_tokens.weight']} has shape (321, 64), but "
        "config.json implies (321, 48)": edited(qwen2, tmp_path / "shape", {"hidden_size": 48}),
    }
    for needle, spec in cases.items():
        code = main(["eval", "--init-from", spec, "--set", 'data.tokenizer="byte"'])
        err = capsys.readouterr().err
        assert code == 2 and needle in err and err.count("\n") == 1 and "Traceback" not in err, (needle, err)


def test_model_args_refuse_fields_that_describe_no_model():
    from fivecut.model.args import ModelArgs

    mla = dict(kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, n_kv_heads=4)
    cases = {
        "full_attention_layers (1) needs a sliding_window": dict(full_attention_layers=1),
        "full_attention_layers (5) exceeds n_layers (4)": dict(sliding_window=8, full_attention_layers=5),
        "sliding_window (4) shapes grouped-query attention, not multi-head latent": dict(sliding_window=4, **mla),
        "qk_norm (True) shapes grouped-query attention": dict(qk_norm=True, **mla),
    }
    for needle, fields in cases.items():
        with pytest.raises(ValueError, match=re.escape(needle)):
            ModelArgs(**fields).check()
    assert ModelArgs(n_heads=4, dim=128, attention_head_dim=48).check().head_dim == 48  # dim need not be heads x 48


def test_a_stacked_tensor_is_one_hugging_face_tensor_per_expert(tmp_path):
    """The record's form for mixture-of-experts classes (their entries live in moe_architectures.py):
    fivecut's experts [E, dim, hidden] <-> E tensors [hidden, dim]; written by export, and a box of
    experts and channels read back by import opens only those experts' slices."""
    from safetensors.torch import save_file

    from fivecut.weights.architectures import TensorMap
    from fivecut.weights.export import Entry, hf_tensors
    from fivecut.weights.hf import HFSource

    theirs = tuple(f"model.layers.0.mlp.experts.{e}.gate_proj.weight" for e in range(3))
    m = TensorMap("layers.0.feed_forward.experts.w1", theirs, stacked=True, transposed=True)
    full = torch.randn(3, 8, 5)  # [E, dim, hidden]
    written = hf_tensors(Entry("model." + m.ours, (3, 8, 5), m), full, torch.float32)
    assert list(written) == list(theirs) and all(t.shape == m.hf_shape((3, 8, 5)) == (5, 8) for t in written.values())
    save_file(written, str(tmp_path / "model.safetensors"))
    source = HFSource.__new__(HFSource)  # the reading half alone, without a config.json
    source.scales = {}  # no fp8 weights
    source.files, source._handles, source.maps, source.buffers = (
        dict.fromkeys(theirs, tmp_path / "model.safetensors"),
        {},
        {m.ours: m},
        {},
    )
    assert source.fivecut_shape(m) == (3, 8, 5)
    box = (slice(1, 3), slice(2, 6), slice(1, 4))
    assert torch.equal(source.read(m.ours, box), full[box])


# ---------------------------------------------------------------- helpers for the other families' tests


def random_hf_model(name: str, config_class: str, config: dict, norm, seed: int = 0):
    """transformers' class `name` built from `config_class(**config)`, fp32, eval mode, each norm
    weight set to `norm(weight)` (a random draw away from its init)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    model = getattr(transformers, name)(getattr(transformers, config_class)(**config)).float().eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.copy_(norm(p))
    return model


def save_each(root: Path, build, names, tokens: torch.Tensor) -> dict[str, tuple[Path, torch.Tensor]]:
    """Each class of `names` built by `build(name)`, saved in shards under root/name: name -> (its folder,
    transformers' logits of `tokens`)."""
    out = {}
    for name in names:
        model = build(name)
        model.save_pretrained(root / name, max_shard_size="60KB")
        with torch.no_grad():
            out[name] = (root / name, model(tokens).logits)
    return out


def assert_each_gives_its_logits_under(saved: dict, cache: str, overrides: tuple[str, ...], tokens, layout: str):
    """On 2 ranks laid out by `overrides`, each saved folder's logits of `tokens` are transformers'."""
    configs = [import_config(cache, folder, *overrides) for folder, _ in saved.values()]
    for rank, rank_logits in enumerate(spawn(logits_of, 2, configs, tokens)):
        for (name, (_, expected)), got in zip(saved.items(), rank_logits):
            torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL, msg=f"{layout} rank {rank}, {name}")


def assert_each_exports_to_itself(saved: dict, cache: str, work: Path, tokens: torch.Tensor) -> None:
    """Each saved folder trained two steps, exported, read by its own class: the trained logits, moved."""
    import transformers

    from fivecut.weights import export as ex
    from fivecut.weights.load import single_model

    for name, (folder, before) in saved.items():
        ck = train_two_steps(cache, folder, work / name)
        out = ex.export(ck, work / name / "hf", max_shard_bytes=100_000)
        assert json.loads((out / "config.json").read_text())["architectures"] == [name]
        theirs = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        assert type(theirs).__name__ == name
        ours, _ = single_model(checkpoint=str(ck))
        with torch.no_grad():
            expected = ours(tokens)
            torch.testing.assert_close(theirs(tokens).logits, expected, rtol=RTOL, atol=ATOL, msg=name)
        assert not torch.allclose(expected, before, atol=1e-3), name


def assert_refused_in_one_line(capsys, cases: dict[str, str]) -> None:
    """Each `hf:` folder of `cases` (needle -> it) refused by `fivecut eval` in one line naming the needle, exit 2."""
    from fivecut.cli import main

    for needle, spec in cases.items():
        code = main(["eval", "--init-from", spec, "--set", 'data.tokenizer="byte"'])
        err = capsys.readouterr().err
        assert code == 2 and needle in err and err.count("\n") == 1 and "Traceback" not in err, (needle, err)
