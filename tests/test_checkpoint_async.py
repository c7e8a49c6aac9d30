"""Background saves (`checkpoint.async_mode`): the state staged into host memory is what the step
saved, whatever the steps after it do while the writer writes; a resume from it is bitwise the
uninterrupted run on the same layout.

The run saves step 3 in the background while step 4 trains (DCP's staging copy made slow, so that
step 4's forward and backward run before it is complete and its optimizer step would mutate the
live state under it if the step did not wait for it; the writer made slow, so that step 4's optimizer
step surely mutates the live state before the files are written), ends its launch after step 4,
and loses the checkpoint of step 4 (as a run killed then would); the next launch resumes from step
3 and its losses of steps 4-6 equal the uninterrupted run's (==).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from test_faults import children, rank_of, wait_for_step
from torch.distributed.checkpoint._state_dict_stager import StateDictStager

from fivecut.cli import main
from fivecut.config import load_config
from fivecut.launch import spawn
from fivecut.plan.cost import staging_bytes
from fivecut.train import checkpoint, trainer
from fivecut.train.trainer import train
from fivecut.weights.load import model_args

pytestmark = pytest.mark.multirank
QUICK = ["train.seq_len=32", "train.global_batch=4", "train.warmup=1", "train.eval_every=0", "log.peak_tflops=1.0"]
QUIET = ["log.progress=false", "log.plot=false"]


class SlowWriter(dcp.FileSystemWriter):
    """DCP's writer, which waits before it writes: the steps after the save train meanwhile."""

    def write_data(self, plan, planner):
        time.sleep(1.0)
        return super().write_data(plan, planner)


def slow_copy(stage):
    """DCP's staging copy, which waits before it copies: the next step's forward and backward run meanwhile."""

    def staged(self, state_dict, non_blocking=False):
        time.sleep(1.0)
        return stage(self, state_dict, non_blocking)

    return staged


def run_rank(cfg, resume: str, slow: bool) -> list[float]:
    if slow:
        dcp.FileSystemWriter = SlowWriter
        StateDictStager.stage = slow_copy(StateDictStager.stage)
    return train(cfg, quiet=dist.get_rank() != 0, resume=resume).losses


def config(cache: str, out: Path, *extra: str):
    return load_config(None, [*QUICK, *QUIET, f'data.cache_dir="{cache}"', f'log.out_dir="{out}"', *extra])


MOE = ('model.preset="tiny-moe"', "moe.bias_update_rate=0.01", "moe.eplb_slots=1", "moe.eplb_interval=2")
LAYOUTS = {  # each on 2 ranks but hybrid sharding (4); "dp=2,zero=1" runs by default, the others under sweep
    "dp=2,zero=1": ("parallel.dp=2", "parallel.zero=1"),
    "dp=2,zero=3": ("parallel.dp=2", "parallel.zero=3"),
    "tp=2,sp": ("parallel.tp=2", "parallel.sp=true"),
    "pp=2 1f1b": ("parallel.pp=2", "parallel.microbatches=2"),
    "moe dp=2,ep=2": ("parallel.dp=2", "parallel.ep=2", *MOE),
    "hybrid dp=4,zero=3,zero_shard=2": ("parallel.dp=4", "parallel.zero=3", "parallel.zero_shard=2"),
}


@pytest.mark.parametrize(
    "case", [c if c == "dp=2,zero=1" else pytest.param(c, marks=pytest.mark.sweep) for c in LAYOUTS]
)
def test_a_background_save_resumes_bitwise(byte_cache, tmp_path, case):
    """Thread writers ("process": under torchrun, below: spawn's ranks are daemons)."""
    mode, layout = "thread", ("train.steps=6", *LAYOUTS[case])
    world = 4 if case.startswith("hybrid") else 2
    reference = spawn(run_rank, world, config(byte_cache, tmp_path / "ref", *layout), "never", False)[0]
    ck, out = tmp_path / "ck", tmp_path / "run"
    saving = (f'checkpoint.dir="{ck}"', "checkpoint.every=3", f'checkpoint.async_mode="{mode}"', "train.launch_steps=4")
    cfg = config(byte_cache, out, *layout, *saving)
    first = spawn(run_rank, world, cfg, "never", True)[0]
    assert [p.name for p in checkpoint.checkpoints(ck)] == ["step-00000003", "step-00000004"]
    saves = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if '"checkpoint"' in line]
    assert [s["step"] for s in saves] == [3, 4], saves
    times = saves[0]["checkpoint"]
    assert times["start_s"] < 1.0 < times["staging_s"] < times["total_s"] - 1.0, saves  # copied, then written
    assert times["staging_wait_s"] > 0 and times["blocking_s"] >= times["start_s"] + times["staging_wait_s"], saves
    shutil.rmtree(ck / "step-00000004")  # the run was killed before step 4's save
    resumed = spawn(run_rank, world, cfg, "auto", False)[0]
    assert first == reference[:4] and resumed == reference[3:]  # bitwise


