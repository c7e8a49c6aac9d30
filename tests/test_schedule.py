"""Pipeline schedules as data: complete, causal, matched, deadlock-free, posted in NCCL's order; bubbles against
closed forms; the CLI."""

from __future__ import annotations

import dataclasses

import pytest

from fivecut.cli import main
from fivecut.model.presets import PRESETS
from fivecut.parallel.pipeline import streams
from fivecut.parallel.pipeline.draw import draw
from fivecut.parallel.pipeline.schedule import (
    RECEIVES,
    WINDOW,
    Action,
    ScheduleError,
    Slot,
    boundary_frontier,
    build_schedule,
    check,
    check_in_order,
    dualpipev,
    gpipe,
    interleaved,
    list_schedule,
    make,
    one_f_one_b,
    peak_in_flight,
    posting,
    unit_makespan,
    zb1p,
)
from fivecut.parallel.pipeline.simulate import simulate, text
from fivecut.plan.search import MICROBATCH_STEPS, MIN_STAGE, SCHEDULES

REL = 0.005  # closed forms must hold within 0.5%

LAYOUTS = [  # (name, pp, m, virtual)
    *[
        (name, pp, m, 1)
        for name in ("gpipe", "1f1b", "zb1p")
        for pp, m in [(1, 3), (2, 1), (2, 4), (3, 5), (4, 8), (4, 2), (8, 16)]
    ],
    *[("interleaved", pp, m, v) for pp, m, v in [(2, 4, 2), (4, 8, 2), (4, 8, 3), (3, 6, 4), (8, 16, 2)]],
    *[("dualpipev", pp, m, v) for pp, m, v in [(1, 2, 1), (2, 4, 1), (2, 4, 2), (3, 7, 1), (4, 8, 1), (8, 16, 1)]],
]


def bubble(name: str, pp: int, m: int, virtual: int = 1) -> float:
    return simulate(build_schedule(name, pp, m, virtual)).bubble


@pytest.mark.parametrize("name,pp,m,virtual", LAYOUTS)
def test_every_schedule_passes_the_checks(name, pp, m, virtual):
    sch = build_schedule(name, pp, m, virtual)
    check(sch)
    computes = sum(len(sch.compute(r)) for r in range(pp))
    assert computes == sch.n_stages * m * (3 if sch.split_backward else 2)
    assert 0.0 <= simulate(sch).bubble < 1.0


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_gpipe_and_1f1b_bubble_is_the_closed_form(name):
    assert bubble(name, 4, 8) == pytest.approx(3 / 11, rel=REL)  # (P-1)/(M+P-1) = 0.2727


def test_interleaved_bubble_is_cut_by_v():
    assert bubble("interleaved", 4, 8, 2) == pytest.approx(3 / 19, rel=REL)  # (P-1)/(V*M+P-1) = 0.1579
    for pp, m, v in [(2, 4, 2), (4, 16, 4), (8, 16, 2)]:
        assert bubble("interleaved", pp, m, v) == pytest.approx((pp - 1) / (v * m + pp - 1), rel=REL)


def test_memory_of_gpipe_and_1f1b():
    assert peak_in_flight(gpipe(4, 8)) == [8, 8, 8, 8]  # all m forwards before any backward
    assert peak_in_flight(one_f_one_b(4, 8)) == [4, 3, 2, 1]  # pp on rank 0
    assert peak_in_flight(one_f_one_b(4, 2)) == [2, 2, 2, 1]  # fewer microbatches than ranks


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (4, 4), (3, 7), (8, 16)])
def test_zb1p_beats_1f1b_with_no_more_memory(pp, m):
    assert bubble("zb1p", pp, m) < bubble("1f1b", pp, m)
    assert max(peak_in_flight(zb1p(pp, m))) <= max(peak_in_flight(one_f_one_b(pp, m))) == pp
    assert bubble("zb1p", pp, m) == pytest.approx((pp - 1) / (3 * m + pp - 1), rel=REL)  # (P-1)(F+B-W) per rank


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (3, 6), (8, 16), (4, 20)])
def test_dualpipev_beats_zb1p(pp, m):
    assert bubble("dualpipev", pp, m) < bubble("zb1p", pp, m)
    assert bubble("dualpipev", pp, m) == pytest.approx(
        (pp - 1) / (6 * m + pp - 1), rel=REL
    )  # the last rank's first wait


