"""Compute weights cast once a step: under train.dtype = "bf16", each matmul weight's bf16 copy
is made once per optimizer step and shared by every microbatch's forward and backward.

Autocast over fp32 master weights casts a weight to bf16 at every matmul that reads it, in every
microbatch, and the linear keeps that cast for its backward: with a pipeline one bf16 copy of a
stage's weights per microbatch in flight. Megatron (bf16 parameters, fp32 main gradients) and
FSDP2 (`MixedPrecisionPolicy(param_dtype=bf16)`) instead hold one bf16 copy. Here:

    copy = master.to(bf16)      once a step, differentiable; its backward (ToCopyBackward) saves
                                nothing, so every microbatch's backward flows through it:
    d master += fp32(d copy)    each microbatch's bf16 weight gradient, converted and accumulated
                                into the fp32 `.grad`, exactly as autocast's own cast does

so the numerics are autocast's (bitwise on one process: `tests/test_cast_once.py`), the masters,
their fp32 gradients, the data cut's hooks and `train.reduce_dtype` are untouched.

Which weights: those autocast casts, i.e. the ones a matmul reads: every `nn.Linear` (the
attention and MLP projections, TP-cut or not, the router, the head; a pipeline's `DeferredLinear`)
and the routed experts' stacked weights (`GroupedExperts`). The embedding (a lookup), the norms
(elementwise, fp32) and the replicated projections of tensor parallelism (`ReplicatedKV`,
`ReplicatedLinear`: their weight passes through f, whose backward all-reduce must stay fp32) keep
their fp32 weights, and autocast does what it did.

How: each such module's class becomes a subclass whose weight attribute (`weight`, or `w1`, `w3`,
`w2`) is a property: read while autocast to bf16 is on, it returns the step's copy, made on the
first read with autograd recording; otherwise the master. Parameter names, `state_dict`,
`named_parameters` and the placement records still see the fp32 masters (checkpoints save them,
never the copies). Since the copy is made on first read inside a forward, it follows everything
that writes the masters before: the optimizer's update, ZeRO-1/2's gathers (waited for in the
unit's pre-forward hook, before any of its matmuls), EPLB's moves. `ComputeWeights.invalidate`
drops the copies after each optimizer step (the trainer's `optimizer_step`); until then:

* recomputation (full, selective) reads the same copy again in backward;
* a split backward's W (zero-bubble schedules) holds the copy it was given in B, and computes dW
  into it later: the copy lives until the last W of the step;
* evaluation (no grad) makes no copy: autocast casts as before.

ZeRO-3 under bf16 already gathers its units in bf16 (`FullyShardedDataParallel(param_dtype)`):
its parameters are the bf16 compute copies, so this step is not applied there.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from fivecut.model.transformer import GroupedExperts

CAST = ((nn.Linear, ("weight", "bias")), (GroupedExperts, ("w1", "w3", "w2")))  # module kinds and their matmul weights


@dataclass(eq=False)
class ComputeWeights:
    """The modules whose weights are read as one compute copy a step, and this step's copies."""

    dtype: torch.dtype | None = None  # the compute dtype (None: nothing is cast, fp32 or ZeRO-3)
    modules: list[nn.Module] = field(default_factory=list)
    copies: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)  # (id(module), name) -> copy
    storages: set[int] = field(default_factory=set)  # the copies' storages (saved-tensor accounting)

    def read(self, module: nn.Module, name: str) -> torch.Tensor:
        """`module.<name>`: under autocast to `dtype`, this step's copy; otherwise the master."""
        weight = master(module, name)
        device = weight.device.type
        if not (torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) == self.dtype):
            return weight
        key = (id(module), name)
        copy = self.copies.get(key)
        if copy is None and torch.is_grad_enabled():  # no grad (evaluation): autocast casts, nothing is kept
            copy = self.copies[key] = weight.to(self.dtype)  # [same shape]; ToCopyBackward saves nothing
            self.storages.add(copy.untyped_storage().data_ptr())
        return weight if copy is None else copy

    def invalidate(self) -> None:
        """The masters changed (after the optimizer step): the next forward casts them again."""
        self.copies.clear()
        self.storages.clear()

    def holds(self, t: torch.Tensor) -> bool:
        """Whether `t` is (a view of) one of this step's copies: a weight, not an activation."""
        return t.device.type != "meta" and t.untyped_storage().data_ptr() in self.storages

    def held_bytes(self) -> int:
        return sum(copy.untyped_storage().nbytes() for copy in self.copies.values())


def master(module: nn.Module, name: str) -> nn.Parameter:
    """The fp32 master of `module.<name>` whatever autocast is doing (a cast module reads its copy)."""
    return module._parameters[name]


def cast_once(module: nn.Module, dtype: torch.dtype) -> ComputeWeights:
    """Make every matmul weight of `module` (see the module doc) read as one `dtype` copy a step."""
    record = ComputeWeights(dtype)
    for m in module.modules():
        names = cast_names(m)
        if names:
            m.__class__ = cast_class(type(m), names)
            m._compute_weights = record
            record.modules.append(m)
    return record


def cast_names(module: nn.Module) -> tuple[str, ...]:
    """The fp32 parameters of `module` that its matmuls read (none for other modules)."""
    for kind, names in CAST:
        if isinstance(module, kind):
            params = module._parameters
            return tuple(n for n in names if params.get(n) is not None and params[n].dtype == torch.float32)
    return ()


def cast_class(cls: type, names: tuple[str, ...]) -> type:
    """`cls` with each of `names` read through `ComputeWeights.read` (one class per (cls, names))."""
    key = (cls, names)
    if key not in _CLASSES:
        props = {n: property(lambda self, n=n: self._compute_weights.read(self, n)) for n in names}
        _CLASSES[key] = type(cls.__name__, (cls,), {**props, "__module__": cls.__module__})
    return _CLASSES[key]


_CLASSES: dict[tuple[type, tuple[str, ...]], type] = {}
