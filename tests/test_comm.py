"""Collectives and autograd primitives on real gloo ranks, and the ledger record each one writes.

Every rank's inputs are a deterministic function of its rank (`data`, `weights`), so the
parent process computes the expected values and gradients by hand, single-process.
The ranks run everything in one spawn per world size and return what they saw.
"""

import pytest
import torch
from torch.testing import assert_close

from fivecut.launch import spawn
from fivecut.ledger import PHASES, Ledger, Record, Row, format_rows, ring_factor

# ---------------------------------------------------------------- inputs, known to every process


def data(rank: int, *shape: int, dtype=torch.float32) -> torch.Tensor:
    """Small exact floats that differ between ranks."""
    n = 1
    for s in shape:
        n *= s
    return (torch.arange(n, dtype=torch.float64).reshape(shape) + 100 * (rank + 1)).to(dtype)


def weights(rank: int, *shape: int) -> torch.Tensor:
    """Rank-dependent loss weights: loss_r = sum(weights(r) * y_r)."""
    n = 1
    for s in shape:
        n *= s
    return torch.arange(n, dtype=torch.float32).reshape(shape) * (rank + 2) - 3 * rank


# uneven all-to-all on 2 ranks: rank 0 keeps 1 row and sends 2, rank 1 sends 3 and keeps 1
IN_SPLITS = {0: [1, 2], 1: [3, 1]}
OUT_SPLITS = {0: [1, 3], 1: [2, 1]}


# the design's wire factors, written out here rather than taken from the code under test
WIRE = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "send": lambda n: 1.0,
    "recv": lambda n: 1.0,
}


def rec(op, cut, phase, n, elements, itemsize=4, step=0) -> Record:
    nbytes = elements * itemsize
    return Record(step, cut, op, phase, n, elements, nbytes, nbytes * WIRE[op](n))


# ---------------------------------------------------------------- what each rank runs


