"""Every bad input is refused before any process starts: `error: ...` naming the key, exit 2, no traceback."""

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch.distributed as dist

import fivecut.launch
from fivecut import checks
from fivecut.cli import LOSS_RTOL, TOLERANCES, main, print_comparison, verdict, verify_config
from fivecut.config import Config
from fivecut.layout import ParallelDims
from fivecut.model.presets import PRESETS, runnable_presets
from fivecut.train.data import DataError, load_tokens
from fivecut.train.tokenizer import get_tokenizer

REPO = Path(__file__).resolve().parents[1]
SPAWN = fivecut.launch.spawn  # before `no_processes` replaces it


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
    ("moe.aux_loss_coef=0.01", "moe.aux_loss_coef"),
    ("moe.capacity_factor=1.25", "moe.capacity_factor"),
    ("model.top_k=3", "model.top_k"),
    ("model.gate=sigmoid", "model.gate"),
    ("model.first_dense_layers=1", "model.first_dense_layers"),
    ('log.out_dir=""', "log.out_dir"),
    ('data.cache_dir=""', "data.cache_dir"),
    ('checkpoint.dir=""', "checkpoint.dir"),
    ('data.source=""', "data.source"),
    ('data.source="  "', "data.source"),
    ('log.sample_prompt=""', "log.sample_prompt"),
    ('train.recompute="some"', "train.recompute"),
    ("train.recompute=true", "train.recompute"),
    ("train.recompute_every=0", "train.recompute_every"),
]


@pytest.mark.parametrize("override,key", OPTIONS)
def test_train_option_refused(capsys, tmp_path, override, key):
    err = refused(capsys, train_argv(tmp_path, override))
    assert key in err
    assert not (tmp_path / "run").exists()  # refused before the output folder is made


def test_one_problem_is_one_line(capsys, tmp_path):
    err = refused(capsys, train_argv(tmp_path, "train.steps=0"))
    assert err.count("\n") == 1 and "train.steps=0" in err


def test_moe_only_keys_are_named_together(capsys, tmp_path):
    err = refused(capsys, train_argv(tmp_path, "model.top_k=1", "model.route_scale=2.0"))
    assert "model.top_k=1" in err and "model.route_scale=2.0" in err and "dense" in err and "n_experts" in err
    err = refused(capsys, train_argv(tmp_path, "moe.eplb_window=3", "moe.bias_update_rate=0.001"))
    assert "moe.eplb_window" in err and "moe.bias_update_rate" in err and "dense" in err


def test_moe_only_keys_pass_on_a_moe_model(tmp_path):
    with pytest.raises(AssertionError, match="process was started"):
        main(train_argv(tmp_path, 'model.preset="tiny-moe"', "model.top_k=3", "moe.capacity_factor=1.25"))


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


@pytest.mark.parametrize("key", ["log.out_dir", "data.cache_dir", "checkpoint.dir"])
def test_folder_under_a_file_refused(capsys, tmp_path, key):
    (tmp_path / "file").write_text("x")
    err = refused(capsys, train_argv(tmp_path, f'{key}="{tmp_path / "file" / "sub"}"'))
    assert key in err and str(tmp_path / "file") in err


@pytest.mark.parametrize("key", ["log.out_dir", "data.cache_dir", "checkpoint.dir"])
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


def test_compile_without_a_cxx_compiler_refused(capsys, tmp_path, monkeypatch):
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # no g++ here: inductor's CPU code could not be built
    err = refused(capsys, train_argv(tmp_path, "train.compile=true"))
    assert "train.compile=true" in err and "'g++' is not on PATH" in err and "train.compile=false" in err


