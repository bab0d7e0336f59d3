"""How wrong is the prior here? A small Gaussian process on log(measured / prior).

The throughput prior (`_throughput`) gets the shape of the problem right and the details wrong in
ways that differ per job: its absolute level, how much EP or CP really costs on this cluster, how
much a larger micro-batch really helps. The residual r(c) = log(measured / prior) is modelled as

    r(c) = b + Σ_f w_f·φ_f(c) + u_layout(c) + noise

with an unknown level b (broad prior), a small linear effect per feature (log2 of each parallel
size and of the micro-batch, one-hots for the recompute mode and ViT checkpointing, flags for
groups that leave a node) and a small per-layout offset. That is a Gaussian process with an additive
kernel; with the handful of trials a study has, the exact posterior costs a few milliseconds.
What one measurement teaches spreads to every candidate sharing its features, strongest to those
sharing its layout; a candidate far from everything measured keeps a wide uncertainty.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from zenithtune.space import LAYOUT_PARAMS

LEVEL_SD = 1.0  # the prior's absolute level is unknown (log scale)
SIZE_SD = 0.05  # per doubling of a parallel size or the micro-batch
MODE_SD = 0.04  # per recompute mode / ViT checkpointing value / crossing flag
LAYOUT_SD = 0.03  # per layout
NOISE_SD = 0.01  # measurement noise and what the features cannot explain
_MODES = ("none", "selective", "full/uniform", "full/block")


def features(c: dict[str, Any], *, gpus_per_node: int, n_gpus: int, num_layers: int) -> list[float]:
    tp, pp, cp = int(c.get("tp", 1)), int(c.get("pp", 1)), int(c.get("cp", 1))
    ep, etp = int(c.get("ep", 1) or 1), int(c.get("etp") or tp)
    mode = str(c.get("recompute_granularity") or "none")
    if mode == "full":
        mode = f"full/{c.get('recompute_method')}"
    per_stage = max(1, num_layers // pp)
    block = (int(c.get("recompute_num_layers") or 0) / per_stage) if mode == "full/block" else 0.0
    vit = c.get("vit_gradient_checkpointing")
    return [math.log2(tp), math.log2(pp), math.log2(cp), math.log2(ep), math.log2(etp), math.log2(c.get("mbs", 1)),
            *(float(mode == m) for m in _MODES), block,
            float(vit is True), float(vit is False),
            float(tp * cp > gpus_per_node), float(ep * etp > gpus_per_node), float(n_gpus // pp >= gpus_per_node)]


_SD = np.array([SIZE_SD] * 6 + [MODE_SD] * len(_MODES) + [2 * SIZE_SD] + [MODE_SD] * 2 + [MODE_SD] * 3)


class Residual:
    """Posterior of r(c) given measured (candidate, log ratio) pairs."""

    def __init__(self, cands: Sequence[dict], *, gpus_per_node: int, n_gpus: int, num_layers: int):
        self._phi = np.array([features(c, gpus_per_node=gpus_per_node, n_gpus=n_gpus, num_layers=num_layers)
                              for c in cands], dtype=float).reshape(len(cands), len(_SD))
        layouts: dict[tuple, int] = {}
        self._lay = np.array([layouts.setdefault(tuple(c.get(k) for k in LAYOUT_PARAMS), len(layouts))
                              for c in cands], dtype=int)
        self._w = _SD ** 2

    def _k(self, i: np.ndarray, j: np.ndarray) -> np.ndarray:
        """Kernel between candidates (indices) i and j."""
        lin = (self._phi[i] * self._w) @ self._phi[j].T
        same = (self._lay[i][:, None] == self._lay[j][None, :]).astype(float)
        return LEVEL_SD ** 2 + lin + LAYOUT_SD ** 2 * same

    def predict(self, measured: Sequence[int], values: Sequence[float],
                at: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(mean, sd) of r at candidate indices `at`, given r(measured[i]) = values[i]."""
        diag = LEVEL_SD ** 2 + (self._phi[at] ** 2 * self._w).sum(axis=1) + LAYOUT_SD ** 2
        if not len(measured):
            return np.zeros(len(at)), np.sqrt(diag)
        m = np.asarray(measured, dtype=int)
        y = np.asarray(values, dtype=float)
        K = self._k(m, m) + NOISE_SD ** 2 * np.eye(len(m))
        L = np.linalg.cholesky(K)
        alpha = np.linalg.solve(L.T, np.linalg.solve(L, y))
        Ks = self._k(at, m)
        v = np.linalg.solve(L, Ks.T)
        mean = Ks @ alpha
        var = np.maximum(diag - (v ** 2).sum(axis=0), 1e-12)
        return mean, np.sqrt(var)
