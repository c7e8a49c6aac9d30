"""Runs that end early: non-finite values, signals, a rank that stops answering."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import fivecut as fivecut_package
from fivecut import checks
from fivecut.cli import in_process
from fivecut.config import ConfigError, load_config
from fivecut.launch import spawn
from fivecut.train import checkpoint, run, trainer
from fivecut.train.faults import TrainingStopped
from fivecut.train.optim import lr_at

WORKER_CODE = str(Path(fivecut_package.__file__).parent)  # in a traceback of a rank's own code
QUICK = ["train.seq_len=32", "train.global_batch=4", "train.warmup=1", "train.eval_every=0"]
QUIET = ["log.progress=false", "log.plot=false", "log.log_every=1"]


def sets(cache: str, out: Path, *extra: str) -> list[str]:
    items = [*QUICK, *QUIET, f'data.cache_dir="{cache}"', f'log.out_dir="{out}"', *extra]
    return [arg for item in items for arg in ("--set", item)]


def fivecut(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fivecut", *args], capture_output=True, text=True, timeout=120)


def torchrun_command(nproc: int, *args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "--max-restarts=0",
        "-m",
        "fivecut",
        *args,
    ]


def records(out: Path) -> list[dict]:
    """metrics.jsonl, read as strict JSON (a bare NaN or Infinity fails)."""

    def refuse(token):
        raise ValueError(f"non-standard JSON constant {token}")

    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line, parse_constant=refuse) for line in lines]


def wait_for_step(out: Path, step: int, proc: subprocess.Popen, limit: float = 90) -> None:
    """Until rank 0 has logged `step` in metrics.jsonl."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        path = out / "metrics.jsonl"
        if path.exists() and sum(1 for line in path.read_text().splitlines() if line.endswith("}")) >= step:
            return
        assert proc.poll() is None, "the run ended before the step"
        time.sleep(0.05)
    raise AssertionError(f"step {step} not reached in {limit}s")


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "item,words",
    [
        ("train.collective_timeout=0", "train.collective_timeout=0.0 must be > 0"),
        ("train.on_nonfinite='ignore'", "train.on_nonfinite='ignore'; choose stop or skip"),
        ("train.max_skipped=0", "train.max_skipped=0 must be >= 1"),
    ],
)
def test_fault_keys_are_validated(item, words):
    with pytest.raises(ConfigError) as err:
        checks.validate(load_config(None, [item.replace("'", '"')]))
    assert words in str(err.value)


# ---------------------------------------------------------------- non-finite values
#
# Where a huge learning rate first overflows is chaotic (it moves by a step between AVX2 and
# AVX-512 kernels), so these tests make steps non-finite by construction: in-process runs whose
# forward-backward is wrapped to turn chosen steps' loss or one gradient element into inf, and
# CLI runs that resume from a checkpoint whose embedding is inf (every later step is NaN).


@dataclass
class Faults:
    """Steps made non-finite: "loss" (the loss is inf, the gradients intact) or "gradient" (one
    gradient element is inf, the loss finite), on `ranks` (None: every rank)."""

    steps: tuple[int, ...]
    kind: str = "gradient"
    ranks: tuple[int, ...] | None = None


@dataclass
class Outcome:
    """What a run with faults did: rank 0's metrics.jsonl, each step's starting state (the state
    after the step before), the state at the end, and the early stop (message, code) if any."""

    records: list[dict]
    before: dict[int, dict[str, torch.Tensor]]
    final: dict[str, torch.Tensor]
    stopped: tuple[str, int] | None


def training_state(ctx) -> dict[str, torch.Tensor]:
    """This rank's weights and AdamW state (both moments and the step count), copied."""
    state = {f"param.{name}": p.detach().clone() for name, p in ctx.par.params.items()}
    for i, moments in enumerate(ctx.optimizer.state.values()):
        state.update({f"optim.{i}.{key}": value.clone() for key, value in moments.items()})
    return state


def same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[key], b[key]) for key in a)


