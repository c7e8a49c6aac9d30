"""The token store, mixtures and the epoch order (issue 36, items 1-4).

Every source format is written here by the test (text files, JSONL, JSONL.gz, JSONL.zst, Parquet, a
dataset saved with `save_to_disk`); the same documents must give the same store byte for byte. A
build interrupted after some shards goes on from them. Mixture draws are a closed form of the sample
number; the epoch order reads every sequence once per pass. A run stopped mid-epoch and resumed under
another layout trains on exactly the token ids of the uninterrupted run (`data.record_ids`).
"""

from __future__ import annotations

import dataclasses
import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from fivecut.config import ConfigError, load_config
from fivecut.data import store as store_module
from fivecut.data.mixture import BLOCK, Mixture, normalised
from fivecut.data.sampler import permute
from fivecut.data.sources import DataError
from fivecut.data.store import BuildOptions, open_store
from fivecut.launch import spawn
from fivecut.train.data import BatchSampler, load_tokens
from fivecut.train.resume import check_data_position
from fivecut.train.tokenizer import get_tokenizer
from fivecut.train.trainer import train

DOCS = [
    "First Citizen:\nBefore we proceed any further, hear me speak.\n",
    "All:\nSpeak, speak. Ünïcödé ✓ 日本語 🎭\n",
    "",  # an empty document is still a document (its separator)
    "You are all resolved rather to die than to famish? " * 30,
    "Resolved. resolved.\n" * 7,
] + [f"Document {i}: " + "the quick brown fox jumps over the lazy dog. " * (i % 5 + 1) for i in range(40)]
SMALL = BuildOptions(shard_tokens=97, workers=1, progress=False, unit_bytes=300)  # many shards, many units


