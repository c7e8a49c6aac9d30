"""The plain records of a layout and of MoE training options, free of torch.

`ParallelDims` is the `[parallel]` section and `MoEOptions` the `[moe]` one; a config file
is parsed into them without importing torch. Whether they can work is decided in
`fivecut.checks`; the process groups they describe are built in `fivecut.mesh`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

MESH_DIMS = ("pp", "dp", "cp", "tp")
CP_MODES = ("ring", "ulysses")


@dataclass
class ParallelDims:
    dp: int = 1  # data-parallel replicas
    zero: int = 0  # 0 = DDP; 1/2/3 shard optimizer state / + gradients / + parameters over dp
    reshard_after_forward: bool = True  # ZeRO-3: free gathered parameters after forward (re-gather for backward)
    tp: int = 1  # tensor-parallel ranks (inside a node)
    sp: bool = False  # Megatron sequence parallelism inside the tp group
    pp: int = 1  # pipeline stages (ranks)
    pp_schedule: str = "1f1b"
    pp_virtual: int = 1  # stages per pipeline rank (interleaved, dualpipev)
    microbatches: int = 1  # pipeline microbatches per step
    pp_layers: list[int] | None = None  # layers per pipeline stage; None: balanced by cost
    cp: int = 1  # context-parallel ranks (sequence split inside attention)
    cp_mode: str = "ring"  # "ring" | "ulysses"
    ep: int = 1  # expert-parallel ranks, folded into dp x cp

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.pp, self.dp, self.cp, self.tp)

    def describe(self) -> str:
        parts = [f"{name}={getattr(self, name)}" for name in MESH_DIMS + ("ep",) if getattr(self, name) > 1]
        if self.zero:
            parts.append(f"zero={self.zero}")
        if self.sp:
            parts.append("sp=true")
        return ",".join(parts) or "single"

    def settings(self) -> str:
        """Every field that differs from its default, as `--layout` spells it (`describe` names the cuts only)."""
        parts = [
            f"{f.name}={spelled(getattr(self, f.name))}" for f in fields(self) if getattr(self, f.name) != f.default
        ]
        return ",".join(parts) or "single"


def spelled(value: object) -> str:
    """A value as a TOML literal of `--layout` (bare words are strings): true, [2,2], ulysses."""
    if isinstance(value, bool):
        return str(value).lower()
    return str(value).replace(" ", "")


@dataclass
class MoEOptions:
    """The `[moe]` section: how MoE layers are trained (the architecture is in `[model]`)."""

    capacity_factor: float | None = None  # slots per expert per sequence = ceil(c * s * k / E); None: dropless
    aux_loss_coef: float = 0.0  # alpha of the auxiliary load-balancing loss; 0: off
    bias_update_rate: float = 0.0  # gamma of auxiliary-loss-free balancing (DeepSeek-V3: 0.001); 0: off
    eplb_slots: int = 0  # EPLB: extra expert slots per EP rank for copies of hot experts
    eplb_move: bool = False  # EPLB: also move experts (weights and optimizer state) between ranks
    eplb_interval: int = 10  # EPLB: steps between re-placements
    eplb_window: int = 10  # EPLB: steps of load history a placement is planned from

    def changed(self) -> list[str]:
        """The fields set to something other than their defaults."""
        return [f.name for f in fields(self) if getattr(self, f.name) != f.default]

    @property
    def eplb(self) -> bool:
        return self.eplb_slots > 0 or self.eplb_move
