"""Closed-form communication volume per step, per cut: what `fivecut ledger` checks against.

Wire bytes per rank per optimizer step, with the ring factors of `fivecut.ledger`. The
sizes of flat buffers (ZeRO buckets and units, padded to a multiple of the group size)
come from the model built on the meta device: no memory, exact shapes.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, replace

import torch

from fivecut.ledger import ring_factor
from fivecut.mesh import Mesh
from fivecut.model.lora import EXPERTS, adapter_cut, nf4_bytes
from fivecut.model.transformer import build_model
from fivecut.parallel.parallelize import ParallelizeOptions, parallelize
from fivecut.parallel.pipeline.schedule import build_schedule
from fivecut.parallel.pipeline.split import stage_layers
from fivecut.parallel.placement import FlatSlot, Placement
from fivecut.plan.activations import layer_mode, precision_of

BYTES = {"fp32": 4, "bf16": 2}
FP32 = 4  # stats, the loss's sums, flags and norms travel in fp32 whatever train.dtype is
PARAM_BYTES = FP32  # parameters are kept in fp32 (ZeRO-1/2 gather them so); ZeRO-3 gathers in train.dtype


def predict(args, cfg, routing: dict | None = None, records=None) -> dict[str, tuple[float, str]]:
    """{cut: (wire bytes per rank per optimizer step, the formula in words)} for `cfg`'s layout.
    `routing`: for MoE models, rank 0's rows sent to / received from each ep rank in each MoE
    layer during the step (`RunResult.moe[-1]["local"]`); without it, uniform routing is assumed.
    `records(args, cfg, pp_rank)`: where the placement records come from (`local_placements`, the
    real cuts; `screened_placements` for a search's first pass)."""
    dims = cfg.parallel
    out = {}
    n = dims.dp * dims.cp
    if n > 1 or (args.is_moe and dims.tp > 1):  # MoE under tp: the router's gradients are summed over tp too
        out["dp"] = data_parallel_volume(args, cfg, n, records or local_placements)
    if n > 1:
        out["metrics"] = (ring_factor("all_reduce", n) * 4, "all-reduce of the step's loss (one fp32)")
    if args.is_moe:
        ep = expert_parallel_volume(args, cfg, routing)
        if ep[0] > 0:
            out["ep"] = ep
        if dims.etp > 1:
            out["etp"] = expert_tensor_volume(args, cfg)
    if dims.tp > 1:
        out["tp"] = tensor_parallel_volume(args, cfg)
    if dims.cp > 1:
        out["cp"] = context_parallel_volume(args, cfg)
    if dims.pp > 1:
        out["pp"] = pipeline_volume(args, cfg)
        metrics = out.get("metrics", (0.0, ""))[0]
        out["metrics"] = (
            metrics + ring_factor("all_reduce", dims.pp) * 4,
            "all-reduce of the step's loss (one fp32) over dp and pp",
        )
    if dims.world_size > 1:
        out["control"] = (
            ring_factor("all_reduce", dims.world_size) * 3 * 4,
            "all-reduce (max) over all ranks of the step's flags: signal, non-finite, a save writing (three int32)",
        )
    return out


def message_bytes(cfg) -> tuple[int, int]:
    """(stream, matmul): bytes an element of the residual stream (the embedding's and the norms'
    outputs, their gradients) and of a matmul's output (and its gradient) put on the wire.
    fp32: 4, 4. bf16 under autocast over fp32 weights: the stream stays fp32, a linear's
    output is bf16: 4, 2. bf16 under ZeRO-3 (bf16 units): both bf16: 2, 2."""
    precision = precision_of(cfg.train.dtype, cfg.parallel.zero)
    return {"fp32": (4, 4), "bf16": (4, 2), "bf16-params": (2, 2)}[precision]


def pipeline_volume(args, cfg, rank: int = 0) -> tuple[float, str]:
    """Pipeline rank `rank`: at each stage boundary it borders, each microbatch sends or receives
    its activations forward and their gradient backward, E = b_mb * s_local * h elements each;
    plus the tied embedding's gradient summed over the first and last rank, and the clip norm."""
    dims, train = cfg.parallel, cfg.train
    sched, _ = pipeline_plan(args, cfg)
    owner = sched.stage_rank
    borders = sum(1 for s in range(sched.n_stages - 1) if owner[s] != owner[s + 1] and rank in (owner[s], owner[s + 1]))
    rows = train.global_batch // (dims.dp * train.accumulate * dims.microbatches)
    s_local = train.seq_len // dims.cp // (dims.tp if dims.sp else 1)
    e = rows * s_local * args.dim
    stream, _ = message_bytes(cfg)  # the residual stream: fp32, or bf16 under ZeRO-3's bf16 units
    volume = train.accumulate * dims.microbatches * 2 * borders * e * stream
    how = (
        f"{borders} boundaries x {train.accumulate * dims.microbatches} microbatches x 2 (F, B) x E, E = "
        f"{rows}*{s_local}*{args.dim}"
    )
    ends = {owner[0], owner[-1]}
    if args.tie_embeddings and len(ends) == 2 and rank in ends:
        shard = -(-args.vocab_size // dims.tp) * args.dim
        sums = train.accumulate if dims.zero >= 2 else 1  # ZeRO-2/3 reduce (so sum the tie) every micro-step
        volume += sums * ring_factor("all_reduce", 2) * FP32 * shard
        how += f" + {sums} x tied embedding all-reduce over the two ends"
    if train.grad_clip > 0:
        volume += ring_factor("all_reduce", dims.pp) * FP32
        how += " + clip norm"
    return volume, how


def tensor_parallel_volume(args, cfg) -> tuple[float, str]:
    """Per microbatch (an accumulation micro-step, or a pipeline microbatch), E = b*s*h
    activations (b = its rows), L = the blocks on this rank, fp32:
    no SP: all-reduce of E after the embedding and after each region (1 + 2L, forward), of the
           gradient of E before each region and the head (2L + 1, backward);
    SP:    the same E as reduce-scatters and all-gathers, plus one all-gather of E in backward
           per region and head (the saved inputs, kept as slices) and an all-reduce of each
           norm weight's gradient (2L + 1 of h);
    bf16:  the residual stream (the embedding's and norms' outputs, their gradients) stays fp32
           and a linear's output is bf16 (`message_bytes`); the linears save autocast's bf16
           casts of a region's input, not the gathered input, so SP regathers nothing; under
           ZeRO-3 (bf16 units) everything is bf16 and the inputs are regathered, as in fp32;
           A loss head (train.loss_chunk_tokens > 0) computes its gradients in the forward: no
           regather of the head's input;
    both:  the vocab-parallel loss (max, then sum-exp and target logit: 3*b*s all-reduced, in
           as many pairs of calls as the head has chunks),
           replicated attention weights' gradients (k/v when t > kv heads; MLA's latent
           projections and norms, `replicated_attention_weights`), and the clip norm (1 element);
           whole-projection q/k norms (OLMo 2): per block the q and k sums of squares (2*b*s, fp32)
           all-reduced forward and their gradients backward (again in a recomputed forward).
    A MoE layer has no feed-forward region (it runs on each tp rank's slice of the tokens):
    without SP its input is sliced (backward: all-gather of E, in the stream's dtype) and its
    output all-gathered (in the matmuls' dtype: bf16 under autocast);
    with capacity or the auxiliary loss, each chunk's slots per (sequence, expert) are
    all-gathered (t*b*E_experts int64).
    Under pipeline parallelism the embedding and the head count only on the ranks holding them.
    Full recomputation: each backward pass runs a recomputed block's forward again up to its last
    saved tensor (non-reentrant checkpoints stop there, before the block's last g): one more
    all-reduce of E without SP (the attention region's); with SP two all-gathers and one
    reduce-scatter of E, but no regathers of the regions' inputs (the recomputation keeps them
    whole): one E more in fp32 (under bf16 with fp32 weights, which regathers nothing, all three
    count); with the norms after the sublayers (OLMo 2) the block's last g too, whose output the last
    norm keeps; and again the slot counts of a MoE layer with capacity or the aux loss."""
    dims, train = cfg.parallel, cfg.train
    t, h = dims.tp, args.dim
    ar, ag = ring_factor("all_reduce", t), ring_factor("all_gather", t)
    stream, a = message_bytes(cfg)
    grads = 2 if stream == 2 else FP32  # a replicated weight's gradient: its dtype (ZeRO-3 bf16 units: bf16)
    regather = stream if a == stream else 0  # autocast's bf16 casts, not the fp32 gathered input, are saved
    micro = dims.microbatches if dims.pp > 1 else 1
    b = train.global_batch // (dims.dp * train.accumulate * micro)
    s = train.seq_len // dims.cp  # this rank's chunk of each sequence
    e = b * s * h
    per_micro, calls = 0.0, []
    counts = (
        ag * t * b * args.n_experts * 8 if cfg.moe.capacity_factor is not None or cfg.moe.aux_loss_coef > 0 else 0.0
    )
    for (L, emb, head, moe), (full, full_moe) in zip(rank_stages(args, cfg), recomputed_blocks(args, cfg)):
        again = ag * (2 * stream + a - 2 * regather) if dims.sp else ar * a  # a recomputed block's forward
        # norms after the sublayers (OLMo 2): the last saved tensor is the MLP norm's input, after the last g
        again += (ag if dims.sp else ar) * a * (args.norm_after or args.sandwich_norms)
        per_micro += full * again * e + full_moe * counts
        loss = 3 * b * s * head
        kv = L * replicated_attention_weights(args, t)
        regions = 2 * L - moe
        per_micro += moe * counts
        # whole-projection q/k norms (OLMo 2): each sum of squares [b, s] and its gradient, fp32, for q and for k
        per_micro += ar * FP32 * b * s * (4 * L + 2 * full) * args.qk_norm_whole
        if dims.sp:
            # embedding's reduce-scatter, regions' and head's all-gathers (stream); regions' reduce-scatters (a)
            forward = stream * (emb + regions + head) + a * regions
            # their transposes, and the regathered inputs (not the head's: a loss head keeps no input)
            backward = forward + regather * (regions + head * (train.loss_chunk_tokens == 0))
            norms = (args.block_norms * L + head) * h  # the block norms' and the last norm's weights, tp-summed
            per_micro += ag * (forward + backward) * e + ar * (FP32 * loss + grads * (norms + kv))
        else:
            # g after the embedding (stream) and each region (a); f's transposes (stream)
            per_micro += ar * (stream * (emb + regions + head) * e + a * regions * e + FP32 * loss + grads * kv)
            per_micro += ag * moe * (a + stream) * e  # MoE output gathered (matmul dtype), input's gradient (stream)
        per_micro += lora_tensor_bytes(args, cfg, (emb, L, head, moe), kv, e) if cfg.lora.rank else 0.0
        calls.append(f"L={L}{' +emb' if emb else ''}{' +head' if head else ''}")
    clip = ar * FP32 if train.grad_clip > 0 else 0.0
    total = train.accumulate * micro * per_micro + clip
    how = "SP: all-gather/reduce-scatter of E" if dims.sp else "all-reduce of E"
    return (
        total,
        f"{train.accumulate * micro} microbatches x [{how} per region, 3bs loss; stages {', '.join(calls)}], E "
        f"= {b}*{s}*{h}, t={t}",
    )


def lora_tensor_bytes(args, cfg, stage: tuple[int, int, int, int], kv: int, e: int) -> float:
    """[lora] under TP, per microbatch (E = e, one [b, s, h] activation): a frozen embedding needs
    no gradient, so the first region's input gradient is never reduced (-E; SP: and the
    embedding's own backward all-gather, -2E); frozen norms and replicated attention weights have
    no gradient to all-reduce; each adapter's whole half (a column-parallel weight's A [r, in], a
    row-parallel one's B [out, r]) has its gradient all-reduced, in the dtype of its copy
    (`tensor.cut_adapters`). `stage`: (holds the embedding, blocks, holds the head, MoE blocks)."""
    emb, L, head, moe = stage
    dims, lo = cfg.parallel, cfg.lora
    t, h = dims.tp, args.dim
    ar, ag = ring_factor("all_reduce", t), ring_factor("all_gather", t)
    stream, _ = message_bytes(cfg)
    precision = precision_of(cfg.train.dtype, dims.zero)
    grads = 2 if stream == 2 else FP32
    out = 0.0
    if emb and "embeddings" not in lo.full:
        out -= (2 * ag if dims.sp else ar) * stream * e
    if dims.sp and "norms" not in lo.full:
        out -= ar * grads * (args.block_norms * L + head) * h
    out -= ar * grads * kv
    copies = 2 if precision != "fp32" else FP32  # the adapters' compute copies under bf16
    whole = sum(
        n * adapter_cut(args, kind, lo.targets, lo.rank, dims.tp)[1] for kind, n in ((False, L - moe), (True, moe)) if n
    )
    return out + ar * copies * whole


def replicated_attention_weights(args, t: int) -> int:
    """Elements of one block's attention weights that every tp rank holds whole and whose gradient
    autograd all-reduces over tp: wk and wv when t does not divide the kv heads; under multi-head
    latent attention the down projections and latent norms (wq_a, q_norm, wkv_a, kv_norm); the
    per-head query and key norms (qk_norm); GPT-OSS's wo bias (added by one rank: `RowParallelBias`)."""
    if args.is_mla:
        shapes = args.mla_shapes()
        return sum(shapes.get(name, 0) for name in ("wq_a", "q_norm", "wkv_a", "kv_norm"))
    head_norms = 2 * args.head_dim if args.qk_norm and not args.qk_norm_whole else 0  # whole ones: cut with wq, wk
    head_norms += args.dim * args.wo_bias
    return head_norms + (2 * args.n_kv_heads * args.head_dim * args.dim if args.n_kv_heads % t else 0)


def context_parallel_volume(args, cfg) -> tuple[float, str]:
    """Per microbatch and layer, with [b, heads, s/c, hd] blocks (heads: this tp rank's):
    Ulysses  all-to-alls of q, k, v and the attention output forward and of their gradients
             backward, each (c-1)/c of its tensor (kv heads repeated to the query heads when
             they do not divide by c);
    ring     c-1 passes of the K/V block forward; backward c-1 passes of the K/V block again
             (each rank recomputes its block pairs) and c of its fp32 dK/dV accumulator (it
             follows the block round the ring and one last pass takes it home); each sent and
             received (send and recv both count);
    USP      both: Ulysses over U with [b, heads, s/c, hd] blocks, then the ring over R = c/U
             with blocks [b, kv/U, s/R, hd] (kv: after Ulysses' repetition, if any);
    multi-head latent attention: q and k heads of nope + rope channels, v and o heads of
    v_head_dim (every head has its own key: kv = heads); a ring pass carries K and V side by side;
    MoE layers with capacity or the auxiliary loss also all-gather their slots per (sequence,
    expert) over c. A fully recomputed block repeats its forward part (`forward`, and the slot
    counts) in each backward pass: `forward_repeats`."""
    dims, train = cfg.parallel, cfg.train
    c = dims.cp
    widths = (args.qk_head_dim, args.v_head_dim) if args.is_mla else (args.head_dim, args.head_dim)
    micro = dims.microbatches if dims.pp > 1 else 1
    b = train.global_batch // (dims.dp * train.accumulate * micro)
    heads = args.n_heads // dims.tp
    kv = max(args.n_kv_heads // dims.tp, 1)
    _, a = message_bytes(cfg)
    r = dims.cp_ring  # the ring's degree (c under ring, 1 under Ulysses); Ulysses' is c/r
    (forward, backward), kv = ulysses_bytes(c // r, heads, kv, a * b * train.seq_len // c, widths)
    ring = ring_bytes(r, kv // (c // r), b * train.seq_len // r, a, sum(widths))
    forward, backward = forward + ring[0], backward + ring[1]
    counts = ring_factor("all_gather", c) * c * dims.tp * b * args.n_experts * 8
    counted = cfg.moe.capacity_factor is not None or cfg.moe.aux_loss_coef > 0
    per_micro = sum(
        L * (forward + backward)
        + (moe * counts if counted else 0)
        + full * forward
        + (full_moe * counts if counted else 0)
        for (L, _, _, moe), (full, full_moe) in zip(rank_stages(args, cfg), recomputed_blocks(args, cfg))
    )
    what = {
        "ring": f"c-1 K/V passes forward + c-1 K/V and c dK/dV backward, c={c}",
        "ulysses": f"4 all-to-alls (q, k, v, o) forward + 4 backward, c={c}",
        "usp": f"4 all-to-alls over U={c // r} each way + ring over R={r}: R-1 K/V passes forward, R-1 K/V and R "
        "dK/dV backward",
    }[dims.cp_mode]
    return (
        train.accumulate * micro * per_micro,
        f"{train.accumulate * micro} microbatches x layers x {what} ({dims.cp_mode})",
    )


def ulysses_bytes(
    u: int, heads: int, kv: int, block: float, widths: tuple[int, int]
) -> tuple[tuple[float, float], int]:
    """Ulysses over u ranks, blocks [b, heads, s/cp, hd] of `block` bytes a channel of a head,
    `widths` = (hd of q and k, hd of v and o): (forward, backward) bytes of a layer, and the kv
    heads each rank holds after (repeated to the query heads first when they do not divide by u)."""
    kv = heads if kv % u else kv
    qk, v = widths
    volume = ring_factor("all_to_all", u) * block * (heads + kv) * (qk + v)
    return (volume, volume), kv


def ring_bytes(r: int, kv: int, block: float, a: int, width: int) -> tuple[float, float]:
    """Ring attention over r ranks with `kv` heads per block of `block` elements a channel of a
    head ([b, kv, s/r, hd + hd_v], K and V side by side: `width` = hd + hd_v): (forward,
    backward) bytes of a layer; each pass sent and received. K and V travel in the attention's
    dtype (`a` bytes: bf16 under autocast), the dK/dV accumulators in fp32."""
    pass_elements = 2 * kv * width * block  # K and V (or dK and dV), sent and received
    if r == 1:
        return 0.0, 0.0
    return (r - 1) * a * pass_elements, ((r - 1) * a + r * FP32) * pass_elements


def rank_stages(args, cfg, pp_rank: int = 0) -> list[tuple[int, int, int, int]]:
    """(blocks, embedding 0/1, head 0/1, MoE blocks) of each stage on the rank at pipeline position
    `pp_rank`. Every schedule runs a stage's backward once per microbatch: a split backward's W
    computes the deferred weight gradients without walking the graph again (`pipeline.wgrad`),
    so no collective of backward repeats."""
    dims = cfg.parallel
    if dims.pp == 1:
        return [(args.n_layers, 1, 1, args.n_moe_layers)]
    sched, layers = pipeline_plan(args, cfg)
    last = sched.n_stages - 1
    return [
        (
            len(layers[s]),
            int(s == 0),
            int(s == last),
            sum(args.moe_layer(i) for i in layers[s]),
        )
        for s in sched.stages_of(pp_rank)
    ]


def recomputed_blocks(args, cfg, pp_rank: int = 0) -> list[tuple[int, int]]:
    """(fully recomputed blocks, of which MoE) of each stage on the rank at `pp_rank`, in the order
    of `rank_stages` (selective recomputation repeats no collective)."""
    t = cfg.train
    if cfg.parallel.pp == 1:
        ids = [range(args.n_layers)]
    else:
        sched, layers = pipeline_plan(args, cfg)
        ids = [layers[s] for s in sched.stages_of(pp_rank)]
    full = [[i for i in stage if layer_mode(i, t.recompute, t.recompute_every) == "full"] for stage in ids]
    return [(len(f), sum(args.moe_layer(i) for i in f)) for f in full]


def pipeline_plan(args, cfg):
    """The schedule and each stage's layers; built once per (model, schedule, sequence, split),
    for a search asks again for every data cut and batch split. Shared: read them only."""
    dims = cfg.parallel
    split = tuple(dims.pp_layers) if dims.pp_layers else None
    key = (model_token(args), dims.pp_schedule, dims.pp, dims.microbatches, dims.pp_virtual, cfg.train.seq_len, split)
    if key not in PIPELINES:
        sched = shared_schedule(dims.pp_schedule, dims.pp, dims.microbatches, dims.pp_virtual)
        PIPELINES[key] = sched, stage_layers(args, sched.n_stages, cfg.train.seq_len, dims.pp_layers)
    return PIPELINES[key]


PIPELINES: dict[tuple, tuple] = {}  # see `pipeline_plan`


@functools.cache
def shared_schedule(name: str, pp: int, microbatches: int, virtual: int):
    """`build_schedule`, once per arguments whatever the model: shared, read it only."""
    return build_schedule(name, pp, microbatches, virtual)


def expert_parallel_volume(args, cfg, routing: dict | None) -> tuple[float, str]:
    """MoE layers on rank 0, per forward (accumulation micro-step or pipeline microbatch):
    counts   all-to-all of the rows per (rank, slot), int64: (ep-1) x slots x 8 B
    dispatch all-to-all of the rows sent to other ranks, forward; their gradients come back
    combine  all-to-all of the rows received from other ranks, forward; gradients back
             -> 2 x (sent + received to/from other ranks) x dim x 4 B over the step
    EPLB     copies of expert weights sent (forward) and their gradients returned (backward);
             experts moved to other ranks after the optimizer step (weights and Adam moments)
    per step: all-reduce of the load statistics (2E + 1 + ep x slots per MoE layer, fp32)
    over dp x cp (x tp) and pp, and the clip norm over ep (without ZeRO).
    A fully recomputed layer runs its forward all-to-alls again (counts, dispatch, combine,
    copies) in each backward pass; its rows are counted once in the statistics."""
    dims, train, moe = cfg.parallel, cfg.train, cfg.moe
    ep, e = dims.ep, args.n_experts
    slots = e // ep + moe.eplb_slots
    layers = [i for i in range(args.n_layers) if args.moe_layer(i) and i in rank_layer_ids(args, cfg)]
    forwards = train.accumulate * (dims.microbatches if dims.pp > 1 else 1)
    volume = 0.0
    if ep > 1:
        expert_bytes = 3 * args.dim * args.expert_dim // dims.etp * FP32  # an EPLB copy: this rank's shard
        again = recomputed_moe_layers(args, cfg)
        stream, a = message_bytes(cfg)  # dispatched rows (and their gradients): stream; expert outputs: a
        for i in layers:
            volume += forwards * (1 + (i in again)) * (ep - 1) * slots * 8
            sent, received, copies_out, copies_in = _routing_of(args, cfg, routing, i)
            volume += (sent + received) * args.dim * (stream + a) + (copies_out + copies_in) * expert_bytes
            volume += (i in again) * ((sent * stream + received * a) * args.dim + copies_out * expert_bytes)
            volume += _moved_elements(routing, i) * FP32
    stats_n = dims.dp * dims.cp * dims.tp
    per_layer = 2 * e + 1 + ep * slots
    volume += (
        FP32 * args.n_moe_layers * per_layer * (ring_factor("all_reduce", stats_n) + ring_factor("all_reduce", dims.pp))
    )
    if dims.zero == 0 and ep > 1 and train.grad_clip > 0:
        volume += ring_factor("all_reduce", ep) * FP32
    source = "this step's routing counts" if routing else "uniform routing (expected rows)"
    return (
        volume,
        f"{len(layers)} MoE layers x {forwards} forwards: counts + 2x(dispatch + combine) rows from {source}, "
        f"ep={ep} + load-statistics all-reduce",
    )


def expert_tensor_volume(args, cfg) -> tuple[float, str]:
    """Expert tensor parallelism over n = etp ranks, per forward (accumulation micro-step or
    pipeline microbatch) and MoE layer on rank 0, with T = b * s/(cp*tp) its tokens, k = top_k:
        forward   all-gather of [n*T, dim + k] fp32 (tokens and combine weights) and of
                  [n*T, k] int64 (chosen experts; [n*T, 2k] with capacity: and the kept slots),
                  reduce-scatter of the partial outputs [n*T, dim] fp32
        backward  all-gather of the outputs' gradient [n*T, dim], reduce-scatter of the
                  gradient of the tokens and weights [n*T, dim + k]
    each (n-1)/n of the full tensor. Under bf16 the tokens stay in the stream's dtype, the
    outputs (and their gradient) are bf16 (`message_bytes`). A fully recomputed layer runs its
    forward part again. [lora] on the experts: the gradient of the adapter halves every etp rank
    holds whole (the shared gate/up A [E, dim, r], down's B [E, r, dim], over this rank's slots)
    all-reduced in backward, in their copies' dtype (`LoRAExperts.grad_summed`); so is GPT-OSS's down bias
    [E, dim], whole on every etp rank (`BiasedExperts`)."""
    dims, train = cfg.parallel, cfg.train
    n, k, h = dims.etp, args.top_k, args.dim
    micro = dims.microbatches if dims.pp > 1 else 1
    rows = n * train.global_batch // (dims.dp * train.accumulate * micro) * (train.seq_len // dims.cp // dims.tp)
    choice = 2 * k if cfg.moe.capacity_factor is not None else k
    ring = ring_factor("all_gather", n)
    stream, a = message_bytes(cfg)  # tokens (and their gradient): the stream's dtype; partial outputs: a
    forward = ring * rows * (h * stream + k * FP32 + choice * 8 + h * a)
    backward = ring * rows * (h * a + h * stream + k * FP32)
    slots = args.n_experts // dims.ep + cfg.moe.eplb_slots
    copies = 2 if precision_of(train.dtype, dims.zero) != "fp32" else FP32
    if cfg.lora.rank is not None and EXPERTS in cfg.lora.targets:
        backward += ring_factor("all_reduce", n) * copies * slots * 2 * h * cfg.lora.rank
    backward += ring_factor("all_reduce", n) * copies * slots * h * args.moe_bias
    layers = [i for i in rank_layer_ids(args, cfg) if args.moe_layer(i)]
    again = recomputed_moe_layers(args, cfg)
    volume = train.accumulate * micro * sum(forward + backward + (i in again) * forward for i in layers)
    return (
        volume,
        f"{len(layers)} MoE layers x {train.accumulate * micro} forwards: all-gather [nT, dim+k] + indices, "
        f"reduce-scatter [nT, dim]; backward the reverse, nT={rows}, n={n}",
    )


def recomputed_moe_layers(args, cfg) -> set[int]:
    """The MoE layers whose forward backward runs again (full recomputation)."""
    t = cfg.train
    return {
        i for i in range(args.n_layers) if args.moe_layer(i) and layer_mode(i, t.recompute, t.recompute_every) == "full"
    }


def _routing_of(args, cfg, routing: dict | None, layer: int) -> tuple[float, float, float, float]:
    """Rows rank 0 sent to and received from the other ep ranks in `layer` over the step, and
    EPLB copies it sent and received: measured counts, or the uniform expectation."""
    if routing is not None:
        local = routing[layer] if layer in routing else routing[str(layer)]
        me = 0  # rank 0 is ep rank 0
        return (
            sum(local["sent"]) - local["sent"][me],
            sum(local["received"]) - local["received"][me],
            local["copies_sent"],
            local["copies_received"],
        )
    dims, train = cfg.parallel, cfg.train
    tokens = train.global_batch // dims.dp * train.seq_len // dims.cp // dims.tp * dims.etp  # per step, dispatched
    rows = tokens * args.top_k * (dims.ep - 1) / dims.ep
    return rows, rows, 0.0, 0.0


def _moved_elements(routing: dict | None, layer: int) -> float:
    """Elements rank 0 sent to move experts of `layer` (EPLB re-placement; measured, not predictable)."""
    if routing is None:
        return 0.0
    local = routing[layer] if layer in routing else routing[str(layer)]
    return local.get("moved_elements", 0)


def rank_layer_ids(args, cfg, pp_rank: int = 0) -> set[int]:
    """The transformer blocks held by the rank at pipeline position `pp_rank`."""
    dims = cfg.parallel
    if dims.pp == 1:
        return set(range(args.n_layers))
    sched, layers = pipeline_plan(args, cfg)
    return {i for s in sched.stages_of(pp_rank) for i in layers[s]}


def reduce_group_sizes(cfg) -> dict[str, int]:
    """How many ranks sum each kind of gradient (see `fivecut.mesh.Mesh._expert_groups`)."""
    dims = cfg.parallel
    n = dims.dp * dims.cp
    return {"dp_cp": n, "expert_dp": n // dims.ep * dims.tp // dims.etp, "dp_cp_tp": n * dims.tp}


def zero_replicas(cfg) -> int:
    """Hybrid sharding (`parallel.zero_shard`): the shard groups that hold the same shard; else 1."""
    dims = cfg.parallel
    return dims.dp * dims.cp // dims.shard_size if dims.hybrid else 1


def shard_group_sizes(cfg) -> dict[str, int]:
    """How many ranks ZeRO shards each kind of gradient over: its reduce group, or under hybrid
    sharding the part of it inside one block of `zero_shard` dp x cp ranks (`fivecut.mesh`)."""
    r = zero_replicas(cfg)
    return {name: size // r for name, size in reduce_group_sizes(cfg).items()}


def data_parallel_volume(args, cfg, n: int, records=None) -> tuple[float, str]:
    """The gradient reduction of each group of parameters (`reduce_group_sizes`), summed."""
    records = records or local_placements
    if records is screened_placements:  # the screen's sums, without its records
        by_group = screened_sums(args, cfg)
    else:
        by_group = record_sums(records(args, cfg, 0).values())
    sizes, r = shard_group_sizes(cfg), zero_replicas(cfg)
    parts = [group_reduction_volume(cfg, sums, sizes[name], r) for name, sums in by_group.items()]
    norm = cfg.parallel.shard_size  # the clip norm sums over one shard group, not its replicas
    clip = ring_factor("all_reduce", norm) * 4 if cfg.train.grad_clip > 0 and cfg.parallel.zero > 0 else 0.0
    again = tied_regathers(args, cfg, records, sizes["dp_cp"])  # gathered inside the shard group
    volume = sum(v for v, _ in parts + again) + clip
    how = (
        parts[0][1]
        if len(parts) == 1
        else "; ".join(
            f"{name} ({sizes[name]} rank{'s' if sizes[name] > 1 else ''}): {how}"
            for name, (_, how) in zip(by_group, parts)
        )
    )
    how += "".join(f" + {what}" for _, what in again)
    return volume, how + (" + clip-norm all-reduce (squared shard norms, one fp32)" if clip else "")


@dataclass(frozen=True)
class GroupSums:
    """What the data cut reads of the records of one reduce group."""

    phi: int  # elements of this rank's parameters (its stages, its TP and EP shards)
    flat: int  # elements of their ZeRO flat buffers, padded (0 without ZeRO)


def record_sums(records) -> dict[str, GroupSums]:
    """By reduce group (in the order the records first name them), Phi and the padded elements of
    the distinct flat buffers the records sit in."""
    phi: dict[str, int] = {}
    buffers: dict[str, set[tuple[int, int]]] = {}
    for pl in records:
        if pl.frozen:  # [lora]: no gradient to reduce
            continue
        phi[pl.reduce] = phi.get(pl.reduce, 0) + pl.local_numel()
        if pl.flat is not None:
            buffers.setdefault(pl.reduce, set()).add((pl.flat.buffer, pl.flat.padded))
    return {g: GroupSums(phi[g], sum(padded for _, padded in buffers.get(g, ()))) for g in phi}


def screened_sums(args, cfg) -> dict[str, GroupSums]:
    """`record_sums` of rank 0's `screened_placements` (each parameter a buffer of its own, padded to
    a multiple of its shard group: `padded_alone`), summed per kind of block without the records;
    once per layout and shard group sizes."""
    sizes = shard_group_sizes(cfg)
    key = ("sums", composed_key(args, cfg, 0), tuple(sizes.items()), bool(cfg.parallel.zero))
    if key not in SUMS:
        parts = composition(args, replace(cfg, parallel=plain_dims(cfg.parallel)), 0)
        shards = sizes if cfg.parallel.zero else None  # without ZeRO nothing is padded
        per_kind = [kind_sums(records.values(), shards) for records in parts.kinds]
        outside = kind_sums((pl for pl, _ in parts.outside), shards)
        totals: dict[str, tuple[int, int]] = {}
        for sums in [per_kind[k] for _, _, k in parts.blocks] + [outside]:
            for g, (phi, flat) in sums.items():
                old = totals.get(g, (0, 0))
                totals[g] = (old[0] + phi, old[1] + flat)
        SUMS[key] = {g: GroupSums(phi, flat) for g, (phi, flat) in totals.items()}
    return SUMS[key]


SUMS: dict[tuple, dict[str, GroupSums]] = {}  # see `screened_sums`: a few numbers per layout


def kind_sums(records, shards: dict[str, int] | None) -> dict[str, tuple[int, int]]:
    """By reduce group, (elements, elements padded each to a multiple of its group's `shards`; 0
    without them) of `records`."""
    out: dict[str, tuple[int, int]] = {}
    for pl in records:
        numel, old = pl.local_numel(), out.get(pl.reduce, (0, 0))
        padded = -(-numel // shards[pl.reduce]) * shards[pl.reduce] if shards else 0
        out[pl.reduce] = (old[0] + numel, old[1] + padded)
    return out


def group_reduction_volume(cfg, sums: GroupSums, n: int, r: int = 1) -> tuple[float, str]:
    """DDP or ZeRO-1/2/3 of the parameters of one group (`sums`) over n ranks; ZeRO's flat buffers
    (padded to a multiple of n) are the records' flat slots. Hybrid sharding: ZeRO over n ranks
    of each of r replicas, and each rank's 1/n of every buffer all-reduced over the r replicas once
    per step, after the step's last reduce-scatter."""
    dims, train = cfg.parallel, cfg.train
    g = BYTES[train.reduce_dtype]
    phi = sums.phi  # this rank's parameters (its stages, its TP and EP shards)
    if n * r == 1:
        return 0.0, f"one rank, nothing to reduce (Phi={phi:,})"
    if dims.zero == 0:
        ar = ring_factor("all_reduce", n)
        return ar * g * phi, f"all-reduce of every gradient: 2(n-1)/n x {g}B x Phi, n={n}, Phi={phi:,}"
    volume, how = zero_volume(cfg, sums, n)
    if r > 1:
        shard = sums.flat // n
        volume += ring_factor("all_reduce", r) * g * shard
        how += f" + all-reduce of the {shard:,}-element shard over r={r} replicas at {g}B"
    return volume, how


def zero_volume(cfg, sums: GroupSums, n: int) -> tuple[float, str]:
    """ZeRO-1/2/3 inside a shard group of n ranks (see `group_reduction_volume`)."""
    dims, train = cfg.parallel, cfg.train
    g = BYTES[train.reduce_dtype]
    phi, flat = sums.phi, sums.flat
    ag, rs = ring_factor("all_gather", n), ring_factor("reduce_scatter", n)
    acc = train.accumulate
    if dims.zero in (1, 2):
        sends = acc if dims.zero == 2 else 1
        volume = sends * rs * g * flat + ag * PARAM_BYTES * flat
        return (
            volume,
            f"{sends} x reduce-scatter + all-gather of Phi'={flat:,} (Phi={phi:,} padded per bucket) x (n-1)/n, n={n}",
        )
    # resharding: each unit gathered for every forward and backward, of each pipeline microbatch too
    # (a stage keeps its units gathered from its first forward to its last backward without it)
    gathers = 2 * (dims.microbatches if dims.pp > 1 else 1) if dims.reshard_after_forward else 1
    p = BYTES[train.dtype]  # the compute copy: bf16 from the fp32 masters under train.dtype = "bf16"
    volume = acc * (gathers * ag * p * flat + rs * g * flat)
    return (
        volume,
        f"{acc} x ({gathers} all-gathers at {p}B + 1 reduce-scatter at {g}B) of Phi'={flat:,} "
        f"(Phi={phi:,} padded per unit) x (n-1)/n, n={n}",
    )


def tied_regathers(args, cfg, records, n: int) -> list[tuple[float, str]]:
    """ZeRO-3 with resharding, both pipeline ends on this rank (DualPipeV) and a tied embedding: the
    first stage's embedding unit is gathered again for the last stage's head, forward and backward,
    in every microbatch (`Unit.borrowed`)."""
    dims, train = cfg.parallel, cfg.train
    if dims.zero != 3 or dims.pp == 1 or not args.tie_embeddings or not dims.reshard_after_forward:
        return []
    owner = pipeline_plan(args, cfg)[0].stage_rank
    if owner[0] != owner[-1] or owner[0] != 0:
        return []
    flat = records(args, cfg, 0)["tok_embeddings.weight"].flat.padded
    gathers = train.accumulate * 2 * dims.microbatches
    volume = gathers * ring_factor("all_gather", n) * BYTES[train.dtype] * flat
    return [(volume, f"{gathers} all-gathers of the tied embedding's unit ({flat:,}) for the head on the same rank")]


def local_placements(args, cfg, pp_rank: int = 0) -> dict[str, Placement]:
    """The placement records of the rank at pipeline position `pp_rank` (index 0 on dp, cp, tp):
    the real cuts applied to the model on the meta device, under a mesh with no process groups.
    Built once per (model, layout, the train fields the cuts read, position): a search over
    layouts asks for the same records many times. The records are shared: read them only."""
    t = cfg.train
    key = (args, layout_key(records_layout(args, cfg.parallel)), t.bucket_mb, t.global_batch, t.seq_len)
    key += (repr(cfg.moe), repr(cfg.lora), t.dtype if cfg.lora.rank else None, pp_rank)
    if key not in PLACEMENTS:
        kept(key, real_placements(args, cfg, pp_rank))
    return PLACEMENTS[key]


def real_placements(args, cfg, pp_rank: int = 0) -> dict[str, Placement]:
    """`local_placements` built now: the model on the meta device, cut by `parallelize`."""
    dims, t = cfg.parallel, cfg.train
    mesh = Mesh.virtual(dims, rank=int(Mesh.virtual(dims).grid[pp_rank, 0, 0, 0]), moe=args.is_moe)
    options = ParallelizeOptions(t.bucket_mb, None, cfg.moe, t.global_batch, t.seq_len, device="meta")
    if cfg.lora.rank is not None:  # adapters, the rest frozen (`fivecut ledger` of a [lora] run)
        options = replace(options, lora=cfg.lora, param_dtype=torch.bfloat16 if t.dtype == "bf16" else None)
    return parallelize(build_model(args, device="meta"), mesh, options).placements


def records_layout(args, dims):
    """The layout whose records are `dims`'s: in a dense model the parameters are not cut over cp
    (it cuts the sequence) and ZeRO shards over dp x cp as one group, so its records are those of
    dp x cp data-parallel ranks without cp; nor do they depend on the microbatch count (tests
    compare the records). A MoE model's experts are borrowed from dp x cp: its own layout."""
    if args.is_moe:
        return dims
    return replace(
        dims, dp=dims.dp * dims.cp, cp=1, cp_mode="ring", cp_ulysses=1, microbatches=least_microbatches(dims)
    )


PLACEMENTS: dict[tuple, dict] = {}  # see `local_placements`; `kept` drops the oldest
PLACEMENTS_KEPT = 1024


def kept(key: tuple, value: dict) -> dict:
    """Remember `value` under `key` in PLACEMENTS, forgetting the oldest entry when full."""
    return remembered(PLACEMENTS, key, value, PLACEMENTS_KEPT)


def remembered(cache: dict, key, value, limit: int):
    """`cache[key] = value`, first forgetting `cache`'s oldest entry when it holds `limit`: the
    planner's caches stay bounded however many searches a process runs."""
    if len(cache) >= limit:
        cache.pop(next(iter(cache)))
    cache[key] = value
    return value


def model_token(args) -> int:
    """A number standing for the model `args` in cache keys, never reused: hashing a model's many
    fields costs more than the rest of a key (an equal model elsewhere only gets its own number)."""
    if LAST_TOKEN and LAST_TOKEN[0] is args:  # a search asks for one model many times in a row
        return LAST_TOKEN[1]
    entry = TOKENS.get(id(args))
    if entry is None or entry[0] is not args:  # kept with its number: its id stays its own meanwhile
        entry = remembered(TOKENS, id(args), (args, next(TOKEN_NUMBERS)), PLACEMENTS_KEPT)
    LAST_TOKEN[:] = entry
    return entry[1]


TOKENS: dict[int, tuple] = {}
LAST_TOKEN: list = []  # the last model asked for and its number
TOKEN_NUMBERS = itertools.count()


def dims_key(dims, skip: str = "") -> tuple:
    """`layout_key(dims)` with the field `skip` left out (None in its place): a cheap key of a layout."""
    return tuple(None if k == skip else tuple(v) if isinstance(v, list) else v for k, v in vars(dims).items())


def screened_placements(args, cfg, pp_rank: int = 0) -> dict[str, Placement]:
    """The records of `local_placements` without building the whole model: the real cuts applied
    to one block of each kind (dense, MoE), then each block of the rank's stages given the records
    of its kind. Their counts are exact (tests compare them); ZeRO's flat buffers are not built:
    each parameter stands for a buffer of its own, padded to a multiple of its shard group."""
    dims = cfg.parallel
    key = composed_key(args, cfg, pp_rank)
    if key not in PLACEMENTS:
        kept(key, composed_placements(args, replace(cfg, parallel=plain_dims(dims)), pp_rank))
    if not dims.zero:
        return PLACEMENTS[key]
    flat_key = ("padded", key, tuple(shard_group_sizes(cfg).items()))  # all that `padded_alone` reads of ZeRO
    if flat_key not in PLACEMENTS:
        kept(flat_key, padded_alone(PLACEMENTS[key], cfg))
    return PLACEMENTS[flat_key]


def plain_dims(dims):
    """`dims` without what does not change which parameters a rank holds: ZeRO and the microbatch count."""
    return replace(dims, zero=0, zero_shard=None, reshard_after_forward=True, microbatches=least_microbatches(dims))


PLAIN = {"zero": 0, "zero_shard": None, "reshard_after_forward": True}  # `plain_dims`'s fields, microbatches aside


def composed_key(args, cfg, pp_rank: int) -> tuple:
    """The key of `screened_placements`'s records: `layout_key(plain_dims(dims))` without building it;
    a dense model's as `records_layout` gives it (its records are those of dp x cp ranks without cp)."""
    dims, t = cfg.parallel, cfg.train
    fields = vars(dims) | PLAIN
    fields["microbatches"] = least_microbatches(dims)
    if not args.is_moe:
        fields |= {"dp": dims.dp * dims.cp, "cp": 1, "cp_mode": "ring", "cp_ulysses": 1}
    if isinstance(dims.pp_layers, list):  # the one list among the fields (`layout_key`)
        fields["pp_layers"] = tuple(dims.pp_layers)
    plain = tuple(fields.values())
    return ("composed", model_token(args), plain, t.bucket_mb, t.global_batch, t.seq_len, repr(cfg.moe), pp_rank)


def least_microbatches(dims) -> int:
    """The fewest microbatches `dims`'s schedule runs (the stage split and owners are the same for any count)."""
    if dims.pp == 1:
        return 1
    return 2 * dims.pp if dims.pp_schedule == "dualpipev" else dims.pp


def virtual_mesh(dims, moe: bool) -> Mesh:
    """`Mesh.virtual(dims, 0, moe)`, once per what a mesh reads of `dims` (its sizes, the cp and ep
    cuts, hybrid sharding's groups; not the schedule, the microbatches or the ZeRO stage): a search
    costs many layouts on one mesh. Shared: read its groups only."""
    key = (dims.shape, dims.cp_mode, dims.cp_ulysses, dims.ep, dims.etp, dims.hybrid, dims.shard_size, moe)
    if key not in MESHES:
        MESHES[key] = Mesh.virtual(dims, rank=0, moe=moe)
    return MESHES[key]


MESHES: dict[tuple, Mesh] = {}  # see `virtual_mesh`


def layout_key(dims) -> tuple:
    return tuple(tuple(v) if isinstance(v, list) else v for v in vars(dims).values())


@dataclass
class Composition:
    """What the screen composes a rank's records from: the one-block model's cut records by kind of
    block (each name after `layers.K.`), the (stage, layer, kind) of each block the rank holds, and
    the records outside the blocks it holds with their stage."""

    kinds: list[dict[str, Placement]]
    blocks: list[tuple[int | None, int, int]]
    outside: list[tuple[Placement, int]]


def composition(args, cfg, pp_rank: int) -> Composition:
    dims = cfg.parallel
    kinds, _ = block_kinds(args)
    cut, by_kind = one_block_cut(args, cfg)
    sched, layers = pipeline_plan(args, cfg) if dims.pp > 1 else (None, [range(args.n_layers)])
    stages = [s for s in range(len(layers)) if sched is None or sched.stage_rank[s] == pp_rank]
    held = [(s if sched is not None else None, i, kinds.index(args.moe_layer(i))) for s in stages for i in layers[s]]
    last, outside = len(layers) - 1, []
    for name, pl in cut.items():
        head = not name.startswith(("layers.", "tok_embeddings."))
        if (name.startswith("tok_embeddings.") and (0 in stages or ends_copy(args, sched, stages, last))) or (
            head and last in stages
        ):
            outside.append((pl, 0 if name.startswith("tok_embeddings.") and 0 in stages else last))
    return Composition(by_kind, held, outside)


def one_block_cut(args, cfg) -> tuple[dict[str, Placement], list[dict[str, Placement]]]:
    """The real cuts of the model of one block of each kind under `cfg`'s layout without its pipeline,
    and those records by kind of block (each name after `layers.K.`); once per layout, for all of its
    pipeline positions."""
    key = composed_key(args, cfg, None)
    if key not in BLOCK_CUTS:
        kinds, blocks = block_kinds(args)
        short = replace(cfg, parallel=block_layout(args, cfg.parallel))
        cut = local_placements(replace(args, n_layers=len(kinds), first_dense_layers=blocks), short, 0)
        by_kind = [
            {name.removeprefix(f"layers.{k}."): pl for name, pl in cut.items() if name.startswith(f"layers.{k}.")}
            for k in range(len(kinds))
        ]
        BLOCK_CUTS[key] = cut, by_kind
    return BLOCK_CUTS[key]


BLOCK_CUTS: dict[tuple, tuple] = {}  # see `one_block_cut`: a few records per layout


def composed_placements(args, cfg, pp_rank: int) -> dict[str, Placement]:
    parts = composition(args, cfg, pp_rank)
    out: dict[str, Placement] = {}
    for stage, i, k in parts.blocks:
        for suffix, pl in parts.kinds[k].items():
            renamed = f"layers.{i}.{suffix}"
            out[renamed] = altered(pl, name=renamed, stage=stage)
    for pl, stage in parts.outside:
        out[pl.name] = altered(pl, stage=stage)
    return padded_alone(out, cfg)


def composed_counts(args, cfg, pp_rank: int) -> dict[str, int]:
    """The local parameter counts of `composed_placements`'s records by reduce group, without
    building them: each block adds its kind's counts (a renamed record keeps its shape and cut)."""
    parts = composition(args, cfg, pp_rank)
    per_kind = [group_counts(records.values()) for records in parts.kinds]
    counts: dict[str, int] = {}
    for _, _, k in parts.blocks:
        for group, n in per_kind[k].items():
            counts[group] = counts.get(group, 0) + n
    for group, n in group_counts(pl for pl, _ in parts.outside).items():
        counts[group] = counts.get(group, 0) + n
    return counts


def group_counts(records) -> dict[str, int]:
    """The trained parameters' elements by reduce group (a [lora] run's frozen ones: `frozen_bytes`)."""
    counts: dict[str, int] = {}
    for pl in records:
        if not pl.frozen:
            counts[pl.reduce] = counts.get(pl.reduce, 0) + pl.local_numel()
    return counts


def frozen_bytes(args, cfg, pp_rank: int = 0) -> int:
    """[lora]: the frozen weights this rank holds, whole on every data-parallel rank, in their dtype
    (the matmuls' in bf16 under train.dtype = "bf16": they are read, never updated)."""
    if cfg.lora.rank is None:
        return 0
    records = local_placements(args, cfg, pp_rank)
    nf4 = cfg.lora.quantize == "nf4"  # QLoRA: the adapted layers' weights in 4 bits
    return sum(
        nf4_bytes(pl.local_numel()) if nf4 and f"{name.removesuffix('.weight')}.lora_a" in records else
        pl.itemsize * pl.local_numel()
        for name, pl in records.items()
        if pl.frozen
    )  # fmt: skip


def block_kinds(args) -> tuple[list[bool], int]:
    """The kinds of block the model has (False: dense, True: MoE) and, for the one-block-each
    model, how many dense blocks come first."""
    kinds = sorted({args.moe_layer(i) for i in range(args.n_layers)})
    return kinds, 1 if kinds == [False, True] else 0


def unpipelined(dims):
    """The layout without its pipeline or its ZeRO: the cuts inside a block are the same."""
    return replace(
        dims, pp=1, pp_schedule="1f1b", pp_virtual=1, microbatches=1, pp_layers=None, zero=0, zero_shard=None
    )


def block_layout(args, dims):
    """The layout whose cuts the screen applies to one block of each kind: `unpipelined`, and for a
    dense model on one data-parallel rank and no cp (without ZeRO or experts the data cut slices
    nothing, and cp cuts the sequence; a test compares the records): a search's layouts of every
    dp and cp share one build."""
    short = unpipelined(dims)
    return short if args.is_moe else replace(short, dp=1, cp=1, cp_mode="ring", cp_ulysses=1)


def ends_copy(args, sched, stages: list[int], last: int) -> bool:
    """A tied head on the last stage holds its own copy of the embedding, unless the first stage
    is on the same rank (DualPipeV)."""
    return args.tie_embeddings and sched is not None and last in stages and 0 not in stages


def altered(pl: Placement, **fields) -> Placement:
    """`dataclasses.replace(pl, **fields)` for a record, without its per-field work (a record
    has no `__post_init__`): the screen renames and pads many thousands of them."""
    out = object.__new__(Placement)
    out.__dict__.update(vars(pl), **fields)
    return out


def padded_alone(records: dict[str, Placement], cfg) -> dict[str, Placement]:
    if not cfg.parallel.zero:
        return records
    sizes = shard_group_sizes(cfg)
    out = {}
    for i, (name, pl) in enumerate(records.items()):
        n, numel = sizes[pl.reduce], pl.local_numel()
        padded = -(-numel // n) * n
        out[name] = altered(pl, flat=FlatSlot(i, 0, numel, padded, 0, padded // n))
    return out


def local_param_counts(args, cfg, pp_rank: int = 0, records=None) -> dict[str, int]:
    """This rank's parameters by the group that sums their gradients (`reduce_group_sizes`)."""
    key = (id(records), composed_key(args, cfg, pp_rank))  # counts do not depend on ZeRO or the microbatches
    if key not in COUNTS:
        if records is None:  # the screen's: `composed_placements`'s counts
            COUNTS[key] = composed_counts(args, replace(cfg, parallel=plain_dims(cfg.parallel)), pp_rank)
        else:
            COUNTS[key] = group_counts(records(args, cfg, pp_rank).values())
    return dict(COUNTS[key])


COUNTS: dict[tuple, dict[str, int]] = {}  # see `local_param_counts`: a few numbers per layout
