"""End to end: the CLI as a user runs it (subprocesses, real corpus, real collectives)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.e2e

QUICK = [
    "--set",
    "train.seq_len=32",
    "--set",
    "train.global_batch=4",
    "--set",
    "train.eval_every=2",
    "--set",
    "train.eval_batches=2",
    "--set",
    "train.warmup=1",  # a warmup longer than the run is refused
]


def fivecut(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fivecut", *args], capture_output=True, text=True, timeout=timeout)


def torchrun(nproc: int, *args: str) -> subprocess.CompletedProcess:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "fivecut",
        *args,
    ]
    return subprocess.run(command, capture_output=True, text=True, timeout=300)


def test_unknown_key_is_refused_with_a_suggestion():
    run = fivecut("train", "--set", "train.stepz=3")
    assert run.returncode != 0
    assert "train.stepz" in run.stderr and "train.steps" in run.stderr


def test_impossible_layout_is_refused_before_any_process_starts():
    run = fivecut("verify", "--layout", "tp=3", timeout=60)
    assert run.returncode != 0
    assert "n_heads=4" in run.stderr and "tp=3" in run.stderr
    assert "verify:" not in run.stdout  # nothing was started


def test_verify_dp2_passes(byte_cache):
    run = fivecut("verify", "--layout", "dp=2", "--steps", "3", "--set", f'data.cache_dir="{byte_cache}"')
    assert run.returncode == 0, run.stdout + run.stderr
    last = run.stdout.strip().splitlines()[-1]
    assert last.startswith("PASS max_rel_loss_diff=")
    assert "max_rel_grad_norm_diff=" in last and "max_rel_val_loss_diff=" in last  # all three compared


def test_ledger_dp2_matches_the_closed_form(byte_cache):
    run = fivecut("ledger", "--layout", "dp=2", "--set", f'data.cache_dir="{byte_cache}"')
    assert run.returncode == 0, run.stdout + run.stderr
    assert_every_cut_exact(run.stdout)
    assert "all_reduce" in run.stdout and "backward" in run.stdout


def cut_bytes(stdout: str) -> dict[str, tuple[int, int]]:
    """(measured, predicted) bytes on the wire of each cut in `fivecut ledger`'s per-cut table."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:4] == ["cut", "measured", "predicted", "ratio"])
    rows = {}
    for line in lines[start + 1 :]:
        if not line.strip() or line.startswith(("ratio=", "no closed form")):
            break
        cut, measured, predicted = line.split()[:3]
        rows[cut] = (int(measured.replace(",", "")), int(predicted.replace(",", "")))
    return rows


def assert_every_cut_exact(stdout: str) -> None:
    """Each cut's measured bytes equal its formula's, to the byte (a ratio printed to three
    decimals would let a 0.04% error through)."""
    rows = cut_bytes(stdout)
    assert rows and all(measured == predicted for measured, predicted in rows.values()), rows


