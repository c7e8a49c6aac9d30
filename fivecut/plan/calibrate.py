"""`fivecut plan calibrate`: this machine as a cluster file, so that plans can be checked here.

Every rank runs as fivecut runs its ranks (`fivecut.launch.spawn`: one process each, one
thread, gloo on CPU, NCCL on GPUs), all at once, so that the figures include the contention
of ranks sharing the machine. Each figure is the slowest rank's median of `REPEATS` runs, the
compute ones in lockstep (`lockstep_rounds`: the ranks start together and wait for the slowest
at the end, as between a step's collectives, so that a rank slowed on a shared core slows them)
and in rounds that run every compute probe once in turn, each figure derived within a round
(a CPU's speed drifts by tens of percent over seconds; the figures that subtract one probe's
time from another's must see the same machine):

    matmul rate      a linear layer's forward and backward (its three matmuls) on `LINEAR`
                     (tokens, in, out; a GPU's: `probe_sizes`) in the dtype runs use (fp32 on
                     CPU, bf16 on a GPU); the device's rate (`achievable` = 1: measured; a GPU
                     with a preset: the data sheet's peak, `achievable` the measured share)
    kernel cost      fivecut's own model (`fivecut.model`) at a negligible size (`PROBE`, one
                     sequence of `PROBE_TOKENS` tokens), forward, loss and backward, with
                     `PROBE_LAYERS` blocks and with one: the difference per block, divided by the
                     kernels the planner counts for a block's forward and backward
                     (`fivecut.plan.cost.block_kernels`), is `kernel_us` (dispatch, autograd,
                     Python and launch, as a real step pays them); the same with every block
                     fully recomputed (`apply_recompute`): what a block costs beyond the plain
                     one, over its forward kernels, is `recompute_us`
    pipeline         one real step of fivecut's pipeline executor (`PipelineStep`, 1F1B, 4
                     microbatches) of the probe model over pairs of ranks, every pair at once:
                     what it takes beyond the planner's own costing of that step
                     (`fivecut.plan.cost.pipeline_time`), over a rank's F and B actions, is
                     `action_us` (the executor's bookkeeping, an autograd call, posting and
                     waking for messages)
    attention        the fused causal attention's forward and backward on `ATTENTION`
                     (a GPU's: the run's heads, head size and sequence, `probe_sizes`):
                     `attention_tflops` (a CPU runs it several times slower than its matmuls)
    activations      the same difference of steps at a training size (`BLOCK`, `BLOCK_ROWS`
                     sequences): what a block takes beyond its matmuls, attention core and
                     kernels, over the bytes the planner has its memory-bound kernels move
                     (`fivecut.plan.cost.stage_traffic`), is `activation_gbps`
    loss             the output head and cross-entropy, forward and backward, on `LOSS`: what
                     they take beyond the head's matmuls, at `fivecut.plan.cost.LOSS_BYTES` a
                     logit, is `loss_gbps`
    step's tail      the gradient norm, clipping and AdamW step (`step_tail`) over `TENSORS` tiny
                     tensors (a GPU's: as many as the model has; `tensor_us`: per tensor) and
                     over one tensor of `BIG` elements (a GPU's: gigabytes, `probe_sizes`)
                     (`memory_gbps`: `fivecut.plan.cost.TAIL_BYTES` a parameter)
    link             all-reduces of `SIZES` bytes over all ranks, read through the ring's
                     alpha-beta model of `fivecut.plan.cluster`, t = 2(n-1) alpha + 2(n-1)/n x
                     bytes / bandwidth: the bandwidth from the two largest; then every op a step
                     calls (all-reduce, all-gather, reduce-scatter, all-to-all, send/recv) at
                     `MESSAGES` elements a rank on pairs of ranks, every pair at once (the
                     groups of a few ranks that most cuts use, beside the others' work;
                     `op_groups`), and a one-element all-reduce over the world, through
                     `fivecut.comm`, each call after the forward of one probe block (the kernels
                     a step runs between two of its collectives, so the ranks arrive as far
                     apart as in a step), less that forward alone, the mean over `REPEATS`
                     rounds: an op's bandwidth from the slope between its two sizes, its per-hop
                     latency from the smaller less its bytes (`fit_link`; a send's: half an
                     exchange of a send and a recv with a neighbour)
    overlap          an all-reduce of `OVERLAP_BYTES` in flight while matmuls of about its length
                     run: the share of the shorter that hides (`overlap_share`), the median of
                     per-round shares; 0 where the ranks fill a CPU's cores (`spare_cores`)

On a GPU every compute probe is sized by `probe_sizes` from the run's model and sequence (`--model`,
`--seq`; else llama-1b at 2048) and the GPU's memory: the linear layer at the model's width and
MLP, the attention core at its heads and sequence, the loss at its vocabulary, the activation
block at its shape and thousands of tokens, the tail's tensor of gigabytes (a CPU-sized one is
launch-bound there: 36.6 GB/s on an H200); the device is named by `torch.cuda.get_device_name`,
its memory is the GPU's, and a GPU a preset knows (`NVIDIA H200`) keeps the data sheet's peak
with the measured rate as its `achievable`. The same code runs on a CPU at the CPU's sizes.

The machine is one node: its intra- and inter-node links are the same measured link. On a CPU
its cores (`cores_per_node`) are shared by the ranks, whose rates were measured all busy at once.
"""

