"""Low-rank adapters (LoRA, Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models").

A published weight W [out, in] stays frozen; beside it two small matrices train:

    y = x W^T + (alpha / r) * dropout(x) A^T B^T        A [r, in], B [out, r]

A starts uniform in +-1/sqrt(in) (the Kaiming-uniform bound `peft` and `nn.Linear` use), B at
zero, so the adapted model starts as the published one. Only A and B have gradients, optimizer
state and fp32 masters; the frozen weights keep no gradient and, under train.dtype = "bf16", are
held in bf16 (they are read, never updated). `[lora]` in the config chooses the rank, alpha,
dropout and which weights take adapters (`TARGET_GROUPS`, or single weight names), and which
weights train whole beside them (`FULL_GROUPS`). The frozen norms and embedding stay fp32 (tiny,
or read by a lookup: the residual stream keeps the dtype it has in full training). Adapters are
parameters of the model like any other: the cuts, the checkpoints and the seed's initialization
see them by name (`layers.3.attention.wq.lora_a`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from fivecut.model.transformer import Block, ExpertLowRank, GroupedExperts, _name_seed, build_model, grouped_swiglu

# target group -> (the module holding the linears, their names): attention covers plain and
# latent attention (MLA's down and up projections); mlp the dense feed-forward blocks
TARGET_GROUPS = {
    "attention": ("attention", ("wq", "wk", "wv", "wo", "wq_a", "wq_b", "wkv_a", "wkv_b")),
    "mlp": ("feed_forward", ("w1", "w2", "w3")),
    "shared_experts": ("feed_forward.shared", ("w1", "w2", "w3")),
}
EXPERTS = "experts"  # the routed experts of every MoE layer: each expert's gate, up and down (`LoRAExperts`)
# weights trained whole beside the adapters, when asked (lora.full): their names' endings
FULL_GROUPS = {"embeddings": ("tok_embeddings.weight",), "head": ("output.weight",), "norms": ("norm.weight",)}
ADAPTER_NAMES = ("lora_a", "lora_b")


class LoRALinear(nn.Linear):
    """An `nn.Linear` (the same weight and bias Parameters, frozen) with a trained low-rank
    update: forward = linear(x) + scale * B(A(dropout(x)))."""

    def __init__(self, linear: nn.Linear, rank: int, alpha: float, dropout: float):
        nn.Module.__init__(self)  # the layer's own Parameters move over
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # [out, in]
        self.register_parameter("bias", linear.bias)
        device, dtype = linear.weight.device, torch.float32
        self.lora_a = nn.Parameter(torch.empty(rank, self.in_features, device=device, dtype=dtype))  # [r, in]
        self.lora_b = nn.Parameter(torch.empty(self.out_features, rank, device=device, dtype=dtype))  # [out, r]
        self.scale = alpha / rank
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        # tensor parallelism (`fivecut.parallel.tensor.cut_adapters`): the half left whole on every
        # rank, and the op that sums its gradient over the ranks (identity forward)
        self.grad_summed: tuple[str, Callable] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = frozen_linear(x, self.weight, self.bias)  # [..., out]
        a, b = self.lora_a, self.lora_b  # [r, in], [out, r] (or this rank's rows of B, columns of A)
        if self.grad_summed is not None:
            half, summed = self.grad_summed
            a, b = (summed(a), b) if half == "lora_a" else (a, summed(b))
        low = F.linear(F.linear(self.dropout(x), a), b)  # [..., r] -> [..., out]
        return y + low * self.scale


class LoRAExperts(GroupedExperts):
    """A MoE layer's routed experts (the same stacked weights, frozen) with one adapter per expert
    and weight, run as grouped GEMMs like the experts themselves. Gate and up share an A (Hugging
    Face fuses them into `gate_up_proj`, the weight peft adapts); each has its B; down has its own
    A and B. Every adapter is stacked over the experts ([E, ...]), so the expert cuts slice, move
    and copy it with its expert."""

    EXPERT_TENSORS = GroupedExperts.EXPERT_TENSORS | {
        "w13_lora_a": None,  # [E, dim, r]: whole under expert TP (its gradient summed over etp)
        "w1_lora_b": 2,  # [E, r, hidden]: cut like w1's columns
        "w3_lora_b": 2,  # [E, r, hidden]
        "w2_lora_a": 1,  # [E, hidden, r]: cut like w2's rows
        "w2_lora_b": None,  # [E, r, dim]: whole under expert TP (its gradient summed over etp)
    }

    def __init__(self, experts: GroupedExperts, rank: int, alpha: float, dropout: float):
        nn.Module.__init__(self)  # the experts' own Parameters move over
        self.w1, self.w3, self.w2 = experts.w1, experts.w3, experts.w2
        self.glu = experts.glu  # (GPT-OSS's biased experts are refused by fivecut.checks)
        n, dim, hidden = experts.w1.shape
        shapes = {"w13_lora_a": (n, dim, rank), "w1_lora_b": (n, rank, hidden), "w3_lora_b": (n, rank, hidden),
                  "w2_lora_a": (n, hidden, rank), "w2_lora_b": (n, rank, dim)}  # fmt: skip
        for name, shape in shapes.items():
            setattr(self, name, nn.Parameter(torch.empty(shape, device=experts.w1.device, dtype=torch.float32)))
        self.scale = alpha / rank
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        # expert tensor parallelism (`fivecut.parallel.expert.cut_expert_hidden`): the op that sums
        # the gradient of the adapters it keeps whole over the etp ranks (identity forward)
        self.grad_summed: Callable | None = None

    def run(self, x: torch.Tensor, tensors: dict[str, torch.Tensor], ends: torch.Tensor,
            recompute_product: bool = False) -> torch.Tensor:  # fmt: skip
        whole = self.grad_summed or (lambda t: t)
        low_rank = ExpertLowRank(
            whole(tensors["w13_lora_a"]), tensors["w1_lora_b"], tensors["w3_lora_b"], tensors["w2_lora_a"],
            whole(tensors["w2_lora_b"]), self.scale, self.dropout,
        )  # fmt: skip
        w1, w3, w2 = tensors["w1"], tensors["w3"], tensors["w2"]
        return grouped_swiglu(x, w1, w3, w2, ends, recompute_product, low_rank, glu=self.glu)


# each expert weight's adapter: (its A, its B), stacked over the experts ([E, in, r], [E, r, out])
EXPERT_ADAPTERS = {
    "w1": ("w13_lora_a", "w1_lora_b"),
    "w3": ("w13_lora_a", "w3_lora_b"),
    "w2": ("w2_lora_a", "w2_lora_b"),
}


def frozen_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x W^T (+ b) for a frozen W, stored as it is or in NF4 (QLoRA: torchao dequantizes it to x's
    dtype for the product, in forward and for dx in backward)."""
    if type(weight).__name__ != "NF4Tensor":
        return F.linear(x, weight, bias)
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import linear_nf4

    y = linear_nf4(x, weight)
    return y if bias is None else y + bias


