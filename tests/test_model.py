"""Single-device model: counts, shapes, causality, init determinism, MoE and GQA
against naive references, gradients, argument validation."""

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fivecut.model.args import ModelArgs
from fivecut.model.presets import PRESETS, SHAPE_ONLY, get_preset
from fivecut.model.transformer import GroupedExperts, MoE, Transformer, build_model


def tokens(args, b=2, s=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, args.vocab_size, (b, s), generator=g)


def count(model):
    return sum(p.numel() for p in model.parameters())  # shared parameters once


# ----- counts ---------------------------------------------------------------


@pytest.mark.parametrize("name", list(PRESETS))
def test_num_params_matches_module(name):
    args = get_preset(name)
    model = build_model(args, device="meta")
    assert args.num_params() == count(model)
    embedding = 0 if args.tie_embeddings else model.tok_embeddings.weight.numel()
    assert args.num_params(embedding=False) == count(model) - embedding


@pytest.mark.parametrize("name", ["tiny", "tiny-gpt2"])
def test_num_params_after_materializing(name):
    args = get_preset(name)
    assert args.num_params() == count(build_model(args))


def test_small_size_and_shape_only_set():
    assert 10e6 <= get_preset("small").num_params() <= 30e6
    assert 0.8e6 <= get_preset("tiny").num_params() <= 1e6
    assert SHAPE_ONLY <= set(PRESETS)


@pytest.mark.parametrize("name, billions", [("llama3-8b", 8.03), ("llama3-70b", 70.55), ("llama3-405b", 405.85)])
def test_shape_only_llama_presets_have_the_published_sizes(name, billions):
    """Hugging Face's model cards of Meta-Llama-3(.1): 8.03B, 70.55B and 405.85B parameters."""
    assert get_preset(name).num_params() / 1e9 == pytest.approx(billions, rel=1e-3)


def test_active_params_and_flops():
    args = get_preset("tiny-moe")
    idle = args.n_experts - args.top_k
    expert = 3 * args.dim * args.expert_dim
    assert args.num_active_params() == args.num_params() - idle * expert * args.n_moe_layers
    dense = get_preset("tiny")
    assert dense.num_active_params() == dense.num_params()
    n = dense.num_params() - dense.vocab_size * dense.dim
    assert dense.flops_per_token(64) == 6 * n + 12 * dense.n_layers * dense.dim * 64


# ----- forward --------------------------------------------------------------


@pytest.mark.parametrize("name", ["tiny", "tiny-moe"])
def test_output_shape_and_causality(name):
    args = get_preset(name)
    model = build_model(args)
    x = tokens(args)
    logits = model(x)
    assert logits.shape == (2, 16, args.vocab_size) and logits.dtype == torch.float32
    y = x.clone()
    y[:, 10] = (y[:, 10] + 1) % args.vocab_size
    changed = model(y)
    torch.testing.assert_close(changed[:, :10], logits[:, :10], rtol=0, atol=1e-6)
    assert not torch.allclose(changed[:, 10], logits[:, 10])


def test_positions_default_and_relative():
    args = get_preset("tiny")
    model = build_model(args)
    x = tokens(args)
    ref = model(x)
    assert torch.equal(model(x, positions=torch.arange(16)), ref)
    # RoPE attention depends only on relative positions: shifting all of them
    # leaves the output unchanged (up to rounding).
    torch.testing.assert_close(model(x, positions=torch.arange(16) + 37), ref, rtol=1e-4, atol=1e-4)
    batched = torch.arange(16).expand(2, 16)
    torch.testing.assert_close(model(x, positions=batched), ref, rtol=0, atol=1e-6)


def test_bf16_build_keeps_rope_fp32():
    args = get_preset("tiny")
    model = build_model(args, dtype=torch.bfloat16)
    assert model.output.weight.dtype == torch.bfloat16 and model.rope_cos.dtype == torch.float32
    assert model(tokens(args)).dtype == torch.bfloat16


# ----- initialization -------------------------------------------------------


def test_init_deterministic_per_seed():
    args = get_preset("tiny-moe")
    a, b, c = build_model(args, seed=3), build_model(args, seed=3), build_model(args, seed=4)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        if not name.endswith("norm.weight"):
            assert not torch.equal(pa, pc), name


