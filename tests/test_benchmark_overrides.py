"""benchmarks/search.py's --override reaches the studies it names and no other."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import search  # noqa: E402


def test_a_strategy_override_reaches_the_heuristic_and_spares_the_grid_sweep(monkeypatch):
    # `--override strategy.neighbours=0` used to reach the sweep's grid job too, which has no such setting:
    # Hydra refused it and the whole benchmark stopped before its first study
    monkeypatch.setattr(search, "EXTRA_OVERRIDES", ["strategy.neighbours=0", "memory_safety_margin=0.1"])
    sc = next(s for s in search.SCENARIOS if s.name == "llama3-8b-8xh100")
    grid = search.make_job(sc, "grid", None, 1)
    heuristic = search.make_job(sc, "heuristic", None, 50)
    assert heuristic.strategy.neighbours == 0
    assert type(grid.strategy).__name__ == "GridStrategy"
    assert grid.memory.margin == heuristic.memory.margin == 0.1  # other overrides reach every job
