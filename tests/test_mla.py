"""Multi-head latent attention (DeepSeek-V2/V3's MLA): the published counts of `deepseek-v3`, the
module's math against an explicit reference, cached decoding, the cuts (TP with and without SP,
PP, ZeRO-3, and the sequence cut: ring, Ulysses, USP) against one process, the refusals, and the
ledger's closed forms."""

from __future__ import annotations

import dataclasses
import json
import math
import types

import pytest
import torch
from safetensors.torch import load_file
from test_bad_input import refused, train_argv
from test_ddp import assert_same_run, single_process_run, small_config
from test_e2e import assert_activations_exact, assert_every_cut_exact, assert_memory_exact
from test_export import run_config, train_here
from test_tensor import TOL, reference, tensor_parallel_step

from fivecut.cli import main
from fivecut.launch import spawn
from fivecut.layout import ParallelDims
from fivecut.mesh import Mesh
from fivecut.model.args import ModelArgs
from fivecut.model.decode import decode, new_cache
from fivecut.model.presets import get_preset
from fivecut.model.transformer import CausalSDPA, LatentAttention, build_model, rope_tables
from fivecut.parallel.context import RingAttention, zigzag_positions
from fivecut.train import checkpoint
from fivecut.weights import export
from fivecut.weights.load import source_args

MLA = 'model.preset="tiny-mla"'


# ---------------------------------------------------------------- counts


def test_deepseek_v3_counts_are_the_published_ones():
    """DeepSeek-V3's report: 671B parameters, 37B activated per token (the 14B of the multi-token
    prediction module left out). Counting MLA's shapes gives 671.03B in all, and 37.55B activated
    with the token embedding (a lookup) or 36.63B without it: the published 37B lies between, 1.5%
    above and 1.0% below; the planner counts compute without the lookup."""
    args = get_preset("deepseek-v3").check()
    assert args.is_mla and args.qk_head_dim == 192 and args.value_head_dim == 128
    assert args.num_params() == pytest.approx(671e9, rel=0.01)
    assert args.num_params() == 671_026_404_352
    assert args.num_active_params(embedding=False) == pytest.approx(37e9, rel=0.0102)
    assert args.num_active_params() == 37_552_282_624
    per_layer = sum(args.mla_shapes().values())  # wq_a, q_norm, wq_b, wkv_a, kv_norm, wkv_b, wo
    assert per_layer == 7168 * 1536 + 1536 + 1536 * 128 * 192 + 7168 * 576 + 512 + 512 * 128 * 256 + 128 * 128 * 7168


def test_analytic_counts_match_the_module_without_a_query_latent():
    args = dataclasses.replace(get_preset("tiny-mla"), q_lora_rank=0)
    model = build_model(args, device="meta")
    assert args.num_params() == sum(p.numel() for p in model.parameters())
    assert not hasattr(model.layers["0"].attention, "wq_a")


# ---------------------------------------------------------------- the module's math


