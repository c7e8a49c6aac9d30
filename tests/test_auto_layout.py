"""parallel.layout = "auto": the planner chooses the layout for the world a run starts with, and a
run restarted on another number of ranks goes on under the layout planned for that world.

Tolerances: a resume into another layout continues as an uninterrupted run does up to rounding
(see tests/test_checkpoint.py): losses at rtol 1e-5, gradient norms at 1e-3 (the two runs reach
the resumed steps by different roundings, which a step's gradient amplifies). The first launch's
steps are compared at 1e-5 too, and its first gradient norm at 1e-5: a wrong gradient scale moves
it by a factor.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from fivecut.checks import checked_model_args
from fivecut.cli import main, same_layout_everywhere
from fivecut.config import load_config
from fivecut.launch import spawn
from fivecut.layout import ParallelDims
from fivecut.plan.auto import cluster_for_world, planned_layout
from fivecut.plan.cluster import cluster_toml, preset_cluster

RTOL = 1e-5
NORM_RTOL = 1e-3  # later steps' gradient norms (see the module doc)

# a cluster file as `fivecut plan calibrate` writes one, with fixed figures so that the choice is
# the same on every machine: 2 CPU ranks of 50 GFLOP/s, gloo at 2 GB/s and 60 us a hop
CPU_RANK = """
[cluster]
name = "this-machine"
nodes = 1
gpus_per_node = 2
[device]
name = "cpu"
peak_tflops = 0.05
memory_gb = 8
achievable = 1
kernel_us = 20
[links.intra]
bandwidth_gbps = 2
latency_us = 60
[links.inter]
bandwidth_gbps = 2
latency_us = 60
"""


@pytest.fixture
def cluster_file(tmp_path) -> str:
    path = tmp_path / "cluster-local.toml"
    path.write_text(CPU_RANK)
    return str(path)


def train_command(nproc: int, cache: str, out: Path, cluster: str, *extra: str) -> list[str]:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    settings = [
        'parallel.layout="auto"',
        f'parallel.cluster="{cluster}"',
        "train.steps=6",
        "train.seq_len=32",
        "train.global_batch=8",
        "train.warmup=1",
        "train.eval_every=0",
        'data.tokenizer="byte"',
        f'data.cache_dir="{cache}"',
        f'log.out_dir="{out}"',
        "log.progress=false",
        "log.plot=false",
        *extra,
    ]
    flags = [item for s in settings for item in ("--set", s)]
    return (launcher if nproc > 1 else [sys.executable]) + ["-m", "fivecut", "train", *flags]


def run(command: list[str]) -> str:
    done = subprocess.run(command, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def records(out: Path) -> dict[int, dict]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines) if "step" in r and "loss" in r}


def chosen(stdout: str) -> str:
    line = next(x for x in stdout.splitlines() if "parallel.layout=auto chose" in x)
    return line.split(" chose ")[1].split(" ")[0]


@pytest.mark.multirank
@pytest.mark.sweep  # ~50-100 s; the default suite's node-loss test below resumes under a smaller world too
def test_a_run_restarted_on_fewer_ranks_goes_on_under_their_layout(byte_cache, tmp_path, cluster_file):
    whole = tmp_path / "whole"
    run(train_command(1, byte_cache, whole, cluster_file))
    out, ckpt = tmp_path / "elastic", f'checkpoint.dir="{tmp_path / "ckpt"}"'
    first = run(train_command(4, byte_cache, out, cluster_file, ckpt, "train.launch_steps=3"))
    assert "stopped at step 3 of 6" in first
    second = run(train_command(2, byte_cache, out, cluster_file, ckpt, "train.launch_steps=3"))
    assert "resumed at step 3" in second and "parallel.dp 4 -> 2" in second and "stopped" not in second
    on_four, on_two = chosen(first), chosen(second)
    assert on_four != on_two and "dp=4" in on_four and "dp=2" in on_two, (on_four, on_two)
    ref, got = records(whole), records(out)
    assert sorted(got) == list(range(1, 7))
    np.testing.assert_allclose([got[s]["loss"] for s in got], [ref[s]["loss"] for s in got], rtol=RTOL)
    np.testing.assert_allclose(got[1]["grad_norm"], ref[1]["grad_norm"], rtol=RTOL)
    np.testing.assert_allclose([got[s]["grad_norm"] for s in got], [ref[s]["grad_norm"] for s in got], rtol=NORM_RTOL)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def elastic_agent(port: int, cache: str, out: Path, cluster: str, *extra: str) -> subprocess.Popen:
    """One torchrun agent of an elastic job of 1 to 2 nodes of 2 ranks (both agents on this host)."""
    command = train_command(2, cache, out, cluster, *extra)
    elastic = [
        "--nnodes=1:2",
        "--max-restarts=2",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-id=fivecut-elastic",
        "--rdzv-conf=last_call_timeout=10,join_timeout=120",
    ]
    at = command.index("--standalone")
    command[at : at + 1] = elastic
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_for(path: Path, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} did not appear within {seconds} s"
        time.sleep(0.05)


def kill_agent(agent: subprocess.Popen) -> None:
    """The node is lost: its agent and its ranks at once (SIGKILL, nothing saved)."""
    for child in subprocess.run(["pgrep", "-P", str(agent.pid)], capture_output=True, text=True).stdout.split():
        os.kill(int(child), signal.SIGKILL)
    agent.kill()
    agent.wait()


@pytest.mark.multirank
def test_torchrun_loses_a_node_and_the_job_goes_on_under_the_smaller_worlds_layout(byte_cache, tmp_path, cluster_file):
    """torchrun --nnodes 1:2: two agents of 2 ranks each; one is killed after the first checkpoint;
    the other's agent re-forms the job with 2 ranks, which plan dp=2 and resume from the checkpoint."""
    steps, ckpt = "train.steps=40", f'checkpoint.dir="{tmp_path / "ckpt"}"'
    whole = tmp_path / "whole"
    run(train_command(1, byte_cache, whole, cluster_file, steps))
    out, port = tmp_path / "elastic", free_port()
    options = (byte_cache, out, cluster_file, steps, ckpt, "checkpoint.every=4", "log.log_every=1")
    survivor = elastic_agent(port, *options)
    time.sleep(1)  # the first agent hosts the rendezvous store
    lost = elastic_agent(port, *options)
    wait_for(tmp_path / "ckpt" / "step-00000004" / "COMPLETE", 240)
    kill_agent(lost)
    said, _ = survivor.communicate(timeout=400)
    assert survivor.returncode == 0, said[-4000:]
    first = next(x for x in said.splitlines() if "parallel.layout=auto chose" in x)
    assert "dp=4" in first and "for 4 ranks" in first, said[-4000:]
    restarted = said[said.index(first) + len(first) :]
    assert "for 2 ranks" in restarted and "resumed at step" in restarted and "parallel.dp 4 -> 2" in restarted
    ref, got = records(whole), last_records(out)
    assert sorted(got) == list(range(1, 41))
    np.testing.assert_allclose([got[s]["loss"] for s in got], [ref[s]["loss"] for s in got], rtol=RTOL)
    np.testing.assert_allclose(got[1]["grad_norm"], ref[1]["grad_norm"], rtol=RTOL)
    np.testing.assert_allclose([got[s]["grad_norm"] for s in got], [ref[s]["grad_norm"] for s in got], rtol=NORM_RTOL)


