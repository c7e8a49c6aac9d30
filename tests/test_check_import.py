"""`fivecut check-import`: a Hugging Face folder built both ways (fivecut's import, transformers')
and compared on a random batch. PASS on tiny random models of every class fivecut reads (a
parametrized test over tiny folders; bf16 and layer by layer on each class in the sweep), exit 0;
FAIL (exit 1) naming the first decoder layer that differs when fivecut's import is altered after
reading, whole or layer by layer, fp32 or bf16; bad input in one line, exit 2.

Why an import altered, not a folder: fivecut and transformers read the same files, so a folder whose
weights were altered after saving is one both read alike (it passes, rightly); what the check exists
to catch is fivecut reading a folder otherwise than transformers, which the tests make happen.

The tiny models are test_hf_dense's, test_hf_families', test_hf_moe's and test_hf_glm's (random norms
and biases, sharded).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from fivecut.cli import hint_check_import, main


def save(folder, module, name: str):
    model = module.hf_model(name)
    model.save_pretrained(folder, max_shard_size="60KB")
    return folder


def save_any(root, name: str):
    """A tiny random model of class `name`, whichever test module builds it, saved under root / name."""
    import test_hf_dense
    import test_hf_families
    import test_hf_gemma
    import test_hf_glm
    import test_hf_gpt_oss
    import test_hf_moe

    folder = root / name
    for module in (test_hf_dense, test_hf_families, test_hf_gemma):
        if name in module.MODELS:
            return save(folder, module, name)
    if name == "GptOssForCausalLM":
        test_hf_gpt_oss.hf_model().save_pretrained(folder, max_shard_size="60KB")
        return folder
    if name == test_hf_glm.CLASS:
        test_hf_glm.save_glm(folder)
        return folder
    test_hf_moe.save_hf({v: k for k, v in test_hf_moe.CLASSES.items()}[name], folder)
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("check-import")
    return {name: save_any(root, name) for name in ("Qwen2ForCausalLM", "SmolLM3ForCausalLM", "Olmo2ForCausalLM")}


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["check-import", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_each_class_passes(folders, capsys):
    for name, folder in folders.items():
        code, out, _ = run(capsys, f"hf:{folder}")
        assert code == 0 and "\nPASS: largest relative difference" in out and name in out, out
        assert out.count("output's largest relative difference") == 2 and "KL(transformers || fivecut)" in out, out


def zoo():
    from fivecut.weights.architectures import ARCHITECTURES

    return sorted(ARCHITECTURES)


@pytest.mark.parametrize("name", zoo())
def test_every_class_of_the_zoo_passes(tmp_path, capsys, name):
    """Every registered class, dense and mixture-of-experts, as its own tests build it."""
    code, out, _ = run(capsys, f"hf:{save_any(tmp_path, name)}")
    assert code == 0 and out.splitlines()[-1].startswith("PASS") and name in out, out


@pytest.mark.sweep
@pytest.mark.parametrize("how", [("--dtype", "bf16"), ("--layer-by-layer",), ("--layer-by-layer", "--dtype", "bf16")])
@pytest.mark.parametrize("name", zoo())
def test_every_class_passes_in_bf16_and_layer_by_layer(tmp_path, capsys, name, how):
    code, out, _ = run(capsys, f"hf:{save_any(tmp_path, name)}", *how)
    assert code == 0 and out.splitlines()[-1].startswith("PASS") and name in out, out


def test_bf16_passes_against_its_stated_tolerance(folders, capsys):
    """bf16's tolerance for 2 layers, 4 * 2^-8 * sqrt(4) = 0.031, stated; the tiny models land near 1e-2."""
    from fivecut.weights.import_check import bf16_rtol

    assert bf16_rtol(2) == 4 * 2**-8 * 2 and bf16_rtol(46) == pytest.approx(0.150, abs=1e-3)
    code, out, _ = run(capsys, f"hf:{folders['Qwen2ForCausalLM']}", "--dtype", "bf16")
    assert code == 0 and "bf16 tolerance after 2 layers: 4 u sqrt(2 * 2) = 0.031, u = 2^-8" in out, out
    assert "from transformers' fp32 logits: fivecut's bf16" in out and "(tolerance 0.022)" in out, out
    assert out.splitlines()[-1].startswith("PASS: largest relative difference"), out


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_an_import_that_differs_fails_naming_its_first_layer(folders, capsys, monkeypatch, dtype):
    """fivecut's import broken on purpose: layer 1's norm (OLMo 2's post-attention norm) scaled by 1.5
    after reading. Layer 0 still agrees; layer 1 is named, the logits differ, exit 1; in bf16 too."""
    from fivecut.weights import import_check

    read = import_check.single_model

    def altered(**kwargs):
        model, tokenizer = read(**kwargs)
        with torch.no_grad():
            model.layers["1"].attention_norm.weight.mul_(1.5)
        return model, tokenizer

    monkeypatch.setattr(import_check, "single_model", altered)
    code, out, _ = run(capsys, f"hf:{folders['Olmo2ForCausalLM']}", "--dtype", dtype)
    assert code == 1 and "the first layer that differs is layer 1" in out, out
    assert out.splitlines()[-1].startswith("FAIL: largest relative difference"), out


