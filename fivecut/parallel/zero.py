"""ZeRO-1/2/3: cut the optimizer state, then the gradients, then the parameters, over dp.

Plain DP keeps three full copies on every rank: parameters (4Psi bytes in fp32),
gradients (4Psi) and Adam's two moments (8Psi). ZeRO lays parameters end to end in flat
buffers padded to a multiple of n (the dp group size) and gives rank r the r-th of n
equal slices (its *shard*); each rank updates only its shard.

    stage  kept whole on every rank      model-state bytes per rank   communication per step
    1      parameters, gradients          8Psi + 8Psi/n                reduce-scatter Psi + all-gather Psi
    2      parameters                     4Psi + 12Psi/n               the same (gradients freed per bucket)
    3      nothing but the unit in use    16Psi/n                      all-gather x2 + reduce-scatter = 3Psi

(wire bytes are these volumes x 4 bytes x (n-1)/n; with `reshard_after_forward=False`
ZeRO-3 gathers once, 2Psi.)

Stages 1 and 2 reuse the bucket machinery of DDP (`fivecut.parallel.data`): a bucket's
gradients are reduce-scattered as soon as backward has produced them; after the
optimizer step every rank launches the all-gathers of the updated shards into the
parameters, which are views of the flat buffers, and the next forward waits for each just
before the first unit that reads it (the gathers overlap the forward; `settle` waits for
all, before a checkpoint). Stage 2 reduces every micro-step (accumulating into the
shard) and frees each bucket's full gradients as soon as they are sent; stage 1 keeps
them and, like DDP, communicates only on the last micro-step. Stage 2 keeps at most one
bucket in flight: launching a bucket first waits for the one before, whose flat copy of the
full gradients the collective holds until then, so at its peak stage 2 holds about two
buckets of full gradients (the one being filled and the one on the wire), not all of them.

Stage 3 (FSDP) cuts the model into units (each transformer block; the root unit holds
everything else: embedding, final norm, head, so that tied weights live in one unit).
A unit's parameters are gathered just before its first module runs and freed after its
last module (or kept until backward when `reshard_after_forward` is false), gathered
again when backward reaches the unit, and its gradients are reduce-scattered as soon as
the unit's backward is done. The next unit's all-gather is issued while the current one
computes, in forward and in backward. Every unit, the root included, follows
`reshard_after_forward`, so ZeRO-3 moves exactly 3Psi (FSDP2 keeps its root gathered
between forward and backward, saving the root's second gather).

Each unit owns one flat buffer `full` [padded] for its lifetime, and its parameters are
views of it. Freeing resizes the buffer's *storage* to 0 and gathering resizes it back and
all-gathers into it (as FSDP2 does): the tensors autograd saved in forward (e.g. a
Linear's `weight.t()`) are views of the same storage, so freeing really frees them, and
backward reads the re-gathered values. (Pointing parameters at a fresh buffer per gather
would leave every forward buffer alive through autograd's saved views until backward.)
At most one reduce-scatter is in flight: launching a unit's waits for the previous one,
whose full-size gradient buffer the collective holds until then.

Hybrid sharding (`parallel.zero_shard = S`, FSDP2's HSDP): every stage shards over a group
of S consecutive dp x cp ranks (`Mesh.zero_groups`: the shard group is `group`, the groups
given to FSDP) instead of all of them, and `Replicas` sums each reduced shard over the ranks
holding the same shard in the other groups: reduce-scatter inside, then one all-reduce of the
1/S shard across, once per step (after the step's last micro-step: `no_sync` defers it, and a
pipeline's `reduce()` runs it). Gathers stay inside the shard group.

Mixed precision (`param_dtype`, train.dtype = "bf16"; FSDP2's MixedPrecisionPolicy): the
shards stay fp32 masters, which the optimizer updates; `full` is a bf16 buffer, and each
gather casts the rank's shard to bf16 and all-gathers that, so the wire carries 2 bytes a
parameter instead of 4 and forward and backward compute on bf16 parameters. Their gradients
arrive in bf16; they are flattened into the reduce dtype (`reduce_dtype`, fp32 unless
train.reduce_dtype = "bf16"), reduce-scattered, and added to the fp32 shard gradients.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from fivecut import comm
from fivecut.comm import Group
from fivecut.parallel.data import (
    Bucket,
    BufferPeak,
    DataParallel,
    Held,
    Kinds,
    Piece,
    flat_order,
    padded,
    plain_kinds,
)
from fivecut.parallel.placement import FlatSlot


class FlatShard:
    """`params` laid end to end (decayed ones first) in a buffer of `padded` elements, cut into
    n equal slices; this rank owns slice `group.rank`, of `size` elements starting at `lo`."""

    def __init__(self, params: list[nn.Parameter], group: Group, kinds: Kinds):
        self.params = sorted(params, key=lambda p: flat_order(kinds[p]))  # stable: decayed first, then TP shards
        # recorded now: ZeRO-3 frees the parameters (size 0), which hides their shapes
        self.shapes = [p.shape for p in self.params]
        self.offsets = [sum(s.numel() for s in self.shapes[:i]) for i in range(len(self.shapes))]
        self.kinds = [(kinds[p].decays, kinds[p].norm_weight) for p in self.params]
        self.group = group
        self.numel = sum(p.numel() for p in params)
        self.padded = padded(self.numel, group.size)
        self.size = self.padded // group.size
        self.lo = group.rank * self.size
        self.full: torch.Tensor | None = None  # [padded] ZeRO-1/2: the parameters' storage
        self.local: torch.Tensor | None = None  # [size] this rank's parameters (what the optimizer updates)
        self.grad: torch.Tensor | None = None  # [size] this rank's reduced gradient
        self._pieces: list[tuple[_Span, Piece]] | None = None  # the optimizer's views, made once

    def flatten(self, tensors: list[torch.Tensor | None], like: torch.Tensor, dtype=None) -> torch.Tensor:
        """[padded] the tensors (parameters or gradients, in `params` order; None = zeros) end to end,
        on `like`'s device, in `dtype` (default `like`'s)."""
        flat = like.new_zeros(self.padded, dtype=dtype)
        offset = 0
        for t, shape in zip(tensors, self.shapes):
            if t is not None:
                flat[offset : offset + shape.numel()].copy_(t.reshape(-1))
            offset += shape.numel()
        return flat

    def point_params_into(self, full: torch.Tensor) -> None:
        """Make every parameter a view of the gathered buffer `full` [padded]."""
        offset = 0
        for p, shape in zip(self.params, self.shapes):
            p.data = full[offset : offset + shape.numel()].view(shape)
            offset += shape.numel()

    def optimizer_pieces(self) -> list[Piece]:
        """This rank's shard cut wherever the parameters' kind (decay, norm weight) changes; made once."""
        if self._pieces is None:
            self._pieces = [(span, self._piece(span)) for span in self._spans()]
        return [piece for _, piece in self._pieces]

    def _spans(self) -> list[_Span]:
        spans: list[_Span] = []
        for offset, shape, kind in zip(self.offsets, self.shapes, self.kinds):
            start, stop = max(offset, self.lo) - self.lo, min(offset + shape.numel(), self.lo + self.size) - self.lo
            if stop <= start:
                continue
            if spans and spans[-1].kind == kind and spans[-1].stop == start:
                spans[-1].stop = stop
            else:
                spans.append(_Span(start, stop, kind))
        return spans

    def _piece(self, span: _Span) -> Piece:
        view = self.local[span.start : span.stop]
        view.grad = self.grad[span.start : span.stop]
        return Piece(view, *span.kind)

    def slots(self, buffer: int) -> dict[nn.Parameter, FlatSlot]:
        """Each parameter's place in this flat buffer (number `buffer` of its data cut)."""
        return {
            p: FlatSlot(buffer, offset, shape.numel(), self.padded, self.lo, self.size)
            for p, offset, shape in zip(self.params, self.offsets, self.shapes)
        }

    def held(self, param: nn.Parameter, lo: int, hi: int, in_param: bool) -> Held:
        """Elements [lo, hi) of `param` that this rank's shard holds: their master values (the
        parameter's own storage when `in_param`, as in ZeRO-1/2) and their optimizer pieces."""
        i = next((i for i, q in enumerate(self.params) if q is param), None)
        if i is None:
            return Held()
        whole = [(param.data.view(-1)[lo:hi], lo)] if in_param else []
        a, b = max(self.offsets[i] + lo, self.lo) - self.lo, min(self.offsets[i] + hi, self.lo + self.size) - self.lo
        if b <= a:
            return Held(whole)
        to_param = self.lo - self.offsets[i]  # shard-local position + to_param = the parameter's element
        self.optimizer_pieces()
        pieces = [(p.tensor, max(a, sp.start), min(b, sp.stop), sp.start) for sp, p in self._pieces]
        optimized = [(t, x - start, y - start, x + to_param) for t, x, y, start in pieces if y > x]
        return Held(whole or [(self.local[a:b], a + to_param)], optimized)


