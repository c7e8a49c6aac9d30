"""fivecut's DataParallel against torch.nn.parallel.DistributedDataParallel.

    python benchmarks/ddp.py [--model tiny|tiny-gpt2|small] [--world 2] [--steps 20] [--repeats 5]
                             [--batch 8] [--seq 128] [--bucket-mb 25] [--torch-set-to-none]

The default model is `tiny` (0.85M parameters), not `small`: on the 2-core CPU machine the
defaults take about 40 s with `tiny`, about 4 min with `tiny-gpt2` (0.85 s a step, the GPT-2
vocabulary's head and loss dominate) and about 14 min with `small` (3.5-4 s a step). For
`small`, `--steps 5 --repeats 3` fits in about 3 minutes.

Each of `world` gloo ranks (fivecut.launch.spawn, one thread per rank) builds the same model
from the same seed twice: one copy wrapped by fivecut's DataParallel over the dp group, the
other by torch's DDP over the same process group (same bucket size, gradients as bucket
views, no per-forward buffer broadcast: fivecut has none and the only buffers are RoPE
tables). Both see the same random-token batch on a rank (a different one per rank).

fivecut sums gradients over ranks (the loss is divided by the *global* token count); torch
averages them, so torch's loss is multiplied by the world size. The two then compute the
same gradients, which is checked once before timing, and follow the same AdamW trajectory,
which is checked again after timing.

A timed step: zero_grad, forward, loss, backward (which ends with the wait for the gradient
all-reduce, in both), AdamW step. Timing is interleaved (benchmarks/common.py). The last
line printed is `ratio=<fivecut/torch>`.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

from benchmarks.common import (  # noqa: E402
    ADAMW,
    TIMING_COLUMNS,
    add_common_arguments,
    benchmark_parser,
    check_gradients,
    compare,
    format_ratio,
    interleave_pair,
    load_average,
    markdown_table,
    max_rel_diff,
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
from fivecut.parallel.data import DataParallel  # noqa: E402
from fivecut.parallel.parallelize import token_loss_sum  # noqa: E402

FIVECUT, TORCH = "fivecut DataParallel", "torch DDP"
GRAD_RTOL = 1e-6  # gradients must agree to this, relative to each tensor's largest entry


class Side:
    """One candidate: a model, its gradient sync, its optimizer, and how to zero and scale."""

    def __init__(self, name, model, wrapped, zero_grad, loss_scale):
        self.name, self.model, self.wrapped = name, model, wrapped
        self.zero_grad, self.loss_scale = zero_grad, loss_scale
        self.optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)

    def forward_backward(self, inputs, targets, global_tokens) -> torch.Tensor:
        self.zero_grad()
        loss = token_loss_sum(self.wrapped(inputs), targets) / global_tokens * self.loss_scale
        loss.backward()
        return loss.detach()

    def step(self, inputs, targets, global_tokens) -> None:
        self.forward_backward(inputs, targets, global_tokens)
        self.optimizer.step()


def build_sides(opts: dict, world: int):
    args = get_preset(opts["model"])
    mesh = Mesh(ParallelDims(dp=world), "cpu")
    group = mesh.group("dp_cp")

    ours = build_model(args, seed=0)
    dp = DataParallel(ours, group, bucket_mb=opts["bucket_mb"])

    def ours_zero():
        mesh.ledger.begin_step(0)  # keep the ledger from growing over hundreds of steps
        dp.zero_grad()

    theirs = build_model(args, seed=0)
    ddp = DistributedDataParallel(
        theirs,
        process_group=group.pg,
        bucket_cap_mb=opts["bucket_mb"],
        gradient_as_bucket_view=True,
        forward_sync_buffers=False,
    )
    fivecut = Side(FIVECUT, ours, ours, ours_zero, loss_scale=1.0)
    torch_side = Side(TORCH, theirs, ddp, lambda: theirs.zero_grad(set_to_none=opts["torch_set_to_none"]), world)
    return args, mesh, dp, ddp, fivecut, torch_side


def torch_bucket_bytes(ddp) -> list[int]:
    """Sizes of torch's buckets as rebuilt after the first step (private API; empty if it moved)."""
    try:
        return [b.buffer().numel() * b.buffer().element_size() for b in ddp.reducer._get_zeros_like_grad_buckets()]
    except (AttributeError, RuntimeError):
        return []


