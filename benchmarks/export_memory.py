"""Peak memory per process of `fivecut export --workers 4` of a checkpoint written by 4 ranks,
against the model's bytes.

    python benchmarks/export_memory.py                 # ~100M parameters, 4 workers, shards of a quarter
    python benchmarks/export_memory.py --params 2e6    # the smoke size

A random Qwen2-shaped model (`benchmarks/import_memory.py`'s) is written as a Hugging Face folder,
then converted by `fivecut convert --layout tp=2,pp=2` (4 ranks, each reading and writing its
part) into a DCP checkpoint. Then, each in a fresh process:

    baseline   a pool of 4 spawned workers that import what the export's workers import and write
               nothing: the largest worker's peak resident set (RUSAGE_CHILDREN's ru_maxrss)
    export     `fivecut.weights.export.export` of the checkpoint to Qwen2ForCausalLM with 4 workers
               and shards of a quarter of the model: the largest worker's peak
    whole      `fivecut.train.checkpoint.full_state` in one process: every weight at once, what an
               export that gathers the model holds (its own peak)

Each figure is above the baseline; the export's per worker should be about a quarter of the
model's fp32 bytes (its shards' tensors as read, then as written) and the whole model's all of
it. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import multiprocessing
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.import_memory import shape, write_folder  # noqa: E402

WORKERS = 4


def children_peak() -> int:
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # KiB on Linux


def nothing() -> None:
    import fivecut.weights.export  # noqa: F401  (what a worker of the export imports)


def child(mode: str, checkpoint: Path, out: Path, shard_bytes: int) -> None:
    """One measurement in this fresh process; prints peak_bytes=N."""
    import torch  # noqa: F401

    if mode == "baseline":
        context = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(WORKERS, mp_context=context) as pool:
            for future in [pool.submit(nothing) for _ in range(WORKERS)]:
                future.result()
        peak = children_peak()
    elif mode == "export":
        from fivecut.weights.export import export

        export(checkpoint, out, None, shard_bytes, "fp32", "Qwen2ForCausalLM", WORKERS)
        peak = children_peak()
    else:
        from fivecut.train.checkpoint import find_checkpoint, full_state

        full_state(find_checkpoint(checkpoint, None))
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(f"peak_bytes={peak}")


def measure(mode: str, checkpoint: Path, out: Path, shard_bytes: int) -> int:
    argv = [sys.executable, __file__, "--child", mode, str(checkpoint), str(out), str(shard_bytes)]
    done = subprocess.run(argv, capture_output=True, text=True, check=True)
    return int(next(line for line in done.stdout.splitlines() if line.startswith("peak_bytes="))[11:])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params", type=float, default=1e8)
    p.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    ns = p.parse_args(argv)
    if ns.child:
        mode, checkpoint, out, shard = ns.child
        child(mode, Path(checkpoint), Path(out), int(shard))
        return 0
    from fivecut.cli import main as fivecut

    args = shape(ns.params)
    model = args.num_params() * 4
    with tempfile.TemporaryDirectory() as tmp:
        folder, ckpt = Path(tmp) / "qwen2", Path(tmp) / "ckpt"
        write_folder(folder, args)
        assert fivecut(["convert", "--from", f"hf:{folder}", "--to", str(ckpt), "--layout", "tp=2,pp=2"]) == 0
        shard = model // WORKERS + 1
        base = measure("baseline", ckpt, Path(tmp) / "none", shard)
        peaks = {mode: measure(mode, ckpt, Path(tmp) / mode, shard) - base for mode in ("export", "whole")}
    print(
        f"\nexport of a 4-rank checkpoint of {args.num_params():,} parameters ({model / 2**20:.0f} MiB fp32), "
        f"{WORKERS} workers, shards of at most {shard / 2**20:.0f} MiB; worker baseline {base / 2**20:.0f} MiB"
    )
    print("| what | peak per process above the baseline, MiB | / model bytes |")
    print("|---|---:|---:|")
    for mode, peak in peaks.items():
        print(f"| {mode} | {peak / 2**20:.0f} | {peak / model:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
