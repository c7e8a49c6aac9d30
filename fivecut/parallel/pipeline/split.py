"""Cutting the model into pipeline stages.

The transformer's layers are split into contiguous runs, one per stage, balanced by a
cost estimate: forward FLOPs per token of each block, with the embedding (a lookup: ~0)
on the first stage and the head (2 h V) on the last, so a large vocabulary does not
leave the last stage the slowest. Any layer count is accepted; every stage gets at
least one layer; an explicit split (layers per stage) overrides the balance.

A rank builds only its own stages: the model is constructed on the meta device, cut
down to the stage (its layers, and the embedding / final norm / head only where they
belong); the cuts that follow keep it there until `fivecut.parallel.parallelize`'s materialize step.
Initialization is keyed by parameter name, so every stage holds exactly the weights the
single-device model has.
"""

from __future__ import annotations

import copy
import functools

from torch import nn


def block_cost(args, seq_len: int) -> float:
    """Forward FLOPs per token of one block: 2 x its matmul parameters + attention scores (4 s w,
    w = `ModelArgs.attention_width`)."""
    mlp = 3 * args.dim * args.ffn_dim
    return 2 * (args.attention_matmul_params() + mlp) + 4 * seq_len * args.attention_width


def head_cost(args) -> float:
    return 2 * args.dim * args.vocab_size


def balance(costs: list[float], n_stages: int, first_extra: float = 0.0, last_extra: float = 0.0) -> list[int]:
    """Layers per stage (contiguous, each >= 1) minimizing the most expensive stage."""
    n = len(costs)
    if n < n_stages:
        raise ValueError(f"{n} layers cannot fill {n_stages} pipeline stages; lower pp or pp_virtual")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def stage_cost(a: int, b: int, stage: int) -> float:
        extra = (first_extra if stage == 0 else 0.0) + (last_extra if stage == n_stages - 1 else 0.0)
        return prefix[b] - prefix[a] + extra

    # best[k][i]: smallest achievable maximum cost placing the first i layers in k stages
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, n_stages + 1):
        for i in range(k, n - (n_stages - k) + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], stage_cost(j, i, k - 1))
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    counts, i = [], n
    for k in range(n_stages, 0, -1):
        counts.append(i - cut[k][i])
        i = cut[k][i]
    return counts[::-1]


def stage_layers(args, n_stages: int, seq_len: int, override: list[int] | None = None) -> list[range]:
    """Which layers each stage holds."""
    if override:
        if len(override) != n_stages or sum(override) != args.n_layers or min(override) < 1:
            raise ValueError(
                f"parallel.pp_layers={override} must give {n_stages} stages of >= 1 layer summing to "
                f"n_layers={args.n_layers}"
            )
        counts = list(override)
    else:
        counts = uniform_balance(block_cost(args, seq_len), args.n_layers, n_stages, head_cost(args))
    starts = [sum(counts[:i]) for i in range(n_stages)]
    return [range(start, start + count) for start, count in zip(starts, counts)]


@functools.cache
def uniform_balance(block: float, n_layers: int, n_stages: int, head: float) -> tuple[int, ...]:
    """`balance` of `n_layers` blocks of one cost and a head on the last stage, once per arguments
    (a search asks for the same split for every other cut of the layout)."""
    return tuple(balance([block] * n_layers, n_stages, last_extra=head))


def cut_stage(model: nn.Module, layers: range, first: bool, last: bool) -> nn.Module:
    """This stage of `model`: its layers, plus the embedding when first, norm and head when last.
    The stage shares its modules (and Parameters) with `model`, which is left whole."""
    stage = copy.copy(model)
    stage._modules, stage._parameters, stage._buffers = (
        dict(model._modules),
        dict(model._parameters),
        dict(model._buffers),
    )
    stage.layers = nn.ModuleDict({str(i): model.layers[str(i)] for i in layers})
    if not first:
        stage.tok_embeddings = None
    if not last:
        stage.norm, stage.output = None, None
    return stage
