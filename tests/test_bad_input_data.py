"""Bad training data, refused by `fivecut train` in one line naming the file (and line or row) and a
fix, exit status 2, no traceback, before any process group exists (issue 36, item 5). A shard
damaged during a run is in test_datastore.py."""

from __future__ import annotations

import json

import pytest
import torch.distributed as dist

from fivecut.cli import main
from fivecut.train.data import load_tokens


def refused(capsys, tmp_path, *sets: str) -> str:
    argv = ["train"]
    base = ('data.tokenizer="byte"', f'data.cache_dir="{tmp_path / "cache"}"', f'log.out_dir="{tmp_path / "out"}"')
    for item in (*base, "train.steps=1", "train.warmup=0", "log.progress=false", *sets):
        argv += ["--set", item]
    capsys.readouterr()
    assert main(argv) == 2
    assert not dist.is_initialized()  # refused before any process group
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in err, err
    return errors[0]


def jsonl(tmp_path, *lines: str, name: str = "docs.jsonl") -> str:
    path = tmp_path / name
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


def test_a_jsonl_line_that_is_not_json(capsys, tmp_path):
    path = jsonl(tmp_path, '{"text": "one"}', '{"text": "two"', '{"text": "three"}')
    err = refused(capsys, tmp_path, f'data.source="{path}"')
    assert f"{path}:2 is not JSON" in err and "fix or remove that line" in err


def test_a_missing_text_field_names_the_line_and_the_key(capsys, tmp_path):
    path = jsonl(tmp_path, '{"text": "one"}', '{"body": "two"}')
    err = refused(capsys, tmp_path, f'data.source="{path}"')
    assert f"{path}:2 has no field 'text' (it has: body)" in err and "set data.text_field" in err


def test_an_empty_shard(capsys, tmp_path):
    good = jsonl(tmp_path, '{"text": "one"}', name="a.jsonl")
    empty = jsonl(tmp_path, "", name="b.jsonl")
    err = refused(capsys, tmp_path, f'data.source="{tmp_path / "*.jsonl"}"')
    assert f"{empty} holds no documents (an empty shard)" in err and good not in err


def test_a_parquet_file_without_the_column(capsys, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "part.parquet"
    pq.write_table(pa.table({"content": ["a", "b"]}), path)
    err = refused(capsys, tmp_path, f'data.source="{path}"')
    assert f"{path} has no column 'text' (its columns: content)" in err and "set data.text_field" in err


@pytest.mark.parametrize(
    "weights,words",
    [("[1, -0.5]", "data.weights[1] = -0.5 is negative"), ('[1, "half"]', "config key data.weights wants list")],
)
def test_a_mixture_weight_negative_or_not_a_number(capsys, tmp_path, weights, words):
    a = jsonl(tmp_path, '{"text": "one"}', name="a.jsonl")
    b = jsonl(tmp_path, '{"text": "two"}', name="b.jsonl")
    err = refused(capsys, tmp_path, f"data.source={json.dumps([a, b])}", f"data.weights={weights}")
    assert words in err


def test_a_source_that_matches_no_files(capsys, tmp_path):
    err = refused(capsys, tmp_path, f'data.source="{tmp_path / "shards" / "*.jsonl.zst"}"')
    assert f"data.source '{tmp_path / 'shards' / '*.jsonl.zst'}' matches no files" in err


def test_a_store_whose_checksum_does_not_match(capsys, tmp_path):
    path = jsonl(tmp_path, *[json.dumps({"text": f"document {i} " * 30}) for i in range(20)])
    folder = load_tokens(path, "byte", tmp_path / "cache").cache_path
    shard = folder / "shard-00000.bin"
    data = bytearray(shard.read_bytes())
    data[100] ^= 1  # one bit
    shard.write_bytes(bytes(data))
    err = refused(capsys, tmp_path, f'data.source="{path}"')
    assert f"{shard} does not match the sha256" in err and f"remove the folder {folder}" in err
