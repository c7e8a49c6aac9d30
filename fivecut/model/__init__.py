"""Single-device Llama-style transformer (dense and MoE), its arguments and presets."""

from fivecut.model.args import ModelArgs
from fivecut.model.presets import PRESETS, SHAPE_ONLY, get_preset
from fivecut.model.transformer import Transformer, build_model

__all__ = ["ModelArgs", "PRESETS", "SHAPE_ONLY", "get_preset", "Transformer", "build_model"]
