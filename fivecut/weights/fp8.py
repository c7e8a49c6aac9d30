"""Block-scaled fp8 weights, as DeepSeek-V3 (and the "-FP8" Qwen releases) publish them, read as
fp32 for training.

`config.json` says `"quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
"weight_block_size": [128, 128], "activation_scheme": "dynamic"}`; each quantized weight
`X.weight` [out, in] is stored in float8_e4m3fn beside `X.weight_scale_inv` [ceil(out/128),
ceil(in/128)], one factor a block: the weight is the fp8 value times its block's factor
(DeepSeek's `weight_dequant`). A box of the weight is read with only the scale blocks it
overlaps, so a rank dequantizes only its slice. Activations are not quantized here (the
"activation_scheme" is for inference); training runs on the dequantized weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from fivecut.weights.safetensors_file import StoredTensor
from fivecut.weights.source import WeightsError

SCALE = "_scale_inv"  # the suffix of a weight's scale tensor
KNOWN = {"quant_method", "fmt", "weight_block_size", "activation_scheme"}


def fp8_blocks(config: dict, path: Path) -> tuple[int, int] | None:
    """The [rows, columns] of a scale block, from `config`'s quantization_config (None without
    one); anything but block-scaled e4m3 fp8 is refused naming the key."""
    q = config.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, dict):
        raise WeightsError(f"{path}: quantization_config is {q!r}, not a table")
    if q.get("quant_method") != "fp8":
        raise WeightsError(
            f"{path}: quantization_config.quant_method = {q.get('quant_method')!r} is not implemented; "
            'fivecut reads block-scaled fp8 ("fp8") only'
        )
    if q.get("fmt", "e4m3") != "e4m3":
        raise WeightsError(f"{path}: quantization_config.fmt = {q['fmt']!r} is not implemented; fivecut reads e4m3")
    unknown = sorted(set(q) - KNOWN)
    if unknown:
        raise WeightsError(f"{path}: quantization_config.{unknown[0]} is not implemented by fivecut's fp8 reader")
    block = q.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(n, int) and n > 0 for n in block)):
        raise WeightsError(f"{path}: quantization_config.weight_block_size is {block!r}, not [rows, columns] > 0")
    return block[0], block[1]


def split_scales(files: dict[str, Path]) -> tuple[dict[str, Path], dict[str, str]]:
    """(the tensors without the scales, weight name -> its scale's name)."""
    scales = {name.removesuffix(SCALE): name for name in files if name.endswith(SCALE)}
    return {n: f for n, f in files.items() if not n.endswith(SCALE)}, scales


@dataclass(frozen=True)
class BlockScaled:
    """A 2-D fp8 weight and its block scales, read box by box as fp32 (the `StoredTensor` interface)."""

    weight: StoredTensor
    scale: StoredTensor
    block: tuple[int, int]

    def check(self, name: str) -> None:
        rows, cols = self.weight.shape if len(self.weight.shape) == 2 else (0, 0)
        want = (math.ceil(rows / self.block[0]), math.ceil(cols / self.block[1]))
        if len(self.weight.shape) != 2 or tuple(self.scale.shape) != want:
            raise WeightsError(
                f"{self.scale.file}: {name}{SCALE} has shape {tuple(self.scale.shape)}; blocks of {list(self.block)} "
                f"over {name} {tuple(self.weight.shape)} need {want}"
            )

    def get_shape(self) -> list[int]:
        return self.weight.get_shape()

    def __getitem__(self, box) -> torch.Tensor:
        """weight[box] times the factor of each element's block: [rows, cols] fp32."""
        box = (*(box if isinstance(box, tuple) else (box,)), slice(None), slice(None))[:2]
        (r0, r1, _), (c0, c1, _) = (b.indices(n) for b, n in zip(box, self.weight.shape))
        bo, bi = self.block
        scale = self.scale[(slice(r0 // bo, -(-r1 // bo)), slice(c0 // bi, -(-c1 // bi)))].float()
        scale = scale.repeat_interleave(bo, 0).repeat_interleave(bi, 1)  # [blocks * bo, blocks * bi]
        scale = scale[r0 - r0 // bo * bo :][: r1 - r0, c0 - c0 // bi * bi :][:, : c1 - c0]
        return self.weight[(slice(r0, r1), slice(c0, c1))].float() * scale
