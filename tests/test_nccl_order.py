"""The pipeline, ring attention and ZeRO inside a pipeline under NCCL's semantics, on gloo.

`nccl_order.NcclOrder` runs a group's point-to-point batches as NCCL does (one stream a rank, in
posting order, tags ignored, a send completing with its receive). Each case runs one step on
plain gloo and the same step again under it, in the same process group: the global loss, the
gradient norm, every local gradient and the validation loss (the forward-only pass) are bitwise
equal (the same arithmetic; only the order in which messages are matched differs). Every group's
collectives were posted in one order on all its ranks (the recorded groups: the mesh's). The
executor's posting recorded from the run is the one
`schedule.posting` plans and `schedule.check` proves (the static model, `streams`), so a change to
either cannot pass unseen. The executor as it was, every receive posted when the step begins, is
caught by the transport in seconds: a timeout naming each rank and the batch it waits for.

Timing: the default suite runs the pp=2 product (every schedule, microbatches 2, 4, 7 where the
schedule takes them) in one world, and one case each of pp=3 and pp=4, ring attention at cp=2 and
ZeRO-3 inside a pipeline; `pytest -m sweep` runs pp = 3, 4 in full, cp = 3, 4 and ZeRO-2.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from nccl_order import NcclOrder, Recording, install
from test_context import RING_SEQS, attention_inputs
from test_ddp import small_config

import fivecut.train.run as run
from fivecut.launch import RankFailure, spawn
from fivecut.layout import ParallelDims
from fivecut.mesh import Mesh
from fivecut.parallel.context import RingAttention, zigzag_positions
from fivecut.parallel.pipeline import streams
from fivecut.parallel.pipeline.executor import PipelineStep
from fivecut.parallel.pipeline.schedule import (
    NAMES,
    RECEIVES,
    SENDS,
    Slot,
    build_schedule,
    feeding,
    message_op,
    partner,
    posting,
    programs,
)
from fivecut.train.optim import grad_norm
from fivecut.train.run import evaluate, forward_backward, global_mean, setup

pytestmark = pytest.mark.multirank

TIMEOUT_S = 30.0  # a wait under the transport; a deadlock fails by it, far below the spawn's


def product(pp: int) -> list[tuple[str, int]]:
    """(schedule, microbatches) for microbatches in pp, 2 pp, 3 pp + 1, where the schedule takes them."""
    out = []
    for name in NAMES:
        for m in (pp, 2 * pp, 3 * pp + 1):
            if (name == "interleaved" and m % pp) or (name == "dualpipev" and m < 2 * pp):
                continue
            out.append((name, m))
    return out


def pipeline_config(cache: str, out: str, pp: int, name: str, m: int, *extra: str):
    """A small model of 2 pp blocks (interleaved and dualpipev hold 2 stages a rank), one row a microbatch."""
    return small_config(
        cache,
        f"parallel.pp={pp}",
        f'parallel.pp_schedule="{name}"',
        f"parallel.microbatches={m}",
        *(("parallel.pp_virtual=2",) if name == "interleaved" else ()),
        f"model.n_layers={2 * pp}",
        "model.dim=64",
        "model.ffn_dim=128",
        "train.seq_len=16",
        f"train.global_batch={m * cfg_dp(extra)}",
        "train.eval_every=1",  # validation batches: the evaluation's forward-only pass runs too
        "train.eval_batches=1",
        f'log.out_dir="{out}"',
        *extra,
    )


def cfg_dp(extra: tuple[str, ...]) -> int:
    return next((int(e.split("=")[1]) for e in extra if e.startswith("parallel.dp=")), 1)


def one_step(ctx) -> tuple[float, float, list[torch.Tensor], float, int]:
    """Step 1's global loss, gradient norm and this rank's gradients (shards under ZeRO), the
    validation loss (`evaluate`: the executor's forward-only pass), and how many items of the pp
    group's recorded program the step's pipeline posted and waited for (the evaluation's follow)."""
    ctx.par.sync.zero_grad()
    loss = global_mean(ctx, forward_backward(ctx, 1))
    posted = len(ctx.mesh.group("pp").transport.program)
    norm = float(grad_norm(ctx.par.pieces, ctx.par.norm_groups))
    return loss, norm, [g.clone() for g in ctx.par.grads if g is not None], evaluate(ctx), posted


def under_both(configs: list) -> list[dict]:
    """Each config: step 1 on plain gloo (recorded), then under NCCL's order; what to compare."""
    out = []
    for cfg in configs:
        ctx = setup(cfg)
        recordings = record_every_group(ctx)
        pp = ctx.mesh.group("pp")
        plain = install(pp, Recording())
        gloo = one_step(ctx)
        ordered = install(pp, NcclOrder(TIMEOUT_S))
        nccl = one_step(ctx)
        recordings["pp"] = [*plain.collectives, *ordered.collectives]
        out.append(
            {
                "case": (cfg.parallel.pp_schedule, cfg.parallel.microbatches),
                "rank": pp.rank,
                "pp_ranks": pp.ranks,
                "loss": (gloo[0], nccl[0]),
                "norm": (gloo[1], nccl[1]),
                "val_loss": (gloo[3], nccl[3]),
                "grads_equal": len(gloo[2]) == len(nccl[2]) and all(map(torch.equal, gloo[2], nccl[2])),
                "recorded": (plain.program, ordered.program),  # the step's, then the evaluation's
                "step_items": (gloo[4], nccl[4]),
                "collectives": {(name, ctx.mesh.group(name).ranks): calls for name, calls in recordings.items()},
            }
        )
        for group in ctx.mesh.groups.values():
            group.transport = None
    return out


def record_every_group(ctx) -> dict[str, list]:
    """A `Recording` on each of the mesh's groups (in place: every cut holding one records on it);
    name -> the list its collectives go to, in order."""
    recordings = {}
    for name, group in ctx.mesh.groups.items():
        if group.pg is not None and group.transport is None:
            recordings[name] = install(group, Recording()).collectives
    return recordings


def assert_collectives_in_one_order(results: list[list[dict]]) -> None:
    """Every rank of a group posted the same collectives (op, shapes, dtypes) in the same order."""
    for case in zip(*results):
        seen: dict = {}
        for rank_result in case:
            for key, calls in rank_result["collectives"].items():
                assert seen.setdefault(key, calls) == calls, (case[0]["case"], key)


def planned(schedule, rank: int) -> streams.Program:
    """The rank's program as `schedule.posting` plans it, each message named by the executor's tag
    (`comm.batch_send_recv` posts a batch's sends before its receives)."""
    program = programs(schedule, posting(schedule))[rank]
    return [
        sends_first(tuple(tagged(schedule, op) for op in item)) if isinstance(item, tuple) else item for item in program
    ]


def sends_first(batch: tuple) -> tuple:
    return tuple(op for op in batch if op.send) + tuple(op for op in batch if not op.send)


def tagged(schedule, op: streams.Op) -> streams.Op:
    send = op.message  # a message by its send action
    boundary = min(send.stage, partner(send).stage)
    tag = 2 * (boundary * schedule.microbatches + send.microbatch) + (send.kind == "SEND_B")
    return dataclasses.replace(op, message=tag)


def assert_same_under_nccl_order(results: list[list[dict]], pp: int) -> None:
    """Bitwise the same step; the recorded posting is the planned one, and runs under the model."""
    for case in zip(*results):
        name, m = case[0]["case"]
        schedule = run_schedule(name, pp, m)
        for rank_result in case:
            gloo, nccl = rank_result["loss"], rank_result["norm"]
            assert rank_result["loss"][0] == rank_result["loss"][1], (name, m, gloo)
            assert rank_result["norm"][0] == rank_result["norm"][1], (name, m, nccl)
            assert rank_result["val_loss"][0] == rank_result["val_loss"][1] > 0, (name, m, rank_result["val_loss"])
            assert rank_result["grads_equal"], (name, m, rank_result["rank"])
            for program, items in zip(rank_result["recorded"], rank_result["step_items"]):
                assert without_elements(program[:items]) == planned(schedule, rank_result["rank"]), (name, m)
        for ranks in {r["pp_ranks"] for r in case}:  # each pipeline's ranks, by group rank
            by_rank = sorted((r for r in case if r["pp_ranks"] == ranks), key=lambda r: r["rank"])
            for k in (0, 1):
                assert streams.run([r["recorded"][k] for r in by_rank]) == [], (name, m)


def without_elements(program: streams.Program) -> streams.Program:
    """A recorded program with its operations' sizes left out (the plan has none)."""
    return [tuple(dataclasses.replace(op, elements=0) for op in b) if isinstance(b, tuple) else b for b in program]


def run_schedule(name: str, pp: int, m: int):
    return build_schedule(name, pp, m, 2 if name == "interleaved" else 1)


def check_pipelines(cache: str, tmp_path, pp: int, cases: list[tuple[str, int]], *extra: str) -> None:
    """Every case in one world (one spawn): bitwise the same under NCCL's order, as planned, and every
    group's collectives in one order on all its ranks."""
    configs = [pipeline_config(cache, f"{tmp_path}/{i}", pp, name, m, *extra) for i, (name, m) in enumerate(cases)]
    results = spawn(under_both, configs[0].parallel.world_size, configs, timeout_s=600)
    assert_same_under_nccl_order(results, pp)
    assert_collectives_in_one_order(results)


def test_every_schedule_at_pp2_runs_under_nccls_order(byte_cache, tmp_path):
    check_pipelines(byte_cache, tmp_path, 2, product(2))


@pytest.mark.parametrize("pp,cases", [(3, [("zb1p", 10)]), (4, [("interleaved", 8), ("dualpipev", 13)])])
def test_deeper_pipelines_run_under_nccls_order(pp, cases, byte_cache, tmp_path):
    check_pipelines(byte_cache, tmp_path, pp, cases)


@pytest.mark.sweep
@pytest.mark.parametrize("pp", [3, 4])
def test_every_schedule_and_microbatch_count_runs_under_nccls_order(pp, byte_cache, tmp_path):
    check_pipelines(byte_cache, tmp_path, pp, product(pp))


@pytest.mark.parametrize(
    "zero,cases",
    [(3, [("1f1b", 4), ("zb1p", 4)]), pytest.param(2, [("interleaved", 4), ("dualpipev", 4)], marks=pytest.mark.sweep)],
)
def test_zero_inside_a_pipeline_runs_under_nccls_order(zero, cases, byte_cache, tmp_path):
    """pp=2, dp=2: the stages' reduce-scatters (and ZeRO-3's gathers) on the dp groups between the
    pipeline's messages; every group's collectives in one order on all its ranks."""
    check_pipelines(byte_cache, tmp_path, 2, cases, "parallel.dp=2", f"parallel.zero={zero}")


# ---------------------------------------------------------------- the executor as it was


class TodaysPosting(PipelineStep):
    """The executor before issue 43: every receive posted when the step begins, in the list's
    order, each send right after its producer, every message in a batch of its own."""

    def slots(self) -> list[Slot]:
        return todays_slots(self.schedule, self.group.rank)

    def post(self, actions) -> None:
        for a in actions:
            super().post((a,))


def todays_slots(schedule, rank: int) -> list[Slot]:
    mine = schedule.actions[rank]
    computes = [a for a in mine if a.is_compute]
    posts: list[list] = [[a for a in mine if a.kind in RECEIVES]] + [[] for _ in computes]
    k = 0
    for a in mine:
        k += a.is_compute
        if a.kind in SENDS:
            posts[k].append(a)
    return [Slot(tuple(p), computes[i] if i < len(computes) else None) for i, p in enumerate(posts)]


def todays_programs(schedule) -> list[streams.Program]:
    """What `TodaysPosting` posts and waits for, a message a batch (`schedule.programs`' form)."""
    out = []
    for rank in range(schedule.pp):
        program, batch = [], {}
        for slot in todays_slots(schedule, rank):
            for a in slot.post:
                batch[a] = len(batch)
                program.append((message_op(schedule, a),))
            waits = feeding(slot.compute, schedule) if slot.compute is not None else []
            program += [streams.Wait(batch[r]) for r in waits]
        out.append(program)
    return out


def todays_executor(cfg, timeout_s: float) -> float:
    """Step 1 by `TodaysPosting` on plain gloo (it runs), then under NCCL's order (it must not)."""
    run.PipelineStep = TodaysPosting  # this rank's process only: `pipeline_step` builds one
    ctx = setup(cfg)
    loss = global_mean(ctx, forward_backward(ctx, 1))
    install(ctx.mesh.group("pp"), NcclOrder(timeout_s))
    forward_backward(ctx, 1)
    return loss


def test_the_executor_that_posted_every_receive_up_front_deadlocks_under_nccls_order(byte_cache, tmp_path):
    """1F1B, pp=2: rank 0's stream holds its gradient receives ahead of its first activation send,
    rank 1's its activation receives: each waits for the other's first batch. The transport says
    so in seconds, for each rank: the batch it waits for, where its stream is stuck, and whom that
    batch waits for. The static model finds the same deadlock in the same programs."""
    cfg = pipeline_config(byte_cache, f"{tmp_path}/p", 2, "1f1b", 4)
    with pytest.raises(RankFailure) as err:
        spawn(todays_executor, 2, cfg, 5.0, timeout_s=120)
    text, summary = str(err.value), err.value.summary
    assert "rank 0 raised CollectiveError" in summary and "rank 1 raised CollectiveError" in summary, summary
    for me, peer, tag in ((0, 1, 1), (1, 0, 0)):  # the first receive each posted: rB0.0 (tag 1), rF1.0 (tag 0)
        assert re.search(
            rf"rank {me}: recv on the pp group \(ranks \[0, 1\]\) timed out \(NCCL order: rank {me} \(of group "
            rf"ranks \[0, 1\]\) timed out after 5 s waiting for batch #0 \[recv from rank {peer} \(tag {tag}, 1024 "
            rf"elements\)\], the head of its stream \(which has run 0 batches\), posted [\d.]+ s ago and not "
            rf"matched by rank {peer}",
            text,
        ), text
    problems = streams.run(todays_programs(build_schedule("1f1b", 2, 4)))
    assert problems[0].startswith(
        "deadlock: rank 0 waits for batch #0 [rB0.0 (recv from rank 1)]: its stream's head rB0.0 (recv from rank 1) "
        "is not matched by a running operation of rank 1; rank 1 waits for batch #0 [rF1.0 (recv from rank 0)]"
    ), problems


# ---------------------------------------------------------------- ring attention


def ring_under_both(cp: int) -> dict:
    """Ring attention's output and q, k, v gradients on this rank's chunk, on plain gloo and under
    NCCL's order, and the ring's recorded posting under each."""
    group = Mesh(ParallelDims(cp=cp, cp_mode="ring"), "cpu").group("cp")
    runs = []
    for transport in (Recording(), NcclOrder(TIMEOUT_S)):
        install(group, transport)
        q, k, v, grad = attention_inputs(RING_SEQS[0])
        positions = zigzag_positions(group.rank, cp, RING_SEQS[0] // cp)
        q, k, v = (t[:, :, positions].clone().requires_grad_() for t in (q, k, v))
        out = RingAttention(group)(q, k, v)
        out.backward(grad[:, :, positions])
        runs.append(([out.detach(), q.grad, k.grad, v.grad], transport.program))
    return {"equal": all(map(torch.equal, runs[0][0], runs[1][0])), "programs": [p for _, p in runs]}


@pytest.mark.parametrize("cp", [2, pytest.param(3, marks=pytest.mark.sweep), pytest.param(4, marks=pytest.mark.sweep)])
def test_ring_attention_runs_under_nccls_order(cp):
    """Forward (a K/V block round the ring a step) and backward (the blocks again, their gradients
    following): bitwise the same under NCCL's order, and the recorded posting runs under the model."""
    results = spawn(ring_under_both, cp, cp, timeout_s=300)
    assert all(r["equal"] for r in results)
    for k in (0, 1):
        assert streams.run([r["programs"][k] for r in results]) == []
