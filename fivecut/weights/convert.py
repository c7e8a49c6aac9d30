"""`fivecut convert`: a model from one format to another, never whole in one process.

    fivecut convert --from hf:FOLDER --to ckpt --layout tp=2,pp=2     # or --from gguf:FILE
        A published model as a fivecut checkpoint (`ckpt/step-00000000`, weights only). The
        layout's ranks -- spawned here, or torchrun's when run under it -- each build their part
        on the meta device, read only the slices their placement records hold, and write them with
        DCP, all in parallel: a rank holds its share of the model, not the model. A run then
        starts from it with `model.init_from = "dcp:ckpt"` under any layout (DCP reads each
        rank's chunks from whichever were saved), so a cluster job never has every rank open every
        safetensors file.
    fivecut convert --from dcp:ckpt --to hf:OUT [--architecture C --dtype D --max-shard-size S --workers N]
        A fivecut checkpoint (a training run's, or one converted as above) as a Hugging Face
        folder: `fivecut export`, shard by shard, each of the N processes reading only the
        tensors of its own shards.

The --to folder must not exist or be empty: nothing is overwritten.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch.distributed as dist

from fivecut.config import Config, model_label
from fivecut.mesh import Mesh
from fivecut.parallel.parallelize import build_parallel
from fivecut.train import checkpoint as ckpt
from fivecut.train.tokenizer import TOKENIZERS
from fivecut.weights.export import ExportError, check_out, export, write_tokenizer
from fivecut.weights.load import load_routing_biases, model_args, source_of

PUBLISHED = ("hf:", "gguf:")  # what --from may name to make a checkpoint
CHECKPOINT = "dcp:"


@dataclasses.dataclass(frozen=True)
class Conversion:
    """What `--from` and `--to` name: a published model into a checkpoint folder, or back."""

    source: str  # hf:FOLDER, gguf:FILE or dcp:CHECKPOINT
    out: Path  # the folder to write (without its scheme)

    @property
    def to_checkpoint(self) -> bool:
        return self.source.startswith(PUBLISHED)


def conversion(source: str, to: str) -> Conversion:
    """The pair `--from source --to to`, refused in one line unless it is published -> DCP or DCP -> hf."""
    if source.startswith(PUBLISHED):
        if to.startswith(PUBLISHED):
            raise ExportError(f"--to {to}: a published model converts to a fivecut checkpoint; give --to a folder")
        out = Path(to.removeprefix(CHECKPOINT)).expanduser()
    elif source.startswith(CHECKPOINT):
        if not to.startswith("hf:"):
            raise ExportError(f"--to {to}: a checkpoint converts to a Hugging Face folder; write --to hf:FOLDER")
        out = Path(to.removeprefix("hf:")).expanduser()
    else:
        raise ExportError(f"--from {source}: give hf:FOLDER, gguf:FILE (to a checkpoint) or dcp:CHECKPOINT (to hf:)")
    check_out(out, f"--to {to}")
    return Conversion(source, out)


def to_hugging_face(c: Conversion, max_shard_bytes: int, dtype: str, architecture: str | None, workers: int) -> Path:
    """DCP -> Hugging Face: `fivecut export` of the checkpoint."""
    checkpoint = Path(c.source.removeprefix(CHECKPOINT)).expanduser()
    return export(checkpoint, c.out, None, max_shard_bytes, dtype, architecture, workers)


def convert_rank(cfg: Config, out: Path) -> tuple[int, int]:
    """One rank of published -> DCP: its part of the model from the file, written into `out` as step
    0 (weights and routing biases; rank 0 adds the tokenizer's files, or the config names it: byte,
    gpt2); (elements it holds, its rank)."""
    args = model_args(cfg.model)
    source = source_of(cfg.model.init_from)
    mesh = Mesh(cfg.parallel, "cpu", moe=args.is_moe)
    par = build_parallel(args, mesh, "cpu", cfg.train.seed, cfg.train, cfg.moe, source)
    load_routing_biases(par, source)
    tokenizer = source.tokenizer()
    if tokenizer is not None and tokenizer.name in TOKENIZERS:  # a named one (byte, gpt2): no files to copy
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, tokenizer=tokenizer.name))
    meta = {
        "weights_only": True,
        "layout": cfg.parallel.describe(),
        "world_size": dist.get_world_size(),
        "tokens": 0,
        "preset": model_label(cfg.model),
        "source_class": getattr(getattr(source, "architecture", None), "hf_class", None),  # export writes it back
        "model": dataclasses.asdict(args),
        "config": cfg.to_dict(),
    }
    path = ckpt.save(out, 0, par, None, meta, keep=1)
    if dist.get_rank() == 0 and tokenizer is not None and tokenizer.name not in TOKENIZERS:
        write_tokenizer(path, tokenizer, args.max_seq_len)
    dist.barrier()
    return sum(pl.local_numel() for pl in par.placements.values()), dist.get_rank()
