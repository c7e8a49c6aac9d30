"""How a run saves: blocking, or in the background (`checkpoint.async_mode`); what a failed save
does (`checkpoint.on_error`, `fivecut.train.faults.SaveFailures`); each save's times in metrics.jsonl.

A background save ("thread": DCP's writer in a thread of each rank; "process": in a writer process
per rank, DCP's `AsyncCheckpointerType.PROCESS`) copies each rank's chunks into host memory with
DCP's `DefaultStager` (pinned where a GPU is, shared memory for a writer process) in the stager's
own thread (`StagingOptions.use_async_staging`), while the next step's forward and backward run:
they read the state and do not change it. The training loop waits for the copy (the
`staging_completion` of DCP's `AsyncSaveResponse`) only before the first thing that mutates the
state in place (`Saves.before_update`, called by the trainer before the MoE balancing biases move
and the optimizer steps), and before any later save. DCP's own collectives of that save (the
plans, the write results) run on a gloo group of their own, made for it. DCP's writer starts once
the copy is complete and writes `.tmp-step-N` while training goes on. At most one save is in
flight: a save that comes due while the previous one is still writing first waits for it. At every
step's end the control all-reduce tells every rank whether any rank is still writing
(`faults.agree`); once none is, every rank finishes the save together as a blocking save does: the
checksums of each rank's files are gathered, rank 0 records them and renames the folder into
place, the files are read back (`checkpoint.verify`) and older checkpoints pruned (renamed out of
sight at once, deleted in a thread of rank 0). The last save of a run, and one on SIGTERM/SIGINT,
are finished before the process exits. A process killed while a save writes leaves `.tmp-step-N`,
removed at the next start (and `.pruned-step-N`, what a deletion did not finish).

Each background save adds `{"step": N, "checkpoint": {"async_mode", "start_s", "staging_s",
"staging_wait_s", "blocking_s", "total_s", "staged_bytes"}}` to metrics.jsonl once in place: the
seconds its start took on the training thread (the folder, DCP's call), the seconds from its start
to the end of the staging copy (in the background), the seconds the step waited for that copy before
its update, all the seconds the training loop waited for the save (its start, that wait, a wait for
it before the next save or the run's end, the check and rename at its end), the seconds from its
start to its rename, and the host memory the stager holds (`fivecut plan` counts it:
`plan.cost.staging_bytes`).
(A blocking save's time is its step's: it adds no record.)
"""

from __future__ import annotations

import multiprocessing
import shutil
import threading
import time
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import _async_process_executor as process_executor  # its writer, to replace
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from fivecut.comm import backend_reason
from fivecut.config import CheckpointConfig
from fivecut.train import checkpoint
from fivecut.train.faults import SaveFailures

WRITERS = {"thread": AsyncCheckpointerType.THREAD, "process": AsyncCheckpointerType.PROCESS}
WRITER_FAILED = "the writer failed"
CHUNKS = "chunks"  # the state dict's one entry: {(key, i): chunk i of the table's key}


@dataclass
class InFlight:
    """A background save that is writing: where, and what rank 0 records once every rank is done."""

    step: int
    root: Path
    meta: dict
    moe: dict  # this rank's MoE state as it was staged
    hashed: Future  # (this rank's files' checksums, problems reading them back), once DCP's writer is done
    staging: Future  # DCP's staging_completion: this rank's copy of the state is complete
    started: float  # time.perf_counter() at its start
    blocking: float  # seconds the training loop waited for it so far
    start: float = 0.0  # seconds its start took on the training thread
    staged_at: float | None = None  # time.perf_counter() when the staging copy was complete
    staging_wait: float | None = None  # seconds the training loop waited for the copy (None: not yet)

    def copied(self, _future: Future) -> None:
        self.staged_at = time.perf_counter()

    @property
    def tmp(self) -> Path:
        return self.root / f".tmp-step-{self.step:08d}"