def rank_main(opts: dict) -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    args, mesh, dp, ddp, fivecut, torch_side = build_sides(opts, world)
    batch, seq = opts["batch"], opts["seq"]
    inputs, targets = token_batch(args.vocab_size, batch, seq, seed=1234 + rank)  # [b, s] each
    global_tokens = world * batch * seq

    # Same work: one backward each, then every summed gradient must agree.
    loss_a = fivecut.forward_backward(inputs, targets, global_tokens)
    loss_b = torch_side.forward_backward(inputs, targets, global_tokens) / world
    params_a, params_b = list(fivecut.model.parameters()), list(torch_side.model.parameters())
    grad_diff, grad_bitwise = check_gradients(params_a, params_b, GRAD_RTOL)
    fivecut.optimizer.step()
    torch_side.optimizer.step()

    steps = {
        FIVECUT: lambda: fivecut.step(inputs, targets, global_tokens),
        TORCH: lambda: torch_side.step(inputs, targets, global_tokens),
    }
    runs = interleave_pair(steps, opts)  # the order alternates; rank 0 reports each repeat
    param_diff = max_rel_diff(params_a, params_b)  # same trajectory after every step taken
    return dict(
        runs=runs,
        loss=(float(loss_a), float(loss_b)),
        grad_diff=grad_diff,
        grad_bitwise=grad_bitwise,
        param_diff=param_diff,
        params=sum(p.numel() for p in params_a),
        fivecut_buckets=[b.flat.numel() * b.flat.element_size() for b in dp.buckets],
        torch_buckets=torch_bucket_bytes(ddp),
        all_reduces=len(mesh.ledger.records),
    )


def report(opts: dict, results: list[dict], elapsed: float, before: str) -> str:
    r0 = results[0]
    runs = r0["runs"]  # step times are already the slowest rank's
    cmp = compare(runs, FIVECUT, TORCH)
    tokens = opts["world"] * opts["batch"] * opts["seq"]
    rows = [[name, *timing_cells(runs[name], tokens)] for name in (FIVECUT, TORCH)]
    rows.append(["ratio fivecut / torch", *ratio_cells(runs, FIVECUT, TORCH), ""])
    header = ["", *TIMING_COLUMNS, "tokens/s (global, at median)"]
    table = markdown_table(header, rows)
    worst_grad = max(r["grad_diff"] for r in results)
    worst_param = max(r["param_diff"] for r in results)
    bitwise = all(r["grad_bitwise"] for r in results)
    mb = lambda xs: ", ".join(f"{x / 2**20:.1f}" for x in xs)  # noqa: E731
    lines = [
        f"model {opts['model']} ({r0['params'] / 1e6:.2f}M parameters), {opts['world']} gloo ranks x 1 thread, "
        f"batch {opts['batch']} x {opts['seq']} tokens per rank, bucket {opts['bucket_mb']} MB, "
        f"{opts['repeats']} repeats x {opts['steps']} steps (+{opts['warmup']} warm-up) each, "
        f"torch zero_grad(set_to_none={opts['torch_set_to_none']})",
        f"machine: {before} before, {load_average()} after",
        f"same work: loss {r0['loss'][0]:.6f} vs {r0['loss'][1]:.6f}; gradients after one step "
        f"{'bitwise equal' if bitwise else f'max rel diff {worst_grad:.2e}'} on every rank; "
        f"parameters after all steps max rel diff {worst_param:.2e}",
        f"buckets (MB): fivecut [{mb(r0['fivecut_buckets'])}] ({r0['all_reduces']} all-reduces/step); "
        f"torch [{mb(r0['torch_buckets']) or '?'}]",
        "",
        table,
        "",
        f"per-repeat ratios: {', '.join(format_ratio(x) for x in cmp.ratios)}; wall time {elapsed:.0f} s",
        f"ratio={cmp.ratio:.3f}",
    ]
    return "\n".join(lines)


def parse(argv=None) -> dict:
    p = benchmark_parser(__doc__)
    p.add_argument("--world", type=int, default=2)
    add_common_arguments(p, steps=20)
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument(
        "--torch-set-to-none",
        action="store_true",
        help="zero torch's gradients with set_to_none=True (its default) instead of zeroing the bucket views",
    )
    return parse_options(p, argv)


def main(argv=None) -> None:
    opts = parse(argv)
    run("benchmarks/ddp.py", rank_main, report, opts, world=opts["world"])


if __name__ == "__main__":
    main()
