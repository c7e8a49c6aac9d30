"""Running a rank's schedule: the action list, executed with point-to-point messages.

Shapes are known in advance (hidden states [b_mb, s (/t with SP), h]), so receives are
posted into preallocated buffers. Every message is asynchronous: all of a step's receives
are posted when `run` starts (in the list's order, so between two ranks they are posted in
the order the peer sends), each is waited for just before the F or B that consumes it, and
the sends are awaited at the end of the step. `schedule.check` proves the lists
deadlock-free under a stricter model (a receive blocks at its own place in the list, sends
never block); waiting later, at the consumer, only lets a rank run further ahead and post
its sends sooner, so the proof still holds. Each message carries a tag derived from
(direction, stage, microbatch), so messages between the same two ranks can never be
confused. (This relies on a transport that matches tagged messages out of order, as gloo
does; one that matches in posting order, such as NCCL, would need the receives posted at
their places in the list.)

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
from fivecut.parallel.pipeline.schedule import Action, Schedule
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
    """A receive in flight: its buffer fills when the works complete."""

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
    state: dict[tuple[int, int], MicrobatchState] = field(default_factory=dict)
    sends: list = field(default_factory=list)
    posted: set[Action] = field(default_factory=set)  # the receives posted in this step

    def __post_init__(self):
        if self.schedule.split_backward and self.weight_grads is None:
            raise ValueError(
                f"{self.schedule.name} splits the backward: PipelineStep needs the stages' WeightGrads "
                "(Parallelized.pipeline.weight_grads, from parallelize)"
            )

    def run(self, batches: list[tuple[torch.Tensor, torch.Tensor]], denominator: int, ledger) -> torch.Tensor:
        """Execute every action of this rank; returns the sum of this rank's (last-stage) losses."""
        self.state, self.sends, self.posted = {}, [], set()
        self.batches, self.denominator = batches, denominator
        if self.weight_grads is not None:
            self.weight_grads.clear()  # what a step that raised half-way may have left
        total = torch.zeros((), device=self.positions.device)
        actions = self.schedule.actions[self.group.rank]
        for action in actions:  # every receive, as early as can be: nothing it needs is computed here
            if action.kind.startswith("RECV"):
                with ledger.phase("forward" if action.kind == "RECV_F" else "backward"):
                    self.post(action)
        last = self.last_backwards(actions)
        for i, action in enumerate(actions):
            phase = "forward" if action.kind in ("F", "SEND_F", "RECV_F") else "backward"
            with ledger.phase(phase):
                loss = self.execute(action)
                if self.stage_done is not None and last.get(action.stage) == i:
                    self.stage_done(action.stage)  # the stage's gradients are complete: reduce them
            if loss is not None:
                total += loss
        for work, _ in self.sends:
            comm.wait(work, "send", self.group)
        self.state, self.sends = {}, []  # the graphs were freed by backward; drop the boundary tensors
        if self.weight_grads is not None and self.weight_grads.pending:
            raise RuntimeError(f"W never ran for {sorted(self.weight_grads.pending)}")
        return total

    def last_backwards(self, actions: list[Action]) -> dict[int, int]:
        """stage -> index of its last action that produces gradients (B, or W when split)."""
        kind = "W" if self.schedule.split_backward else "B"
        return {a.stage: i for i, a in enumerate(actions) if a.kind == kind}

    @torch.no_grad()
    def forward_only(self, batches: list[tuple[torch.Tensor, torch.Tensor]], denominator: int) -> torch.Tensor:
        """Evaluation: every microbatch through the stages in order (no backward, nothing kept)."""
        self.state, self.sends, self.posted = {}, [], set()
        self.batches, self.denominator = batches, denominator
        total = torch.zeros((), device=self.positions.device)
        mine = set(self.schedule.stages_of(self.group.rank))
        for m in range(len(batches)):
            for s in range(self.schedule.n_stages):
                if s not in mine:
                    continue
                steps = [Action("RECV_F", s, m)] if s > 0 and self.schedule.stage_rank[s - 1] != self.group.rank else []
                steps.append(Action("F", s, m))
                if s < self.schedule.n_stages - 1 and self.schedule.stage_rank[s + 1] != self.group.rank:
                    steps.append(Action("SEND_F", s, m))
                for action in steps:
                    loss = self.execute(action)
                    if loss is not None:
                        total += loss
        for work, _ in self.sends:
            comm.wait(work, "send", self.group)
        return total

    # ------------------------------------------------------------ dispatch

    def execute(self, action: Action) -> torch.Tensor | None:
        self.reap_sends()
        mb = self.state.setdefault((action.stage, action.microbatch), MicrobatchState())
        if action.kind == "F":
            return self.forward(action, mb)
        if action.kind == "B":
            self.backward(action, mb)
        elif action.kind == "W":
            self.weight_grad(action, mb)
        elif action.kind == "SEND_F":
            self.send(mb.output.detach(), action.stage + 1, action, forward=True)
        elif action.kind == "SEND_B":
            self.send(mb.grad_input, action.stage - 1, action, forward=False)
            mb.grad_input = None  # the send holds it until it is out
        elif action.kind.startswith("RECV"):
            self.post(action)  # already posted when `run` began; `forward_only` posts here
        else:
            raise ValueError(f"unknown pipeline action {action}")
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
        if action.stage > 0 and self.here(action.stage - 1):
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
            self.hand_back(action, mb.grad_input)
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
        for work, tensor in self.sends:
            if work.is_completed():
                comm.wait(work, "send", self.group)
            else:
                pending.append((work, tensor))
        self.sends = pending

    def send(self, tensor: torch.Tensor, to_stage: int, action: Action, forward: bool) -> None:
        boundary = min(action.stage, to_stage)
        peer = self.schedule.stage_rank[to_stage]
        tensor = tensor.contiguous()
        works = comm.batch_send_recv([(tensor, peer)], [], self.group, tag=self.tag(action, forward, boundary))
        self.sends += [(work, tensor) for work in works]  # the tensor stays alive until the send completes

    def post(self, action: Action) -> None:
        """Post the receive `action` (once per step) into a fresh buffer; its consumer waits for it."""
        if action in self.posted:
            return
        self.posted.add(action)
        mb = self.state.setdefault((action.stage, action.microbatch), MicrobatchState())
        forward = action.kind == "RECV_F"
        from_stage = action.stage - 1 if forward else action.stage + 1
        boundary = min(action.stage, from_stage)
        peer = self.schedule.stage_rank[from_stage]
        buffer = torch.empty(self.hidden_shape, dtype=self.dtype, device=self.positions.device)
        works = comm.batch_send_recv([], [(buffer, peer)], self.group, tag=self.tag(action, forward, boundary))
        if forward:
            mb.arriving_input = Posted(buffer, works)
        else:
            mb.arriving_grad = Posted(buffer, works)

    def wait(self, posted: Posted, op: str) -> torch.Tensor:
        """Block until a posted receive has arrived (just before the action that consumes it)."""
        for work in posted.works:
            comm.wait(work, op, self.group)
        return posted.buffer
