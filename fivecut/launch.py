"""Starting ranks: under torchrun, alone, or spawned here for `verify`, `ledger` and the tests.

`spawn(fn, world_size, *args, device=...)` starts one process per rank from a fork server
(gloo on CPU; NCCL with a GPU per rank on CUDA, see `choose_backend`), one thread each, which
rendezvous through a FileStore in a private temporary folder (no ports, no retries). Each rank
answers through that folder too: its pickled result or traceback goes into a file renamed into
place when whole, so the parent never reads a half-written answer and never waits on a pipe.
The parent polls for those files and for the ranks' lives until a deadline. It returns every
rank's result, or raises `RankFailure`: each rank that raised with its traceback, each that died
without answering with its exit code or signal, and each still running at the deadline with
its stack (faulthandler dumps it into a file the parent reads) before it is killed.
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import signal
import tempfile
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import wait
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

DEVICES = ("auto", "cpu", "cuda")
FAILURE_GRACE_S = 10.0  # after one rank failed, how long the others may take to end too
POLL_S = 0.02  # how often the parent looks for answers


def backend_for(device_type: str) -> str:
    return "nccl" if device_type == "cuda" else "gloo"


def device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def choose_backend(device: str, world_size: int, device_count: int) -> tuple[str, str]:
    """(backend, device type) for `world_size` ranks on one machine with `device_count` GPUs.

    "cpu": gloo. "cuda": NCCL, one GPU per rank; NCCL refuses two ranks of one communicator on
    the same GPU, so more ranks than GPUs is an error (gloo could not serve the cuts either: it
    lacks CUDA send/recv, all-gather, reduce-scatter and all-to-all). "auto": cuda when every rank
    gets a GPU of its own, else cpu."""
    if device not in DEVICES:
        raise ValueError(f"device={device!r}; choose one of {', '.join(DEVICES)}")
    if device == "auto":
        device = "cuda" if 0 < world_size <= device_count else "cpu"
    if device == "cuda" and world_size > device_count:
        raise ValueError(
            f"{world_size} ranks on {device_count} GPU(s): NCCL needs a GPU per rank; use fewer ranks, "
            + "a machine with more GPUs, or device='cpu' (gloo)"
        )
    return backend_for(device), device


def rank_device(device: str, rank: int, device_count: int) -> torch.device:
    """The device of spawned rank `rank`: its own GPU (rank % device_count), or the cpu."""
    return torch.device("cuda", rank % device_count) if device == "cuda" else torch.device("cpu")


def local_device() -> torch.device:
    """This rank's device, as its launcher set it: under NCCL the GPU made current before the
    process group was formed (spawn: the rank's own; torchrun: LOCAL_RANK's), else the cpu."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def attempt_store(rank: int, world: int, timeout: timedelta) -> dist.Store:
    """The job's TCPStore (torchrun's agent hosts it; other launchers: rank 0), its keys prefixed by
    torchrun's restart count. Without the prefix, the ranks restarted after a failure read the
    addresses the previous attempt's ranks published and gloo cannot connect (torch 2.13)."""
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    store = dist.TCPStore(address, port, world, is_master=not agent and rank == 0, timeout=timeout)
    return dist.PrefixStore(f"fivecut/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def init_from_environment(timeout_s: float = 300.0) -> None:
    """Join the job torchrun describes (RANK, WORLD_SIZE, MASTER_ADDR...), or form a one-rank job;
    a collective waits at most `timeout_s` seconds (`train.collective_timeout`)."""
    if dist.is_initialized():
        return
    backend = backend_for(device_type())
    timeout = timedelta(seconds=timeout_s)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        if backend == "nccl":  # torchrun's LOCAL_RANK, never the global rank (multi-node)
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        store = attempt_store(rank, world, timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)


@dataclass(frozen=True)
class Ended:
    """How one spawned rank ended. `how`: "ok" (`detail` is fn's result), "raised" (its traceback;
    `line`: the exception in one line), "died" without a result (`line`: its exit code or signal)
    or "stuck" past the deadline (`detail`: its stack as faulthandler dumped it)."""

    how: str
    detail: object = None
    line: str = ""


class RankFailure(RuntimeError):
    """One or more spawned ranks failed or hung. The first line of the message, `summary`, names
    the failing ranks and what happened to them (the first to fail first); the lines after it hold
    each one's traceback, exit code or stack."""

    @property
    def summary(self) -> str:
        return str(self).split("\n", 1)[0]


def spawn(
    fn,
    world_size: int,
    *args,
    timeout_s: float = 300.0,
    collective_timeout_s: float | None = None,
    device: str = "auto",
) -> list:
    """Run `fn(*args)` on `world_size` ranks on this machine; return the results by rank. The whole
    run may take `timeout_s` (plus a few seconds to dump stacks and stop the ranks); one collective
    `collective_timeout_s` (default: the same). `device` picks the backend and each rank's device
    (`choose_backend`); `local_device()` in each rank then names that device."""
    placement = choose_backend(device, world_size, torch.cuda.device_count() if torch.cuda.is_available() else 0)
    per_collective = timeout_s if collective_timeout_s is None else collective_timeout_s
    with tempfile.TemporaryDirectory(prefix="fivecut-") as tmp:
        procs, ended = [], {}
        try:
            for rank in range(world_size):
                procs.append(_start_rank(rank, (world_size, tmp, per_collective, placement, fn, args)))
            ended = _collect(procs, Path(tmp), timeout_s)
        finally:
            _stop(procs, ended)
        return _finish(ended, timeout_s)


def rank_context():
    """Ranks start from a fork server that has imported torch and fivecut once (a fresh process
    each, no state of this one: CUDA untouched, no threads), not from a bare interpreter that
    imports torch again for every rank: a spawned world of two starts in ~1 s instead of ~8.
    torch._dynamo is preloaded too: `fivecut.comm` marks its collectives opaque to torch.compile,
    which imports it, and that import alone takes as long as torch's."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "fivecut.launch"])
    return ctx


def _start_rank(rank: int, common: tuple, attempts: int = 3):
    """Start rank `rank`. multiprocessing starts a new fork server when the last one died; one
    that dies while it is asked fails the start, which is tried again."""
    for attempt in range(attempts):
        proc = rank_context().Process(target=_rank_main, args=(rank, *common), daemon=True)
        try:
            proc.start()
            return proc
        except (OSError, EOFError) as err:
            if attempt == attempts - 1:
                raise RankFailure(
                    f"rank {rank} could not be started: the fork server failed ({_one_line(err)})"
                ) from err
            time.sleep(0.5)


def _rank_main(rank, world_size, folder, collective_timeout_s, placement, fn, args):
    torch.set_num_threads(1)
    folder = Path(folder)
    stack = open(folder / f"rank{rank}.stack", "w")
    faulthandler.register(signal.SIGUSR1, file=stack, all_threads=False)
    try:
        backend, device = placement
        if device == "cuda":  # before the group forms: NCCL binds this rank to the current GPU
            torch.cuda.set_device(rank_device(device, rank, torch.cuda.device_count()))
        store = dist.FileStore(str(folder / "store"), world_size)
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=collective_timeout_s)
        )
        _deliver(folder, rank, Ended("ok", fn(*args)))
    except BaseException as err:  # report everything, including KeyboardInterrupt, to the parent
        _deliver(folder, rank, Ended("raised", traceback.format_exc(), _one_line(err)))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _deliver(folder: Path, rank: int, ended: Ended) -> None:
    """Write this rank's answer where the parent looks for it, whole or not at all: pickled by
    value (tensors too) into a private file, then renamed into place."""
    part = folder / f"rank{rank}.part"
    with open(part, "wb") as f:
        pickle.dump(ended, f)
    os.replace(part, folder / f"rank{rank}.result")


def _read_answer(folder: Path, rank: int) -> Ended | None:
    path = folder / f"rank{rank}.result"
    if not path.exists():
        return None
    with open(path, "rb") as f:
        return pickle.load(f)


def _one_line(err: BaseException) -> str:
    """`ValueError: the first line of its message`."""
    lines = str(err).strip().splitlines()
    return type(err).__name__ + (f": {lines[0]}" if lines else "")


def _running(proc) -> bool:
    """Whether a rank's process still runs. When the fork server that forked it is gone, its
    `Process` says it ended with 255 while the rank itself may live on; then /proc says (a zombie
    has ended)."""
    if proc.exitcode is None:
        return True
    if proc.exitcode != 255:
        return False
    try:
        state = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def _collect(procs, folder: Path, timeout_s: float) -> dict[int, Ended]:
    """Each rank's answer as it comes, or its death without one, until every rank has ended, a
    short grace after the first failure, or the deadline; the ranks still running then are stuck."""
    ended: dict[int, Ended] = {}
    deadline = time.monotonic() + timeout_s
    while True:
        for rank, proc in enumerate(procs):
            if rank in ended:
                continue
            alive = _running(proc)  # before looking: a rank writes its answer, then exits
            answer = _read_answer(folder, rank)
            if answer is None and not alive:
                answer = Ended("died", None, _exit_words(proc.exitcode))
            if answer is not None:
                ended[rank] = answer
                if answer.how != "ok":
                    deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
        if len(ended) == len(procs) or time.monotonic() >= deadline:
            return ended | _stacks_of_stuck(procs, folder, ended)
        waiting = [p.sentinel for rank, p in enumerate(procs) if rank not in ended and p.exitcode is None]
        if waiting:  # wakes at once when one exits
            wait(waiting, timeout=POLL_S)
        else:  # no fork server to tell us: by /proc
            time.sleep(POLL_S)


def _exit_words(code: int | None) -> str:
    """`exit code 3`, or `killed by SIGKILL` for a negative code."""
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _stacks_of_stuck(procs, folder: Path, ended: dict[int, Ended]) -> dict[int, Ended]:
    """Every rank that has not ended writes its Python stack (SIGUSR1 -> faulthandler)."""
    stuck = {rank: folder / f"rank{rank}.stack" for rank in range(len(procs)) if rank not in ended}
    for rank in stuck:
        _signal(procs[rank], signal.SIGUSR1)
    limit = time.monotonic() + 2.0
    while stuck and time.monotonic() < limit and not all(f.exists() and f.stat().st_size for f in stuck.values()):
        time.sleep(POLL_S)
    if stuck:
        time.sleep(0.2)  # the rest of the dump
    return {rank: Ended("stuck", f.read_text() if f.exists() else "") for rank, f in stuck.items()}


def _signal(proc, signum: int) -> None:
    """Signal a rank by its pid: also one whose fork server is gone (`Process.kill` would not)."""
    if _running(proc):
        try:
            os.kill(proc.pid, signum)
        except ProcessLookupError:
            pass


def _stop(procs, ended: dict[int, Ended]) -> None:
    """Kill the stuck ranks (all, when collecting did not finish); the others get a few seconds
    to end by themselves first."""
    for rank, proc in enumerate(procs):
        if rank not in ended or ended[rank].how == "stuck":
            _signal(proc, signal.SIGKILL)
    limit = time.monotonic() + 5
    for proc in procs:
        proc.join(timeout=max(0.0, limit - time.monotonic()))
        _signal(proc, signal.SIGKILL)
        proc.join(timeout=1)


def _finish(ended: dict[int, Ended], timeout_s: float) -> list:
    """The results by rank, or a `RankFailure` naming the failed ranks in the order they failed."""
    if all(e.how == "ok" for e in ended.values()):
        return [ended[r].detail for r in range(len(ended))]
    failed = {r: _describe(r, e, timeout_s) for r, e in ended.items() if e.how != "ok"}
    by_what: dict[str, list[int]] = {}
    for r, (_, what) in failed.items():
        by_what.setdefault(what, []).append(r)
    summary = "; ".join(f"{_ranks_words(ranks)} {what}" for what, ranks in by_what.items())
    raise RankFailure("\n".join([summary, *(failed[r][0] for r in sorted(failed))]))


def _describe(rank: int, e: Ended, timeout_s: float) -> tuple[str, str]:
    """A failed rank's part of `str(RankFailure)`, and what happened to it in a few words."""
    if e.how == "raised":
        return f"--- rank {rank} raised:\n{e.detail}", f"raised {e.line}"
    if e.how == "died":
        return f"--- rank {rank} died: {e.line}, no traceback", f"died ({e.line}) before returning"
    stack = e.detail or "(not dumped)"
    return (
        f"--- rank {rank} did not finish within {timeout_s:.0f}s; its stack:\n{stack}",
        f"did not finish within {timeout_s:.0f} s",
    )


def _ranks_words(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, sorted(ranks)))
