"""The token store: a source tokenized once into a folder of shards, shared by every rank and run.

    store = open_store("web/*.jsonl.zst", "gpt2", "~/.cache/fivecut")   # builds it once, then reuses it
    tokens = store.tokens()            # one stream over every shard, read through memmaps
    tokens[a:b], tokens[idx]           # a view; the ids at an int array of positions (any shape)

Layout of `<cache_dir>/<tokenizer>-<key>/`:

    shard-00000.bin   ids, little-endian uint16 (uint32 for vocabularies over 65,536), at most
                      `shard_tokens` of them; the stream is every shard's ids in order
    shard-00000.idx   uint64: where each document that starts in this shard starts in the stream
                      (its first token is the eot separator, except for the stream's first document)
    store.json        written last: tokenizer, dtype, totals, each shard's size and the sha256 of
                      its .bin and .idx, `content`: one sha256 over all of them, and `inputs`:
                      each input file's path, sha256 and (size, mtime_ns, ctime_ns, inode) when hashed
    progress.json     while a build runs: the finished shards and where the next one starts

Documents are joined as the single-file cache joined them: the tokenizer's eot id before every
document but the first (no separator when the tokenizer has none). The key hashes the tokenizer's
identity, `text_field`, `shard_tokens` and every input file's path and sha256.

The inputs' content is checked by the build, which hashes every byte of them. An open trusts it: an
input whose (size, mtime_ns, ctime_ns, inode) equals what a finished store in the same cache_dir
recorded is taken to hold the content hashed then, and is not read (minutes saved at every launch on
tens of GB); an input where any of them differs is hashed again, and new content is a new key, so a
new store. The ctime is there because a program can put an mtime back (`touch -r`, an in-place
restore) but not a ctime: any write or utime moves it.

Building: the sources are cut into work units (`fivecut.data.sources.plan_units`) that a pool of
`workers` processes tokenizes with the tokenizer's batch encoding; results come back in unit order,
at most two per worker in flight, and are appended to the open shard, so memory holds a few units,
never the corpus. A finished shard is renamed into place and recorded in progress.json; a build
that is interrupted starts again after its last finished shard whose sha256 still matches. One
process per node builds (an exclusive `flock` on `<folder>.lock`); the others wait for it and then
read the finished store. Opening a finished store checks every shard against store.json; a shard
that does not match is refused by name (DataError: exit 2), and so is one that changes later: a
`TokenStream` hashes each shard again before it first reads from it.

Instruction data (`BuildOptions.chat`, `fivecut.data.chat`) adds one file per shard:

    shard-00000.mask  uint8, one per id at the same offsets: 1 where the id is a loss target (an
                      assistant's reply), 0 elsewhere (prompts, template headers, separators);
                      listed in store.json with its sha256 beside the .bin's and hashed like it

and `TokenStream.loss_mask()` reads it at the same positions as the ids.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import hashlib
import itertools
import json
import multiprocessing
import os
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from fivecut.data.chat import ChatTemplate, Targets, encode_chat_unit, refuse_untrained, untrained_note
from fivecut.data.sources import (
    JSON,
    JSONL,
    UNIT_BYTES,
    DataError,
    SourceFile,
    Unit,
    plan_units,
    read_unit,
    resolve_source,
)
from fivecut.train.tokenizer import TOKENIZERS, Tokenizer, get_tokenizer

STORE_VERSION = 1  # bump when the layout or the tokenization rules change
SHARD_TOKENS = 1 << 28  # 512 MiB of uint16 ids per shard
SMALL_TOKENS = np.dtype("<u2")  # ids 0..65535
LARGE_TOKENS = np.dtype("<u4")  # bigger vocabularies (Llama 3: 128,256)
INDEX = np.dtype("<u8")
MASK = np.dtype("u1")
META, PROGRESS = "store.json", "progress.json"


def token_dtype(vocab_size: int) -> np.dtype:
    return SMALL_TOKENS if vocab_size <= int(np.iinfo(SMALL_TOKENS).max) + 1 else LARGE_TOKENS


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with Path(path).open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def available_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@dataclass(frozen=True)
class BuildOptions:
    text_field: str = "text"
    shard_tokens: int = SHARD_TOKENS
    workers: int = 0  # worker processes; 0: one per core
    progress: bool = True  # a bar in tokens/s on stderr, when it is a terminal
    unit_bytes: int | None = None  # text per work unit (None: the sources module's default)
    chat: ChatTemplate | None = None  # chat-formatted JSONL rendered with this template, with loss masks


# ---------------------------------------------------------------------------- reading


class ShardSet:
    """Every shard's ids as a read-only memmap, each hashed against store.json before it is first read."""

    def __init__(self, folder: Path, meta: dict, verified: bool):
        self.folder = folder
        self.records = meta["shards"]
        dtype = np.dtype(meta["dtype"])
        self.arrays = [
            np.memmap(folder / r["name"], dtype=dtype, mode="r", shape=(r["n_tokens"],)) if r["n_tokens"] else None
            for r in self.records
        ]
        self.masks = (
            [
                np.memmap(folder / r["mask"], dtype=MASK, mode="r", shape=(r["n_tokens"],)) if r["n_tokens"] else None
                for r in self.records
            ]
            if self.records and "mask" in self.records[0]
            else None
        )
        self.starts = np.cumsum([0] + [r["n_tokens"] for r in self.records])  # [n_shards + 1]
        self.checked = set(range(len(self.records))) if verified else set()

    def check(self, shard: int) -> None:
        if shard in self.checked:
            return
        record = self.records[shard]
        for name, digest in shard_files(record):
            if file_sha256(self.folder / name) != digest:
                raise DataError(corrupt_message(self.folder, name))
        self.checked.add(shard)


