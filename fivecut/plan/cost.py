"""What one layout costs on a cluster: memory per rank, communication per cut, step time.

Memory and communication are the closed forms `fivecut ledger` checks against a real step
(`fivecut.plan.memory`, `fivecut.plan.activations`, `fivecut.plan.buffers`, `fivecut.plan.volume`:
model states, activations, the data cut's buffers, messages), applied to the
records of the real cuts built on the meta device under a virtual mesh; only the time is a
model. For rank 0 of the layout (pipeline position 0 for memory; see `peak_rank`):

    compute     forward FLOPs of every microbatch through this rank's stages (2 x matmul
                parameters per token; MoE layers: router, top-k routed and shared experts),
                backward 2x forward (split: B = W = 1x), recomputation adds the forward it
                repeats, at the device's achievable rate; the attention core's (4 s w a token,
                causal: half) at the attention kernel's rate (`Device.attention_flops`);
                plus a fixed `kernel_us` per kernel: `KERNELS_PER_LAYER` forward kernels a block
                (norms, projections, RoPE, attention, SwiGLU, residuals; a MoE block adds its
                router and dispatch, `KERNELS_MOE`, and `KERNELS_PER_EXPERT` for each routed expert
                the rank holds), `KERNELS_OUTSIDE` for the embedding, final norm, head and loss on
                the stages holding them, the backward 2x (split: B = W = 1x); a fully recomputed
                block runs its forward kernels again at `recompute_us` each (under the
                checkpoint's saved-tensor hooks); this per-op cost dominates tiny models (and
                CPUs), and is a few microseconds on GPUs;
                plus the memory-bound kernels' traffic: the bytes each block saves for backward
                (`fivecut.plan.activations`) written, read back and their gradient written, at
                `Device.activation_bps`, on the last stage the cross-entropy's passes over
                the logits (`LOSS_BYTES` a logit, vocab-parallel under TP) at `Device.loss_bps`,
                and on the first the embedding's dense [V, h] gradient each microbatch
                (`EMBEDDING_GRAD_BYTES` an element, but under a split backward) at `memory_gbps`,
                and under the chunked loss each chunk's head gradient added into the fp32 one
                (`CHUNK_GRAD_BYTES` an element) at `memory_gbps`; `stage_terms` gives each part
    bubble      fivecut's own schedule simulator (`pipeline.simulate`) with the stages' mean
                F, B, W costs (each with a fixed `Device.action_us`: what the executor's action
                costs beyond its kernels, measured on a real `PipelineStep` by calibration) and
                each boundary message's alpha-beta time as its latency gives
                a rank's idle time; the pipeline takes the busiest rank's compute + that idle
                time (stages of unequal cost: the one with the head sets the pace); on a CPU
                host whose ranks share its cores (`Cluster.cores_per_node`) the ranks waiting in
                the bubble, or in the exposed collectives of a group smaller than their node
                (`apart_share`), leave their cores to the computing ones (`shared_cores`)
    collectives alpha-beta on the link each group crosses (`Cluster.link_for` of its ranks):
                NVLink inside a node, the network across nodes; every call
                (`fivecut.plan.calls`, the counts `fivecut ledger` shows) pays its op's latency
                hops (`Link.latency`: gloo's all-gather, reduce-scatter, all-to-all and send
                each have their own), the bytes go at the link's bandwidth (an op's own, where
                the link gives one: `wire_seconds`)
    overlap     DP / ZeRO-1/2 gradient reduction hidden behind the backward up to its length;
                ZeRO-1/2's gathers of the updated shards behind the next step's first forward,
                but for the first bucket's, which the forward waits for (`data_exposed`);
                ZeRO-3 gathers prefetched behind the compute up to its length; ring attention's
                K/V passes behind the attention's compute; TP, Ulysses, EP not overlapped; each
                at most `Device.overlap` of that compute (NCCL: 1, its own SMs; gloo on ranks
                that fill the CPU's cores: near 0, the collective needs the cores computing)
    tail        after the backward: gradient clipping and AdamW over rank 0's parameters (ZeRO:
                its shards), memory-bound (`TAIL_BYTES` a parameter at `memory_gbps`) + a fixed
                `tensor_us` per tensor (ZeRO: per flat piece); the casts of the weights to the
                compute dtype and of their gradients back (`CAST_BYTES` a byte of the copies the
                memory plan holds, at `memory_gbps`); and the latency of the step's small
                all-reduces (loss, stop flags, the gradient norm's groups)

Step time = the pipeline (compute, boundary messages and bubble) + the exposed collectives +
the tail. MFU = the model's FLOPs per token (6N + 12 L h s, `ModelArgs`) x tokens per step /
(world x peak x step time).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fivecut.mesh import Mesh
from fivecut.model.lora import EXPERTS, TARGET_GROUPS, adapter_cut, block_targets, expert_adapter_elements
from fivecut.parallel.pipeline.schedule import boundary_frontier, peak_in_flight
from fivecut.parallel.pipeline.simulate import compiled, timed
from fivecut.plan.activations import (
    activation_bytes_per_layer,
    deferred_bytes_per_layer,
    layer_mode,
    loss_peak_bytes,
    norm_bytes,
    precision_of,
    weight_copies,
)
from fivecut.plan.buffers import buffer_bytes, loss_moment_buffers
from fivecut.plan.calls import step_calls, step_collective_calls
from fivecut.plan.cluster import Cluster
from fivecut.plan.memory import FP32_BYTES, kernels_of, model_state_bytes, step_moments, step_temporaries
from fivecut.plan.volume import (
    dims_key,
    frozen_bytes,
    local_param_counts,
    local_placements,
    message_bytes,
    model_token,
    pipeline_plan,
    predict,
    remembered,
    shard_group_sizes,
    virtual_mesh,
)

GROUP_OF_CUT = {"dp": "dp_cp", "tp": "tp", "cp": "cp", "ep": "ep", "etp": "etp", "pp": "pp"}  # each cut's mesh group
KERNELS_PER_LAYER = 30  # forward kernels of a block (~42 top-level aten ops: `kernel_us` is measured per 30)
# a MoE block's router, top-k, dispatch, combine and routed experts beyond a dense block's: the experts
# run as three grouped GEMMs and one SwiGLU whatever their number (the profiler counts 50 top-level aten
# ops in tiny-moe's MoE layer with 4, 8 or 16 local experts; the per-expert loop had 51 + 10 an expert):
# the 22 of the router and dispatch, plus the 6 that one expert of the loop cost
KERNELS_MOE = 28
KERNELS_PER_EXPERT = 0  # each routed expert a rank holds: nothing more since the grouped GEMMs
KERNELS_OUTSIDE = 10  # embedding, final norm, head, cross-entropy (forward)
# memory traffic of AdamW a parameter (`train.adamw`): fused reads the parameter, its gradient and
# both moments and writes all but the gradient once (7 fp32 passes); foreach makes ~16 passes
ADAMW_BYTES = {"fused": 28, "foreach": 64}
CLIP_BYTES = 12  # the gradient norm (one read, multi-tensor) and the scale (read + write), fp32
TAIL_BYTES = ADAMW_BYTES["fused"] + CLIP_BYTES  # what calibration's tail (the default kernel) moves a parameter
EMBEDDING_GRAD_BYTES = 16  # an embedding element's fp32 passes a backward: the dense [V, h] gradient zeroed,
# then added into `.grad` (read both, write); the lookup's scatter of the microbatch's rows is negligible
CAST_BYTES = 6  # bytes moved a byte of a bf16 weight copy: the cast from fp32 (3) and its gradient's back (3)
CHUNK_GRAD_BYTES = 10  # a head element a chunk of the chunked loss: its bf16 gradient read, the fp32 one
# read and written (benchmarks/results/gpu.md, "One H200": 2048-token chunks cost 1.9% of llama-1b's step)
LOSS_BYTES = 16  # a logit's fp32 passes in the cross-entropy: the log-sum-exp's read, the gradient's
# write, read and scale  # a parameter's bytes in a step's tail (clipping, then AdamW)
HIDDEN = {  # how much of a cut's time hides behind compute, and behind which
    "dp": "reduction behind the backward; ZeRO-1/2's gathers behind the next forward (not the first "
    "bucket's); ZeRO-3's prefetched behind the compute",
    "cp": "ring: behind the attention's compute; Ulysses: not hidden",
    "tp": "not hidden",
    "ep": "not hidden",
    "etp": "not hidden",
    "pp": "in the simulated pipeline (each message's alpha-beta time is its latency)",
}


@dataclass
class CutTime:
    cut: str
    wire_bytes: float  # per rank per step (`fivecut ledger`'s measure)
    link: str  # "intra" | "inter"
    seconds: float  # alpha-beta time, all of it: each call's latency + the bytes at the bandwidth
    exposed: float  # what is left after the overlap rule
    rule: str


@dataclass
class LayoutCost:
    world: int
    memory: dict[str, float]  # params, grads, optimizer, activations, total (bytes, rank `memory_rank`)
    memory_rank: int  # the pipeline position that holds the most
    fits: bool
    compute: float  # seconds of F, B, W on rank 0 per step
    makespan: float  # the simulated pipeline (or the compute alone without a pipeline)
    bubble: float
    cuts: list[CutTime] = field(default_factory=list)
    optimizer: float = 0.0  # seconds of the step's tail: AdamW, clipping, the loss/flags/norm all-reduces
    calls: dict[str, dict[str, float]] = field(default_factory=dict)  # cut -> op -> collective calls per step
    step: float = 0.0
    mfu: float = 0.0
    tokens_per_s: float = 0.0
    traffic: dict[str, float] = field(default_factory=dict)  # link class -> wire bytes per rank per step
    compute_terms: dict[str, float] = field(default_factory=dict)  # `compute` by what spends it (`rank_terms`)
    staging: float = 0.0  # host bytes a background save holds on a rank (`staging_bytes`), not device memory


def layer_matmul_flops(args, layer_id: int) -> float:
    """Forward matmul FLOPs per token of block `layer_id`: 2 x the matmul parameters one token
    passes through (a MoE block: the router, its top-k routed and its shared experts)."""
    attention = args.attention_matmul_params()
    if args.moe_layer(layer_id):
        experts = (args.top_k + args.n_shared_experts) * 3 * args.dim * args.expert_dim
        mlp = args.dim * args.n_experts + experts
    else:
        mlp = 3 * args.dim * args.ffn_dim
    return 2 * (attention + mlp)


def attention_flops(args, seq: int) -> float:
    """Forward FLOPs per token of the attention core: scores and values, 2 x 2 s w, half of them
    masked (causal); w = `attention_width` (h, or under multi-head latent attention H (qk + v) / 2)."""
    return 2 * seq * args.attention_width


def layer_forward_flops(args, layer_id: int, seq: int) -> float:
    """Forward FLOPs per token of block `layer_id`: its matmuls and its attention core."""
    return layer_matmul_flops(args, layer_id) + attention_flops(args, seq)


def stage_compute(
    args,
    layers: range,
    last: bool,
    tokens: int,
    seq: int,
    recompute: tuple[str, int],
    embedding: bool = False,
    loss_chunks: int = 0,
    lora: LoraWork | None = None,
) -> dict:
    """FLOPs of `tokens` tokens through a stage: F and B of the matmuls (backward 2x forward,
    with the forward a recomputation repeats) and of the attention core (`attention_F`,
    `attention_B`: it runs on its own kernel, at `Device.attention_flops`); on the last stage
    the bytes the cross-entropy moves over the logits (`loss_F`, `loss_B`: `LOSS_BYTES` a logit);
    with `embedding` (the first stage, `dense_embedding`), the bytes the embedding's backward
    moves over its dense [V, h] gradient (`embedding_B`: `EMBEDDING_GRAD_BYTES` an element, each
    microbatch, at `Device.memory_gbps`); a loss in `loss_chunks` chunks (the chunked loss, 0: the
    full logits) adds each chunk's [V, h] head gradient into the fp32 one (`head_B`: `CHUNK_GRAD_BYTES`
    an element, at `Device.memory_gbps`). With `lora` ([lora]) the frozen weights make no dW: their
    backward is their dx alone (1x forward), the adapters' products add 1x forward and 2x backward,
    a frozen head's dW is skipped too."""
    matmuls = sum(layer_matmul_flops(args, i) for i in layers) * tokens
    core = attention_flops(args, seq) * tokens * len(layers)
    mode, every = recompute
    repeated = repeated_core = 0.0
    for i in layers:
        kind = layer_mode(i, mode, every)
        if kind == "full":
            repeated += layer_matmul_flops(args, i) * tokens
        if kind in ("full", "selective"):  # selective: the attention core (and the SwiGLU product)
            repeated_core += attention_flops(args, seq) * tokens
    logits = args.vocab_size * tokens if last else 0
    matmuls += 2 * args.dim * logits
    backward = 2 * matmuls
    if lora is not None:
        adapters = sum(lora.flops[i] for i in layers) * tokens
        head_dw = 2 * args.dim * logits if lora.head_trained else 0
        repeated += sum(lora.flops[i] for i in layers if layer_mode(i, mode, every) == "full") * tokens
        matmuls, backward = matmuls + adapters, matmuls + 2 * adapters + head_dw
    return {
        "F": matmuls,
        "B": backward + repeated,
        "attention_F": core,
        "attention_B": 2 * core + repeated_core,
        "loss_F": LOSS_BYTES * logits / 3,  # the loss's passes over the logits: a third forward
        "loss_B": LOSS_BYTES * logits * 2 / 3,
        "embedding_F": 0.0,
        "embedding_B": EMBEDDING_GRAD_BYTES * args.vocab_size * args.dim if embedding else 0.0,
        "head_F": 0.0,
        "head_B": CHUNK_GRAD_BYTES * args.vocab_size * args.dim * loss_chunks if last else 0.0,
        "recomputed": repeated + repeated_core,
    }