def with_faults(real, faults: Faults, before: dict, seen: dict):
    """`trainer.forward_backward`, made non-finite at `faults.steps`; notes each step's starting state."""

    def forward_backward(ctx, step, activations=None):
        seen["ctx"] = ctx
        before[step] = training_state(ctx)
        local = real(ctx, step, activations)
        if step not in faults.steps or (faults.ranks is not None and dist.get_rank() not in faults.ranks):
            return local
        if faults.kind == "loss":
            return torch.full_like(local, float("inf"))
        ctx.par.pieces[0].tensor.grad.view(-1)[0] = float("inf")
        return local

    return forward_backward


def train_with_faults(cfg, faults: Faults, resume: str = "never") -> Outcome:
    """`train` on this rank with `faults` (in-process as a world of one, or on a spawned rank)."""
    real, before, seen, stopped = trainer.forward_backward, {}, {}, None
    trainer.forward_backward = with_faults(real, faults, before, seen)
    try:
        trainer.train(cfg, resume=resume)
    except TrainingStopped as stop:
        stopped = (stop.message, stop.code)
    finally:
        trainer.forward_backward = real
    records = read_records(Path(cfg.log.out_dir)) if dist.get_rank() == 0 else []
    return Outcome(records, before, training_state(seen["ctx"]), stopped)


def read_records(out: Path) -> list[dict]:
    return records(out) if (out / "metrics.jsonl").exists() else []


def fault_config(cache: str, out: Path, *extra: str):
    """A quick run logging to `out` (log.peak_tflops given: no matmul timed for MFU in each run)."""
    items = [*QUICK, *QUIET, "log.peak_tflops=1.0", f'data.cache_dir="{cache}"', f'log.out_dir="{out}"']
    return load_config(None, [*items, *extra])


def lr_of(cfg, applied: int) -> float:
    """The learning rate of the `applied`-th update (the schedule counts applied updates only)."""
    t = cfg.train
    return lr_at(applied, t.lr, t.min_lr, t.warmup, t.steps)


def skips(outcome: Outcome) -> list[tuple[int, bool, int]]:
    return [(r["step"], r["skipped"], r["skipped_total"]) for r in outcome.records]


@pytest.mark.parametrize(
    "kind, words",
    [("loss", "non-finite loss=inf at step 3"), ("gradient", "non-finite gradient norm=inf at step 3")],
    ids=["loss", "gradient"],
)
def test_stop_names_the_step_and_saves_nothing_of_it(byte_cache, tmp_path, kind, words):
    ck = tmp_path / "ck"
    cfg = fault_config(
        byte_cache,
        tmp_path / "out",
        "train.steps=6",
        f'checkpoint.dir="{ck}"',
        "checkpoint.every=1",
        "checkpoint.keep=10",
    )
    outcome = in_process(train_with_faults, cfg, Faults((3,), kind))
    message, code = outcome.stopped
    assert code == 3 and message.startswith(words) and 'train.on_nonfinite="stop"' in message, message
    assert [r["step"] for r in outcome.records] == [1, 2]  # nothing logged for the bad step
    assert checkpoint_steps(ck) == [1, 2]


def test_a_skipped_step_changes_nothing_and_training_goes_on(byte_cache, tmp_path):
    cfg = fault_config(byte_cache, tmp_path, "train.steps=6", 'train.on_nonfinite="skip"', "train.max_skipped=2")
    outcome = in_process(train_with_faults, cfg, Faults((3,)))
    assert outcome.stopped is None
    assert skips(outcome) == [(1, False, 0), (2, False, 0), (3, True, 1), (4, False, 1), (5, False, 1), (6, False, 1)]
    assert outcome.records[2]["grad_norm"] is None  # inf is written as null
    assert same_state(outcome.before[4], outcome.before[3])  # weights, both Adam moments, Adam's step count
    assert not same_state(outcome.before[3], outcome.before[2]) and not same_state(outcome.before[5], outcome.before[4])
    applied = {1: 1, 2: 2, 4: 3, 5: 4, 6: 5}  # the step after a skip takes the update the skipped one would have
    assert {r["step"]: r["lr"] for r in outcome.records if not r["skipped"]} == {
        step: lr_of(cfg, n) for step, n in applied.items()
    }