def test_compile_where_dynamo_cannot_run_refused():
    def unsupported():
        raise RuntimeError("Python 3.15+ not yet supported for torch.compile")

    problems = checks.compile_problems(True, dynamo_check=unsupported)
    assert problems == [
        "train.compile=true but torch.compile cannot run here: Python 3.15+ not yet supported for torch.compile; "
        "set train.compile=false"
    ]
    assert checks.compile_problems(False, path="") == []  # nothing is asked of an eager run


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
    ("verify", ["--layout", "dp=2", "--rtol", "nan"], "--rtol"),
    ("verify", ["--layout", "dp=2", "--timeout", "nan"], "--timeout"),
    ("ledger", ["--layout", "dp=2", "--timeout", "inf"], "--timeout"),
    ("verify", ["--layout", "dp=2", "--steps=-2"], "--steps"),
    # every setting is applied or refused, never replaced by another
    ("verify", ["--layout", "dp=2", "--set", "parallel.dp=4"], "parallel.dp"),
    ("ledger", ["--layout", "dp=2", "--set", "parallel={dp=4}"], "parallel.dp"),
    ("verify", ["--layout", "dp=2", "--set", "train.steps=3"], "--steps"),
    ("verify", ["--layout", "dp=2", "--set", 'model.preset="tiny-moe"'], "--model"),
    ("ledger", ["--layout", "dp=2", "--set", 'log.out_dir="elsewhere"'], "log.out_dir"),
    ("verify", ["--layout", "dp=2", "--set", 'checkpoint.dir="elsewhere"'], "checkpoint.dir"),
    ("verify", ["--layout", "dp=2", "--set", "model.top_k=3"], "model.top_k"),
]


@pytest.mark.parametrize("command,args,key", LAYOUT_ARGS)
def test_layout_command_refused_before_spawn(capsys, tmp_path, command, args, key):
    err = refused(capsys, layout_argv(command, tmp_path, *args))
    assert key in err


def test_layout_keys_are_named(capsys, tmp_path):
    err = refused(capsys, layout_argv("verify", tmp_path, "--layout", "dp:2"))
    assert "dp=2" in err and "parallel" in err


PP_LAYERS = "parallel.pp_layers=[5, 5] must give 2 stages of >= 1 layer summing to n_layers=4"


@pytest.mark.parametrize("command", ["verify", "ledger"])
def test_layout_command_refuses_what_train_refuses(capsys, tmp_path, command):
    """--set parallel.* is applied under --layout, not replaced by it, and refused as `train` refuses it."""
    train_err = refused(capsys, train_argv(tmp_path, "parallel.pp=2", "parallel.pp_layers=[5,5]"))
    err = refused(capsys, layout_argv(command, tmp_path, "--set", "parallel.pp_layers=[5,5]", "--layout", "pp=2"))
    assert PP_LAYERS in train_err and PP_LAYERS in err


# each bad layout, with a fragment of the one line each of its causes must give (and no other line)
ONE_LINE_PER_CAUSE = [
    ("tiny-gpt2", "tp=2,pp=2,sp=true,pp_schedule=dualpipev,microbatches=4", [], ["2 layers cannot fill 4"]),
    ("tiny-gpt2", "tp=2,pp=2,sp=true,pp_schedule=dualpipev", [], ["cannot fill 4"]),  # microbatches unset: 4
    ("tiny", "cp=3", [], ["seq_len=64 must divide by 6 (2*cp=6"]),  # not again as "by cp=3"
    ("tiny", "cp=3,cp_mode=ulysses", [], ["Ulysses cuts each tp rank's 4 heads", "seq_len=64 must divide by 3"]),
    ("tiny-moe", "tp=2,sp=true", ["train.seq_len=63"], ["seq_len=63 must divide by 2"]),  # SP and the MoE cut
    ("tiny-moe", "tp=2,cp=2", ["train.seq_len=62"], ["seq_len=62 must divide by 4 (2*cp=4"]),  # ring and MoE
    ("tiny", "tp=3", [], ["tp=3 must divide n_heads=4, and divide or be a multiple of n_kv_heads=2"]),
    ("tiny", "tp=3,cp=2,cp_mode=ulysses", [], ["tp=3 must divide n_heads=4"]),  # no Ulysses line of a bad tp
    ("tiny", "pp=2,pp_virtual=4,microbatches=2", [], ["pp_virtual=4 only applies"]),  # no 8 stages to fill
    ("tiny", "pp=2,pp_schedule=foo,pp_virtual=2", [], ["pp_schedule='foo'"]),  # no rules of an unknown schedule
    ("tiny", "pp=2,microbatches=0", [], ["parallel.microbatches=0 must be >= 1"]),  # not also "needs >= pp"
    ("tiny", "pp=3,pp_schedule=interleaved,pp_virtual=2,microbatches=4", [], ["not a multiple of pp=3", "fill 6"]),
    ("tiny-moe", "dp=2", ["moe.eplb_interval=0"], ["apply only to EPLB"]),  # not also "must be >= 1"
    ("tiny-moe", "dp=3,ep=3", [], ["n_experts=8 not divisible by ep=3", "global_batch=8 must divide by"]),
]