@dataclass(frozen=True)
class LoraWork:
    """[lora] as the step's FLOPs see it: each block's adapter FLOPs a token (forward), and whether
    the head trains (its dW)."""

    flops: tuple[float, ...]  # by layer id
    head_trained: bool

    @staticmethod
    def of(args, cfg) -> LoraWork | None:
        lo = cfg.lora
        if lo.rank is None:
            return None
        flops = tuple(adapter_flops(args, i, lo.targets, lo.rank) for i in range(args.n_layers))
        return LoraWork(flops, head_training(args, cfg)[0])


def adapter_flops(args, layer_id: int, targets: list[str], rank: int) -> float:
    """Forward FLOPs a token of block `layer_id`'s adapters: x A then (x A) B, 2 r (in + out) for
    each adapted linear; for each of the top_k experts a token visits, its gate/up A, the two B's
    and down's A and B (`LoRAExperts`)."""
    linears = sum(2 * rank * (n_in + n_out) for _, n_in, n_out in block_targets(args, layer_id, tuple(targets)))
    if not (args.moe_layer(layer_id) and EXPERTS in targets):
        return linears
    return linears + args.top_k * 2 * rank * (2 * args.dim + 3 * args.expert_dim)


def block_forward_kernels(args, layer_id: int, experts: int = 0) -> int:
    """Kernels of block `layer_id`'s forward; a MoE block's router and dispatch add theirs, and
    each of the `experts` routed experts the rank holds `KERNELS_PER_EXPERT` (none: grouped GEMMs)."""
    if not args.moe_layer(layer_id):
        return KERNELS_PER_LAYER
    return KERNELS_PER_LAYER + KERNELS_MOE + KERNELS_PER_EXPERT * experts


