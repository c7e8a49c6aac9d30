"""fivecut ZeRO-0/1/2/3 against PyTorch's DDP, ZeroRedundancyOptimizer and FSDP2.

    python benchmarks/zero.py [--model tiny|tiny-gpt2|small] [--world 2] [--steps 10] [--repeats 5]
                              [--batch 8] [--seq 128] [--bucket-mb 25] [--only zero3,zero0,zero12] [--profile]
                              [--dtype fp32|bf16]

Candidates, each built in every rank from the same seed (so with the same weights):

    fivecut ZeRO-3   parallelize(parallel.zero=3, reshard_after_forward=True)   vs  torch FSDP2
    fivecut ZeRO-0   parallelize(parallel.zero=0): fivecut's DDP                vs  torch DDP
    fivecut ZeRO-1   parallelize(parallel.zero=1)                               vs  torch DDP + ZeroRedundancyOptimizer
    fivecut ZeRO-2   parallelize(parallel.zero=2)         (no torch equivalent; shown against the ZeRO-1-like one)

torch FSDP2 is `fully_shard` applied to every transformer block (`model.layers[i]`) and then
to the root model (embedding, final norm, head: the same units as fivecut's ZeRO-3), over a
1-d `init_device_mesh("cpu", (world,))`, fp32, no mixed-precision policy, reshard after forward
(the default). torch DDP uses gradients as bucket views and the same bucket size;
ZeroRedundancyOptimizer wraps torch.optim.AdamW (each rank updates the whole parameters it
owns, then broadcasts them; DDP still all-reduces every gradient).

Same work. fivecut's loss is the sum of token losses divided by the tokens of the *global*
batch, and gradients are summed over ranks. FSDP2 averages gradients by default; here every
FSDP2 module gets `set_gradient_divide_factor(1.0)` and `set_force_sum_reduction_for_comms(True)`
(a divide factor other than the world size otherwise asks for ReduceOp.PREMUL_SUM, which gloo
lacks), so its reduce-scatter is a plain SUM, as fivecut's is, and the loss is not scaled.
DDP and ZeroRedundancyOptimizer average, so their loss is multiplied by the world size (as in
benchmarks/ddp.py). Every candidate uses AdamW (lr 3e-4, betas 0.9/0.95, eps 1e-8) with weight
decay 0.1 on matrices and none on norm weights (fivecut's `build_optimizer` split); fivecut's
optimizer steps flat shards, FSDP2's DTensor shards, the others whole tensors. Before timing,
every candidate trains three steps on the same per-rank batches and the global losses (the
loss before any update, after one step and after two steps) must agree with the torch
counterpart's to 1e-5 relative.

A timed step: zero_grad, forward, loss, backward, optimizer step (and fivecut's
`sync.after_step()`: the all-gather of ZeRO-1/2). Timing is interleaved (benchmarks/common.py),
and candidates that are compared run back to back: each repeat runs the groups
[ZeRO-3, FSDP2], [ZeRO-0, DDP], [ZeRO-1, ZeroRedundancyOptimizer, ZeRO-2] in a rotating order,
rotating the members of each group too (`--only` keeps some of the groups). The ratio of a
candidate is the median over repeats of median(candidate) / median(counterpart).

Memory, per rank (CPU, so no allocator statistics):
  - model state: bytes of parameters, gradients and optimizer state held between steps
    (`fivecut.train.memory.model_state_bytes`, every storage once; for FSDP2 the local shards);
  - step peak: the model state held after zero_grad plus the peak of tensor bytes allocated
    during forward, backward and optimizer step (the profiler's memory events), i.e. the most
    tensor memory the step had live: activations, gathered units, full gradients, buffers;
  - RSS peak: the process's peak resident set during one step above its resident set before
    it (VmHWM reset through /proc/self/clear_refs after malloc_trim). ru_maxrss cannot separate
    candidates: it only grows, and all candidates live in the same process.

The last two lines are `ratio_zero3_vs_fsdp2=<x>` and `ratio_zero0_vs_ddp=<x>` (each only when
its pair runs).

With `--dtype bf16` (the zero3 group only) both sides compute in bf16 from fp32 master shards:
fivecut's ZeRO-3 as train.dtype = "bf16" builds it (parallelize(param_dtype=bf16): bf16 gathers,
reduce-scatter in fp32), FSDP2 with `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`;
both run forward and loss under bf16 autocast, as fivecut's trainer does, so the ops are the same.
bf16 losses are not bit-exact across implementations (each rounds its gradients to bf16 before its
own sums), so they must agree to BF16_LOSS_RTOL (2^-7, two bf16 roundings) instead of 1e-5. The
report adds fivecut's all-gather bytes per element (2 under bf16, 4 under fp32) from its ledger.

The default model is `tiny` (0.85M parameters): the defaults take about 75 s on the 2-core
machine when it is quiet (7 candidates x 5 repeats x 12 steps of about 0.11 s), 2-4 min when
it is shared. A step of `tiny-gpt2` takes about 0.85 s and one of `small` 3.5-4 s there
(benchmarks/ddp.py), so the defaults would take about 6 and 26 minutes; for `small`, use
`--steps 3 --repeats 3` (about 7 min), or `--batch 1 --seq 32`, where parameters rather than
activations dominate memory (`--only zero3 --steps 4 --repeats 4`: about 100 s).
"""

