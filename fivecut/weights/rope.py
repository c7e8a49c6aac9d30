"""RoPE's parameters between a Hugging Face `config.json` and `ModelArgs`.

transformers >= 5 writes `rope_parameters` (rope_type, rope_theta and the scaling's keys); older
files have `rope_scaling` (rope_type or type) beside a top-level `rope_theta`. fivecut implements
the plain RoPE and three scalings (`fivecut.model.transformer.rope_frequencies`):

    linear   factor                                           (position interpolation)
    llama3   factor, low_freq_factor, high_freq_factor,       (Llama 3.1, 3.2, 3.3)
             original_max_position_embeddings
    yarn     factor, original_max_position_embeddings,        (Qwen2.5's long contexts, DeepSeek-V3)
             beta_fast, beta_slow, mscale, mscale_all_dim

YaRN's truncate = false (GPT-OSS) is `rope_truncate`. Any other rope_type, or a key a type does not read
(attention_factor, truncate other than YaRN's,
partial_rotary_factor other than 1, ...), is refused by name: a model using it would compute
something else.

Which table: the one transformers reads (`rope_table`). A `rope_scaling` replaces `rope_parameters`
whole -- what a user does who follows an older guide to extend a context in a file transformers 5
wrote -- so a `rope_parameters` beside it must say nothing else (a rope_type "default" aside):
a value of it that transformers drops (a rope_theta of 1e6 where transformers falls back to the
class default, another factor) is refused naming both keys.
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
NEEDED = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor"), "yarn": ("factor",)}
NEUTRAL = {"rope_type", "type", "rope_theta", "truncate", "partial_rotary_factor"}  # the last two: `check_whole`
ORIGINAL = ("llama3", "yarn")  # their original context defaults to max_position_embeddings, as in transformers
# the config.json keys a RoPE is read from: every class's reader hands them to `rope_fields`
CONFIG_KEYS = ("rope_parameters", "rope_scaling", "rope_theta", "partial_rotary_factor")


class RopeError(ValueError):
    """A RoPE the file describes that fivecut does not implement; the message names the key."""


def rope_fields(config: dict, path: Path, theta: float, max_positions: int, head_dim: int | None = None) -> dict:
    """ModelArgs' RoPE fields of a parsed config.json at `path` (`theta`: its top-level rope_theta
    or the class default; `max_positions`: its max_position_embeddings), read from the table
    transformers reads (`rope_table`). `head_dim`: the class turns part of each head
    (partial_rotary_factor, Phi-3), int(head_dim * factor) channels: `rope_partial_dim`."""
    where, params = rope_table(config, path, theta, max_positions)
    partial = partial_dim(params, where, path, head_dim) if head_dim else {}
    return partial | plain_fields(params, where, path)


def partial_dim(params: dict, where: str, path: Path, head_dim: int) -> dict:
    """{"rope_partial_dim": k} of a partial_rotary_factor below 1 (its entry then dropped from `params`)."""
    factor = number(params.pop("partial_rotary_factor", 1.0), f"{where}.partial_rotary_factor", path)
    turned = int(head_dim * factor)
    if not 0 < factor <= 1 or turned % 2:
        raise RopeError(
            f"{path}: partial_rotary_factor = {factor!r} turns {turned} of a head's {head_dim} channels; RoPE turns "
            "pairs of channels: give a factor in (0, 1] turning an even number"
        )
    return {"rope_partial_dim": turned} if turned < head_dim else {}


def plain_fields(params: dict, where: str, path: Path) -> dict:
    """The RoPE table's base and scaling as ModelArgs fields."""
    kind = params["rope_type"]
    if kind not in KEYS:
        raise RopeError(
            f"{path}: {where}.rope_type = {kind!r} is not implemented; fivecut's RoPE is one of {', '.join(KEYS)}"
        )
    unknown = sorted(set(params) - NEUTRAL - set(KEYS[kind]))
    if unknown:
        raise RopeError(f"{path}: {where}.{unknown[0]} is not implemented by fivecut's {kind} RoPE")
    check_whole(params, where, path)
    truncate = {"rope_truncate": False} if kind == "yarn" and params.get("truncate") is False else {}
    missing = [key for key in NEEDED.get(kind, ()) if params.get(key) is None]
    if missing:
        raise RopeError(f"{path}: {where} of rope_type {kind!r} has no {missing[0]}")
    out = {"rope_theta": float(number(params["rope_theta"], f"{where}.rope_theta", path))}
    if kind == "default":
        return out
    out |= truncate
    out["rope_scaling"] = kind
    for key in KEYS[kind]:
        value = params.get(key)
        if value is not None:
            out[FIELDS[key]] = number(value, f"{where}.{key}", path)
    if "rope_original_context" in out:
        out["rope_original_context"] = int(out["rope_original_context"])
    return out


