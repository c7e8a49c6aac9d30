"""The parity matrix: `fivecut verify` over every pair of cuts, every schedule and CP mode, ZeRO 0-3 with
and without a pipeline, accumulation, dense and MoE models with each MoE option; writes docs/parity.md.

    PYTHONPATH=. python scripts/parity_matrix.py                 # every row -> docs/parity.md
    PYTHONPATH=. python scripts/parity_matrix.py --subset ci     # the rows CI runs (printed only)
    PYTHONPATH=. python scripts/parity_matrix.py --only tp2-sp cp2-ring --out /tmp/parity.md

Each row is verify's comparison, run through verify's own functions (`cli.verify_config`,
`cli.reference_of`, `cli.run_spawned`, `cli.TOLERANCES`): the layout's run against a single process
from the same seed in fp32, loss at every step, gradient norm, validation loss at the last step,
under verify's tolerances. Rows that share a single-process reference (same model, options and
steps) run it once. A row whose option is not on this commit (a layout key that `ParallelDims`
lacks, or a CP mode it does not know) stays in the table as pending and runs as soon as its
option lands. The rows are data: `ROWS` below.
"""

from __future__ import annotations

import argparse
import io
import subprocess
import sys
import time
import tomllib
from contextlib import redirect_stdout
from dataclasses import dataclass, fields
from itertools import combinations
from pathlib import Path
from types import SimpleNamespace

from fivecut import checks, cli
from fivecut.config import ConfigError, load_config, parse_override, preset_args
from fivecut.layout import CP_MODES, ParallelDims, spelled

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "parity.md"
CUTS = ("dp", "tp", "pp", "cp", "ep", "zero")  # every pair of these is a row
SCHEDULES = checks.PP_SCHEDULES
ALL_CP_MODES = ("ring", "ulysses", "usp")  # usp: cp_mode="usp" with cp_ulysses (issue 18)
MOE_OPTIONS = (
    "capacity",
    "aux_loss",
    "aux_free",
    "eplb_slots",
    "eplb_move",
    "sigmoid",
    "group_limited",
    "shared_experts",
    "first_dense_layers",
)
TIMEOUT_S = 300.0  # one run (a reference or a layout)


@dataclass(frozen=True)
class Row:
    """One verify: `--model model --layout layout --set s...` for `steps` steps."""

    name: str
    layout: str
    model: str = "tiny"
    sets: tuple[str, ...] = ()
    steps: int = 3
    ci: bool = False  # in the subset CI runs (tests/test_parity_matrix.py)
    config: str | None = None  # the config file the layout and `sets` were read from (`config_row`)

    @property
    def table(self) -> dict[str, object]:
        """The layout's parallel.* keys and values, as --layout reads them."""
        return dict(parse_override(item) for item in checks.layout_items(self.layout))

    @property
    def world(self) -> int:
        t = self.table
        return int(t.get("pp", 1)) * int(t.get("dp", 1)) * int(t.get("cp", 1)) * int(t.get("tp", 1))


@dataclass
class Outcome:
    """What one row gave: `status` is PASS, FAIL or `pending: ...`; differences are relative."""

    row: Row
    status: str
    steps: int
    seconds: float = 0.0
    loss: float | None = None  # the largest over the steps
    grad_first: float | None = None  # step 1's gradient norm
    grad_max: float | None = None  # the largest over the steps
    val: float | None = None  # the validation loss at the last step
    note: str = ""  # why a row failed


def config_row(name: str, path: str, steps: int = 5, changes: tuple[str, ...] = ()) -> Row:
    """A row that verifies the layout and model of a config file (its [model], [moe], [parallel]
    and global batch) at verify's sequence length, with `changes` (`section.key=value`) over them."""
    table = tomllib.loads((REPO / path).read_text())
    model = table["model"]
    sets = {f"model.{k}": v for k, v in model.items() if k != "preset"}
    sets |= {f"moe.{k}": v for k, v in table.get("moe", {}).items()}
    sets |= {"train.global_batch": table["train"]["global_batch"]} | dict(map(parse_override, changes))
    layout = ",".join(f"{k}={spelled(v)}" for k, v in table["parallel"].items())
    items = tuple(f"{k}={spelled(v)}" for k, v in sets.items())
    return Row(name, layout, model["preset"], items, steps, config=path)