@dataclass
class _Span:
    start: int
    stop: int
    kind: tuple[bool, float]  # (decays, norm_weight)


class Replicas:
    """Hybrid sharding: the ranks holding the same shard in the other shard groups (`Mesh.zero_groups`);
    each reduced shard gradient is all-reduced over them, in the reduce dtype (1/S of the bytes the
    shard group reduce-scattered). A group of one rank communicates nothing."""

    def __init__(self, group: Group | None):
        self.group = group  # None: no replicas (the shard group is all of the reduce group)
        self._works: list[tuple[torch.Tensor, torch.Tensor, object]] = []

    @property
    def size(self) -> int:
        return self.group.size if self.group is not None else 1

    def launch(self, grad: torch.Tensor, to_wire) -> None:
        """Start summing `grad` [shard size] over the replicas; `to_wire` casts it to the reduce dtype."""
        if self.size == 1:
            return
        wire = to_wire(grad)  # `grad` itself when it is already in the reduce dtype
        self._works.append((grad, wire, comm.all_reduce(wire, self.group, async_op=True)))

    def finish(self) -> None:
        for grad, wire, work in self._works:
            comm.wait(work, "all_reduce", self.group)
            if wire is not grad:
                grad.copy_(wire)
        self._works = []


# ---------------------------------------------------------------- ZeRO-1 and ZeRO-2


