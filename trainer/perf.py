"""Throughput accounting: FLOPs per sample, the device's peak, MFU, and where step time goes.

MFU (model FLOPs utilisation) = achieved model FLOP/s / (ranks x the device's dense peak). The
model FLOPs of one sample (forward + backward) are counted once at start with torch's
FlopCounterMode on a copy of the plain model, so recomputation (activation checkpointing) and
padding do not count as useful work. Peaks are the vendors' dense (no sparsity) numbers for the
run's compute dtype; a device missing from the table, and any CPU, gets no MFU.
"""

from __future__ import annotations

import copy

import torch

# Dense peak FLOP/s per device: (bf16/fp16 tensor cores, fp32 without TF32). Matched by substring
# of torch.cuda.get_device_name, most specific first.
PEAK_FLOPS: tuple[tuple[str, float, float], ...] = (
    ("H200", 989e12, 67e12),
    ("H100 PCIe", 756e12, 51e12),
    ("H100 NVL", 835e12, 60e12),
    ("H100", 989e12, 67e12),  # SXM
    ("A100", 312e12, 19.5e12),
    ("L40S", 362e12, 91.6e12),
    ("L4", 121e12, 30.3e12),
    ("A10G", 70e12, 31.2e12),
    ("A10", 125e12, 31.2e12),
    ("V100", 125e12, 15.7e12),
    ("T4", 65e12, 8.1e12),
)


def peak_flops(device_name: str | None, precision: str) -> float | None:
    """The dense peak FLOP/s of one device for train.precision, or None when unknown."""
    if not device_name:
        return None
    for key, half, fp32 in PEAK_FLOPS:
        if key in device_name:
            return fp32 if precision == "fp32" else half
    return None


def device_name(device: str) -> str | None:
    """The GPU's marketing name (None on the CPU)."""
    if not device.startswith("cuda"):
        return None
    return torch.cuda.get_device_name(torch.device(device))


def flops_per_sample(model: torch.nn.Module, task, batch, device: str) -> float | None:
    """Forward + backward FLOPs of one training sample, counted on a copy of the plain model
    over a real `batch` of the data through the run's task (None if it cannot be counted:
    throughput reporting never stops a run)."""
    from torch.utils.flop_counter import FlopCounterMode

    from trainer import batch as batches

    try:
        if any(p.is_meta for p in model.parameters()):  # a deferred model: count on shapes
            probe, batch = copy.deepcopy(model), batches.map_tensors(_on_meta, batch)
        else:
            probe = copy.deepcopy(model).to(device)
        probe.eval()  # no BatchNorm statistics or dropout draws; the FLOPs are the same
        with FlopCounterMode(display=False) as counter:
            task.loss(task.forward(probe, batch), batch).backward()
        return counter.get_total_flops() / batches.size(batch)
    except Exception:
        return None


def _on_meta(t: torch.Tensor) -> torch.Tensor:
    return t.to("meta")


def mfu(samples_per_s: float, flops: float | None, peak: float | None, world_size: int):
    """Achieved model FLOP/s over the ranks' combined peak, or None without both numbers."""
    if not flops or not peak:
        return None
    return samples_per_s * flops / (peak * world_size)
