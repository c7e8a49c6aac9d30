"""ZeRO-2 and ZeRO-3 inside a pipeline (`fivecut.parallel.zero_pipeline`) against one process.

Each stage's gradients accumulate over the microbatches and are reduce-scattered once, after
the stage's last B (or W, for the zero-bubble schedules); ZeRO-3 gathers its units per stage
(twice per microbatch with resharding, once per step without). Checked on real gloo ranks:
  - step-1 gradients, reassembled from every dp rank's shards, against the single process
    (rtol 1e-5, atol 1e-7, as for ZeRO and the pipeline alone: only the order of sums differs);
  - losses and gradient norms over 6 steps (rtol 1e-5; the norm of step 1 at 1e-5 too);
  - the ledger's closed forms (ratio=1.000, memory_ratio=1.000);
  - a checkpoint saved under dp=2,pp=2,zero=3 loads under dp=4,zero=3 and continues alike.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_checkpoint import config as ckpt_config
from test_checkpoint import run as run_for_checkpoint
from test_ddp import GRAD_TOL, assert_same_run, single_process_run, small_config
from test_e2e import assert_every_cut_exact, assert_memory_exact
from test_pipeline import single_process_gradients

from fivecut import comm
from fivecut.cli import main
from fivecut.launch import spawn
from fivecut.train import checkpoint
from fivecut.train.run import forward_backward, setup

pytestmark = pytest.mark.multirank

PP = ("parallel.pp=2", "parallel.dp=2")
SCHEDULES = {
    "1f1b": ('parallel.pp_schedule="1f1b"', "parallel.microbatches=2"),
    "zb1p": ('parallel.pp_schedule="zb1p"', "parallel.microbatches=2"),
    "gpipe": ('parallel.pp_schedule="gpipe"', "parallel.microbatches=2"),
    "interleaved": ('parallel.pp_schedule="interleaved"', "parallel.pp_virtual=2", "parallel.microbatches=2"),
    "dualpipev": ('parallel.pp_schedule="dualpipev"', "parallel.microbatches=4"),
}
DEFAULT = {(2, "1f1b"), (3, "zb1p")}  # in the suite; `pytest -m sweep` runs every other pair


def case(zero: int, schedule: str, default: set) -> pytest.param:
    marks = () if (zero, schedule) in default else (pytest.mark.sweep,)
    return pytest.param(zero, schedule, marks=marks, id=f"zero={zero},{schedule}")


def reassembled_gradients(cfg) -> dict[str, torch.Tensor]:
    """Step 1's gradients of this rank's stages, each flat shard all-gathered over dp and cut back
    into named parameters (stage prefixes removed)."""
    ctx = setup(cfg)
    ctx.par.sync.zero_grad()
    forward_backward(ctx, 1)
    names = {id(p): name.split(".", 1)[1] for name, p in ctx.par.module.named_parameters()}
    grads = {}
    for cut in ctx.par.sync.syncs:
        for shard in cut.shards:
            flat = comm.all_gather(shard.grad, shard.group)  # [padded]
            for p, shape, offset in zip(shard.params, shard.shapes, shard.offsets):
                grads[names[id(p)]] = flat[offset : offset + shape.numel()].view(shape).clone()
    assert all(p.grad is None for p in ctx.par.module.parameters())  # only the shards hold gradients
    return grads


@pytest.mark.parametrize("zero,schedule", [case(z, s, DEFAULT) for z in (2, 3) for s in SCHEDULES])
def test_shard_gradients_match_single_process(zero, schedule, byte_cache, tmp_path):
    reference = single_process_gradients(byte_cache)
    cfg = small_config(byte_cache, *PP, f"parallel.zero={zero}", *SCHEDULES[schedule], f'log.out_dir="{tmp_path}/p"')
    merged: dict[str, torch.Tensor] = {}
    for grads in spawn(reassembled_gradients, 4, cfg):
        for name, g in grads.items():
            if name in merged:  # the other dp rank of the same stage: the same reassembled gradient
                torch.testing.assert_close(g, merged[name], rtol=0, atol=0)
            merged[name] = g
    assert merged.keys() == reference.keys()
    for name, g in reference.items():
        torch.testing.assert_close(merged[name], g, **GRAD_TOL, msg=lambda m, n=name: f"{n}: {m}")


LOSSES_DEFAULT = {(3, "1f1b"), (2, "zb1p")}


@pytest.mark.parametrize(
    "zero,schedule", [case(z, s, LOSSES_DEFAULT) for z in (2, 3) for s in ("1f1b", "zb1p", "interleaved", "dualpipev")]
)
def test_losses_over_steps(zero, schedule, byte_cache, tmp_path):
    cfg = small_config(byte_cache, *PP, f"parallel.zero={zero}", *SCHEDULES[schedule], f'log.out_dir="{tmp_path}/p"')
    assert_same_run(cfg, single_process_run(byte_cache), f"zero={zero} {schedule}")


@pytest.mark.sweep
@pytest.mark.parametrize(
    "layout",
    [
        ("parallel.zero=3", "parallel.reshard_after_forward=false", *SCHEDULES["1f1b"], "train.accumulate=2"),
        ("parallel.zero=3", "parallel.reshard_after_forward=false", *SCHEDULES["dualpipev"]),
        ("parallel.zero=2", *SCHEDULES["interleaved"], "train.accumulate=2"),
    ],
)
def test_losses_without_resharding_and_with_accumulation(layout, byte_cache, tmp_path):
    cfg = small_config(byte_cache, *PP, *layout, f'log.out_dir="{tmp_path}/p"')
    assert_same_run(cfg, single_process_run(byte_cache), ",".join(layout))


GPT2 = ('model.preset="tiny-gpt2"', "model.n_layers=4", 'data.tokenizer="gpt2"', "train.steps=3", "train.grad_clip=0.5")


@pytest.mark.parametrize(
    "zero,schedule",
    [pytest.param(3, "1f1b", id="zero=3,1f1b: a copy on each end")]
    + [pytest.param(2, "dualpipev", marks=pytest.mark.sweep, id="zero=2,dualpipev: both ends on rank 0")]
    + [pytest.param(3, "interleaved", marks=pytest.mark.sweep, id="zero=3,interleaved")]
    + [pytest.param(3, "dualpipev", marks=pytest.mark.sweep, id="zero=3,dualpipev: a unit borrowed by the head")],
)
def test_tied_embeddings(zero, schedule, byte_cache, tmp_path):
    """The tied copies' full gradients are summed over the two ends before their stages reduce;
    with both ends on one rank (DualPipeV) the first stage's cut holds the one Parameter (ZeRO-3:
    in its embedding unit, which the last stage's head unit gathers and frees with its own)."""
    reference = single_process_run(byte_cache, *GPT2)
    cfg = small_config(
        byte_cache, *GPT2, *PP, f"parallel.zero={zero}", *SCHEDULES[schedule], f'log.out_dir="{tmp_path}/p"'
    )
    assert min(reference[1]) > 0.5  # the clip is active at every step
    assert_same_run(cfg, reference, f"tied, zero={zero} {schedule}")