def two_rank_checks() -> dict:
    import torch.distributed as dist

    from fivecut import comm
    from fivecut.comm import Group

    r, n = dist.get_rank(), dist.get_world_size()
    ledger = Ledger()
    g = Group("tp", (0, 1), dist.group.WORLD, ledger)
    out: dict = {"rank": r, "world": n, "group_rank": g.rank, "global": [g.global_rank(i) for i in range(n)]}

    def take() -> list:
        records = list(ledger.records)
        ledger.records.clear()
        return records

    # ---- plain collectives
    x = data(r, 2, 3)
    ret = comm.all_reduce(x, g)
    out["all_reduce"] = (ret, x, take())

    x = data(r, 2, 3, dtype=torch.float64)
    with ledger.phase("optimizer"):
        comm.all_reduce(x, g, op=dist.ReduceOp.MAX)
    out["all_reduce_max_f64"] = (x, take())

    x = data(r, 4)
    work = comm.all_reduce(x, g, async_op=True)
    work.wait()
    out["all_reduce_async"] = (x, take())

    out["all_gather_0"] = (comm.all_gather(data(r, 2, 3), g, dim=0), take())
    out["all_gather_1"] = (comm.all_gather(data(r, 2, 3), g, dim=1), take())
    out["reduce_scatter_1"] = (comm.reduce_scatter(data(r, 3, 4), g, dim=1), take())
    out["reduce_scatter_0"] = (comm.reduce_scatter(data(r, 4, 3), g, dim=0), take())
    try:
        comm.reduce_scatter(data(r, 3, 3), g, dim=0)
        out["reduce_scatter_indivisible"] = None
    except ValueError as err:
        out["reduce_scatter_indivisible"] = (str(err), take())

    gathered = torch.empty(4, 3)
    comm.all_gather_into(gathered, data(r, 2, 3), g)
    out["all_gather_into"] = (gathered, take())
    scattered = torch.empty(2, 3)
    comm.reduce_scatter_into(scattered, data(r, 4, 3), g)
    out["reduce_scatter_into"] = (scattered, take())

    out["all_to_all_even"] = (comm.all_to_all_single(data(r, 4, 3), g), take())
    x = data(r, sum(IN_SPLITS[r]), 2)
    out["all_to_all_uneven"] = (comm.all_to_all_single(x, g, OUT_SPLITS[r], IN_SPLITS[r]), take())

    send, recv = data(r, 5), torch.empty(5)
    works = comm.batch_send_recv([(send, (g.rank + 1) % n)], [(recv, (g.rank - 1) % n)], g)
    for w in works:
        w.wait()
    out["send_recv"] = (recv, take())
    out["send_recv_nothing"] = (comm.batch_send_recv([], [], g), take())

    # ---- autograd primitives: forward under "forward", backward under "backward"
    def run(name, fn, x, wshape):
        x = x.clone().requires_grad_(True)
        y = fn(x)
        forward = take()
        with ledger.phase("backward"):
            (weights(r, *wshape) * y).sum().backward()
        out[name] = (y.detach(), x.grad, forward, take())

    run("copy_to", lambda x: comm.copy_to(x, g), data(0, 2, 3), (2, 3))
    run("reduce_from", lambda x: comm.reduce_from(x, g), data(r, 2, 3), (2, 3))
    run("scatter_along", lambda x: comm.scatter_along(x, 1, g), data(0, 2, 4), (2, 2))
    run("gather_along", lambda x: comm.gather_along(x, 1, g), data(r, 2, 2), (2, 4))
    run("gather_along_reduce", lambda x: comm.gather_along(x, 1, g, grad_reduce=True), data(r, 2, 2), (2, 4))
    run("reduce_scatter_along", lambda x: comm.reduce_scatter_along(x, 0, g), data(r, 4, 3), (2, 3))
    run("all_to_all", lambda x: comm.all_to_all(x, g), data(r, 4, 2), (4, 2))
    rows = sum(OUT_SPLITS[r])
    run(
        "all_to_all_uneven_grad",
        lambda x: comm.all_to_all(x, g, OUT_SPLITS[r], IN_SPLITS[r]),
        data(r, sum(IN_SPLITS[r]), 2),
        (rows, 2),
    )

    # ---- a one-rank group communicates nothing and records nothing
    solo = Group("pp", (r,), None, ledger)
    x = data(r, 2, 4)
    same = [
        comm.all_reduce(x, solo) is None,
        comm.all_gather(x, solo, 1) is x,
        comm.reduce_scatter(x, solo, 1) is x,
        comm.all_to_all_single(x, solo) is x,
        comm.copy_to(x, solo) is x,
        comm.reduce_from(x, solo) is x,
        comm.scatter_along(x, 1, solo) is x,
        comm.gather_along(x, 1, solo, grad_reduce=True) is x,
        comm.reduce_scatter_along(x, 1, solo) is x,
        comm.all_to_all(x, solo) is x,
    ]
    copied = torch.empty(2, 4)
    comm.all_gather_into(copied, x, solo)
    comm.reduce_scatter_into(copied, x, solo)
    out["solo"] = (same, solo.size, solo.rank, torch.equal(x, data(r, 2, 4)), torch.equal(copied, x), take())
    return out


def four_rank_checks() -> dict:
    import torch.distributed as dist

    from fivecut import comm
    from fivecut.comm import Group

    r, n = dist.get_rank(), dist.get_world_size()
    ledger = Ledger()
    g = Group("ep", (0, 1, 2, 3), dist.group.WORLD, ledger)
    out: dict = {}

    def take() -> list:
        records = list(ledger.records)
        ledger.records.clear()
        return records

    x = data(r, 3)
    comm.all_reduce(x, g)
    out["all_reduce"] = (x, take())
    out["all_gather"] = (comm.all_gather(data(r, 2, 2), g, dim=1), take())
    out["reduce_scatter"] = (comm.reduce_scatter(data(r, 8), g), take())
    # rank r sends j+1 rows... to rank j: splits differ per rank and per peer
    in_splits = [(r + j) % 3 + 1 for j in range(n)]
    out_splits = [(j + r) % 3 + 1 for j in range(n)]  # what rank j sends to me
    x = data(r, sum(in_splits), 2)
    out["all_to_all"] = (comm.all_to_all_single(x, g, out_splits, in_splits), in_splits, take())

    # ring exchange over the world
    recv = torch.empty(3)
    for w in comm.batch_send_recv([(data(r, 3), (r + 1) % n)], [(recv, (r - 1) % n)], g):
        w.wait()
    out["ring"] = (recv, take())

    # point-to-point in a subgroup: peers are group ranks, translated to global ranks
    pairs = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    ranks = (0, 2) if r % 2 == 0 else (1, 3)
    sub = Group("pp", ranks, pairs[r % 2], ledger)
    recv = torch.empty(2)
    other = 1 - sub.rank
    for w in comm.batch_send_recv([(data(r, 2), other)], [(recv, other)], sub):
        w.wait()
    out["pair"] = (sub.rank, recv, take())
    y = comm.all_gather(data(r, 2), sub)
    out["pair_gather"] = (y, take())
    return out


