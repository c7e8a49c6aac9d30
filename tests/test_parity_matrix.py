"""The parity matrix (scripts/parity_matrix.py): its rows cover what issue 18 lists, and the CI subset
PASSes through the script's own code (verify's functions on real gloo ranks, 2 steps a row)."""

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "parity_matrix.py"


def load_script():
    spec = importlib.util.spec_from_file_location("parity_matrix", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


pm = load_script()


def test_the_matrix_has_48_rows_and_a_ci_subset_of_12():
    names = [row.name for row in pm.ROWS]
    assert len(names) == len(set(names)) and len(names) >= 48
    ci = pm.selected(None, "ci")
    assert len(ci) >= 12 and all(row.world <= 4 and pm.pending(row) is None for row in ci)


def test_the_rows_cover_what_the_issue_lists():
    """Every pair of cuts, schedule, CP mode, ZeRO stage in and out of a pipeline, etp and zero_shard,
    accumulation, dense and MoE models, each MoE option under EP: some row holds each."""
    for what, entries in pm.coverage(pm.ROWS).items():
        missing = [need for need, rows in entries if not rows]
        assert not missing, (what, missing)
    assert set(pm.SCHEDULES) == {"gpipe", "1f1b", "interleaved", "zb1p", "dualpipev"}


def test_every_pair_of_cuts_runs_on_this_commit():
    runnable = [row for row in pm.ROWS if pm.pending(row) is None]
    pairs = dict(pm.coverage(runnable)["every pair of cuts"])
    assert all(pairs.values()), [pair for pair, rows in pairs.items() if not rows]


def test_a_row_whose_option_has_not_landed_is_pending():
    row = pm.Row("future", "dp=2,not_a_field=2")
    assert pm.pending(row) == "pending: parallel.not_a_field not on this commit"
    assert pm.run_row(row, None, {}).status.startswith("pending")
    assert pm.pending(pm.Row("ring", "cp=2")) is None


def test_the_deepseek_row_is_its_config():
    row = next(row for row in pm.ROWS if row.name == "deepseek-v3-mini")
    t = row.table
    assert (row.world, t["pp"], t["dp"], t["ep"], t["zero"], t["pp_schedule"]) == (8, 2, 4, 2, 1, "dualpipev")
    features = pm.features(row)
    assert {"moe:sigmoid", "moe:group_limited", "moe:aux_free", "moe:eplb_slots", "moe:first_dense_layers"} <= features
    assert "tp" not in features


@pytest.fixture(scope="module")
def ci_outcomes():
    return pm.run_rows(pm.selected(None, "ci"), steps=2, say=lambda line: None)


def test_the_ci_rows_pass(ci_outcomes):
    failed = [(o.row.name, o.status, o.note) for o in ci_outcomes if o.status != "PASS"]
    assert not failed
    assert all(o.loss <= 1e-5 and o.grad_first <= 1e-5 and o.val <= 1e-5 for o in ci_outcomes)


def test_the_document_holds_every_row(ci_outcomes):
    text = pm.document(ci_outcomes, "python scripts/parity_matrix.py --subset ci", 60.0)
    assert "at commit `" in text and "--subset ci" in text
    assert sum(line.startswith("| ") for line in text.splitlines()) == len(ci_outcomes) + 1  # the rows and the head
