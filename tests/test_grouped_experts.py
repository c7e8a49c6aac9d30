"""Routed experts as grouped GEMMs (`grouped_swiglu`): the same numbers as a loop over the
experts, and no host sync in a MoE layer at ep = 1.

Tolerances (fp32): a grouped kernel runs each group's matmul as the loop does, but the padded
fallback sums a weight's gradient over blocks of rows: outputs and gradients rtol 1e-5, atol 1e-6.
The distributed paths (ep, etp, capacity, EPLB, pipelines, recomputation) are compared with
one process in test_expert.py, test_etp.py, test_pipeline.py and test_recompute.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from fivecut.comm import Group
from fivecut.layout import MoEOptions
from fivecut.ledger import Ledger
from fivecut.model.presets import get_preset
from fivecut.model.transformer import (
    MoE,
    group_ends,
    grouped_kernel,
    grouped_mm_cpu,
    grouped_swiglu,
    padded_grouped_mm,
)
from fivecut.parallel.expert import ExpertParallelMoE, capacity_keep

TOL = {"rtol": 1e-5, "atol": 1e-6}
COUNTS = [5, 0, 17, 1, 0, 9, 0, 32]  # uneven, with experts that get no rows


def loop_reference(x, w1, w3, w2, counts: list[int]) -> torch.Tensor:
    """One SwiGLU matmul chain per expert over its rows, as the experts ran before."""
    chunks = torch.split(x[: sum(counts)], counts)
    return torch.cat([(F.silu(xe @ w1[e]) * (xe @ w3[e])) @ w2[e] for e, xe in enumerate(chunks)])


def expert_inputs(dim: int, hidden: int, rows: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    e = len(COUNTS)
    x = torch.randn(rows, dim, generator=g)
    w1, w3 = torch.randn(e, dim, hidden, generator=g) * 0.1, torch.randn(e, dim, hidden, generator=g) * 0.1
    w2 = torch.randn(e, hidden, dim, generator=g) * 0.1
    return [t.requires_grad_() for t in (x, w1, w3, w2)]


def swiglu_with(mm, x, w1, w3, w2, ends):
    return mm(F.silu(mm(x, w1, ends)) * mm(x, w3, ends), w2, ends)


@pytest.mark.parametrize("kernel", [grouped_mm_cpu, padded_grouped_mm], ids=["grouped_mm_cpu", "padded"])
def test_each_kernel_matches_the_loop_forward_and_gradients(kernel):
    rows = sum(COUNTS)
    inputs = expert_inputs(16, 32, rows)
    ends = group_ends(torch.tensor(COUNTS))
    grad = torch.randn(rows, 16, generator=torch.Generator().manual_seed(2))
    want = loop_reference(*inputs, COUNTS)
    want_grads = torch.autograd.grad(want, inputs, grad)
    got = swiglu_with(kernel, *inputs, ends)
    torch.testing.assert_close(got, want, **TOL)
    grads = torch.autograd.grad(got, inputs, grad)
    for name, g, w in zip(("x", "w1", "w3", "w2"), grads, want_grads):
        torch.testing.assert_close(g, w, **TOL, msg=lambda m, n=name: f"{n}: {m}")
    for g in grads[1:]:  # an expert without rows gets a zero gradient (not what the memory held)
        assert all(torch.equal(g[e], torch.zeros_like(g[e])) for e in (1, 4, 6))


@pytest.mark.parametrize("recompute_product", [False, True])
def test_grouped_swiglu_matches_the_loop_and_zeroes_nothing_it_should_not(recompute_product):
    """The chosen kernel (aligned sizes: the CPU's grouped_mm; 6 x 10: the padded fallback), and
    the selective form that computes the SwiGLU product again in backward."""
    for dim, hidden in ((16, 32), (6, 10)):
        inputs = expert_inputs(dim, hidden, sum(COUNTS), seed=dim)
        got = grouped_swiglu(*inputs, group_ends(torch.tensor(COUNTS)), recompute_product)
        want = loop_reference(*inputs, COUNTS)
        torch.testing.assert_close(got, want, **TOL)
        grads = torch.autograd.grad(got.square().sum(), inputs)
        for g, w in zip(grads, torch.autograd.grad(want.square().sum(), inputs)):
            torch.testing.assert_close(g, w, **TOL)


def test_the_kernel_is_chosen_by_device_dtype_and_alignment():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert grouped_kernel(cpu, torch.float32, (128, 128)) is grouped_mm_cpu
    assert grouped_kernel(cpu, torch.bfloat16, (128, 64)) is grouped_mm_cpu
    assert grouped_kernel(cpu, torch.float32, (128, 6)) is padded_grouped_mm  # 24-byte rows
    assert grouped_kernel(cpu, torch.float16, (128, 128)) is padded_grouped_mm
    assert grouped_kernel(cuda, torch.float32, (128, 128)) is padded_grouped_mm  # _grouped_mm is bf16 only there


# ---------------------------------------------------------------- no host sync at ep = 1

SYNCING = {"_local_scalar_dense", "nonzero", "bincount", "masked_select", "unique_consecutive", "_unique2"}


class FailOnHostSync(TorchDispatchMode):
    """Fails on every op that reads a tensor's values on the host (item, tolist: aten._local_scalar_dense)
    or sizes its output from them (nonzero, bincount, masked_select, unique): on a GPU each waits for it."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._overloadpacket.__name__ in SYNCING:
            raise AssertionError(f"host sync in a MoE layer: {func}")
        return func(*args, **(kwargs or {}))


def single_group(cut: str) -> Group:
    return Group(cut, (0,), None, Ledger(), index=0)


def moe_layer(options: MoEOptions | None, model: dict) -> MoE:
    """tiny-moe's MoE layer 1 (seeded like the model); with `options`, under its ep = 1 runtime."""
    args = dataclasses.replace(get_preset("tiny-moe"), **model)
    moe = MoE(args)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    if options is not None:
        moe.runtime = ExpertParallelMoE(moe, options, single_group("ep"), single_group("tp"), False, 1.0)
    return moe


LAYERS = {
    "plain": (None, {}),
    "runtime dropless": (MoEOptions(), {}),
    "runtime capacity + aux, sigmoid": (MoEOptions(capacity_factor=1.0, aux_loss_coef=0.01), {"gate": "sigmoid"}),
}


@pytest.mark.parametrize("layer", list(LAYERS))
def test_no_host_sync_in_forward_and_backward(layer):
    moe = moe_layer(*LAYERS[layer])
    if moe.runtime is not None:
        moe.runtime.recompute_product = layer.startswith("runtime capacity")  # the selective form as well
    x = torch.randn(2, 24, moe.router.weight.shape[1], requires_grad=True)
    with FailOnHostSync():
        moe(x).square().sum().backward()
    assert x.grad is not None and moe.experts.w1.grad is not None


def test_no_host_sync_fails_on_a_sync():
    """The guard itself: a per-expert loop that reads the counts is caught. (On the CPU `tolist`
    reads memory without an op; dynamo refuses it, so the compile test below catches it.)"""
    x, w1, w3, w2 = expert_inputs(16, 32, sum(COUNTS))
    with pytest.raises(AssertionError, match="_local_scalar_dense"), FailOnHostSync():
        loop_reference(x, w1, w3, w2, [int(c) for c in torch.tensor(COUNTS)])


@pytest.mark.parametrize("layer", ["plain", "runtime capacity + aux, sigmoid"])
def test_the_moe_layer_compiles_as_one_graph_with_dynamic_token_counts(layer):
    """torch.compile(fullgraph=True): any sync would break the graph; two batch sizes, one compile.
    The aot_eager backend traces forward and backward as inductor would, without its codegen."""
    moe = moe_layer(*LAYERS[layer])
    compiled = torch.compile(moe, fullgraph=True, dynamic=True, backend="aot_eager")
    for b in (2, 3):
        x = torch.randn(b, 16, moe.router.weight.shape[1], generator=torch.Generator().manual_seed(b))
        grads = []
        for fn in (moe, compiled):
            xi = x.clone().requires_grad_()
            out = fn(xi)
            out.square().sum().backward()
            grads.append((out.detach(), xi.grad, moe.experts.w2.grad.clone()))
            moe.zero_grad()
        for got, want in zip(grads[1], grads[0]):
            torch.testing.assert_close(got, want, **TOL)


def test_capacity_at_one_rank_drops_exactly_the_slots_past_capacity():
    """ep = 1 keeps the dropped slots as rows past the last group: they must add nothing."""
    moe = moe_layer(MoEOptions(capacity_factor=0.5), {})
    x = torch.randn(2, 16, moe.router.weight.shape[1], generator=torch.Generator().manual_seed(3))
    got = moe(x).reshape(32, -1)
    x_flat = x.reshape(32, -1)
    idx, weight, _ = moe.route(x_flat)
    e, k = moe.router.weight.shape[0], idx.shape[1]
    keep = capacity_keep(idx, 2, e, int(0.5 * 16 * k / e + 0.999), torch.zeros(2, e, dtype=torch.long))
    assert not keep.all()
    ex = moe.experts
    want = moe.shared(x_flat).clone()
    for t in range(32):
        for j in range(k):
            if keep[t, j]:
                i = idx[t, j]
                want[t] += weight[t, j] * ((F.silu(x_flat[t] @ ex.w1[i]) * (x_flat[t] @ ex.w3[i])) @ ex.w2[i])
    torch.testing.assert_close(got, want, **TOL)
