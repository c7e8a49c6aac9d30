"""The communication ledger: every byte a rank moves, by cut, op and phase.

`fivecut.comm` writes one `Record` per collective call. Wire bytes are the bytes a rank
sends over its links under the standard ring algorithms:

    all_reduce                          2(n-1)/n x tensor bytes
    all_gather / reduce_scatter         (n-1)/n  x bytes of the full (gathered / unreduced) tensor
    all_to_all                          bytes this rank sends to the other ranks ((n-1)/n when even)
    send / recv                         1        x tensor bytes

The planner's closed forms are checked against these sums (`fivecut ledger`).
"""

from __future__ import annotations

from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass

PHASES = ("forward", "backward", "optimizer", "metrics")


def ring_factor(op: str, group_size: int) -> float:
    """Fraction of the tensor's bytes a rank puts on the wire for `op` in a ring of `group_size`."""
    n = group_size
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    if op in ("send", "recv"):
        return 1.0
    raise ValueError(f"no wire factor for op {op!r}")


@dataclass(frozen=True)
class Record:
    step: int
    cut: str
    op: str
    phase: str
    group_size: int
    elements: int  # elements of the full tensor (see module docstring)
    bytes: int
    wire_bytes: float


@dataclass
class Row:
    cut: str
    op: str
    phase: str
    calls: int = 0
    elements: int = 0
    bytes: int = 0
    wire_bytes: float = 0.0


class Ledger:
    """Per-rank record of collectives. The trainer names the phase; `comm` fills the rest."""

    def __init__(self) -> None:
        self.records: list[Record] = []
        self.step = 0
        self.current_phase = "forward"

    @contextmanager
    def phase(self, name: str):
        if name not in PHASES:
            raise ValueError(f"unknown phase {name!r}; phases are {PHASES}")
        previous, self.current_phase = self.current_phase, name
        try:
            yield
        finally:
            self.current_phase = previous

    def begin_step(self, step: int) -> None:
        """Start accounting for optimizer step `step`, forgetting older steps."""
        self.step = step
        self.records.clear()

    def record(
        self, op: str, cut: str, group_size: int, elements: int, itemsize: int, wire_bytes: float | None = None
    ) -> None:
        nbytes = elements * itemsize
        wire = nbytes * ring_factor(op, group_size) if wire_bytes is None else wire_bytes
        self.records.append(Record(self.step, cut, op, self.current_phase, group_size, elements, nbytes, wire))

    def rows(self, cut: str | None = None) -> list[Row]:
        """Records summed by (cut, op, phase), in order of first appearance."""
        table: dict[tuple[str, str, str], Row] = {}
        for r in self.records:
            if cut is not None and r.cut != cut:
                continue
            row = table.setdefault((r.cut, r.op, r.phase), Row(r.cut, r.op, r.phase))
            row.calls += 1
            row.elements += r.elements
            row.bytes += r.bytes
            row.wire_bytes += r.wire_bytes
        return list(table.values())

    def wire_bytes(self, cut: str | None = None, op: str | None = None, phase: str | None = None) -> float:
        return sum(
            r.wire_bytes
            for r in self.records
            if (cut is None or r.cut == cut) and (op is None or r.op == op) and (phase is None or r.phase == phase)
        )

    def by_cut(self) -> dict[str, float]:
        totals: dict[str, float] = defaultdict(float)
        for r in self.records:
            totals[r.cut] += r.wire_bytes
        return dict(totals)

    def table(self) -> str:
        return format_rows(self.rows())


def format_rows(rows: list[Row]) -> str:
    header = f"{'cut':<8} {'op':<15} {'phase':<10} {'calls':>6} {'elements':>14} {'wire bytes/rank':>17}"
    lines = [header, "-" * len(header)]
    for row in rows:
        lines.append(
            f"{row.cut:<8} {row.op:<15} {row.phase:<10} {row.calls:>6} {row.elements:>14,} {row.wire_bytes:>17,.0f}"
        )
    return "\n".join(lines)
