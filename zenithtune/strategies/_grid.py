"""Exhaustive search: every valid candidate once. The ground truth of the benchmark."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from zenithtune.strategies._base import Proposal, Strategy


class GridStrategy(Strategy):
    exhaustive = True  # every valid candidate, however many in a row cannot be launched

    def __init__(self, order: Literal["memory", "space"] = "memory"):
        if order not in ("memory", "space"):
            raise ValueError(f"grid order={order!r} is not one of memory|space")
        self.order = order
        self._queue: list[dict] | None = None

    def _build(self) -> list[dict]:
        cands = list(self.space.walk())
        if self.order == "memory":
            cands.sort(key=lambda c: self.judge.assess(c).predicted_gb or 0.0)
        return cands

    def ask(self, pending: Sequence[dict] = ()) -> Proposal | None:
        if self._queue is None:
            self._queue = self._build()
        while self._queue:
            cand = self._queue.pop(0)
            if not self.tried(cand, pending):
                return Proposal(cand, why="grid")
        self.stop_reason = "every valid candidate was proposed"
        return None
