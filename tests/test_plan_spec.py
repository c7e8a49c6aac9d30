"""The specification's tables, from fivecut's own closed forms (`fivecut.plan.volume.predict`, the
ledger's check) and its schedule simulator: each cut's textbook volume per step, each schedule's
textbook bubble. Shape-only presets on the meta device, fp32 (4 bytes an element), so that the
leading terms dominate; each assert states its tolerance and why."""

from __future__ import annotations

import dataclasses

import pytest

from fivecut.cli import build_parser, plan_config
from fivecut.model.transformer import build_model
from fivecut.parallel.pipeline.schedule import build_schedule
from fivecut.parallel.pipeline.simulate import simulate
from fivecut.plan.volume import expert_parallel_volume, pipeline_volume, predict

FP32 = 4


def config(model: str, layout: str, seq: int, batch: int, *sets: str):
    flags = ["--seq", str(seq), "--global-batch", str(batch), "--dtype", "fp32"]
    for s in sets:
        flags += ["--set", s]
    ns = build_parser().parse_args(["plan", "--model", model, "--layout", layout, *flags])
    return plan_config(ns)


def ar(n: int) -> float:
    """The ring all-reduce's factor 2(n-1)/n (all-gather and reduce-scatter: half of it each)."""
    return 2 * (n - 1) / n


def params(args) -> int:
    return sum(p.numel() for p in build_model(args, device="meta").parameters())


# ---------------------------------------------------------------- DP and ZeRO: Phi per step


@pytest.mark.parametrize(
    "zero, phis",
    [(0, 2), (1, 2), (2, 2), (3, 3)],  # DDP all-reduce; ZeRO-1/2 reduce-scatter + all-gather; ZeRO-3 +1 gather
)
def test_data_parallel_moves_2_phi_and_zero3_3_phi(zero, phis):
    """Gradient reduction over n = 16 ranks: DP 2(n-1)/n Phi (all-reduce), ZeRO-1/2 (n-1)/n Phi
    reduce-scatter + (n-1)/n Phi all-gather, ZeRO-3 two gathers (forward, backward) and one
    reduce-scatter: 3(n-1)/n Phi, at 4 bytes. Tolerance 1e-3: ZeRO pads each flat buffer to a
    multiple of n and the clip norm adds one fp32; DDP is exact but for the clip norm's nothing."""
    cfg, args = config("llama3-8b", f"dp=16,zero={zero}", 1024, 16)
    n, phi = 16, params(args)
    volume, _ = predict(args, cfg)["dp"]
    assert volume == pytest.approx(phis * (n - 1) / n * FP32 * phi, rel=1e-3)
    if zero == 0:
        assert volume == ar(n) * FP32 * phi  # exact: every gradient all-reduced once


# ---------------------------------------------------------------- TP and SP: b*s*h per block


def block_volume(model: str, layout: str, seq: int, batch: int, cut: str) -> tuple[float, object, object]:
    """The cut's bytes per step that one more transformer block adds (the model at L and 2L
    blocks, differenced): the per-block term alone, embedding, head and loss cancelled."""
    cfg, args = config(model, layout, seq, batch)
    deeper = dataclasses.replace(args, n_layers=2 * args.n_layers)
    one, two = predict(args, cfg)[cut][0], predict(deeper, cfg)[cut][0]
    return (two - one) / args.n_layers, cfg, args


def test_tensor_parallelism_all_reduces_bsh_twice_per_block_forward_and_twice_backward():
    """Megatron's f and g: two all-reduces of E = b*s*h per block forward, two backward:
    4 x 2(t-1)/t x E x 4 bytes a block. Exact (differenced, nothing else is per block); the
    whole step within 3% of 4 L such all-reduces (the embedding, the head and the loss add
    2 E + 3 b s of 4 L E)."""
    per_block, cfg, args = block_volume("llama3-8b", "tp=8", 1024, 1, "tp")
    t, e = 8, 1 * 1024 * args.dim
    assert per_block == pytest.approx(4 * ar(t) * e * FP32, rel=1e-12)
    whole, _ = predict(args, cfg)["tp"]
    assert whole == pytest.approx(4 * args.n_layers * ar(t) * e * FP32, rel=0.03)


def test_sequence_parallelism_moves_the_all_reduces_bytes_as_all_gathers_and_reduce_scatters():
    """SP replaces each all-reduce of E by a reduce-scatter and an all-gather, (t-1)/t E each:
    the same bytes. fivecut adds per block what SP's memory saving costs: the two region inputs,
    kept as slices, all-gathered again in backward (2 x (t-1)/t E), and the two replicated norm
    weights' gradients all-reduced (2 x 2(t-1)/t h). Exact, per block."""
    sp, _, args = block_volume("llama3-8b", "tp=8,sp=true", 1024, 1, "tp")
    tp, _, _ = block_volume("llama3-8b", "tp=8", 1024, 1, "tp")
    t, e = 8, 1 * 1024 * args.dim
    regathers = 2 * (t - 1) / t * e * FP32
    norm_grads = 2 * ar(t) * args.dim * FP32
    assert sp - regathers - norm_grads == pytest.approx(tp, rel=1e-12)


