"""`fivecut export --adapter`: a LoRA run's adapters as a `peft` adapter folder.

    adapter_config.json          peft's LoraConfig: r, lora_alpha, lora_dropout, the target modules
                                 (each adapted module's full Hugging Face path, so that no other
                                 module of the same leaf name is matched), bias "none", the base model
    adapter_model.safetensors    base_model.model.<module>.lora_A.weight [r, in] and .lora_B.weight
                                 [out, r], fp32, for each adapted module

A MoE class's routed experts (transformers 5 keeps each layer's as two 3-D tensors) are adapted
through peft's `target_parameters`: `model.layers.N.mlp.experts.gate_up_proj` [E, 2I, H] and
`.down_proj` [E, H, I], each with one A [r*E, in] and one B [out, r*E] (expert e: rows e*r.. of
A, columns e, e+E, .. of B). peft nests the second parameter's wrapper around the first's, so the
gate_up adapter is stored under `experts.base_layer.lora_A/B` and down's under `experts.lora_A/B`.

`peft.PeftModel.from_pretrained(<the transformers model>, folder)` then computes what fivecut
does: W x + (alpha / r) B A x. A module's Hugging Face path is its weight's name in the export of
the model's class (`fivecut.weights.architectures`, `moe_architectures`), less ".weight". Only the
adapters are written; the base model is the run's model.init_from, which peft loads itself.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from fivecut.model.lora import FULL_GROUPS, is_adapter, target_experts, target_linears
from fivecut.model.transformer import GroupedExperts, SeedWeights, build_model
from fivecut.train import checkpoint as ckpt
from fivecut.weights import moe_architectures as moe
from fivecut.weights.architectures import TensorMap, for_args
from fivecut.weights.export import (
    Entry,
    ExportError,
    check_out,
    checkpoint_shapes,
    export_class,
    model_args,
    read_entries,
    write_atomically,
    write_json,
)
from fivecut.weights.load import LayeredSource, source_of
from fivecut.weights.source import WeightsError, expected_shapes, resolve_path

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
    args = model_args(source, meta)
    arch = export_class(args, architecture, meta)
    if arch is None:
        raise ExportError(f"checkpoint {source}: no Hugging Face class holds this model, so peft has no module names")
    modules = adapted_modules(source, args, arch)
    refuse_renamed_by_peft(source, arch, modules)
    whole = trained_whole(source, args, arch)
    layers = adapted_expert_layers(source)
    tensors = adapter_tensors(source, modules, row_orders(args, arch)) | whole_tensors(source, whole)
    tensors |= expert_adapter_tensors(source, layers)
    config = adapter_config(lora, sorted(modules.values()), meta, sorted(whole.values()), expert_parameters(layers))
    written = write_atomically(out, lambda tmp: write_adapter(tmp, tensors, config))
    for file in written:
        print(f"wrote {out / file}")
    print(f"exported the adapters of step {meta['step']} ({len(modules)} modules, rank {lora['rank']}) to {out}")
    return out


def adapted_modules(source: Path, args, arch) -> dict[str, str]:
    """fivecut's adapted weight (its name less ".weight") -> the Hugging Face module path."""
    adapted = sorted(
        k.removeprefix("model.").removesuffix(".lora_a")
        for k in checkpoint_shapes(source)
        if k.startswith("model.") and k.endswith(".lora_a")
    )
    paths = module_paths(args, arch)
    missing = [base for base in adapted if base not in paths]
    if missing:
        raise ExportError(
            f"checkpoint {source}: {arch.hf_class} stores {missing[0]} transformed (or in parts); peft has no "
            "module for its adapter: export the merged model (without --adapter)"
        )
    return {base: paths[base] for base in adapted}


# peft (0.21) reads an adapter of these model types as one made for transformers 4 (GLM-4.5: transformers
# converts it as qwen2_moe, as Qwen3-MoE): a target module ending in one of these names is taken for an
# expert's projection and moved to the fused experts
PEFT_V4_EXPERT_NAMES = {"deepseek_v3": (".gate_proj", ".up_proj", ".down_proj"),
                        "qwen3_moe": (".gate_proj", ".up_proj", ".down_proj"),
                        "glm4_moe": (".gate_proj", ".up_proj", ".down_proj")}  # fmt: skip