@dataclass
class Saves:
    """Every save of one run, on every rank alike. `report(line, record)`: rank 0's log line (None:
    none) and metrics.jsonl record."""

    config: CheckpointConfig
    report: Callable[[str | None, dict], None]
    timeout: float = 300.0  # seconds a checkpoint collective waits (train.collective_timeout)
    failures: SaveFailures | None = None
    in_flight: InFlight | None = None
    group: object = None  # the gloo group of DCP's background collectives
    stager: DefaultStager | None = None
    deleting: threading.Thread | None = None  # rank 0's deletion of the checkpoints the last save pruned

    def __post_init__(self):
        if self.config.on_error == "continue":
            self.failures = SaveFailures(self.config.max_failures, self.report)

    @property
    def background(self) -> bool:
        return self.config.async_mode != "off"

    def save(self, root: Path, step: int, par, optimizer, meta: dict) -> None:
        """A blocking save, or the start of a background one (after the one in flight, if any, finished)."""
        self.finish()
        if not self.background:
            c = self.config
            self.guarded(step, lambda: checkpoint.save(root, step, par, optimizer, meta, c.keep, c.verify))
            return
        self.guarded(step, lambda: self.start(root, step, par, optimizer, meta, time.perf_counter()))

    def start(self, root: Path, step: int, par, optimizer, meta: dict, started: float) -> None:
        """Stage this rank's chunks into host memory and hand them to DCP's background writer."""
        tmp = root / f".tmp-step-{step:08d}"
        if self.config.async_mode == "process" and multiprocessing.current_process().daemon:
            raise checkpoint.CheckpointError(
                "checkpoint.async_mode='process' starts a writer process from each rank, but these ranks are "
                "daemonic processes, which may not have children (fivecut.launch.spawn's); use 'thread', or torchrun"
            )
        with checkpoint.collectives(f"save of step {step}"), checkpoint.unwritable(root, step):
            checkpoint.agree(checkpoint.rank_zero(lambda: checkpoint.fresh_folder(tmp)))
            table = checkpoint.state_table(par, optimizer)
            moe = checkpoint.moe_state(par)  # as staged: the EPLB window and placement of this step
            if torch.cuda.is_available():
                torch.cuda.synchronize()  # the step's kernels done before the stager's stream reads the state
            response = dcp.async_save(
                {CHUNKS: chunk_views(table)},  # one entry: DCP wraps each top-level entry in its logger
                storage_writer=dcp.FileSystemWriter(str(tmp)),
                planner=StagedPlanner(table),
                process_group=self.checkpoint_group(),
                async_checkpointer_type=WRITERS[self.config.async_mode],
                async_stager=self.stager_for(),
            )
        begun, staging = time.perf_counter() - started, response.staging_completion
        hashed = checksums_after(response.upload_completion, tmp, self.config.verify)
        flight = InFlight(step, root, meta | {"step": step}, moe, hashed, staging, started, begun, begun)
        staging.add_done_callback(flight.copied)
        self.in_flight = flight

    def before_update(self) -> None:
        """(every step, before anything mutates the training state in place: the MoE balancing
        biases, EPLB's moves, the optimizer step and ZeRO's gathers after it) Wait until the save in
        flight holds its copy of the state. A copy that failed fails the save at its end."""
        flight = self.in_flight
        if flight is None or flight.staging_wait is not None:
            return
        waiting = time.perf_counter()
        futures.wait([flight.staging])
        flight.staging_wait = time.perf_counter() - waiting
        flight.blocking += flight.staging_wait

    def writing(self) -> bool:
        """Whether this rank's writer is still writing (the step's control all-reduce shares it)."""
        return self.in_flight is not None and not self.in_flight.hashed.done()

    def finish(self) -> None:
        """(every rank) Wait for the save in flight, then check, record and rename it as a blocking save does."""
        flight, self.in_flight = self.in_flight, None
        if flight is None:
            return
        waiting = time.perf_counter()
        self.guarded(flight.step, lambda: self.complete(flight))
        self.record(flight, flight.blocking + time.perf_counter() - waiting)

    def complete(self, flight: InFlight) -> None:
        final = checkpoint.step_dir(flight.root, flight.step)
        with checkpoint.collectives(f"save of step {flight.step}"), checkpoint.removed_if_failed(flight.tmp), \
                checkpoint.unwritable(flight.root, flight.step):  # fmt: skip
            every = checkpoint.gathered(lambda: (*written_files(flight.hashed), flight.moe))
            problems = [problem for _, found, _ in every for problem in found]
            if problems:
                if any(problem.startswith(WRITER_FAILED) for problem in problems):
                    self.new_writers()
                raise checkpoint.SaveFailed(
                    f"the save of step {flight.step} failed ({problems[0]}); it was abandoned, the earlier "
                    "checkpoints are kept"
                )
            written = [(sums, moe) for sums, _, moe in every]
            checkpoint.agree(checkpoint.rank_zero(lambda: checkpoint.finish(flight.tmp, final, flight.meta, written)))
            if self.config.verify:  # every rank read its files back in the background: all intact
                checkpoint.agree(checkpoint.rank_zero(lambda: checkpoint.mark_verified(final)))
            checkpoint.agree(checkpoint.rank_zero(lambda: self.prune(flight.root)))

    def prune(self, root: Path) -> None:
        """(rank 0) The checkpoints `keep` lets go, renamed out of sight now (`checkpoint.hidden`) and
        deleted in a thread while training goes on (a deletion cut short: `checkpoint.clean_partial`)."""
        self.deleted()
        doomed = [checkpoint.hidden(old) for old in checkpoint.unkept(root, self.config.keep)]
        delete = lambda: [shutil.rmtree(old, ignore_errors=True) for old in doomed]  # noqa: E731
        self.deleting = threading.Thread(target=delete, name="fivecut-prune", daemon=True)
        self.deleting.start()

    def deleted(self) -> None:
        if self.deleting is not None:
            self.deleting.join()
            self.deleting = None

    def guarded(self, step: int, work: Callable[[], None]) -> None:
        """`work` (a save or its end); a failed save stops the run, or (on_error="continue") is said and recorded."""
        try:
            work()
        except checkpoint.SaveFailed as err:
            if self.failures is None:
                raise
            self.failures.failed(step, err)
            return
        if self.failures is not None and not (self.background and self.in_flight is not None):
            self.failures.saved()

    def record(self, flight: InFlight, blocking: float) -> None:
        total = time.perf_counter() - flight.started
        staging = None if flight.staged_at is None else flight.staged_at - flight.started
        times = {"async_mode": self.config.async_mode, "start_s": flight.start, "staging_s": staging}
        times |= {"staging_wait_s": flight.staging_wait or 0.0, "blocking_s": blocking, "total_s": total}
        times["staged_bytes"] = staged_bytes(self.stager_for())
        self.report(None, {"step": flight.step, "checkpoint": times})

    def stager_for(self) -> DefaultStager:
        if self.stager is None:
            gpu = torch.cuda.is_available()
            shared = self.config.async_mode == "process"
            self.stager = DefaultStager(StagingOptions(gpu, shared, True, gpu))  # pinned, shared, async, non-blocking
        return self.stager

    def checkpoint_group(self):
        """The gloo group of DCP's background collectives: every rank, made at the first save."""
        if self.group is None:
            self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=self.timeout))
        return self.group

    def new_writers(self) -> None:
        """After a writer failed (a writer process killed: its gloo group is broken on every rank),
        the next save starts new writer processes on every rank (DCP keeps one for the process's
        life, in `_async_process_executor._CHECKPOINT_PROCESS`, and would reuse the broken one)."""
        if self.config.async_mode == "process":
            process_executor._CHECKPOINT_PROCESS = None  # the old one is terminated as it is collected

    def close(self) -> None:
        """Finish the save in flight and the deletion of what it pruned, then free the stager's
        memory (the end of a run, or a stop)."""
        self.finish()
        self.deleted()
        if self.stager is not None:
            self.stager.close()
            self.stager = None


