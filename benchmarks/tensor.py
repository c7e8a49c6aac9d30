"""fivecut's tensor (and sequence) parallelism against PyTorch's DTensor `parallelize_module`.

    python benchmarks/tensor.py [--model tiny] [--tp 2] [--sp | --no-sp] [--steps 10] [--repeats 5]
                                [--batch 8] [--seq 128] [--warmup 2] [--foreach] [--ablate] [--profile]

Both variants run by default: plain TP (Megatron f/g all-reduces) and TP with sequence
parallelism (all-gather / reduce-scatter, norms cut along the sequence); `--sp` runs only the
second, `--no-sp` only the first. On the 2-core CPU machine the defaults (`tiny`, tp 2,
5 repeats x 10 steps, both variants) take about 1.5 minutes at a load average of 8.

Each of `tp` gloo ranks (fivecut.launch.spawn, one thread per rank) builds the same model
from the same seed twice and cuts it over the tp group:

    fivecut   parallelize(model, Mesh(ParallelDims(tp=N, sp=...), "cpu")): column/row-parallel
              regions with f/g forward hooks, vocab-parallel embedding and cross-entropy
              (`par.loss_sum`), SP norms; each forward inside `par.saved.forward()`, which with
              SP keeps only the local slice of each gathered region input and all-gathers it
              again in backward.
    DTensor   torch.distributed.tensor.parallel.parallelize_module over the same mesh's "tp"
              DeviceMesh, torchtitan's Llama plan: tok_embeddings RowwiseParallel (output
              Shard(1) with SP, else Replicate); attention / feed_forward PrepareModuleInput to
              Replicate; wq, wk, wv, w1, w3 ColwiseParallel (local outputs: the model derives its
              local heads from the projection width); wo, w2 RowwiseParallel (output Shard(1) with
              SP, else Replicate); norms SequenceParallel() with SP; output ColwiseParallel with
              DTensor logits Shard(-1), and the cross-entropy inside `loss_parallel()`.

Every rank sees the same batch (tensor parallelism splits the work, not the data). Both losses
are the sum of token losses divided by the batch's tokens. Both optimizers are AdamW (lr 3e-4,
betas 0.9/0.95, eps 1e-8, weight decay 0.1 on matrices, none on norm weights: fivecut's
`build_optimizer` split on both sides, over fivecut's Pieces and over the DTensor parameters),
no gradient clipping. Before timing, both train three steps and the losses (before any update,
after one and after two steps) must agree to LOSS_RTOL: the two do the same work.

A timed step: zero_grad, forward, loss, backward, AdamW step. Timing is interleaved
(benchmarks/common.py); within a repeat the variants run one after the other, each its own
interleaved block, and the order of the candidates rotates from one repeat to the next. The
table splits each step into forward+loss / backward / optimizer (medians on rank 0). The
collectives of one step are counted the same way on both sides, from the process group's own
`c10d::` operators as the profiler sees them; bytes are fivecut's ledger and the shapes of
DTensor's functional collectives.

Options for finding where time goes: `--profile` prints the profiler's top operators of one
step per side; `--ablate` adds, in the sequence-parallel variant, fivecut candidates with the
backward re-gather of saved region inputs turned off (the full gathered input is saved, as
DTensor does), with one-copy all-gather / reduce-scatter along dim 1 instead of comm's two
copies, and with both (monkeypatched in this process only; gradients are checked bitwise equal);
`--foreach` runs AdamW with foreach=True on both sides (the default on GPUs). The last lines
printed are `ratio_tp=<x>` and/or `ratio_tp_sp=<x>` (fivecut / DTensor, median of per-repeat
ratios of median step times).
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.tensor import DTensor, Replicate, Shard  # noqa: E402
from torch.distributed.tensor.parallel import (  # noqa: E402
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from benchmarks.common import (  # noqa: E402
    ADAMW,
    TIMING_COLUMNS,
    add_common_arguments,
    benchmark_parser,
    compare,
    format_ratio,
    format_seconds,
    interleave,
    load_average,
    markdown_table,
    median,
    parse_options,
    ratio_cells,
    run,
    timing_cells,
    token_batch,
)
from fivecut import comm  # noqa: E402
from fivecut.layout import ParallelDims  # noqa: E402
from fivecut.ledger import ring_factor  # noqa: E402
from fivecut.mesh import Mesh  # noqa: E402
from fivecut.model.presets import get_preset  # noqa: E402
from fivecut.model.transformer import build_model  # noqa: E402
from fivecut.parallel.data import Piece, decays  # noqa: E402
from fivecut.parallel.parallelize import parallelize  # noqa: E402
from fivecut.train.optim import build_optimizer  # noqa: E402

FIVECUT, DTENSOR = "fivecut", "DTensor"
LOSS_RTOL = 1e-5  # losses before and after one and two optimizer steps must agree to this
VARIANTS = {"tp": False, "tp_sp": True}  # name -> sequence parallel


class Side:
    """One implementation: forward+loss, backward and optimizer of one training step."""

    def __init__(self, name: str, model, forward_loss, backward, zero_grad, optimizer, after_step=lambda: None):
        self.name, self.model = name, model
        self.forward_loss, self.backward = forward_loss, backward
        self.zero_grad, self.optimizer, self.after_step = zero_grad, optimizer, after_step

    def step(self, phases: list | None = None) -> torch.Tensor:
        t0 = time.perf_counter()
        self.zero_grad()
        loss = self.forward_loss()
        t1 = time.perf_counter()
        self.backward(loss)
        t2 = time.perf_counter()
        self.optimizer.step()
        self.after_step()
        t3 = time.perf_counter()
        if phases is not None:
            phases.append((t1 - t0, t2 - t1, t3 - t2))
        return loss.detach()

    def gradients(self) -> list[torch.Tensor]:
        """Gradients of one forward/backward at the current weights (no optimizer step)."""
        self.zero_grad()
        self.backward(self.forward_loss())
        return [p.grad.detach().clone() for p in self.model.parameters()]


class Candidate:
    """A timed candidate: a Side, optionally run under `patches` (fivecut ablations)."""

    def __init__(self, name: str, side: Side, patches: Callable[[], object] = nullcontext):
        self.name, self.side, self.patches = name, side, patches
        self.phases: list[tuple[float, float, float]] = []  # seconds per step on this rank

    def step(self) -> torch.Tensor:
        with self.patches():
            return self.side.step(self.phases)


def dtensor_plan(sp: bool) -> tuple[dict, dict]:
    """torchtitan's Llama TP plan: (root plan, per-block plan)."""
    seq = Shard(1) if sp else Replicate()
    root = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "output": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False),
    }
    block = {
        "attention": PrepareModuleInput(
            input_layouts=(seq, None, None), desired_input_layouts=(Replicate(), None, None)
        ),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=seq),
        "feed_forward": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=seq),
    }
    if sp:
        root["norm"] = SequenceParallel()
        block |= {"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel()}
    return root, block


def build_sides(opts: dict, sp: bool, inputs, targets):
    """The fivecut and DTensor candidates of one variant, from the same seed."""
    args = get_preset(opts["model"])
    tp = opts["tp"]
    mesh = Mesh(ParallelDims(tp=tp, sp=sp), "cpu")
    tokens = inputs.numel()  # every tp rank holds the whole batch

    ours = build_model(args, seed=0)
    par = parallelize(ours, mesh)
    ours_opt = build_optimizer(par.pieces, **ADAMW)

    def ours_forward_loss():
        with par.saved.forward():
            return par.loss_sum(par.module(inputs), targets) / tokens

    def ours_zero():
        mesh.ledger.begin_step(0)  # keep the ledger from growing over hundreds of steps
        par.sync.zero_grad()

    backward = lambda loss: loss.backward()  # noqa: E731
    fivecut = Side(FIVECUT, ours, ours_forward_loss, backward, ours_zero, ours_opt, par.sync.after_step)

    theirs = build_model(args, seed=0)
    root, block = dtensor_plan(sp)
    tp_mesh = mesh.device_mesh["tp"]
    for layer in theirs.layers.values():
        parallelize_module(layer, tp_mesh, block)
    parallelize_module(theirs, tp_mesh, root)
    check_local_projections(theirs, args, tp, inputs)
    their_opt = build_optimizer([Piece(p, decays(p)) for p in theirs.parameters()], **ADAMW)
    for opt in (ours_opt, their_opt):
        for group in opt.param_groups:
            group["foreach"] = opts["foreach"]  # None: torch's default (single-tensor on CPU, foreach on GPU)

    def their_forward_loss():
        with loss_parallel():
            logits = theirs(inputs)  # DTensor [b, s, V] Shard(-1)
            return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum") / tokens

    def their_backward(loss):
        with loss_parallel():
            loss.backward()

    dtensor = Side(DTENSOR, theirs, their_forward_loss, their_backward, lambda: theirs.zero_grad(), their_opt)
    return mesh, par, fivecut, dtensor


def check_local_projections(model, args, tp: int, inputs) -> None:
    """The model derives its local heads from the projections' output width: under DTensor,
    wq/wk/wv must hand plain local tensors of n_heads*hd/tp (n_kv_heads*hd/tp) features to it."""
    seen = {}
    attention = model.layers["0"].attention
    hooks = [
        getattr(attention, n).register_forward_hook(lambda m, a, out, n=n: seen.setdefault(n, out))
        for n in ("wq", "wk", "wv")
    ]
    with torch.no_grad():
        model(inputs[:1])
    for h in hooks:
        h.remove()
    want = {"wq": args.n_heads * args.head_dim // tp, "wk": args.n_kv_heads * args.head_dim // tp}
    want["wv"] = want["wk"]
    for n, out in seen.items():
        if isinstance(out, DTensor) or out.shape[-1] != want[n]:
            got = f"{type(out).__name__} {tuple(out.shape)}"
            raise AssertionError(f"DTensor plan: attention.{n} gave {got}; the model needs a local [..., {want[n]}]")


def scalar(loss: torch.Tensor) -> float:
    full = getattr(loss, "full_tensor", None)
    return float(full() if full is not None else loss)


@contextmanager
def quiet_stderr():
    """Silence file descriptor 2 (the profiler's C++ start/stop lines) for the duration."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def profiled(step: Callable[[], object], record_shapes: bool = False):
    from torch.profiler import ProfilerActivity, profile

    with quiet_stderr(), profile(activities=[ProfilerActivity.CPU], record_shapes=record_shapes) as prof:
        step()
    return prof


def collective_kind(name: str) -> str | None:
    """all_reduce / all_gather / reduce_scatter for a c10d operator name; None for the rest."""
    if "wait" in name or "barrier" in name or "wrap_tensor" in name:
        return None
    for kind, key in (("all_reduce", "allreduce"), ("all_gather", "allgather"), ("reduce_scatter", "reduce_scatter")):
        if key in name.replace("all_reduce", "allreduce").replace("all_gather", "allgather"):
            return kind
    return name


def count_collectives(step: Callable[[], object], tp: int, ledger=None) -> dict[str, list[int]]:
    """Collectives of one call of `step`: {kind: [calls, elements of the full tensor]}.

    Calls are counted the same way on both sides: the process group's own `c10d::` operators,
    which every collective reaches (fivecut's directly, DTensor's functional collectives through
    `_c10d_functional::`, including those issued inside DTensor's dispatch, e.g. by
    loss_parallel). Elements: fivecut's from its ledger; DTensor's from the input shapes of the
    `_c10d_functional::` operators (all-gather: input x tp)."""
    prof = profiled(step, record_shapes=True)
    out: dict[str, list[int]] = {}
    for e in prof.events():
        if e.name.startswith("c10d::") and (kind := collective_kind(e.name)):
            out.setdefault(kind, [0, 0])[0] += 1
        elif e.name.startswith("_c10d_functional::") and ledger is None and (kind := collective_kind(e.name)):
            numel = math.prod(e.input_shapes[0]) if e.input_shapes and e.input_shapes[0] else 0
            out.setdefault(kind, [0, 0])[1] += numel * (tp if kind == "all_gather" else 1)
    if ledger is not None:
        for record in ledger.records:
            out.setdefault(record.op, [0, 0])[1] += record.elements
    return out


def profile_top(step: Callable[[], object], rows: int = 25) -> str:
    return profiled(step).key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


# ---------------------------------------------------------------- ablations of fivecut (--ablate)
#
# Two changes to fivecut's sequence parallelism, applied only while an ablated candidate runs
# (monkeypatches of this process; the library is untouched). Both leave every gradient bitwise
# equal, which is checked before timing.


def all_gather_one_copy(x: torch.Tensor, group, dim: int = 0) -> torch.Tensor:
    """comm.all_gather with one copy instead of two: gather the (contiguous) local tensor as a
    stack [n, *x.shape] (no movedim copy in), then one copy to move the rank dim next to `dim`."""
    if group.size == 1:
        return x
    x = x.contiguous()
    out = x.new_empty((group.size, *x.shape))  # [n, ...] rank-major
    comm.all_gather_into(out.flatten(0, 1), x, group)  # gloo wants [n * x.shape[0], ...]: a view
    return out.movedim(0, dim).flatten(dim, dim + 1)  # [..., n * x.shape[dim], ...]: a copy unless dim == 0


def reduce_scatter_one_copy(x: torch.Tensor, group, dim: int = 0) -> torch.Tensor:
    """comm.reduce_scatter with one copy instead of two: lay the input out as [n, ...] chunks
    (one copy, none when dim == 0), reduce-scatter straight into a contiguous result."""
    if group.size == 1:
        return x
    n = group.size
    if x.shape[dim] % n:
        raise ValueError(f"reduce_scatter: dim {dim} of size {x.shape[dim]} does not divide by group size {n}")
    chunks = x.unflatten(dim, (n, x.shape[dim] // n)).movedim(dim, 0).contiguous()  # [n, ..., s/n, ...]
    out = chunks.new_empty(chunks.shape[1:])
    comm.reduce_scatter_into(out, chunks.flatten(0, 1), group)  # gloo wants [n * out.shape[0], ...]: a view
    return out


@contextmanager
def patched(obj, **attrs):
    old = {name: getattr(obj, name) for name in attrs}
    for name, value in attrs.items():
        setattr(obj, name, value)
    try:
        yield
    finally:
        for name, value in old.items():
            setattr(obj, name, value)


def ablations(par) -> dict[str, Callable[[], object]]:
    """name -> context manager factory, for the sequence-parallel variant."""
    keep_full = lambda: patched(par.saved, keep_local=lambda *a, **k: None)  # noqa: E731
    one_copy = lambda: patched(  # noqa: E731
        comm, all_gather=all_gather_one_copy, reduce_scatter=reduce_scatter_one_copy
    )

    @contextmanager
    def both():
        with keep_full(), one_copy():
            yield

    return {
        "fivecut, no SP re-gather": keep_full,  # save the gathered region inputs whole, as DTensor does
        "fivecut, one-copy comm": one_copy,
        "fivecut, both": both,
    }


# ---------------------------------------------------------------- one rank


def rank_main(opts: dict) -> dict:
    rank = dist.get_rank()
    args = get_preset(opts["model"])
    inputs, targets = token_batch(args.vocab_size, opts["batch"], opts["seq"])  # [b, s] each, the same on every tp rank

    variants = {}
    for name in opts["variants"]:
        sp = VARIANTS[name]
        mesh, par, ours, theirs = build_sides(opts, sp, inputs, targets)
        # Same work: the loss before any update, after one step and after two.
        losses = [(scalar(ours.step()), scalar(theirs.step())) for _ in range(3)]
        for i, (a, b) in enumerate(losses):
            if abs(a - b) > LOSS_RTOL * abs(b):
                raise AssertionError(f"rank {rank} {name}: loss after {i} steps: fivecut {a:.8f} vs DTensor {b:.8f}")
        candidates = [Candidate(FIVECUT, ours), Candidate(DTENSOR, theirs)]
        if opts["ablate"] and sp:
            reference = ours.gradients()
            for label, patches in ablations(par).items():
                with patches():
                    grads = ours.gradients()
                if not all(torch.equal(g, r) for g, r in zip(grads, reference, strict=True)):
                    raise AssertionError(f"rank {rank}: ablation {label!r} changed the gradients")
                candidates.append(Candidate(label, ours, patches))
        comms = {
            FIVECUT: count_collectives(ours.step, opts["tp"], mesh.ledger),
            DTENSOR: count_collectives(theirs.step, opts["tp"]),
        }
        profiles = {c.name: profile_top(c.step) for c in candidates[:2]} if opts["profile"] else {}
        variants[name] = dict(
            candidates=candidates,
            sides=(ours, theirs),
            losses=losses,
            comms=comms,
            profiles=profiles,
            runs={c.name: [] for c in candidates},
        )

    started = time.perf_counter()
    for r in range(opts["repeats"]):
        for name, v in variants.items():
            cands = v["candidates"]
            shift = r % len(cands)  # rotate which candidate goes first
            order = {c.name: c.step for c in cands[shift:] + cands[:shift]}
            one = interleave(order, opts["steps"], repeats=1, warmup=opts["warmup"])
            for label in one:
                v["runs"][label] += one[label]
            if rank == 0:
                a, b = median(v["runs"][FIVECUT][-1]), median(v["runs"][DTENSOR][-1])
                extra = "".join(f", {c.name} {format_seconds(median(v['runs'][c.name][-1]))}" for c in cands[2:])
                print(
                    f"  repeat {r + 1}/{opts['repeats']} {name:<5} ({' then '.join(order)}): "
                    f"fivecut {format_seconds(a)}, DTensor {format_seconds(b)}{extra}, "
                    f"ratio {format_ratio(a / b)}  [{time.perf_counter() - started:.0f} s]",
                    flush=True,
                )

    out = {}
    for name, v in variants.items():
        ours, theirs = v["sides"]
        with torch.no_grad():
            final = (scalar(ours.forward_loss()), scalar(theirs.forward_loss()))  # after every step taken
        out[name] = dict(
            runs=v["runs"],
            losses=v["losses"],
            final=final,
            comms=v["comms"],
            profiles=v["profiles"],
            phases={c.name: [median(col) for col in zip(*c.phases)] for c in v["candidates"]},
            params=sum(p.numel() for p in build_model(args, device="meta").parameters()),
        )
    return out


# ---------------------------------------------------------------- report


def format_comms(comms: dict[str, list[int]], tp: int) -> str:
    """'op xcalls (MiB on the wire per rank)', fp32, ring factors as in fivecut.ledger."""
    wire = {op: elements * 4 * ring_factor(op, tp) for op, (_, elements) in comms.items()}
    parts = [f"{op} x{calls} ({wire[op] / 2**20:.2f} MiB)" for op, (calls, _) in sorted(comms.items())]
    return (", ".join(parts) + f"; {sum(wire.values()) / 2**20:.2f} MiB in all") if parts else "none"


def variant_section(opts: dict, name: str, results: list[dict]) -> tuple[list[str], float]:
    v = results[0][name]
    runs = v["runs"]
    tokens = opts["batch"] * opts["seq"]
    cmp = compare(runs, FIVECUT, DTENSOR)
    worst = max(abs(a - b) / abs(b) for r in results for a, b in r[name]["losses"])
    rows = []
    for label in runs:
        fwd, bwd, opt = v["phases"][label]
        rows.append(
            [
                label,
                *timing_cells(runs[label], tokens),
                f"{format_seconds(fwd)} / {format_seconds(bwd)} / {format_seconds(opt)}",
            ]
        )
    pairs = [(label, DTENSOR) for label in runs if label != DTENSOR]
    pairs += [(label, FIVECUT) for label in list(runs)[2:]]  # ablations against fivecut as it is
    for a, b in pairs:
        rows.append([f"ratio {a} / {b}", *ratio_cells(runs, a, b), "", ""])
    header = ["", *TIMING_COLUMNS, "tokens/s (at median)", "fwd+loss / bwd / optim (rank 0 medians)"]
    losses = ", ".join(f"{a:.6f} vs {b:.6f}" for a, b in v["losses"])
    fb = lambda label: sum(v["phases"][label][:2])  # noqa: E731
    lines = [
        f"### {name} ({'with' if VARIANTS[name] else 'without'} sequence parallelism)",
        "",
        f"same work: losses before / after 1 / after 2 steps {losses} (max rel diff {worst:.1e} over ranks); "
        + (
            f"after all timed steps {v['final'][0]:.6f} vs {v['final'][1]:.6f}"
            if len(runs) == 2
            else "(the ablations train fivecut's model too, so later losses are not compared)"
        ),
        f"collectives per step (rank 0): fivecut {format_comms(v['comms'][FIVECUT], opts['tp'])}; "
        f"DTensor {format_comms(v['comms'][DTENSOR], opts['tp'])}",
        "",
        markdown_table(header, rows),
        "",
        f"per-repeat ratios: {', '.join(format_ratio(x) for x in cmp.ratios)}; "
        f"forward+backward alone (rank 0 phase medians): fivecut / DTensor {format_ratio(fb(FIVECUT) / fb(DTENSOR))}",
        "",
    ]
    for label, table in v["profiles"].items():
        lines += [f"profile of one {label} step (rank 0):", table, ""]
    return lines, cmp.ratio


def report(opts: dict, results: list[dict], elapsed: float, before: str) -> str:
    r0 = results[0]
    foreach = {None: "torch's default (single-tensor on CPU)", True: "foreach", False: "single-tensor"}[opts["foreach"]]
    params = r0[opts["variants"][0]]["params"]
    lines = [
        f"model {opts['model']} ({params / 1e6:.2f}M parameters), tp {opts['tp']} gloo ranks x 1 thread, "
        f"batch {opts['batch']} x {opts['seq']} tokens (the same on every tp rank), "
        f"{opts['repeats']} repeats x {opts['steps']} steps (+{opts['warmup']} warm-up) each, AdamW {foreach}",
        f"machine: {before} before, {load_average()} after",
        "",
    ]
    ratios = {}
    for name in opts["variants"]:
        section, ratios[name] = variant_section(opts, name, results)
        lines += section
    lines.append(f"wall time {elapsed:.0f} s")
    lines += [f"ratio_{name}={ratios[name]:.3f}" for name in opts["variants"]]
    return "\n".join(lines)


def parse(argv=None) -> dict:
    p = benchmark_parser(__doc__, model_help="fivecut preset whose vocabulary, heads and kv heads divide by tp")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks (DTensor's plan needs tp | n_kv_heads)")
    only = p.add_mutually_exclusive_group()
    only.add_argument("--sp", action="store_true", help="run only the sequence-parallel variant")
    only.add_argument("--no-sp", action="store_true", help="run only the variant without sequence parallelism")
    add_common_arguments(p, steps=10, batch_help="sequences (the same on every tp rank)")
    p.add_argument("--foreach", action="store_true", default=None, help="AdamW foreach=True on both sides (as on GPUs)")
    p.add_argument(
        "--ablate",
        action="store_true",
        help="also time fivecut SP without its backward re-gather, with one-copy comm, and with both",
    )
    p.add_argument("--profile", action="store_true", help="print the profiler's top operators of one step per side")
    opts = parse_options(p, argv)
    opts["variants"] = ["tp_sp"] if opts["sp"] else ["tp"] if opts["no_sp"] else ["tp", "tp_sp"]
    args = get_preset(opts["model"])
    t = opts["tp"]
    for what in ("vocab_size", "n_heads", "n_kv_heads", "ffn_dim"):
        n = getattr(args, what)
        if n % t:
            p.error(f"model {opts['model']} has {what}={n}, not divisible by tp={t}: DTensor's plan cannot cut it")
    if "tp_sp" in opts["variants"] and opts["seq"] % t:
        p.error(f"--seq {opts['seq']} must divide by tp={t} for sequence parallelism")
    return opts


def main(argv=None) -> None:
    opts = parse(argv)
    run("benchmarks/tensor.py", rank_main, report, opts, world=opts["tp"])


if __name__ == "__main__":
    main()
