"""LoRA (`fivecut.model.lora`, `[lora]`): adapters on a published model's linear layers, the rest
frozen, in and out of `peft`.

A tiny random Llama built by `transformers` is imported, fine-tuned with adapters for a few steps
in fp32, and exported both ways: as a peft adapter folder, which `peft` loads onto the same
transformers model, and merged into the weights, which transformers loads alone. Both give the
logits of fivecut's own model, continued from the run's checkpoint (fp32; the differences are the
order of floating-point operations: 1e-5 as in tests/test_hf_dense.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_hf_dense import TOKENS, hf_model
from test_import import import_config, logits_of

from fivecut.cli import main
from fivecut.launch import spawn

RTOL = ATOL = 1e-5
LORA = ("lora.rank=4", "lora.alpha=8.0")


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("lora") / "llama"
    hf_model("LlamaForCausalLM").save_pretrained(folder)
    return folder


def run_sets(byte_cache: str, folder: Path, out: Path, *extra: str) -> list[str]:
    """A 3-step fp32 fine-tune of `folder`'s model with adapters, saved under `out`."""
    return [
        f'model.init_from="hf:{folder}"', 'data.tokenizer="byte"', f'data.cache_dir="{byte_cache}"',
        "train.seq_len=32", "train.global_batch=8", "train.eval_every=0", "train.steps=3", "train.warmup=1",
        'train.dtype="fp32"', "train.lr=0.01", "log.progress=false", "log.plot=false", *LORA,
        f'checkpoint.dir="{out / "ckpt"}"', f'log.out_dir="{out / "log"}"', *extra,
    ]  # fmt: skip


def train(sets: list[str]) -> None:
    assert main(["train", *[x for s in sets for x in ("--set", s)]]) == 0


def fivecut_logits(byte_cache: str, folder: Path, out: Path) -> torch.Tensor:
    """fivecut's model with the run's adapters: its checkpoint as model.init_from, [lora] as the run's."""
    ckpt = next((out / "ckpt").glob("step-*"))
    cfg = import_config(byte_cache, folder, *LORA, f'model.init_from="dcp:{ckpt}"', 'train.dtype="fp32"')
    (logits,) = spawn(logits_of, 1, [cfg], TOKENS)
    return logits[0]


def test_the_adapters_peft_loads_and_the_merged_model_give_fivecuts_logits(llama, byte_cache, tmp_path, capsys):
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    train(run_sets(byte_cache, llama, tmp_path))
    ours = fivecut_logits(byte_cache, llama, tmp_path)
    base = transformers.AutoModelForCausalLM.from_pretrained(llama).float().eval()
    with torch.no_grad():
        before = base(TOKENS).logits
    assert (ours - before).abs().max() > 1e-3  # the adapters trained
    ckpt = str(tmp_path / "ckpt")
    assert main(["export", "--checkpoint", ckpt, "--out", str(tmp_path / "adapter"), "--adapter"]) == 0
    assert main(["export", "--checkpoint", ckpt, "--out", str(tmp_path / "merged")]) == 0
    adapted = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").float().eval()
    with torch.no_grad():
        torch.testing.assert_close(adapted(TOKENS).logits, ours, rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(merged(TOKENS).logits, ours, rtol=RTOL, atol=ATOL)