def problem_lines(err: str) -> list[str]:
    """The problems of a refusal: its one line, or the `  - ` lines under its title."""
    lines = err.strip().splitlines()
    return lines if len(lines) == 1 else [line for line in lines[1:] if line.startswith("  - ")]


@pytest.mark.parametrize("model,layout,sets,causes", ONE_LINE_PER_CAUSE)
def test_each_cause_is_said_once(capsys, tmp_path, model, layout, sets, causes):
    argv = layout_argv(
        "verify", tmp_path, "--model", model, "--layout", layout, *(a for s in sets for a in ("--set", s))
    )
    lines = problem_lines(refused(capsys, argv))
    assert len(lines) == len(causes), lines
    for cause in causes:
        assert sum(cause in line for line in lines) == 1, (cause, lines)


def test_a_sequence_every_cut_divides_passes(tmp_path):
    """seq_len=60 under cp=2 x tp=2 with SP: 60 = 15 x 4, no refusal (the folded check still lets it through)."""
    overrides = [f'data.cache_dir="{tmp_path / "cache"}"', "train.seq_len=60"]
    ns = SimpleNamespace(
        model="tiny", layout="tp=2,cp=2,sp=true", steps=2, timeout=60.0, rtol=LOSS_RTOL, overrides=overrides
    )
    assert verify_config(ns).train.seq_len == 60


def test_schedule_command_says_a_count_once(capsys):
    err = refused(capsys, ["schedule", "--schedule", "1f1b", "--pp", "2", "--microbatches", "0"])
    assert problem_lines(err) == [line for line in problem_lines(err) if "--microbatches=0" in line]


class Recorder:
    """Stands in for `fivecut.launch.spawn`: records each run's config and returns `result` per rank."""

    def __init__(self, result):
        self.result, self.configs = result, []

    def __call__(self, fn, world_size, cfg, *args, **kwargs):
        self.configs.append(cfg)
        return [self.result] * world_size


def test_verify_runs_the_set_parallel_keys(capsys, monkeypatch, tmp_path, corpus):
    same = SimpleNamespace(losses=[2.0], grad_norms=[1.0], val_losses={1: 2.5})
    spawn = Recorder(same)
    monkeypatch.setattr(fivecut.launch, "spawn", spawn)
    argv = ["--layout", "pp=2,microbatches=2", "--set", "parallel.pp_layers=[1,3]", "--set", "parallel.dp=2"]
    assert main(layout_argv("verify", tmp_path, *argv, "--steps", "1", "--set", f'data.source="{corpus}"')) == 0
    reference, layout = (cfg.parallel for cfg in spawn.configs)
    assert reference == ParallelDims() and layout == ParallelDims(pp=2, microbatches=2, pp_layers=[1, 3], dp=2)
    out = capsys.readouterr().out
    assert "layout dp=2,pp=2,microbatches=2,pp_layers=[1,3] vs single process" in out and "PASS" in out


