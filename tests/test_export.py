"""`fivecut export`: checkpoints out as Hugging Face folders.

Tolerance: transformers' LlamaForCausalLM and fivecut's Transformer run the same fp32 math in a
different order of operations (its RoPE, RMSNorm and attention kernels), so their logits agree
to rounding: 1e-5 absolute on logits of magnitude ~4 (measured: about 1e-6).
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from test_ddp import small_config

from fivecut.cli import main
from fivecut.launch import spawn
from fivecut.model.args import ModelArgs
from fivecut.model.transformer import build_model
from fivecut.train import checkpoint
from fivecut.train.trainer import train
from fivecut.weights import export as ex
from fivecut.weights.names import to_hf

LOGITS_ATOL = 1e-5  # see the module doc
# `fivecut eval` prints the loss to 4 decimals and the perplexity to 2; a value that differs from the
# reference by rounding (1e-5, the project's bar) can print one unit of the last digit apart, so the
# printed numbers are held to the reference within half a unit of that digit plus 1e-5 relative
EVAL_RTOL = 1e-5
EVAL_LINE = r"(?P<loss>\d+\.\d{4}), perplexity (?P<perplexity>\d+\.\d{2})"


@contextlib.contextmanager
def one_rank():
    """A one-process group in this process, for `train`; torn down afterwards."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def run_config(cache: str, folder: Path, preset: str, tokenizer: str, *extra: str):
    return small_config(
        cache,
        f'model.preset="{preset}"',
        f'data.tokenizer="{tokenizer}"',
        "train.steps=2",
        "train.global_batch=2",
        "train.warmup=1",
        f'checkpoint.dir="{folder / "ck"}"',
        f'log.out_dir="{folder / "out"}"',
        *extra,
    )


def train_here(cfg) -> Path:
    torch.set_num_threads(1)
    with one_rank():
        train(cfg, quiet=True, resume="never")
    return Path(cfg.checkpoint.dir)


def train_spawned(cfg):
    train(cfg, quiet=True, resume="never")


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> str:
    return str(tmp_path_factory.getbasetemp() / "token-cache")  # the `byte_cache` of the other tests


@pytest.fixture(scope="module")
def small_run(cache, tmp_path_factory) -> Path:
    """`small` (GPT-2 tokenizer, tied head) after 2 steps: its checkpoint.dir."""
    return train_here(run_config(cache, tmp_path_factory.mktemp("small"), "small", "gpt2"))


@pytest.fixture(scope="module")
def tiny_run(cache, tmp_path_factory) -> Path:
    """`tiny` (byte tokenizer, untied head), saved after steps 1 and 2."""
    return train_here(run_config(cache, tmp_path_factory.mktemp("tiny"), "tiny", "byte", "checkpoint.every=1"))


def fivecut_model(path: Path):
    """fivecut's own model with the checkpoint's weights."""
    args = ModelArgs(**checkpoint.read_meta(path)["model"])
    state = checkpoint.full_state(path)
    if args.tie_embeddings:
        state["output.weight"] = state["tok_embeddings.weight"]
    model = build_model(args)
    model.load_state_dict(state)
    return model.eval(), args


