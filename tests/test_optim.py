"""The optimizer step: AdamW's kernel (fused where torch has one), the multi-tensor gradient norm
and clipping, and a training path that starts without the optional `gguf` package."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fivecut import checks
from fivecut.config import ConfigError, load_config
from fivecut.parallel.data import Piece
from fivecut.train.optim import adamw_kernel, build_optimizer, clip_gradients, grad_norm

REPO = Path(__file__).resolve().parents[1]
ADAMW = dict(lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)


def pieces_of(seed: int, weights=(1.0, 1.0, 0.5)) -> list[Piece]:
    """Three tensors of uneven sizes with gradients; the last counts half (a copy on two ranks)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, (shape, weight) in enumerate(zip([(7, 5), (13,), (3, 4, 2)], weights)):
        t = torch.nn.Parameter(torch.randn(shape, generator=g))
        t.grad = torch.randn(shape, generator=g)
        out.append(Piece(t, decays=i != 1, norm_weight=weight))
    return out


def test_auto_is_fused_on_the_cpu_and_foreach_is_kept_when_asked():
    assert adamw_kernel("auto", torch.device("cpu")) == ("fused", None)
    assert adamw_kernel("fused", torch.device("cpu")) == ("fused", None)
    assert adamw_kernel("foreach", torch.device("cpu")) == ("foreach", None)


def test_fused_where_torch_has_none_falls_back_and_says_so_once():
    kernel, note = adamw_kernel("fused", torch.device("meta"))
    assert kernel == "foreach" and "train.adamw" in note and "meta" in note
    assert adamw_kernel("auto", torch.device("meta")) == ("foreach", None)  # nothing was asked for: nothing to say


@pytest.mark.parametrize("kernel", ["fused", "foreach"])
def test_build_optimizer_runs_the_kernel_it_was_given(kernel):
    optimizer = build_optimizer(pieces_of(0), **ADAMW, kernel=kernel)
    assert all(group[kernel] for group in optimizer.param_groups)


def test_fused_and_foreach_adamw_take_the_same_steps():
    """fp32: the two kernels do the same arithmetic per element, to rounding."""
    runs = []
    for kernel in ("fused", "foreach"):
        pieces = pieces_of(0)
        optimizer = build_optimizer(pieces, **ADAMW, kernel=kernel)
        for step in range(3):
            for p, fresh in zip(pieces, pieces_of(step + 1)):
                p.tensor.grad = fresh.tensor.grad
            optimizer.step()
        runs.append([p.tensor.detach().clone() for p in pieces])
    for a, b in zip(*runs):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_gradient_norm_counts_each_piece_by_its_weight():
    pieces = pieces_of(0)
    expected = sum(p.norm_weight * p.tensor.grad.double().pow(2).sum() for p in pieces).sqrt()
    assert float(grad_norm(pieces, groups=[])) == pytest.approx(float(expected), rel=1e-6)


def test_clipping_scales_every_gradient_to_the_limit():
    pieces = pieces_of(0, weights=(1.0, 1.0, 1.0))
    before = [p.tensor.grad.clone() for p in pieces]
    norm = clip_gradients(pieces, max_norm=0.5, groups=[])
    assert norm > 0.5
    for p, g in zip(pieces, before):
        torch.testing.assert_close(p.tensor.grad, g * (0.5 / (norm + 1e-6)), rtol=1e-6, atol=0)
    assert float(grad_norm(pieces, groups=[])) == pytest.approx(0.5, rel=1e-5)


def test_training_starts_without_the_gguf_package(tmp_path):
    """A bare GPU image has torch, transformers, tokenizers, tiktoken, safetensors, but no gguf:
    `fivecut train` must import it only where a GGUF file is read."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 400)
    overrides = [
        f'data.source="{corpus}"',
        'data.tokenizer="byte"',
        f'data.cache_dir="{tmp_path / "cache"}"',
        f'log.out_dir="{tmp_path / "run"}"',
        "train.steps=2",
        "train.seq_len=16",
        "train.global_batch=2",
        "train.warmup=1",
        "train.eval_every=0",
        "log.progress=false",
        "log.plot=false",
    ]
    argv = ["train"] + [a for o in overrides for a in ("--set", o)]
    code = f"import sys; sys.modules['gguf'] = None; from fivecut.cli import main; sys.exit(main({argv!r}))"
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert (tmp_path / "run" / "metrics.jsonl").exists()


def test_an_unknown_adamw_kernel_is_refused_naming_the_key_and_the_choices():
    cfg = load_config(overrides=['train.adamw="fast"'])
    with pytest.raises(ConfigError, match=r"train.adamw='fast'; choose auto, fused, foreach"):
        checks.validate(cfg, 1)


def test_the_cpu_gradient_norm_stays_accurate_on_large_tensors():
    """torch's CPU norm kernel loses ~6e-5 at 3M elements; the layouts' parity needs better."""
    g = torch.randn(3_000_000, generator=torch.Generator().manual_seed(0)) * 1e-2
    piece = Piece(torch.nn.Parameter(torch.zeros_like(g)), decays=True)
    piece.tensor.grad = g
    assert float(grad_norm([piece], groups=[])) == pytest.approx(float(g.double().norm()), rel=1e-6)
