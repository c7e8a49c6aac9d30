"""Whether a Hugging Face folder imports into fivecut as the model transformers builds from it
(`fivecut check-import`): the automatic form of a hand-kept compatibility table.

Both models are built from the folder on this machine's CPU in fp32 -- fivecut's by its importer
(`single_model`, the path every run's `model.init_from = "hf:..."` takes), transformers' by
`AutoModelForCausalLM.from_pretrained` -- and run on the same random token batch. Compared:

    each decoder layer's output [b, s, dim]   to name the first layer that differs
    the logits [b, s, V]                      largest absolute difference, and the largest relative
                                              one: max |ours - theirs| / max |theirs|
    the next-token distributions              KL(transformers || fivecut) per token, mean and max

A difference is scaled by the largest magnitude of transformers' tensor (not element by element:
a logit near zero would make any rounding look large). transformers is imported only here, and
only when a check runs: a training image without it still imports fivecut.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from fivecut.weights.load import single_model
from fivecut.weights.source import WeightsError

FP32_RTOL = 1e-5  # fp32: the two models differ only in the order of floating-point operations


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

    def first_layer_over(self, rtol: float) -> int | None:
        return next((i for i, rel in enumerate(self.layers) if rel > rtol), None)


def hf_folder(spec: str) -> Path:
    """The folder `hf:FOLDER` (or a bare path) names; refused in one line unless it holds a config.json."""
    path = Path(spec.removeprefix("hf:")).expanduser()
    if not (path / "config.json").is_file():
        raise WeightsError(f"{spec!r} is not a Hugging Face folder (no {path / 'config.json'}); give hf:FOLDER")
    return path


def transformers_model(folder: Path) -> torch.nn.Module:
    """transformers' model of `folder`, fp32, eval mode; refused in one line when it cannot be built."""
    try:
        import transformers
    except ModuleNotFoundError:
        raise WeightsError("check-import runs transformers' model beside fivecut's: pip install transformers") from None
    transformers.utils.logging.disable_progress_bar()  # the report is the output: no bar on the terminal
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    except Exception as err:  # transformers raises many kinds; the first line says which
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise WeightsError(f"{folder}: transformers cannot build its model: {first}") from None
    return model.eval()


def layer_outputs(layers, store: list) -> list:
    """Forward hooks keeping each layer's output [b, s, dim] (a decoder layer of transformers may return a tuple)."""

    def keep(_module, _args, out):
        store.append((out[0] if isinstance(out, tuple) else out).detach())

    return [layer.register_forward_hook(keep) for layer in layers]


def relative(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    """max |ours - theirs| / max |theirs| (float64)."""
    ours, theirs = ours.double(), theirs.double()
    return ((ours - theirs).abs().max() / theirs.abs().max().clamp_min(1e-30)).item()


def kl_per_token(ours: torch.Tensor, theirs: torch.Tensor) -> torch.Tensor:
    """KL(P || Q) of each position's next-token distribution, P transformers', Q fivecut's: [b * s]."""
    log_p = torch.log_softmax(theirs.double(), dim=-1)
    log_q = torch.log_softmax(ours.double(), dim=-1)
    return (log_p.exp() * (log_p - log_q)).sum(-1).flatten()


def compare(spec: str, batch: int = 2, seq: int = 32, seed: int = 0) -> Comparison:
    """Both models of the folder `spec` names on one random batch [batch, seq] drawn from `seed`."""
    folder = hf_folder(spec)
    ours, _ = single_model(init_from=f"hf:{folder}")
    args = ours.args
    seq = min(seq, args.max_seq_len)
    tokens = torch.randint(0, args.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed))
    theirs = transformers_model(folder)
    mine, yours = [], []
    hooks = layer_outputs(ours.layers.values(), mine) + layer_outputs(theirs.model.layers, yours)
    with torch.no_grad():
        logits, expected = ours(tokens), theirs(tokens).logits
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
    )