def max_logit_difference(ckpt: Path, folder: Path) -> float:
    from transformers import LlamaForCausalLM

    ours, args = fivecut_model(ckpt)
    theirs = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokens = torch.randint(0, args.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return (ours(tokens) - theirs(tokens).logits).abs().max().item()


@pytest.fixture(scope="module")
def small_export(small_run, tmp_path_factory) -> tuple[Path, list[str]]:
    """`small_run` exported once, and what the export printed."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        out = ex.export(small_run, tmp_path_factory.mktemp("small-hf") / "hf")
    return out, printed.getvalue().splitlines()


def test_small_round_trips_into_transformers(small_run, small_export):
    out, printed = small_export
    assert printed[-1].startswith("exported 'small' step 2") and printed[-1].endswith(f"to {out}")
    assert sorted(p.name for p in out.iterdir()) == sorted(line.split("/")[-1] for line in printed[:-1])
    assert max_logit_difference(checkpoint.newest(small_run), out) <= LOGITS_ATOL
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] and config["vocab_size"] == 50257 and config["eos_token_id"] == 50256
    assert "lm_head.weight" not in load_file(out / "model.safetensors")  # a tied head is written once
    assert json.loads((out / "generation_config.json").read_text()) == {"bos_token_id": 50256, "eos_token_id": 50256}


def test_generate_from_the_checkpoint_and_from_its_export_agree(small_run, small_export, capsys):
    """`fivecut generate` reads a checkpoint (GPT-2 tokenizer from its run) and the exported folder
    (its tokenizer.json) to the same greedy text: the weights and the tokenizer survived the trip."""
    from fivecut.cli import main

    prompt = ["--prompt", "ROMEO:", "--temperature", "0", "--max-new-tokens", "6"]
    assert main(["generate", "--checkpoint", str(small_run), *prompt]) == 0
    from_checkpoint = capsys.readouterr().out
    assert main(["generate", "--init-from", f"hf:{small_export[0]}", *prompt]) == 0
    assert capsys.readouterr().out == from_checkpoint and from_checkpoint.startswith("ROMEO:")


def test_the_gpt2_tokenizer_loads_in_transformers(small_export):
    from transformers import AutoTokenizer

    from fivecut.train.tokenizer import get_tokenizer

    tokenizer = AutoTokenizer.from_pretrained(small_export[0])
    assert tokenizer("Hello world").input_ids == [15496, 995]
    text = "  First Citizen:\n\nWe're 123 naïve  words\t 你好 's"
    assert tokenizer(text).input_ids == get_tokenizer("gpt2").encode(text)
    assert tokenizer("a<|endoftext|>b").input_ids == [64, 50256, 65]  # special to transformers (plain text to fivecut)
    assert tokenizer.eos_token_id == 50256 and tokenizer.decode([15496, 995]) == "Hello world"


def test_a_model_s_own_tokenizer_is_written_as_its_json(tmp_path):
    from transformers import AutoTokenizer

    from fivecut.train.tokenizer import FileTokenizer

    own = FileTokenizer(ex.gpt2_tokenizer(), 50256, "a test")
    written = ex.write_tokenizer(tmp_path, own, 64)
    assert written == ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]
    assert (tmp_path / "tokenizer.json").read_text() == own.json
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded("Hello world").input_ids == [15496, 995] and loaded.eos_token_id == 50256


def test_an_untied_model_in_several_shards(tiny_run, tmp_path, capsys):
    out = ex.export(tiny_run, tmp_path / "hf", max_shard_bytes=300_000)
    assert "no Hugging Face tokenizer" in capsys.readouterr().out
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 3 and files == sorted(p.name for p in out.glob("model-*.safetensors"))
    tensors = {name: t for file in files for name, t in load_file(out / file).items()}
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    assert "lm_head.weight" in tensors and not (out / "tokenizer.json").exists()
    for file in files:  # each shard within the limit, unless one tensor alone exceeds it
        part = load_file(out / file)
        assert len(part) == 1 or sum(t.numel() * 4 for t in part.values()) <= 300_000
    assert max_logit_difference(checkpoint.newest(tiny_run), out) <= LOGITS_ATOL


@pytest.mark.multirank
def test_a_checkpoint_saved_under_tensor_parallelism(cache, tmp_path):
    """tiny-gpt2 under tp=2 pads its 50257-row vocabulary to split it; the export holds the global tensors."""
    cfg = run_config(cache, tmp_path, "tiny-gpt2", "gpt2", "parallel.tp=2")
    spawn(train_spawned, 2, cfg)
    out = ex.export(tmp_path / "ck", tmp_path / "hf")
    saved = checkpoint.full_state(checkpoint.newest(tmp_path / "ck"))
    exported = load_file(out / "model.safetensors")
    assert exported.keys() == {to_hf(name) for name in saved}
    assert exported["model.embed_tokens.weight"].shape == (50257, 64)
    for name, tensor in saved.items():
        assert torch.equal(exported[to_hf(name)], tensor), name


def test_a_moe_model_keeps_fivecut_names(cache, tmp_path):
    root = train_here(run_config(cache, tmp_path, "tiny-moe", "byte", "moe.bias_update_rate=0.01"))
    out = ex.export(root, tmp_path / "hf")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["FivecutMoEForCausalLM"] and "Weights in and out" in config["note"]
    assert ModelArgs(**config["fivecut"]) == ModelArgs(**checkpoint.read_meta(checkpoint.newest(root))["model"])
    exported = load_file(out / "model.safetensors")
    saved = checkpoint.full_state(checkpoint.newest(root))
    biases = checkpoint.full_state(checkpoint.newest(root), "moe.")
    saved |= {f"layers.{key.split('.')[0]}.feed_forward.expert_bias": t for key, t in biases.items()}
    assert exported.keys() == saved.keys() and "layers.1.feed_forward.experts.w1" in exported
    assert any(t.abs().sum() > 0 for key, t in biases.items())  # the routing biases moved, and are kept
    for name, tensor in saved.items():
        assert torch.equal(exported[name], tensor), name


def export_cli(capsys, *args: str) -> tuple[int, str]:
    code = main(["export", *args])
    return code, capsys.readouterr().err


def test_a_non_empty_out_folder_is_refused_untouched(tiny_run, tmp_path, capsys):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "mine.txt").write_text("keep me")
    code, err = export_cli(capsys, "--checkpoint", str(tiny_run), "--out", str(out))
    assert code == 2 and str(out) in err and "choose another folder" in err and "Traceback" not in err
    assert [p.name for p in out.iterdir()] == ["mine.txt"] and (out / "mine.txt").read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]


def test_an_empty_out_folder_is_filled(tiny_run, tmp_path, capsys):
    (tmp_path / "hf").mkdir()
    assert main(["export", "--checkpoint", str(tiny_run), "--out", str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


@pytest.mark.parametrize(
    "case",
    ["missing checkpoint", "missing step", "incomplete checkpoint", "no checkpoint in dir", "bad size", "bad dtype"],
)
def test_bad_input_exits_2_naming_it(case, tiny_run, tmp_path, capsys):
    step = checkpoint.newest(tiny_run)
    args, named = {
        "missing checkpoint": (["--checkpoint", str(tmp_path / "nowhere")], str(tmp_path / "nowhere")),
        "missing step": (["--checkpoint", str(tiny_run), "--step", "99"], "--step 99"),
        "incomplete checkpoint": (["--checkpoint", str(tmp_path / "step-00000002")], "COMPLETE"),
        "no checkpoint in dir": (["--checkpoint", str(tmp_path)], str(tmp_path)),
        "bad size": (["--checkpoint", str(step), "--max-shard-size", "5XB"], "--max-shard-size"),
        "bad dtype": (["--checkpoint", str(step), "--dtype", "int8"], "--dtype"),
    }[case]
    (tmp_path / "step-00000002").mkdir()  # a checkpoint folder without its marker
    code, err = export_cli(capsys, *args, "--out", str(tmp_path / "hf"))
    assert code == 2 and named in err and "Traceback" not in err, err
    assert not (tmp_path / "hf").exists()


def test_a_failed_export_leaves_nothing(tiny_run, tmp_path, monkeypatch):
    def broken(*_):
        raise OSError("disk full")

    monkeypatch.setattr(ex, "write_tokenizer", broken)
    with pytest.raises(OSError, match="disk full"):
        ex.export(tiny_run, tmp_path / "hf")
    assert list(tmp_path.iterdir()) == []


def test_step_picks_an_older_checkpoint_and_bf16_casts(tiny_run, tmp_path):
    out = ex.export(tiny_run, tmp_path / "hf", step=1, dtype="bf16")
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    tensors = load_file(out / "model.safetensors")
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())


def test_sizes_parse_as_hugging_face_writes_them():
    assert ex.parse_size("2000000") == 2_000_000
    assert ex.parse_size("500MB") == 500 * 10**6 and ex.parse_size("5GB") == 5 * 10**9
    assert ex.parse_size("2GiB") == 2 * 2**30 and ex.parse_size("1.5kb") == 1500
    for bad in ("", "5XB", "-3MB", "0", "GB"):
        with pytest.raises(ValueError, match="--max-shard-size"):
            ex.parse_size(bad)


def killed_export(out: Path) -> Path:
    """The temporary folder an export to `out` leaves when it is killed mid-write (a process that
    writes half a shard, then dies without cleaning up)."""
    import subprocess
    import sys

    code = (
        "import os, sys; from pathlib import Path; from fivecut.weights.export import write_atomically; "
        "write_atomically(Path(sys.argv[1]), lambda tmp: ((tmp / 'model.safetensors').write_text('half'), "
        "os._exit(9)))"
    )
    assert subprocess.run([sys.executable, "-c", code, str(out)]).returncode == 9
    (left,) = [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.tmp-")]
    return left


def test_the_next_export_removes_what_a_killed_one_left(tiny_run, tmp_path, capsys):
    """Its own temporary folders for that destination only: a killed export's, one of an older
    fivecut (no PID); not another destination's, not a running export's, not a file, not a look-alike."""
    import os

    out = tmp_path / "hf"
    killed, older = killed_export(out), tmp_path / ".hf.tmp-ab1cd_9z"
    running, other = tmp_path / f".hf.tmp-{os.getpid()}-qwertyui", tmp_path / ".hf2.tmp-abcdefgh"
    lookalike, a_file = tmp_path / ".hf.tmp-abcdefgh.keep", tmp_path / ".hf.tmp-zyxw9876"
    for folder in (older, running, other, lookalike):
        folder.mkdir()
        (folder / "x").write_text("x")
    a_file.write_text("mine")
    capsys.readouterr()
    assert main(["export", "--checkpoint", str(tiny_run), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    line = f"removed 2 temporary folder(s) of an interrupted export to {out}: "
    assert line in printed and killed.name in printed and older.name in printed, printed
    assert f"note: left {running.name}: an export to {out} still running writes it" in printed, printed
    assert not killed.exists() and not older.exists() and (out / "model.safetensors").is_file()
    assert all((f / "x").is_file() for f in (running, other, lookalike)) and a_file.read_text() == "mine"


def test_workers_are_bounded_by_the_cores_and_said(tiny_run, tmp_path, capsys, monkeypatch):
    """--workers 100000 on a 1-core machine: one process writes every shard, in this process (no
    pool may start); the lowering is said. --workers 0 is refused before anything is written."""

    def no_pool(*_):
        raise AssertionError("a pool of worker processes was started")

    monkeypatch.setattr(ex.os, "cpu_count", lambda: 1)
    monkeypatch.setattr(ex.multiprocessing, "get_context", no_pool)
    argv = ["export", "--checkpoint", str(tiny_run), "--max-shard-size", "100KB", "--workers", "100000"]
    assert main([*argv, "--out", str(tmp_path / "hf")]) == 0
    printed = capsys.readouterr().out
    shards = len(list((tmp_path / "hf").glob("model-*-of-*.safetensors")))
    assert shards > 1 and f"note: --workers 100000 lowered to 1 ({shards} shard(s) to write, 1 cores here)" in printed
    for bad in ("0", "-3"):
        code, err = export_cli(capsys, *argv[1:-2], f"--workers={bad}", "--out", str(tmp_path / "none"))
        assert code == 2 and f"--workers {bad} is not positive" in err and "Traceback" not in err, err
        assert err.count("\n") == 1 and not (tmp_path / "none").exists()


@pytest.mark.multirank
def test_eval_of_a_checkpoint_is_the_same_under_a_layout(tiny_run, cache, capsys):
    """`fivecut eval --checkpoint` in one process and under cp=2 (ring) print the same loss, and it is
    the whole model's mean token loss on the validation windows."""
    from fivecut.cli import main
    from fivecut.train.data import eval_batches, load_tokens
    from fivecut.weights.load import single_model

    sizes = ["--batches", "2", "--batch-size", "2", "--seq-len", "32", "--set", f'data.cache_dir="{cache}"']
    printed = []
    for layout in ([], ["--layout", "cp=2,cp_mode=ring"]):
        assert main(["eval", "--checkpoint", str(tiny_run), *sizes, *layout]) == 0
        printed.append(re.fullmatch(EVAL_LINE, capsys.readouterr().out.strip().split("loss ")[-1]))
    model, _ = single_model(checkpoint=str(tiny_run))
    batches = eval_batches(load_tokens("shakespeare", "byte", cache).val, 32, 2, 2)
    with torch.no_grad():
        losses = [torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()) for x, y in batches]
    loss = float(sum(losses)) / 2
    for line in printed:  # the printed digits round the loss; the loss itself differs by rounding (ring CP)
        assert line is not None
        assert float(line["loss"]) == pytest.approx(loss, rel=EVAL_RTOL, abs=0.5e-4)
        assert float(line["perplexity"]) == pytest.approx(math.exp(loss), rel=EVAL_RTOL, abs=0.5e-2)


