"""Whole logits from a model under any layout, and a short greedy sample from it.

The trainer's forward gives each rank its part of the logits: cut by vocabulary under TP, by
sequence under CP, on the last stage only under PP. `full_logits` runs the same forward and puts
the parts back together on every rank, so a layout can be checked against a single process
logit for logit, and a training run can print what its model writes.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

from fivecut import comm
from fivecut.train import checkpoint
from fivecut.train.data import counted_targets
from fivecut.train.run import evaluate, local_tokens, pipeline_step, setup


def seq_multiple(dims) -> int:
    """The sequence lengths a layout can run are multiples of this (ring CP: 2cp chunks; USP: 2R
    zigzag chunks, their pairs cut over U; SP: tp)."""
    chunks = math.lcm(2 * dims.cp_ring, dims.cp) if dims.cp_ring > 1 else dims.cp
    return chunks * (dims.tp if dims.sp else 1)


@torch.no_grad()
def full_logits(ctx, tokens: torch.Tensor) -> torch.Tensor:
    """tokens [b, s] -> logits [b, s, vocab] on every rank, fp32. The sequence is padded on the right
    to a length the layout runs; causal attention keeps the padding out of the real positions."""
    b, s = tokens.shape
    m = seq_multiple(ctx.mesh.dims)
    padded = F.pad(tokens, (0, math.ceil(s / m) * m - s))  # [b, s_pad]
    inputs, _, positions = local_tokens(ctx, padded, padded)
    logits = local_logits(ctx, inputs, positions, padded.shape[1])  # [b, s_pad/cp, V_pad/tp] or None
    logits = whole_vocabulary(ctx, logits)  # [b, s_pad/cp, V]
    logits = whole_sequence(ctx, logits, positions, padded.shape[1])  # [b, s_pad, V]
    return from_last_stage(ctx, logits, (b, padded.shape[1], ctx.args.vocab_size))[:, :s]


def local_logits(ctx, inputs, positions, seq: int) -> torch.Tensor | None:
    """This rank's part of the logits; None on pipeline ranks without the last stage."""
    if ctx.par.pipeline is None:
        with ctx.autocast():
            return ctx.par.module(inputs, positions).float()
    kept = []

    def keep(logits, _targets):
        kept.append(logits.float())
        return logits.new_zeros(())

    step = pipeline_step(ctx, inputs.shape[0], positions, seq=seq, loss_sum=keep)
    step.forward_only([(inputs, inputs)], 1)
    return kept[0] if kept else None


def whole_vocabulary(ctx, logits: torch.Tensor | None) -> torch.Tensor | None:
    """[b, s, V_pad/tp] -> [b, s, V]: the tp ranks' contiguous vocabulary slices, padding dropped."""
    if logits is None or ctx.mesh.dims.tp == 1:
        return logits
    return comm.all_gather(logits.contiguous(), ctx.mesh.group("tp"), dim=-1)[..., : ctx.args.vocab_size]


def whole_sequence(ctx, logits, positions, seq: int):
    """[b, s/cp, V] at `positions` -> [b, s, V] in position order."""
    if logits is None or ctx.mesh.dims.cp == 1:
        return logits
    group = ctx.mesh.group("cp")
    every = comm.all_gather(logits.contiguous(), group, dim=1)  # [b, s, V] in rank order
    where = comm.all_gather(positions.contiguous(), group)  # [s] the position of each gathered row
    return every.new_zeros(every.shape).index_copy(1, where, every)


def from_last_stage(ctx, logits, shape) -> torch.Tensor:
    """Under PP, the last stage's logits on every pipeline rank (a sum with zeros elsewhere)."""
    if ctx.par.pipeline is None:
        return logits
    out = logits.contiguous() if logits is not None else torch.zeros(shape, device=ctx.device)
    comm.all_reduce(out, ctx.mesh.group("pp"))  # gloo reduces a contiguous buffer
    return out


@torch.no_grad()
def greedy_sample(ctx, tokenizer, prompt: str, new_tokens: int) -> str:
    """The prompt's greedy continuation (`new_tokens` ids, fewer at end of text) under the run's
    layout: a whole forward per token, no cache -- a few dozen tokens to show what the model writes."""
    ids = tokenizer.encode(prompt) or [tokenizer.eot_id or 0]
    limit = ctx.args.max_seq_len
    out: list[int] = []
    for _ in range(new_tokens):
        window = torch.tensor([(ids + out)[-limit:]], device=ctx.device)
        nxt = int(full_logits(ctx, window)[0, -1].argmax())
        if nxt == tokenizer.eot_id:
            break
        out.append(nxt)
    return tokenizer.decode(out)


# ---------------------------------------------------------------- evaluation


def evaluate_on_rank(cfg, checkpoint_path: str | None = None) -> dict:
    """`fivecut eval` on one rank: the model (imported by model.init_from, or the checkpoint's
    weights) under cfg's layout, its mean token loss on the validation split and the perplexity."""

    ctx = setup(cfg)
    if checkpoint_path is not None:
        checkpoint.load(checkpoint_path, ctx.par, ctx.optimizer, dataclasses.asdict(ctx.args))
    loss = evaluate(ctx)
    tokens = sum(counted_targets(batch[1]) for batch in ctx.val_batches)
    return {"loss": loss, "perplexity": math.exp(loss), "tokens": tokens}
