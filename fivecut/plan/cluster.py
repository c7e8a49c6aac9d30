"""The cluster a plan is made for: nodes of GPUs, the device, and the two classes of link.

A cluster is written `NODESxGPUSxDEVICE` (`32x8xH100`) or as a TOML file:

    [cluster]
    nodes = 32                    # or gpus = 256: the world, a whole number of nodes
    gpus_per_node = 8
    cores_per_node = 0            # optional: the CPU cores a node's ranks share (a CPU host, as
                                  # `fivecut plan calibrate` writes it); 0: a device each (GPUs)
    device = "H100"               # a preset below, or a [device] table
    [device]                      # optional: overrides or defines the device
    name = "H100"
    peak_tflops = 989.4           # dense bf16 peak, no sparsity (calibrated: the measured rate)
    memory_gb = 80
    achievable = 0.7              # the fraction of the peak a large matmul reaches
    kernel_us = 5                 # fixed microseconds per kernel (launch and dispatch; calibrated: measured)
    memory_gbps = 3350            # GB/s memory-bound passes reach (the optimizer, clipping)
    tensor_us = 26                # fixed microseconds per parameter tensor of clipping and AdamW
    overlap = 1                   # share of compute a collective in flight hides behind (0..1)
    attention_tflops = 0          # the attention kernel's rate (0: peak x achievable, as the matmuls)
    activation_gbps = 0           # GB/s of a block's memory-bound kernels (0: memory_gbps)
    loss_gbps = 0                 # GB/s of the cross-entropy over the logits (0: memory_gbps)
    recompute_us = 0              # fixed microseconds per kernel of a forward recomputed in backward
                                  # (the checkpoint's saved-tensor hooks as well; 0: kernel_us)
    action_us = 0                 # fixed microseconds per pipeline action (an F, B or W of a microbatch
                                  # on a stage: the executor, an autograd call, its message); 0: none
    [links.intra]                 # inside a node (NVLink / NVSwitch), per GPU, per direction
    bandwidth_gbps = 450          # GB/s
    latency_us = 3
    all_gather_us = 3             # optional: one op's own latency per hop of a message (default:
                                  # latency_us; also all_reduce_us, reduce_scatter_us, ...)
    all_gather_gbps = 450         # optional: one op's own bandwidth (default: bandwidth_gbps)
    [links.inter]                 # between nodes (InfiniBand / RoCE), per GPU, per direction
    bandwidth_gbps = 50
    latency_us = 10

Each collective costs alpha + beta under the ring algorithms `fivecut.ledger` counts bytes by:
a ring of n ranks takes n-1 (all-gather, reduce-scatter, all-to-all) or 2(n-1) (all-reduce)
latency hops, and its wire bytes (`ring_factor` x tensor bytes) at the bandwidth of the slowest
link it crosses: NVLink when the group lies in one node, the inter-node link otherwise. A link
may give an op its own per-hop latency for a message (`all_reduce_us`, `all_gather_us`,
`reduce_scatter_us`, `all_to_all_us`, `send_us`: gloo's differ from one another, and a call of
a few kilobytes costs it several times a one-element all-reduce's `latency_us`, which the
step's control all-reduces pay; NCCL's are alike, so the presets give none), and its own
bandwidth (`all_gather_gbps`, ...: gloo's all-gather, reduce-scatter and all-to-all move their
bytes several times slower than its all-reduce).

The device figures are NVIDIA's data sheets (dense bf16 tensor-core peak, memory, NVLink
bandwidth halved to one direction); inter-node bandwidth is the network interface per GPU of
the vendors' reference nodes (DGX A100: one 200 Gb/s HDR port per GPU; DGX H100/H200 and the
H800 nodes of DeepSeek-V3: one 400 Gb/s NDR port per GPU). Latencies and `achievable` are
not data-sheet figures: they are typical values (NCCL small-message latencies of a few
microseconds inside a node and about ten across; large bf16 GEMMs at 60-75% of the dense
peak) and are meant to be replaced by a calibration (`fivecut plan calibrate`).
This file is torch-free.
"""

