"""Whether a Hugging Face folder imports into fivecut as the model transformers builds from it
(`fivecut check-import`): the automatic form of a hand-kept compatibility table.

Whole (when both models fit in host memory): both models are built from the folder on this
machine's CPU -- fivecut's by its importer (`single_model`, the path every run's
`model.init_from = "hf:..."` takes), transformers' by `AutoModelForCausalLM.from_pretrained` -- and
run on the same random token batch. Compared:

    each decoder layer's output [b, s, dim]   to name the first layer that differs
    the logits [b, s, V]                      largest absolute difference, and the largest relative
                                              one: max |ours - theirs| / max |theirs|
    the next-token distributions              KL(transformers || fivecut) per token, mean and max

Layer by layer (a model too large for host memory, or asked for): one decoder layer of each kind,
alone (`fivecut.weights.layer_check`).

In fp32 the two differ only in the order of operations: 1e-5. In bf16 -- fivecut under autocast over
fp32 weights as training runs, transformers with bf16 weights -- `bf16_rtol` of the depth; and since
a router near a tie may flip in either bf16 model, fivecut's bf16 also passes when it lies within that
tolerance of transformers' fp32 model (the function both approximate).

A difference is scaled by the largest magnitude of transformers' tensor (not element by element:
a logit near zero would make any rounding look large). transformers is imported only here, and
only when a check runs: a training image without it still imports fivecut.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from fivecut.weights.layer_check import (
    LayerResult,
    cannot_build,
    compare_layers,
    import_transformers,
    precision,
    relative,
)
from fivecut.weights.load import single_model, source_args, source_of
from fivecut.weights.source import WeightsError

FP32_RTOL = 1e-5  # fp32: the two models differ only in the order of floating-point operations
BF16_UNIT = 2.0**-8  # bf16's unit roundoff: 8 significant bits (7 stored, 1 implied), round to nearest


def bf16_rtol(depth: int) -> float:
    """The bf16 tolerance after `depth` decoder layers: 4 u sqrt(2 depth). Each rounding to bf16 moves a
    value by at most u = 2^-8 relative; two implementations round at different places (fused kernels,
    the order of sums, which ops run in fp32), so their difference is a sum of independent rounding
    errors, one per residual branch (two a layer), growing as a random walk: u sqrt(2 depth) in a
    typical entry; the largest of b * s * V logits lies a few of those out, hence the 4. 3.1e-2 at 2
    layers, 0.15 at 46 (GLM-4.5-Air), 0.22 at 94."""
    return 4 * BF16_UNIT * math.sqrt(2 * depth)


@dataclass(frozen=True)
class Comparison:
    hf_class: str
    n_layers: int
    tokens: tuple[int, int]  # [b, s] of the random batch
    layers: list[float]  # each decoder layer's output: largest relative difference
    max_abs: float  # logits
    max_rel: float  # logits, scaled by max |theirs|
    kl_mean: float  # KL(transformers || fivecut) of the next-token distributions, per token
    kl_max: float
    dtype: str = "fp32"
    # bf16: how far each model's bf16 logits lie from transformers' fp32 ones (fivecut's, transformers'), relative
    from_fp32: tuple[float, float] | None = None

    def tolerance(self, depth: int, rtol: float | None = None) -> float:
        return tolerance(self.dtype, depth, rtol)

    def first_layer_over(self, rtol: float | None = None) -> int | None:
        return next((i for i, rel in enumerate(self.layers) if rel > self.tolerance(i + 1, rtol)), None)

    def passed(self, rtol: float | None = None) -> bool:
        """fp32: the logits and every layer within the tolerance. bf16: those, or fivecut's bf16 logits within
        it of transformers' fp32 ones (transformers' own bf16 may drift further: a router that flips)."""
        limit = self.tolerance(self.n_layers, rtol)
        agree = self.max_rel <= limit and self.first_layer_over(rtol) is None
        return agree or (self.from_fp32 is not None and self.from_fp32[0] <= limit)


def tolerance(dtype: str, depth: int, rtol: float | None = None) -> float:
    """What passes after `depth` layers in `dtype`: `rtol` when given, else fp32's, or bf16's for that depth."""
    if rtol is not None:
        return rtol
    return FP32_RTOL if dtype == "fp32" else bf16_rtol(depth)


def layer_passes(result: LayerResult, dtype: str, rtol: float | None = None) -> bool:
    """A layer checked alone (depth 1) within the tolerance of transformers' layer, or in bf16 of its fp32 one."""
    limit = tolerance(dtype, 1, rtol)
    return result.rel <= limit or (result.from_fp32 is not None and result.from_fp32 <= limit)