def refuse_renamed_by_peft(source: Path, arch, modules: dict[str, str]) -> None:
    """An adapter peft would load onto other weights than it adapts is not written."""
    endings = PEFT_V4_EXPERT_NAMES.get(getattr(arch, "model_type", None), ())
    renamed = sorted(m for m in modules.values() if m.endswith(endings))
    if renamed:
        raise ExportError(
            f"checkpoint {source}: peft takes {renamed[0]} of a {arch.model_type} model for an expert's projection "
            "(a transformers 4 name) and would load its adapter onto the experts; export the merged model "
            "(without --adapter), or train without the dense MLP and shared-expert adapters"
        )


def module_paths(args, arch) -> dict[str, str]:
    """fivecut weight (its name less ".weight") -> the Hugging Face module path, for each weight the
    class `arch` stores whole, as it is or with its rows permuted (`row_orders`): an adapter's A
    and B are that module's. A weight cut into parts or transposed has no module peft could adapt."""
    out = {}
    if isinstance(arch, moe.Architecture):
        shapes = expected_shapes(args)
        for name, stored in arch.tensors(args, set(), arch.config(args)).items():
            parts = stored.parts(shapes[name])
            rows = parts[0].transform is moe._whole or isinstance(parts[0].transform, moe.Interleave)
            if len(parts) == 1 and rows and not any(parts[0].offsets):
                out[name.removesuffix(".weight")] = parts[0].hf_name.removesuffix(".weight")
        return out
    for m in arch.tensors(args):
        if not (m.stacked or m.transposed or m.rows):  # a row block of a fused projection has no module of its own
            out[m.ours.removesuffix(".weight")] = m.theirs[0].removesuffix(".weight")
    return out


def trained_whole(source: Path, args, arch) -> dict[str, str]:
    """lora.full: each weight the checkpoint trained whole -> its Hugging Face module path (peft's
    modules_to_save). A tied embedding is refused: peft would give the head the original weight."""
    names = [k.removeprefix("model.") for k in checkpoint_shapes(source) if k.startswith("model.")]
    names = [n for n in names if not is_adapter(n)]
    if args.tie_embeddings and any(n.startswith("tok_embeddings.") for n in names):
        raise ExportError(
            f"checkpoint {source} trained a tied embedding whole; peft's modules_to_save would leave the head on the "
            "original weight: export the merged model (without --adapter)"
        )
    paths = module_paths(args, arch)
    missing = [n for n in names if n.removesuffix(".weight") not in paths]
    if missing:
        raise ExportError(f"checkpoint {source}: {arch.hf_class} has no module holding {missing[0]} whole")
    return {n: paths[n.removesuffix(".weight")] for n in names}


def whole_tensors(source: Path, whole: dict[str, str]) -> dict:
    """peft's names of the weights trained whole (base_model.model.<module>.weight) -> values, fp32."""
    shapes = checkpoint_shapes(source)
    keys = [f"model.{name}" for name in whole]
    values = read_entries(source, [Entry(k, shapes[k], TensorMap(k, (k,))) for k in keys])
    return {f"base_model.model.{module}.weight": values[f"model.{name}"].contiguous() for name, module in whole.items()}


def row_orders(args, arch) -> dict[str, torch.Tensor]:
    """fivecut weight (less ".weight") -> [out] the Hugging Face row of each of its rows, for the
    weights `arch` stores with rows permuted (DeepSeek's interleaved RoPE rows): the update B A
    of such a weight is theirs with B's rows permuted alike, A as it is."""
    if not isinstance(arch, moe.Architecture):
        return {}
    shapes, out = expected_shapes(args), {}
    for name, stored in arch.tensors(args, set(), arch.config(args)).items():
        transform = stored.parts(shapes[name])[0].transform
        if isinstance(transform, moe.Interleave):
            out[name.removesuffix(".weight")] = transform.order
    return out


