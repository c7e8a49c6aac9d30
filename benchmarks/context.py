"""Context parallelism: fivecut's ring attention (fused flash blocks) against Ulysses, USP (both),
one device's SDPA and PyTorch's `context_parallel`, step time and activation memory.

    python benchmarks/context.py [--model small] [--cp 2] [--ulysses 2] [--seq 1024] [--batch 1]
                                 [--steps 3] [--repeats 5] [--warmup 1]
    python benchmarks/context.py --memory [--model small] [--seq 1024] [--batch 1] [--ulysses 2]
    python benchmarks/context.py --cp 4 --ulysses 2      # USP vs ring and Ulysses alone, same shape

Timing (default): `cp` gloo ranks (fivecut.launch.spawn, one thread per rank) each build the
same model from the same seed once per candidate and see the same batch [batch, seq]:

    ring        parallelize(model, Mesh(ParallelDims(cp=N, cp_mode="ring"))): the rank's zigzag
                chunks (r and 2N-1-r of 2N), K/V blocks passed round the ring, each block pair on
                PyTorch's fused flash kernel; backward passes K/V again (fivecut/parallel/context.py)
    ulysses     the same with cp_mode="ulysses": all-to-alls of q, k, v, o around the model's
                own SDPA core (flash on CPU)
    usp         cp_mode="usp", cp_ulysses=U (--ulysses; only where 1 < U < cp, as U = 1 is the
                ring and U = cp is Ulysses): all-to-alls over U consecutive ranks around the
                fused ring over cp/U (each rank its piece of its ring position's zigzag pair)
    one device  the unparallelized model on the whole sequence, on every rank at once (each rank
                is one device of one thread: what the step costs without cutting the sequence)
    torch       torch.distributed.tensor.experimental.context_parallel over a "cp" DeviceMesh
                (round-robin load balance, its ring SDPA dispatch), when it runs here; where it
                does not, its exact error is printed and the others are compared among themselves

A timed step is zero_grad, forward, the mean token loss, backward (for the fivecut cuts: with
the gradients' all-reduce over cp); no optimizer step (it does the same work on every side).
Before timing each candidate's first loss must equal one device's to rtol 1e-5. Timing is
interleaved (benchmarks/common.py): each repeat runs every candidate's block of steps, the
order rotating, and ratios are medians over repeats of the per-repeat ratio of median step
times. Memory per candidate, on rank 0, one step each: the bytes the last transformer layer
saves for backward (fivecut's saved-tensors count, the figure `fivecut ledger` prints; the last
layer, since the first also holds the RoPE tables of the whole model) and the peak of live
tensor bytes over forward + backward above the start (the profiler's memory events).

--memory: the acceptance figure of issue 17: the saved bytes per layer of ring and Ulysses at
cp=2 and cp=4 (one spawn each, one run each) and of one device, with ring/Ulysses and the fall
from cp=2 to cp=4, and USP's at cp=4. The last lines printed are `ratio_ring_ulysses=<x>` (timing:
step time; with USP also `ratio_usp_ring=<x>` and `ratio_usp_ulysses=<x>`) or
`memory_ring_ulysses_cp2=<x>` and `memory_ring_cp2_cp4=<x>` (--memory, and `memory_usp_ring_cp4=<x>`).
On the 2-core CPU machine at a load average of 13, the defaults took 5 minutes and --memory 2.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks.common import (  # noqa: E402
    TIMING_COLUMNS,
    add_common_arguments,
    benchmark_parser,
    format_bytes,
    format_ratio,
    format_seconds,
    interleave,
    markdown_table,
    median,
    parse_options,
    profile_tensor_memory,
    ratio_cells,
    run,
    timing_cells,
)
from fivecut.launch import spawn  # noqa: E402
from fivecut.layout import ParallelDims  # noqa: E402
from fivecut.mesh import Mesh  # noqa: E402
from fivecut.model.presets import get_preset  # noqa: E402
from fivecut.model.transformer import build_model  # noqa: E402
from fivecut.parallel.context import sequence_chunk  # noqa: E402
from fivecut.parallel.parallelize import parallelize, token_loss_sum  # noqa: E402
from fivecut.parallel.saved import SavedActivations  # noqa: E402

LOSS_RTOL = 1e-5


def cuts(opts: dict, cp: int) -> tuple[str, ...]:
    """fivecut's cp modes compared at this cp: USP where its Ulysses degree is neither 1 nor cp."""
    return ("ring", "ulysses") + (("usp",) if 1 < opts["ulysses"] < cp and cp % opts["ulysses"] == 0 else ())


def model_args(opts: dict):
    """The preset, its max_seq_len raised to --seq where shorter (RoPE tables only)."""
    args = get_preset(opts["model"])
    return dataclasses.replace(args, max_seq_len=max(args.max_seq_len, opts["seq"]))


def batch(args, opts: dict) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(
        0, args.vocab_size, (opts["batch"], opts["seq"] + 1), generator=torch.Generator().manual_seed(0)
    )
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


@dataclasses.dataclass
class Candidate:
    """One side's step (returns the loss) and how to count what its layers save for backward."""

    step: Callable[[], torch.Tensor]
    saved: SavedActivations
    last_layer: str


