"""The search over layouts: every valid way to cut a model over a cluster, costed, ranked.

For a world of `cluster.world_size` ranks the search enumerates the cuts that fix which
parameters a rank holds (`Shape`: tp with or without sp, pp with each of the five schedules and
interleaved's two virtual stages, cp under ring, Ulysses and USP, ep and etp for MoE models),
then the data cut over what is left (dp with ZeRO 0-3, and under ZeRO hybrid sharding over the
ranks of one node), then how each rank's share of the global batch is cut into microbatches or
accumulation steps, and the recomputation mode. `fivecut.checks.validate_layout` refuses the
combinations a run would refuse; `fivecut.plan.cost.cost_layout` costs the others.

Three rules prune the search; each only skips layouts that cannot be faster:

    recomputation   per (shape, data cut), "none", "selective" and "full" are tried in that
                    order and the first under which some batch split fits is kept: more
                    recomputation repeats forward work and changes nothing else the model costs
    batch splits    without a pipeline only the fewest accumulation steps that fit are costed
                    (more steps add ZeRO-2/3 traffic and change nothing else); with a pipeline
                    every microbatch count the rows allow is costed (more microbatches: less
                    bubble, more, smaller messages)
    model states    a (shape, data cut) whose parameters, gradients and optimizer state alone
                    exceed the device's memory is dropped before any batch split is tried

The rest is bookkeeping. What a layout's cost reads is cached by the few fields it depends on (a
rank's model states and buffers per layout without its microbatch count, each schedule's order
compiled for timing, rank 0's calls per microbatch), and the (shape, data cut) pairs are searched
on a pool of forked processes, one a CPU, whose parts are merged in the search's order: the
ranking, counts and smallest layout are those one process finds. `benchmarks/plan_speed.py`
times it and compares the ranking to the float.

The first layout of the ranking is the fastest predicted step among those that fit; `why`
says in one sentence what it gains over the second. When nothing fits, `grown_cluster` finds the
first cluster of 2, 4, 8, ... times the nodes on which a layout fits (`first_fitting`: the same
pairs, memory model and checks, stopping at the first fit).
"""

from __future__ import annotations

import contextlib
import copy
import math
import multiprocessing
import os
import re
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace

from fivecut.checks import LayoutError, validate_layout
from fivecut.config import Config
from fivecut.layout import ParallelDims
from fivecut.model.args import divisors
from fivecut.plan.cluster import Cluster
from fivecut.plan.cost import LayoutCost, cost_layout, layout_memory, program_of, state_memory
from fivecut.plan.memory import kernels_of
from fivecut.plan.volume import pipeline_plan, screened_placements

RECOMPUTE = ("none", "selective", "full")
SCHEDULES = (("1f1b", 1), ("interleaved", 2), ("zb1p", 1), ("dualpipev", 2))  # GPipe: 1F1B's time, more memory
MICROBATCH_STEPS = 3  # microbatch counts tried per pipeline: the least the schedule takes, x2, x4
MIN_CHUNK = 1024  # tokens of each sequence a cp rank keeps at least
MIN_STAGE = 4  # blocks a pipeline rank holds at least (models of fewer than 8 blocks: any 2-rank pipeline)
EXACT = 4  # the screen's best (this many times --top) are costed again with the real cuts


@dataclass(frozen=True)
class Shape:
    """The cuts that fix which parameters and which part of each activation a rank holds."""

    tp: int = 1
    sp: bool = False
    pp: int = 1
    schedule: str = "1f1b"
    virtual: int = 1
    cp: int = 1
    cp_mode: str = "ring"
    cp_ulysses: int = 1
    ep: int = 1
    etp: int = 1


@dataclass
class Candidate:
    cfg: Config
    cost: LayoutCost

    @property
    def layout(self) -> str:
        return self.cfg.parallel.settings()

    @property
    def recompute(self) -> str:
        return self.cfg.train.recompute


@dataclass
class StatesOnly:
    """A layout the model-states rule dropped: its parameters, gradients and optimizer state alone
    exceed the device, the bytes on its fullest rank (a bound below all it would need)."""

    cfg: Config
    states: float


@dataclass
class SearchResult:
    ranked: list[Candidate]  # fitting layouts, fastest first
    tried: int = 0  # layouts costed (memory at least)
    invalid: int = 0  # refused by the checks a run makes
    too_big: int = 0  # costed and over the device's memory
    smallest: Candidate | None = None  # the layout needing least memory, when none fits
    least_states: StatesOnly | None = None  # the least model states of the layouts dropped before costing
    rules: list[str] = field(default_factory=list)
    checked: dict = field(default_factory=dict)  # the layout checks' verdicts (`valid`)