def test_dualpipev_places_stages_in_a_v():
    sch = dualpipev(4, 8)
    assert sch.n_stages == 8 and sch.split_backward
    for r in range(4):
        assert sch.stages_of(r) == [r, 7 - r]
    turn = {str(a) for a in sch.actions[3] if not a.is_compute}  # stages 3 and 4 share rank 3: nothing between them
    assert not turn & {f"{k}{i}" for i in range(8) for k in ("sF3.", "rF4.", "sB4.", "rB3.")}
    assert {"rF3.0", "sF4.0", "rB4.0", "sB3.0"} <= turn  # but both talk to rank 2


def test_communication_is_placed_next_to_compute():
    rank1 = one_f_one_b(2, 2).actions[1]
    assert [str(a) for a in rank1] == ["rF1.0", "F1.0", "B1.0", "sB1.0", "rF1.1", "F1.1", "B1.1", "sB1.1"]
    assert str(Action("RECV_B", 2, 5)) == "rB2.5"


def test_deadlock_is_reported_with_the_stuck_ranks():
    sch = gpipe(2, 2)
    rank0 = sch.actions[0]
    rank0.insert(0, rank0.pop(rank0.index(Action("RECV_B", 0, 0))))  # rank 0 waits for a gradient first
    with pytest.raises(ScheduleError, match=r"deadlock.*rank 0 stuck at rB0\.0.*rank 1 stuck at rF1\.0"):
        check(sch)


def test_swapped_receives_are_caught():
    sch = one_f_one_b(2, 2)
    rank1 = sch.actions[1]  # rF1.0 F1.0 B1.0 sB1.0 rF1.1 ...: make rank 1 receive microbatch 1 first
    i, j = rank1.index(Action("RECV_F", 1, 0)), rank1.index(Action("RECV_F", 1, 1))
    rank1[i], rank1[j] = rank1[j], rank1[i]
    with pytest.raises(ScheduleError, match=r"rank 1: F1\.0 \(position 1\) must come after rF1\.0 \(position 4\)"):
        check(sch)


def test_a_receive_moved_too_early_deadlocks_the_whole_pipeline():
    sch = interleaved(4, 8, 2)
    rank0 = sch.actions[0]  # wait for microbatch 0's gradient before sending microbatch 1 forward on chunk 1
    rank0.insert(rank0.index(Action("F", 4, 1)), rank0.pop(rank0.index(Action("RECV_B", 4, 0))))
    with pytest.raises(ScheduleError) as err:
        check(sch)
    assert "deadlock" in str(err.value)
    assert "rank 0 stuck at rB4.0" in str(err.value) and "rank 1 stuck at rF5.1" in str(err.value)


def test_receives_follow_the_peers_send_order():
    sch = dualpipev(2, 4)
    rank1 = sch.actions[1]  # rank 0 sends F0.2 before B3.0's gradient: rank 1 receives rF1.2 first, early
    assert rank1.index(Action("RECV_F", 1, 2)) < rank1.index(Action("RECV_B", 2, 0)) < rank1.index(Action("F", 1, 2))
    recv = rank1.pop(rank1.index(Action("RECV_F", 1, 2)))
    rank1.insert(rank1.index(Action("F", 1, 2)), recv)  # back to just before F1.2: crosses rank 0's send order
    with pytest.raises(
        ScheduleError, match=r"rank 1: receive #2 from rank 0 is rB2\.0 but rank 0's send #2 to it is sF0\.2"
    ):
        check(sch)


def test_dropped_send_is_caught():
    sch = one_f_one_b(4, 4)
    sch.actions[2].remove(Action("SEND_F", 2, 1))
    with pytest.raises(ScheduleError, match=r"rank 3: rF3\.1 has no matching sF2\.1 on rank 2"):
        check(sch)


