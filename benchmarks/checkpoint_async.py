"""Blocking time of a checkpoint save: blocking (`checkpoint.async_mode = "off"`) vs a writer thread
("thread") vs a writer process ("process"), and the steps' speed while a save writes.

    python benchmarks/checkpoint_async.py [--model small] [--modes off,thread,process] [--saves 3]
                                          [--every 4] [--seq 64] [--batch 8] [--dp 2] [--dir /tmp]
                                          [--set model.dim=1024 ...]

Each mode is its own `torchrun --nproc-per-node=DP` job (a writer process needs ranks that may have
children, which `fivecut.launch.spawn`'s daemonic ranks may not), running this file as its worker:
each rank builds the training context as `fivecut train` does and trains `4 + saves x every` steps
with `trainer.run_step`, the run's `fivecut.train.saving.Saves` given, and saves after step 4,
4 + every, ... (`trainer.save_checkpoint`). Measured on rank 0:

    blocking   "off": the seconds `save_checkpoint` took (the whole save: DCP's write, sha256 of
               every file, the rename, the read-back of checkpoint.verify, pruning);
               "thread"/"process": the record's `blocking_s`, what the training loop waited: the
               save's start, the next step's wait for the staging copy before its update, and the
               end of the save once written and read back in the background (the gather of the
               checksums, the rename, pruning)
    start      the background save's start on the training thread (`start_s`)
    staging    from the start to the end of DCP's DefaultStager copying every chunk, in the
               stager's thread while the next step's forward and backward run (`staging_s`)
    wait       what the next step waited for that copy before its update (`staging_wait_s`)
    end        the rest of blocking: the save's end (and a wait for its writer, where it had not
               written and read back its files by the next save or the run's end)
    total      from the save's start to its rename (background: while the steps went on)
    steps      the median seconds of steps 2-4 (before the first save: nothing in flight) over
               the median of the steps after the first save (their saves' ends included):
               >= 0.9 is the issue's target

The first background save of a run pays for the writer's start (a writer process: a Python process
that imports torch and joins its own gloo group): the figures are medians over the saves after the
first (all saves are listed). Staged bytes: what rank 0's stager holds after the last save (the
record's `staged_bytes`: the host copies of its state's storages); "off": the bytes of the chunks
the rank would stage.
Nothing is asserted; the machine's load is printed with the figures.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch.distributed as dist  # noqa: E402

from benchmarks.common import format_bytes, format_ratio, format_seconds, load_average, machine, markdown_table, median  # noqa: E402  # noqa: E402
from fivecut.config import load_config  # noqa: E402
from fivecut.launch import init_from_environment  # noqa: E402
from fivecut.train import checkpoint, run, trainer  # noqa: E402
from fivecut.train.faults import NonFiniteGuard, SignalFlag  # noqa: E402
from fivecut.train.saving import Saves  # noqa: E402

WARM = 4  # steps before the first save: those after the first are the steps with nothing in flight
BACKGROUND = ("start_s", "staging_s", "staging_wait_s", "end_s")  # a background save's alone


def arguments(argv: list[str]) -> dict:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="small")
    parser.add_argument("--modes", default="off,thread,process")
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--every", type=int, default=4, help="steps from one save to the next")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where the checkpoints are written")
    parser.add_argument("--verify", action=argparse.BooleanOptionalAction, default=True, help="checkpoint.verify")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="a config override (repeatable)"
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # a mode: run as one of torchrun's ranks
    parser.add_argument("--out", help=argparse.SUPPRESS)
    return vars(parser.parse_args(argv))


def config(opts: dict, mode: str, root: Path):
    return load_config(None, [
        f'model.preset="{opts["model"]}"', 'data.tokenizer="byte"', "train.steps=100000", "train.warmup=0",
        "train.eval_every=0", f"train.seq_len={opts['seq']}", f"train.global_batch={opts['batch']}",
        f"parallel.dp={opts['dp']}", f'checkpoint.dir="{root / "ck"}"', "checkpoint.keep=1",
        f'checkpoint.async_mode="{mode}"', f'log.out_dir="{root / "run"}"', "log.progress=false", "log.plot=false",
        f"checkpoint.verify={str(opts['verify']).lower()}", *opts["set"],
    ])  # fmt: skip


def worker(opts: dict) -> None:
    """One rank of one mode's job; rank 0 writes the figures to --out."""
    root = Path(opts["out"]).with_suffix("")
    cfg = config(opts, opts["worker"], root)
    init_from_environment(cfg.train.collective_timeout)
    ctx = run.setup(cfg)
    records: list[dict] = []
    saves = Saves(cfg.checkpoint, lambda line, record: records.append(record), cfg.train.collective_timeout)
    guard, log = NonFiniteGuard("stop", 1), trainer.Logger(ctx, quiet=True)
    save_after = [WARM + k * opts["every"] for k in range(opts["saves"])]
    steps, blocking = {}, {}
    with SignalFlag() as signals:
        for step in range(1, save_after[-1] + opts["every"]):
            started = time.perf_counter()
            trainer.run_step(ctx, step, trainer.RunResult(), log, guard, signals, False, saves)
            steps[step] = time.perf_counter() - started
            if step in save_after:
                started = time.perf_counter()
                trainer.save_checkpoint(ctx, step, guard, saves)
                blocking[step] = time.perf_counter() - started
    saves.close()
    staged = records[-1]["checkpoint"]["staged_bytes"] if records else sum_bytes(ctx)
    if dist.get_rank() == 0:
        figures = dict(mode=opts["worker"], steps=steps, save_after=save_after, sync=blocking, records=records)
        Path(opts["out"]).write_text(json.dumps(figures | {"staged_bytes": staged}))
    dist.destroy_process_group()


