"""Pipeline parallelism parity: every schedule's gradients and losses against the single
process, on the real ranks, plus compositions with DP, ZeRO-1 and TP, and the split
backward of the zero-bubble schedules (W from what B kept, `pipeline/wgrad.py`) with each.

Tolerances (fp32): microbatches sum their token losses in a different order than one
batch does, so gradients rtol 1e-5, atol 1e-7 and losses over steps rtol 1e-5. The
single-process W test compares B + W with one autograd backward of the same layers:
the same products in the same order, so rtol 1e-6.
"""

from __future__ import annotations

import copy
import functools
from collections import Counter

import pytest
import torch
from test_ddp import GRAD_TOL, assert_same_run, single_process_run, small_config
from torch import nn

from fivecut.launch import spawn
from fivecut.parallel.pipeline.executor import release
from fivecut.parallel.pipeline.wgrad import DeferredLinear, WeightGrads, defer_weight_grads
from fivecut.train.run import forward_backward, setup

W_TOL = dict(rtol=1e-6, atol=1e-8)


def step_gradients(cfg):
    """Gradients of step 1 by parameter name (stage prefixes removed), on this rank."""
    ctx = setup(cfg)
    ctx.par.sync.zero_grad()
    forward_backward(ctx, 1)
    grads = {}
    for name, p in ctx.par.module.named_parameters():
        if ctx.par.pipeline is not None:
            name = name.split(".", 1)[1]  # "3.layers.3.attention..." -> "layers.3.attention..."
        grads[name] = p.grad.clone()
    return grads


def gradients(cfg, world: int) -> dict[str, torch.Tensor]:
    merged: dict[str, torch.Tensor] = {}
    for grads in spawn(step_gradients, world, cfg):
        merged.update(grads)
    return merged


@functools.cache
def single_process_gradients(cache_dir: str) -> dict[str, torch.Tensor]:
    return gradients(small_config(cache_dir), 1)


@pytest.mark.multirank
@pytest.mark.parametrize(
    "schedule",
    [
        ('pp_schedule="gpipe"', "microbatches=4"),
        ('pp_schedule="1f1b"', "microbatches=4"),
        ('pp_schedule="interleaved"', "pp_virtual=2", "microbatches=4"),
        ('pp_schedule="zb1p"', "microbatches=4"),
        ('pp_schedule="dualpipev"', "microbatches=4"),
    ],
)
def test_every_schedule_reproduces_single_process_gradients(schedule, byte_cache, tmp_path):
    reference = single_process_gradients(byte_cache)
    cfg = small_config(
        byte_cache, "parallel.pp=2", *(f"parallel.{item}" for item in schedule), f'log.out_dir="{tmp_path}/p"'
    )
    pipelined = gradients(cfg, 2)
    assert pipelined.keys() == reference.keys()
    for name, g in reference.items():
        torch.testing.assert_close(pipelined[name], g, **GRAD_TOL, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.multirank
@pytest.mark.parametrize(
    "layout",
    [
        ("parallel.pp=4", "parallel.microbatches=8", "train.global_batch=8"),
        ("parallel.pp=2", "parallel.dp=2", "parallel.microbatches=2"),
        ("parallel.pp=2", "parallel.dp=2", "parallel.zero=1", "parallel.microbatches=2", "train.accumulate=2"),
        ("parallel.pp=2", "parallel.tp=2", "parallel.sp=true", "parallel.microbatches=2"),
        ("parallel.pp=2", 'parallel.pp_schedule="zb1p"', "parallel.microbatches=4", "parallel.pp_layers=[1,3]"),
    ],
)
def test_losses_over_steps(layout, byte_cache, tmp_path):
    cfg = small_config(byte_cache, *layout, f'log.out_dir="{tmp_path}/p"')
    assert_same_run(cfg, single_process_run(byte_cache), ",".join(layout))


@pytest.mark.multirank
@pytest.mark.parametrize("schedule", ['"1f1b"', '"dualpipev"'])
def test_tied_embeddings_across_or_on_one_rank(schedule, tmp_path, byte_cache):
    """GPT-2 vocabulary, tied embedding: 1F1B keeps a copy on each end (gradients summed over the
    two ranks, counted once in the clip norm); DualPipeV puts both ends on rank 0 (one Parameter)."""
    gpt2 = (
        'model.preset="tiny-gpt2"',
        "model.n_layers=4",
        'data.tokenizer="gpt2"',
        "train.steps=3",
        "train.grad_clip=0.5",
    )
    reference = single_process_run(byte_cache, *gpt2)
    cfg = small_config(
        byte_cache,
        *gpt2,
        "parallel.pp=2",
        f"parallel.pp_schedule={schedule}",
        "parallel.microbatches=4",
        f'log.out_dir="{tmp_path}/p"',
    )
    assert min(reference[1]) > 0.5  # the clip is active at every step
    assert_same_run(cfg, reference, schedule)


# ---------------------------------------------------------------- the split backward (B, then W)


def two_layers(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16, bias=False), nn.Tanh(), nn.Linear(16, 4), nn.LayerNorm(4))


