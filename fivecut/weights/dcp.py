"""A fivecut checkpoint as a weight source: `model.init_from = "dcp:PATH"`.

PATH is a checkpoint (a `step-N` folder) or a checkpoint.dir (its newest complete one): what a
training run saved, or what `fivecut convert` wrote from a published model. A run that starts
from it takes the weights (and a MoE model's routing biases) only -- its optimizer starts fresh
at step 0, unlike a resume -- under any layout: each rank asks DCP for the chunks its own
placement records hold, in one load (`fill`), and DCP reads the overlapping parts of whichever
chunks were saved, so no rank reads the whole model.

    source = DCPSource(Path("ckpt/step-00000000"))
    source.fill([("layers.0.attention.wq.weight", (slice(0, 64), slice(None)), view)])  # view [64, dim]
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from fivecut.model.args import ModelArgs
from fivecut.train import checkpoint as ckpt
from fivecut.train.checkpoint import Chunk, Entry, TableLoadPlanner
from fivecut.train.tokenizer import AUTO_TOKENIZER, TOKENIZERS, get_tokenizer
from fivecut.weights.hf import folder_tokenizer
from fivecut.weights.source import Box, Request, WeightsError

WEIGHTS = "model."  # checkpoint keys of the parameters: model.<fivecut name>
BIASES = "moe."  # moe.<layer>.expert_bias: the routing biases, fivecut's layers.<layer>.feed_forward.expert_bias


class DCPSource:
    """The weights of a fivecut checkpoint, by fivecut name and global shape (`WeightSource`)."""

    def __init__(self, path: Path):
        try:
            self.path = ckpt.find_checkpoint(path, None)
            meta = ckpt.read_meta(self.path)
        except ckpt.CheckpointError as err:
            raise WeightsError(f"model.init_from dcp:{path}: {err}") from None
        if meta.get("version") != ckpt.VERSION:
            raise WeightsError(
                f"{self.path / ckpt.META}: format version {meta.get('version')}, this fivecut reads {ckpt.VERSION}"
            )
        damaged = [p for name, record in meta["files"].items() if (p := ckpt.size_problem(self.path, name, record))]
        if damaged:
            raise WeightsError(f"checkpoint {self.path} is damaged: " + "; ".join(damaged))
        self.meta = meta
        self.args = ModelArgs(**meta["model"])
        saved = ckpt.dcp_metadata(self.path).state_dict_metadata
        self.saved = {key: tuple(m.size) for key, m in saved.items() if isinstance(m, TensorStorageMetadata)}

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {key.removeprefix(WEIGHTS): shape for key, shape in self.saved.items() if key.startswith(WEIGHTS)}

    def buffer_shapes(self) -> dict[str, tuple[int, ...]]:
        return {
            bias_name(key): shape
            for key, shape in self.saved.items()
            if key.startswith(BIASES) and key.endswith(".expert_bias")
        }

    def read(self, name: str, box: Box) -> torch.Tensor:
        out = torch.empty([b.stop - b.start for b in box])
        self.fill([(name, box, out)])
        return out

    def fill(self, requests: list[Request]) -> None:
        """Every request in one DCP load, in this process alone (no process group: each rank reads
        its own chunks); the checkpoint holds fp32, the views take their own dtype."""
        table: dict[str, Entry] = {}
        for name, box, view in requests:
            key = checkpoint_key(name)
            entry = table.setdefault(key, Entry(self.saved[key], torch.float32, []))
            entry.chunks.append(Chunk(tuple(b.start for b in box), view))
        with warnings.catch_warnings():  # DCP warns that no_dist means one process: that is the point here
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            reader = ckpt.SafeReader(self.path)
            dcp.load({}, storage_reader=reader, planner=TableLoadPlanner(table, self.path), no_dist=True)

    def tokenizer(self):
        """The tokenizer files `fivecut convert` copied beside the weights; else the saving run's
        data.tokenizer where it names one (gpt2, byte); else None."""
        found = folder_tokenizer(self.path)
        if found is not None:
            return found
        name = self.meta.get("config", {}).get("data", {}).get("tokenizer")
        return get_tokenizer(name) if name in TOKENIZERS and name != AUTO_TOKENIZER else None


def checkpoint_key(name: str) -> str:
    """The checkpoint key of fivecut name `name` (a parameter, or a MoE layer's routing bias)."""
    if name.endswith(".feed_forward.expert_bias"):
        return f"{BIASES}{name.split('.')[1]}.expert_bias"
    return WEIGHTS + name


def bias_name(key: str) -> str:
    """fivecut's name of the routing bias at checkpoint key moe.<layer>.expert_bias."""
    return f"layers.{key.split('.')[1]}.feed_forward.expert_bias"
