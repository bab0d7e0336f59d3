"""A simulated trainer that disagrees with the tuner: seeded per-component errors of memory and speed.

The simulator's physics and the tuner's models (zenithtune/memory.py, the heuristic's throughput
prior) were written from the same notes, so on the plain simulator they agree more than a real user's
Megatron build would (other kernels, allocator fragmentation, FP8, Transformer Engine versions, a
slower network). A `Perturbation` multiplies each component of the simulator's truth by its own
factor, drawn independently of anything the tuner knows:

    --sim-perturb-seed 7 --sim-perturb-scale 0.3     # every factor uniform in [0.7, 1.3], seeded
    --sim-perturb ep_comm=1.3,activations=1.2        # explicit factors (override drawn ones)

Memory components scale bytes: `weights` (bf16 weights and fp32 grads), `optimizer` (master weights
and Adam moments), `activations` (saved activations of dense layers, attention and layer inputs),
`expert_activations` (the routed tokens' copies and expert FFN intermediates of MoE layers),
`logits` (the output layer's logits and loss). Speed components scale seconds: `tp_comm`, `cp_comm`,
`ep_comm`, `dp_comm`, `pp_comm` (point-to-point sends and the pipeline bubble), and `gemm` scales
GEMM efficiency (above 1: faster kernels).

In-process: `simulate(argv)` with the same options, or `dataclasses.replace(cfg, perturb=...)` on a
parsed `SimConfig` (benchmarks/robustness.py sweeps thousands of configurations that way).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, fields, replace

MEMORY = ("weights", "optimizer", "activations", "expert_activations", "logits")
SPEED = ("gemm", "tp_comm", "cp_comm", "ep_comm", "dp_comm", "pp_comm")
COMPONENTS = MEMORY + SPEED


@dataclass(frozen=True)
class Perturbation:
    """Multipliers on the simulator's components (1.0: the unperturbed simulator)."""

    weights: float = 1.0
    optimizer: float = 1.0
    activations: float = 1.0
    expert_activations: float = 1.0
    logits: float = 1.0
    gemm: float = 1.0  # on GEMM efficiency (> 1 faster); every other speed factor is on seconds
    tp_comm: float = 1.0
    cp_comm: float = 1.0
    ep_comm: float = 1.0
    dp_comm: float = 1.0
    pp_comm: float = 1.0

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if not 0.1 <= v <= 10.0:
                raise ValueError(f"--sim-perturb {f.name}={v}: a factor must be in [0.1, 10] (1.0 = unperturbed)")

    @property
    def active(self) -> bool:
        return any(getattr(self, f.name) != 1.0 for f in fields(self))

    @classmethod
    def draw(cls, seed: int, scale: float = 0.3) -> Perturbation:
        """Every factor independently uniform in [1 - scale, 1 + scale], from `seed` alone."""
        if not 0 <= scale < 0.9:
            raise ValueError(f"--sim-perturb-scale {scale} must be in [0, 0.9) (0.3 = up to +-30 % per component)")
        rng = random.Random(f"zenithtune.sim.perturb/{seed}")
        return cls(**{name: round(rng.uniform(1 - scale, 1 + scale), 4) for name in COMPONENTS})

    def with_factors(self, spec: str) -> Perturbation:
        """Override factors from 'name=factor,name=factor'."""
        out: dict[str, float] = {}
        for part in filter(None, (p.strip() for p in spec.split(","))):
            name, sep, value = part.partition("=")
            if not sep or name not in COMPONENTS:
                raise ValueError(f"--sim-perturb {part!r}: expected name=factor with name in {', '.join(COMPONENTS)}")
            try:
                out[name] = float(value)
            except ValueError:
                raise ValueError(f"--sim-perturb {part!r}: {value!r} is not a number") from None
        return replace(self, **out)

    def describe(self) -> str:
        return ", ".join(f"{f.name} x{getattr(self, f.name):.2f}" for f in fields(self)
                         if getattr(self, f.name) != 1.0)


NONE = Perturbation()


def from_options(seed: int | None, scale: float, spec: str | None) -> Perturbation:
    """The perturbation the --sim-perturb* options ask for."""
    base = NONE if seed is None else Perturbation.draw(seed, scale)
    return base.with_factors(spec) if spec else base
