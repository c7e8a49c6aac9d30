"""Every benchmark and script runs as a user runs it (`python benchmarks/x.py ...`) at its smallest
size: it starts, runs and prints its report. The figures are not checked (they belong in
benchmarks/RESULTS.md, measured on a quiet machine); that the report is printed is. The shell
scripts are checked in tests/test_scripts.py. Each run here is a few seconds to ~20 s on a loaded
2-core machine."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fivecut.parallel.pipeline.schedule import build_schedule
from fivecut.parallel.pipeline.simulate import simulate

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 240  # a stuck run fails here rather than hanging the suite


def run_script(path: str, *args: str, cwd: Path) -> str:
    """`python <path> <args>` from `cwd`, with this checkout importable; its stdout. Fails with the
    run's own output when it exits non-zero."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, str(ROOT / path), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S
    )
    assert result.returncode == 0, f"{path} exited {result.returncode}:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    return result.stdout


# ---------------------------------------------------------------- side by side with PyTorch

SMALLEST = ["--steps", "1", "--repeats", "1", "--warmup", "0"]  # one timed step per candidate


def test_ddp_benchmark_reports(tmp_path):
    out = run_script("benchmarks/ddp.py", *SMALLEST, "--batch", "2", "--seq", "16", cwd=tmp_path)
    assert "| ratio fivecut / torch |" in out and out.rstrip().splitlines()[-1].startswith("ratio=")


def test_tensor_benchmark_reports(tmp_path):
    out = run_script("benchmarks/tensor.py", *SMALLEST, "--sp", "--batch", "2", "--seq", "16", cwd=tmp_path)
    assert "ratio fivecut / DTensor" in out and out.rstrip().splitlines()[-1].startswith("ratio_tp_sp=")


def test_zero_benchmark_reports(tmp_path):
    out = run_script("benchmarks/zero.py", *SMALLEST, "--only", "zero3", "--batch", "2", "--seq", "16", cwd=tmp_path)
    assert out.rstrip().splitlines()[-1].startswith("ratio_zero3_vs_fsdp2=")


def test_hsdp_benchmark_reports(tmp_path):
    args = ["--world", "2", "--shard", "1", *SMALLEST, "--batch", "2", "--seq", "16"]
    out = run_script("benchmarks/hsdp.py", *args, cwd=tmp_path)
    assert "| torch FSDP2 HSDP |" in out and out.rstrip().splitlines()[-1].startswith("ratio_hsdp_vs_fsdp2=")


def test_recompute_benchmark_reports(tmp_path):
    args = ["--model", "tiny", *SMALLEST, "--batch", "1", "--seq", "16"]
    out = run_script("benchmarks/recompute.py", *args, cwd=tmp_path)
    assert "| full |" in out and out.rstrip().splitlines()[-1].startswith("ratio_full=")


def test_context_benchmark_reports(tmp_path):
    args = ["--model", "tiny", "--cp", "2", "--seq", "64", "--batch", "1", *SMALLEST]
    out = run_script("benchmarks/context.py", *args, cwd=tmp_path)
    assert "| one device |" in out and out.rstrip().splitlines()[-1].startswith("ratio_ring_ulysses=")


# ---------------------------------------------------------------- pipeline: vs torch, bubbles vs the simulator

PIPELINE_SMALLEST = [*SMALLEST, "--batch", "4", "--seq", "16", "--microbatches", "2", "--bubble-microbatches", "4"]


def test_pipeline_benchmark_reports_all_three_parts(tmp_path):
    """Part 1 (1F1B vs torch), part 2 (every schedule's measured idle vs the simulator, whose report
    once crashed on a simulator internal that had gone) and part 3 (the zero-bubble schedules vs
    torch's), one step each."""
    args = [*PIPELINE_SMALLEST, "--bubble-steps", "1", "--bubble-repeats", "1", "--vs-torch-zb"]
    out = run_script("benchmarks/pipeline.py", *args, cwd=tmp_path)
    assert "ratio fivecut / torch" in out  # part 1
    assert "Idle fraction per rank, measured (means over steps) and simulated:" in out  # part 2
    assert "| dualpipev | 1 |" in out and "+comm" in out
    assert "ratio fivecut zb1p / torch ScheduleInterleavedZeroBubble" in out  # part 3
    assert out.count("CPU time per step, medians") == 4  # part 1's pair and part 3's three
    assert out.rstrip().splitlines()[-1].startswith("ratio_1f1b=")


def test_simulator_takes_measured_costs_per_stage_and_a_send_cost():
    """What part 2 of the pipeline benchmark simulates with: one cost per (kind, stage), falling
    back to the kind's; a send that occupies its rank; a message's latency."""
    sch = build_schedule("gpipe", 2, 1)  # rank 0: F0 SEND_F RECV_B B0; rank 1: RECV_F F1 B1 SEND_B
    plain = simulate(sch, 1.0, 2.0)
    assert plain.makespan == 1 + 1 + 2 + 2
    per_stage = simulate(sch, 1.0, 2.0, stage_costs={("F", 1): 3.0, ("B", 1): 5.0})
    assert per_stage.makespan == 1 + 3 + 5 + 2  # stage 0 keeps the kind's costs
    assert per_stage.busy(1) == 8 and per_stage.idle_fraction(0) == 1 - 3 / 11
    sending = simulate(sch, 1.0, 2.0, cost_comm=0.25, stage_costs={("F", 1): 3.0}, cost_send=0.5)
    # F0 ends at 1, its send is posted then and arrives at 1.25 (rank 0 is busy sending until 1.5);
    # F1, B1, the send back posted at 6.25 arrives at 6.5; B0 until 8.5 (rank 1 ends its send at 6.75)
    assert sending.makespan == 1 + 0.25 + 3 + 2 + 0.25 + 2
    assert [end for _, _, end in sending.rows[0]] == [1, 1.5, 6.5, 8.5]
    with pytest.raises(ValueError, match="must not be negative"):
        simulate(sch, stage_costs={("W", 0): -1.0})
