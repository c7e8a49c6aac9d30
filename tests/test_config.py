"""Typed configuration: defaults, TOML files, `--set` overrides, and the errors that name the key."""

import pytest

from fivecut.config import Config, ConfigError, ModelConfig, load_config, model_label, parse_override, preset_args
from fivecut.layout import ParallelDims
from fivecut.model.presets import get_preset


def error_of(*overrides, path=None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, list(overrides))
    return str(info.value)


# ---------------------------------------------------------------- loading


def test_defaults_load():
    cfg = load_config()
    assert cfg == Config()
    assert cfg.model.preset is None and model_label(cfg.model) == "tiny"  # unset: the default preset
    assert cfg.train.steps == 100 and cfg.train.lr == 3e-3
    assert cfg.parallel == ParallelDims()
    assert cfg.parallel.world_size == 1
    d = cfg.to_dict()
    assert d["train"]["global_batch"] == 8 and d["parallel"]["pp_schedule"] == "1f1b"


def test_toml_file_sets_nested_keys(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(
        """
[model]
preset = "tiny-moe"
dim = 64

[train]
steps = 7
lr = 1e-2
warmup = 0

[parallel]
dp = 2
sp = false

[log]
out_dir = "runs/x"
"""
    )
    cfg = load_config(path)
    assert cfg.model.preset == "tiny-moe" and cfg.model.dim == 64
    assert cfg.train.steps == 7 and cfg.train.lr == 1e-2 and cfg.train.warmup == 0
    assert cfg.parallel.dp == 2 and cfg.parallel.sp is False
    assert cfg.log.out_dir == "runs/x"
    # untouched keys keep their defaults
    assert cfg.train.seq_len == 128 and cfg.data.tokenizer == "auto"


def test_overrides_apply_after_the_file(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("[train]\nsteps = 7\nseed = 3\n")
    cfg = load_config(str(path), ["train.steps=9"])
    assert cfg.train.steps == 9  # override wins
    assert cfg.train.seed == 3  # file value kept


def test_overrides_parse_toml_literals_and_bare_strings():
    cfg = load_config(
        None,
        [
            "train.steps=12",
            "train.lr=0.5",
            "train.min_lr=1e-5",
            "log.progress=false",
            "parallel.sp=true",
            'data.tokenizer="gpt2"',
            "train.dtype=bf16",  # not a TOML literal: kept as a string
            "data.source=/some/dir/with=equals.txt",  # only the first '=' splits
            " parallel.dp = 4",  # spaces around the key and value
        ],
    )
    assert cfg.train.steps == 12 and type(cfg.train.steps) is int
    assert cfg.train.lr == 0.5 and cfg.train.min_lr == 1e-5
    assert cfg.log.progress is False and cfg.parallel.sp is True
    assert cfg.data.tokenizer == "gpt2"
    assert cfg.train.dtype == "bf16"
    assert cfg.data.source == "/some/dir/with=equals.txt"
    assert cfg.parallel.dp == 4


def test_parse_override():
    assert parse_override("a.b=3") == ("a.b", 3)
    assert parse_override("a.b=2.5") == ("a.b", 2.5)
    assert parse_override("a.b=true") == ("a.b", True)
    assert parse_override('a.b="3"') == ("a.b", "3")
    assert parse_override("a.b=hello") == ("a.b", "hello")


def test_int_is_accepted_for_float_fields():
    cfg = load_config(None, ["train.lr=1", "train.bucket_mb=4", "model.rope_theta=500000"])
    assert cfg.train.lr == 1.0 and type(cfg.train.lr) is float
    assert type(cfg.train.bucket_mb) is float and cfg.train.bucket_mb == 4.0
    assert type(cfg.model.rope_theta) is float  # `float | None` field


# ---------------------------------------------------------------- errors


def test_unknown_key_suggests_the_closest():
    msg = error_of("train.stepz=3")
    assert "train.stepz" in msg and "did you mean train.steps?" in msg
    assert "--set train.stepz=3" in msg  # names where it came from


def test_unknown_parallel_key_suggests_a_parallel_key():
    msg = error_of("parallel.dpp=2")
    assert "parallel.dpp" in msg
    # 'dpp' is one edit from both dp and pp; either is a sensible suggestion
    assert "did you mean parallel.dp or parallel.pp?" in msg  # equally close: both offered


def test_unknown_key_far_from_any_lists_the_valid_ones():
    msg = error_of("train.zzzzzzzz=1")
    assert "train.zzzzzzzz" in msg and "valid keys:" in msg
    assert "train.steps" in msg and "train.global_batch" in msg


def test_unknown_section():
    msg = error_of("trian.steps=1")
    assert "unknown config key trian" in msg and "did you mean train?" in msg


def test_unknown_key_in_file_names_the_file(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[train]\nstepz = 3\n")
    msg = error_of(path=path)
    assert "train.stepz" in msg and str(path) in msg and "train.steps" in msg


@pytest.mark.parametrize(
    "override, key, wanted, got",
    [
        ('train.steps="ten"', "train.steps", "wants int", "'ten' (str)"),
        ("train.steps=ten", "train.steps", "wants int", "'ten' (str)"),
        ("train.steps=2.5", "train.steps", "wants int", "2.5 (float)"),
        ("train.steps=true", "train.steps", "wants int", "True (bool)"),  # bool is not an int here
        ("train.lr=true", "train.lr", "wants float", "True (bool)"),
        ("parallel.sp=3", "parallel.sp", "wants bool", "3 (int)"),
        ("model.dim=big", "model.dim", "wants int", "'big' (str)"),  # `int | None` names int only
        ("data.tokenizer=3", "data.tokenizer", "wants str", "3 (int)"),
    ],
)
def test_wrong_type_names_key_type_and_value(override, key, wanted, got):
    msg = error_of(override)
    assert f"config key {key} {wanted}, got {got}" in msg
    assert "None" not in msg.split("got")[0]  # the Optional is not offered as a type to give


def test_section_given_a_scalar():
    msg = error_of("train=5")
    assert "train is a section" in msg and "train.steps" in msg


def test_scalar_given_a_table(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[train.steps]\nx = 1\n")
    msg = error_of(path=path)
    assert "train.steps" in msg and "wants int" in msg


@pytest.mark.parametrize("bad", ["train.steps", "=3", "  =3"])
def test_malformed_override(bad):
    msg = error_of(bad)
    assert repr(bad) in msg and "section.key=value" in msg


def test_missing_file(tmp_path):
    path = tmp_path / "nope.toml"
    msg = error_of(path=path)
    assert str(path) in msg and "does not exist" in msg


def test_invalid_toml(tmp_path):
    path = tmp_path / "broken.toml"
    path.write_text("[train\nsteps = \n")
    msg = error_of(path=path)
    assert str(path) in msg and "not valid TOML" in msg


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


# ---------------------------------------------------------------- model args


def test_preset_args_overrides_the_preset():
    cfg = load_config(None, ["model.dim=256", "model.n_layers=2"])
    args = preset_args(cfg.model)
    base = get_preset("tiny")
    assert args.dim == 256 and args.n_layers == 2
    # everything not set comes from the preset
    assert args.n_heads == base.n_heads and args.vocab_size == base.vocab_size and args.ffn_dim == base.ffn_dim
    assert base.dim == 128  # the preset itself is untouched


def test_preset_args_other_preset():
    args = preset_args(ModelConfig(preset="tiny-moe", top_k=1))
    assert args.n_experts == get_preset("tiny-moe").n_experts and args.top_k == 1


def test_preset_args_without_overrides_is_the_preset():
    assert preset_args(ModelConfig()) == get_preset("tiny")


def test_unknown_preset_names_the_valid_ones():
    with pytest.raises(ValueError) as info:
        preset_args(ModelConfig(preset="tinyy"))
    msg = str(info.value)
    assert "'tinyy'" in msg
    for name in ("tiny", "tiny-moe", "small"):
        assert name in msg