@pytest.mark.parametrize(
    "bad, steps, stopped",
    [
        ((2, 4, 5, 6), [1, 2, 3, 4, 5, 6], "3 non-finite steps in a row up to step 6 (train.max_skipped=3); stopped"),
        ((2, 3, 5, 6), [1, 2, 3, 4, 5, 6, 7, 8], None),
    ],
    ids=["three in a row after a lone skip", "four skips, never three in a row"],
)
def test_max_skipped_counts_skips_in_a_row_exactly(byte_cache, tmp_path, bad, steps, stopped):
    cfg = fault_config(byte_cache, tmp_path, "train.steps=8", 'train.on_nonfinite="skip"', "train.max_skipped=3")
    outcome = in_process(train_with_faults, cfg, Faults(bad, "loss"))
    assert outcome.stopped == (None if stopped is None else (stopped, 3))
    total = lambda step: sum(b <= step for b in bad)  # noqa: E731
    assert skips(outcome) == [(s, s in bad, total(s)) for s in steps]


def test_skipped_steps_are_restored_on_resume(byte_cache, tmp_path):
    """Resumed from step 4 of a run that skipped step 2: the count and the schedule go on as in that run."""
    ck = tmp_path / "ck"
    skip = (
        "train.steps=6",
        'train.on_nonfinite="skip"',
        f'checkpoint.dir="{ck}"',
        "checkpoint.every=2",
        "checkpoint.keep=3",
    )
    whole = in_process(train_with_faults, fault_config(byte_cache, tmp_path / "whole", *skip), Faults((2,)))
    cfg = fault_config(byte_cache, tmp_path / "resumed", *skip)
    resumed = in_process(train_with_faults, cfg, Faults(()), str(checkpoint.step_dir(ck, 4)))
    assert skips(resumed) == [(5, False, 1), (6, False, 1)]
    assert [r["lr"] for r in resumed.records] == [lr_of(cfg, 4), lr_of(cfg, 5)]
    assert [r["loss"] for r in resumed.records] == [r["loss"] for r in whole.records[4:]]  # bitwise: same process


@pytest.mark.multirank
def test_every_rank_skips_when_one_rank_sees_a_nonfinite_value(byte_cache, tmp_path):
    """Only rank 1's gradient is inf at step 2: both data-parallel ranks drop that update, so their
    replicas stay equal (and equal to their state after step 1)."""
    cfg = fault_config(byte_cache, tmp_path, "train.steps=3", 'train.on_nonfinite="skip"', "parallel.dp=2")
    rank0, rank1 = spawn(train_with_faults, 2, cfg, Faults((2,), ranks=(1,)), timeout_s=120)
    assert skips(rank0) == [(1, False, 0), (2, True, 1), (3, False, 1)]
    for outcome in (rank0, rank1):
        assert same_state(outcome.before[3], outcome.before[2])
    assert same_state(rank0.final, rank1.final)


def poisoned_checkpoint(cache: str, root: Path) -> Path:
    """checkpoint.dir of a run that trained two steps, its step-2 embedding then overwritten with inf
    (saved again): every step after a resume is NaN, whatever the kernels."""
    cfg = fault_config(cache, root / "first", "train.steps=2", f'checkpoint.dir="{root / "ck"}"')
    in_process(train_then_poison, cfg)
    return root / "ck"


def train_then_poison(cfg) -> None:
    trainer.train(cfg, quiet=True)
    ctx = run.setup(cfg)
    step = trainer.resume_from(ctx, "auto")
    with torch.no_grad():
        ctx.par.params["tok_embeddings.weight"].fill_(float("inf"))
    trainer.save_checkpoint(ctx, step)