MOE = "tiny-moe"  # 8 routed experts, top-2, one shared expert, the first layer dense
EPLB_NOW = ("moe.eplb_interval=1", "moe.eplb_window=1")  # re-placed after every step of a short run

ROWS: list[Row] = [
    # one cut at a time
    Row("dp2", "dp=2"),
    Row("dp4", "dp=4"),
    Row("tp2", "tp=2"),
    Row("tp2-sp", "tp=2,sp=true", ci=True),
    Row("tp4-sp", "tp=4,sp=true"),
    Row("pp2-1f1b", "pp=2,microbatches=2", ci=True),
    Row("pp4-1f1b", "pp=4,microbatches=4"),
    Row("pp2-gpipe", "pp=2,pp_schedule=gpipe,microbatches=2"),
    Row("pp2-interleaved", "pp=2,pp_schedule=interleaved,pp_virtual=2,microbatches=2", ci=True),
    Row("pp2-zb1p", "pp=2,pp_schedule=zb1p,microbatches=2", ci=True),
    Row("pp2-dualpipev", "pp=2,pp_schedule=dualpipev,microbatches=4", ci=True),
    Row("cp2-ring", "cp=2", ci=True),
    Row("cp4-ring", "cp=4"),
    Row("cp2-ulysses", "cp=2,cp_mode=ulysses", ci=True),
    Row("cp4-ulysses", "cp=4,cp_mode=ulysses"),
    Row("cp4-usp", "cp=4,cp_mode=usp,cp_ulysses=2"),
    Row("dp2-cp4-usp", "dp=2,cp=4,cp_mode=usp,cp_ulysses=2"),
    Row("moe-dp2-ep2", "dp=2,ep=2", MOE),
    Row("moe-dp4-ep4", "dp=4,ep=4", MOE),
    # ZeRO stages without a pipeline
    Row("dp2-zero1", "dp=2,zero=1"),
    Row("dp2-zero2", "dp=2,zero=2"),
    Row("dp2-zero3", "dp=2,zero=3", ci=True),
    Row("dp2-zero3-keep", "dp=2,zero=3,reshard_after_forward=false"),
    Row("dp4-zero3-shard2", "dp=4,zero=3,zero_shard=2"),
    # two cuts
    Row("dp2-tp2-sp", "dp=2,tp=2,sp=true"),
    Row("dp2-pp2", "dp=2,pp=2,microbatches=2"),
    Row("dp2-cp2", "dp=2,cp=2"),
    Row("tp2-pp2-sp", "tp=2,pp=2,sp=true,microbatches=2"),
    Row("tp2-cp2-ring", "tp=2,cp=2"),
    Row("tp2-sp-cp2-ulysses", "tp=2,sp=true,cp=2,cp_mode=ulysses"),
    Row("moe-dp2-ep2-tp2", "dp=2,ep=2,tp=2", MOE),
    Row("moe-dp2-ep2-tp2-etp2-sp", "dp=2,ep=2,tp=2,etp=2,sp=true", MOE),
    Row("dp2-tp2-zero1", "dp=2,tp=2,zero=1"),
    Row("pp2-cp2", "pp=2,cp=2,microbatches=2"),
    Row("moe-pp2-dp2-ep2", "pp=2,dp=2,ep=2,microbatches=2", MOE),
    Row("moe-cp2-ep2", "cp=2,ep=2", MOE),
    Row("dp2-cp2-zero1", "dp=2,cp=2,zero=1"),
    Row("moe-dp2-ep2-zero1", "dp=2,ep=2,zero=1", MOE),
    Row("moe-dp4-ep2-zero3", "dp=4,ep=2,zero=3", MOE),
    # ZeRO inside a pipeline
    Row("dp2-pp2-zero1", "dp=2,pp=2,zero=1,microbatches=2", ci=True),
    Row("dp2-pp2-zero2", "dp=2,pp=2,zero=2,microbatches=2"),
    Row("dp2-pp2-zero3-1f1b", "dp=2,pp=2,zero=3,microbatches=2"),
    Row("dp2-pp2-zero3-interleaved", "dp=2,pp=2,zero=3,pp_schedule=interleaved,pp_virtual=2,microbatches=2"),
    Row("dp2-pp2-zero3-zb1p", "dp=2,pp=2,zero=3,pp_schedule=zb1p,microbatches=2"),
    Row("dp2-pp2-zero3-dualpipev", "dp=2,pp=2,zero=3,pp_schedule=dualpipev,microbatches=4"),
    Row("dp2-tp2-pp2-zero3-sp", "dp=2,tp=2,pp=2,zero=3,sp=true,microbatches=2"),
    Row("dp4-pp2-zero1-shard2", "dp=4,zero=1,zero_shard=2,pp=2,microbatches=2"),
    Row("dp4-pp2-zero3-shard2-zb1p", "dp=4,zero=3,zero_shard=2,pp=2,pp_schedule=zb1p,microbatches=2"),
    Row(
        "dp4-pp2-zero2-shard2-accumulate2",
        "dp=4,zero=2,zero_shard=2,pp=2,microbatches=2",
        sets=("train.accumulate=2", "train.global_batch=16"),
    ),
    # three and more cuts, up to 8 ranks
    Row("dp2-tp2-pp2-sp", "dp=2,tp=2,pp=2,sp=true,microbatches=2"),
    Row("dp2-cp2-tp2", "dp=2,cp=2,tp=2"),
    Row("pp2-dp2-cp2-zero1", "pp=2,dp=2,cp=2,zero=1,microbatches=2"),
    Row("moe-dp2-ep2-tp2-etp2-pp2-sp", "dp=2,ep=2,tp=2,etp=2,pp=2,sp=true,microbatches=2", MOE),
    Row("moe-pp2-dp2-ep2-tp2-sp", "pp=2,dp=2,ep=2,tp=2,sp=true,microbatches=2", MOE),
    Row("dp2-tp2-sp-zero2", "dp=2,tp=2,sp=true,zero=2"),
    Row("dp2-pp2-interleaved-zero1", "dp=2,pp=2,zero=1,pp_schedule=interleaved,pp_virtual=2,microbatches=2"),
    Row("tp2-sp-pp2-dualpipev", "tp=2,sp=true,pp=2,pp_schedule=dualpipev,microbatches=4"),
    Row("pp2-cp2-ulysses-gpipe", "pp=2,cp=2,cp_mode=ulysses,pp_schedule=gpipe,microbatches=2"),
    Row("moe-pp2-dp2-ep2-zb1p", "pp=2,dp=2,ep=2,pp_schedule=zb1p,microbatches=2", MOE),
    Row("moe-dp2-ep2-tp2-sp-capacity", "dp=2,ep=2,tp=2,sp=true", MOE, ("moe.capacity_factor=1.25",)),
    Row("moe-dp4-ep2-tp2-etp2-sp-zero3-shard2", "dp=4,ep=2,tp=2,etp=2,sp=true,zero=3,zero_shard=2", MOE),
    Row("dp2-cp4-usp-zero3-shard4", "dp=2,cp=4,cp_mode=usp,cp_ulysses=2,zero=3,zero_shard=4"),
    # accumulation
    Row("dp2-accumulate2", "dp=2", sets=("train.accumulate=2",), ci=True),
    Row("pp2-accumulate2", "pp=2,microbatches=2", sets=("train.accumulate=2",)),
    Row("moe-dp2-ep2-accumulate2", "dp=2,ep=2", MOE, ("train.accumulate=2",)),
    # each MoE option, under expert parallelism
    Row("moe-capacity", "dp=2,ep=2", MOE, ("moe.capacity_factor=1.0",), ci=True),
    Row("moe-capacity-ulysses", "cp=2,cp_mode=ulysses,ep=2", MOE, ("moe.capacity_factor=1.25",)),
    Row("moe-aux-loss", "dp=2,ep=2", MOE, ("moe.aux_loss_coef=0.01",)),
    Row("moe-aux-free", "dp=2,ep=2", MOE, ("moe.bias_update_rate=0.01",)),
    Row("moe-eplb-slots", "dp=4,ep=4", MOE, ("moe.eplb_slots=1", *EPLB_NOW)),
    Row("moe-eplb-move", "dp=4,ep=4", MOE, ("moe.eplb_move=true", *EPLB_NOW)),
    Row(
        "moe-sigmoid-groups",
        "dp=2,ep=2",
        MOE,
        ("model.gate=sigmoid", "model.expert_groups=4", "model.route_group_limit=2"),
        ci=True,
    ),
    Row("moe-shared2", "dp=2,ep=2", MOE, ("model.n_shared_experts=2",)),
    Row("moe-no-shared-no-dense", "dp=2,ep=2", MOE, ("model.n_shared_experts=0", "model.first_dense_layers=0")),
    Row("moe-first-dense2", "pp=2,dp=2,ep=2,microbatches=2", MOE, ("model.first_dense_layers=2",)),
    # other dense models: tied embeddings (across the pipeline's ends), GPT-2's odd vocabulary
    Row("gpt2-tp2-sp", "tp=2,sp=true", "tiny-gpt2"),
    Row("gpt2-pp2-tied", "pp=2,microbatches=2", "tiny-gpt2"),
    # DeepSeek-V3's layout in miniature (docs/cuts.md)
    config_row("deepseek-v3-mini", "configs/deepseek-v3-mini.toml", changes=EPLB_NOW),
]


