"""NCCL's point-to-point semantics on gloo, for the tests: a `fivecut.comm.Group.transport`.

gloo matches a message by (peer, tag) whenever both ends have posted it, so a posting order that
NCCL would deadlock on runs on gloo. `NcclOrder` runs a group's point-to-point batches as NCCL
runs them (`fivecut.parallel.pipeline.streams`): every batch of a rank on one stream (a thread),
one after the other in posting order, the operations of a batch together, tags ignored (every
message goes with tag 0, so gloo matches them between two ranks in the order posted), a send
completing only with its receive (gloo's sends wait for their receives). `per_pair`: one stream
per pair of ranks instead (plain isend/irecv). A wait that does not end within `timeout_s` raises,
naming the rank, the batch it waits for and the batch its stream is stuck at, with the ranks that
have not matched it: a deadlock fails a test in seconds and says where.

Every transport here records what passes through it (`Recording`): the rank's program of posts and
waits for receives (`streams.Program`, each operation's message its tag) and the collectives, in
order. `Recording` alone only records (plain gloo underneath). Install one on a group in place
(`install`): the layers that hold the group see it.
"""

from __future__ import annotations

import queue
import threading
import time

import torch
import torch.distributed as dist

from fivecut.comm import Group
from fivecut.parallel.pipeline import streams


class Recording:
    """Records a rank's point-to-point program and collectives on one group; runs every call as is."""

    def __init__(self) -> None:
        self.group: Group | None = None
        self.program: streams.Program = []  # batches (tuples of streams.Op) and waits, in this rank's order
        self.collectives: list[tuple] = []  # (name, shapes and dtypes of its tensors), in order
        self.batch_of: dict[int, tuple[object, int]] = {}  # id(work) -> (the work, kept alive; its batch)

    def __call__(self, name: str, call, *args, **kwargs):
        if call is dist.batch_isend_irecv:
            return self.post(args[0])
        if id(getattr(call, "__self__", None)) in self.batch_of:  # a wait for a Work this transport gave
            if name != "send":  # a receive's (a send's wait, `PipelineStep.reap_sends`, comes once it is out)
                self.program.append(streams.Wait(self.batch_of[id(call.__self__)][1]))
            return call(*args, **kwargs)
        if getattr(call, "__name__", "") != "wait":  # a collective posted (its wait posts nothing)
            self.collectives.append((name, tuple((tuple(t.shape), str(t.dtype)) for t in tensors(args, kwargs))))
        return call(*args, **kwargs)

    def post(self, ops: list) -> list:
        works = dist.batch_isend_irecv(ops)
        self.remember(ops, works)
        return works

    def remember(self, ops: list, works: list) -> int:
        b = sum(1 for item in self.program if isinstance(item, tuple))
        self.program.append(tuple(recorded_op(op) for op in ops))
        for work in works:
            self.batch_of[id(work)] = (work, b)
        return b


def tensors(args, kwargs) -> list[torch.Tensor]:
    found = []
    for x in (*args, *kwargs.values()):
        if isinstance(x, torch.Tensor):
            found.append(x)
        elif isinstance(x, (list, tuple)):
            found += [t for t in x if isinstance(t, torch.Tensor)]
    return found


def recorded_op(op: dist.P2POp) -> streams.Op:
    send = op.op is dist.isend
    return streams.Op(send, op.group_peer, op.tag, op.tensor.numel(), label=f"tag {op.tag}")


def install(group: Group, transport: Recording) -> Recording:
    """Put `transport` on `group` (in place: every holder of the group uses it)."""
    group.transport, transport.group = transport, group
    return transport


class Part:
    """A batch's operations on one stream (the whole batch when a rank has one stream)."""

    def __init__(self, batch: int, ops: list, stream: Stream):
        self.batch, self.ops, self.stream = batch, ops, stream
        self.posted = time.monotonic()
        self.done = threading.Event()
        self.error: BaseException | None = None

    def words(self) -> str:
        return f"batch #{self.batch} [" + ", ".join(describe(op) for op in self.ops) + "]"


