"""Every benchmark and script runs as a user runs it (`python benchmarks/x.py ...`) at its smallest
size: it starts, runs and prints its report. The figures are not checked (they belong in
benchmarks/results/, indexed by benchmarks/RESULTS.md, measured on a quiet machine); that the
report is printed is. The shell scripts are checked in tests/test_scripts.py. Each run here is a
few seconds to ~20 s on a loaded 2-core machine."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch import nn

from fivecut.parallel.pipeline.schedule import build_schedule
from fivecut.parallel.pipeline.simulate import simulate
from fivecut.parallel.pipeline.wgrad import WeightGrads, defer_weight_grads

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 240  # a stuck run fails here rather than hanging the suite


def run_script(path: str, *args: str, cwd: Path) -> str:
    """`python <path> <args>` from `cwd`, with this checkout importable; its stdout. Fails with the
    run's own output when it exits non-zero."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, str(ROOT / path), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S
    )
    tail = f"{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    assert result.returncode == 0, f"{path} exited {result.returncode}:\n{tail}"
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
    """The smallest hybrid: 4 ranks, shard groups of 2, 2 replicas."""
    args = ["--world", "4", "--shard", "2", *SMALLEST, "--batch", "2", "--seq", "16"]
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
    assert "| dualpipev | 4 |" in out and "+comm" in out  # its row of costs (4 stages) and its timelines
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


@pytest.mark.sweep  # torch.compile of each block: 30-100 s on 2 loaded cores, whatever the size
def test_compile_benchmark_reports(tmp_path):
    args = ["--model", "tiny", *SMALLEST, "--batch", "1", "--seq", "16"]
    out = run_script("benchmarks/compile.py", *args, cwd=tmp_path)
    assert "| compiled |" in out and out.rstrip().splitlines()[-1].startswith("ratio_compile=")


def test_checkpoint_benchmark_reports(tmp_path):
    args = ["--model", "tiny", "--layouts", "single", "--repeats", "1", "--seq", "16", "--batch", "2"]
    out = run_script("benchmarks/checkpoint.py", *args, "--dir", str(tmp_path), cwd=tmp_path)
    assert "| torch.save / torch.load, 1 process |" in out and "seconds per repeat: single:" in out


@pytest.mark.sweep  # three torchrun jobs (~45 s on the 2-core machine)
def test_checkpoint_async_benchmark_reports(tmp_path):
    args = ["--model", "tiny", "--saves", "2", "--every", "1", "--seq", "16", "--batch", "2", "--dir", str(tmp_path)]
    out = run_script("benchmarks/checkpoint_async.py", *args, cwd=tmp_path)
    assert "| async_mode | blocking (median) |" in out and out.rstrip().splitlines()[-1].startswith("blocking_process")


def test_generate_benchmark_reports(tmp_path):
    args = ["--models", "small", "--prompt-tokens", "4", "--new-tokens", "2", "--repeats", "1", "--steps", "1"]
    out = run_script("benchmarks/generate.py", *args, "--warmup", "0", cwd=tmp_path)
    assert "| small | transformers generate |" in out and out.rstrip().splitlines()[-1].startswith("ratio=")


# ---------------------------------------------------------------- training statistics, the planner, weights


def test_moe_balance_benchmark_reports(tmp_path):
    """Past step 10, where EPLB first re-plans; fewer steps than the default lr warm-up are allowed."""
    args = ["--steps", "11", "--dp", "2", "--ep", "2", "--window", "1", "--only", "moves + 1"]
    out = run_script("benchmarks/moe_balance.py", *args, cwd=tmp_path)
    assert "| unbalanced + EPLB moves + 1 extra slot |" in out


def test_plan_speed_benchmark_reports(tmp_path):
    out = run_script("benchmarks/plan_speed.py", "8b", "--out", str(tmp_path / "ranking.json"), cwd=tmp_path)
    assert out.startswith("8b: search ") and "layouts costed" in out
    assert json.loads((tmp_path / "ranking.json").read_text())["ranked"]


