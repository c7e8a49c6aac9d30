"""The shell scripts under scripts/: what can be checked without root, daemons or a GPU.
(scripts/slurm_local.sh itself runs a Slurm cluster; its output is in docs/running.md, "Slurm".)"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


@pytest.mark.parametrize("name", ["slurm.sbatch", "slurm_local.sh", "setup.sh", "gpu_check.sh"])
def test_script_parses(name):
    result = subprocess.run(["bash", "-n", str(SCRIPTS / name)], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr


def test_slurm_local_refuses_an_unknown_command_naming_the_choices():
    result = subprocess.run(
        ["bash", str(SCRIPTS / "slurm_local.sh"), "start"], capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == (
        "slurm_local: unknown command 'start'; give setup, stop, or nothing (setup, then the three jobs)\n"
    )


def test_sbatch_script_passes_its_arguments_to_fivecut_train():
    """`sbatch scripts/slurm.sbatch --set KEY=VALUE` reaches `fivecut train`, after the script's own --set."""
    lines = (SCRIPTS / "slurm.sbatch").read_text().splitlines()
    train = next(i for i, line in enumerate(lines) if "-m fivecut train" in line)
    command = lines[train:]
    assert command[-1].strip() == '"$@"' and all(line.endswith("\\") for line in command[:-1])
