"""`fivecut plan --layout`: one layout costed on a cluster (memory, communication per link, time)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from fivecut.cli import NOTHING_FITS, build_parser, main, plan_config, staging_line
from fivecut.plan.cluster import parse_cluster
from fivecut.plan.cost import (
    EMBEDDING_GRAD_BYTES,
    KERNELS_MOE,
    KERNELS_PER_EXPERT,
    KERNELS_PER_LAYER,
    block_forward_kernels,
    call_ranks,
    compute_actions,
    cost_layout,
    dense_embedding,
    layer_matmul_flops,
    rank_states,
    shared_cores,
    stage_work,
)
from fivecut.plan.report import hiding_bandwidth
from fivecut.plan.search import time_terms
from fivecut.plan.volume import local_param_counts, pipeline_plan, predict

EXACT = dict(rel=1e-12)  # the same closed form on the same inputs


def planned(model: str, layout: str, cluster: str, *flags: str):
    ns = build_parser().parse_args(["plan", "--model", model, "--layout", layout, "--cluster", cluster, *flags])
    cfg, args = plan_config(ns, parse_cluster(cluster).world_size)
    return cost_layout(args, cfg, parse_cluster(cluster)), cfg, args


def test_the_specifications_3d_example_puts_tp_inside_nodes_and_dp_pp_across():
    """16 DP x 4 TP x 4 PP on 32 nodes of 8 H100: TP groups are 4 neighbouring ranks (one node);
    a DP group and a pipeline span nodes."""
    cost, cfg, args = planned(
        "llama3-8b", "dp=16,tp=4,pp=4,microbatches=8", "32x8xH100", "--seq", "2048", "--global-batch", "256"
    )
    links = {c.cut: c.link for c in cost.cuts}
    assert links == {"dp": "inter", "tp": "intra", "pp": "inter"}
    assert {c.cut: c.wire_bytes for c in cost.cuts} == {
        cut: v for cut, (v, _) in predict(args, cfg).items() if cut in links
    }
    assert cost.traffic["intra"] == next(c.wire_bytes for c in cost.cuts if c.cut == "tp")
    assert 0 < cost.bubble < 1 and cost.step >= cost.makespan and 0 < cost.mfu < 1
    assert sum(time_terms(cost).values()) == pytest.approx(cost.step)  # the plot's bars add up to the step
    needed = hiding_bandwidth(cost)  # GB/s per rank for each link's bytes in the compute's time
    assert needed == pytest.approx({link: wire / cost.compute / 1e9 for link, wire in cost.traffic.items()})
    assert set(needed) == {"intra", "inter"}


def test_plan_prints_the_bandwidth_that_hides_each_links_traffic(capsys, tmp_path):
    flags = ["--model", "llama3-8b", "--layout", "dp=4,tp=2,zero=1", "--cluster", "1x8xH100", "--seq", "2048"]
    assert main(["plan", *flags, "--out", str(tmp_path)]) == 0  # zero=1: it fits (unsharded AdamW does not)
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("traffic per rank"))
    assert "intra" in line and "hidden behind the compute at" in line and "the link has 450" in line


def test_the_plan_counts_a_background_saves_host_memory():
    """checkpoint.async_mode "thread"/"process": each rank stages its share of the checkpoint in
    host memory (its fp32 masters, Adam's moments, the step count, the MoE biases), apart from the
    device's memory; "off": nothing. (Against what DCP's stager held: test_checkpoint_async.)"""
    layout = ("tiny-moe", "dp=2,ep=2,zero=1", "1x2xH100", "--seq", "64")
    saving = ("--set", 'checkpoint.dir="ck"', "--set", 'checkpoint.async_mode="process"')
    (cost, cfg, args), (off, blocking, _) = planned(*layout, *saving), planned(*layout)
    states, moe_layers = rank_states(args, cfg, 0), args.n_layers - args.first_dense_layers
    assert cost.staging == states["params"] + states["optimizer"] + 4 * (1 + moe_layers * args.n_experts)
    assert off.staging == 0 and off.memory == cost.memory
    assert staging_line(cost, cfg).startswith("  host memory  11.03 MiB per rank staged by a background save")
    assert "none for checkpoints" in staging_line(off, blocking)


def test_a_layout_that_does_not_fit_names_its_largest_term(capsys):
    assert (
        main(["plan", "--model", "llama3-70b", "--layout", "dp=8", "--cluster", "1x8xH100", "--seq", "4096"])
        == NOTHING_FITS
    )
    out = capsys.readouterr().out
    assert "does NOT fit" in out and "largest term is" in out


@pytest.mark.parametrize(
    "flags, said",
    [
        (["--layout", "dp=4", "--cluster", "1x8xH100"], "uses 4 ranks but --cluster 1x8xH100 has 8 GPUs"),
        (["--layout", "dp=8", "--cluster", "1x8xB300"], "unknown device 'B300'"),
        (["--layout", "dp=8"], "needs --cluster"),
        (["--layout", "dp=8", "--cluster", "1x8xH100", "--model", "nope"], "is not a model preset"),
        (["--layout", "tp=3,dp=2", "--cluster", "1x6xH100", "--model", "tiny"], "tp"),
    ],
)
def test_bad_plan_input_is_refused_with_exit_2(flags, said, capsys):
    assert main(["plan", *flags]) == 2
    assert said in capsys.readouterr().err


def test_memory_follows_hybrid_sharding_and_the_pipelined_zero_peak():
    """Model states shard over zero_shard ranks, not all of dp; under ZeRO-2 in a pipeline the
    peak holds each stage's full gradients (4 bytes a local parameter), not their shards."""
    plain, _, _ = planned("llama3-8b", "dp=8,zero=3", "1x8xH100", "--seq", "2048")
    hybrid, _, _ = planned("llama3-8b", "dp=8,zero=3,zero_shard=2", "1x8xH100", "--seq", "2048")
    assert hybrid.memory["params"] == pytest.approx(4 * plain.memory["params"], rel=1e-3)  # 1/2 vs 1/8
    staged, cfg, args = planned("llama3-8b", "dp=4,pp=2,zero=2,microbatches=2", "1x8xH100", "--seq", "2048")
    local = sum(local_param_counts(args, cfg, pp_rank=staged.memory_rank).values())
    assert staged.memory["grads"] == 4 * local


