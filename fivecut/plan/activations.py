"""Activation memory a transformer layer keeps for backward, in the manner of Korthikanti et
al. ("Reducing Activation Recomputation in Large Transformer Models"), for fivecut's layer:
RMSNorm, grouped-query attention through SDPA (flash: saves q, k, v, the output and one
log-sum-exp per query), SwiGLU, no dropout.

In units of b*s*h elements per layer, with t tensor-parallel ranks:

    norms      6     input, normalized input and output of both norms (output = the
                     input the q/k/v or w1/w3 projections save)        -> /t only with SP
    attention  2/t + 2*kv*hd/h      q and attention output; k and v (kv = kv heads per rank)
    MLP        4F/(h t)             w1 out, silu(w1 out), w3 out, their product

plus per token: 2 rstd values (norms; /t with SP) and a/t log-sum-exps. Megatron's
figure for GPT (fp16, dropout, 4h GeLU MLP) is sbh(10 + 24/t + 5as/(ht)) with TP and
sbh(34/t + 5as/(ht)) with TP+SP: the same split between what TP leaves replicated and
what it cuts, which SP then cuts too.
"""

from __future__ import annotations


def activation_bytes_per_layer(args, batch: int, seq: int, tp: int, sp: bool, itemsize: int = 4) -> float:
    h, hd = args.dim, args.head_dim
    kv_heads_per_rank = max(args.n_kv_heads // tp, 1)
    norms = 6 / (tp if sp else 1)
    attention = 2 / tp + 2 * kv_heads_per_rank * hd / h
    mlp = 4 * args.ffn_dim / (h * tp)
    per_token = 2 / (tp if sp else 1) + args.n_heads / tp
    return itemsize * batch * seq * (h * (norms + attention + mlp) + per_token)