def shard_files(record: dict) -> list[tuple[str, str]]:
    """(name, sha256) of a shard's ids and, in a chat store, its loss mask."""
    mask = [(record["mask"], record["mask_sha256"])] if "mask" in record else []
    return [(record["name"], record["sha256"]), *mask]


def corrupt_message(folder: Path, name: str) -> str:
    return (
        f"token store shard {folder / name} does not match the sha256 in {folder / META} (corrupted); it is never "
        f"trained on: remove the folder {folder} and run again (or `fivecut data build`) to rebuild it"
    )


class TokenStream:
    """Positions [start, stop) of a store's stream; behaves as a 1-D read-only id array for slicing
    (`tokens[a:b]`, a view) and gathering (`tokens[idx]`, idx an int array of any shape)."""

    ndim = 1

    def __init__(self, shards: ShardSet, start: int = 0, stop: int | None = None, mask: bool = False):
        self.shards = shards
        self.start = start
        self.stop = int(shards.starts[-1]) if stop is None else stop
        self.mask = mask  # this stream reads the loss mask (uint8), not the ids
        self.arrays = shards.masks if mask else shards.arrays
        if mask:
            self.dtype = MASK
        else:
            self.dtype = shards.arrays[0].dtype if shards.arrays and shards.arrays[0] is not None else SMALL_TOKENS

    def loss_mask(self) -> TokenStream | None:
        """The same positions' loss mask (1: a target the loss counts), None for a store without one."""
        return None if self.shards.masks is None else TokenStream(self.shards, self.start, self.stop, mask=True)

    def __len__(self) -> int:
        return self.stop - self.start

    @property
    def shape(self) -> tuple[int]:
        return (len(self),)

    def __getitem__(self, key):
        if isinstance(key, slice):
            a, b, step = key.indices(len(self))
            if step != 1:
                raise ValueError("a token stream is sliced with step 1 only")
            return TokenStream(self.shards, self.start + a, self.start + max(a, b), self.mask)
        if isinstance(key, int | np.integer):
            return self.gather(np.asarray([key]))[0]
        return self.gather(np.asarray(key))

    def gather(self, idx: np.ndarray) -> np.ndarray:
        """The ids at positions `idx` (relative to this view), shaped like `idx`."""
        flat = idx.reshape(-1).astype(np.int64)
        if flat.size and (flat.min() < 0 or flat.max() >= len(self)):
            raise IndexError(f"token position out of range 0..{len(self) - 1}")
        flat = flat + self.start
        shard = np.searchsorted(self.shards.starts, flat, side="right") - 1  # [n]
        out = np.empty(flat.shape, dtype=self.dtype)
        for s in np.unique(shard):
            self.shards.check(int(s))
            here = shard == s
            out[here] = self.arrays[s][flat[here] - self.shards.starts[s]]
        return out.reshape(idx.shape)

    def check_span(self, starts: np.ndarray, length: int) -> None:
        """Hash (once per process) every shard that windows [start, start + length) touch."""
        first = np.asarray(starts, dtype=np.int64) + self.start
        lo = np.searchsorted(self.shards.starts, first, side="right") - 1
        hi = np.searchsorted(self.shards.starts, first + length - 1, side="right") - 1
        for s in sorted({int(k) for a, b in zip(lo, hi) for k in range(a, b + 1)}):
            self.shards.check(s)

    def tolist(self) -> list[int]:
        return np.asarray(self).tolist()

    def __array__(self, dtype=None, copy=None):
        out = self.gather(np.arange(len(self)))
        return out.astype(dtype) if dtype is not None else out