from __future__ import annotations

import contextlib
import resource
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard  # noqa: E402
from torch.distributed.optim import ZeroRedundancyOptimizer  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

from benchmarks.common import (  # noqa: E402
    ADAMW,
    TIMING_COLUMNS,
    add_common_arguments,
    benchmark_parser,
    compare,
    format_bytes,
    format_ratio,
    load_average,
    markdown_table,
    median,
    parse_options,
    peak_rss_delta,
    profile_tensor_memory,
    ratio_cells,
    run,
    time_steps,
    timing_cells,
    token_batch,
)
from fivecut.layout import ParallelDims  # noqa: E402
from fivecut.mesh import Mesh  # noqa: E402
from fivecut.model.presets import get_preset  # noqa: E402
from fivecut.model.transformer import build_model  # noqa: E402
from fivecut.parallel.data import decays  # noqa: E402
from fivecut.parallel.parallelize import ParallelizeOptions, parallelize, token_loss_sum  # noqa: E402
from fivecut.train.memory import model_state_bytes  # noqa: E402
from fivecut.train.optim import build_optimizer  # noqa: E402

Z3, FSDP2 = "fivecut ZeRO-3", "torch FSDP2"
Z0, DDP = "fivecut ZeRO-0 (DDP)", "torch DDP"
Z1, ZRO = "fivecut ZeRO-1", "torch DDP + ZeroRedundancyOptimizer"
Z2 = "fivecut ZeRO-2"
SHORT = {
    Z3: "ZeRO-3",
    FSDP2: "FSDP2",
    Z0: "ZeRO-0",
    DDP: "DDP",
    Z1: "ZeRO-1",
    ZRO: "ZeroRedundancyOptimizer",
    Z2: "ZeRO-2",
}
GROUPS = {"zero3": [Z3, FSDP2], "zero0": [Z0, DDP], "zero12": [Z1, ZRO, Z2]}  # each timed back to back
COUNTERPART = {Z3: FSDP2, Z0: DDP, Z1: ZRO, Z2: ZRO}
ORDER = [Z3, FSDP2, Z0, DDP, Z1, ZRO, Z2]  # table order
# expected model-state bytes per rank (fp32 parameters and gradients, two fp32 Adam moments)
FORMULA = {Z3: "16Ψ/n", FSDP2: "16Ψ/n", Z0: "16Ψ", DDP: "16Ψ", Z1: "8Ψ + 8Ψ/n", ZRO: "8Ψ + 8Ψ/n", Z2: "4Ψ + 12Ψ/n"}
LOSS_RTOL = 1e-5
BF16_LOSS_RTOL = 2.0**-7  # --dtype bf16: see the module doc
DTYPES = {"fp32": None, "bf16": torch.bfloat16}
CHECK_STEPS = 3  # losses before the first update, after one step, after two steps


