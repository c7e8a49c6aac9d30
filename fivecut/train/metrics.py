"""Throughput, MFU, and where the numbers go: JSONL, TensorBoard (when installed), a PNG."""

from __future__ import annotations

import json
import time
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


def peak_tflops(device: torch.device, dtype: str, configured: float = 0.0) -> tuple[float, str]:
    """Per-device peak TFLOP/s used as MFU's denominator, and where the figure came from."""
    if configured > 0:
        return configured, "log.peak_tflops"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, (bf16, fp32) in GPU_PEAK_TFLOPS.items():
            if key in name:
                return (bf16 if dtype == "bf16" else fp32), f"{name} data sheet"
        return 0.0, f"unknown GPU {name}; set log.peak_tflops"
    return measured_matmul_tflops(dtype), "measured CPU matmul"


def measured_matmul_tflops(dtype: str, n: int = 1024, repeats: int = 10) -> float:
    """What one process's matmul achieves here: a stand-in for peak on a CPU, which has no data sheet."""
    kind = torch.bfloat16 if dtype == "bf16" else torch.float32
    a, b = torch.randn(n, n, dtype=kind), torch.randn(n, n, dtype=kind)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
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
