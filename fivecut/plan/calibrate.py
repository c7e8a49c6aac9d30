"""`fivecut plan calibrate`: this machine as a cluster file, so that plans can be checked here.

Every rank runs as fivecut runs its ranks (`fivecut.launch.spawn`: one process each, one
thread, gloo on CPU, NCCL on GPUs), all at once, so that the figures include the contention
of ranks sharing the machine. Each figure is the slowest rank's median of `REPEATS` runs, the
compute ones in lockstep (`in_lockstep`: the ranks start together and wait for the slowest at
the end, as between a step's collectives, so that a rank slowed on a shared core slows them):

    matmul rate      square matmuls of `MATMUL_SIZE` in the dtype runs use (fp32 on CPU,
                     bf16 on a GPU); the device's rate (`achievable` = 1: measured)
    kernel cost      fivecut's own model (`fivecut.model`) at a negligible size (`PROBE`, one
                     sequence of `PROBE_TOKENS` tokens), forward, loss and backward, with
                     `PROBE_LAYERS` blocks and with one: the difference per block, divided by the
                     kernels the planner counts for a block's forward and backward
                     (`fivecut.plan.cost.block_kernels`), is `kernel_us` (dispatch, autograd,
                     Python and launch, as a real step pays them)
    step's tail      the gradient norm, clipping and AdamW step (`step_tail`) over `TENSORS` tiny
                     tensors (`tensor_us`: per tensor) and over one tensor of `BIG` elements
                     (`memory_gbps`: `fivecut.plan.cost.TAIL_BYTES` a parameter)
    link             all-reduces of `SIZES` bytes over all ranks, read through the ring's
                     alpha-beta model of `fivecut.plan.cluster`, t = 2(n-1) alpha + 2(n-1)/n x
                     bytes / bandwidth: the bandwidth from the two largest; then every op a step
                     calls (all-reduce, all-gather, reduce-scatter, all-to-all, send/recv) on a
                     4-byte-a-rank tensor through `fivecut.comm`, each call after the forward
                     of one probe block (the kernels a step runs between two of its collectives,
                     so the ranks arrive as far apart as in a step), less that forward alone:
                     one call's time over its hops is that op's per-hop latency
                     (a send's: half an exchange of a send and a recv with a neighbour)
    overlap          an all-reduce of `OVERLAP_BYTES` in flight while matmuls of about its length
                     run: the share of the shorter that hides (`overlap_share`)

The machine is one node: its intra- and inter-node links are the same measured link.
"""

from __future__ import annotations

import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from fivecut import comm
from fivecut.launch import local_device, spawn
from fivecut.ledger import Ledger
from fivecut.model.args import ModelArgs
from fivecut.model.transformer import Transformer
from fivecut.plan.cluster import Cluster, Device, Link, hops_of
from fivecut.plan.cost import TAIL_BYTES, block_kernels

MATMUL_SIZE = 512
REPEATS = 21
PROBE = ModelArgs(vocab_size=32, dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=64, max_seq_len=16)
PROBE_TOKENS = 8
PROBE_LAYERS = 4
TENSORS = 64  # tiny tensors in the optimizer's per-tensor measurement
BIG = 1 << 18  # elements of the tail's per-parameter measurement (a tensor of the size models hold)
SIZES = (4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20)  # all-reduce tensor bytes
OVERLAP_BYTES = 4 << 20  # the all-reduce whose overlap with matmuls is measured
OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send")


def timed(fn, repeats: int, sync) -> float:
    """Median seconds of `fn` over `repeats` runs (after one warm-up)."""
    fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def in_lockstep(fn, repeats: int, sync) -> float:
    """Seconds of `fn` as the slowest rank runs it between two of a step's collectives: each run
    starts together (a barrier) and ends with a one-element all-reduce, whose own time alone is
    taken off. The ranks that share the machine's cores wait for one another, as in a step."""
    if dist.get_world_size() == 1:
        return timed(fn, repeats, sync)
    flag = torch.zeros(1, device=local_device())
    alone = timed(lambda: dist.all_reduce(flag), repeats, sync)

    def together():
        fn()
        sync()
        dist.all_reduce(flag)

    together()
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        together()
        sync()
        times.append(time.perf_counter() - start)
    return max(statistics.median(times) - alone, 1e-9)


