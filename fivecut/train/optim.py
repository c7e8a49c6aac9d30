"""AdamW, the learning-rate schedule and global-norm gradient clipping."""

from __future__ import annotations

import math
from collections import defaultdict

import torch
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

from fivecut import comm
from fivecut.comm import Group


def adamw_kernel(requested: str, device: torch.device) -> tuple[str, str | None]:
    """The AdamW kernel that runs on `device` for `train.adamw`, and a note when "fused" was asked
    for where torch has no fused kernel (then foreach runs). "auto" is fused wherever torch has it
    (CUDA and the CPU in torch >= 2.4): one kernel reads and writes each tensor once."""
    if requested == "foreach":
        return "foreach", None
    if device.type in _get_fused_kernels_supported_devices():
        return "fused", None
    note = f'train.adamw = "fused": torch has no fused AdamW on {device.type}; running foreach instead'
    return "foreach", note if requested == "fused" else None


def build_optimizer(pieces, lr: float, weight_decay: float, betas, eps: float, kernel: str = "auto"):
    """AdamW over `Piece`s: whole parameters, or ZeRO shards cut where the kind of parameter changes.
    `kernel` is `adamw_kernel`'s answer ("auto" resolves it on the pieces' device)."""
    decay = [piece.tensor for piece in pieces if piece.decays]
    no_decay = [piece.tensor for piece in pieces if not piece.decays]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if kernel == "auto":
        kernel, _ = adamw_kernel("auto", pieces[0].tensor.device if pieces else torch.device("cpu"))
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=betas, eps=eps, **{kernel: True})


def lr_at(step: int, peak: float, floor: float, warmup: int, total: int) -> float:
    """Linear warm-up to `peak` over `warmup` steps, then cosine decay to `floor` at `total` (steps count from 1)."""
    if warmup and step <= warmup:
        return peak * step / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return floor + 0.5 * (peak - floor) * (1 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def grad_norm(pieces, groups: list[Group]) -> torch.Tensor:
    """Global L2 norm of the gradients of this rank's `Piece`s. Squared norms are summed over
    `groups` (ZeRO's dp group when gradients are sharded, the tp group under tensor
    parallelism, the pp group under pipeline parallelism); a piece with k copies on those
    ranks (replicated over tp, tied on two pipeline stages) has `norm_weight` 1/k: it counts once."""
    by_weight = defaultdict(list)  # norm_weight -> the gradients that count with it
    for p in pieces:
        if p.tensor.grad is not None:
            by_weight[p.norm_weight].append(p.tensor.grad.detach())
    squares = torch.zeros((), device=pieces[0].tensor.device if pieces else "cpu")
    for weight, grads in by_weight.items():
        squares += sum_of_squares(grads) * weight
    for group in groups:
        comm.all_reduce(squares, group)
    return squares.sqrt()


def sum_of_squares(grads: list[torch.Tensor]) -> torch.Tensor:
    """The sum of every element's square over `grads`, in fp32. On a GPU one multi-tensor kernel
    (`_foreach_norm`, whose block-wise reductions keep fp32 accurate). On the CPU torch's norm
    kernel accumulates sequentially (6e-5 relative error at 3M elements, measured against fp64),
    so there each tensor's squares are summed by `sum`, which adds in a cascade (5e-8)."""
    if grads[0].device.type == "cpu":
        return torch.stack([g.float().pow(2).sum() for g in grads]).sum()
    return torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)).square().sum()


def clip_gradients(pieces, max_norm: float, groups: list[Group]) -> float:
    """Scale gradients in place so that their global norm is at most `max_norm`; return the norm before."""
    return float(clipped_norm(pieces, max_norm, groups))


def clipped_norm(pieces, max_norm: float, groups: list[Group]) -> torch.Tensor:
    """`clip_gradients` without reading the norm's value (a tensor: fake tensors have no value)."""
    norm = grad_norm(pieces, groups)
    if max_norm > 0:
        scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        grads = [piece.tensor.grad for piece in pieces if piece.tensor.grad is not None]
        for dtype in {g.dtype for g in grads}:  # one multi-tensor scale a dtype
            torch._foreach_mul_([g for g in grads if g.dtype == dtype], scale.to(dtype))
    return norm
