"""The plain records of a layout and of MoE training options, free of torch.

`ParallelDims` is the `[parallel]` section and `MoEOptions` the `[moe]` one; a config file
is parsed into them without importing torch. Each lists what is wrong with its own fields
(`problems()`, naming the keys); whether they work with a model, a pipeline schedule and a
world is decided in `fivecut.checks`, which composes these lists; the process groups they
describe are built in `fivecut.mesh`. This file is the bottom floor: it imports no fivecut module.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

MESH_DIMS = ("pp", "dp", "cp", "tp")
CP_MODES = ("ring", "ulysses")
COUNTS = ("ep", "pp_virtual", "microbatches")  # the other fields that count something, each >= 1


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

    def problems(self) -> list[str]:
        """What is wrong with these fields on their own (sizes, names, cuts that need another cut)."""
        out = [f"parallel.{n}={getattr(self, n)} must be >= 1" for n in (*MESH_DIMS, *COUNTS) if getattr(self, n) < 1]
        if self.zero not in (0, 1, 2, 3):
            out.append(f"parallel.zero={self.zero}; ZeRO stages are 0, 1, 2, 3")
        if self.cp_mode not in CP_MODES:
            out.append(f"parallel.cp_mode={self.cp_mode!r}; choose one of {', '.join(CP_MODES)}")
        if self.sp and self.tp == 1:
            out.append("parallel.sp=true needs tensor parallelism; set parallel.tp >= 2 or sp=false")
        if self.zero and self.dp == 1:
            out.append(f"parallel.zero={self.zero} shards over data-parallel ranks but dp=1; set parallel.dp >= 2")
        if self.pp_layers is not None and self.pp == 1:
            out.append(
                f"parallel.pp_layers={self.pp_layers} splits layers over pipeline stages but pp=1; set parallel.pp >= "
                "2 or remove pp_layers"
            )
        if self.ep > 1 and (self.dp * self.cp) % self.ep:
            out.append(f"ep={self.ep} must divide dp*cp={self.dp * self.cp} (expert ranks are borrowed from dp x cp)")
        return out

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

    def problems(self) -> list[str]:
        """What is wrong with these fields on their own (the model and the layout are `fivecut.checks`'s)."""
        out = []
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            out.append(f"moe.capacity_factor={self.capacity_factor} must be > 0 (leave it unset for dropless)")
        for key in ("aux_loss_coef", "bias_update_rate"):
            if not getattr(self, key) >= 0:
                out.append(f"moe.{key}={getattr(self, key)} must be >= 0")
        return out + self._eplb_problems()

    def _eplb_problems(self) -> list[str]:
        """Each problem once: an EPLB timing given without EPLB is refused as unused, whatever its value."""
        out = []
        if self.eplb_slots < 0:
            out.append(f"moe.eplb_slots={self.eplb_slots} must be >= 0")
        defaults = (MoEOptions.eplb_interval, MoEOptions.eplb_window)
        if not self.eplb and (self.eplb_interval, self.eplb_window) != defaults:
            out.append(
                "moe.eplb_interval and moe.eplb_window apply only to EPLB; set moe.eplb_slots >= 1 or "
                "moe.eplb_move=true, or leave them"
            )
        elif self.eplb_interval < 1 or self.eplb_window < 1:
            out.append("moe.eplb_interval and moe.eplb_window must be >= 1")
        return out

    def changed(self) -> list[str]:
        """The fields set to something other than their defaults."""
        return [f.name for f in fields(self) if getattr(self, f.name) != f.default]

    @property
    def eplb(self) -> bool:
        return self.eplb_slots > 0 or self.eplb_move
