"""Peak memory of `fivecut export` of a DeepSeek-V3-shaped MoE checkpoint: shard by shard vs the whole model.

    python benchmarks/hf_moe_export.py [--dim 512] [--layers 4] [--experts 32] [--vocab 32000]
                                       [--shard-mb 20] [--dir /tmp]

A model of DeepseekV3ForCausalLM's shape (latent attention, sigmoid routing in 4 groups of which 2
are chosen, one shared expert, a first dense layer) is trained one step on one spawned rank, which
writes its DCP checkpoint (weights and AdamW moments). Then, each in a fresh process, the peak
resident memory (ru_maxrss) of:

    baseline   the imports the export needs (python, torch, safetensors, fivecut), nothing read
    whole      `fivecut.train.checkpoint.full_state`: every weight of the checkpoint in memory at
               once, what an export that gathers the model holds before it writes anything
    export     `fivecut.weights.export.export` to `DeepseekV3ForCausalLM` in shards of --shard-mb:
               each shard's boxes read from DCP, converted (experts one by one, RoPE rows paired),
               written, dropped

Memory above the baseline is the figure: the export's should be about its largest shard (or largest
single tensor, when one exceeds a shard) times a small factor (the boxes as read, the converted
tensors, safetensors' serialized bytes), whatever the model's size; the whole model's is the
model's fp32 bytes. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import resource
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import benchmark_parser, format_bytes, machine, markdown_table, parse_options  # noqa: E402

MODES = ("baseline", "whole", "export")


def model_fields(opts: dict) -> dict:
    dim = opts["dim"]
    return dict(
        vocab_size=opts["vocab"],
        dim=dim,
        n_layers=opts["layers"],
        n_heads=8,
        n_kv_heads=8,
        ffn_dim=2 * dim,
        norm_eps=1e-6,
        n_experts=opts["experts"],
        top_k=4,
        n_shared_experts=1,
        moe_ffn_dim=dim,
        first_dense_layers=1,
        gate='"sigmoid"',
        route_scale=2.5,
        expert_groups=4,
        route_group_limit=2,
        q_lora_rank=3 * dim // 8,
        kv_lora_rank=dim // 4,
        qk_nope_head_dim=dim // 16,
        qk_rope_head_dim=dim // 32,
        v_head_dim=dim // 16,
        max_seq_len=64,
    )


def train_one_step(opts: dict, root: str) -> None:
    """On a spawned rank: one step of the model, its checkpoint written to root/ck."""
    from fivecut.config import load_config
    from fivecut.train.trainer import train

    sets = [f"model.{k}={v}" for k, v in model_fields(opts).items()] + [
        'data.tokenizer="byte"',
        f'data.cache_dir="{root}/cache"',
        "train.steps=1",
        "train.warmup=1",
        "train.seq_len=16",
        "train.global_batch=2",
        "train.eval_every=0",
        "log.progress=false",
        "log.plot=false",
        f'checkpoint.dir="{root}/ck"',
        f'log.out_dir="{root}/out"',
    ]
    train(load_config(None, sets), quiet=True, resume="never")


def child(mode: str, root: Path, shard_bytes: int) -> None:
    """In a fresh process: one mode, then its peak resident bytes on the last line."""
    from fivecut.train import checkpoint as ckpt
    from fivecut.weights.export import export

    if mode == "whole":
        ckpt.full_state(ckpt.find_checkpoint(root / "ck", None))
    elif mode == "export":
        export(root / "ck", root / "hf", max_shard_bytes=shard_bytes)
    print(f"peak_bytes={resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}")


def measure(mode: str, root: Path, shard_bytes: int) -> int:
    argv = [sys.executable, __file__, "--child", mode, "--dir", str(root), "--shard-mb", str(shard_bytes / 1e6)]
    out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    return int(out.strip().splitlines()[-1].removeprefix("peak_bytes="))


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--shard-mb", type=float, default=20.0, help="the export's --max-shard-size, in 10^6 bytes")
    parser.add_argument("--dir", default=None, help="where the checkpoint and the export are written (a temp folder)")
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)  # one measurement, in its own process
    opts = parse_options(parser)
    shard_bytes = int(opts["shard_mb"] * 1e6)
    if opts["child"]:
        return child(opts["child"], Path(opts["dir"]), shard_bytes)
    print(f"hf_moe_export {' '.join(sys.argv[1:])}".rstrip(), flush=True)
    root = Path(tempfile.mkdtemp(prefix="hf-moe-export-", dir=opts["dir"]))
    try:
        report(opts, root, shard_bytes)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def report(opts: dict, root: Path, shard_bytes: int) -> None:
    from fivecut.launch import spawn
    from fivecut.model.args import ModelArgs
    from fivecut.weights.architectures import for_args

    fields = {k: v.strip('"') if isinstance(v, str) else v for k, v in model_fields(opts).items()}
    args = ModelArgs(**fields).check()
    spawn(train_one_step, 1, opts, str(root))
    peaks = {mode: measure(mode, root, shard_bytes) for mode in MODES}
    model_bytes = args.num_params() * 4
    base = peaks["baseline"]
    rows = [
        [mode, format_bytes(peak), format_bytes(peak - base), f"{(peak - base) / model_bytes:.2f}"]
        for mode, peak in peaks.items()
    ]
    files = sorted(p.name for p in (root / "hf").glob("*.safetensors"))
    print(f"{machine()}")
    print(
        f"model: {args.num_params():,} parameters ({format_bytes(model_bytes)} fp32) as {for_args(args).hf_class}; "
        f"export in {len(files)} shards of at most {format_bytes(shard_bytes)}"
    )
    print(markdown_table(["process", "peak resident", "above baseline", "above baseline / model bytes"], rows))
    print(
        f"export_over_model={(peaks['export'] - base) / model_bytes:.2f} "
        f"whole_over_model={(peaks['whole'] - base) / model_bytes:.2f}"
    )


if __name__ == "__main__":
    main()