def adapter_tensors(source: Path, modules: dict[str, str], orders: dict[str, torch.Tensor]) -> dict:
    """peft's names -> A and B, fp32 (B's rows in the class's order)."""
    shapes = checkpoint_shapes(source)
    keys = [f"model.{base}.lora_{x}" for base in modules for x in "ab"]
    values = read_entries(source, [Entry(k, shapes[k], TensorMap(k, (k,))) for k in keys])
    out = {}
    for base, module in modules.items():
        b = values[f"model.{base}.lora_b"]
        if base in orders:
            b = moe.Interleave(orders[base])(b)
        out[f"base_model.model.{module}.lora_A.weight"] = values[f"model.{base}.lora_a"].contiguous()
        out[f"base_model.model.{module}.lora_B.weight"] = b.contiguous()
    return out


def adapted_expert_layers(source: Path) -> list[int]:
    """The layers whose routed experts the checkpoint holds adapters of."""
    keys = [k.split(".") for k in checkpoint_shapes(source) if k.startswith("model.") and k.endswith(".w13_lora_a")]
    return sorted(int(parts[2]) for parts in keys)  # model.layers.N.feed_forward.experts.w13_lora_a


def experts_module(layer: int) -> str:
    """Where transformers 5 keeps a MoE layer's experts (Mixtral, Qwen3-MoE and DeepSeek-V3 alike)."""
    return f"model.layers.{layer}.mlp.experts"


def expert_parameters(layers: list[int]) -> list[str]:
    """peft's target_parameters: per layer gate_up_proj, then down_proj (the order of the nesting)."""
    return [f"{experts_module(n)}.{name}" for n in layers for name in ("gate_up_proj", "down_proj")]


def expert_adapter_tensors(source: Path, layers: list[int]) -> dict:
    """peft's names -> the experts' A and B (fp32) of `layers`, from fivecut's stacks."""
    if not layers:
        return {}
    shapes = checkpoint_shapes(source)
    ours = [f"model.layers.{n}.feed_forward.experts.{name}" for n in layers for name in EXPERT_ADAPTER_NAMES]
    values = read_entries(source, [Entry(k, shapes[k], TensorMap(k, (k,))) for k in ours])
    out = {}
    for n in layers:
        stack = {name: values[f"model.layers.{n}.feed_forward.experts.{name}"] for name in EXPERT_ADAPTER_NAMES}
        for module, (a, b) in peft_expert_adapters(stack).items():
            prefix = f"base_model.model.{experts_module(n)}{module}"
            out[f"{prefix}.lora_A.weight"], out[f"{prefix}.lora_B.weight"] = a.contiguous(), b.contiguous()
    return out


EXPERT_ADAPTER_NAMES = ("w13_lora_a", "w1_lora_b", "w3_lora_b", "w2_lora_a", "w2_lora_b")


