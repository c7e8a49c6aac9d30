"""Closed-form model-state memory per rank (fp32 parameters, gradients and Adam moments).

stage   params   grads    Adam (2 moments)   total
DDP     4Psi     4Psi     8Psi               16Psi
ZeRO-1  4Psi     4Psi     8Psi/n             8Psi + 8Psi/n
ZeRO-2  4Psi     4Psi/n   8Psi/n             4Psi + 12Psi/n
ZeRO-3  4Psi/n   4Psi/n   8Psi/n             16Psi/n   (+ the units gathered at the time)

n is the ranks a state is sharded over: its reduce group, or with `parallel.zero_shard = S`
(hybrid sharding) the part of it in one shard group (S for most parameters; `shard_group_sizes`).

Under train.dtype = "bf16" the masters, gradient shards and moments stay fp32, so the table holds;
only ZeRO-3's gathered units (freed between steps, not counted here) are bf16: 2 bytes a parameter.
"""

from __future__ import annotations


def model_state_bytes(psi: int, zero: int, n: int) -> dict[str, float]:
    params = 4 * psi / (n if zero == 3 else 1)
    grads = 4 * psi / (n if zero >= 2 else 1)
    adam = 8 * psi / (n if zero >= 1 else 1)
    return {"params": params, "grads": grads, "optimizer": adam, "total": params + grads + adam}


def formula(zero: int) -> str:
    return {0: "16Psi", 1: "8Psi + 8Psi/n", 2: "4Psi + 12Psi/n", 3: "16Psi/n"}[zero]


# The step's moments. A rank's memory peaks at one of three moments of a step, and the plan's
# terms (`fivecut.plan.cost.peak_memory`) say which are alive at each:
#   loss       the head's cross-entropy (on the last stage; elsewhere "forward": the last forward
#              before the first backward), with every block's activations of the microbatches in
#              flight: model states, compute copies, buffers, activations, what the last stage keeps
#              between its blocks and the head ("head": the final norm's, the chunked head's input),
#              a pipeline's boundary tensors ("boundaries": its posted receives, its kept outputs)
#              and the loss's peak
#   backward   its end: the activations are freed, the gradients reduced: model states, compute
#              copies and the data cut's buffers
#   optimizer  clipping and AdamW: model states, compute copies (dropped after the step) and the
#              step's temporaries (`step_temporaries`)
# `fivecut plan --check` counts the same moments on one real step (fivecut.train.memory_check).
STATES = ("params", "grads", "optimizer", "weight_copies")


def step_moments(memory: dict[str, float]) -> dict[str, float]:
    """Bytes at each moment of a step from the plan's terms (`fivecut.plan.cost.peak_memory`)."""
    held = sum(memory.get(k, 0.0) for k in STATES)
    first = "loss" if memory.get("loss", 0.0) > 0 else "forward"
    return {
        first: held + at_loss(memory) + sum(memory.get(k, 0.0) for k in ("activations", "boundaries", "head", "loss")),
        "backward": held + memory.get("buffers", 0.0),
        "optimizer": held + memory.get("temporaries", 0.0),
    }


def at_loss(memory: dict[str, float]) -> float:
    """The data cut's buffers at the loss ("buffers_at_loss": `fivecut.plan.buffers.loss_moment_buffers`)."""
    return memory.get("buffers_at_loss", memory.get("buffers", 0.0))


def peak_moment(memory: dict[str, float]) -> str:
    moments = step_moments(memory)
    return max(moments, key=moments.get)


def step_temporaries(adamw: str, largest_group: float, largest_tensor: float, kernels: str) -> float:
    """The optimizer moment's temporaries on one rank, the most alive at once (bytes):
    AdamW "foreach": torch's multi-tensor AdamW makes the square roots of the second moments, one
    fp32 tensor a parameter, for a parameter group at a time (4 B x `largest_group` elements);
    "fused" (and "auto" where fused runs): one kernel updates in place, nothing.
    The gradient norm before it: on a GPU (`kernels` "cuda") one `_foreach_norm`, a float a tensor;
    on the CPU the squares of one gradient at a time (4 B x `largest_tensor`). The two never
    overlap (the norm's squares are freed before AdamW runs): the larger counts."""
    adam = FP32_BYTES * largest_group if adamw == "foreach" else 0.0
    norm = FP32_BYTES * largest_tensor if kernels == "cpu" else 0.0
    return max(adam, norm)


