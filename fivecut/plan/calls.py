"""How many collective calls one step issues on rank 0, per cut and op: what each call's fixed
latency multiplies (`fivecut.plan.cost`). The bytes are `fivecut.plan.volume`'s; these are the
counts `fivecut ledger` shows in its `calls` column (tests/test_plan_ledger.py compares them).

Per microbatch, through the blocks of rank 0's stages (F: forward, B: backward):

    tp       a dense block: F 2 all-reduces (g after attention and MLP), B 2 (f); a MoE block its
             attention's 1 and 1 and an all-gather each way of the tokens its experts see; the
             embedding and the vocab-parallel loss: F 1 + 2 a chunk of the loss head, B 1. Under SP
             each all-reduce of a block is an all-gather and a reduce-scatter, the backward gathers
             again what the forward gathered (B: all-gather 4, reduce-scatter 2 a block), and each
             norm weight's gradient is summed over tp (an all-reduce each: the records'
             `summed_over`); outside the blocks F all-gather 1, reduce-scatter 1, all-reduce 2,
             B all-gather 2, reduce-scatter 1
    cp       Ulysses (and USP's Ulysses part): 4 all-to-alls a block each way (q, k, v, out);
             ring (and USP's ring part) of r ranks: F r-1 sends and receives a block, B 3(r-1)
    ep       a MoE block: F 3 all-to-alls (counts, dispatch, combine), B 2
    etp      a MoE block: F 2 all-gathers and a reduce-scatter, B 1 and 1
    pp       each of rank 0's stages receives its input (F) and sends its input's gradient (B)
             unless it is the first, sends its output (F) and receives its gradient (B) unless last;
             once a step, a tied embedding's gradient is summed over the two ends
    dp       once a step, a gradient bucket (`train.bucket_mb`, filled from the last parameter) of
             each reduce group: ZeRO-0 an all-reduce, ZeRO-1/2 a reduce-scatter and, after the step,
             an all-gather of its shard; ZeRO-3 per microbatch an all-gather of each unit (every
             block, and the root) in the forward, again in the backward, and its reduce-scatter

A fully recomputed block issues its forward's tp, cp, ep and etp calls again in its backward.
Besides these, a step's tail (`step_calls`): the loss's all-reduce, the stop flags' and the
gradient norm's, one over each group `fivecut.train.optim.grad_norm` sums over.
"""

from __future__ import annotations

from fivecut.plan.activations import layer_mode
from fivecut.plan.volume import model_token, pipeline_plan, reduce_group_sizes, remembered, shard_group_sizes

Calls = dict[str, dict[str, float]]  # cut -> op -> calls per step


def add(out: Calls, cut: str, op: str, calls: float) -> None:
    if calls:
        out.setdefault(cut, {})
        out[cut][op] = out[cut].get(op, 0.0) + calls


def rank0_stages(args, cfg) -> list[tuple[list[int], bool, bool]]:
    """(block ids, first, last) of each stage rank 0 runs (one stage of every block without a pipeline)."""
    if cfg.parallel.pp == 1:
        return [(list(range(args.n_layers)), True, True)]
    sched, layers = pipeline_plan(args, cfg)
    last = sched.n_stages - 1
    return [(list(layers[s]), s == 0, s == last) for s in sched.stages_of(0)]


