"""Search strategies behind one interface (see `_base.Strategy`).

heuristic (the default), staged_blackbox, and the baselines grid, random, tpe and upstream; each is
selected with `strategy=<name>` (conf/strategy/<name>.yaml)."""
from __future__ import annotations

from zenithtune.strategies._base import Outcome, Proposal, Strategy
from zenithtune.strategies._baselines import TPEStrategy, UpstreamStrategy
from zenithtune.strategies._grid import GridStrategy
from zenithtune.strategies._heuristic import HeuristicStrategy
from zenithtune.strategies._random import RandomStrategy
from zenithtune.strategies._staged import StagedBlackboxStrategy

__all__ = ["GridStrategy", "HeuristicStrategy", "Outcome", "Proposal", "RandomStrategy", "StagedBlackboxStrategy",
           "Strategy", "TPEStrategy", "UpstreamStrategy"]
