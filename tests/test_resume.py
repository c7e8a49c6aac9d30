"""Resuming with another config: a change that keeps the run's math is listed in one line; one that
changes it (data position, model, optimizer) is refused naming each key, unless `--override KEY`
accepts it, and then it is recorded in metrics.jsonl and in the next checkpoint's config.

The unit tests compare configs only (no torch); the CLI runs train `tiny` in this process for a
few steps of 4 x 32 tokens. The layout change (dp=2 -> one process) is in test_checkpoint.py.
"""

from __future__ import annotations

import json

import pytest
from test_faults import records, sets

import fivecut.launch
from fivecut.cli import main
from fivecut.config import Config, ConfigError, load_config, preset_args
from fivecut.train import checkpoint
from fivecut.train.optim import lr_at
from fivecut.train.resume import FREE_ON_RESUME, REFUSED_ON_RESUME, config_keys, resume_changes

SAVED = "ck/step-00000002"


def saved_meta(*items: str, step: int = 2, overrides: list | None = None) -> dict:
    """A checkpoint's fivecut.json as far as a resume compares it."""
    return {"step": step, "config": load_config(None, list(items)).to_dict(), "overrides": overrides or []}


def changes(meta: dict, *items: str, accept: list[str] = ()):
    return resume_changes(SAVED, meta, load_config(None, list(items)), list(accept))


def test_every_config_key_is_classified_once():
    listed = [f"{s}.{n}" for table in (FREE_ON_RESUME, REFUSED_ON_RESUME) for s, v in table.items() for n in v.split()]
    assert sorted(listed) == sorted(config_keys())  # each key once; none missing, none left over


REFUSED = [
    ("train.global_batch", 8, 16),
    ("train.seq_len", 128, 64),
    ("train.lr", 0.003, 0.001),
    ("train.beta1", 0.9, 0.8),
    ("train.weight_decay", 0.1, 0.0),
]


@pytest.mark.parametrize("key,old,new", REFUSED)
def test_a_change_of_the_run_is_refused_naming_old_and_new(key, old, new):
    with pytest.raises(ConfigError) as err:
        changes(saved_meta(), f"{key}={new}")
    assert str(err.value) == (
        f"resuming {SAVED} with a changed run: {key} {old!r} -> {new!r}; restore it, or accept each with "
        f"--override KEY (e.g. --override {key})"
    )


@pytest.mark.parametrize("key,old,new", REFUSED)
def test_override_accepts_the_change_and_records_it(key, old, new):
    resume = changes(saved_meta(), f"{key}={new}", accept=[key])
    assert resume.record() == {"step": 2, "overridden": {key: [old, new]}}
    assert resume.lines() == [f"fivecut: resuming with changed config: {key} {old!r} -> {new!r} (--override)"]


def test_each_refused_key_is_named_and_an_override_accepts_only_its_own():
    with pytest.raises(ConfigError) as err:
        changes(saved_meta(), "train.lr=0.001", "train.global_batch=16", "parallel.dp=2", accept=["train.lr"])
    message = str(err.value)
    assert "changed run: train.global_batch 8 -> 16; restore it" in message
    assert "train.lr" not in message and "parallel.dp" not in message


def test_free_keys_change_in_one_line():
    resume = changes(saved_meta("parallel.dp=2", "train.steps=20"), "train.steps=40", "train.accumulate=2")
    assert resume.lines() == ["fivecut: resuming with changed config: train.steps 20 -> 40, train.accumulate 1 -> 2, "
                              "parallel.dp 2 -> 1"]  # fmt: skip
    assert resume.record() is None and resume.step == 2


def test_a_key_an_older_checkpoint_lacks_counts_as_its_default():
    meta = saved_meta()
    del meta["config"]["train"]["beta2"]
    assert changes(meta).changes == []
    with pytest.raises(ConfigError, match=r"train.beta2 0.95 -> 0.99"):
        changes(meta, "train.beta2=0.99")


def test_the_same_model_written_another_way_is_no_change():
    dim = preset_args(load_config(None, []).model).dim  # the default preset's own dim
    assert changes(saved_meta(), 'model.preset="tiny"').changes == []
    assert changes(saved_meta('model.preset="tiny"'), f"model.dim={dim}").changes == []
    with pytest.raises(ConfigError, match=rf"model.dim None -> {2 * dim}"):  # another shape is still refused
        changes(saved_meta(), f"model.dim={2 * dim}")


