"""fivecut's pipeline parallelism: 1F1B against torch.distributed.pipelining, and measured
bubbles against fivecut's own schedule simulator.

    python benchmarks/pipeline.py [--model tiny] [--microbatches 4,8] [--steps 10] [--repeats 7]
                                  [--warmup 2] [--batch 8] [--seq 128]
                                  [--schedules gpipe,1f1b,zb1p,interleaved,dualpipev]
                                  [--bubble-microbatches 4] [--bubble-steps 10] [--bubble-repeats 3]
                                  [--even-layers] [--vs-torch-zb] [--torch-zb ScheduleInterleavedZeroBubble,...]
                                  [--untied] [--no-compare] [--no-bubbles]

A quick check of all three parts (about 6 s):

    python benchmarks/pipeline.py --steps 1 --repeats 1 --warmup 0 --batch 4 --seq 16 --microbatches 2 \
        --bubble-microbatches 4 --bubble-steps 1 --bubble-repeats 1 --vs-torch-zb

Two gloo ranks (fivecut.launch.spawn, one thread per rank), pp=2, fp32, every rank sees the
same random-token batch of `batch` x `seq` tokens per step (the first stage reads the tokens,
the last the targets). On the 2-core CPU machine at a load average of about 5.5, the defaults
take about 1.5 minutes (part 1: 25 s per microbatch count; part 2: 40 s).

Part 1, fivecut 1F1B vs torch `Schedule1F1B`, for each `--microbatches` count:

    fivecut   build_parallel(args, Mesh(ParallelDims(pp=2, pp_schedule="1f1b", microbatches=m,
              pp_layers=[n/2, n/2])), ...) and the trainer's PipelineStep (each forward inside
              `par.saved.forward()`), DataParallel over the (size-1) dp group as the trainer has
              it: gradients in one flat bucket, zero_grad zeroes the bucket.
    torch     the single-device model built from the same seed, cut to the same layers (other
              layers deleted, embedding / final norm / head set to None where they do not
              belong, as fivecut's split does), wrapped in PipelineStage(module, rank, 2, cpu,
              group=<its own 2-rank gloo group>) and Schedule1F1B(stage, m, loss_fn,
              scale_grads=False), step(..., return_outputs=False); zero_grad(set_to_none=True),
              torch's default.

Loss: fivecut sums token cross-entropies and divides by the global batch's token count on the
last stage. torch's schedules divide the accumulated gradients by n_microbatches unless
`scale_grads=False`; with `scale_grads=False` and loss_fn = sum of token cross-entropy / global
tokens the two compute the same loss and gradients, which is checked once before timing (loss
and every gradient, rtol GRAD_RTOL), and again after timing (parameters after every step).
Both optimizers are AdamW (lr 3e-4, betas 0.9/0.95, eps 1e-8, weight decay 0.1 on matrices, none
on norm weights, fivecut's `build_optimizer` split on both sides), no clipping.

A timed step: zero_grad, the schedule (forwards and backwards of all microbatches, the
point-to-point messages, fivecut's end-of-step wait for its sends), AdamW step. Timing is
interleaved (benchmarks/common.py). The compute orders are the same (torch warms up with
pp - r forwards and then runs 1B1F, fivecut with pp - 1 - r and then 1F1B: F0 F1 B0 F2 B1 ... on
rank 0, F0 B0 F1 B1 ... on rank 1); the messages are posted differently: torch posts a send
together with the next receive (one batch_isend_irecv) and waits for each send before the next,
fivecut posts a slot's sends and receives together (`schedule.posting`: a receive at most 2
compute actions before its consumer) and lets each send go once it is out. Each rank also
records its CPU time per step (main thread, and the whole process with gloo's threads), which
the load on a shared machine disturbs less than wall time.

Part 2, measured idle per rank vs `simulate`: fivecut alone under every schedule, pp=2,
`--bubble-microbatches` microbatches (dualpipev needs >= 2 pp = 4; interleaved a multiple of
pp). gpipe, 1f1b and zb1p have 2 stages; interleaved (pp_virtual 2) and dualpipev (pp_virtual 1:
it always holds 2 stages per rank) 4 stages (layers: see below). The schedules
take turns, rotating the order each repeat. `PipelineStep.execute` is wrapped (in this process
only) with perf_counter, which on Linux is CLOCK_MONOTONIC, one clock for both processes, so
the two ranks' records form one timeline. For each timed step:

    makespan       first rank's start of `run` (after a barrier) to the last rank's end
    vs 1f1b        the median over the k-th timed steps of (this schedule's makespan / 1f1b's),
                   step k of both taken in the same repeat (interleaved)
    busy(rank)     its F, B, W actions' time
    idle(rank)     1 - busy / makespan       (the simulator's definition), split into the time
                   in RECV (posting, waiting for the message), in SEND (posting), before its
                   own `run` started / after it ended, and the rest (the executor's bookkeeping)
    latency        for a receive that was already waiting when its send was posted: send
                   posted -> receive returns

Idle fractions are means over the timed steps (so that the parts add up); they are set next to
four simulations of the same schedule:

    mean costs          simulate(schedule, cost_f=F, cost_b=B, cost_w=W), F, B, W the measured
                        mean action times of that schedule (both ranks, all stages, all steps)
    per-stage costs     one measured mean per (kind, stage): the last stage carries the head and
                        the loss, stage 0 of a split backward has no input gradient (its B does
                        nothing, its W is the whole backward)
    per-stage + comm    the same, a send occupying its rank for the mean measured send time and a
                        message arriving the median latency after its send was posted
    + after the schedule  the same, followed by the measured mean time from the last rank's end
                        of the schedule to the end of the step: the tied embedding's gradient
                        sum over the pipeline ends and the data cut's reduction, which every
                        step runs after its schedule and which no schedule models
    unit costs          the simulator's defaults (F = 1, B = 2 whole; B = W = 1 split)

(the simulations with per-stage costs use `simulate`'s `stage_costs` and `cost_send`).

Part 3 (`--vs-torch-zb`), the zero-bubble schedules against torch.distributed.pipelining's,
`--bubble-microbatches` microbatches: fivecut dualpipev vs torch `ScheduleDualPipeV`, and fivecut
zb1p vs torch `ScheduleZBVZeroBubble` (torch's zero-bubble schedule for this placement; its
`ScheduleInterleavedZeroBubble` loops stages instead). Both torch schedules place 2*pp stages in
a V (stages r and 2pp-1-r on rank r), as fivecut's dualpipev does, cut by fivecut's layer
balance for 4 stages; each stage is the single-device model from the same seed with the other
layers deleted (as in part 1), the tied embedding shared by stages 0 and 3 on rank 0. Before
timing, every gradient after one step of each torch schedule is compared with fivecut
dualpipev's (the same parameters on each rank) and the largest relative difference reported
(not enforced: with `small`'s tied embedding torch's zero-bubble schedules do not compute the
single device's gradients, and `ScheduleZBVZeroBubble`'s differ on `small` even untied; on
`tiny` all three torch schedules are bitwise equal to fivecut's; `--untied` unties the preset).
zb1p keeps 2 stages, so that row compares step time only. The like-for-like peer of zb1p is the third pair: torch's
`ScheduleInterleavedZeroBubble` with one stage per rank, the same 2-stage cut (fivecut's layer
balance), its gradients compared with fivecut zb1p's. Steps as in part 1 (zero_grad, schedule,
AdamW), interleaved, with each rank's CPU time per step as in part 1. `--torch-zb` keeps some of
the three pairs (e.g. `--torch-zb ScheduleInterleavedZeroBubble`: the like-for-like one alone).

Waits: the executor posts each receive in its window (`schedule.posting`, with the sends of the
same slot, one batch: `PipelineStep.post` is wrapped, and each send is recorded with the batch's
posting time) and waits for it just before the F or B that consumes it; the wait is timed
(`PipelineStep.wait` is wrapped too) and recorded as that receive (RECV_F before an F, RECV_B
before a B), the consuming action's time starting after it, so busy time is compute only.

Layers: part 2 lets fivecut balance the layers over the stages (`pp_layers` unset, the cost
model of `split.stage_layers` weighing the embedding and the head), as a user gets them;
with `--even-layers` every stage gets n / stages layers (n must divide).
"""