def ledger_lines(capsys, byte_cache: str, layout: str, *sets: str, model: str = "tiny") -> list[str]:
    args = ["ledger", "--model", model, "--layout", layout, "--set", f'data.cache_dir="{byte_cache}"']
    for item in sets:
        args += ["--set", item]
    assert main(args) == 0
    return capsys.readouterr().out.splitlines()


@pytest.mark.parametrize(
    "layout",
    [
        pytest.param("dp=2,pp=2,zero=3,microbatches=4", marks=pytest.mark.sweep),
        pytest.param("dp=2,pp=2,zero=2,microbatches=2", marks=pytest.mark.sweep),
        pytest.param("dp=2,pp=2,zero=3,microbatches=4,pp_schedule=zb1p", marks=pytest.mark.sweep),
        pytest.param("dp=2,pp=2,zero=3,microbatches=2,pp_schedule=interleaved,pp_virtual=2", marks=pytest.mark.sweep),
        pytest.param("dp=2,pp=2,zero=3,microbatches=4,pp_schedule=dualpipev", marks=pytest.mark.sweep),
        pytest.param("dp=2,pp=2,zero=3,microbatches=2,reshard_after_forward=false", marks=pytest.mark.sweep),
    ],
)
def test_ledger_counts_the_gathers_per_microbatch(layout, capsys, byte_cache):
    lines = ledger_lines(capsys, byte_cache, layout)
    assert_every_cut_exact("\n".join(lines))
    assert_memory_exact("\n".join(lines))
    gathers = sum(int(row.split()[3]) for row in lines if row.split()[:2] == ["dp", "all_gather"])
    if "zero=3" in layout:  # tiny on pp rank 0: 3 units (embedding, 2 blocks) or 2 stages' 4
        microbatches = int(layout.split("microbatches=")[1].split(",")[0])
        units = 4 if "dualpipev" in layout else 3
        assert gathers == units * (1 if "reshard_after_forward=false" in layout else 2 * microbatches)