# ---------------------------------------------------------------- QLoRA: the frozen base in NF4

NF4_BLOCK = 64  # elements sharing one scale (QLoRA's block size)


def nf4_scaler_block(numel: int) -> int:
    """Scales quantized together (QLoRA's 256, or the largest power of two under it that divides
    the weight's blocks, for small weights)."""
    blocks = numel // NF4_BLOCK
    return next(b for b in (256, 128, 64, 32, 16, 8, 4, 2, 1) if blocks % b == 0)


def nf4_bytes(numel: int, itemsize: int = 2) -> int:
    """Bytes of an NF4 weight of `numel` elements quantized from `itemsize`-byte values: 4 bits an
    element, an int8 scale a block of 64, a scale factor a block of scales, the mean of the scales
    and the 16-value NF4 table in the source dtype."""
    blocks = numel // NF4_BLOCK
    return numel // 2 + blocks + itemsize * (blocks // nf4_scaler_block(numel)) + itemsize + 16 * itemsize


def quantize_frozen(block: nn.Module) -> None:
    """QLoRA: every adapted linear layer of `block` gets its frozen weight as torchao's NF4Tensor
    (4-bit NormalFloat, blocks of 64; quantized from bf16)."""
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

    for module in block.modules():
        if isinstance(module, LoRALinear) and type(module.weight).__name__ != "NF4Tensor":
            w = module.weight.detach().to(torch.bfloat16)
            nf4 = to_nf4(w, NF4_BLOCK, nf4_scaler_block(w.numel()))
            nf4.quantization_factor = nf4.quantization_factor.clone()  # with one factor, a view holding them all
            module.weight = nn.Parameter(nf4, requires_grad=False)


def target_linears(model: nn.Module, targets: list[str]) -> dict[str, nn.Linear]:
    """Module path -> linear layer, for every linear `targets` names (group names or weight
    names: `wq`, `w2`, ...) in every block of `model`."""
    out = {}
    for path, module in model.named_modules():
        if not isinstance(module, nn.Linear) or isinstance(module, LoRALinear):
            continue
        parent, _, leaf = path.rpartition(".")
        owner = parent.split(".", 2)[-1] if parent.startswith("layers.") else ""  # "attention", "feed_forward"...
        for group, (holder, names) in TARGET_GROUPS.items():
            by_name = leaf in targets and group != "shared_experts"  # a bare name: attention's or the dense MLP's
            if owner == holder and leaf in names and (group in targets or by_name):
                out[path] = module
    return out