def test_plan_check_benchmark_reports(tmp_path):
    """One layout, one run, with a stored calibration from benchmarks/plan_check/ (no calibration here)."""
    cluster = ROOT / "benchmarks" / "plan_check" / "plan_check.run11.cluster2.toml"
    args = ["--only", "tiny dp=2,zero=1", "--runs", "1", "--steps", "3", "--cluster", str(cluster)]
    out = run_script("benchmarks/plan_check.py", *args, "--out", str(tmp_path / "table.md"), cwd=tmp_path)
    assert "| tiny | dp=2,zero=1 |" in out and "planned step within 25% of the measured median:" in out
    assert (tmp_path / "table.md").exists() and (tmp_path / "table.cluster2.toml").exists()


@pytest.mark.sweep  # the real 135M model has no smaller size: read, shuffled, written and read again (40-50 s)
def test_smollm2_eval_benchmark_reports(tmp_path):
    sizes = ["--batches", "1", "--batch-size", "1", "--seq-len", "16"]
    out = run_script("benchmarks/smollm2_eval.py", *sizes, cwd=tmp_path)
    assert out.count("eval: ") == 2 and "hf:" in out and "perplexity" in out


# ---------------------------------------------------------------- scripts/


def test_parity_matrix_script_runs_a_row_and_writes_its_table(tmp_path):
    table = tmp_path / "parity.md"
    out = run_script("scripts/parity_matrix.py", "--only", "tp2-sp", "--steps", "1", "--out", str(table), cwd=tmp_path)
    assert "1 rows in" in out and "FAIL: none" in out
    assert "| tp2-sp | tiny | `tp=2,sp=true` | 2 | 1 |" in table.read_text()


# ---------------------------------------------------------------- the W pass's kept dW buffers (the zb1p speed-up)


def test_loss_benchmark_reports(tmp_path):
    out = run_script("benchmarks/loss.py", "--preset", "tiny", "--batch", "1", "--seq", "32", "--chunk", "8",
                     "--repeats", "1", "--dtype", "fp32", "--device", "cpu", cwd=tmp_path)  # fmt: skip
    assert "chunked" in out.splitlines()[-1]


def test_moe_experts_benchmark_reports(tmp_path):
    out = run_script("benchmarks/moe_experts.py", "--steps", "1", "--repeats", "1", cwd=tmp_path)
    assert "grouped / loop" in out and out.count("| tiny-moe |") == 1


def test_cast_once_benchmark_reports(tmp_path):
    out = run_script("benchmarks/cast_once.py", "--microbatches", "2", "--steps", "1", cwd=tmp_path)
    assert out.rstrip().splitlines()[-1].startswith("ratio_step=")


@pytest.mark.sweep  # three exports each measured in a fresh process (~40-80 s); export's own tests run by default
def test_export_memory_benchmark_reports(tmp_path):
    out = run_script("benchmarks/export_memory.py", "--params", "2e6", cwd=tmp_path)
    assert "| export |" in out and "| whole |" in out