from __future__ import annotations

import math
import re
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from fivecut.ledger import ring_factor

GB = 1e9


class ClusterError(ValueError):
    """A cluster that cannot be planned for; the message names the key and the fix."""


@dataclass(frozen=True)
class Device:
    name: str
    peak_tflops: float  # dense peak
    memory_gb: float
    achievable: float = 0.7  # fraction of the peak large matmuls reach
    source: str = ""
    kernel_us: float = 5.0  # fixed cost of one kernel (launch, per-op dispatch), whatever its size
    memory_gbps: float = 2000.0  # GB/s that memory-bound passes (AdamW, clipping) reach
    tensor_us: float = 26.0  # fixed cost per parameter tensor of the norm, clipping and AdamW (see DEVICES)
    overlap: float = 1.0  # share of concurrent compute a collective in flight hides behind (NCCL: all)
    attention_tflops: float = 0.0  # the attention kernel's rate (0: the matmuls' achievable rate)
    activation_gbps: float = 0.0  # GB/s a block's memory-bound kernels move its activations at (0: memory_gbps)
    loss_gbps: float = 0.0  # GB/s of the cross-entropy over the logits, LOSS_BYTES a logit (0: memory_gbps)
    recompute_us: float = 0.0  # fixed cost of one kernel of a recomputed forward (0: kernel_us)
    action_us: float = 0.0  # fixed cost of one pipeline action beyond its kernels and message (calibrated)

    @property
    def flops(self) -> float:
        """Achievable FLOP/s."""
        return self.peak_tflops * 1e12 * self.achievable

    @property
    def attention_flops(self) -> float:
        """FLOP/s of the attention core (fused scaled-dot-product attention, forward and backward)."""
        return self.attention_tflops * 1e12 if self.attention_tflops else self.flops

    @property
    def activation_bps(self) -> float:
        """Bytes/s at which a block's memory-bound kernels (norms, RoPE, SwiGLU, residuals) move
        the activations it saves for backward."""
        return (self.activation_gbps or self.memory_gbps) * GB

    @property
    def loss_bps(self) -> float:
        """Bytes/s of the cross-entropy's forward and backward over the logits."""
        return (self.loss_gbps or self.memory_gbps) * GB

    @property
    def recompute_s(self) -> float:
        """Seconds of one kernel of a forward that a checkpoint runs again in backward."""
        return (self.recompute_us or self.kernel_us) * 1e-6


OWN_LATENCY = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send")  # ops a link may time apart


@dataclass(frozen=True)
class Link:
    bandwidth_gbps: float  # GB/s per GPU, per direction
    latency_us: float  # per hop of a ring: a one-element all-reduce's (control), and every op's default
    op_latency_us: tuple[tuple[str, float], ...] = ()  # (op, per-hop latency) of the ops timed apart
    op_bandwidth_gbps: tuple[tuple[str, float], ...] = ()  # (op, GB/s) of the ops whose bytes go slower

    def hop_us(self, op: str) -> float:
        """The latency of one hop of `op` (a recv is its send's)."""
        return dict(self.op_latency_us).get("send" if op == "recv" else op, self.latency_us)

    def bandwidth(self, op: str) -> float:
        """Bytes/s at which `op`'s wire bytes go (a recv's are its send's)."""
        return dict(self.op_bandwidth_gbps).get("send" if op == "recv" else op, self.bandwidth_gbps) * GB

    def latency(self, op: str, n: int) -> float:
        """Seconds of one call of `op` over `n` ranks before any byte: its hops x their latency."""
        if n <= 1:
            return 0.0
        return hops_of(op, n) * self.hop_us(op) * 1e-6

    def control_latency(self, n: int) -> float:
        """Seconds of a one-element all-reduce over `n` ranks (a step's loss, flags and norms)."""
        return hops_of("all_reduce", n) * self.latency_us * 1e-6 if n > 1 else 0.0

    def seconds(self, op: str, tensor_bytes: float, n: int) -> float:
        """alpha-beta time of `op` on a tensor of `tensor_bytes` over a ring of `n` ranks."""
        if n <= 1 or tensor_bytes <= 0:
            return 0.0
        return self.latency(op, n) + ring_factor(op, n) * tensor_bytes / self.bandwidth(op)


