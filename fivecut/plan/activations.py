"""Activation memory a transformer layer keeps for backward, in the manner of Korthikanti et
al. ("Reducing Activation Recomputation in Large Transformer Models"), for fivecut's layer:
RMSNorm, grouped-query attention through SDPA (flash: saves q, k, v, the output and one
log-sum-exp per query), SwiGLU, no dropout.

In units of b*s*h elements per layer, with t tensor-parallel ranks:

    norms      6     input, normalized input and output of both norms (output = the
                     input the q/k/v or w1/w3 projections save)        -> /t only with SP
    attention  2/t + 2*kv*hd/h      q and attention output; k and v (kv = kv heads per rank)
    MLP        4F/(h t)             w1 out, silu(w1 out), w3 out, their product

plus per token: 2 rstd values (norms; /t with SP) and a/t log-sum-exps. A MoE block replaces
the MLP term by what its router, dispatch, experts, combine and shared experts keep
(`moe_bytes`), which depends on how many rows this rank sent and received. Megatron's
figure for GPT (fp16, dropout, 4h GeLU MLP) is sbh(10 + 24/t + 5as/(ht)) with TP and
sbh(34/t + 5as/(ht)) with TP+SP: the same split between what TP leaves replicated and
what it cuts, which SP then cuts too.

Those units are at 4 bytes (train.dtype = "fp32"). Under bf16 autocast each saved tensor has
its own dtype (`precision_of`; measured with `fivecut ledger`, every term exact):
    "bf16"   (fp32 weights) norms keep their input and normalized input in fp32; each linear
             reading a norm's output saves its own bf16 cast of it, whole even under SP (the
             regathered fp32 input is not what is saved): 3 (q, k, v) + 2 (w1, w3) x 2h bytes
             per token; q, k, v, the attention output and the SwiGLU tensors are bf16; rstd and
             log-sum-exps fp32. The linears' bf16 weights are not per microbatch: each matmul
             weight is cast once a step (`fivecut.parallel.precision`) and that one copy is held
             for every microbatch in flight (`weight_copies`, counted once per rank by the
             planner); only a replicated k/v weight (t > kv heads) is still cast per forward,
             sliced to this rank's head (`replicated_kv_copies`)
    "bf16-params" (ZeRO-3's bf16 units) a bf16 residual stream: each norm keeps an fp32 upcast
             of its input, the normalized input in fp32 and its bf16 output once (all / t with
             SP); no weight copies

Recomputation (`fivecut.parallel.recompute`) changes the terms for the blocks it picks:
    full       only the block's input: 1 (/t with SP), the residual stream
    selective  no log-sum-exps (the attention core keeps only q, k, v, which it saved
               anyway; under Ulysses no second copy of the output); MLP 2F/(h t): w1 out
               and w3 out, the product recomputed (routed and shared experts: 2H per row, not 4H)
"""

from __future__ import annotations

FP32 = 4
BYTES = {"fp32": 4, "bf16": 2, "bf16-params": 2}  # a matmul's input or output under each precision


def recomputed(layer_id: int, every: int) -> bool:
    """Recomputation's rule (`train.recompute_every`): block `layer_id`, its id in the whole model,
    is recomputed when id % every == 0 (every=1: all; 2: blocks 0, 2, 4, ...)."""
    return layer_id % every == 0


def layer_mode(layer_id: int, recompute: str, every: int) -> str:
    """The recomputation mode block `layer_id` runs in."""
    return recompute if recomputed(layer_id, every) else "none"


