"""Every bad input is refused before any process starts: `error: ...` naming the key, exit 2, no traceback."""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch.distributed as dist

import fivecut.launch
from fivecut.cli import main
from fivecut.config import Config
from fivecut.model.presets import PRESETS, runnable_presets
from fivecut.train.data import load_tokens
from fivecut.train.tokenizer import get_tokenizer

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def no_processes(monkeypatch):
    """Reaching a spawn or a process group means a bad input got through."""

    def started(*args, **kwargs):
        raise AssertionError("a process was started for a bad input")

    monkeypatch.setattr(fivecut.launch, "spawn", started)
    monkeypatch.setattr(fivecut.launch, "init_from_environment", started)


def refused(capsys, argv: list[str]) -> str:
    """Run the CLI in-process; it must refuse with exit 2 and a one-line-per-problem message."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err
    assert not dist.is_initialized()
    return err


def train_argv(tmp_path: Path, *overrides: str) -> list[str]:
    folders = [f'log.out_dir="{tmp_path / "run"}"', f'data.cache_dir="{tmp_path / "cache"}"']
    return ["train"] + [arg for item in folders + list(overrides) for arg in ("--set", item)]


# ---------------------------------------------------------------- options of a training run

OPTIONS = [
    ("train.steps=0", "train.steps"),
    ("train.steps=-3", "train.steps"),
    ("train.lr=-1.0", "train.lr"),
    ("train.lr=nan", "train.lr"),
    ("train.lr=inf", "train.lr"),
    ("train.min_lr=0.1", "train.min_lr"),
    ("train.warmup=101", "train.warmup"),
    ("train.warmup=-1", "train.warmup"),
    ("train.grad_clip=-1.0", "train.grad_clip"),
    ("train.beta1=1.0", "train.beta1"),
    ("train.beta2=-0.1", "train.beta2"),
    ("train.eps=0", "train.eps"),
    ("train.weight_decay=-0.1", "train.weight_decay"),
    ("train.global_batch=0", "train.global_batch"),
    ("train.seq_len=0", "train.seq_len"),
    ("train.accumulate=0", "train.accumulate"),
    ("train.eval_every=-1", "train.eval_every"),
    ("train.eval_batches=0", "train.eval_batches"),
    ("train.bucket_mb=0", "train.bucket_mb"),
    ("train.seed=-1", "train.seed"),
    ("train.dtype=fp16", "train.dtype"),
    ("train.seq_len=1024", "train.seq_len"),
    ("log.log_every=0", "log.log_every"),
    ("log.peak_tflops=-1.0", "log.peak_tflops"),
    ("data.val_fraction=0.0", "data.val_fraction"),
    ("data.val_fraction=1.0", "data.val_fraction"),
    ("data.tokenizer=bpe", "data.tokenizer"),
    ('data.source="/no/such/corpus"', "data.source"),
    ("model.preset=tinyy", "model.preset"),
    ("model.dim=130", "model"),
    ("parallel.pp_layers=[2, 2]", "parallel.pp_layers"),
    ("parallel.tp=3", "tp=3"),
    ("moe.aux_loss_coef=0.01", "[moe]"),
]


@pytest.mark.parametrize("override,key", OPTIONS)
def test_train_option_refused(capsys, tmp_path, override, key):
    err = refused(capsys, train_argv(tmp_path, override))
    assert key in err
    assert not (tmp_path / "run").exists()  # refused before the output folder is made


@pytest.mark.parametrize("preset", ["llama3-8b", "llama3-70b", "deepseek-v3"])
def test_shape_only_preset_refused_by_train(capsys, tmp_path, preset):
    err = refused(capsys, train_argv(tmp_path, f'model.preset="{preset}"'))
    assert "model.preset" in err and "shape-only" in err and all(name in err for name in runnable_presets())


def test_unknown_preset_names_the_valid_ones(capsys, tmp_path):
    err = refused(capsys, train_argv(tmp_path, "model.preset=tinyy"))
    assert all(name in err for name in runnable_presets())


def test_good_train_passes_the_checks(tmp_path):
    with pytest.raises(AssertionError, match="process was started"):
        main(train_argv(tmp_path, "train.steps=5", "train.warmup=5"))
    assert list((tmp_path / "run").iterdir()) == []  # the write probe leaves nothing behind


@pytest.mark.parametrize("command", ["verify", "ledger"])
def test_good_layout_passes_the_checks(tmp_path, corpus, command):
    """Default --steps included (ledger runs one step, shorter than verify's usual warm-up)."""
    with pytest.raises(AssertionError, match="process was started"):
        main(layout_argv(command, tmp_path, "--layout", "dp=2", "--set", f'data.source="{corpus}"'))


# ---------------------------------------------------------------- folders


@pytest.mark.parametrize("key", ["log.out_dir", "data.cache_dir"])
def test_folder_under_a_file_refused(capsys, tmp_path, key):
    (tmp_path / "file").write_text("x")
    err = refused(capsys, train_argv(tmp_path, f'{key}="{tmp_path / "file" / "sub"}"'))
    assert key in err and str(tmp_path / "file") in err


@pytest.mark.parametrize("key", ["log.out_dir", "data.cache_dir"])
def test_folder_that_is_a_file_refused(capsys, tmp_path, key):
    (tmp_path / "file").write_text("x")
    err = refused(capsys, train_argv(tmp_path, f'{key}="{tmp_path / "file"}"'))
    assert key in err and "is a file" in err


@pytest.mark.parametrize("folder", ["/sys/fivecut-test", "/proc/fivecut-test"])
@pytest.mark.parametrize("key", ["log.out_dir", "data.cache_dir"])
def test_unwritable_system_folder_refused(capsys, tmp_path, key, folder):
    err = refused(capsys, train_argv(tmp_path, f'{key}="{folder}"'))
    assert key in err and folder in err


@pytest.mark.parametrize("leftover", ["metrics.jsonl", "config.json"])
def test_out_dir_with_an_earlier_run_refused(capsys, tmp_path, leftover):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / leftover).write_text("{}")
    err = refused(capsys, train_argv(tmp_path))
    assert "log.out_dir" in err and "earlier run" in err and leftover in err and "remove" in err


