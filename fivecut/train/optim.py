"""AdamW, the learning-rate schedule and global-norm gradient clipping."""

from __future__ import annotations

import math

import torch

from fivecut import comm
from fivecut.comm import Group


def build_optimizer(pieces, lr: float, weight_decay: float, betas, eps: float) -> torch.optim.AdamW:
    """AdamW over `Piece`s: whole parameters, or ZeRO shards cut where the kind of parameter changes."""
    decay = [piece.tensor for piece in pieces if piece.decays]
    no_decay = [piece.tensor for piece in pieces if not piece.decays]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=betas, eps=eps)


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
    grads = [(p.tensor.grad, p.norm_weight) for p in pieces if p.tensor.grad is not None]
    squares = torch.zeros((), device=grads[0][0].device if grads else "cpu")
    for g, weight in grads:
        squares += g.detach().float().pow(2).sum() * weight
    for group in groups:
        comm.all_reduce(squares, group)
    return squares.sqrt()


def clip_gradients(pieces, max_norm: float, groups: list[Group]) -> float:
    """Scale gradients in place so that their global norm is at most `max_norm`; return the norm before."""
    norm = grad_norm(pieces, groups)
    if max_norm > 0:
        scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for piece in pieces:
            if piece.tensor.grad is not None:
                piece.tensor.grad.mul_(scale.to(piece.tensor.grad.dtype))
    return float(norm)
