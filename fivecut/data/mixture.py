"""Mixtures: which source each sample of the run comes from, given the sources' weights.

    [data]
    source = ["web/*.jsonl.zst", "books/", "code/*.parquet"]
    weights = [0.6, 0.3, 0.1]          # one per source; normalised when they do not sum to one

Samples are numbered over the whole run (sample j = row j % global_batch of step j // global_batch
+ 1). They are dealt in blocks of BLOCK: a block holds exactly `counts[k]` samples of source k (the
weights times BLOCK, rounded by largest remainder), spread through the block at evenly spaced
times, the same pattern every block. So sample j's source, and how many samples of that source came
before it, are a closed form of j alone: no state, any step can be found directly, and a resume at
any layout continues exactly (`draw`).

The mixture's epoch is the number of samples after which every source has been read once at least:
the source with the most sequences for its weight is read exactly once, and a smaller one repeats
(`repeats`, said when it is over one).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from fivecut.data.sources import DataError

BLOCK = 1 << 16  # samples per block: weights are kept to 1/65,536


def normalised(weights: list[float] | None, n_sources: int) -> tuple[tuple[float, ...], str | None]:
    """(weights summing to one, a note saying they were normalised or None). None: equal weights."""
    if weights is None:
        return tuple([1.0 / n_sources] * n_sources), None
    problem = weight_problem(weights, n_sources)
    if problem:
        raise DataError(problem)
    total = math.fsum(weights)
    out = tuple(w / total for w in weights)
    if abs(total - 1.0) > 1e-9:
        shown = ", ".join(f"{w:.4g}" for w in out)
        return out, f"data.weights {list(weights)} sum to {total:.6g}, not 1; normalised to [{shown}]"
    return out, None


def weight_problem(weights: list[float] | None, n_sources: int) -> str | None:
    """Why `data.weights` cannot weigh `n_sources` sources (None: it can)."""
    if weights is None:
        return None
    if len(weights) != n_sources:
        return (
            f"data.weights has {len(weights)} weights for {n_sources} sources in data.source; give one weight per "
            "source, in the same order"
        )
    for i, w in enumerate(weights):
        if isinstance(w, bool) or not isinstance(w, int | float) or not math.isfinite(w):
            return f"data.weights[{i}] = {w!r} is not a number; give a finite weight >= 0"
        if w < 0:
            return f"data.weights[{i}] = {w} is negative; give a weight >= 0 (0 leaves that source out)"
    if math.fsum(weights) <= 0:
        return "data.weights are all 0; give at least one source a positive weight"
    small = [i for i, w in enumerate(weights) if 0 < w / math.fsum(weights) < 0.5 / BLOCK]
    if small:
        return f"data.weights[{small[0]}] is below 1/{BLOCK} of the total; raise it, or set it to 0 to leave it out"
    return None


def largest_remainder(weights: tuple[float, ...], total: int) -> np.ndarray:
    """Integers summing to `total`, each the closest to weight * total that allows that."""
    exact = np.asarray(weights, dtype=np.float64) * total
    counts = np.floor(exact).astype(np.int64)
    order = np.argsort(-(exact - counts), kind="stable")
    counts[order[: total - int(counts.sum())]] += 1
    return counts


@dataclass(frozen=True)
class Mixture:
    weights: tuple[float, ...]  # normalised
    counts: np.ndarray  # [K] samples of each source per block
    labels: np.ndarray  # [BLOCK] the source of each sample of a block
    before: np.ndarray  # [BLOCK] samples of the same source earlier in the block

    @classmethod
    def of(cls, weights: tuple[float, ...]) -> Mixture:
        counts = largest_remainder(weights, BLOCK)
        times = np.concatenate([(np.arange(c) + 0.5) / c for c in counts if c])  # evenly spaced per source
        owners = np.concatenate([np.full(c, k) for k, c in enumerate(counts) if c])
        labels = owners[np.lexsort((owners, times))]  # by time, ties by source
        before = np.zeros(BLOCK, dtype=np.int64)
        for k in range(len(counts)):
            here = labels == k
            before[here] = np.arange(int(here.sum()))
        return cls(weights, counts, labels, before)

    def draw(self, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, how many samples of that source came before) of each run-wide sample number."""
        block, at = np.divmod(np.asarray(samples, dtype=np.int64), BLOCK)
        source = self.labels[at]
        return source, block * self.counts[source] + self.before[at]

    def epoch_samples(self, sequences: list[int]) -> int:
        """Samples in one epoch: until the source with the most sequences for its weight is read once."""
        return max(math.ceil(n * BLOCK / c) for n, c in zip(sequences, self.counts) if c)

    def repeats(self, sequences: list[int]) -> list[float]:
        """How many times each source is read per epoch."""
        most = max(n / c for n, c in zip(sequences, self.counts) if c)  # the source read once
        return [most / (n / c) if n and c else 0.0 for n, c in zip(sequences, self.counts)]

    def lines(self, sources: list[str], sequences: list[int]) -> list[str]:
        """What the run says about its mixture: each source read more than once per epoch."""
        if len(sources) == 1:
            return []
        out = []
        for name, w, n, r in zip(sources, self.weights, sequences, self.repeats(sequences)):
            if r > 1.0 + 1e-9:
                out.append(
                    f"data source {name!r} (weight {w:.4g}) has {n:,} sequences, too few for its weight: it repeats "
                    f"{r:.3g} times per epoch"
                )
        return out
