"""`fivecut export --adapter`: a LoRA run's adapters as a `peft` adapter folder.

    adapter_config.json          peft's LoraConfig: r, lora_alpha, lora_dropout, the target modules
                                 (each adapted module's full Hugging Face path, so that no other
                                 module of the same leaf name is matched), bias "none", the base model
    adapter_model.safetensors    base_model.model.<module>.lora_A.weight [r, in] and .lora_B.weight
                                 [out, r], fp32, for each adapted module

`peft.PeftModel.from_pretrained(<the transformers model>, folder)` then computes what fivecut
does: W x + (alpha / r) B A x. A module's Hugging Face path is its weight's name in the export of
the model's class (`fivecut.weights.architectures`, `moe_architectures`), less ".weight". Only the
adapters are written; the base model is the run's model.init_from, which peft loads itself.
"""

from __future__ import annotations

from pathlib import Path

from fivecut.train import checkpoint as ckpt
from fivecut.weights import moe_architectures as moe
from fivecut.weights.architectures import TensorMap
from fivecut.weights.export import (
    Entry,
    ExportError,
    check_out,
    checkpoint_shapes,
    export_class,
    model_args,
    plain_entries,
    read_entries,
    write_atomically,
    write_json,
)
from fivecut.weights.source import expected_shapes

ADAPTER_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"


def export_adapter(checkpoint: Path, out: Path, step: int | None = None, architecture: str | None = None) -> Path:
    """Write the adapters of the LoRA checkpoint `checkpoint` as a peft folder `out`."""
    out = Path(out).expanduser()
    check_out(out)
    source = ckpt.find_checkpoint(Path(checkpoint).expanduser(), step)
    meta = ckpt.read_meta(source)
    lora = meta.get("config", {}).get("lora") or {}
    if not lora.get("rank"):
        raise ExportError(
            f"checkpoint {source} holds no adapters (its run had no lora.rank); export it without --adapter"
        )
    if lora.get("full"):
        raise ExportError(
            f"checkpoint {source} also trained {lora['full']} whole; peft's modules_to_save is not written yet: "
            "export the merged model (without --adapter)"
        )
    args = model_args(source, meta)
    arch = export_class(args, architecture, meta)
    if arch is None:
        raise ExportError(f"checkpoint {source}: no Hugging Face class holds this model, so peft has no module names")
    modules = adapted_modules(source, args, arch)
    tensors = adapter_tensors(source, modules)
    config = adapter_config(lora, sorted(modules.values()), meta)
    written = write_atomically(out, lambda tmp: write_adapter(tmp, tensors, config))
    for file in written:
        print(f"wrote {out / file}")
    print(f"exported the adapters of step {meta['step']} ({len(modules)} modules, rank {lora['rank']}) to {out}")
    return out


def adapted_modules(source: Path, args, arch) -> dict[str, str]:
    """fivecut's adapted weight (its name less ".weight") -> the Hugging Face module path."""
    saved = checkpoint_shapes(source)
    weights = expected_shapes(args)  # the checkpoint holds the trained tensors only
    saved = saved | {f"model.{name}": shape for name, shape in weights.items()}
    adapted = {
        k.removeprefix("model.").removesuffix(".lora_a")
        for k in saved
        if k.startswith("model.") and k.endswith(".lora_a")
    }
    out = {}
    for entry in plain_entries(saved, weights, args, arch):
        base = entry.key.removeprefix("model.").removesuffix(".weight")
        if base in adapted:
            out[base] = hf_module(entry, base)
    missing = sorted(adapted - set(out))
    if missing:
        raise ExportError(f"checkpoint {source}: no Hugging Face module holds the adapted {missing[0]} whole")
    return out


def hf_module(entry: Entry, base: str) -> str:
    """The module path of the Hugging Face tensor that `entry` writes whole (an adapter's A and B
    are that module's; a weight cut into parts, or whose rows a class permutes, has none)."""
    if isinstance(entry.map, moe.Part):
        full = all(o == 0 for o in entry.map.offsets) and entry.map.transform is moe._whole
        if not full:
            raise ExportError(f"{base}: its Hugging Face class stores it transformed; peft cannot hold its adapter")
        return entry.map.hf_name.removesuffix(".weight")
    if entry.map.stacked or entry.map.transposed:
        raise ExportError(f"{base}: its Hugging Face class stores it transformed; peft cannot hold its adapter")
    return entry.map.theirs[0].removesuffix(".weight")


def adapter_tensors(source: Path, modules: dict[str, str]) -> dict:
    """peft's names -> A and B, fp32."""
    shapes = checkpoint_shapes(source)
    keys = [f"model.{base}.lora_{x}" for base in modules for x in "ab"]
    values = read_entries(source, [Entry(k, shapes[k], TensorMap(k, (k,))) for k in keys])
    out = {}
    for base, module in modules.items():
        out[f"base_model.model.{module}.lora_A.weight"] = values[f"model.{base}.lora_a"].contiguous()
        out[f"base_model.model.{module}.lora_B.weight"] = values[f"model.{base}.lora_b"].contiguous()
    return out


def adapter_config(lora: dict, modules: list[str], meta: dict) -> dict:
    init_from = meta.get("config", {}).get("model", {}).get("init_from") or ""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": init_from.removeprefix("hf:") or None,
        "r": lora["rank"],
        "lora_alpha": lora["alpha"],
        "lora_dropout": lora["dropout"],
        "target_modules": modules,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "inference_mode": True,
        "fivecut": {"step": meta["step"], "targets": lora["targets"]},
    }


def write_adapter(folder: Path, tensors: dict, config: dict) -> list[str]:
    from safetensors.torch import save_file

    save_file(tensors, str(folder / ADAPTER_FILE), metadata={"format": "pt"})
    write_json(folder / CONFIG_FILE, config)
    return [CONFIG_FILE, ADAPTER_FILE]