def test_missing_and_duplicated_compute_is_caught():
    sch = zb1p(2, 2)
    sch.actions[1].remove(Action("W", 1, 0))
    with pytest.raises(ScheduleError, match=r"rank 1: W1\.0 appears 0 times"):
        check(sch)
    sch = gpipe(2, 2)
    sch.actions[0].append(Action("F", 0, 1))
    with pytest.raises(ScheduleError, match=r"rank 0: F0\.1 appears 2 times"):
        check(sch)


def test_backward_before_forward_is_caught():
    sch = gpipe(1, 2)
    sch.actions[0] = [Action("B", 0, 0), Action("F", 0, 0), Action("F", 0, 1), Action("B", 0, 1)]
    with pytest.raises(ScheduleError, match=r"rank 0: B0\.0 \(position 0\) must come after F0\.0"):
        check(sch)


def test_stage_on_the_wrong_rank_is_caught():
    sch = dataclasses.replace(gpipe(2, 2), stage_rank=[1, 0])
    with pytest.raises(ScheduleError, match="rank 0"):
        check(sch)


@pytest.mark.parametrize(
    "args,words",
    [
        (("interleaved", 4, 6, 2), ["microbatches=6", "pp=4", "microbatches=8"]),
        (("interleaved", 4, 8, 1), ["virtual=1"]),
        (("dualpipev", 4, 6, 1), ["microbatches=6", "2*pp=8"]),
        (("1f1b", 4, 8, 2), ["virtual=2"]),
        (("zb2p", 4, 8, 1), ["zb2p", "zb1p"]),
        (("gpipe", 0, 8, 1), ["pp=0"]),
        (("gpipe", 2, 0, 1), ["microbatches=0"]),
    ],
)
def test_bad_numbers_are_refused_with_a_fix(args, words):
    with pytest.raises(ValueError) as err:
        build_schedule(*args)
    assert all(w in str(err.value) for w in words), str(err.value)


def test_simulator_defaults_and_comm_latency():
    assert simulate(gpipe(2, 2)).costs["B"] == 2.0
    assert simulate(zb1p(2, 2)).costs["B"] == 1.0
    slow = simulate(gpipe(2, 2), cost_comm=0.5)
    assert slow.makespan == pytest.approx(simulate(gpipe(2, 2)).makespan + 2 * 0.5)  # one hop down, one back
    assert slow.bubble == pytest.approx(1 - 2 * 6 / (2 * slow.makespan))


def test_text_timeline():
    lines = text(simulate(gpipe(2, 2))).splitlines()
    assert lines == ["rank 0: F0 F1 .  .  .  B0 B0 B1 B1", "rank 1: .  F0 F1 B0 B0 B1 B1 .  ."]
    assert "F0'" in text(simulate(dualpipev(2, 4)))  # the rank's second stage is primed


