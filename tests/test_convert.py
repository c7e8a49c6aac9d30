"""`fivecut convert`: a published model into a fivecut checkpoint written by a layout's ranks, a run
that starts from it under another layout, and the checkpoint back to Hugging Face.

The models are tiny random ones made by transformers here: a Qwen2 (q/k/v biases; an odd
vocabulary, which tensor parallelism pads) and a DeepSeek-V3 (experts, which expert parallelism
splits; routing biases, which travel as buffers). A conversion copies fp32 values, so a round
trip gives every tensor back to the bit; the checkpoint's logits equal transformers' at the
import tolerance (1e-5 absolute and relative: only the order of operations differs).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_hf_dense import TOKENS as DENSE_TOKENS
from test_hf_dense import save_hf as save_dense
from test_hf_moe import TOKENS as MOE_TOKENS
from test_hf_moe import save_hf as save_moe

TOL = dict(rtol=1e-5, atol=1e-5)


def convert(*argv: str) -> int:
    from fivecut.cli import main

    return main(["convert", *argv])


def published(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face folder, by its name."""
    from safetensors.torch import load_file

    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


def checkpoint_logits(ckpt: Path, tokens: torch.Tensor) -> torch.Tensor:
    from fivecut.weights.load import single_model

    model, _ = single_model(init_from=f"dcp:{ckpt}")
    with torch.no_grad():
        return model(tokens)


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory) -> tuple[Path, torch.Tensor]:
    """A Qwen2 folder and transformers' logits of DENSE_TOKENS."""
    pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp("convert") / "qwen2"
    return folder, save_dense(folder, "Qwen2ForCausalLM")


@pytest.fixture(scope="module")
def converted(qwen2, tmp_path_factory) -> Path:
    """The Qwen2 as a checkpoint written by pp=2's two ranks, each its layers."""
    out = tmp_path_factory.mktemp("convert") / "qwen2-pp2"
    assert convert("--from", f"hf:{qwen2[0]}", "--to", str(out), "--layout", "pp=2,microbatches=2") == 0
    return out


@pytest.mark.multirank
def test_a_checkpoint_written_under_pp_gives_transformers_logits(qwen2, converted):
    folder, reference = qwen2
    assert sorted(p.name for p in converted.iterdir()) == ["step-00000000"]
    assert (converted / "step-00000000" / "tokenizer.json").is_file() == (folder / "tokenizer.json").is_file()
    torch.testing.assert_close(checkpoint_logits(converted, DENSE_TOKENS), reference, **TOL)


@pytest.mark.multirank
def test_the_checkpoint_converts_back_to_the_same_tensors(qwen2, converted, tmp_path, capsys):
    out = tmp_path / "back"
    assert convert("--from", f"dcp:{converted}", "--to", f"hf:{out}", "--workers", "2") == 0
    assert "Qwen2ForCausalLM" in capsys.readouterr().out
    before, after = published(qwen2[0]), published(out)
    assert before.keys() == after.keys()
    for name, tensor in before.items():
        assert torch.equal(after[name], tensor), name


@pytest.mark.multirank
def test_a_run_starts_from_the_checkpoint_under_another_layout(converted, capsys):
    """The checkpoint was written by pp=2, each tensor whole; tp=2's ranks each read their rows or
    columns of it, and the run equals the single process that reads the whole of it."""
    from fivecut.cli import main

    code = main(["verify", "--model", f"dcp:{converted}", "--layout", "tp=2", "--steps", "2"])
    out = capsys.readouterr().out
    assert code == 0 and "PASS" in out, out


@pytest.mark.multirank
def test_experts_and_routing_biases_convert_under_expert_parallelism(tmp_path):
    """DeepSeek-V3 under dp=2,ep=2: each rank reads and writes its half of the experts."""
    pytest.importorskip("transformers")
    folder, out = tmp_path / "deepseek", tmp_path / "ckpt"
    reference = save_moe("deepseek_v3", folder)
    assert convert("--from", f"hf:{folder}", "--to", str(out), "--layout", "dp=2,ep=2") == 0
    torch.testing.assert_close(checkpoint_logits(out, MOE_TOKENS), reference, **TOL)