def test_layer_by_layer_checks_each_kind_of_layer(folders, capsys):
    """Qwen2's first layer attends globally, its second in a window of 4; SmolLM3's second has no RoPE."""
    code, out, _ = run(capsys, f"hf:{folders['Qwen2ForCausalLM']}", "--layer-by-layer")
    assert code == 0 and "layer by layer: asked for (--layer-by-layer)" in out, out
    assert "layer 0 (dense, global attention)" in out and "layer 1 (dense, sliding window 4)" in out, out
    assert out.splitlines()[-1].startswith("PASS: every kind of layer within 1e-05"), out
    code, out, _ = run(capsys, str(folders["SmolLM3ForCausalLM"]), "--layer-by-layer")  # a bare path as well
    assert code == 0 and "layer 1 (dense, global attention, NoPE)" in out, out


def test_layer_by_layer_fails_naming_the_layer_and_its_kind(folders, capsys, monkeypatch):
    """fivecut's block of the windowed layer altered after reading (its q bias moved): exit 1, named."""
    from fivecut.weights import layer_check

    read = layer_check.fivecut_block

    def altered(spec, args, i):
        block = read(spec, args, i)
        if i == 1:
            with torch.no_grad():
                block.attention.wq.bias.add_(0.5)
        return block

    monkeypatch.setattr(layer_check, "fivecut_block", altered)
    code, out, _ = run(capsys, f"hf:{folders['Qwen2ForCausalLM']}", "--layer-by-layer")
    assert code == 1 and out.splitlines()[-1].startswith("FAIL: layer 1 (dense, sliding window 4) differs"), out


def test_a_model_too_large_for_host_memory_goes_layer_by_layer(folders, capsys, monkeypatch):
    from fivecut.weights import import_check

    monkeypatch.setattr(import_check, "available_memory", lambda: 2**10)  # 1 KiB: less than the tiny model's
    code, out, _ = run(capsys, f"hf:{folders['Qwen2ForCausalLM']}")
    assert code == 0 and "layer by layer: both whole models need about 0.0 GiB, 0.0 GiB of host memory" in out, out
    assert out.splitlines()[-1].startswith("PASS: every kind of layer"), out


def test_bad_input_is_one_line(folders, capsys, tmp_path):
    (tmp_path / "empty").mkdir()
    unknown = tmp_path / "unknown"
    shutil.copytree(folders["Qwen2ForCausalLM"], unknown)
    config = json.loads((unknown / "config.json").read_text())
    (unknown / "config.json").write_text(json.dumps(config | {"architectures": ["GPT2LMHeadModel"]}))
    cases = {
        "is not a Hugging Face folder (no": str(tmp_path / "empty"),
        "GPT2LMHeadModel, which fivecut does not import": f"hf:{unknown}",
    }
    for needle, spec in cases.items():
        code, out, err = run(capsys, spec)
        assert code == 2 and needle in err and err.count("\n") == 1 and "Traceback" not in err, (needle, err)
    code, _, err = run(capsys, f"hf:{folders['Qwen2ForCausalLM']}", "--seq", "0")
    assert code == 2 and "--seq is 0" in err, err


def test_the_comparison_measures_what_it_says():
    from fivecut.weights.import_check import Comparison, kl_per_token, relative

    theirs = torch.tensor([[1.0, -2.0, 0.5]])
    assert relative(theirs + torch.tensor([[0.0, 0.2, 0.0]]), theirs) == pytest.approx(0.1)
    assert kl_per_token(theirs, theirs).abs().max().item() < 1e-15
    c = Comparison("X", 3, (1, 3), [1e-7, 2e-3, 5e-1], 1.0, 0.5, 0.0, 0.0)
    assert c.first_layer_over(1e-5) == 1 and c.first_layer_over(1.0) is None


def test_a_new_run_from_a_hugging_face_folder_hints_at_the_check(folders, byte_cache, tmp_path, capsys):
    """`fivecut train` from hf:FOLDER (OLMo 2's, one step): the hint, once, before the run."""
    spec = f"hf:{folders['Olmo2ForCausalLM']}"
    sets = [f"model.init_from={json.dumps(spec)}", 'data.tokenizer="byte"', f'data.cache_dir="{byte_cache}"',
            "train.steps=1", "train.warmup=1", "train.seq_len=16", "train.global_batch=2", "train.eval_every=0",
            "log.progress=false", "log.plot=false", f'log.out_dir="{tmp_path / "out"}"',
            f'checkpoint.dir="{tmp_path / "ck"}"']  # fmt: skip
    code = main(["train", *(arg for s in sets for arg in ("--set", s))])
    out, err = capsys.readouterr()
    assert code == 0 and out.count(f"hint: `fivecut check-import {spec}` compares") == 1, out + err
    hint = next(line for line in out.splitlines() if line.startswith("hint: `fivecut check-import"))
    command = hint.split("`")[1].split()[1:]  # the command the hint gives, run as it says
    code = main(command)
    assert code == 0 and capsys.readouterr().out.splitlines()[-1].startswith("PASS"), command
    hint_check_import(spec, "bf16")  # a bf16 run is told to check in bf16
    assert f"`fivecut check-import {spec} --dtype bf16`" in capsys.readouterr().out