def test_draw_writes_a_png(tmp_path):
    path = tmp_path / "zb1p.png"
    draw(simulate(zb1p(4, 8)), path, "zb1p")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_prints_the_bubble_and_writes_the_png(capsys, tmp_path):
    out = tmp_path / "gpipe.png"
    assert main(["schedule", "--schedule", "gpipe", "--pp", "4", "--microbatches", "8", "--out", str(out)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1] == "bubble=0.2727"
    assert any(line.startswith("closed form (P-1)/(M+P-1) = 0.2727") for line in lines)
    assert out.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("name,virtual,expected", [("1f1b", 1, "bubble=0.2727"), ("interleaved", 2, "bubble=0.1579")])
def test_cli_closed_forms(capsys, name, virtual, expected):
    assert main(["schedule", "--schedule", name, "--pp", "4", "--microbatches", "8", "--virtual", str(virtual)]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == expected


def test_cli_refuses_bad_numbers(capsys):
    assert main(["schedule", "--schedule", "interleaved", "--pp", "4", "--microbatches", "6", "--virtual", "2"]) == 2
    assert "error: interleaved: microbatches=6" in capsys.readouterr().err


def test_boundary_frontier_counts_the_posted_receives_and_the_outputs_not_yet_sent():
    """1F1B on 4 ranks: rank 0 peaks with 4 microbatches in flight, an output not yet sent and two
    gradient receives posted (3 boundary tensors); a middle rank with 3 in flight holds 3 too; the
    last rank sends no output. The receives are posted in their window (`posting`) and a sent
    output is let go, so 8 or 32 microbatches hold the same (before issue 43 every receive was
    posted when the step began and every output kept until its B: 12 and 16 at 8 microbatches).
    Kept until B (a compiled block's output), the outputs count again: 6. GPipe's rank 0 holds all
    its microbatches' activations, and still 3 boundary tensors."""
    for m in (8, 32):
        frontier = boundary_frontier(build_schedule("1f1b", 4, m))
        assert frontier[:3] == [((4, 0, 3),), ((3, 0, 3),), ((2, 0, 3),)] and max(frontier[3]) == (1, 0, 1)
        assert boundary_frontier(build_schedule("1f1b", 4, m), released=False)[0] == ((4, 0, 6),)
        assert boundary_frontier(build_schedule("gpipe", 4, m))[0] == ((m, 0, 3),)


def test_boundary_frontier_counts_the_split_backwards_waiting_for_their_w():
    """zb1p's rank r runs W r microbatches behind its B, so the last rank (r = 3) holds one
    microbatch-stage whole and up to 4 between B and W (what W reads: `deferred_bytes_per_layer`),
    the first rank at most the one whose W follows its B."""
    frontier = boundary_frontier(build_schedule("zb1p", 4, 8))
    assert max(p[1] for p in frontier[3]) == 4 and max(p[0] for p in frontier[3]) == 1
    assert max(p[1] for p in frontier[0]) == 1


@pytest.mark.parametrize("pp,m", [(8, 32), (16, 32), (16, 120)])
def test_dualpipev_bounds_the_ws_waiting_without_a_longer_makespan(pp, m):
    """At most pp W's wait on a rank where that costs no unit-cost time (DeepSeek-V3's pp=16 at
    120 microbatches: 16 instead of 32, and a shorter makespan); elsewhere the free order stays."""
    sch = dualpipev(pp, m)
    waiting = [max(p[1] for p in f) for f in boundary_frontier(sch)]
    free = make("dualpipev", pp, m, sch.stage_rank, list_schedule(sch.stage_rank, m, [2 * pp + 1] * pp), split=True)
    assert unit_makespan(sch) <= unit_makespan(free)
    if (pp, m) != (16, 32):
        assert max(waiting) <= pp < max(max(p[1] for p in f) for f in boundary_frontier(free))


# ---------------------------------------------------------------- posting under NCCL's order

PLANNED = [  # what the planner's search emits: its schedules at the least microbatches, x2, x4
    (name, pp, (2 * pp if name == "dualpipev" else pp) << k, virtual)
    for name, virtual in SCHEDULES
    for pp in range(2, 9)
    for k in range(MICROBATCH_STEPS)
]


@pytest.mark.parametrize("name,pp,m,virtual", PLANNED)
def test_every_schedule_the_planner_emits_is_posted_in_nccls_order(name, pp, m, virtual):
    """`check` plays the executor's posting under NCCL's model (a rank's batches on one stream, as
    `batch_isend_irecv` puts them); one stream per pair of ranks (plain isend/irecv) runs too, and
    so do windows 1 and 3."""
    sch = build_schedule(name, pp, m, virtual)
    check(sch)
    for window in (1, 2, 3):
        check_in_order(sch, window, per_pair=True)


@pytest.mark.sweep
@pytest.mark.parametrize("name,virtual", SCHEDULES + (("gpipe", 1),))
def test_every_pipeline_depth_of_the_presets_is_posted_in_nccls_order(name, virtual):
    """Every pp the search tries for the presets (up to n_layers / MIN_STAGE blocks a stage)."""
    deepest = max(max(args.n_layers // MIN_STAGE, 2) for args in PRESETS.values())
    for pp in range(9, deepest + 1):
        least = 2 * pp if name == "dualpipev" else pp
        for k in range(MICROBATCH_STEPS):
            check(build_schedule(name, pp, least << k, virtual))


@pytest.mark.parametrize("name,pp,m,virtual", LAYOUTS)
@pytest.mark.parametrize("window", [1, 2, 4])
def test_posting_keeps_each_receive_in_its_window_and_each_send_after_its_producer(name, pp, m, virtual, window):
    """Every message posted once by each end; a receive at most `window` compute actions before the
    one that consumes it and not after; a send after the action that made it."""
    sch = build_schedule(name, pp, m, virtual)
    for rank, slots in enumerate(posting(sch, window)):
        assert [s.compute for s in slots[:-1]] == sch.compute(rank) and slots[-1].compute is None
        posted = {a: k for k, slot in enumerate(slots) for a in slot.post}
        assert sorted(posted, key=str) == sorted((a for a in sch.actions[rank] if not a.is_compute), key=str)
        at = {s.compute: k for k, s in enumerate(slots)}
        for a, k in posted.items():
            made = at[Action(a.kind[-1], a.stage, a.microbatch)]
            assert made - window < k <= made if a.kind in RECEIVES else k > made, (rank, str(a), k, made)


def test_a_posting_out_of_the_global_order_deadlocks_under_nccls_model():
    """1F1B, pp=2 (rank 0 posts: F0.0 | sF0.0 F0.1 | sF0.1 rB0.0 rB0.1 B0.0 | B0.1): rank 0 posting
    its first gradient receive with its first send, before its second send, holds the second send
    behind a receive that rank 1 answers only after it has received that second send."""
    sch = one_f_one_b(2, 2)
    second = posting(sch)[1]
    f0, f1, b0, b1 = (Action(k, 0, i) for k, i in (("F", 0), ("F", 1), ("B", 0), ("B", 1)))
    early = [
        Slot((), f0),
        Slot((Action("SEND_F", 0, 0), Action("RECV_B", 0, 0)), f1),
        Slot((Action("SEND_F", 0, 1), Action("RECV_B", 0, 1)), b0),
        Slot((), b1),
        Slot((), None),
    ]
    sch.posted[WINDOW] = [early, second]
    with pytest.raises(ScheduleError) as err:
        check(sch)
    assert str(err.value).startswith(
        "1f1b under NCCL's order (window 2): deadlock: rank 0 waits for batch #0 [sF0.0 (send to rank 1), rB0.0 "
        "(recv from rank 1)]: its stream's head rB0.0 (recv from rank 1) is not matched by a running operation of "
        "rank 1; rank 1 waits for batch #1 [rF1.1 (recv from rank 0)]"
    ), str(err.value)


def test_the_model_names_a_deadlock_and_a_message_received_as_another():
    send, recv = (lambda peer, m: streams.Op(True, peer, m)), (lambda peer, m: streams.Op(False, peer, m))
    both_receive_first = [
        [(recv(1, "b"),), streams.Wait(0), (send(1, "a"),)],
        [(recv(0, "a"),), streams.Wait(0), (send(0, "b"),)],
    ]
    (problem,) = streams.run(both_receive_first)
    assert problem == (
        "deadlock: rank 0 waits for batch #0 [b (recv from rank 1)]: its stream's head b (recv from rank 1) is not "
        "matched by a running operation of rank 1; rank 1 waits for batch #0 [a (recv from rank 0)]: its stream's "
        "head a (recv from rank 0) is not matched by a running operation of rank 0"
    )
    batched = [[(send(1, "a"), recv(1, "b"))], [(recv(0, "a"), send(0, "b"))]]  # one batch a rank: they run together
    assert streams.run(batched) == []
    crossed = [[(send(1, "a"),), (send(1, "b"),)], [(recv(0, "b"),), (recv(0, "a"),)]]
    assert (
        "rank 1's receive #0 from rank 0 is b (recv from rank 0) but rank 0's send #0 to it is a"
        in streams.run(crossed)[0]
    )
