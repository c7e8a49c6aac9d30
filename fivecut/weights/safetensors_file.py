"""Reading boxes of the tensors of a safetensors file with positioned reads, never a memory map.

`safetensors.safe_open(...).get_slice` reads through a memory map of the file. A rank's slice of a
row-major weight cut along its columns (tensor parallelism's row-parallel projections: wo, w2)
touches a page of every row, so every page of the tensor becomes resident in the rank, and stays
so while the file is open: importing a 110M-parameter model (420 MiB) under tp=2 through
`get_slice`, a rank peaked 285-364 MiB above what it held built (its weights and gradients), at
pp=2 210 MiB above, in one process 420 MiB above; with the reads here, 6-18 MiB
(`benchmarks/import_memory.py`). Here a box is read in blocks of whole rows of at most
`BLOCK_BYTES` with `os.pread` into a buffer that is freed after the box's part is copied out, so a
rank's resident memory is its parameters plus one block.

The format (the safetensors specification): 8 bytes little-endian N, a JSON header of N bytes
(name -> dtype, shape, data_offsets [begin, end) from the end of the header; `__metadata__`),
then the data, C-ordered, little-endian.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

BLOCK_BYTES = 64 * 2**20  # whole rows read at once, at most (one row when a row is larger)
DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}  # fmt: skip


class NotSafetensors(ValueError):
    """The file is not a readable safetensors file; the message says why."""


@dataclass(frozen=True)
class StoredTensor:
    """One tensor of a safetensors file: its dtype, shape and where its bytes start."""

    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # byte offset of element 0 in the file

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def __getitem__(self, box) -> torch.Tensor:
        """The box (slices of steps 1, one per leading dimension) as a tensor of its own storage."""
        box = box if isinstance(box, tuple) else (box,)
        ranges = [range(*s.indices(n)) for s, n in zip(box, self.shape)]
        ranges += [range(n) for n in self.shape[len(ranges) :]]
        if not self.shape:
            return self.rows(0, 1).reshape(())
        out = torch.empty([len(r) for r in ranges], dtype=self.dtype)
        inner = tuple(slice(r.start, r.stop) for r in ranges[1:])
        rows = ranges[0]
        per_block = max(1, BLOCK_BYTES // max(self.row_bytes, 1))
        for first in range(rows.start, rows.stop, per_block):
            n = min(per_block, rows.stop - first)
            out[first - rows.start : first - rows.start + n] = self.rows(first, n)[(slice(None), *inner)]
        return out

    @property
    def row_bytes(self) -> int:
        return math.prod(self.shape[1:]) * self.dtype.itemsize

    def rows(self, first: int, n: int) -> torch.Tensor:
        """Rows first .. first + n along dimension 0, read whole: [n, *shape[1:]]."""
        size = n * self.row_bytes if self.shape else self.dtype.itemsize
        buffer = bytearray(size)
        with open(self.file, "rb", buffering=0) as f:
            got = os.preadv(f.fileno(), [buffer], self.start + first * self.row_bytes)
        if got != size:
            raise NotSafetensors(f"{self.file} ends {size - got} bytes before a tensor's data (truncated?)")
        flat = torch.frombuffer(buffer, dtype=self.dtype) if size else torch.empty(0, dtype=self.dtype)
        return flat.view(n, *self.shape[1:]) if self.shape else flat


def read_header(file: Path) -> dict[str, StoredTensor]:
    """Every tensor of the safetensors file `file`, by name, from its header alone."""
    try:
        with open(file, "rb") as f:
            length = int.from_bytes(f.read(8), "little")
            if length <= 0 or length > file.stat().st_size - 8:
                raise NotSafetensors(f"{file} is not a safetensors file: header length {length} does not fit the file")
            header = json.loads(f.read(length))
    except (OSError, ValueError, UnicodeDecodeError) as err:
        if isinstance(err, NotSafetensors):
            raise
        raise NotSafetensors(f"{file} is not a safetensors file: {err}") from None
    header.pop("__metadata__", None)
    out = {}
    for name, record in header.items():
        dtype = DTYPES.get(record.get("dtype")) if isinstance(record, dict) else None
        if dtype is None:
            raise NotSafetensors(f"{file}: tensor {name} has dtype {record!r}, which fivecut cannot read")
        out[name] = stored(file, name, record, dtype, 8 + length)
    return out


def stored(file: Path, name: str, record: dict, dtype: torch.dtype, data_start: int) -> StoredTensor:
    """One header entry, its bytes held to its shape and to the file's size (a cut file is refused
    here, before any rank reads)."""
    try:
        shape, (begin, end) = tuple(int(n) for n in record["shape"]), record["data_offsets"]
    except (KeyError, TypeError, ValueError):
        raise NotSafetensors(f"{file}: tensor {name} has no valid shape and data_offsets in the header") from None
    if end - begin != math.prod(shape) * dtype.itemsize:
        raise NotSafetensors(
            f"{file}: tensor {name} spans {end - begin} bytes, its shape {shape} needs "
            f"{math.prod(shape) * dtype.itemsize}"
        )
    if data_start + end > file.stat().st_size:
        raise NotSafetensors(f"{file} ends before tensor {name}'s data (truncated?)")
    return StoredTensor(file, dtype, shape, data_start + begin)