def peft_expert_adapters(stack: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """fivecut's stacked expert adapters (`LoRAExperts`) -> peft's (A [r*E, in], B [out, r*E]) by
    module suffix: gate_up's (the inner wrapper, `.base_layer`), down's."""
    gate_up_b = torch.cat([stack["w1_lora_b"], stack["w3_lora_b"]], 2)  # [E, r, 2I]: gate rows, then up
    return {
        ".base_layer": (flat_a(stack["w13_lora_a"]), flat_b(gate_up_b)),
        "": (flat_a(stack["w2_lora_a"]), flat_b(stack["w2_lora_b"])),
    }


def flat_a(a: torch.Tensor) -> torch.Tensor:
    """[E, in, r] -> peft's [E*r, in] (expert e: rows e*r to (e+1)*r)."""
    return a.transpose(1, 2).reshape(-1, a.shape[1])


def flat_b(b: torch.Tensor) -> torch.Tensor:
    """[E, r, out] -> peft's [out, r*E] (column j*E + e: rank j of expert e)."""
    return b.permute(2, 1, 0).reshape(b.shape[2], -1)


def stacked_a(a: torch.Tensor, experts: int) -> torch.Tensor:
    """peft's [E*r, in] -> [E, in, r] (`flat_a` undone)."""
    return a.view(experts, -1, a.shape[1]).transpose(1, 2)


def stacked_b(b: torch.Tensor, experts: int) -> torch.Tensor:
    """peft's [out, r*E] -> [E, r, out] (`flat_b` undone)."""
    return b.view(b.shape[0], -1, experts).permute(2, 1, 0)


def adapter_config(lora: dict, modules: list[str], meta: dict, whole: list[str], parameters: list[str]) -> dict:
    init_from = meta.get("config", {}).get("model", {}).get("init_from") or ""
    if parameters and lora["dropout"]:
        print(f"note: peft adapts expert parameters without dropout; {CONFIG_FILE} says lora_dropout 0 (the "
              f"run's {lora['dropout']} changes training only, not the adapted model)")  # fmt: skip
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": init_from.removeprefix("hf:") or None,
        "r": lora["rank"],
        "lora_alpha": lora["alpha"],
        "lora_dropout": 0.0 if parameters else lora["dropout"],
        "target_modules": modules,
        "target_parameters": parameters or None,  # the routed experts' 3-D weights
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "modules_to_save": whole or None,  # full paths: peft matches a module whose name ends with one
        "inference_mode": True,
        "fivecut": {"step": meta["step"], "targets": lora["targets"]},
    }


def write_adapter(folder: Path, tensors: dict, config: dict) -> list[str]:
    from safetensors.torch import save_file

    save_file(tensors, str(folder / ADAPTER_FILE), metadata={"format": "pt"})
    write_json(folder / CONFIG_FILE, config)
    return [CONFIG_FILE, ADAPTER_FILE]


# ---------------------------------------------------------------- in: lora.adapter

# peft LoraConfig keys fivecut reads, and those it accepts only at the value that means plain LoRA
# (anything else changes the math: refused by name)
PLAIN_LORA = {
    "bias": "none",
    "use_dora": False,
    "use_rslora": False,
    "fan_in_fan_out": False,
    "rank_pattern": {},
    "alpha_pattern": {},
    "layers_to_transform": None,
    "layers_pattern": None,
    "lora_bias": False,
}


class PeftSource:
    """A peft LoRA folder as the source of a run's adapters (`WeightSource`'s methods, by fivecut
    name: `layers.3.attention.wq.lora_a`), for the model `args` of class `arch`."""

    def __init__(self, folder: Path, args, arch):
        from safetensors import safe_open

        self.path, self.args, self.folder = folder, args, folder
        self.config = read_json(folder / CONFIG_FILE)
        paths = {module: base for base, module in module_paths(args, arch).items()}
        self.orders = {f"{base}.lora_b": order for base, order in row_orders(args, arch).items()}
        self.names: dict[str, str] = {}  # fivecut name -> peft's tensor name
        with safe_open(str(folder / ADAPTER_FILE), "pt") as f:
            self.stored = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
            experts = expert_keys(self.config.get("target_parameters") or [], args, folder / CONFIG_FILE)
            self.experts = expert_stacks(experts, {k: f.get_tensor(k) for k in experts if k in self.stored}, args)
        for key in self.stored:
            if key in experts:
                continue
            module, _, kind = key.removeprefix("base_model.model.").rpartition(".lora_")
            if not module:  # a module trained whole (modules_to_save): base_model.model.<module>.weight
                module, kind = key.removeprefix("base_model.model.").removesuffix(".weight"), "whole"
            if module not in paths or kind not in ("A.weight", "B.weight", "whole"):
                raise WeightsError(f"{folder / ADAPTER_FILE}: {key} adapts no weight of this {arch.hf_class}")
            self.names[f"{paths[module]}.{'weight' if kind == 'whole' else 'lora_' + kind[0].lower()}"] = key

    def shapes(self) -> dict[str, tuple[int, ...]]:
        stacks = {name: tuple(t.shape) for name, t in self.experts.items()}
        return {name: self.stored[key] for name, key in self.names.items()} | stacks

    def buffer_shapes(self) -> dict[str, tuple[int, ...]]:
        return {}

    def read(self, name: str, box) -> torch.Tensor:
        from safetensors import safe_open

        if name in self.experts:
            return self.experts[name][box].float()
        with safe_open(str(self.folder / ADAPTER_FILE), "pt") as f:
            value = f.get_tensor(self.names[name])
        if name in self.orders:  # B of a weight stored with rows permuted: fivecut's row j is their order[j]
            value = value[self.orders[name]]
        return value[box].float()

    def fill(self, requests) -> None:
        for name, box, view in requests:
            view.copy_(self.read(name, box))

    def tokenizer(self):
        return None