def test_bad_conversions_are_refused_in_one_line(qwen2, tmp_path, capsys):
    from fivecut.cli import main

    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    spec, back = f"hf:{qwen2[0]}", f"hf:{tmp_path / 'b'}"
    cases = {
        f"--to {full} is not empty; fivecut never overwrites": ["--from", spec, "--to", str(full)],
        "--dtype does not apply to converting": ["--from", spec, "--to", str(tmp_path / "a"), "--dtype", "bf16"],
        "--layout does not apply to converting": ["--from", "dcp:x", "--to", back, "--layout", "tp=2"],
        "give hf:FOLDER, gguf:FILE (to a checkpoint) or dcp:CHECKPOINT": ["--from", "x", "--to", str(tmp_path / "c")],
        "a checkpoint converts to a Hugging Face folder": ["--from", "dcp:x", "--to", str(tmp_path / "d")],
    }
    for needle, argv in cases.items():
        code = main(["convert", *argv])
        err = capsys.readouterr().err
        assert code == 2 and needle in err and err.count("\n") == 1 and "Traceback" not in err, (needle, err)
    assert (full / "keep.txt").read_text() == "mine"


def test_a_refused_destination_is_named_by_convert_s_own_flag(tmp_path, capsys):
    """convert has no --out: its refusals of a destination name --to, as the user wrote it."""
    from fivecut.cli import main

    full, a_file = tmp_path / "full", tmp_path / "a-file"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    a_file.write_text("mine too")
    cases = {
        f"--to {full} is not empty": ["--from", "hf:anything", "--to", str(full)],
        f"--to hf:{full} is not empty": ["--from", "dcp:x", "--to", f"hf:{full}"],
        f"--to hf:{a_file} is a file": ["--from", "dcp:x", "--to", f"hf:{a_file}"],
        f"--to {a_file}/ckpt: {a_file} is a file": ["--from", "gguf:x", "--to", str(a_file / "ckpt")],
    }
    for needle, argv in cases.items():
        code = main(["convert", *argv])
        err = capsys.readouterr().err
        assert code == 2 and needle in err and "--out" not in err, (needle, err)
        assert err.count("\n") == 1 and "Traceback" not in err, err
    assert (full / "keep.txt").read_text() == "mine" and a_file.read_text() == "mine too"


@pytest.mark.multirank
def test_resuming_a_converted_checkpoint_is_refused_before_any_rank(converted, tmp_path, capsys):
    from fivecut.cli import main

    overrides = [f'checkpoint.dir="{converted}"', f'model.init_from="dcp:{converted}"', 'data.tokenizer="byte"']
    code = main(["train", *[a for o in overrides for a in ("--set", o)]])
    err = capsys.readouterr().err
    assert code == 2 and "holds weights only" in err and "model.init_from = 'dcp:" in err, err


@pytest.mark.multirank
def test_torchrun_s_ranks_write_the_same_weights(qwen2, converted, tmp_path):
    """`torchrun -m fivecut convert` under tp=2 (each rank its rows or columns) writes the tensors that
    pp=2's spawned ranks wrote (each its layers)."""
    from test_bad_input_run import torchrun

    from fivecut.train.checkpoint import find_checkpoint, full_state

    out = tmp_path / "ckpt"
    run = torchrun(2, tmp_path, "convert", "--from", f"hf:{qwen2[0]}", "--to", str(out), "--layout", "tp=2")
    assert run.returncode == 0 and "rank 0 held" in run.stdout, run.stderr[-3000:]
    mine, theirs = (full_state(find_checkpoint(p, None)) for p in (out, converted))
    assert mine.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert torch.equal(mine[name], tensor), name
