"""Staged black-box search: Optuna's TPE on the parallel layout, then on the settings of the best layouts.

Stage 1 ("layout") gives TP/PP/CP/EP/ETP to the study's TPE sampler; the strategy completes each
sampled layout with memory-safe settings: MBS 1, no interleaving (vp=1 holds the fewest activations in
flight; the virtual pipeline size is a setting of a pipelined layout, tuned in stage 2 with MBS and
recompute), ViT checkpointing on, and the cheapest recompute the memory model says fits with room to
spare (none, selective, full/block with the fewest layers, else full/uniform), so a layout is not lost
to an OOM. Only the layout is an Optuna parameter of these trials, so stage 1 does not bias TPE's view
of MBS, vp or recompute. A layout whose TP crosses nodes is not drawn (`tp_within_node`: TPE's draw of one
is pruned, and TPE learns so; the layout steps skip them). The first `n_startup_trials` layouts are drawn
at random among the valid ones not drawn yet, in place of TPE's random start, whose independent draws
of each size are mostly invalid for a MoE space. It lasts `stage1_trials` launches (left out,
STAGE1_SHARE of the study's `n_trials`: a fixed count took a short study whole), or
less when every valid layout has run. When the next OOM would be the last `max_ooms` allows, a
layout run at memory-safe settings (here and in step 5) may carry at most `last_oom_risk` of running
out under the learned memory model; the loop prunes one above it and TPE draws another layout: after
the last OOM only proven fits run, which would keep stage 2 from every setting it has not measured. So
do stage 2's settings, but for a promotion that plausibly beats the best by `probe_gain` (an MBS step
or a TPE draw foresees no gain worth the last OOM; no lighter recompute of a layout measured under full
recompute is ever proven to fit). After an OOM, until a layout is measured, stage 1's draw is the untried
layout whose memory-safe settings carry the least risk under the learned memory model (a random one could
spend the last OOM before anything fit, and after it nothing is proven to fit).
Once an OOM above a layout's floor showed the estimate short of this trainer, such a run takes the
layout's memory floor (every layer recomputed) rather than the cheapest recompute the estimate says fits.

Stage 2 ("settings") proposes, in this order, each time it is asked:

0. Re-check: a run measured once that the other runs (the effects fit of step 5, without it) predict
   above the best, while it measured more than a straggler's gap (record.STRAGGLER) below the best, is
   measured again: stage 1 measures each layout once, and a straggler's run (1.5x slower on a busy
   cluster) would lose its layout and the layouts next to it for good. At most `rechecks` per study,
   none after a re-run agreed with its first run (the fit's miss was then the trainer's, not noise).
1. Promotion: a layout measured under recompute it may not need is judged by its best plausible
   setting, not by the safe one. Its plausible value is the measured one times the work the
   recompute cost (MEGATRON.md: ~4/3 per fully recomputed layer) over the work of the lightest
   setting at the same MBS that the memory screen admits; the layout with the highest plausible value
   above the best measured is launched at the setting of it whose plausible gain over the best, weighed
   by its chance to fit under the learned memory model, is largest (the lightest where none carries a
   risk: the lightest admitted setting sits at the memory edge by construction). This repeats until no
   layout can plausibly beat the best, so the safe-settings handicap never decides which layouts stage
   2 tunes.
2. Memory probe: when the lightest setting of such a layout is hidden only by the memory estimate
   (predicted just past the screen, at most `probe_reach` above capacity) and would plausibly beat
   the best by `probe_gain`, it is launched anyway, at most `memory_probes` times per study, never
   after any launch ran out of memory and never when the learned memory model gives it more than
   `probe_risk` of running out: the estimate must never miss an OOM, so at its edge it is a few GB
   pessimistic, and the fastest layouts often live there.
3. MBS steps: the best setting at the next smaller and larger MBS (same recompute, or where that is
   screened, the lightest recompute that fits at the larger MBS and costs little more work), then the
   next larger MBS of every other layout whose best is within `mbs_reach` of the best: a larger
   micro-batch gains more on some layouts than on others, so the order at MBS 1 is not the final one.
   Each is measured once.
4. The learned judge: the default strategy's next proposal (HeuristicStrategy, with this study's
   `max_ooms`, probe and last-OOM settings), asked with this strategy's history: its speed model
   re-prices the throughput prior's components with what every run so far measured (stage 1's layouts,
   the promotions and MBS steps), a Gaussian process corrects what that misses, and each prediction
   carries an uncertainty that widens where the measurements contradict the prior's ranking; its memory
   model learns from every peak and OOM. It proposes, best first, any candidate of any layout (its own
   why-line says why), measures again what noise could have decided, and has nothing to propose once no
   launchable candidate could beat the best. The layout steps below walked from where TPE's draws landed,
   ranked by an additive fit without an uncertainty, and which path a study took decided its result
   (robustness.py, Qwen3-30B-A3B on the speed trainer: the steps reached the optimum's layout after
   `max_ooms` was spent, where nothing proved it fits, 0.758; the 64-expert MoE on 64 H100: PP 2->1 from
   the best was never a step, 0.850-0.874). The judge ranks the layouts by one fit of every run instead.
5. Layout steps, once the judge has nothing: up to `layout_steps` unmeasured layouts next to the best one (one dimension one value
   up or down, or one up and another down; where none is left, one or two dimensions to any value: a
   MoE space's valid layouts are sparse), at memory-safe settings; the next is the one whose changed
   values did best in the runs so far (an additive model of every run's log throughput, recompute work
   taken out, one effect per dimension value, MBS and vp, fitted jointly: stage 1's random layouts share
   values by chance, and a tuned layout must not look better for its MBS). Stage 1's budget covers few
   layouts of a large MoE space; this walks from where it landed, and a step that finds a better layout
   does not count against `layout_steps`.
   Once the study has spent its `max_ooms`, only a layout whose memory-safe settings a run proves fit;
   with one OOM left, only one whose memory-safe settings the last-OOM stake allows.
6. TPE picks MBS, recompute granularity, method and layer count (and ViT checkpointing for a VLM) on
   the `top_layouts` best measured layouts; the one holding the best result gets most proposals, the
   runners-up every third. Both stages ask the same study, so TPE learns from every trial. Once the
   study has spent its `max_ooms`, the loop launches only proven fits, so instead of TPE's draws the
   untried setting of a measured layout that a run proves fits and that plausibly does best (`_proven`).
Steps 0-5 are asked again after every launch (a new best opens new ones); TPE gets what is left.
"""
from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Literal

import numpy as np

from zenithtune.record import STRAGGLER, unslowed
from zenithtune.space import LAYOUT_PARAMS, RECOMPUTE_PARAMS, SWITCH_PARAMS, settings
from zenithtune.strategies._base import Outcome, Proposal, Strategy, tpe_sampler
from zenithtune.strategies._heuristic import HeuristicStrategy
from zenithtune.validate import candidate_modules