def block_kernels(args, layer_id: int, experts: int = 0) -> int:
    """Kernels of block `layer_id`'s forward and backward (2x)."""
    return 3 * block_forward_kernels(args, layer_id, experts)


def stage_kernels(args, layers: range, first: bool, last: bool, recompute: tuple[str, int], experts: int = 0) -> dict:
    """Kernels of one microbatch through a stage whose MoE blocks hold `experts` routed experts each:
    {"F": forward, "B": backward, "R": the forward kernels a full recomputation runs again in backward}."""
    mode, every = recompute
    forward = {i: block_forward_kernels(args, i, experts) for i in layers}
    outside = KERNELS_OUTSIDE * (first + last) / 2
    again = sum(k for i, k in forward.items() if layer_mode(i, mode, every) == "full")
    return {"F": sum(forward.values()) + outside, "B": 2 * (sum(forward.values()) + outside), "R": again}


def stage_traffic(args, cfg, layers: range, rows: int) -> dict:
    """Activation bytes the memory-bound kernels of a stage move for one microbatch of `rows`
    sequences: what its blocks save for backward (`block_bytes` without recomputation) is
    written once in the forward, read and its gradient written in the backward; a fully
    recomputed block writes it once more."""
    t = cfg.train
    precision = precision_of(t.dtype, cfg.parallel.zero)
    seq = t.seq_len // cfg.parallel.cp
    forward = backward = 0.0
    for i in layers:
        saved = block_bytes(args, cfg, rows, seq, precision, i, mode="none")
        forward += saved
        backward += saved * (3 if layer_mode(i, t.recompute, t.recompute_every) == "full" else 2)
    return {"F": forward, "B": backward}


def stage_seconds(works: dict, kernels: dict, traffic: dict, cut: int, cluster: Cluster) -> dict:
    """F and B seconds of a stage: the sum of its `stage_terms`."""
    terms = stage_terms(works, kernels, traffic, cut, cluster)
    return {k: sum(terms[k].values()) for k in ("F", "B")}


def stage_terms(works: dict, kernels: dict, traffic: dict, cut: int, cluster: Cluster) -> dict:
    """F and B seconds of a stage by what spends them: matmul FLOPs (divided over `cut` TP ranks)
    at the achievable rate ("matmuls"), the attention core's at the attention kernel's
    ("attention"), the cross-entropy's passes over the logits (vocab-parallel under TP) at the
    loss's rate ("loss"), kernels x kernel_us ("kernels"), the activations' traffic at the rate a
    block's memory-bound kernels move it ("activations"), the embedding's dense gradient at
    `memory_gbps` ("embedding"), a chunked loss's accumulation of its chunks' head gradients at
    `memory_gbps` ("loss_chunks"), and in B the kernels of a fully recomputed forward at
    `recompute_us` ("recompute")."""
    d = cluster.device
    terms = {
        k: {
            "matmuls": works[k] / cut / d.flops,
            "attention": works[f"attention_{k}"] / cut / d.attention_flops,
            "loss": works[f"loss_{k}"] / cut / d.loss_bps,
            "kernels": kernels[k] * d.kernel_us * 1e-6,
            "activations": traffic[k] / d.activation_bps,
            "embedding": works[f"embedding_{k}"] / cut / (d.memory_gbps * 1e9),
            "loss_chunks": works[f"head_{k}"] / cut / (d.memory_gbps * 1e9),
        }
        for k in ("F", "B")
    }
    terms["F"]["recompute"] = 0.0
    terms["B"]["recompute"] = kernels["R"] * d.recompute_s
    return terms


def cost_layout(args, cfg, cluster: Cluster, records=None) -> LayoutCost:
    """`records`: where the data cut's flat buffers come from (`fivecut.plan.volume.predict`)."""
    dims, t = cfg.parallel, cfg.train
    world = dims.world_size
    mesh = virtual_mesh(dims, args.is_moe)
    rows = t.global_batch // (dims.dp * t.accumulate)  # sequences per rank per micro-step
    microbatches = dims.microbatches if dims.pp > 1 else 1
    seq_local = t.seq_len // dims.cp
    tokens_mb = rows // microbatches * seq_local  # per microbatch, per rank
    pipe = pipeline_time(args, cfg, cluster, mesh, tokens_mb)
    compute, makespan = pipe.compute * t.accumulate, pipe.makespan * t.accumulate
    counts = local_param_counts(args, cfg, records=records)
    calls = step_collective_calls(args, cfg, (records or local_placements)(args, cfg, 0))
    cuts = collective_times(args, cfg, cluster, mesh, compute, calls, records)
    exposed = sum(c.exposed for c in cuts if c.cut != "pp")
    waits = sum(
        c.exposed * apart_share(cluster, c.cut, calls.get(c.cut, {}), dims, mesh) for c in cuts if c.cut != "pp"
    )
    faster = shared_cores(cluster, pipe.busy * t.accumulate / (makespan + waits))
    compute, makespan = compute * faster, makespan * faster
    memory, rank = peak_memory(args, cfg, pipe.layers, kernels_of(cluster))
    tail = optimizer_seconds(args, cfg, cluster, counts, records) + tail_collectives(args, cfg, cluster)
    tail += cast_seconds(memory["weight_copies"], cluster)
    step = makespan + exposed + tail
    tokens = t.global_batch * t.seq_len
    traffic: dict[str, float] = {}
    for c in cuts:
        traffic[c.link] = traffic.get(c.link, 0.0) + c.wire_bytes
    return LayoutCost(
        world=world,
        memory=memory,
        memory_rank=rank,
        fits=memory["total"] <= cluster.device.memory_gb * 1e9,
        compute=compute,
        makespan=makespan,
        bubble=pipe.bubble,
        cuts=cuts,
        optimizer=tail,
        calls=calls,
        step=step,
        mfu=model_flops(args, t.seq_len) * tokens / (world * cluster.device.peak_tflops * 1e12 * step),
        tokens_per_s=tokens / step,
        traffic=traffic,
        compute_terms=rank_terms(args, cfg, cluster, tokens_mb, compute),
        staging=staging_bytes(args, cfg),
    )