def expert_keys(parameters: list[str], args, where: Path) -> dict[str, tuple[int, str, str]]:
    """peft's tensor names of the expert adapters its target_parameters `parameters` make (each a
    parameter's full name or its ending, as peft matches them) -> (layer, "gate_up_proj" or
    "down_proj", "A" or "B"). peft wraps a module's parameters in the order the module holds them
    (gate_up_proj, then down_proj), each around the last: the first one's adapter is stored one
    ".base_layer" deeper for each targeted after it."""

    def matches(name: str) -> bool:
        return any(name == t or name.endswith(f".{t}") for t in parameters)

    out, used = {}, set()
    for layer in (n for n in range(args.n_layers) if args.moe_layer(n)):
        module = experts_module(layer)
        names = [p for p in ("gate_up_proj", "down_proj") if matches(f"{module}.{p}")]
        used |= {t for t in parameters for p in names if f"{module}.{p}" == t or f"{module}.{p}".endswith(f".{t}")}
        for i, name in enumerate(names):
            prefix = f"base_model.model.{module}" + ".base_layer" * (len(names) - 1 - i)
            out |= {f"{prefix}.lora_{x}.weight": (layer, name, x) for x in "AB"}
    odd = [t for t in parameters if t not in used]
    if odd:
        raise WeightsError(
            f"{where}: target_parameters has {odd[0]!r}, no expert weight of this model (fivecut adapts a MoE "
            "layer's experts.gate_up_proj and down_proj)"
        )
    return out


def expert_stacks(keys: dict[str, tuple[int, str, str]], tensors: dict[str, torch.Tensor], args) -> dict:
    """fivecut's stacked expert adapters (`LoRAExperts`, by name) from peft's `tensors`."""
    out, experts, hidden = {}, args.n_experts, args.expert_dim
    for key, (layer, param, x) in keys.items():
        if key not in tensors:
            continue
        ours = f"layers.{layer}.feed_forward.experts."
        t = tensors[key]
        if x == "A":
            out[ours + ("w13_lora_a" if param == "gate_up_proj" else "w2_lora_a")] = stacked_a(t, experts)
        elif param == "down_proj":
            out[ours + "w2_lora_b"] = stacked_b(t, experts)
        else:  # [E, r, 2I]: gate's columns, then up's
            out[ours + "w1_lora_b"], out[ours + "w3_lora_b"] = stacked_b(t, experts).split(hidden, 2)
    return {name: t.contiguous() for name, t in out.items()}