@dataclass
class Store:
    folder: Path
    meta: dict
    verified: bool = False
    _shards: ShardSet | None = field(default=None, repr=False)

    @property
    def n_tokens(self) -> int:
        return self.meta["n_tokens"]

    @property
    def n_docs(self) -> int:
        return self.meta["n_docs"]

    def tokens(self) -> TokenStream:
        if self._shards is None:
            self._shards = ShardSet(self.folder, self.meta, self.verified)
        return TokenStream(self._shards)

    def document_starts(self) -> np.ndarray:
        """Where each document starts in the stream (uint64), every shard's index concatenated."""
        parts = [np.fromfile(self.folder / r["index"], dtype=INDEX) for r in self.meta["shards"]]
        return np.concatenate(parts) if parts else np.zeros(0, INDEX)

    def verify(self) -> None:
        """Every shard and index against store.json (sizes and sha256); the first mismatch refused by name."""
        for r in self.meta["shards"]:
            for name, digest, size in (
                (r["name"], r["sha256"], r["n_tokens"] * np.dtype(self.meta["dtype"]).itemsize),
                (r["index"], r["index_sha256"], r["n_docs"] * INDEX.itemsize),
                *([(r["mask"], r["mask_sha256"], r["n_tokens"])] if "mask" in r else []),
            ):
                path = self.folder / name
                if not path.is_file() or path.stat().st_size != size or file_sha256(path) != digest:
                    raise DataError(corrupt_message(self.folder, name))
        self.verified = True


def store_key(tokenizer: str, inputs: list[dict], options: BuildOptions) -> str:
    h = hashlib.sha256(f"fivecut-store-v{STORE_VERSION}\0{tokenizer}\0{options.text_field}".encode())
    h.update(f"\0{options.shard_tokens}".encode())
    if options.chat is not None:  # the same files rendered with another template are another store
        h.update(f"\0chat\0{options.chat.digest}".encode())
    for r in inputs:
        h.update(f"\0{r['path']}\0{r['sha256']}".encode())
    return h.hexdigest()[:16]


def input_records(files: list[SourceFile], cache_dir: Path) -> list[dict]:
    """Each input's {path, stat, sha256}; the sha256 recorded by a store of `cache_dir` for the same
    path and stat is trusted (see the module docstring), any other input is hashed."""
    known = recorded_inputs(cache_dir)
    records = []
    for f in files:
        stat = input_stat(f.path)  # before the hash: a file changed while it is hashed differs next time
        digest = known.get((str(f.path), json.dumps(stat)))
        if digest is None:
            digest = file_sha256(f.path) if f.path.is_file() else folder_sha256(f.path)
        records.append({"path": str(f.path), "stat": stat, "sha256": digest})
    return records