def rank_terms(args, cfg, cluster: Cluster, tokens_mb: int, compute: float) -> dict[str, float]:
    """Rank 0's `compute` seconds a step by what spends them (`stage_terms` of its stages, every
    microbatch and micro-step; a pipeline's stages add their actions, `Device.action_us` each),
    scaled to sum to `compute` (a CPU's shared cores, `shared_cores`, speed them all alike)."""
    dims, t = cfg.parallel, cfg.train
    if dims.pp == 1:
        stages, actions, repeats = [(range(args.n_layers), True, True)], 0, 1
    else:
        schedule, layers = pipeline_plan(args, cfg)
        last = schedule.n_stages - 1
        stages = [(layers[s], s == 0, s == last) for s in range(last + 1) if schedule.stage_rank[s] == 0]
        actions, repeats = compute_actions(schedule, 0), dims.microbatches
    terms: dict[str, float] = {}
    for layers, first, last in stages:
        for part in stage_terms(*stage_work(args, cfg, layers, first, last, tokens_mb), dims.tp, cluster).values():
            for name, seconds in part.items():
                terms[name] = terms.get(name, 0.0) + seconds * repeats * t.accumulate
    terms["actions"] = actions * cluster.device.action_us * 1e-6 * t.accumulate
    total = sum(terms.values())
    return {name: seconds * compute / total for name, seconds in terms.items()} if total > 0 else terms


def model_flops(args, seq: int) -> float:
    """`ModelArgs.flops_per_token`, once per model and sequence (it counts every parameter)."""
    key = (model_token(args), seq)
    if key not in MODEL_FLOPS:
        remembered(MODEL_FLOPS, key, args.flops_per_token(seq), STAGES_KEPT)
    return MODEL_FLOPS[key]


MODEL_FLOPS: dict[tuple, float] = {}


@dataclass
class PipelineTime:
    """A micro-step's compute at the rates calibrated with every rank busy (before `shared_cores`)."""

    compute: float  # seconds of F, B, W on rank 0
    makespan: float  # the simulated pipeline (the compute alone without one)
    bubble: float  # a rank's idle share of the makespan
    busy: float  # the mean rank's compute
    layers: dict[int, list[range]]  # each pipeline rank's stages (for memory)


def pipeline_time(args, cfg, cluster: Cluster, mesh: Mesh, tokens_mb: int) -> PipelineTime:
    """Rank 0's compute a micro-step, the simulated makespan and its bubble."""
    dims = cfg.parallel
    cut = dims.tp  # TP divides every matmul; EP moves tokens, not FLOPs
    if dims.pp == 1:
        timed = stage_seconds(*stage_work(args, cfg, range(args.n_layers), True, True, tokens_mb), cut, cluster)
        seconds = timed["F"] + timed["B"]
        return PipelineTime(seconds, seconds, 0.0, seconds, {0: [range(args.n_layers)]})
    schedule, layers = pipeline_plan(args, cfg)
    last = schedule.n_stages - 1
    works = [stage_work(args, cfg, layers[s], s == 0, s == last, tokens_mb) for s in range(last + 1)]
    action = cluster.device.action_us * 1e-6  # an F, B, W of a microbatch on a stage: each one action
    backwards = 2 if schedule.split_backward else 1
    times = [
        {"F": x["F"] + action, "B": x["B"] + backwards * action}
        for x in (stage_seconds(*work, cut, cluster) for work in works)
    ]
    f = sum(x["F"] for x in times) / len(times)  # the stages' mean: the schedule's idle time
    b = sum(x["B"] for x in times) / len(times)
    message = tokens_mb * args.dim * message_bytes(cfg)[0] / (dims.tp if dims.sp else 1)  # the residual stream's
    pp_group = mesh.group("pp")
    latency = cluster.link_for(pp_group.ranks).seconds("send", message, 2)
    if schedule.split_backward:
        timeline = simulated(schedule, f, b / 2, b / 2, latency)
    else:
        timeline = simulated(schedule, f, b, None, latency)
    busy = [
        sum(times[s]["F"] + times[s]["B"] for s in range(last + 1) if schedule.stage_rank[s] == r)
        for r in range(dims.pp)
    ]
    idle = timeline.makespan * timeline.bubble  # a rank's mean idle time under the mean costs
    makespan = max(busy) * dims.microbatches + idle  # the busiest rank's compute sets the pace
    mean = sum(busy) / len(busy) * dims.microbatches
    return PipelineTime(busy[0] * dims.microbatches, makespan, idle / makespan, mean, layers_by_rank(args, cfg))


def compute_actions(schedule, rank: int) -> int:
    """The F, B and W actions of `rank` in a step of `schedule` (`Device.action_us` each)."""
    return sum(a.kind in ("F", "B", "W") for a in schedule.actions[rank])


def shared_cores(cluster: Cluster, busy_share: float) -> float:
    """What a step's compute is multiplied by when a node's ranks share its `cores_per_node` CPU
    cores: the rates were calibrated with every rank busy, and a rank waiting (in the pipeline's
    bubble, or in a collective of fewer ranks than its node, `apart_share`) leaves its core to the
    computing ones, which then run as if `busy_share` of the node's ranks shared the cores (never
    faster than a core each). GPUs (0 cores): 1."""
    cores, ranks = cluster.cores_per_node, cluster.gpus_per_node
    if not cores or ranks <= cores:
        return 1.0
    return max(busy_share, cores / ranks)


def apart_share(cluster: Cluster, cut: str, ops: dict[str, float], dims, mesh: Mesh) -> float:
    """The share of `cut`'s calls (`ops`: op -> calls a step) in which a waiting rank can leave its
    core to ranks that compute meanwhile: calls spanning fewer ranks than its node (`call_ranks`:
    the other TP pairs of dp=2,tp=2 on one node run their own layers while a pair all-reduces;
    USP's all-to-alls go over its Ulysses pairs). A call spanning the whole node waits as one."""
    node = min(cluster.gpus_per_node, cluster.world_size)
    size = len(mesh.group(GROUP_OF_CUT[cut]).ranks)
    total = sum(ops.values())
    if not total:
        return float(size < node)
    return sum(n for op, n in ops.items() if call_ranks(cut, op, dims, size) < node) / total