def staged_bytes(stager: DefaultStager) -> int:
    """The host memory DCP's stager holds: its copies of the state's storages, kept between saves
    (the stager's own record of them)."""
    return sum(copy.nbytes() for copy in stager._state_dict_stager._cached_storage_mapping.values())


def written_files(hashed: Future) -> tuple[dict, list[str]]:
    """(this rank's checksums, problems) of a background write; a writer that failed (a writer
    process killed, DCP's error from another rank) is a problem; a folder that cannot be written
    is raised (`checkpoint.unwritable` names it, on every rank)."""
    try:
        return hashed.result()
    except Exception as err:  # noqa: BLE001 -- any writer failure is this save's, said in its one line
        failures = err.failures.values() if isinstance(err, CheckpointException) else ()
        if isinstance(err, OSError) or any(isinstance(e, OSError) for e, _ in failures):
            raise
        return {}, [f"{WRITER_FAILED} on rank {dist.get_rank()}: {backend_reason(err)}"]


def checksums_after(upload: Future, tmp: Path, verify: bool) -> Future:
    """(the sha256 and size of this rank's files, what reading them back found wrong), computed in a
    thread of its own once DCP's writer (`upload`) is done (`verify`: each file read a second time
    against the first); its error, if it failed."""
    out: Future = Future()

    def run() -> None:
        try:
            upload.result()
            sums = checkpoint.own_checksums(tmp)
            found = [checkpoint.file_problem(tmp, name, record) for name, record in sums.items()] if verify else []
            out.set_result((sums, [problem for problem in found if problem is not None]))
        except BaseException as err:  # noqa: BLE001 -- handed to the training thread, which raises it
            out.set_exception(err)

    threading.Thread(target=run, name=f"fivecut-checksums-{tmp.name}", daemon=True).start()
    return out


def chunk_views(table: checkpoint.Table) -> dict[tuple[str, int], torch.Tensor]:
    """The state dict DCP's stager copies: chunk i of `table[key]` as (key, i)."""
    return {(key, i): chunk.view.detach() for key, entry in table.items() for i, chunk in enumerate(entry.chunks)}


def with_views(table: checkpoint.Table, views: dict[tuple[str, int], torch.Tensor]) -> checkpoint.Table:
    """`table` with chunk i of each key's view replaced by `views[(key, i)]`."""
    return {
        key: checkpoint.Entry(entry.shape, entry.dtype, [
            checkpoint.Chunk(chunk.offsets, views[(key, i)]) for i, chunk in enumerate(entry.chunks)
        ])
        for key, entry in table.items()
    }  # fmt: skip


class StagedPlanner(checkpoint.TableSavePlanner):
    """DCP's planner for `table`'s chunks as DCP's stager copied them: made on the chunks' shapes
    alone (meta tensors: no live state travels with it to a writer process); DCP's save hands it the
    staged state dict ({CHUNKS: {(key, i): copy}}) once the copy is complete."""

    def __init__(self, table: checkpoint.Table):
        shapes = {k: v.to("meta") for k, v in chunk_views(table).items()}
        super().__init__(with_views(table, shapes))

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
        super().set_up_planner(state_dict, storage_meta, is_coordinator)
        self.take(with_views(self.table, state_dict[CHUNKS]))