def test_w_computes_what_b_deferred_and_fires_the_hooks_then():
    """B gives the input's gradient and the gradients of what is not a linear weight (the
    LayerNorm, a bias); the linear weights get theirs at W only, with their post-accumulate
    hooks (the data cut's signal) firing then, and equal to one plain backward's."""
    plain, split, grads = two_layers(0), two_layers(0), WeightGrads()
    assert defer_weight_grads(split, grads) == 2 and isinstance(split[0], DeferredLinear)
    fired = Counter()
    for name, p in split.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, n=name: fired.update([n]))
    x = torch.randn(3, 5, 8)
    x_plain, x_split = x.clone().requires_grad_(), x.clone().requires_grad_()
    plain(x_plain).square().sum().backward()
    with grads.collecting(stage=0, microbatch=0):  # B
        split(x_split).square().sum().backward()
    torch.testing.assert_close(x_split.grad, x_plain.grad, **W_TOL)
    assert split[0].weight.grad is None and split[2].weight.grad is None
    assert set(fired) == {"2.bias", "3.weight", "3.bias"}
    grads.apply(stage=0, microbatch=0)  # W
    assert fired["0.weight"] == fired["2.weight"] == 1 and not grads.pending
    for (name, p), q in zip(split.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **W_TOL, msg=lambda m, n=name: f"{n}: {m}")


class TiedLookup(nn.Module):
    """An embedding, a projection and a head tied to the embedding (dualpipev's rank 0 holds both ends)."""

    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.embedding, self.proj, self.head = nn.Embedding(11, 8), nn.Linear(8, 8, bias=False), nn.Linear(8, 11)
        self.head.weight = self.embedding.weight

    def forward(self, ids):
        return self.head(torch.tanh(self.proj(self.embedding(ids))))  # [b, s, 11]


def test_w_computes_the_embedding_rows_b_deferred():
    """The embedding's gradient (rows hit by several tokens, and a head tied to it) comes at W
    only, with its hook firing once, bitwise equal to one plain backward's (the same op)."""
    plain, split, grads = TiedLookup(2), TiedLookup(2), WeightGrads()
    assert defer_weight_grads(split, grads) == 3
    fired = Counter()
    for name, p in split.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, n=name: fired.update([n]))
    ids = torch.tensor([[1, 3, 3, 7], [0, 3, 10, 1]])  # [b, s], rows repeat
    plain(ids).square().sum().backward()
    with grads.collecting(stage=0, microbatch=0):  # B: nothing but the head's bias
        split(ids).square().sum().backward()
    assert split.embedding.weight.grad is None and set(fired) == {"head.bias"}
    grads.apply(stage=0, microbatch=0)  # W
    assert fired["embedding.weight"] == 1 and not grads.pending
    for (name, p), q in zip(split.named_parameters(), plain.parameters()):
        assert torch.equal(p.grad, q.grad), name


