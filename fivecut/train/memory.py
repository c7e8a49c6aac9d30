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
    Tensors made before entering (weights, inputs) are not counted."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0
        self.peak = 0
        self._storages: dict[int, list[int]] = {}  # storage -> [bytes, live tensors on it]
        self._tracked: set[int] = set()  # ids of the live tensors counted

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and id(t) not in self._tracked:
                self._track(t)
        return out

    def _track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = storage._cdata  # the storage itself: on the meta device too, where data pointers are 0
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
