"""Checkpoints that go wrong without costing the run: a save checked after writing (`checkpoint.verify`),
a damaged newest checkpoint passed over by `--resume auto` (set aside, never deleted), and a save
that fails on any rank abandoned on every rank (`checkpoint.on_error = "continue"`,
`checkpoint.max_failures`). Faults are injected in the rank that meets them: a DCP writer whose
write fails with ENOSPC, a byte flipped after the rename, a folder made read-only.

Losses after a resume are compared bitwise (==) with an uninterrupted run on the same layout.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from test_bad_input_run import REPO, drop_root_writes

from fivecut.cli import main
from fivecut.config import CheckpointConfig, load_config
from fivecut.launch import spawn
from fivecut.train import checkpoint, saving
from fivecut.train.faults import TrainingStopped
from fivecut.train.trainer import train

QUICK = ["train.seq_len=32", "train.global_batch=4", "train.warmup=1", "train.eval_every=0", "log.peak_tflops=1.0"]
QUIET = ["log.progress=false", "log.plot=false", "log.log_every=1"]


def items(cache: str, out: Path, ck: Path | None, *extra: str) -> list[str]:
    where = [f'checkpoint.dir="{ck}"'] if ck is not None else []
    return [*QUICK, *QUIET, f'data.cache_dir="{cache}"', f'log.out_dir="{out}"', *where, *extra]


def sets(*values: str) -> list[str]:
    return [arg for value in values for arg in ("--set", value)]


def losses(out: Path) -> dict[int, float]:
    """The last logged loss of each step (a resumed run appends the steps it repeats)."""
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if "loss" in r}


def failures(out: Path) -> list[dict]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "checkpoint_failed" in r]


def steps_in(root: Path) -> list[int]:
    return [int(p.name.split("-")[1]) for p in checkpoint.checkpoints(root)]


# ---------------------------------------------------------------- keep never deletes the last verified


def fake_checkpoint(root: Path, step: int, is_verified: bool) -> None:
    path = checkpoint.step_dir(root, step)
    path.mkdir(parents=True)
    (path / checkpoint.COMPLETE).write_text("")
    (path / checkpoint.META).write_text(json.dumps({"step": step, "files": {}}))
    if is_verified:
        (path / checkpoint.VERIFIED).write_text("")


def test_keep_never_deletes_the_newest_verified_checkpoint(tmp_path):
    for step, is_verified in ((1, True), (2, True), (3, False), (4, False)):
        fake_checkpoint(tmp_path, step, is_verified)
    (tmp_path / "step-00000005.damaged").mkdir()  # set aside: never listed, never pruned
    checkpoint.prune(tmp_path, keep=1)
    assert steps_in(tmp_path) == [2, 4] and (tmp_path / "step-00000005.damaged").is_dir()


def test_a_background_saves_pruning_hides_at_once_and_deletes_in_a_thread(tmp_path, monkeypatch):
    """Rank 0's end of a background save: what `keep` lets go is out of sight when it returns,
    deleted while training goes on (here held until released), and gone once the run closes its saves;
    a deletion cut short is removed at the next start (`clean_partial`)."""
    for step in (1, 2, 3):
        fake_checkpoint(tmp_path, step, is_verified=True)
    release, rmtree = threading.Event(), shutil.rmtree

    def held(path, **kw):  # the deleting thread's waits for the release
        return (threading.current_thread().name != "fivecut-prune" or release.wait(30)) and rmtree(path, **kw)

    monkeypatch.setattr(shutil, "rmtree", held)
    saves = saving.Saves(CheckpointConfig(dir=str(tmp_path), keep=1, async_mode="thread"), lambda *_: None)
    saves.prune(tmp_path)
    hidden = sorted(p.name for p in tmp_path.glob(".pruned-*"))
    assert steps_in(tmp_path) == [3] and hidden == [".pruned-step-00000001", ".pruned-step-00000002"]
    release.set()
    saves.close()
    assert [p.name for p in tmp_path.iterdir()] == ["step-00000003"]
    checkpoint.hidden(checkpoint.step_dir(tmp_path, 3))  # a run killed before it deleted
    checkpoint.clean_partial(tmp_path)
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------- --resume auto passes over a damaged one


@pytest.fixture(scope="module")
def three_saves(tmp_path_factory) -> tuple[Path, str, dict[int, float]]:
    """A 4-step run launched for 3 steps, saved (and verified) after each; and the 4-step run
    uninterrupted (its losses, the reference)."""
    base = tmp_path_factory.mktemp("saves")
    cache = str(tmp_path_factory.getbasetemp() / "token-cache")
    run = items(cache, base / "run", base / "ck", "train.steps=4", "train.launch_steps=3", "checkpoint.every=1")
    assert main(["train", *sets(*run, "checkpoint.keep=3")]) == 0
    assert main(["train", *sets(*items(cache, base / "ref", None, "train.steps=4"))]) == 0
    return base / "ck", cache, losses(base / "ref")


def damage(path: Path, how: str) -> Path:
    """Damage the checkpoint at `path`; returns the file named."""
    shard = sorted(path.glob("*.distcp"))[0]
    if how == "flip a byte":
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    elif how == "truncate":
        shard.write_bytes(shard.read_bytes()[:-10])
    elif how == "delete":
        shard.unlink()
    else:
        (path / checkpoint.META).write_text('{"step": ')  # fivecut.json unreadable
        return path / checkpoint.META
    return shard


@pytest.mark.parametrize("how", ["flip a byte", "truncate", "delete", "unreadable fivecut.json"])
def test_resume_auto_sets_a_damaged_newest_aside_and_resumes_from_the_one_before(three_saves, how, tmp_path, capsys):
    saved, cache, reference = three_saves
    ck = shutil.copytree(saved, tmp_path / "ck")
    assert all((p / checkpoint.VERIFIED).is_file() for p in checkpoint.checkpoints(ck))  # checkpoint.verify's mark
    named = damage(ck / "step-00000003", how)
    out = tmp_path / "run"
    assert main(["train", *sets(*items(cache, out, ck, "train.steps=4", "checkpoint.every=1"))]) == 0
    said = [line for line in capsys.readouterr().out.splitlines() if "damaged" in line]
    assert len(said) == 1 and str(named) in said[0] and "step-00000003.damaged" in said[0], said
    assert (ck / "step-00000003.damaged" / named.name).exists() or how == "delete"  # kept, renamed
    assert losses(out) == {3: reference[3], 4: reference[4]}  # resumed at 2: bitwise the uninterrupted run
    assert steps_in(ck) == [3, 4]


def test_resume_path_to_a_damaged_checkpoint_is_refused(three_saves, tmp_path, capsys):
    saved, cache, _ = three_saves
    ck = shutil.copytree(saved, tmp_path / "ck")
    named = damage(ck / "step-00000003", "flip a byte")
    run = items(cache, tmp_path / "run", None, "train.steps=4")
    assert main(["train", "--resume", str(ck / "step-00000003"), *sets(*run)]) == 2
    err = capsys.readouterr().err
    assert str(named) in err and "Traceback" not in err
    assert steps_in(ck) == [1, 2, 3]  # nothing set aside


# ---------------------------------------------------------------- a save that fails


class FullDisk(dcp.FileSystemWriter):
    """DCP's writer on a disk that fills up during the saves of `steps`."""

    steps: tuple[int, ...] = ()

    def write_data(self, plan, planner):
        if int(Path(self.path).name.split("-")[-1]) in self.steps:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path))
        return super().write_data(plan, planner)