from __future__ import annotations

import os
import statistics
import time
from contextlib import nullcontext
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.nn.functional as F

from fivecut import comm
from fivecut.config import Config, ModelConfig, TrainConfig
from fivecut.launch import local_device, spawn
from fivecut.layout import ParallelDims
from fivecut.ledger import Ledger
from fivecut.model.args import ModelArgs
from fivecut.model.presets import PRESETS
from fivecut.model.transformer import Transformer, build_model
from fivecut.parallel.data import Piece
from fivecut.parallel.parallelize import token_loss_sum
from fivecut.parallel.pipeline.executor import PipelineStep
from fivecut.parallel.pipeline.schedule import build_schedule
from fivecut.parallel.pipeline.split import cut_stage, stage_layers
from fivecut.parallel.recompute import apply_recompute
from fivecut.parallel.saved import SavedActivations
from fivecut.plan.activations import activation_bytes_per_layer
from fivecut.plan.cluster import DEVICES, Cluster, Device, Link, hops_of
from fivecut.plan.cost import (
    LOSS_BYTES,
    TAIL_BYTES,
    block_forward_kernels,
    block_kernels,
    compute_actions,
    pipeline_time,
    shared_cores,
    stage_compute,
)
from fivecut.plan.volume import virtual_mesh
from fivecut.train.optim import build_optimizer, clip_gradients

MATMUL_SIZE = 512  # the square matmuls an all-reduce's overlap is measured against
LINEAR = (512, 512, 1536)  # tokens, in, out features of the layer whose matmuls give the rate (CPU)
LOSS = (256, 256, 32768)  # tokens, width, vocabulary of the head and loss measured (logits out of cache)
REPEATS = 21
PROBE = ModelArgs(vocab_size=32, dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=64, max_seq_len=16)
PROBE_TOKENS = 8
PROBE_LAYERS = 4
ATTENTION = (4, 4, 128, 32)  # rows, heads, seq, head dim of the attention core's measurement (CPU)
BLOCK = ModelArgs(vocab_size=256, dim=128, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=384, max_seq_len=128)
BLOCK_ROWS = 2  # sequences of BLOCK.max_seq_len tokens in the activation-rate measurement
TENSORS = 64  # tiny tensors in the optimizer's per-tensor measurement
BIG = 1 << 18  # elements of the tail's per-parameter measurement (a tensor of the size models hold)
SIZES = (4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20)  # all-reduce tensor bytes
OVERLAP_BYTES = 4 << 20  # the all-reduce whose overlap with matmuls is measured
OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send")
MESSAGES = (16384, 262144)  # elements a rank in each op's measured calls: 64 KB and 1 MB of fp32
PIPELINE_MICROBATCHES = 4  # microbatches of the pipeline probe's step (one `PROBE_TOKENS` sequence each)
GPU_MODEL = "llama-1b"  # the shape a GPU's probes take when no --model is given (`probe_sizes`)
GPU_SEQ = 2048
GPU_SHARE = 1 / 8  # of a GPU's memory, what one probe's tensors may take (`probe_sizes`)
GPU_TOKENS = 16384  # the most tokens a GPU's block, linear-layer and attention probes run at once
OP_ROUNDS = 5  # the ops' rounds, in `REPEATS`: a few ms each, and their means swing by tens of percent over 21
SLOWEST_FACTOR = 4.0  # an op's bandwidth is at most this times the all-reduce's (a noisy slope is bounded)


@dataclass(frozen=True)
class ProbeSizes:
    """The shapes the compute probes run at on one kind of device (`probe_sizes`)."""

    device: str  # "cpu" or "cuda": the device the sizes are for
    linear: tuple[int, int, int]  # tokens, in, out features of the linear layer (the matmul rate)
    attention: tuple[int, int, int, int]  # rows, heads, seq, head dim of the attention core
    loss: tuple[int, int, int]  # tokens, width, vocabulary of the head and cross-entropy
    block: ModelArgs  # the block whose memory-bound kernels give `activation_gbps` (n_layers ignored)
    block_rows: int  # sequences of `block.max_seq_len` tokens in that probe
    tensors: int  # tiny tensors of the optimizer's per-tensor probe (the model's tensor count)
    big: int  # elements of the one tensor of the step tail's per-parameter probe

    def describe(self) -> str:
        tokens, n_in, n_out = self.linear
        rows, heads, seq, head_dim = self.attention
        return (
            f"linear {tokens}x{n_in}x{n_out}, attention {rows}x{heads}x{seq}x{head_dim}, loss "
            f"{'x'.join(map(str, self.loss))}, block dim {self.block.dim} on {self.block_rows}x"
            f"{self.block.max_seq_len} tokens, tail {self.tensors} tensors and one of {self.big:,} elements"
        )


