"""The data source's doors (issue 42): `.json` files as JSON lines or one array, damaged compressed
files, a missing `zstandard`, an unwritable cache for `fivecut data build`, an open that trusts the
inputs' (size, mtime_ns, inode) instead of hashing them, and a loss-mask file damaged before the
store opens and during a run. Each refusal is one line naming the file, key or flag, and a fix.
"""

from __future__ import annotations

import gzip
import json
import os
import random
import re
import sys
from pathlib import Path

import pytest
from test_bad_input_data import jsonl, refused

from fivecut.cli import main
from fivecut.data import store as store_module
from fivecut.data.chat import ChatTemplate
from fivecut.data.sources import DataError
from fivecut.data.store import BuildOptions, open_store
from fivecut.train.data import BatchSampler, load_tokens

ONE = BuildOptions(workers=1, progress=False)
DOCS = ["First document.\n", 'a "quoted" one, a \\ and ünïcödé ✓', "", "the last\n\nwith a blank line"]
WORDS = "the a cat dog sat ran on mat log sun moon red blue big small why how what yes no ok".split()


def compressed(path: Path, data: bytes) -> str:
    """`data` written to `path`, compressed as its suffix says."""
    import zstandard

    if path.name.endswith(".gz"):
        data = gzip.compress(data)
    elif path.name.endswith(".zst"):
        data = zstandard.ZstdCompressor(write_checksum=True).compress(data)  # as the zstd tool writes
    path.write_bytes(data)
    return str(path)


def content(source: str, cache: Path) -> str:
    return open_store(source, "byte", cache, ONE).meta["content"]


# ---------------------------------------------------------------------------- .json


@pytest.mark.parametrize("suffix", [".json", ".json.gz", ".json.zst"])
def test_a_json_file_is_read_as_json_lines_or_as_an_array(tmp_path, suffix):
    reference = content(jsonl(tmp_path, *[json.dumps({"text": d}) for d in DOCS]), tmp_path / "cache")
    lines = "".join(json.dumps({"id": i, "text": d}) + "\n" for i, d in enumerate(DOCS))
    array = "\n  " + json.dumps([{"text": d, "id": i} for i, d in enumerate(DOCS)], indent=2)
    for name, text in (("lines", lines), ("array", array)):
        source = compressed(tmp_path / f"{name}{suffix}", text.encode())
        assert content(source, tmp_path / "cache") == reference, name


def test_a_json_file_that_begins_with_a_byte_order_mark_is_read_as_its_records(tmp_path):
    """A UTF-8 byte order mark (what Windows editors and some exporters put first) is no character: the
    file is JSON lines or an array by what follows it. Caught: the form told by the mark's first byte,
    which refuses the file as neither."""
    reference = content(jsonl(tmp_path, *[json.dumps({"text": d}) for d in DOCS]), tmp_path / "cache")
    lines = "".join(json.dumps({"text": d}) + "\n" for d in DOCS)
    array = json.dumps([{"text": d} for d in DOCS])
    for name, text in (("lines", lines), ("array", array)):
        path = tmp_path / f"{name}.json"
        path.write_bytes(b"\xef\xbb\xbf" + text.encode())
        assert content(str(path), tmp_path / "cache") == reference, name


@pytest.mark.parametrize(
    "text,words",
    [
        ("just some prose", "is neither JSON lines nor a JSON array (it begins with 'j')"),
        ('[{"text": "one"}, {"body": "two"}]', ":2 has no field 'text' (it has: body)"),
        ('[{"text": "one"}, "two"]', ":2 has no field 'text' (it has: str)"),
        ('[{"text": "one"}, {"text": "two"', "is not a valid JSON array"),
        ('[{"text": "one"}, {"text": 2}]', ":2: field 'text' is int, not a string"),
    ],
)
def test_a_json_file_that_is_not_records_is_refused_naming_it(capsys, tmp_path, text, words):
    path = tmp_path / "train.json"
    path.write_text(text)
    err = refused(capsys, tmp_path, f'data.source="{path}"')
    assert str(path) in err and words in err


# ---------------------------------------------------------------------------- damaged and unreadable


def numbered_lines(n: int) -> bytes:
    r = random.Random(0)  # words at random: the file does not compress to nothing
    return "".join(json.dumps({"text": " ".join(r.choices(WORDS, k=12))}) + "\n" for _ in range(n)).encode()


