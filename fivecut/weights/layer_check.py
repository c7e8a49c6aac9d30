"""`fivecut check-import` layer by layer, for a model too large for host memory: one decoder layer of
each distinct kind, loaded alone from the folder's safetensors (only that layer's tensors read), run
on the same random hidden state by fivecut's block and by transformers' decoder layer built from the
folder's own config.json.

A layer's kind is what makes its computation differ from another's in fivecut's model (`kind_of`):
its feed-forward (dense or mixture-of-experts), its attention's reach (global or a sliding window of
w positions) and whether it rotates by RoPE (NoPE layers). The first layer of each kind is checked.

transformers' side is its whole model built on the meta device (no memory), of which only the
checked layer is made real and filled by transformers' own loading code from that layer's slices
(`convert_and_load_state_dict_in_model`, which fuses per-expert tensors as `from_pretrained` does);
the other layers pass their input through, so that transformers' model computes the masks and
rotary tables each layer kind receives, and the checked layer's output is taken by a hook that ends
the forward there. transformers is imported only here, and only when a check runs.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from fivecut.model.args import ModelArgs
from fivecut.model.transformer import Block, rope_tables
from fivecut.weights.load import expected_shapes, fill, full_box, source_args, source_of
from fivecut.weights.source import WeightsError


@dataclass(frozen=True)
class LayerResult:
    index: int
    kind: str
    rel: float  # the output's largest relative difference, max |ours - theirs| / max |theirs|
    from_fp32: float | None = None  # bf16: fivecut's output from transformers' fp32 layer's, relative


def relative(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    """max |ours - theirs| / max |theirs| (float64)."""
    ours, theirs = ours.double(), theirs.double()
    return ((ours - theirs).abs().max() / theirs.abs().max().clamp_min(1e-30)).item()


@contextlib.contextmanager
def precision(dtype: str):
    """fivecut's forward as training runs it in `dtype`: bf16 autocast over fp32 weights, or plain fp32."""
    if dtype == "fp32":
        yield
        return
    with warnings.catch_warnings(), torch.autocast("cpu", dtype=torch.bfloat16):
        # a bf16 activation meets an fp32 norm weight: torch says its fused kernel is not used
        warnings.filterwarnings("ignore", "Mismatch dtype between input and weight")
        yield


def kind_of(args: ModelArgs, i: int) -> str:
    """What sets layer i's computation apart: feed-forward, attention's reach, RoPE."""
    parts = ["MoE" if args.moe_layer(i) else "dense"]
    window = args.layer_window(i)
    parts.append(f"sliding window {window}" if window else "global attention")
    return ", ".join(parts + ([] if args.layer_rope(i) else ["NoPE"]))


def layer_kinds(args: ModelArgs) -> dict[str, int]:
    """Each distinct kind -> its first layer."""
    kinds: dict[str, int] = {}
    for i in range(args.n_layers):
        kinds.setdefault(kind_of(args, i), i)
    return kinds


def fivecut_block(spec: str, args: ModelArgs, i: int) -> Block:
    """fivecut's block i, its tensors (and routing biases) read alone from the folder."""
    source = source_of(spec)
    prefix = f"layers.{i}."
    shapes = {n: s for n, s in (expected_shapes(args) | source.buffer_shapes()).items() if n.startswith(prefix)}
    holder = nn.Module()
    with torch.device("meta"):
        holder.layers = nn.ModuleDict({str(i): Block(i, args)})
    holder.to_empty(device="cpu")
    for module in holder.modules():
        if hasattr(module, "reset_buffers"):  # MoE: its routing bias and load counters
            module.reset_buffers()
    fill(holder, {name: source.read(name, full_box(shape)) for name, shape in shapes.items()})
    return holder.layers[str(i)].eval()


class _Reached(Exception):
    """Raised by the hook on the checked layer: its output, and the forward stops there."""

    def __init__(self, output: torch.Tensor):
        super().__init__()
        self.output = output


def _passthrough(hidden_states, *args, **kwargs):
    return hidden_states


def import_transformers():
    """transformers, refused in one line when it is not installed."""
    try:
        import transformers
    except ModuleNotFoundError:
        raise WeightsError("check-import runs transformers' model beside fivecut's: pip install transformers") from None
    transformers.utils.logging.disable_progress_bar()  # the report is the output: no bar on the terminal
    return transformers


def cannot_build(folder: Path, err: Exception) -> WeightsError:
    """transformers raises many kinds; the first line of its message says which."""
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return WeightsError(f"{folder}: transformers cannot build its model: {first}")