def hops_of(op: str, n: int) -> int:
    """Latency hops of one call on a ring of `n`: all-reduce 2(n-1), a send or recv 1, the rest n-1."""
    return {"all_reduce": 2 * (n - 1), "send": 1, "recv": 1}.get(op, n - 1)


# Peaks and capacities: NVIDIA data sheets: A100 SXM4 80GB (bf16 312 TFLOPS dense, NVLink 600 GB/s,
# HBM2e 2,039 GB/s), H100 SXM5 and H200 SXM (bf16 1,979 TFLOPS with sparsity = 989.4 dense, NVLink
# 900 GB/s; 80 GB HBM3 at 3.35 TB/s / 141 GB HBM3e at 4.8 TB/s), H800 SXM5 (H100's compute and
# memory, NVLink 400 GB/s).
#
# Rates: what real kernels reach, not a hoped-for share of the peak (docs/planner-vs-published.md):
#   achievable        bf16 matmuls as a layer runs them (forward and backward, `fivecut plan calibrate`'s
#                     linear-layer probe, 8192 x 4096 x 12288): 764 TFLOP/s measured on one H200
#                     (torch 2.11, CUDA 13; an 8192^3 matmul alone: 788), 0.772 of the peak. The H100 and
#                     H800 have the H200's compute die, clocks and 700 W limit (the H200 differs in its
#                     HBM only): the same share.
#   attention_tflops  PyTorch's fused attention (the FlashAttention-2 kernel) on Hopper: about 35% of the
#                     H100's peak (FlashAttention-3, arXiv 2407.08608, section 1), counted as that paper
#                     counts a backward (2.5 forwards with the recomputation inside the kernel); the planner
#                     counts 2, so 989.4 x 0.35 x 3 / 3.5 = 297, 300 TFLOP/s. A100: FlashAttention-2 at
#                     50-73% of the peak forward and less backward (arXiv 2307.08691): 0.5 x 312 = 156.
#   STREAM            what a streaming kernel moves: 90% of the data sheet's HBM bandwidth (H200 4,320,
#                     H100 and H800 3,015, A100 1,835 GB/s)
#   memory_gbps       the step's tail: fused AdamW over llama-1b's 1.24B fp32 parameters took 10.9 ms on
#                     the H200 (benchmarks/results/gpu.md, "One H200"): `ADAMW_BYTES` 28 a parameter at
#                     3,180 GB/s, 0.74 of STREAM; the others at the same share
#   activation_gbps   a block's memory-bound kernels: the planner counts what a block saves, written and
#                     read back with its gradient (3x); fivecut's eager kernels (RMSNorm, RoPE in fp32,
#                     SwiGLU, the residuals, autocast's casts) move 3.08x that (19.5 GB against 6.35 GB for
#                     llama-1b's block at 8 x 2048 tokens, counted op by op on the meta device:
#                     `benchmarks/eager_traffic.py`), so STREAM / 3.08
#   loss_gbps         the full-logits cross-entropy moves 36 bytes a logit in eager PyTorch (the fp32
#                     upcast 6, log-softmax 8, its backward 12, the gradient's zeros 4, the cast back 6;
#                     the same count) against the planner's `LOSS_BYTES` 16: STREAM x 16 / 36
#   tensor_us         the tail's fixed cost a tensor: the clipping's norm and scale and AdamW run as
#                     multi-tensor kernels on a GPU (`fivecut.train.optim`): a few microseconds a tensor
# Latencies and `overlap` remain typical values (NCCL's few microseconds inside a node, about ten
# across); `fivecut plan calibrate` on the GPUs themselves replaces all of these.
STREAM = {"A100": 1835.0, "H100": 3015.0, "H800": 3015.0, "H200": 4320.0}
HOPPER_MATMUL = 764.0 / 989.4  # measured on one H200 (benchmarks/results/gpu.md, "One H200")
TAIL_SHARE = 3180.0 / 4320.0  # fused AdamW's rate on the H200 over its STREAM
EAGER_BLOCK_TRAFFIC = 3.08  # the bytes eager kernels move / the bytes the planner counts (a block)
EAGER_LOSS_TRAFFIC = 2.25  # the same for the cross-entropy over the logits