if TYPE_CHECKING:
    import optuna

    from zenithtune.assessment import Judge

LAYOUT_STAGE = "layout"
SETTINGS_STAGE = "settings"
LAYOUT_STEP_WHY = "stage 2, layout next to the best"
RECHECK_STAGE = "recheck"  # a run measured again: the others say a straggler slowed it (`_recheck`)
EFFECT_SHRINK = 0.25  # the ridge penalty on each layout dimension value's effect (`_effects`)
SAFE_SHARE = 0.9  # stage 1's settings must be predicted to use at most this share of GPU memory
# Recompute from cheapest to most memory-saving; stage 1 takes the first that fits.
# Module sets of selective recompute (those the space does not search are invalid there, and skipped)
# take their place by their work (`_work`).
RECOMPUTE_LADDER = ([{"recompute_granularity": "none"}, {"recompute_granularity": "selective"}]
                    + [{"recompute_granularity": "selective", "recompute_modules": m}
                       for m in ("layernorm", "layernorm+moe_act", "mlp", "moe")]
                    + [{"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": n}
                       for n in range(1, 9)]
                    + [{"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}])
# Extra work of recompute, as a share of a step without it: a fully recomputed layer runs its forward
# twice (~4/3 the work, MEGATRON.md); selective recompute redoes only the attention core, and ViT
# checkpointing only the (small) vision tower. Used to rank layouts, never as a prediction of speed.
FULL_RECOMPUTE_WORK = 1 / 3
SELECTIVE_WORK = 0.02
# selective recompute of the dense MLP or the MoE part re-runs most of a layer's GEMMs (about 2/3 of them)
SELECTIVE_GEMM_WORK = 0.2
VIT_CHECKPOINT_WORK = 0.01
# An overlap switch (SWITCH_PARAMS) hides communication: counted as this much less work, so a promotion
# tries the best layout with it on (stage 1 runs it off: it costs memory)
OVERLAP_WORK = 0.03
# A larger MBS that needs more recompute is tried next to the best only if it adds at most this much work.
NEIGHBOUR_EXTRA_WORK = 0.1
# Layout steps (`_layout_step`) start from the best layout and from every layout measured within this share
# of it: the noise and unequal tuning can put the better one just below.
STEP_REACH = 0.05
# Stage 1's share of the study's launches when `stage1_trials` is left out (null), of STAGE1_BUDGET when the
# strategy is built without the study's n_trials (conf/config.yaml's default)
STAGE1_SHARE = 0.6
STAGE1_BUDGET = 50


class StagedBlackboxStrategy(Strategy):
    def __init__(self, stage1_trials: int | None = None, n_trials: int | None = None, top_layouts: int = 2,
                 seed: int = 0, n_startup_trials: int = 10,
                 patience: int = 5, memory_probes: int = 2, probe_reach: float = 0.10, probe_gain: float = 0.02,
                 min_gain: float = 0.01, layout_steps: int = 6, mbs_reach: float = 0.1, probe_risk: float = 0.95,
                 max_ooms: int = 2, last_oom_risk: float = 0.25, tp_within_node: bool = True, rechecks: int = 2):
        if stage1_trials is None:
            # the study's budget split: stage 2 (the judge, promotions, TPE on the settings) gets the rest
            stage1_trials = _stage1_share(n_trials or STAGE1_BUDGET)
        elif int(stage1_trials) < 1:
            raise ValueError(f"stage1_trials={stage1_trials} must be >= 1 (launches spent on the layout)")
        elif n_trials is not None and int(stage1_trials) >= int(n_trials):
            raise ValueError(f"stage1_trials={stage1_trials} leaves none of n_trials={n_trials} launches to stage 2 "
                             f"(the settings of the best layouts): set stage1_trials below n_trials, or leave it "
                             f"out (null: {100 * STAGE1_SHARE:g} % of n_trials, {_stage1_share(int(n_trials))} here)")
        if int(top_layouts) < 1:
            raise ValueError(f"top_layouts={top_layouts} must be >= 1 (layouts tuned in stage 2)")
        if int(memory_probes) < 0 or not 0 <= probe_reach <= 0.5 or not 0 <= probe_gain < 1 or not 0 <= min_gain < 1:
            raise ValueError(f"memory_probes={memory_probes} (>= 0), probe_reach={probe_reach} (0..0.5), "
                             f"probe_gain={probe_gain} and min_gain={min_gain} (0..1) are out of range")
        if not 0 < probe_risk <= 1:
            raise ValueError(f"probe_risk={probe_risk} must be in (0, 1] (0.95: no probe the learned memory "
                             f"model gives more than a 95 % risk of running out of memory)")
        if int(rechecks) < 0:
            raise ValueError(f"rechecks={rechecks} must be >= 0 (layouts measured again when a straggler may have "
                             f"slowed their one run)")
        if max_ooms < 0 or not 0 < last_oom_risk <= 1:
            raise ValueError(f"max_ooms={max_ooms} (>= 0) or last_oom_risk={last_oom_risk} (0..1] is out of range "
                             f"(0.25: a memory-safe layout run that could spend the last OOM carries at most 25 % risk)")
        self.stage1_trials = int(stage1_trials)
        self.top_layouts = int(top_layouts)
        self.seed = seed
        # stage 1's first launches: untried valid layouts at random (`ask`), not TPE's own start, which
        # draws each size independently: most draws of a MoE space are invalid or cross nodes, are pruned,
        # and count towards its start all the same (the 64-expert MoE on 64 H100: after the pruned draws
        # at TP 16 and 32 TPE modelled 13 runs and drew TP 4 for 15 of 30 layouts, 0.822)
        self.n_startup_trials = n_startup_trials
        # proposals in a row that could not be launched (TPE repeating itself) before one untried
        # candidate is drawn at random instead
        self.patience = int(patience)
        self.memory_probes = int(memory_probes)  # launches past the memory screen per study
        self.probe_reach = float(probe_reach)  # ... only up to capacity x (1 + this) predicted
        self.probe_gain = float(probe_gain)  # ... and only when it plausibly beats the best by this much
        self.min_gain = float(min_gain)  # a promotion must plausibly beat the best by this much
        self.layout_steps = int(layout_steps)  # unmeasured layouts next to the best tried in stage 2
        self.mbs_reach = float(mbs_reach)  # layouts this close to the best get their next MBS measured
        self.probe_risk = float(probe_risk)  # ... and not when the learned memory model all but rules it out
        self.max_ooms = int(max_ooms)  # the study's OOM budget (the loop holds it)
        self.last_oom_risk = float(last_oom_risk)  # a layout run at memory-safe settings that could spend its last
        self.tp_within_node = bool(tp_within_node)  # no layout whose TP crosses nodes (`_far`)
        self.rechecks = int(rechecks)  # runs measured again when the others say a straggler slowed them
        self._rng = random.Random(seed)
        self._stage1_done = False
        self._stage2_asked = 0

    def sampler(self) -> optuna.samplers.BaseSampler:
        return tpe_sampler(self.seed, self.n_startup_trials)

    @property
    def past_screen(self) -> int:
        return self.memory_probes

    def setup(self, judge: Judge, history: list[Outcome], direction: Literal["maximize", "minimize"] = "maximize",
              metric: str = "TFLOP/s/GPU") -> None:
        space = judge.space
        self._by_layout: dict[tuple, dict[tuple, dict]] = {}  # layout -> {key: candidate} of the valid ones
        for cand in space.walk():
            self._by_layout.setdefault(_layout(space, cand), {})[space.key(cand)] = cand
        # TP beyond one node puts its per-layer collectives on the network (MEGATRON.md; NeMo's Auto
        # Configurator and the heuristic keep TP inside a node too): such layouts are not drawn, unless
        # nothing else can run at all (a model only TP across nodes holds)
        self._far: set[tuple] = set()
        if self.tp_within_node:
            far = {lay for lay in self._by_layout if dict(lay).get("tp", 1) > judge.ctx.gpus_per_node}
            near = (c for lay, cs in self._by_layout.items() if lay not in far for c in cs.values())
            if any(judge.assess(c).launchable for c in near):
                self._far = far
        self._seen: dict[tuple, set[tuple]] = {}  # layout -> keys measured or screened
        self._best: dict[tuple, Outcome] = {}  # layout -> its best measured outcome
        self._stage1_layouts: set[tuple] = set()
        self._stage1_launched = 0
        self._streak = 0  # proposals in a row (this stage) that could not be launched
        self._neighboured: set[tuple] = set()  # (best's key, mbs) already proposed as an MBS neighbour
        self._values: dict[str, list] = {}  # each layout dimension's values, sorted
        self._stepped: set[tuple] = set()  # layouts proposed as a step from the best
        self._step_layouts: set[tuple] = set()  # layouts a told layout step measured
        self._step_wins: set[tuple] = set()  # of those, the ones that came to hold the best: not counted
        self._steps_asked: set[tuple] = set()  # keys of the layout steps this process proposed
        self._judge2: HeuristicStrategy | None = None  # step 4's judge, created on this history when first asked
        super().setup(judge, [], direction, metric)
        for o in history:
            self.tell(o)

    def tell(self, outcome: Outcome) -> None:
        super().tell(outcome)
        lay = _layout(self.space, outcome.candidate)
        if (outcome.why or "").startswith(LAYOUT_STEP_WHY) and outcome.ok:
            self._step_layouts.add(lay)
        best = self.best()
        if best is not None and _layout(self.space, best.candidate) in self._step_layouts:
            # a step that found a better layout does not count against `layout_steps`: the walk goes on
            # from there (the 64-expert MoE on 64 H100: the EP 4->8 step won with the budget spent, and
            # PP 2->1 from it, the optimum, was never taken: 0.874). Found, too, when the step's own run,
            # at memory-safe settings, was slower and a promotion of its layout then took the lead (the
            # same MoE on the memory trainer: TP 4->2 at full recompute 174.7, promoted 232.8, the best)
            self._step_wins.add(_layout(self.space, best.candidate))
        self._seen.setdefault(lay, set()).add(self.space.key(outcome.candidate))
        if outcome.ok and (lay not in self._best or self.better(outcome.value, self._best[lay].value)):  # type: ignore[arg-type]
            self._best[lay] = outcome
        if outcome.stage == LAYOUT_STAGE:
            self._stage1_layouts.add(lay)
            self._stage1_launched += outcome.launched
        elif outcome.stage == SETTINGS_STAGE:
            # a study resumed with a larger n_trials (so a larger share for stage 1) goes on with stage 2
            self._stage1_done = True
        self._streak = 0 if outcome.launched else self._streak + 1

    def _untried(self, lay: tuple) -> list[dict]:
        """This layout's valid candidates that were neither measured nor screened, in a stable order."""
        seen = self._seen.get(lay, set())
        return [c for k, c in self._by_layout.get(lay, {}).items() if k not in seen]

    # --- stage 1 -----------------------------------------------------------------------------------
    def _stage1_over(self) -> bool:
        return self._stage1_launched >= self.stage1_trials or not self._untried_layouts()

    def _safe_settings(self, layout: dict) -> dict:
        """MBS 1, no interleaving (a pipelined candidate without vp runs vp=1: `Space.normalize`), ViT
        checkpointing, and the cheapest recompute predicted to fit with room to spare; once a launch ran
        out of memory above its layout's floor (`_short`), the heaviest recompute the space allows (the
        layout's memory floor)."""
        base = {**layout, "mbs": 1}
        if "vit_gradient_checkpointing" in self.space.params:
            base["vit_gradient_checkpointing"] = True
        base.update({n: False for n in SWITCH_PARAMS if n in self.space.params})  # overlap costs memory
        cap, risk = self.judge.capacity_gb, self._safe_risk()
        judged = [(c, self.judge.assess(c)) for c in self._ladder(base)]
        valid = [(c, a) for c, a in judged if a.valid]
        if not valid:  # the layout itself cannot run: the loop says why, in the job's own recompute choices
            return next((c for c, a in judged if "choices" not in {r for r, _ in a.reasons}), judged[-1][0])
        # the layout's memory floor: the heaviest recompute the space allows (every layer recomputed keeps
        # only the layers' inputs). Once an OOM showed the estimate short of this trainer, a layout is
        # measured there, whatever the estimate says of the lighter settings; a promotion measures those.
        floor = valid[-1][0]
        if self._short():
            return floor
        for cand, a in valid:
            gb = a.predicted_gb
            if (gb is None or gb <= SAFE_SHARE * cap) and (risk is None or a.oom_risk <= risk):
                return cand
        return floor

    def _safest_layout(self) -> tuple[tuple, float] | None:
        """After an OOM, while no layout has been measured: the untried layout whose memory-safe settings
        the learned memory model gives the least risk of running out, and that risk (None otherwise: the
        draw stays random). A random draw then may spend the study's last OOM before anything fit, and
        after it only proven fits run, which nothing measured proves (robustness.py, Mixtral on 24 H100,
        memory and stand-in trainers, noise seed 2: TP1 PP1 CP2 EP8 and then TP1 PP1 CP4 EP8, each with
        every layer recomputed, ran out of memory, and the study ended after 2 launches with nothing
        measured)."""
        if self._best or not self._oom_runs():
            return None
        judged = ((lay, self.judge.assess(self._safe_settings(dict(lay)))) for lay in self._untried_layouts())
        # the space's order among equals
        return min(((lay, a.oom_risk) for lay, a in judged if a.valid), key=lambda t: t[1], default=None)

    def _ladder(self, base: dict) -> list[dict]:
        """`base` with each recompute setting of RECOMPUTE_LADDER, from the least work to the most."""
        return [self.space.normalize({**base, **rec})
                for rec in sorted(RECOMPUTE_LADDER, key=lambda r: self._work({**base, **r}))]

    def _at_floor(self, c: dict) -> bool:
        """Was `c` run at its layout's memory floor (`_safe_settings` after an OOM)? MBS 1, no
        interleaving, the heaviest recompute the space allows there."""
        if c.get("mbs", 1) != 1 or (c.get("vp") or 1) != 1:
            return False
        floor = next((f for f in reversed(self._ladder(c)) if self.judge.assess(f).valid), None)
        return floor is not None and all(c.get(k) == floor.get(k) for k in RECOMPUTE_PARAMS)

    def _short(self) -> bool:
        """Has an OOM shown the estimate short of what this trainer's settings need: a run that ran out
        of memory above its layout's floor? (One at the floor says the layout cannot hold its weights and
        optimizer state, which no recompute helps; the OOM's dominance rules out what needs more.)"""
        return any(not self._at_floor(o.candidate) for o in self._oom_runs())

    def _safe_risk(self) -> float | None:
        """The OOM risk a layout run at memory-safe settings may carry: any (None) while more than one OOM
        of `max_ooms` is left; `last_oom_risk` when the next OOM would be the last. Such a run is there
        to measure a layout; once an OOM showed the estimate short of this trainer, the last OOM is kept
        for the settings of the layouts measured (stage 2), not spent on a layout the learned model doubts.
        Before any layout was measured there is nothing to keep it for: capped then, stage 1 saw every layout
        it drew refused (robustness.py, Mixtral on the memory-flavoured trainer: after an OOM on its first
        launch every layout's floor carried more than the cap) and ended with nothing measured, the study
        stopped after one launch."""
        if not self._best:
            return None
        return self.last_oom_risk if self._one_oom_left() else None

    def _stake(self, gain: float) -> float | None:
        """The OOM risk a stage-2 setting may carry: any (None) while more than one OOM of `max_ooms` is
        left, or for a promotion plausibly `probe_gain` better than the best; else `last_oom_risk` when
        the next OOM would be the last. An MBS step or a TPE draw (no gain foreseen) that spends it leaves
        only proven fits, so no lighter recompute of a layout measured under full recompute could run
        after it (robustness.py, the stand-in 128-expert MoE with noise: an MBS-2 step ran out of memory
        as the second OOM, and the best layout stayed at full recompute, 0.754 of the optimum; that step's
        learned risk, 17 %, was under this cap, so the study is unchanged)."""
        risk = self._safe_risk()
        return None if risk is None or gain >= self.probe_gain else risk

    def _untried_layouts(self) -> list[tuple]:
        return [lay for lay in self._by_layout if lay not in self._stage1_layouts and lay not in self._far]

    def _veto(self, cand: dict) -> str | None:
        """Stage 1's own rule on what TPE drew: no TP across nodes (`_far`)."""
        lay = _layout(self.space, cand)
        if lay in self._far:
            return (f"tp={dict(lay).get('tp')} crosses nodes of {self.ctx.gpus_per_node} GPUs: its collectives "
                    f"would run over the network (strategy.tp_within_node=false allows it)")
        return None

    # --- stage 2: what measurements and the memory screen suggest before TPE -------------------------
    def _work(self, c: dict) -> float:
        """A step's work relative to one without recompute (see FULL_RECOMPUTE_WORK)."""
        extra = VIT_CHECKPOINT_WORK if c.get("vit_gradient_checkpointing") else 0.0
        extra -= OVERLAP_WORK * sum(bool(c.get(n)) for n in SWITCH_PARAMS)  # hidden communication
        g = c.get("recompute_granularity", "none")
        if g == "selective":
            mods = candidate_modules(c)
            extra += SELECTIVE_GEMM_WORK if "mlp" in mods or "moe" in mods else SELECTIVE_WORK
        elif g == "full":
            share = 1.0
            if c.get("recompute_method") == "block":
                layers = self.ctx.model.num_layers
                per_stage = layers / int(c.get("pp", 1)) if layers else 8
                share = min(1.0, int(c.get("recompute_num_layers") or 1) / max(per_stage, 1))
            extra += FULL_RECOMPUTE_WORK * share
        return 1.0 + extra

    def _cost(self, c: dict) -> float:
        """A step's time relative to one without recompute and without a pipeline bubble: `_work` times
        the 1F1B bubble, 1 + (p-1)/(v m) (MEGATRON.md; m micro-batches per pipeline, v the virtual
        pipeline size), so a promotion weighs interleaving as it weighs recompute. Stage 1 measures
        every pipelined layout at vp=1; without this, vp came only from TPE on the top layouts
        (robustness.py, the 128-expert MoE on the plain trainer: the optimum is a runner-up layout
        interleaved, with its overlaps on, 0.882)."""
        lay = self.space.layout(c)
        if lay.pp == 1:
            return self._work(c)
        return self._work(c) * (1 + (lay.pp - 1) / ((lay.vpp_size or 1) * max(lay.microbatches, 1)))

    def _plausible(self, o: Outcome, c: dict) -> float:
        """What setting `c` of `o`'s layout could reach: `o`'s rate times the work `c` saves (`_cost`)."""
        return self.rate(float(o.value)) * self._cost(o.candidate) / self._cost(c)  # type: ignore[arg-type]

    def _screened(self, c: dict) -> str | None:
        """Why the study's memory screen would not launch `c` (None: it would); once the OOMs are spent,
        what no run proves fits is screened too."""
        a = self.judge.assess(c)
        if a.predicted_oom:
            return a.predicted_oom
        if self._budget_spent() and a.fits_surely is None:
            return f"not proven to fit after {self._ooms()} OOM (max_ooms={self.max_ooms})"
        return None

    def _may_probe(self, c: dict) -> bool:
        """Once per `memory_probes`, never after an OOM, only just past the screen (`probe_reach`) and
        not when the learned memory model all but rules it out (`probe_risk`)."""
        if sum(1 for o in self.history if o.probe) >= self.memory_probes or \
                self._ooms() > 0:
            return False
        a = self.judge.assess(c)
        return a.predicted_gb is not None and a.predicted_gb <= self.judge.capacity_gb * (1 + self.probe_reach) \
            and a.oom_risk <= self.probe_risk

    def _lighter_settings(self, best: Outcome, tried: set[tuple]) -> list[dict]:
        """The untried settings of `best`'s layout at its MBS (recompute, overlap switches, virtual pipeline
        size) lighter than `best`'s (`_cost`), the lightest first (stable: the space's order breaks ties)."""
        b = best.candidate
        rest = {k: v for k, v in b.items()
                if k not in (*RECOMPUTE_PARAMS, "vit_gradient_checkpointing", "vp", *SWITCH_PARAMS)}
        same = [c for k, c in self._by_layout.get(_layout(self.space, b), {}).items()
                if k not in tried and all(c.get(n) == v for n, v in rest.items()) and self._cost(c) < self._cost(b)]
        return sorted(same, key=self._cost)

    def _lighter(self, best: Outcome, tried: set[tuple]) -> tuple[dict | None, dict | None]:
        """The lightest of `_lighter_settings` that the screen admits, and the lightest one lighter still
        that only the screen hides."""
        hidden = None
        for c in self._lighter_settings(best, tried):
            if self._screened(c):
                hidden = hidden or c
                continue
            return c, hidden
        return None, hidden

    def _lighter_pick(self, best: Outcome, tried: set[tuple], bar: float,
                      worth: Callable[[dict, float], float]) -> dict | None:
        """Of `_lighter_settings` that the screen admits and that plausibly reach `bar`, the one `worth` (of the
        setting and its plausible rate) rates highest (ties: the lightest), or None."""
        found: tuple[float, dict] | None = None
        for c in self._lighter_settings(best, tried):
            rate = self._plausible(best, c)
            if self._screened(c) or rate < bar:
                continue
            w = worth(c, rate)
            if found is None or w > found[0]:
                found = (w, c)
        return None if found is None else found[1]

    def _safest(self, best: Outcome, tried: set[tuple], bar: float) -> dict | None:
        """Of the lighter settings plausibly reaching `bar`, the one carrying the least risk of running out of
        memory (`_lighter_pick`)."""
        return self._lighter_pick(best, tried, bar, lambda c, _: -self.judge.assess(c).oom_risk)

    def _likeliest(self, best: Outcome, tried: set[tuple], incumbent: float) -> dict | None:
        """Of the lighter settings plausibly beating `incumbent` by `min_gain`, the one whose gain is largest
        once weighed by its chance to fit: (1 - OOM risk) x (plausible rate - incumbent) under the learned
        memory model (`_lighter_pick`)."""
        return self._lighter_pick(best, tried, incumbent * (1 + self.min_gain),
                                  lambda c, rate: (1 - self.judge.assess(c).oom_risk) * (rate - incumbent))

    def _promotion(self, incumbent: float, tried: set[tuple]) -> Proposal | None:
        """Steps 1 and 2 of stage 2 (module docstring): the layout whose lightest admissible setting
        plausibly beats the best by the most, at its setting with the largest gain weighed by the chance
        to fit (`_likeliest`: the lightest, at 71 % risk, spent an OOM on robustness.py's Mixtral on the
        speed trainer, full/block/3 with TP overlap on, while block/4 at 23 % then measured 388.5 against
        the best's 363.3: 0.909 -> 0.963), else a memory probe. With one OOM of `max_ooms` left,
        that layout's setting carrying the least risk among those still plausibly `probe_gain` better than
        the best goes instead: the memory edge is approached from the safe side, since after that OOM only
        proven fits run, and a run that fit proves its neighbours (search.py, qwen3-30b-a3b-8xh100: the
        lightest, selective/moe with vp 8 and TP overlap on at once, spent the last OOM, and every later
        proposal was unproven: 0.872 after 26 of 50 launches). The layout is still chosen by its lightest
        setting: chosen by the safest, another layout went first (robustness.py, Mixtral on the memory
        trainer with noise: 0.988 -> 0.952)."""
        options = []  # (plausible rate, is a probe, order, candidate, layout's best)
        for i, o in enumerate(self._best.values()):
            light, hidden = self._lighter(o, tried)
            for c, probe in ((light, False), (hidden, True)):
                if c is not None:
                    options.append((self._plausible(o, c), probe, i, c, o))
        edge = self._one_oom_left()
        for rate, probe, _, c, o in sorted(options, key=lambda t: (t[1], -t[0], t[2])):
            gain = rate / incumbent - 1
            if gain <= (self.probe_gain if probe else self.min_gain):
                continue
            if probe and not self._may_probe(c):
                continue
            safe = self._safest(o, tried, incumbent * (1 + self.probe_gain)) if edge and not probe else None
            likeliest = None if edge or probe else self._likeliest(o, tried, incumbent)
            lightest = c
            chosen = safe if safe is not None else likeliest
            if chosen is not None:
                c = chosen
                rate = self._plausible(o, c)
                gain = rate / incumbent - 1
            desc = " ".join(f"{k}={v}" for k, v in _layout(self.space, c))
            why = (f"layout {desc} measured {o.value:.4g} with {_rec(o.candidate)} (trial {o.trial_number}); with "
                   f"{_rec(c)}{_changed(o.candidate, c)} it does less work and could reach {self.rate(rate):.4g}, "
                   f"{100 * gain:.0f} % better "
                   f"than the best ({self.rate(incumbent):.4g})")
            if probe:
                return Proposal(dict(c), probe_memory=True, stage=SETTINGS_STAGE,
                                why=f"stage 2, memory probe: {why}; only the memory estimate hides "
                                f"{_rec(c)} ({100 * self.judge.assess(c).oom_risk:.0f} % risk of running out of "
                                f"memory), one launch tests it at its edge")
            if likeliest is not None and likeliest is not lightest:
                why += (f"; of its settings, the largest gain weighed by the chance to fit "
                        f"({100 * (1 - self.judge.assess(c).oom_risk):.0f} %)")
            if safe is not None:
                why += (f"; with one OOM of max_ooms={self.max_ooms} left, the setting carrying the least risk "
                        f"({100 * self.judge.assess(c).oom_risk:.0f} %) that could still beat it by "
                        f"{100 * self.probe_gain:g} %")
            return Proposal(dict(c), stage=SETTINGS_STAGE, max_risk=self._stake(gain),
                            why=f"stage 2, promotion: {why}, so it is measured")
        return None

    def _neighbour(self, best: Outcome, tried: set[tuple]) -> Proposal | None:
        """Step 3: the best setting at the next smaller and larger MBS, then each runner-up layout
        within `mbs_reach` of the best at its next larger MBS (a larger micro-batch often gains more on
        one layout than on another, so the order at MBS 1 is not the order at the optimum)."""
        rate = self.rate(float(best.value))  # type: ignore[arg-type]
        ranked = sorted((o for o in self._best.values() if o is not best
                         and self.rate(float(o.value)) >= rate * (1 - self.mbs_reach)),  # type: ignore[arg-type]
                        key=lambda o: -self.rate(float(o.value)))  # type: ignore[arg-type]
        for o, down in ((best, True), *((o, False) for o in ranked)):
            step = self._mbs_step(o, tried, down, o is best)
            if step is not None:
                return step
        return None

    def _mbs_step(self, best: Outcome, tried: set[tuple], down: bool, incumbent: bool) -> Proposal | None:
        b = best.candidate
        cands = self._by_layout.get(_layout(self.space, b), {})
        sizes = sorted({c.get("mbs", 1) for c in cands.values()})
        mbs = b.get("mbs", 1)
        steps = [m for m in sizes if m > mbs][:1] + ([m for m in sizes if m < mbs][-1:] if down else [])
        for m in steps:
            if (self.space.key(b), m) in self._neighboured:
                continue
            key = self.space.key({**b, "mbs": m})
            same = cands.get(key)
            if same is not None and not self._screened(same):
                pick = None if key in tried else same
            elif m > mbs:
                # the larger MBS needs more recompute: the lightest that fits, if it costs little work
                ups = [c for k, c in cands.items() if k not in tried and c.get("mbs") == m
                       and settings(c) == settings(b)
                       and self._work(c) <= self._work(b) + NEIGHBOUR_EXTRA_WORK]
                pick = next((c for c in sorted(ups, key=self._work) if not self._screened(c)), None)
            else:
                pick = None
            if pick is not None:
                self._neighboured.add((self.space.key(b), m))
                who = "the best" if incumbent else "a runner-up layout's best"
                return Proposal(dict(pick), stage=SETTINGS_STAGE, max_risk=self._stake(0.0),
                                why=f"stage 2, MBS next to {who} (trial {best.trial_number}, mbs {mbs}): "
                                f"mbs {m} with {_rec(pick)}")
        return None

    def _rows(self) -> list[tuple[dict, float, Outcome]]:
        """Every measured run as the effects fit takes it (`_effects`): its layout values, MBS and vp, and its
        log rate with its recompute work taken out; a run a straggler slowed (`record.unslowed` of its
        candidate's runs) left out. (A score that is not a positive number, e.g. 0 from a broken log line,
        says nothing of speed.)"""
        runs: dict[tuple, list[Outcome]] = {}
        for o in self.history:
            if o.usable:
                runs.setdefault(self.space.key(o.candidate), []).append(o)
        rows = []
        for group in runs.values():
            kept = unslowed([float(o.value) for o in group], self.direction)  # type: ignore[arg-type]
            for o in group:
                if float(o.value) in kept:  # type: ignore[arg-type]
                    rows.append(({**dict(_layout(self.space, o.candidate)), "mbs": o.candidate.get("mbs", 1),
                                  "vp": o.candidate.get("vp", 1)},
                                 math.log(self.rate(float(o.value)) * self._work(o.candidate)), o))  # type: ignore[arg-type]
        return rows

    def _recheck(self, best: Outcome) -> Proposal | None:
        """Step 0 (issue 19 1d, a result far from its prediction is measured again before it steers the
        search): stage 1 measures each layout once, and a run a straggler slowed (1.5x on a busy cluster)
        loses its layout for good, and with it the layouts next to it, which the steps judge by it. A run
        measured once is measured again when the other runs predict it (the effects fit without its runs,
        `_effects`) above the best, while it measured more than a straggler's gap (record.STRAGGLER) below
        the best (a run within it is in contention as it stands, and the fit, a weak model of sizes that
        interact, misses by 10-15 % often: re-checks of such runs went to the best itself): the highest
        such prediction first, at most `rechecks` per study, and none after a re-run agreed with the first
        (then the fit's miss was the trainer's, not the noise's). The 64-expert MoE on 64 H100 (plain
        trainer, 3 % noise): TP1 PP2 EP8 measured 153 (a straggler; 231 without), the other runs predicted
        266, above the best 229; PP 2->1 from it is the optimum, which no layout step reached (0.844)."""
        if self.rechecks <= 0:
            return None
        again = [o for o in self.history if o.stage == RECHECK_STAGE and o.usable]
        if len(again) >= self.rechecks or any(len(unslowed(self.measurements(o.candidate), self.direction)) > 1
                                              for o in again):
            return None
        rows = self._rows()
        runs = Counter(self.space.key(o.candidate) for o in self.history if o.ok)
        top = self.rate(float(best.value))  # type: ignore[arg-type]
        dims = [*dict(_layout(self.space, best.candidate)), "mbs", "vp"]
        found: tuple[float, Outcome] | None = None
        for values, _, o in rows:
            key = self.space.key(o.candidate)
            if runs[key] != 1:  # measured again already (a re-check among them)
                continue
            rest = [(v, r) for v, r, other in rows if self.space.key(other.candidate) != key]
            if len(rest) < 2:
                continue
            effect = _effects(rest, dims)
            pred = float(np.mean([r for _, r in rest])) + sum(effect[d].get(values.get(d), 0.0) for d in dims)
            rate = math.exp(pred) / self._work(o.candidate)
            measured = self.rate(float(o.value))  # type: ignore[arg-type]
            if rate > top and measured < top * (1 - STRAGGLER) and (found is None or rate > found[0]):
                found = (rate, o)
        if found is None:
            return None
        rate, o = found
        desc = " ".join(f"{k}={v}" for k, v in _layout(self.space, o.candidate))
        return Proposal(dict(o.candidate), repeat=True, stage=RECHECK_STAGE,
                        why=f"stage 2, re-check: layout {desc} measured {o.value:.4g} once (trial {o.trial_number}); "
                            f"the other runs predict {self.rate(rate):.4g} for it, above the best ({best.value:.4g}) "
                            f"and beyond a straggler's {100 * STRAGGLER:.0f} %: measured again before it steers "
                            f"the search")

    def _layout_step(self, best: Outcome) -> Proposal | None:
        """Step 5: an unmeasured layout next to the best one (`_adjacent`: the nearest first), or next to a
        layout measured within STEP_REACH of it, the one that measurements so far favour, at memory-safe
        settings."""
        if self._steps_spent() >= self.layout_steps:
            return None
        top = self.rate(float(best.value))  # type: ignore[arg-type]
        # Where the walk may start: the best layout and those within STEP_REACH of it. Under measurement
        # noise, and with layouts tuned to different depths, such a layout may be the better one, and the
        # optimum may lie next to it, not next to the best (the 64-expert MoE on 16 H100, stand-in trainer
        # with noise: PP2 EP8 measured 0.8 % below PP4 EP4, and PP 2->1 from it, the optimum, was never a
        # step: 0.861).
        origins = [best, *sorted((o for o in self._best.values() if o is not best and
                                  self.rate(float(o.value)) >= top * (1 - STEP_REACH)),  # type: ignore[arg-type]
                                 key=lambda o: -self.rate(float(o.value)))]  # type: ignore[arg-type]
        # What the runs so far say of each dimension's value: an additive model of the log throughput of
        # every measured run (its recompute work taken out), one effect per layout dimension value, MBS and
        # virtual pipeline size, fitted jointly and shrunk toward none (`_effects`): a layout that stage 2
        # has tuned does not look better than one measured at memory-safe settings for its MBS. A
        # neighbour is predicted at its origin's measured value times the effects of the layout values it
        # changes; no model of the trainer is involved.
        rows = [(v, r) for v, r, _ in self._rows()]
        if not rows:
            return None
        here = dict(_layout(self.space, best.candidate))
        effect = _effects(rows, [*here, "mbs", "vp"])
        open_ = [lay for lay in self._by_layout if lay not in self._best and lay not in self._stage1_layouts
                 and lay not in self._stepped and lay not in self._far]
        scored: dict[tuple, tuple[float, float, Outcome]] = {}  # layout -> (predicted log rate, score, origin)
        for o in origins:
            at = dict(_layout(self.space, o.candidate))
            tier = {lay: self._adjacent(dict(lay), at) for lay in open_}
            # the nearest first: one value up or down; where none is left, one or two dimensions to any value
            near = [lay for lay, t in tier.items() if t == 1] or [lay for lay, t in tier.items() if t == 2]
            for lay in near:
                n = dict(lay)
                score = sum(effect[d].get(n.get(d), 0.0) - effect[d].get(at[d], 0.0) for d in at if n.get(d) != at[d])
                pred = math.log(self.rate(float(o.value))) + score  # type: ignore[arg-type]
                if lay not in scored or pred > scored[lay][0]:
                    scored[lay] = (pred, score, o)
        if not scored:
            return None
        # the best predicted first (a stable sort keeps the space's order among equals); once the OOMs are
        # spent, only a layout whose memory-safe settings a run proves fit, and with one OOM left only one
        # whose memory-safe settings carry no more risk than its stake (the loop refuses the rest, and a
        # refused step was spent: robustness.py, Qwen3 on the memory trainer, two of six steps refused)
        spent, stake = self._budget_spent(), self._safe_risk()
        steps = ((lay, self._safe_settings(dict(lay))) for lay in sorted(scored, key=lambda lay: -scored[lay][0]))
        pick, cand = next(((lay, c) for lay, c in steps if (not spent or not self._screened(c))
                           and (stake is None or self.judge.assess(c).oom_risk <= stake)), (None, None))
        if pick is None or cand is None:
            return None
        self._stepped.add(pick)
        self._steps_asked.add(self.space.key(cand))
        desc = " ".join(f"{k}={v}" for k, v in pick)
        _, score, origin = scored[pick]
        origin_desc = " ".join(f"{k}={v}" for k, v in _layout(self.space, origin.candidate))
        via = "" if origin is best else (f", by a step from layout {origin_desc} (trial {origin.trial_number}), "
                                         f"measured within {100 * STEP_REACH:g} % of it")
        return Proposal(cand, stage=SETTINGS_STAGE, max_risk=stake,
                        why=f"{LAYOUT_STEP_WHY} (trial {best.trial_number}){via}: {desc}, the one the "
                        f"runs so far favour ({score:+.2f} log), at memory-safe settings")

    def _steps_spent(self) -> int:
        """Layout steps counted against `layout_steps`: those told (a resumed study's too) and those still
        running, less those that found a better layout."""
        told = [self.space.key(o.candidate) for o in self.history if (o.why or "").startswith(LAYOUT_STEP_WHY)]
        return len(told) + len(self._steps_asked - set(told)) - len(self._step_wins)

    def _adjacent(self, a: dict, b: dict) -> int:
        """How near layout a is to b: 1 for one dimension one value up or down, or two dimensions one
        value apart in opposite directions; 2 for one or two dimensions changed to any value (the valid
        layouts of a MoE space are sparse, since EP x ETP must divide what TP x CP x DP leave, so the
        move that matters may be two values at once: more EP, less ETP); 0 for anything farther."""
        moves = []
        for d in b:
            if a.get(d) != b[d]:
                vals = self._values.setdefault(d, sorted({dict(lay).get(d) for lay in self._by_layout}))
                moves.append(vals.index(a.get(d)) - vals.index(b[d]) if a.get(d) in vals else 99)
        if moves in ([1], [-1]) or sorted(moves) == [-1, 1]:
            return 1
        return 2 if 1 <= len(moves) <= 2 else 0

    # --- both --------------------------------------------------------------------------------------
    def ask(self, pending: Sequence[dict] = ()) -> Proposal | None:
        if not self._stage1_done:
            if not self._stage1_over():
                if self._streak >= self.patience or self._stage1_launched < self.n_startup_trials:
                    why = "TPE repeated itself" if self._streak >= self.patience else \
                        f"TPE's start ({self._stage1_launched + 1} of {self.n_startup_trials})"
                    safest = self._safest_layout()
                    if safest is not None:
                        lay, how = safest[0], (f"no layout measured yet after an OOM: the untried layout whose "
                                               f"memory-safe settings carry the least risk ({100 * safest[1]:.0f} %)")
                    else:
                        lay, how = self._rng.choice(self._untried_layouts()), \
                            "an untried layout at random, at memory-safe settings"
                    return Proposal(dict(lay), why=f"stage 1: {why}; {how}", stage=LAYOUT_STAGE, sample=LAYOUT_PARAMS,
                                    complete=self._safe_settings, max_risk=self._safe_risk())
                return Proposal({}, why="stage 1: TPE picks the layout, at memory-safe settings",
                                stage=LAYOUT_STAGE, sample=LAYOUT_PARAMS, complete=self._safe_settings,
                                max_risk=self._safe_risk(), veto=self._veto)
            self._stage1_done = True
            self._streak = 0
        best = self.best()
        if best is not None:
            tried = self.tried_keys(pending)
            rate = self.rate(float(best.value))  # type: ignore[arg-type]
            step = self._recheck(best) or self._promotion(rate, tried) or self._neighbour(best, tried) or \
                self._judged(pending) or self._layout_step(best)
            if step is not None:
                return step
        if best is not None and self._budget_spent():
            return self._proven(best, pending)
        ranked = sorted(((lay, o) for lay, o in self._best.items() if self._untried(lay)),
                        key=lambda kv: self.rate(float(kv[1].value)), reverse=True)  # type: ignore[arg-type]
        if not ranked:
            self.stop_reason = ("every setting of every measured layout was tried" if self._best else
                                "no layout could be measured: every layout stage 1 drew was refused or failed")
            return None
        top = ranked[: self.top_layouts]
        self._stage2_asked += 1
        i = 0 if len(top) == 1 or self._stage2_asked % 3 else 1 + (self._stage2_asked // 3) % (len(top) - 1)
        lay, o = top[i]
        desc = " ".join(f"{k}={v}" for k, v in lay)
        if self._streak >= self.patience:
            cand = self._rng.choice(self._untried(lay))
            return Proposal(dict(cand), why=f"stage 2: TPE repeated itself; an untried setting of layout #{i + 1} "
                            f"{desc} at random", stage=SETTINGS_STAGE, max_risk=self._stake(0.0))
        tuned = "mbs/vp/recompute" if self.space.applies_vp(dict(lay)) else "mbs/recompute"
        return Proposal(dict(lay), why=f"stage 2: TPE tunes {tuned} on layout #{i + 1} {desc} "
                        f"(best so far {o.value:.1f})", stage=SETTINGS_STAGE, max_risk=self._stake(0.0))

    def _judged(self, pending: Sequence[dict]) -> Proposal | None:
        """Step 4: the default strategy's next proposal, judged on every run so far (it shares this
        strategy's history; the study's budgets are this strategy's), or None when it sees no candidate
        that could still beat the best."""
        if self._judge2 is None:
            judge2 = HeuristicStrategy(max_ooms=self.max_ooms, memory_probes=self.memory_probes,
                                       probe_reach=self.probe_reach, probe_gain=self.probe_gain,
                                       probe_risk=self.probe_risk, min_gain=self.min_gain,
                                       last_oom_risk=self.last_oom_risk, tp_within_node=self.tp_within_node)
            judge2.setup(self.judge, [], self.direction, self.metric)
            judge2.history = self.history  # one history: every outcome told here is the judge's too
            self._judge2 = judge2
        self._judge2.free_launches = self.free_launches
        proposal = self._judge2.ask(pending)
        # its why is kept as written: the judge counts its own explorations and neighbour tests by it
        return None if proposal is None else replace(proposal, stage=SETTINGS_STAGE)

    def _proven(self, best: Outcome, pending: Sequence[dict]) -> Proposal | None:
        """Step 6 once the study spent its `max_ooms`: TPE would draw settings no run proves fit, which
        the loop refuses one after another until the study stops with launches unused (search.py,
        qwen3-30b-a3b-8xh100: 26 of 50). Instead, of the untried settings of the measured layouts that a
        run that fit proves fit, the one that plausibly does best: its layout's best times the work that
        setting saves (`_cost`). Only settings plausibly `min_gain` better than the best, and those of the
        `top_layouts` best layouts (where TPE would have searched: a larger MBS saves no work the cost
        counts), are judged: proving is dear, and a setting of a slow layout that saves no work is no
        bet. When none is proven, the study stops and says so."""
        tried = self.tried_keys(pending)
        bar = self.rate(float(best.value)) * (1 + self.min_gain)  # type: ignore[arg-type]
        top = {lay for lay, _ in sorted(self._best.items(), key=lambda kv: -self.rate(float(kv[1].value)))  # type: ignore[arg-type]
               [: self.top_layouts]}
        ranked = sorted(((self._plausible(o, c), i, lay, c, o) for i, (lay, o) in enumerate(self._best.items())
                         for k, c in self._by_layout.get(lay, {}).items() if k not in tried),
                        key=lambda t: (-t[0], t[1]))
        for rate, _, lay, c, o in ranked:
            if rate <= bar and lay not in top:
                continue
            proof = self.judge.assess(c).fits_surely
            if proof is None:
                continue
            desc = " ".join(f"{k}={v}" for k, v in lay)
            return Proposal(dict(c), stage=SETTINGS_STAGE,
                            why=f"stage 2, proven fit after {self._ooms()} OOM (max_ooms={self.max_ooms}): layout "
                                f"{desc} at mbs {c.get('mbs', 1)} with {_rec(c)}{_changed(o.candidate, c)} could "
                                f"reach {self.rate(rate):.4g} by the work it saves over trial {o.trial_number}; "
                                f"{proof}")
        self.stop_reason = (f"the study spent its max_ooms={self.max_ooms}: no untried setting of a measured "
                            f"layout that could beat the best by {100 * self.min_gain:g} % (by the work it saves), "
                            f"nor of the {self.top_layouts} best layouts, is proven to fit")
        return None


def _stage1_share(n_trials: int) -> int:
    """Stage 1's launches when `stage1_trials` is left out: STAGE1_SHARE of the study's budget."""
    return max(1, round(STAGE1_SHARE * n_trials))


def _layout(space, cand: dict) -> tuple:
    n = space.normalize(cand)
    return tuple((k, n[k]) for k in LAYOUT_PARAMS if k in n)


def _changed(was: dict, now: dict) -> str:
    """The virtual pipeline size and overlap switches `now` changes from `was`, as ", vp 1->3, ..."."""
    parts = [f"vp {was.get('vp') or 1}->{now.get('vp') or 1}"] if (was.get("vp") or 1) != (now.get("vp") or 1) else []
    parts += [f"{n} {'on' if now.get(n) else 'off'}" for n in SWITCH_PARAMS if bool(was.get(n)) != bool(now.get(n))]
    return "".join(f", {p}" for p in parts)


def _rec(c: dict) -> str:
    g = c.get("recompute_granularity", "none")
    s = f"recompute {g}" if g != "full" else \
        f"full recompute ({c.get('recompute_method')}, {c.get('recompute_num_layers')} layers)"
    if g == "selective" and c.get("recompute_modules"):
        s += f" ({c['recompute_modules']})"
    if c.get("vit_gradient_checkpointing") is not None:
        s += f", ViT checkpointing {'on' if c['vit_gradient_checkpointing'] else 'off'}"
    return s


def _effects(rows: list[tuple[dict, float]], dims: list[str]) -> dict[str, dict]:
    """Per dimension and value, its effect on the log throughput of the measured runs (`rows`): the
    least-squares fit of an additive model (the mean plus one effect per dimension value), each effect
    shrunk toward 0 by EFFECT_SHRINK (ridge), so a value measured once says less than one measured often.
    Fitted jointly, not as the mean of each value's runs on its own: stage 1's layouts are drawn at random,
    and a value's runs share other values by chance (on the 64-expert MoE on 64 H100 the PP1 layouts
    drawn mostly had CP 2-4 or TP 4-8, so PP1 looked slow and the best layout's PP 2->1 step, the optimum,
    was never taken: 0.874). A candidate measured more than once weighs more, as it should."""
    cols = sorted({(d, lay.get(d)) for lay, _ in rows for d in dims}, key=str)
    at = {c: i for i, c in enumerate(cols)}
    x = np.zeros((len(rows), len(cols)))
    for i, (lay, _) in enumerate(rows):
        for d in dims:
            x[i, at[(d, lay.get(d))]] = 1.0
    y = np.array([r for _, r in rows])
    y = y - y.mean()
    beta = np.linalg.solve(x.T @ x + EFFECT_SHRINK * np.eye(len(cols)), x.T @ y)
    effect: dict[str, dict] = {d: {} for d in dims}
    for (d, v), b in zip(cols, beta):
        effect[d][v] = float(b)
    return effect
