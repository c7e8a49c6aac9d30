"""The planner's cluster: presets, TOML files, the alpha-beta link model, and calibration."""

from __future__ import annotations

import math
import os
import time
from dataclasses import replace

import pytest

from fivecut.cli import main
from fivecut.plan.cluster import ClusterError, Link, cluster_toml, parse_cluster
from fivecut.plan.cost import wire_seconds

EXACT = dict(rel=1e-12)  # closed forms of a few operations on exact inputs


def test_a_preset_cluster_has_the_data_sheet_figures_and_its_links():
    cluster = parse_cluster("32x8xH100")
    assert cluster.world_size == 256 and cluster.device.memory_gb == 80
    assert cluster.device.peak_tflops == pytest.approx(989.4, **EXACT)  # dense bf16 (1,979 with sparsity)
    assert cluster.link_for((0, 7)) is cluster.intra  # one node: NVLink
    assert cluster.link_for((7, 8)) is cluster.inter  # two nodes: the network
    assert cluster.intra.bandwidth_gbps == 450 and cluster.inter.bandwidth_gbps == 50


def test_a_ring_collective_costs_its_hops_and_its_wire_bytes():
    link = Link(bandwidth_gbps=100.0, latency_us=5.0)
    size, n = 4e9, 4
    assert link.seconds("all_reduce", size, n) == pytest.approx(6 * 5e-6 + 1.5 * size / 1e11, **EXACT)
    assert link.seconds("all_gather", size, n) == pytest.approx(3 * 5e-6 + 0.75 * size / 1e11, **EXACT)
    assert link.seconds("send", size, 2) == pytest.approx(5e-6 + size / 1e11, **EXACT)
    assert link.seconds("all_reduce", size, 1) == 0.0


def test_an_op_may_have_its_own_latency_and_a_recv_is_its_send():
    link = Link(bandwidth_gbps=100.0, latency_us=5.0, op_latency_us=(("all_gather", 7.0), ("send", 40.0)))
    assert link.latency("all_gather", 4) == pytest.approx(3 * 7e-6, **EXACT)
    assert link.latency("all_reduce", 4) == pytest.approx(6 * 5e-6, **EXACT)  # not given: latency_us
    assert link.latency("recv", 2) == link.latency("send", 2) == pytest.approx(40e-6, **EXACT)
    assert link.latency("reduce_scatter", 1) == 0.0


def test_a_cluster_file_reads_back_as_written(tmp_path):
    cluster = parse_cluster("4x8xA100")
    path = tmp_path / "a100.toml"
    path.write_text(cluster_toml(cluster, "a note"))
    assert parse_cluster(str(path)) == cluster
    calibrated = replace(  # every field calibration writes, an op latency of each kind included
        cluster,
        cores_per_node=2,
        device=replace(
            cluster.device,
            kernel_us=41.5,
            memory_gbps=2.25,
            tensor_us=115.0,
            overlap=0.61,
            attention_tflops=0.011,
            activation_gbps=4.8,
            loss_gbps=0.65,
            recompute_us=68.0,
            action_us=380.0,
        ),
        intra=Link(
            0.66,
            143.0,
            (
                ("all_reduce", 820.0),
                ("all_gather", 688.0),
                ("reduce_scatter", 578.0),
                ("all_to_all", 672.0),
                ("send", 2.5),
            ),
        ),
    )
    path.write_text(cluster_toml(calibrated))
    assert parse_cluster(str(path)) == calibrated


def test_a_file_may_name_a_preset_and_override_a_link(tmp_path):
    path = tmp_path / "h800.toml"
    path.write_text(
        '[cluster]\nnodes = 2\ngpus_per_node = 8\ndevice = "H800"\n[links.inter]\nbandwidth_gbps = 40\nlatency_us = 8\n'
    )
    cluster = parse_cluster(str(path))
    assert cluster.device.name == "H800" and cluster.intra == parse_cluster("1x8xH800").intra
    assert cluster.inter == Link(40.0, 8.0)


@pytest.mark.parametrize(
    "text, said",
    [
        ("[cluster]\nnodes = 2\n", "gpus_per_node"),
        ('[cluster]\nnodes = 2\ngpus_per_node = 8\ndevice = "B300"\n', "unknown device 'B300'"),
        ('[cluster]\nnodes = 1\ngpus_per_node = 8\n[device]\nname = "x"\n', "peak_tflops, memory_gb"),
        (
            '[cluster]\nnodes = 1\ngpus_per_node = 8\n[device]\nname = "x"\npeak_tflops = 1\nmemory_gb = 8\n',
            "[links.intra] is missing",
        ),
        ("[cluster]\nnodes = 1\ngpus_per_node = 8\ndevice = 'H100'\n[links.intra]\nlatency_us = 1\n", "bandwidth_gbps"),
        ("[cluster\n", "not valid TOML"),
        ("[cluster]\nnodes = 1\ngpus_per_node = 4\ncores_per_node = -2\ndevice = 'H100'\n", "cores_per_node"),
    ],
)
def test_a_bad_cluster_file_is_refused_naming_the_key(tmp_path, text, said):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ClusterError) as info:
        parse_cluster(str(path))
    assert said in str(info.value)


