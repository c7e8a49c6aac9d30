"""Phi-3's LongRoPE (rope_type longrope; 'su' and 'yarn', which Phi3Config reads as longrope) in and
out of Hugging Face, one process, under the cuts, and through generation.

Tiny random Phi-3s built by `transformers`, pretrained context (original_max_position_embeddings) 16
of max_position_embeddings 64: a sequence of 12 turns by the short factors, one of 24 by the long
ones; the factors differ channel by channel, so the wrong set, a factor on the wrong channel pair or
a missing attention factor changes the logits. One model turns half of each head (partial rotary:
4 channel pairs), the other all of it (8 pairs) with an attention_factor of its own.

Tolerances as in tests/test_hf_dense.py: fp32, 1e-5 absolute and relative.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_hf_dense import assert_refused_in_one_line, edited, random_hf_model, train_two_steps
from test_hf_families import COMMON as FAMILIES
from test_import import import_config, logits_of

from fivecut.launch import spawn

RTOL = ATOL = 1e-5
VOCAB = 321
ORIGINAL = 16
SHORT = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))  # <= 16: short factors
LONG = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(4))  # > 16: long factors
COMMON = FAMILIES | dict(max_position_embeddings=64, original_max_position_embeddings=ORIGINAL)


def factors(pairs: int, first: float, step: float) -> list[float]:
    return [round(first + step * i, 3) for i in range(pairs)]


def longrope(pairs: int, **extra) -> dict:
    return {"short_factor": factors(pairs, 1.0, 0.37), "long_factor": factors(pairs, 1.5, 2.9), **extra}


# name -> the model's own config keys
MODELS = {
    "half": dict(
        partial_rotary_factor=0.5, rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, **longrope(4)}
    ),
    "whole": dict(rope_parameters={"rope_type": "longrope", "rope_theta": 5e3, **longrope(8, attention_factor=1.3)}),
}


def hf_model(name: str, seed: int = 0):
    own = MODELS[name]
    return random_hf_model("Phi3ForCausalLM", "Phi3Config", COMMON | own, lambda p: 1 + 0.2 * torch.randn_like(p), seed)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, tuple[Path, torch.Tensor, torch.Tensor]]:
    """name -> (its folder, transformers' logits of SHORT, of LONG)."""
    root, out = tmp_path_factory.mktemp("longrope"), {}
    for name in MODELS:
        model = hf_model(name)
        model.save_pretrained(root / name, max_shard_size="60KB")
        with torch.no_grad():
            out[name] = (root / name, model(SHORT).logits, model(LONG).logits)
    return out


# ---------------------------------------------------------------- in: the logits of transformers


def assert_gives_the_logits(spec: str, short: torch.Tensor, long: torch.Tensor, msg: str) -> None:
    from fivecut.weights.load import single_model

    model, _ = single_model(init_from=spec)
    with torch.no_grad():
        for tokens, expected, which in ((SHORT, short, "short"), (LONG, long, "long"), (SHORT, short, "short again")):
            torch.testing.assert_close(model(tokens), expected, rtol=RTOL, atol=ATOL, msg=f"{msg}, {which}")


def test_each_gives_its_logits_short_and_long_in_one_process(saved):
    for name, (folder, short, long) in saved.items():
        assert_gives_the_logits(f"hf:{folder}", short, long, name)


def test_the_config_becomes_the_right_fields(saved):
    from fivecut.weights.load import source_of

    half, whole = (source_of(f"hf:{saved[name][0]}").args for name in ("half", "whole"))
    assert half.rope_scaling == whole.rope_scaling == "longrope" and half.rope_original_context == ORIGINAL
    assert half.rope_dim == 8 and half.rope_short_factors == tuple(longrope(4)["short_factor"])
    assert half.rope_factor == 4.0 and half.rope_attention_factor == 0.0  # 64 / 16, derived
    assert len(whole.rope_long_factors) == 8 and whole.rope_attention_factor == 1.3
    assert not half.rope_long(ORIGINAL) and half.rope_long(ORIGINAL + 1)


@pytest.mark.parametrize("name", MODELS)
def test_the_frequencies_and_factor_are_transformers(saved, name):
    """fivecut's inverse frequencies and cos/sin factor = transformers' longrope function's, for a
    sequence of the original context (short factors) and one position more (long)."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from fivecut.model.transformer import rope_frequencies
    from fivecut.weights.load import source_of

    config = transformers.AutoConfig.from_pretrained(saved[name][0])
    args = source_of(f"hf:{saved[name][0]}").args
    for seq in (ORIGINAL, ORIGINAL + 1):
        theirs, factor = ROPE_INIT_FUNCTIONS["longrope"](config, seq_len=seq)
        ours, our_factor = rope_frequencies(args, args.rope_long(seq))
        torch.testing.assert_close(ours.float(), theirs, rtol=1e-6, atol=0, msg=f"{name}, {seq}")
        assert our_factor == pytest.approx(factor, rel=1e-12), (name, seq)


def test_su_and_yarn_are_read_as_longrope(saved, tmp_path):
    """An older file's rope_scaling of type 'su' or 'yarn': Phi3Config reads it as longrope."""
    folder, short, long = saved["half"]
    table = json.loads((folder / "config.json").read_text())["rope_parameters"]
    for kind in ("su", "yarn"):
        scaling = {k: v for k, v in table.items() if k != "rope_type"} | {"type": kind}
        spec = edited(folder, tmp_path / kind, {"rope_scaling": scaling, "rope_parameters": None})
        assert_gives_the_logits(spec, short, long, kind)


# ---------------------------------------------------------------- under the cuts

LAYOUTS = {"tp=2": ("parallel.tp=2",), "cp=2,cp_mode=ulysses": ("parallel.cp=2", 'parallel.cp_mode="ulysses"')}


@pytest.mark.multirank
def test_logits_under_ulysses_short_and_long(saved, byte_cache):
    """Each cp rank holds positions of both halves of the sequence; the run's length chooses the factors."""
    assert_logits_under(saved, byte_cache, "cp=2,cp_mode=ulysses")


@pytest.mark.sweep
@pytest.mark.multirank
def test_logits_under_tp(saved, byte_cache):
    assert_logits_under(saved, byte_cache, "tp=2")


def assert_logits_under(saved: dict, cache: str, layout: str) -> None:
    """On 2 ranks, each model's logits of SHORT (run at train.seq_len 12) and of LONG (at 24)."""
    for index, tokens in ((1, SHORT), (2, LONG)):
        seq = f"train.seq_len={tokens.shape[1]}"
        configs = [import_config(cache, folder, *LAYOUTS[layout], seq) for folder, *_ in saved.values()]
        for rank, rank_logits in enumerate(spawn(logits_of, 2, configs, tokens)):
            for (name, expected), got in zip(saved.items(), rank_logits, strict=True):
                msg = f"{layout} rank {rank}, {name}, {tokens.shape[1]} tokens"
                torch.testing.assert_close(got, expected[index], rtol=RTOL, atol=ATOL, msg=msg)


@pytest.mark.multirank
def test_verify_passes_under_tp(saved, capsys):
    assert_verify_passes(capsys, saved["half"][0], "tp=2", 24)


CUTS = ["tp=2", "cp=2,cp_mode=ulysses", "pp=2,microbatches=2", "tp=2,sp=true", "dp=2,zero=3"]


@pytest.mark.sweep
@pytest.mark.multirank
@pytest.mark.parametrize("layout", CUTS)
@pytest.mark.parametrize("seq", [12, 24])
def test_verify_passes_under_each_cut(saved, capsys, layout, seq):
    assert_verify_passes(capsys, saved["whole"][0], layout, seq)


@pytest.mark.sweep
@pytest.mark.multirank
@pytest.mark.parametrize("layout", ["tp=2,sp=true", "cp=2,cp_mode=ulysses"])
def test_ledger_measures_what_the_planner_predicts(saved, capsys, layout):
    """The long tables are the short ones' size: measured = predicted, as for any Phi-3."""
    import re

    from fivecut.cli import main

    argv = ["ledger", "--model", f"hf:{saved['half'][0]}", "--layout", layout, "--steps", "1"]
    code = main([*argv, "--set", "train.seq_len=24"])
    out = capsys.readouterr().out
    ratios = dict(re.findall(r"^(\w*ratio)=(\S+)$", out, re.M))
    assert code == 0 and set(ratios.values()) == {"1.000"} and "memory_ratio" in ratios, out


def assert_verify_passes(capsys, folder: Path, layout: str, seq: int) -> None:
    from fivecut.cli import main

    argv = ["verify", "--model", f"hf:{folder}", "--layout", layout, "--steps", "2", "--set", f"train.seq_len={seq}"]
    code = main(argv)
    out = capsys.readouterr().out
    assert code == 0 and "PASS" in out, out


# ---------------------------------------------------------------- out, generation, check-import


def test_exports_to_itself_after_training(saved, byte_cache, tmp_path):
    """Trained two steps (at train.seq_len 32: the long factors), exported, read by Phi3ForCausalLM."""
    import transformers

    from fivecut.weights import export as ex
    from fivecut.weights.load import single_model

    folder, short, _ = saved["half"]
    ck = train_two_steps(byte_cache, folder, tmp_path)
    out = ex.export(ck, tmp_path / "hf")
    config = json.loads((out / "config.json").read_text())
    assert (
        config["original_max_position_embeddings"] == ORIGINAL and config["rope_parameters"]["rope_type"] == "longrope"
    )
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ours, _ = single_model(checkpoint=str(ck))
    with torch.no_grad():
        for tokens in (SHORT, LONG):
            torch.testing.assert_close(theirs(tokens).logits, ours(tokens), rtol=RTOL, atol=ATOL)
        assert not torch.allclose(ours(SHORT), short, atol=1e-3)


@pytest.mark.parametrize("prompt", [10, 20])  # crossing 16 while generating; past it from the prompt on
def test_greedy_generation_equals_transformers(saved, prompt):
    """transformers' Phi-3 drops its cache when the sequence passes the original context and runs it all
    again under the long factors; fivecut's generation does the same."""
    import transformers

    from fivecut.generate import Sampling, generate_ids
    from fivecut.weights.load import single_model

    ids = LONG[0, :prompt].tolist()
    for name, (folder, _, _) in saved.items():
        ours, _ = single_model(init_from=f"hf:{folder}")
        theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        expected = theirs.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=None)
        got = generate_ids(ours, ids, 12, Sampling(temperature=0.0), eot_id=None).new_ids
        assert got == expected[0, prompt:].tolist(), name


