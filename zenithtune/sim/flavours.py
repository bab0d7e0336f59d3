"""Simulator flavours: trainers whose physics has a different *structure* from the plain simulator's.

The tuner's memory model and throughput prior were written from the same notes as the simulator, so on
the plain simulator (and on sim/perturb.py's trainers, which only scale its components) they agree on
what grows with what. A real cluster does not: its allocator, kernels, schedule and network follow
other laws. Each flavour here replaces one law of the simulator by another one, written from a
published description (cited per flavour below), not by scaling the existing formula:

    --sim-flavour stand_in                         # every structural change below at once
    --sim-flavour mbs_buffers,tp_exposed           # composable: names joined by commas
    --sim-flavour overhead=6.5,slow_network=0.25   # numeric flavours take their size after '='

Memory (what the GPU holds; an OOM is still an OOM at the GPU's capacity):
- `mbs_buffers[=G]`: activations per micro-batch grow faster than the micro-batch size: each sample
  beyond the first adds G (0.08) to every saved byte. Megatron's 1F1B keeps the p2p send/receive
  tensors of every micro-batch in flight (megatron/core/pipeline_parallel/p2p_communication.py) and
  cuDNN/TE attention workspaces grow with b·s; the caching allocator rounds bigger blocks up (PyTorch
  "CUDA semantics", memory management). Korthikanti et al. 2022 count only the saved tensors, linear in b.
- `fragmentation`: reserved over allocated depends on recompute and MBS, not on the model alone:
  recompute frees and re-allocates every layer's activations each step, larger micro-batches make
  larger blocks the allocator cannot reuse for smaller requests (PyTorch caching-allocator notes on
  block splitting; Megatron-Bridge's performance guide recommends expandable_segments for this).
- `overhead[=GiB]`: a fixed 2-8 GiB outside the caching allocator (default 5): NCCL NVLS/user buffers,
  CUDA graphs, TE userbuffers and cuBLAS workspaces per stream (NCCL environment docs: NCCL_NVLS_ENABLE
  buffers; Megatron-Bridge performance guide: CUDA graphs and TP-comm-overlap buffers cost memory).
- `etp_experts`: MoE layers all-gather the routed tokens over TP before the experts and split the
  expert FFN over expert-TP, so expert activations are divided by ETP, not TP (Megatron-Core MoE
  README: "MoE parallel folding" decouples the experts' TP from the attention's TP).
- `more_memory[=F]`: every byte the allocator holds x F (1.2): another build (Transformer Engine version,
  FP8 copies, logits kept in fp32) needs 20 % more than the tuner's model.

Speed:
- `tp_exposed`: TP collectives are not overlapped with GEMMs at all (Megatron runs them on the compute
  stream unless `--tp-comm-overlap` with TE userbuffers; Megatron-Bridge performance guide), and reach
  75 % of the bus bandwidth a large ring gets (NCCL tests: small messages on 2-8 GPUs).
- `a2a_dp_carved`: expert parallelism carved out of data parallelism (Megatron-Core before MoE
  parallel folding: rank order tp-cp-ep-dp-pp), so EP peers are TP·CP ranks apart and the all-to-all
  leaves the node as soon as e·t·c exceeds the node; each peer costs its own latency.
- `slow_network[=F]`: inter-node bandwidth x F (0.25: a 4x slower network, e.g. 100 Gb/s per GPU
  instead of 400).
- `sync_warmup`: the pipeline's warm-up and cool-down send/receive synchronously (no overlap with the
  next micro-batch) and wait for the slowest stage, and interleaving recovers only part of the bubble
  (Narayanan et al. 2021 §2.2: the interleaved schedule pays v times the communication; its bubble
  (p-1)/(v·m) assumes perfectly balanced, communication-free chunks).
- `gemm_waves`: GEMM efficiency follows tile and wave quantization (NVIDIA Deep Learning Performance
  guide, "Matrix Multiplication Background": 128x256 output tiles over the SMs; a partial last wave
  idles SMs) and saturates with K alone, instead of the plain simulator's smooth 1/(1 + X0/m + X0/n + X0/k).

Groups: `memory` (mbs_buffers, fragmentation, overhead, etp_experts), `speed` (tp_exposed,
a2a_dp_carved, sync_warmup, gemm_waves), `stand_in` (both).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal


@dataclass(frozen=True)
class Flavour:
    """The laws a flavoured simulator follows (the defaults are the plain simulator's)."""

    names: tuple[str, ...] = ()  # what --sim-flavour asked for, for the banner
    mbs_growth: float = 0.0  # each sample beyond the first adds this share to every activation byte
    fragmentation: Literal["plain", "recompute_mbs"] = "plain"
    overhead_gib: float = 0.0  # fixed bytes outside the caching allocator
    expert_split: Literal["tp", "etp"] = "tp"  # what divides the experts' activations per rank
    memory_scale: float = 1.0  # on every byte the allocator holds
    tp_overlap: bool = True  # False: TP collectives fully exposed, at reduced bandwidth
    a2a_layout: Literal["folded", "dp_carved"] = "folded"  # where EP peers sit in the rank order
    network_scale: float = 1.0  # on inter-node bandwidth
    pipeline: Literal["1f1b", "sync_warmup"] = "1f1b"
    gemm_curve: Literal["saturating", "waves"] = "saturating"

    @property
    def active(self) -> bool:
        return self != PLAIN

    def describe(self) -> str:
        return ", ".join(self.names)


PLAIN = Flavour()

# name -> (field, value when given without '=', (lowest, highest) when given with one, or None)
_SINGLE: dict[str, tuple[str, Any, tuple[float, float] | None]] = {
    "mbs_buffers": ("mbs_growth", 0.08, (0.0, 0.5)),
    "fragmentation": ("fragmentation", "recompute_mbs", None),
    "overhead": ("overhead_gib", 5.0, (0.0, 16.0)),
    "etp_experts": ("expert_split", "etp", None),
    "more_memory": ("memory_scale", 1.2, (1.0, 2.0)),
    "tp_exposed": ("tp_overlap", False, None),
    "a2a_dp_carved": ("a2a_layout", "dp_carved", None),
    "slow_network": ("network_scale", 0.25, (0.05, 1.0)),
    "sync_warmup": ("pipeline", "sync_warmup", None),
    "gemm_waves": ("gemm_curve", "waves", None),
}
GROUPS: dict[str, tuple[str, ...]] = {
    "plain": (),
    "memory": ("mbs_buffers", "fragmentation", "overhead", "etp_experts"),
    "speed": ("tp_exposed", "a2a_dp_carved", "sync_warmup", "gemm_waves"),
}
GROUPS["stand_in"] = GROUPS["memory"] + GROUPS["speed"]
NAMES = (*_SINGLE, *GROUPS)


def parse(spec: str | None) -> Flavour:
    """The flavour a comma-separated --sim-flavour spec asks for (several specs: join them with commas).

    Raises ValueError with one line naming the bad part and the known names."""
    if not spec:
        return PLAIN
    out: dict[str, Any] = {}
    names: list[str] = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, sep, value = part.partition("=")
        if name in GROUPS and not sep:
            for member in GROUPS[name]:
                field_name, default, _ = _SINGLE[member]
                out[field_name] = default
            names.append(name)
            continue
        if name not in _SINGLE:
            raise ValueError(f"--sim-flavour {part!r}: unknown flavour; known: {', '.join(NAMES)}")
        field_name, default, bounds = _SINGLE[name]
        if sep:
            if bounds is None:
                raise ValueError(f"--sim-flavour {part!r}: {name} takes no value (write just {name!r})")
            try:
                number = float(value)
            except ValueError:
                raise ValueError(f"--sim-flavour {part!r}: {value!r} is not a number") from None
            lo, hi = bounds
            if not lo <= number <= hi:
                raise ValueError(f"--sim-flavour {part!r}: {name} must be in [{lo:g}, {hi:g}]")
            default = number
        out[field_name] = default
        names.append(part)
    return replace(PLAIN, names=tuple(names), **out)

