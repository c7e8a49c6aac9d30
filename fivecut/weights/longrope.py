"""Phi-3's LongRoPE between a Hugging Face `config.json` and `ModelArgs`.

Phi3Config reads `rope_scaling` (when set) in place of `rope_parameters`, and a rope_type 'su' or
'yarn' as 'longrope'. Its keys:

    short_factor, long_factor      rope_dim/2 numbers each: channel pair i turns at
                                   1 / (f_i * rope_theta^(2i/rope_dim))
    factor                         default max_position_embeddings / original_max_position_embeddings
    attention_factor               cos and sin times it; default sqrt(1 + ln(factor) / ln(original)), 1 for
                                   a factor <= 1

The pretraining context is the top-level `original_max_position_embeddings` (Phi3Config's field, 4096
when absent), which transformers puts over the table's own; a table that says another is refused.
Which factors turn a sequence is the model's choice by its length (`ModelArgs.rope_long`). Any other
key of the table is refused by name.
"""

from __future__ import annotations

from pathlib import Path

from fivecut.model.args import ModelArgs
from fivecut.weights.rope import RopeError, number, partial_dim, rope_fields, rope_table

NAMES = ("su", "yarn", "longrope")  # the rope_types Phi3Config reads as longrope
KEYS = {"short_factor", "long_factor", "factor", "attention_factor", "original_max_position_embeddings"}
NEUTRAL = {"rope_type", "type", "rope_theta", "partial_rotary_factor"}
ORIGINAL = "original_max_position_embeddings"
PHI3_ORIGINAL = 4096  # Phi3Config's default


def phi3_rope_fields(config: dict, path: Path, theta: float, max_positions: int, head_dim: int) -> dict:
    """ModelArgs' RoPE fields of a Phi-3 config.json (`fivecut.weights.rope.rope_fields`'s arguments):
    a longrope table read here, any other by `rope_fields`."""
    where, table = rope_table(config, path, theta, max_positions)
    if table["rope_type"] not in NAMES:
        return rope_fields(config, path, theta, max_positions, head_dim)
    partial = partial_dim(table, where, path, head_dim)
    unknown = sorted(set(table) - NEUTRAL - KEYS)
    if unknown:
        raise RopeError(f"{path}: {where}.{unknown[0]} is not implemented by fivecut's longrope RoPE")
    original = int(number(config.get(ORIGINAL, PHI3_ORIGINAL), ORIGINAL, path))
    written = (config.get(where) or {}).get(ORIGINAL, original)  # (`rope_table` fills in YaRN's)
    if written != original:
        raise RopeError(
            f"{path}: {where}.{ORIGINAL} = {written!r} but the top-level {ORIGINAL} = {original}, which "
            "transformers' Phi-3 reads; write one value"
        )
    pairs = (partial.get("rope_partial_dim") or head_dim) // 2
    return partial | {
        "rope_theta": float(number(table["rope_theta"], f"{where}.rope_theta", path)),
        "rope_scaling": "longrope",
        "rope_original_context": original,
        "rope_short_factors": factor_list(table, "short_factor", pairs, where, path),
        "rope_long_factors": factor_list(table, "long_factor", pairs, where, path),
        "rope_factor": stretch(table, max_positions / original, where, path),
        "rope_attention_factor": attention_factor(table, where, path),
    }


def factor_list(table: dict, key: str, pairs: int, where: str, path: Path) -> tuple[float, ...]:
    """The table's `key`: `pairs` positive numbers, one per rotated channel pair."""
    value = table.get(key)
    if not isinstance(value, list) or len(value) != pairs:
        raise RopeError(f"{path}: {where}.{key} is {value!r}; longrope needs a list of {pairs} numbers (rope_dim / 2)")
    factors = tuple(float(number(f, f"{where}.{key}", path)) for f in value)
    if not all(f > 0 for f in factors):
        raise RopeError(f"{path}: {where}.{key} holds a factor <= 0; each divides a frequency")
    return factors


def stretch(table: dict, derived: float, where: str, path: Path) -> float:
    """The table's factor (`derived` when it has none); one <= 1 is read as 1, which gives the same
    attention factor (1)."""
    value = table.get("factor")
    return max(float(derived if value is None else number(value, f"{where}.factor", path)), 1.0)


def attention_factor(table: dict, where: str, path: Path) -> float:
    """The table's attention_factor, or 0 (ModelArgs' "derived") when it has none."""
    value = table.get("attention_factor")
    if value is None:
        return 0.0
    if not number(value, f"{where}.attention_factor", path) > 0:
        raise RopeError(f"{path}: {where}.attention_factor = {value!r} is not implemented; give a number > 0")
    return float(value)


def longrope_config(args: ModelArgs) -> dict:
    """The config.json keys of `args`'s longrope (Phi-3): rope_parameters (transformers >= 5), rope_theta
    with rope_scaling (older ones) and the pretraining context; {} for any other RoPE."""
    if args.rope_scaling != "longrope":
        return {}
    params = {
        "rope_type": "longrope",
        "rope_theta": args.rope_theta,
        "short_factor": list(args.rope_short_factors),
        "long_factor": list(args.rope_long_factors),
        "factor": args.rope_factor,
    }
    if args.rope_attention_factor:
        params["attention_factor"] = args.rope_attention_factor
    if args.rope_partial_dim:
        params["partial_rotary_factor"] = args.rope_partial_dim / args.head_dim
    old = {k: v for k, v in params.items() if k != "rope_theta"}
    return {
        "rope_theta": args.rope_theta,
        "rope_parameters": params,
        "rope_scaling": old,
        ORIGINAL: args.rope_original_context,
    }