def write_formats(root: Path) -> dict[str, str]:
    """The same documents as each source format; returns {format: data.source}."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    root.mkdir(parents=True, exist_ok=True)
    folder = root / "texts"
    folder.mkdir()
    for i, doc in enumerate(DOCS):
        (folder / f"{i:03d}.txt").write_text(doc, encoding="utf-8")
    lines = "".join(json.dumps({"id": i, "text": d}) + "\n" for i, d in enumerate(DOCS)).encode()
    (root / "docs.jsonl").write_bytes(lines)
    (root / "docs.jsonl.gz").write_bytes(gzip.compress(lines))
    (root / "docs.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines))
    shards = root / "parquet"
    shards.mkdir()
    half = len(DOCS) // 2  # two files (a glob), the second with several row groups
    pq.write_table(pa.table({"text": DOCS[:half]}), shards / "part-0.parquet")
    pq.write_table(pa.table({"text": DOCS[half:], "n": list(range(len(DOCS) - half))}), shards / "part-1.parquet", 5)
    datasets.Dataset.from_dict({"text": DOCS}).save_to_disk(str(root / "saved"))
    return {
        "text": str(folder),
        "jsonl": str(root / "docs.jsonl"),
        "jsonl.gz": str(root / "docs.jsonl.gz"),
        "jsonl.zst": str(root / "docs.jsonl.zst"),
        "parquet": str(shards / "*.parquet"),
        "saved": str(root / "saved"),
    }


def store_files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.glob("shard-*"))}


def test_every_format_gives_the_same_store_byte_for_byte(tmp_path):
    sources = write_formats(tmp_path / "data")
    tok = get_tokenizer("gpt2")
    stores = {fmt: open_store(src, "gpt2", tmp_path / "cache", SMALL) for fmt, src in sources.items()}
    two = dataclasses.replace(SMALL, workers=2)  # two worker processes, one unit each at a time
    two_workers = open_store(sources["jsonl.zst"], "gpt2", tmp_path / "cache2", two)
    reference = store_files(stores["text"].folder)
    assert len(reference) == 2 * len(stores["text"].meta["shards"]) > 8  # .bin and .idx per shard
    for fmt, store in [*stores.items(), ("two workers", two_workers)]:
        assert store_files(store.folder) == reference, fmt
        assert store.meta["content"] == stores["text"].meta["content"], fmt
    # the stream: documents joined by eot; the index: where each starts (its separator first)
    encoded = [tok.encode(d) for d in DOCS]
    expected = encoded[0] + [t for ids in encoded[1:] for t in (tok.eot_id, *ids)]
    assert np.asarray(stores["saved"].tokens()).tolist() == expected
    starts = np.cumsum([0, len(encoded[0])] + [len(ids) + 1 for ids in encoded[1:-1]])
    assert stores["parquet"].document_starts().tolist() == starts.tolist()
    size = sum(p.stat().st_size for p in stores["text"].folder.iterdir())
    assert all(r["n_tokens"] <= 97 for r in stores["text"].meta["shards"]) and size > 2 * len(expected)


class Interrupt(Exception):
    pass


def test_an_interrupted_build_goes_on_from_its_finished_shards(tmp_path, monkeypatch, capfd):
    source = write_formats(tmp_path / "data")["jsonl"]
    options = BuildOptions(shard_tokens=97, workers=1, progress=False, unit_bytes=300)
    whole = open_store(source, "gpt2", tmp_path / "whole", options)
    real, calls = store_module.tokenize_unit, []

    def dies_after_six_units(unit):
        calls.append(unit)
        if len(calls) > 6:
            raise Interrupt
        return real(unit)

    monkeypatch.setattr(store_module, "tokenize_unit", dies_after_six_units)
    with pytest.raises(Interrupt):
        open_store(source, "gpt2", tmp_path / "cache", options)
    folder = next(p for p in (tmp_path / "cache").iterdir() if p.is_dir())
    kept = json.loads((folder / "progress.json").read_text())["shards"]
    assert len(kept) >= 3 and not (folder / "store.json").exists()
    assert not [p for p in folder.iterdir() if p.name.endswith(".tmp")]  # the open shard's files removed
    (folder / kept[-1]["name"]).write_bytes(b"\0" * (2 * kept[-1]["n_tokens"]))  # a damaged last shard: redone
    monkeypatch.setattr(store_module, "tokenize_unit", real)
    capfd.readouterr()
    again = open_store(source, "gpt2", tmp_path / "cache", options)
    assert f"{len(kept) - 1} finished shards kept" in capfd.readouterr().out
    assert store_files(again.folder) == store_files(whole.folder)


def test_a_shard_damaged_during_a_run_is_refused_by_name_never_read(tmp_path):
    source = write_formats(tmp_path / "data")["jsonl"]
    load_tokens(source, "gpt2", tmp_path / "cache", 0.1, SMALL)  # built (and hashed as it was written)
    splits = load_tokens(source, "gpt2", tmp_path / "cache", 0.1, SMALL, verify=False)  # as a run opens it
    sampler = BatchSampler(splits.train, 16, 4, 0, order="epoch")
    sampler.global_batch(1)
    unread = min(set(range(15)) - splits.train.shards.checked)  # a shard step 1 did not read (hashed when first read)
    shard = splits.cache_path / f"shard-{unread:05d}.bin"
    shard.write_bytes(bytes(shard.stat().st_size))
    with pytest.raises(DataError, match=f"shard-{unread:05d}.bin does not match the sha256"):
        for step in range(2, 200):
            sampler.global_batch(step)


# ---------------------------------------------------------------------------- mixtures


def test_weights_are_normalised_and_said_and_bad_ones_refused_naming_the_key():
    weights, note = normalised([3, 1], 2)
    assert weights == (0.75, 0.25) and note == "data.weights [3, 1] sum to 4, not 1; normalised to [0.75, 0.25]"
    assert normalised([0.5, 0.5], 2)[1] is None
    for bad, words in (([1, -1], "data.weights[1] = -1 is negative"), ([1], "1 weights for 2 sources")):
        with pytest.raises(DataError, match=words.replace("[", r"\[")):
            normalised(bad, 2)
    with pytest.raises(ConfigError, match="data.weights wants list"):
        load_config(None, ['data.weights=[1, "x"]'])


def test_mixture_draws_are_a_closed_form_of_the_sample_number():
    mixture = Mixture.of(normalised([0.7, 0.2, 0.1], 3)[0])
    assert mixture.counts.tolist() == [45875, 13107, 6554] and mixture.counts.sum() == BLOCK
    samples = np.arange(3 * BLOCK + 1234)
    source, before = mixture.draw(samples)
    seen = np.zeros(3, dtype=np.int64)  # a sequential count agrees with the closed form
    for k, b in zip(source[:5000], before[:5000]):
        assert b == seen[k]
        seen[k] += 1
    tail = np.arange(2 * BLOCK, 3 * BLOCK)
    assert np.bincount(mixture.draw(tail)[0], minlength=3).tolist() == mixture.counts.tolist()
    window = np.bincount(source[:1000], minlength=3)  # evenly spread: any 1000 samples within a few of 70/20/10
    assert np.abs(window - [700, 200, 100]).max() <= 2


def test_a_small_source_repeats_and_says_how_often():
    big, small = np.arange(10_001, dtype=np.uint16), np.arange(2_001, dtype=np.uint16)  # 1000 and 200 sequences
    sampler = BatchSampler([big, small], 10, 8, 0, order="epoch", weights=[0.5, 0.5])
    lines = sampler.lines(["big", "small"])
    assert lines == ["data source 'small' (weight 0.5) has 200 sequences, too few for its weight: it repeats 5 times "
                     "per epoch"]  # fmt: skip


# ---------------------------------------------------------------------------- epochs


@pytest.mark.parametrize("n", [1, 2, 3, 17, 1000, 4099])
def test_the_permutation_is_a_bijection(n):
    keys = np.random.default_rng(n).integers(0, 1 << 63, 4, dtype=np.uint64)
    out = permute(np.arange(n), n, keys)
    assert sorted(out.tolist()) == list(range(n))
    assert n < 17 or (out != np.arange(n)).mean() > 0.9  # shuffled


def test_an_epoch_reads_every_sequence_once_then_another_order():
    tokens = np.arange(50 * 16 + 1, dtype=np.uint16)  # 50 sequences of 16
    sampler = BatchSampler(tokens, 16, 5, 3, order="epoch")
    starts = np.concatenate([sampler.offsets(step) for step in range(1, 21)])  # two epochs
    first, second = starts[:50], starts[50:]
    assert sorted(first.tolist()) == list(range(0, 800, 16)) == sorted(second.tolist())
    assert first.tolist() != second.tolist()
    assert sampler.position(10) == {"order": "epoch", "samples": 50, "epoch": 1, "index": 0, "sequences": [50],
                                    "content": []}  # fmt: skip
    x, y = sampler.global_batch(1)
    assert (x[:, 1:] == y[:, :-1]).all() and (y[:, -1] == x[:, -1] + 1).all()  # windows overlap by one


def test_a_changed_store_is_refused_on_resume_unless_overridden():
    tokens = np.arange(50 * 16 + 1, dtype=np.uint16)
    saved = BatchSampler(tokens, 16, 5, 3, order="epoch", content=("a" * 64,)).position(4)
    now = BatchSampler(tokens[:-16], 16, 5, 3, order="epoch", content=("b" * 64,)).position(4)
    meta = {"step": 4, "data": saved}
    check_data_position(meta, saved, [])
    with pytest.raises(ConfigError, match="resuming at step 4 with other data: the checkpoint read epoch 0 index 20"):
        check_data_position(meta, now, [])
    check_data_position(meta, now, ["data.source"])


# ---------------------------------------------------------------------------- resume


def trained_ids(out: Path) -> dict[int, dict[int, list]]:
    """step -> global row -> its input ids, merged over every rank's record (copies must agree)."""
    steps: dict[int, dict[int, list]] = {}
    for path in sorted(out.glob("data-ids-rank*.jsonl")):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            rows = steps.setdefault(record["step"], {})
            for row, ids in zip(record["rows"], record["inputs"]):
                assert rows.setdefault(row, ids) == ids
    return steps