def block_calls(args, cfg, layer: int) -> Calls:
    """The forward's calls of one block, per microbatch, as {"F"/"B" + cut: {op: calls}}."""
    d = cfg.parallel
    moe = args.moe_layer(layer)
    out: Calls = {}
    if d.tp > 1:
        regions = 1 if moe else 2  # the MoE's experts sit outside tp's f/g
        if d.sp:
            add(out, "Ftp", "all_gather", regions)
            add(out, "Ftp", "reduce_scatter", regions)
            add(out, "Btp", "all_gather", 2 * regions)
            add(out, "Btp", "reduce_scatter", regions)
            add(out, "Btp", "all_reduce", 2)  # the two norms' weights (`summed_over`)
        else:
            add(out, "Ftp", "all_reduce", regions)
            add(out, "Btp", "all_reduce", regions)
        if moe:
            add(out, "Ftp", "all_gather", 1)
            add(out, "Btp", "all_gather", 1)
    if d.cp > 1:
        ulysses = d.cp if d.cp_mode == "ulysses" else d.cp_ulysses if d.cp_mode == "usp" else 1
        ring = d.cp // ulysses
        if ulysses > 1:
            add(out, "Fcp", "all_to_all", 4)
            add(out, "Bcp", "all_to_all", 4)
        for op in ("send", "recv"):
            add(out, "Fcp", op, ring - 1)
            add(out, "Bcp", op, 3 * (ring - 1))
    if moe and d.ep > 1:
        add(out, "Fep", "all_to_all", 3)
        add(out, "Bep", "all_to_all", 2)
    if moe and d.etp > 1:
        add(out, "Fetp", "all_gather", 2)
        add(out, "Fetp", "reduce_scatter", 1)
        add(out, "Betp", "all_gather", 1)
        add(out, "Betp", "reduce_scatter", 1)
    return out


def outside_calls(cfg, first: bool, last: bool) -> Calls:
    """The embedding's (first stage) and the vocab-parallel loss's (last stage) tp calls."""
    d = cfg.parallel
    out: Calls = {}
    if d.tp == 1:
        return out
    chunks = loss_chunks(cfg)  # the loss's two all-reduces, once per chunk of the head
    if d.sp:
        add(out, "Ftp", "all_gather", first)
        add(out, "Ftp", "reduce_scatter", last)
        add(out, "Ftp", "all_reduce", 2 * last * chunks)
        add(out, "Btp", "all_gather", first + last * (cfg.train.loss_chunk_tokens == 0))  # a loss head: no regather
        add(out, "Btp", "reduce_scatter", first)
        add(out, "Btp", "all_reduce", last)  # the final norm's weight
    else:
        add(out, "Ftp", "all_reduce", first + 2 * last * chunks)
        add(out, "Btp", "all_reduce", first)
    return out