def overlap_share(a: torch.Tensor, b: torch.Tensor, matmul_s: float, sync, repeats: int) -> float:
    """The share of an all-reduce of `OVERLAP_BYTES` that hides behind matmuls (`matmul_s` each)
    issued while it is in flight: (compute + collective - both at once) / the shorter, in [0, 1]."""
    x = torch.zeros(OVERLAP_BYTES // 4, device=a.device)
    alone = in_lockstep(lambda: dist.all_reduce(x), repeats, sync)
    count = torch.tensor([min(max(round(alone / matmul_s), 1), 256)], device=a.device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)  # every rank runs as many
    count = int(count.item())

    def matmuls():
        for _ in range(count):
            a @ b

    def both():
        work = dist.all_reduce(x, async_op=True)
        matmuls()
        work.wait()

    compute = in_lockstep(matmuls, repeats, sync)
    together = in_lockstep(both, repeats, sync)
    return min(max((compute + alone - together) / min(compute, alone), 0.0), 1.0)


def probe_step(layers: int, device, dtype):
    """A forward, loss and backward of fivecut's model with `layers` blocks on `PROBE_TOKENS` tokens."""
    args = ModelArgs(**{**PROBE.__dict__, "n_layers": layers})
    model = Transformer(args).to(device=device, dtype=dtype)
    model.init_weights(0)
    tokens = torch.randint(0, args.vocab_size, (1, PROBE_TOKENS), device=device)

    def step():
        logits = model(tokens)  # [1, s, vocab]
        F.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten()).backward()

    return step


def probe_block(device):
    """The forward of one block of the probe model on `PROBE_TOKENS` tokens, without autograd."""
    model = Transformer(PROBE).to(device)
    model.init_weights(0)
    block, rope = model.layers["0"], (model.rope_cos[:PROBE_TOKENS], model.rope_sin[:PROBE_TOKENS])
    x = torch.randn(1, PROBE_TOKENS, PROBE.dim, device=device)

    def forward():
        with torch.no_grad():
            block(x, rope)

    return forward


def step_tail(shapes: list[int], device):
    """A step's tail over tensors of `shapes`: the gradient norm and clipping as
    `fivecut.train.optim.clip_gradients` does them (without the norm's all-reduce), then AdamW."""
    params = [torch.zeros(n, device=device, requires_grad=True) for n in shapes]
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)

    def tail():
        squares = torch.zeros((), device=device)
        for p in params:
            squares += p.grad.detach().float().pow(2).sum()
        scale = torch.clamp(1.0 / (squares.sqrt() + 1e-6), max=1.0)
        for p in params:
            p.grad.mul_(scale)
        optimizer.step()

    return tail


def op_call(op: str, group: comm.Group, device):
    """One small call of `op` (4 bytes a rank) on `group`, as `fivecut.comm` issues it."""
    n, me = group.size, group.rank
    x = torch.zeros(n, device=device)
    if op == "all_reduce":
        return lambda: comm.all_reduce(x[:1], group)
    if op == "all_gather":
        return lambda: comm.all_gather(x[:1], group)
    if op == "reduce_scatter":
        return lambda: comm.reduce_scatter(x, group)
    if op == "all_to_all":
        return lambda: comm.all_to_all_single(x, group)
    peer = me ^ 1 if (me ^ 1) < n else me  # pairs 0-1, 2-3, ...: one message each way
    out = torch.zeros(1, device=device)

    def exchange():
        for work in comm.batch_send_recv([(x[:1], peer)], [(out, peer)], group):
            work.wait()

    return exchange


def op_latencies(device, sync, repeats: int) -> dict[str, float]:
    """Seconds of one small call of each op in `OPS` after a probe block's forward, less the forward."""
    n = dist.get_world_size()
    group = comm.Group("calibrate", tuple(range(n)), dist.group.WORLD, Ledger())
    block = probe_block(device)
    alone = timed(block, repeats, sync)
    out = {}
    for op in OPS:
        call = op_call(op, group, device)
        dist.barrier()
        seconds = max(timed(lambda call=call: (block(), call()), repeats, sync) - alone, 0.0)
        out[op] = seconds / (2 if op == "send" else 1)  # an exchange is a send and a recv
    return out