# ---------------------------------------------------------------- world 2


@pytest.fixture(scope="module")
def two():
    return spawn(two_rank_checks, 2, timeout_s=120)


@pytest.mark.multirank
def test_group_rank_and_global_rank(two):
    for r, res in enumerate(two):
        assert res["rank"] == r and res["world"] == 2
        assert res["group_rank"] == r and res["global"] == [0, 1]


@pytest.mark.multirank
def test_all_reduce(two):
    total = data(0, 2, 3) + data(1, 2, 3)
    for res in two:
        ret, x, records = res["all_reduce"]
        assert ret is None
        assert_close(x, total)
        # 6 fp32 elements, ring all-reduce puts 2(n-1)/n = 1 x 24 bytes on the wire
        assert records == [Record(0, "tp", "all_reduce", "forward", 2, 6, 24, 24.0)]


@pytest.mark.multirank
def test_all_reduce_max_fp64_optimizer_phase(two):
    for res in two:
        x, records = res["all_reduce_max_f64"]
        assert x.dtype == torch.float64
        assert_close(x, data(1, 2, 3, dtype=torch.float64))
        assert records == [Record(0, "tp", "all_reduce", "optimizer", 2, 6, 48, 48.0)]


@pytest.mark.multirank
def test_all_reduce_async(two):
    for res in two:
        x, records = res["all_reduce_async"]
        assert_close(x, data(0, 4) + data(1, 4))
        assert records == [rec("all_reduce", "tp", "forward", 2, 4)]


@pytest.mark.multirank
@pytest.mark.parametrize("dim", [0, 1])
def test_all_gather(two, dim):
    expected = torch.cat([data(0, 2, 3), data(1, 2, 3)], dim=dim)
    for res in two:
        y, records = res[f"all_gather_{dim}"]
        assert_close(y, expected)
        # elements of the gathered tensor (12), wire (n-1)/n of its 48 bytes
        assert records == [Record(0, "tp", "all_gather", "forward", 2, 12, 48, 24.0)]


@pytest.mark.multirank
@pytest.mark.parametrize("dim", [0, 1])
def test_reduce_scatter(two, dim):
    shape = (3, 4) if dim == 1 else (4, 3)
    total = data(0, *shape) + data(1, *shape)
    for r, res in enumerate(two):
        y, records = res[f"reduce_scatter_{dim}"]
        assert_close(y, total.chunk(2, dim=dim)[r])
        # elements of the unreduced input (12), wire (n-1)/n of its 48 bytes
        assert records == [Record(0, "tp", "reduce_scatter", "forward", 2, 12, 48, 24.0)]


@pytest.mark.multirank
def test_reduce_scatter_indivisible(two):
    for res in two:
        message, records = res["reduce_scatter_indivisible"]
        assert "size 3" in message and "group size 2" in message
        assert records == []


@pytest.mark.multirank
def test_into_variants(two):
    for r, res in enumerate(two):
        gathered, records = res["all_gather_into"]
        assert_close(gathered, torch.cat([data(0, 2, 3), data(1, 2, 3)]))
        assert records == [rec("all_gather", "tp", "forward", 2, 12)]
        scattered, records = res["reduce_scatter_into"]
        assert_close(scattered, (data(0, 4, 3) + data(1, 4, 3))[2 * r : 2 * r + 2])
        assert records == [rec("reduce_scatter", "tp", "forward", 2, 12)]


@pytest.mark.multirank
def test_all_to_all_even(two):
    for r, res in enumerate(two):
        y, records = res["all_to_all_even"]
        # block r of every rank's input, in source-rank order
        assert_close(y, torch.cat([data(0, 4, 3)[2 * r : 2 * r + 2], data(1, 4, 3)[2 * r : 2 * r + 2]]))
        # 12 elements; 2 of the 4 rows (24 bytes) go to the other rank
        assert records == [Record(0, "tp", "all_to_all", "forward", 2, 12, 48, 24.0)]


