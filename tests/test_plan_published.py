"""Published layouts, costed by `fivecut plan --layout` (figures and sources in the README's planner section).

DeepSeek-V3 (arXiv 2412.19437, section 3.2): 2048 H800, EP64 x PP16 (DualPipe) x DP with ZeRO-1,
sequences of 4,096, a batch of 15,360 sequences. Llama 3.1 405B (arXiv 2407.21783, table 4):
8,192 H100, TP8 x PP16 (interleaved) x DP64, sequences of 8,192, 16M tokens a step, 38-43% MFU
(BF16); its data cut is FSDP that shards parameters, gradients and optimizer state and does not
reshard after the forward (section 3.3.2): fivecut's ZeRO-3 with `reshard_after_forward=false`.
Both fit only under full recomputation in fivecut's memory model: autocast over fp32
weights keeps each microbatch's bf16 copies of the weights and of SP's gathered inputs.
"""

from __future__ import annotations

import pytest

from fivecut.cli import build_parser, plan_config
from fivecut.plan.cluster import parse_cluster
from fivecut.plan.cost import cost_layout
from fivecut.plan.search import search

GB = 1e9


def cost(model: str, cluster: str, layout: str, *flags: str):
    ns = build_parser().parse_args(["plan", "--model", model, "--cluster", cluster, "--layout", layout, *flags])
    cfg, args = plan_config(ns, parse_cluster(cluster).world_size)
    return cost_layout(args, cfg, parse_cluster(cluster))


def test_deepseek_v3_fits_in_80_gb_under_ep64_pp16_dualpipe():
    c = cost(
        "deepseek-v3",
        "256x8xH800",
        "dp=128,ep=64,pp=16,pp_schedule=dualpipev,microbatches=120,zero=1",
        *("--seq", "4096", "--global-batch", "15360", "--set", 'train.recompute="full"'),
    )
    assert c.fits and c.memory["total"] < 80 * GB
    assert {x.cut: x.link for x in c.cuts}["ep"] == "inter"  # EP64 spans 8 nodes


def test_llama3_405b_fits_and_its_mfu_is_within_10_points_of_metas_43():
    c = cost(
        "llama3-405b",
        "1024x8xH100",
        "dp=64,tp=8,sp=true,pp=16,pp_schedule=interleaved,pp_virtual=2,microbatches=32,zero=3,reshard_after_forward=false",
        *("--seq", "8192", "--global-batch-tokens", "16M", "--set", 'train.recompute="full"'),
    )
    assert c.fits
    assert c.mfu == pytest.approx(0.43, abs=0.10)
    assert {x.cut: x.link for x in c.cuts}["tp"] == "intra"


@pytest.mark.sweep
def test_llama3_70b_on_256_h100_keeps_tp_inside_a_node():
    """torchtitan trained Llama 3 70B on 256 H100 with FSDP x TP8; the search's best layout keeps
    its TP group inside one node of 8 (a few minutes: the whole search)."""
    ns = build_parser().parse_args(
        ["plan", "--model", "llama3-70b", "--cluster", "32x8xH100", "--seq", "8192", "--global-batch-tokens", "4M"]
    )
    cfg, args = plan_config(ns, 256)
    best = search(args, cfg, parse_cluster("32x8xH100"), top=3).ranked[0]
    assert best.cfg.parallel.tp <= 8 and {c.cut: c.link for c in best.cost.cuts}.get("tp", "intra") == "intra"