def test_init_independent_of_present_modules():
    args = get_preset("tiny-moe")
    full = dict(build_model(args, seed=7).named_parameters())
    with torch.device("meta"):
        part = Transformer(args)
    del part.layers["1"]
    part.tok_embeddings = None
    part.to_empty(device="cpu")
    part.init_weights(7)
    for name, p in part.named_parameters():
        assert torch.equal(p, full[name]), name
    assert torch.isfinite(part.rope_cos).all() and torch.equal(part.rope_cos, build_model(args).rope_cos)


def test_tied_head_same_weights_without_embedding():
    args = get_preset("tiny-gpt2")
    full = build_model(args, seed=1)
    with torch.device("meta"):
        last = Transformer(args)
    last.tok_embeddings = None  # a last pipeline stage keeps only the head
    last.to_empty(device="cpu")
    last.init_weights(1)
    assert torch.equal(last.output.weight, full.output.weight)


def test_tied_embeddings_share_storage():
    model = build_model(get_preset("tiny-gpt2"))
    assert model.output.weight is model.tok_embeddings.weight
    assert model.output.weight.data_ptr() == model.tok_embeddings.weight.data_ptr()
    untied = build_model(get_preset("tiny"))
    assert untied.output.weight is not untied.tok_embeddings.weight


# ----- attention and MoE against naive references ---------------------------


class RepeatedKVCore(nn.Module):
    """Explicit GQA: repeat each kv head, causal softmax by hand."""

    def forward(self, q, k, v, documents=None):  # no document mask here
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)  # [b, n_heads, s, hd]
        scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5  # [b, n_heads, s, s]
        s = q.shape[2]
        mask = torch.ones(s, s, dtype=torch.bool).tril()
        return scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v


def test_gqa_matches_repeat_interleave():
    args = get_preset("tiny")
    assert args.n_kv_heads < args.n_heads
    model = build_model(args)
    x = tokens(args)
    ref = model(x)
    for layer in model.layers.values():
        layer.attention.core = RepeatedKVCore()
    torch.testing.assert_close(model(x), ref, rtol=1e-5, atol=1e-5)


def _shard_linear(linear, rows=None, cols=None):
    w = linear.weight.detach()
    w = w[rows] if rows is not None else w[:, cols]
    out = nn.Linear(w.shape[1], w.shape[0], bias=False)
    out.weight = nn.Parameter(w.clone())
    return out


