"""The spawn harness: results in rank order, a rank that raises or dies, a rank that hangs."""

import os
import time

import pytest
import torch

from fivecut.launch import RankFailure, backend_for, device_type, spawn


def whoami(tag, payload):
    """Each rank reports what it knows; rank 0 finishes last, so arrival order is not rank order."""
    import torch.distributed as dist

    from fivecut.launch import init_from_environment

    rank = dist.get_rank()
    init_from_environment()  # already initialized by spawn: must be a no-op
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    if rank == 0:
        time.sleep(1.0)
    return {
        "tag": tag,
        "rank": rank,
        "world": dist.get_world_size(),
        "backend": dist.get_backend(),
        "threads": torch.get_num_threads(),
        "pid": os.getpid(),
        "sum": t.item(),
        "tensor": payload * (rank + 1),  # tensors come back by value, after the process is gone
    }


@pytest.mark.multirank
def test_results_in_rank_order():
    payload = torch.arange(4.0)
    results = spawn(whoami, 3, "hello", payload, timeout_s=120)
    assert [r["rank"] for r in results] == [0, 1, 2]
    for rank, r in enumerate(results):
        assert r["tag"] == "hello" and r["world"] == 3 and r["backend"] == "gloo"
        assert r["threads"] == 1
        assert r["sum"] == 6.0
        assert torch.equal(r["tensor"], payload * (rank + 1))
    pids = {r["pid"] for r in results}
    assert len(pids) == 3 and os.getpid() not in pids


def explode_in_rank_one():
    """Rank 1 raises; rank 2 vanishes without a traceback; rank 0 waits in a collective for them."""
    import torch.distributed as dist

    from fivecut import comm
    from fivecut.ledger import Ledger

    rank = dist.get_rank()
    if rank == 1:
        raise ValueError("rank one exploded with code 4242")
    if rank == 2:
        os._exit(3)
    comm.all_reduce(torch.ones(1), comm.Group("dp", (0, 1, 2), dist.group.WORLD, Ledger()))
    return "unreachable"


@pytest.mark.multirank
def test_a_rank_that_raises_or_dies():
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        spawn(explode_in_rank_one, 3, timeout_s=120)
    elapsed = time.monotonic() - start
    msg = str(info.value)
    # rank 1: its exception and the traceback through the test function
    assert "--- rank 1 raised:" in msg
    assert "ValueError: rank one exploded with code 4242" in msg
    assert "Traceback (most recent call last)" in msg and "explode_in_rank_one" in msg
    # rank 2: no traceback, but its exit code
    assert "rank 2 died: exit code 3" in msg
    # rank 0 never got its all_reduce: either it failed when its peers vanished, or it was killed
    assert "--- rank 0 raised:" in msg or "--- rank 0 did not finish" in msg
    if "--- rank 0 raised:" in msg:  # the failed collective is named: rank, op, cut, group
        assert "CollectiveError: rank 0: all_reduce on the dp group (ranks [0, 1, 2]) failed" in msg
    assert "unreachable" not in msg
    # not the 120 s timeout: a failed rank ends the run after a short grace
    assert elapsed < 60, elapsed


def stuck_forever_here():
    time.sleep(600)


def hang_in_rank_one():
    """Rank 1 never joins rank 0's all_reduce."""
    import torch.distributed as dist

    if dist.get_rank() == 1:
        stuck_forever_here()
    dist.all_reduce(torch.ones(1))


@pytest.mark.multirank
def test_a_rank_that_hangs_is_reported_with_its_stack():
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        spawn(hang_in_rank_one, 2, timeout_s=8)
    elapsed = time.monotonic() - start
    msg = str(info.value)
    assert "--- rank 1 did not finish within 8s; its stack:" in msg
    rank1 = msg.split("--- rank 1", 1)[1]
    # faulthandler's dump of the stuck rank: the function it sleeps in, and who called it
    assert "stuck_forever_here" in rank1 and "hang_in_rank_one" in rank1
    assert "(not dumped)" not in rank1
    # rank 0 is stuck in (or timed out of) the collective rank 1 never joined
    assert "--- rank 0" in msg
    rank0 = msg.split("--- rank 0", 1)[1].split("--- rank 1", 1)[0]
    assert "hang_in_rank_one" in rank0 and "all_reduce" in rank0
    assert elapsed < 60, elapsed  # the timeout is honoured, the hang is not waited out


def test_backend_and_device_type():
    assert backend_for("cuda") == "nccl"
    assert backend_for("cpu") == "gloo"
    assert device_type() == ("cuda" if torch.cuda.is_available() else "cpu")


def test_rank_failure_is_a_runtime_error():
    assert issubclass(RankFailure, RuntimeError)