@pytest.mark.parametrize(
    "key,words",
    [
        ("train.lrr", "--override train.lrr: not a config key; did you mean train.lr?"),
        ("lr", "--override lr: not a config key; did you mean train.lr?"),
        ("train", "--override train: a config section, not a key; name each key (e.g. --override train.KEY)"),
    ],
)
def test_an_override_of_no_config_key_is_refused(key, words):
    for meta in (saved_meta(), None):  # also on a fresh start: a typo never passes silently
        with pytest.raises(ConfigError) as err:
            resume_changes(None if meta is None else SAVED, meta, Config(), [key])
        assert str(err.value).startswith(words)


def test_an_override_with_nothing_to_accept_says_so():
    meta = saved_meta("train.lr=0.001", overrides=[{"step": 1, "overridden": {"train.lr": [0.003, 0.001]}}])
    resume = changes(meta, "train.lr=0.001", accept=["train.lr", "train.beta1", "parallel.dp"])
    assert resume.lines() == [
        "fivecut: --override train.lr: train.lr is 0.001 in the checkpoint too (accepted at step 1); nothing to accept",
        "fivecut: --override train.beta1: train.beta1 is 0.9 in the checkpoint too; nothing to accept",
        "fivecut: --override parallel.dp: parallel.dp may change on a resume without --override; nothing to accept",
    ]
    fresh = resume_changes(None, None, Config(), ["train.lr"])
    assert fresh.lines() == ["fivecut: --override train.lr: no checkpoint to resume; nothing to accept"]


# ---------------------------------------------------------------- the CLI, in this process


def train_args(cache: str, tmp_path, *extra: str) -> list[str]:
    ck = f'checkpoint.dir="{tmp_path / "ck"}"'
    return ["train", *sets(cache, tmp_path / "run", "train.steps=2", "checkpoint.every=1", ck, *extra)]


@pytest.fixture
def saved(byte_cache, tmp_path):
    """Two steps of `tiny` in this process, checkpoints at steps 1 and 2."""
    assert main(train_args(byte_cache, tmp_path)) == 0
    return tmp_path / "ck"


def test_a_changed_run_is_refused_before_any_process_group(saved, byte_cache, tmp_path, monkeypatch, capsys):
    def no_group(*args):
        raise AssertionError("a process group was formed")

    monkeypatch.setattr(fivecut.launch, "init_from_environment", no_group)
    capsys.readouterr()
    assert main(train_args(byte_cache, tmp_path, "train.lr=0.001", "train.global_batch=8")) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [
        f"error: resuming {saved / 'step-00000002'} with a changed run: train.global_batch 4 -> 8, train.lr 0.003 -> "
        "0.001; restore them, or accept each with --override KEY (e.g. --override train.global_batch)"
    ]
    assert checkpoint.checkpoints(saved)[-1].name == "step-00000002"


def test_override_resumes_and_a_restarted_attempt_resumes_again(saved, byte_cache, tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    args = [*train_args(byte_cache, tmp_path, "train.lr=0.001", "train.steps=4"), "--override", "train.lr"]
    capsys.readouterr()
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "fivecut: resuming with changed config: train.steps 2 -> 4, train.lr 0.003 -> 0.001 (--override)" in out
    accepted = {"step": 2, "overridden": {"train.lr": [0.003, 0.001]}}
    first = records(run)
    assert accepted in first
    assert first[-2]["step"] == 3 and first[-2]["lr"] == lr_at(3, 0.001, 3e-4, 1, 4)  # the new peak is in use
    for step in (3, 4):
        meta = json.loads((saved / f"step-{step:08d}" / checkpoint.META).read_text())
        assert meta["config"]["train"]["lr"] == 0.001 and meta["overrides"] == [accepted]

    # torchrun's next attempt of the same command, after the first saved step 3 and died
    checkpoint.prune(saved, keep=2)
    (saved / "step-00000004" / checkpoint.COMPLETE).unlink()
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "resumed at step 3" in out and "resuming with changed config" not in out
    assert "--override train.lr: train.lr is 0.001 in the checkpoint too (accepted at step 2)" in out
    again = records(run)[len(first) :]
    assert [r["step"] for r in again] == [4] and again[0]["loss"] == first[-1]["loss"]
    meta = json.loads((saved / "step-00000004" / checkpoint.META).read_text())
    assert meta["overrides"] == [accepted]  # the history travels with the checkpoints


def test_an_accepted_model_key_loads_when_the_tensors_fit(saved, byte_cache, tmp_path, capsys):
    args = train_args(byte_cache, tmp_path, "model.rope_theta=20000.0", "train.steps=3")
    assert main(args) == 2
    assert "model.rope_theta None -> 20000.0" in capsys.readouterr().err
    assert main([*args, "--override", "model.rope_theta"]) == 0
