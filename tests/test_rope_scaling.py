"""RoPE scaled for long contexts, as published models carry it: Llama 3.1's `llama3`, YaRN (Qwen2.5's
long-context configs; DeepSeek-V3's, with mscale and mscale_all_dim) and linear interpolation.

The frequencies and the cos/sin factor are held to transformers' own functions; then tiny random
models of each class are imported and exported: logits equal to transformers' (fp32, 1e-5, only
the order of operations differs) over sequences longer than the original context the scaling
starts from, so that a wrong or missing scaling changes them.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from test_import import import_config, logits_of

from fivecut.launch import spawn
from fivecut.model.args import ModelArgs

TOL = dict(rtol=1e-5, atol=1e-5)
ORIGINAL = 16  # the "pretraining" context; the tokens run past it
TOKENS = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(3))  # [b, s], s > ORIGINAL
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": ORIGINAL}  # fmt: skip
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL}
DEEPSEEK_YARN = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": ORIGINAL, "beta_fast": 32,
                 "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}  # fmt: skip
LINEAR = {"rope_type": "linear", "factor": 2.0}
# case -> (transformers class, its config class, rope parameters)
CASES = {
    "llama3": ("LlamaForCausalLM", "LlamaConfig", LLAMA3),
    "yarn": ("Qwen2ForCausalLM", "Qwen2Config", YARN),
    "yarn-mscale": ("Qwen2ForCausalLM", "Qwen2Config", YARN | {"mscale": 0.8, "mscale_all_dim": 0.5}),
    "linear": ("MistralForCausalLM", "MistralConfig", LINEAR),
}
DENSE = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=500.0)  # fmt: skip


def hf_model(case: str):
    transformers = pytest.importorskip("transformers")
    cls, config_cls, rope = CASES[case]
    config = getattr(transformers, config_cls)(**DENSE, rope_parameters=rope | {"rope_theta": 500.0})
    torch.manual_seed(0)
    return getattr(transformers, cls)(config).float().eval()


def deepseek_model():
    transformers = pytest.importorskip("transformers")
    from test_hf_moe import hf_config

    config = hf_config("deepseek_v3")
    config.rope_parameters = DEEPSEEK_YARN | {"rope_theta": 500.0}
    torch.manual_seed(0)
    return transformers.DeepseekV3ForCausalLM(config).float().eval()


def saved(folder: Path, model) -> torch.Tensor:
    model.save_pretrained(folder)
    with torch.no_grad():
        return model(TOKENS % model.config.vocab_size).logits


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, tuple[Path, torch.Tensor]]:
    root = tmp_path_factory.mktemp("rope")
    out = {case: (root / case, saved(root / case, hf_model(case))) for case in CASES}
    out["deepseek"] = (root / "deepseek", saved(root / "deepseek", deepseek_model()))
    return out


def imported(folder: Path):
    from fivecut.weights.load import single_model

    return single_model(init_from=f"hf:{folder}")[0]


@pytest.mark.parametrize("case", [*CASES, "deepseek"])
def test_the_frequencies_and_factor_are_transformers(folders, case):
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from fivecut.model.transformer import rope_frequencies

    config = AutoConfig.from_pretrained(folders[case][0])
    theirs, factor = ROPE_INIT_FUNCTIONS[config.rope_parameters["rope_type"]](config, "cpu")
    ours, our_factor = rope_frequencies(imported(folders[case][0]).args)
    torch.testing.assert_close(ours.float(), theirs, rtol=1e-6, atol=0)
    assert our_factor == pytest.approx(factor, rel=1e-12)


@pytest.mark.parametrize("case", [*CASES, "deepseek"])
def test_logits_past_the_original_context_are_transformers(folders, case):
    folder, reference = folders[case]
    model = imported(folder)
    assert model.args.rope_scaling == json.loads((folder / "config.json").read_text())["rope_parameters"]["rope_type"]
    with torch.no_grad():
        torch.testing.assert_close(model(TOKENS % model.args.vocab_size), reference, **TOL)


@pytest.mark.parametrize("case", ["llama3", "deepseek"])
def test_an_export_keeps_the_scaling(folders, case, tmp_path):
    """fivecut's config.json of the imported shape, read back by transformers, gives the same model."""
    import transformers

    from fivecut.weights.architectures import for_args
    from fivecut.weights.hf import hf_config

    folder = folders[case][0]
    args = imported(folder).args
    (tmp_path / "config.json").write_text(json.dumps(hf_config(for_args(args), args, "float32", None, None)))
    back = transformers.AutoConfig.from_pretrained(tmp_path)
    assert back.rope_parameters == transformers.AutoConfig.from_pretrained(folder).rope_parameters


