"""`fivecut plan calibrate`: this machine as a cluster file, so that plans can be checked here.

Every rank runs as fivecut runs its ranks (`fivecut.launch.spawn`: one process each, one
thread, gloo on CPU, NCCL on GPUs), all at once, so that the figures include the contention
of ranks sharing the machine:

    matmul rate      square matmuls of `MATMUL_SIZE` in the dtype runs use (fp32 on CPU,
                     bf16 on a GPU), the median of `REPEATS` timed runs on every rank; the
                     slowest rank's rate is the device's (`achievable` = 1: measured)
    kernel cost      a chain of `CHAIN` multiplies of an 8-element tensor and its sum, forward and
                     backward under autograd (all fixed cost: dispatch, autograd's records, launch),
                     divided by its kernels (3 per op: the forward, the backward's two), the
                     slowest rank's median, as the device's `kernel_us`
    link             all-reduces of `SIZES` bytes over all ranks (the slowest rank's median
                     times), read through the ring's alpha-beta model of `fivecut.plan.cluster`,
                     t = 2(n-1) alpha + 2(n-1)/n x bytes / bandwidth: alpha from the smallest
                     (latency only), the bandwidth from the two largest

The machine is one node: its intra- and inter-node links are the same measured link.
"""

from __future__ import annotations

import os
import statistics
import time

import torch
import torch.distributed as dist

from fivecut.launch import local_device, spawn
from fivecut.plan.cluster import Cluster, Device, Link

MATMUL_SIZE = 512
REPEATS = 9
CHAIN = 50  # tiny multiplies in the per-kernel cost's measurement
SIZES = (4, 4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20)  # all-reduce tensor bytes


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


def tiny_chain(device, dtype) -> None:
    """`CHAIN` multiplies and a sum of an 8-element tensor, forward and backward: per-op cost only."""
    x = torch.ones(8, device=device, dtype=dtype, requires_grad=True)
    y = x
    for _ in range(CHAIN):
        y = y * 1.0001
    y.sum().backward()


def measure_rank(repeats: int) -> dict:
    """On each rank: its matmul FLOP/s and the median time of an all-reduce of each size."""
    device = local_device()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    a = torch.randn(MATMUL_SIZE, MATMUL_SIZE, device=device, dtype=dtype)
    b = torch.randn(MATMUL_SIZE, MATMUL_SIZE, device=device, dtype=dtype)
    dist.barrier()
    seconds = timed(lambda: a @ b, repeats, sync)
    flops = 2 * MATMUL_SIZE**3 / seconds
    kernel = timed(lambda: tiny_chain(device, dtype), repeats, sync) / (3 * (CHAIN + 1))
    reduces = {}
    for size in SIZES:
        x = torch.zeros(max(size // 4, 1), device=device)
        dist.barrier()
        reduces[size] = timed(lambda x=x: dist.all_reduce(x), repeats, sync)
    return {"flops": flops, "kernel_s": kernel, "reduces": reduces, "dtype": str(dtype).removeprefix("torch.")}


def fit_link(times: dict[int, float], n: int) -> Link:
    """alpha from the smallest all-reduce (all latency: t / hops), the bandwidth from the slope
    between the two largest (their difference in wire bytes over their difference in time)."""
    hops, factor = 2 * (n - 1), 2 * (n - 1) / n
    sizes = sorted(times)
    alpha = times[sizes[0]] / hops
    big, bigger = sizes[-2], sizes[-1]
    seconds = max(times[bigger] - times[big], 1e-12)
    return Link(bandwidth_gbps=factor * (bigger - big) / seconds / 1e9, latency_us=alpha * 1e6)


def calibrate(ranks: int, repeats: int = REPEATS) -> tuple[Cluster, dict]:
    """This machine as a one-node cluster of `ranks` ranks, and the raw measurements."""
    results = spawn(measure_rank, ranks, repeats, timeout_s=600.0)
    slowest = min(r["flops"] for r in results)
    times = {size: max(r["reduces"][size] for r in results) for size in SIZES}
    link = fit_link(times, ranks) if ranks > 1 else Link(1e3, 0.0)
    memory_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9 / ranks
    device = Device(
        name=f"{os.uname().nodename}-rank",
        peak_tflops=slowest / 1e12,
        memory_gb=memory_gb,
        achievable=1.0,
        kernel_us=max(r["kernel_s"] for r in results) * 1e6,
        source=f"fivecut plan calibrate: {MATMUL_SIZE}^3 {results[0]['dtype']} matmuls on {ranks} ranks at once",
    )
    cluster = Cluster(1, ranks, device, link, link, name="this-machine")
    return cluster, {
        "flops": [r["flops"] for r in results],
        "kernel_s": [r["kernel_s"] for r in results],
        "all_reduce_s": times,
    }
