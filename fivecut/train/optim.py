"""AdamW, the learning-rate schedule and global-norm gradient clipping."""

from __future__ import annotations

import math

import torch
from fivecut import comm
from fivecut.comm import Group


def build_optimizer(pieces: list[tuple[torch.Tensor, bool]], lr: float, weight_decay: float, betas, eps: float) -> torch.optim.AdamW:
    """AdamW over (tensor, decays) pieces: whole parameters, or ZeRO shards cut where decay changes."""
    decay = [t for t, decayed in pieces if decayed]
    no_decay = [t for t, decayed in pieces if not decayed]
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


def grad_norm(local_grads: list[torch.Tensor], shard_group: Group | None = None) -> torch.Tensor:
    """Global L2 norm of the gradients. `local_grads` are this rank's gradients; when they are
    shards of a larger set (ZeRO, TP), `shard_group` sums the squared norms over the owners."""
    grads = [g for g in local_grads if g is not None]
    device = grads[0].device if grads else torch.device("cpu")
    squares = torch.stack([g.detach().float().pow(2).sum() for g in grads]).sum() if grads else torch.zeros((), device=device)
    if shard_group is not None:
        comm.all_reduce(squares, shard_group)
    return squares.sqrt()


def clip_gradients(grads: list[torch.Tensor], max_norm: float, shard_group: Group | None = None) -> float:
    """Scale gradients in place so that their global norm is at most `max_norm`; return the norm before."""
    norm = grad_norm(grads, shard_group)
    if max_norm > 0:
        scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for g in grads:
            if g is not None:
                g.mul_(scale.to(g.dtype))
    return float(norm)
