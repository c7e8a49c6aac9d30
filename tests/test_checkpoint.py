"""Checkpoints: bit-exact resume on the same layout, resharding into another layout, and damaged
checkpoints refused.

Tolerances: a resume on the same layout repeats the same floating-point operations, so its
losses are compared bitwise (==). A resume into another layout loads bitwise the same logical
state (compared exactly, after a save under the new layout), and continues as an uninterrupted
run under that layout does: losses at rtol 1e-5, the project's bar; gradient norms at 1e-3, because
the two runs reach step 6 by different roundings and this run's step-7 gradient amplifies them: a
single process with train.accumulate=4 (2 rows per matmul instead of 8, the same math) already
differs from accumulate=1 by 3.0e-4 in that step's gradient norm (and dp=4 by 2.9e-4), while a
wrong gradient scale moves it by a factor. A MoE model's trajectories part further (a token whose
top-k experts tie goes another way), so a MoE run resumed under B is held to 1e-4 against B's
own run (measured: 5.7e-5 for dp=2,tp=2,ep=2,zero=3 -> dp=4,ep=2,zero=1), and to 1e-5 against
A's own continuation from the very state it loaded (measured: 1.4e-7).
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from test_ddp import small_config
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from fivecut.cli import in_process, main
from fivecut.launch import spawn
from fivecut.train import checkpoint
from fivecut.train.run import setup
from fivecut.train.trainer import resume_from, save_checkpoint, train

pytestmark = pytest.mark.multirank
RTOL = 1e-5
NORM_RTOL = 1e-3  # see the module doc
MOE_RTOL = 1e-4  # see the module doc


def config(cache: str, tmp: Path, layout: tuple[str, ...], model: str = "tiny", steps: int = 12, **ckpt):
    options = [f'model.preset="{model}"', f"train.steps={steps}", f'log.out_dir="{tmp}/out"']
    options += [f"checkpoint.{k}={v!r}".replace("'", '"') for k, v in ckpt.items()]
    return small_config(cache, *options, *layout)


def run(cfg, resume: str = "never"):
    result = train(cfg, quiet=True, resume=resume)
    return result.losses, result.grad_norms


def resave(cfg, source: str, target: str):
    """Load `source` into this layout and save it again at once, to compare what was loaded."""
    ctx = setup(cfg)
    step = resume_from(ctx, source)
    cfg.checkpoint.dir = target
    save_checkpoint(ctx, step)


def world(cfg) -> int:
    return cfg.parallel.world_size


def full_state(path: Path, out: Path) -> dict[str, torch.Tensor]:
    dcp_to_torch_save(str(path), str(out))
    return torch.load(out, weights_only=False)


MOE = ("moe.bias_update_rate=0.01", "moe.eplb_slots=1", "moe.eplb_interval=2", "moe.eplb_window=2")
SAME_LAYOUT = {
    "one process": ("tiny", ()),
    "dp=2,zero=3": ("tiny", ("parallel.dp=2", "parallel.zero=3")),
    "tp=2,sp": ("tiny", ("parallel.tp=2", "parallel.sp=true")),
    "pp=2 1f1b": ("tiny", ("parallel.pp=2", "parallel.microbatches=2")),
    "cp=2 ring": ("tiny", ("parallel.cp=2",)),
    "moe dp=2,ep=2 aux-free + EPLB copies": ("tiny-moe", ("parallel.dp=2", "parallel.ep=2", *MOE)),
}


@pytest.mark.parametrize("case", list(SAME_LAYOUT))
def test_resume_is_bit_exact(case, byte_cache, tmp_path):
    """Megatron's test: 12 steps uninterrupted; the same run resumed in a new process from its
    step-6 checkpoint gives bitwise the same losses for steps 7-12."""
    model, layout = SAME_LAYOUT[case]
    cfg = config(byte_cache, tmp_path, layout, model, dir=str(tmp_path / "ck"), every=6)
    whole = spawn(run, world(cfg), cfg)[0]
    resumed = spawn(run, world(cfg), cfg, str(checkpoint.step_dir(tmp_path / "ck", 6)))[0]
    assert resumed[0] == whole[0][6:], f"{case}: losses after resume differ"
    assert resumed[1] == whole[1][6:], f"{case}: gradient norms after resume differ"


RESHARD = {  # (model, saved under, loaded into)
    "dp=2,zero=3 -> tp=2,pp=2": (
        "tiny",
        ("parallel.dp=2", "parallel.zero=3"),
        ("parallel.tp=2", "parallel.pp=2", "parallel.microbatches=2"),
    ),
    "pp=2 interleaved -> dp=4,zero=1": (
        "tiny",
        ("parallel.pp=2", 'parallel.pp_schedule="interleaved"', "parallel.pp_virtual=2", "parallel.microbatches=2"),
        ("parallel.dp=4", "parallel.zero=1"),
    ),
    "tp=4 -> dp=2,tp=2,sp": ("tiny-gpt2", ("parallel.tp=4",), ("parallel.dp=2", "parallel.tp=2", "parallel.sp=true")),
    "moe dp=4,ep=4 EPLB moves -> dp=2,ep=2,pp=2": (
        "tiny-moe",
        ("parallel.dp=4", "parallel.ep=4", "moe.eplb_move=true", "moe.eplb_interval=2", "moe.eplb_window=2"),
        ("parallel.dp=2", "parallel.ep=2", "parallel.pp=2", "parallel.microbatches=2"),
    ),
    "cp=2 ulysses -> one process": ("tiny", ("parallel.cp=2", 'parallel.cp_mode="ulysses"'), ()),
    "dp=2,tp=2,sp,zero=1 -> dp=2,cp=2 ring,zero=2": (
        "tiny",
        ("parallel.dp=2", "parallel.tp=2", "parallel.sp=true", "parallel.zero=1"),
        ("parallel.dp=2", "parallel.cp=2", "parallel.zero=2"),
    ),
    "dp=2,cp=2 ring -> pp=2 dualpipev": (
        "tiny",
        ("parallel.dp=2", "parallel.cp=2"),
        ("parallel.pp=2", 'parallel.pp_schedule="dualpipev"', "parallel.microbatches=4"),
    ),
    "moe dp=2,tp=2,ep=2,zero=3 -> dp=2,cp=2 ulysses,ep=2,zero=1": (
        "tiny-moe",
        ("parallel.dp=2", "parallel.tp=2", "parallel.ep=2", "parallel.zero=3", "moe.bias_update_rate=0.01"),
        (
            "parallel.dp=2",
            "parallel.cp=2",
            'parallel.cp_mode="ulysses"',
            "parallel.ep=2",
            "parallel.zero=1",
            "moe.bias_update_rate=0.01",
        ),
    ),
    "moe dp=2,ep=2,tp=2,etp=2,sp -> dp=4,ep=4": (  # expert tensor parallelism: experts' hidden cut over etp
        "tiny-moe",
        ("parallel.dp=2", "parallel.ep=2", "parallel.tp=2", "parallel.etp=2", "parallel.sp=true"),
        ("parallel.dp=4", "parallel.ep=4"),
    ),
}


# the suite runs four pairs (every cut on one side or the other, padding, EPLB moves, one process);
# the other four are a sweep, run with `pytest -m sweep` (pyproject.toml deselects it by default)
SWEEP = (
    "pp=2 interleaved -> dp=4,zero=1",
    "dp=2,tp=2,sp,zero=1 -> dp=2,cp=2 ring,zero=2",
    "dp=2,cp=2 ring -> pp=2 dualpipev",
    "moe dp=2,tp=2,ep=2,zero=3 -> dp=2,cp=2 ulysses,ep=2,zero=1",
    "moe dp=2,ep=2,tp=2,etp=2,sp -> dp=4,ep=4",  # 91 s on 2 busy cores
)


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.sweep) if c in SWEEP else c for c in RESHARD])
def test_resume_under_another_layout(case, byte_cache, tmp_path):
    model, saved_under, loaded_into = RESHARD[case]
    a = config(byte_cache, tmp_path, saved_under, model, dir=str(tmp_path / "a"), every=6)
    b = config(byte_cache, tmp_path, loaded_into, model)
    under_a = spawn(run, world(a), a)[0]
    source = checkpoint.step_dir(tmp_path / "a", 6)
    spawn(resave, world(b), copy.deepcopy(b), str(source), str(tmp_path / "b"))
    saved = full_state(source, tmp_path / "a.pt")
    loaded = full_state(checkpoint.step_dir(tmp_path / "b", 6), tmp_path / "b.pt")
    assert saved.keys() == loaded.keys()
    for key in saved:
        assert torch.equal(saved[key], loaded[key]), f"{case}: {key} changed in the move"
    whole = spawn(run, world(b), b)[0]
    resumed = spawn(run, world(b), b, str(source))[0]
    np.testing.assert_allclose(resumed[0], under_a[0][6:], rtol=RTOL)  # A's own continuation, from the same state
    np.testing.assert_allclose(resumed[1], under_a[1][6:], rtol=NORM_RTOL)
    np.testing.assert_allclose(resumed[0], whole[0][6:], rtol=MOE_RTOL if model == "tiny-moe" else RTOL)
    np.testing.assert_allclose(resumed[1], whole[1][6:], rtol=NORM_RTOL)


def test_bytes_on_disk_hold_each_element_once(byte_cache, tmp_path):
    """dp=2 replicas write one copy: weights and Adam's two moments, 12 Psi bytes plus metadata."""
    cfg = config(byte_cache, tmp_path, ("parallel.dp=2",), steps=2, dir=str(tmp_path / "ck"))
    spawn(run, 2, cfg)
    path = checkpoint.newest(tmp_path / "ck")
    psi = sum(t.numel() for t in full_state(path, tmp_path / "s.pt").values() if t.dim() > 0) // 3
    data = sum(f.stat().st_size for f in path.glob("*.distcp"))
    assert 12 * psi <= data <= 1.02 * 12 * psi


