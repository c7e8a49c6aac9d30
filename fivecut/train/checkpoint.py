"""Checkpoints that outlive the process and the layout: PyTorch Distributed Checkpoint (DCP)
keyed by single-device names and global shapes.

Every tensor of the training state is described as *chunks* of its single-device (global)
tensor, read off the parameters' placement records: a TP shard is one chunk, a rank's experts
are one chunk per run of consecutive logical experts, a ZeRO flat shard is the few boxes that a
contiguous run of a C-ordered tensor decomposes into. Each rank hands DCP only the chunks it
holds; replicas describe identical chunks, and DCP's planner keeps one of each, so the files
hold every element once (~12 Psi bytes in fp32: weights and Adam's two moments), written by all
ranks in parallel. Loading asks DCP for the chunks the *new* layout holds; DCP's resharding
reads the overlapping parts of whatever chunks were saved. Nothing is gathered onto one rank.

What a checkpoint holds:
    model.<name>                  the weights (a tied head is its embedding)
    optim.exp_avg.<name>, optim.exp_avg_sq.<name>, optim.step
    moe.<layer>.expert_bias       auxiliary-loss-free balancing biases
    moe.<layer>.eplb_history      the EPLB load window [steps, E] (global sums, the same everywhere)
and, in `fivecut.json`: the step, tokens seen, the config and layout, the config changes accepted
on resumes (`fivecut.train.resume`), the EPLB placements, the format version, and each file's
sha256. The learning rate and the data are functions of the step.

A save goes to `.tmp-step-N`, and only when every rank has written, the checksums are recorded
and a COMPLETE marker is in place, is it renamed to `step-N` (atomic on one filesystem): a
save killed half-way leaves the previous checkpoint intact and the partial one is ignored and
cleaned up at the next start. A folder that cannot be written (any more) ends the save on every
rank with one `SaveFailed` naming it and the step still intact (`checkpoint.on_error` decides
whether the run goes on, `fivecut.train.saving`).

After the rename every rank re-reads its share of the files against the recorded sha256
(`checkpoint.verify`); a checkpoint that reads back whole is marked VERIFIED before older ones are
pruned, and pruning never deletes the newest verified one. `--resume auto` takes the newest
checkpoint that is whole: a damaged newer one is renamed `step-N.damaged` (never deleted, never
listed again) with one line naming the damaged file.

DCP's `.metadata` is a pickle: fivecut reads it only through `MetadataUnpickler` (`SafeReader`,
`dcp_metadata`), which admits DCP's own records and nothing that could run code.
"""

from __future__ import annotations

import json
import math
import pickle
import shutil
import warnings
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from fivecut.comm import CollectiveError, backend_reason
from fivecut.parallel.placement import Placement
from fivecut.train.data import file_sha256
from fivecut.train.resume import check_new_run

VERSION = 1
META = "fivecut.json"
COMPLETE = "COMPLETE"
VERIFIED = "VERIFIED"  # written once every file of a finished save was re-read against its sha256 (checkpoint.verify)
PRUNED = ".pruned-"  # the prefix of a checkpoint a background save pruned, while a thread deletes it
DAMAGED = ".damaged"  # the suffix a damaged checkpoint that `--resume auto` passed over gets (kept, never deleted)
MOMENTS = ("exp_avg", "exp_avg_sq")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: the message names the file and what does not match."""


class SaveFailed(CheckpointError):
    """A save that failed on some rank and was abandoned on every rank alike; the checkpoints saved
    before it are intact (`checkpoint.on_error` decides whether the run goes on)."""


# ---------------------------------------------------------------- .metadata read without running code

DCP_METADATA = ".metadata"  # DCP's index of the checkpoint: a pickle
# what DCP's metadata is made of (torch 2.13; `torch.save`-free): its records, the filesystem's
# storage records, and the torch and pathlib values they hold. Nothing else may be created.
METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a layout by its name (torch.strided)
    ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id
    ("pathlib._local", "PosixPath"),  # the same class on Python >= 3.13
}


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's metadata only: a global outside `METADATA_CLASSES` (or a dtype) is refused
    before it is looked up, so a crafted file cannot call anything (as `torch.load(weights_only=True)`)."""

    def find_class(self, module: str, name: str):
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if (module, name) in METADATA_CLASSES or dtype:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it asks for {module}.{name}, which is not part of DCP's metadata")