def sum_bytes(ctx) -> int:
    table = checkpoint.state_table(ctx.par, ctx.optimizer)
    return sum(c.view.numel() * c.view.element_size() for e in table.values() for c in e.chunks)


def job(opts: dict, mode: str, folder: Path) -> dict:
    out = folder / f"{mode}.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={opts['dp']}",
               __file__, "--worker", mode, "--out", str(out)]  # fmt: skip
    for key in ("model", "saves", "every", "seq", "batch", "dp"):
        command += [f"--{key}", str(opts[key])]
    command.append("--verify" if opts["verify"] else "--no-verify")
    command += [arg for item in opts["set"] for arg in ("--set", item)]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"{mode}: torchrun exited {done.returncode}\n{done.stderr[-4000:]}")
    return json.loads(out.read_text())


def per_save(figures: dict) -> list[dict]:
    """Each save's blocking, staging and total seconds."""
    if figures["mode"] == "off":
        return [{"blocking_s": s, "total_s": s} for s in figures["sync"].values()]
    records = {r["step"]: r["checkpoint"] for r in figures["records"] if "checkpoint" in r}
    ends = {s: {"end_s": r["blocking_s"] - r["start_s"] - r["staging_wait_s"]} for s, r in records.items()}
    return [records[s] | ends[s] for s in figures["save_after"]]


def row(figures: dict) -> list[str]:
    saves = per_save(figures)
    later = saves[1:] or saves  # the first pays for the writer's start
    steps = {int(k): v for k, v in figures["steps"].items()}
    quiet = median([steps[s] for s in range(2, WARM + 1)])
    after = median([t for s, t in steps.items() if s > figures["save_after"][0]])
    return [
        figures["mode"],
        format_seconds(blocking(figures)),
        *(format_seconds(median([s[key] for s in later])) if key in later[0] else "-" for key in BACKGROUND),
        format_seconds(median([s["total_s"] for s in later])),
        ", ".join(format_seconds(s["blocking_s"]) for s in saves),
        format_ratio(quiet / after),
        format_bytes(figures["staged_bytes"]),
    ]


def main(argv: list[str] | None = None) -> None:
    opts = arguments(sys.argv[1:] if argv is None else argv)
    if opts["worker"]:
        worker(opts)
        return
    before = load_average()
    with tempfile.TemporaryDirectory(dir=opts["dir"]) as tmp:
        results = [job(opts, mode, Path(tmp)) for mode in opts["modes"].split(",")]
    header = ["async_mode", "blocking (median)", "start", "staging", "wait", "end", "total", "blocking of each save",
              "steps after / before", "staged per rank"]  # fmt: skip
    model = " ".join([opts["model"], *opts["set"]])
    print(f"checkpoint saves of {model}, dp={opts['dp']}, {opts['batch']}x{opts['seq']} tokens per step, "
          f"a save every {opts['every']} steps, {opts['saves']} saves, checkpoint.verify={opts['verify']}; "
          f"{machine()}")  # fmt: skip
    print(markdown_table(header, [row(r) for r in results]))
    print(f"load average before: {before}; after: {load_average()}")
    sync = next((r for r in results if r["mode"] == "off"), None)
    for r in results if sync is not None else ():
        if r is not sync:
            print(f"blocking_{r['mode']}_vs_off={blocking(r) / blocking(sync):.3f}")


def blocking(figures: dict) -> float:
    """The median blocking seconds of the saves after the first."""
    saves = per_save(figures)
    return median([s["blocking_s"] for s in saves[1:] or saves])


if __name__ == "__main__":
    main()