def describe(op: dist.P2POp) -> str:
    way = "send to" if op.op is dist.isend else "recv from"
    return f"{way} rank {op.group_peer} (tag {op.tag}, {op.tensor.numel()} elements)"


class Stream:
    """One CUDA stream of NCCL's: its parts run one after the other, each after the one before ended."""

    def __init__(self, name: str):
        self.name = name
        self.parts: queue.Queue = queue.Queue()
        self.head: Part | None = None
        self.ran = 0
        threading.Thread(target=self.run, name=f"nccl-order {name}", daemon=True).start()

    def run(self) -> None:
        while True:
            part = self.parts.get()
            self.head = part
            try:  # tag 0 for all: between two ranks gloo then matches in the order posted
                works = [
                    dist.isend(op.tensor, group=op.group, group_dst=op.group_peer, tag=0)
                    if op.op is dist.isend
                    else dist.irecv(op.tensor, group=op.group, group_src=op.group_peer, tag=0)
                    for op in part.ops
                ]
                for work in works:
                    work.wait()
            except BaseException as err:  # noqa: BLE001 - reported by the wait that meets it
                part.error = err
            self.ran += 1
            part.done.set()
            if part.error is not None:
                return  # a broken stream runs nothing more, as NCCL's after an error


class OrderedWork:
    """The Work of one operation: complete when its part of the batch has run."""

    def __init__(self, transport: NcclOrder, part: Part):
        self.transport, self.part = transport, part

    def is_completed(self) -> bool:
        return self.part.done.is_set()

    def wait(self, timeout=None) -> bool:
        if not self.part.done.wait(self.transport.timeout_s):
            raise RuntimeError(self.transport.stuck(self.part))
        if self.part.error is not None:
            raise RuntimeError(f"NCCL order: {self.part.words()} failed: {self.part.error}")
        return True


class NcclOrder(Recording):
    """NCCL's in-order semantics on a gloo group (module doc); records like `Recording`."""

    def __init__(self, timeout_s: float = 30.0, per_pair: bool = False):
        super().__init__()
        self.timeout_s, self.per_pair = timeout_s, per_pair
        self.streams: dict[object, Stream] = {}

    def post(self, ops: list) -> list:
        """Each operation onto its stream (one part of the batch a stream); a Work for each, in order."""
        b = sum(1 for item in self.program if isinstance(item, tuple))
        parts: dict[object, Part] = {}
        for op in ops:
            key = op.group_peer if self.per_pair else "all"
            if key not in self.streams:
                self.streams[key] = Stream(f"rank {self.rank}, {key}")
            parts.setdefault(key, Part(b, [], self.streams[key])).ops.append(op)
        works = [OrderedWork(self, parts[op.group_peer if self.per_pair else "all"]) for op in ops]
        for part in parts.values():
            part.stream.parts.put(part)
        self.remember(ops, works)
        return works

    @property
    def rank(self) -> int:
        return self.group.rank if self.group is not None else -1

    def stuck(self, part: Part) -> str:
        """One line: this rank, the batch it waits for, where its stream is and whom that waits for."""
        head, stream = part.stream.head, part.stream
        text = (
            f"NCCL order: rank {self.rank} (of group ranks {list(self.group.ranks)}) timed out after "
            f"{self.timeout_s:.0f} s waiting for {part.words()}"
        )
        if head is None or head.done.is_set():
            return text + f"; its stream has run {stream.ran} batches"
        where = "the head of its stream" if head is part else f"behind {head.words()} at the head of its stream"
        peers = ", ".join(map(str, sorted({op.group_peer for op in head.ops})))
        return text + (
            f", {where} (which has run {stream.ran} batches), posted {time.monotonic() - head.posted:.1f} s ago and "
            f"not matched by rank {peers} (a rank's batches run in the order posted)"
        )