def test_w_reuses_one_buffer_per_shape_bitwise_and_fires_the_hooks():
    """Once `.grad` exists (a data cut's bucket view, or an earlier microbatch), W computes each
    linear layer's dW into a buffer it keeps per shape and adds it into `.grad` in place: two
    layers of one shape share the buffer within a record, `.grad` stays the same tensor, every
    hook fires once per microbatch, and the gradients are bitwise a plain backward's."""
    torch.manual_seed(5)
    plain = nn.Sequential(nn.Linear(8, 8, bias=False), nn.Tanh(), nn.Linear(8, 8, bias=False), nn.Linear(8, 3))
    split, grads = copy.deepcopy(plain), WeightGrads()
    defer_weight_grads(split, grads)
    buckets = [torch.zeros_like(p) for p in split.parameters()]  # as DataParallel's flat bucket views
    for p, b in zip(split.parameters(), buckets):
        p.grad = b
    fired = Counter()
    for name, p in split.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, n=name: fired.update([n]))
    for m in range(3):
        x = torch.randn(2, 5, 8)  # [b, s, h] received from the previous stage: it takes a gradient
        plain(x.clone().requires_grad_()).square().sum().backward()
        with grads.collecting(stage=0, microbatch=m):
            split(x.clone().requires_grad_()).square().sum().backward()
        assert len(grads.pending[(0, m)]) == 3  # every weight's dW waits for W
        grads.apply(stage=0, microbatch=m)
    assert sorted(tuple(shape) for shape, _ in grads.scratch) == [(3, 8), (8, 8)]
    assert all(p.grad is b for p, b in zip(split.parameters(), buckets))
    assert fired["0.weight"] == fired["2.weight"] == fired["3.weight"] == 3
    for p, q in zip(split.parameters(), plain.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_document_mask_benchmark_reports(tmp_path):
    args = ["--batch", "1", "--seq", "64", "--heads", "2", "--head-dim", "16", "--doc", "16", *SMALLEST]
    out = run_script("benchmarks/document_mask.py", *args, cwd=tmp_path)
    assert "| sdpa-bool |" in out and out.rstrip().splitlines()[-1].startswith("fastest=")


def test_memory_check_benchmark_reports(tmp_path):
    """The plan beside one step on fake tensors, at its tiny case (tiny, pp=2: both stages' moments)."""
    out = run_script("benchmarks/memory_check.py", "--smallest", "--out", str(tmp_path / "table.md"), cwd=tmp_path)
    assert "| tiny | 1x2xH100 pp=2,microbatches=2" in out and (tmp_path / "table.md").exists()


def test_eager_traffic_benchmark_reports(tmp_path):
    """The counts behind the GPU presets' memory-bound rates, at `tiny`'s shape (meta device: no device time)."""
    out = run_script("benchmarks/eager_traffic.py", "--model", "tiny", "--rows", "1", "--seq", "16", cwd=tmp_path)
    assert "| a block |" in out and out.rstrip().splitlines()[-1].startswith("block_ratio=")


def test_plan_gpu_benchmark_reports(tmp_path):
    """The planner beside gpu_step.py's measured steps (here a made-up measurement of `tiny`)."""
    steps = tmp_path / "gpu_step.json"
    steps.write_text(json.dumps({"fivecut-eager": {"tokens_per_s": 1e6}, "fivecut-full-logits": {"error": "x"}}))
    flags = ["--steps", str(steps), "--cluster", "1x1xH200", "--model", "tiny", "--seq", "32", "--batch", "2"]
    out = run_script("benchmarks/plan_gpu.py", *flags, cwd=tmp_path)
    assert "| fivecut-eager | 1,000,000 |" in out and out.rstrip().splitlines()[-1].startswith("within_10%[1x1xH200]=")


def test_data_store_benchmark_reports(tmp_path):
    out = run_script(
        "benchmarks/data_store.py",
        *("--tokens", "20000", "--memory-cap-mb", "2", "--loader-steps", "3", "--step-preset", "tiny"),
        *("--shapes", "2x16", "--repeats", "1"),
        cwd=tmp_path,
    )
    assert "| fivecut store, 2 workers |" in out and "loader share" in out and "peak resident memory" in out
    assert out.rstrip().splitlines()[-1].startswith("ratio_two_workers_vs_datasets_map=")


def test_import_memory_benchmark_reports(tmp_path):
    out = run_script("benchmarks/import_memory.py", "--params", "2e6", cwd=tmp_path)
    assert "| pp=2 | 1 |" in out and "| tp=2 | 1 |" in out


def test_sliding_window_benchmark_reports(tmp_path):
    args = ["--seq", "64", "--window", "16", "--steps", "1", "--repeats", "1", "--warmup", "0"]
    out = run_script("benchmarks/sliding_window.py", *args, cwd=tmp_path)
    assert "| fivecut: SDPA + band mask |" in out and out.rstrip().splitlines()[-1].startswith("ratio_flex_sdpa=")


def test_hf_moe_export_benchmark_reports(tmp_path):
    args = ("--dim", "64", "--layers", "2", "--experts", "8", "--vocab", "300", "--shard-mb", "0.05")
    out = run_script("benchmarks/hf_moe_export.py", *args, "--dir", str(tmp_path), cwd=tmp_path)
    assert "as DeepseekV3ForCausalLM" in out and out.rstrip().splitlines()[-1].startswith("export_over_model=")