def assert_memory_exact(stdout: str) -> None:
    """The model-state bytes (params, grads, optimizer, total) measured equal the formula's."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.rstrip().endswith("measured B      predicted B"))
    rows = {line.split()[0]: line.split()[-2:] for line in lines[start + 1 : start + 5]}
    assert list(rows) == ["params", "grads", "optimizer", "total"], rows
    assert all(m == p for m, p in rows.values()), rows


def assert_activations_exact(stdout: str) -> None:
    """A layer's saved bytes measured equal the formula's: `measured X (N B), predicted Y (M B)`."""
    line = next(x for x in stdout.splitlines() if x.startswith("measured ") and "predicted" in x)
    measured, predicted = re.findall(r"\(([\d,]+) B\)", line)
    assert measured == predicted, line


def train_args(cache: str, out: str, steps: int = 4) -> list[str]:
    return [
        "train",
        "--set",
        f"train.steps={steps}",
        "--set",
        f'data.cache_dir="{cache}"',
        "--set",
        f'log.out_dir="{out}"',
        *QUICK,
    ]


def losses(out) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_train_one_process_logs_metrics_and_plots(byte_cache, tmp_path):
    run = fivecut(*train_args(byte_cache, str(tmp_path)))
    assert run.returncode == 0, run.stderr
    text = run.stdout + run.stderr
    for needle in ("tok/s", "MFU", "model-state memory", "val", "loss curve:"):
        assert needle in text
    assert (tmp_path / "loss.png").stat().st_size > 1000
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert "val_loss" in records[1] and "mfu" in records[0]


@pytest.mark.multirank
def test_torchrun_dp2_logs_the_same_losses(byte_cache, tmp_path):
    single = fivecut(*train_args(byte_cache, str(tmp_path / "one")))
    assert single.returncode == 0, single.stderr
    double = torchrun(2, *train_args(byte_cache, str(tmp_path / "two")), "--set", "parallel.dp=2")
    assert double.returncode == 0, double.stderr
    np.testing.assert_allclose(losses(tmp_path / "two"), losses(tmp_path / "one"), rtol=1e-5)


def test_torchrun_with_the_wrong_world_size_names_the_fix(byte_cache, tmp_path):
    run = torchrun(2, *train_args(byte_cache, str(tmp_path)))
    assert run.returncode != 0
    assert "2 processes" in run.stderr and "parallel.dp=2" in run.stderr


@pytest.mark.multirank
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_ledger_zero_matches_volume_and_memory(byte_cache, stage):
    run = fivecut("ledger", "--layout", f"dp=4,zero={stage}", "--set", f'data.cache_dir="{byte_cache}"')
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.strip().splitlines()
    assert_every_cut_exact(run.stdout)
    memory = next(line for line in lines if line.startswith("memory_ratio="))
    assert abs(float(memory.split("=")[1]) - 1) <= 0.05  # measured model-state bytes within 5% of the formula
    assert "reduce_scatter" in run.stdout and "all_gather" in run.stdout


@pytest.mark.multirank
@pytest.mark.parametrize("layout", ["tp=2", "tp=2,sp=true"])
def test_ledger_tensor_parallel_volume_and_activations(byte_cache, layout):
    run = fivecut("ledger", "--layout", layout, "--set", f'data.cache_dir="{byte_cache}"')
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.strip().splitlines()
    assert_every_cut_exact(run.stdout)
    activations = next(line for line in lines if line.startswith("activation_ratio="))
    assert abs(float(activations.split("=")[1]) - 1) <= 0.10  # measured saved bytes within 10% of the formula
    assert "SP cuts activations by" in run.stdout


@pytest.mark.multirank
def test_ledger_pipeline_boundaries(byte_cache):
    run = fivecut("ledger", "--layout", "pp=2,microbatches=4", "--set", f'data.cache_dir="{byte_cache}"')
    assert run.returncode == 0, run.stdout + run.stderr
    assert_every_cut_exact(run.stdout)
    assert_activations_exact(run.stdout)  # microbatch 0's saved bytes, per layer, on rank 0
    assert "send" in run.stdout and "recv" in run.stdout


@pytest.mark.multirank
@pytest.mark.parametrize(
    "layout,options",
    [
        ("dp=2,ep=2", []),
        # EPLB's copies stacked beside the owned experts for the one grouped GEMM, in bf16
        ("dp=2,ep=2", ["--set", "moe.eplb_slots=1", "--set", 'train.dtype="bf16"']),
        ("dp=2,tp=2,sp=true,ep=2", ["--set", "moe.capacity_factor=1.5", "--set", "moe.aux_loss_coef=0.01"]),
    ],
)
def test_ledger_expert_parallel_from_routing_counts(byte_cache, layout, options):
    run = fivecut(
        "ledger", "--model", "tiny-moe", "--layout", layout, "--set", f'data.cache_dir="{byte_cache}"', *options
    )
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.strip().splitlines()
    assert_every_cut_exact(run.stdout)
    assert_memory_exact(run.stdout)
    assert any(x.startswith("ep ") and "routing counts" in x for x in lines)  # dispatch + combine, to the byte
    if "moe.capacity_factor=1.5" not in options:  # dropless: the MoE block's saved activations follow the formula
        assert_activations_exact(run.stdout)


@pytest.mark.multirank
@pytest.mark.parametrize("mode", ["ulysses", "ring"])
def test_ledger_context_parallel(byte_cache, mode):
    run = fivecut("ledger", "--layout", f"cp=2,cp_mode={mode}", "--set", f'data.cache_dir="{byte_cache}"')
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.strip().splitlines()
    assert_every_cut_exact(run.stdout)
    assert_memory_exact(run.stdout)
    assert any(line.startswith("cp ") and mode in line for line in lines)
    assert_activations_exact(run.stdout)


def test_bad_pipeline_is_refused_before_start():
    run = fivecut("verify", "--layout", "pp=2,pp_schedule=interleaved,pp_virtual=2,microbatches=3", timeout=60)
    assert run.returncode != 0
    assert "microbatches=3 is not a multiple of pp=2" in run.stderr
