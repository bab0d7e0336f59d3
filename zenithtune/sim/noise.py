"""Measurement noise of a simulated cluster: every run differs, some runs are much slower.

    --sim-noise-sigma 0.03 --sim-outlier-rate 0.1 --sim-noise-seed 7

Each run draws one factor exp(N(0, sigma)) on all its iteration times (a node's clocks, its neighbours'
traffic, the data loader's cache), and with probability `outlier_rate` it is an outlier whose every
iteration is 1.5x slower (a straggler node, a congested link, thermal throttling). On top, every
iteration varies by exp(N(0, sigma / 2)), so the per-iteration values a trial prints differ and a
median after warm-up has something to work on; the run-level factor is what no selector can remove.

Runs are told apart by the trial marker the tuner sets (ZENITHTUNE_TRIAL, zenithtune/processes.py):
the same configuration launched twice draws twice, as on a cluster; the same seed, configuration and
marker draw the same numbers. The noise-free value stays known to the simulator (`SimResult.true_tflops`),
so a benchmark can value what a study called best at what it is really worth.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

OUTLIER_SLOWDOWN = 1.5  # an outlier run's iterations take this much longer
RUN_ENV = "ZENITHTUNE_TRIAL"  # the marker that tells two runs of one configuration apart


@dataclass(frozen=True)
class Noise:
    """How noisy the simulated cluster is (the defaults: not at all)."""

    sigma: float = 0.0  # log-normal sigma of the run-level factor (0.03: about 3 %)
    outlier_rate: float = 0.0  # share of runs OUTLIER_SLOWDOWN x slower
    seed: int = 0  # --sim-noise-seed

    def __post_init__(self) -> None:
        if not 0.0 <= self.sigma <= 0.5:
            raise ValueError(f"--sim-noise-sigma {self.sigma}: must be in [0, 0.5] (0.03 = about 3 % per run)")
        if not 0.0 <= self.outlier_rate <= 1.0:
            raise ValueError(f"--sim-outlier-rate {self.outlier_rate}: must be in [0, 1] (0.1 = one run in ten)")

    @property
    def active(self) -> bool:
        return self.sigma > 0 or self.outlier_rate > 0

    def draw(self, config_key: str, run_key: str, iterations: int) -> RunNoise:
        """The factors of one run: seeded by the noise seed, the configuration and the run's marker."""
        if not self.active:
            return RunNoise(1.0, False, [1.0] * iterations)
        rng = random.Random(f"zenithtune.sim.noise/{self.seed}/{config_key}/{run_key}")
        factor = math.exp(rng.gauss(0.0, self.sigma))
        outlier = rng.random() < self.outlier_rate
        if outlier:
            factor *= OUTLIER_SLOWDOWN
        per_iteration = [math.exp(rng.gauss(0.0, self.sigma / 2)) for _ in range(iterations)]
        return RunNoise(factor, outlier, per_iteration)

    def describe(self) -> str:
        return f"sigma {self.sigma:g}, outlier rate {self.outlier_rate:g}, seed {self.seed}"


@dataclass(frozen=True)
class RunNoise:
    """What one run drew."""

    factor: float  # on every iteration's time (outlier slowdown included)
    outlier: bool
    per_iteration: list[float]  # on each iteration's time, on top of `factor`


QUIET = Noise()