@pytest.mark.multirank
def test_all_to_all_uneven(two):
    x0, x1 = data(0, 3, 2), data(1, 4, 2)
    expected = {0: torch.cat([x0[:1], x1[:3]]), 1: torch.cat([x0[1:], x1[3:]])}
    for r, res in enumerate(two):
        y, records = res["all_to_all_uneven"]
        assert_close(y, expected[r])
        rows, sent = sum(IN_SPLITS[r]), IN_SPLITS[r][1 - r]
        # wire = bytes sent to the other rank only: 2 rows from rank 0, 3 rows from rank 1 (8 bytes a row)
        assert records == [Record(0, "tp", "all_to_all", "forward", 2, rows * 2, rows * 8, sent * 8)]


@pytest.mark.multirank
def test_send_recv_ring(two):
    for r, res in enumerate(two):
        recv, records = res["send_recv"]
        assert_close(recv, data(1 - r, 5))
        assert records == [
            Record(0, "tp", "send", "forward", 2, 5, 20, 20.0),
            Record(0, "tp", "recv", "forward", 2, 5, 20, 20.0),
        ]
        assert res["send_recv_nothing"] == ([], [])


# ---- autograd primitives: forward value, gradient of sum_r sum(weights(r) * y_r), ledger


def check_primitive(two, name, expected_y, expected_grad, forward_ops, backward_ops, elements):
    for r, res in enumerate(two):
        y, grad, forward, backward = res[name]
        assert_close(y, expected_y(r))
        assert_close(grad, expected_grad(r))
        assert [(x.op, x.phase, x.elements, x.cut) for x in forward] == [
            (op, "forward", elements, "tp") for op in forward_ops
        ]
        assert [(x.op, x.phase, x.elements, x.cut) for x in backward] == [
            (op, "backward", elements, "tp") for op in backward_ops
        ]


@pytest.mark.multirank
def test_copy_to(two):
    # f: identity forward; the gradient of the replicated input is the sum over ranks
    check_primitive(
        two, "copy_to",
        expected_y=lambda r: data(0, 2, 3),
        expected_grad=lambda r: weights(0, 2, 3) + weights(1, 2, 3),
        forward_ops=[], backward_ops=["all_reduce"], elements=6,
    )  # fmt: skip


@pytest.mark.multirank
def test_reduce_from(two):
    # g: all-reduce forward, identity backward
    check_primitive(
        two, "reduce_from",
        expected_y=lambda r: data(0, 2, 3) + data(1, 2, 3),
        expected_grad=lambda r: weights(r, 2, 3),
        forward_ops=["all_reduce"], backward_ops=[], elements=6,
    )  # fmt: skip


@pytest.mark.multirank
def test_scatter_along(two):
    # keep my columns; the gradient of the full input gathers every rank's slice gradient
    check_primitive(
        two, "scatter_along",
        expected_y=lambda r: data(0, 2, 4)[:, 2 * r : 2 * r + 2],
        expected_grad=lambda r: torch.cat([weights(0, 2, 2), weights(1, 2, 2)], dim=1),
        forward_ops=[], backward_ops=["all_gather"], elements=8,
    )  # fmt: skip


@pytest.mark.multirank
def test_gather_along(two):
    # gather forward; the backward keeps my slice of my own gradient (replicated downstream)
    full = torch.cat([data(0, 2, 2), data(1, 2, 2)], dim=1)
    check_primitive(
        two, "gather_along",
        expected_y=lambda r: full,
        expected_grad=lambda r: weights(r, 2, 4)[:, 2 * r : 2 * r + 2],
        forward_ops=["all_gather"], backward_ops=[], elements=8,
    )  # fmt: skip


@pytest.mark.multirank
def test_gather_along_grad_reduce(two):
    # sequence parallel: the backward reduce-scatters, so my slice gets every rank's gradient
    full = torch.cat([data(0, 2, 2), data(1, 2, 2)], dim=1)
    check_primitive(
        two, "gather_along_reduce",
        expected_y=lambda r: full,
        expected_grad=lambda r: (weights(0, 2, 4) + weights(1, 2, 4))[:, 2 * r : 2 * r + 2],
        forward_ops=["all_gather"], backward_ops=["reduce_scatter"], elements=8,
    )  # fmt: skip


