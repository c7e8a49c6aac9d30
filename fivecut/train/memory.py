"""Model-state memory actually held by a rank: parameters, gradients, optimizer state.

Storages are counted once each (a gradient that is a view into a flat bucket counts the
bucket; tied weights count once), so the figure is what the rank really allocates.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def _storage_bytes(tensors, seen: set[int]) -> int:
    total = 0
    for t in tensors:
        if t is None or t.device.type == "meta":
            continue
        if hasattr(t, "__tensor_flatten__"):  # a wrapper subclass (QLoRA's NF4 weights): its inner tensors
            names, _ = t.__tensor_flatten__()
            total += _storage_bytes([getattr(t, n) for n in names], seen)
            continue
        storage = t.untyped_storage()
        if storage.data_ptr() in seen or storage.nbytes() == 0:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


def optimizer_tensors(optimizer: torch.optim.Optimizer):
    for state in optimizer.state.values():
        for value in state.values():
            if torch.is_tensor(value) and value.dim() > 0:
                yield value


def model_state_bytes(params, grads, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state held by this rank (each storage once)."""
    seen: set[int] = set()
    out = {
        "params": _storage_bytes(params, seen),
        "grads": _storage_bytes(grads, seen),
        "optimizer": _storage_bytes(optimizer_tensors(optimizer), seen) if optimizer is not None else 0,
    }
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1024
    return f"{n:.1f} TiB"


def step_peak_bytes(device: torch.device) -> int | None:
    """The most bytes the allocator held on `device` since the last call (a step's real peak),
    and a new count from here; None where torch keeps no such count (the CPU)."""
    if device.type != "cuda":
        return None
    peak = torch.cuda.max_memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    return peak


class LiveTensorBytes(TorchDispatchMode):
    """The peak of the bytes held by tensors created inside it (each storage once, from the op that
    made it until the last tensor on it dies): a real peak on any device, the CPU included, where
    no allocator keeps statistics, and on the meta device (real shapes, no data, no time).
    Tensors made before entering (weights, inputs) are not counted, nor views of them."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0
        self.peak = 0
        self.counting = True  # False: tensors made now are not counted (those counted still die)
        self._storages: dict[int, list[int]] = {}  # storage -> [bytes, live tensors on it]
        self._tracked: set[int] = set()  # ids of the live tensors counted

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.counting:
            return out
        inputs = {t.untyped_storage()._cdata for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and id(t) not in self._tracked:
                self._track(t, inputs)
        return out

    def _track(self, t: torch.Tensor, inputs: set[int]) -> None:
        storage = t.untyped_storage()
        key = storage._cdata  # the storage itself: on the meta device too, where data pointers are 0
        if key not in self._storages and key in inputs:  # a view or in-place result of a tensor made before
            return
        if key not in self._storages:
            self._storages[key] = [storage.nbytes(), 0]
            self.now += storage.nbytes()
            self.peak = max(self.peak, self.now)
        self._storages[key][1] += 1
        self._tracked.add(id(t))
        weakref.finalize(t, self._release, key, id(t))

    def _release(self, key: int, ident: int) -> None:
        self._tracked.discard(ident)
        entry = self._storages[key]
        entry[1] -= 1
        if entry[1] == 0:
            del self._storages[key]
            self.now -= entry[0]


class LossPeak:
    """Measures the loss's peak on the rank that holds the head, for the first (micro)batch that
    reaches it (`fivecut ledger`, step 1): the peak of `LiveTensorBytes` over two windows, the
    head's forward (from its input, gathered under SP, to the sum of token losses) and its backward
    (from the gradient of that sum to the gradient of the head's input); what the forward made and
    still holds counts on into the backward, what is made between the windows is not the head's.
    The meaning, term by term: `fivecut.plan.activations.loss_peak_bytes`.

    `head` is the output module; `loss_in_head`: it returns the loss itself (`LossHead`), else the
    loss is `loss_sum(head's logits, targets)` and `loss_sum` (wrapped by `wrap`) ends the forward.
    Inside `with`, every op passes through the tracker (autograd's engine keeps the dispatch modes
    active when backward is called, not those entered in a hook), counting only in the windows."""

    def __init__(self, head: torch.nn.Module, loss_in_head: bool):
        self.live = LiveTensorBytes()
        self.live.counting = False
        self.peak: int | None = None  # set when the first backward through the head is done
        self.state = "waiting"  # -> "forward" -> "between" -> "backward" -> "done"
        self._hooks = [head.register_forward_pre_hook(self._forward_starts)]
        if loss_in_head:
            self._hooks.append(head.register_forward_hook(lambda _module, _args, loss: self._forward_ends(loss)))

    def __enter__(self) -> LossPeak:
        self.live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.live.__exit__(*exc)
        for hook in self._hooks:
            hook.remove()

    def wrap(self, loss_sum):
        """`loss_sum` (logits, targets) -> loss, ending the head's forward window when it has computed."""

        def measured(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            return self._forward_ends(loss_sum(logits, targets))

        return measured

    def _forward_starts(self, _module, args) -> None:
        if self.state == "waiting" and torch.is_grad_enabled():
            self.state, self.live.counting = "forward", True
            args[0].register_hook(self._backward_ends)  # the head's input [b, s, h]: its gradient ends the count

    def _forward_ends(self, loss: torch.Tensor) -> torch.Tensor:
        if self.state == "forward":
            self.state, self.live.counting = "between", False
            loss.register_hook(self._backward_starts)
        return loss

    def _backward_starts(self, _grad) -> None:
        self.state, self.live.counting = "backward", True

    def _backward_ends(self, _grad) -> None:
        if self.state == "backward":
            self.state, self.live.counting, self.peak = "done", False, self.live.peak