@pytest.fixture
def saved_tiny(byte_cache, tmp_path):
    cfg = config(byte_cache, tmp_path, ("parallel.dp=2",), steps=2, dir=str(tmp_path / "ck"))
    spawn(run, 2, cfg)
    return checkpoint.newest(tmp_path / "ck"), cfg


def resume_cli(path: Path, cfg, *extra: str) -> list[str]:
    items = [  # the saved run's, but for train.steps, the layout and where it writes
        f'data.cache_dir="{cfg.data.cache_dir}"',
        'model.preset="tiny"',
        "train.steps=3",
        "train.warmup=2",
        "train.seq_len=32",
        "train.eval_every=0",
        "log.progress=false",
        "log.plot=false",
        f'log.out_dir="{path.parent.parent}/cli"',
    ]
    return ["train", "--resume", str(path), *(arg for item in items for arg in ("--set", item)), *extra]


@pytest.mark.parametrize("damage", ["flip a byte", "truncate", "delete"])
def test_a_damaged_checkpoint_is_refused_naming_the_file(saved_tiny, damage, capsys):
    path, cfg = saved_tiny
    shard = sorted(path.glob("*.distcp"))[0]
    if damage == "flip a byte":
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    elif damage == "truncate":
        shard.write_bytes(shard.read_bytes()[:-100])
    else:
        shard.unlink()
    assert main(resume_cli(path, cfg)) == 2
    err = capsys.readouterr().err
    assert shard.name in err and "Traceback" not in err


