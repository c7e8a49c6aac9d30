"""Expert tensor parallelism (parallel.etp): each routed expert's hidden size cut over etp
ranks of the tp group, composed with EP's dispatch and combine.

Parity: the forward output and every gradient (experts gathered back over etp and ep) equal
the single-device model's; losses over optimizer steps equal the single-process run's.
Tolerances are test_expert.py's (fp32; the same rows meet the experts, the partial sums over
hidden are added in a different order by the reduce-scatter): logits rtol 1e-5, atol 1e-6;
gradients rtol 1e-5, atol 1e-7; losses over steps rtol 1e-5.
"""

from __future__ import annotations

import pytest
import torch
from test_expert import GRAD_TOL, LOGIT_TOL, ROWS, moe_step

from fivecut.launch import spawn

CASES = {
    "dp=2,ep=2,tp=2,etp=2,sp": ("dp=2,ep=2,tp=2,etp=2,sp=true", {}),
    "tp=2,etp=2 no sp, capacity + aux": ("tp=2,etp=2", {"capacity_factor": 1.0, "aux_loss_coef": 0.01}),
}


def world_of(layout: str) -> tuple[int, int]:
    """(processes, dp) of a `moe_step` layout."""
    kv = dict(item.split("=") for item in layout.split(","))
    return int(kv.get("dp", 1)) * int(kv.get("tp", 1)), int(kv.get("dp", 1))


@pytest.mark.multirank
@pytest.mark.parametrize("case", list(CASES))
def test_forward_and_gradients_match_single_device(case):
    layout, options = CASES[case]
    ref_logits, ref_grads = spawn(moe_step, 1, "", options, {})[0]
    world, dp = world_of(layout)
    rows = ROWS // dp
    for rank, (logits, grads) in enumerate(spawn(moe_step, world, layout, options, {})):
        dp_rank = rank // (world // dp)
        torch.testing.assert_close(logits, ref_logits[dp_rank * rows : (dp_rank + 1) * rows], **LOGIT_TOL)
        assert grads.keys() == ref_grads.keys()
        for name, g in grads.items():
            torch.testing.assert_close(
                g, ref_grads[name], **GRAD_TOL, msg=lambda m, n=name, r=rank: f"{case} rank {r} {n}: {m}"
            )