@dataclass
class Candidate:
    name: str
    module: nn.Module  # what forward is called on
    optimizer: torch.optim.Optimizer
    zero_grad: Callable[[], None]
    after_step: Callable[[], None]
    loss_scale: float  # 1 when gradients are summed over ranks, world size when averaged
    state_bytes: Callable[[], dict[str, int]]
    ledger: object | None = None  # fivecut's communication ledger
    autocast: Callable[[], object] = contextlib.nullcontext  # --dtype bf16: bf16 autocast

    def forward_backward(self, inputs, targets, global_tokens) -> torch.Tensor:
        with self.autocast():
            loss = token_loss_sum(self.module(inputs), targets) / global_tokens  # this rank's share
        (loss * self.loss_scale).backward()
        return loss.detach()

    def update(self) -> None:
        self.optimizer.step()
        self.after_step()

    def step(self, inputs, targets, global_tokens) -> torch.Tensor:
        self.zero_grad()
        loss = self.forward_backward(inputs, targets, global_tokens)
        self.update()
        return loss


def adamw_groups(params: list[nn.Parameter]) -> list[dict]:
    """fivecut's build_optimizer split: weight decay on matrices only."""
    decay = [p for p in params if decays(p)]
    no_decay = [p for p in params if not decays(p)]
    groups = [{"params": decay, "weight_decay": ADAMW["weight_decay"]}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def adamw(params: list[nn.Parameter]) -> torch.optim.AdamW:
    return torch.optim.AdamW(adamw_groups(params), lr=ADAMW["lr"], betas=ADAMW["betas"], eps=ADAMW["eps"])


def autocast_to(dtype) -> Callable[[], object]:
    return contextlib.nullcontext if dtype is None else lambda: torch.autocast("cpu", dtype=dtype)


def build_fivecut(name: str, stage: int, args, world: int, bucket_mb: float, dtype=None) -> Candidate:
    mesh = Mesh(ParallelDims(dp=world, zero=stage, reshard_after_forward=True), "cpu")
    par = parallelize(build_model(args, seed=0), mesh, ParallelizeOptions(bucket_mb=bucket_mb, param_dtype=dtype))
    optimizer = build_optimizer(par.pieces, **ADAMW)

    def zero_grad():
        mesh.ledger.begin_step(0)  # keep the ledger to one step's records
        par.sync.zero_grad()

    state = lambda: model_state_bytes(*par.state_tensors(), optimizer)  # noqa: E731
    cast = autocast_to(dtype)
    return Candidate(name, par.module, optimizer, zero_grad, par.sync.after_step, 1.0, state, mesh.ledger, cast)


def build_fsdp2(args, world: int, dtype=None) -> Candidate:
    mesh = init_device_mesh("cpu", (world,))
    model = build_model(args, seed=0)
    policy = MixedPrecisionPolicy() if dtype is None else MixedPrecisionPolicy(dtype, torch.float32)  # param, reduce
    for block in model.layers.values():
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)  # the root unit: embedding, final norm, head
    for module in model.modules():
        if isinstance(module, FSDPModule):  # sum gradients over ranks, as fivecut does
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    optimizer = adamw(list(model.parameters()))
    state = lambda: fsdp2_state_bytes(model, optimizer)  # noqa: E731
    return Candidate(FSDP2, model, optimizer, optimizer.zero_grad, lambda: None, 1.0, state, None, autocast_to(dtype))


def local(t: torch.Tensor | None) -> torch.Tensor | None:
    return t.to_local() if isinstance(t, DTensor) else t


def fsdp2_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """The local shards of FSDP2's parameters, gradients and optimizer states."""
    params = [local(p) for p in model.parameters()]
    grads = [local(p.grad) for p in model.parameters()]
    states = SimpleNamespace(state={k: {n: local(v) for n, v in s.items()} for k, s in optimizer.state.items()})
    return model_state_bytes(params, grads, states)


def build_ddp(args, world: int, bucket_mb: float, zero_redundancy: bool) -> Candidate:
    model = build_model(args, seed=0)
    ddp = DistributedDataParallel(
        model, bucket_cap_mb=bucket_mb, gradient_as_bucket_view=True, forward_sync_buffers=False
    )
    params = list(model.parameters())
    if zero_redundancy:
        optimizer = ZeroRedundancyOptimizer(
            adamw_groups(params),
            optimizer_class=torch.optim.AdamW,
            lr=ADAMW["lr"],
            betas=ADAMW["betas"],
            eps=ADAMW["eps"],
        )
        held = optimizer.optim  # the optimizer over the parameters this rank owns
    else:
        optimizer = held = adamw(params)
    state = lambda: model_state_bytes(params, [p.grad for p in params], held)  # noqa: E731
    zero = lambda: model.zero_grad(set_to_none=False)  # noqa: E731  (as fivecut: zero the bucket views)
    return Candidate(ZRO if zero_redundancy else DDP, ddp, optimizer, zero, lambda: None, float(world), state)