def target_experts(model: nn.Module, targets: list[str]) -> dict[str, GroupedExperts]:
    """Module path -> routed experts, for every MoE layer of `model` when `targets` has "experts"."""
    if EXPERTS not in targets:
        return {}
    return {p: m for p, m in model.named_modules() if type(m) is GroupedExperts}


def add_adapters(model: nn.Module, rank: int, alpha: float, dropout: float, targets: list[str], full: list[str],
                 frozen_dtype: torch.dtype | None = None) -> dict[str, tuple[int, ...]]:  # fmt: skip
    """Replace each target linear of `model` (a whole model, on any device, meta included) by a
    `LoRALinear`; freeze every other Parameter but those `full` names (`FULL_GROUPS`); the frozen
    weights the matmuls read (every linear layer's, the experts') are held in `frozen_dtype` (None:
    as they are). Returns each adapter's name and global shape."""
    for path, linear in target_linears(model, targets).items():
        parent, _, leaf = path.rpartition(".")
        setattr(model.get_submodule(parent), leaf, LoRALinear(linear, rank, alpha, dropout))
    for path, experts in target_experts(model, targets).items():
        model.get_submodule(path.removesuffix(".experts")).experts = LoRAExperts(experts, rank, alpha, dropout)
    trained = tuple(end for group in full for end in FULL_GROUPS[group])
    looked_up = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    adapters = {name: tuple(p.shape) for name, p in model.named_parameters() if is_adapter(name)}
    for mname, module in model.named_modules():
        matmul = isinstance(module, nn.Linear | GroupedExperts)
        for pname, p in list(module.named_parameters(recurse=False)):
            name = f"{mname}.{pname}" if mname else pname
            if is_adapter(name) or name.endswith(trained):
                continue
            p.requires_grad_(False)
            if frozen_dtype is not None and matmul and id(p) not in looked_up and p.dtype != frozen_dtype:
                # norms and the embedding (a tied head's too) stay fp32: the residual stream keeps its dtype
                setattr(module, pname, nn.Parameter(p.detach().to(frozen_dtype), requires_grad=False))
    return adapters


def target_problems(
    rank: int, targets: list[str], full: list[str], args, quantize: str | None = None, tp: int = 1
) -> list[str]:
    """What in `[lora]` does not fit the model `args`: a target naming no weight of it, a rank
    larger than a target weight's smaller side, an unknown `full` group; under QLoRA a weight
    whose size is not a multiple of NF4's block; under tensor parallelism (`tp`) a target the cut
    leaves whole on every rank (`replicated_under_tp`)."""
    names = {n for _, (_, ns) in TARGET_GROUPS.items() for n in ns}
    problems = [
        f"lora.targets has {t!r}, neither a group ({', '.join([*TARGET_GROUPS, EXPERTS])}) nor a weight name "
        f"({', '.join(sorted(names))})"
        for t in targets
        if t not in TARGET_GROUPS and t not in names and t != EXPERTS
    ]
    problems += [f"lora.full has {f!r}; use {', '.join(FULL_GROUPS)}" for f in full if f not in FULL_GROUPS]
    if problems:
        return problems
    model = build_model(args, device="meta")
    problems = [
        f"lora.targets has {t!r}, which matches no weight of this model"
        for t in targets
        if not target_linears(model, [t]) and not target_experts(model, [t])
    ]
    experts = target_experts(model, targets)
    if quantize == "nf4" and experts:
        problems.append(
            "lora.quantize='nf4' quantizes linear layers, not the routed experts' stacked weights; drop "
            f"{EXPERTS!r} from lora.targets, or leave lora.quantize unset"
        )
    chosen = target_linears(model, targets)
    odd = [p for p, m in chosen.items() if m.weight.numel() % NF4_BLOCK]
    if quantize == "nf4" and odd:
        problems.append(
            f"lora.quantize='nf4' quantizes in blocks of {NF4_BLOCK}, and {odd[0]} has {chosen[odd[0]].weight.numel()} "
            "elements; leave lora.quantize unset for this model"
        )
    whole = replicated_under_tp(list(chosen), args, tp)
    if whole:
        problems.append(
            f"lora on {whole[0]} is not carried through tensor parallelism yet (tp={tp} leaves it whole on every "
            "rank); drop it from lora.targets, or set parallel.tp=1"
        )
    sides = {p: (m.out_features, m.in_features) for p, m in chosen.items()}
    sides |= {f"{p}.w2": tuple(m.w2.shape[1:]) for p, m in experts.items()}  # [hidden, dim]
    small = {p: (out, n_in) for p, (out, n_in) in sides.items() if rank > min(out, n_in)}
    if small:
        path, (out, n_in) = next(iter(small.items()))
        most = min(min(side) for side in small.values())
        problems.append(
            f"lora.rank={rank} exceeds the smaller side of {path} [{out}, {n_in}] "
            f"({len(small)} target weights alike); use lora.rank <= {most}"
        )
    return problems


