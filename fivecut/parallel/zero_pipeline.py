"""ZeRO-2 and ZeRO-3 inside a pipeline: one data cut per stage, reduced when the stage is done.

A rank of a pipeline holds one stage (1F1B, GPipe, ZB1P) or two (interleaved with
pp_virtual=2, DualPipeV) and runs M microbatches through each per accumulation step. Each
stage gets its own ZeRO-2 (`ZeroDataParallel`, buckets of that stage only) or ZeRO-3
(`FullyShardedDataParallel` over the stage's units: embedding, blocks, norm + head), so
that a stage's reduction depends on that stage alone.

Gradients: the stage's full gradients accumulate (autograd's own `.grad`) over the M
microbatches; when the executor has run the stage's last backward of the schedule (its last
B, or its last W under a split backward: W produces the linear layers' weight gradients),
it calls `stage_done`, which launches the stage's reduce-scatters into the shard gradients
and frees the full gradients. So each accumulation step reduce-scatters each gradient once
(the fewest bytes: Psi_stage per step, as ZeRO-2 without a pipeline reduces once per
micro-step), at the cost of holding the stage's full gradients (4Psi_stage bytes) from its
first backward to its last; between steps only the shards remain (4Psi/n).

A stage that holds a tied embedding (the first and the last) waits: its copy's gradient
must first be summed over the two ends (`Pipeline.sum_tied_grads`, on the full gradients),
which happens after the schedule; `reduce` then starts it. Every rank of a dp group has the
same pipeline position, so all issue the same collectives in the same order.

ZeRO-3 parameters (`parallel.reshard_after_forward`):
  true   each unit is gathered for every microbatch's forward, freed after it, gathered again
         for that microbatch's backward and freed when the next unit's backward starts (the
         last at the end of B): 2M all-gathers of the stage per step. W needs no parameter
         (dW = dy^T x from what B kept, `pipeline/wgrad.py`), so nothing is gathered for it.
  false  each unit is gathered at the stage's first forward and kept until its reduction
         after the last backward / W: one all-gather per step, the stage's parameters held
         in full through the schedule.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

from torch import nn

from fivecut.parallel.data import GradSync, SyncSet
from fivecut.parallel.placement import FlatSlot


class StageCut(GradSync, Protocol):
    """A data cut of one stage: ZeRO-2's `ZeroDataParallel` or ZeRO-3's `FullyShardedDataParallel`."""

    def start_reduce(self) -> None: ...  # the stage's last backward (or W) is done: reduce-scatter now


class StagedSync(SyncSet):
    """The data cuts of this rank's stages (`cuts[stage]`, one per gradient group), driven as one;
    each stage's reduction starts when the executor says the stage is done (`stage_done`)."""

    def __init__(self, cuts: dict[int, list[StageCut]], waiting: set[int]):
        super().__init__([cut for stage in sorted(cuts) for cut in cuts[stage]])
        self.cuts = cuts
        self.waiting = waiting  # stages whose reduction waits for the tied embedding's sum
        self.started: set[int] = set()

    def stage_done(self, stage: int) -> None:
        """The executor ran the stage's last backward (or W) of the schedule."""
        if stage not in self.waiting:
            self._start(stage)

    def _start(self, stage: int) -> None:
        self.started.add(stage)
        for cut in self.cuts[stage]:
            cut.start_reduce()

    def reduce(self) -> None:
        """After the schedule (and the tied sum): start the stages still waiting; wait for all."""
        for stage in sorted(set(self.cuts) - self.started):
            self._start(stage)
        super().reduce()
        self.started.clear()

    def flat_slots(self) -> dict[nn.Parameter, FlatSlot]:
        """Every cut's slots, its buffers numbered after the previous cut's (one number per buffer:
        two stages' cuts over the same group must not share one)."""
        out: dict[nn.Parameter, FlatSlot] = {}
        base = 0
        for cut in self.syncs:
            slots = cut.flat_slots()
            out.update({p: dataclasses.replace(slot, buffer=base + slot.buffer) for p, slot in slots.items()})
            base += 1 + max((slot.buffer for slot in slots.values()), default=-1)
        return out