@pytest.mark.parametrize("prompt", [10, 20])
def test_each_step_s_logits_equal_transformers_generate(saved, prompt):
    """The logits of every step through the cache (`logits_after`), switch included, = those of
    transformers' generate: the greedy tokens alone would hide a cache that kept the short-factor keys."""
    import transformers

    from fivecut.generate import logits_after
    from fivecut.model.decode import new_cache
    from fivecut.weights.load import single_model

    ids = LONG[0, :prompt].tolist()
    for name, (folder, _, _) in saved.items():
        ours, _ = single_model(init_from=f"hf:{folder}")
        theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        run = theirs.generate(
            torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=None, output_logits=True,
            return_dict_in_generate=True,
        )  # fmt: skip
        sequence, cache = run.sequences[0].tolist(), new_cache(ours, max_len=prompt + 12)
        for step, expected in enumerate(run.logits):
            got = logits_after(ours, sequence[: prompt + step], cache, torch.device("cpu"))[:, -1]  # [1, V]
            torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL, msg=f"{name}, step {step}")


def test_check_import_passes(saved, capsys):
    from fivecut.cli import main

    for seq in ("12", "24"):
        code = main(["check-import", f"hf:{saved['half'][0]}", "--seq", seq])
        out = capsys.readouterr().out
        assert code == 0 and out.splitlines()[-1].startswith("PASS"), out


