"""train.compile against eager: fivecut's step with each block compiled vs the same model eager.

    python benchmarks/compile.py --model small --tp 1
    python benchmarks/compile.py --model small --tp 2      # tp=2 with sequence parallelism (--no-sp: without)

Both candidates are the same model from the same seed, cut by `parallelize` on the same mesh,
one with `compile=True` (train.compile). A timed step: zero_grad, forward, loss, backward, AdamW
step. Before timing, each runs one step on the same batch: the first compiled step is the compile
time (reported on its own, minus the eager first step), and both first losses and gradients must
agree (losses to LOSS_RTOL, gradients to GRAD_RTOL). Timing is interleaved (benchmarks/common.py):
each repeat times both, rotating which goes first; the ratio compiled / eager is the median of
the per-repeat ratios of median step times. The last line printed is `ratio_compile=<x>`.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks.common import (  # noqa: E402
    ADAMW,
    TIMING_COLUMNS,
    add_common_arguments,
    benchmark_parser,
    compare,
    format_ratio,
    format_seconds,
    interleave,
    markdown_table,
    max_rel_diff,
    median,
    parse_options,
    ratio_cells,
    run,
    timing_cells,
    token_batch,
)
from fivecut.layout import ParallelDims  # noqa: E402
from fivecut.mesh import Mesh  # noqa: E402
from fivecut.model.presets import get_preset  # noqa: E402
from fivecut.model.transformer import build_model  # noqa: E402
from fivecut.parallel.parallelize import ParallelizeOptions, parallelize  # noqa: E402
from fivecut.train.optim import build_optimizer  # noqa: E402

EAGER, COMPILED = "eager", "compiled"
LOSS_RTOL, GRAD_RTOL = 1e-5, 1e-4  # first step of both sides (inductor reorders sums; measured below)


class Side:
    """One candidate: fivecut's model under `parallelize`, with or without train.compile."""

    def __init__(self, opts: dict, mesh: Mesh, compiled: bool, inputs, targets):
        self.par = parallelize(
            build_model(get_preset(opts["model"]), seed=0), mesh, ParallelizeOptions(compile=compiled)
        )
        self.optimizer = build_optimizer(self.par.pieces, **ADAMW)
        self.mesh, self.inputs, self.targets = mesh, inputs, targets

    def forward_backward(self) -> torch.Tensor:
        self.mesh.ledger.begin_step(0)  # keep the ledger from growing over hundreds of steps
        self.par.sync.zero_grad()
        with self.par.saved.forward():
            loss = self.par.loss_sum(self.par.module(self.inputs), self.targets) / self.inputs.numel()
        loss.backward()
        return loss.detach()

    def step(self) -> torch.Tensor:
        loss = self.forward_backward()
        self.optimizer.step()
        self.par.sync.after_step()
        return loss


def first_step(side: Side) -> tuple[float, float, list[torch.Tensor]]:
    """Seconds, loss and gradients of one forward/backward (no update)."""
    t0 = time.perf_counter()
    loss = side.forward_backward()
    seconds = time.perf_counter() - t0
    return seconds, float(loss), [p.grad.detach().clone() for p in side.par.module.parameters()]


def progress(repeats: int):
    """Rank 0 prints each repeat's medians as it ends (a loaded machine makes a run long)."""
    started = time.perf_counter()

    def line(r: int, order: list[str], runs: dict[str, list[list[float]]]) -> None:
        if dist.is_initialized() and dist.get_rank() != 0:
            return
        e, c = median(runs[EAGER][-1]), median(runs[COMPILED][-1])
        print(
            f"  repeat {r + 1}/{repeats} ({' then '.join(order)}): eager {format_seconds(e)}, compiled "
            f"{format_seconds(c)}, ratio {format_ratio(c / e)}  [{time.perf_counter() - started:.0f} s]",
            flush=True,
        )

    return line


def rank_main(opts: dict) -> dict:
    torch.manual_seed(0)
    # a cold compile, as on a fresh machine: no graph caches, and the kernels built into a new folder
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="fivecut-inductor-")
    mesh = Mesh(ParallelDims(tp=opts["tp"], sp=opts["sp"] and opts["tp"] > 1), "cpu")
    inputs, targets = token_batch(get_preset(opts["model"]).vocab_size, opts["batch"], opts["seq"])
    sides = {name: Side(opts, mesh, name == COMPILED, inputs, targets) for name in (EAGER, COMPILED)}
    first = {name: first_step(side) for name, side in sides.items()}
    (te, le, ge), (tc, lc, gc) = first[EAGER], first[COMPILED]
    loss_diff, grad_diff = abs(lc - le) / abs(le), max_rel_diff(gc, ge)
    if loss_diff > LOSS_RTOL or grad_diff > GRAD_RTOL:
        raise AssertionError(f"compiled and eager differ: loss {loss_diff:.3g}, gradients {grad_diff:.3g}")
    steps = {name: side.step for name, side in sides.items()}
    runs = interleave(steps, opts["steps"], opts["repeats"], opts["warmup"], on_repeat=progress(opts["repeats"]))
    counts = sides[COMPILED].par.compiled.counts()
    return {"runs": runs, "compile_s": tc - te, "loss_diff": loss_diff, "grad_diff": grad_diff, "counts": counts}


def report(opts: dict, results: list[dict], elapsed: float, before: str) -> str:
    r = results[0]  # time_steps already takes the slowest rank's step
    runs, tokens = r["runs"], opts["batch"] * opts["seq"]
    layout = "one process" if opts["tp"] == 1 else f"tp={opts['tp']}" + (",sp=true" if opts["sp"] else "")
    rows = [[name, *timing_cells(runs[name], tokens)] for name in (EAGER, COMPILED)]
    ratio = ratio_cells(runs, COMPILED, EAGER)
    counts = r["counts"]
    lines = [
        f"model {opts['model']}, {layout}, batch {opts['batch']}x{opts['seq']}, {opts['steps']} steps x "
        f"{opts['repeats']} repeats (interleaved), fp32 on cpu",
        f"machine before: {before}",
        f"compile time, cold (first compiled step minus first eager step, rank 0): {format_seconds(r['compile_s'])}; "
        f"{counts['graphs']} graphs, {counts['graph_breaks']} graph breaks",
        f"first step, compiled vs eager: loss rel diff {r['loss_diff']:.2e}, "
        f"gradients max rel diff {r['grad_diff']:.2e}",
        "",
        markdown_table(["candidate", *TIMING_COLUMNS, "tokens/s"], rows),
        "",
        f"compiled / eager: median of per-repeat ratios {ratio[0]}, fastest steps {ratio[1]}, repeats {ratio[2]}",
        f"wall {elapsed:.0f} s",
        f"ratio_compile={format_ratio(compare(runs, COMPILED, EAGER).ratio)}",
    ]
    return "\n".join(lines)


def parse(argv=None) -> dict:
    p = benchmark_parser(__doc__)
    p.set_defaults(model="small")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (1: one process)")
    p.add_argument("--no-sp", dest="sp", action="store_false", help="tp without sequence parallelism")
    add_common_arguments(p, steps=5, repeats=5, batch_help="sequences (every tp rank holds the whole batch)")
    return parse_options(p, argv)


def main(argv=None) -> None:
    opts = parse(argv)
    run("benchmarks/compile.py", rank_main, report, opts, world=opts["tp"])


if __name__ == "__main__":
    main()