def build_all(args, world: int, bucket_mb: float, names: list[str], dtype=None) -> dict[str, Candidate]:
    builders = {
        Z3: lambda: build_fivecut(Z3, 3, args, world, bucket_mb, dtype),
        FSDP2: lambda: build_fsdp2(args, world, dtype),
        Z0: lambda: build_fivecut(Z0, 0, args, world, bucket_mb),
        DDP: lambda: build_ddp(args, world, bucket_mb, zero_redundancy=False),
        Z1: lambda: build_fivecut(Z1, 1, args, world, bucket_mb),
        ZRO: lambda: build_ddp(args, world, bucket_mb, zero_redundancy=True),
        Z2: lambda: build_fivecut(Z2, 2, args, world, bucket_mb),
    }
    return {name: builders[name]() for name in ORDER if name in names}


def pairs(names) -> dict[str, str]:
    """{fivecut candidate: its torch counterpart} among `names`."""
    return {a: b for a, b in COUNTERPART.items() if a in names and b in names}


def global_loss(loss: torch.Tensor) -> float:
    total = loss.detach().clone().double()
    dist.all_reduce(total)  # each rank's share of the global mean
    return float(total)


def check_same_work(candidates: dict[str, Candidate], batch, rtol: float = LOSS_RTOL) -> dict[str, list[float]]:
    """Train every candidate CHECK_STEPS steps on the same batches; its global losses must match its
    counterpart's (and the torch DDP reference's) to `rtol`."""
    losses = {name: [global_loss(c.step(*batch)) for _ in range(CHECK_STEPS)] for name, c in candidates.items()}
    reference = [(n, DDP) for n in candidates if n != DDP and DDP in candidates]
    for name, against in [*pairs(candidates).items(), *reference]:
        for step, (x, y) in enumerate(zip(losses[name], losses[against])):
            if abs(x - y) > rtol * abs(y):
                raise AssertionError(f"{name} vs {against}: loss {step} is {x!r} vs {y!r} (rel diff > {rtol})")
    return losses


def time_interleaved(candidates, batch, opts, rank) -> dict[str, list[list[float]]]:
    runs: dict[str, list[list[float]]] = {name: [] for name in candidates}
    started = time.perf_counter()
    groups = [GROUPS[key] for key in opts["only"]]
    for r in range(opts["repeats"]):
        shift = r % len(groups)
        order = []
        for group in groups[shift:] + groups[:shift]:
            k = r % len(group)
            order += group[k:] + group[:k]
        for name in order:
            c = candidates[name]
            runs[name].append(time_steps(lambda c=c: c.step(*batch), opts["steps"], opts["warmup"]))
        if rank == 0:
            now = ", ".join(
                f"{SHORT[a]}/{SHORT[b]} {format_ratio(median(runs[a][-1]) / median(runs[b][-1]))}"
                for a, b in pairs(candidates).items()
            )
            print(f"  repeat {r + 1}/{opts['repeats']}: {now}  [{time.perf_counter() - started:.0f} s]", flush=True)
    return runs


def measure_memory(candidates, batch, opts) -> dict[str, dict]:
    """Per candidate: model state held between steps, the step's peak tensor bytes, peak RSS."""
    out = {}
    for name, c in candidates.items():
        c.step(*batch)
        state = c.state_bytes()  # between steps: after the optimizer step (and after_step)
        rss = max(peak_rss_delta(lambda c=c: c.step(*batch)) or 0 for _ in range(2))
        c.zero_grad()
        held = c.state_bytes()["total"]  # FSDP2 has dropped its gradients here (set_to_none)

        def rest(c=c):
            c.forward_backward(*batch)
            c.update()

        prof = profile_tensor_memory(rest)
        out[name] = dict(
            state=state,
            step_peak=held + prof["peak_bytes"],
            rss=rss,
            collectives=prof["collectives"],
            wire=c.ledger.wire_bytes() if c.ledger is not None else None,
            gathers=gather_rows(c.ledger) if c.ledger is not None else None,
        )
        if opts["profile"] and dist.get_rank() == 0 and name in (Z3, FSDP2):
            print(f"--- {name}: one step, ops by self CPU time (rank 0)")
            print(prof["profiler"].key_averages().table(sort_by="self_cpu_time_total", row_limit=opts["profile_rows"]))
    return out