def transformers_layer(folder: Path, files: dict[str, Path], i: int, dtype: torch.dtype) -> nn.Module:
    """transformers' model of the folder on the meta device, its layer i made real from that layer's
    tensors, every other layer passing its input through, its rotary tables rebuilt on the CPU."""
    transformers = import_transformers()
    try:
        config = transformers.AutoConfig.from_pretrained(folder)
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
        for name, module in list(model.model.named_children()):
            if (
                "rotary" in name
            ):  # its inverse frequencies (fp32, as from_pretrained keeps them): buffers meta left empty
                setattr(model.model, name, type(module)(config=model.config))
    except Exception as err:
        raise cannot_build(folder, err) from None
    load_layer(model, folder, {name: file for name, file in files.items() if name.startswith(f"model.layers.{i}.")}, i)
    for j, layer in enumerate(model.model.layers):
        if j != i:
            layer.forward = _passthrough
    return model.eval()


def load_layer(model: nn.Module, folder: Path, files: dict[str, Path], i: int) -> None:
    """Layer i of transformers' meta-device `model` made real and filled from `files` (its tensors' names
    -> their safetensors files) by transformers' own loading code (renaming and fusing them)."""
    from safetensors import safe_open

    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import convert_and_load_state_dict_in_model
        from transformers.modeling_utils import LoadStateDictConfig
    except ImportError as err:
        raise WeightsError(f"check-import layer by layer reads one layer with transformers 5's loader: {err}") from None
    dtype = model.dtype
    model.model.layers[i].to_empty(device="cpu")
    with contextlib.ExitStack() as stack:
        opened = {file: stack.enter_context(safe_open(file, framework="pt")) for file in set(files.values())}
        state = {name: opened[file].get_slice(name) for name, file in files.items()}  # not read yet
        # in `dtype` but the modules the class keeps in fp32 (routers, correction biases), as from_pretrained
        plan = model._get_dtype_plan(dtype)
        load = LoadStateDictConfig(weight_mapping=get_model_conversion_mapping(model), dtype=dtype, dtype_plan=plan)
        info, _ = convert_and_load_state_dict_in_model(model=model, state_dict=state, load_config=load)
    missing = sorted(k for k in info.missing_keys if k.startswith(f"model.layers.{i}."))
    if missing:
        raise WeightsError(f"{folder}: transformers found no tensor for {missing[0]} of layer {i}")


def transformers_output(folder: Path, files: dict[str, Path], i: int, x: torch.Tensor, dtype: torch.dtype):
    """Layer i's output [b, s, dim] of transformers' model (in `dtype`) fed `x` [b, s, dim] as its embeddings."""
    model = transformers_layer(folder, files, i, dtype)

    def reached(_module, _args, out):
        raise _Reached(out[0] if isinstance(out, tuple) else out)

    model.model.layers[i].register_forward_hook(reached)
    try:
        with torch.no_grad():
            model.model(inputs_embeds=x.to(dtype))
    except _Reached as stop:
        return stop.output
    raise WeightsError(f"{folder}: transformers' model never ran layer {i}")


def compare_layers(spec: str, folder: Path, batch: int, seq: int, seed: int, dtype: str) -> list[LayerResult]:
    """The first layer of each kind, fivecut's against transformers', on one random hidden state; in
    bf16 also against transformers' fp32 layer (as `fivecut.weights.import_check.compare`)."""
    args = source_args(spec)
    files = source_of(spec).files
    seq = min(seq, args.max_seq_len)
    low = dtype == "bf16"
    x = torch.randn(batch, seq, args.dim, generator=torch.Generator().manual_seed(seed))  # [b, s, dim]
    x = x.to(torch.bfloat16).float() if low else x  # the values bf16 holds: both models see the same
    cos, sin = rope_tables(args, long=args.rope_long(seq))  # the tables of a sequence of `seq` (LongRoPE)
    results = []
    for kind, i in layer_kinds(args).items():
        block = fivecut_block(spec, args, i)
        with torch.no_grad(), precision(dtype):
            ours = block(x, (cos[:seq], sin[:seq]))  # [b, s, dim]
        del block
        theirs = transformers_output(folder, files, i, x, torch.bfloat16 if low else torch.float32)
        from_fp32 = relative(ours, transformers_output(folder, files, i, x, torch.float32)) if low else None
        results.append(LayerResult(i, kind, relative(ours, theirs), from_fp32))
    return results