def adapter_problems(folder: Path, rank: int, alpha: float, adapted: dict, args, arch, full=()) -> list[str]:
    """What makes the peft folder `folder` unusable as this run's adapters: a missing file, a peft
    method other than plain LoRA, another rank or alpha, another architecture, modules other than
    the `adapted` linear layers (fivecut path -> layer), tensors of other shapes."""
    files = [folder / CONFIG_FILE, folder / ADAPTER_FILE]
    missing = [f for f in files if not f.is_file()]
    if missing:
        return [
            f"lora.adapter: {missing[0]} does not exist (a peft LoRA folder holds {CONFIG_FILE} and {ADAPTER_FILE})"
        ]
    config = read_json(folder / CONFIG_FILE)
    where = f"{folder / CONFIG_FILE}"
    if config.get("peft_type") != "LORA":
        return [f"{where}: peft_type {config.get('peft_type')!r}; fivecut reads LORA adapters only"]
    odd = [k for k, plain in PLAIN_LORA.items() if config.get(k, plain) not in (plain, None, {}, [])]
    if odd:
        return [f"{where}: {odd[0]}={config[odd[0]]!r} is not plain LoRA, which is all fivecut implements"]
    if config.get("r") != rank or float(config.get("lora_alpha", 0)) != alpha:
        return [
            f"{where}: r={config.get('r')}, lora_alpha={config.get('lora_alpha')}; this run has lora.rank={rank}, "
            f"lora.alpha={alpha}: set them to the adapter's"
        ]
    try:
        source = PeftSource(folder, args, arch)
    except WeightsError as err:
        return [f"lora.adapter: {err} (an adapter for another model or architecture?)"]
    whole = {name for name in source.shapes() if name.endswith(".weight")}
    want = {n for n in expected_shapes(args) if n.endswith(tuple(e for g in full for e in FULL_GROUPS[g]))}
    if whole != want:
        other = sorted(whole ^ want)[0]
        return [f"{where}: its modules_to_save and lora.full differ at {other}; set lora.full to what it trained whole"]
    held = {name.rsplit(".", 1)[0] for name in source.shapes() if not name.endswith(".weight")}
    if held != set(adapted):
        other = sorted(held ^ set(adapted))[0]
        return [
            f"{where}: its target modules and lora.targets differ at {other}; set lora.targets to what the "
            f"adapter adapts"
        ]
    for path, layer in adapted.items():
        if isinstance(layer, GroupedExperts):  # [E, dim, hidden]: the stacks `LoRAExperts` holds
            (n, dim, hidden), names = layer.w1.shape, EXPERT_ADAPTER_NAMES
            want = dict(zip((f"{path}.{x}" for x in names), ((n, dim, rank), (n, rank, hidden), (n, rank, hidden),
                                                            (n, hidden, rank), (n, rank, dim))))  # fmt: skip
        else:
            want = {f"{path}.lora_a": (rank, layer.in_features), f"{path}.lora_b": (layer.out_features, rank)}
        for name, shape in want.items():
            if source.shapes().get(name) != shape:
                key = source.names.get(name, name)
                return [f"{folder / ADAPTER_FILE}: {key} is {list(source.shapes()[name])}, this model's is "
                        f"{list(shape)} (an adapter for another model?)"]  # fmt: skip
    return []


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise WeightsError(f"{path} cannot be read as JSON ({err})") from None


def run_class(init_from: str | None, args):
    """The Hugging Face class whose module names a run's adapters take: its hf: folder's, else the
    first that holds the model's shape."""
    if init_from is not None and init_from.startswith("hf:"):
        source = source_of(init_from)
        if source.architecture is not None:
            return source.architecture
    return for_args(args)


def lora_adapter_problems(lora, init_from: str | None, args) -> list[str]:
    """`adapter_problems` of a run's lora.adapter (its targets' weights, its class)."""
    arch = run_class(init_from, args)
    if arch is None:
        return ["lora.adapter: no Hugging Face class holds this model, so peft's module names mean nothing here"]
    model = build_model(args, device="meta")
    adapted = target_linears(model, lora.targets) | target_experts(model, lora.targets)
    return adapter_problems(resolve_path(lora.adapter), lora.rank, lora.alpha, adapted, args, arch, lora.full)


def with_adapter(lora, init_from: str | None, args, published, seed: int):
    """The run's initial weights with its adapters from the peft folder lora.adapter (checked
    before by `lora_adapter_problems`), over `published` (None: the seed's model)."""
    base = published if published is not None else SeedWeights(args, seed)
    return LayeredSource(PeftSource(resolve_path(lora.adapter), args, run_class(init_from, args)), base)
