"""How wrong is the prior here? A small Gaussian process on log(measured / prior).

The throughput prior (`_throughput`) gets the shape of the problem right and the details wrong in
ways that differ per job: its absolute level, how much EP or CP really costs on this cluster, how
much a larger micro-batch really helps. The residual r(c) = log(measured / prior) is modelled as

    r(c) = b + Σ_f w_f·φ_f(c) + u_layout(c) + noise

with an unknown level b, a small linear effect per feature (log2 of each parallel size and of the
micro-batch, one-hots for the recompute mode and ViT checkpointing, flags for groups that leave a
node) and a small per-layout offset. That is a Gaussian process with an additive kernel; with the
handful of trials a study has, the exact posterior costs a few milliseconds. What one measurement
teaches spreads to every candidate sharing its features, strongest to those sharing its layout; a
candidate far from everything measured keeps a wide uncertainty.

How much to trust the prior's fine structure is itself learned (empirical Bayes): the feature and
layout scales are multiplied by the factor in TRUST_SCALES that best explains the measurements
(largest marginal likelihood). Measurements that agree with the prior keep the uncertainty tight
and the study short; measurements far off the prior (a cluster unlike the model) widen it, so the
heuristic explores instead of trusting a prior that has just been shown wrong.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from zenithtune.space import LAYOUT_PARAMS
from zenithtune.validate import candidate_modules

LEVEL_SD = 0.3  # the prior's absolute level (log scale): it already includes a typical efficiency
SIZE_SD = 0.05  # per doubling of a parallel size or the micro-batch
MODE_SD = 0.04  # per recompute mode / ViT checkpointing value / crossing flag
LAYOUT_SD = 0.03  # per layout
NOISE_SD = 0.01  # measurement noise and what the features cannot explain
TRUST_SCALES = (1.0, 2.0, 4.0)  # candidate multipliers of the feature/layout scales (empirical Bayes)
# recompute modes; selective recompute of the dense MLP or the MoE part re-runs GEMMs (a mode of its own)
_MODES = ("none", "selective", "selective/mlp", "selective/moe", "full/uniform", "full/block")


def features(c: dict[str, Any], *, gpus_per_node: int, n_gpus: int, num_layers: int) -> list[float]:
    tp, pp, cp = int(c.get("tp", 1)), int(c.get("pp", 1)), int(c.get("cp", 1))
    ep, etp = int(c.get("ep", 1) or 1), int(c.get("etp") or tp)
    mode = str(c.get("recompute_granularity") or "none")
    if mode == "full":
        mode = f"full/{c.get('recompute_method')}"
    elif mode == "selective":
        mods = candidate_modules(c)
        mode = "selective/moe" if "moe" in mods else "selective/mlp" if "mlp" in mods else mode
    per_stage = max(1, num_layers // pp)
    block = (int(c.get("recompute_num_layers") or 0) / per_stage) if mode == "full/block" else 0.0
    vit = c.get("vit_gradient_checkpointing")
    vp = int(c.get("vp") or 1)
    return [math.log2(tp), math.log2(pp), math.log2(cp), math.log2(ep), math.log2(etp), math.log2(c.get("mbs", 1)),
            math.log2(vp),
            *(float(mode == m) for m in _MODES), block,
            float(vit is True), float(vit is False),
            # the overlap switches: what the prior believes they hide may be off for this trainer
            float(c.get("tp_comm_overlap") is True), float(c.get("moe_a2a_overlap") is True),
            float(tp * cp > gpus_per_node), float(ep * etp > gpus_per_node), float(n_gpus // pp >= gpus_per_node)]


_SD = np.array([SIZE_SD] * 7 + [MODE_SD] * len(_MODES) + [2 * SIZE_SD] + [MODE_SD] * 2 + [MODE_SD] * 2
               + [MODE_SD] * 3)


class Residual:
    """Posterior of r(c) given measured (candidate, log ratio) pairs."""

    def __init__(self, cands: Sequence[dict], *, gpus_per_node: int, n_gpus: int, num_layers: int):
        self._phi = np.array([features(c, gpus_per_node=gpus_per_node, n_gpus=n_gpus, num_layers=num_layers)
                              for c in cands], dtype=float).reshape(len(cands), len(_SD))
        # the per-layout term is over the parallel sizes only: the virtual pipeline sizes of one layout share
        # it (the prior models what vp changes, the bubble and the p2p sends; log2(vp) is a feature), so a
        # measurement at vp=1 tells about vp=5 of the same layout (benchmarks/search.py: fewer launches)
        layouts: dict[tuple, int] = {}
        self._lay = np.array([layouts.setdefault(tuple(c.get(k) for k in LAYOUT_PARAMS), len(layouts))
                              for c in cands], dtype=int)
        self._w = _SD ** 2

    def _k(self, i: np.ndarray, j: np.ndarray, scale: float) -> np.ndarray:
        """Kernel between candidates (indices) i and j, feature/layout variances times scale**2."""
        lin = (self._phi[i] * self._w) @ self._phi[j].T
        same = (self._lay[i][:, None] == self._lay[j][None, :]).astype(float)
        return LEVEL_SD ** 2 + scale ** 2 * (lin + LAYOUT_SD ** 2 * same)

    def _fit(self, m: np.ndarray, y: np.ndarray, noise: float) -> tuple[float, np.ndarray, np.ndarray]:
        """(scale, Cholesky factor, alpha) for the scale with the largest marginal likelihood."""
        best = None
        for scale in TRUST_SCALES:
            K = self._k(m, m, scale) + noise ** 2 * np.eye(len(m))
            L = np.linalg.cholesky(K)
            alpha = np.linalg.solve(L.T, np.linalg.solve(L, y))
            loglik = -0.5 * float(y @ alpha) - float(np.log(np.diag(L)).sum())
            if best is None or loglik > best[0] + 1e-9:
                best = (loglik, scale, L, alpha)
        assert best is not None
        return best[1], best[2], best[3]

    def predict(self, measured: Sequence[int], values: Sequence[float], at: np.ndarray, *,
                noise: float | None = None) -> tuple[np.ndarray, np.ndarray, float]:
        """(mean, sd, trust scale) of r at candidate indices `at`, given r(measured[i]) = values[i];
        `noise`: the run-to-run noise (relative sd) when it is larger than NOISE_SD."""
        if not len(measured):
            diag = LEVEL_SD ** 2 + (self._phi[at] ** 2 * self._w).sum(axis=1) + LAYOUT_SD ** 2
            return np.zeros(len(at)), np.sqrt(diag), 1.0
        m = np.asarray(measured, dtype=int)
        y = np.asarray(values, dtype=float)
        scale, L, alpha = self._fit(m, y, max(NOISE_SD, noise or 0.0))
        diag = LEVEL_SD ** 2 + scale ** 2 * ((self._phi[at] ** 2 * self._w).sum(axis=1) + LAYOUT_SD ** 2)
        Ks = self._k(at, m, scale)
        v = np.linalg.solve(L, Ks.T)
        mean = Ks @ alpha
        var = np.maximum(diag - (v ** 2).sum(axis=0), 1e-12)
        return mean, np.sqrt(var), scale