def fivecut_candidate(args, mode: str, cp: int, inputs, targets, ulysses: int = 1) -> Candidate:
    u = ulysses if mode == "usp" else 1  # the USP degree (the field is usp's only)
    mesh = Mesh(ParallelDims(cp=cp, cp_mode=mode, cp_ulysses=u), "cpu")
    par = parallelize(build_model(args, seed=0), mesh)
    total = targets.numel()
    x, y, positions = sequence_chunk(inputs, targets, mesh.group("cp"), mode, u)  # [b, s/cp] and [s/cp]

    def step() -> torch.Tensor:
        par.sync.zero_grad()
        with par.saved.forward():
            loss = par.loss_sum(par.module(x, positions), y) / total
        loss.backward()  # gradients all-reduced over cp by the data cut
        return loss.detach()

    return Candidate(step, par.saved, str(args.n_layers - 1))


def one_device_candidate(args, inputs, targets) -> Candidate:
    model = build_model(args, seed=0)
    saved = SavedActivations()
    saved.track_layers(model.layers)

    def step() -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        loss = token_loss_sum(model(inputs), targets) / targets.numel()
        loss.backward()
        return loss.detach()

    return Candidate(step, saved, str(args.n_layers - 1))


def torch_candidate(args, cp: int, inputs, targets) -> Candidate:
    """PyTorch's context parallelism: the buffers (tokens, targets, positions) are sharded along
    the sequence inside `context_parallel`, SDPA dispatched to its ring; gradients all-reduced
    over cp by hand (torch leaves that to FSDP/DDP)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    mesh = init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",))
    model = build_model(args, seed=0)
    saved = SavedActivations()
    saved.track_layers(model.layers)
    total = targets.numel()

    def step() -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        x, y = inputs.clone(), targets.clone()
        positions = torch.arange(x.shape[1]).expand_as(x).contiguous()  # [b, s]: sharded with the tokens
        with context_parallel(mesh, buffers=[x, y, positions], buffer_seq_dims=[1, 1, 1]):
            loss = token_loss_sum(model(x, positions[0]), y) / total
            loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        summed = loss.detach().clone()
        dist.all_reduce(summed)
        return summed

    return Candidate(step, saved, str(args.n_layers - 1))


def cp_loss(loss: torch.Tensor, cut: bool) -> float:
    """The whole batch's mean loss: a cut rank holds its chunk's share (summed over the ranks)."""
    if cut and dist.is_initialized() and dist.get_world_size() > 1:
        loss = loss.clone()
        dist.all_reduce(loss)
    return loss.item()


def memory_of(c: Candidate) -> dict:
    """Saved bytes of the last layer in one forward, and the step's peak of live tensor bytes."""
    with c.saved.measure():
        c.step()
    layer = c.saved.bytes_per_layer.get(c.last_layer, 0)
    return {"saved": layer, "peak": profile_tensor_memory(c.step)["peak_bytes"]}


def build_candidates(opts: dict) -> tuple[dict[str, Candidate], str | None]:
    args, cp = model_args(opts), opts["cp"]
    inputs, targets = batch(args, opts)
    candidates = {mode: fivecut_candidate(args, mode, cp, inputs, targets, opts["ulysses"]) for mode in cuts(opts, cp)}
    candidates["one device"] = one_device_candidate(args, inputs, targets)
    try:
        theirs = torch_candidate(args, cp, inputs, targets)
        theirs.step()
        candidates["torch"] = theirs
        return candidates, None
    except Exception as err:  # recorded: PyTorch's CP may not run on CPU / gloo
        return candidates, f"{type(err).__name__}: {str(err).strip().splitlines()[0]}"


def rank_main(opts: dict) -> dict:
    candidates, torch_error = build_candidates(opts)
    losses = {name: cp_loss(c.step(), name in cuts(opts, opts["cp"])) for name, c in candidates.items()}
    reference = losses["one device"]
    for name, loss in losses.items():
        if abs(loss - reference) > LOSS_RTOL * abs(reference):
            raise AssertionError(f"{name}: loss {loss} differs from one device's {reference} (> rtol {LOSS_RTOL})")
    memory = {name: memory_of(c) for name, c in candidates.items()}
    started = time.perf_counter()

    def progress(r: int, order: list[str], runs: dict) -> None:
        if dist.get_rank() == 0:
            times = ", ".join(f"{n} {format_seconds(median(runs[n][-1]))}" for n in order)
            print(f"  repeat {r + 1}/{opts['repeats']}: {times}  [{time.perf_counter() - started:.0f} s]", flush=True)

    steps = {name: c.step for name, c in candidates.items()}
    runs = interleave(steps, opts["steps"], opts["repeats"], opts["warmup"], on_repeat=progress)
    return {"runs": runs, "memory": memory, "losses": losses, "torch_error": torch_error}


