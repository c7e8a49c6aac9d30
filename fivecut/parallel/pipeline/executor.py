"""Running a rank's schedule: the action list, executed with point-to-point messages.

Shapes are known in advance (hidden states [b_mb, s (/t with SP), h]), so receives are
posted into preallocated buffers. Sends are asynchronous (their completion is awaited at
the end of the step); a receive blocks just before the action that consumes it, the
execution model under which `schedule.check` proved the lists deadlock-free. Each message
carries a tag derived from (direction, stage, microbatch), so messages between the same
two ranks can never be confused.

The loss is computed on the last stage as the sum of token losses divided by the token
count of the global batch, so microbatches, stages and data-parallel ranks add up to the
single-device loss and gradient. With a split backward (zero-bubble schedules), B computes
the gradient of the stage's input only (keeping the graph) and W the weights' gradients.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from fivecut import comm
from fivecut.comm import Group
from fivecut.parallel.pipeline.schedule import Action, Schedule


@dataclass
class MicrobatchState:
    input: torch.Tensor | None = None  # what the stage received (requires grad), or the tokens
    output: torch.Tensor | None = None  # hidden state sent on, or the loss on the last stage
    grad_output: torch.Tensor | None = None  # received from the next stage
    grad_input: torch.Tensor | None = None  # sent to the previous stage


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
    state: dict[tuple[int, int], MicrobatchState] = field(default_factory=dict)
    sends: list = field(default_factory=list)

    def run(self, batches: list[tuple[torch.Tensor, torch.Tensor]], denominator: int, ledger) -> torch.Tensor:
        """Execute every action of this rank; returns the sum of this rank's (last-stage) losses."""
        self.state, self.sends = {}, []
        self.batches, self.denominator = batches, denominator
        total = torch.zeros((), device=self.positions.device)
        for action in self.schedule.actions[self.group.rank]:
            phase = "forward" if action.kind in ("F", "SEND_F", "RECV_F") else "backward"
            with ledger.phase(phase):
                loss = self.execute(action)
            if loss is not None:
                total += loss
        for work, _ in self.sends:
            comm.wait(work, "send", self.group)
        self.state, self.sends = {}, []  # the graphs were freed by backward; drop the boundary tensors
        return total

    @torch.no_grad()
    def forward_only(self, batches: list[tuple[torch.Tensor, torch.Tensor]], denominator: int) -> torch.Tensor:
        """Evaluation: every microbatch through the stages in order (no backward, nothing kept)."""
        self.state, self.sends = {}, []
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
        elif action.kind == "RECV_F":
            mb.input = self.receive(action.stage - 1, action, forward=True).requires_grad_()
        elif action.kind == "RECV_B":
            mb.grad_output = self.receive(action.stage + 1, action, forward=False)
        else:
            raise ValueError(f"unknown pipeline action {action}")
        return None

    # ------------------------------------------------------------ compute

    def forward(self, action: Action, mb: MicrobatchState) -> torch.Tensor | None:
        inputs, targets = self.batches[action.microbatch]
        stage = self.stages[action.stage]
        if action.stage == 0:
            mb.input = inputs
        with self.forward_context(action.microbatch):
            out = stage(mb.input, positions=self.positions)
            if action.stage == self.schedule.n_stages - 1:
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
        grad = None if action.stage == self.schedule.n_stages - 1 else mb.grad_output
        needs_input = action.stage > 0
        if self.schedule.split_backward:  # B: the input's gradient only; W follows
            if needs_input:
                (mb.grad_input,) = torch.autograd.grad(mb.output, [mb.input], grad, retain_graph=True)
                self.hand_back(action, mb.grad_input)
            return
        torch.autograd.backward(mb.output, grad)
        if needs_input:
            mb.grad_input = mb.input.grad
            self.hand_back(action, mb.grad_input)

    def weight_grad(self, action: Action, mb: MicrobatchState) -> None:
        grad = None if action.stage == self.schedule.n_stages - 1 else mb.grad_output
        params = [p for p in self.stages[action.stage].parameters() if p.requires_grad]
        torch.autograd.backward(mb.output, grad, inputs=params)

    # ------------------------------------------------------------ messages

    def tag(self, action: Action, forward: bool, stage: int) -> int:
        """Same on both ends: (direction, the boundary's lower stage, microbatch)."""
        return (2 * (stage * self.schedule.microbatches + action.microbatch)) + (0 if forward else 1)

    def send(self, tensor: torch.Tensor, to_stage: int, action: Action, forward: bool) -> None:
        boundary = min(action.stage, to_stage)
        peer = self.schedule.stage_rank[to_stage]
        tensor = tensor.contiguous()
        works = comm.batch_send_recv([(tensor, peer)], [], self.group, tag=self.tag(action, forward, boundary))
        self.sends += [(work, tensor) for work in works]  # the tensor stays alive until the send completes

    def receive(self, from_stage: int, action: Action, forward: bool) -> torch.Tensor:
        boundary = min(action.stage, from_stage)
        peer = self.schedule.stage_rank[from_stage]
        buffer = torch.empty(self.hidden_shape, dtype=self.dtype, device=self.positions.device)
        works = comm.batch_send_recv([], [(buffer, peer)], self.group, tag=self.tag(action, forward, boundary))
        for work in works:
            comm.wait(work, "recv", self.group)
        return buffer