# ---------------------------------------------------------------- damaged Hugging Face folders: refused by name

SHAPE = ModelArgs(vocab_size=256, dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=64, max_seq_len=64)


def hf_folder(folder: Path, max_bytes: int = ex.DEFAULT_SHARD_BYTES) -> Path:
    """A small Llama folder as `export` writes it (random weights, no tokenizer files: the byte tokenizer)."""
    from safetensors.torch import save_file

    from fivecut.train.tokenizer import get_tokenizer
    from fivecut.weights.hf import llama_config
    from fivecut.weights.source import expected_shapes

    tensors = {to_hf(name): torch.randn(shape) for name, shape in expected_shapes(SHAPE).items()}
    folder.mkdir()
    ex.write_json(folder / "config.json", llama_config(SHAPE) | {"fivecut_tokenizer": get_tokenizer("byte").name})
    parts, size = [{}], 0
    for name, t in tensors.items():
        if parts[-1] and size + t.numel() * 4 > max_bytes:
            parts, size = [*parts, {}], 0
        parts[-1][name], size = t, size + t.numel() * 4
    if len(parts) == 1:
        save_file(parts[0], str(folder / ex.SAFETENSORS))
        return folder
    files = [f"model-{k}.safetensors" for k in range(len(parts))]
    for file, part in zip(files, parts):
        save_file(part, str(folder / file))
    ex.write_json(folder / ex.INDEX, {"weight_map": {n: f for f, part in zip(files, parts) for n in part}})
    return folder