def measured_rates(key: str, achievable: float, attention_tflops: float) -> dict:
    """A device's rates from `STREAM` and the shares above."""
    stream = STREAM[key]
    return {
        "achievable": achievable,
        "attention_tflops": attention_tflops,
        "memory_gbps": round(stream * TAIL_SHARE),
        "activation_gbps": round(stream / EAGER_BLOCK_TRAFFIC),
        "loss_gbps": round(stream / EAGER_LOSS_TRAFFIC),
        "tensor_us": 3.0,
    }


HOPPER_SOURCE = (
    "data sheet peak; rates: bf16 matmul 764 TFLOP/s measured on an H200 (same die, clocks and power), "
    "FlashAttention-2 at 35% of peak (arXiv 2407.08608), memory-bound terms at 90% of the HBM bandwidth over "
    "eager PyTorch's counted traffic (docs/planner-vs-published.md)"
)
DEVICES = {
    "A100": Device(
        "A100",
        312.0,
        80,
        source="NVIDIA A100 data sheet (SXM4 80GB); matmul share not measured (0.7 assumed), FlashAttention-2 "
        "at 50% of peak (arXiv 2307.08691), memory-bound terms as the Hopper presets",
        **measured_rates("A100", 0.7, 156.0),
    ),
    "H100": Device(
        "H100", 989.4, 80, source=f"NVIDIA H100 SXM5 {HOPPER_SOURCE}", **measured_rates("H100", HOPPER_MATMUL, 300.0)
    ),
    "H800": Device(
        "H800",
        989.4,
        80,
        source=f"NVIDIA H800 SXM5 (H100 compute) {HOPPER_SOURCE}",
        **measured_rates("H800", HOPPER_MATMUL, 300.0),
    ),
    "H200": Device(
        "H200", 989.4, 141, source=f"NVIDIA H200 SXM {HOPPER_SOURCE}", **measured_rates("H200", HOPPER_MATMUL, 300.0)
    ),
}
INTRA = {  # NVLink, one direction
    "A100": Link(300.0, 3.0),
    "H100": Link(450.0, 3.0),
    "H800": Link(200.0, 3.0),
    "H200": Link(450.0, 3.0),
}
INTER = {  # one NIC per GPU: 200 Gb/s HDR (A100 nodes), 400 Gb/s NDR (H100, H800, H200 nodes)
    "A100": Link(25.0, 10.0),
    "H100": Link(50.0, 10.0),
    "H800": Link(50.0, 10.0),
    "H200": Link(50.0, 10.0),
}


@dataclass(frozen=True)
class Cluster:
    nodes: int
    gpus_per_node: int
    device: Device
    intra: Link
    inter: Link
    name: str = ""
    cores_per_node: int = 0  # CPU cores a node's ranks share, its rates measured with every rank busy (0: GPUs)

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def link_for(self, ranks: tuple[int, ...] | list[int]) -> Link:
        """The link a group's ring is limited by: NVLink inside one node, the network otherwise."""
        return self.intra if len({self.node_of(r) for r in ranks}) <= 1 else self.inter

    def describe(self) -> str:
        d = self.device
        return (
            f"{self.name or f'{self.nodes}x{self.gpus_per_node}x{d.name}'}: {self.world_size} devices, {d.name} "
            f"({d.peak_tflops:.4g} TFLOP/s x {d.achievable:g} achievable, {d.memory_gb:.4g} GB); intra-node "
            f"{self.intra.bandwidth_gbps:.4g} GB/s {self.intra.latency_us:.3g} us, inter-node "
            f"{self.inter.bandwidth_gbps:.4g} GB/s {self.inter.latency_us:.3g} us"
        )


