"""`fivecut train | verify | ledger`: the commands a user runs."""

from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile
from pathlib import Path

from fivecut.config import Config, ConfigError, ModelConfig, apply_table, load_config, model_args, parse_override
from fivecut.ledger import format_rows
from fivecut.mesh import LayoutError, ParallelDims

LOSS_RTOL = 1e-5  # verify's tolerance on the relative loss difference (fp32); see DESIGN.md


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    try:
        return ns.func(ns)
    except (ConfigError, LayoutError, ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fivecut", description="Train transformer LMs cut five ways.")
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train a model (one process, or under torchrun)")
    train.add_argument("--config", help="TOML file; defaults apply to missing keys")
    add_overrides(train)
    train.set_defaults(func=cmd_train)

    verify = sub.add_parser("verify", help="compare a layout's losses with a single-process run")
    add_layout_arguments(verify, steps=10)
    verify.add_argument("--rtol", type=float, default=LOSS_RTOL, help="largest relative loss difference accepted")
    verify.set_defaults(func=cmd_verify)

    ledger = sub.add_parser("ledger", help="one step under a layout: communication measured vs predicted")
    add_layout_arguments(ledger, steps=1)
    ledger.set_defaults(func=cmd_ledger)
    return parser


def add_overrides(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")


def add_layout_arguments(parser: argparse.ArgumentParser, steps: int) -> None:
    parser.add_argument("--layout", required=True, help="e.g. dp=2 or dp=2,zero=1; keys are parallel.* fields")
    parser.add_argument("--model", default="tiny", help="model preset (tiny, tiny-moe, tiny-gpt2, small)")
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds before a hung run is reported")
    add_overrides(parser)


# ---------------------------------------------------------------- train


def cmd_train(ns) -> int:
    from fivecut.launch import init_from_environment
    from fivecut.train.trainer import train, validate

    cfg = load_config(ns.config, ns.overrides)
    validate(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    init_from_environment()
    import torch.distributed as dist

    try:
        train(cfg)
    finally:
        dist.destroy_process_group()
    return 0


# ---------------------------------------------------------------- verify / ledger


def parse_layout(text: str) -> ParallelDims:
    """`dp=2,zero=1,sp=true` -> ParallelDims, each key checked like a config key."""
    table = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, value = parse_override(item)
        table[key] = value
    holder = Config()
    apply_table(holder, {"parallel": table}, origin=f"--layout {text}")
    return holder.parallel


def layout_config(ns) -> Config:
    """A small, quiet run of `ns.model` on Shakespeare, under the layout of `ns.layout`."""
    args = model_args(ModelConfig(preset=ns.model))
    tokenizer = "byte" if args.vocab_size <= 256 else "gpt2"
    base = [
        f"model.preset={ns.model!r}",
        f"data.tokenizer={tokenizer!r}",
        f"train.steps={ns.steps}",
        "train.seq_len=64",
        "train.global_batch=8",
        "train.warmup=2",
        "train.eval_every=0",
        "log.progress=false",
        "log.plot=false",
    ]
    cfg = load_config(None, [o.replace("'", '"') for o in base] + ns.overrides)
    cfg.parallel = parse_layout(ns.layout)
    from fivecut.train.trainer import validate

    validate(cfg, cfg.parallel.world_size)
    return cfg


def reference_of(cfg: Config) -> Config:
    ref = copy.deepcopy(cfg)
    ref.parallel = ParallelDims()
    return ref


def run_spawned(cfg: Config, timeout: float, measure_activations: bool = False):
    """Tokenize once here, then run `cfg` on its own ranks; returns every rank's RunResult."""
    from fivecut.launch import spawn
    from fivecut.train.data import load_tokens

    load_tokens(cfg.data.source, cfg.data.tokenizer, Path(cfg.data.cache_dir).expanduser(), cfg.data.val_fraction)
    with tempfile.TemporaryDirectory(prefix="fivecut-run-") as out:
        cfg = copy.deepcopy(cfg)
        cfg.log.out_dir = out
        return spawn(train_quietly, cfg.parallel.world_size, cfg, measure_activations, timeout_s=timeout)


def train_quietly(cfg: Config, measure_activations: bool = False):
    from fivecut.train.trainer import train

    return train(cfg, quiet=True, measure_activations=measure_activations)


def cmd_verify(ns) -> int:
    cfg = layout_config(ns)
    print(f"verify: {cfg.model.preset}, layout {cfg.parallel.describe()} vs single process, {cfg.train.steps} steps, fp32")
    reference = run_spawned(reference_of(cfg), ns.timeout)[0].losses
    layout = run_spawned(cfg, ns.timeout)[0].losses
    print(f"{'step':>4} {'single':>12} {'layout':>12} {'rel diff':>10}")
    worst = 0.0
    for step, (a, b) in enumerate(zip(reference, layout), start=1):
        rel = abs(a - b) / abs(a)
        worst = max(worst, rel)
        print(f"{step:>4} {a:>12.7f} {b:>12.7f} {rel:>10.2e}")
    if len(reference) != len(layout) or worst > ns.rtol:
        print(f"FAIL max_rel_loss_diff={worst:.3e} (tolerance {ns.rtol:g})")
        return 1
    print(f"PASS max_rel_loss_diff={worst:.3e}")
    return 0


def print_memory(measured: dict[str, int], cfg: Config) -> None:
    from fivecut.plan.memory import formula, model_state_bytes
    from fivecut.train.memory import format_bytes

    from fivecut.plan.volume import meta_model, meta_params

    dims = cfg.parallel
    n = dims.dp * dims.cp
    psi = sum(p.numel() for p in meta_params(meta_model(model_args(cfg.model), dims.tp, dims.sp)))
    predicted = model_state_bytes(psi, dims.zero, n)
    print(f"\nmodel-state memory per rank (ZeRO-{dims.zero}: {formula(dims.zero)}, n={n}, Psi={psi:,} on this rank)")
    print(f"{'':<10} {'measured':>12} {'predicted':>12}")
    for key in ("params", "grads", "optimizer", "total"):
        print(f"{key:<10} {format_bytes(measured[key]):>12} {format_bytes(predicted[key]):>12}")
    print(f"memory_ratio={measured['total'] / predicted['total']:.3f}")


def print_activations(measured: dict[str, int], cfg: Config) -> None:
    """Bytes a layer keeps for backward (step 1, first micro-step), measured vs the formula."""
    from fivecut.plan.activations import activation_bytes_per_layer
    from fivecut.train.memory import format_bytes

    args, dims, t = model_args(cfg.model), cfg.parallel, cfg.train
    rows = t.global_batch // (dims.dp * t.accumulate)
    last = measured[str(args.n_layers - 1)]  # layer 0 also holds what all layers share (RoPE tables)
    predicted = activation_bytes_per_layer(args, rows, t.seq_len, dims.tp, dims.sp)
    print(f"\nactivations saved for backward per layer (b={rows}, s={t.seq_len}, tp={dims.tp}, sp={dims.sp}):")
    print(f"measured {format_bytes(last)} ({last:,} B), predicted {format_bytes(predicted)} ({predicted:,.0f} B)")
    if dims.tp > 1:
        without, single = (activation_bytes_per_layer(args, rows, t.seq_len, dims.tp, sp) for sp in (False, True))
        print(f"at tp={dims.tp} the formula gives {format_bytes(without)} without SP, {format_bytes(single)} with SP: "
              f"SP cuts activations by {without / single:.3f}x")
    print(f"activation_ratio={last / predicted:.3f}")


def cmd_ledger(ns) -> int:
    from fivecut.plan.volume import predict

    cfg = layout_config(ns)
    results = run_spawned(cfg, ns.timeout, measure_activations=True)
    mine = results[0]
    print(f"ledger: {cfg.model.preset}, layout {cfg.parallel.describe()}, step {cfg.train.steps}, rank 0")
    print(format_rows(mine.ledger_rows))
    print()
    print_memory(mine.memory, cfg)
    print_activations(mine.activations, cfg)
    predicted = predict(model_args(cfg.model), cfg)
    measured_total = predicted_total = 0.0
    print(f"\n{'cut':<8} {'measured':>16} {'predicted':>16} {'ratio':>7}   formula")
    for cut, (volume, formula) in predicted.items():
        measured = sum(r.wire_bytes for r in mine.ledger_rows if r.cut == cut)
        measured_total += measured
        predicted_total += volume
        print(f"{cut:<8} {measured:>16,.0f} {volume:>16,.0f} {measured / volume if volume else float('nan'):>7.3f}   {formula}")
    unpredicted = {r.cut for r in mine.ledger_rows} - set(predicted)
    if unpredicted:
        print(f"no closed form for: {', '.join(sorted(unpredicted))}")
    print(f"ratio={measured_total / predicted_total:.3f}" if predicted_total else "ratio=nan (nothing predicted)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
