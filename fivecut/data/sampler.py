"""The order of training sequences: which window of which source each row of a step reads.

`data.order = "epoch"`: each source's training split is cut into sequences of seq_len + 1 tokens
that overlap by one (sequence i = tokens[i*seq_len : (i+1)*seq_len + 1]), so every token is a target
exactly once per pass. Source k's i-th sample is sequence perm(i mod n_k) of pass i // n_k, perm a
pseudo-random permutation of 0..n_k-1 drawn from (seed, k, pass): a 4-round Feistel network over the
next power of two, walked until it lands below n_k, so no table of n_k entries is ever built.

`data.order = "random"`: rows start at uniform offsets, drawn with replacement from (seed, step), as
fivecut always sampled; with one source exactly the offsets of before.

Either way the rows of step s depend only on (sources, weights, seq_len, global_batch, seed, s):
sample j (the run's j-th row) is row j % global_batch of step j // global_batch + 1, its source is the
mixture's closed form (`fivecut.data.mixture`), and a layout only decides which rows a rank reads.
`position(step)` is the (epoch, index) after `step`, saved in checkpoints.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fivecut.data.mixture import Mixture
from fivecut.data.sources import DataError

ORDERS = ("epoch", "random")
ROUNDS = 4
MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)


S30, S27, S31 = np.uint64(30), np.uint64(27), np.uint64(31)
M1, M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: a 64-bit hash of each uint64 (array arithmetic wraps modulo 2**64)."""
    x = (x ^ (x >> S30)) * M1
    x = (x ^ (x >> S27)) * M2
    return x ^ (x >> S31)


def permute(positions: np.ndarray, n: int, keys: np.ndarray) -> np.ndarray:
    """A bijection of 0..n-1 (keyed by `keys`, ROUNDS uint64s) applied to `positions`: an unbalanced
    Feistel network over [0, 2**bits), the smallest power of two >= n, so fewer than two walks on average."""
    bits = max(1, int(n - 1).bit_length())
    x = np.asarray(positions, dtype=np.uint64)
    todo = np.ones(x.shape, dtype=bool)
    while todo.any():  # cycle walking: a value that lands at n or above goes round again
        y = x[todo]
        high, low = bits // 2, bits - bits // 2  # y = left (high bits) | right (low bits)
        for key in keys:  # (left, right) -> (right, left ^ F(right)); the halves swap widths
            left, right = y >> np.uint64(low), y & np.uint64((1 << low) - 1)
            y = (right << np.uint64(high)) | (left ^ (mix64(right ^ key) & np.uint64((1 << high) - 1)))
            high, low = low, high
        x[todo] = y
        todo = x >= np.uint64(n)
    return x.astype(np.int64)


@dataclass(frozen=True)
class Position:
    """Where the data stands after a step: the epoch and the sample's index in it (`order` "epoch"),
    or only the samples read ("random")."""

    order: str
    samples: int
    epoch: int | None
    index: int | None
    sequences: tuple[int, ...]  # each source's training sequences
    content: tuple[str, ...]  # each source's store content hash

    def as_dict(self) -> dict:
        return {
            "order": self.order,
            "samples": self.samples,
            "epoch": self.epoch,
            "index": self.index,
            "sequences": list(self.sequences),
            "content": list(self.content),
        }


class SequenceOrder:
    """Rows of the run: (source, start) of each global row of a step, for `tokens` (each source's
    training split: anything with len() and gather by an int array, e.g. a TokenStream)."""

    def __init__(self, tokens: list, mixture: Mixture, seq_len: int, global_batch: int, seed: int, order: str):
        if order not in ORDERS:
            raise DataError(f"data.order={order!r}; choose one of {', '.join(ORDERS)}")
        for k, t in enumerate(tokens):
            if mixture.counts[k] and len(t) < seq_len + 1:
                raise DataError(
                    f"data source {k} has {len(t)} training tokens but one row needs seq_len + 1 = {seq_len + 1}; "
                    "use a shorter train.seq_len or a bigger corpus"
                )
        self.tokens, self.mixture = tokens, mixture
        self.seq_len, self.global_batch, self.seed, self.order = seq_len, global_batch, seed, order
        self.sequences = [(len(t) - 1) // seq_len for t in tokens]
        self._keys: dict[tuple[int, int], np.ndarray] = {}

    def rows(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(source [G], start [G]) of step `step`'s global rows (steps count from 1)."""
        if step < (1 if self.order == "epoch" else 0):
            raise ValueError(f"step must be >= 1 (the first step is 1), got {step}")
        samples = (max(step, 1) - 1) * self.global_batch + np.arange(self.global_batch)
        source, drawn = self.mixture.draw(samples)
        if self.order == "random":
            return source, self.random_starts(step, source)
        starts = np.empty(self.global_batch, dtype=np.int64)
        for k in np.unique(source):
            here = source == k
            n = self.sequences[k]
            passes, at = np.divmod(drawn[here], n)
            seq = np.empty(len(at), dtype=np.int64)
            for p in np.unique(passes):
                same = passes == p
                seq[same] = permute(at[same], n, self.keys(int(k), int(p)))
            starts[here] = seq * self.seq_len
        return source, starts

    def random_starts(self, step: int, source: np.ndarray) -> np.ndarray:
        rng = np.random.default_rng((self.seed, step))
        if len(self.tokens) == 1:  # the offsets fivecut always drew
            return rng.integers(0, len(self.tokens[0]) - self.seq_len - 1, size=self.global_batch, endpoint=True)
        highs = np.asarray([len(t) - self.seq_len - 1 for t in self.tokens], dtype=np.int64)[source]
        return rng.integers(0, highs, endpoint=True)

    def keys(self, source: int, epoch: int) -> np.ndarray:
        if (source, epoch) not in self._keys:
            if len(self._keys) > 64:
                self._keys.clear()
            rng = np.random.default_rng((self.seed, source, epoch))
            self._keys[(source, epoch)] = rng.integers(0, 1 << 63, ROUNDS, dtype=np.uint64)
        return self._keys[(source, epoch)]

    def windows(self, source: np.ndarray, starts: np.ndarray) -> np.ndarray:
        """The rows' ids [len(starts), seq_len + 1], read from each row's source."""
        out = np.empty((len(starts), self.seq_len + 1), dtype=np.int64)
        offsets = np.arange(self.seq_len + 1)
        for k in np.unique(source):
            here = source == k
            out[here] = self.tokens[k][starts[here][:, None] + offsets]
        return out

    def position(self, step: int, content: tuple[str, ...] = ()) -> Position:
        """Where the data stands after `step` steps."""
        samples = step * self.global_batch
        if self.order == "random":
            return Position(self.order, samples, None, None, tuple(self.sequences), content)
        epoch, index = divmod(samples, self.mixture.epoch_samples(self.sequences))
        return Position(self.order, samples, epoch, index, tuple(self.sequences), content)