def input_stat(path: Path) -> list:
    """[size, mtime_ns, ctime_ns, inode] of a file; of a saved dataset's folder, [name, ...] of each file."""
    if path.is_file():
        st = path.stat()
        return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]
    return [[str(p.relative_to(path)), *input_stat(p)] for p in sorted(q for q in path.rglob("*") if q.is_file())]


def recorded_inputs(cache_dir: Path) -> dict[tuple[str, str], str]:
    """(path, stat as JSON) -> sha256 of every input recorded by a finished store in `cache_dir`."""
    known = {}
    for meta_file in cache_dir.glob(f"*/{META}"):
        for r in (read_meta(meta_file.parent) or {}).get("inputs", ()):
            known[(r["path"], json.dumps(r["stat"]))] = r["sha256"]
    return known


def folder_sha256(folder: Path) -> str:
    """A saved dataset's folder: every file's name and sha256."""
    h = hashlib.sha256()
    for p in sorted(q for q in folder.rglob("*") if q.is_file()):
        h.update(f"{p.relative_to(folder)}\0{file_sha256(p)}\0".encode())
    return h.hexdigest()


def read_meta(folder: Path) -> dict | None:
    try:
        meta = json.loads((folder / META).read_text())
    except (OSError, ValueError):
        return None
    return meta if meta.get("version") == STORE_VERSION else None


def open_store(
    source: str,
    tokenizer: str | Tokenizer,
    cache_dir: str | Path,
    options: BuildOptions | None = None,
    verify: bool = True,
) -> Store:
    """The store of `source` under `tokenizer`, built first when it is missing or unfinished (by one
    process per node; the others wait), then checked against its sha256s (`verify`; else each shard
    is checked before it is first read)."""
    if isinstance(tokenizer, str) and tokenizer not in TOKENIZERS:
        raise ValueError(f"unknown tokenizer {tokenizer!r}; choose one of {', '.join(TOKENIZERS)}")
    options = options or BuildOptions()
    if options.shard_tokens < 1:
        raise DataError(f"data.shard_tokens={options.shard_tokens}; give a positive number of tokens per shard")
    name = tokenizer if isinstance(tokenizer, str) else tokenizer.name
    files = resolve_source(source)
    cache_dir = Path(cache_dir).expanduser()
    cache_dir.mkdir(parents=True, exist_ok=True)
    inputs = input_records(files, cache_dir)
    folder = cache_dir / f"{name}-{store_key(name, inputs, options)}"
    meta, built = read_meta(folder), False
    if meta is None:
        with build_lock(folder):
            meta = read_meta(folder)  # another process may have finished it while this one waited
            if meta is None:
                tok = get_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
                meta, built = build(folder, files, inputs, tok, options), True
    store = Store(folder, meta, verified=built)  # a build hashed every byte it wrote
    if verify and not built:
        store.verify()
    return store


@contextlib.contextmanager
def build_lock(folder: Path):
    """An exclusive lock on `<folder>.lock`: one builder per node; the others wait for it."""
    with open(folder.with_name(folder.name + ".lock"), "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"fivecut: waiting for another process building the token store {folder}", flush=True)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# ---------------------------------------------------------------------------- building


_WORKER: dict = {}  # a worker process's tokenizer, text field and dtype (set once by `start_worker`)


def start_worker(tokenizer: str | Tokenizer, text_field: str, dtype: str, chat: ChatTemplate | None = None) -> None:
    tok = get_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
    _WORKER.update(tokenizer=tok, text_field=text_field, dtype=np.dtype(dtype), chat=chat)


def tokenize_unit(unit: Unit) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, list[str]]:
    """(ids, lengths, mask, untrained): the unit's documents, each after the eot separator, each one's
    length with its separator, and (chat data) each id's loss mask, 0 on the separators, else None;
    and the file:line of each conversation with no loss token."""
    tok, dtype, chat = _WORKER["tokenizer"], _WORKER["dtype"], _WORKER["chat"]
    if chat is None:
        docs = list(read_unit(unit, _WORKER["text_field"]))
        encoded = tok.encode_batch(docs) if hasattr(tok, "encode_batch") else [tok.encode(d) for d in docs]
        masks, untrained = None, []
    else:
        encoded, masks, untrained = encode_chat_unit(unit, tok, chat)
    sep = () if tok.eot_id is None else (tok.eot_id,)
    lengths = np.fromiter((len(ids) + len(sep) for ids in encoded), dtype=np.int64, count=len(encoded))
    total = int(lengths.sum())
    ids = np.fromiter(itertools.chain.from_iterable(itertools.chain(sep, e) for e in encoded), dtype, count=total)
    if masks is None:
        return ids, lengths, None, untrained
    unmasked = (0,) * len(sep)  # the separator is never a target
    mask = np.fromiter(itertools.chain.from_iterable(itertools.chain(unmasked, m) for m in masks), MASK, count=total)
    return ids, lengths, mask, untrained


