"""`fivecut plan` without --layout: the search over layouts, its screen, plan.json and plan.png."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from fivecut.cli import PLAN_TOP, build_parser, main, plan_config
from fivecut.plan.cluster import ClusterError, cluster_from_table, parse_cluster
from fivecut.plan.cost import cost_layout
from fivecut.plan.search import search
from fivecut.plan.volume import (
    block_layout,
    layout_key,
    local_param_counts,
    local_placements,
    real_placements,
    record_sums,
    records_layout,
    screened_placements,
    screened_sums,
    unpipelined,
)


def config(model: str, layout: str | None, cluster: str, *flags: str):
    argv = ["plan", "--model", model, "--cluster", cluster, *flags] + (["--layout", layout] if layout else [])
    return plan_config(build_parser().parse_args(argv), parse_cluster(cluster).world_size)


def by_group(records) -> dict[str, int]:
    counts: dict[str, int] = {}
    for pl in records.values():
        counts[pl.reduce] = counts.get(pl.reduce, 0) + pl.local_numel()
    return counts


@pytest.mark.parametrize(
    "model, layout, sets",
    [
        ("tiny-gpt2", "dp=2,pp=2,microbatches=2", ()),  # a tied head on the last stage: its own copy
        ("tiny", "dp=2,pp=2,pp_schedule=dualpipev,microbatches=4", ("model.tie_embeddings=true",)),
        ("tiny-moe", "dp=2,ep=2,tp=2,pp=2,microbatches=2", ()),
        ("tiny-moe", "dp=4,ep=4,tp=2,etp=2,sp=true", ()),
        ("tiny-moe", "dp=2,cp=2,ep=4,zero=1,pp=2,pp_schedule=interleaved,pp_virtual=2,microbatches=2", ()),
        ("tiny", "tp=4,dp=2,zero=2", ()),
        ("tiny-mla", "tp=2,sp=true,pp=2,microbatches=2,dp=2", ()),
    ],
)
def test_the_screen_holds_exactly_the_parameters_the_real_cuts_give(model, layout, sets):
    """The screen composes a rank's records from one block of each kind; every name and every
    local count must be those of the whole model cut for real, on every pipeline position."""
    cfg, args = config(model, layout, "1x8xH100", "--seq", "64", *[f for s in sets for f in ("--set", s)])
    for rank in range(cfg.parallel.pp):
        real, screened = local_placements(args, cfg, rank), screened_placements(args, cfg, rank)
        assert set(real) == set(screened)
        assert by_group(real) == by_group(screened)
        assert local_param_counts(args, cfg, rank) == by_group(real)  # summed without the records
    for zero in (1, 3) if cfg.parallel.dp > 1 else ():  # the data cut's sums, without the padded records
        sharded = replace(cfg, parallel=replace(cfg.parallel, zero=zero))
        assert screened_sums(args, sharded) == record_sums(screened_placements(args, sharded, 0).values())


@pytest.mark.parametrize("layout", ["dp=6,zero=1", "dp=3,tp=2,zero=3", "dp=3,pp=2,zero=2,microbatches=2,zero_shard=3"])
def test_the_screens_data_cut_sums_are_those_of_its_padded_records(layout):
    """`screened_sums` adds each kind of block's padded sizes; on 6 ranks (norms of 64 pad to 66) they
    must be the sums of `screened_placements`'s own padded records."""
    cfg, args = config("tiny", layout, "1x6xH100", "--seq", "64")
    assert screened_sums(args, cfg) == record_sums(screened_placements(args, cfg, 0).values())


@pytest.mark.parametrize("layout", ["dp=8", "dp=2,tp=2,sp=true,cp=2", "dp=2,cp=4,cp_mode=usp,cp_ulysses=2"])
def test_a_dense_block_is_cut_the_same_on_any_number_of_data_parallel_ranks(layout):
    """The screen cuts a dense model's blocks on one dp rank (`block_layout`): the records must be
    those of the layout's own dp."""
    cfg, args = config("tiny", layout, "1x8xH100", "--seq", "64")
    own = local_placements(args, replace(cfg, parallel=unpipelined(cfg.parallel)), 0)
    assert own == local_placements(args, replace(cfg, parallel=block_layout(args, cfg.parallel)), 0)
    assert block_layout(args, cfg.parallel).dp == 1


@pytest.mark.parametrize(
    "model, layout, same",
    [
        ("tiny", "dp=8,zero=3", "dp=4,zero=3,cp=2"),
        ("tiny", "dp=8,zero=1", "dp=2,zero=1,cp=4,cp_mode=usp,cp_ulysses=2"),
        ("tiny", "dp=4,zero=2,tp=2,sp=true", "dp=2,zero=2,tp=2,sp=true,cp=2,cp_mode=ulysses"),
        ("tiny", "dp=4,zero=3,zero_shard=2", "dp=2,zero=3,cp=2,zero_shard=2"),
        ("tiny-gpt2", "dp=4,zero=3,pp=2,microbatches=2", "dp=2,zero=3,cp=2,pp=2,microbatches=4"),
        (
            "tiny",
            "dp=2,zero=2,pp=2,pp_schedule=zb1p,microbatches=2",
            "dp=2,zero=2,pp=2,microbatches=4,pp_schedule=zb1p",
        ),
    ],
)
def test_a_dense_model_has_the_records_of_its_dp_x_cp_ranks_without_cp(model, layout, same):
    """`local_placements` shares one build among the layouts `records_layout` maps together: their
    records, built apart, must be equal on every pipeline position."""
    cfg, args = config(model, layout, "1x8xH100", "--seq", "64")
    other, _ = config(model, same, "1x8xH100", "--seq", "64")
    assert layout_key(records_layout(args, cfg.parallel)) == layout_key(records_layout(args, other.parallel))
    for rank in range(cfg.parallel.pp):
        assert real_placements(args, cfg, rank) == real_placements(args, other, rank)