def signalled_at(step: int, real):
    """`trainer.forward_backward`, which sends this process SIGINT during `step`."""

    def forward_backward(ctx, at, activations=None):
        if at == step:
            signal.raise_signal(signal.SIGINT)
        return real(ctx, at, activations)

    return forward_backward


@pytest.mark.parametrize("mode", ["thread"])
def test_a_signal_finishes_the_save_in_flight_and_its_own_before_exit(byte_cache, tmp_path, monkeypatch, capsys, mode):
    """SIGINT during step 3, while step 2's save is still writing: both saves are in place at exit."""
    ck = tmp_path / "ck"
    monkeypatch.setattr(dcp, "FileSystemWriter", SlowWriter)
    monkeypatch.setattr(trainer, "forward_backward", signalled_at(3, trainer.forward_backward))
    items = [*QUICK, *QUIET, f'data.cache_dir="{byte_cache}"', f'log.out_dir="{tmp_path / "out"}"', "train.steps=6"]
    items += [f'checkpoint.dir="{ck}"', "checkpoint.every=2", f'checkpoint.async_mode="{mode}"', "checkpoint.keep=5"]
    assert main(["train", *(arg for item in items for arg in ("--set", item))]) == 130
    assert capsys.readouterr().err == "fivecut: stopped by SIGINT after step 3\n"
    assert [p.name for p in checkpoint.checkpoints(ck)] == ["step-00000002", "step-00000003"]
    assert not list(ck.glob(".tmp-*"))


def torchrun(cache: str, out: Path, *extra: str) -> dict[int, float]:
    """`fivecut train` on 2 ranks under torchrun (a writer process needs ranks that may have children)."""
    items = [*QUICK, *QUIET, f'data.cache_dir="{cache}"', f'log.out_dir="{out}"', *extra]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=0"]
    command += ["-m", "fivecut", "train", *(arg for item in items for arg in ("--set", item))]
    job = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert job.returncode == 0, job.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


@pytest.mark.sweep
@pytest.mark.e2e
def test_a_save_by_a_writer_process_resumes_bitwise(byte_cache, tmp_path):
    layout = ("train.steps=6", "parallel.dp=2", "parallel.zero=1")
    reference = torchrun(byte_cache, tmp_path / "ref", *layout)
    ck, out = tmp_path / "ck", tmp_path / "run"
    saving = (f'checkpoint.dir="{ck}"', "checkpoint.every=3", 'checkpoint.async_mode="process"', "train.launch_steps=4")
    first = torchrun(byte_cache, out, *layout, *saving)
    assert [p.name for p in checkpoint.checkpoints(ck)] == ["step-00000003", "step-00000004"]
    shutil.rmtree(ck / "step-00000004")  # the run was killed before step 4's save
    resumed = torchrun(byte_cache, out, *layout, *saving)
    assert first == {s: reference[s] for s in range(1, 5)} and resumed == {s: reference[s] for s in range(1, 7)}


def writer_of(rank_pid: int) -> int | None:
    """DCP's writer process of the rank process `rank_pid` (a multiprocessing child, spawned)."""
    for pid in children(rank_pid):
        try:
            if b"spawn_main" in (Path("/proc") / str(pid) / "cmdline").read_bytes():
                return pid
        except OSError:
            continue
    return None


