"""fivecut checkpoints (DCP, resharding) against torch.save / torch.load: seconds and bytes on disk.

    python benchmarks/checkpoint.py [--model small] [--layouts single,dp=2,dp=2:zero=3,tp=2] [--repeats 3]
                                    [--seq 64] [--batch 8] [--dir /tmp]

For each layout, its ranks are spawned (`fivecut.launch.spawn`) and build the training context as
`fivecut train` does (`fivecut.train.run.setup` on a config from `load_config(None, overrides)`),
then run one training step with `run_step`, which also writes the step's checkpoint (an untimed
warm-up save). The state is then what a run holds after one step: the weights and AdamW's two
moments (and its step), fp32. Timed, on every rank between a barrier and the slowest rank's end:

    fivecut save   `trainer.save_checkpoint(ctx, step)`: DCP writes every rank's chunks in parallel
                   (fsync'd), sha256 of each file, fivecut.json, COMPLETE marker, rename, pruning
    fivecut load   `trainer.resume_from(ctx, path)`: sha256 of every file (shared out over the ranks),
                   then DCP reads the chunks this layout holds into the live parameters and moments
    torch.save     (one process only) {"model": state_dict(), "optim": optimizer.state_dict()} into
                   one file, then fsync (as DCP's writer does), so both sides reach the disk
    torch.load     (one process only) torch.load(weights_only=True), then load_state_dict into the
                   model and the optimizer

Each repeat saves a new step and loads it back; on one process the torch pair runs in the same
repeat, first on odd repeats and second on even ones (interleaved); the figures are medians over
repeats. Layouts run one after another (each is its own set of processes). The load reads a file
written moments before, so it mostly comes from the page cache: these are not cold-disk reads.

Bytes on disk: each rank's files (`__<rank>_*.distcp`, DCP's names), their total, and the whole
checkpoint folder (with `.metadata`, `fivecut.json`, `COMPLETE`). The state is 12 Psi bytes (Psi
parameters counted once, a tied head with its embedding; fp32 weights + two Adam moments, 4 bytes
each); the ratio of the .distcp total to 12 Psi is ~1.00 when every replica is written once (a
replicated tensor written by every rank would show as a ratio near the number of replicas: plain
`dp=2` replicates everything, and the tied head written apart from its embedding would add 0.73).
"Loaded = saved" is whether every parameter and moment on every rank is bitwise what it was
before the save (nothing trains between save and load, so it must be). Nothing is asserted.

Data: the byte-level Shakespeare cache (`data.tokenizer = "byte"`), which needs no GPT-2 files;
the model keeps its own vocabulary (50,257 for `small`), so the state is the same. At seq 64 and
8 sequences, the defaults take about 1.5-2.5 minutes on the 2-core machine.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks.common import (  # noqa: E402
    barrier,
    benchmark_parser,
    format_bytes,
    format_seconds,
    load_average,
    machine,
    markdown_table,
    median,
    parse_options,
)
from fivecut.config import load_config, preset_args  # noqa: E402
from fivecut.launch import spawn  # noqa: E402
from fivecut.train import run, trainer  # noqa: E402
from fivecut.train.faults import NonFiniteGuard, SignalFlag  # noqa: E402

FC_SAVE, FC_LOAD, T_SAVE, T_LOAD = "fivecut save", "fivecut load", "torch.save", "torch.load"


def overrides(opts: dict, layout: str, root: Path) -> list[str]:
    """The config of one layout: `layout` is `single` or `key=value` pairs joined by ':'."""
    parallel = [] if layout == "single" else [f"parallel.{kv}" for kv in layout.split(":")]
    return [
        f"model.preset={opts['model']}",
        "data.tokenizer=byte",
        "train.steps=1",
        "train.warmup=0",
        "train.eval_every=0",
        f"train.seq_len={opts['seq']}",
        f"train.global_batch={opts['batch']}",
        f"checkpoint.dir={root / 'ckpt'}",
        "checkpoint.keep=1",
        f"log.out_dir={root / 'run'}",
        "log.progress=false",
        "log.plot=false",
        *parallel,
    ]


def slowest(seconds: float) -> float:
    if dist.get_world_size() == 1:
        return seconds
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def timed(fn) -> tuple[float, object]:
    """Run `fn` on every rank between a barrier and its end; the slowest rank's seconds and fn's value."""
    barrier()
    t0 = time.perf_counter()
    value = fn()
    return slowest(time.perf_counter() - t0), value


def snapshot(ctx) -> list[torch.Tensor]:
    """Copies of what this rank's optimizer updates (its parameters, or its ZeRO shards) and their Adam
    moments: what a load must give back. (ZeRO-3's module parameters have no storage between units' runs.)"""
    tensors = []
    for piece in ctx.par.pieces:
        state = ctx.optimizer.state[piece.tensor]
        tensors += [piece.tensor.detach().clone(), state["exp_avg"].clone(), state["exp_avg_sq"].clone()]
    return tensors


def torch_save(ctx, file: Path) -> None:
    state = {"model": ctx.par.module.state_dict(), "optim": ctx.optimizer.state_dict()}
    with file.open("wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def torch_load(ctx, file: Path) -> None:
    state = torch.load(file, weights_only=True)
    ctx.par.module.load_state_dict(state["model"])
    ctx.optimizer.load_state_dict(state["optim"])


def rank_main(opts: dict, layout: str, root: str) -> dict:
    root = Path(root)
    cfg = load_config(None, overrides(opts, layout, root))
    ctx = run.setup(cfg)
    guard = NonFiniteGuard(cfg.train.on_nonfinite, cfg.train.max_skipped)
    with SignalFlag() as signals:  # one step, as `train` runs it; it saves step 1 (the warm-up save)
        trainer.run_step(ctx, 1, trainer.RunResult(), trainer.Logger(ctx, quiet=True), guard, signals, False)
    before = snapshot(ctx)
    single = dist.get_world_size() == 1
    times: dict[str, list[float]] = {FC_SAVE: [], FC_LOAD: []} | ({T_SAVE: [], T_LOAD: []} if single else {})
    resumed, path = "", None
    for r in range(opts["repeats"]):

        def fivecut_pair(step=2 + r):
            nonlocal resumed, path
            seconds, path = timed(lambda: trainer.save_checkpoint(ctx, step, guard))
            times[FC_SAVE].append(seconds)
            captured = io.StringIO()
            with contextlib.redirect_stdout(captured):  # rank 0's "fivecut: resumed at step ..." line
                seconds, _ = timed(lambda: trainer.resume_from(ctx, str(path)))
            times[FC_LOAD].append(seconds)
            resumed = captured.getvalue().strip() or resumed

        def torch_pair():
            file = root / "torch.pt"
            times[T_SAVE].append(timed(lambda: torch_save(ctx, file))[0])
            times[T_LOAD].append(timed(lambda: torch_load(ctx, file))[0])

        pairs = [fivecut_pair, torch_pair] if single else [fivecut_pair]
        for pair in pairs if r % 2 == 0 else pairs[::-1]:
            pair()
        if dist.get_rank() == 0:
            now = ", ".join(f"{name} {format_seconds(ts[-1])}" for name, ts in times.items())
            print(f"  {layout} repeat {r + 1}/{opts['repeats']}: {now}", flush=True)
    after = snapshot(ctx)
    same = torch.tensor([int(all(torch.equal(a, b) for a, b in zip(before, after, strict=True)))])
    if not single:
        dist.all_reduce(same, op=dist.ReduceOp.MIN)
    out = dict(times=times, same=bool(same), layout=ctx.mesh.dims.describe(), resumed=resumed)
    if dist.get_rank() == 0:
        world = dist.get_world_size()
        out["per_rank"] = [sum(f.stat().st_size for f in path.glob(f"__{k}_*.distcp")) for k in range(world)]
        out["folder"] = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
        out["files"] = len(list(path.glob("*.distcp")))
        out["torch_file"] = (root / "torch.pt").stat().st_size if single else None
    return out


def world_of(layout: str) -> int:
    if layout == "single":
        return 1
    dims = dict(kv.split("=") for kv in layout.split(":"))
    return math.prod(int(dims.get(cut, 1)) for cut in ("pp", "dp", "cp", "tp"))


def report(opts: dict, results: dict[str, dict], psi: int, elapsed: float, before: str) -> str:
    state = 12 * psi
    rows = []
    for r in results.values():
        t = r["times"]
        distcp = sum(r["per_rank"])
        rows.append(
            [
                f"fivecut, {r['layout']}",
                format_seconds(median(t[FC_SAVE])),
                format_seconds(median(t[FC_LOAD])),
                " / ".join(f"{n:,}" for n in r["per_rank"]),
                f"{distcp:,}",
                f"{r['folder']:,}",
                f"{distcp / state:.4f}",
                "yes" if r["same"] else "NO",
            ]
        )
        if r["torch_file"] is not None:
            size = r["torch_file"]
            rows.append(
                [
                    "torch.save / torch.load, 1 process",
                    format_seconds(median(t[T_SAVE])),
                    format_seconds(median(t[T_LOAD])),
                    f"{size:,}",
                    f"{size:,}",
                    f"{size:,}",
                    f"{size / state:.4f}",
                    "",
                ]
            )
    table = markdown_table(
        [
            "",
            "save (median)",
            "load (median)",
            "bytes per rank (.distcp)",
            ".distcp total",
            "folder total",
            "total / 12Ψ",
            "loaded = saved",
        ],
        rows,
    )
    per_repeat = "; ".join(
        f"{r['layout']}: " + ", ".join(f"{k} " + "/".join(f"{x:.3f}" for x in v) for k, v in r["times"].items())
        for r in results.values()
    )
    resumed = next((r["resumed"] for r in results.values() if r["resumed"]), "")
    lines = [
        f"model {opts['model']} (Ψ = {psi:,} parameters; 12Ψ = {state:,} bytes = {format_bytes(state)}), "
        f"{opts['batch']} x {opts['seq']} tokens per step, one step trained, {opts['repeats']} repeats "
        f"(save then load, interleaved with torch on one process), medians; gloo ranks x 1 thread",
        f"machine: {before} before, {load_average()} after",
        "",
        table,
        "",
        f"seconds per repeat: {per_repeat}",
        f"a load's line (rank 0): {resumed}",
        f"wall time {elapsed:.0f} s",
    ]
    return "\n".join(lines)


def parse(argv=None) -> dict:
    p = benchmark_parser(__doc__)
    p.set_defaults(model="small")
    p.add_argument(
        "--layouts",
        default="single,dp=2,dp=2:zero=3,tp=2",
        type=lambda s: s.split(","),
        help="comma-separated layouts: single, or parallel.* key=value pairs joined by ':'",
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch", type=int, default=8, help="global batch (sequences per step)")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--dir", default=None, help="where the checkpoints are written (default: a temporary folder)")
    return parse_options(p, argv)


def main(argv=None) -> None:
    opts = parse(argv)
    print(f"benchmarks/checkpoint.py {' '.join(sys.argv[1:])}".rstrip(), flush=True)
    before, started = machine(), time.perf_counter()
    psi = preset_args(load_config(None, [f"model.preset={opts['model']}"]).model).num_params()
    results = {}
    for layout in opts["layouts"]:
        root = Path(
            tempfile.mkdtemp(prefix=f"fivecut-ckpt-{layout.replace('=', '').replace(':', '-')}-", dir=opts["dir"])
        )
        try:
            results[layout] = spawn(rank_main, world_of(layout), opts, layout, str(root), timeout_s=opts["timeout"])[0]
        finally:
            shutil.rmtree(root, ignore_errors=True)
    print(report(opts, results, psi, time.perf_counter() - started, before), flush=True)


if __name__ == "__main__":
    main()
