"""benchmarks/gpu_step.py (the GPU check's measurements) runs end to end at its smallest size on
the CPU: fivecut's CLI and transformers side by side, and AdamW's kernels (not its figures)."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_gpu_step_smoke_runs_every_kind_of_case(tmp_path):
    command = [sys.executable, "benchmarks/gpu_step.py", "--smoke", "--out", str(tmp_path)]
    command += ["--cases", "fivecut-eager,hf-eager,adamw"]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    assert "| fivecut-eager |" in result.stdout and "| hf-eager |" in result.stdout
    assert "AdamW over" in result.stdout and (tmp_path / "gpu_step.json").exists()
