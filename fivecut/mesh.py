"""The layout: `ParallelDims` validated before any process exists, then one `Mesh`.

Mesh dimensions are ordered (pp, dp, cp, tp), tp innermost so that a tensor-parallel
group is made of neighbouring ranks (one node). Derived groups:
    dp_cp      gradient reduction of non-expert parameters (dp x cp)
    ep         expert-parallel ranks, borrowed from dp x cp
    expert_dp  the remaining (dp x cp) / ep ranks that replicate the same experts
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from fivecut.comm import Group
from fivecut.ledger import Ledger

MESH_DIMS = ("pp", "dp", "cp", "tp")
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb1p", "dualpipev")
CP_MODES = ("ring", "ulysses")


class LayoutError(ValueError):
    """A layout that cannot work; the message gives the numbers and a fix."""


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

    # ------------------------------------------------------------ validation

    def validate(self, model, seq_len: int, global_batch: int, accumulate: int, world_size: int | None = None) -> None:
        """Refuse a layout that cannot work for `model` (a ModelArgs), naming the numbers and a fix."""
        problems = self._structural_problems()
        if accumulate < 1:
            problems.append(f"train.accumulate={accumulate} must be >= 1")
        sizes = [getattr(self, n) for n in MESH_DIMS + ("ep", "pp_virtual", "microbatches")] + [accumulate]
        if min(sizes) < 1:  # the checks below divide by these numbers
            raise LayoutError("invalid layout " + self.describe() + ":\n  - " + "\n  - ".join(problems))
        problems += (
            self._pipeline_problems(model, seq_len)
            + self._model_problems(model)
            + self._moe_problems(model, seq_len)
            + self._batch_problems(seq_len, global_batch, accumulate)
            + self._world_problems(world_size)
        )
        if problems:
            raise LayoutError("invalid layout " + self.describe() + ":\n  - " + "\n  - ".join(problems))
        unimplemented = self.unimplemented()
        if unimplemented:
            raise LayoutError("not implemented yet in this version of fivecut:\n  - " + "\n  - ".join(unimplemented))

    def _structural_problems(self) -> list[str]:
        out = []
        for name in MESH_DIMS + ("ep", "pp_virtual", "microbatches"):
            if getattr(self, name) < 1:
                out.append(f"parallel.{name}={getattr(self, name)} must be >= 1")
        if self.zero not in (0, 1, 2, 3):
            out.append(f"parallel.zero={self.zero}; ZeRO stages are 0, 1, 2, 3")
        if self.pp_schedule not in PP_SCHEDULES:
            out.append(f"parallel.pp_schedule={self.pp_schedule!r}; choose one of {', '.join(PP_SCHEDULES)}")
        if self.cp_mode not in CP_MODES:
            out.append(f"parallel.cp_mode={self.cp_mode!r}; choose one of {', '.join(CP_MODES)}")
        if self.sp and self.tp == 1:
            out.append("parallel.sp=true needs tensor parallelism; set parallel.tp >= 2 or sp=false")
        if self.zero and self.dp == 1:
            out.append(f"parallel.zero={self.zero} shards over data-parallel ranks but dp=1; set parallel.dp >= 2")
        if self.pp > 1 and self.microbatches < self.pp and self.pp_schedule != "gpipe":
            out.append(f"{self.pp_schedule} with pp={self.pp} needs microbatches >= pp; got {self.microbatches}")
        if self.pp_virtual > 1 and self.pp_schedule not in ("interleaved", "dualpipev"):
            out.append(f"pp_virtual={self.pp_virtual} only applies to interleaved or dualpipev, not {self.pp_schedule}")
        if self.ep > 1 and (self.dp * self.cp) % self.ep:
            out.append(f"ep={self.ep} must divide dp*cp={self.dp * self.cp} (expert ranks are borrowed from dp x cp)")
        return out

    def _pipeline_problems(self, model, seq_len: int) -> list[str]:
        """Build the schedule and the stage split now, so that a bad pipeline never starts."""
        if self.pp == 1:
            return []
        from fivecut.parallel.pipeline.schedule import build_schedule, check
        from fivecut.parallel.pipeline.split import stage_layers

        try:
            schedule = build_schedule(self.pp_schedule, self.pp, self.microbatches, self.pp_virtual)
            check(schedule)
            stage_layers(model, schedule.n_stages, seq_len, self.pp_layers)
        except ValueError as err:
            return [str(err)]
        return []

    def _model_problems(self, model) -> list[str]:
        out = []
        if model.n_heads % self.tp:
            out.append(
                f"model has n_heads={model.n_heads}, not divisible by tp={self.tp}; choose tp from "
                f"{divisors(model.n_heads)}"
            )
        kv_ok = model.n_kv_heads % self.tp == 0 or self.tp % model.n_kv_heads == 0
        if not kv_ok:
            out.append(
                f"n_kv_heads={model.n_kv_heads} and tp={self.tp}: one must divide the other to split or "
                f"replicate kv heads"
            )
        stages = self.pp * (2 if self.pp_schedule == "dualpipev" else self.pp_virtual)  # DualPipeV: two per rank
        if self.pp > 1 and model.n_layers < stages:
            out.append(f"n_layers={model.n_layers} is fewer than the {stages} pipeline stages; lower pp or pp_virtual")
        if self.cp > 1 and self.cp_mode == "ulysses" and (model.n_heads // self.tp) % self.cp:
            out.append(
                f"Ulysses cuts each tp rank's {model.n_heads // self.tp} heads over cp={self.cp}; choose cp from "
                + f"{divisors(model.n_heads // self.tp)}"
            )
        if self.ep > 1 and not model.n_experts:
            out.append(f"ep={self.ep} needs a mixture-of-experts model; this one is dense (n_experts=0)")
        if self.ep > 1 and model.n_experts % self.ep:
            out.append(
                f"n_experts={model.n_experts} not divisible by ep={self.ep}; choose ep from {divisors(model.n_experts)}"
            )
        return out

    def _moe_problems(self, model, seq_len: int) -> list[str]:
        """Under tp a MoE layer runs on each tp rank's slice of the (cp chunk of the) sequence."""
        local = seq_len // self.cp
        if model.n_experts and self.tp > 1 and local % self.tp:
            return [
                f"a MoE layer under tp={self.tp} cuts its {local} tokens per sequence over tp; make seq_len/cp "
                f"divisible by tp"
            ]
        return []

    def _batch_problems(self, seq_len: int, global_batch: int, accumulate: int) -> list[str]:
        out = []
        if self.cp > 1 and self.cp_mode == "ring" and seq_len % (2 * self.cp):
            out.append(f"seq_len={seq_len} must divide by 2*cp={2 * self.cp} (load-balanced causal chunks)")
        if self.cp > 1 and seq_len % (self.cp * (self.tp if self.sp else 1)):
            out.append(
                f"seq_len={seq_len} must divide by cp={self.cp}"
                + (f" x tp={self.tp} (sequence parallelism)" if self.sp else "")
            )
        if self.sp and seq_len % self.tp:
            out.append(f"seq_len={seq_len} must divide by tp={self.tp} for sequence parallelism")
        per_rank = self.dp * accumulate * (self.microbatches if self.pp > 1 else 1)
        if global_batch % per_rank:
            good = per_rank * max(1, round(global_batch / per_rank))
            out.append(
                f"global_batch={global_batch} must divide by dp*accumulate*microbatches={per_rank}; try "
                f"train.global_batch={good}"
            )
        return out

    def _world_problems(self, world_size: int | None) -> list[str]:
        if world_size is None or world_size == self.world_size:
            return []
        rest = self.world_size // self.dp  # pp*cp*tp
        fix = (
            f"e.g. parallel.dp={world_size // rest}"
            if world_size % rest == 0
            else f"pp*cp*tp = {rest} must divide {world_size}"
        )
        return [
            f"pp*dp*cp*tp = {self.pp}*{self.dp}*{self.cp}*{self.tp} = {self.world_size} but {world_size} processes "
            f"were started; make the product {world_size} ({fix})"
        ]

    def unimplemented(self) -> list[str]:
        out = []
        if self.pp > 1 and self.zero >= 2:
            out.append(
                f"parallel.zero={self.zero} with pp={self.pp}: ZeRO-2/3 inside a pipeline is not in this "
                f"version; use zero=0 or 1"
            )
        return out


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


