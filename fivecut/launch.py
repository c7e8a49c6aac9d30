"""Starting ranks: under torchrun, alone, or spawned here for `verify`, `ledger` and the tests.

`spawn(fn, world_size, *args, device=...)` starts one process per rank with torch.multiprocessing
(gloo on CPU; NCCL with a GPU per rank on CUDA, see `choose_backend`),
rendezvous through a FileStore in a private temporary folder (no ports, no retries), one
thread per rank. It returns every rank's result, or raises `RankFailure` carrying each
rank's traceback: a rank that raised, and, on timeout, where each stuck rank was
(faulthandler dumps its stack into a file the parent reads).
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import queue
import signal
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class RankFailure(RuntimeError):
    """One or more spawned ranks failed or hung; the message holds each rank's traceback."""


DEVICES = ("auto", "cpu", "cuda")


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


def _rank_main(rank, world_size, store_path, trace_dir, collective_timeout_s, placement, fn, args, results):
    torch.set_num_threads(1)
    trace = open(Path(trace_dir) / f"rank{rank}.txt", "w")
    faulthandler.register(signal.SIGUSR1, file=trace, all_threads=False)
    try:
        backend, device = placement
        if device == "cuda":  # before the group forms: NCCL binds this rank to the current GPU
            torch.cuda.set_device(rank_device(device, rank, torch.cuda.device_count()))
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=collective_timeout_s)
        )
        # pickled here, in-band: tensors shared by file descriptor would vanish with this process
        results.put((rank, "ok", pickle.dumps(fn(*args))))
    except BaseException:  # report everything, including KeyboardInterrupt, to the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(
    fn,
    world_size: int,
    *args,
    timeout_s: float = 300.0,
    collective_timeout_s: float | None = None,
    device: str = "auto",
) -> list:
    """Run `fn(*args)` on `world_size` ranks on this machine; return the results by rank. The whole
    run may take `timeout_s`; one collective `collective_timeout_s` (default: the same). `device`
    picks the backend and each rank's device (`choose_backend`); `local_device()` in each rank then
    names that device."""
    placement = choose_backend(device, world_size, torch.cuda.device_count() if torch.cuda.is_available() else 0)
    ctx = rank_context()
    per_collective = timeout_s if collective_timeout_s is None else collective_timeout_s
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="fivecut-") as tmp:
        common = (world_size, f"{tmp}/store", tmp, per_collective, placement, fn, args, results)
        procs = [ctx.Process(target=_rank_main, args=(r, *common), daemon=True) for r in range(world_size)]
        for p in procs:
            p.start()
        outcome = _collect(results, procs, timeout_s)
        _dump_stuck_stacks(procs, outcome)
        for rank, p in enumerate(procs):
            if rank not in outcome and p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
        return _finish(outcome, world_size, Path(tmp), timeout_s)


def rank_context():
    """Ranks start from a fork server that has imported torch and fivecut once (a fresh process
    each, no state of this one: CUDA untouched, no threads), not from a bare interpreter that
    imports torch again for every rank: a spawned world of two starts in ~1 s instead of ~8."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "fivecut.launch"])
    return ctx


def _collect(results, procs, timeout_s: float) -> dict[int, tuple[str, object]]:
    """Gather results until all ranks answered, one failed (plus a short grace), or time ran out."""
    outcome: dict[int, tuple[str, object]] = {}
    deadline = time.monotonic() + timeout_s
    while len(outcome) < len(procs) and time.monotonic() < deadline:
        try:
            rank, status, value = results.get(timeout=0.5)
            outcome[rank] = (status, value)
            if status == "error":
                deadline = min(deadline, time.monotonic() + 10)
        except queue.Empty:
            dead = [i for i, p in enumerate(procs) if not p.is_alive() and i not in outcome]
            for i in dead:
                time.sleep(0.5)  # a result may still be in flight
                if i not in outcome and results.empty():
                    outcome[i] = ("died", f"exit code {procs[i].exitcode}, no traceback")
                    deadline = min(deadline, time.monotonic() + 10)
    return outcome


def _dump_stuck_stacks(procs, outcome) -> None:
    """Ask every rank that has not answered to write its Python stack (SIGUSR1 -> faulthandler)."""
    stuck = [p for rank, p in enumerate(procs) if rank not in outcome and p.is_alive()]
    for p in stuck:
        os.kill(p.pid, signal.SIGUSR1)
    if stuck:
        time.sleep(1.0)  # time to write the stacks


def _finish(outcome, world_size: int, trace_dir: Path, timeout_s: float) -> list:
    if len(outcome) == world_size and all(status == "ok" for status, _ in outcome.values()):
        return [pickle.loads(outcome[r][1]) for r in range(world_size)]
    parts = []
    for r in range(world_size):
        if r in outcome and outcome[r][0] == "error":
            parts.append(f"--- rank {r} raised:\n{outcome[r][1]}")
        elif r in outcome and outcome[r][0] == "died":
            parts.append(f"--- rank {r} died: {outcome[r][1]}")
        elif r not in outcome:
            stack = (trace_dir / f"rank{r}.txt").read_text() if (trace_dir / f"rank{r}.txt").exists() else ""
            parts.append(f"--- rank {r} did not finish within {timeout_s:.0f}s; its stack:\n{stack or '(not dumped)'}")
    raise RankFailure("\n".join(parts))