def activation_bytes_per_layer(
    args,
    batch: int,
    seq: int,
    tp: int,
    sp: bool,
    precision: str = "fp32",
    moe_rows: tuple[int, int] | None = None,
    cp: int = 1,
    recompute: str = "none",
    cp_mode: str = "ulysses",
    cp_ulysses: int = 1,
    etp: int = 1,
    ep: int = 1,
    eplb_slots: int = 0,
    documents: bool = False,
    fused_norm: bool = False,
    split: bool = False,
    idle: frozenset[str] = frozenset(),
    layer: int | None = None,
) -> float:
    """Bytes one block keeps for backward, `seq` being this rank's tokens of a sequence (its
    chunk under context parallelism); `moe_rows` = (rows sent, rows received) by this rank's
    dispatch makes it a MoE block (see `moe_bytes`). Ulysses (cp > 1) keeps the same bytes per
    token, except that kv heads too few to split over cp are repeated to one per query head, and
    the attention output is kept twice: by the core ([b, H/cp, s, hd]) and, back in sequence
    chunks, by the output projection. Ring attention keeps exactly what one device keeps for
    its chunk: q, k, v, the output and the log-sum-exp of its own tokens (the K/V blocks of
    the other ranks are passed round again in backward, not kept); selective recomputation
    leaves the ring's core as it is (recomputing it would repeat its passes to save only the
    log-sum-exps). USP (Ulysses degree `cp_ulysses` = U) keeps the same bytes per token as
    Ulysses over U around the ring: kv heads repeated when too few to split over U, the output
    twice (the ring's and the output projection's input) and the log-sum-exps, in every mode but
    full (the ring's core is never recomputed); with U = 1 it is the ring. `recompute`: the
    block's mode ("none" for a block that `recompute_every` leaves out). `etp`: expert tensor
    parallelism (see `moe_bytes`). `documents` (data.document_mask): SDPA keeps its mask, converted
    to the matmuls' dtype, [b, 1, S, S] over the sequence the core sees (the whole sequence, also
    inside Ulysses), unless the core is recomputed; the ring builds each pair's mask again in
    backward and keeps none. `fused_norm`: the norms run CUDA's fused kernel (`norm_bytes`).
    `split`: the zero-bubble split of backward (`fivecut.parallel.pipeline.wgrad`): its linears
    keep their input as it comes, so under autocast over fp32 weights each norm's fp32 output is
    kept once (this rank's slice under SP) instead of each reader's bf16 cast of it. `idle`: the
    block's linears (paths inside it: "attention.wq", "feed_forward.router") that keep no input,
    frozen without an adapter ([lora]): no bf16 cast of it under autocast, the norm's output not
    at all when no reader keeps it, the SwiGLU's product not when its down projection is idle.
    `layer`: the block's id, whose window (`ModelArgs.layer_window`) decides its band mask (None: a
    window on any layer counts). Gemma: the sandwich's second norms keep `post_norm_bytes` and an rstd
    each; soft-capped scores (attn_softcap) run the explicit core (`capped_core_bytes`)."""
    usp = cp > 1 and cp_mode == "usp"
    ring = cp > 1 and cp_mode == "ring"
    u = cp_ulysses if usp else (1 if ring else cp)  # the Ulysses degree
    h, hd = args.dim, args.head_dim
    a = BYTES[precision]  # matmul inputs and outputs (autocast's dtype); norms' stats, lse: fp32
    cut = tp if sp else 1  # what SP cuts: the residual stream and the norms
    if recompute == "full":  # only the block's input: the residual stream (bf16 with bf16 weights)
        return (2 if precision == "bf16-params" else 4) * batch * seq * h / cut
    plain = recompute == "none"
    swiglu = 4 if plain else 2  # tensors of [tokens, hidden] a SwiGLU keeps
    kv_heads_per_rank = max(args.n_kv_heads // tp, 1)
    if u > 1 and kv_heads_per_rank % u:
        kv_heads_per_rank = args.n_heads // tp
    # the linears reading the attention's norm: wq_a (or wq), wkv_a; wq, wk, wv; the MLP's: w1, w3
    first = ("wq_a" if args.q_lora_rank else "wq", "wkv_a") if args.is_mla else ("wq", "wk", "wv")
    readers = sum(f"attention.{n}" not in idle for n in first)
    mlp_readers = sum(f"feed_forward.{n}" not in idle for n in ("w1", "w3")) if moe_rows is None else 0
    norms = kept_norm_bytes(precision, h, cut, readers, fused_norm, split, readers > 0)
    norms += kept_norm_bytes(precision, h, cut, mlp_readers, fused_norm, split, moe_rows is None or moe_reads(idle))
    norms += (args.block_norms - 2) * post_norm_bytes(precision, h, cut, fused_norm)
    capped = bool(args.attn_softcap) and not args.is_mla
    if moe_rows is not None and tp > 1 and not sp:  # the MoE layer keeps only its slice of the norm's output (a copy)
        norms += FP32 * h * (1 / tp - 1) if precision == "fp32" else 0.0
    twice = u > 1 and (plain or usp)  # the core's output and, back in sequence chunks, the projection's input
    if args.is_mla:
        sequence_cut = "usp" if usp and u > 1 else "ring" if ring or usp else "ulysses" if u > 1 else "none"
        attention = a * latent_attention_floats(args, tp, plain, sequence_cut)
        attention += latent_norm_bytes(args, precision, fused_norm, split)
    elif capped and plain:
        attention = a * 4 * args.n_heads * hd / tp + head_norm_bytes(args, tp, kv_heads_per_rank, precision, fused_norm)
    else:
        width = args.n_heads * hd  # q's and the output's channels (h, unless the head size is its own)
        attention = a * (2 * width / tp + 2 * kv_heads_per_rank * hd + (width / tp if twice else 0))
        attention += head_norm_bytes(args, tp, kv_heads_per_rank, precision, fused_norm)
        # the core's output, merged for wo, is copied unless Ulysses lays it out by tokens or the core is recomputed
        attention += merge_copy_bytes(args, tp, precision) if u == 1 and (plain or ring or usp) else 0.0
    product = plain and "feed_forward.w2" in idle  # the SwiGLU product w2 would keep for its dW
    mlp = a * (swiglu - product) * args.ffn_dim / tp if moe_rows is None else 0.0
    lse = (plain or ring or usp) and not capped  # the log-sum-exps, unless the core is recomputed (or explicit)
    per_token = FP32 * (args.block_norms / cut + (args.n_heads / tp if lse else 0))  # rstd; lse
    dense = batch * seq * (norms + attention + mlp + per_token) + replicated_kv_copies(args, tp, precision)
    window = args.layer_window(layer) if layer is not None else args.has_window
    if capped and plain:
        dense += capped_core_bytes(args, batch, seq, tp, u, documents)
    elif documents and plain and not (ring or usp):  # the core's mask [b, 1, s, s] (Ulysses: u chunks gathered),
        dense += a * batch * (seq * u) ** 2  # the window's band inside it when there is one
    elif plain and window and not (ring or usp or args.is_mla):  # the band the fused kernel keeps: an additive mask
        dense += a * (seq * u) ** 2  # [s, s] over the whole sequence (Ulysses gathers it); full layers have none
    if moe_rows is None:
        return dense
    return dense + moe_bytes(args, batch * seq // tp, *moe_rows, precision, swiglu, etp, ep, eplb_slots, split, idle)


def capped_core_bytes(args, batch: int, seq: int, tp: int, u: int, documents: bool) -> float:
    """What the explicit core of soft-capped scores (`fivecut.model.transformer.capped_attention`)
    keeps beyond its q, k and v (repeated to every query head: counted with the attention), over the
    H/(t u) heads and the s u positions it sees: the capped scores' tanh and the softmax, 8 B a score
    (fp32: 4 + 4; under bf16 the bf16 tanh, the fp32 softmax and its bf16 cast the product reads:
    2 + 4 + 2), and its bool mask [s u, s u] ([b, 1, s u, s u] with documents)."""
    scores = batch * args.n_heads / tp * seq * seq * u  # b (H/(t u)) (s u)^2
    return 8 * scores + (batch if documents else 1) * (seq * u) ** 2


def post_norm_bytes(precision: str, h: int, cut: int, fused: bool) -> float:
    """Per token, a norm on a sublayer's output (Gemma's second norms, `sandwich_norms`): `norm_bytes`
    without an output kept, as only the residual add reads it (and keeps nothing)."""
    output = {"fp32": FP32, "bf16": 0, "bf16-params": 2}[precision] * h / cut
    return norm_bytes(precision, h, cut, 0, fused) - output


def kept_norm_bytes(precision: str, h: int, cut: int, readers: int, fused: bool, split: bool,
                    read: bool = True) -> float:  # fmt: skip
    """`read_norm_bytes` of a norm whose output `readers` linears keep (casts under autocast); when
    nothing keeps the output (`read` false: every reader idle, [lora]), fp32 and bf16-params leave
    it out too (the frozen norm weight's product keeps nothing of it)."""
    out = read_norm_bytes(precision, h, cut, readers, fused, split)
    if read or precision == "bf16":
        return out
    return out - (FP32 if precision == "fp32" else 2) * h / cut


def moe_reads(idle: frozenset[str]) -> bool:
    """Whether a MoE layer's router or shared experts keep the normalized input (not all idle)."""
    return not {"feed_forward.router", "feed_forward.shared.w1", "feed_forward.shared.w3"} <= idle


def read_norm_bytes(precision: str, h: int, cut: int, readers: int, fused: bool, split: bool) -> float:
    """`norm_bytes` of a norm read by `readers` linears; under the zero-bubble split those keep the
    norm's output itself (`activation_bytes_per_layer`): under autocast over fp32 weights one fp32
    copy, this rank's slice under SP; under the other precisions the same bytes as unsplit."""
    if split and precision == "bf16" and readers:
        return norm_bytes(precision, h, cut, 0, fused) + FP32 * h / cut
    return norm_bytes(precision, h, cut, readers, fused)


def deferred_bytes_per_layer(args, batch: int, seq: int, tp: int, precision: str, moe: bool) -> float:
    """What one block's zero-bubble split keeps from its B to its W (`wgrad.Deferred`): each
    linear layer's input x and output gradient dy, each storage once, for `seq` tokens of this
    rank (its chunk under CP). x of a column-parallel layer is the whole sequence (SP gathers it
    again in backward) in the residual stream's dtype (the norms' output: fp32, bf16 with bf16
    weights), shared by the layers reading one norm; a row-parallel layer's dy is the whole
    [t, h]; everything else in the matmuls' dtype, cut by t where its layer is:
        attention   x + wo's input (H hd/t) + dy of wq, wk, wv, wo (H hd/t + 2 K hd/t + h); kv
                    projections replicated over t (K < t, `ReplicatedKV`) reduce in B, keep nothing
        MLA         x + dy of wq_a (r_q) and wkv_a (r_kv + rope) + wq_b's and wkv_b's inputs (the
                    latents' norms' outputs, in the residual's dtype) and dy (H qk/t, H (nope + v)/t)
                    + wo's input and dy (H v/t, h); without a query latent wq's dy (H qk/t)
        MLP         x + w2's input (F/t) + dy of w1, w3, w2 (2F/t + h)
        MoE         x + the router's dy (E) + the shared experts' MLP (their hidden size; the
                    routed experts' grouped GEMMs compute their gradients in B)"""
    a = BYTES[precision]
    r = 2 if precision == "bf16-params" else FP32  # what the norms give the linears
    h = args.dim
    if args.is_mla:
        heads = args.n_heads / tp
        q = args.q_lora_rank
        attention = a * (args.kv_lora_rank + args.qk_rope_head_dim) + r * args.kv_lora_rank
        attention += a * heads * (args.qk_nope_head_dim + args.v_head_dim)  # wkv_b's dy
        attention += a * (q + heads * args.qk_head_dim) + r * q if q else a * heads * args.qk_head_dim
        attention += a * (heads * args.v_head_dim + h)  # wo
    else:
        width = args.n_heads * args.head_dim / tp
        kv = 2 * args.n_kv_heads // tp * args.head_dim  # 0 when replicated
        attention = a * (2 * width + kv + h)
    if moe:
        shared = args.expert_dim * args.n_shared_experts / tp
        mlp = a * (args.n_experts + (3 * shared + h if shared else 0))
    else:
        mlp = a * (3 * args.ffn_dim / tp + h)
    return batch * seq * (2 * r * h + attention + mlp)


def head_norm_bytes(args, tp: int, kv_heads_per_rank: int, precision: str, fused: bool = False) -> float:
    """Per token, Qwen3's per-head q and k norms: each keeps its input in fp32 (under autocast the
    fp32 upcast of the projection's output: the CPU's composite norm makes it, CUDA's autocast
    makes it for the fused kernel; but CUDA's fused kernel on ZeRO-3's bf16 units, outside
    autocast, keeps the bf16 input itself) and, but for CUDA's fused kernel (`norm_bytes`), its
    fp32 normalized input, hd per head, and one fp32 rstd per head (RoPE after it keeps only its
    tables). OLMo 2's norms over the whole projections (qk_norm_whole) keep the same per channel and
    one rstd per token each, q's and k's; under tp > 1 they are `ProjectionRMSNorm`s, composite
    (never CUDA's fused kernel). The copy wo keeps of per-head-normed heads is `merge_copy_bytes`."""
    if not args.qk_norm:
        return 0.0
    heads, a = args.n_heads / tp + kv_heads_per_rank, BYTES[precision]
    fused = fused and not (args.qk_norm_whole and tp > 1)
    kept = (a if precision == "bf16-params" else FP32) if fused else 2 * FP32  # bytes an element
    rstds = 2 if args.qk_norm_whole else heads
    return heads * kept * args.head_dim + FP32 * rstds


def merge_copy_bytes(args, tp: int, precision: str) -> float:
    """Per token, the copy of the core's output that wo keeps when q reaches the core laid out
    [b, H, s, hd] (normed per head, or the concatenation of partial rotary's turned and passed
    channels): the output follows q's layout, so merging its heads copies it. A q that is a view of
    its projection (no per-head norm, RoPE over whole heads) keeps the output in token order and
    the merge is a view. The caller leaves it out where there is no such copy: under Ulysses (whose
    all-to-all lays the output out by tokens; counted with `twice`) and where the core is recomputed
    (selective recomputation of a core on one device or under Ulysses: the merge is redone too)."""
    head_major = (args.qk_norm and not args.qk_norm_whole) or args.rope_partial_dim
    return BYTES[precision] * args.n_heads / tp * args.head_dim if head_major else 0.0


def latent_attention_floats(args, tp: int, plain: bool, sequence_cut: str = "none") -> float:
    """Floats per token (in the matmuls' dtype) that multi-head latent attention's core keeps for
    backward on one of `tp` ranks, besides the block's norm (counted with the norms), the latents'
    norms (`latent_norm_bytes`) and the log-sum-exps (counted per token). The heads (H/t of them)
    are cut; qk = nope + rope:
        core           (H/t)(2 qk + v' + o')   q and k; v' = qk, the value zero-padded to the head
                                      size (`CausalSDPA`), or nope + v without padding (a view of
                                      wkv_b's output); o' = the output (qk padded, else v) and
                                      wo's [b, s, H v] copy of it (q is laid out [b, H, s, qk], and
                                      SDPA's output follows q's layout, so the transpose copies)
    Selective recomputation keeps the core's inputs q, k, v (a view of wkv_b's output: nope + v)
    and wo's input (v) instead of the core's tensors.
    Under context parallelism (`sequence_cut`) the core's tensors are those of the sequence cut:
        ulysses   q, k, v come from the all-to-alls (v alone, no longer a view: v; padded by the
                  core as on one device), and wo's input from the one back (v); selective: q, k,
                  v and wo's input: 2 qk + 2 v
        ring      q, k, v (the view: nope + v) and the ring's output without its padding (v),
                  laid out [b, s, H, v] so wo's input is a view of it: 2 qk + nope + 2 v in every
                  mode but full (the ring's core is never recomputed)
        usp       Ulysses' all-to-all outputs q, k, v (v alone), the ring's output (v) and the
                  all-to-all's back (wo's input, v): 2 qk + 3 v"""
    heads, qk, nope, v = args.n_heads / tp, args.qk_head_dim, args.qk_nope_head_dim, args.v_head_dim
    padded = v < qk
    if sequence_cut == "ring":
        core = 2 * qk + nope + 2 * v
    elif sequence_cut == "usp":
        core = 2 * qk + 3 * v
    elif plain:
        core = 2 * qk + (qk if padded else v if sequence_cut == "ulysses" else nope + v) + (qk if padded else v) + v
    else:
        core = 2 * qk + (0 if sequence_cut == "ulysses" else nope) + 2 * v
    return heads * core


def latent_norm_bytes(args, precision: str, fused: bool, split: bool = False) -> float:
    """Bytes per token the query and key-value latents' norms keep (the latents are whole on every
    tp rank; r = the latent's rank), with the rstd (4 B):
        fp32        the norm's input (wq_a's output; kv_norm's is a view of wkv_a's, whose rope
                    channels it keeps alive: r + rope), the normalized input (not under CUDA's
                    fused kernel) and the output, which the next linear keeps: 4 (3r [+ rope]) + 4,
                    fused 4 (2r [+ rope]) + 4
        bf16        (autocast over fp32 weights) the input's fp32 upcast (the CPU's composite norm
                    makes it; CUDA's autocast runs `rms_norm` in fp32 and makes it for the fused
                    kernel), the fp32 normalized input (not fused), and the next linear's bf16 cast
                    of the fp32 output: 10r + 4, fused 6r + 4 (the bf16 matmul output is not kept)
        bf16-params (bf16 weights: the norm runs outside autocast, `fivecut.model.transformer.rms_norm`)
                    the composite norm as under bf16, its output already bf16: 10r + 4; the fused
                    kernel keeps its bf16 input and output, as under fp32 at 2 B: 2 (2r [+ rope]) + 4
    Nothing for the query without a latent (wq reads the block's norm). Under the zero-bubble
    split (`split`) the next linear keeps the fp32 output itself under bf16: 2r more."""
    ranks = [(args.kv_lora_rank, args.qk_rope_head_dim)] + ([(args.q_lora_rank, 0)] if args.q_lora_rank else [])
    if precision == "fp32" or (fused and precision == "bf16-params"):
        a = BYTES[precision]
        return sum(a * ((2 if fused else 3) * r + rope) + FP32 for r, rope in ranks)
    return sum((6 if fused else 10) * r + 2 * r * split + FP32 for r, _ in ranks)


def norm_bytes(precision: str, h: int, cut: int, consumers: int, fused: bool = False) -> float:
    """Bytes per token one RMSNorm leaves saved, with `consumers` linears reading its output and
    `cut` = t under SP (else 1). fp32: input, normalized input, output (4 B, all / cut).
    bf16 (autocast, fp32 weights): input and normalized input fp32 / cut; each linear saves its
    own bf16 cast of the (gathered) output, whole: consumers x 2h. bf16-params (ZeRO-3's bf16
    units: a bf16 residual stream): the fp32 upcast of the input and the normalized input, and
    the bf16 output, saved once (under SP as this rank's slice), all / cut.
    `fused`: the norm is CUDA's `_fused_rms_norm`, whose backward reads the input and the rstd
    only: no normalized input (fp32, bf16: 4h less), and under bf16-params the bf16 input itself
    instead of its fp32 upcast (2h + 2h output). The CPU's composite norm saves the normalized
    input; `fivecut plan --check` runs either (`fivecut.train.memory_check.KernelRMSNorm`)."""
    if precision == "fp32":
        return FP32 * (2 if fused else 3) * h / cut
    if precision == "bf16":
        return FP32 * (1 if fused else 2) * h / cut + 2 * consumers * h
    return ((2 + 2) * h if fused else (FP32 * 2 * h + 2 * h)) / cut


def weight_copies(args, tp: int, precision: str, moe: bool, ep: int = 1, etp: int = 1) -> float:
    """The bf16 compute copies of one block's matmul weights on one rank, made once a step and
    shared by every microbatch (`fivecut.parallel.precision`): 2 B x the block's local attention
    weights (a replicated k/v weight is not among them: `replicated_kv_copies`) and its dense MLP,
    or its router, this rank's E/ep routed experts (their hidden size / etp) and shared experts."""
    if precision != "bf16":
        return 0.0
    h = args.dim
    attention = attention_copy_elements(args, tp)
    if not moe:
        return 2 * (attention + 3 * h * args.ffn_dim // tp)
    e, shared = args.n_experts, args.expert_dim * args.n_shared_experts
    experts = h * e + 3 * (e // ep) * h * args.expert_dim // etp + 3 * h * shared
    return 2 * (attention + experts)


def attention_copy_elements(args, tp: int) -> int:
    """Elements of one block's attention weights (and QKV biases) a rank copies to bf16: GQA's wq,
    wo and, when its kv heads split over tp, wk and wv, each / tp; latent attention's wq_a and
    wkv_a whole (the latents are whole on every rank) and its head-cut wq_b (or wq), wkv_b, wo / tp."""
    if args.is_mla:
        shapes = args.mla_shapes()
        whole = shapes.get("wq_a", 0) + shapes["wkv_a"]
        cut = shapes.get("wq_b", shapes.get("wq", 0)) + shapes["wkv_b"] + shapes["wo"]
        return whole + cut // tp
    h, hd = args.dim, args.head_dim
    kv_split = args.n_kv_heads % tp == 0
    kv = 2 * args.n_kv_heads * hd * h // tp if kv_split else 0
    biases = (args.n_heads + (2 * args.n_kv_heads if kv_split else 0)) * hd // tp if args.qkv_bias else 0
    return 2 * args.n_heads * hd * h // tp + kv + biases


def replicated_kv_copies(args, tp: int, precision: str) -> float:
    """A replicated k/v weight (t > kv heads: `ReplicatedKV`) is sliced to this rank's head and
    autocast casts that slice in each forward, which keeps it: 2 B x 2 hd h per microbatch."""
    if precision != "bf16" or args.n_kv_heads % tp == 0:
        return 0.0
    return 2 * 2 * args.head_dim * args.dim


def precision_of(dtype: str, zero: int) -> str:
    """What a run computes in: "fp32"; "bf16" (autocast over fp32 weights); "bf16-params"
    (train.dtype = "bf16" under ZeRO-3, whose units are gathered in bf16: no casts of weights,
    and the embedding gives a bf16 residual stream)."""
    if dtype == "fp32":
        return "fp32"
    return "bf16-params" if zero == 3 else "bf16"


def moe_bytes(
    args,
    tokens: int,
    sent: int,
    received: int,
    precision: str = "fp32",
    swiglu: int = 4,
    etp: int = 1,
    ep: int = 1,
    eplb_slots: int = 0,
    split: bool = False,
    idle: frozenset[str] = frozenset(),
) -> float:
    """What a MoE feed-forward keeps for backward on one rank, dropless and without the auxiliary
    loss (its input, the normalized residual, is counted with the norms). T = this rank's tokens
    (b*s, or b*s/t under tp), k = top_k, E experts, H = expert hidden size, N = rows sent, R =
    rows received (they depend on the routing):
        router     T*E scores; T*k expert indices (int64); T + T*k for the weights' renormalization
        dispatch   N row indices (int64); GPT-OSS's expert biases: R row experts (int64), `routed_glu_tensors`
        experts    R*(h + 4H): the rows each expert received, and SwiGLU's four intermediates;
                   the one grouped GEMM's group ends (int32 for each of the S = E/ep + X local
                   slots, X = `eplb_slots`); with ep > 1, 2R row indices (int64), the received
                   rows reordered from (source, slot) blocks to slot-major and back; with X > 0,
                   the owned experts and the fetched copies stacked, a new tensor (in the matmuls'
                   dtype) of all S slots' three weights (3*S*h*H/etp) kept for the GEMM's
                   backward, and the X copies' row indices (int64)
        combine    T*k slot indices (int64), T*k*h results per slot, T*k weights
        shared     4*T*H_shared (a SwiGLU on every token)
    (`swiglu` = 2 under selective recomputation: two intermediates instead of four).
    Expert tensor parallelism (etp ranks): the router and the shared experts keep the same; the
    dispatch and the combine work on the etp ranks' T_e = etp*T gathered tokens (N, R count
    those rows), the experts' intermediates are R*4H/etp, and the combine keeps T_e*k slot
    indices, T_e*k*h results and T_e*k weights.
    Under `precision` the router's scores and weights stay fp32 and the rest is in the matmuls'
    dtype; autocast over fp32 weights ("bf16") also keeps, per linear, its bf16 cast of its input
    (the router's and the shared experts' two; the routed experts' one grouped GEMM reads its
    rows once, in the matmuls' dtype: R*h); under the zero-bubble split (`split`) the router and
    the shared experts keep the fp32 input itself instead, once: 4*T*h
    (its weights are the step's compute copies, held once: `weight_copies`). `idle` ([lora]): the
    router and shared experts' linears that keep no input (`activation_bytes_per_layer`)."""
    t, k, h, e = tokens, args.top_k, args.dim, args.n_experts
    gathered = etp * t  # the tokens the dispatch and the combine see
    a, casts = BYTES[precision], precision == "bf16"
    renormalize = t + t * k if args.gate == "sigmoid" or k > 1 else 0
    stats = FP32 * (t * e + renormalize)
    shared = args.expert_dim * args.n_shared_experts  # the shared experts' hidden size
    rows = received * (h + routed_glu_tensors(args, swiglu) * args.expert_dim // etp) + gathered * k * (h + 1)
    readers = ("router",) + (("shared.w1", "shared.w3") if shared > 0 else ())
    reading = sum(f"feed_forward.{n}" not in idle for n in readers)
    casts_kept = (FP32 / a * (reading > 0) if split else reading) if casts else 0  # router's, shared's
    product = swiglu == 4 and "feed_forward.shared.w2" in idle  # the shared SwiGLU's product, unread
    rows += (swiglu - product) * t * shared + t * h * casts_kept
    local = e // ep + eplb_slots
    grouped = 4 * local + (8 * 2 * received if ep > 1 else 0)  # group ends; the slot-major reorder
    stacked = a * 3 * local * h * args.expert_dim // etp + 8 * eplb_slots if eplb_slots else 0
    biases = 8 * received * args.moe_bias  # GPT-OSS: each row's expert (int64), which indexes the three biases
    return stats + a * rows + 8 * (t * k + sent + gathered * k) + grouped + stacked + biases


def routed_glu_tensors(args, swiglu: int) -> int:
    """[rows, hidden] tensors the routed experts' product keeps: SwiGLU's `swiglu`; GPT-OSS's clamped one
    (`ClampedGLU`) without recomputation 7: the two products, the clamped gate, the sigmoid, up + 1, gate x
    sigmoid and the product w2 reads (recomputed: the two products, as SwiGLU's)."""
    return 7 if args.swiglu_limit and swiglu == 4 else swiglu


def stage_activation_bytes(
    args,
    layer_ids,
    batch: int,
    seq: int,
    tp: int = 1,
    sp: bool = False,
    precision: str = "fp32",
    cp: int = 1,
    recompute: str = "none",
    every: int = 1,
    etp: int = 1,
) -> dict[str, float]:
    """The planner's activation memory of a rank holding blocks `layer_ids`, in a recompute mode:
    `kept`, what its blocks keep for backward through one forward; `transient`, what backward
    adds on top while it recomputes a block (the block's activations less what the mode kept
    of them; one block at a time); `peak` = kept + transient. MoE blocks assume uniform
    routing (this rank's T*k rows sent and received)."""

    def block(i: int, mode: str) -> float:
        rows = batch * seq // tp * args.top_k * etp  # etp: the etp ranks' tokens, gathered
        moe = (rows, rows) if args.moe_layer(i) else None
        return activation_bytes_per_layer(args, batch, seq, tp, sp, precision, moe, cp, mode, etp=etp, layer=i)

    modes = {i: layer_mode(i, recompute, every) for i in layer_ids}
    kept = sum(block(i, mode) for i, mode in modes.items())
    transient = max((block(i, "none") - block(i, mode) for i, mode in modes.items() if mode != "none"), default=0.0)
    return {"kept": kept, "transient": transient, "peak": kept + transient}


CE_TOKEN_BYTES = 27  # `cross_entropy_in_place`'s own per-token tensors at their most (targets int64)
CE_STATS_BYTES = 12  # its statistics a token (max, sum of exponentials, target logit: fp32), the caller's buffer


def loss_peak_bytes(
    args, tokens: int, tp: int = 1, precision: str = "fp32", chunk: int = 0, head_trained: bool = True,
    head_cast: bool = True, sp: bool = False,
) -> float:  # fmt: skip
    """The loss's peak on the rank holding the head (the last stage), for one microbatch of T =
    `tokens` on this rank (the head sees the whole sequence under SP): the most bytes held at once
    by the tensors the head and the cross-entropy make, in the head's forward (from its input to
    the sum of token losses) and its backward (from that sum's gradient to the gradient of the
    head's input), each storage once. Not counted: what existed when the head started (its input,
    the weights and the step's bf16 weight copies, `.grad` buffers) and what is made between the
    two (the scaling by the global token count, backward's seed): those are the blocks', the model
    states' or a scalar's. `fivecut ledger` measures exactly this (`fivecut.train.memory.LossPeak`)
    and the planner's memory term "loss" is this figure. V' = ceil(V/t) vocabulary columns, C' =
    min(C, T) tokens a chunk, a = the matmuls' bytes (`BYTES[precision]`), r = the residual
    stream's (4; 2 for "bf16-params"), u = 1 when the logits are upcast to fp32 (a < 4):
        chunked          buffers kept over the chunks: the token losses (4 T), d hidden (r T h), dW
                         (4 V' h, fp32), the chunks' statistics (12 C': max, sum of exponentials and
                         target logit, which tp's all-reduces read); under bf16 the weight cast once
                         for all chunks (2 V' h) and the chunk's input cast (2 C' h). Then the most
                         of: the logits and their fp32 copy at the upcast ((a + 4) C' V'), or (fp32)
                         the logits becoming their own gradient in `cross_entropy_in_place` with its
                         per-token tensors (4 C' V' + 27 C'); the gradient and d hidden's product
                         (a C' V' + a C' h); under bf16, the gradient and dW's product before its
                         fp32 add (2 C' V' + 2 V' h). Backward scales both buffers in place.
        full, one rank   torch's log-softmax: 12 T V' at its backward (its saved fp32 output, the
                         fp32 gradient it receives and the one it makes); under bf16 the head's
                         cast of its input, saved by its matmul (2 T h)
        full, tp > 1     the vocabulary-parallel cross-entropy: forward, the logits and the fp32
                         copy that becomes their gradient, with its per-token tensors ((a + 4) T V'
                         + 39 T: its statistics 12, the rest 27); backward, under bf16 that gradient
                         cast to bf16 ((4 + a) T V'), in fp32 the gradient with the head's products d
                         hidden (4 T h) and dW (4 V' h), and under SP the head's input gathered again
                         (4 T h)
    Exact (`tests/test_loss_ledger.py`) where the moment named is the peak. [lora]: a frozen head
    (`head_trained` false) makes no dW, and a head weight already held in bf16 (`head_cast` false:
    frozen and untied) is not cast. Soft-capped logits (Gemma 2's logit_softcap): chunked, the cap's
    slope 1 - tanh^2 beside the capped logits (8 C' V' + 27 C' at the cross-entropy); the full logits
    keep the cap's tanh (a T V')."""
    columns, a, h = -(-args.vocab_size // tp), BYTES[precision], args.dim
    casts, capped = precision == "bf16", bool(args.logit_softcap)
    if chunk:
        rows = min(chunk, tokens)
        return chunked_loss_peak(columns, h, tokens, rows, precision, head_trained, head_cast, capped)
    tanh = a * tokens * columns if capped else 0  # the cap's tanh, kept for its backward
    if tp == 1:
        return 12 * tokens * columns + (2 * tokens * h if casts else 0) + tanh
    input_cast = 2 * tokens * h if casts else 0
    forward = input_cast + (a + 4) * tokens * columns + (CE_STATS_BYTES + CE_TOKEN_BYTES) * tokens + tanh
    if a < FP32:
        return max(forward, input_cast + (4 + a) * tokens * columns + tanh)
    backward = 4 * tokens * columns + 4 * tokens * h * (1 + sp) + (4 * columns * h if head_trained else 0)
    return max(forward, backward)


def chunked_loss_peak(
    columns: int, h: int, tokens: int, rows: int, precision: str, head_trained: bool, head_cast: bool, capped: bool
) -> float:
    """`loss_peak_bytes` of the chunked head (`fivecut.parallel.loss`): V' = `columns`, C' = `rows`;
    `capped`: the logits soft-capped, whose slope is kept beside them through the cross-entropy."""
    a, casts = BYTES[precision], precision == "bf16"
    residual = 2 if precision == "bf16-params" else FP32
    buffers = FP32 * tokens + residual * tokens * h + (FP32 * columns * h if head_trained else 0)
    buffers += CE_STATS_BYTES * rows  # the chunks' statistics [3, C'] (max, sum of exponentials, target logit)
    buffers += 2 * columns * h * head_cast + 2 * rows * h if casts else 0
    logits = (a + 4) * rows * columns if a < FP32 else 4 * rows * columns + CE_TOKEN_BYTES * rows
    if capped:
        logits = 8 * rows * columns + CE_TOKEN_BYTES * rows
    d_hidden = a * rows * columns + a * rows * h
    d_weight = a * rows * columns + a * columns * h if a < FP32 and head_trained else 0
    return buffers + max(logits, d_hidden, d_weight)