@pytest.mark.sweep
@pytest.mark.parametrize("reshard", ["true", "false"])
def test_ledger_counts_the_borrowed_unit(reshard, capsys, byte_cache):
    """DualPipeV, tied: rank 0's embedding unit is gathered for the head too (2M more with resharding)."""
    layout = f"dp=2,pp=2,zero=3,microbatches=4,pp_schedule=dualpipev,reshard_after_forward={reshard}"
    lines = ledger_lines(capsys, byte_cache, layout, "model.n_layers=4", 'data.tokenizer="gpt2"', model="tiny-gpt2")
    assert_every_cut_exact("\n".join(lines))
    assert_memory_exact("\n".join(lines))
    gathers = sum(int(row.split()[3]) for row in lines if row.split()[:2] == ["dp", "all_gather"])
    assert gathers == (4 * 2 * 4 + 2 * 4 if reshard == "true" else 4)  # 4 units (+ the borrowed) x 2M, or once


def test_checkpoint_of_zero3_in_a_pipeline_loads_under_dp4_zero3(byte_cache, tmp_path):
    """Saved at step 3 under dp=2,pp=2,zero=3 (per-stage flat shards), resumed under dp=4,zero=3:
    steps 4-6 give the losses the pipeline run itself gave."""
    saved_under = (*PP, "parallel.zero=3", *SCHEDULES["1f1b"])
    a = ckpt_config(byte_cache, tmp_path, saved_under, steps=6, dir=str(tmp_path / "a"), every=3)
    b = ckpt_config(byte_cache, tmp_path, ("parallel.dp=4", "parallel.zero=3"), steps=6)
    under_a = spawn(run_for_checkpoint, 4, a)[0]
    resumed = spawn(run_for_checkpoint, 4, b, str(checkpoint.step_dir(tmp_path / "a", 3)))[0]
    np.testing.assert_allclose(resumed[0], under_a[0][3:], rtol=1e-5)
    np.testing.assert_allclose(resumed[1], under_a[1][3:], rtol=1e-3)


@pytest.mark.sweep
def test_zero3_with_tensor_parallelism_and_sp_in_a_pipeline(byte_cache, tmp_path):
    """8 ranks: dp=2 x tp=2 (SP) x pp=2, ZeRO-3 units of TP shards in each stage."""
    layout = ("parallel.tp=2", "parallel.sp=true", "parallel.zero=3", *SCHEDULES["1f1b"])
    cfg = small_config(byte_cache, *PP, *layout, f'log.out_dir="{tmp_path}/p"')
    assert_same_run(cfg, single_process_run(byte_cache), ",".join(layout))


@pytest.mark.sweep
@pytest.mark.parametrize("zero", [2, 3])
def test_zero_with_expert_parallelism_in_a_pipeline(zero, byte_cache, tmp_path):
    """tiny-moe, ep=2 over dp=2: the experts in their own (expert-dp) cut of each stage."""
    moe = ('model.preset="tiny-moe"',)
    cfg = small_config(
        byte_cache, *moe, *PP, "parallel.ep=2", f"parallel.zero={zero}", *SCHEDULES["zb1p"],
        f'log.out_dir="{tmp_path}/p"',
    )  # fmt: skip
    assert_same_run(cfg, single_process_run(byte_cache, *moe), f"tiny-moe ep=2 zero={zero}")