def test_a_checkpoint_of_another_model_is_refused(saved_tiny, capsys):
    """Even where --override accepts the changed config key: the tensors are another model's."""
    path, cfg = saved_tiny
    assert main(resume_cli(path, cfg, "--set", 'model.preset="small"', "--override", "model.preset")) == 2
    err = capsys.readouterr().err
    assert "fivecut.json" in err and "'tiny'" in err and "dim" in err


def test_a_changed_layout_and_steps_resume_in_one_line(saved_tiny, capsys):
    path, cfg = saved_tiny  # saved under dp=2 after 2 of 2 steps; resumed in one process for 3
    assert main(resume_cli(path, cfg)) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "changed config" in line]
    assert len(lines) == 1 and lines[0].startswith("fivecut: resuming with changed config: train.steps 2 -> 3, ")
    assert "parallel.dp 2 -> 1" in lines[0] and "(--override)" not in lines[0]


def test_info_reports_step_layout_and_integrity(saved_tiny, capsys):
    path, _ = saved_tiny
    assert main(["checkpoint", "info", str(path.parent)]) == 0
    out = capsys.readouterr().out
    assert "step 2" in out and "layout dp=2" in out and "complete and intact" in out


class KilledSave(Exception):
    """Stands for the process dying in the middle of a save."""