def rotate(x: torch.Tensor, position: int, theta: float) -> torch.Tensor:
    """RoPE of one vector x [r] at `position`, pairs (i, i + r/2), written out."""
    r = x.shape[-1]
    out = x.clone()
    for i in range(r // 2):
        angle = position * theta ** (-2 * i / r)
        a, b = x[i], x[i + r // 2]
        out[i] = a * math.cos(angle) - b * math.sin(angle)
        out[i + r // 2] = a * math.sin(angle) + b * math.cos(angle)
    return out


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * weight


def reference_mla(attn: LatentAttention, args, x: torch.Tensor) -> torch.Tensor:
    """Token by token, head by head: x [s, dim] -> [s, dim], with explicit softmax and masking."""
    s, heads = x.shape[0], args.n_heads
    nope, r, v_dim = args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim
    if args.q_lora_rank:
        q = rms(x @ attn.wq_a.weight.T, attn.q_norm.weight, args.norm_eps) @ attn.wq_b.weight.T
    else:
        q = x @ attn.wq.weight.T
    q = q.view(s, heads, nope + r)
    latent = x @ attn.wkv_a.weight.T  # [s, kv_lora + r]
    c, k_pe = latent[:, : args.kv_lora_rank], latent[:, args.kv_lora_rank :]
    kv = (rms(c, attn.kv_norm.weight, args.norm_eps) @ attn.wkv_b.weight.T).view(s, heads, nope + v_dim)
    out = torch.zeros(s, heads, v_dim)
    for head in range(heads):
        for i in range(s):
            qi = torch.cat([q[i, head, :nope], rotate(q[i, head, nope:], i, args.rope_theta)])
            scores = torch.stack(
                [qi @ torch.cat([kv[j, head, :nope], rotate(k_pe[j], j, args.rope_theta)]) for j in range(i + 1)]
            ) / math.sqrt(nope + r)
            weights = torch.exp(scores - scores.max())
            weights = weights / weights.sum()
            out[i, head] = sum(weights[j] * kv[j, head, nope:] for j in range(i + 1))
    return out.reshape(s, heads * v_dim) @ attn.wo.weight.T


@pytest.mark.parametrize("q_lora_rank", [48, 0])
def test_module_matches_an_explicit_reference(q_lora_rank):
    args = dataclasses.replace(get_preset("tiny-mla"), q_lora_rank=q_lora_rank, init_std=0.3)
    model = build_model(args, seed=3)
    attn = model.layers["0"].attention
    x = torch.randn(1, 9, args.dim, generator=torch.Generator().manual_seed(0))
    cos, sin = rope_tables(dataclasses.replace(args, max_seq_len=9))
    with torch.no_grad():
        got = attn(x, (cos, sin))[0]
        want = reference_mla(attn, args, x[0])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_cached_decoding_matches_the_full_forward():
    model = build_model(get_preset("tiny-mla"), seed=1)
    x = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(x)
    cache = new_cache(model, batch=2, max_len=16)
    parts = [decode(model, x[:, a:b], cache) for a, b in ((0, 7), (7, 9), (9, 10), (10, 12))]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- the cuts against one process


DENSE_MLA = dataclasses.replace(get_preset("tiny-mla"), n_experts=0, first_dense_layers=0)


@pytest.mark.multirank
@pytest.mark.parametrize("sp, q_lora_rank", [(False, 48), (True, 48), (True, 0)])
def test_tensor_parallel_forward_and_every_gradient(sp, q_lora_rank):
    """tp=2 on a dense tiny-mla: heads cut (wq_b or wq, wkv_b, wo), latents replicated; every
    gradient, gathered, is one process's (the latent weights' only after their sum over tp)."""
    args = dataclasses.replace(DENSE_MLA, q_lora_rank=q_lora_rank)
    ref_logits, ref_grads = reference(args)
    for logits, grads in spawn(tensor_parallel_step, 2, args, 2, sp):
        torch.testing.assert_close(logits, ref_logits, **TOL)
        assert grads.keys() == ref_grads.keys()
        for name, g in ref_grads.items():
            torch.testing.assert_close(grads[name], g, **TOL, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.multirank
@pytest.mark.parametrize(
    "layout",
    [
        ("parallel.tp=2", "parallel.sp=true"),
        ("parallel.pp=2", "parallel.microbatches=2"),
        ("parallel.dp=2", "parallel.zero=3"),
    ],
)
def test_losses_and_gradient_norms_over_steps(layout, byte_cache, tmp_path):
    cfg = small_config(byte_cache, MLA, *layout, f'log.out_dir="{tmp_path}/l"')
    assert_same_run(cfg, single_process_run(byte_cache, MLA), ",".join(layout))


# ---------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    "overrides, named",
    [
        (("model.v_head_dim=32",), "v_head_dim"),
        (("model.n_kv_heads=2",), "n_kv_heads"),
        (("model.qk_rope_head_dim=7",), "qk_rope_head_dim"),
        (("model.qk_nope_head_dim=0",), "qk_nope_head_dim"),
        (('model.preset="tiny"', "model.q_lora_rank=16"), "model.q_lora_rank"),
    ],
)
def test_bad_latent_attention_input_is_refused(capsys, tmp_path, overrides, named):
    err = refused(capsys, train_argv(tmp_path, MLA, *overrides))
    assert named in err


# ---------------------------------------------------------------- the ledger


@pytest.mark.multirank
def test_ledger_closed_forms_are_exact_under_tp_and_sp(capsys):
    """`fivecut ledger --model tiny-mla --layout tp=2,sp=true`: communication, model states and
    the activations of the MoE block all as measured."""
    assert main(["ledger", "--model", "tiny-mla", "--layout", "tp=2,sp=true"]) == 0
    out = capsys.readouterr().out
    assert_every_cut_exact(out)
    assert_memory_exact(out)
    assert_activations_exact(out)


# ---------------------------------------------------------------- weights out and in


def test_a_dense_mla_model_exports_and_imports_under_fivecut_names(byte_cache, tmp_path):
    """No Hugging Face Llama class reads MLA: the export keeps fivecut's names and ModelArgs, and
    `init_from = "hf:..."` reads the same shape back (every tensor checked against it)."""
    mla = ("model.kv_lora_rank=32", "model.n_kv_heads=4", "model.qk_nope_head_dim=16")
    mla += ("model.qk_rope_head_dim=8", "model.v_head_dim=24", "model.q_lora_rank=0")
    root = train_here(run_config(byte_cache, tmp_path, "tiny", "byte", *mla))
    out = export.export(root, tmp_path / "hf")
    config = json.loads((out / "config.json").read_text())
    args = ModelArgs(**checkpoint.read_meta(checkpoint.newest(root))["model"])
    assert config["model_type"] == "fivecut" and args.is_mla and not args.is_moe
    exported = load_file(out / "model.safetensors")
    saved = checkpoint.full_state(checkpoint.newest(root))
    assert exported.keys() == saved.keys() and "layers.0.attention.wkv_b.weight" in exported
    for name, tensor in saved.items():
        assert torch.equal(exported[name], tensor), name
    assert source_args(f"hf:{out}") == args


# ---------------------------------------------------------------- the sequence cut (issue 35)

# q, k [b, H, s, nope + rope] and v [b, H, s, v_dim] with v narrower, as tiny-mla's (24 and 12)
LATENT_SHAPE = {"b": 2, "heads": 4, "qk": 24, "v": 12, "seq": 32}
RING_TOL = {"rtol": 1e-5, "atol": 2e-6}  # as tests/test_context.py: block sums in another order


def latent_inputs():
    g = torch.Generator().manual_seed(3)
    b, h, qk, v, s = LATENT_SHAPE.values()
    return [torch.randn(shape, generator=g) for shape in ((b, h, s, qk), (b, h, s, qk), (b, h, s, v), (b, h, s, v))]


def latent_ring_run(cp: int):
    """Each rank's zigzag positions, the ring's output and its q, k, v gradients, on MLA's shapes."""
    group = Mesh(ParallelDims(cp=cp, cp_mode="ring"), "cpu").group("cp")
    q, k, v, grad = latent_inputs()
    positions = zigzag_positions(group.rank, cp, q.shape[2] // cp)
    q, k, v = (t[:, :, positions].clone().requires_grad_() for t in (q, k, v))
    out = RingAttention(group)(q, k, v)
    out.backward(grad[:, :, positions])
    return positions, out.detach(), q.grad, k.grad, v.grad


@pytest.mark.multirank
def test_ring_attention_takes_a_value_head_narrower_than_the_keys():
    """K and V travel side by side ([.., nope + rope + v_dim] a message), V is zero-padded for the
    fused kernel and the padding cut off: each rank's output and q, k, v gradients equal one
    device's (`CausalSDPA`, the model's own core)."""
    q, k, v, grad = (t.clone().requires_grad_() for t in latent_inputs())
    out = CausalSDPA()(q, k, v)
    out.backward(grad.detach())
    expected = (out.detach(), q.grad, k.grad, v.grad)
    for rank, (positions, *got) in enumerate(spawn(latent_ring_run, 2, 2)):
        assert got[0].shape[-1] == LATENT_SHAPE["v"] and got[3].shape[-1] == LATENT_SHAPE["v"]
        for name, a, want in zip(("out", "dq", "dk", "dv"), got, expected):
            msg = lambda m, n=name, r=rank: f"rank {r} {n}: {m}"  # noqa: E731
            torch.testing.assert_close(a, want[:, :, positions], **RING_TOL, msg=msg)


def test_ring_attention_keeps_no_padded_output_for_backward():
    """What the ring keeps for backward on MLA's shapes (value heads narrower than the keys): q, k, v,
    its output cut to the value width [b, H, s, v] and the log-sum-exps [b, H, s], each storage once,
    nothing else. Caught: the output cut as a view of the padded [b, H, s, qk] merge (`value_width`
    without its copy), which keeps the padding alive until backward with every value unchanged.
    One rank's forward: a ring of one posts no message, so no process group is needed."""
    q, k, v, _ = (t.requires_grad_() for t in latent_inputs())
    b, h, qk, v_dim, s = LATENT_SHAPE.values()
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = RingAttention(types.SimpleNamespace(size=1, rank=0))(q, k, v)
    assert out.shape == (b, h, s, v_dim)
    torch.testing.assert_close(out, CausalSDPA()(q, k, v), **RING_TOL)
    assert sum(storages.values()) == 4 * (q.numel() + k.numel() + v.numel() + b * h * s * v_dim + b * h * s)


CP_LAYOUTS = [
    "cp=2,cp_mode=ring",
    pytest.param("cp=2,cp_mode=ulysses", marks=pytest.mark.sweep),
    pytest.param("cp=4,cp_mode=usp,cp_ulysses=2", marks=pytest.mark.sweep),
]


@pytest.mark.multirank
@pytest.mark.parametrize("layout", CP_LAYOUTS)
def test_verify_passes_under_context_parallelism(capsys, byte_cache, layout):
    """`fivecut verify --model tiny-mla` under ring, Ulysses and USP (U=2): losses and gradient norms
    over 5 steps equal the single process's."""
    argv = ["verify", "--model", "tiny-mla", "--layout", layout, "--steps", "5"]
    code = main([*argv, "--set", f'data.cache_dir="{byte_cache}"'])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert code == 0 and last.startswith("PASS"), last


@pytest.mark.multirank
@pytest.mark.sweep
@pytest.mark.parametrize("layout", ["cp=2,cp_mode=ring", "cp=2,cp_mode=ulysses", "cp=4,cp_mode=usp,cp_ulysses=2"])
@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_ledger_is_exact_under_context_parallelism(capsys, byte_cache, layout, recompute):
    """`fivecut ledger --model tiny-mla`: the cp all-to-alls and ring passes (q/k heads of nope + rope
    channels, v and o heads of v_dim) and the saved activations equal the closed forms."""
    argv = ["ledger", "--model", "tiny-mla", "--layout", layout, "--set", f'train.recompute="{recompute}"']
    assert main([*argv, "--set", f'data.cache_dir="{byte_cache}"']) == 0
    out = capsys.readouterr().out
    assert_every_cut_exact(out)
    assert_memory_exact(out)
    assert_activations_exact(out)
