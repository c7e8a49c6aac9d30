"""`fivecut ledger` measures the loss's peak (the head and cross-entropy's forward and backward,
step 1, on the rank holding the head) and `loss_peak_bytes` predicts it to the byte: one process
in fp32 and bf16, the vocabulary-parallel loss (tp=2, with and without SP) and a pipeline's last
stage (pp=2, 1F1B), each on the chunked head and on the full logits."""

from __future__ import annotations

import re

import pytest

from fivecut.cli import main

CHUNKED, FULL = "train.loss_chunk_tokens=128", "train.loss_chunk_tokens=0"  # tiny: 512 tokens, 4 chunks


def assert_loss_peak_exact(stdout: str) -> None:
    """`loss peak: measured X (N B), predicted Y (M B)`: N == M."""
    line = next(x for x in stdout.splitlines() if x.startswith("loss peak: measured "))
    measured, predicted = re.findall(r"\(([\d,]+) B\)", line)
    assert measured == predicted, line
    assert "loss_ratio=1.000" in stdout


def ledger(capsys, layout: str, *settings: str) -> str:
    argv = ["ledger", "--model", "tiny", "--layout", layout]
    for setting in settings:
        argv += ["--set", setting]
    assert main(argv) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("chunk", [CHUNKED, FULL])
@pytest.mark.parametrize("dtype", ['train.dtype="fp32"', 'train.dtype="bf16"'])
def test_one_process_loss_peak_is_exact(capsys, chunk, dtype):
    assert_loss_peak_exact(ledger(capsys, "tp=1", chunk, dtype))


@pytest.mark.multirank
@pytest.mark.parametrize("layout", ["tp=2", "tp=2,sp=true", "pp=2,pp_schedule=1f1b"])
@pytest.mark.parametrize("chunk", [CHUNKED, FULL])
def test_distributed_loss_peak_is_exact(capsys, layout, chunk):
    out = ledger(capsys, layout, chunk)
    assert_loss_peak_exact(out)
    if layout.startswith("pp"):
        assert "loss peak on rank 1 " in out  # the last stage holds the head


@pytest.mark.multirank
@pytest.mark.parametrize("chunk", [CHUNKED, FULL])
def test_vocabulary_parallel_loss_peak_under_bf16_is_exact(capsys, chunk):
    """Under autocast the logits are bf16 and their fp32 upcast is freed once masked."""
    assert_loss_peak_exact(ledger(capsys, "tp=2", chunk, 'train.dtype="bf16"'))