@pytest.mark.e2e
def test_nonfinite_stop_names_the_step(byte_cache, tmp_path):
    ck = poisoned_checkpoint(byte_cache, tmp_path)
    run = fivecut("train", *sets(byte_cache, tmp_path / "out", "train.steps=20", f'checkpoint.dir="{ck}"'))
    assert run.returncode == 3, run.stderr
    assert run.stderr.strip().splitlines() == [
        'fivecut: non-finite loss=nan and gradient norm=nan at step 3; stopped (train.on_nonfinite="stop"), '
        "nothing was saved for this step"
    ]
    assert read_records(tmp_path / "out") == [] and checkpoint_steps(ck) == [2]


@pytest.mark.e2e
def test_nonfinite_skip_counts_and_stops_after_max_skipped(byte_cache, tmp_path):
    ck = poisoned_checkpoint(byte_cache, tmp_path)
    extra = ("train.steps=20", 'train.on_nonfinite="skip"', "train.max_skipped=3", f'checkpoint.dir="{ck}"')
    run = fivecut("train", *sets(byte_cache, tmp_path / "out", *extra))
    assert run.returncode == 3, run.stderr
    assert run.stderr.strip().splitlines() == [
        "fivecut: 3 non-finite steps in a row up to step 5 (train.max_skipped=3); stopped"
    ]
    got = records(tmp_path / "out")
    assert [(r["step"], r["skipped"], r["skipped_total"]) for r in got] == [(3, True, 1), (4, True, 2), (5, True, 3)]
    assert got[-1]["grad_norm"] is None and got[-1]["loss"] is None  # a NaN is written as null
    assert "skipped (non-finite; 3 so far)" in run.stdout
    assert checkpoint_steps(ck) == [2]  # stopped without saving


def test_skip_changes_nothing_on_a_healthy_run(byte_cache, tmp_path):
    from fivecut.cli import run_spawned

    base = [*QUICK, "train.steps=4", f'data.cache_dir="{byte_cache}"', "log.progress=false", "log.plot=false"]
    losses = {}
    for policy in ("stop", "skip"):
        cfg = load_config(None, [*base, f'train.on_nonfinite="{policy}"'])
        losses[policy] = run_spawned(cfg, timeout=120)[0].losses
    assert losses["skip"] == losses["stop"]


# ---------------------------------------------------------------- signals


@pytest.mark.e2e
def test_sigint_finishes_the_step_and_exits_in_one_line(byte_cache, tmp_path):
    fivecut("train", *sets(byte_cache, tmp_path / "warm", "train.steps=1"))  # the token cache exists
    command = [sys.executable, "-m", "fivecut", "train", *sets(byte_cache, tmp_path, "train.steps=100000")]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wait_for_step(tmp_path, 5, proc)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    mentions = [line for line in err.splitlines() if "SIGINT" in line]
    last = records(tmp_path)[-1]["step"]
    assert mentions == [f"fivecut: stopped by SIGINT after step {last}"]