# ---------------------------------------------------------------- bad input: one line, exit 2


def test_what_longrope_cannot_carry_is_refused_in_one_line(saved, tmp_path, capsys):
    folder = saved["half"][0]
    table = json.loads((folder / "config.json").read_text())["rope_parameters"]

    def with_table(name: str, **change) -> str:
        return edited(folder, tmp_path / name, {"rope_parameters": table | change})

    assert_refused_in_one_line(
        capsys,
        {
            "rope_parameters.short_factor is [1.0, 2.0]; longrope needs a list of 4 numbers": with_table(
                "short", short_factor=[1.0, 2.0]
            ),
            "rope_parameters.long_factor holds a factor <= 0": with_table("zero", long_factor=[1.0, 0.0, 1.0, 1.0]),
            "rope_parameters.attention_factor = 0 is not implemented": with_table("attention", attention_factor=0),
            "rope_parameters.low_freq_factor is not implemented by fivecut's longrope": with_table(
                "key", low_freq_factor=1.0
            ),
            "rope_parameters.original_max_position_embeddings = 8 but the top-level": with_table(
                "original", original_max_position_embeddings=8
            ),
        },
    )


def test_documents_past_the_original_context_are_refused_in_one_line(saved, capsys):
    """Packed documents restart their positions: transformers would choose the factors by the longest one."""
    from fivecut.cli import main

    spec = f'model.init_from="hf:{saved["half"][0]}"'
    code = main(["train", "--set", spec, "--set", "data.document_mask=true", "--set", "train.seq_len=24"])
    err = capsys.readouterr().err
    assert code == 2 and "data.document_mask=true with LongRoPE" in err and err.count("\n") == 1, err