BYTES_A_PARAMETER = {"fp32": 4 + 4, "bf16": 4 + 2 + 4}  # fivecut fp32; transformers fp32 (and bf16)


def too_large(spec: str, dtype: str) -> str | None:
    """Why the whole models do not fit in host memory (then the check goes layer by layer), or None."""
    need = BYTES_A_PARAMETER[dtype] * source_args(spec).num_params()
    free = available_memory()
    if need <= free:
        return None
    return f"both whole models need about {need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB of host memory is available"


def available_memory() -> int:
    """Bytes of host memory available now (Linux's MemAvailable; elsewhere the free pages)."""
    meminfo = Path("/proc/meminfo")
    if meminfo.is_file():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def hf_folder(spec: str) -> Path:
    """The folder `hf:FOLDER` (or a bare path) names; refused in one line unless it holds a config.json."""
    path = Path(spec.removeprefix("hf:")).expanduser()
    if not (path / "config.json").is_file():
        raise WeightsError(f"{spec!r} is not a Hugging Face folder (no {path / 'config.json'}); give hf:FOLDER")
    return path


def transformers_model(folder: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """transformers' model of `folder` in `dtype`, eval mode; refused in one line when it cannot be built."""
    transformers = import_transformers()
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    except Exception as err:  # transformers raises many kinds; the first line says which
        raise cannot_build(folder, err) from None
    return model.eval()


def layer_outputs(layers, store: list) -> list:
    """Forward hooks keeping each layer's output [b, s, dim] (a decoder layer of transformers may return a tuple)."""

    def keep(_module, _args, out):
        store.append((out[0] if isinstance(out, tuple) else out).detach())

    return [layer.register_forward_hook(keep) for layer in layers]


def kl_per_token(ours: torch.Tensor, theirs: torch.Tensor) -> torch.Tensor:
    """KL(P || Q) of each position's next-token distribution, P transformers', Q fivecut's: [b * s]."""
    log_p = torch.log_softmax(theirs.double(), dim=-1)
    log_q = torch.log_softmax(ours.double(), dim=-1)
    return (log_p.exp() * (log_p - log_q)).sum(-1).flatten()


def compare(spec: str, batch: int = 2, seq: int = 32, seed: int = 0, dtype: str = "fp32") -> Comparison:
    """Both models of the folder `spec` names on one random batch [batch, seq] drawn from `seed`, in
    `dtype`: fp32, or bf16 -- fivecut under autocast over its fp32 weights (as training runs), transformers
    with bf16 weights (as it runs in bf16) -- then also transformers in fp32, the model both approximate."""
    folder = hf_folder(spec)
    ours, _ = single_model(init_from=f"hf:{folder}")
    args = ours.args
    seq = min(seq, args.max_seq_len)
    tokens = torch.randint(0, args.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed))
    low = dtype == "bf16"
    theirs = transformers_model(folder, torch.bfloat16 if low else torch.float32)
    mine, yours = [], []
    hooks = layer_outputs(ours.layers.values(), mine) + layer_outputs(theirs.model.layers, yours)
    with torch.no_grad():
        with precision(dtype):
            logits = ours(tokens)
        expected = theirs(tokens).logits
    for hook in hooks:
        hook.remove()
    kl = kl_per_token(logits, expected)
    return Comparison(
        hf_class=type(theirs).__name__,
        n_layers=args.n_layers,
        tokens=(batch, seq),
        layers=[relative(a, b) for a, b in zip(mine, yours, strict=True)],
        max_abs=(logits.double() - expected.double()).abs().max().item(),
        max_rel=relative(logits, expected),
        kl_mean=kl.mean().item(),
        kl_max=kl.max().item(),
        dtype=dtype,
        from_fp32=distances_from_fp32(folder, tokens, logits, expected) if low else None,
    )


def distances_from_fp32(folder: Path, tokens: torch.Tensor, ours: torch.Tensor, theirs: torch.Tensor):
    """(fivecut's, transformers') bf16 logits from transformers' fp32 ones, relative."""
    with torch.no_grad():
        reference = transformers_model(folder)(tokens).logits
    return relative(ours, reference), relative(theirs, reference)


def check_layers(spec: str, batch: int = 2, seq: int = 32, seed: int = 0, dtype: str = "fp32"):
    """(class name, layers, the first layer of each kind compared alone) of the folder `spec` names."""
    folder = hf_folder(spec)
    args = source_args(f"hf:{folder}")
    return class_of(folder), args.n_layers, compare_layers(f"hf:{folder}", folder, batch, seq, seed, dtype)


def class_of(folder: Path) -> str:
    architecture = source_of(f"hf:{folder}").architecture
    return architecture.hf_class if architecture is not None else "fivecut's own format"
