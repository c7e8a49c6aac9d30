"""What a forward pass keeps for backward: the one saved-tensors hook of fivecut.

Two jobs share one hook (PyTorch applies only the innermost saved-tensors hook, so they
cannot be separate):

* Sequence parallelism (Korthikanti et al.): the input of a tensor-parallel region is
  all-gathered to [b, s, h], but only this rank's slice [b, s/t, h] is kept; backward
  all-gathers it again when it is first needed. Without this the gathered input would
  be saved whole and SP would not cut the activations inside the regions.
* Measurement: when `measure()` is on, the bytes each transformer layer keeps are
  counted (each storage once per layer; parameters and their bf16 compute copies, held once a
  step by `fivecut.parallel.precision`, are not activations). Inside a
  checkpoint (activation recomputation) the checkpoint's own hook is the innermost one:
  what it holds by closure, its inputs, is reported with `count_kept`.
"""

from __future__ import annotations

from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from fivecut import comm
from fivecut.comm import Group
from fivecut.parallel.precision import ComputeWeights


class Regathered:
    """Stands in for a saved view of an all-gathered tensor: keeps the local slice, gathers it
    again in backward (once, however many views of it were saved), and rebuilds the view."""

    def __init__(self, local: torch.Tensor, dim: int, group: Group):
        self.local, self.dim, self.group = local, dim, group
        self._full: torch.Tensor | None = None

    def full(self) -> torch.Tensor:
        if self._full is None:
            self._full = comm.all_gather(self.local.contiguous(), self.group, self.dim)
        return self._full


@dataclass(frozen=True)
class SavedView:
    source: Regathered
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int

    def rebuild(self) -> torch.Tensor:
        return self.source.full().as_strided(self.size, self.stride, self.offset)


class SavedActivations:
    def __init__(self) -> None:
        self._gathered: dict[int, tuple[torch.Tensor, Regathered]] = {}  # storage of full -> (full, stand-in)
        self._measuring = False
        self._layer: str | None = None
        self.bytes_per_layer: dict[str, int] = defaultdict(int)
        self._seen: set[int] = set()
        self.regathers = False  # set by sequence parallelism: some region keeps only its local slice
        self._in_forward = False  # inside `forward()`: a recomputation in backward keeps nothing here
        self.copies: ComputeWeights | None = None  # bf16: the step's weight copies (weights, not activations)

    def keep_local(self, full: torch.Tensor, local: torch.Tensor, dim: int, group: Group) -> None:
        """`full` was all-gathered from `local`: if backward needs it, keep `local` and gather again."""
        if not self._in_forward:  # a forward recomputed in backward: its saved tensors are transient
            return
        self._gathered[full.untyped_storage().data_ptr()] = (full, Regathered(local, dim, group))

    def track_layers(self, layers: nn.ModuleDict) -> None:
        """Attribute saved bytes to the transformer layer whose forward is running."""
        for name, layer in layers.items():
            layer.register_forward_pre_hook(lambda m, a, n=name: setattr(self, "_layer", n))
            layer.register_forward_hook(lambda m, a, o: setattr(self, "_layer", None))

    @contextmanager
    def measure(self, reset: bool = True):
        """Count the bytes each layer saves for backward while inside; `reset=False` adds to the
        last count (a pipeline rank measures each of its stages' first microbatch in turn)."""
        if reset:
            self.bytes_per_layer.clear()
            self._seen.clear()
        self._measuring = True
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield self.bytes_per_layer
        finally:
            self._measuring = False

    @contextmanager
    def forward(self):
        """Wrap one forward pass (its backward may run later, outside). Without sequence parallelism
        nothing is kept differently, and the hook (a Python call per saved tensor) is left out."""
        if not self.regathers:
            yield
            return
        self._in_forward = True
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            try:
                yield
            finally:
                self._gathered.clear()
                self._in_forward = False

    def count_kept(self, *tensors: torch.Tensor) -> None:
        """Tensors a checkpoint keeps for backward by closure (its hook hides them from `_pack`)."""
        if self._measuring and self._layer is not None:
            for t in tensors:
                if not self._is_weight(t):
                    self._count(t)

    def _pack(self, t: torch.Tensor):
        kept = self._stand_in(t)
        if self._measuring and self._layer is not None and not self._is_weight(t):
            self._count(kept.source.local if isinstance(kept, SavedView) else t)
        return kept

    def _is_weight(self, t: torch.Tensor) -> bool:
        """A parameter, or (bf16) the step's compute copy of one: held once a step, not per microbatch."""
        return _is_parameter(t) or (self.copies is not None and self.copies.holds(t))

    def _stand_in(self, t: torch.Tensor):
        """A `SavedView` when `t` is a view of a gathered tensor whose local slice we keep instead."""
        if t.device.type == "meta" or _is_parameter(t):  # a weight (QLoRA's NF4 ones have no plain storage)
            return t
        entry = self._gathered.get(t.untyped_storage().data_ptr())
        if entry is None or entry[0].dtype != t.dtype:
            return t
        return SavedView(entry[1], tuple(t.size()), tuple(t.stride()), t.storage_offset())

    @staticmethod
    def _unpack(kept):
        return kept.rebuild() if isinstance(kept, SavedView) else kept

    def _count(self, t: torch.Tensor) -> None:
        """Each storage once, in the first layer that saves it (tensors shared by all layers,
        such as the RoPE tables of this sequence, land in the first)."""
        key = t.untyped_storage().data_ptr()
        if key not in self._seen:
            self._seen.add(key)
            self.bytes_per_layer[self._layer] += t.untyped_storage().nbytes()


def _is_parameter(t: torch.Tensor) -> bool:
    """Weights saved by matmuls are not activations (also views of them, e.g. f applied to a weight)."""
    while t is not None:
        if isinstance(t, nn.Parameter):
            return True
        t = t._base
    return False