@pytest.mark.e2e
@pytest.mark.multirank
def test_sigterm_under_torchrun_stops_every_rank_after_the_same_step(byte_cache, tmp_path):
    fivecut("train", *sets(byte_cache, tmp_path / "warm", "train.steps=1"))
    args = sets(byte_cache, tmp_path, "train.steps=100000", "parallel.dp=2", f'checkpoint.dir="{tmp_path / "ck"}"')
    proc = subprocess.Popen(
        torchrun_command(2, "train", *args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    wait_for_step(tmp_path, 3, proc)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=90)
    assert WORKER_CODE not in out + err, err  # torchrun's agent prints its own SignalException; the ranks none
    last = records(tmp_path)[-1]["step"]
    mentions = sorted(re.findall(r"fivecut: rank \d+: stopped by .*? after step \d+", err))  # lines may interleave
    assert mentions == [f"fivecut: rank {r}: stopped by SIGTERM after step {last}" for r in (0, 1)], err
    # the ranks return 143, but torchrun's agent re-raises the signal as its SignalException: 1 (torch 2.13)
    assert proc.returncode == 1 and "SignalException" in err, err
    assert checkpoint_steps(tmp_path / "ck") == [last]  # saved before the ranks exited


# ---------------------------------------------------------------- a rank that stops answering


def children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def rank_of(pid: int) -> int | None:
    try:
        environ = (Path("/proc") / str(pid) / "environ").read_bytes().split(b"\0")
    except OSError:
        return None
    values = dict(item.split(b"=", 1) for item in environ if b"=" in item)
    return int(values[b"RANK"]) if b"RANK" in values else None


def finished(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] in "ZX"
    except OSError:
        return True


@pytest.mark.e2e
@pytest.mark.multirank
def test_a_stopped_rank_makes_the_other_fail_within_the_timeout(byte_cache, tmp_path):
    timeout = 10
    fivecut("train", *sets(byte_cache, tmp_path / "warm", "train.steps=1"))
    args = sets(byte_cache, tmp_path, "train.steps=100000", "parallel.dp=2", f"train.collective_timeout={timeout}")
    proc = subprocess.Popen(
        torchrun_command(2, "train", *args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    stopped = None
    try:
        wait_for_step(tmp_path, 3, proc)
        ranks = {rank_of(pid): pid for pid in children(proc.pid)}
        stopped, survivor = ranks[1], ranks[0]
        os.kill(stopped, signal.SIGSTOP)
        start = time.monotonic()
        while not finished(survivor) and time.monotonic() - start < timeout + 30:
            time.sleep(0.2)
        assert finished(survivor), "rank 0 still waits"
    finally:
        if stopped is not None:
            os.kill(stopped, signal.SIGCONT)
            os.kill(stopped, signal.SIGKILL)
        out, err = proc.communicate(timeout=90)
    assert proc.returncode != 0
    line = next(line for line in err.splitlines() if line.startswith("fivecut: rank 0:"))
    assert "timed out" in line and "rank 1 did not arrive" in line and "group (ranks [0, 1])" in line, err
    assert WORKER_CODE not in err


# ---------------------------------------------------------------- faults with checkpoints


def losses_by_step(out: Path) -> dict[int, float]:
    """The last logged loss of each step (a resumed run appends the steps it repeats)."""
    return {r["step"]: r["loss"] for r in records(out)}


def uninterrupted(cache: str, out: Path, nproc: int, *extra: str) -> dict[int, float]:
    command = torchrun_command(nproc, "train", *sets(cache, out, *extra))
    subprocess.run(command, capture_output=True, text=True, timeout=300, check=True)
    return losses_by_step(out)


def checkpointed(cache: str, out: Path, ck: Path, *extra: str) -> list[str]:
    return sets(cache, out, *extra, f'checkpoint.dir="{ck}"')


@pytest.mark.e2e
def test_sigint_saves_a_checkpoint_that_resumes_bit_exactly(byte_cache, tmp_path):
    fivecut("train", *sets(byte_cache, tmp_path / "warm", "train.steps=1"))
    args = checkpointed(byte_cache, tmp_path / "run", tmp_path / "ck", "train.steps=12")
    proc = subprocess.Popen([sys.executable, "-m", "fivecut", "train", *args], stderr=subprocess.PIPE, text=True)
    wait_for_step(tmp_path / "run", 5, proc)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    stopped = records(tmp_path / "run")[-1]["step"]
    assert proc.returncode == 130 and [line for line in err.splitlines() if line.strip()] == [
        f"fivecut: stopped by SIGINT after step {stopped}"
    ], err
    assert stopped < 12 and (tmp_path / "ck" / f"step-{stopped:08d}" / "COMPLETE").is_file()
    resumed = fivecut("train", *args)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed at step {stopped}" in resumed.stdout
    reference = uninterrupted(byte_cache, tmp_path / "ref", 1, "train.steps=12")
    assert losses_by_step(tmp_path / "run") == reference  # bitwise, every step


@pytest.mark.e2e
@pytest.mark.multirank
def test_torchrun_restarts_a_killed_rank_and_the_run_ends_as_if_uninterrupted(byte_cache, tmp_path):
    fivecut("train", *sets(byte_cache, tmp_path / "warm", "train.steps=1"))
    args = checkpointed(byte_cache, tmp_path / "run", tmp_path / "ck", "train.steps=20", "checkpoint.every=5")
    command = torchrun_command(2, "train", *args, "--set", "parallel.dp=2")
    command[command.index("--max-restarts=0")] = "--max-restarts=1"
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_step(tmp_path / "run", 12, proc)
    victim = {rank_of(pid): pid for pid in children(proc.pid)}[1]
    os.kill(victim, signal.SIGKILL)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert "resumed at step 10" in out, out
    reference = uninterrupted(byte_cache, tmp_path / "ref", 2, "train.steps=20", "parallel.dp=2")
    assert losses_by_step(tmp_path / "run") == reference


@pytest.mark.e2e
@pytest.mark.multirank
def test_a_rank_killed_during_a_save_leaves_the_previous_checkpoint(byte_cache, tmp_path):
    fivecut("train", *sets(byte_cache, tmp_path / "warm", "train.steps=1"))
    ck = tmp_path / "ck"
    args = [*checkpointed(byte_cache, tmp_path / "run", ck, "train.steps=12", "checkpoint.every=1"), "--set",
            "parallel.dp=2"]  # fmt: skip
    proc = subprocess.Popen(torchrun_command(2, "train", *args), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    wait_for_step(tmp_path / "run", 5, proc)
    ranks = {rank_of(pid): pid for pid in children(proc.pid)}
    partial = ck / ".tmp-step-00000007"
    while not partial.exists():  # rank 0 makes it as the save of step 7 begins
        assert proc.poll() is None
    os.kill(ranks[1], signal.SIGSTOP)  # rank 1 cannot have reported its files: step 7 never completes
    assert partial.exists() and not (ck / "step-00000007").exists()
    os.kill(ranks[1], signal.SIGKILL)
    proc.communicate(timeout=120)
    assert proc.returncode != 0 and checkpoint_steps(ck) == [5, 6]
    resumed = subprocess.run(torchrun_command(2, "train", *args), capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed at step 6" in resumed.stdout and not partial.exists()
    reference = uninterrupted(byte_cache, tmp_path / "ref", 2, "train.steps=12", "parallel.dp=2")
    assert {s: v for s, v in losses_by_step(tmp_path / "run").items() if s > 6} == {
        s: v for s, v in reference.items() if s > 6
    }


def checkpoint_steps(root: Path) -> list[int]:
    return [int(p.name.split("-")[1]) for p in sorted(root.glob("step-*")) if (p / "COMPLETE").is_file()]


# ---------------------------------------------------------------- an input mistake under torchrun


@pytest.mark.e2e
@pytest.mark.multirank
def test_an_input_mistake_under_torchrun_is_said_once():
    """Every rank finds the bad key; rank 0 alone says it, and every rank exits 2."""
    alone = fivecut("train", "--set", "train.stepz=3")
    assert alone.returncode == 2 and alone.stderr.count("\n") == 1, alone.stderr
    second = subprocess.run(
        [sys.executable, "-m", "fivecut", "train", "--set", "train.stepz=3"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "RANK": "1", "WORLD_SIZE": "2"},  # what torchrun tells its second rank
    )
    assert second.returncode == 2 and second.stderr == "", second.stderr
    command = torchrun_command(2, "train", "--set", "train.stepz=3")
    command.insert(command.index("-m", 3), "--monitor-interval=3")  # both ranks end before the agent looks
    job = subprocess.run(command, capture_output=True, text=True, timeout=120)
    ours = [line for line in job.stderr.splitlines() if line.startswith(("error:", "fivecut:", "usage:"))]
    assert ours == alone.stderr.splitlines(), job.stderr  # fivecut's lines; torchrun adds ~45 of its own
    assert "exitcode  : 2" in job.stderr and job.returncode == 1, job.stderr
    assert WORKER_CODE not in job.stderr