def tokenized(units: list[Unit], workers: int, init: tuple):
    """Each unit's (ids, lengths), in order; `workers` processes, at most two units each in flight."""
    if workers == 1:
        start_worker(*init)
        yield from map(tokenize_unit, units)
        return
    # fork, as torch's DataLoader workers: no re-import of __main__, the tokenizer's files read once
    context = multiprocessing.get_context("fork")
    pool = ProcessPoolExecutor(workers, mp_context=context, initializer=start_worker, initargs=init)
    try:
        todo = iter(units)
        pending = collections.deque(pool.submit(tokenize_unit, u) for u in itertools.islice(todo, 2 * workers))
        while pending:
            result = pending.popleft().result()
            for u in itertools.islice(todo, 1):
                pending.append(pool.submit(tokenize_unit, u))
            yield result
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


class ShardWriter:
    """Appends ids and document starts to the open shard, closing it at `shard_tokens` ids."""

    def __init__(self, folder: Path, dtype: np.dtype, shard_tokens: int, kept: list[dict], plan: int):
        self.folder, self.dtype, self.shard_tokens, self.plan = folder, dtype, shard_tokens, plan
        self.shards = kept
        self.position = sum(r["n_tokens"] for r in kept)  # ids written so far (the stream's length)
        self.docs = sum(r["n_docs"] for r in kept)
        self.open = None

    def resume_point(self) -> tuple[int, int]:
        """(unit, ids of that unit's output already in kept shards) to start from."""
        if not self.shards:
            return 0, 0
        return tuple(self.shards[-1]["end"])

    def add(self, ids: np.ndarray, starts: np.ndarray, unit: int, used: int, mask: np.ndarray | None = None) -> None:
        """ids (and their loss mask, chat data) at stream positions [position, position + len(ids));
        `starts`: documents starting there. `used`: how many ids of unit `unit`'s output precede `ids`."""
        at = 0
        while at < len(ids):
            if self.open is None:
                self.open = OpenShard.create(self.folder, len(self.shards), mask is not None)
            take = min(len(ids) - at, self.shard_tokens - self.open.n_tokens)
            lo, hi = self.position, self.position + take
            part = None if mask is None else mask[at : at + take]
            self.open.write(ids[at : at + take], starts[(starts >= lo) & (starts < hi)], part)
            self.position, at = hi, at + take
            if self.open.n_tokens == self.shard_tokens:
                self.close([unit, used + at])

    def discard(self) -> None:
        if self.open is not None:
            for f in self.open.files():
                f.close()
                Path(f.name).unlink(missing_ok=True)
            self.open = None

    def close(self, end: list[int]) -> None:
        record = self.open.finish(end)
        self.docs += record["n_docs"]
        self.shards.append(record)
        self.open = None
        progress = {"unit_bytes": self.plan, "shards": self.shards}  # a restart cuts the same units
        atomic_write(self.folder / PROGRESS, json.dumps(progress, indent=1).encode())