class ZeroDataParallel(DataParallel):
    """ZeRO-1 (`stage=1`) or ZeRO-2 (`stage=2`) over `group`: replicated parameters, sharded
    optimizer state (and, for stage 2, sharded gradients)."""

    def __init__(
        self,
        module: nn.Module,
        group: Group,
        stage: int,
        bucket_mb: float = 25.0,
        reduce_dtype=None,
        params: list[nn.Parameter] | None = None,
        kinds: Kinds | None = None,
        replicate: Group | None = None,
        pipelined: bool = False,
    ):
        if stage not in (1, 2):
            raise ValueError(f"ZeroDataParallel is ZeRO-1 or ZeRO-2, not stage {stage}")
        self.stage = stage
        self.replicas = Replicas(replicate)
        self.pipelined = pipelined  # one stage's parameters: reduced when `start_reduce` says (`zero_pipeline`)
        super().__init__(module, group, bucket_mb, reduce_dtype, params, kinds)
        self.shards = [self._shard_bucket(b) for b in self.buckets]
        self.shard_of = dict(zip(map(id, self.buckets), self.shards))
        self.gathers: dict[int, tuple] = {}  # shard index -> (its gather in flight since the step, its input)
        self._wait_before_use(module)
        if stage == 2:  # gradients live in the shards only; full ones exist per bucket, in flight
            for bucket in self.buckets:
                bucket.flat = None
            for p in self.params:
                p.grad = None
            self.view_of = {}

    def pad_to(self, group: Group) -> int:
        return group.size

    def _shard_bucket(self, bucket: Bucket) -> FlatShard:
        shard = FlatShard(bucket.params, self.group, self.kinds)
        full = shard.flatten([p.detach() for p in shard.params], like=bucket.params[0])  # [padded]
        shard.point_params_into(full)
        shard.full = full
        shard.local = full[shard.lo : shard.lo + shard.size]
        # stage 1: the reduced gradient overwrites this rank's slice of the bucket
        shard.grad = bucket.flat[shard.lo : shard.lo + shard.size] if self.stage == 1 else full.new_zeros(shard.size)
        return shard

    def pieces(self) -> list[Piece]:
        return [piece for shard in self.shards for piece in shard.optimizer_pieces()]

    def held(self, param: nn.Parameter, lo: int, hi: int) -> Held:
        return sum((shard.held(param, lo, hi, in_param=True) for shard in self.shards), Held())

    def flat_slots(self) -> dict[nn.Parameter, FlatSlot]:
        return {p: slot for i, shard in enumerate(self.shards) for p, slot in shard.slots(i).items()}

    def shard_grads(self) -> list[torch.Tensor]:
        return [shard.grad for shard in self.shards]

    def reducing(self) -> bool:
        communicates = self.group.size > 1 or self.replicas.size > 1
        return communicates and (self.sync or (self.stage == 2 and not self.pipelined))

    def start_reduce(self) -> None:
        """Pipeline: the stage's last backward (or W) of the schedule is done; launch every bucket
        (ZeRO-2: each stage's full gradients, accumulated over the microbatches, then freed)."""
        while (self.group.size > 1 or self.replicas.size > 1) and self._next < len(self.buckets):
            self._launch_next()

    def reduce(self) -> None:
        """Launch what `start_reduce` did not, and wait for every bucket."""
        if self.group.size > 1 or self.replicas.size > 1:
            self._finish()

    def zero_grad(self) -> None:
        if self.stage == 1:
            super().zero_grad()
        else:
            for shard in self.shards:
                shard.grad.zero_()

    def grad_arrived(self, param: nn.Parameter) -> None:
        if self.stage == 1:
            super().grad_arrived(param)

    def _launch_next(self) -> None:
        if self.stage == 2 and self._next > 0:  # one bucket in flight: the one before is settled first
            self._settle(self.buckets[self._next - 1])
        super()._launch_next()

    def held_buffers(self) -> list[torch.Tensor | None]:
        """Stage 2 adds the full gradients backward produced that no bucket has taken yet (in a
        pipeline stage they are its model states: kept over the microbatches)."""
        grads = [p.grad for p in self.params] if self.stage == 2 and not self.pipelined else []
        return super().held_buffers() + grads

    def launch(self, bucket: Bucket) -> object:
        shard = self.shard_of[id(bucket)]
        flat = bucket.flat
        if self.stage == 2:  # gather this micro-step's gradients, and free them
            flat = shard.flatten([p.grad for p in shard.params], like=shard.local)
            self.buffers.sample(self.held_buffers() + [flat])  # the bucket's gradients twice, for a moment
            for p in bucket.params:
                p.grad = None
        bucket.wire = self.to_wire(flat)
        bucket.out = bucket.wire.new_empty(shard.size)
        return comm.reduce_scatter_into(bucket.out, bucket.wire, self.group, async_op=True)

    def complete(self, bucket: Bucket) -> None:
        shard = self.shard_of[id(bucket)]
        if self.stage == 1:
            shard.grad.copy_(bucket.out)
        else:
            shard.grad.add_(bucket.out)
        bucket.out = None

    def _finish(self) -> None:
        """Wait for every bucket; at the step's last micro-step (not inside `no_sync`), then sum each
        shard over the replicas (hybrid sharding). A pipeline's buckets may complete during its
        schedule, inside `no_sync`, so the replicas are summed here, after all of them."""
        super()._finish()
        if self.sync:
            for shard in self.shards:
                self.replicas.launch(shard.grad, self.to_wire)
        self.replicas.finish()

    def after_step(self) -> None:
        """Every rank updated its shard: launch the gathers of all shards back into the parameters,
        the first the forward needs first (buckets fill from the last parameter). Each is waited for
        just before the first unit that reads it runs (`_wait_before_use`), so that the gathers
        overlap the next step's forward, as Megatron's overlapped parameter gather does."""
        for i in reversed(range(len(self.shards))):
            shard, mine = self.shards[i], self.shards[i].local.clone()  # [size] kept until the gather is done
            self.gathers[i] = (comm.all_gather_into(shard.full, mine, self.group, async_op=True), mine)

    def settle(self) -> None:
        self._gathered(list(self.gathers))

    def _gathered(self, shards: list[int]) -> None:
        """Wait for the gathers in flight of these shards (indices into `shards`)."""
        for i in shards:
            if i in self.gathers:
                work, _mine = self.gathers.pop(i)
                comm.wait(work, "all_gather", self.group)

    def _wait_before_use(self, module: nn.Module) -> None:
        """Before each unit (`stage_units`: embedding, blocks, head) of each stage in `module` runs
        its forward, wait for the gathers of the shards that hold its parameters (the hooks sit on
        the unit's own modules, outside what `train.compile` compiles); a parameter outside every
        unit waits before the module that holds it runs."""
        shard_of = {id(p): i for i, shard in enumerate(self.shards) for p in shard.params}
        stages = [m for m in module.modules() if hasattr(m, "layers")]  # the model, or a pipeline's stages
        units = [modules for stage in stages for _name, modules in stage_units(stage)]
        covered = {id(p) for modules in units for p in unique_params(modules)}
        units += [[m] for m in module.modules() if any(id(p) not in covered for p in m.parameters(recurse=False))]
        for modules in units:
            shards = sorted({shard_of[id(p)] for p in unique_params(modules) if id(p) in shard_of})
            for m in modules if shards else []:
                m.register_forward_pre_hook(lambda m, args, shards=shards: self._gathered(shards))


