"""Activation recomputation: step time and activation bytes for train.recompute none / selective / full.

    python benchmarks/recompute.py [--model small] [--batch 4] [--seq 512] [--steps 4] [--repeats 5]
                                   [--warmup 1] [--every 1]

One process (a gloo rank of its own, fivecut.launch.spawn, one thread) builds the same model
from the same seed three times, through `parallelize(..., ParallelizeOptions(recompute=mode, recompute_every=k))`:

    none       every block keeps what autograd saves
    selective  the attention core keeps q, k, v only and the SwiGLU product is recomputed
               (Korthikanti et al.); matmul outputs kept
    full       each block keeps its input; its forward runs again in backward

Before timing, one forward + backward per mode on the same batch: the losses and every gradient
must be equal to the last bit (the same operations in the same order), and the bytes each layer
keeps for backward are counted (`SavedActivations.measure`) against the closed form
(`fivecut.plan.activations`). A timed step is zero_grad, forward, loss, backward (no optimizer:
recomputation changes the forward and backward only). Timing is interleaved
(benchmarks/common.py): every repeat runs each mode for `steps` steps, rotating which goes
first; the ratio to `none` is taken per repeat, and the median of those ratios is reported.
The last lines printed are `ratio_selective=<x>` and `ratio_full=<x>`.
"""

from __future__ import annotations

import contextlib

import torch
from common import (
    add_common_arguments,
    benchmark_parser,
    compare,
    format_bytes,
    format_seconds,
    interleave,
    machine,
    markdown_table,
    median,
    parse_options,
    ratio_cells,
    run,
    timing_cells,
    token_batch,
)

from fivecut.layout import ParallelDims
from fivecut.mesh import Mesh
from fivecut.model.presets import get_preset
from fivecut.model.transformer import build_model
from fivecut.parallel.parallelize import ParallelizeOptions, parallelize
from fivecut.plan.activations import activation_bytes_per_layer, layer_mode

MODES = ("none", "selective", "full")


def rank_main(opts: dict) -> dict:
    torch.set_num_threads(1)
    args = get_preset(opts["model"])
    inputs, targets = token_batch(args.vocab_size, opts["batch"], opts["seq"])
    mesh = Mesh(ParallelDims(), "cpu")
    pars = {
        m: parallelize(
            build_model(args, device="meta"), mesh, ParallelizeOptions(recompute=m, recompute_every=opts["every"])
        )
        for m in MODES
    }

    def step(par, measure=False):
        for p in par.module.parameters():
            p.grad = None
        with par.saved.forward(), par.saved.measure() if measure else contextlib.nullcontext():
            logits = par.module(inputs)
        loss = par.loss_sum(logits, targets) / targets.numel()
        loss.backward()
        return loss.detach()

    first = {m: (float(step(pars[m], measure=True)), dict(pars[m].saved.bytes_per_layer)) for m in MODES}
    grads = {m: [p.grad.clone() for p in pars[m].module.parameters()] for m in MODES}
    equal = all(first[m][0] == first["none"][0] for m in MODES) and all(
        all(torch.equal(a, b) for a, b in zip(grads[m], grads["none"], strict=True)) for m in MODES
    )
    del grads

    def progress(r: int, order: list[str], runs: dict) -> None:
        medians = ", ".join(f"{m} {format_seconds(median(runs[m][-1]))}" for m in MODES)
        print(f"  repeat {r + 1}/{opts['repeats']} ({' then '.join(order)}): {medians}", flush=True)

    candidates = {m: (lambda par=pars[m]: step(par)) for m in MODES}
    runs = interleave(candidates, opts["steps"], opts["repeats"], opts["warmup"], on_repeat=progress)
    return {"runs": runs, "kept": {m: first[m][1] for m in MODES}, "equal": equal, "args": args}


def report(opts: dict, results: list, elapsed: float, before: str) -> str:
    out = results[0]
    runs, kept, args = out["runs"], out["kept"], out["args"]
    b, s, layer = opts["batch"], opts["seq"], str(args.n_layers - 1)
    tokens = b * s
    rows = []
    for m in MODES:
        mode = layer_mode(int(layer), m, opts["every"])
        predicted = activation_bytes_per_layer(args, b, s, 1, False, recompute=mode)
        total = sum(kept[m].values())
        ratio = ["", "", ""] if m == "none" else ratio_cells(runs, m, "none")
        rows.append(
            [m, *timing_cells(runs[m], tokens), *ratio, format_bytes(kept[m][layer]),
             f"{kept[m][layer] / predicted:.3f}", format_bytes(total), f"{total / sum(kept['none'].values()):.3f}"]
        )  # fmt: skip
    header = ["mode", "median step", "fastest step", "repeat medians (min .. max)", "tokens/s",
              "time / none (median of repeats)", "ratio of fastest", "per repeat (min .. max)",
              f"kept by layer {layer}", "measured / closed form", "kept by all layers", "kept / none"]  # fmt: skip
    lines = [
        f"before: {before}",
        f"after:  {machine()}  ({elapsed:.0f} s)",
        f"model {opts['model']}, batch {b} x seq {s}, one process, forward + backward per step, "
        f"{opts['repeats']} repeats x {opts['steps']} steps, recompute_every={opts['every']}",
        f"losses and gradients of the three modes equal to the last bit: {out['equal']}",
        "",
        markdown_table(header, rows),
        "",
    ]
    for m in ("selective", "full"):
        lines.append(f"ratio_{m}={compare(runs, m, 'none').ratio:.3f}")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = benchmark_parser(__doc__, "fivecut preset (default small)")
    parser.set_defaults(model="small")
    add_common_arguments(parser, steps=4, repeats=5)
    parser.set_defaults(batch=4, seq=512, warmup=1)
    parser.add_argument("--every", type=int, default=1, help="train.recompute_every")
    opts = parse_options(parser, argv)
    run("benchmarks/recompute.py", rank_main, report, opts, world=1)


if __name__ == "__main__":
    main()