def gather_rows(ledger) -> tuple[int, int, float]:
    """(elements, bytes, wire bytes) of one step's all-gathers in fivecut's ledger."""
    rows = [r for r in ledger.rows() if r.op == "all_gather"]
    return sum(r.elements for r in rows), sum(r.bytes for r in rows), sum(r.wire_bytes for r in rows)


def rank_main(opts: dict) -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    args = get_preset(opts["model"])
    names = [n for key in opts["only"] for n in GROUPS[key]]
    candidates = build_all(args, world, opts["bucket_mb"], names, DTYPES[opts["dtype"]])
    inputs, targets = token_batch(args.vocab_size, opts["batch"], opts["seq"], seed=1234 + rank)  # [b, s] each
    batch = (inputs, targets, world * opts["batch"] * opts["seq"])
    maxrss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    losses = check_same_work(candidates, batch, LOSS_RTOL if opts["dtype"] == "fp32" else BF16_LOSS_RTOL)
    runs = time_interleaved(candidates, batch, opts, rank)
    memory = measure_memory(candidates, batch, opts)
    return dict(
        runs=runs,
        losses=losses,
        memory=memory,
        params=sum(p.numel() for p in build_model(args, device="meta").parameters()),
        maxrss=(maxrss_before, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024),
    )


def collective_summary(counts: dict[str, int]) -> str:
    short = {
        "c10d::allgather_": "AG",
        "c10d::_allgather_base_": "AG",
        "c10d::allgather_into_tensor_coalesced_": "AG",
        "c10d::reduce_scatter_": "RS",
        "c10d::_reduce_scatter_base_": "RS",
        "c10d::reduce_scatter_tensor_coalesced_": "RS",
        "c10d::allreduce_": "AR",
        "c10d::allreduce_coalesced_": "AR",
        "c10d::broadcast_": "BC",
    }
    merged: dict[str, int] = {}
    for op, n in counts.items():
        key = short.get(op, op.removeprefix("c10d::"))
        merged[key] = merged.get(key, 0) + n
    return " ".join(f"{n} {k}" for k, n in sorted(merged.items())) or "none"