# ---------------------------------------------------------------- what the rows cover


def features(row: Row) -> set[str]:
    """What `row` exercises: its cuts, schedule, CP mode, ZeRO stage in or out of a pipeline, MoE options."""
    t, cfg = row.table, load_config(None, [f"model.preset={row.model}", *row.sets])
    pp, zero = int(t.get("pp", 1)), int(t.get("zero", 0))
    out = {cut for cut in ("dp", "tp", "pp", "cp", "ep", "etp") if int(t.get(cut, 1)) > 1}
    out |= {"zero"} if zero else set()
    out |= {k for k in ("sp", "zero_shard") if t.get(k)}
    out.add(f"zero{zero}+{'pp' if pp > 1 else 'no-pp'}")
    if pp > 1:
        out.add(f"schedule:{t.get('pp_schedule', '1f1b')}")
    if int(t.get("cp", 1)) > 1:
        out.add(f"cp_mode:{t.get('cp_mode', 'ring')}")
    if cfg.train.accumulate > 1:
        out.add("accumulate")
    return out | model_features(cfg)


def model_features(cfg) -> set[str]:
    args, moe = preset_args(cfg.model), cfg.moe
    if not args.is_moe:
        return {"model:dense"}
    on = {
        "capacity": moe.capacity_factor is not None,
        "aux_loss": moe.aux_loss_coef > 0,
        "aux_free": moe.bias_update_rate > 0,
        "eplb_slots": moe.eplb_slots > 0,
        "eplb_move": moe.eplb_move,
        "sigmoid": args.gate == "sigmoid",
        "group_limited": args.expert_groups > 1,
        "shared_experts": args.n_shared_experts > 0,
        "first_dense_layers": args.first_dense_layers > 0,
    }
    return {"model:moe"} | {f"moe:{name}" for name, yes in on.items() if yes}