SPELLING = re.compile(r"^(\d+)x(\d+)x([A-Za-z0-9]+)$")


def preset_cluster(nodes: int, gpus_per_node: int, device: str) -> Cluster:
    key = device.upper()
    if key not in DEVICES:
        raise ClusterError(f"unknown device {device!r}; known devices: {', '.join(DEVICES)} (or a cluster TOML file)")
    if nodes < 1 or gpus_per_node < 1:
        raise ClusterError(f"a cluster needs >= 1 node and >= 1 GPU per node, not {nodes}x{gpus_per_node}")
    return Cluster(nodes, gpus_per_node, DEVICES[key], INTRA[key], INTER[key], f"{nodes}x{gpus_per_node}x{key}")


def parse_cluster(spec: str) -> Cluster:
    """`32x8xH100`, or the path of a cluster TOML file (see the module doc)."""
    found = SPELLING.match(spec.strip())
    if found:
        return preset_cluster(int(found[1]), int(found[2]), found[3])
    path = Path(spec)
    if not path.is_file():
        raise ClusterError(
            f"--cluster {spec!r} is neither NODESxGPUSxDEVICE (e.g. 32x8xH100; devices: {', '.join(DEVICES)}) "
            "nor a cluster TOML file"
        )
    return cluster_from_table(read_toml(path), str(path))


def read_toml(path: Path) -> dict:
    """A cluster file's tables; a file that cannot be read, is not UTF-8 or is not TOML is refused by name."""
    try:
        return tomllib.loads(path.read_bytes().decode("utf-8"))
    except OSError as err:
        raise ClusterError(f"{path}: cannot be read ({err.strerror}); give a cluster TOML file you can read") from None
    except UnicodeDecodeError as err:
        raise ClusterError(
            f"{path}: not UTF-8 text (byte {err.object[err.start]:#04x} at offset {err.start}); save the cluster "
            "file as UTF-8"
        ) from None
    except tomllib.TOMLDecodeError as err:
        raise ClusterError(f"{path}: not valid TOML ({err})") from None


@dataclass(frozen=True)
class Field:
    """What one key of a cluster file holds: text, an integer or a finite number, within `allows`."""

    kind: str  # "text", "integer" or "number"
    allows: Callable[[float], bool] = lambda value: True
    words: str = ""  # the values `allows` lets through, in words ("> 0")

    def problem(self, value) -> str | None:
        """What is wrong with `value` for this key (None: nothing)."""
        if self.kind == "text":
            right = isinstance(value, str)
        elif self.kind == "integer":
            right = isinstance(value, int) and not isinstance(value, bool) and self.allows(value)
        else:
            number = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
            right = number and self.allows(value)
        if right:
            return None
        wanted = {"text": "a string", "integer": "an integer", "number": "a finite number"}[self.kind]
        return f"must be {wanted}{' ' + self.words if self.words else ''}, not {shown(value)}"


def shown(value) -> str:
    """A TOML value as a message quotes it, with its kind where the kind is the mistake."""
    if isinstance(value, dict):
        return "a table"
    kind = {bool: "true/false", str: "a string", list: "an array"}.get(type(value))
    return f"{value!r} ({kind})" if kind else repr(value)


