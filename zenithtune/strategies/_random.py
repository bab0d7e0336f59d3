"""Uniform random search over the valid space (a baseline)."""
from __future__ import annotations

import random
from collections.abc import Sequence

from zenithtune.strategies._base import Proposal, Strategy


class RandomStrategy(Strategy):
    def __init__(self, seed: int = 0):
        self.seed = seed
        self._queue: list[dict] | None = None

    def ask(self, pending: Sequence[dict] = ()) -> Proposal | None:
        if self._queue is None:
            self._queue = list(self.space.walk())
            random.Random(self.seed).shuffle(self._queue)
        while self._queue:
            cand = self._queue.pop()
            if not self.tried(cand, pending):
                return Proposal(cand, why="random")
        self.stop_reason = "every valid candidate was proposed"
        return None
