"""`fivecut plan`'s doors: every bad flag or cluster file is refused naming it, exit 2, before the
search or any process; a model that fits nowhere is an answer (exit 1) with the figures."""

from pathlib import Path

import pytest
import torch.distributed as dist

import fivecut.launch
import fivecut.plan.calibrate
import fivecut.plan.search
from fivecut.cli import NOTHING_FITS, main
from fivecut.plan.calibrate import rank_room

TINY = ["plan", "--model", "tiny", "--cluster", "1x2xH100", "--seq", "64"]
H100 = '[cluster]\nnodes = 1\ngpus_per_node = 2\ndevice = "H100"\n'


@pytest.fixture(autouse=True)
def nothing_runs(monkeypatch):
    """Reaching a spawn, a process group or the search means a bad input got through."""

    def started(*args, **kwargs):
        raise AssertionError("a process or the search was started for a bad input")

    for module, name in (
        (fivecut.launch, "spawn"),
        (fivecut.launch, "init_from_environment"),
        (fivecut.plan.calibrate, "spawn"),
        (fivecut.plan.search, "search"),
    ):
        monkeypatch.setattr(module, name, started)


def refused(capsys, argv: list[str]) -> str:
    """The CLI in-process: exit 2, one line naming the problem, no traceback."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err and err.count("\n") == 1
    assert not dist.is_initialized()
    return err


def test_calibrate_refuses_more_ranks_than_the_machine_holds(tmp_path, capsys):
    room, machine = rank_room()
    for ranks in (room + 1, 256 + room):
        err = refused(capsys, ["plan", "calibrate", "--ranks", str(ranks), "--out", str(tmp_path / "c.toml")])
        assert f"--ranks {ranks}" in err and machine in err and f"--ranks {room} or fewer" in err
    assert not (tmp_path / "c.toml").exists()


@pytest.mark.parametrize(
    "flags, said",
    [
        (["--device", "cuda"], "--device cuda: torch"),  # no GPU here: why, in one line
        (["--seq", "0"], "--seq 0"),
        (["--model", "nope"], "--model 'nope'"),
        (["--model", "small"], "size a GPU's probes"),  # this CPU's probes take no model
    ],
)
def test_calibrate_refuses_what_it_cannot_measure(tmp_path, capsys, monkeypatch, flags, said):
    monkeypatch.setattr(fivecut.plan.calibrate.torch.cuda, "is_available", lambda: False)
    err = refused(capsys, ["plan", "calibrate", "--ranks", "1", "--out", str(tmp_path / "c.toml"), *flags])
    assert said in err
    assert not (tmp_path / "c.toml").exists()


@pytest.mark.parametrize(
    "flags, said",
    [
        (["--top", "0"], "--top 0"),
        (["--top", "-2"], "--top -2"),
        (["--seq", "0"], "--seq 0"),
        (["--seq", "-64"], "--seq -64"),
        (["--global-batch", "0"], "--global-batch 0"),
        (["--global-batch", "-8"], "--global-batch -8"),
        (["--global-batch-tokens=inf"], "--global-batch-tokens 'inf' is not a finite number"),
        (["--global-batch-tokens=nan"], "--global-batch-tokens 'nan' is not a finite number"),
        (["--global-batch-tokens=1e400"], "--global-batch-tokens '1e400' is not a finite number"),
    ],
)
def test_a_plan_number_below_one_or_not_finite_is_refused_naming_the_flag(flags, said, tmp_path, capsys):
    assert said in refused(capsys, [*TINY, *flags, "--out", str(tmp_path / "plan")])


def test_an_out_under_a_regular_file_is_refused_before_the_search(tmp_path, capsys):
    (tmp_path / "notes").write_text("mine")
    err = refused(capsys, [*TINY, "--out", str(tmp_path / "notes" / "p")])
    assert f"--out {tmp_path / 'notes' / 'p'}" in err and f"{tmp_path / 'notes'} is a file" in err
    assert (tmp_path / "notes").read_text() == "mine"


BAD_CLUSTERS = [
    (H100 + "[links]\nintra = 5\n", "links.intra must be a table"),
    (H100 + '[device]\npeak_tflops = "fast"\n', "device.peak_tflops must be a finite number > 0, not 'fast'"),
    (H100 + '[links.intra]\nbandwidth_gbps = "fast"\nlatency_us = 3\n', "links.intra.bandwidth_gbps must be a finite"),
    (H100 + "[device]\nmemory_gb = nan\n", "device.memory_gb must be a finite number > 0, not nan"),
    (H100 + "[links.intra]\nbandwidth_gbps = inf\nlatency_us = 3\n", "links.intra.bandwidth_gbps must be a finite"),
    (H100 + "[device]\nachievable = 1.5\n", "device.achievable must be a finite number in (0, 1]"),
    (H100 + "[links.inter]\nbandwidth_gbps = 50\nlatency_us = -1\n", "links.inter.latency_us must be"),
    (H100.replace("nodes = 1", "nodes = true"), "cluster.nodes must be an integer >= 1, not True"),
    (H100.replace("nodes = 1", "nodes = 1.5"), "cluster.nodes must be an integer >= 1, not 1.5"),
    (H100.replace('"H100"', "100"), "cluster.device must be a string, not 100"),
    (H100 + "[device]\npeak_tflop = 900\n", "unknown key device.peak_tflop"),
    (H100 + "[links.between]\nbandwidth_gbps = 50\n", "unknown key links.between"),
    ("links = 3\n" + H100, "links must be a table"),
]


@pytest.mark.parametrize("text, said", BAD_CLUSTERS)
def test_a_cluster_file_with_a_wrong_value_is_refused_naming_the_file_and_the_key(text, said, tmp_path, capsys):
    path = tmp_path / "mine.toml"
    path.write_text(text)
    err = refused(capsys, ["plan", "--model", "tiny", "--cluster", str(path), "--out", str(tmp_path / "plan")])
    assert f"{path}: " in err and said in err


def auto_train(tmp_path: Path, cluster: Path) -> list[str]:
    sets = [
        f'log.out_dir="{tmp_path / "run"}"',
        f'data.cache_dir="{tmp_path / "cache"}"',
        'parallel.layout="auto"',
        f'parallel.cluster="{cluster}"',
    ]
    return ["train"] + [arg for item in sets for arg in ("--set", item)]


@pytest.mark.parametrize("text, said", BAD_CLUSTERS[:3])
def test_train_auto_refuses_the_same_cluster_file_naming_the_file_and_the_key(text, said, tmp_path, capsys):
    path = tmp_path / "mine.toml"
    path.write_text(text)
    err = refused(capsys, auto_train(tmp_path, path))
    assert f"parallel.cluster: {path}: " in err and said in err


def test_a_cluster_file_that_is_not_utf8_is_refused_naming_it(tmp_path, capsys):
    path = tmp_path / "latin1.toml"
    path.write_bytes((H100 + 'name = "Zürich"\n').encode("latin-1"))
    err = refused(capsys, ["plan", "--model", "tiny", "--cluster", str(path), "--out", str(tmp_path / "plan")])
    assert f"{path}: not UTF-8" in err
    assert f"{path}: not UTF-8" in refused(capsys, auto_train(tmp_path, path))


def test_a_model_that_fits_nowhere_says_what_it_needs_and_on_how_many_devices_it_fits(tmp_path, capsys, monkeypatch):
    """llama3-405b on one H100: the least a device would need, and the first doubled cluster on which a
    layout fits; exit 1, no plan written. The answer is the planner's: on that cluster its search finds a
    fitting layout, on the one before none."""
    monkeypatch.undo()  # the search runs here: the input is good
    out = tmp_path / "plan"
    assert main(["plan", "--model", "llama3-405b", "--cluster", "1x1xH100", "--out", str(out)]) == 1
    text = capsys.readouterr().out
    assert "no layout fits in 80 GB; the one needing least, single, needs more than 6493.7 GB a device" in text
    assert "it fits on 128 devices (128 nodes of 1 H100" in text and "plan it with --cluster 128x1xH100" in text
    assert not out.exists()

    argv = ["plan", "--model", "llama3-70b", "--seq", "2048", "--global-batch", "2", "--out", str(out)]
    assert main([*argv, "--cluster", "1x2xA100"]) == 1
    text = capsys.readouterr().out
    assert "it fits on 16 devices (8 nodes of 2 A100" in text and "--cluster 8x2xA100" in text
    assert main([*argv, "--cluster", "4x2xA100"]) == 1  # the doubling before: nothing fits
    assert main([*argv, "--cluster", "8x2xA100"]) == 0 and (out / "plan.json").is_file()


def test_top_beside_a_layout_is_refused_naming_both_flags(tmp_path, capsys):
    """--top ranks a search; --layout costs one layout, so --top would be ignored. Caught: accepted, exit 0."""
    err = refused(capsys, [*TINY, "--layout", "dp=2", "--top", "3", "--out", str(tmp_path / "plan")])
    assert "--top 3" in err and "--layout dp=2" in err and "drop --top, or drop --layout" in err, err
    assert not (tmp_path / "plan").exists()


def test_a_layout_that_does_not_fit_exits_as_a_search_in_which_none_fits(tmp_path, capsys):
    """llama3-70b on two H100s, data-parallel: the plan is printed and written, exit NOTHING_FITS (1),
    as a search that finds no layout; a layout that fits exits 0. Caught: exit 0 whatever the verdict."""
    out = tmp_path / "plan"
    argv = ["plan", "--model", "llama3-70b", "--cluster", "1x2xH100", "--seq", "1024", "--layout", "dp=2"]
    assert main([*argv, "--out", str(out)]) == NOTHING_FITS == 1
    text = capsys.readouterr().out
    assert "layout dp=2" in text and "does NOT fit" in text and (out / "plan.json").is_file()
    assert main([*TINY, "--layout", "dp=2", "--out", str(out)]) == 0
    assert ": fits" in capsys.readouterr().out