def wanted() -> dict[str, list[set[str]]]:
    """What the matrix must cover (issue 18): each entry is a set of features one row must hold."""
    return {
        "every pair of cuts": [set(pair) for pair in combinations(CUTS, 2)],
        "every schedule": [{f"schedule:{s}"} for s in SCHEDULES],
        "every CP mode": [{f"cp_mode:{m}"} for m in ALL_CP_MODES],
        "ZeRO 0-3 with and without PP": [{f"zero{z}+{p}"} for z in range(4) for p in ("pp", "no-pp")],
        "etp and zero_shard": [{"etp"}, {"zero_shard"}, {"etp", "pp"}, {"zero_shard", "pp"}],
        "accumulation": [{"accumulate"}, {"accumulate", "pp"}],
        "dense and MoE models": [{"model:dense"}, {"model:moe"}],
        "each MoE option": [{f"moe:{name}", "ep"} for name in MOE_OPTIONS],
    }


def coverage(rows: list[Row]) -> dict[str, list[tuple[str, list[str]]]]:
    """For each wanted entry, the names of the rows that hold it (an empty list: not covered)."""
    held = {row.name: features(row) for row in rows}
    return {
        what: [("+".join(sorted(need)), [n for n, f in held.items() if need <= f]) for need in needs]
        for what, needs in wanted().items()
    }