# ---------------------------------------------------------------- ZeRO-3


@dataclass(eq=False)
class UnitPart:
    """The parameters of a unit that one group shards (most: dp x cp; MoE experts: expert_dp)."""

    shard: FlatShard
    full: torch.Tensor  # [padded] the parameters' storage: allocated while gathered, size 0 otherwise
    gather_work: object | None = None
    reduce_work: object | None = None
    reduce_in: torch.Tensor | None = None  # [padded] the gradients on the wire (the reduce dtype)
    reduce_out: torch.Tensor | None = None

    @property
    def group(self) -> Group:
        return self.shard.group


@dataclass(eq=False)
class Unit:
    """A group of modules whose parameters are gathered and freed together."""

    name: str
    modules: list[nn.Module]  # in forward order; the first gathers, the last may free
    parts: list[UnitPart]  # one per sharding group
    gathered: bool = True  # `full` holds the parameters (or an all-gather into it is in flight)
    ready: int = 0  # parameters whose gradient this backward has produced
    reduced: bool = False
    # units of another stage's cut whose parameters these modules use too (a tied embedding with
    # both pipeline ends on this rank): gathered and freed with this one, reduced by their owner
    borrowed: list[Unit] = field(default_factory=list)

    @property
    def params(self) -> list[nn.Parameter]:
        return [p for part in self.parts for p in part.shard.params]