def check_whole(params: dict, where: str, path: Path) -> None:
    """What fivecut's RoPE always does: YaRN's truncate is true or false (`rope_truncate`), and only YaRN's;
    every channel of a head rotates."""
    truncate = params.get("truncate", True)
    if truncate is not True and (truncate is not False or params["rope_type"] != "yarn"):
        raise RopeError(
            f"{path}: {where}.truncate = {truncate!r} is not implemented; fivecut's YaRN reads true or false"
        )
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise RopeError(
            f"{path}: partial_rotary_factor = {params['partial_rotary_factor']!r} is not implemented; fivecut's "
            "RoPE rotates every channel of a head (1.0)"
        )


def rope_table(config: dict, path: Path, theta: float, max_positions: int) -> tuple[str, dict]:
    """(its key, the table) of the RoPE transformers reads, standardized as its config loading does
    (`convert_rope_params_to_dict` and `standardize_rope_params` of transformers' modeling_rope_utils):
    `rope_scaling`, when set, replaces `rope_parameters` whole; rope_type defaults to `type`, then
    "default"; rope_theta and partial_rotary_factor to the top-level keys (`theta`: rope_theta or the
    class default); llama3's and YaRN's original context to `max_positions`. A `rope_parameters`
    beside a `rope_scaling` must agree with what transformers reads (`check_agree`): it drops it."""
    scaling, params = config.get("rope_scaling"), config.get("rope_parameters")
    where = "rope_scaling" if scaling else "rope_parameters"
    for key, value in ((where, scaling or params or {}), ("rope_parameters", params or {})):
        if not isinstance(value, dict):
            raise RopeError(f"{path}: {key} is {value!r}, not a table of RoPE parameters")
    table = dict(scaling or params or {})
    table.setdefault("rope_type", table.get("type", "default"))
    table.setdefault("rope_theta", theta)
    if config.get("partial_rotary_factor") is not None:
        table.setdefault("partial_rotary_factor", config["partial_rotary_factor"])
    if table["rope_type"] in ORIGINAL:
        table.setdefault("original_max_position_embeddings", max_positions)
    if scaling and params:
        theta_from = "rope_scaling" if "rope_theta" in scaling else "the top-level rope_theta"
        if "rope_theta" not in scaling and config.get("rope_theta") is None:
            theta_from = "the class default, rope_scaling and the file having none"
        check_agree(table, params, path, theta_from)
    return where, table


def check_agree(table: dict, params: dict, path: Path, theta_from: str) -> None:
    """Every value `params` (a rope_parameters beside a rope_scaling) sets is the one transformers
    reads in `table` (rope_scaling, standardized); a rope_type "default" is the plain RoPE that the
    scaling extends."""
    given = {("rope_type" if k == "type" else k): v for k, v in params.items()}
    if given.get("rope_type", "default") == "default":
        given.pop("rope_type", None)
    for key, value in sorted(given.items()):
        if table.get(key) != value:
            origin = theta_from if key == "rope_theta" else "rope_scaling"
            raise RopeError(
                f"{path}: rope_scaling and rope_parameters disagree on {key}: transformers reads {table.get(key)!r} "
                f"(from {origin}) and drops rope_parameters' {value!r}; write one table: move rope_scaling's keys "
                "into rope_parameters (with its rope_theta) and delete rope_scaling"
            )


def number(value, key: str, path: Path) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise RopeError(f"{path}: {key} is {value!r}, not a number")
    return value


def rope_config(args: ModelArgs) -> dict:
    """The config.json keys of `args`'s RoPE: rope_parameters (transformers >= 5), and rope_theta
    with rope_scaling (older ones)."""
    kind = "default" if args.rope_scaling == "none" else args.rope_scaling
    params = {"rope_type": kind, "rope_theta": args.rope_theta}
    if args.rope_partial_dim:  # (Phi-3) the fraction of each head RoPE turns
        params["partial_rotary_factor"] = args.rope_partial_dim / args.head_dim
    for key in KEYS.get(params["rope_type"], ()):
        value = getattr(args, FIELDS[key])
        if key not in ("mscale", "mscale_all_dim") or value:  # 0: unset
            params[key] = value
    if args.rope_scaling == "yarn" and not args.rope_truncate:  # (GPT-OSS) the ramp's ends not rounded
        params["truncate"] = False
    old = None if args.rope_scaling == "none" else {k: v for k, v in params.items() if k != "rope_theta"}
    return {"rope_theta": args.rope_theta, "rope_parameters": params, "rope_scaling": old}
