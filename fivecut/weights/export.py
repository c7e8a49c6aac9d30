"""`fivecut export`: a checkpoint as a folder that Hugging Face `from_pretrained` reads.

The Hugging Face class (`fivecut.weights.architectures`: Llama, Mistral, Qwen2, Qwen3, SmolLM3,
OLMo 2, Phi-3, Mixtral, Qwen3-MoE, DeepSeek-V3) is `--architecture`, else the class the model was
imported from (the run's model.init_from, `export_class`: a Mistral without a window goes back out a
Mistral, though Llama holds it too), else the first that holds the model's shape; the checkpoint's tensor shapes, read
from DCP's metadata alone, are checked against the shapes its `ModelArgs` imply. The weights are
never gathered: the output is planned as shards of at most --max-shard-size, and each shard is
read from DCP by itself (only its tensors' global values, whatever layout saved them), converted,
written and freed -- by `workers` processes (at most one per shard and per core of the machine,
said when fewer than asked), each writing every workers-th shard, so a process holds about one
shard at a time, never the model:

    config.json                    the class's config, or fivecut's own (a shape no class holds)
    generation_config.json         the tokenizer's bos/eos ids
    model.safetensors              or model-0000K-of-0000N.safetensors + model.safetensors.index.json
    tokenizer.json, tokenizer_config.json, special_tokens_map.json   when the run's tokenizer has a form
                                   Hugging Face reads (GPT-2's BPE; a model's own tokenizer.json)

A dense model's tensors take the class's names (the table in `fivecut.weights.architectures`).
fivecut's model and these classes share the rotate-half RoPE and the [out, in] layout of every
linear weight, so no dense tensor is permuted or transposed (a record's `TensorMap` says where
one is: stacked experts); Phi-3's fused projections are written from their row blocks, joined.
The vocabulary is never padded: a checkpoint holds global tensors, however a layout padded them
for its cuts.

A mixture-of-experts class writes each expert as its own [out, in] tensor and, for DeepSeek-V3,
the RoPE rows of the latent attention interleaved in pairs and the routing biases as
`e_score_correction_bias` (the placements of `fivecut.weights.moe_architectures`). A model no
registered class holds (e.g. a MoE without a class's routing, latent attention alone, routing
biases moved by balancing where the class has none) is written under
fivecut's own names (the list above, plus `layers.N.feed_forward.router.weight`, the stacked experts
`layers.N.feed_forward.experts.w1|w3|w2` [E, dim, hidden] / [E, hidden, dim], the shared experts
`layers.N.feed_forward.shared.w1|w3|w2.weight`, and the auxiliary-loss-free routing biases
`layers.N.feed_forward.expert_bias` that expert selection adds), with a config.json whose
"fivecut" entry holds every ModelArgs field.

The folder appears whole or not at all: it is written next to `out` under a temporary name
(`.OUT.tmp-PID-XXXXXXXX`) and renamed at the end; an `out` that exists and is not empty is
refused, never overwritten. An export killed before its rename leaves its temporary folder: the
next export to the same `out` removes it (`remove_stale`: that name's pattern, a process gone).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import math
import multiprocessing
import os
import re
import shutil
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from fivecut.model.args import ModelArgs
from fivecut.model.lora import EXPERT_ADAPTERS, is_adapter
from fivecut.train import checkpoint as ckpt
from fivecut.train.checkpoint import CheckpointError
from fivecut.train.tokenizer import FileTokenizer, GPT2Tokenizer, gpt2_files
from fivecut.weights import gemma  # noqa: F401  (registers Gemma 2 and Gemma 3)
from fivecut.weights import moe_architectures as moe
from fivecut.weights.architectures import ARCHITECTURES, AnyArchitecture, ArchitectureError, TensorMap, for_args
from fivecut.weights.hf import folder_tokenizer, hf_config, read_config
from fivecut.weights.load import open_source
from fivecut.weights.load import run_tokenizer as resolve_tokenizer
from fivecut.weights.source import WeightsError, expected_shapes, resolve_path

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DEFAULT_SHARD_BYTES = 5 * 2**30
MOE_ARCHITECTURE = "FivecutMoEForCausalLM"
SAFETENSORS = "model.safetensors"
INDEX = "model.safetensors.index.json"
GPT2_SPECIAL = "<|endoftext|>"
UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
UNITS |= {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


class ExportError(ValueError):
    """An export that cannot be done as asked; the message names the path or flag and a fix."""


def export(
    checkpoint: Path,
    out: Path,
    step: int | None = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    dtype: str = "fp32",
    architecture: str | None = None,
    workers: int = 1,
) -> Path:
    """Write the checkpoint `checkpoint` (a step-N folder, or a checkpoint.dir: its newest complete
    checkpoint, or step `step`) as a Hugging Face folder `out` of class `architecture` (default: the
    first registered class that holds the model's shape), its shards written by `workers` processes;
    returns `out`."""
    out = Path(out).expanduser()
    check_out(out)
    check_options(max_shard_bytes, dtype, workers)
    source = ckpt.find_checkpoint(Path(checkpoint).expanduser(), step)
    meta = ckpt.read_meta(source)
    args = model_args(source, meta)
    arch = export_class(args, architecture, meta)
    problems = ckpt.file_problems(source, meta)
    if problems:
        raise CheckpointError(f"checkpoint {source} is damaged: " + "; ".join(problems))
    arch = with_routing_biases(source, args, arch, named=architecture is not None)
    tokenizer = run_tokenizer(meta.get("config", {})) if not meta.get("weights_only") else folder_tokenizer(source)
    entries = export_entries(source, args, arch, layered=adapter_scale(meta) > 0)
    plan = Plan(source, arch, entries, DTYPES[dtype], max_shard_bytes, workers, adapter_scale(meta))
    spelled = str(DTYPES[dtype]).removeprefix("torch.")  # "float32", as config.json spells it
    written = write_atomically(out, lambda tmp: write_folder(tmp, args, spelled, plan, tokenizer))
    for file in written:
        print(f"wrote {out / file}")
    kind = arch.hf_class if arch is not None else MOE_ARCHITECTURE
    print(f"exported {meta.get('preset')!r} step {meta['step']} ({kind}, {dtype}) from {source} to {out}")
    return out


# ---------------------------------------------------------------- what to read, where to write


def check_out(out: Path, flag: str | None = None) -> None:
    """`out` can become the export's folder: absent or empty, under folders that are folders and
    writable. `flag`: how the command line named it (export's `--out OUT`, convert's `--to hf:OUT`)."""
    flag = flag or f"--out {out}"
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        what = "is a file" if not out.is_dir() else "is not empty"
        raise ExportError(f"{flag} {what}; fivecut never overwrites: choose another folder, or empty this one first")
    existing = next(p for p in out.absolute().parents if p.exists())
    if not existing.is_dir():
        raise ExportError(f"{flag}: {existing} is a file, so no folder can be made under it; choose another path")
    if not os.access(existing, os.W_OK):
        raise ExportError(f"{flag}: {existing} cannot be written; choose a folder you can write")


def check_options(max_shard_bytes: int, dtype: str, workers: int = 1) -> None:
    if workers < 1:
        raise ExportError(f"--workers {workers} is not positive; give 1 or more processes")
    if max_shard_bytes <= 0:
        raise ExportError(f"--max-shard-size {max_shard_bytes} is not positive; give e.g. 5GB or 500MB")
    if dtype not in DTYPES:
        raise ExportError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}")


def parse_size(text: str) -> int:
    """A size in bytes: 2000000, 500MB, 5GB (powers of 10), 2GiB (powers of 2), as Hugging Face reads them."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = match[2].lower() if match else None
    if unit not in UNITS or float(match[1]) * UNITS[unit] < 1:
        raise ExportError(f"--max-shard-size {text!r} is not a size; write e.g. 5GB, 500MB, 2GiB or 2000000 (bytes)")
    return int(float(match[1]) * UNITS[unit])


def adapter_scale(meta: dict) -> float:
    """alpha / rank of the run's [lora] (0 without adapters)."""
    lora = meta.get("config", {}).get("lora") or {}
    return lora["alpha"] / lora["rank"] if lora.get("rank") else 0.0


def model_args(path: Path, meta: dict) -> ModelArgs:
    if meta.get("version") != ckpt.VERSION:
        version = meta.get("version")
        raise CheckpointError(f"{path / ckpt.META}: format version {version}, this fivecut reads {ckpt.VERSION}")
    try:
        return ModelArgs(**meta["model"])
    except (KeyError, TypeError) as err:
        raise CheckpointError(f"{path / ckpt.META} has no model shape fivecut knows ({err})") from None


def write_atomically(out: Path, write) -> list[str]:
    """`write(tmp)` into a fresh folder next to `out` (`.OUT.tmp-PID-XXXXXXXX`), then rename it to
    `out`; on any failure nothing stays, and what a killed export left is removed by the next one
    (`remove_stale`)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(out)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-{os.getpid()}-", dir=out.parent))
    try:
        written = write(tmp)
        for path in (tmp, *tmp.iterdir()):  # mkdtemp's folder is private to its owner; a model folder is not
            path.chmod(0o755 if path.is_dir() else 0o644)
        tmp.replace(out)  # an empty `out` folder is replaced too
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return written


def remove_stale(out: Path) -> list[Path]:
    """The temporary folders of earlier exports to `out` that were killed before their rename: named
    as `write_atomically` names them (with or without the PID of earlier versions), whose process is
    gone. Removed, said in one line; a folder of an export still running is left, and said too."""
    own = re.compile(rf"\.{re.escape(out.name)}\.tmp-(?:(\d+)-)?[a-z0-9_]{{8}}")
    found = [(p, own.fullmatch(p.name)) for p in out.parent.iterdir()]
    found = [(p, m[1]) for p, m in found if m and p.is_dir() and not p.is_symlink()]
    live = [p for p, pid in found if pid is not None and running(int(pid))]
    stale = [p for p, _ in found if p not in live]
    for path in stale:
        shutil.rmtree(path)
    if stale:
        names = ", ".join(p.name for p in stale)
        print(f"removed {len(stale)} temporary folder(s) of an interrupted export to {out}: {names}")
    if live:
        print(f"note: left {', '.join(p.name for p in live)}: an export to {out} still running writes it")
    return stale


def running(pid: int) -> bool:
    """Whether process `pid` runs on this machine (another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it runs, as another user
        pass
    return True


# ---------------------------------------------------------------- tensors


@dataclass(frozen=True)
class Entry:
    """One checkpoint tensor to export: its DCP key and the Hugging Face tensor(s) it becomes."""

    key: str  # "model.<fivecut name>" (or "moe.<layer>.expert_bias")
    shape: tuple[int, ...]  # global
    # a MoE class's entry is one Hugging Face tensor (`moe.Part`): a box of the checkpoint tensor
    # (one expert, a projection whose RoPE rows are interleaved, a routing bias), transformed
    map: TensorMap | moe.Part
    keep_fp32: bool = False  # routing biases: selection reads them in fp32
    adapter: tuple[str, str] | None = None  # [lora]: the DCP keys of its A and B, merged in (`merged`)

    def nbytes(self, dtype: torch.dtype) -> int:
        itemsize = 4 if self.keep_fp32 else dtype.itemsize
        return math.prod(self.map.sizes if isinstance(self.map, moe.Part) else self.shape) * itemsize


@dataclass(frozen=True)
class Plan:
    """What to write: the checkpoint, the class (None: fivecut's own names), the tensors in order."""

    path: Path
    arch: AnyArchitecture | None
    entries: list[Entry]
    dtype: torch.dtype
    max_bytes: int
    workers: int
    adapter_scale: float = 0.0  # [lora]: alpha / rank, what B A is scaled by when merged

    def shards(self) -> list[list[Entry]]:
        """The entries in order, cut into runs of at most `max_bytes` (a larger tensor alone), as
        Hugging Face does; the experts of one stacked tensor stay in one shard (a MoE class's
        entries are single experts: its shards cut between them)."""
        out: list[list[Entry]] = [[]]
        size = 0
        for entry in self.entries:
            nbytes = entry.nbytes(self.dtype)
            if out[-1] and size + nbytes > self.max_bytes and not fused_with(out[-1][-1], entry):
                out.append([])
                size = 0
            out[-1].append(entry)
            size += nbytes
        return out


def fused_with(before: Entry, entry: Entry) -> bool:
    """Whether `entry` is a later row block of the fused tensor `before` writes (one shard holds them all)."""
    maps = (before.map, entry.map)
    if all(isinstance(m, moe.Part) and m.interleave is not None for m in maps):  # GPT-OSS's gate_up_proj
        return maps[0].hf_name == maps[1].hf_name
    return all(isinstance(m, TensorMap) and m.rows for m in maps) and maps[0].theirs == maps[1].theirs


def export_entries(path: Path, args: ModelArgs, arch: AnyArchitecture | None, layered: bool = False) -> list[Entry]:
    """The checkpoint's tensors in export order, checked against the model's shapes (metadata only);
    a weight with adapters ([lora]) is written merged with them. `layered`: a [lora] run's
    checkpoint, which holds the trained tensors only (the rest come from its base, `read_layered`)."""
    saved = checkpoint_shapes(path)
    everything = {key.removeprefix("model."): shape for key, shape in saved.items() if key.startswith("model.")}
    weights = {name: shape for name, shape in everything.items() if not is_adapter(name)}
    if layered:
        weights = expected_shapes(args)
        saved = saved | {f"model.{name}": shape for name, shape in weights.items()}
    check_shapes(path, weights, expected_shapes(args))
    return [with_adapter(e, everything) for e in plain_entries(saved, weights, args, arch)]


def with_adapter(entry: Entry, names: dict[str, tuple[int, ...]]) -> Entry:
    """`entry` merged with its weight's adapters when the checkpoint holds them (a linear layer's
    `.lora_a`, `.lora_b`; an expert weight's `EXPERT_ADAPTERS`)."""
    base = entry.key.removeprefix("model.").removesuffix(".weight")
    holder, _, leaf = base.rpartition(".")
    if holder.endswith(".experts") and leaf in EXPERT_ADAPTERS:
        a, b = (f"{holder}.{name}" for name in EXPERT_ADAPTERS[leaf])
    else:
        a, b = f"{base}.lora_a", f"{base}.lora_b"
    if a not in names:
        return entry
    return dataclasses.replace(entry, adapter=(f"model.{a}", f"model.{b}"))


def plain_entries(saved: dict, weights: dict, args: ModelArgs, arch: AnyArchitecture | None) -> list[Entry]:
    if isinstance(arch, moe.Architecture):  # one entry per Hugging Face tensor (experts split, RoPE rows paired)
        parts = moe.export_parts(arch, args, saved)
        return [Entry(key, saved[key], part, keep_fp32=key.startswith("moe.")) for key, part in parts]
    if arch is not None:
        return [Entry(f"model.{m.ours}", weights[m.ours], m) for m in arch.tensors(args)]
    entries = [Entry(f"model.{name}", shape, TensorMap(name, (name,))) for name, shape in weights.items()]
    for key, shape in saved.items():  # "moe.<layer>.expert_bias": auxiliary-loss-free routing biases
        if key.startswith("moe.") and key.endswith(".expert_bias"):
            name = f"layers.{key.split('.')[1]}.feed_forward.expert_bias"
            entries.append(Entry(key, shape, TensorMap(name, (name,)), keep_fp32=True))
    return entries


def checkpoint_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """DCP key -> global shape of every tensor the checkpoint holds, from its metadata (no tensor read)."""
    saved = ckpt.dcp_metadata(path).state_dict_metadata
    return {key: tuple(e.size) for key, e in saved.items() if isinstance(e, TensorStorageMetadata)}


def own_names(args: ModelArgs) -> bool:
    """Whether the export keeps fivecut's tensor names and records ModelArgs: no registered Hugging
    Face class holds the model (mixture-of-experts layers, or multi-head latent attention)."""
    return for_args(args) is None


def check_shapes(path: Path, weights: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]]) -> None:
    if weights != expected:
        wrong = sorted(set(weights) ^ set(expected)) or [n for n in expected if weights[n] != expected[n]]
        raise CheckpointError(f"checkpoint {path} does not hold its model's tensors: {', '.join(wrong[:5])}")


