"""`fivecut ledger` under train.dtype = "bf16" (autocast): the closed forms follow each saved
tensor's and each message's dtype, so communication, model-state memory and activations stay
exact (bytes equal, each), as they are in fp32."""

from __future__ import annotations

import subprocess
import sys

import pytest
from test_e2e import assert_activations_exact, assert_every_cut_exact, assert_memory_exact

pytestmark = pytest.mark.multirank


def ledger_bf16(byte_cache: str, model: str, layout: str, *options: str) -> list[str]:
    run = subprocess.run(
        [sys.executable, "-m", "fivecut", "ledger", "--model", model, "--layout", layout]
        + ["--set", 'train.dtype="bf16"', "--set", f'data.cache_dir="{byte_cache}"', *options],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert_every_cut_exact(run.stdout)
    assert_memory_exact(run.stdout)
    assert_activations_exact(run.stdout)
    return run.stdout.strip().splitlines()


SWEEP = pytest.mark.sweep


@pytest.mark.parametrize(
    "model, layout, options",
    [
        # fp32 weights: fp32 residual stream and norms, bf16 linear outputs, a bf16 cast per linear
        ("tiny", "tp=2,sp=true", []),
        # ZeRO-3's bf16 units: a bf16 residual stream, which a pipeline stage sends and receives in bf16
        ("tiny", "dp=2,pp=2,zero=3,microbatches=2", []),
        pytest.param("tiny-moe", "dp=2,zero=3,ep=2", [], marks=SWEEP),
        pytest.param("tiny", "tp=2", [], marks=SWEEP),
        pytest.param("tiny", "dp=2", [], marks=SWEEP),
        pytest.param("tiny", "dp=2,zero=1", [], marks=SWEEP),
        pytest.param("tiny", "dp=2,zero=3,tp=2,sp=true", [], marks=SWEEP),
        pytest.param("tiny", "pp=2,microbatches=4", [], marks=SWEEP),
        pytest.param("tiny", "cp=2,cp_mode=ring", [], marks=SWEEP),
        pytest.param("tiny", "cp=2,cp_mode=ulysses", [], marks=SWEEP),
        pytest.param("tiny", "cp=4,cp_mode=usp,cp_ulysses=2", [], marks=SWEEP),
        pytest.param("tiny", "tp=2,sp=true", ["--set", 'train.recompute="full"'], marks=SWEEP),
        pytest.param("tiny", "tp=2", ["--set", 'train.recompute="full"'], marks=SWEEP),
        pytest.param("tiny", "dp=2,zero=3,tp=2,sp=true", ["--set", 'train.recompute="full"'], marks=SWEEP),
        pytest.param("tiny", "tp=2,sp=true", ["--set", 'train.recompute="selective"'], marks=SWEEP),
        pytest.param("tiny-moe", "dp=2,ep=2", [], marks=SWEEP),
        pytest.param("tiny-moe", "dp=2,ep=2", ["--set", 'train.recompute="selective"'], marks=SWEEP),
        pytest.param("tiny-moe", "dp=2,tp=2,sp=true,ep=2", [], marks=SWEEP),
        pytest.param("tiny-moe", "dp=2,ep=2,tp=2,etp=2,sp=true", [], marks=SWEEP),
    ],
)
def test_ledger_is_exact_under_bf16(byte_cache, model, layout, options):
    ledger_bf16(byte_cache, model, layout, *options)