def stage_work(args, cfg, layers: range, first: bool, last: bool, tokens_mb: int) -> tuple[dict, dict, dict]:
    """A stage's FLOPs, kernels and activation traffic for one microbatch of `tokens_mb` tokens
    (`stage_compute`, `stage_kernels`, `stage_traffic`), once per stage and the fields they read:
    a search costs the same stages under many data cuts and clusters."""
    d, t = cfg.parallel, cfg.train
    key = (model_token(args), layers.start, layers.stop, first, last, tokens_mb, t.seq_len, t.dtype, d.zero >= 3)
    key += (t.recompute, t.recompute_every, d.tp, d.sp, d.cp, d.cp_mode, d.cp_ulysses, d.etp, d.ep, t.loss_chunk_tokens)
    key += (repr(cfg.lora),)
    if key not in STAGE_WORK:
        recompute = (t.recompute, t.recompute_every)
        rows = tokens_mb // (t.seq_len // d.cp)  # sequences per microbatch
        work = (
            stage_compute(
                args,
                layers,
                last,
                tokens_mb,
                t.seq_len,
                recompute,
                first and dense_embedding(args, cfg),
                chunks_of(t.loss_chunk_tokens, tokens_mb) if head_training(args, cfg)[0] else 0,
                LoraWork.of(args, cfg),
            ),
            stage_kernels(args, layers, first, last, recompute, args.n_experts // d.ep),
            stage_traffic(args, cfg, layers, rows),
        )
        remembered(STAGE_WORK, key, work, STAGES_KEPT)
    return STAGE_WORK[key]


def chunks_of(chunk_tokens: int, tokens_mb: int) -> int:
    """Chunks of the chunked loss over a microbatch of `tokens_mb` tokens (0: the full logits)."""
    return -(-tokens_mb // chunk_tokens) if chunk_tokens > 0 else 0


def dense_embedding(args, cfg) -> bool:
    """Whether the embedding's backward writes a dense [V, h] gradient each microbatch: not under a
    split backward (zero-bubble schedules: W adds the rows a microbatch looked up, `wgrad`), nor
    for a frozen embedding ([lora] without "embeddings" in lora.full)."""
    if cfg.lora.rank is not None and "embeddings" not in cfg.lora.full:
        return False
    return cfg.parallel.pp == 1 or not pipeline_plan(args, cfg)[0].split_backward


STAGE_WORK: dict[tuple, tuple] = {}
STAGES_KEPT = 1 << 16  # stages `stage_work` remembers (the oldest forgotten first)


def layers_by_rank(args, cfg) -> dict[int, list[range]]:
    """The layers of each pipeline position's stages (one stage of every layer without a pipeline);
    once per pipeline plan. Shared: read it only."""
    if cfg.parallel.pp == 1:
        return {0: [range(args.n_layers)]}
    schedule, layers = plan = pipeline_plan(args, cfg)
    key = id(plan)  # `pipeline_plan`'s entries are kept for the process: an id is not reused
    if key not in RANK_LAYERS:
        owner = schedule.stage_rank
        by_rank = {r: [layers[s] for s in range(schedule.n_stages) if owner[s] == r] for r in range(cfg.parallel.pp)}
        remembered(RANK_LAYERS, key, (plan, by_rank), CACHED)
    return RANK_LAYERS[key][1]


RANK_LAYERS: dict[int, tuple] = {}  # id of a pipeline plan -> (the plan, kept alive, its `layers_by_rank`)


def layout_memory(args, cfg, kernels: str = "cuda") -> dict[str, float]:
    """`peak_memory` alone: what a search asks first, before any time is modelled."""
    return peak_memory(args, cfg, layers_by_rank(args, cfg), kernels)[0]


@dataclass(frozen=True)
class Simulated:
    makespan: float
    bubble: float


def simulated(schedule, f: float, b: float, w: float | None, latency: float) -> Simulated:
    """`simulate`'s makespan and bubble (`timed`: the same floats), once per (schedule, costs): a
    search costs the same pipeline for every data cut; the schedule's order compiled once."""
    key = (schedule.name, schedule.pp, schedule.n_stages, schedule.microbatches, f, b, w, latency)
    if key not in TIMELINES:
        remembered(TIMELINES, key, Simulated(*timed(program_of(schedule), f, b, w, latency)), CACHED)
    return TIMELINES[key]


def program_of(schedule):
    """The schedule's `compiled` execution order, once per (name, ranks, stages, microbatches)."""
    name = (schedule.name, schedule.pp, schedule.n_stages, schedule.microbatches)
    return PROGRAMS.get(name) or remembered(PROGRAMS, name, compiled(schedule), CACHED)


CACHED = 8192  # entries each of this module's caches keeps at most (the oldest go first)
TIMELINES: dict[tuple, Simulated] = {}
PROGRAMS: dict[tuple, object] = {}  # (name, pp, stages, microbatches) -> the schedule's `compiled` order


def collective_times(args, cfg, cluster: Cluster, mesh: Mesh, compute: float, calls, records=None) -> list[CutTime]:
    """Each cut's wire bytes (the ledger's closed forms), their alpha-beta time (every call's
    latency, `calls`, + the bytes at the link's bandwidth) and what stays exposed."""
    dims = cfg.parallel
    hides = cluster.device.overlap  # the share of compute a collective in flight may hide behind
    out = []
    for cut, (wire, _how) in predict(args, cfg, records=records).items():
        if cut not in GROUP_OF_CUT:
            continue  # metrics and control: a few bytes per step (their calls: `tail_collectives`)
        group = mesh.group(GROUP_OF_CUT[cut])
        link = cluster.link_for(group.ranks)
        ops = calls.get(cut, {})
        latency = sum(n * link.latency(op, call_ranks(cut, op, dims, group.size)) for op, n in ops.items())
        seconds = wire_seconds(wire, ops, link) + latency
        if cut == "dp":
            exposed = data_exposed(cfg, seconds, wire, ops, link, group.size, hides * compute)
        elif cut == "cp" and dims.cp_mode == "ring":
            exposed = max(0.0, seconds - hides * compute / 3)  # at most behind the forward's share
        elif cut == "pp":
            exposed = 0.0  # inside the simulated makespan
        else:
            exposed = seconds
        out.append(
            CutTime(cut, wire, "intra" if link is cluster.intra else "inter", seconds, exposed, HIDDEN.get(cut, ""))
        )
    return out


def data_exposed(cfg, seconds: float, wire: float, ops: dict[str, float], link, n: int, hiding: float) -> float:
    """What the data cut leaves exposed of its `seconds`, `hiding` the compute a collective in flight
    may hide behind (`Device.overlap` x the step's F + B): the gradient reduction hides behind the
    backward (2/3 of it); ZeRO-1/2's gathers of the updated shards (`after_step`) behind the next
    step's first forward (of its first micro-step and microbatch), but for the gather of the bucket
    that forward needs first, which its first unit waits for whole."""
    gather = 0.0
    if cfg.parallel.zero in (1, 2) and ops.get("all_gather"):
        calls = ops["all_gather"]
        gather = wire * calls / sum(ops.values()) / link.bandwidth("all_gather") + calls * link.latency("all_gather", n)
    first = gather / ops["all_gather"] if gather else 0.0  # a bucket's share
    window = hiding / 3 / (cfg.train.accumulate * (cfg.parallel.microbatches if cfg.parallel.pp > 1 else 1))
    reduction = max(0.0, seconds - gather - hiding * 2 / 3)
    return reduction + first + max(0.0, gather - first - window)


def call_ranks(cut: str, op: str, dims, group_size: int) -> int:
    """The ranks one call of `op` spans in `cut`'s group of `group_size`: USP's all-to-alls go over
    its Ulysses ranks (`cp_ulysses`) and its ring's sends to one neighbour, not over all cp ranks."""
    if cut == "cp" and op == "all_to_all" and dims.cp_mode == "usp":
        return dims.cp_ulysses
    return group_size


def wire_seconds(wire: float, ops: dict[str, float], link) -> float:
    """Seconds of a cut's `wire` bytes on `link`: shared among its ops in proportion to their
    calls (`ops`; exact where a cut's ops move like messages: ZeRO's reduce-scatter and
    all-gather of the same buffers, SP's gathers and scatters of the same activations, a ring's
    sends and receives), each share at its op's bandwidth (`Link.bandwidth`)."""
    calls = sum(ops.values())
    if not calls:
        return wire / (link.bandwidth_gbps * 1e9)
    return sum(wire * n / calls / link.bandwidth(op) for op, n in ops.items())


def optimizer_seconds(args, cfg, cluster: Cluster, counts: dict[str, int], records=None) -> float:
    """AdamW over rank 0's (ZeRO: sharded) parameters and the gradient clipping before it, both
    memory-bound: bytes a parameter (`ADAMW_BYTES`, `CLIP_BYTES`) at `memory_gbps`, and
    `tensor_us` a tensor for both (their per-tensor kernels). ZeRO's optimizer and clipping
    see one flat piece per reduce group and kind (decay or not) instead of every tensor."""
    d = cluster.device
    sizes = shard_group_sizes(cfg)
    if cfg.parallel.zero >= 1:
        held = sum(n / sizes[name] for name, n in counts.items())
        tensors = 2 * sum(1 for n in counts.values() if n)
    else:
        held = sum(counts.values())
        tensors = len((records or local_placements)(args, cfg, 0))
    clip_held = held if cfg.parallel.zero >= 2 else sum(counts.values())
    adamw = ADAMW_BYTES["foreach" if cfg.train.adamw == "foreach" else "fused"]
    memory = (adamw * held + CLIP_BYTES * clip_held) / (d.memory_gbps * 1e9)
    return memory + tensors * d.tensor_us * 1e-6


def cast_seconds(copies: float, cluster: Cluster) -> float:
    """The casts of the weights to the compute dtype and of their gradients back, memory-bound:
    `copies` bytes of compute-dtype copies (bf16: 2 a weight), each cast from fp32 (read 4, write 2)
    and its gradient cast back (read 2, write 4): `CAST_BYTES` a byte of copy, at `memory_gbps`."""
    return CAST_BYTES * copies / (cluster.device.memory_gbps * 1e9)


def tail_collectives(args, cfg, cluster: Cluster) -> float:
    """The step's small all-reduces (loss, stop flags, the gradient norm's groups): their latency."""
    link = cluster.link_for(range(cfg.parallel.world_size))
    return sum(k * link.control_latency(n) for n, k in step_calls(args, cfg).items())


def peak_memory(
    args, cfg, layers_by_rank: dict[int, list[range]], kernels: str = "cuda"
) -> tuple[dict[str, float], int]:
    """Model states and activations of the pipeline position that holds the most, at its peak:
    under ZeRO-2/3 inside a pipeline the stages' full gradients (4 bytes a parameter) exist from
    the first backward to the reduction after the last (between steps only the shards remain).
    "total" is the step's highest moment (`fivecut.plan.memory.step_moments`: the loss, the end of
    the backward, the optimizer step); `kernels`: whose kernels the device runs ("cuda": the
    fused RMSNorm; "cpu": the composite one and the CPU's gradient norm)."""
    dims, t = cfg.parallel, cfg.train
    rows = t.global_batch // (dims.dp * t.accumulate * (dims.microbatches if dims.pp > 1 else 1))
    seq = t.seq_len // dims.cp
    precision = precision_of(t.dtype, dims.zero)  # what each saved tensor's dtype follows
    in_flight, frontiers = [1] * dims.pp, [((1, 0, 0),)] * dims.pp
    if dims.pp > 1:
        in_flight, frontiers = in_flight_of(args, cfg), frontiers_of(args, cfg)
    boundary = rows * seq // (dims.tp if dims.sp else 1) * args.dim * message_bytes(cfg)[0]  # [b_mb, s, h]
    held = layout_key_of(args, cfg)
    every_state, buffers = all_rank_states(args, cfg, held), all_rank_buffers(args, cfg, held)
    fused = kernels == "cuda"
    best, best_rank, of_kind = None, 0, {}  # of_kind: (MoE, recompute mode) -> `block_bytes`, once a call
    for rank, stage_ranges in layers_by_rank.items():
        states = dict(every_state[rank])
        firsts, order = block_sequence(args, stage_ranges, t.recompute, t.recompute_every)
        for kind, i in firsts.items():  # `block_bytes` once per kind of block in this call
            if kind not in of_kind:
                of_kind[kind] = block_bytes(args, cfg, rows, seq, precision, i, fused_norm=fused)
        per_layer = [of_kind[kind] for kind in order]
        stage = sum(per_layer) / max(len(stage_ranges), 1)  # a microbatch-stage's
        deferred = sum(deferred_block_bytes(args, cfg, rows, seq, precision, moe) for moe, _mode in order)
        deferred /= max(len(stage_ranges), 1)
        kept, waiting, alive = max(frontiers[rank], key=lambda p: p[0] * stage + p[1] * deferred + p[2] * boundary)
        states["activations"] = stage * kept + deferred * waiting  # held at the peak, and waiting for W
        states["boundaries"] = boundary * alive  # the pipeline's posted receives and kept outputs
        last = any(r.stop == args.n_layers for r in stage_ranges)  # the last stage: the head and loss's peak
        trained, cast = head_training(args, cfg)
        states["loss"] = (
            loss_peak_bytes(args, rows * seq, dims.tp, precision, t.loss_chunk_tokens, trained, cast, dims.sp)
            if last
            else 0.0
        )
        states["weight_copies"] = sum(block_copies(args, cfg, precision, moe) for moe, _mode in order)  # once a step
        states["head"] = head_saved_bytes(args, cfg, rows * seq, precision, fused) * in_flight[rank] if last else 0.0
        if last:
            states["weight_copies"] += head_copy_bytes(args, cfg, precision)
        states["buffers"] = buffers[rank]  # gathered ZeRO-3 units, reduction copies
        states["buffers_at_loss"] = loss_moment_buffers(args, cfg, rank)
        states["temporaries"] = optimizer_temporaries(args, cfg, rank, kernels)
        states["total"] = max(step_moments(states).values())
        if best is None or states["total"] > best["total"]:
            best, best_rank = states, rank
    return best, best_rank


def head_saved_bytes(args, cfg, tokens: int, precision: str, fused: bool) -> float:
    """What the last stage keeps for backward between its blocks and the loss (`loss_peak_bytes`
    counts from the head's input on): the final norm's saved tensors and its rstd, and, where the
    head computes the loss in chunks, the head's input itself, which each chunk's backward reads
    (the residual stream's dtype, the whole sequence: the head gathers it under SP)."""
    d = cfg.parallel
    cut = d.tp if d.sp else 1
    norm = norm_bytes(precision, args.dim, cut, 0, fused) + 4 / cut  # + rstd
    kept = (2 if precision == "bf16-params" else 4) * args.dim if cfg.train.loss_chunk_tokens else 0
    return tokens * (norm + kept)


def head_training(args, cfg) -> tuple[bool, bool]:
    """(whether the head's weight trains, whether it is cast to bf16 for its matmuls): both, but
    under [lora] a frozen head trains not, and is already bf16 unless it is the (fp32) embedding."""
    lo = cfg.lora
    if lo.rank is None:
        return True, True
    tied = args.tie_embeddings
    trained = "head" in lo.full or (tied and "embeddings" in lo.full)
    return trained, trained or tied


def head_copy_bytes(args, cfg, precision: str) -> float:
    """The head's bf16 compute copy where it computes the full logits (a cast module outside the
    blocks, `fivecut.parallel.precision`): 2 B x its V/t x h (the chunked head's is in the loss)."""
    if precision != "bf16" or cfg.train.loss_chunk_tokens or not head_training(args, cfg)[1]:
        return 0.0
    return 2 * -(-args.vocab_size // cfg.parallel.tp) * args.dim


def optimizer_temporaries(args, cfg, pp_rank: int, kernels: str) -> float:
    """`step_temporaries` of the rank at `pp_rank`: AdamW's over its parameter groups (all its
    parameters, or ZeRO's shards of them: the no-decay group of norm weights is a rounding
    error), the CPU's gradient norm over its largest gradient (ZeRO: its largest flat piece)."""
    sizes = shard_group_sizes(cfg)
    counts = local_param_counts(args, cfg, pp_rank=pp_rank)
    zero = cfg.parallel.zero
    group = sum(n / (sizes[name] if zero >= 1 else 1) for name, n in counts.items())
    largest = group if zero >= 1 else largest_tensor(args, cfg)
    adamw = "fused" if cfg.train.adamw == "auto" else cfg.train.adamw
    return step_temporaries(adamw, group, largest, kernels)


def largest_tensor(args, cfg) -> float:
    """Elements of a rank's largest parameter: the embedding or the head (vocabulary-parallel
    under tp), a block's widest projection, or a MoE layer's stacked experts."""
    d = cfg.parallel
    h, hd = args.dim, args.head_dim
    sizes = [args.vocab_size * h / d.tp, args.ffn_dim * h / d.tp, args.n_heads * hd * h / d.tp]
    if args.is_moe:
        sizes.append(args.n_experts // d.ep * h * args.expert_dim / d.etp)
    return max(sizes)


def block_sequence(args, stage_ranges: list[range], recompute: str, every: int) -> tuple[dict, tuple]:
    """The (MoE, recomputation mode) kinds of a rank's blocks, in order, and each kind's first
    block; once per (model, stages, recomputation)."""
    key = (model_token(args), tuple(stage_ranges), recompute, every)
    if key not in SEQUENCES:
        order = tuple((args.moe_layer(i), layer_mode(i, recompute, every)) for r in stage_ranges for i in r)
        ids = [i for r in stage_ranges for i in r]
        firsts = {}
        for kind, i in zip(order, ids):
            firsts.setdefault(kind, i)
        remembered(SEQUENCES, key, (firsts, order), CACHED)
    return SEQUENCES[key]


SEQUENCES: dict[tuple, tuple] = {}


def layout_key_of(args, cfg) -> tuple:
    """What a rank's model states and buffers read of a layout: the model, every parallel field but
    the microbatch count (the stage split is the same for any count), the train fields they read."""
    t = cfg.train
    fields = (t.seq_len, t.dtype, t.reduce_dtype, t.bucket_mb, t.global_batch, repr(cfg.moe))
    return (model_token(args), dims_key(cfg.parallel, "microbatches"), *fields)


def deferred_block_bytes(args, cfg, rows: int, seq: int, precision: str, moe: bool) -> float:
    """`deferred_bytes_per_layer` of a dense or MoE block of the layout (nothing unless split)."""
    if not split_backward(args, cfg):
        return 0.0
    return deferred_bytes_per_layer(args, rows, seq, cfg.parallel.tp, precision, moe)


def split_backward(args, cfg) -> bool:
    """Whether the layout's pipeline splits backward into B and W (the zero-bubble schedules)."""
    return cfg.parallel.pp > 1 and pipeline_plan(args, cfg)[0].split_backward


def block_bytes(
    args, cfg, rows: int, seq: int, precision: str, layer: int, mode: str | None = None, fused_norm: bool = False
) -> float:
    """The activation closed form of block `layer`, once per kind of block (dense or MoE, its
    recomputation mode: `mode`, else the run's) and layout: the blocks of a kind keep the same bytes."""
    dims, t = cfg.parallel, cfg.train
    moe = args.moe_layer(layer)
    mode = mode or layer_mode(layer, t.recompute, t.recompute_every)
    key = (model_token(args), dims.tp, dims.sp, dims.cp, dims.cp_mode, dims.cp_ulysses, dims.etp, dims.ep, rows, seq)
    idle = idle_linears(args, cfg, layer)
    key += (precision, moe, mode, cfg.moe.eplb_slots, fused_norm, split_backward(args, cfg), idle)
    key += (args.layer_window(layer),)  # its band mask
    if key not in BLOCK_BYTES:
        BLOCK_BYTES[key] = activation_bytes_per_layer(
            args,
            rows,
            seq,
            dims.tp,
            dims.sp,
            precision,
            moe_rows=uniform_rows(args, rows * seq // dims.tp * dims.etp) if moe else None,
            cp=dims.cp,
            recompute=mode,
            cp_mode=dims.cp_mode,
            cp_ulysses=dims.cp_ulysses,
            etp=dims.etp,
            ep=dims.ep,
            eplb_slots=cfg.moe.eplb_slots,
            fused_norm=fused_norm,
            split=split_backward(args, cfg),
            idle=idle,
            layer=layer,
        )
    return BLOCK_BYTES[key]


def idle_linears(args, cfg, layer: int) -> frozenset[str]:
    """[lora]: block `layer`'s linears frozen without an adapter (they keep no input for a weight
    gradient): those `lora.targets` leave out, and a MoE layer's router."""
    lo = cfg.lora
    if lo.rank is None:
        return frozenset()
    every = {path for path, _, _ in block_targets(args, layer, tuple(TARGET_GROUPS))}
    adapted = {path for path, _, _ in block_targets(args, layer, tuple(lo.targets))}
    router = {"feed_forward.router"} if args.moe_layer(layer) else set()
    return frozenset(every - adapted | router)


BLOCK_BYTES: dict[tuple, float] = {}


def block_copies(args, cfg, precision: str, moe: bool) -> float:
    """The bf16 compute copies of one block's matmul weights on a rank: one a step, shared by
    every microbatch in flight (`fivecut.parallel.precision`; none in fp32 or under ZeRO-3).
    [lora]: the frozen weights are bf16 already; only the adapters are copied."""
    dims = cfg.parallel
    if cfg.lora.rank is not None:
        return 2.0 * adapter_elements(args, cfg, moe) if precision == "bf16" else 0.0
    return weight_copies(args, dims.tp, precision, moe, dims.ep, dims.etp)


def adapter_elements(args, cfg, moe: bool) -> int:
    """[lora]: one block's adapter elements on a tp rank (`adapter_cut`), a MoE block's experts'
    included (this rank's slots, EPLB's copies among them: `expert_adapter_elements`)."""
    lo, dims = cfg.lora, cfg.parallel
    linears = sum(adapter_cut(args, moe, lo.targets, lo.rank, dims.tp))
    if not moe or EXPERTS not in lo.targets:
        return linears
    slots = args.n_experts // dims.ep + cfg.moe.eplb_slots
    return linears + expert_adapter_elements(args, lo.rank, slots, dims.etp)


def in_flight_of(args, cfg) -> list[int]:
    """Microbatches each pipeline rank holds at its peak (`peak_in_flight`), once per schedule."""
    d = cfg.parallel
    key = (d.pp_schedule, d.pp, d.microbatches, d.pp_virtual)
    if key not in IN_FLIGHT:
        IN_FLIGHT[key] = peak_in_flight(pipeline_plan(args, cfg)[0])
    return IN_FLIGHT[key]


IN_FLIGHT: dict[tuple, list[int]] = {}


def frontiers_of(args, cfg) -> list[tuple[tuple[int, int, int], ...]]:
    """`boundary_frontier` of the layout's schedule, once per schedule: a sent output let go once
    out, but for a compiled block's (train.compile: its graph may keep it), kept until B."""
    d = cfg.parallel
    released = not cfg.train.compile
    key = (d.pp_schedule, d.pp, d.microbatches, d.pp_virtual, released)
    if key not in FRONTIERS:
        FRONTIERS[key] = boundary_frontier(pipeline_plan(args, cfg)[0], released=released)
    return FRONTIERS[key]


FRONTIERS: dict[tuple, list] = {}


def rank_states(args, cfg, pp_rank: int) -> dict[str, float]:
    """Parameters, gradients and optimizer state (bytes) of the rank at pipeline position `pp_rank`
    at its peak: under ZeRO-2/3 inside a pipeline the stages' full gradients (4 bytes a parameter)
    exist from the first backward to the reduction after the last. Once per `layout_key_of`."""
    return dict(all_rank_states(args, cfg, layout_key_of(args, cfg))[pp_rank])


def all_rank_states(args, cfg, key: tuple) -> tuple[dict[str, float], ...]:
    """`rank_states` of every pipeline position, once per `key` (`layout_key_of(args, cfg)`). Shared."""
    if key not in STATES:
        remembered(STATES, key, tuple(states_now(args, cfg, r) for r in range(cfg.parallel.pp)), CACHED)
    return STATES[key]


def all_rank_buffers(args, cfg, key: tuple) -> tuple[float, ...]:
    """`buffer_bytes` of every pipeline position, once per `key` (`layout_key_of(args, cfg)`)."""
    if key not in RANK_BUFFERS:
        remembered(RANK_BUFFERS, key, tuple(buffer_bytes(args, cfg, r) for r in range(cfg.parallel.pp)), CACHED)
    return RANK_BUFFERS[key]


STATES: dict[tuple, tuple] = {}
RANK_BUFFERS: dict[tuple, tuple] = {}


def states_now(args, cfg, pp_rank: int) -> dict[str, float]:
    """`rank_states` computed now."""
    dims = cfg.parallel
    sizes = shard_group_sizes(cfg)  # hybrid sharding: model states cut over zero_shard ranks
    counts = local_param_counts(args, cfg, pp_rank=pp_rank)
    parts = [model_state_bytes(psi, dims.zero, sizes[name]) for name, psi in counts.items()]
    states = {key: sum(p[key] for p in parts) for key in ("params", "grads", "optimizer")}
    states["params"] += frozen_bytes(args, cfg, pp_rank)  # [lora]: no gradient, no optimizer state
    if dims.pp > 1 and dims.zero >= 2:  # a stage's full gradients live through the schedule
        states["grads"] = 4 * sum(counts.values())  # (`zero_pipeline`): its peak, not its shards
    return states


def staging_bytes(args, cfg) -> float:
    """Host memory a background save holds on the rank that stages the most (checkpoint.async_mode
    "thread" or "process"; "off": none): DCP's stager keeps its copy of the rank's share of the
    checkpoint between saves (pinned beside a GPU, shared memory for a writer process)."""
    if cfg.checkpoint.async_mode == "off":
        return 0.0
    return max(checkpoint_share(args, cfg, r) for r in range(cfg.parallel.pp))


def checkpoint_share(args, cfg, pp_rank: int) -> float:
    """The bytes of the checkpoint the rank at pipeline position `pp_rank` holds, as it holds them:
    its master weights (fp32: whole under DDP and ZeRO-1/2, its shard under ZeRO-3; [lora]'s frozen
    weights are not saved), Adam's two moments (fp32, sharded from ZeRO-1 on), the step count, and
    each of its MoE layers' balancing biases (one fp32 an expert)."""
    sizes = shard_group_sizes(cfg)
    counts = local_param_counts(args, cfg, pp_rank=pp_rank)
    parts = [model_state_bytes(psi, cfg.parallel.zero, sizes[name]) for name, psi in counts.items()]
    moe = [i for layers in layers_by_rank(args, cfg)[pp_rank] for i in layers if i >= args.first_dense_layers]
    biases = len(moe) * args.n_experts if args.is_moe else 0
    return sum(p["params"] + p["optimizer"] for p in parts) + FP32_BYTES * (1 + biases)


def state_memory(args, cfg) -> float:
    """The most model-state bytes any pipeline position holds (a bound below its total memory)."""
    return max(sum(rank_states(args, cfg, r).values()) for r in range(cfg.parallel.pp))


def uniform_rows(args, tokens: int) -> tuple[int, int]:
    """Rows a rank sends and receives in a MoE layer's dispatch when routing is uniform: k per token
    of the `tokens` its dispatch sees (under tp a MoE layer runs on a 1/tp slice of the rank's
    tokens; with etp the dispatch sees the etp ranks' slices gathered)."""
    rows = tokens * args.top_k
    return rows, rows