def test_eval_runs_the_set_parallel_keys(capsys, monkeypatch, tmp_path, corpus, tiny_gguf):
    spawn = Recorder({"tokens": 64, "loss": 1.0, "perplexity": 2.7})
    monkeypatch.setattr(fivecut.launch, "spawn", spawn)
    sizes = ["--batches", "1", "--batch-size", "2", "--seq-len", "16", "--data", str(corpus)]
    argv = ["eval", "--init-from", f"gguf:{tiny_gguf}", *sizes, "--layout", "dp=2", "--set", "parallel.zero=1"]
    assert main(layout_argv(*argv[:1], tmp_path, *argv[1:])) == 0
    assert [cfg.parallel for cfg in spawn.configs] == [ParallelDims(dp=2, zero=1)]
    assert "layout dp=2,zero=1" in capsys.readouterr().out


# ---------------------------------------------------------------- eval and generate: their flags by name


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    """A tiny llama GGUF (max_seq_len 128) with its own tokenizer."""
    from test_gguf import write_tiny

    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_tiny(path)
    return path


EVAL_ARGS = [
    (["--batches", "0"], "--batches"),
    (["--batch-size", "0"], "--batch-size"),
    (["--seq-len", "0"], "--seq-len"),
    (["--seq-len", "1000"], "--seq-len"),  # over the file's max_seq_len 128
    (["--batch-size", "3", "--layout", "dp=2"], "--batch-size"),
    (["--layout", "dp=0"], "parallel.dp=0"),
    (["--layout", "pp=2,microbatches=0"], "parallel.microbatches=0"),
    (["--timeout", "0"], "--timeout"),
    (["--layout", ""], "--layout"),
    (["--layout", "tp=2", "--set", "parallel.tp=4"], "parallel.tp"),
    (["--set", "train.seq_len=64"], "--seq-len"),
    (["--set", "train.eval_batches=3"], "--batches"),
    (["--set", 'data.source="shakespeare"'], "--data"),
    (["--step", "2"], "--checkpoint"),
]


@pytest.mark.parametrize("args,flag", EVAL_ARGS)
def test_eval_refuses_its_flags_by_name(capsys, tmp_path, tiny_gguf, args, flag):
    err = refused(capsys, layout_argv("eval", tmp_path, "--init-from", f"gguf:{tiny_gguf}", *args))
    assert flag in err and ("train." not in err or "--set train." in err)