def test_on_a_cpu_host_a_pipelines_waiting_ranks_leave_their_cores_to_the_computing_ones(tmp_path):
    """4 ranks on 2 shared cores, their rates measured all busy: a pipeline's time shrinks to the
    larger of its ranks' mean busy share and cores / ranks (a core each at most); GPUs and a
    layout without a pipeline keep their time."""
    gpus = parse_cluster("1x4xH100")
    host = replace(gpus, cores_per_node=2)
    flags = ("--seq", "256", "--global-batch", "8")
    for layout in ("pp=2,dp=2,microbatches=2", "pp=4,microbatches=2,pp_schedule=gpipe"):
        _, cfg, args = planned("tiny", layout, "1x4xH100", *flags)
        alone, shared = cost_layout(args, cfg, gpus), cost_layout(args, cfg, host)
        busy = alone.compute / alone.makespan  # rank 0's compute; the stages of tiny cost about alike
        assert shared.makespan / alone.makespan == pytest.approx(max(busy, 0.5), rel=0.05)
        assert shared.makespan < alone.makespan and shared.bubble == pytest.approx(alone.bubble, **EXACT)
    assert shared_cores(host, 0.3) == 0.5 and shared_cores(host, 0.8) == 0.8  # bounded by a core each
    assert shared_cores(gpus, 0.3) == 1.0 and shared_cores(replace(host, cores_per_node=4), 0.3) == 1.0
    _, cfg, args = planned("tiny", "dp=4", "1x4xH100", *flags)
    assert cost_layout(args, cfg, host).step == cost_layout(args, cfg, gpus).step


