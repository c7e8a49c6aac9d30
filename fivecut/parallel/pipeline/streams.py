"""Point-to-point messages as NCCL runs them: in the order they were posted, one stream a rank.

gloo matches a message by (peer, tag) whenever both ends have posted it. NCCL has no tags and
runs a rank's operations on a CUDA stream, one after the other, in the order they were posted:
PyTorch's `batch_isend_irecv` puts every batch of a process group on that group's own
communicator and stream (plain isend/irecv: on one stream per pair of ranks), and the
operations of one batch run together (ncclGroupStart/End). Between two ranks the k-th send one
way is received by the k-th receive posted for it, and a large message is a rendezvous: a send
completes only with its receive. So an operation completes when it and its match are both
running, i.e. both batches are at the head of their streams, and a batch completes when all its
operations have.

A rank's `Program` is what it posts and waits for, in its order: a batch (a tuple of `Op`) is
posted and the rank goes on; a `Wait` stops the rank until that batch (by its index among the
rank's batches) has completed; at its end the rank waits for every batch it posted. `run`
plays the programs of every rank of a group to the end and returns the problems it finds: a
deadlock (every rank stopped, naming what each waits for and what its stream's head waits
for), a message received as another one (k-th send and k-th receive of a pair not the same
message, or not the same size), or operations never matched. The pipeline's planned programs
(`schedule.programs`) and its recorded ones (the test transport's) are played alike.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Op:
    """One send or receive of a rank: `peer` is a group rank; `message` names what it carries and is
    the same at both ends (an action of the schedule, or a tag); `label` only describes it."""

    send: bool
    peer: int
    message: Hashable
    elements: int = 0  # 0: unknown
    label: str = field(default="", compare=False)

    def __str__(self) -> str:
        what = self.label or str(self.message)
        return f"{what} ({'send to' if self.send else 'recv from'} rank {self.peer})"


@dataclass(frozen=True)
class Wait:
    batch: int  # index among the rank's batches


Program = list  # of tuple[Op, ...] (a batch, posted) and Wait, in the rank's order


def run(programs: list[Program], per_pair: bool = False) -> list[str]:
    """Play every rank's program under NCCL's order; the problems found (none: it runs).
    `per_pair`: one stream per pair of ranks (plain isend/irecv) instead of one a rank."""
    return Streams(programs, per_pair).play()


class Streams:
    """The state of `run`: each rank's place in its program, its batches and their streams."""

    def __init__(self, programs: list[Program], per_pair: bool):
        self.programs, self.per_pair = programs, per_pair
        n = len(programs)
        self.pc = [0] * n
        self.batches: list[list[tuple[Op, ...]]] = [[] for _ in range(n)]
        self.left: list[list[int]] = [[] for _ in range(n)]  # ops of each batch not yet complete
        self.queues: dict[tuple, deque] = {}  # stream -> its parts of batches: (batch, [op index])
        self.posted: dict[tuple[int, int, bool], list[tuple[int, int, int]]] = {}  # (src, dst, send) -> ops
        self.place: dict[tuple[int, int, int], tuple[int, int, bool, int]] = {}  # op -> (src, dst, send, k)
        self.running: set[tuple[int, int, int]] = set()  # (rank, batch, op index) at a stream's head
        self.done: set[tuple[int, int, int]] = set()
        self.problems: list[str] = []
        self.ready: deque[int] = deque(range(n))

    def play(self) -> list[str]:
        while self.ready:
            self.advance(self.ready.popleft())
        stuck = [r for r in range(len(self.programs)) if not self.finished(r)]
        if stuck:
            self.problems.append("deadlock: " + "; ".join(self.stuck_at(r) for r in stuck))
        return self.problems

    def finished(self, rank: int) -> bool:
        return self.pc[rank] == len(self.programs[rank]) and not any(self.left[rank])

    def advance(self, rank: int) -> None:
        """Post and go on until a wait for a batch that has not completed (or the end)."""
        program = self.programs[rank]
        while self.pc[rank] < len(program):
            item = program[self.pc[rank]]
            if isinstance(item, Wait):
                if item.batch >= len(self.batches[rank]):
                    self.problems.append(f"rank {rank} waits for batch #{item.batch}, never posted")
                elif self.left[rank][item.batch]:
                    return
            else:
                self.post(rank, tuple(item))
            self.pc[rank] += 1

    def stream(self, rank: int, op: Op) -> tuple:
        return (rank, op.peer) if self.per_pair else (rank,)

    def post(self, rank: int, ops: tuple[Op, ...]) -> None:
        b = len(self.batches[rank])
        self.batches[rank].append(ops)
        self.left[rank].append(len(ops))
        parts: dict[tuple, list[int]] = {}
        for i, op in enumerate(ops):
            src, dst = (rank, op.peer) if op.send else (op.peer, rank)
            mine = self.posted.setdefault((src, dst, op.send), [])
            self.place[(rank, b, i)] = (src, dst, op.send, len(mine))
            mine.append((rank, b, i))
            parts.setdefault(self.stream(rank, op), []).append(i)
        for key, indices in parts.items():
            queue = self.queues.setdefault(key, deque())
            queue.append((b, indices))
            if len(queue) == 1:
                self.start(rank, b, indices)

    def start(self, rank: int, b: int, indices: list[int]) -> None:
        """A part of a batch reaches the head of its stream: its operations run."""
        for i in indices:
            self.running.add((rank, b, i))
        for i in indices:
            self.meet((rank, b, i))

    def meet(self, handle: tuple[int, int, int]) -> None:
        """An operation running: complete it with its match if that one runs too."""
        src, dst, send, k = self.place[handle]
        others = self.posted.get((src, dst, not send), [])
        if handle in self.done or k >= len(others) or others[k] not in self.running:
            return
        match = others[k]
        mine, theirs = self.op(handle), self.op(match)
        if mine.message != theirs.message or (mine.elements and theirs.elements and mine.elements != theirs.elements):
            sender, receiver = (mine, theirs) if send else (theirs, mine)
            self.problems.append(
                f"rank {dst}'s receive #{k} from rank {src} is {receiver} but rank {src}'s send #{k} to it "
                f"is {sender} (messages between two ranks are matched in order)"
            )
        for h in (handle, match):
            self.complete(h)

    def op(self, handle: tuple[int, int, int]) -> Op:
        rank, b, i = handle
        return self.batches[rank][b][i]

    def complete(self, handle: tuple[int, int, int]) -> None:
        rank, b, i = handle
        self.done.add(handle)
        self.running.discard(handle)
        self.left[rank][b] -= 1
        queue = self.queues[self.stream(rank, self.op(handle))]
        head, indices = queue[0]
        if all((rank, head, j) in self.done for j in indices):
            queue.popleft()
            if queue:
                self.start(rank, *queue[0])
        if not self.left[rank][b]:
            self.ready.append(rank)

    def stuck_at(self, rank: int) -> str:
        """What a rank waits for, and what the head of its stream waits for."""
        program, pc = self.programs[rank], self.pc[rank]
        if pc < len(program):
            b = program[pc].batch
            waits = f"rank {rank} waits for batch #{b} [{', '.join(map(str, self.batches[rank][b]))}]"
        else:
            waits = f"rank {rank} waits at the end for its batches"
        heads = []
        for key, queue in self.queues.items():
            if key[0] == rank and queue:
                b, indices = queue[0]
                pending = [self.op((rank, b, i)) for i in indices if (rank, b, i) not in self.done]
                heads += [f"{op} is not matched by a running operation of rank {op.peer}" for op in pending]
        return waits + (": its stream's head " + ", ".join(heads) if heads else "")
