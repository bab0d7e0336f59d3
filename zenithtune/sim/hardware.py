"""The GPUs the simulator can play, with the numbers its physics needs (MEGATRON.md §Calibration).

Bandwidths are per GPU per direction, as the hardware is sold; the physics applies its own achievable
fractions. `capacity_gib` is what PyTorch reports as "total capacity" (a little under the marketing GB).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GPU:
    name: str  # the --sim-gpu choice
    label: str  # what a log line calls it
    peak_tflops: float  # dense bf16 peak, TFLOP/s
    capacity_gib: float  # torch.cuda total capacity
    hbm_gbps: float  # HBM bandwidth, GB/s (memory-bound kernels)
    nvlink_gbps: float  # NVLink per GPU per direction, GB/s (inside a node)
    network_gbps: float  # InfiniBand per GPU per direction, GB/s (across nodes)
    gemm_peak_fraction: float  # best bf16 GEMM efficiency on large shapes (A100 gets closer to peak than H100)
    gemm_half_dim: float  # a GEMM dimension this small halves efficiency (more SMs, bigger tiles: larger)
    attn_fraction: float  # flash-attention forward efficiency, of peak, on long sequences


GPUS: dict[str, GPU] = {
    "h100": GPU("h100", "NVIDIA H100 80GB HBM3", 989.0, 79.11, 3350.0, 450.0, 50.0, 0.85, 350.0, 0.52),
    "h200": GPU("h200", "NVIDIA H200", 989.0, 139.72, 4800.0, 450.0, 50.0, 0.85, 350.0, 0.52),
    "a100-80g": GPU("a100-80g", "NVIDIA A100-SXM4-80GB", 312.0, 79.15, 2039.0, 300.0, 25.0, 0.86, 160.0, 0.62),
    "a100-40g": GPU("a100-40g", "NVIDIA A100-SXM4-40GB", 312.0, 39.39, 1555.0, 300.0, 25.0, 0.86, 160.0, 0.62),
}