def test_sizes_come_from_weight_shapes():
    """A tensor-parallel split (heads / hidden columns, then rows) needs no model
    change: the two halves' outputs sum to the full output. Likewise experts."""
    args = get_preset("tiny-moe")
    model = build_model(args)
    x = torch.randn(2, 8, args.dim, generator=torch.Generator().manual_seed(0))
    rope = (model.rope_cos[:8], model.rope_sin[:8])
    attn, ffn = model.layers["0"].attention, model.layers["0"].feed_forward
    q, kv = args.n_heads * args.head_dim // 2, args.n_kv_heads * args.head_dim // 2
    h = args.ffn_dim // 2
    with torch.no_grad():
        halves_attn, halves_ffn = [], []
        for r in range(2):
            a = copy.deepcopy(attn)
            a.wq = _shard_linear(attn.wq, rows=slice(r * q, (r + 1) * q))
            a.wk = _shard_linear(attn.wk, rows=slice(r * kv, (r + 1) * kv))
            a.wv = _shard_linear(attn.wv, rows=slice(r * kv, (r + 1) * kv))
            a.wo = _shard_linear(attn.wo, cols=slice(r * q, (r + 1) * q))
            halves_attn.append(a(x, rope))
            f = copy.deepcopy(ffn)
            f.w1 = _shard_linear(ffn.w1, rows=slice(r * h, (r + 1) * h))
            f.w3 = _shard_linear(ffn.w3, rows=slice(r * h, (r + 1) * h))
            f.w2 = _shard_linear(ffn.w2, cols=slice(r * h, (r + 1) * h))
            halves_ffn.append(f(x))
        torch.testing.assert_close(sum(halves_attn), attn(x, rope), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(sum(halves_ffn), ffn(x), rtol=1e-5, atol=1e-5)
        experts = model.layers["1"].feed_forward.experts
        xs, counts = x.reshape(16, -1), [3, 0, 2, 1, 4, 2, 4, 0]
        full = experts(xs, counts)
        local = GroupedExperts(4, args.dim, args.expert_dim)  # an expert-parallel rank's half
        for n in ("w1", "w2", "w3"):
            getattr(local, n).copy_(getattr(experts, n)[4:])
        torch.testing.assert_close(local(xs[6:], torch.tensor(counts[4:])), full[6:], rtol=0, atol=1e-6)


def naive_moe(moe: MoE, x: torch.Tensor, args: ModelArgs) -> torch.Tensor:
    """Token by token: score, pick top-k, weight, sum the experts, add shared."""
    out = []
    ex = moe.experts
    for xt in x.reshape(-1, x.shape[-1]):
        logits = moe.router.weight @ xt
        scores = logits.softmax(-1) if args.gate == "softmax" else logits.sigmoid()
        idx = (scores + moe.expert_bias).topk(args.top_k).indices
        w = scores[idx]
        if args.gate == "sigmoid" or args.top_k > 1:
            w = w / w.sum()
        w = w * args.route_scale
        y = sum(wi * ((F.silu(xt @ ex.w1[e]) * (xt @ ex.w3[e])) @ ex.w2[e]) for wi, e in zip(w, idx))
        if moe.shared is not None:
            y = y + moe.shared(xt)
        out.append(y)
    return torch.stack(out).view_as(x)


@pytest.mark.parametrize(
    "gate,top_k,scale", [("softmax", 2, 1.0), ("softmax", 1, 1.0), ("sigmoid", 3, 2.5), ("sigmoid", 1, 1.0)]
)
def test_moe_matches_naive_loop(gate, top_k, scale):
    args = dataclasses.replace(get_preset("tiny-moe"), gate=gate, top_k=top_k, route_scale=scale)
    moe = build_model(args).layers["1"].feed_forward
    assert isinstance(moe, MoE) and moe.shared is not None
    if gate == "sigmoid":
        moe.expert_bias.copy_(torch.linspace(-0.05, 0.05, args.n_experts))
    x = torch.randn(2, 8, args.dim, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(moe(x), naive_moe(moe, x, args), rtol=1e-5, atol=1e-5)
    assert moe.tokens_per_expert.sum().item() == 16 * top_k


@pytest.mark.parametrize("name", ["tiny", "tiny-moe"])
def test_gradients_reach_every_parameter(name):
    args = get_preset(name)
    model = build_model(args)
    x = tokens(args)
    logits = model(x)
    F.cross_entropy(logits.flatten(0, 1), torch.roll(x, -1, 1).flatten()).backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), pname
        if "experts" not in pname:  # an expert may receive no token in a tiny batch
            assert p.grad.abs().sum() > 0, pname


# ----- configuration errors -------------------------------------------------


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(dim=130), r"dim \(130\) is not divisible by n_heads \(4\)"),
        (dict(n_kv_heads=3), r"n_heads \(4\) is not divisible by n_kv_heads \(3\)"),
        (dict(dim=120, n_heads=8), r"head_dim .* 15 is odd"),
        (dict(n_experts=4, top_k=5), r"top_k \(5\) exceeds n_experts \(4\)"),
        (dict(first_dense_layers=5), r"first_dense_layers \(5\) exceeds n_layers \(4\)"),
        (dict(gate="relu"), r"gate 'relu'"),
        (dict(vocab_size=0), r"vocab_size must be positive, got 0"),
        (dict(n_experts=-1), r"n_experts must be >= 0"),
    ],
)
def test_validate_refuses(change, match):
    with pytest.raises(ValueError, match=match):
        ModelArgs(**change).check()
    with pytest.raises(ValueError, match=match):
        build_model(ModelArgs(**change))


def test_presets_valid_and_unknown_suggests():
    for args in PRESETS.values():
        assert args.check() is args
    with pytest.raises(ValueError, match=r"'tiny-mo'.*tiny-gpt2.*did you mean 'tiny-moe'"):
        get_preset("tiny-mo")
