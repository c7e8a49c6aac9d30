"""The doors of a training run (issue 32): one run per checkpoint folder, a folder that stops being
writable between two saves, keys that would do nothing, and the pipeline's default microbatches.
Each refusal is one line naming the key, folder or flag and a fix, exit 2, no traceback."""

import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch.distributed as dist

import fivecut.launch
from fivecut import checks
from fivecut.checks import LayoutError
from fivecut.cli import LOSS_RTOL, main, verify_config
from fivecut.config import ConfigError, load_config, settle_min_lr
from fivecut.train.data import eval_batches, load_sources

REPO = Path(__file__).resolve().parents[1]


def run_settings(cache: str, out: Path, *overrides: str) -> list[str]:
    """A tiny, quiet CLI training run writing to `out` (a few seconds)."""
    base = [
        'model.preset="tiny"',
        "train.seq_len=32",
        "train.global_batch=4",
        "train.warmup=1",
        "train.eval_every=0",
        "log.progress=false",
        "log.plot=false",
        f'data.cache_dir="{cache}"',
        f'log.out_dir="{out}"',
    ]
    return [arg for item in base + list(overrides) for arg in ("--set", item)]


def refused(capsys, argv: list[str]) -> str:
    """The CLI in-process, with no process group allowed: exit 2 and one `error: ` line."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err and err.count("\n") == 1, err
    assert not dist.is_initialized()
    return err


@pytest.fixture
def no_processes(monkeypatch):
    def started(*args, **kwargs):
        raise AssertionError("a process group was formed for a refused input")

    monkeypatch.setattr(fivecut.launch, "init_from_environment", started)
    monkeypatch.setattr(fivecut.launch, "spawn", started)


def digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


# ---------------------------------------------------------------- 1. one run per checkpoint folder


@pytest.fixture(scope="module")
def earlier_run(tmp_path_factory):
    """A run of 4 steps at lr 3e-3 that saved steps 2 and 4 into its checkpoint.dir."""
    tmp = tmp_path_factory.mktemp("earlier")
    cache = str(tmp_path_factory.getbasetemp() / "token-cache")
    folder = tmp / "ckpt"
    argv = ["train", "--resume", "never"] + run_settings(
        cache, tmp / "out", "train.steps=4", "checkpoint.every=2", f'checkpoint.dir="{folder}"'
    )
    assert main(argv) == 0
    assert sorted(p.name for p in folder.glob("step-*")) == ["step-00000002", "step-00000004"]
    return cache, folder


# a new run's unset floor follows its lr (`config.lr_floor`), so a changed lr changes both
ANOTHER_RUN = "another run (train.lr 0.003 -> 0.001, train.min_lr 0.0003 -> 0.0001)"


@pytest.mark.parametrize("lr, whose", [("1e-3", ANOTHER_RUN), ("3e-3", "--resume auto")])
def test_resume_never_into_a_folder_holding_a_run_is_refused(earlier_run, tmp_path, capsys, no_processes, lr, whose):
    """Another run (a changed lr) or the same config again: a new run never saves among a run's checkpoints."""
    cache, folder = earlier_run
    before = {p.name: digest(p) for p in folder.glob("step-*")}
    argv = ["train", "--resume", "never"] + run_settings(
        cache, tmp_path / "out", "train.steps=4", f"train.lr={lr}", f'checkpoint.dir="{folder}"'
    )
    err = refused(capsys, argv)
    assert f"checkpoint.dir={str(folder)!r}" in err and "newest step 4" in err, err
    assert "another checkpoint.dir" in err and f"remove {folder}" in err and whose in err, err
    assert {p.name: digest(p) for p in folder.glob("step-*")} == before  # nothing overwritten
    assert not (tmp_path / "out").exists()  # nothing written before the refusal


# ---------------------------------------------------------------- 2. a folder unwritable between two saves

# Runs the CLI in a fresh process whose `checkpoint.save` makes checkpoint.dir read-only after its
# first save. As root, the process gives up the capabilities that let root write anywhere
# (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_FOWNER leave the bounding set before exec), so
# that the folder's mode binds it as it binds any user.
READ_ONLY_AFTER_FIRST_SAVE = textwrap.dedent(
    """
    import os, sys
    import fivecut.train.checkpoint as checkpoint
    from fivecut.cli import main

    real_save = checkpoint.save

    def save_then_lock(root, *args, **kwargs):
        path = real_save(root, *args, **kwargs)
        os.chmod(root, 0o555)
        return path

    checkpoint.save = save_then_lock
    sys.exit(main(sys.argv[1:]))
    """
)


