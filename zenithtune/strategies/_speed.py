"""Speed that learns: the throughput prior's components, corrected from what a study measured.

The prior (`_throughput`) adds up seconds per component of an iteration: GEMMs, the attention core,
TP collectives, the CP ring, the MoE token dispatcher (EP all-to-alls, ETP gathers), the DP sync and
the pipeline (bubble, point-to-point). A real trainer differs per component: a slower network makes
the all-to-all dearer, another pipeline schedule changes the bubble, other kernels the GEMMs. One
scale on the whole prior cannot express that "EP costs 30 % more here" and so cannot re-order the
EP-heavy candidates against the others; a multiplier per component can.

Model, for measured candidate i with measured rate y_i (log, in any unit proportional to TFLOP/s:
TFLOP/s, samples/s, 1/(s/it) differ by a constant, since the model FLOPs per iteration are fixed):

    log y_i = level + log prior_i(m_gemm, m_attention, m_tp, m_cp, m_ep, m_dp, m_pp) + noise

with log m_k ~ N(0, COMPONENT_SD[k]²) (ridge to the prior's 1.0) and level ~ N(0, LEVEL_SD²) for
TFLOP/s (the prior already includes a typical efficiency), flat otherwise (the unit is unknown). The
posterior mode comes from a few Gauss-Newton steps on the log-multipliers, the model linearised by
finite differences: d log prior_i / d log m_k is about the share of component k in candidate i's
iteration. A component no measured candidate exercises (CP when every run had cp=1) has no gradient
and keeps its prior 1.0; one that all measured candidates share in equal parts (GEMMs) is mostly
absorbed by the level, which the heuristic's residual (`_calibration`) learns again anyway.

What the fit leaves uncertain is kept: the posterior covariance of (level, log-multipliers), through
each candidate's sensitivity to them, gives `sd`, the log-scale doubt about the corrected prior, which
the heuristic adds to its residual's. Without it, the corrected prior explains the runs so well that
the residual turns confident and the study stops before testing candidates whose components no run
has pinned down (measured on benchmarks/robustness.py: fewer launches, but a worse worst case).

NOISE_SD is not the measurement noise (about 1 %) but what the prior's structure gets wrong beyond
its components' scale (a crude efficiency curve, overlap rules): small enough that a few runs move a
multiplier, large enough that a multiplier does not chase the prior's every detail.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from zenithtune.modelinfo import ModelInfo
from zenithtune.strategies._throughput import COMPONENTS, assemble, pieces, tflops_of

# prior sd of each component's log-multiplier: the perturbed trainers of benchmarks/robustness.py draw
# each factor uniform in +-30 % (sd 0.17); GEMMs and attention are what the prior knows best
COMPONENT_SD = {"gemm": 0.1, "attention": 0.15, "tp": 0.25, "cp": 0.25, "ep": 0.25, "dp": 0.3, "pp": 0.25}
LEVEL_SD = 0.3  # as _calibration.LEVEL_SD
NOISE_SD = 0.05
STEPS = 6
_H = 1e-4  # finite-difference step on a log-multiplier
SHOWN = 0.1  # a learned multiplier this far from 1 (log) is named in the why-lines
_NAMES = {"gemm": "gemm", "attention": "attention", "tp": "tp comm", "cp": "cp comm", "ep": "ep comm",
          "dp": "dp comm", "pp": "pp bubble/p2p"}


class SpeedModel:
    """The throughput prior of a fixed pool of candidates, with per-component multipliers fitted to
    measured rates. `prior` is the pool's current (corrected) prior in TFLOP/s; `mult` the multipliers."""

    def __init__(self, cands: Sequence[Mapping[str, Any]], *, model: ModelInfo, n_gpus: int, gbs: int,
                 gpus_per_node: int = 8):
        rows = [pieces(c, model=model, n_gpus=n_gpus, gbs=gbs, gpus_per_node=gpus_per_node) for c in cands]
        keys = list(rows[0]) if rows else []
        self._tab = {k: np.array([r[k] for r in rows], dtype=float) for k in keys}
        self._model, self._n_gpus, self._gbs = model, n_gpus, gbs
        self._sd = np.array([COMPONENT_SD[k] for k in COMPONENTS])
        self.mult = {k: 1.0 for k in COMPONENTS}
        self._exercised: set[str] = set()
        self._fitted: tuple | None = None
        self.sd = np.zeros(len(rows))  # log-scale sd of `prior` left by the fit (SHARE_SD)
        # bit for bit predict_tflops while every multiplier is 1.0
        self.prior = self._tflops(self._tab, self.mult) if rows else np.zeros(0)

    def _tflops(self, tab: Mapping[str, np.ndarray], mult: Mapping[str, float]) -> np.ndarray:
        return np.asarray(tflops_of(assemble(tab, mult), model=self._model, n_gpus=self._n_gpus, gbs=self._gbs),
                          dtype=float)

    def _log_prior(self, tab: Mapping[str, np.ndarray], theta: np.ndarray) -> np.ndarray:
        return np.log(self._tflops(tab, dict(zip(COMPONENTS, np.exp(theta).tolist(), strict=True))))

    def fit(self, measured: Sequence[int], log_rates: Sequence[float], *, level_sd: float | None = LEVEL_SD) -> None:
        """Fit the multipliers to log measured rates of pool candidates `measured` and recompute `prior`.
        level_sd: prior sd of log(measured / prior) common to all (None: flat, for a metric in
        another unit than TFLOP/s)."""
        key = (tuple(measured), tuple(log_rates), level_sd)
        if not len(measured) or key == self._fitted:  # a wave of parallel asks: same runs, same fit
            return
        self._fitted = key
        idx = np.asarray(measured, dtype=int)
        tab = {k: v[idx] for k, v in self._tab.items()}
        prec = np.concatenate([[0.0 if level_sd is None else 1.0 / level_sd ** 2], 1.0 / self._sd ** 2])
        theta, A, exercised = self._posterior_mode(tab, np.asarray(log_rates, dtype=float), prec)
        self.mult = dict(zip(COMPONENTS, np.exp(theta).tolist(), strict=True))
        self._exercised = {k for k, e in zip(COMPONENTS, exercised, strict=True) if e}
        self.prior = self._tflops(self._tab, self.mult)
        self.sd = self._prior_sd(theta, A)

    def _jacobian(self, tab: Mapping[str, np.ndarray], theta: np.ndarray, at: np.ndarray) -> np.ndarray:
        """d (level + log prior) / d (level, log-multipliers), by finite differences from `at`."""
        K = len(COMPONENTS)
        J = np.ones((len(at), K + 1))
        for k in range(K):
            step = theta.copy()
            step[k] += _H
            J[:, k + 1] = (self._log_prior(tab, step) - at) / _H
        return J

    def _posterior_mode(self, tab: Mapping[str, np.ndarray], y: np.ndarray,
                        prec: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Gauss-Newton on (level, log-multipliers) for the measured rows `tab`: the log-multipliers at
        the mode, the last normal matrix (the posterior precision) and which components any row exercises."""
        K = len(COMPONENTS)
        theta = np.zeros(K)
        base = self._log_prior(tab, theta)
        level = float(np.mean(y - base))

        def objective(lv: float, th: np.ndarray, g: np.ndarray) -> float:
            r = y - lv - g
            return float(r @ r) / NOISE_SD ** 2 + float(prec @ (np.concatenate([[lv], th]) ** 2))

        g = base
        exercised = np.zeros(K, dtype=bool)
        for _ in range(STEPS):
            J = self._jacobian(tab, theta, g)
            exercised |= np.abs(J[:, 1:]).max(axis=0) > 1e-6
            cur = np.concatenate([[level], theta])
            A = J.T @ J / NOISE_SD ** 2 + np.diag(prec)
            rhs = J.T @ (y - level - g) / NOISE_SD ** 2 - prec * cur
            delta = np.linalg.solve(A + 1e-12 * np.eye(K + 1), rhs)
            # the model has kinks (overlap: max(exposed, hidden)): halve a step that does not improve
            before = objective(level, theta, g)
            for _ in range(6):
                new = cur + delta
                g_new = self._log_prior(tab, new[1:])
                if objective(new[0], new[1:], g_new) <= before + 1e-12:
                    break
                delta = delta / 2
            else:
                break
            level, theta, g = float(new[0]), new[1:], g_new
            if float(np.abs(delta).max()) < 1e-4:
                break
        return theta, A, exercised

    def _prior_sd(self, theta: np.ndarray, A: np.ndarray) -> np.ndarray:
        """How unsure the fit leaves each candidate's prior (log): the multipliers' posterior covariance
        (Laplace, at the mode; with the level, which trades against the GEMMs) through each candidate's
        sensitivity to them, so a candidate whose components no run pinned down keeps its doubt. Of
        level + log prior: what all candidates share (GEMMs against the level) cancels out."""
        K = len(COMPONENTS)
        cov = np.linalg.inv(A + 1e-12 * np.eye(K + 1))
        Jp = self._jacobian(self._tab, theta, np.log(self.prior))
        return np.sqrt(np.maximum(np.einsum("ik,kl,il->i", Jp, cov, Jp), 0.0))

    def learned(self) -> str:
        """The multipliers that moved noticeably, largest first: 'ep comm x1.31, pp bubble/p2p x0.80'."""
        moved = sorted(((abs(math.log(v)), k) for k, v in self.mult.items()
                        if k in self._exercised and abs(math.log(v)) >= SHOWN), reverse=True)
        return ", ".join(f"{_NAMES[k]} x{self.mult[k]:.2f}" for _, k in moved[:3])
