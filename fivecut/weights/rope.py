"""RoPE's parameters between a Hugging Face `config.json` and `ModelArgs`.

transformers >= 5 writes `rope_parameters` (rope_type, rope_theta and the scaling's keys); older
files have `rope_scaling` (rope_type or type) beside a top-level `rope_theta`. fivecut implements
the plain RoPE and three scalings (`fivecut.model.transformer.rope_frequencies`):

    linear   factor                                           (position interpolation)
    llama3   factor, low_freq_factor, high_freq_factor,       (Llama 3.1, 3.2, 3.3)
             original_max_position_embeddings
    yarn     factor, original_max_position_embeddings,        (Qwen2.5's long contexts, DeepSeek-V3)
             beta_fast, beta_slow, mscale, mscale_all_dim

Any other rope_type, or a key a type does not read (attention_factor, truncate = false,
partial_rotary_factor, ...), is refused by name: a model using it would compute something else.
"""

from __future__ import annotations

from pathlib import Path

from fivecut.model.args import ModelArgs

# Hugging Face key -> ModelArgs field
FIELDS = {
    "factor": "rope_factor",
    "original_max_position_embeddings": "rope_original_context",
    "low_freq_factor": "rope_low_freq_factor",
    "high_freq_factor": "rope_high_freq_factor",
    "beta_fast": "rope_beta_fast",
    "beta_slow": "rope_beta_slow",
    "mscale": "rope_mscale",
    "mscale_all_dim": "rope_mscale_all_dim",
}
# rope_type -> the keys it reads, besides rope_type and rope_theta
KEYS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim"),
}
NEEDED = {"linear": ("factor",), "llama3": KEYS["llama3"], "yarn": ("factor",)}
NEUTRAL = {"rope_type", "type", "rope_theta", "truncate"}  # truncate = true is what fivecut's YaRN does


class RopeError(ValueError):
    """A RoPE the file describes that fivecut does not implement; the message names the key."""


def rope_fields(config: dict, path: Path, theta: float, max_positions: int) -> dict:
    """ModelArgs' RoPE fields of a parsed config.json at `path` (`theta`: its top-level rope_theta
    or the class default; `max_positions`: its max_position_embeddings, YaRN's original context
    when the file gives none)."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    where = "rope_parameters" if config.get("rope_parameters") else "rope_scaling"
    if not isinstance(params, dict):
        raise RopeError(f"{path}: {where} is {params!r}, not a table of RoPE parameters")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in KEYS:
        raise RopeError(
            f"{path}: {where}.rope_type = {kind!r} is not implemented; fivecut's RoPE is one of {', '.join(KEYS)}"
        )
    unknown = sorted(set(params) - NEUTRAL - set(KEYS[kind]))
    if unknown:
        raise RopeError(f"{path}: {where}.{unknown[0]} is not implemented by fivecut's {kind} RoPE")
    if params.get("truncate", True) is not True:
        raise RopeError(
            f"{path}: {where}.truncate = {params['truncate']!r} is not implemented; fivecut's YaRN truncates"
        )
    missing = [key for key in NEEDED.get(kind, ()) if params.get(key) is None]
    if missing:
        raise RopeError(f"{path}: {where} of rope_type {kind!r} has no {missing[0]}")
    out = {"rope_theta": float(number(params.get("rope_theta", theta), f"{where}.rope_theta", path))}
    if kind == "default":
        return out
    out["rope_scaling"] = kind
    for key in KEYS[kind]:
        value = params.get(key)
        if value is not None:
            out[FIELDS[key]] = number(value, f"{where}.{key}", path)
    if kind == "yarn" and params.get("original_max_position_embeddings") is None:
        out["rope_original_context"] = max_positions
    if "rope_original_context" in out:
        out["rope_original_context"] = int(out["rope_original_context"])
    return out


def number(value, key: str, path: Path) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise RopeError(f"{path}: {key} is {value!r}, not a number")
    return value


def rope_config(args: ModelArgs) -> dict:
    """The config.json keys of `args`'s RoPE: rope_parameters (transformers >= 5), and rope_theta
    with rope_scaling (older ones)."""
    kind = "default" if args.rope_scaling == "none" else args.rope_scaling
    params = {"rope_type": kind, "rope_theta": args.rope_theta}
    for key in KEYS.get(params["rope_type"], ()):
        value = getattr(args, FIELDS[key])
        if key not in ("mscale", "mscale_all_dim") or value:  # 0: unset
            params[key] = value
    old = None if args.rope_scaling == "none" else {k: v for k, v in params.items() if k != "rope_theta"}
    return {"rope_theta": args.rope_theta, "rope_parameters": params, "rope_scaling": old}