class Mesh:
    """The DeviceMesh (pp, dp, cp, tp) and the named groups every cut receives explicitly.

    `Mesh.virtual(dims, rank)` is the same mesh as one rank sees it, with no process group
    behind it: the planner applies the real cuts on the meta device to learn what a rank holds."""

    def __init__(
        self,
        dims: ParallelDims,
        device_type: str,
        ledger: Ledger | None = None,
        moe: bool = False,
        virtual_rank: int | None = None,
    ):
        self.dims = dims
        self.ledger = ledger if ledger is not None else Ledger()
        self.virtual = virtual_rank is not None
        self.rank = virtual_rank if self.virtual else dist.get_rank()
        self.grid = torch.arange(dims.world_size).view(dims.shape)  # [pp, dp, cp, tp] global ranks, as DeviceMesh
        if not self.virtual:
            self.device_mesh = init_device_mesh(device_type, dims.shape, mesh_dim_names=MESH_DIMS)
        index = (self.grid == self.rank).nonzero()[0].tolist()
        self.coords = dict(zip(MESH_DIMS, index))
        self.groups: dict[str, Group] = {}
        for name in MESH_DIMS:
            self.groups[name] = self._mesh_group(name)
        self.groups["dp_cp"] = self._derived_group("dp", ("dp", "cp"))
        self.groups["pp_ends"] = self._pipeline_ends()
        if moe and (dims.ep > 1 or dims.tp > 1):
            self._expert_groups()
        else:  # one rank per ep group; experts replicated like everything else
            self.groups["ep"] = self._group("ep", (self.rank,), None)
            self.groups["expert_dp"] = self.groups["dp_cp_tp"] = self.groups["dp_cp"]

    @classmethod
    def virtual(cls, dims: ParallelDims, rank: int = 0, moe: bool = False) -> Mesh:
        return cls(dims, "meta", moe=moe, virtual_rank=rank)

    def group(self, name: str) -> Group:
        return self.groups[name]

    def coordinate(self, name: str) -> int:
        return self.coords[name]

    def _mesh_group(self, name: str) -> Group:
        ranks = self._ranks_along((name,))
        pg = self.device_mesh.get_group(name) if len(ranks) > 1 and not self.virtual else None
        return self._group(name, ranks, pg)

    def _group(self, cut: str, ranks: tuple[int, ...], pg) -> Group:
        """A virtual mesh's groups know their members and this rank's place, and have no process group."""
        return Group(cut, ranks, pg, self.ledger, index=ranks.index(self.rank) if self.virtual else None)

    def _new_group(self, ranks: list[int]):
        return None if self.virtual else dist.new_group(ranks)

    def _derived_group(self, cut: str, dims: tuple[str, ...]) -> Group:
        """A group over several mesh dims; every rank creates every such group, in the same order."""
        mine = self._ranks_along(dims)
        if len(mine) == 1:
            return self._group(cut, mine, None)
        pg = None
        for ranks in self._all_rank_sets(dims):
            created = self._new_group(list(ranks))
            if ranks == mine:
                pg = created
        return self._group(cut, mine, pg)

    def _expert_groups(self) -> None:
        """Expert parallelism folded into dp x cp. With i = dp_index * cp + cp_index, the ranks
        i // ep = const (same pp and tp) form an `ep` group; an expert's replicas live on the ranks
        with the same i % ep, and its gradients are summed over them and over tp (the MoE layer
        runs on a tp rank's own slice of the tokens): `expert_dp`. The router and the shared
        experts are data-parallel over dp x cp x tp: `dp_cp_tp`."""
        ep = self.dims.ep

        def inner(c: dict) -> int:  # the dp x cp index
            return c["dp"] * self.dims.cp + c["cp"]

        self.groups["ep"] = self._keyed_group("ep", lambda c: (c["pp"], c["tp"], inner(c) // ep))
        self.groups["expert_dp"] = self._keyed_group("dp", lambda c: (c["pp"], inner(c) % ep))
        self.groups["dp_cp_tp"] = self._keyed_group("dp", lambda c: (c["pp"],))

    def _keyed_group(self, cut: str, key) -> Group:
        """Ranks whose coordinates give the same `key` form a group; every rank creates all of them."""
        members: dict[tuple, list[int]] = {}
        grid = self.grid
        for index in itertools.product(*(range(n) for n in grid.shape)):
            members.setdefault(key(dict(zip(MESH_DIMS, index))), []).append(int(grid[index]))
        mine = None
        for ranks in members.values():
            created = self._new_group(ranks) if len(ranks) > 1 else None
            if self.rank in ranks:
                mine = self._group(cut, tuple(ranks), created)
        return mine

    def _pipeline_ends(self) -> Group:
        """First and last pipeline rank of each pipeline (they hold the tied embedding twice)."""
        grid = self.grid  # [pp, dp, cp, tp]
        mine = self._group("pp", (self.rank,), None)
        if self.dims.pp == 1:
            return mine
        for pair in zip(grid[0].flatten().tolist(), grid[-1].flatten().tolist()):
            created = self._new_group(list(pair))
            if self.rank in pair:
                mine = self._group("pp", tuple(pair), created)
        return mine

    def _ranks_along(self, dims: tuple[str, ...]) -> tuple[int, ...]:
        """Global ranks that share this rank's coordinates on every dim not in `dims`."""
        return next(r for r in self._all_rank_sets(dims) if self.rank in r)

    def _all_rank_sets(self, dims: tuple[str, ...]) -> list[tuple[int, ...]]:
        grid = self.grid  # [pp, dp, cp, tp] tensor of global ranks
        keep = [MESH_DIMS.index(d) for d in dims]
        fixed = [i for i in range(len(MESH_DIMS)) if i not in keep]
        sets = []
        for outer in itertools.product(*(range(grid.shape[i]) for i in fixed)):
            index: list[object] = [slice(None)] * len(MESH_DIMS)
            for axis, value in zip(fixed, outer):
                index[axis] = value
            sets.append(tuple(int(r) for r in grid[tuple(index)].flatten().tolist()))
        return sets
