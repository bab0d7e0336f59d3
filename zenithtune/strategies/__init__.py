"""Search strategies behind one interface (see `_base.Strategy`)."""
from __future__ import annotations

from zenithtune.strategies._base import Outcome, Proposal, Strategy
from zenithtune.strategies._grid import GridStrategy
from zenithtune.strategies._random import RandomStrategy

__all__ = ["GridStrategy", "Outcome", "Proposal", "RandomStrategy", "Strategy"]