# ---------------------------------------------------------------- running a row


def pending(row: Row) -> str | None:
    """Why `row` cannot run on this commit (an option that has not landed), or None."""
    t = row.table
    known = {f.name for f in fields(ParallelDims)}
    missing = [key for key in t if key not in known]
    if missing:
        return f"pending: parallel.{missing[0]} not on this commit"
    if t.get("cp_mode", "ring") not in CP_MODES:
        return f"pending: cp_mode={t['cp_mode']} not on this commit"
    return None


def run_row(row: Row, steps: int | None, references: dict) -> Outcome:
    """Verify `row` (at `steps`, default its own); `references` caches single-process runs by config."""
    steps = steps or row.steps
    why = pending(row)
    if why:
        return Outcome(row, why, steps)
    start = time.perf_counter()
    try:
        series = compared(row, steps, references)
    except (ConfigError, checks.LayoutError, cli.RunFailed) as err:
        note = str(err).replace("\n", " ")
        return Outcome(row, "FAIL", steps, time.perf_counter() - start, note=note)
    return judged(row, steps, series, time.perf_counter() - start)


def compared(row: Row, steps: int, references: dict) -> dict[str, dict[int, float]]:
    """Each quantity's relative difference by step, the layout's run against the single process."""
    ns = SimpleNamespace(
        model=row.model, layout=row.layout, steps=steps, timeout=TIMEOUT_S, rtol=cli.LOSS_RTOL, overrides=list(row.sets)
    )
    cfg = cli.verify_config(ns)
    _, device = cli.verify_device(cfg)
    ref_cfg = cli.reference_of(cfg)
    key = repr(ref_cfg)
    if key not in references:
        run = cli.run_spawned(ref_cfg, TIMEOUT_S, device=device, what="verify, the single process")[0]
        references[key] = cli.verify_series(run)
    run = cli.run_spawned(cfg, TIMEOUT_S, device=device, what=f"verify, layout {row.layout}")[0]
    with redirect_stdout(io.StringIO()):  # verify's table of steps; the row keeps the figures
        return cli.print_comparison(references[key], cli.verify_series(run))


def judged(row: Row, steps: int, diffs: dict[str, dict[int, float]], seconds: float) -> Outcome:
    """The row's figures and PASS/FAIL under verify's tolerances (`cli.TOLERANCES`)."""
    over = [
        f"{name} at step {step} {rel:.2e}"
        for name, by_step in diffs.items()
        for step, rel in by_step.items()
        if not rel <= cli.TOLERANCES["fp32"].at(name, step)
    ]
    worst = {name: max(by_step.values(), default=float("inf")) for name, by_step in diffs.items()}
    out = Outcome(row, "FAIL" if over else "PASS", steps, seconds, note="; ".join(over))
    out.loss, out.grad_max, out.val = worst["loss"], worst["grad_norm"], worst["val_loss"]
    out.grad_first = diffs["grad_norm"].get(1, float("inf"))
    return out


def run_rows(rows: list[Row], steps: int | None = None, say=print) -> list[Outcome]:
    references: dict = {}
    outcomes = []
    for row in rows:
        outcome = run_row(row, steps, references)
        say(f"{row.name:<32} {outcome.status:<8} {outcome.seconds:6.1f} s  {outcome.note}")
        outcomes.append(outcome)
    return outcomes


# ---------------------------------------------------------------- the document


def figure(value: float | None) -> str:
    return "" if value is None else f"{value:.1e}"