def train_on_a_full_disk(cfg, steps: tuple[int, ...], ranks: tuple[int, ...]):
    """`train` on this rank, its disk full during the saves of `steps` where it is one of `ranks`;
    returns the early stop's (message, code), if any."""
    if dist.get_rank() in ranks:
        FullDisk.steps = steps
        dcp.FileSystemWriter = FullDisk
    try:
        train(cfg, quiet=dist.get_rank() != 0, resume="never")
    except TrainingStopped as stop:
        return stop.message, stop.code
    return None


@pytest.mark.multirank
@pytest.mark.parametrize(
    "full, stopped", [((2, 4), None), ((2, 3), "2 checkpoint saves in a row failed")], ids=["twice", "twice in a row"]
)
def test_a_save_that_fails_on_one_rank_is_abandoned_on_every_rank(byte_cache, tmp_path, full, stopped):
    ck, out = tmp_path / "ck", tmp_path / "out"
    run = items(byte_cache, out, ck, "train.steps=4", "parallel.dp=2", "checkpoint.every=1", "checkpoint.keep=10")
    cfg = load_config(None, [*run, 'checkpoint.on_error="continue"', "checkpoint.max_failures=2"])
    ends = spawn(train_on_a_full_disk, 2, cfg, full, (1,))  # rank 1's disk only
    records = failures(out)
    assert [r["step"] for r in records] == list(full) and "No space left on device" in records[0]["checkpoint_failed"]
    if stopped is None:
        assert ends == [None, None] and steps_in(ck) == [1, 3]
    else:
        assert all(stopped in end[0] and end[1] == 2 for end in ends) and steps_in(ck) == [1]
    assert not list(ck.glob(".tmp-*"))  # nothing of a failed save stays