def test_config_that_is_a_directory(capsys, tmp_path):
    err = refused(capsys, ["train", "--config", str(tmp_path)])
    assert str(tmp_path) in err and "is a directory" in err


def test_config_that_is_not_utf8(capsys, tmp_path):
    path = tmp_path / "latin1.toml"
    path.write_bytes('[log]\nout_dir = "caf\xe9"\n'.encode("latin-1"))
    err = refused(capsys, ["train", "--config", str(path)])
    assert str(path) in err and "UTF-8" in err


# ---------------------------------------------------------------- verify / ledger


def layout_argv(command: str, tmp_path: Path, *args: str) -> list[str]:
    return [command, "--set", f'data.cache_dir="{tmp_path / "cache"}"', *args]


LAYOUT_ARGS = [
    ("verify", ["--layout", "dp=2", "--steps", "0"], "--steps"),
    ("ledger", ["--layout", "dp=2", "--steps", "0"], "--steps"),
    ("verify", ["--layout", ""], "--layout"),
    ("verify", ["--layout", "  "], "--layout"),
    ("verify", ["--layout", "dp=2,,tp=2"], "--layout"),
    ("verify", ["--layout", "dp=2,dp=3"], "dp more than once"),
    ("verify", ["--layout", "dp:2"], "key=value"),
    ("ledger", ["--layout", "dp=2,"], "--layout"),
    ("verify", ["--layout", "dp=2", "--rtol", "0"], "--rtol"),
    ("verify", ["--layout", "dp=2", "--rtol=-1e-5"], "--rtol"),
    ("verify", ["--layout", "dp=2", "--timeout", "0"], "--timeout"),
    ("ledger", ["--layout", "dp=2", "--timeout=-5"], "--timeout"),
    ("verify", ["--layout", "dp=2", "--model", "llama3-8b"], "--model"),
    ("ledger", ["--layout", "dp=2", "--model", "deepseek-v3"], "--model"),
    ("verify", ["--layout", "dp=2", "--model", "nope"], "--model"),
    ("verify", ["--layout", "dpp=2"], "parallel.dpp"),
    ("verify", ["--layout", "tp=3"], "tp=3"),
    ("ledger", ["--layout", "dp=2", "--set", "log.log_every=0"], "log.log_every"),
    ("verify", ["--layout", "dp=2", "--set", f'data.cache_dir="{"/proc/fivecut-test"}"'], "data.cache_dir"),
]


@pytest.mark.parametrize("command,args,key", LAYOUT_ARGS)
def test_layout_command_refused_before_spawn(capsys, tmp_path, command, args, key):
    err = refused(capsys, layout_argv(command, tmp_path, *args))
    assert key in err


def test_layout_keys_are_named(capsys, tmp_path):
    err = refused(capsys, layout_argv("verify", tmp_path, "--layout", "dp:2"))
    assert "dp=2" in err and "parallel" in err


# ---------------------------------------------------------------- schedule


SCHEDULES = [
    (["--schedule", "1f1b", "--pp", "4", "--microbatches", "2"], "microbatches >= pp"),
    (["--schedule", "zb1p", "--pp", "4", "--microbatches", "3"], "microbatches >= pp"),
    (["--schedule", "1f1b", "--pp", "2", "--microbatches", "4", "--cost-w", "1"], "--cost-w"),
    (["--schedule", "gpipe", "--pp", "0", "--microbatches", "4"], "--pp"),
    (["--schedule", "gpipe", "--pp", "2", "--microbatches", "0"], "--microbatches"),
    (["--schedule", "gpipe", "--pp", "2", "--microbatches", "4", "--cost-f=-1"], "--cost-f"),
    (["--schedule", "1f1b", "--pp", "2", "--microbatches", "4", "--virtual", "2"], "pp_virtual=2"),
]


@pytest.mark.parametrize("args,key", SCHEDULES)
def test_schedule_refused(capsys, args, key):
    assert key in refused(capsys, ["schedule", *args])


