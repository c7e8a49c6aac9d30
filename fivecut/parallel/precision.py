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
`w2`) is a property that returns the step's copy when there is one, else the master. Parameter
names, `state_dict`, `named_parameters` and the placement records still see the fp32 masters
(checkpoints save them, never the copies). The copies are made by a forward pre-hook on each
transformer block (and on a cast module outside every block, such as a head computing full
logits), eagerly, when a forward under autocast to bf16 with autograd on reaches it: compiled
blocks keep their `__call__` eager, so the casts stay out of the compiled graphs, which only read
the copies (a copy made inside one graph and read by the next microbatch's would chain the two
graphs' backward). The hook runs after the data cut's own pre-forward hooks (registered before it),
so a copy follows everything that writes the masters first: the optimizer's update, ZeRO-1/2's
gathers, EPLB's moves. `ComputeWeights.invalidate` drops the copies after each optimizer step
(the trainer's `optimizer_step`); until then:

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

from fivecut.model.lora import LoRAExperts, LoRALinear
from fivecut.model.transformer import BiasedExperts, GroupedExperts

CAST = (
    (LoRALinear, ("weight", "bias", "lora_a", "lora_b")),
    (nn.Linear, ("weight", "bias")),
    (LoRAExperts, tuple(LoRAExperts.EXPERT_TENSORS)),
    (BiasedExperts, tuple(BiasedExperts.EXPERT_TENSORS)),  # GPT-OSS's: the biases too
    (GroupedExperts, tuple(GroupedExperts.EXPERT_TENSORS)),
)  # module kinds and their matmul weights


@dataclass(eq=False)
class ComputeWeights:
    """The modules whose weights are read as one compute copy a step, and this step's copies."""

    dtype: torch.dtype | None = None  # the compute dtype (None: nothing is cast, fp32 or ZeRO-3)
    modules: list[nn.Module] = field(default_factory=list)
    storages: set[int] = field(default_factory=set)  # the copies' storages (saved-tensor accounting)

    def prepare(self, owner: nn.Module) -> None:
        """Before `owner`'s forward: under autocast to `dtype` with autograd on, the copies of the
        cast modules inside it that this step has not made yet. Evaluation (no grad) makes none."""
        device = next(owner.parameters()).device.type
        if not (torch.is_grad_enabled() and torch.is_autocast_enabled(device)):
            return
        if torch.get_autocast_dtype(device) != self.dtype:
            return
        for m in owner.modules():
            copies = getattr(m, "_compute_copies", None)
            if copies is None or copies:
                continue
            for name in m._compute_names:
                copy = copies[name] = master(m, name).to(self.dtype)  # [same shape]; ToCopyBackward saves nothing
                self.storages.add(copy.untyped_storage().data_ptr())

    def invalidate(self) -> None:
        """The masters changed (after the optimizer step): the next forward casts them again."""
        for m in self.modules:
            m._compute_copies.clear()
        self.storages.clear()

    def holds(self, t: torch.Tensor) -> bool:
        """Whether `t` is (a view of) one of this step's copies: a weight, not an activation."""
        return t.device.type != "meta" and t.untyped_storage().data_ptr() in self.storages


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
            m._compute_names, m._compute_copies = names, {}  # name -> this step's copy
            record.modules.append(m)
    for owner in copy_owners(module, record.modules):
        owner.register_forward_pre_hook(lambda owner, _args: record.prepare(owner))
    return record


def copy_owners(module: nn.Module, cast: list[nn.Module]) -> list[nn.Module]:
    """The modules whose pre-forward hook makes the copies: every transformer block (`layers` of
    a model or pipeline stage), and each cast module outside all blocks."""
    blocks = [
        b for m in module.modules() if isinstance(getattr(m, "layers", None), nn.ModuleDict) for b in m.layers.values()
    ]
    inside = {id(m) for block in blocks for m in block.modules()}
    return blocks + [m for m in cast if id(m) not in inside]


def cast_names(module: nn.Module) -> tuple[str, ...]:
    """The fp32 parameters of `module` that its matmuls read (none for other modules)."""
    for kind, names in CAST:
        if isinstance(module, kind):
            params = module._parameters
            return tuple(n for n in names if params.get(n) is not None and params[n].dtype == torch.float32)
    return ()


def compute_weight(module: nn.Module, name: str) -> torch.Tensor:
    """`module.<name>` as its matmuls read it: this step's copy when one was made, else the master."""
    copy = module._compute_copies.get(name)
    return master(module, name) if copy is None else copy


def cast_class(cls: type, names: tuple[str, ...]) -> type:
    """`cls` with each of `names` read through `compute_weight` (one class per (cls, names))."""
    key = (cls, names)
    if key not in _CLASSES:
        props = {n: property(lambda self, n=n: compute_weight(self, n)) for n in names}
        _CLASSES[key] = type(cls.__name__, (cls,), {**props, "__module__": cls.__module__})
    return _CLASSES[key]


_CLASSES: dict[tuple[type, tuple[str, ...]], type] = {}
