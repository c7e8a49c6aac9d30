"""Compute weights cast once a step (`fivecut.parallel.precision`) against PyTorch's autocast
casting each weight at each matmul: step time, bf16, on the CPU.

    python benchmarks/cast_once.py [--model tiny] [--microbatches 8] [--steps 3]

Two gloo ranks (fivecut.launch.spawn), pp=2 under 1F1B with `--microbatches` microbatches of 2
sequences of 64 tokens. The same model from the same seed, built twice: `param_dtype=None`
(torch.autocast casts every fp32 weight in every microbatch and keeps the cast for backward) and
`param_dtype=bf16` (one bf16 copy of each matmul weight a step). A step is zero_grad, the
schedule, an in-place SGD update and `invalidate()`. Rank 0's median step time over `--steps`
steps (after one warm-up step) is printed. Memory is measured in tests/test_cast_once.py (the
bytes saved for backward per microbatch, by a saved-tensors hook), not here.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from fivecut.launch import spawn
from fivecut.layout import ParallelDims
from fivecut.mesh import Mesh
from fivecut.model.presets import get_preset
from fivecut.model.transformer import build_model
from fivecut.parallel.parallelize import ParallelizeOptions, parallelize
from fivecut.parallel.pipeline.executor import PipelineStep


def run(model: str, microbatches: int, steps: int, cast_once: bool) -> float:
    torch.set_num_threads(1)
    mesh = Mesh(ParallelDims(pp=2, microbatches=microbatches, pp_schedule="1f1b"), "cpu")
    args = get_preset(model)
    options = ParallelizeOptions(param_dtype=torch.bfloat16 if cast_once else None)
    par = parallelize(build_model(args, seed=0), mesh, options)
    seq, rows = 64, 2 * microbatches
    tokens = torch.randint(0, args.vocab_size, (rows, seq + 1), generator=torch.Generator().manual_seed(0))
    batches = list(zip(tokens[:, :-1].chunk(microbatches), tokens[:, 1:].chunk(microbatches)))
    executor = PipelineStep(
        par.pipeline.schedule, par.pipeline.stages, mesh.group("pp"), par.loss_sum,
        hidden_shape=(2, seq, args.dim), positions=torch.arange(seq),
        forward_context=lambda m: torch.autocast("cpu", dtype=torch.bfloat16),
    )  # fmt: skip
    times = []
    for step in range(steps + 1):
        par.sync.zero_grad()
        started = time.perf_counter()
        executor.run(batches, rows * seq, mesh.ledger)
        with torch.no_grad():
            for p in par.module.parameters():
                if p.grad is not None:
                    p.sub_(1e-3 * p.grad)
        par.compute.invalidate()
        if step:  # the first is a warm-up
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    a = parser.parse_args()
    results = {}
    for name, cast_once in (("autocast", False), ("cast once", True)):
        results[name] = spawn(run, 2, a.model, a.microbatches, a.steps, cast_once)[0]
        print(f"{name:<10} step {results[name] * 1e3:8.1f} ms")
    print(f"ratio_step={results['cast once'] / results['autocast']:.3f}")


if __name__ == "__main__":
    main()