def report(opts: dict, results: list[dict], seconds: float, before: str) -> str:
    mine = results[0]
    runs, memory = mine["runs"], mine["memory"]
    tokens = opts["batch"] * opts["seq"]
    lines = [
        f"\nmodel {opts['model']}, cp={opts['cp']}, batch {opts['batch']} x seq {opts['seq']}, "
        f"{opts['repeats']} repeats x {opts['steps']} steps (+{opts['warmup']} warm-up), {seconds:.0f} s",
        f"machine at start: {before}",
        f"first losses: {', '.join(f'{n} {v:.7f}' for n, v in mine['losses'].items())}",
    ]
    if mine["torch_error"]:
        lines.append(f"torch context_parallel did not run: {mine['torch_error']}")
    rows = [[name, *timing_cells(r, tokens)] for name, r in runs.items()]
    lines += ["", markdown_table(["candidate", *TIMING_COLUMNS, "tokens/s"], rows)]
    others = [n for n in runs if n != "ring"]
    rows = [[f"ring / {n}", *ratio_cells(runs, "ring", n)] for n in others]
    lines += ["", markdown_table(["step time", "median of ratios", "fastest", "per repeat"], rows)]
    rows = [[n, format_bytes(m["saved"]), format_bytes(m["peak"])] for n, m in memory.items()]
    lines += ["", markdown_table(["rank 0, one step", "saved by the last layer", "peak live tensors"], rows)]
    for n in others:
        saved, peak = memory["ring"]["saved"] / memory[n]["saved"], memory["ring"]["peak"] / memory[n]["peak"]
        lines.append(f"ring / {n}: saved per layer {format_ratio(saved)}, peak {format_ratio(peak)}")
    if "usp" in runs:
        rows = [[f"usp / {n}", *ratio_cells(runs, "usp", n)] for n in ("ring", "ulysses")]
        lines += ["", markdown_table(["step time", "median of ratios", "fastest", "per repeat"], rows)]
        for n in ("ring", "ulysses"):
            saved, peak = memory["usp"]["saved"] / memory[n]["saved"], memory["usp"]["peak"] / memory[n]["peak"]
            lines.append(f"usp / {n}: saved per layer {format_ratio(saved)}, peak {format_ratio(peak)}")
    lines.append(f"ratio_ring_ulysses={ratio_cells(runs, 'ring', 'ulysses')[0].rstrip('x')}")
    if "usp" in runs:
        lines += [f"ratio_usp_{n}={ratio_cells(runs, 'usp', n)[0].rstrip('x')}" for n in ("ring", "ulysses")]
    return "\n".join(lines)


# ---------------------------------------------------------------- --memory


def memory_rank(opts: dict, cp: int) -> dict[str, int]:
    """Saved bytes of the last layer under ring, Ulysses (and USP) at this cp (and one device on cp=2)."""
    args = model_args(opts)
    inputs, targets = batch(args, opts)
    candidates = {mode: fivecut_candidate(args, mode, cp, inputs, targets, opts["ulysses"]) for mode in cuts(opts, cp)}
    if cp == 2:
        candidates["one device"] = one_device_candidate(args, inputs, targets)
    out = {}
    for name, c in candidates.items():
        with c.saved.measure():
            c.step()
        out[name] = c.saved.bytes_per_layer[c.last_layer]
    return out


def memory_main(opts: dict) -> None:
    print(f"context.py {' '.join(sys.argv[1:])}".rstrip(), flush=True)
    saved = {cp: spawn(memory_rank, cp, opts, cp, timeout_s=opts["timeout"])[0] for cp in (2, 4)}
    rows = [
        [f"{mode}, cp={cp}", format_bytes(saved[cp][mode]), f"{saved[cp][mode]:,}"]
        for cp in (2, 4)
        for mode in cuts(opts, cp)
    ]
    rows.append(["one device", format_bytes(saved[2]["one device"]), f"{saved[2]['one device']:,}"])
    print(
        f"\nmodel {opts['model']}, batch {opts['batch']} x seq {opts['seq']}: bytes the last layer saves for backward"
    )
    print(markdown_table(["layout (rank 0)", "saved per layer", "bytes"], rows))
    print(f"memory_ring_ulysses_cp2={saved[2]['ring'] / saved[2]['ulysses']:.3f}")
    print(f"memory_ring_ulysses_cp4={saved[4]['ring'] / saved[4]['ulysses']:.3f}")
    print(f"memory_ring_cp2_cp4={saved[2]['ring'] / saved[4]['ring']:.3f}")
    if "usp" in saved[4]:
        print(f"memory_usp_ring_cp4={saved[4]['usp'] / saved[4]['ring']:.3f}")


def main(argv=None) -> None:
    parser = benchmark_parser(__doc__)
    parser.set_defaults(model="small")
    parser.add_argument("--cp", type=int, default=2)
    parser.add_argument("--ulysses", type=int, default=2, help="USP's Ulysses degree (USP runs where 1 < it < cp)")
    parser.add_argument("--memory", action="store_true", help="saved bytes per layer at cp=2 and cp=4, no timing")
    add_common_arguments(parser, steps=3, repeats=5)
    parser.set_defaults(batch=1, seq=1024, warmup=1)
    opts = parse_options(parser, argv)
    if opts["memory"]:
        memory_main(opts)
        return
    run("context.py", rank_main, report, opts, opts["cp"])


if __name__ == "__main__":
    main()