def test_the_search_ranks_fitting_layouts_by_the_exact_cost():
    cfg, args = config("tiny", None, "1x4xH100", "--seq", "64", "--global-batch", "8")
    result = search(args, cfg, parse_cluster("1x4xH100"), top=3)
    assert result.ranked and result.tried > len(result.ranked)
    steps = [c.cost.step for c in result.ranked]
    assert steps == sorted(steps)
    best = result.ranked[0]
    again = cost_layout(args, best.cfg, parse_cluster("1x4xH100"))  # the real cuts, not the screen
    assert again.step == best.cost.step and again.memory == best.cost.memory
    assert {c.cfg.parallel.world_size for c in result.ranked} == {4}
    assert all(c.cfg.train.global_batch == 8 for c in result.ranked)  # the batch is the user's


def test_plan_writes_json_and_png_and_says_why(tmp_path, capsys):
    out = tmp_path / "plan"
    argv = ["plan", "--model", "tiny", "--cluster", "1x4xH100", "--seq", "64", "--global-batch", "8"]
    assert main([*argv, "--top", "3", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert " wins by " in text or "ties with" in text
    record = json.loads((out / "plan.json").read_text())
    assert record["written_by"] == "fivecut plan" and 1 <= len(record["layouts"]) <= 3
    assert [rule.split(":")[0] for rule in record["rules"]] == ["recomputation", "batch splits", "model states"]
    first = record["layouts"][0]
    assert first["fits"] and set(first["memory_bytes"]) >= {"params", "grads", "optimizer", "activations"}
    assert (out / "plan.png").read_bytes()[:4] == b"\x89PNG"
    assert main([*argv, "--out", str(out)]) == 0  # its own earlier plan is replaced
    assert len(json.loads((out / "plan.json").read_text())["layouts"]) == PLAN_TOP  # no --top: the default


def test_plan_keeps_a_file_it_did_not_write(tmp_path, capsys):
    (tmp_path / "plan.json").write_text("{}")
    argv = ["plan", "--model", "tiny", "--cluster", "1x4xH100", "--seq", "64", "--out", str(tmp_path)]
    assert main(argv) == 2
    assert "is not a plan fivecut wrote" in capsys.readouterr().err
    assert (tmp_path / "plan.json").read_text() == "{}"


def test_nothing_fits_names_the_least_memory_and_its_largest_term(capsys):
    argv = ["plan", "--model", "llama3-70b", "--cluster", "1x2xA100", "--seq", "2048", "--global-batch", "2"]
    assert main(argv) == 1  # an answer, not a bad input
    out = capsys.readouterr().out
    assert "no layout fits in 80 GB" in out and ("most of it" in out or "model states alone" in out)


@pytest.mark.parametrize(
    "flags, said",
    [
        (["--global-batch-tokens", "1000", "--seq", "64"], "not a whole number of sequences of 64"),
        (["--global-batch-tokens", "lots"], "not a token count"),
        (["--model", "missing.toml"], "not a model preset, a config TOML or a Hugging Face config.json"),
    ],
)
def test_bad_search_input_is_refused(flags, said, capsys):
    assert main(["plan", "--cluster", "1x4xH100", *flags]) == 2
    assert said in capsys.readouterr().err


def test_a_world_that_is_not_whole_nodes_is_refused():
    with pytest.raises(ClusterError, match="not a whole number of nodes of gpus_per_node = 8"):
        cluster_from_table({"cluster": {"gpus": 20, "gpus_per_node": 8, "device": "H100"}}, "c.toml")
    assert cluster_from_table({"cluster": {"gpus": 16, "gpus_per_node": 8, "device": "H100"}}, "c.toml").nodes == 2


def test_a_model_from_a_config_toml_and_an_hf_config_json(tmp_path):
    (tmp_path / "m.toml").write_text('[model]\npreset = "tiny"\nn_layers = 6\n')
    _, args = config(str(tmp_path / "m.toml"), "dp=2", "1x2xH100", "--seq", "64")
    assert args.n_layers == 6
    hf = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 192,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 300,
        "max_position_embeddings": 128,
    }
    (tmp_path / "config.json").write_text(json.dumps(hf))
    _, args = config(str(tmp_path / "config.json"), "dp=2", "1x2xH100", "--seq", "64")
    assert (args.dim, args.n_layers, args.n_kv_heads, args.vocab_size) == (64, 3, 2, 300)
