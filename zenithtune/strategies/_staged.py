"""Staged black-box search: Optuna's TPE on the parallel layout, then on the settings of the best layouts.

Stage 1 ("layout") leaves TP/PP/CP/EP/ETP open to the study's TPE sampler and fixes everything else at
memory-safe settings (MBS 1, full recompute of every layer, ViT checkpointing on), so a layout is
judged by what it can do, not lost to an OOM. It lasts `stage1_trials` launches, or less when every
valid layout has run or TPE keeps proposing layouts that cannot run.
Stage 2 ("settings") fixes the best layouts of stage 1 and lets TPE pick MBS, recompute granularity,
method and layer count (and ViT checkpointing for a VLM); the layout holding the best result gets
most proposals, the runners-up every third. Both stages ask the same study, so TPE in stage 2 learns
from every trial of stage 1.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from zenithtune.space import LAYOUT_PARAMS
from zenithtune.strategies._base import Outcome, Proposal, Strategy

if TYPE_CHECKING:
    import optuna

LAYOUT_STAGE = "layout"
SETTINGS_STAGE = "settings"
# The memory-safe settings stage 1 measures every layout at.
SAFE_SETTINGS = {"mbs": 1, "recompute_granularity": "full", "recompute_method": "uniform",
                 "recompute_num_layers": 1, "vit_gradient_checkpointing": True}


class StagedBlackboxStrategy(Strategy):
    def __init__(self, stage1_trials: int = 30, top_layouts: int = 2, seed: int = 0, n_startup_trials: int = 10,
                 patience: int = 60):
        if int(stage1_trials) < 1:
            raise ValueError(f"stage1_trials={stage1_trials} must be >= 1 (launches spent on the layout)")
        if int(top_layouts) < 1:
            raise ValueError(f"top_layouts={top_layouts} must be >= 1 (layouts tuned in stage 2)")
        self.stage1_trials = int(stage1_trials)
        self.top_layouts = int(top_layouts)
        self.seed = seed
        self.n_startup_trials = n_startup_trials
        self.patience = patience  # proposals in a row that could not be launched before a stage gives up
        self._stage1_done = False
        self._stage2_asked = 0

    def sampler(self) -> optuna.samplers.BaseSampler:
        import optuna

        return optuna.samplers.TPESampler(seed=self.seed, n_startup_trials=self.n_startup_trials,
                                          multivariate=True, group=True)

    def setup(self, space, memory, history) -> None:
        super().setup(space, memory, history)
        self._by_layout: dict[tuple, set[tuple]] = {}  # layout -> keys of its valid candidates
        for cand in space.walk():
            self._by_layout.setdefault(self._layout(cand), set()).add(space.key(cand))
        self._safe = {k: v for k, v in SAFE_SETTINGS.items() if k in space.params}

    def _layout(self, cand: dict) -> tuple:
        n = self.space.normalize(cand)
        return tuple((k, n[k]) for k in LAYOUT_PARAMS if k in n)

    # --- stage 1 -----------------------------------------------------------------------------------
    def _stage1_over(self) -> str | None:
        mine = [o for o in self.history if o.stage == LAYOUT_STAGE]
        launched = sum(o.launched for o in mine)
        if launched >= self.stage1_trials:
            return f"{launched} layouts launched (stage1_trials={self.stage1_trials})"
        tried = {self._layout(o.candidate) for o in mine}
        if len(tried) >= len(self._by_layout):
            return f"all {len(self._by_layout)} valid layouts tried"
        if _stalled(mine, self.patience):
            return f"TPE proposed {self.patience} layouts in a row that could not be launched"
        return None

    # --- stage 2 -----------------------------------------------------------------------------------
    def _ranked_layouts(self) -> list[tuple[tuple, float]]:
        best: dict[tuple, float] = {}
        for o in self.history:
            if o.ok:
                lay = self._layout(o.candidate)
                if lay not in best or self.better(o.value, best[lay]):  # type: ignore[arg-type]
                    best[lay] = float(o.value)  # type: ignore[arg-type]
        return sorted(best.items(), key=lambda kv: kv[1], reverse=self.direction == "maximize")

    def _open(self, lay: tuple) -> bool:
        """Does this layout still have valid candidates that were neither measured nor screened?"""
        seen = {self.space.key(o.candidate) for o in self.history if self._layout(o.candidate) == lay}
        return bool(self._by_layout.get(lay, set()) - seen)

    def ask(self) -> Proposal | None:
        if not self._stage1_done:
            if self._stage1_over() is None:
                return Proposal(dict(self._safe), why="stage 1: TPE picks the layout at memory-safe settings "
                                "(mbs 1, full recompute)", stage=LAYOUT_STAGE)
            self._stage1_done = True
        mine = [o for o in self.history if o.stage == SETTINGS_STAGE]
        ranked = [(lay, v) for lay, v in self._ranked_layouts() if self._open(lay)]
        if not ranked or _stalled(mine, self.patience):
            return None
        top = ranked[: self.top_layouts]
        self._stage2_asked += 1
        i = 0 if len(top) == 1 or self._stage2_asked % 3 else 1 + (self._stage2_asked // 3) % (len(top) - 1)
        lay, value = top[i]
        fixed = dict(lay)
        desc = " ".join(f"{k}={v}" for k, v in lay)
        return Proposal(fixed, why=f"stage 2: TPE tunes mbs/recompute on layout #{i + 1} {desc} "
                        f"(best so far {value:.1f})", stage=SETTINGS_STAGE)


def _stalled(outcomes: list[Outcome], patience: int) -> bool:
    """The last `patience` outcomes were all screened (nothing launched)."""
    tail = outcomes[-patience:]
    return len(tail) >= patience and not any(o.launched for o in tail)