def test_schedule_refuses_what_train_refuses(capsys, tmp_path):
    """One rule for both: the message `train` gives for parallel.* is the one `schedule` gives."""
    layout = ["parallel.pp=4", "parallel.microbatches=2", "train.global_batch=8"]
    train_err = refused(capsys, train_argv(tmp_path, *layout))
    schedule_err = refused(capsys, ["schedule", "--schedule", "1f1b", "--pp", "4", "--microbatches", "2"])
    rule = "1f1b with pp=4 needs microbatches >= pp; got 2"
    assert rule in train_err and rule in schedule_err


def test_schedule_with_cost_w_on_a_split_schedule_runs(capsys):
    assert main(["schedule", "--schedule", "zb1p", "--pp", "2", "--microbatches", "4", "--cost-w", "0.5"]) == 0
    assert "W=0.5" in capsys.readouterr().out


def test_unknown_schedule_lists_the_names(capsys):
    with pytest.raises(SystemExit) as info:
        main(["schedule", "--schedule", "1f1", "--pp", "2", "--microbatches", "2"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and all(name in err for name in ("gpipe", "1f1b", "interleaved", "zb1p", "dualpipev"))


# ---------------------------------------------------------------- help


def help_of(capsys, command: str) -> str:
    with pytest.raises(SystemExit):
        main([command, "--help"])
    return " ".join(capsys.readouterr().out.split())


def test_set_help_lists_the_sections(capsys):
    text = help_of(capsys, "train")
    assert all(field.name in text for field in dataclasses.fields(Config))


def test_model_help_lists_every_preset(capsys):
    text = help_of(capsys, "verify")
    assert all(name in text for name in PRESETS)


# ---------------------------------------------------------------- end to end: no traceback


@pytest.mark.parametrize(
    "argv,key",
    [
        (["train", "--set", "train.steps=0"], "train.steps"),
        (["verify", "--layout", "dp=2,,tp=2"], "--layout"),
    ],
)
def test_subprocess_exit_2_without_traceback(tmp_path, argv, key):
    argv = argv + ["--set", f'log.out_dir="{tmp_path / "run"}"', "--set", f'data.cache_dir="{tmp_path}"']
    run = subprocess.run([sys.executable, "-m", "fivecut", *argv], cwd=REPO, capture_output=True, text=True)
    assert run.returncode == 2 and run.stderr.startswith("error: ") and key in run.stderr
    assert "Traceback" not in run.stderr


# ---------------------------------------------------------------- the token cache


@pytest.fixture
def corpus(tmp_path) -> Path:
    path = tmp_path / "corpus.txt"
    path.write_text("To be, or not to be, that is the question.\n" * 40)
    return path


def fresh_tokens(corpus: Path) -> np.ndarray:
    return np.asarray(get_tokenizer("byte").encode(corpus.read_text()), dtype=np.int64)


def all_tokens(splits) -> np.ndarray:
    return np.concatenate([splits.train, splits.val]).astype(np.int64)


@pytest.mark.parametrize("damage", ["zeros", "random"])
def test_corrupted_cache_is_rebuilt(tmp_path, corpus, capfd, damage):
    cache = tmp_path / "cache"
    path = load_tokens(str(corpus), "byte", cache).cache_path
    size = path.stat().st_size
    garbage = bytes(size) if damage == "zeros" else np.random.default_rng(0).bytes(size)
    path.write_bytes(garbage)
    capfd.readouterr()
    splits = load_tokens(str(corpus), "byte", cache)
    assert "rebuilding" in capfd.readouterr().err
    np.testing.assert_array_equal(all_tokens(splits), fresh_tokens(corpus))


@pytest.mark.parametrize("old", ["no sidecar", "no checksum"])
def test_cache_of_the_old_format_is_rebuilt(tmp_path, corpus, capfd, old):
    cache = tmp_path / "cache"
    path = load_tokens(str(corpus), "byte", cache).cache_path
    meta_path = path.with_suffix(".json")
    if old == "no sidecar":
        meta_path.unlink()
    else:
        meta = json.loads(meta_path.read_text())
        del meta["sha256"]
        meta_path.write_text(json.dumps({**meta, "version": 1}))
    path.write_bytes(bytes(path.stat().st_size))
    capfd.readouterr()
    splits = load_tokens(str(corpus), "byte", cache)
    assert "rebuilding" in capfd.readouterr().err
    np.testing.assert_array_equal(all_tokens(splits), fresh_tokens(corpus))


def test_sound_cache_is_reused_quietly(tmp_path, corpus, capfd):
    cache = tmp_path / "cache"
    first = load_tokens(str(corpus), "byte", cache)
    meta = json.loads(first.cache_path.with_suffix(".json").read_text())
    assert len(meta["sha256"]) == 64 and meta["tokenizer"] == "byte" and meta["vocab_size"] == 256
    capfd.readouterr()
    load_tokens(str(corpus), "byte", cache)
    assert "rebuilding" not in capfd.readouterr().err