def drop_root_writes() -> None:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2, 3):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_FOWNER
        if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            os._exit(99)


def test_a_checkpoint_folder_unwritable_after_the_first_save_ends_in_one_line(byte_cache, tmp_path):
    folder = tmp_path / "ckpt"
    settings = run_settings(byte_cache, tmp_path / "out", "train.steps=4", "checkpoint.every=2")
    argv = ["train", "--resume", "never", *settings, "--set", f'checkpoint.dir="{folder}"']
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("RANK", None)
    run = subprocess.run(
        [sys.executable, "-c", READ_ONLY_AFTER_FIRST_SAVE, *argv],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
        preexec_fn=drop_root_writes if os.geteuid() == 0 else None,
    )
    try:
        if run.returncode == 99:
            pytest.skip("running as root without CAP_SETPCAP: no way to make a folder unwritable for this process")
        assert run.returncode == 2, run.stdout + run.stderr
        assert "Traceback" not in run.stderr and run.stderr.count("error: ") == 1, run.stderr
        line = next(x for x in run.stderr.splitlines() if x.startswith("error: "))
        assert f"checkpoint.dir={str(folder)!r} cannot be written" in line and "step 4 was not saved" in line
        assert f"step 2 is intact in {folder / 'step-00000002'}" in line, line
        assert [p.name for p in folder.iterdir()] == ["step-00000002"]
        assert main(["checkpoint", "info", str(folder / "step-00000002")]) == 0  # complete and intact
    finally:
        folder.chmod(0o755)


# ---------------------------------------------------------------- 3. keys that would do nothing


def test_recompute_every_without_recompute_is_refused(capsys, tmp_path, no_processes):
    err = refused(capsys, ["train"] + run_settings(str(tmp_path), tmp_path / "out", "train.recompute_every=2"))
    assert "train.recompute_every=2" in err and "train.recompute='none'" in err, err
    assert "train.recompute='full' or 'selective'" in err and "remove train.recompute_every" in err


# ---------------------------------------------------------------- 4. microbatches under a pipeline


def resolved(*overrides: str) -> int:
    cfg = load_config(None, ['model.preset="tiny"', "train.seq_len=32", *overrides])
    checks.validate(cfg, cfg.parallel.world_size)
    return cfg.parallel.microbatches


@pytest.mark.parametrize(
    "schedule, extra, count",
    [("1f1b", (), 2), ("gpipe", (), 2), ("zb1p", (), 2), ("interleaved", ("parallel.pp_virtual=2",), 2)]
    + [("dualpipev", (), 4)],
)
def test_unset_microbatches_are_the_fewest_the_schedule_needs(schedule, extra, count):
    assert resolved("parallel.pp=2", f'parallel.pp_schedule="{schedule}"', *extra) == count
    assert resolved("parallel.pp=1") is None  # no pipeline: nothing to count


def test_unset_microbatches_divide_a_ranks_rows():
    """dualpipev on pp=2 needs 4; 6 rows per rank take 6 (4 and 5 leave rows over)."""
    assert resolved("parallel.pp=2", 'parallel.pp_schedule="dualpipev"', "train.global_batch=6") == 6
    assert resolved("parallel.pp=2", "parallel.dp=2", "train.global_batch=12") == 2  # 6 rows per dp rank


def test_no_microbatch_count_that_fits_is_refused_naming_the_batch(capsys, tmp_path, no_processes):
    argv = ["verify", "--layout", "pp=4", "--set", "train.global_batch=2", "--set", f'data.cache_dir="{tmp_path}"']
    err = refused(capsys, argv)
    assert "parallel.microbatches is unset" in err and "needs at least 4" in err, err
    assert "train.global_batch=4" in err


def test_a_microbatch_count_given_that_cannot_work_is_still_refused(capsys, tmp_path, no_processes):
    err = refused(capsys, ["verify", "--layout", "pp=2,microbatches=1", "--set", f'data.cache_dir="{tmp_path}"'])
    assert "1f1b with pp=2 needs microbatches >= pp; got 1" in err


def test_verify_and_the_planner_see_the_count_chosen(capsys, tmp_path):
    ns = SimpleNamespace(model="tiny", layout="pp=2", steps=2, timeout=60.0, rtol=LOSS_RTOL, overrides=[])
    assert verify_config(ns).parallel.microbatches == 2
    argv = ["plan", "--layout", "pp=2", "--cluster", "1x2xH100", "--out", str(tmp_path / "plan")]
    assert main(argv) == 0
    assert "layout pp=2,microbatches=2," in capsys.readouterr().out