@pytest.mark.parametrize("suffix", [".jsonl.gz", ".jsonl.zst"])
@pytest.mark.parametrize("damage", ["truncated", "corrupt", "corrupt first block"])
def test_a_damaged_compressed_file_is_refused_naming_it_and_where(capsys, tmp_path, suffix, damage):
    """Truncated; 16 bytes zeroed in the middle (gzip: its CRC fails at the end, BadGzipFile); 16 bytes
    of 0xff after the header (gzip: a deflate block that does not decode, zlib.error)."""
    lines = 20_000
    path = Path(compressed(tmp_path / f"docs{suffix}", numbered_lines(lines)))
    data = bytearray(path.read_bytes())
    if damage == "truncated":
        data = data[: len(data) // 2]
    elif damage == "corrupt":
        data[len(data) // 2 : len(data) // 2 + 16] = bytes(16)
    else:
        data[12:28] = b"\xff" * 16
    path.write_bytes(bytes(data))
    err = refused(capsys, tmp_path, f'data.source="{path}"')
    assert f"{path} is truncated or corrupt" in err and "copy or download it again" in err
    read = int(re.search(r"broke off after ([\d,]+) lines", err)[1].replace(",", ""))
    assert 0 < read < lines or damage != "truncated"  # a truncation is placed (a checksum is checked at the end)


def test_a_zst_file_of_several_frames_is_read_whole(tmp_path):
    """pzstd, and `cat a.zst b.zst`, write several zstd frames one after the other: every frame's
    documents are read, as zstd -d reads them. Caught: the bytes after the first frame's end dropped."""
    import zstandard

    data = numbered_lines(300)
    cut = data.index(b"\n", len(data) // 3) + 1, data.index(b"\n", 2 * len(data) // 3) + 1
    parts = data[: cut[0]], data[cut[0] : cut[1]], data[cut[1] :]
    frames = tmp_path / "frames.jsonl.zst"
    frames.write_bytes(b"".join(zstandard.ZstdCompressor(write_checksum=True).compress(p) for p in parts))
    whole = tmp_path / "whole.jsonl"
    whole.write_bytes(data)
    assert content(str(frames), tmp_path / "cache") == content(str(whole), tmp_path / "cache")


def test_a_zst_source_without_zstandard_is_refused_with_the_fix(capsys, tmp_path, monkeypatch):
    path = compressed(tmp_path / "docs.jsonl.zst", numbered_lines(3))
    monkeypatch.setitem(sys.modules, "zstandard", None)  # `import zstandard` fails
    err = refused(capsys, tmp_path, f'data.source="{path}"')
    assert f"{path} is zstd-compressed" in err and "pip install zstandard" in err


@pytest.mark.parametrize("where", ["file", "under a file"])
def test_data_build_into_a_cache_dir_it_cannot_write_is_refused_naming_the_key(capsys, tmp_path, where):
    source = jsonl(tmp_path, json.dumps({"text": "one"}))
    blocker = tmp_path / "blocker"
    blocker.write_text("keep me")
    cache = blocker if where == "file" else blocker / "cache"
    argv = ["data", "build", "--set", f'data.source="{source}"', "--set", 'data.tokenizer="byte"']
    capsys.readouterr()
    assert main([*argv, "--set", f'data.cache_dir="{cache}"']) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in err, err
    assert "data.cache_dir" in errors[0] and str(blocker) in errors[0]
    assert blocker.read_text() == "keep me"  # nothing the user has is overwritten


# ---------------------------------------------------------------------------- opening trusts the build's hash


@pytest.mark.parametrize("change", ["content and mtime", "content, mtime put back", "same bytes, new inode"])
def test_an_open_does_not_read_unchanged_inputs_and_a_changed_one_is_hashed(tmp_path, monkeypatch, change):
    path = Path(jsonl(tmp_path, *[json.dumps({"text": d}) for d in DOCS]))
    other = Path(jsonl(tmp_path, json.dumps({"text": "a second file"}), name="other.jsonl"))
    source = str(tmp_path / "*.jsonl")
    real, hashed = store_module.file_sha256, []
    monkeypatch.setattr(store_module, "file_sha256", lambda p: hashed.append(Path(p)) or real(p))
    built = open_store(source, "byte", tmp_path / "cache", ONE)
    assert {path, other} <= set(hashed)  # the build hashes every input
    hashed.clear()
    opened = open_store(source, "byte", tmp_path / "cache", ONE)
    assert opened.folder == built.folder and not {path, other} & set(hashed)  # trusted: not read
    before = path.stat()
    if change == "same bytes, new inode":  # the same bytes and mtime in a new file put in its place
        copy = tmp_path / "copy"
        copy.write_bytes(path.read_bytes())
        os.utime(copy, ns=(before.st_atime_ns, before.st_mtime_ns))
        os.replace(copy, path)
    else:  # other text of the same size, in place: a later mtime, or the old one put back (the ctime moves)
        path.write_bytes(path.read_bytes().replace(b"First", b"Fir5t"))
        later = before.st_mtime_ns + (1_000_000_000 if change == "content and mtime" else 0)
        os.utime(path, ns=(before.st_atime_ns, later))
    assert path.stat().st_size == before.st_size
    hashed.clear()
    again = open_store(source, "byte", tmp_path / "cache", ONE)
    assert path in hashed and other not in hashed
    assert (again.folder == built.folder) == (change == "same bytes, new inode")  # new content: a new store


# ---------------------------------------------------------------------------- loss masks, before and during a run

SPECIAL = ["[UNK]", "<|im_start|>", "<|im_end|>"]
ROLES = ["system", "user", "assistant"]
TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def chat_tokenizer():
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    from fivecut.train.tokenizer import FileTokenizer

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(SPECIAL + ROLES + WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL[1:]])
    return FileTokenizer(tok, eot_id=2, source="test")


@pytest.fixture
def chat_store(tmp_path):
    """A chat store of 200 conversations in many small shards: (source, tokenizer, options, its folder)."""
    r = random.Random(0)
    chats = [
        [{"role": "user", "content": " ".join(r.choices(WORDS, k=5))}, {"role": "assistant", "content": "ok yes"}]
        for _ in range(200)
    ]
    source = tmp_path / "chats.jsonl"
    source.write_text("".join(json.dumps({"messages": m}) + "\n" for m in chats))
    tok = chat_tokenizer()
    options = BuildOptions(chat=ChatTemplate(TEMPLATE, "test"), workers=1, progress=False, shard_tokens=300)
    store = open_store(str(source), tok, tmp_path / "cache", options)
    assert len(store.meta["shards"]) > 8 and "mask" in store.meta["shards"][0]
    return str(source), tok, options, store.folder


def test_chat_data_as_a_json_array_gives_the_same_store(tmp_path, chat_store):
    source, tok, options, folder = chat_store
    records = [json.loads(line) for line in Path(source).read_text().splitlines()]
    array = tmp_path / "chats.json"
    array.write_text(json.dumps(records, indent=1))
    store = open_store(str(array), tok, tmp_path / "cache", options)
    jsonl_meta = json.loads((folder / "store.json").read_text())
    assert store.folder != folder and store.meta["content"] == jsonl_meta["content"]  # the same ids and masks


def test_a_mask_damaged_before_the_store_opens_is_refused_by_name(tmp_path, chat_store):
    source, tok, options, folder = chat_store
    mask = folder / "shard-00003.mask"
    mask.write_bytes(bytes(mask.stat().st_size))  # every token out of the loss, the same size
    with pytest.raises(DataError, match=f"{mask} does not match the sha256"):
        open_store(source, tok, tmp_path / "cache", options)


def test_a_mask_damaged_during_a_run_is_refused_by_name_never_read(tmp_path, chat_store):
    source, tok, options, folder = chat_store
    splits = load_tokens(source, tok, tmp_path / "cache", 0.1, options, verify=False)  # as a run opens it
    sampler = BatchSampler(splits.train, 16, 4, 0, order="epoch", masks=[splits.train_mask])
    sampler.global_batch(1)
    n_train = len(splits.train.shards.records) - 2  # shards the training split surely reaches
    unread = min(set(range(n_train)) - splits.train.shards.checked)  # step 1 did not read it: hashed when first read
    mask = folder / f"shard-{unread:05d}.mask"
    mask.write_bytes(bytes(mask.stat().st_size))
    with pytest.raises(DataError, match=f"shard-{unread:05d}.mask does not match the sha256"):
        for step in range(2, 200):
            sampler.global_batch(step)


class Killed(Exception):
    pass


def test_a_chat_build_killed_after_its_last_shard_finishes_on_the_next_open(tmp_path, chat_store, monkeypatch):
    """A build killed after its last shard and before store.json: the next open keeps every shard and
    tokenizes nothing; the loss tokens it counts are the kept shards' (`chat_note`), so it finishes
    the same store, not a refusal that the template trains on nothing. Caught: a resumed build that
    counts only the units it tokenized itself."""
    source, tok, options, folder = chat_store

    def killed(*args):
        raise Killed

    real = store_module.store_meta
    monkeypatch.setattr(store_module, "store_meta", killed)
    with pytest.raises(Killed):
        open_store(source, tok, tmp_path / "again", options)
    monkeypatch.setattr(store_module, "store_meta", real)
    store = open_store(source, tok, tmp_path / "again", options)
    assert store.meta["content"] == json.loads((folder / "store.json").read_text())["content"]