GENERATE_ARGS = [
    (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--max-new-tokens=-1"], "--max-new-tokens"),
    (["--top-k=-1"], "--top-k"),
    (["--temperature", "inf"], "--temperature"),
    (["--temperature", "nan"], "--temperature"),
    (["--temperature=-0.5"], "--temperature"),
    (["--device", "tpu"], "--device"),
    (["--device", "cuda:x"], "--device"),
    (["--device", "meta"], "--device"),
]


@pytest.mark.parametrize("args,flag", GENERATE_ARGS)
def test_generate_refuses_its_flags_by_name(capsys, tmp_path, args, flag):
    """Refused before the model is opened: the file named does not even exist."""
    err = refused(capsys, ["generate", "--init-from", f"gguf:{tmp_path / 'none.gguf'}", "--prompt", "x", *args])
    assert flag in err and "none.gguf" not in err and err.count("\n") == 1


@pytest.mark.parametrize("gpus,device", [(0, "cuda"), (0, "cuda:0"), (2, "cuda:2")])
def test_generate_refuses_a_gpu_it_does_not_have(capsys, monkeypatch, tmp_path, gpus, device):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    err = refused(
        capsys, ["generate", "--init-from", f"gguf:{tmp_path / 'x.gguf'}", "--prompt", "x", "--device", device]
    )
    assert "--device" in err and ("cpu" in err if gpus == 0 else "cuda:1" in err)


def test_generate_refuses_a_negative_step(capsys, tmp_path):
    err = refused(capsys, ["generate", "--checkpoint", str(tmp_path), "--prompt", "x", "--step=-1"])
    assert "--step -1 is negative" in err


# ---------------------------------------------------------------- empty paths

EMPTY_PATHS = [
    (["train", "--config", ""], "--config"),
    (["train", "--resume", " "], "--resume"),
    (["eval", "--checkpoint", ""], "--checkpoint"),
    (["eval", "--init-from", ""], "--init-from"),
    (["generate", "--init-from", "gguf:", "--prompt", "x"], "--init-from"),
    (["eval", "--init-from", "gguf:x.gguf", "--data", ""], "--data"),
    (["generate", "--checkpoint", "", "--prompt", "x"], "--checkpoint"),
    (["export", "--checkpoint", "", "--out", "hf"], "--checkpoint"),
    (["export", "--checkpoint", "ck", "--out", ""], "--out"),
    (["schedule", "--schedule", "gpipe", "--pp", "2", "--microbatches", "2", "--out", ""], "--out"),
    (["checkpoint", "info", ""], "DIR"),
]


@pytest.mark.parametrize("argv,flag", EMPTY_PATHS)
def test_an_empty_path_flag_is_refused(capsys, tmp_path, monkeypatch, argv, flag):
    monkeypatch.chdir(tmp_path)
    err = refused(capsys, argv)
    assert flag in err and "empty" in err and err.count("\n") == 1
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------- outputs that cannot be written


def test_export_out_under_a_file_is_refused(capsys, tmp_path):
    """Refused before the checkpoint is even looked for."""
    (tmp_path / "file").write_text("x")
    for out in (tmp_path / "file" / "sub", tmp_path / "file" / "sub" / "deeper"):
        err = refused(capsys, ["export", "--checkpoint", str(tmp_path / "nowhere"), "--out", str(out)])
        assert "--out" in err and str(tmp_path / "file") in err and "is a file" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


# ---------------------------------------------------------------- schedule


SCHEDULES = [
    (["--schedule", "1f1b", "--pp", "4", "--microbatches", "2"], "microbatches >= pp"),
    (["--schedule", "zb1p", "--pp", "4", "--microbatches", "3"], "microbatches >= pp"),
    (["--schedule", "1f1b", "--pp", "2", "--microbatches", "4", "--cost-w", "1"], "--cost-w"),
    (["--schedule", "gpipe", "--pp", "0", "--microbatches", "4"], "--pp"),
    (["--schedule", "gpipe", "--pp", "2", "--microbatches", "0"], "--microbatches"),
    (["--schedule", "gpipe", "--pp", "2", "--microbatches", "4", "--cost-f=-1"], "--cost-f"),
    (["--schedule", "1f1b", "--pp", "2", "--microbatches", "4", "--virtual", "2"], "pp_virtual=2"),
    (["--schedule", "interleaved", "--pp", "2", "--microbatches", "4", "--virtual", "0"], "--virtual"),
    (["--schedule", "gpipe", "--pp", "2", "--microbatches", "4", "--cost-b=-1"], "--cost-b"),
    (["--schedule", "gpipe", "--pp", "2", "--microbatches", "4", "--cost-f", "inf"], "--cost-f"),
    (["--schedule", "gpipe", "--pp", "2", "--microbatches", "4", "--cost-comm", "nan"], "--cost-comm"),
    (["--schedule", "zb1p", "--pp", "2", "--microbatches", "4", "--cost-w", "inf"], "--cost-w"),
]


@pytest.mark.parametrize("args,key", SCHEDULES)
def test_schedule_refused(capsys, args, key):
    assert key in refused(capsys, ["schedule", *args])


@pytest.mark.parametrize(
    "out,named", [("file/x.png", "is a file"), ("missing/x.png", "mkdir"), (".", "folder"), ("chart.svg", ".png")]
)
def test_schedule_out_that_cannot_be_written_is_refused(capsys, tmp_path, monkeypatch, out, named):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "file").write_text("x")
    assert main(["schedule", "--schedule", "gpipe", "--pp", "2", "--microbatches", "2", "--out", out]) == 2
    printed = capsys.readouterr()
    assert printed.err.startswith(f"error: --out {out}") and named in printed.err and printed.err.count("\n") == 1
    assert printed.out == "" and sorted(p.name for p in tmp_path.iterdir()) == ["file"]  # refused before the work


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


