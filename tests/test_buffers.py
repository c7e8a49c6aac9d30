"""The data cut's buffers at their peak (`BufferPeak`): measured in a real step by `fivecut ledger`
against the planner's closed forms (`fivecut.plan.buffers`).

Tolerances: where the buffers are whole tensors the closed form names (DDP's and ZeRO-1's copies
and shards, ZeRO-2 with one bucket, ZeRO-3's gathered units and reductions) the figures are
equal (ratio 1.000, as printed). With several ZeRO-2 buckets the planner takes each bucket as
full (`train.bucket_mb`); real buckets end at a parameter's edge, so the measured peak lies up
to one parameter below: the ratio is held to (0.9, 1.0]. Holding every bucket until the end of
backward (the bug this guards against) measures about 5x the bound here.
"""

from __future__ import annotations

import pytest

from fivecut.checks import checked_model_args
from fivecut.cli import main
from fivecut.config import load_config
from fivecut.plan.buffers import buffer_bytes
from fivecut.plan.volume import local_placements

pytestmark = pytest.mark.multirank

EXACT = {
    "DDP, copies in bf16": ("dp=2", ('train.reduce_dtype="bf16"',)),
    "ZeRO-1": ("dp=2,zero=1", ()),
    "ZeRO-3 bf16 units": ("dp=2,zero=3", ('train.dtype="bf16"',)),
    "ZeRO-3 kept gathered": ("dp=2,zero=3,reshard_after_forward=false", ()),
    "ZeRO-3 in a pipeline": ("dp=2,pp=2,zero=3,microbatches=2", ()),
}


def buffers_ratio(layout: str, settings: tuple[str, ...], cache: str, capsys) -> float:
    flags = [x for s in (*settings, f'data.cache_dir="{cache}"') for x in ("--set", s)]
    assert main(["ledger", "--layout", layout, *flags]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("buffers_ratio="))
    return float(line.split("=")[1])


@pytest.mark.parametrize("case", list(EXACT))
def test_the_buffers_closed_form_is_exact(case, byte_cache, capsys):
    layout, settings = EXACT[case]
    assert buffers_ratio(layout, settings, byte_cache, capsys) == 1.0


def test_zero2_keeps_one_bucket_in_flight(byte_cache, capsys):
    ratio = buffers_ratio("dp=2,zero=2", ("train.bucket_mb=0.5",), byte_cache, capsys)
    assert 0.9 < ratio <= 1.0


SCREENED = [
    ("tiny", "dp=2,zero=3"),
    ("tiny", "dp=4,tp=2,zero=3"),
    ("tiny", "dp=2,pp=2,zero=3,microbatches=4,pp_schedule=dualpipev,pp_virtual=2"),
    ("tiny-moe", "dp=2,ep=2,zero=3"),
    ("tiny-moe", "dp=4,ep=2,zero=1,pp=2,microbatches=2"),
    ("tiny", "dp=2,zero=2"),
]


@pytest.mark.parametrize("model, layout", SCREENED)
def test_the_screen_gives_the_buffers_of_the_real_cut(model, layout):
    """The search counts buffers from one block of each kind (`composition`); the whole model cut
    for real on the meta device gives the same bytes at every pipeline position."""
    items = [f'model.preset="{model}"', "train.seq_len=64", "train.global_batch=8"]
    cfg = load_config(None, items + [f"parallel.{x}".replace("=dualpipev", '="dualpipev"') for x in layout.split(",")])
    args = checked_model_args(cfg)
    for rank in range(cfg.parallel.pp):
        assert buffer_bytes(args, cfg, rank) == buffer_bytes(args, cfg, rank, local_placements)
