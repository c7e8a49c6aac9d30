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
* a MoE feed-forward runs eagerly inside the compiled block: its token counts per expert are
  data (`.tolist()` sizes the splits and the all-to-alls), and compiling past them would
  specialize on each microbatch's counts and recompile every time. The attention, norms and
  residuals of the block are compiled; the graph breaks at the MoE call.

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
    eager: list[str] = field(default_factory=list)  # modules left eager inside the blocks (MoE)
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
        }

    def line(self) -> str:
        c = self.counts()
        why = "; ".join(f"{n}x {reason}" for reason, n in c["reasons"].items())
        return f"torch.compile: {c['blocks']} blocks, {c['graphs']} graphs, {c['graph_breaks']} graph breaks" + (
            f" ({why})" if why else ""
        )


def start_record() -> CompileRecord:
    counters = torch._dynamo.utils.counters
    return CompileRecord(start_graphs=counters["stats"]["unique_graphs"], start_breaks=counters["graph_break"].copy())


def compile_blocks(stage: nn.Module, record: CompileRecord) -> None:
    """Compile the forward of the module at each block position of `stage`; no parameter changes."""
    for name, block in stage.layers.items():
        for path, module in block.named_modules(prefix=f"layers.{name}"):
            if isinstance(module, MoE):
                module.forward = torch.compiler.disable(module.forward, recursive=True)
                record.eager.append(path)
        if isinstance(block.forward, BlockCheckpoint):  # full recomputation: compile inside the checkpoint
            block.forward.forward = torch.compile(block.forward.forward, dynamic=False)
        else:
            block.forward = torch.compile(block.forward, dynamic=False)
        record.blocks.append(f"layers.{name}")