def read_entries(path: Path, entries: list[Entry]) -> dict[str, torch.Tensor]:
    """The global values of these entries' tensors only, read from the DCP checkpoint in this process."""
    state = {e.key: torch.empty(e.shape, dtype=torch.float32) for e in entries}
    with warnings.catch_warnings():  # DCP warns that no_dist means one process: that is the point here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        planner = DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
        dcp.load(state, storage_reader=ckpt.SafeReader(path), planner=planner, no_dist=True)
    return state


def read_boxes(path: Path, entries: list[Entry]) -> list[torch.Tensor]:
    """The boxes of these MoE entries (`moe.Part`) of their checkpoint tensors, in order, read from
    DCP in this process (only the saved chunks each box overlaps)."""
    views = [torch.empty(e.map.sizes, dtype=torch.float32) for e in entries]
    table: ckpt.Table = {}
    for entry, view in zip(entries, views):
        table.setdefault(entry.key, ckpt.Entry(entry.shape, torch.float32, [])).chunks.append(
            ckpt.Chunk(entry.map.offsets, view)
        )
    if table:
        with warnings.catch_warnings():  # DCP warns that no_dist means one process: that is the point here
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            planner = ckpt.TableLoadPlanner(table, path)
            dcp.load({}, storage_reader=ckpt.SafeReader(path), planner=planner, no_dist=True)
    return views