def torchrun(nproc: int, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run(
        [*command, "-m", "fivecut", *args], capture_output=True, text=True, timeout=300, cwd=cwd, env=env
    )


@pytest.mark.multirank
def test_torchrun_pp2_without_microbatches_trains_and_says_the_count(byte_cache, tmp_path):
    run = torchrun(2, tmp_path, "train", *run_settings(byte_cache, tmp_path / "out", "train.steps=2", "parallel.pp=2"))
    assert run.returncode == 0, run.stderr
    assert "layout pp=2,microbatches=2 (2 ranks" in run.stdout, run.stdout


@pytest.mark.multirank
def test_torchrun_refusal_is_said_once_and_named_in_torchruns_report(byte_cache, tmp_path):
    run = torchrun(2, tmp_path, "train", *run_settings(byte_cache, tmp_path / "out", "train.recompute_every=2"))
    assert run.returncode != 0 and "Traceback" in run.stderr  # torchrun's own, from its agent
    ours = [line for line in run.stderr.splitlines() if line.startswith("error: ")]
    assert len(ours) == 1 and "train.recompute_every=2" in ours[0], run.stderr
    assert "traceback : error: invalid options: train.recompute_every=2" in run.stderr  # not a link to docs


# ---------------------------------------------------------------- 5. a fix for too few layers that can be followed


def test_too_few_layers_for_dualpipev_offers_a_fix_that_works(capsys, tmp_path, no_processes):
    layout = "tp=2,pp=2,sp=true,pp_schedule=dualpipev"
    argv = ["verify", "--model", "tiny-gpt2", "--layout", layout, "--set", f'data.cache_dir="{tmp_path}"']
    err = refused(capsys, argv)
    assert "2 layers cannot fill 4 pipeline stages (2 per rank under dualpipev)" in err, err
    assert "lower pp" not in err and "pp_virtual" not in err  # neither can be followed at pp=2
    assert "parallel.pp_schedule='1f1b'" in err and "at least 4 layers (model.n_layers)" in err
    sets = ['model.preset="tiny-gpt2"', "parallel.tp=2", "parallel.pp=2", "parallel.sp=true", "train.seq_len=64"]
    with pytest.raises(LayoutError):
        checks.validate(load_config(None, [*sets, 'parallel.pp_schedule="dualpipev"']), 4)
    for fix in ('parallel.pp_schedule="1f1b"', "model.n_layers=4"):  # each fix offered, followed, passes
        checks.validate(load_config(None, [*sets, 'parallel.pp_schedule="dualpipev"', fix]), 4)


# ---------------------------------------------------------------- 5. the schedule's floor follows the rate (issue 42)


def test_a_lowered_lr_is_trained_with_a_floor_that_follows_it(byte_cache, tmp_path, capsys):
    """`--set train.lr=1e-4` (fine-tuning) with min_lr unset: accepted, and the cosine decays to lr/10.
    Caught: a fixed default min_lr (3e-4, above the rate: refused)."""
    out = tmp_path / "out"
    argv = ["train"] + run_settings(byte_cache, out, "train.lr=1e-4", "train.steps=3", "log.peak_tflops=1.0")
    assert main(argv) == 0, capsys.readouterr().err
    lrs = [json.loads(line)["lr"] for line in (out / "metrics.jsonl").read_text().splitlines() if '"lr"' in line]
    assert lrs[-1] == pytest.approx(1e-5, rel=1e-12)  # the last step sits on the floor
    saved = json.loads((out / "config.json").read_text())
    assert saved["train"]["min_lr"] == pytest.approx(1e-5)  # the floor used, as a resume compares it


def floor(*overrides: str, saved: dict | None = None) -> float:
    cfg = load_config(None, list(overrides))
    checks.validate(cfg, 1)
    settle_min_lr(cfg.train, saved)
    return cfg.train.min_lr


def test_the_default_floor_is_a_tenth_of_the_rate_and_a_resume_keeps_its_own():
    assert floor() == pytest.approx(3e-4)  # the default rate's floor is the earlier fixed default
    assert floor("train.lr=0.5", "train.min_lr=0.2") == 0.2  # a floor given is kept
    assert floor("train.lr=1e-3", saved={"train": {"min_lr": 2e-4}}) == 2e-4  # a resume goes on with its schedule
    assert floor("train.lr=1e-3", "train.min_lr=0.0", saved={"train": {"min_lr": 2e-4}}) == 0.0


def test_a_resume_whose_lowered_rate_is_below_its_kept_floor_is_refused_naming_both():
    with pytest.raises(ConfigError, match=r"^train.lr=1e-05 is below train.min_lr=0.0003, .* from the checkpoint"):
        floor("train.lr=1e-5", saved={"train": {"min_lr": 3e-4}})


def test_a_floor_given_above_the_rate_is_refused_naming_both(capsys, tmp_path, no_processes):
    err = refused(
        capsys, ["train"] + run_settings(str(tmp_path), tmp_path / "out", "train.lr=1e-4", "train.min_lr=1e-3")
    )
    assert "train.min_lr=0.001 exceeds train.lr=0.0001" in err and "set train.min_lr <= train.lr" in err, err


# ---------------------------------------------------------------- 6. a validation split too small (issue 42)


def test_a_validation_split_too_small_for_eval_batches_is_refused_before_any_process(tmp_path, capsys, no_processes):
    """20,000 bytes hold a 1,000-token validation split; 8 x 4 windows of 65 tokens need 2,049. Caught:
    the ranks' own refusal (`train.data.eval_batches`), reached only after the process group formed."""
    corpus = tmp_path / "small.txt"
    corpus.write_text("to be or not to be " * 1052 + "to be or not")  # 20,000 bytes, one document
    sets = (f'data.source="{corpus}"', "train.seq_len=64", "train.eval_every=1", "train.eval_batches=8")
    err = refused(capsys, ["train"] + run_settings(str(tmp_path / "cache"), tmp_path / "out", *sets))
    assert "train.eval_batches=8 x train.global_batch=4 validation windows of 65 tokens need 2,049 tokens" in err, err
    assert f"validation split of {str(corpus)!r} holds 1,000 (data.val_fraction=0.05 of its 20,000)" in err, err
    assert "set train.eval_batches=3, or raise data.val_fraction to 0.103, or set train.eval_every=0" in err, err
    for fix in ("train.eval_batches=3", "data.val_fraction=0.103", "train.eval_every=0"):  # each fix passes
        cfg = load_config(None, [*sets, f'data.cache_dir="{tmp_path / "cache"}"', "train.global_batch=4", fix])
        checks.check_eval_split(cfg, load_sources(cfg.data, "byte"))


def test_the_split_check_and_the_ranks_evaluation_agree_at_every_length():
    """One source, each split length from 1 to 200 tokens: the check passes iff `eval_batches` builds the
    validation set, down to the last token (w windows of seq_len + 1 whose targets never overlap need
    w * seq_len + 1 tokens). Caught: an off-by-one at the boundary (w * seq_len tokens passed)."""
    cfg = load_config(None, ["train.seq_len=16", "train.global_batch=4", "train.eval_every=1"])
    cfg.data.source = "s0"
    for batches in (1, 2, 3):
        cfg.train.eval_batches = batches
        for length in range(1, 201):
            val = np.arange(length) % 7
            try:
                eval_batches([val], 16, 4, batches)
                built = True
            except ValueError:
                built = False
            try:
                checks.check_eval_split(cfg, [SimpleNamespace(val=val, n_tokens=20 * length)])
                passed = True
            except ConfigError:
                passed = False
            assert passed == built, (length, batches)


@pytest.mark.parametrize("weights", [None, [3.0, 1.0], [1.0, 1.0, 5.0]])
def test_the_split_check_refuses_exactly_what_the_ranks_evaluation_cannot_take(weights):
    """Over mixed sources (windows dealt by weight) and split sizes: the check passes iff the ranks'
    `eval_batches` builds the validation set. Caught: a check that deals the windows another way."""
    n = 3 if weights is None or len(weights) == 3 else 2
    cfg = load_config(None, ["train.seq_len=16", "train.global_batch=4", "train.eval_every=1"])
    cfg.data.source, cfg.data.weights = [f"s{k}" for k in range(n)], weights
    for lengths in [(200, 300, 50), (1000, 129, 400), (65, 65, 2000), (500, 500, 500)]:
        vals = [np.arange(length) % 7 for length in lengths[:n]]
        sources = [SimpleNamespace(val=v, n_tokens=20 * len(v)) for v in vals]
        for batches in range(1, 9):
            cfg.train.eval_batches = batches
            try:
                eval_batches(vals, 16, 4, batches, weights)
                built = True
            except ValueError:
                built = False
            try:
                checks.check_eval_split(cfg, sources)
                passed = True
            except ConfigError as err:
                passed = False
                assert "need" in str(err) and "train.eval_every=0" in str(err)
            assert passed == built, (lengths[:n], batches)