def loss_chunks(cfg) -> int:
    """The chunks of a microbatch's tokens on one rank that a loss head runs (1 with the full logits)."""
    d, t = cfg.parallel, cfg.train
    tokens = t.global_batch // (d.dp * t.accumulate * (d.microbatches if d.pp > 1 else 1)) * (t.seq_len // d.cp)
    return -(-tokens // t.loss_chunk_tokens) if t.loss_chunk_tokens > 0 else 1


def microbatch_calls(args, cfg) -> Calls:
    """tp, cp, ep, etp and pp calls of one microbatch through rank 0's stages; once per model, the
    cuts they read, the stage split (any microbatch count) and recomputation. Shared: read it only."""
    d, t = cfg.parallel, cfg.train
    split = tuple(d.pp_layers) if d.pp_layers else None
    key = (model_token(args), d.tp, d.sp, d.pp, d.pp_schedule, d.pp_virtual, split, d.cp, d.cp_mode, d.cp_ulysses)
    key += (d.ep, d.etp, t.seq_len, t.recompute, t.recompute_every, loss_chunks(cfg), t.loss_chunk_tokens == 0)
    if key not in MICROBATCH_CALLS:
        remembered(MICROBATCH_CALLS, key, microbatch_calls_now(args, cfg), CACHED)
    return MICROBATCH_CALLS[key]


CACHED = 8192  # entries each of this module's caches keeps at most (the oldest go first)
MICROBATCH_CALLS: dict[tuple, Calls] = {}


def microbatch_calls_now(args, cfg) -> Calls:
    """`microbatch_calls` counted now."""
    t = cfg.train
    out: Calls = {}
    for layers, first, last in rank0_stages(args, cfg):
        for layer in layers:
            again = layer_mode(layer, t.recompute, t.recompute_every) == "full"
            for key, ops in block_calls(args, cfg, layer).items():
                for op, n in ops.items():
                    add(out, key[1:], op, n * (1 + again * (key[0] == "F")))
        for key, ops in outside_calls(cfg, first, last).items():
            for op, n in ops.items():
                add(out, key[1:], op, n)
        if cfg.parallel.pp > 1:
            add(out, "pp", "recv", not first)
            add(out, "pp", "send", (not first) + (not last))
            add(out, "pp", "recv", not last)
    return out


def buckets(numels: list[int], bucket_bytes: float) -> int:
    """Gradient buckets of fp32 tensors of `numels`, cut as `fivecut.parallel.data.plan_buckets`
    cuts them: a new bucket when the next tensor would overflow the current one."""
    count, size = 0, 0.0
    for n in numels:
        if not count or size + 4 * n > bucket_bytes:
            count, size = count + 1, 0.0
        size += 4 * n
    return count


def data_calls(args, cfg, placements: dict, microbatches: int) -> Calls:
    """The data cut's calls in a step; `placements`: rank 0's records, in the model's order."""
    d, t = cfg.parallel, cfg.train
    sizes = reduce_group_sizes(cfg)
    reduced = {name: numels for name, numels in grouped_numels(placements).items() if sum(numels) and sizes[name] > 1}
    out: Calls = {}
    if d.zero < 3:  # buckets fill from the last parameter (the backward's order)
        for numels in reduced.values():
            n = buckets(numels[::-1], t.bucket_mb * 2**20)
            for op in ("all_reduce",) if d.zero == 0 else ("reduce_scatter", "all_gather"):
                add(out, "dp", op, n)
    elif reduced:
        units = sum(len(layers) for layers, _, _ in rank0_stages(args, cfg)) + 1
        add(out, "dp", "all_gather", 2 * units * microbatches)
        add(out, "dp", "reduce_scatter", units * microbatches)
    return out


def grouped_numels(placements: dict) -> dict[str, list[int]]:
    """The records' local element counts by reduce group, in the model's order; once per records
    object (a search passes the same shared records for many layouts). Shared: read it only."""
    key = id(placements)
    if key not in GROUPED or GROUPED[key][0] is not placements:
        groups: dict[str, list[int]] = {}
        for pl in placements.values():
            groups.setdefault(pl.reduce, []).append(pl.local_numel())
        remembered(GROUPED, key, (placements, groups), GROUPED_KEPT)  # kept: their id stays theirs
    return GROUPED[key][1]


GROUPED: dict[int, tuple] = {}
GROUPED_KEPT = 1024  # as many as `fivecut.plan.volume` keeps records


def step_calls(args, cfg) -> dict[str, int]:
    """The all-reduces of a step's tail, by group size: loss, stop flags, the gradient norm's groups."""
    d = cfg.parallel
    sizes = {d.world_size: 1}
    loss = d.dp * d.cp * (d.pp if d.pp > 1 else 1)
    sizes[loss] = sizes.get(loss, 0) + 1
    zero = d.zero >= 1 and max(shard_group_sizes(cfg).values()) > 1
    for n in (d.tp, d.pp, d.ep if args.is_moe else 1, d.dp * d.cp if zero else 1):
        if n > 1:
            sizes[n] = sizes.get(n, 0) + 1
    return {n: k for n, k in sizes.items() if n > 1}


def step_collective_calls(args, cfg, placements: dict) -> Calls:
    """Every cut's calls in one optimizer step on rank 0 (`placements`: its records)."""
    d, t = cfg.parallel, cfg.train
    microbatches = (d.microbatches if d.pp > 1 else 1) * t.accumulate
    out = {cut: {op: n * microbatches for op, n in ops.items()} for cut, ops in microbatch_calls(args, cfg).items()}
    for cut, ops in data_calls(args, cfg, placements, microbatches).items():
        for op, n in ops.items():
            add(out, cut, op, n)
    if d.pp > 1 and args.tie_embeddings:  # the tied embedding's gradient, summed over the two ends
        add(out, "pp", "all_reduce", 1)
    return out