TEXT = Field("text")
POSITIVE = Field("number", lambda v: v > 0, "> 0")
NOT_NEGATIVE = Field("number", lambda v: v >= 0, ">= 0")
COUNT = Field("integer", lambda v: v >= 1, ">= 1")
CLUSTER_FIELDS = {
    "name": TEXT,
    "nodes": COUNT,
    "gpus": COUNT,
    "gpus_per_node": COUNT,
    "cores_per_node": Field("integer", lambda v: v >= 0, ">= 0 (0: a device each)"),
    "device": TEXT,
}
DEVICE_FIELDS = {
    "name": TEXT,
    "source": TEXT,
    "peak_tflops": POSITIVE,
    "memory_gb": POSITIVE,
    "achievable": Field("number", lambda v: 0 < v <= 1, "in (0, 1]"),
    "kernel_us": NOT_NEGATIVE,
    "memory_gbps": POSITIVE,
    "tensor_us": NOT_NEGATIVE,
    "overlap": Field("number", lambda v: 0 <= v <= 1, "in [0, 1]"),
    **dict.fromkeys(("attention_tflops", "activation_gbps", "loss_gbps", "recompute_us", "action_us"), NOT_NEGATIVE),
}
LINK_FIELDS = {
    "bandwidth_gbps": POSITIVE,
    "latency_us": NOT_NEGATIVE,
    **{f"{op}_us": NOT_NEGATIVE for op in OWN_LATENCY},
    **{f"{op}_gbps": POSITIVE for op in OWN_LATENCY},
}
SCHEMA = {"cluster": CLUSTER_FIELDS, "device": DEVICE_FIELDS, "links": {"intra": LINK_FIELDS, "inter": LINK_FIELDS}}


def table_problems(table: dict, schema: dict, path: str = "") -> list[str]:
    """Each key of `table` (at the dotted `path` of a cluster file) that `schema` does not know or
    whose value is of the wrong kind or out of range, by its dotted path."""
    out = []
    for key, value in table.items():
        dotted = f"{path}.{key}" if path else key
        expected = schema.get(key)
        if expected is None:
            out.append(f"unknown key {dotted}; {f'[{path}]' if path else 'a cluster file'} has {', '.join(schema)}")
        elif isinstance(expected, dict) and not isinstance(value, dict):
            out.append(f"{dotted} must be a table ([{dotted}] and its keys), not {shown(value)}")
        elif isinstance(expected, dict):
            out += table_problems(value, expected, dotted)
        elif (problem := expected.problem(value)) is not None:
            out.append(f"{dotted} {problem}")
    return out


def cluster_from_table(table: dict, where: str) -> Cluster:
    problems = table_problems(table, SCHEMA)
    if len(problems) == 1:
        raise ClusterError(f"{where}: {problems[0]}")
    if problems:
        raise ClusterError(f"{where}:\n  - " + "\n  - ".join(problems))
    top = dict(table.get("cluster", {}))
    if "gpus" in top and "nodes" not in top:  # the world, for nodes of gpus_per_node
        top["nodes"] = whole_nodes(top["gpus"], top.get("gpus_per_node"), where)
    for key in ("nodes", "gpus_per_node"):
        if key not in top:
            raise ClusterError(f"{where}: [cluster] needs {key}, an integer >= 1")
    device = device_from(table, top, where)
    links = table.get("links", {})
    preset = device.name.upper() if device.name.upper() in DEVICES else None
    intra = link_from(links.get("intra"), INTRA.get(preset), f"{where}: [links.intra]")
    inter = link_from(links.get("inter"), INTER.get(preset), f"{where}: [links.inter]")
    name = top.get("name", Path(where).stem)
    return Cluster(top["nodes"], top["gpus_per_node"], device, intra, inter, name, top.get("cores_per_node", 0))


def whole_nodes(gpus: int, per_node: int | None, where: str) -> int:
    if per_node is None:
        raise ClusterError(f"{where}: [cluster] gpus = {gpus} needs gpus_per_node, an integer >= 1")
    if gpus % per_node:
        raise ClusterError(
            f"{where}: [cluster] gpus = {gpus} is not a whole number of nodes of gpus_per_node = {per_node}; "
            f"give a multiple of {per_node} (e.g. {max(gpus // per_node, 1) * per_node}) or the GPUs per node "
            "your machines have"
        )
    return gpus // per_node