@pytest.mark.multirank
def test_reduce_scatter_along(two):
    total = data(0, 4, 3) + data(1, 4, 3)
    check_primitive(
        two, "reduce_scatter_along",
        expected_y=lambda r: total[2 * r : 2 * r + 2],
        expected_grad=lambda r: torch.cat([weights(0, 2, 3), weights(1, 2, 3)], dim=0),
        forward_ops=["reduce_scatter"], backward_ops=["all_gather"], elements=12,
    )  # fmt: skip


@pytest.mark.multirank
def test_all_to_all_autograd(two):
    # block j of my input went to rank j as its block r: its gradient comes back from there
    check_primitive(
        two, "all_to_all",
        expected_y=lambda r: torch.cat([data(0, 4, 2)[2 * r : 2 * r + 2], data(1, 4, 2)[2 * r : 2 * r + 2]]),
        expected_grad=lambda r: torch.cat([weights(0, 4, 2)[2 * r : 2 * r + 2], weights(1, 4, 2)[2 * r : 2 * r + 2]]),
        forward_ops=["all_to_all"], backward_ops=["all_to_all"], elements=8,
    )  # fmt: skip


@pytest.mark.multirank
def test_all_to_all_autograd_uneven(two):
    x0, x1 = data(0, 3, 2), data(1, 4, 2)
    w0, w1 = weights(0, 4, 2), weights(1, 3, 2)  # y_0 has 1 + 3 rows, y_1 has 2 + 1
    y = {0: torch.cat([x0[:1], x1[:3]]), 1: torch.cat([x0[1:], x1[3:]])}
    grad = {0: torch.cat([w0[:1], w1[:2]]), 1: torch.cat([w0[1:], w1[2:]])}
    for r, res in enumerate(two):
        got_y, got_grad, forward, backward = res["all_to_all_uneven_grad"]
        assert_close(got_y, y[r])
        assert_close(got_grad, grad[r])
        # forward sends IN_SPLITS[r][other] rows away; backward sends back what arrived from the other
        other = 1 - r
        assert [(x.op, x.phase, x.wire_bytes) for x in forward] == [("all_to_all", "forward", IN_SPLITS[r][other] * 8)]
        assert [(x.op, x.phase, x.wire_bytes, x.elements) for x in backward] == [
            ("all_to_all", "backward", OUT_SPLITS[r][other] * 8, sum(OUT_SPLITS[r]) * 2)
        ]


@pytest.mark.multirank
def test_one_rank_group_records_nothing(two):
    for res in two:
        same, size, group_rank, untouched, copied, records = res["solo"]
        assert all(same), same
        assert size == 1 and group_rank == 0
        assert untouched and copied
        assert records == []


# ---------------------------------------------------------------- world 4


@pytest.mark.multirank
def test_four_ranks():
    results = spawn(four_rank_checks, 4, timeout_s=120)
    n = 4
    for r, res in enumerate(results):
        x, records = res["all_reduce"]
        assert_close(x, sum(data(i, 3) for i in range(n)))
        assert records == [Record(0, "ep", "all_reduce", "forward", 4, 3, 12, 12 * 2 * 3 / 4)]

        y, records = res["all_gather"]
        assert_close(y, torch.cat([data(i, 2, 2) for i in range(n)], dim=1))
        assert records == [Record(0, "ep", "all_gather", "forward", 4, 16, 64, 64 * 3 / 4)]

        y, records = res["reduce_scatter"]
        assert_close(y, sum(data(i, 8) for i in range(n))[2 * r : 2 * r + 2])
        assert records == [Record(0, "ep", "reduce_scatter", "forward", 4, 8, 32, 32 * 3 / 4)]

        y, in_splits, records = res["all_to_all"]
        expected = []
        for src in range(n):
            splits = [(src + j) % 3 + 1 for j in range(n)]
            start = sum(splits[:r])
            expected.append(data(src, sum(splits), 2)[start : start + splits[r]])
        assert_close(y, torch.cat(expected))
        rows = sum(in_splits)
        assert records == [Record(0, "ep", "all_to_all", "forward", 4, rows * 2, rows * 8, (rows - in_splits[r]) * 8)]

        recv, records = res["ring"]
        assert_close(recv, data((r - 1) % n, 3))
        assert records == [rec("send", "ep", "forward", 4, 3), rec("recv", "ep", "forward", 4, 3)]

        sub_rank, recv, records = res["pair"]
        partner = (r + 2) % n
        assert sub_rank == r // 2
        assert_close(recv, data(partner, 2))
        assert records == [rec("send", "pp", "forward", 2, 2), rec("recv", "pp", "forward", 2, 2)]
        y, records = res["pair_gather"]
        assert_close(y, torch.cat([data(r % 2, 2), data(r % 2 + 2, 2)]))
        assert records == [rec("all_gather", "pp", "forward", 2, 4)]


