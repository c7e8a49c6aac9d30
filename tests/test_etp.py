"""Expert tensor parallelism (parallel.etp): each routed expert's hidden size cut over etp
ranks of the tp group, composed with EP's dispatch and combine.

Parity: the forward output and every gradient (experts gathered back over etp and ep) equal
the single-device model's; losses over optimizer steps equal the single-process run's.
Tolerances are test_expert.py's (fp32; the same rows meet the experts, the partial sums over
hidden are added in a different order by the reduce-scatter): logits rtol 1e-5, atol 1e-6;
gradients rtol 1e-5, atol 1e-7; losses over steps rtol 1e-5.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from test_ddp import GRAD_NORM_RTOL, LOSS_RTOL, small_config
from test_e2e import assert_activations_exact, assert_every_cut_exact, assert_memory_exact
from test_expert import assert_moe_step_matches_one_process, run_moe, run_moe_with_biases
from test_export import run_config

import fivecut.launch
from fivecut.cli import main
from fivecut.launch import spawn
from fivecut.model.presets import get_preset
from fivecut.train import checkpoint
from fivecut.train.trainer import train
from fivecut.weights import export as ex

CASES = {
    "dp=2,ep=2,tp=2,etp=2,sp": ("dp=2,ep=2,tp=2,etp=2,sp=true", {}),
    "tp=2,etp=2 no sp, capacity + aux": ("tp=2,etp=2", {"capacity_factor": 1.0, "aux_loss_coef": 0.01}),
    "dp=2,ep=2,tp=2,etp=2,sp, EPLB copies": ("dp=2,ep=2,tp=2,etp=2,sp=true", {"eplb_slots": 1}),
    "tp=4,etp=2,sp: two etp groups in a tp group": ("tp=4,etp=2,sp=true", {}),
}
EPLB_LOAD = [50.0, 1, 1, 1, 30, 1, 1, 1]  # experts 0 and 4 hot: each gets a copy on the other rank
SWEEP = (
    "tp=2,etp=2 no sp, capacity + aux",
    "dp=2,ep=2,tp=2,etp=2,sp, EPLB copies",
    "tp=4,etp=2,sp: two etp groups in a tp group",
)


@pytest.mark.multirank
@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.sweep) if c in SWEEP else c for c in CASES])
def test_forward_and_gradients_match_single_device(case):
    layout, options = CASES[case]
    eplb = EPLB_LOAD if "eplb_slots" in options else None
    assert_moe_step_matches_one_process(case, layout, options, {}, eplb)


MOE = ('model.preset="tiny-moe"',)
ETP = ("parallel.dp=2", "parallel.ep=2", "parallel.tp=2", "parallel.etp=2", "parallel.sp=true")


@pytest.mark.multirank
@pytest.mark.sweep
def test_loads_and_biases_match_one_process_with_eplb_copies(byte_cache, tmp_path):
    """Under dp=2,ep=2,tp=2,etp=2,sp with auxiliary-loss-free balancing and EPLB copies (ZeRO-1):
    every (token, slot) is counted once although the etp ranks dispatch the same gathered tokens
    (the loads sum to the batch's slots and equal one process's, exactly), the biases move as in
    one process, and losses and gradient norms stay the single process's (rtol 1e-5). Short and
    at lr 3e-4 so that no top-k choice flips by rounding (see test_expert's bias test)."""
    short = ("train.steps=4", "train.global_batch=4", "train.lr=3e-4", "train.min_lr=3e-5")
    balance = (*MOE, "moe.bias_update_rate=0.01", *short, f'log.out_dir="{tmp_path}"')
    eplb = ("moe.eplb_slots=1", "moe.eplb_interval=1", "moe.eplb_window=1")
    reference = spawn(run_moe_with_biases, 1, small_config(byte_cache, *balance))[0]
    ranks = spawn(run_moe_with_biases, 8 // 2, small_config(byte_cache, *balance, *ETP, *eplb, "parallel.zero=1"))
    slots = 4 * 32 * 2  # global batch x seq_len x top_k
    copies = 0
    for rank, (losses, norms, moe, biases) in enumerate(ranks):
        np.testing.assert_allclose(losses, reference[0], rtol=LOSS_RTOL)
        np.testing.assert_allclose(norms, reference[1], rtol=GRAD_NORM_RTOL)
        for step, (got, want) in enumerate(zip(moe, reference[2]), start=1):
            for layer, stats in got["layers"].items():
                assert sum(stats["load"]) == slots, f"rank {rank} step {step} layer {layer}"
                assert stats["load"] == want["layers"][layer]["load"], f"rank {rank} step {step} layer {layer}"
            copies += sum(layer["copies_sent"] for layer in got["local"].values())
        for step, (got, want) in enumerate(zip(biases, reference[3]), start=1):
            for layer in got:
                assert torch.equal(got[layer], want[layer]), f"rank {rank} step {step} layer {layer} biases"
    assert copies > 0  # hot experts' shards were copied


@pytest.mark.multirank
@pytest.mark.sweep
def test_moving_expert_shards_keeps_training_identical(byte_cache, tmp_path):
    """EPLB moves under etp=2 with ZeRO-1: each tp rank moves its own shard of a moved expert
    (weights, master shard, Adam moments) over its ep group; losses and norms stay one process's."""
    balance = (*MOE, "moe.bias_update_rate=0.01")
    reference = spawn(run_moe, 1, small_config(byte_cache, *balance))[0]
    eplb = ("moe.eplb_move=true", "moe.eplb_slots=1", "moe.eplb_interval=1", "moe.eplb_window=1")
    cfg = small_config(byte_cache, *balance, *ETP, *eplb, "parallel.zero=1", f'log.out_dir="{tmp_path}"')
    losses, moe, norms = spawn(run_moe, 4, cfg)[0]
    moved = sum(layer["moved_elements"] for step in moe for layer in step["local"].values())
    assert moved > 0  # experts did change ranks
    np.testing.assert_allclose(losses, reference[0], rtol=LOSS_RTOL)
    np.testing.assert_allclose(norms, reference[2], rtol=GRAD_NORM_RTOL)


def losses_and_norms(cfg):
    result = train(cfg, quiet=True, resume="never")
    return result.losses, result.grad_norms


@pytest.mark.multirank
def test_export_writes_whole_experts(byte_cache, tmp_path):
    """A checkpoint saved under dp=2,ep=2,tp=2,etp=2,sp (each rank holding half of each of its
    experts' hidden size) exports the global [E, dim, hidden] / [E, hidden, dim] experts, equal
    to its logical state (which `test_checkpoint` loads bitwise into dp=4,ep=4)."""
    spawn(losses_and_norms, 4, run_config(byte_cache, tmp_path, "tiny-moe", "byte", *ETP))
    out = ex.export(tmp_path / "ck", tmp_path / "hf")
    saved = checkpoint.full_state(checkpoint.newest(tmp_path / "ck"))
    exported = load_file(out / "model.safetensors")
    args = get_preset("tiny-moe")
    shapes = {"w1": (args.dim, args.expert_dim), "w3": (args.dim, args.expert_dim), "w2": (args.expert_dim, args.dim)}
    for name, shape in shapes.items():
        assert exported[f"layers.1.feed_forward.experts.{name}"].shape == (args.n_experts, *shape)
    for name, tensor in saved.items():
        assert torch.equal(exported[name], tensor), name


@pytest.mark.multirank
@pytest.mark.parametrize(
    "layout,options",
    [
        ("dp=2,ep=2,tp=2,etp=2,sp=true", []),
        pytest.param(
            "dp=2,ep=2,tp=2,etp=2,pp=2,microbatches=2,sp=true",
            ["--set", "moe.capacity_factor=1.0", "--set", 'train.recompute="full"'],
            marks=pytest.mark.sweep,
        ),
    ],
)
def test_ledger_counts_the_etp_collectives_exactly(byte_cache, layout, options):
    """`fivecut ledger`: the etp all-gathers and reduce-scatters (and every other cut) equal their
    closed forms (ratio=1.000), and so do the model-state memory and, dropless, the activations."""
    run = subprocess.run(
        [sys.executable, "-m", "fivecut", "ledger", "--model", "tiny-moe", "--layout", layout]
        + ["--set", f'data.cache_dir="{byte_cache}"', *options],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert_every_cut_exact(run.stdout)
    lines = run.stdout.strip().splitlines()
    assert any(line.startswith("etp ") and line.split()[3] == "1.000" for line in lines)
    assert_memory_exact(run.stdout)
    if not options:
        assert_activations_exact(run.stdout)


# ---------------------------------------------------------------- refused before any process starts


@pytest.fixture
def no_processes(monkeypatch):
    def started(*args, **kwargs):
        raise AssertionError("a process was started for a bad input")

    monkeypatch.setattr(fivecut.launch, "spawn", started)
    monkeypatch.setattr(fivecut.launch, "init_from_environment", started)


REFUSALS = {  # (command, its arguments, what the message names)
    "etp not dividing tp": (
        "verify",
        ["--model", "tiny-moe", "--layout", "tp=2,etp=3"],
        "parallel.etp=3 must divide tp=2",
    ),
    "etp below 1": ("verify", ["--model", "tiny-moe", "--layout", "tp=2,etp=0"], "parallel.etp=0 must be >= 1"),
    "etp on a dense model": ("verify", ["--model", "tiny", "--layout", "tp=2,etp=2"], "the model is dense"),
    "etp not dividing the experts' hidden size": (
        "train",
        [f"--set={item}" for item in ('model.preset="tiny-moe"', "model.moe_ffn_dim=126", "parallel.tp=4")]
        + ["--set=parallel.etp=4"],
        "parallel.etp=4 must divide the experts' hidden size moe_ffn_dim=126",
    ),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_bad_etp_is_refused_before_any_process(case, capsys, tmp_path, no_processes):
    command, args, message = REFUSALS[case]
    argv = [command, "--set", f'data.cache_dir="{tmp_path / "cache"}"']
    if command == "train":
        argv += ["--set", f'log.out_dir="{tmp_path / "run"}"']
    assert main(argv + args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err and message in err
    assert sum("etp" in line for line in err.splitlines()[1:] or [""]) <= 1  # said once
    assert err.count(message) == 1
    assert not dist.is_initialized()
