"""`fivecut verify` under train.dtype = "bf16": both runs in bf16, judged by bf16's measured tolerances
(fivecut.cli.TOLERANCES; the measurement: benchmarks/verify_drift.py); every tolerance set by a flag; a
header that says the dtype, the tolerances and whether the layout is compiled."""

from types import SimpleNamespace

import pytest
import torch.distributed as dist

import fivecut.launch
from fivecut import cli
from fivecut.cli import TOLERANCES, Tolerances, main, verify_tolerances

BF16 = ["--set", 'train.dtype="bf16"']


def verify_argv(cache: str, *extra: str) -> list[str]:
    return ["verify", "--layout", "dp=2", "--steps", "3", "--set", f'data.cache_dir="{cache}"', *extra]


@pytest.fixture
def small(tmp_path) -> list[str]:
    """verify's arguments on a small corpus, for runs that spawn nothing (`TwoRuns`)."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("To be, or not to be, that is the question.\n" * 40)
    return verify_argv(str(tmp_path / "cache"), "--steps", "2", "--set", f'data.source="{corpus}"')


def doubled_gradient(loss):
    """The same value, twice the gradient: what a rank that scaled its gradient by 2 contributes."""
    return loss + (loss - loss.detach())


def rank_one_doubles_its_gradient(cfg, measure_activations=False):
    """verify's rank body (`cli.train_quietly`) with rank 1's loss gradient doubled and its loss kept:
    a dp layout made wrong on purpose, inside the spawned rank (the single process has no rank 1)."""
    from fivecut.train import trainer

    real_setup = trainer.setup

    def setup(cfg):
        ctx = real_setup(cfg)
        if dist.get_rank() == 1:  # the loss of a forward, computed in the head a chunk at a time
            forward_loss = ctx.par.forward_loss
            ctx.par.forward_loss = lambda *inputs: doubled_gradient(forward_loss(*inputs))
        return ctx

    trainer.setup = setup  # this rank's process only
    return cli.train_quietly(cfg, measure_activations)


def test_dp2_passes_under_bf16(capsys, byte_cache):
    assert main(verify_argv(byte_cache, *BF16)) == 0
    out = capsys.readouterr().out
    assert "both runs bf16 on cpu (gloo), both eager" in out
    assert "tolerances (bf16; relative difference): loss 1e-03 at every step; gradient norm 1e-03 at step 1, " in out
    assert out.strip().splitlines()[-1].startswith("PASS")


def test_a_gradient_doubled_on_one_rank_fails_under_bf16(capsys, monkeypatch, byte_cache):
    monkeypatch.setattr(cli, "train_quietly", rank_one_doubles_its_gradient)
    assert main(verify_argv(byte_cache, *BF16)) == 1
    last = capsys.readouterr().out.strip().splitlines()[-1]
    print(last)  # the differences measured (pytest -s)
    assert last.startswith("FAIL") and "grad_norm at step 1 " in last


def test_each_flag_sets_its_tolerances():
    assert verify_tolerances("fp32", dict.fromkeys(cli.TOLERANCE_FLAGS)) == Tolerances(1e-5, 1e-5, 1e-5, 1e-3)
    assert verify_tolerances("bf16", {}) == TOLERANCES["bf16"]
    given = {"--rtol": 2e-4, "--grad-rtol": 3e-4, "--later-grad-rtol": 4e-2}
    assert verify_tolerances("bf16", given) == Tolerances(
        loss=2e-4, val_loss=2e-4, first_grad_norm=3e-4, later_grad_norm=4e-2
    )


class TwoRuns:
    """Stands in for `fivecut.launch.spawn`: the single process's result first, then the layout's."""

    def __init__(self, *results):
        self.results, self.configs = list(results), []

    def __call__(self, fn, world_size, cfg, *args, **kwargs):
        self.configs.append(cfg)
        return [self.results[len(self.configs) - 1]] * world_size


def run(losses, grad_norms, val):
    return SimpleNamespace(losses=losses, grad_norms=grad_norms, val_losses={len(losses): val})


REFERENCE = run([2.0, 1.9], [1.0, 0.9], 2.5)


@pytest.mark.parametrize(
    "layout,flags",
    [
        (run([2.0, 1.9], [1.0, 0.9], 2.5 * (1 + 5e-5)), ["--rtol", "1e-4"]),  # the validation loss
        (run([2.0, 1.9], [1.0 * (1 + 5e-5), 0.9], 2.5), ["--grad-rtol", "1e-4"]),  # step 1's gradient norm
        (run([2.0, 1.9], [1.0, 0.9 * (1 + 5e-3)], 2.5), ["--later-grad-rtol", "1e-2"]),  # a later one
    ],
)
def test_a_flag_governs_its_quantity(capsys, monkeypatch, small, layout, flags):
    """Each difference FAILs fp32's default and PASSes once its flag allows it."""
    for extra, code in (([], 1), (flags, 0)):
        monkeypatch.setattr(fivecut.launch, "spawn", TwoRuns(REFERENCE, layout))
        assert main([*small, *extra]) == code
        assert capsys.readouterr().out.strip().splitlines()[-1].startswith("PASS" if code == 0 else "FAIL")


@pytest.mark.parametrize(
    "sets,said",
    [
        ([], "both runs fp32 on cpu (gloo), both eager"),
        (["train.compile=true"], "fp32 on cpu (gloo), the layout compiled (train.compile), the single process eager"),
        (['train.dtype="bf16"', 'train.reduce_dtype="bf16"'], "both runs bf16, the layout's gradients reduced in bf16"),
    ],
)
def test_the_header_says_the_dtype_and_compilation(capsys, monkeypatch, small, sets, said):
    spawn = TwoRuns(REFERENCE, REFERENCE)
    monkeypatch.setattr(fivecut.launch, "spawn", spawn)
    assert main([*small, *(a for s in sets for a in ("--set", s))]) == 0
    assert said in capsys.readouterr().out
    reference, layout = spawn.configs
    assert reference.train.dtype == layout.train.dtype and not reference.train.compile


@pytest.mark.parametrize("flag", ["--rtol", "--grad-rtol", "--later-grad-rtol"])
def test_a_tolerance_flag_must_be_positive(capsys, monkeypatch, small, flag):
    monkeypatch.setattr(fivecut.launch, "spawn", TwoRuns())
    assert main([*small, flag, "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and f"{flag}=0.0 must be > 0" in err and "Traceback" not in err