@pytest.mark.sweep
@pytest.mark.e2e
def test_a_killed_writer_process_costs_its_save_only(byte_cache, tmp_path):
    """SIGKILL of rank 1's writer process: that save fails on every rank (checkpoint.on_error =
    "continue": said and recorded), new writers start, and the later saves are in place."""
    ck, out = tmp_path / "ck", tmp_path / "run"
    items = [*QUICK, *QUIET, "log.log_every=1", f'data.cache_dir="{byte_cache}"', f'log.out_dir="{out}"']
    items += ["train.steps=80", "parallel.dp=2", f'checkpoint.dir="{ck}"', "checkpoint.every=2", "checkpoint.keep=100"]
    items += ['checkpoint.async_mode="process"', 'checkpoint.on_error="continue"']
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=0"]
    command += ["-m", "fivecut", "train", *(arg for item in items for arg in ("--set", item))]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_step(out, 10, proc, limit=240)  # the writers run (the first save is at step 2)
    ranks = {rank_of(pid): pid for pid in children(proc.pid)}
    os.kill(writer_of(ranks[1]), signal.SIGKILL)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-3000:]
    failed = [
        json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if "checkpoint_failed" in line
    ]
    assert len(failed) == 1 and "the writer failed" in failed[0]["checkpoint_failed"], failed
    said = [line for line in stdout.splitlines() if "was not saved" in line]
    assert len(said) == 1 and f"checkpoint of step {failed[0]['step']}" in said[0], stdout[-2000:]
    saved = [int(p.name.split("-")[1]) for p in checkpoint.checkpoints(ck)]
    assert failed[0]["step"] not in saved and saved[-1] == 80 and saved[-2] > failed[0]["step"]


@pytest.mark.sweep
@pytest.mark.e2e
def test_a_rank_killed_while_saves_write_leaves_the_previous_checkpoint(byte_cache, tmp_path):
    """SIGKILL of rank 1 while a background save is in flight (one is every step): the run ends,
    the newest complete checkpoint is whole, and the next launch resumes from it bitwise."""
    ck, out = tmp_path / "ck", tmp_path / "run"
    layout = ("train.steps=30", "parallel.dp=2")
    saving = (f'checkpoint.dir="{ck}"', "checkpoint.every=1", 'checkpoint.async_mode="thread"', "log.log_every=1")
    items = [*QUICK, *QUIET, f'data.cache_dir="{byte_cache}"', f'log.out_dir="{out}"', *layout, *saving]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=0"]
    command += ["-m", "fivecut", "train", *(arg for item in items for arg in ("--set", item))]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_step(out, 12, proc, limit=240)
    os.kill({rank_of(pid): pid for pid in children(proc.pid)}[1], signal.SIGKILL)
    proc.communicate(timeout=300)
    assert proc.returncode != 0
    newest = checkpoint.newest(ck)
    assert newest is not None and checkpoint.quick_problem(newest) is None
    assert main(["checkpoint", "info", str(newest)]) == 0  # every file against its sha256
    resumed = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0 and f"resumed at step {int(newest.name[5:])}" in resumed.stdout, resumed.stderr
    reference = torchrun(byte_cache, tmp_path / "ref", *layout)
    after = {s: v for s, v in torchrun_losses(out).items() if s > int(newest.name[5:])}
    assert after == {s: v for s, v in reference.items() if s > int(newest.name[5:])}


def torchrun_losses(out: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


STAGED = [  # tiny by default; small dp=2 (the case) and MoE under sweep
    ("tiny", ("parallel.dp=2", "parallel.zero=1")),
    ("small", ("parallel.dp=2",)),
    ("tiny-moe", ("parallel.dp=2", "parallel.ep=2", "parallel.zero=3")),
]


@pytest.mark.parametrize(
    "model,layout", [c if c[0] == "tiny" else pytest.param(*c, marks=pytest.mark.sweep) for c in STAGED]
)
def test_the_plans_staging_memory_is_what_the_stager_held(byte_cache, tmp_path, model, layout):
    """The plan's host memory of a background save (`fivecut.plan.cost.staging_bytes`) against the
    bytes DCP's stager held after a save of the same run (metrics.jsonl's staged_bytes): within 5%."""
    ck, out = tmp_path / "ck", tmp_path / "run"
    saving = (f'checkpoint.dir="{ck}"', 'checkpoint.async_mode="thread"', "checkpoint.verify=false")
    cfg = config(byte_cache, out, f'model.preset="{model}"', *layout, "train.steps=1", *saving)
    spawn(run_rank, 2, cfg, "never", False)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    staged = next(r["checkpoint"]["staged_bytes"] for r in records if "checkpoint" in r)
    planned = staging_bytes(model_args(cfg.model), cfg)
    assert abs(planned / staged - 1) <= 0.05, (planned, staged)