@pytest.mark.multirank
def test_tensor_parallel_ranks_give_the_same_logits(folders, byte_cache):
    """tp=2 under llama3 scaling: each rank's heads rotate by the same stretched tables."""
    folder, reference = folders["llama3"]
    cfg = import_config(byte_cache, folder, "parallel.tp=2")
    logits = spawn(logits_of, 2, [cfg], TOKENS, timeout_s=240)[0][0]
    torch.testing.assert_close(logits, reference, **TOL)


def test_scalings_that_describe_no_rope_are_refused():
    for fields, needle in (
        ({"rope_scaling": "ntk"}, "rope_scaling 'ntk' is not one of"),
        ({"rope_scaling": "yarn", "rope_factor": 4.0}, "needs rope_original_context"),
        ({"rope_scaling": "linear", "rope_factor": 0.5}, "must be >= 1"),
        ({"rope_scaling": "llama3", "rope_factor": 8.0, "rope_original_context": 16, "rope_low_freq_factor": 4.0},
         "rope_high_freq_factor (4.0) > rope_low_freq_factor (4.0)"),
    ):  # fmt: skip
        with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)")):
            dataclasses.replace(ModelArgs(), **fields).check()


# ---------------------------------------------------------------- rope_scaling beside rope_parameters

OLD_GUIDE = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL}  # what older guides add


def qwen2_with(folder: Path, theta: float, **keys) -> Path:
    """A tiny Qwen2 saved by transformers 5 (its RoPE in rope_parameters, base `theta`), then `keys`
    written into its config.json by hand."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen2Config(**DENSE | {"rope_theta": theta})
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(config).float().eval().save_pretrained(folder)
    path = folder / "config.json"
    written = json.loads(path.read_text())
    assert written["rope_parameters"] == {"rope_type": "default", "rope_theta": theta} and "rope_scaling" not in written
    path.write_text(json.dumps(written | keys))
    return folder


@pytest.mark.parametrize(
    "case",
    [
        "beside a plain rope_parameters",  # transformers reads rope_scaling, with the class's default base
        "with a top-level rope_theta",  # the base beside them, as transformers 4 wrote it
        "saying rope_parameters' own values",  # fivecut's exports write both tables, the same
    ],
)
def test_rope_scaling_beside_rope_parameters_is_read_as_transformers_reads_it(tmp_path, case):
    """A rope_scaling added by hand to a file transformers 5 wrote replaces its rope_parameters, in
    transformers and in fivecut: the logits past the original context are the same."""
    import transformers

    if case == "beside a plain rope_parameters":
        folder = qwen2_with(tmp_path, 10000.0, rope_scaling=OLD_GUIDE)
    elif case == "with a top-level rope_theta":
        folder = qwen2_with(tmp_path, 500.0, rope_scaling=OLD_GUIDE, rope_theta=500.0)
    else:
        table = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL, "rope_theta": 500.0}
        folder = qwen2_with(tmp_path, 500.0, rope_scaling=table, rope_parameters=table)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert theirs.config.rope_parameters["rope_type"] == "yarn"
    model = imported(folder)
    assert model.args.rope_scaling == "yarn" and model.args.rope_factor == 4.0
    with torch.no_grad():
        torch.testing.assert_close(model(TOKENS), theirs(TOKENS).logits, **TOL)


def test_rope_scaling_that_contradicts_rope_parameters_is_refused_naming_both(tmp_path, capsys):
    """transformers reads rope_scaling alone: a base of 500 in rope_parameters, none beside it, would
    silently become the class's 10000. One line naming both keys and the file, exit 2."""
    from fivecut.cli import main

    folder = qwen2_with(tmp_path, 500.0, rope_scaling=OLD_GUIDE)
    capsys.readouterr()  # transformers' progress bar
    code = main(["eval", "--init-from", f"hf:{folder}", "--set", 'data.tokenizer="byte"'])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert f"{folder / 'config.json'}: rope_scaling and rope_parameters disagree on rope_theta" in err, err
    assert "transformers reads 10000.0" in err and "drops rope_parameters' 500.0" in err, err
    assert "move rope_scaling's keys into rope_parameters" in err, err
