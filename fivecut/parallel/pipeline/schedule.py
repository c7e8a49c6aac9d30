"""Pipeline schedules as data: for each rank, the ordered list of actions it performs.

The model is cut into `n_stages` stages (stage 0 takes the tokens, the last stage
computes the loss) and the batch into `microbatches`. A schedule says, for every
rank, in which order it runs

    F  forward of (stage, microbatch)
    B  backward: the input-gradient only when the schedule splits the backward
       (`split_backward`, the zero-bubble schedules); otherwise the full backward
    W  weight-gradient of (stage, microbatch), only when split
    SEND_F / RECV_F   activations from stage s to s+1 (send named by the sender s,
                      receive by the receiver s+1)
    SEND_B / RECV_B   gradients from stage s to s-1 (send named by the sender s,
                      receive by the receiver s-1)

The same object is executed (`executor.py`), timed (`simulate.py`), checked for
deadlock (`check`) and drawn (`draw.py`).

Every generator writes the compute order only; `with_comms` adds the communication:
a send right after the action that produced the tensor, a receive right before the
action that consumes it, hoisted earlier only where needed so that a rank receives
from each peer in the order that peer sends (point-to-point messages between two
ranks are matched in order). The loss is computed on the last stage, n_stages - 1.

Notation (`str(action)`): kind, stage, dot, microbatch. `F2.5` is the forward of
microbatch 5 on stage 2; `B2.5`, `W2.5` likewise. Communication is lower-case s/r
before the direction: `sF2.5` sends stage 2's output of microbatch 5 to stage 3,
`rF3.5` receives it on stage 3; `sB3.5` sends stage 3's input-gradient to stage 2,
`rB2.5` receives it there.

Posting: the executor does not post a message at its place in the list but where `posting`
puts it: every rank posts its messages in one global order (NCCL runs a rank's batches in the
order posted, `streams`), a receive at most `WINDOW` compute actions before its consumer, the
sends and receives of one place in one batch; `check` plays that posting under NCCL's model.

Memory: `peak_in_flight` counts microbatch-stages whose activations are held: from F
until B (not split) or until W (split: B frees the stage's graph, but W still needs each
linear layer's input and output gradient, `wgrad.py`). With several stages per rank
(interleaved, DualPipeV) each stage is a fraction of a rank's layers, so the counts are in
those smaller units.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from fivecut.parallel.pipeline import streams

COMPUTE = ("F", "B", "W")
COMM = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
SENDS, RECEIVES = ("SEND_F", "SEND_B"), ("RECV_F", "RECV_B")
SHORT = {"F": "F", "B": "B", "W": "W", "SEND_F": "sF", "RECV_F": "rF", "SEND_B": "sB", "RECV_B": "rB"}
NAMES = ("gpipe", "1f1b", "interleaved", "zb1p", "dualpipev")


class ScheduleError(ValueError):
    """A schedule that cannot run (wrong counts, order, unmatched or deadlocking communication)."""


@dataclass(frozen=True)
class Action:
    kind: str  # one of COMPUTE or COMM
    stage: int
    microbatch: int

    def __post_init__(self):
        if self.kind not in SHORT:
            raise ValueError(f"unknown action kind {self.kind!r}; expected one of {', '.join(SHORT)}")

    def __str__(self) -> str:
        return f"{SHORT[self.kind]}{self.stage}.{self.microbatch}"

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE


@dataclass
class Schedule:
    name: str
    pp: int  # ranks
    n_stages: int  # pp * virtual (2 * pp for dualpipev)
    microbatches: int
    stage_rank: list[int]  # stage -> rank that holds it
    actions: list[list[Action]]  # per rank, in execution order, communication included
    split_backward: bool  # B is input-gradient only and W actions exist
    posted: dict = field(default_factory=dict, init=False, repr=False, compare=False)  # window -> `posting`, once

    def stages_of(self, rank: int) -> list[int]:
        return [s for s, r in enumerate(self.stage_rank) if r == rank]

    def compute(self, rank: int) -> list[Action]:
        return [a for a in self.actions[rank] if a.is_compute]

    def chunk(self, stage: int) -> int:
        """Index of `stage` among the stages of its rank (0 = the rank's first stage)."""
        return self.stages_of(self.stage_rank[stage]).index(stage)


# ---------------------------------------------------------------- communication


def with_comms(stage_rank: list[int], orders: list[list[Action]]) -> list[list[Action]]:
    """Insert sends right after the producing action and receives right before the consuming one,
    then hoist receives where needed so that each rank receives from a peer in the order the peer sends.

    Nothing is inserted between adjacent stages on the same rank (DualPipeV's turn)."""
    actions = [insert_comms(rank, order, stage_rank) for rank, order in enumerate(orders)]
    sent = sends_between(actions, stage_rank)
    return [in_send_order(rank, actions, stage_rank, sent) for rank in range(len(actions))]


def insert_comms(rank: int, order: list[Action], stage_rank: list[int]) -> list[Action]:
    last, actions = len(stage_rank) - 1, []
    for a in order:
        s, m = a.stage, a.microbatch
        if a.kind == "F" and s > 0 and stage_rank[s - 1] != rank:
            actions.append(Action("RECV_F", s, m))
        if a.kind == "B" and s < last and stage_rank[s + 1] != rank:
            actions.append(Action("RECV_B", s, m))
        actions.append(a)
        if a.kind == "F" and s < last and stage_rank[s + 1] != rank:
            actions.append(Action("SEND_F", s, m))
        if a.kind == "B" and s > 0 and stage_rank[s - 1] != rank:
            actions.append(Action("SEND_B", s, m))
    return actions


def sends_between(actions: list[list[Action]], stage_rank: list[int]) -> dict[tuple[int, int], list[Action]]:
    """{(sender, receiver): the receives matching the sender's sends to the receiver, in send order},
    one pass over every list."""
    out: dict[tuple[int, int], list[Action]] = {}
    for sender, acts in enumerate(actions):
        for a in acts:
            if a.kind in SENDS:
                match = partner(a)
                out.setdefault((sender, stage_rank[match.stage]), []).append(match)
    return out


def in_send_order(
    rank: int, actions: list[list[Action]], stage_rank: list[int], sent: dict | None = None
) -> list[Action]:
    """`rank`'s list with receives from each peer in the order that peer sends.

    Point-to-point messages between two ranks are matched in the order they are posted
    (NCCL has no tags), and an activation and a gradient have the same shape [b, s, h], so a
    crossed pair would pass silently with the wrong data. A receive hoisted to just before a
    later-sent one adds no waiting: its send was issued earlier on the same peer."""
    sent = sends_between(actions, stage_rank) if sent is None else sent
    sends = {peer: sent.get((peer, rank), []) for peer in range(len(actions)) if peer != rank}
    taken = {peer: 0 for peer in sends}  # how many of each peer's messages are received so far
    hoisted, out = set(), []
    for a in actions[rank]:
        if a in hoisted:
            continue
        if a.kind.startswith("RECV"):
            peer = stage_rank[partner(a).stage]
            while sends[peer][taken[peer]] != a:  # an earlier-sent message: receive it first
                hoisted.add(sends[peer][taken[peer]])
                out.append(sends[peer][taken[peer]])
                taken[peer] += 1
            taken[peer] += 1
        out.append(a)
    return out


def make(name: str, pp: int, m: int, stage_rank: list[int], orders: list[list[Action]], split: bool) -> Schedule:
    return Schedule(name, pp, len(stage_rank), m, stage_rank, with_comms(stage_rank, orders), split)


def require(pp: int, m: int, name: str) -> None:
    if not isinstance(pp, int) or pp < 1:
        raise ValueError(f"{name}: pp={pp} must be a positive integer")
    if not isinstance(m, int) or m < 1:
        raise ValueError(f"{name}: microbatches={m} must be a positive integer")


# ---------------------------------------------------------------- GPipe, 1F1B


def gpipe(pp: int, m: int) -> Schedule:
    """GPipe: every rank runs all its forwards, then all its backwards (bubble (P-1)/(M+P-1))."""
    require(pp, m, "gpipe")
    orders = [[Action("F", r, i) for i in range(m)] + [Action("B", r, i) for i in range(m)] for r in range(pp)]
    return make("gpipe", pp, m, list(range(pp)), orders, split=False)


def one_f_one_b(pp: int, m: int) -> Schedule:
    """1F1B (PipeDream-flush): warm-up forwards, steady one-forward-one-backward, cool-down backwards.

    Rank r warms up with min(pp-1-r, m) forwards, so at most pp microbatches are in flight
    on rank 0 (P-r on rank r). Same bubble as GPipe, far less activation memory."""
    require(pp, m, "1f1b")
    return make("1f1b", pp, m, list(range(pp)), [one_f_one_b_order(r, pp, m) for r in range(pp)], split=False)


def one_f_one_b_order(r: int, pp: int, m: int) -> list[Action]:
    warmup = min(pp - 1 - r, m)
    order = [Action("F", r, i) for i in range(warmup)]  # warm-up
    for i in range(m - warmup):  # steady 1F1B
        order += [Action("F", r, warmup + i), Action("B", r, i)]
    order += [Action("B", r, i) for i in range(m - warmup, m)]  # cool-down
    return order


# ---------------------------------------------------------------- interleaved 1F1B


def interleaved(pp: int, m: int, virtual: int) -> Schedule:
    """Megatron's interleaved 1F1B: `virtual` stages per rank, looping placement (stage s on rank s % pp).

    Microbatches go through the rank's chunks in groups of pp: forwards of microbatches
    0..pp-1 on chunk 0, then the same microbatches on chunk 1, ... Each stage is 1/v of
    the work, so the warm-up/cool-down bubble shrinks by about v: (P-1)/(V*M+P-1)."""
    require(pp, m, "interleaved")
    if not isinstance(virtual, int) or virtual < 2:
        raise ValueError(f"interleaved: virtual={virtual} stages per rank; use virtual >= 2 (virtual=1 is plain 1f1b)")
    if m % pp:
        lower, upper = m - m % pp, m + pp - m % pp
        fix = f"use microbatches={upper}" + (f" or {lower}" if lower else "")
        raise ValueError(
            f"interleaved: microbatches={m} is not a multiple of pp={pp} (microbatches go in groups of pp); {fix}"
        )
    stage_rank = [s % pp for s in range(pp * virtual)]
    orders = [interleaved_order(r, pp, m, virtual) for r in range(pp)]
    return make("interleaved", pp, m, stage_rank, orders, split=False)


def interleaved_order(r: int, pp: int, m: int, v: int) -> list[Action]:
    total = m * v
    # warm-up: enough forwards that rank r's first backward (chunk v-1) is not waited for
    warmup = min(2 * (pp - r - 1) + (v - 1) * pp, total)
    order = [interleaved_action("F", k, r, pp, v) for k in range(warmup)]
    for i in range(total - warmup):  # steady 1F1B over virtual stages
        order += [interleaved_action("F", warmup + i, r, pp, v), interleaved_action("B", i, r, pp, v)]
    order += [interleaved_action("B", k, r, pp, v) for k in range(total - warmup, total)]  # cool-down
    return order


def interleaved_action(kind: str, k: int, r: int, pp: int, v: int) -> Action:
    """The k-th forward (or backward) of rank r: groups of pp microbatches sweep the chunks."""
    group, within = divmod(k, pp * v)
    chunk = within // pp if kind == "F" else v - 1 - within // pp  # backward sweeps the chunks in reverse
    return Action(kind, chunk * pp + r, group * pp + within % pp)


# ---------------------------------------------------------------- zero-bubble: ZB-H1, DualPipeV


def zb1p(pp: int, m: int) -> Schedule:
    """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism"): backward split into B (input-gradient)
    and W (weight-gradient). B stays on the critical path; W has no consumer on another rank,
    so it is deferred into the bubbles.

    1F1B's order with the W of rank r lagging its B by r microbatches: rank r holds
    (pp-1-r) + 1 + r = pp microbatches at most (from F until W), 1F1B's peak on rank 0.
    The later ranks' cool-down then runs B back to back and rank 0's never waits; with
    F = B = W the bubble is (P-1)(F+B-W) per rank: (P-1)/(3M+P-1) instead of 1F1B's
    (P-1)/(M+P-1)."""
    require(pp, m, "zb1p")
    return make("zb1p", pp, m, list(range(pp)), [zb_h1_order(r, pp, m) for r in range(pp)], split=True)


def zb_h1_order(r: int, pp: int, m: int) -> list[Action]:
    order = []
    for a in one_f_one_b_order(r, pp, m):
        order.append(a)
        lagged = a.microbatch - r  # the W this B releases, r microbatches behind
        if a.kind == "B" and lagged >= 0:
            order.append(Action("W", r, lagged))
    order += [Action("W", r, i) for i in range(max(m - r, 0), m)]  # deferred W's fill the cool-down
    return order


def dualpipev(pp: int, m: int) -> Schedule:
    """DualPipeV (DeepSeek's "cut-in-half" DualPipe): 2*pp stages in a V, stages r and 2pp-1-r on rank r.

    A microbatch goes down the ranks (stages 0..pp-1), turns on the last rank (stages pp-1
    and pp, no communication) and comes back up (stages pp..2pp-1); rank 0 holds the
    embedding and the loss. B/W split. The order comes from list scheduling with unit
    costs (B first, then F, W last): in the steady state each rank alternates forwards of
    newer microbatches with backwards of older ones (the F/B pairs DualPipe overlaps), and
    W fills the bubbles. Bubble (P-1)/(6M+P-1) at F = B = W: only the last rank's wait for
    the first forward."""
    require(pp, m, "dualpipev")
    if m < 2 * pp:
        raise ValueError(
            f"dualpipev: microbatches={m} < 2*pp={2 * pp}: the V needs 2*pp microbatches to fill; "
            f"use microbatches >= {2 * pp}"
        )
    stage_rank = [s if s < pp else 2 * pp - 1 - s for s in range(2 * pp)]
    # admission cap found by simulation: 2pp+1 reaches the (P-1)/(6M+P-1) bubble for every
    # pp <= 8, 2pp <= m <= 32 (2pp does not at pp=8); the peak then is 3pp-1 half-size
    # stages, about 1.5x 1F1B's pp whole stages (a cap of pp+1 gives 1F1B's memory at a
    # larger bubble)
    # W's waiting on a rank are bounded by pp, as DualPipeV itself defers W only in its cool-down:
    # each keeps its linear layers' inputs and output gradients (`wgrad`), which under full
    # recomputation outweigh a held microbatch-stage; unless the bound lengthens the unit-cost
    # makespan (the greedy order is not monotone in it: at pp=4 it does, at pp=16, m=120 it shortens it)
    cap = [2 * pp + 1] * pp
    orders = [list_schedule(stage_rank, m, cap, w_bound) for w_bound in (pp, None)]
    bounded, free = (make("dualpipev", pp, m, stage_rank, o, split=True) for o in orders)
    return bounded if unit_makespan(bounded) <= unit_makespan(free) else free


def unit_makespan(sch: Schedule) -> float:
    """When the last compute action of `sch` ends on `unit_clock`."""
    return max(end for _start, end in unit_clock(sch).values())


def list_schedule(stage_rank: list[int], m: int, cap: list[int], w_bound: int | None = None) -> list[list[Action]]:
    """Greedy list scheduling with unit costs F = B = W = 1 (B/W split).

    At every time step each free rank starts one ready action, preferring B (critical path:
    the gradient chain back to stage 0), then F, then W (no one waits for it: the bubble
    filler); W first while `w_bound` of them wait on the rank (B done, W not). Ties go to the
    oldest microbatch, then to the later stage. A forward that admits a microbatch into the
    rank's first stage waits while `cap[rank]` microbatch-stages are held (F done, W not)."""
    pp, n = len(cap), len(stage_rank)
    first = [stage_rank.index(r) for r in range(pp)]
    ready = [dict() for _ in range(pp)]  # rank -> {action: time its inputs are there}
    ready[stage_rank[0]] = {Action("F", 0, i): 0 for i in range(m)}
    held, orders, busy, waiting = [0] * pp, [[] for _ in range(pp)], [0] * pp, [0] * pp
    left = 3 * n * m
    for t in range(3 * n * m + 1):  # some rank starts an action at every step
        for r in range(pp):
            if busy[r] > t:
                continue
            now = [
                a
                for a, at in ready[r].items()
                if at <= t and (a.kind != "F" or a.stage != first[r] or held[r] < cap[r])
            ]
            if now:
                order = "WBF" if w_bound is not None and waiting[r] >= w_bound else "BFW"
                a = min(now, key=lambda a: (order.index(a.kind), a.microbatch, -a.stage))
                del ready[r][a]
                orders[r].append(a)
                busy[r], held[r], left = t + 1, held[r] + {"F": 1, "B": 0, "W": -1}[a.kind], left - 1
                waiting[r] += {"F": 0, "B": 1, "W": -1}[a.kind]
                for b in successors(a, n):
                    ready[stage_rank[b.stage]][b] = t + 1
        if not left:
            return orders
    raise AssertionError(f"list scheduling did not finish; still ready: {ready}")


def successors(a: Action, n: int) -> list[Action]:
    """Compute actions whose last dependency is `a` (F -> next F, or B on the last stage; B -> W and previous B)."""
    s, i = a.stage, a.microbatch
    if a.kind == "F":
        return [Action("F", s + 1, i) if s < n - 1 else Action("B", s, i)]
    if a.kind == "B":
        return [Action("W", s, i)] + ([Action("B", s - 1, i)] if s > 0 else [])
    return []


# ---------------------------------------------------------------- by name


def build_schedule(name: str, pp: int, m: int, virtual: int = 1) -> Schedule:
    """The schedule called `name` (gpipe, 1f1b, interleaved, zb1p, dualpipev) for pp ranks and m microbatches."""
    if name == "interleaved":
        return interleaved(pp, m, virtual)
    if name == "dualpipev":
        if virtual not in (1, 2):
            raise ValueError(f"dualpipev always holds 2 stages per rank; got virtual={virtual} (use 1 or 2)")
        return dualpipev(pp, m)
    builders = {"gpipe": gpipe, "1f1b": one_f_one_b, "zb1p": zb1p}
    if name not in builders:
        raise ValueError(f"unknown pipeline schedule {name!r}; choose one of {', '.join(NAMES)}")
    if virtual != 1:
        raise ValueError(
            f"{name} holds one stage per rank; got virtual={virtual} (use interleaved or dualpipev for more)"
        )
    return builders[name](pp, m)


# ---------------------------------------------------------------- checks


def check(schedule: Schedule) -> None:
    """Raise ScheduleError unless the schedule is complete, causal, matched and deadlock-free, and
    the executor's posting of its messages (`posting`) runs under NCCL's in-order semantics."""
    check_placement(schedule)
    check_counts(schedule)
    check_order(schedule)
    check_matching(schedule)
    execution_order(schedule)  # raises on deadlock
    check_in_order(schedule)


def check_placement(sch: Schedule) -> None:
    if len(sch.actions) != sch.pp:
        raise ScheduleError(f"{sch.name}: {len(sch.actions)} action lists for pp={sch.pp} ranks")
    if len(sch.stage_rank) != sch.n_stages or not all(0 <= r < sch.pp for r in sch.stage_rank):
        raise ScheduleError(
            f"{sch.name}: stage_rank={sch.stage_rank} does not map {sch.n_stages} stages to {sch.pp} ranks"
        )
    for rank, actions in enumerate(sch.actions):
        for a in actions:
            if not (0 <= a.stage < sch.n_stages and 0 <= a.microbatch < sch.microbatches):
                raise ScheduleError(f"rank {rank}: {a} names a stage or microbatch that does not exist")
            if sch.stage_rank[a.stage] != rank:
                raise ScheduleError(f"rank {rank}: {a} is for stage {a.stage}, held by rank {sch.stage_rank[a.stage]}")


def check_counts(sch: Schedule) -> None:
    """Every microbatch passes every stage forward once, backward once (and W once when split)."""
    kinds = COMPUTE if sch.split_backward else ("F", "B")
    for rank, actions in enumerate(sch.actions):
        seen = Counter(a for a in actions if a.is_compute)
        if not sch.split_backward and any(a.kind == "W" for a in seen):
            raise ScheduleError(f"rank {rank}: W actions in a schedule that does not split the backward")
        for s in sch.stages_of(rank):
            for i in range(sch.microbatches):
                for k in kinds:
                    if seen[Action(k, s, i)] != 1:
                        raise ScheduleError(
                            f"rank {rank}: {Action(k, s, i)} appears {seen[Action(k, s, i)]} times, expected once"
                        )


def check_order(sch: Schedule) -> None:
    """Causality: F before B before W on a rank; F after the previous stage's F; B after the next stage's B."""
    pos = positions(sch)
    for rank, actions in enumerate(sch.actions):
        for a in actions:
            if a.is_compute:
                for before in predecessors(a, sch):
                    if before not in pos or pos[before][1] >= pos[a][1]:
                        raise ScheduleError(
                            f"rank {rank}: {a} (position {pos[a][1]}) must come after {before}"
                            + (f" (position {pos[before][1]})" if before in pos else " (missing)")
                        )


def predecessors(a: Action, sch: Schedule) -> list[Action]:
    """Actions that must precede `a` on its rank: same-rank dependencies and the receive that feeds it."""
    s, i, last = a.stage, a.microbatch, sch.n_stages - 1
    if a.kind == "W":
        return [Action("B", s, i)]
    if a.kind == "F":
        if s == 0:
            return []
        return [Action("F", s - 1, i) if same_rank(sch, s, s - 1) else Action("RECV_F", s, i)]
    deps = [Action("F", s, i)]
    if s < last:
        deps.append(Action("B", s + 1, i) if same_rank(sch, s, s + 1) else Action("RECV_B", s, i))
    return deps


def same_rank(sch: Schedule, s: int, t: int) -> bool:
    return sch.stage_rank[s] == sch.stage_rank[t]


def positions(sch: Schedule) -> dict[Action, tuple[int, int]]:
    return {a: (rank, i) for rank, actions in enumerate(sch.actions) for i, a in enumerate(actions)}


def check_matching(sch: Schedule) -> None:
    """Each SEND exactly once, after its producer, with exactly one matching RECV on the neighbour, in send order."""
    pos = positions(sch)
    count = Counter(a for actions in sch.actions for a in actions if not a.is_compute)
    for rank, actions in enumerate(sch.actions):
        for i, a in enumerate(actions):
            if a.is_compute:
                continue
            if count[a] != 1:
                raise ScheduleError(f"rank {rank}: {a} appears {count[a]} times, expected once")
            peer = partner(a)
            if not 0 <= peer.stage < sch.n_stages or same_rank(sch, a.stage, peer.stage):
                raise ScheduleError(f"rank {rank}: {a} has no neighbour on another rank to talk to")
            if peer not in pos:
                raise ScheduleError(f"rank {rank}: {a} has no matching {peer} on rank {sch.stage_rank[peer.stage]}")
            if a.kind.startswith("SEND"):
                producer = Action(a.kind[-1], a.stage, a.microbatch)
                if pos.get(producer, (rank, i))[1] >= i:
                    raise ScheduleError(f"rank {rank}: {a} (position {i}) is sent before {producer} computed it")
    for a in needed_comms(sch):
        if a not in pos:
            raise ScheduleError(f"rank {sch.stage_rank[a.stage]}: {a} is missing")
    check_send_order(sch)


def check_send_order(sch: Schedule) -> None:
    """Between two ranks, the k-th receive must match the k-th send (messages are matched in order)."""
    sends: dict[tuple[int, int], list[Action]] = {}  # (sender, receiver): its sends, in order
    receives: dict[tuple[int, int], list[Action]] = {}  # (sender, receiver): the receives, in order
    for rank, actions in enumerate(sch.actions):
        for a in actions:
            if a.kind in SENDS:
                sends.setdefault((rank, sch.stage_rank[partner(a).stage]), []).append(a)
            elif a.kind in RECEIVES:
                receives.setdefault((sch.stage_rank[partner(a).stage], rank), []).append(a)
    for rank in range(sch.pp):
        for peer in range(sch.pp):
            pairs = zip(sends.get((peer, rank), []), receives.get((peer, rank), []))
            for k, (s, g) in enumerate(pairs):
                if partner(g) != s:
                    raise ScheduleError(
                        f"rank {rank}: receive #{k} from rank {peer} is {g} but rank {peer}'s send #{k} "
                        f"to it is {s} (messages between two ranks are matched in order)"
                    )


def partner(a: Action) -> Action:
    """The other end of a send or receive."""
    kind, step = PARTNER[a.kind]
    return Action(kind, a.stage + step, a.microbatch)


PARTNER = {"SEND_F": ("RECV_F", 1), "RECV_F": ("SEND_F", -1), "SEND_B": ("RECV_B", -1), "RECV_B": ("SEND_B", 1)}


def needed_comms(sch: Schedule) -> list[Action]:
    out = []
    for s in range(sch.n_stages - 1):
        if not same_rank(sch, s, s + 1):
            for i in range(sch.microbatches):
                out += [
                    Action("SEND_F", s, i),
                    Action("RECV_F", s + 1, i),
                    Action("SEND_B", s + 1, i),
                    Action("RECV_B", s, i),
                ]
    return out


def execution_order(sch: Schedule) -> list[tuple[int, int]]:
    """(rank, index) in an order a machine can run them: sends never block, a receive waits for its send.

    Raises ScheduleError naming the stuck ranks and what each waits for if the lists deadlock."""
    nxt, order = [0] * sch.pp, []
    sent: set[tuple[str, int, int]] = set()  # (receive kind, stage, microbatch) whose send was issued
    progress = True
    while progress:
        progress = False
        for rank, actions in enumerate(sch.actions):
            while nxt[rank] < len(actions):
                a = actions[nxt[rank]]
                if a.kind in RECEIVES and (a.kind, a.stage, a.microbatch) not in sent:
                    break
                if a.kind in SENDS:
                    kind, step = PARTNER[a.kind]
                    sent.add((kind, a.stage + step, a.microbatch))
                order.append((rank, nxt[rank]))
                nxt[rank] += 1
                progress = True
    stuck = [r for r in range(sch.pp) if nxt[r] < len(sch.actions[r])]
    if stuck:
        raise ScheduleError(f"{sch.name}: deadlock; " + "; ".join(waiting(sch, r, nxt[r]) for r in stuck))
    return order


def waiting(sch: Schedule, rank: int, i: int) -> str:
    a = sch.actions[rank][i]
    peer = partner(a)
    return f"rank {rank} stuck at {a} (position {i}) waiting for {peer} from rank {sch.stage_rank[peer.stage]}"


# ---------------------------------------------------------------- posting: NCCL's order

WINDOW = 2  # receives posted at most this many compute actions before the one that consumes them


@dataclass(frozen=True)
class Slot:
    """A place in a rank's step: the messages posted there, as one batch, then a compute action."""

    post: tuple[Action, ...]  # sends and receives, in the order every rank posts its messages
    compute: Action | None  # None: the end of the step (the last sends)


def posting(sch: Schedule, window: int = WINDOW) -> list[list[Slot]]:
    """Where the executor posts each message: per rank, a slot before each compute action and one
    at the end, each posting one batch (`PipelineStep`); once per schedule and window.

    NCCL runs a rank's batches in the order they were posted (`streams`), so every rank posts its
    messages in one global order: message m has a time t(m) on the schedule's unit-cost clock
    (`unit_clock`), t(m) = max(end of its producer, start of the receiver's compute action
    `window` - 1 before the consumer), and each rank posts its messages in the order of t, each
    as early as that order allows (`rank_slots`): the sender after the producer, the receiver at
    most `window` compute actions before the consumer. By induction on t the pipeline cannot
    deadlock: the unfinished message of least t has only finished messages ahead of it in both
    streams, and both ranks post it, for before it they wait only for messages ahead of it (t
    is causal: a message's producer ends before its consumer starts). A receive's buffer is alive
    from its slot until its consumer: at most `window` of them at once. A send may wait behind
    messages of smaller t (its consumer is further on): a forward's output is kept until its
    send is out, a backward's gradient too (`boundary_frontier` counts them).

    Why `WINDOW` = 2: at 1 a receive is posted after the compute action before its consumer, and
    on a GPU NCCL's stream waits for that action before it starts (a message's whole transfer
    exposed, every time); at 2 the message passes during that action (double buffering: a
    stage's compute is tens of ms, a [b, s, h] message a few ms); more buys nothing and holds
    more buffers."""
    if window < 1:
        raise ValueError(f"window={window}: a receive is posted at least 1 compute action before its consumer")
    if window not in sch.posted:
        spans = unit_clock(sch)
        times = message_times(sch, spans, window)
        sch.posted[window] = [rank_slots(sch, rank, times, window) for rank in range(sch.pp)]
    return sch.posted[window]


def unit_clock(sch: Schedule) -> dict[Action, tuple[float, float]]:
    """(start, end) of every compute action: F = W = 1, B = 2 when whole (1 when split), a
    message arriving when it is sent (`simulate.simulate`'s clock with its default costs)."""
    cost = {"F": 1.0, "B": 1.0 if sch.split_backward else 2.0, "W": 1.0}
    free, sent, spans = [0.0] * sch.pp, {}, {}
    for rank, i in execution_order(sch):
        a = sch.actions[rank][i]
        if a.is_compute:
            spans[a] = (free[rank], free[rank] + cost[a.kind])
            free[rank] += cost[a.kind]
        elif a.kind in RECEIVES:
            free[rank] = max(free[rank], sent[partner(a)])
        else:
            sent[a] = free[rank]
    return spans


def message_times(sch: Schedule, spans: dict, window: int) -> dict[Action, float]:
    """send -> t(m): the end of its producer, or the start of the compute action `window` - 1 before
    its consumer on the receiving rank, whichever is later."""
    computes = [sch.compute(rank) for rank in range(sch.pp)]
    index = {a: k for row in computes for k, a in enumerate(row)}
    times = {}
    for actions in sch.actions:
        for a in actions:
            if a.kind in SENDS:
                consumer = made_by(partner(a))
                early = computes[sch.stage_rank[consumer.stage]][max(index[consumer] - window + 1, 0)]
                times[a] = max(spans[made_by(a)][1], spans[early][0])
    return times


def made_by(a: Action) -> Action:
    """The compute action that produces a send's tensor (SEND_F: F) or consumes a receive's (RECV_B: B)."""
    return Action(a.kind[-1], a.stage, a.microbatch)


def rank_slots(sch: Schedule, rank: int, times: dict, window: int) -> list[Slot]:
    """`rank`'s messages in the order of their times (t, then the message: the same order at both
    ends), each posted as early as that order allows (slot k comes before compute action k): a
    send after its producer, a receive at most `window` compute actions before its consumer,
    neither before the message ahead of it."""
    computes = sch.compute(rank)
    index = {a: k for k, a in enumerate(computes)}
    slots: list[list[Action]] = [[] for _ in range(len(computes) + 1)]
    at = 0
    for a in sorted((a for a in sch.actions[rank] if not a.is_compute), key=lambda a: message_key(a, times)):
        made = index[made_by(a)]
        at = max(at, made + 1 if a.kind in SENDS else made - window + 1)
        slots[at].append(a)
    return [Slot(tuple(post), computes[k] if k < len(computes) else None) for k, post in enumerate(slots)]


def message(a: Action) -> Action:
    """A message by its send: the same at both ends."""
    return a if a.kind in SENDS else partner(a)


def message_key(a: Action, times: dict) -> tuple:
    m = message(a)
    return times[m], m.stage, m.microbatch, m.kind


def programs(sch: Schedule, slots: list[list[Slot]]) -> list[streams.Program]:
    """Each rank's posts and waits (`streams.Program`): a slot's batch, then a wait for the receive
    that feeds its compute action."""
    out = []
    for rank, row in enumerate(slots):
        program, batch, posted = [], {}, 0
        for slot in row:
            if slot.post:
                batch.update((a, posted) for a in slot.post)
                program.append(tuple(message_op(sch, a) for a in slot.post))
                posted += 1
            for receive in feeding(slot.compute, sch) if slot.compute is not None else ():
                if receive not in batch:
                    raise ScheduleError(f"rank {rank}: {slot.compute} comes before {receive} is posted")
                program.append(streams.Wait(batch[receive]))
        out.append(program)
    return out


def feeding(a: Action, sch: Schedule) -> list[Action]:
    """The receive whose tensor compute action `a` consumes (none when the producer is on its rank)."""
    return [p for p in predecessors(a, sch) if p.kind in RECEIVES] if a.kind != "W" else []


def message_op(sch: Schedule, a: Action) -> streams.Op:
    return streams.Op(a.kind in SENDS, sch.stage_rank[partner(a).stage], message(a), label=str(a))


def check_in_order(sch: Schedule, window: int = WINDOW, per_pair: bool = False) -> None:
    """The executor's posting (`posting`) under NCCL's semantics (`streams.run`): raise ScheduleError
    on a deadlock or a message received as another."""
    problems = streams.run(programs(sch, posting(sch, window)), per_pair)
    if problems:
        raise ScheduleError(f"{sch.name} under NCCL's order (window {window}): " + "; ".join(problems))


# ---------------------------------------------------------------- memory


def peak_in_flight(schedule: Schedule) -> list[int]:
    """Per rank, the most microbatch-stages holding activations at once: from F until B, or until W when split."""
    release = "W" if schedule.split_backward else "B"
    peaks = []
    for actions in schedule.actions:
        held = peak = 0
        for a in actions:
            held += (a.kind == "F") - (a.kind == release)
            peak = max(peak, held)
        peaks.append(peak)
    return peaks


def boundary_frontier(
    schedule: Schedule, window: int = WINDOW, released: bool = True
) -> list[tuple[tuple[int, int, int], ...]]:
    """Per rank, the (microbatch-stages holding activations, microbatch-stages between their B and
    W, boundary tensors alive) triples its step passes through that no other triple exceeds in
    all three (a split backward's B frees the activations but for what W reads: the linear
    layers' inputs and output gradients), each boundary tensor one [b_mb, s, h] of the
    residual stream, as the executor (`PipelineStep`) holds them under `posting`: a receive's buffer
    from its slot until its F takes it as the stage's input (an activation from then on) or its B
    has run; a stage's output, when the next stage is on another rank, from F until its send is
    out (`released`: the executor lets a block's output go then, `executor.release`) or else until
    B; a backward's input gradient from B until its send is out or, when the previous stage is on
    the same rank, until that stage's B. A send is out at once on the memory check's fake process
    group, at the compute action after its slot; on a real one when its receiver takes it. A
    rank's memory peaks at the triple that maximizes held x activations + waiting x what W reads
    + alive x boundary bytes."""
    split = schedule.split_backward
    sent = ("SEND_F", "SEND_B") if released else ("SEND_B",)
    out = []
    for rank, slots in enumerate(posting(schedule, window)):
        held = waiting = alive = sending = 0
        seen = {(0, 0, 0)}
        for slot in slots:
            alive += sum(a.kind in RECEIVES for a in slot.post)
            sending += sum(a.kind in sent for a in slot.post)
            seen.add((held, waiting, alive))
            if slot.compute is None:
                continue
            alive, sending = alive - sending, 0  # the sends posted are out (`PipelineStep.reap_sends`)
            kind = slot.compute.kind
            alive += boundaries_changed(schedule, slot.compute, rank, released)
            held += (kind == "F") - (kind == "B")
            waiting += (kind == "B" and split) - (kind == "W")
            seen.add((held, waiting, alive))
        out.append(tuple(p for p in seen if not any(q != p and all(x >= y for x, y in zip(q, p)) for q in seen)))
    return out


def boundaries_changed(sch: Schedule, a: Action, rank: int, released: bool) -> int:
    """How many boundary tensors compute action `a` adds (+) or lets go (-) on `rank`, its sends aside."""
    s, last = a.stage, sch.n_stages - 1
    sent_on = s < last and sch.stage_rank[s + 1] != rank  # the output goes to another rank
    received = s > 0 and sch.stage_rank[s - 1] != rank
    if a.kind == "F":  # the received input becomes an activation; the output is kept to be sent
        return sent_on - received
    if a.kind != "B":
        return 0
    # the received (or handed back) gradient goes, and the output if still kept; the input's gradient comes
    handed_back = s < last and not sent_on
    return -sent_on - (sent_on and not released) - handed_back + (s > 0)