def test_on_a_cpu_host_ranks_waiting_in_a_smaller_groups_collectives_leave_their_cores_too():
    """dp=2,tp=2 on 4 ranks sharing 2 cores: while one TP pair all-reduces the other computes, so
    the compute shrinks to its share of compute + the exposed waits of groups smaller than the node
    (at most a core each); the collectives' own time is unchanged. USP's all-to-alls go over its
    Ulysses pairs: apart too. Ulysses' over all 4 ranks wait as one."""
    gpus = parse_cluster("1x4xH100")
    host = replace(gpus, cores_per_node=2)
    flags = ("--seq", "256", "--global-batch", "8")
    _, cfg, args = planned("tiny", "dp=2,tp=2", "1x4xH100", *flags)
    alone, shared = cost_layout(args, cfg, gpus), cost_layout(args, cfg, host)
    waits = sum(c.exposed for c in alone.cuts)
    assert waits > 0 and [c.exposed for c in shared.cuts] == [c.exposed for c in alone.cuts]
    share = max(alone.compute / (alone.compute + waits), 0.5)
    assert shared.compute == pytest.approx(alone.compute * share, rel=1e-9)
    assert shared.step == pytest.approx(alone.step - alone.compute * (1 - share), rel=1e-9)
    _, cfg, args = planned("tiny", "cp=4,cp_mode=usp,cp_ulysses=2", "1x4xH100", *flags)
    assert cost_layout(args, cfg, host).compute < cost_layout(args, cfg, gpus).compute
    _, cfg, args = planned("tiny", "cp=4,cp_mode=ulysses", "1x4xH100", *flags)
    assert cost_layout(args, cfg, host).step == cost_layout(args, cfg, gpus).step


def test_usps_all_to_alls_pay_the_latency_of_its_ulysses_ranks_only():
    _, cfg, _ = planned("tiny", "cp=8,cp_mode=usp,cp_ulysses=2", "1x8xH100", "--seq", "256", "--global-batch", "8")
    assert call_ranks("cp", "all_to_all", cfg.parallel, 8) == 2  # the Ulysses pairs, not the ring of 8
    assert call_ranks("cp", "send", cfg.parallel, 8) == 8  # a send's latency is one hop on any group
    assert call_ranks("tp", "all_to_all", cfg.parallel, 8) == 8


def test_zero12s_gathers_hide_behind_the_next_forward_but_for_the_first_buckets():
    """ZeRO-1/2's gathers of the updated shards run after the step and the next forward waits for
    the first bucket's: in one bucket all of the gathers are exposed; in many, one bucket's share
    (the rest hides behind that forward). The reduce-scatters hide behind the backward. On H100
    every op moves alike, so the gathers are half of the cut's time."""
    flags = ("--seq", "256", "--global-batch", "8")
    for buckets_mb in ("25", "0.25"):
        cost, _, _ = planned("tiny", "dp=8,zero=1", "1x8xH100", *flags, "--set", f"train.bucket_mb={buckets_mb}")
        dp, calls = next(c for c in cost.cuts if c.cut == "dp"), cost.calls["dp"]["all_gather"]
        assert calls == cost.calls["dp"]["reduce_scatter"] and (calls == 1) == (buckets_mb == "25")
        assert dp.exposed == pytest.approx(dp.seconds / 2 / calls, rel=1e-9)


def with_device(cluster, **figures):
    return replace(cluster, device=replace(cluster.device, **figures))


def test_every_pipeline_action_pays_its_fixed_cost_on_the_critical_path():
    """GPipe on p ranks with m microbatches of equal stages is (m + p - 1) F's and B's long: a
    fixed cost a per action (`Device.action_us`) adds 2a(m + p - 1) to it, and nothing without a
    pipeline. The split backward's W is an action too."""
    flags = ("--seq", "256", "--global-batch", "8")
    h100 = parse_cluster("1x4xH100")
    _, cfg, args = planned("tiny", "pp=4,microbatches=4,pp_schedule=gpipe,pp_layers=[1,1,1,1]", "1x4xH100", *flags)
    a = 1e-3
    without, charged = cost_layout(args, cfg, h100), cost_layout(args, cfg, with_device(h100, action_us=a * 1e6))
    assert charged.makespan - without.makespan == pytest.approx(2 * a * (4 + 4 - 1), rel=1e-9)
    schedule = pipeline_plan(args, cfg)[0]
    assert [compute_actions(schedule, r) for r in range(4)] == [8] * 4
    _, cfg, _ = planned("tiny", "pp=2,microbatches=4,pp_schedule=zb1p", "1x2xH100", *flags)
    assert compute_actions(pipeline_plan(args, cfg)[0], 0) == 12  # F, B, W of each microbatch
    _, cfg, args = planned("tiny", "dp=4", "1x4xH100", *flags)
    assert cost_layout(args, cfg, with_device(h100, action_us=1e3)).step == cost_layout(args, cfg, h100).step