def last_records(out: Path) -> dict[int, dict]:
    """Each step's last record: the killed attempt logged the steps after its checkpoint once more."""
    found: dict[int, dict] = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "step" in record and "loss" in record:
            found[record["step"]] = record
    return found


def tiny_config(*items: str):
    return load_config(None, [*items, 'data.tokenizer="byte"', "train.global_batch=8", "train.seq_len=32"])


def test_the_layout_is_planned_for_the_world_and_its_nodes(cluster_file):
    cfg = tiny_config(f'parallel.cluster="{cluster_file}"', 'parallel.layout="auto"')
    args = checked_model_args(cfg)
    planned = planned_layout(cfg, args, 4, 2)
    assert (planned.cluster.nodes, planned.cluster.gpus_per_node) == (2, 2)
    assert planned.cfg.parallel.world_size == 4 and planned.cfg.parallel.layout == "manual"
    assert planned.cfg.parallel.cluster is None  # the resolved config is an ordinary one
    again = planned_layout(cfg, args, 4, 2)
    assert again.cfg.parallel == planned.cfg.parallel  # the same answer on every rank
    assert planned.lines()[0].startswith(f"fivecut: parallel.layout=auto chose {planned.chosen.layout}")


@pytest.mark.parametrize(
    "items, words",
    [
        (['parallel.layout="auto"', "parallel.dp=2"], "parallel.dp=2 is given too"),
        (['parallel.layout="auto"', "train.accumulate=2"], "train.accumulate=2 is given too"),
        (['parallel.layout="auto"', 'train.recompute="full"'], "train.recompute='full' is given too"),
        (['parallel.layout="best"'], "parallel.layout='best'; choose one of manual, auto"),
        (['parallel.cluster="c.toml"'], "set parallel.layout='auto' or remove parallel.cluster"),
        (["train.launch_steps=2"], "checkpoint.dir is unset"),
    ],
)
def test_auto_beside_given_cuts_is_refused_naming_them(items, words, capsys, tmp_path, cluster_file):
    flags = [x for item in items for x in ("--set", item)]
    if any("layout=" in i for i in items) and not any("cluster" in i for i in items):
        flags += ["--set", f'parallel.cluster="{cluster_file}"']
    code = main(["train", *flags, "--set", f'log.out_dir="{tmp_path / "out"}"'])
    assert code == 2
    assert words in capsys.readouterr().err