def test_an_unknown_spelling_names_the_forms_and_the_devices():
    with pytest.raises(ClusterError) as info:
        parse_cluster("32x8xB300")
    assert "unknown device 'B300'" in str(info.value) and "H100" in str(info.value)
    with pytest.raises(ClusterError) as info:
        parse_cluster("no-such-file.toml")
    assert "NODESxGPUSxDEVICE" in str(info.value)


@pytest.mark.multirank
def test_calibration_writes_a_cluster_file_of_this_machine_and_never_overwrites(tmp_path, capsys):
    out = tmp_path / "here.toml"
    assert main(["plan", "calibrate", "--ranks", "2", "--out", str(out)]) == 0
    cluster = parse_cluster(str(out))
    assert cluster.world_size == 2 and cluster.intra == cluster.inter
    assert cluster.cores_per_node == len(os.sched_getaffinity(0))  # a CPU's ranks share its cores
    assert cluster.device.peak_tflops > 0 and cluster.intra.bandwidth_gbps > 0 and cluster.device.achievable == 1
    d = cluster.device
    assert d.attention_tflops > 0 and d.activation_gbps > 0 and d.loss_gbps > 0  # measured, not the defaults
    assert d.recompute_us > 0 and d.action_us >= 0  # a checkpointed block's kernels, a real pipeline step's
    assert {op for op, _ in cluster.intra.op_latency_us} == {
        "all_reduce",
        "all_gather",
        "reduce_scatter",
        "all_to_all",
        "send",
    }
    rates = {op for op, _ in cluster.intra.op_bandwidth_gbps}
    assert rates == {"all_gather", "reduce_scatter", "all_to_all", "send"}  # the all-reduce's: bandwidth_gbps
    written = out.read_text()
    assert main(["plan", "calibrate", "--out", str(out)]) == 2  # exists: refused, untouched
    assert out.read_text() == written and "--force" in capsys.readouterr().err
    assert main(["plan", "calibrate", "--ranks", "0", "--out", str(tmp_path / "x.toml")]) == 2


def test_a_cuts_bytes_go_at_each_of_its_ops_own_bandwidth():
    link = Link(1.0, 0.0, (), (("all_gather", 0.25), ("send", 0.5)))
    assert wire_seconds(1e9, {"all_reduce": 2}, link) == pytest.approx(1.0)
    assert wire_seconds(1e9, {"all_gather": 1, "reduce_scatter": 1}, link) == pytest.approx(0.5 * 4 + 0.5 * 1)
    assert wire_seconds(1e9, {}, link) == pytest.approx(1.0)  # no calls counted: the link's bandwidth
    assert link.bandwidth("recv") == link.bandwidth("send") == pytest.approx(0.5e9)
    assert link.seconds("send", 1e9, 2) == pytest.approx(2.0)


def test_a_gpus_probes_are_sized_by_its_model_and_memory_and_run_here():
    """The GPU path of `fivecut plan calibrate` on this CPU: the probes sized for a GPU of 1 GB running
    `small` at 64 tokens (the model's width, MLP, heads, vocabulary and tensor count; a tail tensor
    from the memory), run once each by the same code a GPU runs, give positive figures."""
    import torch

    from fivecut.model.presets import PRESETS
    from fivecut.plan.calibrate import (
        ATTENTION,
        BIG,
        BLOCK,
        BLOCK_ROWS,
        LINEAR,
        LOSS,
        TENSORS,
        ProbeSizes,
        compute_figures,
        compute_probes,
        probe_sizes,
        tensor_count,
    )

    small = PRESETS["small"]
    sizes = probe_sizes("cuda", 1e9, small, 64)
    assert sizes.linear[1:] == (small.dim, small.ffn_dim) and sizes.attention[1:] == (small.n_heads, 64, small.head_dim)
    assert sizes.loss[1:] == (small.dim, small.vocab_size) and sizes.block.dim == small.dim
    assert sizes.tensors == tensor_count(small) != TENSORS and BIG < sizes.big <= 1e9 / 8 / 16
    assert probe_sizes("cuda", 80e9).attention == (8, 32, 2048, 64)  # no model: llama-1b at 2048, 16,384 tokens
    cpu = (LINEAR, ATTENTION, LOSS, BLOCK, BLOCK_ROWS, TENSORS, BIG)  # a CPU's: the sizes plan_check checks at
    assert probe_sizes("cpu", 80e9) == probe_sizes("cpu", 1e9) == ProbeSizes("cpu", *cpu)
    mla = probe_sizes("cuda", 80e9, PRESETS["deepseek-v3"], 4096)  # its dense block; its heads' qk channels
    assert mla.block.n_experts == 0 and mla.attention == (1, 128, 4096, 192)
    probes, flops_of = compute_probes(torch.device("cpu"), torch.float32, sizes)
    seconds = {}
    for name, probe in probes.items():
        start = time.perf_counter()
        probe()
        seconds[name] = time.perf_counter() - start
    figures = compute_figures(seconds, flops_of, sizes)
    fixed = ("kernel_s", "recompute_s")  # differences of two tiny steps: 0 when one run's noise hides them
    assert all(math.isfinite(v) and (v >= 0 if k in fixed else v > 0) for k, v in figures.items()), figures
