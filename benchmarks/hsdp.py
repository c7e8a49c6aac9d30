"""fivecut ZeRO-3 with hybrid sharding (parallel.zero_shard) against FSDP2's HSDP.

    python benchmarks/hsdp.py [--model tiny|tiny-gpt2|small] [--world 4] [--shard 2] [--steps 10]
                              [--repeats 5] [--batch 8] [--seq 128]

Candidates, each built in every rank from the same seed (so with the same weights):

    fivecut ZeRO-3 HSDP  parallelize(dp=world, zero=3, zero_shard=shard): units sharded over
                         `shard` consecutive ranks, each shard all-reduced over the world/shard replicas
    torch FSDP2 HSDP     `fully_shard` of every block, then of the root, on the 2-D DeviceMesh
                         (replicate = world/shard, shard = shard): the same units and groups

Both fp32, reshard after forward, gradients summed over ranks (FSDP2:
`set_gradient_divide_factor(1.0)` and `set_force_sum_reduction_for_comms(True)`, as in
benchmarks/zero.py, whose candidates and AdamW this reuses). Before timing, both train three steps
on the same per-rank batches and their global losses must agree to 1e-5 relative. Timing is
interleaved (benchmarks/common.py: the two alternate which goes first each repeat); the ratio is
the median over repeats of median(fivecut) / median(FSDP2). The last line is `ratio_hsdp_vs_fsdp2=<x>`.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import FSDPModule, fully_shard  # noqa: E402

from benchmarks.common import (  # noqa: E402
    ADAMW,
    TIMING_COLUMNS,
    add_common_arguments,
    benchmark_parser,
    compare,
    format_bytes,
    interleave_pair,
    load_average,
    markdown_table,
    parse_options,
    run,
    timing_cells,
    token_batch,
)
from benchmarks.zero import CHECK_STEPS, LOSS_RTOL, Candidate, adamw, fsdp2_state_bytes, global_loss  # noqa: E402
from fivecut.layout import ParallelDims  # noqa: E402
from fivecut.mesh import Mesh  # noqa: E402
from fivecut.model.presets import get_preset  # noqa: E402
from fivecut.model.transformer import build_model  # noqa: E402
from fivecut.parallel.parallelize import ParallelizeOptions, parallelize  # noqa: E402
from fivecut.train.memory import model_state_bytes  # noqa: E402
from fivecut.train.optim import build_optimizer  # noqa: E402

OURS, THEIRS = "fivecut ZeRO-3 HSDP", "torch FSDP2 HSDP"


def build_fivecut(args, world: int, shard: int) -> Candidate:
    mesh = Mesh(ParallelDims(dp=world, zero=3, zero_shard=shard), "cpu")
    par = parallelize(build_model(args, seed=0), mesh, ParallelizeOptions())
    optimizer = build_optimizer(par.pieces, **ADAMW)

    def zero_grad():
        mesh.ledger.begin_step(0)  # keep the ledger to one step's records
        par.sync.zero_grad()

    state = lambda: model_state_bytes(*par.state_tensors(), optimizer)  # noqa: E731
    return Candidate(OURS, par.module, optimizer, zero_grad, par.sync.after_step, 1.0, state, mesh.ledger)


def build_fsdp2(args, world: int, shard: int) -> Candidate:
    mesh = init_device_mesh("cpu", (world // shard, shard), mesh_dim_names=("replicate", "shard"))
    model = build_model(args, seed=0)
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)  # the root unit: embedding, final norm, head
    for module in model.modules():
        if isinstance(module, FSDPModule):  # sum gradients over ranks, as fivecut does
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    optimizer = adamw(list(model.parameters()))
    state = lambda: fsdp2_state_bytes(model, optimizer)  # noqa: E731
    return Candidate(THEIRS, model, optimizer, optimizer.zero_grad, lambda: None, 1.0, state)


def rank_main(opts: dict) -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    args = get_preset(opts["model"])
    candidates = {OURS: build_fivecut(args, world, opts["shard"]), THEIRS: build_fsdp2(args, world, opts["shard"])}
    inputs, targets = token_batch(args.vocab_size, opts["batch"], opts["seq"], seed=1234 + rank)  # [b, s] each
    batch = (inputs, targets, world * opts["batch"] * opts["seq"])
    losses = {name: [global_loss(c.step(*batch)) for _ in range(CHECK_STEPS)] for name, c in candidates.items()}
    for step, (x, y) in enumerate(zip(losses[OURS], losses[THEIRS])):
        if abs(x - y) > LOSS_RTOL * abs(y):
            raise AssertionError(f"{OURS} vs {THEIRS}: loss {step} is {x!r} vs {y!r} (rel diff > {LOSS_RTOL})")
    runs = interleave_pair({name: (lambda c=c: c.step(*batch)) for name, c in candidates.items()}, opts)
    wire = candidates[OURS].ledger.wire_bytes()
    return dict(runs=runs, losses=losses, state={n: c.state_bytes()["total"] for n, c in candidates.items()}, wire=wire)


def report(opts: dict, results: list[dict], elapsed: float, before: str) -> str:
    r0 = results[0]
    runs, tokens = r0["runs"], opts["world"] * opts["batch"] * opts["seq"]
    comparison = compare(runs, OURS, THEIRS)
    rows = [[name, *timing_cells(runs[name], tokens, unit=None), format_bytes(r0["state"][name])] for name in runs]
    lines = [
        f"model {opts['model']}, {opts['world']} gloo ranks: shard groups of {opts['shard']}, "
        f"{opts['world'] // opts['shard']} replicas; batch {opts['batch']} x {opts['seq']} tokens per rank, "
        f"{opts['repeats']} repeats x {opts['steps']} steps (+{opts['warmup']} warm-up)",
        f"machine: {before} before, {load_average()} after; wall time {elapsed:.0f} s",
        "same work: global loss before/after 1/after 2 steps: "
        + "; ".join(f"{n} " + "/".join(f"{x:.6f}" for x in r0["losses"][n]) for n in runs),
        "",
        markdown_table(["", *TIMING_COLUMNS, "tok/s (global)", "model state / rank"], rows),
        "",
        f"fivecut wire bytes per step (rank 0, from its ledger): {format_bytes(r0['wire'])}",
        "ratios per repeat: " + ", ".join(f"{x:.3f}" for x in comparison.ratios),
        f"ratio_hsdp_vs_fsdp2={comparison.ratio:.3f}",
    ]
    return "\n".join(lines)


def parse(argv=None) -> dict:
    p = benchmark_parser(__doc__)
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--shard", type=int, default=2, help="ranks per shard group (fivecut parallel.zero_shard)")
    add_common_arguments(p, steps=10)
    opts = parse_options(p, argv)
    if opts["shard"] < 1 or opts["world"] % opts["shard"]:
        p.error(f"--shard {opts['shard']} must be >= 1 and divide --world {opts['world']}")
    return opts


def main(argv=None) -> None:
    opts = parse(argv)
    run("benchmarks/hsdp.py", rank_main, report, opts, world=opts["world"])


if __name__ == "__main__":
    main()