def probe_sizes(device: str, memory_bytes: float, model: ModelArgs | None = None, seq: int | None = None):
    """The probes' shapes on a `device` ("cpu" or "cuda") of `memory_bytes`. A CPU's are small
    (`LINEAR`, `ATTENTION`, `LOSS`, `BLOCK`, `BIG`: the sizes `benchmarks/plan_check.py` checks the
    planner at). A GPU's come from the run's model and sequence (`model`, `seq`; else `GPU_MODEL`
    at `GPU_SEQ`) and from its memory, each probe's tensors within `GPU_SHARE` of it: the linear
    layer at the model's width and MLP, the attention core at its heads, head size and sequence,
    the loss at its vocabulary, the block at its shape (a tiny vocabulary: the head cancels in
    the difference of blocks), the tail's big tensor as large as that share holds (gigabytes: a
    smaller one is launch-bound on a GPU). The optimizer's per-tensor probe runs as many tensors
    as the model has (`tensor_count`: a multi-tensor kernel's launches are shared by its tensors).
    A CPU's sizes take no model (`calibrate` refuses one)."""
    if device != "cuda":
        return ProbeSizes("cpu", LINEAR, ATTENTION, LOSS, BLOCK, BLOCK_ROWS, TENSORS, BIG)
    shape = model or PRESETS[GPU_MODEL]
    seq = seq or (GPU_SEQ if model is None else shape.max_seq_len)
    budget = memory_bytes * GPU_SHARE
    block = replace(shape, vocab_size=256, n_layers=1, max_seq_len=seq, n_experts=0)  # a dense block (a MoE
    # model's: its dense layers' shape; four blocks of hundreds of experts would not fit)
    # bf16 activations the probe keeps for backward over its PROBE_LAYERS blocks, a sequence
    held = PROBE_LAYERS * activation_bytes_per_layer(block, 1, seq, 1, False, "bf16")
    rows = int(max(1, min(GPU_TOKENS // seq, budget // max(held, 1))))
    tokens = rows * seq
    logits = int(min(max(budget // (shape.vocab_size * LOGIT_BYTES), 256), 4096))
    big = int(min(max(budget // ADAMW_STATE_BYTES, BIG), 1 << 28))
    return ProbeSizes(
        "cuda",
        linear=(min(tokens, 8192), shape.dim, shape.ffn_dim),
        attention=(rows, shape.n_heads, seq, shape.qk_head_dim),
        loss=(logits, shape.dim, shape.vocab_size),
        block=block,
        block_rows=rows,
        tensors=tensor_count(shape),
        big=big,
    )


LOGIT_BYTES = 12  # a logit's bytes alive in the loss probe (bf16 logits, the fp32 upcast, its gradient)
ADAMW_STATE_BYTES = 16  # an fp32 parameter's bytes in AdamW: itself, its gradient, two moments


def tensor_count(model: ModelArgs) -> int:
    """The parameter tensors of `model` (built on the meta device): what the optimizer steps over."""
    return sum(1 for _ in build_model(model, device="meta").parameters())


def timed(fn, repeats: int, sync, statistic=statistics.median) -> float:
    """`statistic` (the median) of the seconds of `fn` over `repeats` runs (after one warm-up)."""
    fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistic(times)


def in_lockstep(fn, repeats: int, sync) -> float:
    """Median seconds of `fn` as the slowest rank runs it between two of a step's collectives
    (`lockstep_rounds`)."""
    return statistics.median(lockstep_rounds({"fn": fn}, repeats, sync)["fn"])


def lockstep_rounds(probes: dict, rounds: int, sync) -> dict[str, list[float]]:
    """Seconds of each of `probes` in each of `rounds` rounds, each round running every probe once
    in turn, so that the figures derived from several probes see the machine in one state (its
    speed drifts by tens of percent over seconds). Each run starts together (a barrier) and ends
    with a one-element all-reduce, whose own time alone is taken off: the ranks that share the
    machine's cores wait for one another, as between a step's collectives."""
    alone, flag = 0.0, torch.zeros(1, device=local_device())
    many = dist.get_world_size() > 1
    if many:
        alone = timed(lambda: dist.all_reduce(flag), rounds, sync)

    def together(fn):
        fn()
        sync()
        if many:
            dist.all_reduce(flag)

    for fn in probes.values():
        together(fn)  # a warm-up each
    times: dict[str, list[float]] = {name: [] for name in probes}
    for _ in range(rounds):
        for name, fn in probes.items():
            if many:
                dist.barrier()
            start = time.perf_counter()
            together(fn)
            times[name].append(max(time.perf_counter() - start - alone, 1e-9))
    return times


def overlap_share(a: torch.Tensor, b: torch.Tensor, matmul_s: float, sync, repeats: int) -> float:
    """The share of an all-reduce of `OVERLAP_BYTES` that hides behind matmuls (`matmul_s` each)
    issued while it is in flight: (compute + collective - both at once) / the shorter, in [0, 1];
    each round times the three in turn (`lockstep_rounds`) and gives a share, and the median
    share counts (a difference of three noisy times swings from 0 to 1 between single runs)."""
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

    rounds = lockstep_rounds({"compute": matmuls, "alone": lambda: dist.all_reduce(x), "both": both}, repeats, sync)
    shares = [
        (compute + alone - together) / min(compute, alone)
        for compute, alone, together in zip(rounds["compute"], rounds["alone"], rounds["both"])
    ]
    return min(max(statistics.median(shares), 0.0), 1.0)


def spare_cores(device) -> bool:
    """Whether a collective in flight can run beside the compute: on a GPU (its own engines) or on
    a CPU with cores to spare beyond one a rank. Where the ranks fill the cores, gloo's threads
    take the cores the compute runs on, and nothing hides: the measured share swings between 0
    and ~0.8 from one calibration to the next around that (five calibrations with 2 ranks on 2
    cores: 0.0, 0.01, 0.12, 0.35, 0.78), and planning the step with 0 brought every layout with
    a data-parallel reduction closer to its measured time."""
    return device.type == "cuda" or len(os.sched_getaffinity(0)) > dist.get_world_size()


def probe_step(shape: ModelArgs, layers: int, rows: int, seq: int, device, dtype, recompute: str = "none"):
    """A forward, loss and backward of fivecut's model of `shape` with `layers` blocks on `rows`
    sequences of `seq` tokens, every block recomputed in `recompute` mode (`apply_recompute`)."""
    args = replace(shape, n_layers=layers)
    model = Transformer(args).to(device=device, dtype=dtype)
    model.init_weights(0)
    apply_recompute(model, recompute, 1, SavedActivations())
    tokens = torch.randint(0, args.vocab_size, (rows, seq), device=device)

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


def linear_layer(device, dtype, shape: tuple[int, int, int]):
    """A linear layer's forward and backward (its three matmuls: y = x W^T, dx = dy W, dW = dy^T x,
    in the layouts a model's layers run them) on `shape` = (tokens, in, out); and its FLOPs."""
    tokens, n_in, n_out = shape
    x = torch.randn(tokens, n_in, device=device, dtype=dtype, requires_grad=True)
    w = torch.randn(n_out, n_in, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn(tokens, n_out, device=device, dtype=dtype)

    def layer():
        x.grad = w.grad = None
        F.linear(x, w).backward(grad)

    return layer, 3 * 2 * tokens * n_in * n_out


def head_and_loss(device, dtype, shape: tuple[int, int, int]):
    """The output head and the cross-entropy, forward and backward, as fivecut's model and trainer
    run them (fp32 logits), on `shape` = (tokens, width, vocabulary); and the head's FLOPs."""
    tokens, width, vocab = shape
    x = torch.randn(tokens, width, device=device, dtype=dtype, requires_grad=True)
    w = torch.randn(vocab, width, device=device, dtype=dtype, requires_grad=True)
    targets = torch.randint(0, vocab, (tokens,), device=device)

    def loss():
        x.grad = w.grad = None
        F.cross_entropy(F.linear(x, w).float(), targets).backward()  # [tokens, vocab] logits

    return loss, 3 * 2 * tokens * width * vocab


def loss_rate(seconds: float, head_flops: float, flops: float, shape: tuple[int, int, int]) -> float:
    """Bytes/s of the loss over the logits (`LOSS_BYTES` a logit): what the head and loss take
    beyond the head's matmuls at `flops` (a head too large for the caches runs its matmuls slower
    than a block's: that too is counted here, a logit at a time); `shape`: the probe's (tokens,
    width, vocabulary)."""
    tokens, _, vocab = shape
    moved = LOSS_BYTES * tokens * vocab
    return moved / max(seconds - head_flops / flops, moved / 1e12)


def attention_core(device, dtype, shape: tuple[int, int, int, int]):
    """The fused causal attention (`scaled_dot_product_attention`, as fivecut's blocks call it),
    forward and backward, on q, k, v of `shape` = [rows, heads, seq, head dim]; and its FLOPs
    (forward 2 x 2 s w a token, causal: half; backward 2x)."""
    rows, heads, seq, head_dim = shape
    q, k, v = (torch.randn(rows, heads, seq, head_dim, device=device, dtype=dtype, requires_grad=True) for _ in "qkv")
    grad = torch.randn(rows, heads, seq, head_dim, device=device, dtype=dtype)

    def core():
        F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)

    return core, 3 * 2 * seq * heads * head_dim * rows * seq


def activation_rate(block_s: float, flops: float, attention: float, kernel_s: float, sizes: ProbeSizes) -> float:
    """Bytes/s of the probe block's (`sizes.block`) memory-bound kernels: what a block's forward
    and backward take beyond its matmuls (at `flops`), its attention core (at `attention`) and its
    kernels' fixed cost, over the bytes the planner has them move (what the block saves for
    backward, written once and read back with its gradient: 3x; `fivecut.plan.cost.stage_traffic`)."""
    block, rows = sizes.block, sizes.block_rows
    precision = "bf16" if sizes.device == "cuda" else "fp32"
    tokens = rows * block.max_seq_len
    work = stage_compute(block, range(1), False, tokens, block.max_seq_len, ("none", 1))
    modelled = (work["F"] + work["B"]) / flops + (work["attention_F"] + work["attention_B"]) / attention
    modelled += block_kernels(block, 0) * kernel_s
    moved = 3 * activation_bytes_per_layer(block, rows, block.max_seq_len, 1, False, precision)
    return moved / max(block_s - modelled, moved / 1e12)


def compute_probes(device, dtype, sizes: ProbeSizes) -> tuple[dict, dict]:
    """The probes of the compute figures (`compute_figures`) at `sizes`, and the FLOPs of those
    that count them."""
    layer, layer_flops = linear_layer(device, dtype, sizes.linear)
    loss, head_flops = head_and_loss(device, dtype, sizes.loss)
    core, core_flops = attention_core(device, dtype, sizes.attention)
    probes = {"linear": layer, "loss": loss, "attention": core}
    block = ("block", sizes.block, sizes.block_rows, sizes.block.max_seq_len)
    for name, shape, rows, seq in (("probe", PROBE, 1, PROBE_TOKENS), block):
        probes[f"{name}_1"] = probe_step(shape, 1, rows, seq, device, dtype)
        probes[f"{name}_{PROBE_LAYERS}"] = probe_step(shape, PROBE_LAYERS, rows, seq, device, dtype)
    for layers in (1, PROBE_LAYERS):
        probes[f"recompute_{layers}"] = probe_step(PROBE, layers, 1, PROBE_TOKENS, device, dtype, recompute="full")
    probes["tensors"] = step_tail([8] * sizes.tensors, device)
    probes["big"] = step_tail([sizes.big], device)
    return probes, {"linear": layer_flops, "loss": head_flops, "attention": core_flops}


def compute_figures(t: dict[str, float], flops_of: dict[str, float], sizes: ProbeSizes) -> dict[str, float]:
    """The compute figures from one round of `compute_probes`' seconds `t`: the matmul rate (the
    linear layer's), the per-kernel cost (a `PROBE` block's, less nothing: its matmuls are
    negligible), the attention core's rate, the loss's and the activations' rates (each what its
    probe takes beyond what the other figures already count), and the step tail's costs."""
    flops = flops_of["linear"] / t["linear"]
    per_block = {
        name: max(t[f"{name}_{PROBE_LAYERS}"] - t[f"{name}_1"], 0.0) / (PROBE_LAYERS - 1)
        for name in ("probe", "block", "recompute")
    }
    kernel = per_block["probe"] / block_kernels(PROBE, 0)
    again = max(per_block["recompute"] - per_block["probe"], 0.0) / block_forward_kernels(PROBE, 0)
    attention = flops_of["attention"] / t["attention"]
    tensor = t["tensors"] / sizes.tensors
    return {
        "flops": flops,
        "kernel_s": kernel,
        "recompute_s": again,
        "attention_flops": attention,
        "loss_bps": loss_rate(t["loss"], flops_of["loss"], flops, sizes.loss),
        "activation_bps": activation_rate(per_block["block"], flops, attention, kernel, sizes),
        "tensor_s": tensor,
        "memory_bps": TAIL_BYTES * sizes.big / max(t["big"] - tensor, 1e-12),
    }


def step_tail(shapes: list[int], device):
    """A step's tail over tensors of `shapes`: the gradient norm and clipping
    (`fivecut.train.optim.clip_gradients`, without the norm's all-reduce), then AdamW with the
    kernel a run takes by default on `device` (`build_optimizer`)."""
    pieces = [Piece(torch.zeros(n, device=device, requires_grad=True), decays=True) for n in shapes]
    for piece in pieces:
        piece.tensor.grad = torch.ones_like(piece.tensor)
    optimizer = build_optimizer(pieces, lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)

    def tail():
        clip_gradients(pieces, 1.0, groups=[])
        optimizer.step()

    return tail


def op_call(op: str, group: comm.Group, device, per_rank: int):
    """One call of `op` with `per_rank` elements a rank on `group`, as `fivecut.comm` issues it
    (all-gather: each rank's piece; reduce-scatter, all-to-all: every rank's)."""
    n, me = group.size, group.rank
    x = torch.zeros(n * per_rank, device=device)
    if op == "all_reduce":
        return lambda: comm.all_reduce(x[:per_rank], group)
    if op == "all_gather":
        return lambda: comm.all_gather(x[:per_rank], group)
    if op == "reduce_scatter":
        return lambda: comm.reduce_scatter(x, group)
    if op == "all_to_all":
        return lambda: comm.all_to_all_single(x, group)
    peer = me ^ 1 if (me ^ 1) < n else me  # pairs 0-1, 2-3, ...: one message each way
    out = torch.zeros(per_rank, device=device)

    def exchange():
        for work in comm.batch_send_recv([(x[:per_rank], peer)], [(out, peer)], group):
            work.wait()

    return exchange


def op_groups() -> tuple[comm.Group, comm.Group]:
    """The group each op's calls are timed on, and the world's (the scalar all-reduce's: a step's
    control calls span every rank). Ops go over pairs of ranks, every pair at once: a layout's
    TP, CP, EP and ZeRO groups on a few ranks share the machine with the other groups' ranks, and
    gloo's latency per hop on a pair is not a world-wide ring's (with 4 ranks on 2 cores it is
    about twice). An odd world times its ops on the world."""
    n, me = dist.get_world_size(), dist.get_rank()
    world = comm.Group("calibrate", tuple(range(n)), dist.group.WORLD, Ledger())
    if n <= 2 or n % 2:
        return world, world
    pairs = [dist.new_group([r, r + 1]) for r in range(0, n, 2)]  # every rank creates every group
    first = me - me % 2
    return comm.Group("calibrate", (first, first + 1), pairs[me // 2], Ledger()), world


def pipeline_probe(group: comm.Group, device, dtype):
    """One real step of fivecut's pipeline executor (`PipelineStep`, 1F1B) over `group` (a stage a
    rank) on `PIPELINE_PROBE`: `PROBE` with `PROBE_LAYERS` blocks cut as the planner cuts it,
    `PIPELINE_MICROBATCHES` microbatches of one sequence of `PROBE_TOKENS` tokens."""
    cfg = pipeline_probe_config(group.size)
    args = replace(PROBE, n_layers=PROBE_LAYERS)
    model = Transformer(args).to(device=device, dtype=dtype)
    model.init_weights(0)
    me, last = group.rank, group.size - 1
    layers = stage_layers(args, group.size, PROBE_TOKENS)
    stage = cut_stage(model, layers[me], me == 0, me == last)
    step = PipelineStep(
        build_schedule("1f1b", group.size, PIPELINE_MICROBATCHES),
        {me: stage},
        group,
        token_loss_sum,
        hidden_shape=(1, PROBE_TOKENS, args.dim),
        positions=torch.arange(PROBE_TOKENS, device=device),
        forward_context=lambda microbatch: nullcontext(),
        dtype=dtype,
    )
    tokens = torch.randint(0, args.vocab_size, (1, PROBE_TOKENS), device=device)
    batches = [(tokens, tokens)] * PIPELINE_MICROBATCHES
    ledger, tokens_in_batch = Ledger(), cfg.train.global_batch * PROBE_TOKENS
    return lambda: step.run(batches, tokens_in_batch, ledger)


def pipeline_probe_config(stages: int) -> Config:
    """`pipeline_probe`'s step as a layout the planner costs (`pipeline_time`)."""
    shape = {k: getattr(PROBE, k) for k in ("vocab_size", "dim", "n_heads", "n_kv_heads", "ffn_dim", "max_seq_len")}
    return Config(
        model=ModelConfig(**shape, n_layers=PROBE_LAYERS),
        train=TrainConfig(global_batch=PIPELINE_MICROBATCHES, seq_len=PROBE_TOKENS),
        parallel=ParallelDims(pp=stages, pp_schedule="1f1b", microbatches=PIPELINE_MICROBATCHES),
    )


def action_seconds(measured: float, cluster: Cluster, stages: int) -> float:
    """What a pipeline action (an F or B of a microbatch on a stage) costs beyond the planner's
    model of its compute and message (`pipeline_time` with no such cost): `pipeline_probe`'s
    `measured` step less the planner's, over a rank's actions. The executor's bookkeeping, an
    autograd call a B, posting a message and waking for one: fixed costs a stage's kernels leave out."""
    if stages < 2:
        return 0.0
    cfg = pipeline_probe_config(stages)
    cluster = replace(cluster, device=replace(cluster.device, action_us=0.0))
    args = replace(PROBE, n_layers=PROBE_LAYERS)
    tokens = PROBE_TOKENS  # a microbatch: one sequence
    pipe = pipeline_time(args, cfg, cluster, virtual_mesh(cfg.parallel, False), tokens)
    planned = pipe.makespan * shared_cores(cluster, pipe.busy / pipe.makespan)
    schedule = build_schedule("1f1b", stages, PIPELINE_MICROBATCHES)
    return max(measured - planned, 0.0) / compute_actions(schedule, 0)


def op_latencies(device, sync, repeats: int, pair: comm.Group, world: comm.Group) -> dict[str, tuple]:
    """For each op in `OPS`, at `MESSAGES` elements a rank on pairs of ranks (`op_groups`), and for
    a one-element all-reduce over the world ("scalar"): (mean seconds of a call after a probe
    block's forward, less the forward's; the wire bytes `fivecut.ledger` counts for it) a size.
    Means, not medians: a step pays the sum of its calls, and gloo's small calls have a long tail
    (their mean is up to twice their median). All in `lockstep_rounds`, so that every size of
    every op sees the machine in one state."""
    block = probe_block(device)
    probes, wires = {"block": block}, {}
    for op, per_rank in [*((op, size) for op in OPS for size in MESSAGES), ("scalar", 1)]:
        ledger = Ledger()
        group = replace(world if op == "scalar" else pair, ledger=ledger)
        call = op_call("all_reduce" if op == "scalar" else op, group, device, per_rank)
        call()
        wires[op, per_rank] = ledger.wire_bytes()  # one call's (an exchange: the send's)
        probes[f"{op} {per_rank}"] = lambda call=call: (block(), call())
    rounds = lockstep_rounds(probes, OP_ROUNDS * repeats, sync)
    means = {name: statistics.mean(times) for name, times in rounds.items()}
    out: dict[str, list] = {}
    for (op, per_rank), wire in wires.items():
        seconds = max(means[f"{op} {per_rank}"] - means["block"], 0.0)
        out.setdefault(op, []).append((seconds / (2 if op == "send" else 1), wire))  # an exchange: a send, a recv
    return {op: tuple(sizes) for op, sizes in out.items()}


def measure_rank(repeats: int, sizes: ProbeSizes) -> dict:
    """On each rank: its matmul rate, the per-kernel and optimizer costs at `sizes`, and collective
    times."""
    device = local_device()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    a = torch.randn(MATMUL_SIZE, MATMUL_SIZE, device=device, dtype=dtype)
    b = torch.randn(MATMUL_SIZE, MATMUL_SIZE, device=device, dtype=dtype)
    dist.barrier()
    matmul_s = in_lockstep(lambda: a @ b, repeats, sync)
    probes, flops_of = compute_probes(device, dtype, sizes)
    rounds = lockstep_rounds(probes, repeats, sync)
    each = [compute_figures(dict(zip(rounds, seconds)), flops_of, sizes) for seconds in zip(*rounds.values())]
    figures = {key: statistics.median(r[key] for r in each) for key in each[0]}
    reduces = {}
    for size in SIZES:
        x = torch.zeros(max(size // 4, 1), device=device)
        dist.barrier()
        reduces[size] = timed(lambda x=x: dist.all_reduce(x), repeats, sync)
    calls, overlap, pipeline = {}, 1.0, 0.0  # one rank: no messages, nothing to hide, no pipeline
    if dist.get_world_size() > 1:
        pair, world = op_groups()
        calls = op_latencies(device, sync, repeats, pair, world)
        overlap = overlap_share(a, b, matmul_s, sync, repeats) if spare_cores(device) else 0.0
        pipeline = in_lockstep(pipeline_probe(pair, device, dtype), repeats, sync)
    return {
        **figures,
        "reduces": reduces,
        "calls": calls,
        "overlap": overlap,
        "pipeline_s": pipeline,
        "pipeline_stages": op_ranks(dist.get_world_size()),
        "dtype": str(dtype).removeprefix("torch."),
        "device": device.type,
        "name": torch.cuda.get_device_name(device) if device.type == "cuda" else f"{os.uname().nodename}-rank",
        "memory_bytes": torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else 0,
        "linear": "x".join(map(str, sizes.linear)),
    }


def fit_link(times: dict[int, float], calls: dict[str, tuple[tuple[float, float], ...]], n: int) -> Link:
    """The all-reduce's bandwidth from the slope between the two largest all-reduces (their
    difference in wire bytes over their difference in time); each op's own bandwidth from the
    slope between its two `MESSAGES` (gloo's all-gather, reduce-scatter and all-to-all move
    their bytes several times slower than its all-reduce), and its per-hop latency from its
    smaller call less its bytes at that bandwidth, over the hops of the pairs it was timed on
    (`op_ranks`; gloo's calls of a few kilobytes cost several times a one-element call's; the
    one-element all-reduce's over the world is `latency_us`, what the step's control all-reduces
    pay)."""
    factor = 2 * (n - 1) / n
    big, bigger = sorted(times)[-2:]
    seconds = max(times[bigger] - times[big], 1e-12)
    bandwidth = factor * (bigger - big) / seconds
    rates, hops = {}, {}
    for op in OPS:
        (t_small, w_small), (t_large, w_large) = calls[op]
        slope = (w_large - w_small) / (t_large - t_small) if t_large > t_small else bandwidth
        rates[op] = min(slope, bandwidth * SLOWEST_FACTOR) if op != "all_reduce" else bandwidth
        hops[op] = max(t_small - w_small / rates[op], 0.0) / hops_of(op, op_ranks(n)) * 1e6
    return Link(
        bandwidth_gbps=bandwidth / 1e9,
        latency_us=calls["scalar"][0][0] / hops_of("all_reduce", n) * 1e6,
        op_latency_us=tuple(hops.items()),
        op_bandwidth_gbps=tuple((op, rate / 1e9) for op, rate in rates.items() if op != "all_reduce"),
    )


def op_ranks(n: int) -> int:
    """The ranks each op's calls were timed on in a world of `n` (`op_groups`)."""
    return n if n <= 2 or n % 2 else 2


def slowest_calls(ranks: list[dict]) -> dict[str, tuple[tuple[float, float], ...]]:
    """`op_latencies` of every rank as one: each call's slowest rank's seconds, and its bytes."""
    first = ranks[0]
    return {
        op: tuple((max(r[op][i][0] for r in ranks), wire) for i, (_, wire) in enumerate(sizes))
        for op, sizes in first.items()
    }


RANKS_A_CORE = 2  # the most ranks a CPU core is shared by in a calibration (benchmarks/plan_check.py checked
# the planner against 4-rank runs on 2 cores, calibrated with 4 ranks: the rates of ranks sharing cores)


def rank_room(device: str = "auto") -> tuple[int, str]:
    """The most ranks a calibration of this machine on `device` runs at once, and the machine's
    figure in words: on a GPU host its GPUs (a rank each: `fivecut.launch.spawn` would put more on
    the CPU, which is not the device being calibrated); on a CPU host, or with `device` "cpu",
    RANKS_A_CORE a core (its rates are measured with every rank busy, `cores_per_node`; more ranks
    than that measure the scheduler, not the cores)."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus and device != "cpu":
        return gpus, f"{gpus} GPU{'s' if gpus > 1 else ''} (one a rank)"
    cores = len(os.sched_getaffinity(0))
    return RANKS_A_CORE * cores, f"{cores} CPU core{'s' if cores > 1 else ''} (at most {RANKS_A_CORE} ranks a core)"


def data_sheet_peak(name: str) -> float | None:
    """The dense bf16 peak (TFLOP/s) of the preset whose name is in a GPU's (`NVIDIA H200` ->
    `H200`'s), so that a calibrated plan's MFU is of the data sheet; None for a GPU without one."""
    found = [key for key in DEVICES if key in name.upper()]
    return DEVICES[max(found, key=len)].peak_tflops if found else None


class CalibrationError(ValueError):
    """A calibration that cannot measure what it was asked to; the message says why."""


def device_of(asked: str, ranks: int) -> tuple[str, float]:
    """The kind of device a calibration of `ranks` ranks measures (`fivecut.launch.spawn`'s
    choice for `asked`: "auto", "cpu" or "cuda") and one rank's memory in bytes: a GPU's own, or
    the host's over its ranks."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if asked == "cuda" and not gpus:
        why = "torch has no CUDA build" if torch.version.cuda is None else "torch sees no GPU on this host"
        raise CalibrationError(f"--device cuda: {why}; give --device cpu (or auto) to calibrate this CPU")
    if asked == "cuda" and ranks > gpus:
        raise CalibrationError(f"--device cuda: {ranks} ranks on {gpus} GPU(s); give --ranks {gpus} or fewer")
    kind = "cuda" if asked == "cuda" or (asked == "auto" and 0 < ranks <= gpus) else "cpu"
    if kind == "cuda":
        return kind, float(torch.cuda.get_device_properties(0).total_memory)
    return kind, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / ranks


def calibrate(
    ranks: int, repeats: int = REPEATS, device: str = "auto", model: ModelArgs | None = None, seq: int | None = None
) -> tuple[Cluster, dict]:
    """This machine as a one-node cluster of `ranks` ranks on `device` ("auto", "cpu", "cuda"), its
    probes sized for that device (`probe_sizes`, from `model` at `seq` where given), and the raw
    measurements."""
    kind, memory = device_of(device, ranks)
    if kind == "cpu" and (model is not None or seq is not None):
        raise CalibrationError(
            "--model and --seq size a GPU's probes; this calibration measures the CPU, whose probes have the "
            "sizes benchmarks/plan_check.py checks the planner at: leave them out"
        )
    sizes = probe_sizes(kind, memory, model, seq)
    results = spawn(measure_rank, ranks, repeats, sizes, timeout_s=600.0, device=kind)
    slowest = min(r["flops"] for r in results)
    times = {size: max(r["reduces"][size] for r in results) for size in SIZES}
    calls = slowest_calls([r["calls"] for r in results]) if ranks > 1 else {}
    link = fit_link(times, calls, ranks) if ranks > 1 else Link(1e3, 0.0)
    memory_gb = min(r["memory_bytes"] for r in results) / 1e9 if kind == "cuda" else memory / 1e9
    peak = data_sheet_peak(results[0]["name"]) if kind == "cuda" else None
    device = Device(
        name=results[0]["name"],
        peak_tflops=peak or slowest / 1e12,
        memory_gb=memory_gb,
        achievable=min(slowest / 1e12 / peak, 1.0) if peak else 1.0,
        kernel_us=max(r["kernel_s"] for r in results) * 1e6,
        recompute_us=max(r["recompute_s"] for r in results) * 1e6,
        memory_gbps=min(r["memory_bps"] for r in results) / 1e9,
        tensor_us=max(r["tensor_s"] for r in results) * 1e6,
        overlap=min(r["overlap"] for r in results),
        attention_tflops=min(r["attention_flops"] for r in results) / 1e12,
        activation_gbps=min(r["activation_bps"] for r in results) / 1e9,
        loss_gbps=min(r["loss_bps"] for r in results) / 1e9,
        source=f"fivecut plan calibrate: a {results[0]['linear']} {results[0]['dtype']} linear layer's matmuls on "
        f"{ranks} ranks at once; probes: {sizes.describe()}",
    )
    cores = 0 if results[0]["device"] == "cuda" else len(os.sched_getaffinity(0))  # a CPU's ranks share its cores
    cluster = Cluster(1, ranks, device, link, link, name="this-machine", cores_per_node=cores)
    pipeline = max(r["pipeline_s"] for r in results)
    action = action_seconds(pipeline, cluster, results[0]["pipeline_stages"])
    cluster = replace(cluster, device=replace(device, action_us=action * 1e6))
    return cluster, {
        "flops": [r["flops"] for r in results],
        "kernel_s": [r["kernel_s"] for r in results],
        "all_reduce_s": times,
        "call_s": calls,
    }
