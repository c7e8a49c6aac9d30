"""MXFP4 expert weights, as OpenAI publishes GPT-OSS, read as fp32 for training.

`config.json` says `"quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [...]}`;
each quantized expert weight `X` (transformers' `mlp.experts.gate_up_proj` [E, H, 2I], `down_proj`
[E, I, H], in memory [experts, in, out]) is stored as its transpose [E, out, in] cut into blocks of 32
values along `in`:

    X_blocks [E, out, in/32, 16] uint8   two FP4 (e2m1) values a byte: the low nibble first
    X_scales [E, out, in/32]     uint8   the block's power of two, biased by 127 (e8m0)

    value = FP4[nibble] * 2^(scale - 127),  FP4 = 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives (sign bit 8)

A box of the fivecut weight is read with only its experts, its out rows and the blocks its in rows
overlap, so a rank dequantizes only its slice. Activations are not quantized (training runs on the
dequantized weights); export writes the weights unquantized.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from fivecut.weights.source import WeightsError

BLOCKS, SCALES = "_blocks", "_scales"  # the suffixes of a quantized weight's two tensors
BLOCK = 32  # values a scale covers
FP4 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)  # e2m1 by code
KNOWN = {"quant_method", "modules_to_not_convert"}


def is_mxfp4(config: dict, path: Path) -> bool:
    """Whether `config`'s quantization_config is MXFP4 (its other keys refused by name)."""
    q = config.get("quantization_config")
    if not isinstance(q, dict) or q.get("quant_method") != "mxfp4":
        return False
    unknown = sorted(set(q) - KNOWN)
    if unknown:
        raise WeightsError(f"{path}: quantization_config.{unknown[0]} is not implemented by fivecut's MXFP4 reader")
    return True


def dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """blocks [..., G, 16] uint8, scales [..., G] uint8 -> [..., G * 32] fp32."""
    table = torch.tensor(FP4, dtype=torch.float32)
    low, high = table[(blocks & 0x0F).long()], table[(blocks >> 4).long()]  # [..., G, 16] each
    values = torch.stack([low, high], dim=-1).flatten(-2)  # [..., G, 32]: low nibble first
    values = torch.ldexp(values, scales.long().unsqueeze(-1) - 127)
    return values.flatten(-2)


@dataclass(frozen=True)
class Mxfp4Experts:
    """A fivecut expert weight [E, in, out] held in MXFP4 as `name`_blocks and `name`_scales, read as a
    `moe.Stored` is (import only: an export builds its maps without the folder's files, so it writes the
    plain, unquantized tensors): `half` 0 or 1: the even or odd out columns (GPT-OSS's gate_up_proj holds
    gate and up interleaved); None: all of them (down_proj)."""

    name: str
    half: int | None

    def hf_names(self) -> list[str]:
        return [self.name + BLOCKS, self.name + SCALES]

    def shape(self, slice_of) -> tuple[int, ...]:
        experts, out, groups, size = slice_of(self.name + BLOCKS).get_shape()
        scales = tuple(slice_of(self.name + SCALES).get_shape())
        if scales != (experts, out, groups) or 2 * size != BLOCK:
            raise WeightsError(
                f"{self.name}{SCALES} has shape {scales} beside {self.name}{BLOCKS} "
                f"{(experts, out, groups, size)}: MXFP4 wants [E, out, in/32] beside [E, out, in/32, 16]"
            )
        return (experts, groups * BLOCK, out // 2 if self.half is not None else out)

    def read(self, slice_of, box) -> torch.Tensor:
        experts, rows, cols = box  # over fivecut's [E, in, out]
        _, width, height = self.shape(slice_of)
        (r0, r1, _), (c0, c1, _) = rows.indices(width), cols.indices(height)
        out_rows = slice(2 * c0, 2 * c1) if self.half is not None else slice(c0, c1)
        groups = slice(r0 // BLOCK, -(-r1 // BLOCK))  # the blocks the in rows overlap
        blocks = slice_of(self.name + BLOCKS)[experts, out_rows, groups]  # [e, out', g, 16]
        scales = slice_of(self.name + SCALES)[experts, out_rows, groups]  # [e, out', g]
        first = groups.start * BLOCK
        values = dequantize(blocks, scales)[..., r0 - first : r1 - first]  # [e, out', in box]
        values = values.transpose(1, 2)  # [e, in box, out']
        return values if self.half is None else values[..., self.half :: 2]