from __future__ import annotations

import copy
import dataclasses
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.pipelining import (  # noqa: E402
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)

from benchmarks.common import (  # noqa: E402
    ADAMW,
    TIMING_COLUMNS,
    add_common_arguments,
    barrier,
    benchmark_parser,
    check_gradients,
    compare,
    format_ratio,
    interleave_pair,
    load_average,
    markdown_table,
    max_rel_diff,
    median,
    parse_options,
    ratio_cells,
    run,
    timing_cells,
    token_batch,
)
from fivecut.checks import validate_layout  # noqa: E402
from fivecut.config import TrainConfig  # noqa: E402
from fivecut.layout import ParallelDims  # noqa: E402
from fivecut.mesh import Mesh  # noqa: E402
from fivecut.model.presets import get_preset  # noqa: E402
from fivecut.model.transformer import build_model  # noqa: E402
from fivecut.parallel.data import Piece, decays  # noqa: E402
from fivecut.parallel.parallelize import build_parallel, token_loss_sum  # noqa: E402
from fivecut.parallel.pipeline import executor  # noqa: E402
from fivecut.parallel.pipeline.schedule import Action, build_schedule, partner  # noqa: E402
from fivecut.parallel.pipeline.simulate import Timeline, simulate, text  # noqa: E402
from fivecut.parallel.pipeline.split import stage_layers  # noqa: E402
from fivecut.train.optim import build_optimizer  # noqa: E402

FIVECUT, TORCH = "fivecut 1F1B", "torch Schedule1F1B"
GRAD_RTOL = 1e-5  # gradients must agree to this, relative to each tensor's largest entry
PP = 2

# name -> (pp_virtual, stages): the layouts of part 2. dualpipev always holds 2 stages per rank;
# build_schedule accepts virtual 1 or 2 for it, but checks.validate_layout counts pp_virtual=2
# twice (pp * virtual * 2 = 8 stages) and refuses 4 layers, so it is given pp_virtual=1 here.
LAYOUTS = {"gpipe": (1, 2), "1f1b": (1, 2), "zb1p": (1, 2), "interleaved": (2, 4), "dualpipev": (1, 4)}
# ---------------------------------------------------------------- the two sides


