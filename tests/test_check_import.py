"""`fivecut check-import`: a Hugging Face folder built both ways (fivecut's import, transformers')
and compared on a random batch. PASS on tiny random models (three classes; every class of the zoo,
mixture-of-experts ones included, in the sweep), exit 0; FAIL
(exit 1) naming the first decoder layer that differs when a weight is altered after saving;
bad input in one line, exit 2.

The tiny models are test_hf_dense's and test_hf_families' (random norms and biases, sharded).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from fivecut.cli import main


def save(folder, module, name: str):
    model = module.hf_model(name)
    model.save_pretrained(folder, max_shard_size="60KB")
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    import test_hf_dense
    import test_hf_families

    root = tmp_path_factory.mktemp("check-import")
    return {
        "Qwen2ForCausalLM": save(root / "qwen2", test_hf_dense, "Qwen2ForCausalLM"),
        "SmolLM3ForCausalLM": save(root / "smollm3", test_hf_families, "SmolLM3ForCausalLM"),
        "Olmo2ForCausalLM": save(root / "olmo2", test_hf_families, "Olmo2ForCausalLM"),
    }


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["check-import", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_each_class_passes(folders, capsys):
    for name, folder in folders.items():
        code, out, _ = run(capsys, f"hf:{folder}")
        assert code == 0 and "\nPASS: largest relative difference" in out and name in out, out
        assert out.count("output's largest relative difference") == 2 and "KL(transformers || fivecut)" in out, out


@pytest.mark.sweep
def test_every_class_of_the_zoo_passes(tmp_path, capsys):
    """Every registered class, dense and mixture-of-experts, as the other tests build it."""
    import test_hf_dense
    import test_hf_families
    import test_hf_gemma
    import test_hf_moe

    from fivecut.weights.architectures import ARCHITECTURES

    folders = {name: save(tmp_path / name, test_hf_dense, name) for name in test_hf_dense.MODELS}
    folders |= {name: save(tmp_path / name, test_hf_families, name) for name in test_hf_families.MODELS}
    folders |= {name: save(tmp_path / name, test_hf_gemma, name) for name in test_hf_gemma.MODELS}
    for kind, name in test_hf_moe.CLASSES.items():
        test_hf_moe.save_hf(kind, tmp_path / name)
        folders[name] = tmp_path / name
    assert set(folders) == set(ARCHITECTURES)
    for name, folder in folders.items():
        code, out, _ = run(capsys, f"hf:{folder}")
        assert code == 0 and out.splitlines()[-1].startswith("PASS") and name in out, out


def test_an_import_that_differs_fails_naming_its_first_layer(folders, capsys, monkeypatch):
    """fivecut's import broken on purpose: layer 1's norm (OLMo 2's post-attention norm) scaled by 1.5
    after reading. Layer 0 still agrees; layer 1 is named, the logits differ, exit 1."""
    from fivecut.weights import import_check

    read = import_check.single_model

    def altered(**kwargs):
        model, tokenizer = read(**kwargs)
        with torch.no_grad():
            model.layers["1"].attention_norm.weight.mul_(1.5)
        return model, tokenizer

    monkeypatch.setattr(import_check, "single_model", altered)
    code, out, _ = run(capsys, f"hf:{folders['Olmo2ForCausalLM']}")
    assert code == 1 and "the first layer that differs is layer 1" in out, out
    assert out.splitlines()[-1].startswith("FAIL: largest relative difference"), out


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