# ---------------------------------------------------------------- ledger, single process


def test_ring_factor():
    assert ring_factor("all_reduce", 2) == 1.0
    assert ring_factor("all_reduce", 4) == 1.5
    assert ring_factor("all_reduce", 8) == 2 * 7 / 8
    for op in ("all_gather", "reduce_scatter", "all_to_all"):
        assert ring_factor(op, 2) == 0.5 and ring_factor(op, 4) == 0.75
    assert ring_factor("send", 8) == 1.0 and ring_factor("recv", 2) == 1.0
    assert ring_factor("all_reduce", 1) == 0.0 and ring_factor("all_gather", 1) == 0.0
    with pytest.raises(ValueError, match="broadcast"):
        ring_factor("broadcast", 4)


def test_ledger_record_and_rows():
    ledger = Ledger()
    ledger.begin_step(3)
    ledger.record("all_reduce", "dp", 4, 100, 4)
    with ledger.phase("backward"):
        ledger.record("all_reduce", "dp", 4, 50, 4)
        ledger.record("all_gather", "tp", 2, 10, 2)
        with ledger.phase("optimizer"):
            ledger.record("all_reduce", "dp", 4, 1, 4)
        assert ledger.current_phase == "backward"  # restored after the inner phase
        ledger.record("all_reduce", "dp", 4, 30, 4)
    ledger.record("all_to_all", "ep", 2, 8, 4, wire_bytes=12.0)
    assert ledger.current_phase == "forward"

    first = ledger.records[0]
    assert first == Record(3, "dp", "all_reduce", "forward", 4, 100, 400, 600.0)

    rows = ledger.rows()
    assert rows == [
        Row("dp", "all_reduce", "forward", calls=1, elements=100, bytes=400, wire_bytes=600.0),
        Row("dp", "all_reduce", "backward", calls=2, elements=80, bytes=320, wire_bytes=480.0),
        Row("tp", "all_gather", "backward", calls=1, elements=10, bytes=20, wire_bytes=10.0),
        Row("dp", "all_reduce", "optimizer", calls=1, elements=1, bytes=4, wire_bytes=6.0),
        Row("ep", "all_to_all", "forward", calls=1, elements=8, bytes=32, wire_bytes=12.0),
    ]
    assert ledger.rows("tp") == [rows[2]]
    assert ledger.rows("nope") == []

    assert ledger.wire_bytes() == 600 + 480 + 10 + 6 + 12
    assert ledger.wire_bytes(cut="dp") == 1086.0
    assert ledger.wire_bytes(cut="dp", phase="backward") == 480.0
    assert ledger.wire_bytes(op="all_gather") == 10.0
    assert ledger.by_cut() == {"dp": 1086.0, "tp": 10.0, "ep": 12.0}

    table = ledger.table()
    assert table == format_rows(rows)
    lines = table.splitlines()
    assert len(lines) == 2 + len(rows) and "wire bytes/rank" in lines[0]
    assert "all_reduce" in lines[3] and "backward" in lines[3] and lines[3].rstrip().endswith("480")


def test_begin_step_clears_records():
    ledger = Ledger()
    ledger.record("send", "pp", 2, 4, 4)
    assert len(ledger.records) == 1 and ledger.records[0].step == 0
    ledger.begin_step(1)
    assert ledger.records == [] and ledger.rows() == [] and ledger.wire_bytes() == 0
    ledger.record("recv", "pp", 2, 4, 4)
    assert [r.step for r in ledger.records] == [1]


def test_unknown_phase():
    ledger = Ledger()
    with pytest.raises(ValueError, match="unknown phase 'bwd'"):
        with ledger.phase("bwd"):
            pass
    assert ledger.current_phase == "forward"
    assert set(PHASES) >= {"forward", "backward", "optimizer"}


def test_phase_restored_after_exception():
    ledger = Ledger()
    with pytest.raises(RuntimeError):
        with ledger.phase("optimizer"):
            raise RuntimeError("boom")
    assert ledger.current_phase == "forward"
