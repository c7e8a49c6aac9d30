"""A checkpoint from elsewhere cannot run code: DCP's `.metadata` is a pickle, and every door
fivecut opens a checkpoint through reads it with `checkpoint.MetadataUnpickler`, which admits DCP's
own records only. A crafted `.metadata` (its sha256 recorded in `fivecut.json` too, as whoever
crafts the folder would) is refused naming the file, exit 2, and what it would have run never runs.
"""

from __future__ import annotations

import hashlib
import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import fivecut
from fivecut.cli import main
from fivecut.train import checkpoint

QUICK = ["train.seq_len=32", "train.global_batch=4", "train.warmup=1", "train.eval_every=0", "log.peak_tflops=1.0"]
QUIET = ["log.progress=false", "log.plot=false"]


def sets(*items: str) -> list[str]:
    return [arg for item in items for arg in ("--set", item)]


class Payload:
    """Unpickled, it creates the file `marker` (stands for any code a shared checkpoint could run)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


@pytest.fixture(scope="module")
def crafted(tmp_path_factory) -> tuple[Path, Path, list[str]]:
    """A one-step tiny run's checkpoint whose .metadata was replaced by `Payload`, its record updated."""
    base = tmp_path_factory.mktemp("doors")
    cache = str(tmp_path_factory.getbasetemp() / "token-cache")
    common = [*QUICK, *QUIET, f'data.cache_dir="{cache}"']
    args = sets(*common, "train.steps=1", f'checkpoint.dir="{base / "ck"}"', f'log.out_dir="{base / "run"}"')
    assert main(["train", *args]) == 0
    path = checkpoint.newest(base / "ck")
    marker = base / "code-ran"
    metadata = path / checkpoint.DCP_METADATA
    metadata.write_bytes(pickle.dumps(Payload(marker)))
    meta = json.loads((path / checkpoint.META).read_text())
    digest = hashlib.sha256(metadata.read_bytes()).hexdigest()
    meta["files"][checkpoint.DCP_METADATA] = [digest, metadata.stat().st_size]
    (path / checkpoint.META).write_text(json.dumps(meta))
    return path, marker, common


def doors(path: Path, base: Path, common: list[str]) -> dict[str, list[str]]:
    run = sets(*common, "train.steps=2", f'log.out_dir="{base / "again"}"')
    return {
        "train --resume PATH": ["train", "--resume", str(path), *run],
        "train --resume auto": ["train", *run, *sets(f'checkpoint.dir="{path.parent}"')],
        "model.init_from dcp:": ["train", "--resume", "never", *run, *sets(f'model.init_from="dcp:{path}"')],
        "export": ["export", "--checkpoint", str(path), "--out", str(base / "hf")],
        "convert": ["convert", "--from", f"dcp:{path}", "--to", f"hf:{base / 'hf2'}"],
        "checkpoint info": ["checkpoint", "info", str(path)],
    }


@pytest.mark.parametrize(
    "door",
    ["train --resume PATH", "train --resume auto", "model.init_from dcp:", "export", "convert", "checkpoint info"],
)
def test_every_door_refuses_a_metadata_that_would_run_code(crafted, door, tmp_path, capsys):
    path, marker, common = crafted
    assert main(doors(path, tmp_path, common)[door]) == 2
    err = capsys.readouterr().err
    assert str(path / checkpoint.DCP_METADATA) in err and "refused" in err, err
    assert "Traceback" not in err and err.count("\n") == 1, err
    assert not marker.exists()


def test_the_crafted_file_does_run_code_under_dcps_own_reader(crafted, tmp_path):
    """The payload is live: torch's FileSystemReader (plain pickle.load) runs it (on a copy)."""
    path, _, _ = crafted
    copy = shutil.copytree(path, tmp_path / "copy")
    marker = tmp_path / "ran"
    (copy / checkpoint.DCP_METADATA).write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(AttributeError):  # the payload's result is no Metadata
        dcp.FileSystemReader(str(copy)).read_metadata()
    assert marker.exists()


def test_a_real_metadata_reads_back_whole(tmp_path):
    """Everything DCP writes (tensors of several dtypes, storage records) passes the unpickler."""
    state = {"w": torch.ones(3, 4), "s": torch.tensor(1.0), "b": torch.zeros(2, dtype=torch.bfloat16)}
    dcp.save(state, checkpoint_id=str(tmp_path), no_dist=True)
    ours, theirs = checkpoint.dcp_metadata(tmp_path), dcp.FileSystemReader(str(tmp_path)).read_metadata()
    assert ours.state_dict_metadata == theirs.state_dict_metadata and ours.storage_data == theirs.storage_data


def test_no_code_opens_a_checkpoint_past_the_safe_reader():
    """fivecut's own source never builds torch's FileSystemReader but through `SafeReader`."""
    package = Path(fivecut.__file__).parent
    users = [str(p) for p in package.rglob("*.py") if "FileSystemReader" in p.read_text()]
    assert users == [str(package / "train" / "checkpoint.py")]
    assert "class SafeReader(dcp.FileSystemReader)" in Path(users[0]).read_text()
    assert Path(users[0]).read_text().count("FileSystemReader") == 1  # SafeReader's base