class FullyShardedDataParallel:
    """ZeRO-3 over `group` for a `Transformer`: every parameter sharded; units gathered on use.
    A parameter whose kind names another reduce group is sharded over `other_groups[name]`
    instead (MoE experts over their expert-data-parallel group): its unit then has one part per group."""

    def __init__(
        self,
        model: nn.Module,
        group: Group,
        reshard_after_forward: bool = True,
        reduce_dtype=None,
        kinds: Kinds | None = None,
        other_groups: dict[str, Group] | None = None,
        param_dtype: torch.dtype | None = None,
        replicate: Group | None = None,
        pipelined: bool = False,
        borrowed: dict[nn.Parameter, Unit] | None = None,
    ):
        self.model = model
        self.replicas = Replicas(replicate)  # hybrid sharding: each shard summed over these ranks too
        self.sync = True  # False inside `no_sync`: the replicas are summed at the step's last backward
        # a pipeline stage (`zero_pipeline`): its units in the order its modules run, its gradients
        # accumulated in full over the microbatches and reduce-scattered once, at `start_reduce`
        self.pipelined = pipelined
        self.borrowed = borrowed or {}  # parameters of this stage that another stage's cut owns
        self.param_dtype = param_dtype  # None: gather and compute in the masters' dtype
        self.kinds = kinds if kinds is not None else plain_kinds(list(model.parameters()))
        self.groups = {"dp_cp": group, **(other_groups or {})}
        self.reshard_after_forward = reshard_after_forward
        self.reduce_dtype = reduce_dtype
        units = stage_units(model) if pipelined else transformer_units(model)
        self.units = [self._make_unit(name, modules) for name, modules in units]
        self.unit_of = {p: u for u in self.units for p in u.params}
        self.forward_order = self.units  # root first (the embedding runs first), then the blocks
        # the head runs backward first (the root, which holds it; in a stage, the last unit)
        self.backward_order = self.units[::-1] if pipelined else [self.units[0]] + self.units[1:][::-1]
        self._callback_queued = False
        self._reducing: Unit | None = None  # the unit whose reduce-scatter is in flight
        self.buffers = BufferPeak()
        for unit in self.units:
            self._register_hooks(unit)

    # ------------------------------------------------------------ construction

    def _make_unit(self, name: str, modules: list[nn.Module]) -> Unit:
        by_group: dict[str, list[nn.Parameter]] = {}
        for p in unique_params(modules):
            if p not in self.borrowed:
                by_group.setdefault(self.kinds[p].reduce, []).append(p)
        dtype = self.param_dtype
        parts = [self._make_part(params, self.groups[group], self.kinds, dtype) for group, params in by_group.items()]
        used = {id(p) for p in unique_params(modules)}  # by identity: `in` on tensors compares their values
        others = list({id(u): u for p, u in self.borrowed.items() if id(p) in used}.values())
        unit = Unit(name, modules, parts, borrowed=others)
        self._free(unit)
        return unit

    @staticmethod
    def _make_part(params: list[nn.Parameter], group: Group, kinds: Kinds, param_dtype) -> UnitPart:
        shard = FlatShard(params, group, kinds)
        full = shard.flatten([p.detach() for p in shard.params], like=params[0])  # [padded] masters' dtype
        shard.local = full[shard.lo : shard.lo + shard.size].clone()  # [padded / n] the master shard
        shard.grad = torch.zeros_like(shard.local)
        if param_dtype is not None:  # the compute copy: gathered (and used) in param_dtype
            full = full.to(param_dtype)
        shard.point_params_into(full)  # once: the parameters stay views of `full`
        return UnitPart(shard, full)

    def _register_hooks(self, unit: Unit) -> None:
        for module in unit.modules:
            module.register_forward_pre_hook(lambda m, args, u=unit: self._before_forward(u, m))
        unit.modules[-1].register_forward_hook(lambda m, args, out, u=unit: self._after_forward(u, out))
        for p in unit.params:
            p.register_post_accumulate_grad_hook(lambda p, u=unit: self._grad_ready(u))

    # ------------------------------------------------------------ the trainer's interface

    @contextmanager
    def no_sync(self):
        """ZeRO-3 keeps no full gradients, so every micro-step reduce-scatters inside the shard group;
        only the sum over the replicas (hybrid sharding) waits for the step's last backward."""
        previous, self.sync = self.sync, False
        try:
            yield
        finally:
            self.sync = previous

    def zero_grad(self) -> None:
        for shard in self.shards:
            shard.grad.zero_()

    def after_step(self) -> None:
        """Nothing to do: the next forward gathers the updated shards."""

    def settle(self) -> None:
        """Nothing to do: a unit's parameters are read only while it is gathered."""

    def reduce(self) -> None:
        """Outside a pipeline nothing to do: every backward reduce-scattered as it went and, at the
        step's last, summed the shards over the replicas. In a stage: wait for what `start_reduce`
        sent (starting it if it was not), then, unless inside `no_sync` (a micro-step before the
        step's last), the sum over the replicas (hybrid sharding)."""
        if not self.pipelined:
            return
        if not self.units[0].reduced:
            self.start_reduce()
        if self._reducing is not None:
            self._finish_reduce(self._reducing)
        for unit in self.units:
            unit.reduced = False
        if self.sync:
            self._sum_replicas()

    def start_reduce(self) -> None:
        """Pipeline: the stage's last backward (or W) of the schedule is done. Reduce-scatter each
        unit's gradients (accumulated over the microbatches) into its shard, free them and the unit."""
        for unit in self.backward_order:
            self._reduce(unit)

    def _sum_replicas(self) -> None:
        for shard in self.shards:
            self.replicas.launch(shard.grad, self._to_wire)
        self.replicas.finish()

    def _to_wire(self, grad: torch.Tensor) -> torch.Tensor:
        return grad if grad.dtype == self.wire_dtype else grad.to(self.wire_dtype)

    @property
    def shards(self) -> list[FlatShard]:
        return [part.shard for unit in self.units for part in unit.parts]

    def pieces(self) -> list[Piece]:
        return [piece for shard in self.shards for piece in shard.optimizer_pieces()]

    def held(self, param: nn.Parameter, lo: int, hi: int) -> Held:
        """The master values live in the shard only (the gathered parameters are freed)."""
        return sum((shard.held(param, lo, hi, in_param=False) for shard in self.shards), Held())

    def flat_slots(self) -> dict[nn.Parameter, FlatSlot]:
        return {p: slot for i, shard in enumerate(self.shards) for p, slot in shard.slots(i).items()}

    def shard_grads(self) -> list[torch.Tensor]:
        return [shard.grad for shard in self.shards]

    def buffer_peak(self) -> int:
        return self.buffers.bytes

    def held_buffers(self) -> list[torch.Tensor | None]:
        """Gathered units (a freed one's storage has 0 bytes), the reductions in flight, and outside
        a pipeline the full gradients backward produced (a stage keeps them: its model states)."""
        parts = [part for unit in self.units for part in unit.parts]
        held = [part.full for part in parts] + [t for part in parts for t in (part.reduce_in, part.reduce_out)]
        return held + ([] if self.pipelined else [p.grad for p in self.unit_of])

    @property
    def wire_dtype(self) -> torch.dtype:
        """What gradients are reduce-scattered in: `reduce_dtype`, else the master shards' dtype."""
        return self.reduce_dtype or self.shards[0].local.dtype

    # ------------------------------------------------------------ gather / free

    def _prefetch(self, unit: Unit | None) -> None:
        for other in unit.borrowed if unit is not None else ():
            self._prefetch(other)
        if unit is None or unit.gathered:
            return
        for part in unit.parts:
            part.full.untyped_storage().resize_(part.full.numel() * part.full.element_size())
            # autograd saved views of `full` in forward; refilling it in place is what backward must read
            with torch.autograd._unsafe_preserve_version_counter(part.full):
                mine = part.shard.local.to(part.full.dtype)  # [padded / n] cast before the wire (bf16: half the bytes)
                part.gather_work = comm.all_gather_into(part.full, mine, part.group, async_op=True)
        unit.gathered = True
        self.buffers.sample(self.held_buffers())

    def _gather(self, unit: Unit) -> None:
        self._prefetch(unit)
        for part in [part for u in (unit, *unit.borrowed) for part in u.parts]:
            if part.gather_work is not None:
                comm.wait(part.gather_work, "all_gather", part.group)
                part.gather_work = None

    def _free(self, unit: Unit) -> None:
        """Release the gathered parameters, and with them the views autograd saved of them."""
        for other in unit.borrowed:
            self._free(other)
        for part in unit.parts:
            if part.gather_work is not None:  # prefetched but never used: the collective still writes into it
                comm.wait(part.gather_work, "all_gather", part.group)
                part.gather_work = None
            part.full.untyped_storage().resize_(0)
        unit.gathered = False

    @staticmethod
    def _after(order: list[Unit], unit: Unit) -> Unit | None:
        i = order.index(unit)
        return order[i + 1] if i + 1 < len(order) else None

    # ------------------------------------------------------------ hooks

    def _before_forward(self, unit: Unit, module: nn.Module) -> None:
        self._gather(unit)
        if module is unit.modules[0]:
            self._prefetch(self._after(self.forward_order, unit))

    def _after_forward(self, unit: Unit, out) -> None:
        training = torch.is_grad_enabled()
        if not training or self.reshard_after_forward:
            self._free(unit)
        if training and isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(lambda grad, u=unit: self._before_backward(u))

    def _before_backward(self, unit: Unit) -> None:
        if not self._callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self._callback_queued = True
        if self.pipelined and self.reshard_after_forward:  # the unit that ran backward before this one is done
            done = self._after(self.forward_order, unit)
            if done is not None and done.gathered:
                self._free(done)
        self._gather(unit)
        self._prefetch(self._after(self.backward_order, unit))

    def _grad_ready(self, unit: Unit) -> None:
        if self.pipelined:  # reduced once, after the stage's last backward (or W): `start_reduce`
            return
        unit.ready += 1
        if unit.ready == len(unit.params):
            self._reduce(unit)

    def _reduce(self, unit: Unit) -> None:
        """The unit's backward is done: send its gradients off (reduce-scatter), free them and the unit."""
        if self._reducing is not None:  # one in flight: its work holds a full-size gradient buffer
            self._finish_reduce(self._reducing)
        self._reducing = unit
        for part in unit.parts:
            params = part.shard.params
            # [padded] in the reduce dtype (default: the masters', so bf16 gradients are upcast first)
            part.reduce_in = part.shard.flatten([p.grad for p in params], like=part.shard.local, dtype=self.wire_dtype)
            part.reduce_out = part.reduce_in.new_empty(part.shard.size)
            self.buffers.sample(self.held_buffers())  # the unit's gradients, and their flat copy
            for p in params:
                p.grad = None
            part.reduce_work = comm.reduce_scatter_into(part.reduce_out, part.reduce_in, part.group, async_op=True)
        unit.reduced = True
        self._free(unit)

    def _end_of_backward(self) -> None:
        if self.pipelined:  # one microbatch's backward of the stage: free what it gathered (or keep it)
            for unit in self.units:
                if self.reshard_after_forward and unit.gathered:
                    self._free(unit)
            self._callback_queued = False
            return
        for unit in self.backward_order:
            if not unit.reduced:  # parameters that received no gradient this pass
                self._reduce(unit)
        if self._reducing is not None:
            self._finish_reduce(self._reducing)
        for unit in self.backward_order:
            unit.reduced, unit.ready = False, 0
        self._callback_queued = False
        if self.sync:
            self._sum_replicas()

    def _finish_reduce(self, unit: Unit) -> None:
        for part in unit.parts:
            comm.wait(part.reduce_work, "reduce_scatter", part.group)
            part.shard.grad.add_(part.reduce_out)
            part.reduce_work, part.reduce_in, part.reduce_out = None, None, None
        self._reducing = None


def unique_params(modules: list[nn.Module]) -> list[nn.Parameter]:
    seen: dict[int, nn.Parameter] = {}
    for module in modules:
        for p in module.parameters():
            if p.requires_grad:
                seen.setdefault(id(p), p)
    return list(seen.values())


def transformer_units(model: nn.Module) -> list[tuple[str, list[nn.Module]]]:
    """ZeRO-3 units of a `Transformer`: the root (embedding, final norm, head), then each block."""
    root = [m for m in (model.tok_embeddings, model.norm, model.output) if m is not None]
    blocks = [(f"layers.{name}", [block]) for name, block in model.layers.items()]
    return [("root", root)] + blocks


def stage_units(stage: nn.Module) -> list[tuple[str, list[nn.Module]]]:
    """ZeRO-3 units of a pipeline stage, in the order its modules run: the embedding (first stage),
    each block, the final norm and head (last stage). A tied embedding has a copy on each end."""
    first = [("tok_embeddings", [stage.tok_embeddings])] if stage.tok_embeddings is not None else []
    head = [m for m in (stage.norm, stage.output) if m is not None]
    blocks = [(f"layers.{name}", [block]) for name, block in stage.layers.items()]
    return first + blocks + ([("head", head)] if head else [])
