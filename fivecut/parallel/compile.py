"""`train.compile`: torch.compile of each transformer block, the step after recomputation.

What is compiled is the `forward` of whatever module sits at each block position of a stage
(`stage.layers[name]`) once the cuts before it (EP, TP/SP, CP, recomputation) have rewritten it;
the module's `__call__` stays eager. So:

* parameter names, `state_dict` keys and the placement records do not change (no `_orig_mod.`
  wrapper: the module stays where it was, only its forward is replaced on the instance);
* the hooks on the block run outside the compiled code, as before: ZeRO-3's pre-forward gather
  and post-forward free (`fivecut.parallel.zero`), and the layer tracking of `SavedActivations`;
* the collectives of the cuts (fivecut.comm calls inside the autograd Functions of TP/SP, CP and
  EP) end a graph: Dynamo resumes after them in a new graph. Those graph breaks are allowed; the
  trainer writes their count on step 1 (`CompileRecord.counts`);
* a MoE feed-forward at ep = 1 compiles with its block, in the same graph: routing, the token
  counts (`count_ids`, sized by the number of experts, never by the data), the grouped GEMMs with
  their offsets on the device (the CPU's `fivecut::grouped_mm_cpu` has a fake kernel giving its
  shapes), capacity, the auxiliary loss (`_AttachLoss`) and the load statistics (in-place adds
  on tensors, which the compiled code writes back). Its step-1 bookkeeping (`first_rows` is
  None on a step's first forward only; a recomputed forward is `replaying`) adds a graph or two
  on step 1, none after. A MoE layer that communicates stays eager, with its reason in
  `CompileRecord.eager` and in the step-1 line (`ExpertParallelMoE.eager_reason`):
  - ep > 1: the all-to-all split sizes are read on the host (`.tolist()`) at every dispatch;
    compiling past them would specialize on each microbatch's counts and recompile;
  - etp > 1, tp without sp, or capacity / the auxiliary loss over tp or cp chunks: collectives
    inside the layer, each of which would end a graph in the middle of it.

Under full recomputation the block's forward is a `BlockCheckpoint`: what is compiled is the
forward inside it, so the checkpoint (eager, with its bookkeeping of what it keeps and of MoE
replays) runs the compiled forward once in forward and again in backward. Dynamo cannot trace
that bookkeeping into a checkpoint of its own ("unsafe side effect") and would leave the whole
block eager.

Shapes are fixed (`dynamic=False`): every microbatch of a run has the same shape, so one graph
serves every block of a stage (they share `Block.forward`), plus one for evaluation (no grad).
On the CPU inductor emits C++ (a C++ compiler must be on PATH: `fivecut.checks` refuses
`train.compile` without one); on CUDA, Triton kernels.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
from torch import nn

from fivecut.model.transformer import MoE
from fivecut.parallel.recompute import BlockCheckpoint


@dataclass
class CompileRecord:
    """The blocks `compile_blocks` compiled, and Dynamo's counters when it did (they are global to
    the process: what a run adds is the difference)."""

    blocks: list[str] = field(default_factory=list)  # stage-local paths, e.g. "layers.3"
    eager: dict[str, str] = field(default_factory=dict)  # MoE modules left eager inside the blocks -> why
    start_graphs: int = 0
    start_breaks: Counter = field(default_factory=Counter)

    def counts(self) -> dict:
        """Graphs compiled and graph breaks since the blocks were compiled, with the most common
        reasons (Dynamo's own words, first line)."""
        counters = torch._dynamo.utils.counters
        breaks = counters["graph_break"].copy()
        breaks.subtract(self.start_breaks)
        reasons = Counter()
        for reason, n in breaks.items():
            reasons[reason.splitlines()[0][:120]] += max(n, 0)
        return {
            "blocks": len(self.blocks),
            "graphs": counters["stats"]["unique_graphs"] - self.start_graphs,
            "graph_breaks": sum(n for n in breaks.values() if n > 0),
            "reasons": dict(reasons.most_common(3)),
            "eager": dict(self.eager),
        }

    def line(self) -> str:
        c = self.counts()
        why = "; ".join(f"{n}x {reason}" for reason, n in c["reasons"].items())
        line = f"torch.compile: {c['blocks']} blocks, {c['graphs']} graphs, {c['graph_breaks']} graph breaks"
        return line + (f" ({why})" if why else "") + self._eager_line()

    def _eager_line(self) -> str:
        """`; eager MoE: layers.1.feed_forward, layers.2.feed_forward (ep=2: ...)`, one group per reason."""
        paths_by_reason: dict[str, list[str]] = {}
        for path, reason in self.eager.items():
            paths_by_reason.setdefault(reason, []).append(path)
        groups = [f"{', '.join(paths)} ({reason})" for reason, paths in paths_by_reason.items()]
        return f"; eager MoE: {'; '.join(groups)}" if groups else ""


def start_record() -> CompileRecord:
    counters = torch._dynamo.utils.counters
    return CompileRecord(start_graphs=counters["stats"]["unique_graphs"], start_breaks=counters["graph_break"].copy())


def compile_blocks(stage: nn.Module, record: CompileRecord) -> None:
    """Compile the forward of the module at each block position of `stage`; no parameter changes."""
    for name, block in stage.layers.items():
        for path, module in block.named_modules(prefix=f"layers.{name}"):
            reason = moe_eager_reason(module)
            if reason is not None:
                module.forward = torch.compiler.disable(module.forward, recursive=True)
                record.eager[path] = reason
        if isinstance(block.forward, BlockCheckpoint):  # full recomputation: compile inside the checkpoint
            block.forward.forward = torch.compile(block.forward.forward, dynamic=False)
        else:
            block.forward = torch.compile(block.forward, dynamic=False)
        record.blocks.append(f"layers.{name}")


def moe_eager_reason(module: nn.Module) -> str | None:
    """Why a MoE module stays eager (None: it compiles; so does any other module). A MoE without a
    runtime is the plain dropless layer of one process."""
    if not isinstance(module, MoE) or module.runtime is None:
        return None
    return module.runtime.eager_reason()
