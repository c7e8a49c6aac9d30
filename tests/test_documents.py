"""Documents kept apart (`data.document_mask`, issue 36 item 5).

The reference is each document run alone: with the mask on, the packed window's logits equal,
document by document, those of the model run on that document only (fp32, rtol 1e-5), on one
device for GQA and for latent attention; a training step's loss equals the sum of the
per-document token losses; the ring's masked block pairs (whole pairs and single rows that see
nothing) give one device's outputs and gradients without NaN; and `fivecut verify` passes with
the mask on (ring here; one process vs dp=2, tp=2 with SP, pp=2 1F1B, Ulysses and USP in the
sweep) on a corpus of many short documents the test writes; and (sweep) `fivecut ledger` stays
exact: ratio=1.000, activation_ratio=1.000."""

from __future__ import annotations

import json
import random

import pytest
import torch
from test_bad_input import refused, train_argv
from test_e2e import assert_activations_exact, assert_every_cut_exact

from fivecut.cli import main
from fivecut.config import load_config
from fivecut.launch import spawn
from fivecut.layout import ParallelDims
from fivecut.mesh import Mesh
from fivecut.model.documents import Documents
from fivecut.model.presets import get_preset
from fivecut.model.transformer import CausalSDPA, build_model
from fivecut.parallel.context import RingAttention, UlyssesAttention, zigzag_positions
from fivecut.parallel.parallelize import token_loss_sum
from fivecut.train.run import forward_backward, setup

TOL = {"rtol": 1e-5, "atol": 1e-6}
GRAD_TOL = {"rtol": 1e-5, "atol": 2e-6}  # as tests/test_context.py: block sums in another order
EOT = 0  # an id standing for the end of text in the model-level tests


def test_document_ids_and_positions_restart_after_each_end_of_text():
    tokens = torch.tensor([[5, 6, EOT, 7, EOT, EOT, 8, 9]])
    docs = Documents.of(tokens, EOT)
    assert docs.ids.tolist() == [[0, 0, 0, 1, 1, 2, 3, 3]]  # the end of text closes its document
    assert docs.positions.tolist() == [[0, 1, 2, 0, 1, 0, 0, 1]]
    at = torch.arange(8)
    seen = docs.visible(at, at)[0, 0]
    assert seen[6].tolist() == [False] * 6 + [True, False] and seen[2, :3].all() and not seen[3, 2]


def packed_tokens(vocab: int, seq: int = 48, rows: int = 2) -> torch.Tensor:
    """Rows of random ids with end-of-text ids at a few places (documents of 1 to ~20 tokens)."""
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(1, vocab, (rows, seq), generator=g)
    tokens[0, [5, 6, 20, 33]] = EOT
    tokens[1, [0, 17, 40]] = EOT
    return tokens


@pytest.mark.parametrize("preset", ["tiny", "tiny-mla"])
def test_packed_documents_give_each_documents_own_logits(preset):
    """The packed forward with the mask equals each document run alone; without it, it does not."""
    model = build_model(get_preset(preset), seed=0)
    tokens = packed_tokens(model.args.vocab_size)
    with torch.no_grad():
        packed = model(tokens, documents=Documents.of(tokens, EOT))
        unmasked = model(tokens)
        for row in range(tokens.shape[0]):
            ends = (tokens[row] == EOT).nonzero().flatten().tolist()
            starts = [0] + [e + 1 for e in ends if e + 1 < tokens.shape[1]]
            stops = starts[1:] + [tokens.shape[1]]
            for a, b in zip(starts, stops):
                alone = model(tokens[row : row + 1, a:b])[0]
                torch.testing.assert_close(packed[row, a:b], alone, **TOL, msg=lambda m, a=a: f"doc at {a}: {m}")
    assert not torch.allclose(packed, unmasked, **TOL)


# ---------------------------------------------------------------- the cores under context parallelism

# GQA (2 query heads per kv head) and a narrower value head (latent attention's)
CORE_SHAPES = {"gqa": (4, 2, 8, 8), "latent": (4, 4, 24, 12)}  # heads, kv heads, q/k head dim, v head dim
SEQ = 32
# cp=2 zigzag: rank 0 holds [0, 8) + [24, 32), rank 1 [8, 24). At step 1 rank 0's queries [24, 32)
# meet keys [8, 24) and rank 1's queries [8, 24) keys [0, 8). An end of text at 23 (both rows) masks
# rank 0's pair whole (skipped); one at 7 in row 0 only hides all of row 0's queries from rank 1's
# block while row 1's document 4..12 spans it: rows that see nothing inside a computed pair.
EOT_AT = [12, 15, 23]


