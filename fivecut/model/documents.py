"""Packed documents kept apart (`data.document_mask`).

A training window holds several documents joined by the end-of-text id. With the mask on, a
token attends only to earlier tokens of its own document, and its RoPE position counts from
its document's first token, so each document is computed as if it were alone in the window
(the window's first document may begin before the window: it starts at position 0 here).

The end-of-text token closes its document: document ids [b, S] count the end-of-text tokens
strictly before each token. The ids cover the whole sequence on every rank (a context-parallel
rank holds only a chunk of the tokens but builds the masks of its chunk against any other
rank's from them, with no message); the positions are those of the tokens the rank computes.

On one device the mask is a boolean [b, 1, s, s] given to PyTorch's fused SDPA
(`benchmarks/document_mask.py` measures it against FlexAttention's block masks on the CPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Documents:
    ids: torch.Tensor  # [b, S] int64: the document of each token of the whole sequence
    positions: torch.Tensor  # [b, s] int64: RoPE positions of this rank's tokens (s = S, or a chunk)

    @staticmethod
    def of(tokens: torch.Tensor, eot: int) -> Documents:
        """Documents of token ids [b, S] separated by `eot` (which ends its document)."""
        ends = tokens == eot  # [b, S]
        ids = ends.long().cumsum(1) - ends.long()  # [b, S] end-of-text tokens before each token
        index = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)  # [b, S]
        starts = torch.zeros_like(ends)
        starts[:, 1:] = ends[:, :-1]  # the token after an end-of-text starts a document
        starts[:, 0] = True
        first = torch.where(starts, index, 0).cummax(dim=1).values  # [b, S] index of the document's start
        return Documents(ids, index - first)

    def chunk(self, at: torch.Tensor) -> Documents:
        """This rank's tokens `at` [s] (indices into the sequence): positions cut, ids whole."""
        return Documents(self.ids, self.positions[:, at])

    def split(self, parts: int) -> list[Documents]:
        """The rows cut into `parts` microbatches, as `Tensor.chunk` cuts the inputs."""
        return [Documents(i, p) for i, p in zip(self.ids.chunk(parts), self.positions.chunk(parts))]

    def visible(self, queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """Which keys each query sees: queries [sq] and keys [sk] are indices into the whole
        sequence -> bool [b, 1, sq, sk], True where the key is not later and in the same document."""
        same = self.ids[:, queries].unsqueeze(-1) == self.ids[:, keys].unsqueeze(-2)  # [b, sq, sk]
        return (same & (queries.unsqueeze(-1) >= keys.unsqueeze(-2))).unsqueeze(1)