def mixture_config(cache: Path, sources: list[str], out: Path, *extra: str):
    return load_config(
        None,
        [
            'model.preset="tiny"',
            'data.tokenizer="byte"',
            f"data.source={json.dumps(sources)}",
            "data.weights=[0.75, 0.25]",
            'data.order="epoch"',
            "data.val_fraction=0.1",
            "data.record_ids=true",
            f'data.cache_dir="{cache}"',
            "train.steps=6",
            "train.seq_len=16",
            "train.global_batch=4",
            "train.eval_every=0",
            "train.warmup=1",
            f'log.out_dir="{out}"',
            "log.progress=false",
            "log.plot=false",
            *extra,
        ],
    )


def run(cfg, resume: str = "never"):
    return train(cfg, quiet=True, resume=resume).losses


@pytest.mark.multirank
def test_a_run_stopped_mid_epoch_and_resumed_under_another_layout_reads_the_same_ids(tmp_path):
    sources = write_formats(tmp_path / "data")
    two = [sources["jsonl"], sources["parquet"]]
    cache = tmp_path / "cache"
    whole = mixture_config(cache, two, tmp_path / "whole")
    load_tokens(two[0], "byte", cache, 0.1)  # built once here, then read by every rank
    load_tokens(two[1], "byte", cache, 0.1)
    spawn(run, 1, whole)
    ck = f'checkpoint.dir="{tmp_path / "ck"}"'
    first = mixture_config(cache, two, tmp_path / "part", ck, "parallel.dp=2", "train.launch_steps=3")
    spawn(run, 2, first, "auto")
    second = mixture_config(cache, two, tmp_path / "part", ck, "parallel.tp=2", "train.accumulate=2")
    spawn(run, 2, second, "auto")
    expected, got = trained_ids(tmp_path / "whole"), trained_ids(tmp_path / "part")
    sequences = BatchSampler(
        [load_tokens(s, "byte", cache, 0.1).train for s in two], 16, 4, 0, order="epoch", weights=[0.75, 0.25]
    ).sequence_order.sequences
    assert 6 * 4 < sum(sequences)  # stopped mid-epoch
    assert sorted(expected) == sorted(got) == list(range(1, 7))
    for step in expected:
        assert expected[step] == got[step], f"step {step}"


def test_data_build_builds_the_stores_ahead_of_a_run_once(tmp_path, capsys):
    from fivecut.cli import main

    sources = write_formats(tmp_path / "data")
    argv = ["data", "build", "--set", f"data.source={json.dumps([sources['jsonl.gz'], sources['saved']])}"]
    argv += ["--set", 'data.tokenizer="gpt2"', "--set", f'data.cache_dir="{tmp_path / "cache"}"']
    assert main(argv) == 0
    out, err = capsys.readouterr()
    lines = [line for line in out.splitlines() if not line.startswith("fivecut: ")]
    assert len(lines) == 2 and all("1,849 tokens, 45 documents" in line for line in lines), out
    assert out.count("fivecut: built token store") == 2 and "Traceback" not in err
    assert main(argv) == 0 and "built token store" not in capsys.readouterr().out  # reused