def hf_tensors(entry: Entry, value: torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One checkpoint tensor as its Hugging Face tensor(s): split over experts, transposed, cast."""
    if isinstance(entry.map, TensorMap) and entry.map.offset:  # Gemma's norms store w of their (1 + w), in fp32
        value = value.float() - entry.map.offset
    value = value if entry.keep_fp32 else value.to(dtype)
    if isinstance(entry.map, moe.Part):  # `value` is the part's box
        return {entry.map.hf_name: entry.map.transform(value).contiguous()}
    parts = value.unbind(0) if entry.map.stacked else (value,)
    if entry.map.transposed:
        parts = tuple(p.transpose(-1, -2) for p in parts)
    return {name: p.contiguous() for name, p in zip(entry.map.theirs, parts, strict=True)}


def write_shard(
    path: Path, entries: list[Entry], dtype: torch.dtype, file: Path, scale: float, layered: bool
) -> dict[str, int]:
    """Read, convert and write one output shard (weights with adapters merged: W + `scale` B A;
    `layered`: a [lora] checkpoint over its base); returns its tensors' names and sizes in bytes."""
    from safetensors.torch import save_file

    if layered:
        values, boxes = read_layered(path, entries)
    else:
        whole = [e for e in entries if not isinstance(e.map, moe.Part)]
        values = read_entries(path, whole) if whole else {}
        boxes = read_boxes(path, [e for e in entries if isinstance(e.map, moe.Part)])
    adapters = adapter_values(path, entries)
    tensors: dict[str, torch.Tensor] = {}
    blocks: dict[str, list[torch.Tensor]] = {}  # a fused tensor's row blocks, in row order (Phi-3's qkv_proj)
    pairs: dict[str, dict[int, torch.Tensor]] = {}  # an interleaved tensor's halves, by place (GPT-OSS's gate_up_proj)
    for entry in entries:
        value = boxes.pop(0) if isinstance(entry.map, moe.Part) else values.pop(entry.key)
        if entry.adapter is not None:
            value = merged(entry, value, *(adapters[k] for k in entry.adapter), scale)
        if isinstance(entry.map, TensorMap) and entry.map.rows:
            blocks.setdefault(entry.map.theirs[0], []).append(value.to(dtype))
        elif isinstance(entry.map, moe.Part) and entry.map.interleave is not None:
            pairs.setdefault(entry.map.hf_name, {})[entry.map.interleave] = value.to(dtype)
        else:
            tensors |= hf_tensors(entry, value, dtype)
    tensors |= {name: torch.cat(parts) for name, parts in blocks.items()}  # [total rows, in]
    tensors |= {name: torch.stack([two[0], two[1]], -1).flatten(-2) for name, two in pairs.items()}  # [.., 2 * width]
    save_file(tensors, str(file), metadata={"format": "pt"})
    return {name: t.numel() * t.element_size() for name, t in tensors.items()}


def read_layered(path: Path, entries: list[Entry]) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
    """`read_entries` and `read_boxes` of a [lora] checkpoint: each tensor from the checkpoint where
    it holds it, else from the model its run started from (`fivecut.weights.load.LayeredSource`)."""
    source = open_source(f"dcp:{path}")
    whole, boxes = {}, []
    for e in entries:
        name = e.key.removeprefix("model.")
        if isinstance(e.map, moe.Part):
            if e.key.startswith("moe."):  # a routing bias: the checkpoint's own
                boxes += read_boxes(path, [e])
            else:
                boxes.append(source.read(name, tuple(slice(o, o + n) for o, n in zip(e.map.offsets, e.map.sizes))))
        else:
            whole[e.key] = source.read(name, tuple(slice(0, n) for n in e.shape))
    return whole, boxes


def adapter_values(path: Path, entries: list[Entry]) -> dict[str, torch.Tensor]:
    """The A and B of the adapters these entries merge, read from DCP (small: [r, in], [out, r])."""
    keys = {k: None for e in entries if e.adapter is not None for k in e.adapter}
    if not keys:
        return {}
    shapes = checkpoint_shapes(path)
    return read_entries(path, [Entry(k, shapes[k], TensorMap(k, (k,))) for k in keys])


def merged(entry: Entry, value: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """`value` (the weight, or the box of it a MoE class's part holds) + its adapters' update over
    the same box: scale B A for a linear layer, scale A_e B_e for each expert of a stack."""
    if a.dim() == 3:  # experts [E, in, out]: A [E, in, r], B [E, r, out]; a part is a run of whole experts
        if isinstance(entry.map, moe.Part):
            first, n = entry.map.offsets[0], entry.map.sizes[0]
            a, b = a[first : first + n], b[first : first + n]
        return value + scale * (a @ b)  # [E, in, out]
    if isinstance(entry.map, moe.Part):  # a box [rows, columns] of the [out, in] weight
        (r0, c0), (nr, nc) = entry.map.offsets, entry.map.sizes
        b, a = b[r0 : r0 + nr], a[:, c0 : c0 + nc]
    return value + scale * (b @ a)  # [out, r] @ [r, in]


def write_shards(
    path: Path, jobs: list[tuple[list[Entry], Path]], dtype: torch.dtype, scale: float = 0.0
) -> list[dict[str, int]]:
    """One worker's shards, in order (a process of `write_weights`'s pool, or the caller itself)."""
    torch.set_num_threads(1)
    return [write_shard(path, entries, dtype, file, scale, scale > 0) for entries, file in jobs]


def write_weights(folder: Path, plan: Plan) -> list[str]:
    """Every shard of `plan` into `folder` (the index too when there are several); their file names.
    Worker w writes shards w, w + workers, ...; each reads only its shards' tensors from DCP."""
    parts = plan.shards()
    if len(parts) == 1:
        files = [SAFETENSORS]
    else:
        files = [f"model-{k:05d}-of-{len(parts):05d}.safetensors" for k in range(1, len(parts) + 1)]
    jobs = [(entries, folder / file) for entries, file in zip(parts, files)]
    workers = worker_count(plan.workers, len(jobs))
    scale = plan.adapter_scale
    if workers == 1:
        sizes = write_shards(plan.path, jobs, plan.dtype, scale)
    else:
        context = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context) as pool:
            done = [pool.submit(write_shards, plan.path, jobs[w::workers], plan.dtype, scale) for w in range(workers)]
            per_worker = [future.result() for future in done]
        sizes = [per_worker[k % workers][k // workers] for k in range(len(jobs))]
    if len(parts) == 1:
        return files
    weight_map = {name: file for file, shard in zip(files, sizes) for name in shard}
    total = sum(n for shard in sizes for n in shard.values())
    write_json(folder / INDEX, {"metadata": {"total_size": total}, "weight_map": weight_map})
    return [*files, INDEX]


def worker_count(asked: int, shards: int) -> int:
    """--workers bounded by the shards to write and by this machine's cores (said when lowered)."""
    cores = os.cpu_count() or 1
    workers = min(asked, shards, cores)
    if workers < asked:
        print(f"note: --workers {asked} lowered to {workers} ({shards} shard(s) to write, {cores} cores here)")
    return workers


# ---------------------------------------------------------------- configs


def write_folder(folder: Path, args: ModelArgs, dtype: str, plan: Plan, tokenizer) -> list[str]:
    """Every file of the export of a model of shape `args` (weights as `plan` says, in `dtype`) into `folder`."""
    bos, eos = special_ids(tokenizer)
    if plan.arch is None:
        config = moe_config(args, dtype, bos, eos)
    else:  # transformers >= 5 reads "dtype", older ones "torch_dtype"
        config = hf_config(plan.arch, args, dtype, bos, eos) | {"dtype": dtype}
    tokenizer_files = write_tokenizer(folder, tokenizer, args.max_seq_len) if tokenizer is not None else []
    if tokenizer is None:  # a converted checkpoint (`fivecut convert`) whose source had no tokenizer files
        print("note: the checkpoint holds no tokenizer (its source had none); no tokenizer files written")
    elif not tokenizer_files:  # e.g. the byte tokenizer: named, so that an import of the folder finds it again
        config["fivecut_tokenizer"] = tokenizer.name
    write_json(folder / "config.json", config)
    write_json(folder / "generation_config.json", {"bos_token_id": bos, "eos_token_id": eos})
    weights = write_weights(folder, plan)
    return ["config.json", "generation_config.json", *weights, *tokenizer_files]


def moe_config(args: ModelArgs, dtype: str, bos: int | None, eos: int | None) -> dict:
    return {
        "architectures": [MOE_ARCHITECTURE],
        "model_type": "fivecut",
        "note": "a fivecut model (mixture of experts or latent attention): no Hugging Face class reads it; the "
        "tensor names are "
        "fivecut's own (see docs/models.md, 'Weights in and out', and fivecut/weights/export.py)",
        "fivecut": dataclasses.asdict(args),
        "vocab_size": args.vocab_size,
        "tie_word_embeddings": args.tie_embeddings,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "torch_dtype": dtype,
        "dtype": dtype,
    }


def export_class(args: ModelArgs, named: str | None, meta: dict) -> AnyArchitecture | None:
    """The class to write: `named` (--architecture), else the class the model was imported from
    when it holds the shape (a Mistral goes back out a Mistral, though Llama holds it too), else the
    first that holds it (`for_args`; None: fivecut's own format)."""
    try:
        if named is not None:
            return for_args(args, named)
        origin, where = imported_class(meta)
        if origin in ARCHITECTURES and ARCHITECTURES[origin].holds(args) is None:
            return ARCHITECTURES[origin]
        chosen = for_args(args)
    except ArchitectureError as err:
        raise ExportError(str(err)) from None
    if where and chosen is not None and origin != chosen.hf_class:
        print(f"note: {where}; exported as {chosen.hf_class}, the first class that holds the model")
    return chosen


def imported_class(meta: dict, depth: int = 4) -> tuple[str | None, str | None]:
    """(the Hugging Face class a checkpoint's model was imported from, or None; why it is not used,
    when it was imported but its class cannot be used). The class is the checkpoint's own record
    (`source_class`, written by `fivecut convert`), else its run's model.init_from: the class its
    config.json names (hf:FOLDER), or the class of that checkpoint (dcp:CHECKPOINT)."""
    if meta.get("source_class"):
        return meta["source_class"], f"it was imported from {meta['source_class']}, which cannot hold it"
    init_from = meta.get("config", {}).get("model", {}).get("init_from") or ""
    scheme, _, rest = init_from.partition(":")
    try:
        if scheme == "hf":
            config = read_config(resolve_path(rest))
            origin = (config.get("architectures") or [None])[0]
            return origin, f"model.init_from {init_from!r} is a {origin}, which cannot hold it"
        if scheme == "dcp" and depth > 0:
            return imported_class(ckpt.read_meta(ckpt.find_checkpoint(resolve_path(rest), None)), depth - 1)
    except (WeightsError, CheckpointError, OSError, ImportError) as err:
        return None, f"the class of model.init_from {init_from!r} is unknown ({err}); give --architecture to choose"
    return None, None


def with_routing_biases(path: Path, args: ModelArgs, arch: AnyArchitecture | None, named: bool):
    """`arch`, unless routing biases that balancing moved (moe.bias_update_rate) are in the checkpoint
    and the class has none to hold them (Mixtral, Qwen3-MoE): they change which experts a token
    picks, so such a model is exported as fivecut's own (refused when the class was named)."""
    if arch is None:
        if args.is_moe:  # why each MoE class does not hold it, for a user who expected one
            moes = [a for a in ARCHITECTURES.values() if isinstance(a, moe.Architecture)]
            reasons = "; ".join(f"{a.hf_class}: {a.holds(args)}" for a in moes)
            print(f"note: no Hugging Face MoE class holds this model ({reasons}); fivecut's own names are written")
        return None
    if not isinstance(arch, moe.Architecture) or arch.buffers(args):
        return arch
    biases = ckpt.full_state(path, "moe.")  # "<layer>.expert_bias", [E] each; every file checked against its sha256
    if not any(bool(b.any()) for b in biases.values()):
        return arch
    why = f"routing biases are not zero (auxiliary-loss-free balancing); {arch.hf_class} has none"
    if named:
        raise ExportError(f"--architecture {arch.hf_class} cannot hold this model: {why}; leave --architecture out")
    print(f"note: {why}: exported as fivecut's own MoE model")
    return None


def write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n")


# ---------------------------------------------------------------- tokenizer


def run_tokenizer(config: dict):
    """The tokenizer the run trained with (`data.tokenizer` of its config, "auto": its imported model's)."""
    return resolve_tokenizer(config.get("data", {}).get("tokenizer", "byte"), config.get("model", {}).get("init_from"))


def special_ids(tokenizer) -> tuple[int | None, int | None]:
    """(bos, eos): GPT-2 uses its one special token for both; other tokenizers name only an end-of-text id."""
    if tokenizer is None:
        return None, None
    if isinstance(tokenizer, GPT2Tokenizer):
        return tokenizer.eot_id, tokenizer.eot_id
    return None, tokenizer.eot_id


def write_tokenizer(folder: Path, tokenizer, max_length: int | None = None) -> list[str]:
    """The Hugging Face files of `tokenizer` (a `fivecut.train.tokenizer.Tokenizer`) in `folder`; their names."""
    if isinstance(tokenizer, GPT2Tokenizer):
        (folder / "tokenizer.json").write_text(gpt2_tokenizer().to_str())
        special = dict.fromkeys(("bos_token", "eos_token", "unk_token"), GPT2_SPECIAL)
        return ["tokenizer.json", *tokenizer_configs(folder, "GPT2Tokenizer", special, max_length)]
    if isinstance(tokenizer, FileTokenizer):
        (folder / "tokenizer.json").write_text(tokenizer.json)
        eot = tokenizer.eot_id
        special = {"eos_token": tokenizer.tokenizer.id_to_token(eot)} if eot is not None else {}
        template = {"chat_template": tokenizer.chat_template} if tokenizer.chat_template else {}
        return ["tokenizer.json", *tokenizer_configs(folder, "PreTrainedTokenizerFast", special, max_length, template)]
    if tokenizer.name == "byte":
        print("note: the byte-level model has no Hugging Face tokenizer (its ids are UTF-8 bytes); none written")
    else:
        print(f"note: tokenizer {tokenizer.name!r} has no Hugging Face form here; no tokenizer files written")
    return []


def tokenizer_configs(
    folder: Path, cls: str, special: dict[str, str], max_length: int | None, extra: dict | None = None
) -> list[str]:
    config = {"tokenizer_class": cls, **special, "add_bos_token": False, "clean_up_tokenization_spaces": False}
    config |= extra or {}
    if max_length is not None:
        config["model_max_length"] = max_length
    write_json(folder / "tokenizer_config.json", config)
    write_json(folder / "special_tokens_map.json", special)
    return ["tokenizer_config.json", "special_tokens_map.json"]


def gpt2_tokenizer():
    """GPT-2's byte-level BPE as a `tokenizers.Tokenizer`, built from the published encoder.json and vocab.bpe."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    vocab_bpe, encoder_json = gpt2_files()
    vocab = json.loads(encoder_json.read_text(encoding="utf-8"))
    lines = vocab_bpe.read_text(encoding="utf-8").splitlines()[1:]  # the first line is a version comment
    merges = [tuple(line.split()) for line in lines if line.strip()]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens([AddedToken(GPT2_SPECIAL, special=True)])
    return tok
