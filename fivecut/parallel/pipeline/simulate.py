"""Time a schedule's action lists with per-action costs: the timeline, the bubble, a text picture.

Each rank runs its list in order. A compute action starts when the previous action on
the rank ends and lasts its kind's cost, or its (kind, stage)'s where `stage_costs` gives one
(a measured stage: the last one carries the head and the loss). A send is issued when the rank
gets to it and occupies the rank for `cost_send` (0: it never blocks); a receive ends when the
matching send was issued plus `cost_comm` (or when the rank gets there, if later).

Bubble (one definition everywhere): total idle time / (pp * makespan), where a rank's
idle time is makespan minus its compute time (waiting in a receive is idle; the
communication actions themselves are not compute).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from fivecut.parallel.pipeline.schedule import COMPUTE, PARTNER, RECEIVES, Action, Schedule, execution_order


@dataclass
class Timeline:
    schedule: Schedule
    rows: list[list[tuple[Action, float, float]]]  # per rank: (action, start, end), communication included
    costs: dict[str, float]  # F, B, W, comm (per kind; `stage_costs` may override F, B, W per stage)
    makespan: float
    bubble: float  # idle / (pp * makespan)

    def busy(self, rank: int) -> float:
        return sum(end - start for a, start, end in self.rows[rank] if a.is_compute)

    def idle_fraction(self, rank: int) -> float:
        """One rank's bubble: its idle time / makespan."""
        return 1.0 - self.busy(rank) / self.makespan if self.makespan else 0.0


def simulate(
    schedule: Schedule,
    cost_f: float = 1.0,
    cost_b: float | None = None,
    cost_w: float | None = None,
    cost_comm: float = 0.0,
    *,
    stage_costs: Mapping[tuple[str, int], float] | None = None,
    cost_send: float = 0.0,
) -> Timeline:
    """Run the schedule on a clock. Defaults: B = 2 when the backward is whole, B = 1 and W = 1 when split.
    `stage_costs`: (kind, stage) -> the cost of that stage's F, B or W, in place of the kind's."""
    if cost_b is None:
        cost_b = 1.0 if schedule.split_backward else 2.0
    if cost_w is None:
        cost_w = 1.0
    costs = {"F": cost_f, "B": cost_b, "W": cost_w, "comm": cost_comm}
    per_stage = dict(stage_costs or {})
    if any(c < 0 for c in (*costs.values(), *per_stage.values(), cost_send)):
        raise ValueError(f"costs must not be negative: {costs}, send {cost_send}, per stage {per_stage}")
    rows = [[] for _ in range(schedule.pp)]
    ends = [0.0] * schedule.pp  # when each rank's last action ended
    sent: dict[tuple[str, int, int], float] = {}  # (receive kind, stage, microbatch) -> when its send was issued
    for rank, i in execution_order(schedule):
        a = schedule.actions[rank][i]
        free = ends[rank]
        if a.kind in COMPUTE:
            end = free + per_stage.get((a.kind, a.stage), costs[a.kind])
        elif a.kind in RECEIVES:
            end = max(free, sent[(a.kind, a.stage, a.microbatch)] + cost_comm)
        else:  # a send is issued; the rank moves on after posting it
            kind, step = PARTNER[a.kind]
            end, sent[(kind, a.stage + step, a.microbatch)] = free + cost_send, free
        rows[rank].append((a, free, end))
        ends[rank] = end
    makespan = max((row[-1][2] for row in rows if row), default=0.0)
    busy = sum(end - start for row in rows for a, start, end in row if a.kind in COMPUTE)
    bubble = 1.0 - busy / (schedule.pp * makespan) if makespan else 0.0
    return Timeline(schedule, rows, costs, makespan, bubble)


@dataclass(frozen=True)
class Program:
    """A schedule's execution order compiled for `timed`: each step's rank, what it does (a compute
    kind, "recv" or "send") and the message it waits for or issues (an index), once per schedule."""

    pp: int
    steps: tuple[tuple[int, str, int], ...]
    messages: int
    acting: tuple[int, ...]  # the ranks with any action


def compiled(schedule: Schedule) -> Program:
    slots: dict[tuple[str, int, int], int] = {}
    steps = []
    for rank, i in execution_order(schedule):
        a = schedule.actions[rank][i]
        if a.kind in COMPUTE:
            steps.append((rank, a.kind, -1))
        elif a.kind in RECEIVES:
            steps.append((rank, "recv", slots.setdefault((a.kind, a.stage, a.microbatch), len(slots))))
        else:
            kind, step = PARTNER[a.kind]
            steps.append((rank, "send", slots.setdefault((kind, a.stage + step, a.microbatch), len(slots))))
    acting = tuple(r for r in range(schedule.pp) if schedule.actions[r])
    return Program(schedule.pp, tuple(steps), len(slots), acting)


def timed(program: Program, cost_f: float, cost_b: float, cost_w: float | None, cost_comm: float):
    """(makespan, bubble) of `simulate` with these costs, without the timeline: the same clock, the
    same sums in the same order, so the same floats."""
    costs = {"F": cost_f, "B": cost_b, "W": 1.0 if cost_w is None else cost_w}
    if any(c < 0 for c in (*costs.values(), cost_comm)):
        raise ValueError(f"costs must not be negative: {costs | {'comm': cost_comm}}")
    ends = [0.0] * program.pp
    sent = [0.0] * program.messages
    spans: list[list[float]] = [[] for _ in range(program.pp)]  # each rank's compute, in order
    for rank, op, slot in program.steps:
        free = ends[rank]
        if op == "recv":
            end = max(free, sent[slot] + cost_comm)
        elif op == "send":
            end = sent[slot] = free
        else:
            end = free + costs[op]
            spans[rank].append(end - free)
        ends[rank] = end
    makespan = max((ends[r] for r in program.acting), default=0.0)
    busy = sum(d for row in spans for d in row)
    return makespan, 1.0 - busy / (program.pp * makespan) if makespan else 0.0


def label(schedule: Schedule, a: Action) -> str:
    """`F3` forward of microbatch 3; a prime per chunk for the rank's later stages (`B3'` = second stage)."""
    return f"{a.kind}{a.microbatch}" + "'" * schedule.chunk(a.stage)


def text(timeline: Timeline, unit: float | None = None) -> str:
    """Each rank's timeline as one line: a cell per `unit` of time holding the running action, `.` idle."""
    sch = timeline.schedule
    if unit is None:
        unit = min((timeline.costs[k] for k in ("F", "B", "W") if timeline.costs[k] > 0), default=1.0)
    cells = math.ceil(timeline.makespan / unit - 1e-9)
    labels = {a: label(sch, a) for row in timeline.rows for a, _, _ in row if a.is_compute}
    width = max(map(len, labels.values()), default=1) + 1
    lines = []
    for rank, row in enumerate(timeline.rows):
        line = [".".ljust(width)] * cells
        for a, start, end in row:
            if a.is_compute:  # a cell shows the action running at its midpoint
                for c in range(math.floor(start / unit - 0.5), math.ceil(end / unit - 0.5) + 1):
                    if 0 <= c < cells and start <= (c + 0.5) * unit < end:
                        line[c] = labels[a].ljust(width)
        lines.append(f"rank {rank}: " + "".join(line).rstrip())
    return "\n".join(lines)