@pytest.mark.multirank
def test_a_background_save_that_fails_on_one_rank_is_abandoned_on_every_rank(byte_cache, tmp_path):
    """The same with DCP's writer in a thread (`checkpoint.async_mode = "thread"`): its error comes
    back to every rank when the save ends, and the next save is in place."""
    ck, out = tmp_path / "ck", tmp_path / "out"
    run = items(byte_cache, out, ck, "train.steps=4", "parallel.dp=2", "checkpoint.every=1", "checkpoint.keep=10")
    cfg = load_config(None, [*run, 'checkpoint.on_error="continue"', 'checkpoint.async_mode="thread"'])
    assert spawn(train_on_a_full_disk, 2, cfg, (2,), (1,)) == [None, None]
    records = failures(out)
    assert [r["step"] for r in records] == [2] and "No space left on device" in records[0]["checkpoint_failed"]
    assert steps_in(ck) == [1, 3, 4] and not list(ck.glob(".tmp-*"))


def test_on_error_stop_ends_the_run_in_one_line_with_the_earlier_checkpoint_intact(
    byte_cache, tmp_path, monkeypatch, capsys
):
    ck = tmp_path / "ck"
    monkeypatch.setattr(FullDisk, "steps", (2,))
    monkeypatch.setattr(dcp, "FileSystemWriter", FullDisk)
    assert main(["train", *sets(*items(byte_cache, tmp_path / "out", ck, "train.steps=3", "checkpoint.every=1"))]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "No space left on device" in err and "step 2 was not saved; step 1 is intact" in err
    assert steps_in(ck) == [1]


def flip_after_publishing(step: int):
    """`checkpoint.publish`, which flips a byte of the checkpoint of `step` once it is in place."""
    real = checkpoint.publish

    def publish(tmp: Path, final: Path, meta: dict) -> None:
        real(tmp, final, meta)
        if meta["step"] == step:
            damage(final, "flip a byte")

    return publish


def test_a_save_that_does_not_read_back_intact_is_set_aside_and_the_run_goes_on(byte_cache, tmp_path, monkeypatch):
    ck, out = tmp_path / "ck", tmp_path / "out"
    run = items(byte_cache, out, ck, "train.steps=3", "checkpoint.every=1", "checkpoint.keep=1")
    monkeypatch.setattr(checkpoint, "publish", flip_after_publishing(2))
    assert main(["train", *sets(*run, 'checkpoint.on_error="continue"')]) == 0
    records = failures(out)
    assert [r["step"] for r in records] == [2] and "does not match its sha256" in records[0]["checkpoint_failed"]
    assert steps_in(ck) == [3] and (ck / "step-00000002.damaged").is_dir()


# A fresh process (root's write capabilities dropped, as in test_bad_input_run) whose checkpoint.dir
# is made read-only after the save of step 2 and writable again once the save of step 4 failed.
READ_ONLY_FOR_ONE_SAVE = textwrap.dedent(
    """
    import os, sys
    import fivecut.train.checkpoint as checkpoint
    from fivecut.cli import main

    real_save = checkpoint.save

    def save(root, step, *args, **kwargs):
        try:
            path = real_save(root, step, *args, **kwargs)
        finally:
            os.chmod(root, 0o555 if step == 2 else 0o755)
        return path

    checkpoint.save = save
    sys.exit(main(sys.argv[1:]))
    """
)


@pytest.mark.sweep  # a fresh Python process: ~17 s on the loaded 2-core machine; ENOSPC above is the default case
def test_a_folder_read_only_for_one_save_costs_that_save_only(byte_cache, tmp_path):
    ck, out = tmp_path / "ck", tmp_path / "out"
    run = items(byte_cache, out, ck, "train.steps=6", "checkpoint.every=2", 'checkpoint.on_error="continue"')
    job = subprocess.run(
        [sys.executable, "-c", READ_ONLY_FOR_ONE_SAVE, "train", *sets(*run)],
        capture_output=True,
        text=True,
        env={**{k: v for k, v in os.environ.items() if k != "RANK"}, "PYTHONPATH": str(REPO)},
        timeout=300,
        preexec_fn=drop_root_writes if os.geteuid() == 0 else None,
    )
    ck.chmod(0o755)
    if job.returncode == 99:
        pytest.skip("running as root without CAP_SETPCAP: no way to make a folder unwritable for this process")
    assert job.returncode == 0, job.stderr
    said = [line for line in job.stdout.splitlines() if "was not saved" in line]
    assert len(said) == 1 and "checkpoint of step 4" in said[0] and "cannot be written" in said[0], job.stdout
    assert steps_in(ck) == [2, 6] and [r["step"] for r in failures(out)] == [4]


@pytest.mark.parametrize(
    "setting, words",
    [
        ('checkpoint.on_error="ignore"', "checkpoint.on_error='ignore'"),
        ("checkpoint.max_failures=0", "checkpoint.max_failures=0 must be >= 1"),
        ('checkpoint.async_mode="yes"', "checkpoint.async_mode='yes'; choose off, thread, process"),
        ('checkpoint.async_mode="thread"', "saves nowhere: set checkpoint.dir"),
    ],
)
def test_bad_save_policies_are_refused_naming_the_key(setting, words, tmp_path, capsys):
    assert main(["train", *sets(f'log.out_dir="{tmp_path}"', setting)]) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1, err