def test_auto_without_a_calibration_names_the_command_that_writes_one(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--set", 'parallel.layout="auto"', "--set", "train.warmup=1"]) == 2
    err = capsys.readouterr().err
    assert "cluster-local.toml" in err and "fivecut plan calibrate" in err
    assert not (tmp_path / "runs").exists()  # refused before anything was written


def test_commands_that_need_the_cuts_refuse_auto(capsys):
    assert main(["verify", "--layout", "layout=auto"]) == 2
    assert "chosen by `fivecut train`" in capsys.readouterr().err


def test_a_world_no_layout_can_use_is_refused_naming_the_batch(cluster_file):
    cfg = tiny_config(f'parallel.cluster="{cluster_file}"', 'parallel.layout="auto"')
    with pytest.raises(ValueError, match="no layout of 3 ranks can run .* train.global_batch=8"):
        planned_layout(cfg, checked_model_args(cfg), 3, 3)


def test_a_cluster_the_ranks_do_not_fill_is_refused(cluster_file):
    with pytest.raises(ValueError, match="6 ranks do not fill nodes of 4"):
        cluster_for_world(cluster_file, 6, 4)
    named = cluster_for_world(cluster_toml_file(cluster_file), 16, 8)
    assert (named.nodes, named.gpus_per_node, named.device.name) == (2, 8, "H100")


def cluster_toml_file(near: str) -> str:
    path = Path(near).with_name("h100.toml")
    path.write_text(cluster_toml(preset_cluster(1, 8, "H100")))
    return str(path)


def layouts_by_rank(rank_layout: dict) -> str:
    import torch.distributed as dist

    cfg = load_config(None, [])
    cfg.parallel = ParallelDims(**rank_layout[dist.get_rank()])
    try:
        same_layout_everywhere(cfg)
    except ValueError as err:
        return str(err)
    return "agreed"


@pytest.mark.multirank
def test_ranks_that_planned_different_layouts_stop_naming_both():
    agree = spawn(layouts_by_rank, 2, {0: {"dp": 2}, 1: {"dp": 2}})
    assert agree == ["agreed", "agreed"]
    differ = spawn(layouts_by_rank, 2, {0: {"dp": 2}, 1: {"dp": 2, "zero": 1}})
    plan = "(accumulate 1, recompute none)"
    assert all(f"dp=2 {plan} on rank 0 but dp=2,zero=1 {plan} on rank 1" in d for d in differ), differ