# ---------------------------------------------------------------- PP: b*s*h per microbatch per boundary


@pytest.mark.parametrize("rank, boundaries", [(0, 1), (1, 2), (3, 1)])
def test_pipeline_sends_bsh_per_microbatch_per_boundary(rank, boundaries):
    """1F1B over pp = 4, m = 8 microbatches of b = 2: each boundary a rank borders carries each
    microbatch's activations b*s*h forward and their gradient back. Within 1e-6: the clip norm's
    one fp32 is all that is added (the ends hold no tied embedding in llama3-8b)."""
    cfg, args = config("llama3-8b", "pp=4,microbatches=8", 1024, 16)
    volume, _ = pipeline_volume(args, cfg, rank)
    e = 2 * 1024 * args.dim
    assert volume == pytest.approx(boundaries * 8 * 2 * e * FP32, rel=1e-6)


# ---------------------------------------------------------------- EP: 2 x k x tokens x h per MoE layer


def test_expert_parallelism_moves_2_k_tokens_h_per_moe_layer_each_way():
    """Dispatch sends each token's k copies to the ranks of their experts, combine brings them
    back: 2 x k x T x h per MoE layer forward (under uniform routing (ep-1)/ep of them leave the
    rank), and the same again as gradients in backward. Within 1%: the routing counts and the
    load statistics are a few bytes a token against k h."""
    cfg, args = config("deepseek-v3", "dp=8,ep=8", 1024, 8)
    ep, k, tokens = 8, args.top_k, 1 * 1024  # one sequence per rank
    volume, _ = expert_parallel_volume(args, cfg, None)
    forward = args.n_moe_layers * 2 * k * tokens * args.dim * (ep - 1) / ep * FP32
    assert volume == pytest.approx(2 * forward, rel=0.01)


# ---------------------------------------------------------------- bubbles


@pytest.mark.parametrize("p, m", [(4, 8), (4, 16), (8, 16), (8, 32)])
def test_gpipe_and_1f1b_bubbles_are_p_minus_1_over_m_plus_p_minus_1(p, m):
    """F = 1, B = 2, no communication: both schedules idle (p-1)(F+B) on each rank. Exact up to
    rounding (1e-12)."""
    for name in ("gpipe", "1f1b"):
        assert simulate(build_schedule(name, p, m), 1, 2).bubble == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)


@pytest.mark.parametrize("p, m, v", [(4, 8, 2), (4, 16, 2), (8, 16, 2), (4, 16, 4)])
def test_interleaved_bubble_is_p_minus_1_over_v_m_plus_p_minus_1(p, m, v):
    """v chunks of 1/v of a rank's layers each (F = 1/v, B = 2/v): the fill and drain shrink by v,
    (p-1)/(v m + p - 1). Exact up to rounding."""
    bubble = simulate(build_schedule("interleaved", p, m, v), 1 / v, 2 / v).bubble
    assert bubble == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12)


@pytest.mark.parametrize("p, m", [(4, 8), (4, 64), (8, 16), (8, 128)])
def test_zb_h1_bubble_is_about_a_third_of_1f1b(p, m):
    """ZB-H1 at F = B = W = 1 idles (p-1)(F+B-W) = (p-1) per rank where 1F1B (B+W = 2) idles
    3(p-1): bubble (p-1)/(3m+p-1), exact up to rounding; its ratio to 1F1B's,
    (m+p-1)/(3m+p-1), tends to 1/3: within 0.02 of it once m >= 16 p."""
    zb = simulate(build_schedule("zb1p", p, m), 1, 1, 1).bubble
    one = simulate(build_schedule("1f1b", p, m), 1, 2).bubble
    assert zb == pytest.approx((p - 1) / (3 * m + p - 1), abs=1e-12)
    assert zb / one == pytest.approx((m + p - 1) / (3 * m + p - 1), abs=1e-12)
    if m >= 16 * p:
        assert zb / one == pytest.approx(1 / 3, abs=0.02)


@pytest.mark.parametrize("p, m", [(4, 8), (4, 16), (8, 16), (8, 32)])
def test_dualpipev_bubble_is_p_minus_1_over_6m_plus_p_minus_1(p, m):
    """DualPipeV: two half-size stages per rank (F = B = W = 1/2 each): only the last rank's wait
    for the first forward is left, (p-1)/(6m+p-1). Exact up to rounding."""
    bubble = simulate(build_schedule("dualpipev", p, m), 0.5, 0.5, 0.5).bubble
    assert bubble == pytest.approx((p - 1) / (6 * m + p - 1), abs=1e-12)