# ---------------------------------------------------------------- a spawned run that fails: one line, exit 1


# RankFailure's message: its summary line (`launch.RankFailure.summary`), then each failed rank's report
TIMED_OUT = "--- rank 1 did not finish within 20 s; its stack:\nStack (most recent call first):\n  File x.py, line 3"
RAISED = "--- rank 0 raised:\nTraceback (most recent call last):\n  File x.py, line 1\nRuntimeError: boom"
DIED = "--- rank 1 died: exit code -9, no traceback"
BOTH = "rank 0 raised RuntimeError: boom; rank 1 did not finish within 20 s"
KILLED = "rank 1 died (killed by SIGKILL) before returning"


def failing_spawn(message: str):
    def spawn(*args, **kwargs):
        raise fivecut.launch.RankFailure(message)

    return spawn


@pytest.mark.parametrize(
    "message,line",
    [
        (f"rank 1 did not finish within 20 s\n{TIMED_OUT}", "rank 1 did not finish within 20 s (raise --timeout);"),
        (f"{BOTH}\n{RAISED}\n{TIMED_OUT}", f"{BOTH} (raise --timeout);"),
        (f"{KILLED}\n{DIED}", f"{KILLED};"),
    ],
)
@pytest.mark.parametrize("command", ["verify", "ledger"])
def test_a_failed_rank_is_one_line(capsys, monkeypatch, tmp_path, corpus, command, message, line):
    monkeypatch.setattr(fivecut.launch, "spawn", failing_spawn(message))
    argv = layout_argv(command, tmp_path, "--layout", "dp=2", "--steps", "1", "--set", f'data.source="{corpus}"')
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: {command}") and line in err and err.count("\n") == 1 and "Traceback" not in err
    report = Path(err.split("every rank's report: ")[1].strip())
    assert message in report.read_text()
    report.unlink()


def test_a_timed_out_verify_is_one_line_end_to_end(capsys, monkeypatch, tmp_path, corpus):
    """A real spawn, which cannot finish within 10 ms (starting a process alone takes longer)."""
    monkeypatch.setattr(fivecut.launch, "spawn", SPAWN)
    argv = ["--layout", "dp=2", "--steps", "1", "--timeout", "0.01", "--set", f'data.source="{corpus}"']
    assert main(layout_argv("verify", tmp_path, *argv)) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: verify, the single process: rank 0 ") and "--timeout" in err
    assert err.count("\n") == 1 and "Traceback" not in err
    Path(err.split("every rank's report: ")[1].strip()).unlink()


# ---------------------------------------------------------------- verify's verdict


def verdict_of(capsys, diffs: dict, steps: int = 3) -> tuple[int, str]:
    code = verdict({name: dict(enumerate(values, start=1)) for name, values in diffs.items()}, TOLERANCES["fp32"])
    return code, capsys.readouterr().out


def test_the_first_gradient_norm_is_held_to_1e_5(capsys):
    code, out = verdict_of(capsys, {"loss": [0, 0, 0], "grad_norm": [2e-5, 0, 0], "val_loss": [0]})
    assert code == 1 and "grad_norm at step 1 2.000e-05 > 1e-05" in out


def test_later_gradient_norms_are_held_to_1e_3(capsys):
    code, out = verdict_of(capsys, {"loss": [0, 0, 0], "grad_norm": [1e-6, 5e-4, 9e-4], "val_loss": [0]})
    assert code == 0 and "max_rel_later_grad_norm_diff=9.000e-04" in out and out.startswith("PASS")
    code, out = verdict_of(capsys, {"loss": [0, 0, 0], "grad_norm": [1e-6, 5e-4, 2e-3], "val_loss": [0]})
    assert code == 1 and "grad_norm at step 3 2.000e-03 > 0.001" in out


