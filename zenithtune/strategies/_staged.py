"""Staged black-box search: Optuna's TPE on the parallel layout, then on the settings of the best layouts.

Stage 1 ("layout") gives TP/PP/CP/EP/ETP to the study's TPE sampler; the strategy completes each
sampled layout with memory-safe settings: MBS 1, ViT checkpointing on, and the cheapest recompute the
memory model says fits with room to spare (none, selective, full/block with the fewest layers, else
full/uniform), so a layout is judged by what it can do, not lost to an OOM nor handicapped by
recompute it does not need. Only the layout is an Optuna parameter of these trials, so stage 1 does
not bias TPE's view of MBS or recompute. It lasts `stage1_trials` launches, or less when every valid
layout has run.
Stage 2 ("settings") fixes the best layouts of stage 1 and lets TPE pick MBS, recompute granularity,
method and layer count (and ViT checkpointing for a VLM); the layout holding the best result gets
most proposals, the runners-up every third. Both stages ask the same study, so TPE in stage 2 learns
from every trial of stage 1.
"""
from __future__ import annotations

import random
from typing import TYPE_CHECKING

from zenithtune.space import LAYOUT_PARAMS
from zenithtune.strategies._base import Outcome, Proposal, Strategy, tpe_sampler

if TYPE_CHECKING:
    import optuna

LAYOUT_STAGE = "layout"
SETTINGS_STAGE = "settings"
SAFE_SHARE = 0.9  # stage 1's settings must be predicted to use at most this share of GPU memory
# Recompute from cheapest to most memory-saving; stage 1 takes the first that fits.
RECOMPUTE_LADDER = ([{"recompute_granularity": "none"}, {"recompute_granularity": "selective"}]
                    + [{"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": n}
                       for n in range(1, 9)]
                    + [{"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}])


class StagedBlackboxStrategy(Strategy):
    def __init__(self, stage1_trials: int = 30, top_layouts: int = 2, seed: int = 0, n_startup_trials: int = 10,
                 patience: int = 5):
        if int(stage1_trials) < 1:
            raise ValueError(f"stage1_trials={stage1_trials} must be >= 1 (launches spent on the layout)")
        if int(top_layouts) < 1:
            raise ValueError(f"top_layouts={top_layouts} must be >= 1 (layouts tuned in stage 2)")
        self.stage1_trials = int(stage1_trials)
        self.top_layouts = int(top_layouts)
        self.seed = seed
        self.n_startup_trials = n_startup_trials
        # proposals in a row that could not be launched (TPE repeating itself) before one untried
        # candidate is drawn at random instead
        self.patience = int(patience)
        self._rng = random.Random(seed)
        self._stage1_done = False
        self._stage2_asked = 0

    def sampler(self) -> optuna.samplers.BaseSampler:
        return tpe_sampler(self.seed, self.n_startup_trials)

    def setup(self, space, memory, history) -> None:
        self._by_layout: dict[tuple, dict[tuple, dict]] = {}  # layout -> {key: candidate} of the valid ones
        for cand in space.walk():
            self._by_layout.setdefault(_layout(space, cand), {})[space.key(cand)] = cand
        self._seen: dict[tuple, set[tuple]] = {}  # layout -> keys measured or screened
        self._best: dict[tuple, float] = {}  # layout -> best value measured
        self._stage1_layouts: set[tuple] = set()
        self._stage1_launched = 0
        self._streak = 0  # proposals in a row (this stage) that could not be launched
        super().setup(space, memory, [])
        for o in history:
            self.tell(o)

    def tell(self, outcome: Outcome) -> None:
        super().tell(outcome)
        lay = _layout(self.space, outcome.candidate)
        self._seen.setdefault(lay, set()).add(self.space.key(outcome.candidate))
        if outcome.ok and (lay not in self._best or self.better(outcome.value, self._best[lay])):  # type: ignore[arg-type]
            self._best[lay] = float(outcome.value)  # type: ignore[arg-type]
        if outcome.stage == LAYOUT_STAGE:
            self._stage1_layouts.add(lay)
            self._stage1_launched += outcome.launched
        self._streak = 0 if outcome.launched else self._streak + 1

    def _untried(self, lay: tuple) -> list[dict]:
        """This layout's valid candidates that were neither measured nor screened, in a stable order."""
        seen = self._seen.get(lay, set())
        return [c for k, c in self._by_layout.get(lay, {}).items() if k not in seen]

    # --- stage 1 -----------------------------------------------------------------------------------
    def _stage1_over(self) -> bool:
        return self._stage1_launched >= self.stage1_trials or not self._untried_layouts()

    def _safe_settings(self, layout: dict) -> dict:
        """MBS 1, ViT checkpointing, and the cheapest recompute predicted to fit with room to spare."""
        base = {**layout, "mbs": 1}
        if "vit_gradient_checkpointing" in self.space.params:
            base["vit_gradient_checkpointing"] = True
        cap = self.space.ctx.gpu_memory_gb
        for rec in RECOMPUTE_LADDER:
            cand = self.space.normalize({**base, **rec})
            if self.space.reasons(cand):
                continue
            gb = self.predict_gb(cand)
            if gb is None or gb <= SAFE_SHARE * cap:
                return cand
        return {**base, **RECOMPUTE_LADDER[-1]}

    def _untried_layouts(self) -> list[tuple]:
        return [lay for lay in self._by_layout if lay not in self._stage1_layouts]

    # --- both --------------------------------------------------------------------------------------
    def ask(self) -> Proposal | None:
        if not self._stage1_done:
            if not self._stage1_over():
                if self._streak >= self.patience:
                    lay = self._rng.choice(self._untried_layouts())
                    return Proposal(dict(lay), why="stage 1: TPE repeated itself; an untried layout at random, "
                                    "at memory-safe settings", stage=LAYOUT_STAGE, sample=LAYOUT_PARAMS,
                                    complete=self._safe_settings)
                return Proposal({}, why="stage 1: TPE picks the layout, at memory-safe settings",
                                stage=LAYOUT_STAGE, sample=LAYOUT_PARAMS, complete=self._safe_settings)
            self._stage1_done = True
            self._streak = 0
        ranked = sorted(((lay, v) for lay, v in self._best.items() if self._untried(lay)),
                        key=lambda kv: kv[1], reverse=self.direction == "maximize")
        if not ranked:
            return None
        top = ranked[: self.top_layouts]
        self._stage2_asked += 1
        i = 0 if len(top) == 1 or self._stage2_asked % 3 else 1 + (self._stage2_asked // 3) % (len(top) - 1)
        lay, value = top[i]
        desc = " ".join(f"{k}={v}" for k, v in lay)
        if self._streak >= self.patience:
            cand = self._rng.choice(self._untried(lay))
            return Proposal(dict(cand), why=f"stage 2: TPE repeated itself; an untried setting of layout #{i + 1} "
                            f"{desc} at random", stage=SETTINGS_STAGE)
        return Proposal(dict(lay), why=f"stage 2: TPE tunes mbs/recompute on layout #{i + 1} {desc} "
                        f"(best so far {value:.1f})", stage=SETTINGS_STAGE)


def _layout(space, cand: dict) -> tuple:
    n = space.normalize(cand)
    return tuple((k, n[k]) for k in LAYOUT_PARAMS if k in n)