def shapes(args, world: int, cluster: Cluster, seq: int) -> Iterator[Shape]:
    """Every (tp, sp, pp, schedule, cp, ep, etp) the world and the model allow; tp up to one node
    and one step beyond (to show what TP across nodes costs), cp only where the sequence splits."""
    for tp in divisors(world):
        if tp > 2 * cluster.gpus_per_node or args.n_heads % tp:
            continue
        for pp in divisors(world // tp):
            if pp > max(args.n_layers // MIN_STAGE, min(args.n_layers, 2)):
                continue
            for cp in divisors(world // (tp * pp)):
                if seq % (2 * cp) or (cp > 1 and seq // cp < MIN_CHUNK):
                    continue
                rest = world // (tp * pp * cp)
                for sp in (False, True) if tp > 1 else (False,):
                    for schedule, virtual in SCHEDULES if pp > 1 else (("1f1b", 1),):
                        for mode, u in cp_modes(cp):
                            for ep in expert_degrees(args, rest * cp):
                                for etp in (1, tp) if args.is_moe and tp > 1 else (1,):
                                    yield Shape(tp, sp, pp, schedule, virtual, cp, mode, u, ep, etp)


def cp_modes(cp: int) -> list[tuple[str, int]]:
    """Ring, Ulysses and, from cp = 4, USP with the largest Ulysses degree short of cp."""
    if cp == 1:
        return [("ring", 1)]
    modes = [("ring", 1), ("ulysses", 1)]
    if cp >= 4:
        modes.append(("usp", max(d for d in divisors(cp) if d < cp)))
    return modes


def expert_degrees(args, dp_cp: int) -> list[int]:
    if not args.is_moe:
        return [1]
    return [e for e in divisors(dp_cp) if args.n_experts % e == 0]


def data_cuts(dp_cp: int, dp: int, shape: Shape, cluster: Cluster) -> list[tuple[int, int | None]]:
    """(zero, zero_shard): DDP and ZeRO-1/2/3 over all dp x cp ranks, and ZeRO over the ranks
    of one node (hybrid sharding), replicated across nodes, where that is a smaller group."""
    if dp_cp == 1:
        return [(0, None)]
    if dp == 1:  # ZeRO needs data-parallel ranks; cp alone reduces by all-reduce
        return [(0, None)]
    out: list[tuple[int, int | None]] = []  # DDP: ZeRO-1's bytes (RS + AG = AR) and more memory
    node = max(cluster.gpus_per_node // shape.tp, 1)
    for zero in (1, 2, 3):
        out.append((zero, None))
        if 1 < node < dp_cp and dp_cp % node == 0 and node % shape.ep == 0:
            out.append((zero, node))
    return out


def batch_splits(rows: int, shape: Shape) -> list[tuple[int, int]]:
    """(microbatches, accumulate) that cut a rank's `rows` sequences per step: fewest accumulation
    steps first without a pipeline; with one, every microbatch count the schedule accepts."""
    if shape.pp == 1:
        return [(1, a) for a in divisors(rows)]
    least = 2 * shape.pp if shape.schedule == "dualpipev" else shape.pp
    if shape.schedule == "gpipe":
        least = 1
    return [(m, 1) for m in divisors(rows) if m >= least and any(m == least << k for k in range(MICROBATCH_STEPS))]


def layout_config(base: Config, shape: Shape, zero: int, shard: int | None, split, recompute: str, world: int):
    """`base` under one layout; its other sections are `base`'s own (`owned` copies them for the user)."""
    cfg = copy.copy(base)
    cfg.train = copy.copy(base.train)
    dp = world // (shape.tp * shape.pp * shape.cp)
    cfg.parallel = ParallelDims(
        dp=dp,
        zero=zero,
        tp=shape.tp,
        sp=shape.sp,
        pp=shape.pp,
        pp_schedule=shape.schedule,
        pp_virtual=shape.virtual,
        microbatches=split[0],
        cp=shape.cp,
        cp_mode=shape.cp_mode,
        cp_ulysses=shape.cp_ulysses,
        ep=shape.ep,
        etp=shape.etp,
        zero_shard=shard,
    )
    cfg.train.accumulate = split[1]
    cfg.train.recompute = recompute
    return cfg


def valid(cfg: Config, args, world: int, seen: dict) -> bool:
    """What `fivecut train` would accept; the checks that do not read ZeRO's fields run once per
    shape and batch split (`seen`), the layout's own fields every time."""
    t, dims = cfg.train, cfg.parallel
    if dims.problems():
        return False
    plain = replace(dims, zero=0, zero_shard=None)
    key = (plain.settings(), t.accumulate)
    if key not in seen:
        try:
            validate_layout(plain, args, t.seq_len, t.global_batch, t.accumulate, world)
            seen[key] = True
        except LayoutError:
            seen[key] = False
    return seen[key]


def search(args, base: Config, cluster: Cluster, top: int = 5, workers: int | None = None) -> SearchResult:
    """Every layout of `base`'s model, batch and sequence on `cluster`, fastest fitting first: all
    screened (`screened_placements`: exact counts, ZeRO buffers padded per parameter), the best
    EXACT x `top` costed again from the real cuts and ranked by that. `workers`: the processes
    it runs on (default: `pool_size`, one a CPU; 1: this one)."""
    result = SearchResult([], rules=pruning_rules())
    pairs = list(shape_cuts(args, base, cluster))
    workers = pool_size(len(pairs)) if workers is None else workers
    if workers > 1:
        shared_pipelines(args, base, cluster, pairs)
    with worker_pool(workers) as pool:
        for part in searched_parts(pool, workers, args, base, cluster, pairs):
            merge(result, part)
        result.ranked.sort(key=lambda c: (c.cost.step, c.cost.memory["total"]))
        best = [(args, owned(c.cfg), cluster) for c in result.ranked[: EXACT * top]]
        exact = [Candidate(job[1], cost) for job, cost in zip(best, pooled(pool, exact_cost, best))]
    result.ranked = sorted((c for c in exact if c.cost.fits), key=lambda c: (c.cost.step, c.cost.memory["total"]))
    if result.smallest is not None:
        result.smallest.cfg = owned(result.smallest.cfg)
    if result.least_states is not None:
        result.least_states.cfg = owned(result.least_states.cfg)
    return result


def pruning_rules() -> list[str]:
    """The module doc's three rules, one line each (plan.json's "rules")."""
    block = __doc__.split("\n\n")[3]
    rules: list[str] = []
    for line in block.splitlines():
        if line[4] != " ":  # a rule's first line, "name   text"; deeper lines continue it
            name, text = re.split(r"\s{2,}", line.strip(), maxsplit=1)
            rules.append(f"{name}: {text}")
        else:
            rules[-1] += " " + line.strip()
    return rules


def shape_cuts(args, base: Config, cluster: Cluster) -> Iterator[tuple[Shape, tuple[int, int | None]]]:
    """Every (shape, data cut) of the search, in its order."""
    world = cluster.world_size
    for shape in shapes(args, world, cluster, base.train.seq_len):
        dp = world // (shape.tp * shape.pp * shape.cp)
        if base.train.global_batch % dp == 0:
            for data in data_cuts(dp * shape.cp, dp, shape, cluster):
                yield shape, data


def pool_size(pairs: int) -> int:
    """Processes for a search of `pairs` (shape, data cut) pairs: one a CPU, where there are pairs
    enough for each and processes can fork; 1: the search runs here."""
    if "fork" not in multiprocessing.get_all_start_methods():
        return 1
    return max(min(os.cpu_count() or 1, pairs // POOLED_PAIRS), 1)


@contextlib.contextmanager
def worker_pool(workers: int) -> Iterator[ProcessPoolExecutor | None]:
    """A pool of `workers` forked processes; None for one (the search runs here)."""
    if workers < 2:
        yield None
        return
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
        yield pool


def pooled(pool: ProcessPoolExecutor | None, work, jobs: list) -> list:
    """`work` of each job, in order: on `pool`, or here without one."""
    return list(map(work, jobs) if pool is None else pool.map(work, jobs))


def searched_parts(pool, workers: int, args, base: Config, cluster: Cluster, pairs: list) -> list[SearchResult]:
    """`search_part` of consecutive runs of `pairs`, in order (on `pool`: a few runs a process)."""
    if pool is None:
        return [search_part((args, base, cluster, pairs))]
    size = -(-len(pairs) // (PARTS_A_WORKER * workers))
    return pooled(pool, search_part, [(args, base, cluster, pairs[i : i + size]) for i in range(0, len(pairs), size)])


def shared_pipelines(args, base: Config, cluster: Cluster, pairs: list) -> None:
    """Build here, before the pool forks, every schedule the pairs' pipelines run and its compiled
    order (`program_of`): each process would otherwise build them again."""
    world, seen = cluster.world_size, set()
    for shape, data in pairs:
        rows = base.train.global_batch // (world // (shape.tp * shape.pp * shape.cp))
        for split in batch_splits(rows, shape) if shape.pp > 1 else ():
            if (shape.schedule, shape.pp, shape.virtual, split[0]) not in seen:
                seen.add((shape.schedule, shape.pp, shape.virtual, split[0]))
                program_of(pipeline_plan(args, layout_config(base, shape, *data, split, "none", world))[0])


def exact_cost(job) -> LayoutCost:
    """`cost_layout` from the real cuts (a pool's job: model, config, cluster)."""
    return cost_layout(*job)


POOLED_PAIRS = 64  # (shape, data cut) pairs a process of the pool is worth at least
PARTS_A_WORKER = 8  # runs of pairs a process takes in turn (they differ in cost: shorter runs even it out)


def search_part(job) -> SearchResult:
    """The fitting layouts of some (shape, data cut) pairs, in order, and the counts, the checks'
    verdicts and the smallest layout among them."""
    args, base, cluster, pairs = job
    part = SearchResult([])
    capacity = cluster.device.memory_gb * 1e9
    for shape, data in pairs:
        part.ranked += fastest_fitting(args, base, cluster, shape, data, part, capacity)
    return part


def merge(result: SearchResult, part: SearchResult) -> None:
    """Add a later part of the search to `result` as if the search had gone on through it."""
    result.ranked += part.ranked
    result.tried += part.tried
    result.invalid += part.invalid
    result.too_big += part.too_big
    result.checked.update(part.checked)
    if part.smallest is not None and (
        result.smallest is None or part.smallest.cost.memory["total"] < result.smallest.cost.memory["total"]
    ):
        result.smallest = part.smallest
    if part.least_states is not None and (
        result.least_states is None or part.least_states.states < result.least_states.states
    ):
        result.least_states = part.least_states


def owned(cfg: Config) -> Config:
    """A layout's config with sections of its own (the search's share `base`'s)."""
    return copy.deepcopy(cfg)


def fastest_fitting(args, base, cluster, shape, data, result: SearchResult, capacity: float) -> list[Candidate]:
    """The fitting layouts of one (shape, data cut) under the least recomputation that fits."""
    world = cluster.world_size
    rows = base.train.global_batch // (world // (shape.tp * shape.pp * shape.cp))  # sequences per dp rank
    splits = batch_splits(rows, shape)
    first = layout_config(base, shape, *data, splits[0] if splits else (1, 1), "none", world)
    if not splits or not valid(first, args, world, result.checked):
        result.invalid += 1
        return []
    states = state_memory(args, first)
    if states > capacity:
        result.too_big += 1
        if result.least_states is None or states < result.least_states.states:
            result.least_states = StatesOnly(first, states)
        return []
    for recompute in RECOMPUTE:
        fitting = []
        for split in splits:
            cfg = layout_config(base, shape, *data, split, recompute, world)  # valid as `first` is
            result.tried += 1
            memory = layout_memory(args, cfg, kernels_of(cluster))["total"]
            if memory > capacity:
                result.too_big += 1
                keep_smallest(result, cfg, memory, args, cluster)
                continue
            cost = cost_layout(args, cfg, cluster, screened_placements)
            fitting.append(Candidate(cfg, cost))
            if shape.pp == 1:
                break  # the fewest accumulation steps that fit: more only add traffic
        if fitting:
            return fitting
    return []


def keep_smallest(result: SearchResult, cfg: Config, memory: float, args, cluster: Cluster) -> None:
    """Remember the layout needing least memory (`memory`: its total; costed in full: it is what
    the user is shown)."""
    if result.smallest is None or memory < result.smallest.cost.memory["total"]:
        result.smallest = Candidate(cfg, cost_layout(args, cfg, cluster, screened_placements))


STATE_BYTES = 16  # model-state bytes a parameter at the least (`fivecut.plan.memory`: fp32 master, gradient, 2 moments)
MOST_DEVICES = 1 << 17  # the largest cluster `grown_cluster` tries


@dataclass
class Grown:
    """A cluster of more nodes of the same kind on which a layout fits, and that layout."""

    cluster: Cluster
    fitting: Candidate  # the first layout found to fit there, not the fastest
    searched: list[int]  # the node counts whose layouts were tried, in order (the last: `cluster`'s)
    least_devices: int  # fewer devices cannot hold the model states (STATE_BYTES a parameter)


def grown_cluster(args, cluster: Cluster, config_for) -> Grown | None:
    """The first cluster of 2, 4, 8, ... times `cluster`'s nodes (its device, links and GPUs a node;
    at most MOST_DEVICES devices) on which a layout of `config_for(world)` (the run's config for
    that world) fits, by the search's own memory model; None if none does. A cluster too small to
    hold the model states spread over all its devices (STATE_BYTES a parameter: no cut holds fewer)
    is passed over unsearched."""
    least = math.ceil(STATE_BYTES * args.num_params() / (cluster.device.memory_gb * 1e9))  # devices, at the least
    searched, nodes = [], 2 * cluster.nodes
    while nodes * cluster.gpus_per_node <= MOST_DEVICES:
        bigger = replace(cluster, nodes=nodes)
        if bigger.world_size >= least:
            searched.append(nodes)
            found = first_fitting(args, config_for(bigger.world_size), bigger)
            if found is not None:
                return Grown(bigger, found, searched, least)
        nodes *= 2
    return None


def first_fitting(args, base: Config, cluster: Cluster) -> Candidate | None:
    """A layout of `base` that fits on `cluster`, costed from the real cuts, or None: the search's
    (shape, data cut) pairs in its order and, in each, its recomputation modes and batch splits,
    stopping at the first that fits (the fastest is `search`'s to find, on that cluster)."""
    world, seen = cluster.world_size, {}
    capacity = cluster.device.memory_gb * 1e9
    for shape, data in shape_cuts(args, base, cluster):
        splits = batch_splits(base.train.global_batch // (world // (shape.tp * shape.pp * shape.cp)), shape)
        first = layout_config(base, shape, *data, splits[0], "none", world) if splits else None
        if first is None or not valid(first, args, world, seen) or state_memory(args, first) > capacity:
            continue
        for recompute, split in ((r, s) for r in RECOMPUTE for s in splits):
            cfg = layout_config(base, shape, *data, split, recompute, world)
            if layout_memory(args, cfg, kernels_of(cluster))["total"] <= capacity:
                cost = cost_layout(args, owned(cfg), cluster)
                if cost.fits:
                    return Candidate(owned(cfg), cost)
    return None


def time_terms(cost: LayoutCost) -> dict[str, float]:
    """A step's seconds by what spends them: compute, the bubble, each cut's exposed collectives,
    the tail after backward (clipping, AdamW, the step's small all-reduces)."""
    terms = {"compute": cost.compute, "bubble": max(cost.makespan - cost.compute, 0.0)}
    for c in cost.cuts:
        if c.exposed > 0:
            terms[c.cut] = terms.get(c.cut, 0.0) + c.exposed
    if cost.optimizer > 0:
        terms["optimizer"] = cost.optimizer
    return terms


def why(first: Candidate, others: list[Candidate]) -> str:
    """One sentence: against the fastest layout that cuts the model another way (not only its ZeRO
    stage or microbatches), the term of the step in which the winner gains most."""
    if not others:
        return f"{first.layout} is the only layout that fits."
    shape = layout_shape(first)
    second = next((c for c in others if layout_shape(c) != shape), others[0])
    a, b = time_terms(first.cost), time_terms(second.cost)
    step = second.cost.step - first.cost.step
    if step <= 0:
        memory = f"{first.cost.memory['total'] / 2**30:.1f} GiB against {second.cost.memory['total'] / 2**30:.1f} GiB"
        return (
            f"{first.layout} (recompute {first.recompute}) ties with the best layout cut another way, {second.layout} "
            f"({first.cost.step * 1e3:.1f} ms a step), and comes first on memory: {memory}."
        )
    gains = {k: b.get(k, 0.0) - a.get(k, 0.0) for k in set(a) | set(b)}
    term = max(gains, key=gains.get)
    named = {"compute": "compute (recomputation)", "bubble": "pipeline bubble"}.get(term, f"exposed {term} traffic")
    return (
        f"{first.layout} (recompute {first.recompute}) wins by {step * 1e3:.1f} ms a step over the best layout "
        f"cut another way, {second.layout} (recompute {second.recompute}), most of it in {named}: "
        f"{a.get(term, 0.0) * 1e3:.1f} ms against {b.get(term, 0.0) * 1e3:.1f} ms."
    )


def layout_shape(c: Candidate) -> tuple:
    d = c.cfg.parallel
    return (d.tp, d.pp, d.pp_schedule, d.cp, d.cp_mode, d.ep, d.etp)
