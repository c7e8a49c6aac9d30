"""Closed-form model-state memory per rank (fp32 parameters, gradients and Adam moments).

stage   params   grads    Adam (2 moments)   total
DDP     4Psi     4Psi     8Psi               16Psi
ZeRO-1  4Psi     4Psi     8Psi/n             8Psi + 8Psi/n
ZeRO-2  4Psi     4Psi/n   8Psi/n             4Psi + 12Psi/n
ZeRO-3  4Psi/n   4Psi/n   8Psi/n             16Psi/n   (+ the units gathered at the time)

n is the ranks a state is sharded over: its reduce group, or with `parallel.zero_shard = S`
(hybrid sharding) the part of it in one shard group (S for most parameters; `shard_group_sizes`).

Under train.dtype = "bf16" the masters, gradient shards and moments stay fp32, so the table holds;
only ZeRO-3's gathered units (freed between steps, not counted here) are bf16: 2 bytes a parameter.
"""

from __future__ import annotations


def model_state_bytes(psi: int, zero: int, n: int) -> dict[str, float]:
    params = 4 * psi / (n if zero == 3 else 1)
    grads = 4 * psi / (n if zero >= 2 else 1)
    adam = 8 * psi / (n if zero >= 1 else 1)
    return {"params": params, "grads": grads, "optimizer": adam, "total": params + grads + adam}


def formula(zero: int) -> str:
    return {0: "16Psi", 1: "8Psi + 8Psi/n", 2: "4Psi + 12Psi/n", 3: "16Psi/n"}[zero]