@dataclass
class OpenShard:
    """A shard being written: its ids and index stream into temp files, hashed as they go."""

    folder: Path
    number: int
    ids: object
    index: object
    ids_hash: object = field(default_factory=hashlib.sha256)
    index_hash: object = field(default_factory=hashlib.sha256)
    n_tokens: int = 0
    n_docs: int = 0
    mask: object = None  # chat data: the loss mask's temp file
    mask_hash: object = field(default_factory=hashlib.sha256)

    @classmethod
    def create(cls, folder: Path, number: int, with_mask: bool = False) -> OpenShard:
        name = shard_name(number)
        mask = open(folder / f".{name}.mask.tmp", "wb") if with_mask else None
        return cls(
            folder, number, open(folder / f".{name}.bin.tmp", "wb"), open(folder / f".{name}.idx.tmp", "wb"), mask=mask
        )

    def files(self) -> list:
        return [self.ids, self.index] + ([self.mask] if self.mask is not None else [])

    def write(self, ids: np.ndarray, starts: np.ndarray, mask: np.ndarray | None = None) -> None:
        data, index = ids.tobytes(), starts.astype(INDEX).tobytes()
        self.ids.write(data)
        self.ids_hash.update(data)
        self.index.write(index)
        self.index_hash.update(index)
        if self.mask is not None:
            keep = mask.astype(MASK).tobytes()
            self.mask.write(keep)
            self.mask_hash.update(keep)
        self.n_tokens += len(ids)
        self.n_docs += len(starts)

    def finish(self, end: list[int]) -> dict:
        name = shard_name(self.number)
        for f, suffix in zip(self.files(), (".bin", ".idx", ".mask")):
            f.flush()
            os.fsync(f.fileno())
            f.close()
            os.chmod(f.name, 0o644)
            os.replace(f.name, self.folder / f"{name}{suffix}")
        record = {
            "name": f"{name}.bin",
            "index": f"{name}.idx",
            "n_tokens": self.n_tokens,
            "n_docs": self.n_docs,
            "sha256": self.ids_hash.hexdigest(),
            "index_sha256": self.index_hash.hexdigest(),
            "end": end,  # (unit, ids of its output) where the next shard starts
        }
        if self.mask is not None:
            record |= {"mask": f"{name}.mask", "mask_sha256": self.mask_hash.hexdigest()}
        return record


def shard_name(number: int) -> str:
    return f"shard-{number:05d}"


def kept_shards(folder: Path, unit_bytes: int) -> list[dict]:
    """The finished shards of an interrupted build (of the same work units), up to the first that no
    longer matches its sha256."""
    try:
        progress = json.loads((folder / PROGRESS).read_text())
        shards = progress["shards"] if progress["unit_bytes"] == unit_bytes else []
    except (OSError, ValueError, KeyError):
        return []
    kept = []
    for r in shards:
        ids, index = folder / r["name"], folder / r["index"]
        if not (ids.is_file() and index.is_file()):
            break
        if file_sha256(ids) != r["sha256"] or file_sha256(index) != r["index_sha256"]:
            break
        if "mask" in r and not ((folder / r["mask"]).is_file() and file_sha256(folder / r["mask"]) == r["mask_sha256"]):
            break
        kept.append(r)
    return kept


