"""Built-in simulated Megatron-LM (`python -m zenithtune.sim`) and ms-swift (`python -m zenithtune.sim.swift`).

A stand-in for `pretrain_gpt.py` / `megatron sft` that needs no GPU: it accepts their options, rejects
what Megatron rejects (zenithtune.validate's rules), runs out of memory where the simulated GPU would,
and otherwise prints their log lines with a throughput that follows an analytical model of
distributed training (zenithtune.sim.physics), calibrated on published numbers (zenithtune.sim.calibrate).

In-process, for tests and benchmarks::

    from zenithtune.sim import simulate
    res = simulate(["--num-layers", "32", ..., "--sim-world-size", "8"])
    res.kind, res.tflops, res.peak_memory_gb, res.stdout
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from zenithtune.sim.trainer import Event, SimResult, simulate

if TYPE_CHECKING:
    from zenithtune.sim.swift import simulate_swift

__all__ = ["Event", "SimResult", "simulate", "simulate_swift"]


def __getattr__(name: str):
    # lazy, so `python -m zenithtune.sim.swift` does not import its own module twice (runpy warns)
    if name == "simulate_swift":
        from zenithtune.sim.swift import simulate_swift

        return simulate_swift
    raise AttributeError(f"module 'zenithtune.sim' has no attribute {name!r}")
