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
CP_MODES = ("ring", "ulysses", "usp")
LAYOUTS = ("manual", "auto")  # the cuts as written; the planner's choice for the world (`fivecut.plan.auto`)
COUNTS = ("ep", "pp_virtual", "microbatches", "cp_ulysses")  # the other fields that count something, each >= 1


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
    microbatches: int | None = None  # pipeline microbatches per step; None: the fewest that work (`checks`)
    pp_layers: list[int] | None = None  # layers per pipeline stage; None: balanced by cost
    cp: int = 1  # context-parallel ranks (sequence split inside attention)
    cp_mode: str = "ring"  # "ring" | "ulysses" | "usp"
    cp_ulysses: int = 1  # usp: the Ulysses degree U (groups of U consecutive cp ranks); the ring runs over cp/U
    ep: int = 1  # expert-parallel ranks, folded into dp x cp
    etp: int = 1  # expert tensor parallelism: each routed expert's hidden size cut over etp ranks of the tp group
    zero_shard: int | None = None  # ZeRO shards over groups of this many dp x cp ranks, replicated across; None: all
    layout: str = "manual"  # "manual": the cuts above; "auto": `fivecut train` asks the planner for its world's best
    cluster: str | None = None  # layout="auto": the cluster TOML (or NODESxGPUSxDEVICE); None: ./cluster-local.toml

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.pp, self.dp, self.cp, self.tp)

    def problems(self) -> list[str]:
        """What is wrong with these fields on their own (sizes, names, cuts that need another cut)."""
        counts = [n for n in (*MESH_DIMS, *COUNTS) if getattr(self, n) is not None]  # microbatches: None is unset
        out = [f"parallel.{n}={getattr(self, n)} must be >= 1" for n in counts if getattr(self, n) < 1]
        if self.zero not in (0, 1, 2, 3):
            out.append(f"parallel.zero={self.zero}; ZeRO stages are 0, 1, 2, 3")
        if self.cp_mode not in CP_MODES:
            out.append(f"parallel.cp_mode={self.cp_mode!r}; choose one of {', '.join(CP_MODES)}")
        out += self._usp_problems()
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
        if self.etp < 1:
            out.append(f"parallel.etp={self.etp} must be >= 1 (1: whole experts on each rank)")
        elif self.tp >= 1 and self.tp % self.etp:
            out.append(
                f"parallel.etp={self.etp} must divide tp={self.tp} (expert shards live on ranks of the tp group); "
                f"set parallel.etp to 1 or a divisor of tp"
            )
        return out + self._zero_shard_problems() + self._layout_problems()

    def _layout_problems(self) -> list[str]:
        if self.layout not in LAYOUTS:
            return [f"parallel.layout={self.layout!r}; choose one of {', '.join(LAYOUTS)}"]
        if self.cluster is not None and self.layout != "auto":
            return [
                f"parallel.cluster={self.cluster!r} is the cluster parallel.layout='auto' plans on; set "
                "parallel.layout='auto' or remove parallel.cluster"
            ]
        return []

    def _zero_shard_problems(self) -> list[str]:
        s, n = self.zero_shard, self.dp * self.cp
        if s is None:
            return []
        if s < 1:
            return [f"parallel.zero_shard={s} must be >= 1 (ranks per ZeRO shard group); leave it unset for all dp*cp"]
        if not self.zero:
            return [f"parallel.zero_shard={s} sets ZeRO's shard group but zero=0; set parallel.zero >= 1 or remove it"]
        if n % s:
            good = [d for d in range(1, n + 1) if n % d == 0]
            return [f"parallel.zero_shard={s} must divide dp*cp={n}; choose one of {good}"]
        if self.ep > 1 and s % self.ep and n % self.ep == 0:
            fit = next(d for d in range(s, n + 1) if d % self.ep == 0 and n % d == 0)
            return [
                f"parallel.zero_shard={s} must be a multiple of ep={self.ep} (each shard group holds whole "
                f"expert-parallel groups); e.g. zero_shard={fit}"
            ]
        return []

    @property
    def shard_size(self) -> int:
        """Ranks of dp x cp in one ZeRO shard group (`zero_shard`, default all of them)."""
        return self.zero_shard or self.dp * self.cp

    @property
    def hybrid(self) -> bool:
        """ZeRO shards over part of dp x cp and replicates across the groups (HSDP)."""
        return bool(self.zero) and self.shard_size < self.dp * self.cp

    def _usp_problems(self) -> list[str]:
        if self.cp_ulysses < 1:  # said with the other counts
            return []
        if self.cp_ulysses != 1 and self.cp_mode != "usp":
            return [
                f"parallel.cp_ulysses={self.cp_ulysses} is the Ulysses degree of cp_mode='usp', but cp_mode="
                f"{self.cp_mode!r}; set parallel.cp_mode='usp' or remove cp_ulysses"
            ]
        if self.cp % self.cp_ulysses:
            return [
                f"parallel.cp_ulysses={self.cp_ulysses} must divide cp={self.cp} (the ring runs over cp/cp_ulysses "
                f"groups); choose cp_ulysses from {[u for u in range(1, self.cp + 1) if self.cp % u == 0]}"
            ]
        return []

    @property
    def cp_ring(self) -> int:
        """USP's ring degree R = cp / U (1 under Ulysses; cp under ring)."""
        if self.cp_mode == "usp":
            return self.cp // self.cp_ulysses
        return self.cp if self.cp_mode == "ring" else 1

    def describe(self) -> str:
        parts = [f"{name}={getattr(self, name)}" for name in MESH_DIMS + ("ep", "etp") if getattr(self, name) > 1]
        if self.zero:
            parts.append(f"zero={self.zero}")
        if self.hybrid:
            parts.append(f"zero_shard={self.zero_shard}")
        if self.sp:
            parts.append("sp=true")
        return ",".join(parts) or "single"

    def settings(self) -> str:
        """Every field that differs from its default, as `--layout` spells it (`describe` names the cuts only);
        microbatches only under a pipeline, the only cut that reads them."""
        parts = [
            f"{f.name}={spelled(getattr(self, f.name))}"
            for f in fields(self)
            if getattr(self, f.name) != f.default and (f.name != "microbatches" or self.pp > 1)
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
