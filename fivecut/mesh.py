"""One `Mesh` for a layout (`fivecut.layout.ParallelDims`, checked by `fivecut.checks` before any process exists).

Mesh dimensions are ordered (pp, dp, cp, tp), tp innermost so that a tensor-parallel
group is made of neighbouring ranks (one node). Derived groups:
    dp_cp      gradient reduction of non-expert parameters (dp x cp)
    ep         expert-parallel ranks, borrowed from dp x cp
    expert_dp  the remaining (dp x cp) / ep ranks that replicate the same experts (x tp / etp)
    etp        expert tensor parallelism: the etp ranks of a tp group that hold one expert's shards
    cp_ulysses USP only: U consecutive ranks of a cp group (Ulysses' all-to-alls)
    cp_ring    USP only: the cp/U ranks with the same place in their Ulysses group (the ring)

Hybrid sharding (`zero_shard = S` < dp x cp, ZeRO only; `ZeroGroups`): with i = dp_index * cp +
cp_index, the ranks with the same i // S (same pp, tp) form a `zero_shard` group and the ranks with
the same i % S (same pp, tp) a `zero_replicate` group: ZeRO shards inside the first and sums the
shards across the second. As tp is innermost, consecutive i are neighbours in the rank order
(stride tp), so a shard group of S * tp <= ranks per node stays inside one node and only the
replicate group's all-reduce of 1/S of the gradients crosses nodes. The experts' and the router's
groups (`expert_dp`, `dp_cp_tp`) are cut the same way: their members inside this rank's block of S
(ep divides S, so a block holds whole ep groups), replicated across blocks by `zero_replicate`.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from fivecut.comm import Group
from fivecut.launch import backend_for
from fivecut.layout import MESH_DIMS, ParallelDims
from fivecut.ledger import Ledger


@dataclass(frozen=True)
class ZeroGroups:
    """Where ZeRO cuts the parameters that one mesh group sums: sharded over `shard`, each shard
    summed over `replicate` (one rank without hybrid sharding)."""

    shard: Group
    replicate: Group


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
        timeout: timedelta | None = None,
    ):
        self.dims = dims
        self.timeout = timeout  # how long a collective of these groups waits; None: torch's default
        self.ledger = ledger if ledger is not None else Ledger()
        self.virtual = virtual_rank is not None
        self.rank = virtual_rank if self.virtual else dist.get_rank()
        self.grid = torch.arange(dims.world_size).view(dims.shape)  # [pp, dp, cp, tp] global ranks, as DeviceMesh
        if not self.virtual:
            self.device_mesh = init_device_mesh(
                device_type, dims.shape, mesh_dim_names=MESH_DIMS, backend_override=self._with_timeout(device_type)
            )
        index = (self.grid == self.rank).nonzero()[0].tolist()
        self.coords = dict(zip(MESH_DIMS, index))
        self.groups: dict[str, Group] = {}
        for name in MESH_DIMS:
            self.groups[name] = self._mesh_group(name)
        self.groups["dp_cp"] = self._derived_group("dp", ("dp", "cp"))
        self.groups["pp_ends"] = self._pipeline_ends()
        if dims.cp_mode == "usp":
            self._usp_groups()
        if moe and (dims.ep > 1 or dims.tp > 1):
            self._expert_groups()
        else:  # one rank per ep group; experts replicated like everything else
            self.groups["ep"] = self.groups["etp"] = self._group("ep", (self.rank,), None)
            self.groups["expert_dp"] = self.groups["dp_cp_tp"] = self.groups["dp_cp"]
        self.zero_groups = self._zero_groups(moe)

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
        return None if self.virtual else dist.new_group(ranks, timeout=self.timeout)

    def _with_timeout(self, device_type: str) -> dict | None:
        """DeviceMesh's groups get torch's default timeout unless their options carry one."""
        if self.timeout is None:
            return None
        backend = backend_for(device_type)
        options = dist.ProcessGroupNCCL.Options() if backend == "nccl" else dist.ProcessGroupGloo._Options()
        options._timeout = self.timeout
        return {name: (backend, options) for name in MESH_DIMS}

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
        experts are data-parallel over dp x cp x tp: `dp_cp_tp`. Expert tensor parallelism: the
        etp neighbouring ranks tp // etp = const of a tp group hold the etp shards of the same
        experts (`etp`); `expert_dp` then spans only the tp ranks with the same tp % etp (same shard)."""
        ep, etp, inner = self.dims.ep, self.dims.etp, self._dp_cp_index
        self.groups["ep"] = self._keyed_group("ep", lambda c: (c["pp"], c["tp"], inner(c) // ep))
        self.groups["etp"] = self._keyed_group("etp", lambda c: (c["pp"], c["dp"], c["cp"], c["tp"] // etp))
        self.groups["expert_dp"] = self._keyed_group("dp", lambda c: (c["pp"], inner(c) % ep, c["tp"] % etp))
        self.groups["dp_cp_tp"] = self._keyed_group("dp", lambda c: (c["pp"],))

    def _usp_groups(self) -> None:
        """cp rank c = g*U + u: Ulysses group g (ranks g*U .. g*U+U-1), ring position g of ring u."""
        u = self.dims.cp_ulysses

        def outside(c: dict) -> tuple:  # the coordinates that name this rank's cp group
            return (c["pp"], c["dp"], c["tp"])

        self.groups["cp_ulysses"] = self._keyed_group("cp", lambda c: (*outside(c), c["cp"] // u))
        self.groups["cp_ring"] = self._keyed_group("cp", lambda c: (*outside(c), c["cp"] % u))

    def _zero_groups(self, moe: bool) -> dict[str, ZeroGroups]:
        """The shard and replicate group of each reduce group (see the module doc); the reduce group
        itself and one rank when `zero_shard` is unset."""
        names = ("dp_cp", "expert_dp", "dp_cp_tp")
        if not self.dims.hybrid:
            alone = self._group("dp", (self.rank,), None)
            return {name: ZeroGroups(self.groups[name], alone) for name in names}
        s, ep, inner = self.dims.shard_size, self.dims.ep, self._dp_cp_index
        replicate = self._keyed_group("dp", lambda c: (c["pp"], c["tp"], inner(c) % s))
        self.groups["zero_shard"] = self._keyed_group("dp", lambda c: (c["pp"], c["tp"], inner(c) // s))
        self.groups["zero_replicate"] = replicate
        out = {"dp_cp": ZeroGroups(self.groups["zero_shard"], replicate)}
        if moe and (ep > 1 or self.dims.tp > 1):
            etp = self.dims.etp  # an expert shard is summed only with the same shard (tp % etp)
            experts = self._keyed_group("dp", lambda c: (c["pp"], inner(c) // s, inner(c) % ep, c["tp"] % etp))
            router = self._keyed_group("dp", lambda c: (c["pp"], inner(c) // s))
            out |= {"expert_dp": ZeroGroups(experts, replicate), "dp_cp_tp": ZeroGroups(router, replicate)}
        else:
            out |= {"expert_dp": out["dp_cp"], "dp_cp_tp": out["dp_cp"]}
        return out

    def _dp_cp_index(self, coords: dict) -> int:
        """A rank's place in dp x cp, i = dp_index * cp + cp_index (consecutive i: neighbouring ranks)."""
        return coords["dp"] * self.dims.cp + coords["cp"]

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