def device_from(table: dict, top: dict, where: str) -> Device:
    """The preset `[cluster] device` names, with the `[device]` table's keys over it (every key
    checked by `table_problems` already)."""
    named = top.get("device")
    base = DEVICES.get(named.upper()) if named is not None else None
    if named is not None and base is None and "device" not in table:
        raise ClusterError(
            f"{where}: unknown device {named!r}; use one of {', '.join(DEVICES)} or add a [device] table"
        )
    given = table.get("device", {})
    if base is None:
        missing = [k for k in ("name", "peak_tflops", "memory_gb") if k not in given]
        if missing:
            raise ClusterError(f"{where}: [device] needs {', '.join(missing)} (or [cluster] device = a preset)")
        base = Device(given["name"], float(given["peak_tflops"]), float(given["memory_gb"]))
    return replace(base, **{k: float(v) if k not in ("name", "source") else v for k, v in given.items()})


def link_from(given: dict | None, default: Link | None, where: str) -> Link:
    """A `[links.*]` table (every key checked by `table_problems` already), or the preset's link."""
    if given is None:
        if default is None:
            raise ClusterError(f"{where} is missing (bandwidth_gbps, latency_us): the device is not a preset")
        return default
    missing = [k for k in ("bandwidth_gbps", "latency_us") if k not in given]
    if missing:
        raise ClusterError(f"{where} needs {', '.join(missing)}")
    own = tuple((op, float(given[f"{op}_us"])) for op in OWN_LATENCY if f"{op}_us" in given)
    rates = tuple((op, float(given[f"{op}_gbps"])) for op in OWN_LATENCY if f"{op}_gbps" in given)
    return Link(float(given["bandwidth_gbps"]), float(given["latency_us"]), own, rates)


def cluster_toml(cluster: Cluster, note: str = "") -> str:
    """A cluster as the TOML `parse_cluster` reads (calibration writes this machine's)."""
    d = cluster.device
    lines = [f"# {note}"] if note else []
    lines += [
        "[cluster]",
        f'name = "{cluster.name}"',
        f"nodes = {cluster.nodes}",
        f"gpus_per_node = {cluster.gpus_per_node}",
        *([f"cores_per_node = {cluster.cores_per_node}"] if cluster.cores_per_node else []),
        "",
        "[device]",
        f'name = "{d.name}"',
        f"peak_tflops = {d.peak_tflops:.6g}",
        f"memory_gb = {d.memory_gb:.6g}",
        f"achievable = {d.achievable:.6g}",
        f"kernel_us = {d.kernel_us:.6g}",
        f"memory_gbps = {d.memory_gbps:.6g}",
        f"tensor_us = {d.tensor_us:.6g}",
        f"overlap = {d.overlap:.6g}",
        f"attention_tflops = {d.attention_tflops:.6g}",
        f"activation_gbps = {d.activation_gbps:.6g}",
        f"loss_gbps = {d.loss_gbps:.6g}",
        f"recompute_us = {d.recompute_us:.6g}",
        f"action_us = {d.action_us:.6g}",
        f'source = "{d.source}"',
    ]
    for name, link in (("intra", cluster.intra), ("inter", cluster.inter)):
        lines += [
            "",
            f"[links.{name}]",
            f"bandwidth_gbps = {link.bandwidth_gbps:.6g}",
            f"latency_us = {link.latency_us:.6g}",
        ]
        lines += [f"{op}_us = {us:.6g}" for op, us in link.op_latency_us]
        lines += [f"{op}_gbps = {gbps:.6g}" for op, gbps in link.op_bandwidth_gbps]
    return "\n".join(lines) + "\n"