def table_lines(outcomes: list[Outcome]) -> list[str]:
    head = (
        "| row | model | layout | world | steps | max rel loss diff | grad-norm diff, step 1 | max grad-norm diff "
        "| val-loss diff | seconds | result |"
    )
    lines = [head, "|" + "---|" * 11]
    for o in outcomes:
        r = o.row
        sets = f" `{' '.join(r.sets)}`" if r.sets and r.config is None else ""
        sets += f", the model and layout of `{r.config}`" if r.config else ""
        cells = [r.name, r.model + sets, f"`{r.layout}`", str(r.world), str(o.steps)]
        cells += [figure(o.loss), figure(o.grad_first), figure(o.grad_max), figure(o.val)]
        cells += [f"{o.seconds:.1f}" if o.seconds else "", o.status + (f" ({o.note})" if o.note else "")]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def coverage_lines(rows: list[Row]) -> list[str]:
    """Each wanted entry with its number of rows and how many of them ran on this commit."""
    ran = coverage([row for row in rows if pending(row) is None])
    lines = []
    for what, entries in coverage(rows).items():
        counts = [(need, len(names), len(dict(ran[what])[need])) for need, names in entries]
        lines.append(f"- {what}: " + ", ".join(f"{need} ({n} rows, {k} ran)" for need, n, k in counts))
    return lines


def document(outcomes: list[Outcome], command: str, seconds: float) -> str:
    ran = [o for o in outcomes if not o.status.startswith("pending")]
    passed = sum(o.status == "PASS" for o in ran)
    head = [
        "# The parity matrix",
        "",
        f"Generated by `{command}` at commit `{commit()}` in {seconds / 60:.1f} minutes (CPU, gloo).",
        f"{passed} of {len(ran)} rows that ran PASS; {len(outcomes) - len(ran)} pending (their option is not on "
        "this commit).",
        "",
        "Each row is `fivecut verify`: the layout against one process from the same seed, fp32, byte tokens of "
        "Shakespeare, `seq_len=64`, `global_batch=8` unless the row sets it; relative differences of the loss "
        f"(every step, tolerance {cli.LOSS_RTOL:g}), the gradient norm before clipping (step 1: "
        f"{cli.FIRST_GRAD_NORM_RTOL:g}, later steps {cli.LATER_GRAD_NORM_RTOL:g}) and the validation loss at the "
        f"last step ({cli.VAL_LOSS_RTOL:g}). Seconds: the layout's run, plus its single-process reference when "
        "the row is the first to need it. The rows are `ROWS` in `scripts/parity_matrix.py`.",
        "",
    ]
    cover = ["", "## What the rows cover", "", *coverage_lines([o.row for o in outcomes])]
    return "\n".join(head + table_lines(outcomes) + cover) + "\n"


def commit() -> str:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True).stdout.strip()

    dirty = " (with uncommitted changes)" if git("status", "--porcelain", "--untracked-files=no") else ""
    return git("rev-parse", "--short=12", "HEAD") + dirty


# ---------------------------------------------------------------- command line


def selected(only: list[str] | None, subset: str | None) -> list[Row]:
    """The rows named by --only (all if None), of the --subset (all if None); ValueError for an unknown name."""
    names = {row.name for row in ROWS}
    unknown = sorted(set(only or ()) - names)
    if unknown:
        raise ValueError(f"--only {' '.join(unknown)}: no such row; rows: {' '.join(sorted(names))}")
    return [row for row in ROWS if (only is None or row.name in only) and (subset is None or row.ci)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run these rows only")
    parser.add_argument("--subset", choices=("ci",), help="run the rows CI runs")
    parser.add_argument("--steps", type=int, help="steps of every row (default: each row's own)")
    parser.add_argument("--out", type=Path, help="the table's file (default docs/parity.md for the whole matrix)")
    ns = parser.parse_args(argv)
    try:
        rows = selected(ns.only, ns.subset)
    except ValueError as err:
        parser.error(str(err))  # exit 2
    start = time.perf_counter()
    outcomes = run_rows(rows, ns.steps)
    seconds = time.perf_counter() - start
    out = ns.out or (DOC if ns.only is None and ns.subset is None else None)
    command = "python scripts/parity_matrix.py " + " ".join(argv if argv is not None else sys.argv[1:])
    if out is not None:
        out.write_text(document(outcomes, command.strip(), seconds))
        print(f"table: {out}")
    failed = [o.row.name for o in outcomes if o.status == "FAIL"]
    print(f"{len(outcomes)} rows in {seconds:.0f} s; FAIL: {' '.join(failed) or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