def test_a_later_microbatch_adds_only_its_rows_bitwise():
    """Once `.grad` exists, W adds an untied embedding's rows as a sparse gradient into it in
    place: after two microbatches the gradient is dense, the hook fired twice, and it is
    bitwise two plain backwards' (repeated rows summed in token order either way)."""
    torch.manual_seed(4)
    plain = nn.Sequential(nn.Embedding(13, 8), nn.Linear(8, 3, bias=False))
    split, grads = copy.deepcopy(plain), WeightGrads()
    defer_weight_grads(split, grads)
    fired = Counter()
    split[0].weight.register_post_accumulate_grad_hook(lambda p: fired.update(["embedding"]))
    batches = [torch.tensor([[2, 5, 5, 9]]), torch.tensor([[5, 0, 2, 2]])]  # [b, s], rows repeat
    for m, ids in enumerate(batches):
        plain(ids).square().sum().backward()
        with grads.collecting(stage=0, microbatch=m):
            split(ids).square().sum().backward()
        grads.apply(stage=0, microbatch=m)
    assert fired["embedding"] == 2 and not split[0].weight.grad.is_sparse
    for p, q in zip(split.parameters(), plain.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_a_backward_outside_b_computes_every_gradient():
    """Outside a split B (a full backward), a `DeferredLinear` is an `nn.Linear`."""
    plain, split = two_layers(1), two_layers(1)
    defer_weight_grads(split, WeightGrads())
    x = torch.randn(2, 8)
    plain(x).sum().backward()
    split(x).sum().backward()
    for p, q in zip(split.parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **W_TOL)


SPLIT = ("parallel.pp=2", "parallel.microbatches=4")


@pytest.mark.multirank
def test_split_backward_with_data_parallel_gives_every_gradient(byte_cache, tmp_path):
    """dualpipev with DDP over dp=2: each rank's gradients after the reduction, which starts
    after the last W, are the single process's (every parameter, both dp ranks)."""
    reference = single_process_gradients(byte_cache)
    cfg = small_config(
        byte_cache, *SPLIT, 'parallel.pp_schedule="dualpipev"', "parallel.dp=2", f'log.out_dir="{tmp_path}/p"'
    )
    results = spawn(step_gradients, 4, cfg)  # each rank: its stage's parameters
    assert set().union(*(grads.keys() for grads in results)) == reference.keys()
    for grads in results:
        for name, g in grads.items():
            torch.testing.assert_close(g, reference[name], **GRAD_TOL, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.multirank
@pytest.mark.sweep
@pytest.mark.parametrize(
    "layout",
    [
        ('parallel.pp_schedule="zb1p"', "parallel.tp=2", "parallel.sp=true"),
        ('parallel.pp_schedule="dualpipev"', "parallel.dp=2", "parallel.zero=1"),
    ],
)
def test_split_backward_composes(layout, byte_cache, tmp_path):
    cfg = small_config(byte_cache, *SPLIT, *layout, f'log.out_dir="{tmp_path}/p"')
    assert_same_run(cfg, single_process_run(byte_cache), ",".join(layout))


@pytest.mark.multirank
@pytest.mark.sweep
def test_split_backward_with_expert_parallel(byte_cache, tmp_path):
    """tiny-moe, zb1p over pp=2 with ep=2 (dp=2): the experts' gradients come in B, the
    projections' and the router's in W."""
    moe = ('model.preset="tiny-moe"',)
    cfg = small_config(
        byte_cache, *moe, *SPLIT, 'parallel.pp_schedule="zb1p"', "parallel.dp=2", "parallel.ep=2",
        f'log.out_dir="{tmp_path}/p"',
    )  # fmt: skip
    assert_same_run(cfg, single_process_run(byte_cache, *moe), "tiny-moe zb1p ep=2")


def ledger_and_gradients(cfg) -> tuple[dict, dict]:
    """One step's ledger rows, (cut, op, phase) -> (calls, bytes), and gradients on this rank."""
    ctx = setup(cfg)
    ctx.par.sync.zero_grad()
    ctx.mesh.ledger.begin_step(1)
    forward_backward(ctx, 1)
    rows = {(r.cut, r.op, r.phase): (r.calls, r.bytes) for r in ctx.mesh.ledger.rows()}
    return rows, {name: p.grad.clone() for name, p in ctx.par.module.named_parameters()}


@pytest.mark.multirank
def test_split_backward_repeats_no_collective(byte_cache, tmp_path):
    """tp=2, sp, pp=2: zb1p's ledger (every rank) holds exactly 1F1B's rows, calls and bytes
    (with W as a second backward through the stage, TP's backward collectives ran twice), and
    its gradients (TP shards, every rank) are 1F1B's."""
    layout, out = (*SPLIT, "parallel.tp=2", "parallel.sp=true"), f'log.out_dir="{tmp_path}/p"'
    runs = {
        name: spawn(ledger_and_gradients, 4, small_config(byte_cache, *layout, f"parallel.pp_schedule={name}", out))
        for name in ('"1f1b"', '"zb1p"')
    }
    assert any(cut == "tp" and phase == "backward" for cut, _, phase in runs['"1f1b"'][0][0])
    for (rows, grads), (rows_1f1b, grads_1f1b) in zip(runs['"zb1p"'], runs['"1f1b"']):
        assert rows == rows_1f1b
        for name, g in grads_1f1b.items():
            torch.testing.assert_close(grads[name], g, **GRAD_TOL, msg=lambda m, n=name: f"{n}: {m}")


def test_a_sent_output_is_let_go_and_its_backward_is_the_same():
    """A block's output (a residual add) keeps nothing for backward: `release` frees its memory
    (a one-element stride-0 stand-in of its shape) and B gives the same gradients bitwise; an
    output whose op keeps it (tanh) is left whole."""
    torch.manual_seed(0)
    x, w = torch.randn(2, 3, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)
    dy = torch.randn(2, 3, 8)

    def block(x, w):
        h = x @ w
        return h + h.relu()  # [b, s, h], AddBackward0

    reference = torch.autograd.grad(block(x, w), (x, w), dy)
    out = block(x, w)
    release(out)
    assert out.shape == (2, 3, 8) and out.untyped_storage().nbytes() == 4
    torch.autograd.backward(out, dy)
    assert torch.equal(x.grad, reference[0]) and torch.equal(w.grad, reference[1])
    kept = torch.tanh(x @ w)  # TanhBackward0 reads its output
    release(kept)
    assert kept.untyped_storage().nbytes() == 2 * 3 * 8 * 4
