"""Throughput, MFU, and where the numbers go: JSONL, TensorBoard (when installed), a PNG."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from fivecut.train.faults import json_safe

# Dense peak TFLOP/s per device for bf16 (and tf32 for fp32) from vendor data sheets.
GPU_PEAK_TFLOPS = {
    "H200": (989.0, 494.0),
    "H100": (989.0, 494.0),
    "A100": (312.0, 156.0),
    "L40S": (362.0, 183.0),
    "A10G": (70.0, 35.0),
}


@dataclass
class Peak:
    """MFU's denominator: one device's peak TFLOP/s, where the figure came from, and what a faster step does to it.

    A CPU has no data sheet, so its figure is a measured matmul rate: a lower bound of what the CPU can do.
    A step that achieves more proves the bound low (the machine was busy when it was measured), so the
    step's rate becomes the peak and MFU never passes 100%. A data sheet's figure, or the user's
    log.peak_tflops, is kept: a step above it is said, never hidden (the FLOP count or the figure is wrong).
    Either way the first step above the peak is said once, in one line."""

    tflops: float  # 0: unknown, MFU not computed
    source: str
    measured: bool = False  # a measured CPU rate, which a faster step raises
    exceeded: bool = False  # a step has beaten the peak (and it was said)

    def observe(self, achieved: float, step: int) -> str | None:
        """A step's achieved TFLOP/s per device: the peak raised to it where that is allowed; the line to
        log the first time a step beats the peak, else None."""
        if not 0 < self.tflops < achieved:
            return None
        line = None if self.exceeded else self.exceeded_line(achieved, step)
        self.exceeded = True
        if self.measured:
            self.tflops = achieved
        return line

    def exceeded_line(self, achieved: float, step: int) -> str:
        beat = f"MFU: step {step} achieved {achieved:.3g} TFLOP/s per device, above the peak {self.tflops:.3g}"
        beat += f" ({self.source})"
        if self.measured:
            return f"{beat}; the peak is raised to the fastest step's rate from here (the CPU was busier when measured)"
        return f"{beat}; the peak is kept, so MFU passes 100% (check the figure, or the FLOPs counted per token)"

    def mfu(self, achieved: float) -> float:
        return achieved / self.tflops if self.tflops > 0 else 0.0


def peak_tflops(device: torch.device, dtype: str, configured: float = 0.0) -> Peak:
    """The per-device peak TFLOP/s MFU divides by: log.peak_tflops when set, a known GPU's data sheet,
    or on a CPU the best of several timed matmuls at this process's thread count."""
    if configured > 0:
        return Peak(configured, "log.peak_tflops")
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, (bf16, fp32) in GPU_PEAK_TFLOPS.items():
            if key in name:
                return Peak(bf16 if dtype == "bf16" else fp32, f"{name} data sheet")
        return Peak(0.0, f"unknown GPU {name}; set log.peak_tflops")
    threads = torch.get_num_threads()
    return Peak(measured_matmul_tflops(dtype), f"best CPU matmul, {threads} thread{'s' * (threads > 1)}", measured=True)


def measured_matmul_tflops(dtype: str, n: int = 1024, repeats: int = 10, min_seconds: float = 0.2) -> float:
    """What one process's matmul achieves here at its thread count: a stand-in for peak on a CPU, which has
    no data sheet. The best of at least `repeats` timed [n, n] @ [n, n] products, timed for at least
    `min_seconds` in all, so a moment of load from other processes does not set the figure."""
    kind = torch.bfloat16 if dtype == "bf16" else torch.float32
    a, b = torch.randn(n, n, dtype=kind), torch.randn(n, n, dtype=kind)
    a @ b  # warm-up: the first product allocates and picks its kernel
    best, spent, tries = float("inf"), 0.0, 0
    while tries < repeats or spent < min_seconds:
        start = time.perf_counter()
        a @ b
        took = time.perf_counter() - start
        best, spent, tries = min(best, took), spent + took, tries + 1
    return 2 * n**3 / best / 1e12


class MetricsSink:
    """Rank 0's metric records: one JSON object per line, mirrored to TensorBoard if available."""

    def __init__(self, out_dir: Path, append: bool = False):
        out_dir.mkdir(parents=True, exist_ok=True)
        self.path = out_dir / "metrics.jsonl"
        self.file = self.path.open("a" if append else "w")
        self.tb = self._tensorboard(out_dir)

    @staticmethod
    def _tensorboard(out_dir: Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # tensorboard is optional
            return None
        return SummaryWriter(str(out_dir / "tb"))

    def write(self, record: dict) -> None:
        """One line of strict JSON: non-finite floats (a NaN loss) are written as null."""
        record = json_safe(record)
        self.file.write(json.dumps(record, allow_nan=False) + "\n")
        self.file.flush()
        if self.tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self.tb.add_scalar(key, value, record["step"])

    def close(self) -> None:
        self.file.close()
        if self.tb is not None:
            self.tb.close()


def plot_losses(records: list[dict], path: Path, title: str) -> Path:
    """Training (and validation, where measured) loss against step, saved as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in records], [r["loss"] for r in records], label="train", linewidth=1)
    val = [r for r in records if "val_loss" in r]
    if val:
        ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