def dcp_metadata(path: Path) -> Metadata:
    """The DCP metadata of the checkpoint at `path`, unpickled by `MetadataUnpickler`; anything else
    in it is refused with a `CheckpointError` naming the file."""
    file = Path(path) / DCP_METADATA
    try:
        with file.open("rb") as stream:
            metadata = MetadataUnpickler(stream).load()
    except OSError as err:
        raise CheckpointError(f"{file} cannot be read ({err.strerror or err})") from None
    except Exception as err:  # noqa: BLE001 -- whatever a crafted or broken pickle raises: refused, never run
        raise CheckpointError(
            f"{file} is refused: {err}. A DCP checkpoint's .metadata holds only DCP's records; this one could run "
            "code when opened, so fivecut does not open it; get the checkpoint again from a source you trust"
        ) from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{file} holds a {type(metadata).__name__}, not DCP's Metadata; it is not a checkpoint")
    return metadata


class SafeReader(dcp.FileSystemReader):
    """DCP's filesystem reader whose `.metadata` is read by `dcp_metadata`: every door fivecut opens a
    checkpoint through (resume, `dcp:` weights, export, convert, `fivecut checkpoint`) uses it."""

    def __init__(self, path: Path | str):
        super().__init__(str(path))

    def read_metadata(self, *args, **kwargs) -> Metadata:
        metadata = dcp_metadata(Path(self.path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id  # as DCP's own reader
        return metadata


# ---------------------------------------------------------------- chunks of global tensors


@dataclass
class Chunk:
    offsets: tuple[int, ...]  # where it starts in the global tensor
    view: torch.Tensor  # the local tensor holding it (its shape is the chunk's sizes)


@dataclass
class Entry:
    shape: tuple[int, ...]  # the global shape
    dtype: torch.dtype
    chunks: list[Chunk]


Table = dict[str, Entry]  # checkpoint key -> what this rank holds of it


def boxes(shape: tuple[int, ...], lo: int, hi: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The elements [lo, hi) of a C-ordered tensor of `shape` as (start, sizes) boxes, each contiguous."""
    if hi <= lo:
        return []
    if not shape:
        return [((), ())]
    inner = math.prod(shape[1:])
    first, last = -(-lo // inner), hi // inner  # the whole rows [first, last)
    if first > last:  # inside one row
        row = lo // inner
        return [((row, *s), (1, *z)) for s, z in boxes(shape[1:], lo - row * inner, hi - row * inner)]
    out = (
        [((first - 1, *s), (1, *z)) for s, z in boxes(shape[1:], lo - (first - 1) * inner, inner)] if lo % inner else []
    )
    if last > first:
        out.append(((first,) + (0,) * (len(shape) - 1), (last - first, *shape[1:])))
    if hi % inner:
        out += [((last, *s), (1, *z)) for s, z in boxes(shape[1:], 0, hi - last * inner)]
    return out


def runs(indices: Sequence[int], size: int) -> list[tuple[int, int, int]]:
    """(local start, global start, length) of each run of consecutive global `indices`, padding (>= size) left out."""
    if isinstance(indices, range) and indices.step == 1:  # an uncut dimension's: one run, without a loop
        length = min(indices.stop, size) - indices.start
        return [(0, indices.start, length)] if length > 0 else []
    out: list[list[int]] = []
    for i, g in enumerate(indices):
        if g >= size:
            continue
        if out and out[-1][0] + out[-1][2] == i and out[-1][1] + out[-1][2] == g:
            out[-1][2] += 1
        else:
            out.append([i, g, 1])
    return [tuple(r) for r in out]


def global_chunks(pl: Placement, flat: torch.Tensor, lo: int) -> list[Chunk]:
    """The chunks of `pl`'s global tensor that `flat` holds: flat[k] is element lo + k of this
    rank's (padded) local tensor, flattened."""
    local, chunks = pl.local_shape(), []
    index: list[Sequence[int]] = [range(n) for n in pl.shape]
    for s in pl.slices:
        index[s.dim] = s.indices()
    for start, sizes in boxes(local, lo, lo + flat.numel()):
        at = sum(i * math.prod(local[d + 1 :]) for d, i in enumerate(start)) - lo
        box = flat[at : at + math.prod(sizes)].view(sizes)
        per_dim = [runs(index[d][a : a + n], pl.shape[d]) for d, (a, n) in enumerate(zip(start, sizes))]
        chunks += [sub_chunk(box, combo) for combo in product(per_dim)]
    return chunks


def product(per_dim: list[list[tuple[int, int, int]]]) -> list[list[tuple[int, int, int]]]:
    out: list[list[tuple[int, int, int]]] = [[]]
    for options in per_dim:
        out = [prefix + [run] for prefix in out for run in options]
    return out


def sub_chunk(box: torch.Tensor, combo: list[tuple[int, int, int]]) -> Chunk:
    view = box
    for d, (local, _, length) in enumerate(combo):
        view = view.narrow(d, local, length)
    return Chunk(tuple(g for _, g, _ in combo), view)


# ---------------------------------------------------------------- what a rank holds


def state_table(par, optimizer: torch.optim.Optimizer | None) -> Table:
    """Every tensor of this rank's training state as chunks of global tensors, by checkpoint key.
    Where each parameter's values and optimizer state live is the data cut's answer (`GradSync.held`).
    Without an optimizer (`fivecut convert`): the weights and routing biases alone."""
    table: Table = {}
    master = par.pieces[0].tensor.dtype  # what the optimizer updates (fp32; ZeRO-3 may compute on a bf16 copy)
    for name, pl in par.placements.items():
        if not par.params[name].requires_grad:  # frozen ([lora]): its run's model.init_from holds it
            continue
        held = par.sync.held(par.params[name], 0, pl.local_numel())
        chunks = [c for flat, at in held.values for c in global_chunks(pl, flat, at)]
        table[f"model.{name}"] = Entry(pl.shape, master, chunks)
        for key in MOMENTS if optimizer is not None else ():
            moments = [(optimizer.state[t][key].view(-1)[a:b], at) for t, a, b, at in held.optimized]
            table[f"optim.{key}.{name}"] = Entry(
                pl.shape, torch.float32, [c for m in moments for c in global_chunks(pl, *m)]
            )
    if optimizer is not None:
        table["optim.step"] = Entry((), torch.float32, [Chunk((), next(iter(optimizer.state.values()))["step"])])
    for layer, runtime in par.experts.runtimes.items() if par.experts is not None else ():
        bias = runtime.moe.expert_bias  # auxiliary-loss-free balancing: the same on every rank
        table[f"moe.{layer}.expert_bias"] = Entry(tuple(bias.shape), bias.dtype, [Chunk((0,), bias)])
    return table


def ensure_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """AdamW's state before its first step (what it would create lazily), so that a load can fill it."""
    for group in optimizer.param_groups:
        on_device = group.get("fused") or group.get("capturable")  # their step counts live beside the parameters
        for t in group["params"]:
            if not optimizer.state.get(t):
                zeros = {key: torch.zeros_like(t, memory_format=torch.preserve_format) for key in MOMENTS}
                step = torch.zeros((), dtype=torch.float32, device=t.device if on_device else "cpu")
                optimizer.state[t] = {"step": step, **zeros}


def moe_state(par) -> dict:
    """Each MoE layer's EPLB state on this rank: the load window and the placement of the experts
    (global sums and global plans: the same on every rank that holds the layer)."""
    if par.experts is None:
        return {}
    out = {}
    for layer, runtime in par.experts.runtimes.items():
        slots = runtime.placement
        window = [row.tolist() for row in par.experts.history.get(layer, [])]
        out[str(layer)] = {"window": window, "ep": slots.ep, "expert": slots.expert, "share": slots.share}
    return out


def restore_moe(par, saved: dict) -> None:
    """The EPLB windows; the placements too where the layout has the same ep ranks and slots (else
    the default placement stays: the logical experts are loaded into it, and the math is the same)."""
    if par.experts is None:
        return
    for layer, runtime in par.experts.runtimes.items():
        record = saved.get(str(layer))
        if record is None:
            continue
        history = par.experts.history[layer]
        history.extend(torch.tensor(row, device=par.experts.device) for row in record["window"])
        slots = runtime.placement
        if record["ep"] == slots.ep and len(record["expert"][0]) == slots.slots:
            par.restore_slots(layer, record["expert"], record["share"])


# ---------------------------------------------------------------- DCP planners over a table


class TableSavePlanner(DefaultSavePlanner):
    """DCP's planner for the chunks of `table`; DCP drops the duplicates replicas describe."""

    def __init__(self, table: Table):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.take(table)

    def take(self, table: Table) -> None:
        """Write the chunks of `table` (the same keys, offsets and shapes as the plan's)."""
        self.table = table
        self.views = {MetadataIndex(k, torch.Size(c.offsets)): c.view for k, e in table.items() for c in e.chunks}

    def create_local_plan(self) -> SavePlan:
        self.plan = SavePlan(
            [write_item(key, entry, chunk) for key, entry in self.table.items() for chunk in entry.chunks]
        )
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
        index = MetadataIndex(write_item.index.fqn, write_item.index.offset)
        return self.views[index].detach().contiguous()


def write_item(key: str, entry: Entry, chunk: Chunk) -> WriteItem:
    meta = ChunkStorageMetadata(torch.Size(chunk.offsets), torch.Size(chunk.view.shape))
    return WriteItem(
        index=MetadataIndex(key, torch.Size(chunk.offsets)),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(meta, TensorProperties(dtype=entry.dtype), torch.Size(entry.shape)),
    )


class TableLoadPlanner(DefaultLoadPlanner):
    """Reads, for every chunk of `table`, the overlapping parts of the saved chunks (resharding)."""

    def __init__(self, table: Table, path: Path):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.table, self.path = table, path
        self.views = {(k, tuple(c.offsets)): c.view for k, e in table.items() for c in e.chunks}

    def create_local_plan(self) -> LoadPlan:
        items = []
        for key, entry in self.table.items():
            saved = self.metadata.state_dict_metadata.get(key)
            check_saved(self.path, key, entry, saved)
            meta = [ChunkStorageMetadata(torch.Size(c.offsets), torch.Size(c.view.shape)) for c in entry.chunks]
            items += create_read_items_for_chunk_list(key, saved, meta)
        return LoadPlan(items)

    def resolve_tensor(self, read_item):
        view = self.views[(read_item.dest_index.fqn, tuple(read_item.dest_index.offset))]
        for d, (offset, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            view = view.narrow(d, offset, length)
        return view


def check_saved(path: Path, key: str, entry: Entry, saved) -> None:
    if not isinstance(saved, TensorStorageMetadata):
        raise CheckpointError(f"checkpoint {path} has no tensor {key}; it was written for another model")
    if tuple(saved.size) != tuple(entry.shape):
        raise CheckpointError(
            f"checkpoint {path}: {key} has shape {tuple(saved.size)}, this model's is {tuple(entry.shape)}"
        )


# ---------------------------------------------------------------- directories


@dataclass
class Saved:
    """What `fivecut.json` says of a checkpoint."""

    path: Path
    meta: dict

    @property
    def step(self) -> int:
        return self.meta["step"]


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def complete(path: Path) -> bool:
    return (path / COMPLETE).is_file() and (path / META).is_file()


def checkpoints(root: Path) -> list[Path]:
    """The complete checkpoints under `root`, oldest first (not those set aside as damaged)."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step-*") if p.name[5:].isdigit() and p.is_dir() and complete(p))


def verified(path: Path) -> bool:
    return (path / VERIFIED).is_file()


def newest(root: Path) -> Path | None:
    found = checkpoints(root)
    return found[-1] if found else None


def read_meta(path: Path) -> dict:
    if not complete(path):
        raise CheckpointError(f"{path} is not a complete fivecut checkpoint (no {COMPLETE} marker or {META})")
    try:
        return json.loads((path / META).read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path / META} cannot be read: {err}") from None


def find_checkpoint(path: Path, step: int | None) -> Path:
    """The checkpoint folder `path` names: itself, or (a checkpoint.dir) its step `step` or newest."""
    if step is not None and step < 0:
        raise CheckpointError(f"--step {step} is negative; give the step of one of the checkpoints")
    if not path.exists():
        raise CheckpointError(f"--checkpoint {path} does not exist; give a checkpoint (step-N) or a checkpoint.dir")
    if complete(path) or path.name.startswith(("step-", ".tmp-step-")):
        return own_step(path, step)
    if step is not None:
        return step_of_dir(path, step)
    found = newest(path)
    if found is None:
        raise CheckpointError(
            f"--checkpoint {path} holds no complete fivecut checkpoint (a step-N folder with a COMPLETE marker); "
            "give a checkpoint.dir of a run that saved one, or one of its step-N folders"
        )
    return found


def own_step(path: Path, step: int | None) -> Path:
    saved = read_meta(path)["step"]  # refuses an incomplete checkpoint, naming it
    if step is not None and saved != step:
        raise CheckpointError(f"--checkpoint {path} is step {saved}, not --step {step}; give its checkpoint.dir")
    return path


def step_of_dir(root: Path, step: int) -> Path:
    path = step_dir(root, step)
    if not complete(path):
        steps = ", ".join(str(int(p.name.split("-")[1])) for p in checkpoints(root)) or "none"
        raise CheckpointError(f"--step {step}: {root} has no complete checkpoint {path.name} (complete steps: {steps})")
    return path


def clean_partial(root: Path) -> None:
    """Remove what a save that never finished left behind, and what a pruning did not delete
    (rank 0, before training)."""
    for tmp in [*root.glob(".tmp-step-*"), *root.glob(f"{PRUNED}*")] if root.is_dir() else ():
        shutil.rmtree(tmp, ignore_errors=True)


def prune(root: Path, keep: int) -> None:
    """Keep the newest `keep` complete checkpoints (never fewer than one), and the newest verified one."""
    for old in unkept(root, keep):
        shutil.rmtree(old, ignore_errors=True)


def unkept(root: Path, keep: int) -> list[Path]:
    """The complete checkpoints `prune` deletes."""
    found = checkpoints(root)
    kept = set(found[-max(keep, 1) :]) | set([p for p in found if verified(p)][-1:])
    return [old for old in found if old not in kept]


def hidden(path: Path) -> Path:
    """`path` renamed out of the checkpoints' sight (`.pruned-step-N`), to be deleted
    (`clean_partial` removes it too)."""
    out = path.with_name(PRUNED + path.name)
    if out.exists():  # an earlier pruning's leftover of the same step
        shutil.rmtree(out, ignore_errors=True)
    path.rename(out)
    return out


def set_aside(path: Path) -> Path:
    """Rename a damaged checkpoint to step-N.damaged (step-N.damaged-2, ... if taken); never deleted."""
    aside, n = path.with_name(path.name + DAMAGED), 1
    while aside.exists():
        n += 1
        aside = path.with_name(f"{path.name}{DAMAGED}-{n}")
    path.rename(aside)
    return aside


def pass_over(path: Path, problem: str) -> None:
    """A resume's damaged newest checkpoint set aside, said in one line naming the damaged file."""
    aside = set_aside(path)
    print(f"fivecut: checkpoint {path} is damaged: {problem}; moved aside to {aside.name} (kept), resuming from "
          "the newest intact one", flush=True)  # fmt: skip


# ---------------------------------------------------------------- save


@contextmanager
def collectives(what: str):
    """DCP's and the barriers' collectives bypass `fivecut.comm`; a failure (a rank that died
    mid-save) still ends in fivecut's one-line `CollectiveError`."""
    try:
        yield
    except CheckpointError:
        raise
    except CheckpointException as err:  # DCP gathers every rank's failure; ours name the file and the key
        ours = [e for e, _ in err.failures.values() if isinstance(e, CheckpointError)]
        if ours:
            raise ours[0] from None
        raise CollectiveError(f"rank {dist.get_rank()}: checkpoint {what} failed: {backend_reason(err)}") from err
    except RuntimeError as err:
        reason = backend_reason(err)
        raise CollectiveError(f"rank {dist.get_rank()}: checkpoint {what} failed among all ranks: {reason}") from err


def save(root: Path, step: int, par, optimizer, meta: dict, keep: int, verify: bool = False) -> Path:
    """Write this step's checkpoint from every rank in parallel; visible only once complete
    (`optimizer` None: the weights alone, `meta["weights_only"]`). `verify`: every file re-read
    against its sha256 once in place, before older checkpoints are pruned. A failure on any rank
    raises `SaveFailed` on every rank, the earlier checkpoints intact."""
    root = Path(root)
    tmp, final = root / f".tmp-step-{step:08d}", step_dir(root, step)
    with collectives(f"save of step {step}"), removed_if_failed(tmp), unwritable(root, step):
        agree(rank_zero(lambda: fresh_folder(tmp)))  # every rank waits for the folder, or stops with rank 0
        writer = dcp.FileSystemWriter(str(tmp))
        dcp.save({}, storage_writer=writer, planner=TableSavePlanner(state_table(par, optimizer)))
        every = gathered(lambda: (own_checksums(tmp), moe_state(par)))
        agree(rank_zero(lambda: finish(tmp, final, meta | {"step": step}, every)))
        if verify:
            check_written(final)
        agree(rank_zero(lambda: prune(root, keep)))
    return final


@contextmanager
def removed_if_failed(tmp: Path):
    """A failed save's partial folder removed (rank 0; where it can be) so that nothing of it stays."""
    try:
        yield
    except SaveFailed:
        rank_zero(lambda: shutil.rmtree(tmp, ignore_errors=True))
        raise


def gathered(work) -> list:
    """`work`'s answer from every rank; an OSError on any rank is raised on every rank."""
    try:
        answer, error = work(), None
    except OSError as err:
        answer, error = None, err
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, (answer, error))
    errors = [e for _, e in every if e is not None]
    if errors:
        raise errors[0]
    return [a for a, _ in every]


def check_written(path: Path) -> None:
    """Every file of the save just put in place re-read against its recorded sha256, shared out
    over the ranks; intact: marked VERIFIED; damaged: set aside by rank 0 and `SaveFailed` everywhere."""
    problems = shared_problems(path, read_meta(path))
    if problems:
        agree(rank_zero(lambda: set_aside(path)))
        raise SaveFailed(
            f"the save of {path} did not read back intact ({problems[0]}); it was moved aside to "
            f"{path.name}{DAMAGED}, the earlier checkpoints are kept"
        )
    agree(rank_zero(lambda: mark_verified(path)))


def mark_verified(path: Path) -> None:
    (path / VERIFIED).write_text("")


def fresh_folder(tmp: Path) -> None:
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)


def finish(tmp: Path, final: Path, meta: dict, every: list) -> None:
    """Rank 0: the checksums and MoE state every rank reported, the meta, the rename."""
    files = {name: record for sums, _ in every for name, record in sums.items()}
    files[".metadata"] = [file_sha256(tmp / ".metadata"), (tmp / ".metadata").stat().st_size]
    moe = {layer: record for _, state in every for layer, record in state.items()}
    publish(tmp, final, meta | {"version": VERSION, "files": files, "moe": moe})


def rank_zero(work) -> OSError | None:
    """Run `work` on rank 0 only; the OSError it raised (None on the other ranks, or when it succeeded)."""
    if dist.get_rank() != 0:
        return None
    try:
        work()
    except OSError as err:
        return err
    return None


def agree(error: OSError | None) -> None:
    """Every rank learns rank 0's error (a barrier too) and raises it, so that all stop together."""
    box = [error]
    dist.broadcast_object_list(box, src=0)
    if box[0] is not None:
        raise box[0]


@contextmanager
def unwritable(root: Path, step: int):
    """A folder that cannot be written (a write of any rank, or rank 0's folder, meta or rename):
    one `CheckpointError` naming it and the newest checkpoint, which the failed save left intact."""
    try:
        yield
    except CheckpointException as err:
        oserrors = [e for e, _ in err.failures.values() if isinstance(e, OSError)]
        if not oserrors:
            raise
        raise save_failed(root, step, oserrors[0]) from None
    except OSError as err:
        raise save_failed(root, step, err) from None


def save_failed(root: Path, step: int, err: OSError) -> SaveFailed:
    earlier = newest(root)
    intact = f"step {read_meta(earlier)['step']} is intact in {earlier}" if earlier else "no earlier checkpoint"
    return SaveFailed(
        f"checkpoint.dir={str(root)!r} cannot be written ({err.strerror or err}): step {step} was not saved; "
        f"{intact}; make the folder writable and start the run again (it resumes from there), or give "
        "another checkpoint.dir"
    )


def refuse_other_run(root: str | None, resume: str, cfg) -> None:
    """`--resume never` saves into a checkpoint.dir that holds no run (`fivecut.train.resume.check_new_run`)."""
    if resume != "never" or root is None:
        return
    folder = Path(root).expanduser()
    found = newest(folder)
    check_new_run(folder, found, read_meta(found) if found is not None else None, cfg)


def own_checksums(tmp: Path) -> dict[str, list]:
    """sha256 and size of the files this rank wrote (DCP names them __<rank>_<n>.distcp)."""
    mine = sorted(tmp.glob(f"__{dist.get_rank()}_*.distcp"))
    return {p.name: [file_sha256(p), p.stat().st_size] for p in mine}


def publish(tmp: Path, final: Path, meta: dict) -> None:
    (tmp / META).write_text(json.dumps(meta, indent=1))
    (tmp / COMPLETE).write_text("")
    if final.exists():  # the same step saved again (a resumed run's final save)
        shutil.rmtree(final)
    tmp.rename(final)


# ---------------------------------------------------------------- load


def file_problems(path: Path, meta: dict, rank: int = 0, world: int = 1) -> list[str]:
    """What is wrong with the files (every `world`-th from `rank`): missing, truncated, changed."""
    names = sorted(meta["files"])[rank::world]
    return [problem for name in names if (problem := file_problem(path, name, meta["files"][name]))]


def verify_files(path: Path, meta: dict) -> None:
    """Every file's sha256 against the record, the files shared out over the ranks; raises naming the file."""
    found = shared_problems(path, meta)
    if found:
        raise CheckpointError(f"checkpoint {path} is damaged: " + "; ".join(found))


def shared_problems(path: Path, meta: dict) -> list[str]:
    """`file_problems` of every file, each rank checking its share; every rank gets the whole list."""
    problems = file_problems(path, meta, dist.get_rank(), dist.get_world_size())
    every = [None] * dist.get_world_size()
    with collectives(f"check of {path}"):
        dist.all_gather_object(every, problems)
    return [p for part in every for p in part]


def file_problem(path: Path, name: str, record: list) -> str | None:
    problem = size_problem(path, name, record)
    if problem is None and file_sha256(path / name) != record[0]:
        return f"{path / name} does not match its sha256 (a changed byte)"
    return problem


def size_problem(path: Path, name: str, record: list) -> str | None:
    """A file the checkpoint recorded that is missing or of another size (no byte read)."""
    file = path / name
    if not file.is_file():
        return f"{file} is missing"
    if file.stat().st_size != record[1]:
        return f"{file} has {file.stat().st_size} bytes, {record[1]} were written (truncated?)"
    return None


def quick_problem(path: Path) -> str | None:
    """What makes a complete checkpoint unusable without reading its tensors: an unreadable
    `fivecut.json`, a file missing or of another size."""
    try:
        files = read_meta(path).get("files", {})
    except CheckpointError as err:
        return str(err)
    return next((p for name in sorted(files) if (p := size_problem(path, name, files[name]))), None)


def newest_intact(root: Path) -> Path | None:
    """The newest checkpoint under `root` that `quick_problem` finds nothing wrong with (before any
    process group: the ranks' `newest_verified_intact` sets the damaged newer ones aside)."""
    return next((path for path in reversed(checkpoints(root)) if quick_problem(path) is None), None)


def newest_verified_intact(root: Path) -> Path | None:
    """(every rank) `newest_intact`, and every file's sha256 checked, shared out over the ranks: the
    newest checkpoint that is whole; rank 0 sets the damaged newer ones aside."""
    for path in reversed(checkpoints(root)):  # every rank's list: read before rank 0 renames any
        if intact_else_set_aside(path):
            return path
    return None


def intact_else_set_aside(path: Path) -> bool:
    """(every rank) Whether every file of `path` is whole; if not, rank 0 sets it aside."""
    problems = [p for p in gathered(lambda: quick_problem(path)) if p is not None]  # every rank's verdict, the same
    problems = problems or shared_problems(path, read_meta(path))
    if problems:
        agree(rank_zero(lambda: pass_over(path, problems[0])))
    return not problems


def to_resume(root: str | None, resume: str, hashed: bool = False) -> Path | None:
    """The checkpoint a run starts from: `resume` is "never", "auto" (the newest intact one under
    `root`, if any; `hashed`: on every rank, each file's sha256 checked too and the damaged newer
    ones set aside) or a checkpoint's path (refused if damaged, by `load`)."""
    if resume == "never":
        return None
    path = None
    if resume != "auto":
        path = Path(resume).expanduser()
    elif root is not None and hashed:
        path = newest_verified_intact(Path(root).expanduser())
    elif root is not None:
        path = newest_intact(Path(root).expanduser())
    if path is not None:
        refuse_weights_only(path, read_meta(path))  # and what is not a complete checkpoint
        dcp_metadata(path)  # a .metadata that is more than DCP's records: refused before any process starts
    return path


def refuse_weights_only(path: Path, meta: dict) -> None:
    """A checkpoint of weights alone (`fivecut convert`) has no training state to resume."""
    if meta.get("weights_only"):
        raise CheckpointError(
            f"{path} holds weights only (written by fivecut convert), no optimizer state to resume; start a run from "
            f"it with model.init_from = 'dcp:{path}' (and --resume never, or another checkpoint.dir)"
        )


def check_model(path: Path, meta: dict, model: dict, accepted: set[str] = frozenset()) -> None:
    """The checkpoint's model has this model's shape, but for the `model.*` keys `accepted` names
    (`--override`; a tensor of another shape is still refused); otherwise name both."""
    saved = meta.get("model", {})
    model = {k: list(v) if isinstance(v, tuple) else v for k, v in model.items()}  # as JSON holds them
    differ = [
        f"{k} {saved.get(k)} vs {v}" for k, v in model.items() if saved.get(k) != v and f"model.{k}" not in accepted
    ]
    if differ:
        raise CheckpointError(
            f"{path / META} holds a checkpoint of model {meta.get('preset')!r}, which differs from this one: "
            + ", ".join(differ)
        )


def load(path: Path, par, optimizer, model: dict, accepted: set[str] = frozenset(), checked: bool = False) -> dict:
    """Fill this rank's part of the training state from the checkpoint at `path` (saved under any
    layout) into a model of shape `model` (ModelArgs as a dict; `accepted`: see `check_model`);
    returns the checkpoint's meta. `checked`: its files' sha256s were just checked (`to_resume`)."""
    path = Path(path)
    meta = read_meta(path)
    if meta.get("version") != VERSION:
        raise CheckpointError(f"{path / META}: format version {meta.get('version')}, this fivecut reads {VERSION}")
    refuse_weights_only(path, meta)
    check_model(path, meta, model, accepted)
    if not checked:
        verify_files(path, meta)
    dcp_metadata(path)  # every rank alike, before DCP (which would turn the refusal into a failed collective)
    restore_moe(par, meta.get("moe", {}))
    ensure_optimizer_state(optimizer)
    table = state_table(par, optimizer)
    with collectives(f"load of {path}"):
        dcp.load({}, storage_reader=SafeReader(path), planner=TableLoadPlanner(table, path))
    step = float(table["optim.step"].chunks[0].view)
    for state in optimizer.state.values():
        state["step"].fill_(step)
    return meta


def info(path: Path) -> list[str]:
    """`fivecut checkpoint info`: what a checkpoint (or the newest complete one in a folder) holds."""
    path = Path(path).expanduser()
    if not complete(path) and newest(path) is not None:
        path = newest(path)
    meta = read_meta(path)
    dcp_metadata(path)  # refused before anything else is said of it
    problems = file_problems(path, meta)
    size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    return [
        f"checkpoint {path}",
        f"step {meta['step']}, tokens seen {meta['tokens']:,}",
        f"model {meta['preset']!r} (dim {meta['model']['dim']}, {meta['model']['n_layers']} layers), "
        f"layout {meta['layout']} ({meta['world_size']} ranks)",
        f"size on disk {size:,} bytes in {len(meta['files'])} files",
        "complete and intact" if not problems else "DAMAGED: " + "; ".join(problems),
    ]


def full_state(path: Path, prefix: str = "model.") -> dict[str, torch.Tensor]:
    """The global (single-device) tensors of every key of the checkpoint at `path` that starts with
    `prefix`, by their names without it: read in this one process, no process group, after every
    file is checked against its recorded sha256 (raises `CheckpointError` naming the file)."""
    path = Path(path)
    meta = read_meta(path)
    problems = file_problems(path, meta)
    if problems:
        raise CheckpointError(f"checkpoint {path} is damaged: " + "; ".join(problems))
    reader = SafeReader(path)
    saved = reader.read_metadata().state_dict_metadata
    state = {
        key: torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
        for key, entry in saved.items()
        if key.startswith(prefix) and isinstance(entry, TensorStorageMetadata)
    }
    with warnings.catch_warnings():  # DCP warns that no_dist means one process: that is the point here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        planner = DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
        dcp.load(state, storage_reader=reader, planner=planner, no_dist=True)
    return {key[len(prefix) :]: tensor for key, tensor in state.items()}