def cut(path: Path, keep) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: {"half": len(data) // 2, "all but one": len(data) - 1}.get(keep, keep)])


DAMAGES = {
    **{f"weights cut to {n}": ("model.safetensors", lambda p, n=n: cut(p, n)) for n in (0, 4, 16, 100, 1000)},
    "weights cut to half": ("model.safetensors", lambda p: cut(p, "half")),
    "weights cut by one byte": ("model.safetensors", lambda p: cut(p, "all but one")),
    "config not JSON": ("config.json", lambda p: p.write_text("{not json")),
    "config empty": ("config.json", lambda p: p.write_text("")),
    "config a list": ("config.json", lambda p: p.write_text("[1, 2]")),
    "config of a wrong type": (
        "config.json",
        lambda p: p.write_text(p.read_text().replace('"hidden_size": 32', '"hidden_size": "32"')),
    ),
    "rope theta a string": (
        "config.json",
        lambda p: p.write_text(p.read_text().replace('"rope_theta": 10000.0', '"rope_theta": "big"')),
    ),
    "tokenizer not a tokenizer": ("tokenizer.json", lambda p: p.write_text("garbage")),
}


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_folder_is_refused_naming_the_file(tmp_path, damage):
    from fivecut.weights.load import single_model
    from fivecut.weights.source import WeightsError

    folder = hf_folder(tmp_path / "hf")
    name, edit = DAMAGES[damage]
    edit(folder / name)
    with pytest.raises(WeightsError, match=re.escape(str(folder / name))):
        single_model(init_from=f"hf:{folder}")


@pytest.mark.parametrize("damage", ["a shard cut to half", "index not JSON", "weight_map a list"])
def test_a_damaged_sharded_folder_is_refused_naming_the_file(tmp_path, damage):
    from fivecut.weights.load import single_model
    from fivecut.weights.source import WeightsError

    folder = hf_folder(tmp_path / "hf", max_bytes=20_000)
    index = folder / ex.INDEX
    shard = folder / sorted(set(json.loads(index.read_text())["weight_map"].values()))[-1]
    damaged = {
        "a shard cut to half": (shard, lambda: cut(shard, "half")),
        "index not JSON": (index, lambda: index.write_text("{")),
        "weight_map a list": (index, lambda: index.write_text('{"weight_map": ["model.norm.weight"]}')),
    }
    path, edit = damaged[damage]
    edit()
    with pytest.raises(WeightsError, match=re.escape(str(path))):
        single_model(init_from=f"hf:{folder}")


def test_cli_refuses_a_cut_safetensors_in_one_line(tmp_path, capsys):
    folder = hf_folder(tmp_path / "hf")
    cut(folder / "model.safetensors", "half")
    code = main(["eval", "--init-from", f"hf:{folder}", "--set", f'data.cache_dir="{tmp_path}/cache"'])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"error: {folder / 'model.safetensors'}") and err.count("\n") == 1