def measure_rank(repeats: int) -> dict:
    """On each rank: its matmul rate, the per-kernel and optimizer costs, and collective times."""
    device = local_device()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    a = torch.randn(MATMUL_SIZE, MATMUL_SIZE, device=device, dtype=dtype)
    b = torch.randn(MATMUL_SIZE, MATMUL_SIZE, device=device, dtype=dtype)
    dist.barrier()
    matmul_s = in_lockstep(lambda: a @ b, repeats, sync)
    flops = 2 * MATMUL_SIZE**3 / matmul_s
    one = in_lockstep(probe_step(1, device, dtype), repeats, sync)
    many = in_lockstep(probe_step(PROBE_LAYERS, device, dtype), repeats, sync)
    kernel = max(many - one, 0.0) / (PROBE_LAYERS - 1) / block_kernels(PROBE, 0, "none")
    tensor = in_lockstep(step_tail([8] * TENSORS, device), repeats, sync) / TENSORS
    big = in_lockstep(step_tail([BIG], device), max(repeats // 4, 3), sync)
    reduces = {}
    for size in SIZES:
        x = torch.zeros(max(size // 4, 1), device=device)
        dist.barrier()
        reduces[size] = timed(lambda x=x: dist.all_reduce(x), repeats, sync)
    calls = op_latencies(device, sync, repeats) if dist.get_world_size() > 1 else {}
    overlap = overlap_share(a, b, matmul_s, sync, max(repeats // 3, 3)) if dist.get_world_size() > 1 else 1.0
    return {
        "flops": flops,
        "kernel_s": kernel,
        "tensor_s": tensor,
        "memory_bps": TAIL_BYTES * BIG / max(big - tensor, 1e-12),
        "reduces": reduces,
        "calls": calls,
        "overlap": overlap,
        "dtype": str(dtype).removeprefix("torch."),
    }


def fit_link(times: dict[int, float], calls: dict[str, float], n: int) -> Link:
    """The bandwidth from the slope between the two largest all-reduces (their difference in wire
    bytes over their difference in time); each op's per-hop latency from its small call."""
    factor = 2 * (n - 1) / n
    big, bigger = sorted(times)[-2:]
    seconds = max(times[bigger] - times[big], 1e-12)
    hop = {op: calls[op] / hops_of(op, n) * 1e6 for op in OPS}
    return Link(
        bandwidth_gbps=factor * (bigger - big) / seconds / 1e9,
        latency_us=hop["all_reduce"],
        op_latency_us=tuple((op, us) for op, us in hop.items() if op != "all_reduce"),
    )


def calibrate(ranks: int, repeats: int = REPEATS) -> tuple[Cluster, dict]:
    """This machine as a one-node cluster of `ranks` ranks, and the raw measurements."""
    results = spawn(measure_rank, ranks, repeats, timeout_s=600.0)
    slowest = min(r["flops"] for r in results)
    times = {size: max(r["reduces"][size] for r in results) for size in SIZES}
    calls = {op: max(r["calls"][op] for r in results) for op in OPS} if ranks > 1 else {}
    link = fit_link(times, calls, ranks) if ranks > 1 else Link(1e3, 0.0)
    memory_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9 / ranks
    device = Device(
        name=f"{os.uname().nodename}-rank",
        peak_tflops=slowest / 1e12,
        memory_gb=memory_gb,
        achievable=1.0,
        kernel_us=max(r["kernel_s"] for r in results) * 1e6,
        memory_gbps=min(r["memory_bps"] for r in results) / 1e9,
        tensor_us=max(r["tensor_s"] for r in results) * 1e6,
        overlap=min(r["overlap"] for r in results),
        source=f"fivecut plan calibrate: {MATMUL_SIZE}^3 {results[0]['dtype']} matmuls on {ranks} ranks at once",
    )
    cluster = Cluster(1, ranks, device, link, link, name="this-machine")
    return cluster, {
        "flops": [r["flops"] for r in results],
        "kernel_s": [r["kernel_s"] for r in results],
        "all_reduce_s": times,
        "call_s": calls,
    }
