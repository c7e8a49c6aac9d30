"""Running a rank's schedule: the action list, executed with point-to-point messages.

Shapes are known in advance (hidden states [b_mb, s (/t with SP), h]), so receives are
posted into buffers allocated at posting. The messages are posted where `schedule.posting`
puts them: before each compute action one batch (one `batch_isend_irecv`) of the sends of the
actions before it and of the receives entering the window, at most `window` compute actions
before their consumers; each receive is waited for just before the F or B that consumes it,
and the sends are let go when they are out (`reap_sends`) and awaited at the end of the step.
Every rank posts its messages in one global order, so the step runs under NCCL's semantics
(no tags; a rank's batches run in the order posted, a send completing with its receive),
which `schedule.check` proves for every schedule before a step runs (`streams`), and gloo's
(which matches by tag whenever both ends are posted) a fortiori. A stage holds at most
`window` posted receives at once: the step's memory does not grow with the microbatches
(`schedule.boundary_frontier` counts what it holds). Each message still carries a tag
derived from (direction, stage, microbatch), which nothing relies on.

The loss is computed on the last stage as the sum of token losses divided by the token
count of the global batch, so microbatches, stages and data-parallel ranks add up to the
single-device loss and gradient. With a split backward (zero-bubble schedules), B is the
stage's one backward with the linear layers' weight gradients left out, and W computes those
from what B kept (`wgrad.py`). Under ZeRO-2/3 the executor calls `stage_done(stage)` right after
a stage's last B (or last W) of the step, which starts that stage's gradient reduce-scatters
while the schedule's other actions go on (`fivecut.parallel.zero_pipeline`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from fivecut import comm
from fivecut.comm import Group
from fivecut.parallel.pipeline.schedule import WINDOW, Action, Schedule, Slot, posting
from fivecut.parallel.pipeline.wgrad import WeightGrads


@dataclass
class MicrobatchState:
    input: torch.Tensor | None = None  # what the stage received (requires grad), or the tokens
    output: torch.Tensor | None = None  # hidden state sent on, or the loss on the last stage
    grad_output: torch.Tensor | None = None  # received from the next stage
    grad_input: torch.Tensor | None = None  # sent to the previous stage
    arriving_input: Posted | None = None  # the posted receive of `input`
    arriving_grad: Posted | None = None  # the posted receive of `grad_output`


@dataclass
class Posted:
    """A receive in flight: its buffer fills when the works complete (its batch's, on NCCL)."""

    buffer: torch.Tensor  # [b_mb, s_local, h]
    works: list


@dataclass
class PipelineStep:
    """One rank's execution of `schedule` over a batch of microbatches."""

    schedule: Schedule
    stages: dict[int, nn.Module]  # stage index -> module, for the stages on this rank
    group: Group  # the pp group
    loss_sum: object  # (logits, targets) -> sum of token losses
    hidden_shape: tuple[int, ...]  # [b_mb, s_local, h]
    positions: torch.Tensor  # [s] positions of the full sequence (stages after the first get hidden states)
    forward_context: object  # (microbatch) -> context manager around each forward (saved tensors, autocast)
    dtype: torch.dtype = torch.float32
    weight_grads: WeightGrads | None = None  # split backward: what B keeps for W (`parallelize` makes it)
    stage_done: Callable[[int], None] | None = None  # ZeRO-2/3: called after a stage's last B (or W)
    loss_in_head: bool = False  # the last stage's head takes the targets and returns the loss (`LossHead`)
    window: int = WINDOW  # receives posted at most this many compute actions before their consumers
    state: dict[tuple[int, int], MicrobatchState] = field(default_factory=dict)
    sends: list = field(default_factory=list)  # (works, tensor, the output it was sent from): sends not yet out

    def __post_init__(self):
        if self.schedule.split_backward and self.weight_grads is None:
            raise ValueError(
                f"{self.schedule.name} splits the backward: PipelineStep needs the stages' WeightGrads "
                "(Parallelized.pipeline.weight_grads, from parallelize)"
            )

    def run(self, batches: list[tuple[torch.Tensor, torch.Tensor]], denominator: int, ledger) -> torch.Tensor:
        """Execute every action of this rank; returns the sum of this rank's (last-stage) losses."""
        self.state, self.sends = {}, []
        self.batches, self.denominator = batches, denominator
        if self.weight_grads is not None:
            self.weight_grads.clear()  # what a step that raised half-way may have left
        total = torch.zeros((), device=self.positions.device)
        slots = self.slots()
        last = self.last_backwards(slots)
        for i, slot in enumerate(slots):
            self.post(slot.post)
            if slot.compute is None:
                continue
            with ledger.phase("forward" if slot.compute.kind == "F" else "backward"):
                loss = self.execute(slot.compute)
                if self.stage_done is not None and last.get(slot.compute.stage) == i:
                    self.stage_done(slot.compute.stage)  # the stage's gradients are complete: reduce them
            if loss is not None:
                total += loss
        self.finish_sends()
        if self.weight_grads is not None and self.weight_grads.pending:
            raise RuntimeError(f"W never ran for {sorted(self.weight_grads.pending)}")
        return total

    def slots(self) -> list[Slot]:
        """This rank's step: before each compute action, the batch of messages posted there."""
        return posting(self.schedule, self.window)[self.group.rank]

    def last_backwards(self, slots: list[Slot]) -> dict[int, int]:
        """stage -> index of the slot of its last action that produces gradients (B, or W when split)."""
        kind = "W" if self.schedule.split_backward else "B"
        return {s.compute.stage: i for i, s in enumerate(slots) if s.compute is not None and s.compute.kind == kind}

    @torch.no_grad()
    def forward_only(self, batches: list[tuple[torch.Tensor, torch.Tensor]], denominator: int) -> torch.Tensor:
        """Evaluation: every microbatch through the stages in order (no backward, nothing kept); each
        message posted alone at its place, so every rank posts them in (microbatch, stage) order."""
        self.state, self.sends = {}, []
        self.batches, self.denominator = batches, denominator
        total = torch.zeros((), device=self.positions.device)
        mine = set(self.schedule.stages_of(self.group.rank))
        for m in range(len(batches)):
            for s in sorted(mine):
                if s > 0 and not self.here(s - 1):
                    self.post((Action("RECV_F", s, m),))
                loss = self.execute(Action("F", s, m))
                if loss is not None:
                    total += loss
                if s < self.schedule.n_stages - 1 and not self.here(s + 1):
                    self.post((Action("SEND_F", s, m),))
        self.finish_sends()
        return total

    # ------------------------------------------------------------ dispatch

    def execute(self, action: Action) -> torch.Tensor | None:
        """Run compute action `action` (its received inputs waited for first)."""
        self.reap_sends()
        mb = self.state.setdefault((action.stage, action.microbatch), MicrobatchState())
        if action.kind == "F":
            return self.forward(action, mb)
        if action.kind == "B":
            self.backward(action, mb)
        elif action.kind == "W":
            self.weight_grad(action, mb)
        else:
            raise ValueError(f"{action} is not a compute action")
        return None

    # ------------------------------------------------------------ compute

    def forward(self, action: Action, mb: MicrobatchState) -> torch.Tensor | None:
        inputs, targets, *documents = self.batches[action.microbatch]  # documents: data.document_mask
        documents = documents[0] if documents else None
        stage = self.stages[action.stage]
        if action.stage == 0:
            mb.input = inputs
        if mb.arriving_input is not None:
            mb.input = self.wait(mb.arriving_input, "recv").requires_grad_()
            mb.arriving_input = None
        with self.forward_context(action.microbatch):
            if action.stage != self.schedule.n_stages - 1:
                out = stage(mb.input, positions=self.positions, documents=documents)
            elif self.loss_in_head:  # the loss computed in the head, chunk by chunk
                out = stage(mb.input, positions=self.positions, targets=targets, documents=documents)
                out = out / self.denominator
            else:
                out = stage(mb.input, positions=self.positions, documents=documents)
                out = self.loss_sum(out, targets) / self.denominator
        mb.output = out
        if action.stage == self.schedule.n_stages - 1:
            return out.detach()
        if self.here(action.stage + 1):  # the next stage is on this rank too: hand over, no message
            self.state.setdefault(
                (action.stage + 1, action.microbatch), MicrobatchState()
            ).input = out.detach().requires_grad_()
        return None

    def here(self, stage: int) -> bool:
        return self.schedule.stage_rank[stage] == self.group.rank

    def hand_back(self, action: Action, grad_input: torch.Tensor) -> None:
        """The previous stage is on this rank too: its output's gradient, without a message."""
        self.state.setdefault((action.stage - 1, action.microbatch), MicrobatchState()).grad_output = grad_input

    def backward(self, action: Action, mb: MicrobatchState) -> None:
        """The stage's backward, once (the graph is freed). Split (zero-bubble): the linear layers'
        weight gradients are kept for W (`wgrad`); the rest of the stage's gradients come now."""
        if mb.arriving_grad is not None:
            mb.grad_output = self.wait(mb.arriving_grad, "recv")
            mb.arriving_grad = None
        grad = None if action.stage == self.schedule.n_stages - 1 else mb.grad_output
        split = self.schedule.split_backward
        with self.weight_grads.collecting(action.stage, action.microbatch) if split else contextlib.nullcontext():
            torch.autograd.backward(mb.output, grad)
        if action.stage > 0:
            mb.grad_input = mb.input.grad
            if self.here(action.stage - 1):
                self.hand_back(action, mb.grad_input)
                mb.grad_input = None
        mb.output = mb.grad_output = mb.input = None  # the microbatch's boundary tensors, done with here

    def weight_grad(self, action: Action, mb: MicrobatchState) -> None:
        """W: the deferred dW = dy^T x of the stage's linear layers for this microbatch."""
        self.weight_grads.apply(action.stage, action.microbatch)

    # ------------------------------------------------------------ messages

    def tag(self, action: Action, forward: bool, stage: int) -> int:
        """Same on both ends: (direction, the boundary's lower stage, microbatch)."""
        return (2 * (stage * self.schedule.microbatches + action.microbatch)) + (0 if forward else 1)

    def reap_sends(self) -> None:
        """The sends that are out: waited for (at once; a failed one raises) and their tensors let go,
        so that a step holds the boundary tensors still in flight, not every one it sent."""
        pending = []
        for works, tensor, output in self.sends:
            if all(map(comm.completed, works)):
                for work in works:
                    comm.wait(work, "send", self.group)
                release(output)
            else:
                pending.append((works, tensor, output))
        self.sends = pending

    def finish_sends(self) -> None:
        """The end of the step: every send waited for; the boundary tensors dropped (the graphs were
        freed by backward)."""
        for works, _, _ in self.sends:
            for work in works:
                comm.wait(work, "send", self.group)
        self.state, self.sends = {}, []

    def post(self, actions: tuple[Action, ...]) -> None:
        """Post a slot's sends and receives as one batch (nothing when empty); a receive's buffer is
        allocated here and its consumer waits for it (`wait`)."""
        if not actions:
            return
        sends = [(a, self.message(a)) for a in actions if a.kind.startswith("SEND")]
        recvs = [(a, self.message(a)) for a in actions if a.kind.startswith("RECV")]
        works = comm.batch_send_recv([m for _, m in sends], [m for _, m in recvs], self.group)
        posted = sends + recvs
        # gloo: a Work a message, sends first; NCCL: one Work for the whole batch
        per_message = [[w] for w in works] if len(works) == len(posted) else [works] * len(posted)
        for (action, message), mine in zip(posted, per_message):
            if action.kind.startswith("SEND"):
                output = self.state[(action.stage, action.microbatch)].output if action.kind == "SEND_F" else None
                self.sends.append((mine, message.tensor, output))  # the tensor stays alive until the send is out
                continue
            mb = self.state.setdefault((action.stage, action.microbatch), MicrobatchState())
            if action.kind == "RECV_F":
                mb.arriving_input = Posted(message.tensor, mine)
            else:
                mb.arriving_grad = Posted(message.tensor, mine)

    def message(self, action: Action) -> comm.P2P:
        """The tensor `action` sends, or a new buffer it receives into, with its peer, tag and phase."""
        forward = action.kind.endswith("F")
        other = action.stage + 1 if action.kind in ("SEND_F", "RECV_B") else action.stage - 1
        tag = self.tag(action, forward, min(action.stage, other))
        mb = self.state.setdefault((action.stage, action.microbatch), MicrobatchState())
        if action.kind == "SEND_F":
            tensor = mb.output.detach().contiguous()
        elif action.kind == "SEND_B":
            tensor, mb.grad_input = mb.grad_input.contiguous(), None  # the send holds it until it is out
        else:
            tensor = torch.empty(self.hidden_shape, dtype=self.dtype, device=self.positions.device)
        return comm.P2P(tensor, self.schedule.stage_rank[other], tag, "forward" if forward else "backward")

    def wait(self, posted: Posted, op: str) -> torch.Tensor:
        """Block until a posted receive has arrived (just before the action that consumes it)."""
        for work in posted.works:
            comm.wait(work, op, self.group)
        return posted.buffer


def release(output: torch.Tensor | None) -> None:
    """A stage's output, sent and out, let go (Megatron's deallocate_output_tensor): B needs only
    its grad_fn, and the residual add that makes a block's output (AddBackward0) keeps nothing of
    it, so its memory goes and a stride-0 view of one element [b_mb, s, h] stands in. An output
    made otherwise (a compiled block's: its graph may keep it) stays until B."""
    if output is not None and output._base is None and type(output.grad_fn).__name__ == "AddBackward0":
        output.data = output.new_empty(1).expand(output.shape)