FP32_BYTES = 4
KERNELS = ("cuda", "cpu")


def kernels_of(cluster) -> str:
    """Whose kernels a cluster's devices run: "cpu" for a calibrated CPU (its ranks share the
    node's cores: `cores_per_node`), else "cuda" (the presets and GPU calibrations)."""
    return "cpu" if getattr(cluster, "cores_per_node", 0) else "cuda"


GIB = 1 << 30
TERMS = (
    "params",
    "grads",
    "optimizer",
    "weight_copies",
    "activations",
    "boundaries",
    "head",
    "loss",
    "buffers",
    "temporaries",
)
ALIVE = {  # the terms alive at each moment (`step_moments`)
    "loss": set(TERMS) - {"temporaries"},
    "forward": set(TERMS) - {"temporaries"},
    "backward": {*STATES, "buffers"},
    "optimizer": {*STATES, "temporaries"},
}


def moment_lines(memory: dict[str, float]) -> list[str]:
    """The plan's terms at each moment of the step (GiB), the peak's moment marked."""
    moments = step_moments(memory)
    peak = max(moments, key=moments.get)
    head = "".join(f"{m + (' *' if m == peak else ''):>13}" for m in moments)
    lines = [f"  {'term':<14}{head}"]
    for term in TERMS:
        cells = "".join(f"{gib(term_at(memory, term, m)) if term in ALIVE[m] else '-':>13}" for m in moments)
        lines.append(f"  {term:<14}{cells}")
    lines.append(f"  {'total':<14}" + "".join(f"{gib(v):>13}" for v in moments.values()))
    lines.append(f"  the peak falls at {describe(peak)} (*)")
    return lines


def term_at(memory: dict[str, float], term: str, moment: str) -> float:
    if term == "buffers" and moment in ("loss", "forward"):
        return at_loss(memory)
    return memory.get(term, 0.0)


def describe(moment: str) -> str:
    return {
        "loss": "the loss (the head's cross-entropy, every activation of the microbatches in flight alive)",
        "forward": "the last forward before the first backward (this rank holds no head)",
        "backward": "the end of the backward (the gradients reduced)",
        "optimizer": "the optimizer step (clipping, AdamW's temporaries)",
    }[moment]


def gib(n: float) -> str:
    """Bytes in GiB, or MiB below one GiB (a tiny model's plan)."""
    return f"{n / GIB:.2f} GiB" if abs(n) >= GIB or n == 0 else f"{n / 2**20:.2f} MiB"


def check_lines(memory: dict[str, float], check) -> list[str]:
    """The plan beside the check (`fivecut.train.memory_check.StepMemory`): each moment's total,
    and at the peak the model states term by term and the rest of what the step holds."""
    planned = step_moments(memory)
    lines = [f"  {'moment':<12}{'plan':>14}{'check':>14}{'check/plan':>12}"]
    for moment in ("forward", "loss", "blocks", "backward", "optimizer"):
        if moment not in planned and moment not in check.moments:
            continue
        plan, seen = planned.get(moment), check.moments.get(moment)
        ratio = f"{seen / plan:.3f}" if plan and seen is not None else ""
        p = gib(plan) if plan is not None else "-"
        c = gib(seen) if seen is not None else "-"
        lines.append(f"  {moment:<12}{p:>14}{c:>14}{ratio:>12}")
    peak_plan = max(planned.values())
    lines.append(f"  {'peak':<12}{gib(peak_plan):>14}{gib(check.peak):>14}{check.peak / peak_plan:>12.3f}")
    at = check.terms[check.moment]
    rest_plan = peak_plan - sum(memory.get(k, 0.0) for k in ("params", "grads", "optimizer"))
    rest_check = check.peak - at["params"] - at["grads"] - at["optimizer"]
    lines.append(f"  at the peak ({max(planned, key=planned.get)} planned, {check.moment} checked):")
    for term in ("params", "grads", "optimizer"):
        lines.append(f"    {term:<20}{gib(memory.get(term, 0.0)):>14}{gib(at[term]):>14}")
    lines.append(f"    {'the step tensors':<20}{gib(rest_plan):>14}{gib(rest_check):>14}")
    lines.append("    (plan: weight copies, activations, loss, buffers, temporaries at that moment; check: every")
    lines.append("     other live storage, MemTracker's activations and backward temporaries)")
    return lines