def test_later_losses_stay_at_1e_5(capsys):
    code, out = verdict_of(capsys, {"loss": [0, 0, 2e-5], "grad_norm": [0, 0, 0], "val_loss": [2e-5]})
    assert code == 1 and "loss at step 3 2.000e-05 > 1e-05" in out and "val_loss at step 1" in out


@pytest.mark.parametrize("side", ["layout", "single process"])
def test_a_nan_on_either_side_fails(capsys, side):
    """A loss that is NaN under the layout (or in the single process) is no match: its relative
    difference is NaN, which no tolerance holds. Caught: a verdict that fails only where the
    difference exceeds the tolerance (NaN > tol is False, so a NaN passed)."""
    nan = float("nan")
    good = {"loss": {1: 2.0, 2: 1.9}, "grad_norm": {1: 1.0, 2: 0.9}, "val_loss": {2: 2.1}}
    bad = {**good, "loss": {1: 2.0, 2: nan}}
    reference, layout = (good, bad) if side == "layout" else (bad, good)
    diffs = print_comparison(reference, layout)
    capsys.readouterr()
    assert verdict(diffs, TOLERANCES["fp32"]) == 1
    out = capsys.readouterr().out
    assert out.startswith("FAIL") and "loss at step 2 nan > 1e-05" in out, out


def test_the_tolerances_are_printed(capsys, monkeypatch, tmp_path, corpus):
    monkeypatch.setattr(
        fivecut.launch, "spawn", Recorder(SimpleNamespace(losses=[2.0] * 4, grad_norms=[1.0] * 4, val_losses={4: 2.5}))
    )
    argv = layout_argv("verify", tmp_path, "--layout", "dp=2", "--steps", "4", "--set", f'data.source="{corpus}"')
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "loss 1e-05 at every step; gradient norm 1e-05 at step 1, 1e-03 at steps 2-4; validation loss 1e-05" in out


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
def test_corrupted_store_is_refused_by_name(tmp_path, corpus, damage):
    """A finished store whose shard no longer matches its sha256 is refused, naming the shard and the
    fix; after that fix (its folder removed) the same tokens come back."""
    cache = tmp_path / "cache"
    folder = load_tokens(str(corpus), "byte", cache).cache_path
    shard = folder / "shard-00000.bin"
    size = shard.stat().st_size
    shard.write_bytes(bytes(size) if damage == "zeros" else np.random.default_rng(0).bytes(size))
    with pytest.raises(DataError, match="does not match the sha256") as caught:
        load_tokens(str(corpus), "byte", cache)
    assert str(shard) in str(caught.value) and f"remove the folder {folder}" in str(caught.value)
    shutil.rmtree(folder)
    np.testing.assert_array_equal(all_tokens(load_tokens(str(corpus), "byte", cache)), fresh_tokens(corpus))


@pytest.mark.parametrize("old", ["no store.json", "older version"])
def test_unfinished_or_older_store_is_built_again(tmp_path, corpus, old):
    cache = tmp_path / "cache"
    folder = load_tokens(str(corpus), "byte", cache).cache_path
    meta_path = folder / "store.json"
    if old == "no store.json":
        meta_path.unlink()
    else:
        meta_path.write_text(json.dumps({**json.loads(meta_path.read_text()), "version": 0}))
    (folder / "shard-00000.bin").write_bytes(bytes((folder / "shard-00000.bin").stat().st_size))
    splits = load_tokens(str(corpus), "byte", cache)
    np.testing.assert_array_equal(all_tokens(splits), fresh_tokens(corpus))


def test_sound_cache_is_reused_quietly(tmp_path, corpus, capfd):
    cache = tmp_path / "cache"
    first = load_tokens(str(corpus), "byte", cache)
    meta = json.loads((first.cache_path / "store.json").read_text())
    assert len(meta["shards"][0]["sha256"]) == 64 and meta["tokenizer"] == "byte" and meta["vocab_size"] == 256
    capfd.readouterr()
    load_tokens(str(corpus), "byte", cache)
    assert "built token store" not in capfd.readouterr().out