@functools.cache
def block_targets(args, layer: int, targets: tuple[str, ...]) -> tuple[tuple[str, int, int], ...]:
    """(path inside the block, in, out) of each linear `targets` adapts in block `layer` of `args`."""
    with torch.device("meta"):
        holder = nn.Module()
        holder.layers = nn.ModuleDict({str(layer): Block(layer, args)})
    prefix = f"layers.{layer}."
    chosen = target_linears(holder, list(targets))
    return tuple((p.removeprefix(prefix), m.in_features, m.out_features) for p, m in chosen.items())


def adapter_cut(args, moe: bool, targets: list[str], rank: int, tp: int) -> tuple[int, int]:
    """(elements of a dense or MoE block's adapters each tp rank holds a 1/tp slice of, elements
    every rank holds whole): a column-parallel weight's B [out, r] is cut and its A [r, in] whole,
    a row-parallel weight's (wo, w2) the other way round (`fivecut.parallel.tensor.cut_adapters`)."""
    layer = next(i for i in range(args.n_layers) if args.moe_layer(i) == moe)
    cut = whole = 0
    for path, n_in, n_out in block_targets(args, layer, tuple(targets)):
        a, b = rank * n_in, n_out * rank  # A [r, in], B [out, r]
        row = path.endswith(("attention.wo", "feed_forward.w2"))
        cut, whole = cut + (a if row else b) // tp, whole + (b if row else a)
    return cut, whole


def expert_adapter_elements(args, rank: int, slots: int, etp: int) -> int:
    """Elements of one MoE layer's expert adapters (`LoRAExperts`) on a rank holding `slots` experts
    cut `etp` ways: the hidden sides (w1's and w3's B [r, hidden], w2's A [hidden, r]) cut, the
    shared gate/up A [dim, r] and down's B [r, dim] whole."""
    return slots * (3 * rank * args.expert_dim // etp + 2 * args.dim * rank)


def replicated_under_tp(paths: list[str], args, tp: int) -> list[str]:
    """Of the adapted linears `paths`, those tensor parallelism keeps whole on every rank: k and v
    with fewer kv heads than ranks, MLA's down projections, a MoE layer's shared experts."""
    if tp == 1:
        return []
    whole = ("attention.wq_a", "attention.wkv_a", "feed_forward.shared.")
    whole += ("attention.wk", "attention.wv") if args.n_kv_heads % tp else ()
    return [p for p in paths if any(f".{w}" in f"{p}." or p.endswith(w) for w in whole)]


def is_adapter(name: str) -> bool:
    return name.endswith(ADAPTER_NAMES)


def initial_adapter(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """The seed's value of adapter `name`: A uniform in +-1/sqrt(in) (Kaiming-uniform at a = sqrt(5),
    as `peft` and `nn.Linear` draw it), B zero. Drawn from (seed, name) alone, as every weight is."""
    if name.endswith("lora_b"):
        return torch.zeros(shape)
    bound = 1 / math.sqrt(shape[-1] if len(shape) == 2 else shape[1])  # fan-in: A [r, in], an expert's [E, in, r]
    generator = torch.Generator().manual_seed(_name_seed(seed, name))
    return torch.empty(shape).uniform_(-bound, bound, generator=generator)


class AdapterWeights:
    """A weight source (`fivecut.weights.source.WeightSource`) that serves the adapters (`shapes`:
    name -> global shape) from the seed (`initial_adapter`), unless `base` holds them (a LoRA run's
    checkpoint: its adapters continue), and every other tensor from `base` (the published model,
    or the seed's)."""

    def __init__(self, base, shapes: dict[str, tuple[int, ...]], seed: int):
        held = set(base.shapes()) if hasattr(base, "shapes") else set()
        self.base, self.seed = base, seed
        self.adapter_shapes = {name: shape for name, shape in shapes.items() if name not in held}

    def __getattr__(self, name: str):  # path, args, shapes, tokenizer...: the base's
        return getattr(self.base, name)

    def read(self, name: str, box: tuple[slice, ...]) -> torch.Tensor:
        if name in self.adapter_shapes:
            return initial_adapter(name, self.adapter_shapes[name], self.seed)[box]
        return self.base.read(name, box)

    def fill(self, requests: list[tuple[str, tuple[slice, ...], torch.Tensor]]) -> None:
        self.base.fill([r for r in requests if r[0] not in self.adapter_shapes])
        for name, box, view in requests:
            if name in self.adapter_shapes:
                view.copy_(self.read(name, box))