def core_inputs(kind: str):
    h, kv, qk, v = CORE_SHAPES[kind]
    g = torch.Generator().manual_seed(11)
    shapes = ((2, h, SEQ, qk), (2, kv, SEQ, qk), (2, kv, SEQ, v), (2, h, SEQ, v))
    tokens = torch.ones(2, SEQ, dtype=torch.long)
    tokens[:, EOT_AT] = EOT
    tokens[0, 7] = EOT
    tokens[1, 3] = EOT
    return [torch.randn(s, generator=g) for s in shapes], Documents.of(tokens, EOT)


def masked_core_run(mode: str, kind: str):
    """This rank's positions, output and q, k, v gradients under the masked ring or Ulysses."""
    mesh = Mesh(ParallelDims(cp=2, cp_mode=mode), "cpu")
    group = mesh.group("cp")
    (q, k, v, grad), docs = core_inputs(kind)
    if mode == "ring":
        at = zigzag_positions(group.rank, 2, SEQ // 2)
        core = RingAttention(group)
    else:
        at = torch.arange(group.rank * SEQ // 2, (group.rank + 1) * SEQ // 2)
        core = UlyssesAttention(CausalSDPA(), group)
    q, k, v = (t[:, :, at].clone().requires_grad_() for t in (q, k, v))
    out = core(q, k, v, docs.chunk(at))
    out.backward(grad[:, :, at])
    return at, out.detach(), q.grad, k.grad, v.grad


@pytest.mark.multirank
@pytest.mark.parametrize("mode", ["ring", pytest.param("ulysses", marks=pytest.mark.sweep)])
@pytest.mark.parametrize("kind", list(CORE_SHAPES))
def test_masked_cores_equal_one_device(mode, kind):
    """Each rank's output and gradients equal one device's masked SDPA at its positions: the
    ring's pairs take their slice of the mask, a pair wholly in other documents is skipped, and a
    row that sees nothing of a block leaves the online-softmax merge unchanged (no NaN)."""
    (q, k, v, grad), docs = core_inputs(kind)
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = CausalSDPA()(q, k, v, docs)
    out.backward(grad)
    expected = (out.detach(), q.grad, k.grad, v.grad)
    for rank, (at, *got) in enumerate(spawn(masked_core_run, 2, mode, kind)):
        for name, a, want in zip(("out", "dq", "dk", "dv"), got, expected):
            assert torch.isfinite(a).all(), (rank, name)
            msg = lambda m, n=name, r=rank: f"{mode} rank {r} {n}: {m}"  # noqa: E731
            torch.testing.assert_close(a, want[:, :, at], **(TOL if name == "out" else GRAD_TOL), msg=msg)


# ---------------------------------------------------------------- a run

WORDS = "the a cat dog sat ran on under over bright dark river hill moon sun red blue green old new".split()


@pytest.fixture(scope="module")
def short_documents(tmp_path_factory):
    """A folder of 400 small .txt files (5 to 30 words each: several documents per 32-token window)."""
    folder = tmp_path_factory.mktemp("documents")
    r = random.Random(0)
    for i in range(400):
        (folder / f"doc{i:04d}.txt").write_text(" ".join(r.choice(WORDS) for _ in range(r.randint(5, 30))) + ".\n")
    return folder


@pytest.fixture(scope="module")
def mixture(short_documents, tmp_path_factory) -> list[str]:
    """Two sources mixed 0.7 / 0.3 (issue 36's parity case): the folder above and a JSONL file of
    600 short documents, one a line."""
    jsonl = tmp_path_factory.mktemp("jsonl") / "short.jsonl"
    r = random.Random(1)
    lines = [json.dumps({"text": " ".join(r.choice(WORDS) for _ in range(r.randint(3, 25)))}) for _ in range(600)]
    jsonl.write_text("\n".join(lines) + "\n")
    return [f"data.source={json.dumps([str(short_documents), str(jsonl)])}", "data.weights=[0.7, 0.3]"]


def document_sets(folder, cache) -> list[str]:
    return [
        "data.document_mask=true",
        f'data.source="{folder}"',
        'data.tokenizer="gpt2"',
        f'data.cache_dir="{cache}"',
        "data.val_fraction=0.2",
    ]


def first_step_loss(cfg):
    """On one process: the trainer's loss at step 0 and the same loss from each document alone."""
    ctx = setup(cfg)
    inputs, targets = ctx.sampler.local_batches(0, 0, 1, 1)[0]
    eot, model = ctx.tokenizer.eot_id, ctx.par.module
    total = 0.0
    with torch.no_grad():
        for row in range(inputs.shape[0]):
            cuts = [0] + [i + 1 for i in (inputs[row] == eot).nonzero().flatten().tolist()] + [inputs.shape[1]]
            for a, b in zip(cuts, cuts[1:]):
                if a < b:
                    total += float(token_loss_sum(model(inputs[row : row + 1, a:b]), targets[row : row + 1, a:b]))
    expected = total / ctx.sampler.tokens_in_global_batch()
    documents = int((inputs == eot).sum())
    return float(forward_backward(ctx, 0)), expected, documents


@pytest.mark.multirank
@pytest.mark.parametrize("mask", [True, False])
def test_a_training_steps_loss_is_the_documents_own(short_documents, tmp_path, mask):
    """The trainer's step-0 loss equals the per-document reference with the mask on, and differs
    from it with the mask off (so a flag accepted and ignored fails here)."""
    sets = document_sets(short_documents, tmp_path / "cache")
    sets[0] = f"data.document_mask={str(mask).lower()}"
    shape = ['model.preset="tiny-gpt2"', "model.init_std=0.3", "train.seq_len=32", "train.global_batch=4"]
    cfg = load_config(None, [*sets, *shape])  # init_std: logits far from uniform, so the mask shows
    loss, expected, documents = spawn(first_step_loss, 1, cfg)[0]
    assert documents >= 4  # windows hold several documents
    if mask:
        assert loss == pytest.approx(expected, rel=1e-5)
    else:
        assert abs(loss - expected) > 1e-3 * expected


LAYOUTS = [
    "cp=2,cp_mode=ring",
    pytest.param("dp=2,zero=1", marks=pytest.mark.sweep),
    pytest.param("tp=2,sp=true", marks=pytest.mark.sweep),
    pytest.param("pp=2,pp_schedule=1f1b,microbatches=2", marks=pytest.mark.sweep),
    pytest.param("cp=2,cp_mode=ulysses", marks=pytest.mark.sweep),
    pytest.param("cp=4,cp_mode=usp,cp_ulysses=2", marks=pytest.mark.sweep),
]


@pytest.mark.multirank
@pytest.mark.parametrize("layout", LAYOUTS)
def test_verify_passes_with_document_masks(capsys, short_documents, mixture, tmp_path, layout):
    argv = ["verify", "--model", "tiny-gpt2", "--layout", layout, "--steps", "3"]
    sets = document_sets(short_documents, tmp_path / "cache") + ["train.seq_len=32"] + mixture  # its source wins
    code = main(argv + [arg for s in sets for arg in ("--set", s)])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert code == 0 and last.startswith("PASS"), last


@pytest.mark.multirank
@pytest.mark.sweep
@pytest.mark.parametrize("layout", ["dp=2", "tp=2,sp=true", "cp=2,cp_mode=ulysses", "cp=2,cp_mode=ring"])
@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_ledger_is_exact_with_document_masks(capsys, short_documents, tmp_path, layout, recompute):
    """The mask adds no communication (ratio=1.000); the activations' closed form counts SDPA's
    mask [b, 1, s, s] where the core keeps it (activation_ratio=1.000)."""
    sets = document_sets(short_documents, tmp_path / "cache") + [f'train.recompute="{recompute}"']
    assert main(["ledger", "--model", "tiny-gpt2", "--layout", layout, *[a for s in sets for a in ("--set", s)]]) == 0
    out = capsys.readouterr().out
    assert_every_cut_exact(out)
    assert_activations_exact(out)


def test_document_masks_without_an_end_of_text_id_are_refused(capsys, tmp_path):
    err = refused(capsys, train_argv(tmp_path, "data.document_mask=true"))
    assert "data.document_mask" in err and "data.tokenizer='gpt2'" in err