class Fivecut:
    """fivecut's pipeline as the trainer runs it: build_parallel, PipelineStep, reduce, AdamW."""

    def __init__(self, args, mesh: Mesh, opts: dict, name: str, m: int):
        schedule = name
        virtual, n_stages = LAYOUTS[schedule]
        layers = [args.n_layers // n_stages] * n_stages if opts["even_layers"] else None
        dims = dataclasses.replace(
            mesh.dims, pp_schedule=schedule, microbatches=m, pp_virtual=virtual, pp_layers=layers
        )
        validate_layout(dims, args, opts["seq"], opts["batch"], 1, dist.get_world_size())
        view = copy.copy(mesh)  # same groups, another schedule
        view.dims = dims
        self.mesh = view
        chunk = opts["loss_chunk_tokens"]
        train = TrainConfig(seq_len=opts["seq"], global_batch=opts["batch"], loss_chunk_tokens=chunk)
        self.par = build_parallel(args, view, torch.device("cpu"), seed=0, train=train)
        self.schedule = self.par.pipeline.schedule
        self.runner = executor.PipelineStep(
            self.schedule,
            self.par.pipeline.stages,
            view.group("pp"),
            self.par.loss_sum,
            hidden_shape=(opts["batch"] // m, opts["seq"], args.dim),
            positions=torch.arange(opts["seq"]),
            forward_context=lambda microbatch: self.par.saved.forward(),  # the trainer's context, less autocast (fp32)
            weight_grads=self.par.pipeline.weight_grads,
            loss_in_head=self.par.loss_in_head,  # the head computes the loss chunk by chunk, as in training
        )
        self.optimizer = build_optimizer(self.par.pieces, **ADAMW)
        self.m, self.denominator = m, opts["batch"] * opts["seq"]

    def named_parameters(self):
        return [
            (n, p) for s in sorted(self.par.pipeline.stages) for n, p in self.par.pipeline.stages[s].named_parameters()
        ]

    def zero_grad(self) -> None:
        self.mesh.ledger.begin_step(0)  # keep the ledger from growing over hundreds of steps
        self.par.sync.zero_grad()

    def run(self, micro) -> torch.Tensor:
        """The schedule: forwards and backwards of every microbatch (trainer.pipeline_forward_backward)."""
        ledger = self.mesh.ledger
        with self.par.sync.no_sync():
            loss = self.runner.run(micro, self.denominator, ledger)
        self.schedule_end = time.perf_counter()  # what follows (tied sum, reduction) is no schedule's
        with ledger.phase("backward"):
            self.par.pipeline.sum_tied_grads()
            self.par.sync.reduce()
        return loss

    def forward_backward(self, micro) -> float:
        self.zero_grad()
        return float(self.run(micro))

    def step(self, micro) -> None:
        self.zero_grad()
        self.run(micro)
        self.optimizer.step()


class Torch:
    """The same cut of the same model under torch.distributed.pipelining.Schedule1F1B (even layers),
    or under another one-stage-per-rank schedule class with the layers cut as given (`layers`:
    stage -> its range of layer ids)."""

    def __init__(self, args, group, opts: dict, m: int, schedule_class=Schedule1F1B, layers=None):
        rank, n = dist.get_rank(), args.n_layers
        mine = range(rank * n // PP, (rank + 1) * n // PP) if layers is None else layers[rank]
        model = build_model(args, seed=0)
        for name in [k for k in model.layers if int(k) not in mine]:
            del model.layers[name]
        if rank > 0:
            model.tok_embeddings = None
        if rank < PP - 1:
            model.norm, model.output = None, None
        self.model, self.rank = model, rank
        self.stage = PipelineStage(model, rank, PP, torch.device("cpu"), group=group)
        tokens = opts["batch"] * opts["seq"]
        multi = schedule_class is ScheduleInterleavedZeroBubble  # a schedule over a list of local stages
        self.schedule = schedule_class(
            [self.stage] if multi else self.stage,
            m,
            loss_fn=lambda logits, targets: token_loss_sum(logits, targets) / tokens,
            scale_grads=False,
        )
        self.optimizer = build_optimizer([Piece(p, decays(p)) for p in model.parameters()], **ADAMW)

    def named_parameters(self):
        return list(self.model.named_parameters())

    def run(self, inputs, targets) -> float:
        if self.rank == 0:
            self.schedule.step(inputs, return_outputs=False)
            return 0.0
        losses: list[torch.Tensor] = []
        self.schedule.step(target=targets, losses=losses, return_outputs=False)
        return float(sum(loss.detach() for loss in losses))

    def forward_backward(self, inputs, targets) -> float:
        self.model.zero_grad()
        return self.run(inputs, targets)

    def step(self, inputs, targets) -> None:
        self.model.zero_grad()  # set_to_none=True, torch's default
        self.run(inputs, targets)
        self.optimizer.step()


class TorchV:
    """The V placement (stages r and 2pp-1-r on rank r) under a torch V schedule
    (`ScheduleDualPipeV` or `ScheduleZBVZeroBubble`), layers cut as fivecut's dualpipev cuts them."""

    def __init__(self, args, group, opts: dict, m: int, schedule_class):
        rank, n_stages = dist.get_rank(), 2 * PP
        layers = stage_layers(args, n_stages, opts["seq"], None)  # stage -> its range of layer ids
        self.ids = [rank, n_stages - 1 - rank]
        self.models = [self.stage_model(args, s, layers) for s in self.ids]
        if rank == 0 and args.tie_embeddings:  # stages 0 and 2pp-1 on rank 0: one tied Parameter
            self.models[1].output.weight = self.models[0].tok_embeddings.weight
        stages = [
            PipelineStage(mod, s, n_stages, torch.device("cpu"), group=group) for s, mod in zip(self.ids, self.models)
        ]
        tokens = opts["batch"] * opts["seq"]
        self.schedule = schedule_class(
            stages, m, loss_fn=lambda logits, targets: token_loss_sum(logits, targets) / tokens, scale_grads=False
        )
        params = list({id(p): p for mod in self.models for p in mod.parameters()}.values())
        self.optimizer = build_optimizer([Piece(p, decays(p)) for p in params], **ADAMW)
        self.rank = rank

    @staticmethod
    def stage_model(args, s: int, layers: list[range]):
        model = build_model(args, seed=0)
        for name in [k for k in model.layers if int(k) not in layers[s]]:
            del model.layers[name]
        if s > 0:
            model.tok_embeddings = None
        if s < len(layers) - 1:
            model.norm, model.output = None, None
        return model

    def named_parameters(self):
        return [(n, p) for mod in self.models for n, p in mod.named_parameters(remove_duplicate=False)]

    def run(self, inputs, targets) -> float:
        if self.rank != 0:  # the V: rank 0 holds the first and the last stage
            self.schedule.step(return_outputs=False)
            return 0.0
        losses: list[torch.Tensor] = []
        self.schedule.step(inputs, target=targets, losses=losses, return_outputs=False)
        return float(sum(loss.detach() for loss in losses))

    def zero_grad(self) -> None:
        for mod in self.models:
            mod.zero_grad()

    def forward_backward(self, inputs, targets) -> float:
        self.zero_grad()
        return self.run(inputs, targets)

    def step(self, inputs, targets) -> None:
        self.zero_grad()
        self.run(inputs, targets)
        self.optimizer.step()


def fivecut_named(side: Fivecut):
    """Parameters by stage, each stage's own names (a tied Parameter under both of its names)."""
    stages = side.par.pipeline.stages
    return [(n, p) for s in sorted(stages) for n, p in stages[s].named_parameters(remove_duplicate=False)]


# ---------------------------------------------------------------- part 3

ZB_PAIRS = (("dualpipev", ScheduleDualPipeV), ("zb1p", ScheduleZBVZeroBubble), ("zb1p", ScheduleInterleavedZeroBubble))
LOOP = ScheduleInterleavedZeroBubble  # one stage per rank, fivecut zb1p's cut: gradients compared with zb1p's


def chosen_pairs(opts: dict) -> list[tuple[str, type]]:
    """The pairs of `--torch-zb` (torch's class names), in ZB_PAIRS' order."""
    return [(name, c) for name, c in ZB_PAIRS if c.__name__ in opts["torch_zb"]]


def pair_key(name: str, schedule_class) -> str:
    return f"{name} vs {schedule_class.__name__}"


def compare_zero_bubble(args, mesh: Mesh, torch_group, opts: dict) -> dict:
    m = opts["bubble_microbatches"]
    inputs, targets = batch(args, opts)
    micro = list(zip(inputs.chunk(m), targets.chunk(m)))
    pairs = chosen_pairs(opts)
    reference = Fivecut(args, mesh, opts, "dualpipev", m) if any(c is not LOOP for _, c in pairs) else None
    named_ref = {}
    if reference is not None:  # the V pairs' gradients are compared with fivecut dualpipev's
        reference.forward_backward(micro)
        named_ref = dict(fivecut_named(reference))
    out = {}
    for name, schedule_class in pairs:
        ours = reference if name == "dualpipev" else Fivecut(args, mesh, opts, name, m)
        if schedule_class is LOOP:
            layers = stage_layers(args, PP, opts["seq"], None)  # fivecut's 2-stage cut
            theirs = Torch(args, torch_group, opts, m, LOOP, layers)
            ours.forward_backward(micro)
            against = dict(ours.named_parameters())
        else:
            theirs, against = TorchV(args, torch_group, opts, m, schedule_class), named_ref
        theirs.forward_backward(inputs, targets)
        named = dict(theirs.named_parameters())
        if named.keys() != against.keys():
            raise AssertionError(f"{schedule_class.__name__}: parameters {sorted(named)} vs {sorted(against)}")
        ref, got = [against[k].grad for k in named], [p.grad for p in named.values()]
        diff, bitwise = max_rel_diff(ref, got), all(torch.equal(x, y) for x, y in zip(ref, got))
        steps, cpu = with_cpu(
            {
                f"fivecut {name}": lambda o=ours: o.step(micro),
                f"torch {schedule_class.__name__}": lambda t=theirs: t.step(inputs, targets),
            }
        )
        out[pair_key(name, schedule_class)] = dict(
            runs=interleave_pair(steps, opts, prefix=f"{name} "),
            cpu=cpu_medians(cpu),
            grad_diff=diff,
            grad_bitwise=bitwise,
        )
    return out


def zero_bubble_report(opts: dict, results: list[dict]) -> tuple[list[str], dict[str, float]]:
    m, tokens = opts["bubble_microbatches"], opts["batch"] * opts["seq"]
    lines = [
        f"### Zero-bubble schedules vs torch.distributed.pipelining: pp={PP}, {m} microbatches of "
        f"{opts['batch'] // m} x {opts['seq']} tokens",
        "",
    ]
    ratios = {}
    for name, schedule_class in chosen_pairs(opts):
        key = pair_key(name, schedule_class)
        runs = results[0]["zero_bubble"][key]["runs"]
        a, b = list(runs)
        cmp = compare(runs, a, b)
        ratios[key] = cmp.ratio
        per_rank = [r["zero_bubble"][key] for r in results]
        versus = "fivecut zb1p's (the same 2 stages)" if schedule_class is LOOP else "fivecut dualpipev's"
        same = (
            "bitwise equal"
            if all(r["grad_bitwise"] for r in per_rank)
            else f"max rel diff {max(r['grad_diff'] for r in per_rank):.2e}"
        )
        rows = [[n, *timing_cells(runs[n], tokens)] for n in (a, b)]
        rows.append([f"ratio {a} / {b}", *ratio_cells(runs, a, b), ""])
        lines += [
            f"{schedule_class.__name__}'s gradients after one step vs {versus}: {same} (both ranks; "
            f"fivecut's equal the single device's, see tests/test_pipeline.py)",
            "",
            markdown_table(["", *TIMING_COLUMNS, "tokens/s (at median)"], rows),
            "",
            f"per-repeat ratios: {', '.join(format_ratio(x) for x in cmp.ratios)}",
            "",
            cpu_line(per_rank, a, b),
            "",
        ]
    return lines, ratios


def batch(args, opts: dict):
    return token_batch(args.vocab_size, opts["batch"], opts["seq"])  # [b, s] each, the same on both ranks


def with_cpu(steps: dict) -> tuple[dict, dict[str, list[tuple[float, float]]]]:
    """The same steps, each also recording this rank's CPU seconds per step (warm-up included):
    (main thread, whole process with gloo's threads). The load of other processes on a shared
    machine stretches wall time much more than it does these."""
    cpu: dict[str, list[tuple[float, float]]] = {name: [] for name in steps}

    def timed(name, step):
        def run_step():
            thread, process = time.thread_time(), time.process_time()
            step()
            cpu[name].append((time.thread_time() - thread, time.process_time() - process))

        return run_step

    return {name: timed(name, step) for name, step in steps.items()}, cpu


def cpu_medians(cpu: dict[str, list[tuple[float, float]]]) -> dict[str, tuple[float, float]]:
    return {name: (median([c[0] for c in cs]), median([c[1] for c in cs])) for name, cs in cpu.items()}


def cpu_line(per_rank: list[dict], a: str, b: str) -> str:
    """Each rank's median CPU time per step of `a` and `b` (main thread / whole process)."""
    ms = lambda s: f"{s * 1e3:.1f}"  # noqa: E731
    return (
        "CPU time per step, medians (main thread / whole process incl. gloo's threads): "
        + "; ".join(
            f"rank {r}: {a} {ms(c[a][0])} / {ms(c[a][1])}, {b} {ms(c[b][0])} / {ms(c[b][1])}"
            for r, c in enumerate(p["cpu"] for p in per_rank)
        )
        + " ms"
    )


# ---------------------------------------------------------------- part 1


def compare_1f1b(args, mesh: Mesh, torch_group, opts: dict, m: int) -> dict:
    rank = dist.get_rank()
    inputs, targets = batch(args, opts)
    micro = list(zip(inputs.chunk(m), targets.chunk(m)))
    layers = None if opts["even_layers"] else stage_layers(args, PP, opts["seq"], None)  # fivecut's cut, both sides
    ours, theirs = Fivecut(args, mesh, opts, "1f1b", m), Torch(args, torch_group, opts, m, layers=layers)

    # Same work: one forward+backward each, then the loss and every gradient must agree.
    loss_a, loss_b = ours.forward_backward(micro), theirs.forward_backward(inputs, targets)
    named_a, named_b = ours.named_parameters(), theirs.named_parameters()
    if [n for n, _ in named_a] != [n for n, _ in named_b]:
        raise AssertionError(f"rank {rank}: the two stages hold different parameters: {named_a} vs {named_b}")
    params_a, params_b = [p for _, p in named_a], [p for _, p in named_b]
    grad_diff, grad_bitwise = check_gradients(params_a, params_b, GRAD_RTOL)
    if rank == PP - 1 and abs(loss_a - loss_b) > GRAD_RTOL * abs(loss_b):
        raise AssertionError(f"losses differ: fivecut {loss_a} vs torch {loss_b}")
    ours.optimizer.step()
    theirs.optimizer.step()

    steps, cpu = with_cpu({FIVECUT: lambda: ours.step(micro), TORCH: lambda: theirs.step(inputs, targets)})
    runs = interleave_pair(steps, opts, prefix=f"m={m} ")
    return dict(
        m=m,
        runs=runs,
        cpu=cpu_medians(cpu),
        loss=(loss_a, loss_b),
        grad_diff=grad_diff,
        grad_bitwise=grad_bitwise,
        param_diff=max_rel_diff(params_a, params_b),
        params=sum(p.numel() for p in params_a),
    )


# ---------------------------------------------------------------- part 2

_RECORD: list | None = None  # (kind, stage, microbatch, start, end) of each action, while recording
_execute = executor.PipelineStep.execute


_wait = executor.PipelineStep.wait
_WAITED: list[float] = []  # the receive waits inside the running action


def _timed_wait(self, posted, op):
    start = time.perf_counter()
    out = _wait(self, posted, op)
    _WAITED.append(time.perf_counter() - start)
    return out


_post = executor.PipelineStep.post


def _timed_post(self, actions):
    """A slot's batch posted: each of its sends recorded with the batch's posting time."""
    start = time.perf_counter()
    out = _post(self, actions)
    end = time.perf_counter()
    if _RECORD is not None:
        _RECORD.extend((a.kind, a.stage, a.microbatch, start, end) for a in actions if a.kind.startswith("SEND"))
    return out


def _timed_execute(self, action):
    _WAITED.clear()
    start = time.perf_counter()
    out = _execute(self, action)
    end = time.perf_counter()
    if _RECORD is not None:
        waited = sum(_WAITED)
        if _WAITED:  # the wait for the consumed message first, as that receive
            kind = "RECV_F" if action.kind == "F" else "RECV_B"
            _RECORD.append((kind, action.stage, action.microbatch, start, start + waited))
        _RECORD.append((action.kind, action.stage, action.microbatch, start + waited, end))
    return out


def measure_schedules(args, mesh: Mesh, opts: dict) -> dict:
    """Every schedule of `--schedules`, interleaved; per timed step this rank's (start, end, actions)."""
    global _RECORD
    executor.PipelineStep.execute, executor.PipelineStep.wait = _timed_execute, _timed_wait
    executor.PipelineStep.post = _timed_post
    m = opts["bubble_microbatches"]
    inputs, targets = batch(args, opts)
    micro = list(zip(inputs.chunk(m), targets.chunk(m)))
    sides = {name: Fivecut(args, mesh, opts, name, m) for name in opts["schedules"]}
    steps: dict[str, list] = {name: [] for name in sides}
    checks = {}
    if "zb1p" in sides and "1f1b" in sides:  # same stages: the split backward computes 1F1B's gradients
        base, split = sides["1f1b"], sides["zb1p"]
        base.forward_backward(micro), split.forward_backward(micro)
        grads = [p.grad for _, p in split.named_parameters()], [p.grad for _, p in base.named_parameters()]
        checks["zb1p"] = (max_rel_diff(*grads), all(torch.equal(a, b) for a, b in zip(*grads)))
        if checks["zb1p"][0] > GRAD_RTOL:
            raise AssertionError(f"zb1p: gradients differ from 1f1b's by {checks['zb1p'][0]:.3g}")

    def one_step(side: Fivecut, record: bool):
        global _RECORD
        side.zero_grad()
        barrier()
        _RECORD = [] if record else None
        start = time.perf_counter()
        side.run(micro)
        end = time.perf_counter()
        actions, _RECORD = _RECORD, None
        side.optimizer.step()
        return start, end, actions, side.schedule_end

    names, started = list(sides), time.perf_counter()
    for r in range(opts["bubble_repeats"]):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            for _ in range(opts["warmup"]):
                one_step(sides[name], record=False)
            steps[name] += [one_step(sides[name], record=True) for _ in range(opts["bubble_steps"])]
        if dist.get_rank() == 0:
            print(
                f"  schedules repeat {r + 1}/{opts['bubble_repeats']}  [{time.perf_counter() - started:.0f} s]",
                flush=True,
            )
    executor.PipelineStep.execute, executor.PipelineStep.wait = _execute, _wait
    executor.PipelineStep.post = _post
    return {"steps": steps, "checks": checks}


def simulate_measured(
    schedule, table: dict[tuple[str, int], float], send_cost: float = 0.0, latency: float = 0.0
) -> Timeline:
    """`simulate` with one cost per (kind, stage) instead of one per kind; optionally a send that
    occupies its rank for `send_cost` and a message that arrives `latency` after its send starts.
    (The per-kind costs of 1 only set `text`'s default cell; every compute action has a stage cost.)"""
    return simulate(schedule, 1.0, 1.0, 1.0, cost_comm=latency, stage_costs=table, cost_send=send_cost)


def labelled(picture: str, label: str) -> str:
    return "\n".join(f"{label:<10}{line}" for line in picture.splitlines())


def analyse(name: str, per_rank: list[list], m: int) -> dict:
    """Combine both ranks' records of one schedule: measured idle per rank vs the simulator."""
    virtual, _ = LAYOUTS[name]
    schedule = build_schedule(name, PP, m, virtual)
    compute = {"F": [], "B": [], "W": []}
    by_stage: dict[tuple[str, int], list[float]] = {}
    idle, recv, send, outside = ([[] for _ in range(PP)] for _ in range(4))
    makespans, steps, sends, latencies, tails = [], [], [], [], []
    for i in range(len(per_rank[0])):
        step = [per_rank[r][i] for r in range(PP)]
        start, end = min(s[0] for s in step), max(s[1] for s in step)
        makespan = end - start
        makespans.append(makespan)
        steps.append((makespan, start, step))
        when = {}  # action -> (start, end), both ranks (one clock: CLOCK_MONOTONIC)
        tails.append(end - max(s[3] for s in step))  # the last schedule end -> the step's end
        for r, (own_start, own_end, actions, _) in enumerate(step):
            busy = sum(t1 - t0 for kind, _, _, t0, t1 in actions if kind in compute)
            idle[r].append(1 - busy / makespan)
            recv[r].append(sum(t1 - t0 for kind, _, _, t0, t1 in actions if kind.startswith("RECV")) / makespan)
            send[r].append(sum(t1 - t0 for kind, _, _, t0, t1 in actions if kind.startswith("SEND")) / makespan)
            outside[r].append((makespan - (own_end - own_start)) / makespan)
            for kind, stage, mb, t0, t1 in actions:
                when[Action(kind, stage, mb)] = (t0, t1)
                if kind in compute:
                    compute[kind].append(t1 - t0)
                    by_stage.setdefault((kind, stage), []).append(t1 - t0)
                elif kind.startswith("SEND"):
                    sends.append(t1 - t0)
        for a, (t0, t1) in when.items():  # a message's latency: its send posted -> a waiting receive returns
            if a.kind.startswith("RECV") and t0 <= when[partner(a)][0]:
                latencies.append(t1 - when[partner(a)][0])
    cost = {k: statistics.fmean(v) for k, v in compute.items() if v}
    cost_w = cost.get("W") if schedule.split_backward else None
    predicted = simulate(schedule, cost["F"], cost["B"], cost_w)
    table = {k: statistics.fmean(v) for k, v in by_stage.items()}
    per_stage = simulate_measured(schedule, table)
    send_cost, latency = statistics.fmean(sends), (median(latencies) if latencies else 0.0)
    with_comm = simulate_measured(schedule, table, send_cost, latency)
    tail = statistics.fmean(tails)
    busy = sum(with_comm.busy(r) for r in range(PP))
    makespan = with_comm.makespan + tail  # the schedule, then what every step does after it
    with_tail = dataclasses.replace(with_comm, makespan=makespan, bubble=1 - busy / (PP * makespan))
    unit = simulate(schedule)

    # the step with the median makespan, as a timeline (the simulator's picture of it)
    _, start, step = sorted(steps, key=lambda s: s[0])[len(steps) // 2]
    rows = [
        [(Action(kind, stage, mb), t0 - start, t1 - start) for kind, stage, mb, t0, t1 in actions]
        for _, _, actions, _ in step
    ]
    measured = Timeline(schedule, rows, dict(predicted.costs), max(s[1] for s in step) - start, 0.0)
    cell = min(c for k, c in predicted.costs.items() if k in compute and c > 0)
    sims = {"mean": predicted, "stage": per_stage, "comm": with_comm, "tail": with_tail, "unit": unit}
    return dict(
        name=name,
        stages=schedule.n_stages,
        cost=cost,
        stage_cost=table,
        send_cost=send_cost,
        latency=latency,
        latencies=len(latencies),
        tail=tail,
        makespan=median(makespans),
        makespans=makespans,
        makespan_mean=statistics.fmean(makespans),
        idle=[statistics.fmean(x) for x in idle],  # means over steps, so that the parts add up
        recv=[statistics.fmean(x) for x in recv],
        send=[statistics.fmean(x) for x in send],
        outside=[statistics.fmean(x) for x in outside],
        sim_idle={k: [t.idle_fraction(r) for r in range(PP)] for k, t in sims.items()},
        sim_makespan={k: t.makespan for k, t in sims.items()},
        sim_bubble={k: t.bubble for k, t in sims.items()},
        picture="\n".join(
            [
                labelled(text(measured, cell), "measured"),
                labelled(text(predicted, cell), "mean"),
                labelled(text(with_comm, cell), "+comm"),
            ]
        ),
        cell=cell,
    )


# ---------------------------------------------------------------- the ranks


def model_args(opts: dict):
    """The preset, with its embedding and head untied under `--untied` (torch's zero-bubble
    schedules neither sum a tied weight's gradient over the pipeline ends nor, in a V, accumulate
    it once for the two stages of one rank that share it: their gradients then differ)."""
    args = get_preset(opts["model"])
    return dataclasses.replace(args, tie_embeddings=False) if opts["untied"] else args


def rank_main(opts: dict) -> dict:
    args = model_args(opts)
    mesh = Mesh(ParallelDims(pp=PP, microbatches=PP), "cpu")
    torch_group = dist.new_group(list(range(PP)))  # torch's stages talk over their own group
    out: dict = {"compare": [], "schedules": {}, "zero_bubble": {}}
    if opts["compare"]:
        out["compare"] = [compare_1f1b(args, mesh, torch_group, opts, m) for m in opts["microbatches"]]
    if opts["vs_torch_zb"]:
        out["zero_bubble"] = compare_zero_bubble(args, mesh, torch_group, opts)
    if opts["bubbles"]:
        out["schedules"] = measure_schedules(args, mesh, opts)
    return out


# ---------------------------------------------------------------- the report


def percent(x: float) -> str:
    return f"{100 * x:.1f}%"


def compare_report(opts: dict, results: list[dict], i: int) -> tuple[list[str], float]:
    r0 = results[0]["compare"][i]
    runs, m = r0["runs"], r0["m"]
    cmp = compare(runs, FIVECUT, TORCH)
    tokens = opts["batch"] * opts["seq"]
    rows = [[name, *timing_cells(runs[name], tokens)] for name in (FIVECUT, TORCH)]
    rows.append(["ratio fivecut / torch", *ratio_cells(runs, FIVECUT, TORCH), ""])
    header = ["", *TIMING_COLUMNS, "tokens/s (at median)"]
    per_rank = [r["compare"][i] for r in results]
    bitwise = all(r["grad_bitwise"] for r in per_rank)
    worst_grad = max(r["grad_diff"] for r in per_rank)
    last = per_rank[-1]["loss"]
    lines = [
        f"### {m} microbatches of {opts['batch'] // m} x {opts['seq']} tokens",
        "",
        f"same work: loss {last[0]:.6f} vs {last[1]:.6f}; gradients after one step "
        f"{'bitwise equal' if bitwise else f'max rel diff {worst_grad:.2e}'} on both ranks; parameters after all "
        f"steps max rel diff {max(r['param_diff'] for r in per_rank):.2e}; "
        f"parameters per rank {', '.join(str(r['params']) for r in per_rank)}",
        "",
        markdown_table(header, rows),
        "",
        f"per-repeat ratios: {', '.join(format_ratio(x) for x in cmp.ratios)}",
        "",
        cpu_line(per_rank, FIVECUT, TORCH),
        "",
    ]
    return lines, cmp.ratio


def bubble_report(opts: dict, results: list[dict]) -> list[str]:
    m = opts["bubble_microbatches"]
    per_rank = [r["schedules"]["steps"] for r in results]
    checks = results[0]["schedules"]["checks"]
    analyses = [analyse(name, [p[name] for p in per_rank], m) for name in opts["schedules"]]
    ms = lambda s: f"{s * 1e3:.1f}"  # noqa: E731
    costs = []
    base = next((a for a in analyses if a["name"] == "1f1b"), None)
    for a in analyses:
        c, sm = a["cost"], a["sim_makespan"]
        paired = [x / y for x, y in zip(a["makespans"], base["makespans"])] if base else []
        costs.append(
            [
                a["name"],
                a["stages"],
                ms(c["F"]),
                ms(c["B"]),
                ms(c["W"]) if "W" in c else "-",
                f"{c['B'] / c['F']:.2f}" + (f" / {c['W'] / c['F']:.2f}" if "W" in c else ""),
                f"{ms(a['send_cost'])} / {ms(a['latency'])}",
                f"{ms(a['makespan_mean'])} / {ms(a['makespan'])}",
                f"{median(paired):.3f}" if paired else "-",
                ms(sm["mean"]),
                ms(sm["stage"]),
                ms(sm["comm"]),
                ms(sm["tail"]),
            ]
        )
    cost_table = markdown_table(
        [
            "schedule",
            "stages",
            "F",
            "B",
            "W",
            "B/F (/ W/F)",
            "send / latency",
            "step measured (mean / median)",
            "vs 1f1b (median of ratios)",
            "simulated: mean costs",
            "per-stage costs",
            "per-stage + comm",
            "+ after the schedule",
        ],
        costs,
    )
    ranks = []
    for a in analyses:
        for r in range(PP):
            si = a["sim_idle"]
            rest = a["idle"][r] - a["recv"][r] - a["send"][r] - a["outside"][r]
            ranks.append(
                [
                    a["name"] if r == 0 else "",
                    r,
                    percent(a["idle"][r]),
                    f"{percent(a['recv'][r])} / {percent(a['send'][r])} / {percent(a['outside'][r])} / {percent(rest)}",
                    percent(si["mean"][r]),
                    percent(si["stage"][r]),
                    percent(si["comm"][r]),
                    percent(si["tail"][r]),
                    percent(si["unit"][r]),
                ]
            )
        ranks.append(
            [
                "",
                "bubble",
                f"**{percent(sum(a['idle']) / PP)}**",
                "",
                *(f"**{percent(a['sim_bubble'][k])}**" for k in ("mean", "stage", "comm", "tail", "unit")),
            ]
        )
    rank_table = markdown_table(
        [
            "schedule",
            "rank",
            "idle measured",
            "of which RECV / SEND / before-after own run / rest",
            "simulated: mean costs",
            "per-stage costs",
            "per-stage + comm",
            "+ after the schedule",
            "unit costs",
        ],
        ranks,
    )
    stage_lines = []
    for a in analyses:
        t = a["stage_cost"]
        stages = sorted({s for _, s in t})
        stage_lines.append(
            f"- {a['name']}: "
            + "; ".join(
                f"stage {s}: " + ", ".join(f"{k} {t[(k, s)] * 1e3:.1f}" for k in "FBW" if (k, s) in t) for s in stages
            )
            + f" ms; latency from {a['latencies']} waiting receives"
        )
    pictures = []
    for a in analyses:
        pictures += [f"{a['name']}, one cell = {a['cell'] * 1e3:.1f} ms:", "```", a["picture"], "```", ""]
    return [
        f"### Measured idle vs the simulator: pp={PP}, {m} microbatches of {opts['batch'] // m} x {opts['seq']} "
        f"tokens, "
        f"{opts['bubble_repeats']} repeats x {opts['bubble_steps']} steps (+{opts['warmup']} warm-up) per schedule",
        "",
        "Mean action times and steps (ms):",
        "",
        cost_table,
        "",
        "Idle fraction per rank, measured (means over steps) and simulated:",
        "",
        rank_table,
        "",
        "Mean action times per stage:",
        "",
        *stage_lines,
        "",
        *(
            [
                "Gradients after one step vs 1f1b's (the same stages): "
                + "; ".join(
                    f"{n} {'bitwise equal' if eq else f'max rel diff {d:.2e}'}" for n, (d, eq) in checks.items()
                ),
                "",
            ]
            if checks
            else []
        ),
        "Timelines of the median step: measured, simulated with mean costs, simulated with per-stage costs + comm:",
        "",
        *pictures,
    ]


def report(opts: dict, results: list[dict], elapsed: float, before: str) -> str:
    args = model_args(opts)
    lines = [
        f"model {opts['model']}{' (untied)' if opts['untied'] else ''} ({args.n_layers} layers), pp={PP} gloo ranks "
        f"x 1 thread, fp32, batch {opts['batch']} x "
        f"{opts['seq']} tokens per step, fivecut's loss "
        + (f"in chunks of {opts['loss_chunk_tokens']} tokens" if opts["loss_chunk_tokens"] else "over the full logits")
        + (
            f", {opts['repeats']} repeats x {opts['steps']} steps (+{opts['warmup']} warm-up) per candidate"
            if opts["compare"]
            else ""
        ),
        f"machine: {before} before, {load_average()} after",
        "",
    ]
    ratios = []
    for i in range(len(opts["microbatches"]) if opts["compare"] else 0):
        more, ratio = compare_report(opts, results, i)
        lines += more
        ratios.append((opts["microbatches"][i], ratio))
    zb_ratios = {}
    if opts["vs_torch_zb"]:
        more, zb_ratios = zero_bubble_report(opts, results)
        lines += more
    if opts["bubbles"]:
        lines += bubble_report(opts, results)
    lines.append(f"wall time {elapsed:.0f} s")
    for key, ratio in zb_ratios.items():
        lines.append(f"ratio_{key.replace(' vs ', '_vs_')}={ratio:.3f}")
    for m, ratio in ratios[1:]:
        lines.append(f"ratio_1f1b_m{m}={ratio:.3f}")
    if ratios:
        lines.append(f"ratio_1f1b={ratios[0][1]:.3f}")
    return "\n".join(lines)


def parse(argv=None) -> dict:
    p = benchmark_parser(__doc__, model_help="fivecut preset; n_layers must divide by 4")
    p.add_argument("--microbatches", default="4,8", help="comma-separated microbatch counts for the 1F1B comparison")
    add_common_arguments(p, steps=10, repeats=7, batch_help="sequences per step (the same on both ranks)")
    p.add_argument("--schedules", default="gpipe,1f1b,zb1p,interleaved,dualpipev")
    p.add_argument("--bubble-microbatches", type=int, default=4)
    p.add_argument("--bubble-steps", type=int, default=10, help="timed steps per schedule per repeat (part 2)")
    p.add_argument("--bubble-repeats", type=int, default=3)
    p.add_argument(
        "--even-layers", action="store_true", help="part 2: n / stages layers per stage instead of fivecut's balance"
    )
    p.add_argument("--no-compare", dest="compare", action="store_false", help="skip part 1 (fivecut vs torch)")
    p.add_argument(
        "--vs-torch-zb", action="store_true", help="part 3: dualpipev / zb1p vs torch ScheduleDualPipeV / ZBVZeroBubble"
    )
    p.add_argument(
        "--torch-zb",
        default=",".join(c.__name__ for _, c in ZB_PAIRS),
        help="part 3: the torch schedules to compare with (comma-separated; fivecut's peer of each is fixed)",
    )
    p.add_argument("--no-bubbles", dest="bubbles", action="store_false", help="skip part 2 (measured vs simulated)")
    p.add_argument("--untied", action="store_true", help="untie the preset's embedding and head (see model_args)")
    p.add_argument(
        "--loss-chunk-tokens",
        type=int,
        default=TrainConfig.loss_chunk_tokens,
        help="fivecut's train.loss_chunk_tokens: the head and cross-entropy in chunks (fivecut.parallel.loss, the "
        "default, as a run trains); 0: the full logits and torch's cross-entropy, as torch's side computes them",
    )
    opts = parse_options(p, argv)
    opts["microbatches"] = [int(x) for x in opts["microbatches"].split(",") if x]
    opts["schedules"] = [x for x in opts["schedules"].split(",") if x]
    opts["torch_zb"] = [x for x in opts["torch_zb"].split(",") if x]
    known = [c.__name__ for _, c in ZB_PAIRS]
    if not opts["torch_zb"] or any(x not in known for x in opts["torch_zb"]):
        p.error(f"--torch-zb {','.join(opts['torch_zb'])}: choose from {', '.join(known)}")
    unknown = [s for s in opts["schedules"] if s not in LAYOUTS]
    if unknown:
        p.error(f"unknown schedules {unknown}; choose from {', '.join(LAYOUTS)}")
    if opts["even_layers"] and get_preset(opts["model"]).n_layers % 4:
        p.error(f"model {opts['model']} has {get_preset(opts['model']).n_layers} layers; 4 stages need a multiple of 4")
    if opts["compare"] and not opts["untied"] and get_preset(opts["model"]).tie_embeddings:
        # torch's stages each hold a copy of a tied weight and never sum their gradients; fivecut does
        p.error(f"part 1 compares each stage's gradients; --model {opts['model']} ties its embedding and head, "
                "whose copies torch's stages never sum: add --untied (or --no-compare)")  # fmt: skip
    for m in opts["microbatches"] + [opts["bubble_microbatches"]]:
        if opts["batch"] % m:
            p.error(f"--batch {opts['batch']} does not divide into {m} microbatches")
    return opts


def main(argv=None) -> None:
    opts = parse(argv)
    run("benchmarks/pipeline.py", rank_main, report, opts, world=PP)


if __name__ == "__main__":
    main()
