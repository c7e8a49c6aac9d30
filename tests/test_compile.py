"""train.compile: torch.compile of each block's forward, against the eager single process (fp32)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from fivecut.model.presets import PRESETS
from fivecut.model.transformer import build_model
from fivecut.parallel.compile import compile_blocks, start_record
from fivecut.parallel.parallelize import STEPS

# verify's tolerances (fivecut.cli): inductor reorders sums, so later steps drift like any reordering
LOSS_RTOL, FIRST_GRAD_NORM_RTOL, LATER_GRAD_NORM_RTOL = 1e-5, 1e-5, 1e-3


def test_compile_is_the_step_after_recomputation():
    assert STEPS.index("compile") == STEPS.index("recompute") + 1 == STEPS.index("data") - 1


def test_compiling_keeps_names_and_compiles_a_plain_moe():
    model = build_model(PRESETS["tiny-moe"], seed=0)
    keys = list(model.state_dict())
    record = start_record()
    compile_blocks(model, record)  # lazy: nothing is traced before a forward
    assert list(model.state_dict()) == keys and not any("_orig_mod" in k for k, _ in model.named_parameters())
    assert record.blocks == [f"layers.{i}" for i in range(4)]
    assert record.eager == {}  # one process's dropless MoE compiles with its block (tests/test_moe_compile.py)


def fivecut(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fivecut", *args], capture_output=True, text=True, timeout=timeout)


def train_records(cache: str, out, *extra: str) -> tuple[list[dict], str]:
    sets = [
        "train.steps=2",
        "train.seq_len=32",
        "train.global_batch=4",
        "train.warmup=1",
        "train.eval_every=0",
        "log.plot=false",
        "log.progress=false",
        f'data.cache_dir="{cache}"',
        f'log.out_dir="{out}"',
        *extra,
    ]
    run = fivecut("train", *[a for s in sets for a in ("--set", s)])
    assert run.returncode == 0, run.stdout + run.stderr
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()], run.stdout


def test_one_process_compiled_matches_eager(byte_cache, tmp_path):
    eager, _ = train_records(byte_cache, tmp_path / "eager")
    compiled, log = train_records(byte_cache, tmp_path / "compiled", "train.compile=true")
    for step, (a, b) in enumerate(zip(eager, compiled, strict=True), start=1):
        assert b["loss"] == pytest.approx(a["loss"], rel=LOSS_RTOL)
        rtol = FIRST_GRAD_NORM_RTOL if step == 1 else LATER_GRAD_NORM_RTOL
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=rtol)
    counts = compiled[0]["compile"]  # step 1's record says what was compiled
    assert counts["blocks"] == 4 and counts["graphs"] >= 1 and counts["graph_breaks"] == 0
    assert "compile" not in eager[0] and "compile" not in compiled[1]
    assert "torch.compile: 4 blocks" in log


@pytest.mark.sweep
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_compile_with_recomputation_matches_eager(byte_cache, tmp_path, mode):
    """Compiled blocks under recomputation: a full checkpoint runs a compiled forward (Dynamo
    cannot trace the checkpoint's bookkeeping itself, and would leave the block eager)."""
    eager, _ = train_records(byte_cache, tmp_path / "eager")
    compiled, _ = train_records(byte_cache, tmp_path / mode, "train.compile=true", f'train.recompute="{mode}"')
    for step, (a, b) in enumerate(zip(eager, compiled, strict=True), start=1):
        assert b["loss"] == pytest.approx(a["loss"], rel=LOSS_RTOL)
        rtol = FIRST_GRAD_NORM_RTOL if step == 1 else LATER_GRAD_NORM_RTOL
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=rtol)
    counts = compiled[0]["compile"]
    assert counts["graphs"] >= 1 and counts["graph_breaks"] == 0, counts


# each layout of the acceptance list once (minutes of compilation on 2 cores: a sweep)
LAYOUTS = [
    ("tiny", "dp=2,zero=3"),
    ("tiny", "tp=2,sp=true"),
    ("tiny", "pp=2,pp_schedule=zb1p,microbatches=4"),
    ("tiny", "cp=2,cp_mode=ring"),
    ("tiny-moe", "dp=2,ep=2"),
]


@pytest.mark.sweep
@pytest.mark.parametrize("model,layout", LAYOUTS)
def test_verify_compiled_layout_passes(byte_cache, model, layout):
    run = fivecut(
        "verify",
        "--model",
        model,
        "--layout",
        layout,
        "--steps",
        "3",
        "--set",
        "train.compile=true",
        "--set",
        f'data.cache_dir="{byte_cache}"',
    )
    assert run.returncode == 0, run.stdout + run.stderr
    last = run.stdout.strip().splitlines()[-1]
    print(model, layout, last)  # the differences measured (pytest -s)
    assert last.startswith("PASS")