def report(opts: dict, results: list[dict], elapsed: float, before: str) -> str:
    r0 = results[0]
    runs = r0["runs"]  # step times are already the slowest rank's
    tokens = opts["world"] * opts["batch"] * opts["seq"]
    names = [n for n in ORDER if n in runs]
    comparisons = {a: compare(runs, a, b) for a, b in pairs(names).items()}
    rows = []
    for name in names:
        b = COUNTERPART[name] if name in comparisons else None
        ratio, fastest, spread = ratio_cells(runs, name, b) if b else ("", "", "")
        rows.append(
            [name, *timing_cells(runs[name], tokens, unit=None), f"{ratio} vs {SHORT[b]}" if b else "", spread, fastest]
        )
    timing = markdown_table(
        [
            "",
            *TIMING_COLUMNS,
            "tok/s (global)",
            "ratio (median of repeats)",
            "repeat ratios (min .. max)",
            "ratio of fastest steps",
        ],
        rows,
    )
    mem_rows = []
    for name in names:

        def worst(key, name=name):
            return max(
                r["memory"][name][key] if key != "state" else r["memory"][name]["state"]["total"] for r in results
            )

        s = r0["memory"][name]["state"]
        rss = [r["memory"][name]["rss"] for r in results]
        wire = r0["memory"][name]["wire"]
        mem_rows.append(
            [
                name,
                f"{format_bytes(worst('state'))} ({FORMULA[name]})",
                f"{format_bytes(s['params'])} / {format_bytes(s['grads'])} / {format_bytes(s['optimizer'])}",
                format_bytes(worst("step_peak")),
                format_bytes(max(rss)) if all(x is not None for x in rss) else "n/a",
                collective_summary(r0["memory"][name]["collectives"])
                + (f" ({format_bytes(wire)} on the wire)" if wire else ""),
            ]
        )
    memory = markdown_table(
        [
            "",
            "model state / rank (expected)",
            "params / grads / optimizer (rank 0)",
            "step peak (tensors)",
            "step peak RSS delta",
            "collectives / step (rank 0)",
        ],
        mem_rows,
    )
    losses = r0["losses"]
    worst_loss = max(
        abs(losses[a][i] - losses[b][i]) / abs(losses[b][i])
        for a, b in pairs(names).items()
        for i in range(CHECK_STEPS)
    )
    psi = r0["params"]
    lines = [
        f"model {opts['model']} ({psi / 1e6:.2f}M parameters = Ψ, {format_bytes(4 * psi)} in fp32), "
        f"{opts['world']} gloo ranks x 1 thread, "
        f"batch {opts['batch']} x {opts['seq']} tokens per rank, bucket {opts['bucket_mb']} MB, "
        f"{opts['repeats']} repeats x {opts['steps']} steps (+{opts['warmup']} warm-up) per candidate, "
        f"{opts['dtype']} compute from fp32 masters",
        f"machine: {before} before, {load_average()} after",
        "same work: global loss before/after 1/after 2 steps: "
        + "; ".join(f"{SHORT[n]} " + "/".join(f"{x:.6f}" for x in losses[n]) for n in names),
        f"  largest relative difference from the counterpart: {worst_loss:.2e} "
        f"(tolerance {LOSS_RTOL if opts['dtype'] == 'fp32' else BF16_LOSS_RTOL:.1e})",
        "",
        timing,
        "",
        memory,
        "",
        "ratios per repeat: "
        + "; ".join(f"{SHORT[a]}: " + ", ".join(f"{x:.3f}" for x in c.ratios) for a, c in comparisons.items()),
        f"ru_maxrss (monotonic, all candidates together): rank 0 {format_bytes(r0['maxrss'][0])} after building, "
        f"{format_bytes(r0['maxrss'][1])} at the end; wall time {elapsed:.0f} s",
    ]
    if Z3 in names:
        elements, nbytes, wire = r0["memory"][Z3]["gathers"]
        lines.append(
            f"fivecut ZeRO-3 all-gathers, one step (rank 0): {elements:,} elements, {nbytes / elements:.0f} B each, "
            f"{format_bytes(wire)} on the wire"
        )
    lines += [
        f"ratio_{key}={comparisons[a].ratio:.3f}"
        for a, key in ((Z3, "zero3_vs_fsdp2"), (Z0, "zero0_vs_ddp"))
        if a in comparisons
    ]
    return "\n".join(lines)


def parse(argv=None) -> dict:
    p = benchmark_parser(__doc__)
    p.add_argument("--world", type=int, default=2)
    add_common_arguments(p, steps=10)
    p.add_argument("--bucket-mb", type=float, default=25.0, help="DDP / ZeRO-1/2 bucket size (both sides)")
    p.add_argument(
        "--only",
        default=",".join(GROUPS),
        type=lambda s: s.split(","),
        help="comma-separated groups to run: zero3 (ZeRO-3, FSDP2), zero0 (ZeRO-0, DDP), zero12 (ZeRO-1/2, "
        "ZeroRedundancyOptimizer)",
    )
    p.add_argument(
        "--dtype", default="fp32", choices=list(DTYPES), help="bf16: compute on bf16 copies of fp32 masters (zero3)"
    )
    p.add_argument("--profile", action="store_true", help="print rank 0's op table of one ZeRO-3 and one FSDP2 step")
    p.add_argument("--profile-rows", type=int, default=25)
    opts = parse_options(p, argv)
    unknown = [key for key in opts["only"] if key not in GROUPS]
    if unknown:
        p.error(f"--only: unknown group(s) {', '.join(unknown)}; choose from {', '.join(GROUPS)}")
    if opts["dtype"] != "fp32" and opts["only"] != ["zero3"]:
        p.error(f"--dtype {opts['dtype']}: only with --only zero3 (fivecut's ZeRO-0/1/2 autocast fp32 parameters)")
    return opts


def main(argv=None) -> None:
    opts = parse(argv)
    run("benchmarks/zero.py", rank_main, report, opts, world=opts["world"])


if __name__ == "__main__":
    main()
