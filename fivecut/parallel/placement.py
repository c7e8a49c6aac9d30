"""Where every parameter lives: one typed record per parameter of the single-device model.

A `Placement` answers, for one logical tensor (a key of the single-device `state_dict`):
which slice of it this rank holds along each cut, over which ranks its gradient is summed,
what it is tied to, and -- under ZeRO -- where its elements sit in a flat shard; `kind` adds,
for a layout, how many identical copies of it the gradient norm's ranks hold. The cuts do
not mark tensors; each returns `Change`s keyed by parameter path, `parallelize` folds them
into the records, and everything downstream (gradient sync, clipping, EPLB, the ledger's
formulas, checkpoints, weight import) reads the records.

Slices compose: a tensor cut by EP along dim 0 and by nothing else has one `Slice`; a
TP-cut projection inside a pipeline stage has one `Slice` and a `stage`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from fivecut import comm

# groups whose members include every tensor-parallel rank (see `fivecut.mesh.Mesh`)
SPANS_TP = ("dp_cp_tp", "expert_dp")


@dataclass(frozen=True)
class Slice:
    """The part of one tensor dimension this rank holds, cut over the mesh group `group`.
    TP: the contiguous run [start, start + length) of the dimension padded to `padded`
    (vocabulary padding rows are zeros, never looked up). EP: the logical experts
    `experts`, in local slot order (EPLB may move them, so they need not be contiguous)."""

    group: str  # "tp", "ep" or "etp" (an expert's hidden size, over etp ranks of the tp group)
    dim: int  # tensor dimension that is cut
    start: int
    length: int
    padded: int  # the dimension's global size including padding
    experts: tuple[int, ...] | None = None

    def indices(self) -> list[int]:
        """Global indices along `dim` of the local rows, in local order (padding included)."""
        return list(self.experts) if self.experts is not None else list(range(self.start, self.start + self.length))


@dataclass(frozen=True)
class FlatSlot:
    """Where a parameter's elements live in a ZeRO flat buffer: buffer `buffer` of the data
    cut (a ZeRO-1/2 bucket or a ZeRO-3 unit's part), elements [offset, offset + numel) of its
    `padded` ones; this rank owns [shard_lo, shard_lo + shard_size) of the buffer."""

    buffer: int
    offset: int
    numel: int
    padded: int
    shard_lo: int
    shard_size: int

    def owned(self) -> tuple[int, int]:
        """The parameter's own flat elements [lo, hi) that this rank's shard holds (lo == hi: none)."""
        lo = max(self.offset, self.shard_lo)
        hi = min(self.offset + self.numel, self.shard_lo + self.shard_size)
        return lo - self.offset, max(lo, hi) - self.offset


@dataclass(frozen=True)
class Change:
    """What one cut did to one parameter."""

    slice: Slice | None = None  # it now holds only this part of a dimension
    reduce: str | None = None  # the data cut sums its gradient over this group instead
    summed_over: str | None = None  # autograd already sums its gradient over this group (f on a weight)


@dataclass(frozen=True)
class ParamKind:
    """What the data cut and the optimizer need to know of a parameter."""

    decays: bool  # weight decay applies (matrices, not norm weights)
    reduce: str = "dp_cp"  # the mesh group its gradient is summed over
    sliced: bool = False  # cut by tensor parallelism (flat buffers put these before replicas)
    norm_weight: float = 1.0  # 1 / copies of its gradient among the ranks the clip norm sums over


@dataclass(frozen=True)
class Placement:
    """One logical parameter as this rank holds it."""

    name: str  # the single-device state_dict key
    shape: tuple[int, ...]  # the global (single-device) shape
    stage: int | None = None  # the pipeline stage holding it; None without a pipeline
    slices: tuple[Slice, ...] = ()
    reduce: str = "dp_cp"  # the mesh group the data cut sums its gradient over
    summed_over: tuple[str, ...] = ()  # groups autograd sums its gradient over (SP norms, replicated kv)
    aliases: tuple[str, ...] = ()  # other single-device names of this tensor (a tied head)
    ends: bool = False  # tied across the pipeline ends: a copy on each, gradients summed over pp_ends
    flat: FlatSlot | None = None  # ZeRO: its place in a flat shard
    frozen: bool = False  # [lora]: no gradient, no optimizer state, nothing to reduce
    itemsize: int = 4  # bytes an element (a frozen weight a matmul reads: bf16 under train.dtype = "bf16")

    def apply(self, change: Change) -> Placement:
        return dataclasses.replace(
            self,
            slices=self.slices + ((change.slice,) if change.slice else ()),
            reduce=change.reduce or self.reduce,
            summed_over=self.summed_over + ((change.summed_over,) if change.summed_over else ()),
        )

    def slice_over(self, group: str) -> Slice | None:
        return next((s for s in self.slices if s.group == group), None)

    def local_shape(self) -> tuple[int, ...]:
        shape = list(self.shape)
        for s in self.slices:
            shape[s.dim] = s.length
        return tuple(shape)

    def local_numel(self) -> int:
        return torch.Size(self.local_shape()).numel()

    def kind(self, tp: int, ep: int, zero: int) -> ParamKind:
        """The data cut's view of this parameter on a layout (tp, ep, zero)."""
        spans_tp = self.reduce in SPANS_TP
        copies = 2 if self.ends else 1
        if tp > 1 and self.slice_over("tp") is None and not (zero and spans_tp):
            etp = self.slice_over("etp")  # an expert's hidden cut over etp ranks of tp: tp / etp copies
            copies *= tp // (etp.padded // etp.length) if etp else tp  # the norm sums over tp
        if ep > 1 and not zero and self.reduce != "expert_dp":
            copies *= ep  # replicated over ep, and the norm sums over ep (experts differ)
        return ParamKind(len(self.shape) >= 2, self.reduce, self.slice_over("tp") is not None, 1.0 / copies)

    def global_index(self) -> torch.Tensor:
        """[local shape] the flat index in the global tensor of each local element; -1 for padding."""
        index = torch.arange(torch.Size(self.shape).numel()).view(self.shape)
        for s in self.slices:
            rows = torch.tensor(s.indices())
            padding = rows >= self.shape[s.dim]
            index = index.index_select(s.dim, rows.clamp(max=self.shape[s.dim] - 1))
            mask_shape = [1] * index.dim()
            mask_shape[s.dim] = -1
            index = index.masked_fill(padding.view(mask_shape), -1)
        return index

    def held_indices(self) -> list[list[int]]:
        """For each dimension, the global indices this rank's tensor holds (padding excluded)."""
        out = [list(range(n)) for n in self.shape]
        for s in self.slices:
            out[s.dim] = [i for i in s.indices() if i < self.shape[s.dim]]
        return out

    def global_view(self, local: torch.Tensor) -> tuple[torch.Tensor, list[list[int]]]:
        """`local` without padding rows, and the global indices of what remains, per dimension."""
        keep = []
        for s in self.slices:
            rows = [i for i, g in enumerate(s.indices()) if g < self.shape[s.dim]]
            keep.append((s.dim, rows))
        for dim, rows in keep:
            local = local.index_select(dim, torch.tensor(rows, dtype=torch.long, device=local.device))
        return local, self.held_indices()


def logical_name(path: str, tied: bool) -> str:
    """The single-device name of a parameter at `path` in a (stage) module; a tied head is the embedding."""
    return "tok_embeddings.weight" if tied and path == "output.weight" else path


def initial_placements(stage: nn.Module, stage_index: int | None) -> dict[str, Placement]:
    """Records of a stage's parameters before any cut: global shapes, nothing sliced."""
    tied = stage.args.tie_embeddings
    out: dict[str, Placement] = {}
    for path, p in stage.named_parameters(remove_duplicate=False):
        name = logical_name(path, tied)
        aliases = ("output.weight",) if tied and name == "tok_embeddings.weight" else ()
        frozen = not p.requires_grad
        out[name] = Placement(
            name, tuple(p.shape), stage_index, aliases=aliases, frozen=frozen, itemsize=p.dtype.itemsize
        )
    return out


def params_by_name(module: nn.Module, tied: bool, prefixed: bool) -> dict[str, nn.Parameter]:
    """Logical name -> this rank's Parameter. `prefixed`: `module` is a ModuleDict of stages."""
    out: dict[str, nn.Parameter] = {}
    for path, p in module.named_parameters(remove_duplicate=False):
        out.setdefault(logical_name(path.split(".", 1)[1] if prefixed else path, tied), p)
    return out


def check_local_shapes(placements: dict[str, Placement], params: dict[str, nn.Parameter]) -> None:
    """After every cut: each parameter's local shape is what its record says (a silent fallback
    to an unsharded layer would show here)."""
    if placements.keys() != params.keys():
        missing, extra = placements.keys() - params.keys(), params.keys() - placements.keys()
        raise RuntimeError(
            f"parallelize: parameters without a record {sorted(extra)}, records without one {sorted(missing)}"
        )
    for name, pl in placements.items():
        if tuple(params[name].shape) != pl.local_shape():
            raise RuntimeError(
                f"parallelize left {name} with local shape {tuple(params[name].shape)}; its placement says "
                f"{pl.local_shape()} (global {pl.shape}, slices {pl.slices})"
            )


def gather_full(pl: Placement, local: torch.Tensor, groups: dict[str, object]) -> torch.Tensor:
    """The global tensor of `pl` from every rank's `local` part (a collective over each cut's group
    in `groups`, e.g. `Mesh.groups`): slices gathered, put at their global indices, padding dropped."""
    full = local
    for s in reversed(pl.slices):
        group = groups[s.group]
        index = torch.tensor(s.indices(), dtype=torch.long, device=local.device)
        every = comm.all_gather(full.contiguous(), group, dim=s.dim)
        where = comm.all_gather(index, group)  # [sum of lengths] global index of each gathered row
        shape = list(every.shape)
        shape[s.dim] = s.padded
        full = every.new_zeros(shape).index_copy(s.dim, where, every).narrow(s.dim, 0, pl.shape[s.dim])
    return full
