"""Shared test settings. Multi-rank tests use `fivecut.launch.spawn` (FileStore, gloo, one thread per rank)."""

import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny tensors: one intra-op thread is faster, and far faster on a busy 2-core machine
    where spinning OpenMP threads contend. Restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def byte_cache(tmp_path_factory):
    """A token cache shared by the tests of one session (byte-tokenized Shakespeare is 10 MB)."""
    return str(tmp_path_factory.getbasetemp() / "token-cache")
