"""The bytes eager PyTorch's memory-bound kernels move in a step, counted op by op, against what the
planner counts (`fivecut.plan.cost`): the ratios the GPU presets' `activation_gbps` and `loss_gbps`
divide a device's streaming bandwidth by (`fivecut.plan.cluster`).

    PYTHONPATH=. python benchmarks/eager_traffic.py [--model llama-1b] [--rows 8] [--seq 2048]

Nothing runs on a device: fivecut's own block (`fivecut.model.transformer`) and the loss
(`token_loss_sum`) run forward and backward on the meta device in bf16 under a dispatch mode that
adds up, for every aten op but the matmuls and views, the bytes of its tensor inputs and outputs
(an eager kernel reads its inputs and writes its outputs once). The attention core is replaced by
an opaque function of the same shapes: on the meta device SDPA would take its unfused math path,
and on a GPU it is one fused kernel the planner times by its FLOPs. The loss's count is corrected
for the two kernels that touch less than their inputs: the negative log-likelihood's forward reads
one logit a token, and its backward does not read the log-probabilities.

    block     the bytes a block's memory-bound kernels move (forward and backward), against the
              planner's `3 x activation_bytes_per_layer` (`fivecut.plan.cost.stage_traffic`)
    loss      bytes a logit of the full-logits cross-entropy, against `LOSS_BYTES`
"""

from __future__ import annotations

import argparse
import collections
import dataclasses

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from fivecut.model.presets import PRESETS
from fivecut.model.transformer import Transformer
from fivecut.parallel.parallelize import token_loss_sum
from fivecut.plan.activations import activation_bytes_per_layer
from fivecut.plan.cost import LOSS_BYTES

COMPUTE_BOUND = {"mm", "addmm", "bmm", "linear"}  # timed by their FLOPs
NO_TRAFFIC = {  # views, allocations and metadata: no kernel that moves the tensor
    *("view", "_unsafe_view", "t", "transpose", "unsqueeze", "squeeze", "expand", "slice", "split", "chunk"),
    *("split_with_sizes", "select", "permute", "as_strided", "alias", "detach", "reshape", "lift_fresh"),
    *("empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "zeros_like", "ones_like"),
    *("randn_like", "scalar_tensor", "randint", "randn"),
}


class ByteCount(TorchDispatchMode):
    """Bytes in and out of every memory-bound aten op, by op."""

    def __init__(self):
        super().__init__()
        self.bytes: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name not in COMPUTE_BOUND and name not in NO_TRAFFIC:
            tensors = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
            self.bytes[name] += sum(t.numel() * t.element_size() for t in tensors)
        return out


class OpaqueCore(torch.autograd.Function):
    """The attention core as one kernel of known shapes whose traffic is not counted here."""

    @staticmethod
    def forward(ctx, q, k, v):  # [b, heads, s, hd]
        ctx.shapes = (k.shape, v.shape)
        return torch.empty_like(q)

    @staticmethod
    def backward(ctx, grad):
        k, v = ctx.shapes
        return torch.empty_like(grad), grad.new_empty(k), grad.new_empty(v)


class Opaque(torch.nn.Module):
    def forward(self, q, k, v, documents=None):  # the attention cores' signature (no document masks here)
        return OpaqueCore.apply(q, k, v)


def block_traffic(name: str, rows: int, seq: int) -> tuple[float, float]:
    """(bytes eager kernels move in block 0's forward and backward, the planner's count)."""
    args = dataclasses.replace(PRESETS[name], n_layers=1, max_seq_len=max(seq, PRESETS[name].max_seq_len))
    model = Transformer(args).to(device="meta", dtype=torch.bfloat16)
    block = model.layers["0"]
    block.attention.core = Opaque()
    x = torch.empty(rows, seq, args.dim, device="meta", dtype=torch.bfloat16, requires_grad=True)
    rope = (model.rope_cos[:seq], model.rope_sin[:seq])
    with ByteCount() as count:
        y = block(x, rope)
        y.backward(torch.empty_like(y))
    return sum(count.bytes.values()), 3 * activation_bytes_per_layer(args, rows, seq, 1, False, "bf16")


def loss_traffic(vocab: int, tokens: int = 256) -> float:
    """Bytes a logit that the full-logits cross-entropy's kernels move (forward and backward)."""
    logits = torch.empty(1, tokens, vocab, device="meta", dtype=torch.bfloat16, requires_grad=True)
    targets = torch.zeros(1, tokens, dtype=torch.long, device="meta")
    with ByteCount() as count:
        token_loss_sum(logits, targets).backward()
    log_probs = 4 * tokens * vocab  # [T, V] fp32: counted as read whole by each nll kernel, read by neither
    # (the forward reads one a token; the backward writes the zeros and the targets' entries)
    return (sum(count.bytes.values()) - 2 * log_probs) / (tokens * vocab)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-1b", choices=sorted(PRESETS))
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    opts = parser.parse_args()
    moved, counted = block_traffic(opts.model, opts.rows, opts.seq)
    per_logit = loss_traffic(PRESETS[opts.model].vocab_size)
    print(f"# {opts.model}, {opts.rows} x {opts.seq} tokens, bf16, forward and backward on the meta device")
    print("| part | eager kernels move | the planner counts | ratio |")
    print("|---|---:|---:|---:|")
    print(f"| a block | {moved / 1e9:.2f} GB | {counted / 1e9:.2f} GB | {moved / counted:.2f} |")
    print(f"| the loss, a logit | {per_logit:.0f} B | {LOSS_BYTES} B | {per_logit / LOSS_BYTES:.2f} |")
    print(f"block_ratio={moved / counted:.3f} loss_ratio={per_logit / LOSS_BYTES:.3f}")


if __name__ == "__main__":
    main()
