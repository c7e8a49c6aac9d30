"""What stops a run early, and how every rank agrees to stop after the same step.

Three things end a run before its last step:

- a signal (SIGINT, SIGTERM): the handler only notes it; the step in flight finishes, the
  checkpoint seam is called, and the process exits with 128 + the signal number;
- a non-finite loss or gradient norm: `train.on_nonfinite = "stop"` ends the run at once,
  `"skip"` drops the step's update and ends the run after `train.max_skipped` in a row;
- a collective that fails or times out (`train.collective_timeout`): `comm` raises
  `CollectiveError`, which the CLI reports in one line.

Signals arrive at different ranks at different moments, so each step ends with one small
all-reduce (max) over every rank of [signal number, non-finite flag, writing flag] on the
`control` cut: all ranks see the same three numbers and take the same decision (the writing flag:
a background checkpoint save still writing on some rank, `fivecut.train.saving`).
"""

from __future__ import annotations

import math
import signal
from collections.abc import Callable
from dataclasses import dataclass

import torch

from fivecut import comm

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
NONFINITE_EXIT = 3  # exit status of a run stopped by a non-finite loss or gradient
COLLECTIVE_EXIT = 1  # exit status of a rank whose collective failed or timed out
SAVES_FAILED_EXIT = 2  # exit status of a run stopped by checkpoint.max_failures failed saves in a row


class TrainingStopped(Exception):
    """The run ended early on purpose; `message` is the one line to print, `code` the exit status.
    `every_rank`: each rank says it (a signal reaches each process), else rank 0 speaks for all."""

    def __init__(self, message: str, code: int, every_rank: bool = False):
        super().__init__(message)
        self.message, self.code, self.every_rank = message, code, every_rank


@dataclass
class Verdict:
    """What every rank decided at the end of a step, from the control all-reduce."""

    signal: int  # 0: none received on any rank
    nonfinite: bool
    writing: bool = False  # a background save still writing on some rank


class SignalFlag:
    """Notes SIGINT / SIGTERM instead of raising; the old handlers come back on exit."""

    def __init__(self):
        self.received = 0
        self.previous: dict[int, object] = {}

    def __enter__(self) -> SignalFlag:
        for sig in STOP_SIGNALS:
            self.previous[sig] = signal.signal(sig, self._note)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def _note(self, signum: int, frame) -> None:
        self.received = self.received or signum


def agree(group: comm.Group, received: int, loss: float, norm: float, writing: bool = False) -> Verdict:
    """Combine every rank's [signal, non-finite, writing] by max over `group` (all ranks)."""
    nonfinite = not (math.isfinite(loss) and math.isfinite(norm))
    flags = torch.tensor([received, int(nonfinite), int(writing)], dtype=torch.int32)
    comm.all_reduce(flags, group, op=torch.distributed.ReduceOp.MAX)
    return Verdict(int(flags[0]), bool(flags[1]), bool(flags[2]))


def signal_stop(signum: int, step: int) -> TrainingStopped:
    return TrainingStopped(f"stopped by {signal.Signals(signum).name} after step {step}", 128 + signum, True)


@dataclass
class NonFiniteGuard:
    """`train.on_nonfinite` applied step by step; counts the skipped steps."""

    policy: str  # "stop" | "skip"
    max_skipped: int
    in_a_row: int = 0
    total: int = 0

    def skips(self, step: int, nonfinite: bool, loss: float, norm: float) -> bool:
        """True: drop this step's update. Raises `TrainingStopped` under "stop"."""
        if not nonfinite:
            self.in_a_row = 0
            return False
        if self.policy == "stop":
            raise TrainingStopped(
                f'non-finite {describe(loss, norm)} at step {step}; stopped (train.on_nonfinite="stop"), '
                "nothing was saved for this step",
                NONFINITE_EXIT,
            )
        self.in_a_row += 1
        self.total += 1
        return True

    def exhausted(self, step: int) -> TrainingStopped | None:
        """After `max_skipped` skipped steps in a row, the reason to stop."""
        if self.in_a_row < self.max_skipped:
            return None
        steps = "step" if self.in_a_row == 1 else "steps"
        return TrainingStopped(
            f"{self.in_a_row} non-finite {steps} in a row up to step {step} (train.max_skipped={self.max_skipped}); "
            "stopped",
            NONFINITE_EXIT,
        )


@dataclass
class SaveFailures:
    """`checkpoint.on_error = "continue"` applied save by save: a failed save (abandoned on every
    rank, `checkpoint.SaveFailed`) is said in one line and recorded by `report(line, record)` (rank
    0's log and metrics.jsonl), and training goes on; `max_failures` in a row stop the run."""

    max_failures: int
    report: Callable[[str | None, dict], None]
    in_a_row: int = 0

    def saved(self) -> None:
        self.in_a_row = 0

    def failed(self, step: int, error: Exception) -> None:
        """Say and record the failed save of `step`; raises `TrainingStopped` (exit 2) at the limit."""
        self.in_a_row += 1
        record = {"step": step, "checkpoint_failed": str(error), "failures_in_a_row": self.in_a_row}
        if self.in_a_row >= self.max_failures:
            self.report(None, record)
            raise TrainingStopped(
                f"{self.in_a_row} checkpoint saves in a row failed, the last of step {step} "
                f"(checkpoint.max_failures={self.max_failures}): {error}",
                SAVES_FAILED_EXIT,
            )
        self.report(
            f"fivecut: the checkpoint of step {step} was not saved, training goes on "
            f"({self.in_a_row} of checkpoint.max_failures={self.max_failures} in a row): {error}",
            record,
        )


def describe(loss: float, norm: float) -> str:
    """The values that are not finite, e.g. "loss=nan and gradient norm=inf"."""
    parts = [f"{name}={value}" for name, value in (("loss", loss), ("gradient norm", norm)) if not math.isfinite(value)]
    return " and ".join(parts)


def json_safe(value):
    """A metrics record with every non-finite float written as null (JSON has no NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value
