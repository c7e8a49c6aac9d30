"""Peak resident memory of importing a Hugging Face model (`model.init_from = "hf:DIR"`) per rank,
under one process, tp=2 and pp=2, against each rank's share of the weights.

A random Qwen2-shaped model (q/k/v biases; no transformers needed: the folder is written with
safetensors from the registry's names) of about --params parameters is saved in shards; then each
layout's ranks build their part (`build_parallel` with the folder as its weights: on the meta
device until the cuts are made, then each rank's part alone is given storage and read from the
files, box by box). Each rank reports its peak resident set (ru_maxrss) above what it held before
building, next to its share of the fp32 weights (the elements its placement records hold x 4 B).
For scale, the last rows load the whole folder in one process with `safetensors.torch.load_file`
(what a rank that does not cut before reading holds).

    python benchmarks/import_memory.py                       # ~100M parameters
    python benchmarks/import_memory.py --params 2e6          # the smoke size
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from fivecut.config import TrainConfig  # noqa: E402
from fivecut.launch import spawn  # noqa: E402
from fivecut.layout import ParallelDims  # noqa: E402
from fivecut.mesh import Mesh  # noqa: E402
from fivecut.model.args import ModelArgs  # noqa: E402
from fivecut.parallel.parallelize import build_parallel  # noqa: E402
from fivecut.weights.architectures import QWEN2  # noqa: E402
from fivecut.weights.load import source_of  # noqa: E402
from fivecut.weights.source import expected_shapes  # noqa: E402

LAYOUTS = {"one process": ParallelDims(), "tp=2": ParallelDims(tp=2), "pp=2": ParallelDims(pp=2, microbatches=2)}


def shape(params: float) -> ModelArgs:
    """A Qwen2-like shape of about `params` parameters: width 512 (or 1024 past 50M), 8 layers."""
    dim = 1024 if params > 5e7 else 256
    per_layer = 4 * dim * dim + 3 * dim * 3 * dim  # attention (q, k, v, o) + SwiGLU of 3 x dim
    vocab = max(int((params - 8 * per_layer) / (2 * dim)), 512)
    return ModelArgs(vocab_size=vocab, dim=dim, n_layers=8, n_heads=8, n_kv_heads=8, ffn_dim=3 * dim, qkv_bias=True)


def write_folder(folder: Path, args: ModelArgs) -> None:
    import json

    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(QWEN2.to_config(args) | {"fivecut_tokenizer": "byte"}))
    shapes, g = expected_shapes(args), torch.Generator().manual_seed(0)
    weight_map, part, k = {}, {}, 0
    maps = QWEN2.tensors(args)
    for i, m in enumerate(maps):
        part[m.theirs[0]] = torch.randn(shapes[m.ours], generator=g) * 0.02
        if sum(t.numel() for t in part.values()) * 4 > 100e6 or i == len(maps) - 1:
            file = f"model-{k:05d}.safetensors"
            save_file(part, str(folder / file))
            weight_map |= dict.fromkeys(part, file)
            part, k = {}, k + 1
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def status_mib(field: str) -> float:
    """A field of /proc/self/status in MiB (VmRSS: resident now; VmHWM: the peak since the reset)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024  # kB
    raise RuntimeError(f"/proc/self/status has no {field}")


def start_peak() -> float:
    """Reset this process's resident peak to what it holds now (Linux: clear_refs 5); returns that."""
    Path("/proc/self/clear_refs").write_text("5")
    return status_mib("VmRSS")


def import_rank(folder: Path, dims: ParallelDims) -> tuple[float, float, float]:
    """(peak MiB above the start, this rank's share of the weights in MiB, what the built rank
    holds in MiB: its parameters and the gradient buffers the data cut allocates) of building its
    part from the folder."""
    source = source_of(f"hf:{folder}")
    before = start_peak()
    par = build_parallel(source.args, Mesh(dims, "cpu"), "cpu", 0, TrainConfig(), weights=source)
    share = sum(pl.local_numel() for pl in par.placements.values()) * 4 / 2**20
    params, grads = par.state_tensors()
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in params + grads if t is not None}
    return status_mib("VmHWM") - before, share, sum(storages.values()) / 2**20


def load_whole(folder: Path) -> float:
    """Peak MiB above the start of loading every shard of `folder` whole (each tensor read once:
    load_file's tensors may be backed by the file's map until touched)."""
    from safetensors.torch import load_file

    before = start_peak()
    tensors = {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}
    assert all(torch.isfinite(t).all() for t in tensors.values())
    return status_mib("VmHWM") - before


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params", type=float, default=1e8)
    ns = p.parse_args(argv)
    args = shape(ns.params)
    whole = args.num_params() * 4 / 2**20
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "qwen2"
        write_folder(folder, args)
        print(f"import of a Qwen2-shaped model of {args.num_params():,} parameters ({whole:.0f} MiB fp32)")
        print(
            "| layout | rank | peak above start, MiB | its weights, MiB | it holds built, MiB | peak - held | "
            "peak / whole model |"
        )
        print("|---|---|---:|---:|---:|---:|---:|")
        for name, dims in LAYOUTS.items():
            for rank, (peak, share, held) in enumerate(spawn(import_rank, dims.world_size, folder, dims)):
                print(
                    f"| {name} | {rank} | {peak:.0f} | {share:.0f} | {held:.0f} | {peak - held:.0f} | "
                    f"{peak / whole:.2f} |"
                )
        peak = spawn(load_whole, 1, folder)[0]
        print(f"| safetensors load_file, every shard | 0 | {peak:.0f} | {whole:.0f} | | | {peak / whole:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