def test_a_recomputed_forwards_kernels_cost_what_calibration_measured_for_them():
    """Full recomputation runs each block's forward kernels again in backward, under the
    checkpoint's hooks: each at `Device.recompute_us` (0: `kernel_us`)."""
    flags = ("--seq", "256", "--global-batch", "8", "--set", 'train.recompute="full"')
    h100 = parse_cluster("1x1xH100")
    _, cfg, args = planned("tiny", "dp=1", "1x1xH100", *flags)
    plain = cost_layout(args, cfg, h100).step
    assert cost_layout(args, cfg, with_device(h100, recompute_us=h100.device.kernel_us)).step == pytest.approx(plain)
    dearer = cost_layout(args, cfg, with_device(h100, recompute_us=h100.device.kernel_us + 100)).step
    assert dearer - plain == pytest.approx(args.n_layers * KERNELS_PER_LAYER * 100e-6, rel=1e-9)


def test_the_embeddings_dense_gradient_is_paid_each_microbatch_but_under_a_split_backward():
    flags = ("--seq", "256", "--global-batch", "8")
    for layout, dense in (
        ("dp=2", True),
        ("pp=2,microbatches=4", True),
        ("pp=2,microbatches=4,pp_schedule=zb1p", False),
    ):
        _, cfg, args = planned("small", layout, "1x2xH100", *flags)
        assert dense_embedding(args, cfg) == dense
        first = stage_work(args, cfg, range(1), True, False, 64)[0]["embedding_B"]
        assert first == (EMBEDDING_GRAD_BYTES * args.vocab_size * args.dim if dense else 0)
        assert stage_work(args, cfg, range(1, 2), False, False, 64)[0]["embedding_B"] == 0


def test_a_moe_blocks_kernels_do_not_grow_with_the_experts_a_rank_holds():
    """The routed experts run as grouped GEMMs: a MoE block launches as many kernels at ep=2 as at ep=1."""
    _, cfg, args = planned("tiny-moe", "dp=2,ep=2", "1x2xH100", "--seq", "256", "--global-batch", "8")
    dense, moe = block_forward_kernels(args, 0, 4), block_forward_kernels(args, 1, 4)
    assert dense == KERNELS_PER_LAYER and moe == KERNELS_PER_LAYER + KERNELS_MOE == block_forward_kernels(args, 1, 2)
    assert KERNELS_PER_EXPERT == 0
    assert (
        stage_work(args, cfg, range(2), True, True, 64)[1]["F"]
        == stage_work(args, replace(cfg, parallel=replace(cfg.parallel, ep=1, dp=2)), range(2), True, True, 64)[1]["F"]
    )


@pytest.mark.parametrize(
    "layout, flags",
    [
        ("dp=1", ["--set", "train.loss_chunk_tokens=0"]),
        ("dp=1", ["--set", "train.loss_chunk_tokens=256", "--set", 'train.recompute="full"']),
        ("pp=2,microbatches=4,pp_schedule=zb1p", []),
    ],
)
def test_the_compute_by_term_is_the_compute(layout, flags):
    """`compute by term` splits rank 0's compute without losing or adding any of it; the chunked
    loss adds its chunks' head gradients, the full logits none; a full recomputation its kernels."""
    world = "1x2xH100" if "pp=2" in layout else "1x1xH100"
    cost, cfg, args = planned("tiny", layout, world, "--seq", "256", "--global-batch", "8", *flags)
    terms = cost.compute_terms
    assert sum(terms.values()) == pytest.approx(cost.compute, rel=1e-9)
    if cfg.parallel.pp == 1:  # unscaled: the matmuls' FLOPs (forward, backward 2x, a recomputed forward) at the rate
        blocks = 8 * 256 * sum(layer_matmul_flops(args, i) for i in range(args.n_layers))
        forward = blocks + 8 * 256 * 2 * args.dim * args.vocab_size
        again = blocks * (cfg.train.recompute == "full")
        assert terms["matmuls"] == pytest.approx((3 * forward + again) / parse_cluster(world).device.flops, rel=1e-9)
    assert terms["matmuls"] > 0 and terms["attention"] > 0 and terms["activations"] > 0
    assert (terms["loss_chunks"] > 0) == (cfg.train.loss_chunk_tokens > 0 and cfg.parallel.pp == 1)
    assert (terms["recompute"] > 0) == (cfg.train.recompute == "full")