def test_a_partial_save_is_removed_at_the_next_start_and_the_newest_complete_one_used(
    byte_cache, tmp_path, monkeypatch
):
    """A save that dies after its ranks wrote their files but before the COMPLETE marker leaves
    .tmp-step-6 (real DCP files, no marker): the next run resumes from step 4, the newest complete
    checkpoint, and removes the partial one before training (checkpoint.every=0 there, so no save of
    its own would)."""
    ck = tmp_path / "ck"
    real_publish = checkpoint.publish

    def dies_at_step_6(tmp: Path, final: Path, meta: dict) -> None:
        if meta["step"] == 6:
            raise KilledSave
        real_publish(tmp, final, meta)

    monkeypatch.setattr(checkpoint, "publish", dies_at_step_6)
    with pytest.raises(KilledSave):
        in_process(run, config(byte_cache, tmp_path / "first", (), steps=8, dir=str(ck), every=2))
    monkeypatch.setattr(checkpoint, "publish", real_publish)
    partial = ck / ".tmp-step-00000006"
    assert sorted(p.name for p in ck.iterdir()) == [".tmp-step-00000006", "step-00000002", "step-00000004"]
    assert list(partial.glob("*.distcp")) and not (partial / checkpoint.COMPLETE).exists()
    resumed = in_process(run, config(byte_cache, tmp_path / "again", (), steps=8, dir=str(ck), every=0), "auto")
    assert sorted(p.name for p in ck.iterdir()) == ["step-00000004", "step-00000008"]
    whole = in_process(run, config(byte_cache, tmp_path / "whole", (), steps=8))
    assert resumed == (whole[0][4:], whole[1][4:])  # steps 5-8 from step 4's state, bitwise (the same process)


def damage_another_ranks_file_then_load(cfg, path: str) -> str | None:
    """On each rank: train (which saves), rank 0 flips a byte of the file rank 1 wrote, then every
    rank resumes from it; returns this rank's refusal (None: it loaded)."""
    train(cfg, quiet=True)
    if dist.get_rank() == 0:
        shard = Path(path) / "__1_0.distcp"
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    dist.barrier()
    try:
        resume_from(setup(cfg), path)
    except checkpoint.CheckpointError as err:
        return str(err)
    return None


def test_damage_in_a_nonzero_ranks_file_is_refused_naming_it(byte_cache, tmp_path, capsys):
    """tp=2: each rank writes its own shards (__0_0.distcp, __1_0.distcp), each recorded by sha256;
    a byte changed in rank 1's is refused by name on every rank of a load, by a load in one
    process, and by `fivecut checkpoint info`."""
    cfg = config(byte_cache, tmp_path, ("parallel.tp=2",), steps=2, dir=str(tmp_path / "ck"))
    path = checkpoint.step_dir(tmp_path / "ck", 2)
    refusals = spawn(damage_another_ranks_file_then_load, 2, cfg, str(path), timeout_s=120, collective_timeout_s=30)
    shard = path / "__1_0.distcp"
    for refusal in refusals:
        assert refusal is not None and f"{shard} does not match its sha256" in refusal, refusal
    assert main(["checkpoint", "info", str(path.parent)]) == 2
    assert f"DAMAGED: {shard} does not match its sha256" in capsys.readouterr().out
    assert main(resume_cli(path, cfg)) == 2
    err = capsys.readouterr().err
    assert shard.name in err and "Traceback" not in err


def test_boxes_cover_a_flat_run_exactly():
    shape = (3, 4, 5)
    for lo, hi in [(0, 60), (7, 53), (13, 14), (20, 40), (41, 59)]:
        seen = torch.zeros(60, dtype=torch.long)
        for start, sizes in checkpoint.boxes(shape, lo, hi):
            index = torch.arange(60).view(shape)
            for d, (a, n) in enumerate(zip(start, sizes)):
                index = index.narrow(d, a, n)
            flat = index.flatten()
            assert torch.equal(flat, torch.arange(flat[0], flat[0] + flat.numel()))  # each box is contiguous
            seen[flat] += 1
        assert torch.equal(seen, (torch.arange(60) >= lo).long() * (torch.arange(60) < hi).long())