def build(folder: Path, files: list[SourceFile], inputs: list[dict], tok: Tokenizer, options: BuildOptions) -> dict:
    """Tokenize `files` into `folder` (see the module docstring); `inputs`: their records for store.json
    (`input_records`); returns store.json's contents."""
    folder.mkdir(parents=True, exist_ok=True)
    dtype = token_dtype(tok.vocab_size)
    unit_bytes = options.unit_bytes or UNIT_BYTES
    if options.chat is not None:
        not_jsonl = [f.path for f in files if f.kind not in (JSONL, JSON)]
        if not_jsonl:
            raise DataError(
                f'{not_jsonl[0]}: data.format="chat" reads JSONL files (a "messages" list a line); convert it to JSONL '
                "or remove it from data.source"
            )
    units = plan_units(files, options.text_field, unit_bytes)
    writer = ShardWriter(folder, dtype, options.shard_tokens, kept_shards(folder, unit_bytes), unit_bytes)
    first, skip = writer.resume_point()
    if writer.shards:
        print(f"fivecut: token store {folder}: {len(writer.shards)} finished shards kept; going on", flush=True)
    workers = max(1, min(options.workers or available_cores(), len(units) - first))
    if multiprocessing.current_process().daemon:  # a rank started by fivecut.launch.spawn may not have children
        workers = 1
    began = time.perf_counter()
    bar = progress_bar(options.progress, folder)
    init = (tok.name if tok.name in TOKENIZERS else tok, options.text_field, dtype.str, options.chat)
    targets = Targets()  # chat data: loss tokens, conversations without one
    try:
        for u, (ids, lengths, mask, untrained) in enumerate(tokenized(units[first:], workers, init), start=first):
            targets.add(len(lengths), mask, untrained)
            starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)  # [docs], in the unit's output
            if u == 0 and tok.eot_id is not None and len(ids):  # the stream's first document has no separator
                ids, starts = ids[1:], np.maximum(starts - 1, 0)
                mask = None if mask is None else mask[1:]
            used = skip if u == first else 0
            writer.add(ids[used:], writer.position - used + starts, u, used, None if mask is None else mask[used:])
            bar.update(len(ids) - used)
        if writer.open is not None:
            writer.close([len(units), 0])
    finally:
        bar.close()
        writer.discard()  # an unfinished shard's temp files (the finished ones are kept for a restart)
    if writer.position == 0:
        raise DataError(f"data.source {[str(f.path) for f in files]} tokenizes to 0 tokens; give it some text")
    note = None if options.chat is None else chat_note(folder, files, writer.shards, targets, options.chat)
    meta = store_meta(tok, dtype, inputs, options, writer.shards)
    atomic_write(folder / META, json.dumps(meta, indent=1).encode())
    (folder / PROGRESS).unlink(missing_ok=True)
    seconds = time.perf_counter() - began
    print(
        f"fivecut: built token store {folder}: {meta['n_tokens']:,} tokens, {meta['n_docs']:,} documents, "
        f"{len(writer.shards)} shards, {seconds:.1f} s ({meta['n_tokens'] / max(seconds, 1e-9):,.0f} tokens/s, "
        f"{workers} workers); a later open trusts the inputs' recorded size, times and inode (re-hashes a changed one)",
        flush=True,
    )
    if note:
        print(note, flush=True)
    return meta


def chat_note(folder: Path, files: list[SourceFile], shards: list[dict], targets: Targets, chat: ChatTemplate):
    """Refuses a chat store with no loss token; the warning line when some conversations have none
    (None when all have one). A resumed build's kept shards were counted before: read for theirs."""
    if not targets.tokens:
        targets.tokens = sum(int(np.count_nonzero(np.fromfile(folder / r["mask"], MASK))) for r in shards)
    refuse_untrained(targets, [str(f.path) for f in files], chat)
    return untrained_note(targets, str(folder), chat)


def store_meta(tok: Tokenizer, dtype: np.dtype, inputs: list[dict], options: BuildOptions, shards) -> dict:
    content = hashlib.sha256(
        "".join(r["sha256"] + r["index_sha256"] + r.get("mask_sha256", "") for r in shards).encode()
    ).hexdigest()
    return {
        "version": STORE_VERSION,
        "tokenizer": tok.name,
        "vocab_size": tok.vocab_size,
        "eot_id": tok.eot_id,
        "dtype": dtype.str,
        "n_tokens": sum(r["n_tokens"] for r in shards),
        "n_docs": sum(r["n_docs"] for r in shards),
        "shard_tokens": options.shard_tokens,
        "text_field": options.text_field,
        "format": "text" if options.chat is None else "chat",
        "files": [r["path"] for r in inputs],
        "inputs": inputs,  # path, stat and sha256 of each: an open trusts an unchanged stat (`input_records`)
        "content": content,  # the same documents give the same content, whatever their format
        "shards": [{k: v for k, v in r.items() if k != "end"} for r in shards],
    }


def progress_bar(show: bool, folder: Path):
    from tqdm import tqdm

    # on a terminal only: stderr keeps to errors (a refusal is its first line)
    on = show and sys.stderr.isatty()
    return tqdm(desc=f"tokenize {folder.name}", unit="tok", unit_scale=True, disable=not on, file=sys.stderr)


def atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
