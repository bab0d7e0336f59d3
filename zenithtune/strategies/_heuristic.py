"""The default strategy: deterministic, domain-guided best-first search that learns from every trial.

How it chooses (each launch says which of these made it):

1. The pool: every valid candidate (`Space.walk`, so any n_gpus, divisors included) minus what
   domain knowledge rules out up front: TP beyond one node (its collectives would cross the
   network), CP on sequences too short to hide the ring (fewer than `cp_min_tokens` per rank), and,
   for full recompute with the uniform method, every chunk size but the one needing least memory
   (uniform recomputes every layer whatever the chunk: the chunk only moves memory). If nothing left
   would fit in memory, the rules are dropped rather than give up.
2. A prior for each candidate: `_throughput.predict_tflops`, a coarse model of the iteration (TP
   inside a node, EP all-to-alls and expert GEMM sizes, CP ring, PP bubble, recompute cost, ViT).
   Memory comes from the study's memory model (the estimate, corrected by measured peaks and OOMs).
3. First launch: the highest prior among candidates that fit with a wide margin (`first_fit`), to
   calibrate both the prior and the memory model on something that surely runs.
4. Then, best first: each candidate's prediction is its prior, re-priced with what each of its time
   components (GEMMs, attention, TP/CP/EP/DP communication, pipeline bubble) was measured to cost
   here (`_speed.SpeedModel`, a per-component fit to every measured trial), times a correction learned
   from every measured trial (`_calibration.Residual`, a small Gaussian process over the parallel
   sizes, MBS, recompute mode and per layout), with an uncertainty that grows with the distance to what was
   measured. Of the candidates whose optimistic prediction (+ `kappa` sd) could beat the best measured
   by `min_gain`, launch the one with the best expected outcome: a launch that runs out of memory
   teaches nothing about speed, so each counts as (1 - risk) x optimistic + risk x best, where risk is
   the probability the study's learned memory model gives it of not fitting. Never launched: what the
   memory model screens (or `fit` excludes); the same layout and recompute at an MBS at least as large
   as one that ran out of memory, and without recompute where selective ran out; after an OOM, anything
   carrying more than `oom_risk` of running out, and after `max_ooms` OOMs, anything a run that fit does
   not prove fits (dominance.py; the study loop enforces the same cap for every strategy); for an MoE
   model, a TP / EP / expert-TP split no run that fit had (a dense model's TP too, once it ran out of
   memory there before any run fit on it), or (any model) an MBS over twice the largest
   that fit on its split, or an MBS at or above an MBS step that ran out of memory (above 1 and above
   every MBS that fit holding as many activations) and above the largest that fit holding as many
   activations as it does (full recompute < selective < none), carrying more than NOVEL_RISK of
   running out once its doubt is widened by NOVEL_MEMORY_SD (RISK_DONE where that split ran out of
   memory and never fit), and such a split at an MBS over twice the largest that fit on any split
   (both novelties compound): `max_ooms` is spent where
   runs showed how this trainer uses memory; a larger MBS or more recomputed layers of a layout that
   already lost to a smaller one; a layout that crashed.
   When nothing the screen allows could beat the best, a budgeted memory probe
   (`memory_probes`) may go past the screen: the candidate with the largest expected gain per risk,
   among those the learned memory model gives at most `probe_risk` of running out; a second probe (or
   one after an OOM) only while an OOM of `max_ooms` is left and after everything else (step 5, 7), and
   it is the candidate most likely to fit and beat the best by `min_gain` (below), where one has the
   chance the stop rule asks: the OOM it may spend is the study's last chance to reach a split no run
   that fit proves, so the launch most likely to open one goes, not the largest gain per risk.
   Last, before the study confirms near ties or stops while an OOM of `max_ooms` is left, a screened
   candidate hopeful only through its uncertainty (predicted below the probe's `probe_gain`) is
   probed too, within the same `probe_reach`, `probe_risk` and `memory_probes`: the one most likely
   to fit and beat the best by `min_gain` ((1 - risk) x that chance), where that is at least the
   chance the stop rule asks of a launchable candidate (16 % at `kappa` 1). With none spent, an OOM
   there leaves one of `max_ooms`; a run that fits teaches the memory model the edge, and the speed
   model a layout.
5. Test, don't assume: before stopping, the best layout is measured with full recompute if it won
   without it, and without if it won with it, since some trainers make full the faster; at twice and
   half the best's MBS where no run on that layout had it (`test_mbs`: the MBS gain and its activation
   cost are what trainers differ in most); and each layout
   one TP / PP / CP / EP step (x2 or /2) from the best layout that no run measured is measured once (any
   expert TP where the step cannot keep the best's), its variant of highest prior x (1 - OOM risk) that
   may be launched (`neighbours` per study): a trainer whose law the prior lacks (an all-to-all that
   leaves the node once CP x EP does) hides its optimum next to the best, where a confident prediction
   is no measurement. Then the trades that keep the model-parallel product (TP / PP / CP: one halved,
   another doubled), which hold about the same share of the weights per GPU and so may fit where no
   one-step neighbour does. These tests run earlier, at no more
   than `last_oom_risk`, when the next launch could spend the last OOM `max_ooms` allows at more than
   RISK_DONE: after it, only proven fits run, and a neighbour no run that fit proves is out of reach;
   but not at the budget's last launch before the study loop's confirmations (`free_launches`), where
   nothing follows that the last OOM could be kept for (nor is a launch staked there behind a safer one). A
   launch that could spend that last OOM at more than `last_oom_risk` must also be predicted to beat
   the best by `probe_gain`, as a memory probe must: an optimistic bound alone does not stake it; it waits
   while any launch carrying at most `last_oom_risk` could still beat the best; and with one OOM left the
   best's own tests and the layouts explored (step 7), too, carry no more than `last_oom_risk`. A long
   shot held only to keep the last OOM for what may follow runs once nothing else is left (no hopeful
   launch, test, first probe or unexplored layout), at no more than `last_oom_risk` and alone in its
   wave, before a probe that would spend that OOM past the screen. With one
   OOM left, the memory edge is approached from the safe side: before a launch carrying EDGE_RISK or
   more, the variant of its layout and MBS (another recompute) with the least risk that is still
   predicted to beat the best by `min_gain` runs, and its measurement judges the heavier variants.
6. Noise: a candidate measured more than once counts at the mean of its measurements that no
   straggler slowed (`record.central`: those above the widest gap beyond 10 %). Within
   `repeats` launches, a result that would steer the search on one measurement is measured again
   first: one far from its prediction (beyond 3x the noise and 2 sd) that is near the best or was
   predicted to beat it, one that ends an MBS ladder by coming back slower than the smaller MBS, one
   without recompute slower than the same with recompute (or the reverse: recompute only adds work), two
   measurements that disagree (a third decides), leaving CONFIRM_RESERVE of `repeats` to what follows;
   and before stopping, a best that ran once, and every
   candidate the noise cannot yet tell from the best (within two standard errors of the difference of
   their means, while those could still hide `min_gain`), the rival the noise rules out least (the
   smallest gap in standard errors) first, the fewer-measured of it and the best, up to CONFIRM_RUNS
   runs each (the fewest-measured first until repeats of three candidates measured the noise).
   The noise is `noise` until repeats of three candidates measure it (then at least a quarter of it).
7. Evidence, not the prior, decides when to stop: measurements that contradict the prior's ranking
   (Kendall's tau below CONTRADICTED over clearly ranked pairs) widen every prediction's uncertainty,
   most for candidates whose parallel sizes, alone or in pairs, no run measured (NOVEL_SD), so the
   search explores layouts it has not measured. When the predictions missed by over 35 %
   (EXPLORE_MISSED), the prior does not describe the trainer at all: before stopping, up to
   `explore_layouts` layouts no run measured are measured, in the prior's order. Exhausted when no
   unmeasured candidate could still beat the best: ask() returns None and `stop_reason` says why
   (the study's footer shows it).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Literal

import numpy as np

from zenithtune.record import central, chance_above, gap_in_se, measured_noise, no_recompute, noise_sd, shows_no_noise
from zenithtune.run import FailureKind
from zenithtune.space import LAYOUT_KEYS, SWITCH_PARAMS, settings, switches_at_least
from zenithtune.strategies._base import Outcome, Proposal, Strategy
from zenithtune.strategies._calibration import Residual
from zenithtune.strategies._speed import LEVEL_SD, SpeedModel

if TYPE_CHECKING:
    from zenithtune.assessment import Judge

RISK_DONE = 0.10  # the OOM risk a launch may carry once a study has spent its `max_ooms`
# With one OOM left, a launch carrying at least this risk goes after the variant of its layout and MBS
# carrying the least risk, if one is still predicted to beat the best (`_safe_side`)
EDGE_RISK = 0.05
# With one OOM left, a launch predicted below the best (hopeful only through its uncertainty) runs only
# where a run that fit proves it fits, or at no more than this risk: over 2 sd of margin under the learned
# memory model (on the plain simulator's Mixtral the optimum, TP4 EP8 MBS 1 at 74 of 79 GB, 1 % below
# the best by the prediction, carries ~0; the stand-in Qwen3's long shot that ran out carried 3 %)
LONG_SHOT_RISK = 0.01
# Kendall's tau between the prior's ranking and the measured one below which every prediction's
# uncertainty widens (by 1 + the shortfall: tau 0 -> x1.5, reversed -> x2.5)
CONTRADICTED = 0.5
UNANCHORED_SD = 0.1  # the doubt (log) on a prediction made only from the prior at the others' level
# Once measurements contradict the prior's ranking, the doubt (log) on a candidate whose every pair of
# parallel sizes (tp with ep, cp with ep, ...) no measured run combines: the prior's structure (what
# crosses a node, which all-to-all grows with what) is least tested there; a share of it for a share
# of unseen pairs. It makes the search measure combinations it has not seen before stopping.
NOVEL_SD = 0.15
# Predictions shown to miss by this much (log, `_missed`: 0.3 is 35 %) mean the prior does not describe
# this trainer at all (a tiny model on CPU, where latencies the prior weighs for GPUs decide nothing):
# then, before stopping, the layouts no run measured are measured (`explore_layouts` of them).
EXPLORE_MISSED = 0.3
EXPLORE_WHY = "explore"
NEIGHBOUR_WHY = "test, don't assume: a neighbour"


# Memory on ground no run that fit has covered -- an MoE model's TP / EP / expert-TP split none of them had
# (where trainers differ by whole factors: expert activations divided by expert TP rather than TP under MoE
# parallel folding), a dense model's TP that ran out of memory before any run fit on it, or an MBS more
# than twice the largest that fit on its split (buffers per extra sample) -- is uncertain beyond what the
# learned model knows: its prediction is taken to be off by NOVEL_MEMORY_SD (log, 1 sd: x1.35) on top of
# the model's own sd, and such a launch may carry at most NOVEL_RISK of running out of memory. The
# `max_ooms` budget is spent where runs have shown how this trainer uses memory, not on the first guesses
# about a layout nothing measured.
NOVEL_MEMORY_SD = 0.3
NOVEL_RISK = 0.25


# Measurements of one candidate at most, before stopping, to tell it from a best the noise could have
# decided (3 % run-to-run noise: the mean of 4 runs is within 1.5 %)
CONFIRM_RUNS = 4
# Of `repeats`, this many (at most a third) are kept for the confirmations before stopping: surprises
# (outliers) do not spend them all.
CONFIRM_RESERVE = 4


def _lay(c: dict, vp: bool = True) -> tuple:
    """The layout a candidate runs (its virtual pipeline size included unless `vp` is False)."""
    return tuple(c.get(k) for k in LAYOUT_KEYS if vp or k != "vp")


def _sizes(c: dict) -> tuple:
    """A layout's TP, PP, CP and EP sizes, whatever its expert TP and virtual pipeline size."""
    return ("sizes", c.get("tp"), c.get("pp"), c.get("cp"), c.get("ep"))


def _split(c: dict) -> tuple:
    """How a candidate splits the model's tensors: TP, EP, expert TP (memory laws differ most here)."""
    return c.get("tp"), c.get("ep"), c.get("etp")


def _held(c: dict) -> int:
    """How many of a layer's activations a candidate holds: 0 with full recompute, 1 selective, 2 none."""
    g = c.get("recompute_granularity") or "none"
    return 0 if g == "full" else 1 if g == "selective" else 2


def _rec(c: dict) -> tuple:
    g = c.get("recompute_granularity")
    return (g, c.get("recompute_method")) if g == "full" else (g, c.get("recompute_modules"))


@dataclass(frozen=True)
class _Forecast:
    """The learned model's view of the unmeasured candidates `at` (pool indices), one entry each."""
    at: np.ndarray
    pred: np.ndarray  # predicted speed, in the metric's unit
    sd: np.ndarray  # its uncertainty, in log space
    ucb: np.ndarray  # prediction + kappa sd: whether it could beat the best
    taught: np.ndarray  # what the runs taught on top of the prior (the residual's factor, unit change excluded)
    unit: float  # the unit change from the prior's TFLOP/s/GPU to the metric's (1 for TFLOP/s)
    basis: str  # what the prediction rests on, for the reasons


class HeuristicStrategy(Strategy):
    confirms_best = True  # its repeats (`repeats`) confirm a best the noise could have decided
    def __init__(self, first_fit: float = 0.85, fit: float | None = None, kappa: float = 1.0, min_gain: float = 0.01,
                 cp_min_tokens: int = 4096, tp_within_node: bool = True, test_both_granularities: bool = True,
                 memory_probes: int = 2, probe_reach: float = 0.10, probe_gain: float = 0.02, max_ooms: int = 2,
                 oom_risk: float = 0.5, probe_risk: float = 0.95, repeats: int = 20, noise: float = 0.02,
                 explore_layouts: int = 4, neighbours: int = 6, last_oom_risk: float = 0.25, test_mbs: bool = True):
        for name, v in (("first_fit", first_fit), ("fit", fit)):
            if v is not None and not 0 < v <= 1.5:
                raise ValueError(f"{name}={v} must be a share of GPU memory in (0, 1.5] (e.g. 0.85)")
        self.first_fit = float(first_fit)  # predicted memory share the first launch may use
        # ... later launches; None: whatever the study's memory model does not screen out
        self.fit = None if fit is None else float(fit)
        if not 0 <= min_gain < 1:
            raise ValueError(f"min_gain={min_gain} must be in [0, 1) (0.01: a launch must promise 1 % more)")
        self.min_gain = float(min_gain)  # a launch must promise at least this much over the best
        self.kappa = float(kappa)  # optimism: a candidate is worth a launch if prediction + kappa sd beats the best
        self.cp_min_tokens = int(cp_min_tokens)
        self.tp_within_node = bool(tp_within_node)
        self.test_both_granularities = bool(test_both_granularities)
        self.test_mbs = bool(test_mbs)  # measure the best layout at twice (and half) the best's MBS before stopping
        if memory_probes < 0 or not 0 <= probe_reach <= 0.5 or not 0 <= probe_gain < 1 or not 0 < probe_risk <= 1:
            raise ValueError(f"memory_probes={memory_probes} (>= 0), probe_reach={probe_reach} (0..0.5), "
                             f"probe_gain={probe_gain} (0..1) or probe_risk={probe_risk} (0..1) is out of range")
        self.memory_probes = int(memory_probes)  # launches allowed past the memory screen per study
        self.probe_reach = float(probe_reach)  # ... only up to capacity x (1 + this) predicted
        self.probe_gain = float(probe_gain)  # ... and only when predicted to beat the best by this much
        self.probe_risk = float(probe_risk)  # ... and not when the learned memory model all but rules it out
        if max_ooms < 0 or not 0 < oom_risk <= 1 or not 0 < last_oom_risk <= 1:
            raise ValueError(f"max_ooms={max_ooms} (>= 0), oom_risk={oom_risk} or last_oom_risk={last_oom_risk} "
                             f"(0..1, 0.25: one launch in four may run out of memory) is out of range")
        # Launches out of memory a study may spend: once the study has seen one, the memory model has been
        # shown optimistic near the limit, and a launch must carry at most `oom_risk` of running out;
        # once it has seen `max_ooms`, only what is all but certain to fit (RISK_DONE) is launched.
        self.max_ooms = int(max_ooms)
        self.oom_risk = float(oom_risk)
        # A launch that could spend the last of them carries at most this risk while the best's own tests (its
        # other recompute granularity, its one-step neighbours) can still run at no more (`_before_last_oom`).
        self.last_oom_risk = float(last_oom_risk)
        if repeats < 0 or not 0 <= noise < 0.5:
            raise ValueError(f"repeats={repeats} (>= 0) or noise={noise} (0..0.5, 0.02: runs of one candidate "
                             f"differ by about 2 %) is out of range")
        # Launches a study may spend measuring a candidate again: a result that reverses a ladder or lands
        # far from its prediction, and a best whose runner-up is within the noise (each counts as a launch).
        self.repeats = int(repeats)
        self.noise = float(noise)  # run-to-run noise assumed until repeats measure it (relative sd)
        if explore_layouts < 0:
            raise ValueError(f"explore_layouts={explore_layouts} must be >= 0 (4: launches that may measure "
                             f"layouts no run measured when the predictions proved wrong)")
        self.explore_layouts = int(explore_layouts)
        if neighbours < 0:
            raise ValueError(f"neighbours={neighbours} must be >= 0 (6: launches that may measure the layouts one "
                             f"parallel size away from the best before stopping)")
        self.neighbours = int(neighbours)
        self._predicted: dict[tuple, tuple[float, float]] = {}  # key -> (predicted rate, log sd) when proposed
        self._pending: list[dict] = []  # this wave's proposals not yet told (ask's `pending`)

    @property
    def past_screen(self) -> int:
        return self.memory_probes if self.max_ooms > 0 else 0

    # --- the pool -----------------------------------------------------------------------------------
    def setup(self, judge: Judge, history: list[Outcome], direction: Literal["maximize", "minimize"] = "maximize",
              metric: str = "TFLOP/s/GPU") -> None:
        super().setup(judge, history, direction, metric)
        ctx, space = self.ctx, self.space
        valid = list(space.walk())
        self._dropped: dict[str, int] = {}
        pool = [c for c in valid if self._domain_ok(c)]
        if not any(self._fits(c, None)[0] for c in pool):  # e.g. a model only TP across nodes can hold
            pool, self._dropped = valid, {"nothing left fits: domain rules dropped": len(valid)}
        self._pool = self._one_uniform_chunk(pool)
        self._keys = [space.key(c) for c in self._pool]
        varied = [k for k in LAYOUT_KEYS if len({c.get(k) for c in self._pool}) > 1]
        # what a candidate's layout combines: each varied size alone, and each pair of them
        self._pairs = [[(a, c.get(a)) for a in varied]
                       + [(a, c.get(a), b, c.get(b)) for i, a in enumerate(varied) for b in varied[i + 1:]]
                       for c in self._pool]
        self._index = {k: i for i, k in enumerate(self._keys)}
        # the throughput prior of every candidate (TFLOP/s), with the per-component multipliers learned
        # so far (`_speed`): ask() refits them to the measured runs and updates _prior
        self._speed_model = SpeedModel(self._pool, model=ctx.model, n_gpus=ctx.n_gpus, gbs=ctx.gbs,
                                       gpus_per_node=ctx.gpus_per_node)
        self._prior = self._speed_model.prior
        self._prior0 = self._prior.copy()  # as written, before any measurement: its ranking is tested
        self._residual = Residual(self._pool, gpus_per_node=ctx.gpus_per_node, n_gpus=ctx.n_gpus,
                                  num_layers=ctx.model.num_layers or 32)

    def _domain_ok(self, c: dict) -> bool:
        ctx = self.ctx
        why = None
        if self.tp_within_node and c.get("tp", 1) > ctx.gpus_per_node:
            why = "tp across nodes"
        s = ctx.model.seq_length
        if c.get("cp", 1) > 1 and s and s // c["cp"] < self.cp_min_tokens:
            why = f"cp on a short sequence (< {self.cp_min_tokens} tokens per rank)"
        if why:
            self._dropped[why] = self._dropped.get(why, 0) + 1
        return why is None

    def _one_uniform_chunk(self, pool: list[dict]) -> list[dict]:
        """Keep, per (layout, mbs, vit), only the uniform chunk size with the least estimated memory."""
        best: dict[tuple, tuple[float, int]] = {}
        for i, c in enumerate(pool):
            if c.get("recompute_method") == "uniform":
                k = (_lay(c), c.get("mbs"), settings(c))
                gb = self.judge.assess(c).predicted_gb
                gb = gb if gb is not None else float(c.get("recompute_num_layers") or 1)
                if k not in best or gb < best[k][0]:
                    best[k] = (gb, i)
        keep = {i for _, i in best.values()}
        return [c for i, c in enumerate(pool) if c.get("recompute_method") != "uniform" or i in keep]

    # --- memory -------------------------------------------------------------------------------------
    def _novel(self, c: dict) -> tuple[str, float] | None:
        """What of `c` no run that fit has covered (NOVEL_MEMORY_SD), and the OOM risk a launch of it may
        carry; None when runs cover it (or none fit yet)."""
        if getattr(self, "_covered_at", None) != len(self.history):
            self._covered: dict[tuple, int] = {}  # split -> the largest MBS a run that fit had on it
            self._split_ooms: dict[tuple, int] = {}  # split -> a trial that ran out of memory on it
            self._mbs_ooms: dict[tuple[int, int], int] = {}  # (mbs, `_held`) -> a trial that ran out of memory so
            self._fit_mbs: dict[int, int] = {}  # activations held (`_held`) -> the largest MBS a run that fit had
            for o in self.history:
                k, m, h = _split(o.candidate), int(o.candidate.get("mbs", 1)), _held(o.candidate)
                if o.ok:
                    self._covered[k] = max(self._covered.get(k, 0), m)
                    self._fit_mbs[h] = max(self._fit_mbs.get(h, 0), m)
                elif o.launched and o.kind == FailureKind.OOM:
                    self._split_ooms.setdefault(k, o.trial_number or 0)
                    self._mbs_ooms.setdefault((m, h), o.trial_number or 0)
            self._covered_at = len(self.history)
        if not self._covered:
            return None
        mbs = int(c.get("mbs", 1))
        # MBS steps that ran out of memory: above 1 and above every MBS that fit holding as many activations
        shown = [(m, t) for (m, h), t in self._mbs_ooms.items() if 1 < m <= mbs and m > self._fit_mbs_held(h)]
        fit_here = self._fit_mbs_held(_held(c))
        if shown and mbs > fit_here:
            # the trainer's activations at this MBS are shown to exceed the estimate, and no run says by how
            # much; a run that fit at this MBS with full recompute held a fraction of them (robustness.py,
            # GQA-13B on 16 A100, memory trainer: TP2 CP4 at MBS 8 without recompute ran out; the best's MBS
            # test, TP4 MBS 8 with selective recompute, predicted 74 of 79 GB, spent the last OOM, after
            # which no run proved the optimum's TP2 PP1 fits: 0.979)
            m, t = min(shown)
            return (f"mbs {mbs}, where mbs {m} ran out of memory (trial {t}) and no run that fit holding as many "
                    f"activations was as large ({fit_here})"), NOVEL_RISK
        top = self._covered.get(_split(c))
        if top is None and not self.ctx.model.num_experts and _split(c) not in self._split_ooms:
            # a dense model's memory splits by TP as the estimate says (weights / tp, activations / tp
            # with sequence parallelism); only the MBS is new ground -- until a TP that never fit ran out
            # of memory, which shows the law other than the estimate's there
            top = max(self._covered.values())
        if top is None:
            oom = self._split_ooms.get(_split(c))
            if oom is not None:  # its law is shown to be other than the model's, and no run says which
                return f"a tp/ep/etp split that ran out of memory (trial {oom}) and never fit", RISK_DONE
            widest = max(self._covered.values())
            if mbs > 2 * widest:
                # both novelties at once compound beyond any widening of one prediction: the split's law and
                # activations that grow faster than the MBS (the 64-expert MoE on the stand-in trainer: TP 4
                # / EP 8 at MBS 8, predicted 27 GB after one run at MBS 2, ran out of memory as the 2nd launch)
                return (f"a tp/ep/etp split no run that fit had, at mbs {c.get('mbs')}, over twice the largest "
                        f"that fit on any ({widest})"), 0.0
            return "a tp/ep/etp split no run that fit had", NOVEL_RISK
        if mbs > 2 * top:
            return f"mbs {c.get('mbs')}, over twice the largest that fit on its split ({top})", NOVEL_RISK
        return None

    def _fit_mbs_held(self, held: int) -> int:
        """The largest MBS a run that fit had holding at least `held` activations (`_held`), 0 if none."""
        return max((m for h, m in self._fit_mbs.items() if h >= held), default=0)

    def _risk(self, c: dict) -> tuple[float, tuple[str, float] | None]:
        """The OOM risk a launch of `c` carries and, where no run covered it, what and the risk allowed
        (then the risk is the learned model's, widened by NOVEL_MEMORY_SD)."""
        a = self.judge.assess(c)
        gb = a.predicted_gb
        novel = None if a.fits_surely or a.proven_fit or gb is None else self._novel(c)
        if novel is None or gb is None:
            return a.oom_risk, None
        sd = math.hypot(a.sd or 0.0, NOVEL_MEMORY_SD * gb)
        return max(a.oom_risk, chance_above((self.judge.capacity_gb - gb) / sd)), novel

    def _fits(self, c: dict, share: float | None) -> tuple[bool, str]:
        a = self.judge.assess(c)
        if a.predicted_oom:
            return False, a.predicted_oom
        gb = a.predicted_gb
        if gb is None:
            return True, "memory unknown"
        cap = self.judge.capacity_gb
        if share is not None and gb > share * cap:
            return False, f"{gb:.0f}/{cap:g} GB"
        risk, novel = self._risk(c)
        if novel and not novel[1]:
            return False, f"{gb:.0f}/{cap:g} GB on {novel[0]}: its split is measured at a smaller mbs first"
        if novel and risk > novel[1]:
            return False, (f"{gb:.0f}/{cap:g} GB on {novel[0]}: a {100 * risk:.0f} % risk of running out of "
                           f"memory, above {100 * novel[1]:g} % where no run measured this trainer's memory")
        ooms = self._ooms()
        if ooms:
            allowed = RISK_DONE if ooms >= self.max_ooms else self.oom_risk
            if self._budget_spent():
                # budget spent: only what a run that fit proves fits, by structure (the study loop's rule)
                if a.fits_surely is None:
                    return False, (f"{gb:.0f}/{cap:g} GB, not proven to fit by a run that fit after {ooms} OOM "
                                   f"(max_ooms={self.max_ooms})")
                return True, f"{gb:.0f}/{cap:g} GB, {a.fits_surely}"
            if risk > allowed:
                return False, (f"{gb:.0f}/{cap:g} GB carries a {100 * risk:.0f} % risk of running out of memory, "
                               f"above {100 * allowed:g} % after {ooms} OOM")
        return True, f"{gb:.0f}/{cap:g} GB"

    # --- what the measurements say ------------------------------------------------------------------
    def _speed(self, o: Outcome) -> float:
        """Measured value as a rate (higher is better) comparable with the prior."""
        return self.rate(float(o.value))  # type: ignore[arg-type]

    def _shown(self, speed: float) -> str:
        """A rate as the evaluator reports it (s/it for ms-swift is the inverse of a rate)."""
        v = speed if self.direction == "maximize" else 1.0 / max(speed, 1e-12)
        return f"{v:.0f}" if abs(v) >= 100 else f"{v:.3g}"

    def _ruled_out(self, c: dict, reps: dict[tuple, Outcome]) -> str | None:
        """Why measurements rule this candidate out, or None (`reps`: one outcome per measured candidate,
        at `record.central` of its measurements)."""
        lay, rec, mbs = _lay(c), _rec(c), c.get("mbs", 1)
        for o in self.history:
            oc = o.candidate
            if not o.launched or _lay(oc) != lay:
                continue
            if o.state == "failed" and o.kind not in (FailureKind.OOM, None):
                return f"layout failed in trial {o.trial_number} ({o.kind})"
            if o.kind != FailureKind.OOM or mbs < oc.get("mbs", 1) or not switches_at_least(c, oc) or \
                    c.get("vit_gradient_checkpointing") not in (oc.get("vit_gradient_checkpointing"), False):
                continue
            if _rec(oc) == rec and c.get("recompute_num_layers") == oc.get("recompute_num_layers"):
                return f"same layout and recompute as trial {o.trial_number}, which ran out of memory, at mbs >= its"
            if rec[0] in (None, "none") and _rec(oc)[0] == "selective":
                # no recompute holds all that selective recompute frees, and the allocator fragments alike (a
                # probe spent the last OOM on TP1 CP2 EP8 MBS 4 without recompute right after the same at MBS
                # 4 with selective recompute ran out). Not after full recompute ran out: it frees and
                # re-allocates every recomputed layer's working set, and without it the same layout can fit
                # (search.py, Llama-3-70B on 32 H100: TP4 PP4 CP2 ran out with full/block/1, the optimum is
                # that layout without recompute)
                return (f"same layout as trial {o.trial_number}, which ran out of memory with selective recompute, "
                        f"at mbs >= its without recompute")
        bad = self.judge.assess(c).oom_dominated
        if bad is not None:  # the study loop would not launch it either
            return bad
        # dominance along the ladders of one layout: a larger MBS (same recompute) or more block
        # layers (same MBS) that already lost against a smaller one is not pushed further
        same = [o for o in reps.values() if _lay(o.candidate) == lay and _rec(o.candidate) == rec]
        for a in same:
            for b in same:
                ab, bb = a.candidate.get("mbs", 1), b.candidate.get("mbs", 1)
                if ab < bb < mbs and a.candidate.get("recompute_num_layers") == b.candidate.get("recompute_num_layers") \
                        and self._speed(b) < self._speed(a):
                    return f"mbs {bb} already lost to mbs {ab} (trials {b.trial_number}, {a.trial_number})"
                if rec[1] == "block" and ab == bb == mbs:
                    an, bn = a.candidate.get("recompute_num_layers", 0), b.candidate.get("recompute_num_layers", 0)
                    if an < bn < c.get("recompute_num_layers", 0) and self._speed(b) < self._speed(a):
                        return f"recomputing {bn} layers already lost to {an} (trials {b.trial_number}, {a.trial_number})"
        return None

    # --- proposing ----------------------------------------------------------------------------------
    def ask(self, pending: Sequence[dict] = ()) -> Proposal | None:
        self.stop_reason = ""
        self._pending = list(pending)
        tried = self.tried_keys(pending)  # told, or pending in this wave (parallel_trials): the next best
        reps = self._reps()  # one outcome per measured candidate, at the mean of its unslowed measurements
        ok = list(reps.values())
        if not ok:
            return self._first(tried)
        best = max(ok, key=self._speed)
        target = self._speed(best)
        noise = self._noise_sd()
        learned = self._learn_speed(reps)
        again = self._surprise(reps, target, noise)
        if again is not None:
            return again
        at = np.array([i for i, k in enumerate(self._keys) if k not in tried], dtype=int)
        if not len(at):
            return self._confirm(reps, best, noise, "every candidate of the pool was measured")
        fc = self._forecast(reps, at, noise, learned)
        # Of the candidates that could beat the best, the one with the best expected outcome first: near
        # the memory limit a launch may run out of memory and teach nothing about speed, so a candidate's
        # optimistic value counts only as far as it fits (expected best after it = (1-risk) ucb + risk best).
        hopeful = np.flatnonzero(fc.ucb > target * (1 + self.min_gain))
        risk = np.array([self._risk(self._pool[at[j]])[0] for j in hopeful])
        risk_of = dict(zip(hopeful.tolist(), risk.tolist()))
        order = hopeful[np.argsort(-((1 - risk) * fc.ucb[hopeful] + risk * target), kind="stable")]
        return self._walk(order, risk_of, fc, best, tried, reps, noise)

    @property
    def _tflops(self) -> bool:
        """Scored in the prior's own unit (TFLOP/s/GPU), not s/it, samples/s or a regex's number."""
        return self.metric.startswith("TFLOP/s")

    def _learn_speed(self, reps: dict[tuple, Outcome]) -> str:
        """Refit what each component of the iteration costs here (EP all-to-all, pipeline bubble, ...) to
        every measured run; it re-orders the pool's prior (`_prior`), the residual corrects what it cannot
        express. Returns what was learned, for the reasons."""
        rates = [(self._index[k], math.log(self._speed(o))) for k, o in reps.items() if k in self._index]
        level_sd = LEVEL_SD if self._tflops else None
        self._speed_model.fit([i for i, _ in rates], [v for _, v in rates], level_sd=level_sd)
        self._prior = self._speed_model.prior
        learned = self._speed_model.learned()
        return f"; {learned} learned" if learned else ""

    def _forecast(self, reps: dict[tuple, Outcome], at: np.ndarray, noise: float, learned: str) -> _Forecast:
        """The learned model's prediction, uncertainty and optimistic value for the unmeasured candidates `at`."""
        measured = [(self._index[k], math.log(self._speed(o)) - math.log(self._prior[self._index[k]]))
                    for k, o in reps.items() if k in self._index]
        # The prior is in model TFLOP/s/GPU. Scored in another unit (s/it, samples/s, a regex's number),
        # the residuals share one large offset, the unit conversion: take it out before the correction
        # is learned (whose shrinkage toward the prior would otherwise predict nonsense) and put it back.
        offset = 0.0 if self._tflops else float(np.mean([r for _, r in measured]))
        mean, sd, trust = self._residual.predict([i for i, _ in measured], [r - offset for _, r in measured], at,
                                                 noise=noise)
        if self._speed_model.sd.any():  # what the fitted multipliers leave uncertain adds to the residual's
            sd = np.sqrt(sd ** 2 + self._speed_model.sd[at] ** 2)
        sd, contradicted = self._widened(sd, reps, at)
        n = len(measured)
        basis = (f"learned from {n} run{'' if n == 1 else 's'}{'' if trust == 1 else f', prior trusted 1/{trust:g}'}"
                 f"{learned}{contradicted}")
        return _Forecast(at=at, pred=self._prior[at] * np.exp(mean + offset), sd=sd,
                         ucb=self._prior[at] * np.exp(mean + offset + self.kappa * sd), taught=np.exp(mean),
                         unit=math.exp(offset), basis=basis)

    def _why(self, j: int, fc: _Forecast, best: Outcome) -> str:
        cand = self._pool[fc.at[j]]
        # in the metric's own unit: the prior after the unit change, times what the runs taught
        ratio = float(fc.taught[j]) ** (1 if self.direction == "maximize" else -1)
        scale = f"{ratio:.2f}" if 0.01 <= ratio < 100 else f"{ratio:.3g}"
        return (f"{self._role(cand, best.candidate)}: predicted {self._shown(fc.pred[j])} +-{100 * fc.sd[j]:.0f}% "
                f"(prior {self._shown(self._prior[fc.at[j]] * fc.unit)} {self.metric} x {scale} {fc.basis}) "
                f"could beat best {self._shown(self._speed(best))}")

    def _walk(self, order: np.ndarray, risk_of: dict[int, float], fc: _Forecast, best: Outcome, tried: set[tuple],
              reps: dict[tuple, Outcome], noise: float) -> Proposal | None:
        """The first of the hopeful candidates (`order`) the rules and the memory screen let run; else a
        memory probe, the best's tests, a layout never measured, or the best's confirmation."""
        at, pred, target = fc.at, fc.pred, self._speed(best)
        probe = long_shot = chance_probe = None
        ruled = unfit = 0
        staked: tuple[Proposal, int] | None = None  # a launch that could spend the last OOM, while a safer one is sought
        for j in order:
            cand = self._pool[at[j]]
            if self._ruled_out(cand, reps):
                ruled += 1
                continue
            r = risk_of[int(j)]
            screened, why_not = self._fits(cand, self.fit)
            fits, mem = self._stake(cand, screened, why_not, r, float(pred[j]) / target)
            why = self._why(int(j), fc, best)
            if screened and not fits and long_shot is None and r <= self.last_oom_risk and not self._pending:
                # held only to keep the last OOM for what may follow; when nothing else is left, it goes
                # (at no more than last_oom_risk, and alone: no launch of this wave may spend that OOM first)
                long_shot = (Proposal(dict(cand), why=f"{why}; {why_not}; a long shot held back while anything else "
                                      f"was left: nothing is, so the last OOM max_ooms={self.max_ooms} allows is "
                                      f"risked ({100 * r:.0f} %) on the one with the best expected outcome"), int(j))
            if fits:
                now = self._before_staking(cand, r, int(j), fc, (best, tried, reps), staked is None, f"{why}; {mem}")
                if now is not None:
                    return now
                if self._one_oom_left() and r > self.last_oom_risk:
                    # The last OOM max_ooms allows is staked only when no launch that carries at most
                    # last_oom_risk could beat the best: after it, only proven fits run.
                    if staked is None:
                        staked = (Proposal(dict(cand), why=f"{why}; {mem}; no launch carrying at most "
                                           f"{100 * self.last_oom_risk:g} % risk of running out of memory could "
                                           f"beat the best, so the last OOM max_ooms={self.max_ooms} allows is "
                                           f"staked ({100 * r:.0f} %)"), int(j))
                    continue
                if staked is not None:
                    why += (f"; first, before the last OOM max_ooms={self.max_ooms} allows is staked "
                            f"({100 * risk_of[staked[1]]:.0f} %) on {_at(staked[0].fixed)} {_rec_desc(staked[0].fixed)}")
                k = self._safe_side(cand, r, target * (1 + self.min_gain), at, pred, tried, reps)
                if k is not None:
                    return self._from_safe_side(k, cand, r, fc, best)
                self._remember(fc, int(j))
                return Proposal(dict(cand), why=f"{why}; {mem}")
            unfit += 1
            r = max(r, 0.01)
            if r > self.probe_risk or not self._probe_ok(cand):
                continue
            chance_probe = self._chance_probe(chance_probe, cand, r, fc, int(j), target, f"{why}, though {mem}")
            if pred[j] > target * (1 + self.probe_gain):
                # the probe worth most: expected gain per risk of running out of memory
                worth = (1 - r) * (pred[j] / target - 1) / r
                if probe is None or worth > probe[0]:
                    probe = (worth, Proposal(dict(cand), probe_memory=True,
                                             why=f"memory probe: {why}, though {mem}; {100 * r:.0f} % risk of "
                                                 f"running out of memory for the best expected gain per risk"))
        if staked is not None:
            proposal, j = staked
            # staked, the edge is still approached from the safe side: the variant of its layout and MBS
            # carrying the least risk that is predicted above the bar (the 64-expert MoE on the stand-in:
            # MBS 2 with selective recompute spent the last OOM at 46 %; full/block/7, 33 %, the optimum,
            # was never launched: 0.925)
            k = self._safe_side(proposal.fixed, risk_of[int(j)], target * (1 + self.min_gain), at, pred, tried, reps)
            if k is not None:
                return self._from_safe_side(k, proposal.fixed, risk_of[int(j)], fc, best)
            self._remember(fc, int(j))
            return proposal
        # A long shot with a real chance (its optimistic value beats the best) that the OOM cap still allows
        # runs before the study settles for confirmations or stops: the last OOM is kept only for launches
        # that may follow it, and none other is left (the 64-expert MoE on the stand-in with noise: TP1
        # EP8, the optimum at 54 of 79 GB and 7 % risk, predicted 21 % below the best, was held while the
        # last 10 launches confirmed near ties: 0.896). It goes before a probe that would spend that OOM
        # past the screen, at more risk.
        found = self._before_stopping(best, tried, reps, probe[1] if probe else None,
                                      long_shot[0] if long_shot else None,
                                      chance_probe[1] if chance_probe else None)
        if long_shot is not None and found is long_shot[0]:
            self._remember(fc, long_shot[1])
        return found or self._confirm(reps, best, noise, self._nothing_left(len(order), ruled, unfit, target))

    def _chance_probe(self, found: tuple[float, Proposal] | None, cand: dict, r: float, fc: _Forecast, j: int,
                      target: float, why: str) -> tuple[float, Proposal] | None:
        """A screened candidate hopeful only through its uncertainty, as the probe before stopping (one within
        `probe_risk` and `probe_reach`), or the probe that may spend the last OOM: while an OOM of `max_ooms` is
        left, its chance to fit and beat the best by `min_gain` ((1 - r) x the chance its prediction gives),
        where that is at least what the stop rule asks of a launchable candidate (`_chance`): that chance and
        the probe if it beats `found` (the best so far of the forecast `fc`'s candidates), else `found`.
        robustness.py, Mixtral on the speed trainer with noise: stopped after 9 of 50 launches, no OOM spent,
        the screen hiding 2288 hopeful candidates (0.963); without the chance floor search.py's Llama-3-8B
        spent an OOM on a 12 % fit."""
        spent = self._ooms()  # below max_ooms: `_probe_ok` admitted the candidate
        bar = target * (1 + self.min_gain)
        worth = (1 - r) * chance_above(math.log(bar / max(float(fc.pred[j]), 1e-9)) / max(float(fc.sd[j]), 1e-9))
        if worth < self._chance() or (found is not None and worth <= found[0]):
            return found
        return worth, Proposal(dict(cand), probe_memory=True, why=(
            f"memory probe before stopping: {why}; {100 * r:.0f} % risk of running out of memory; with "
            f"{spent or 'none'} of max_ooms={self.max_ooms} spent, the candidate hidden only by the memory estimate "
            f"most likely to fit and beat the best"))

    def _remember(self, fc: _Forecast, j: int) -> None:
        """What a launch was predicted at, for `_surprise` and the missed-prediction count once it ran."""
        self._predicted[self._keys[fc.at[j]]] = (float(fc.pred[j]), float(fc.sd[j]))

    def _from_safe_side(self, k: int, cand: dict, r: float, fc: _Forecast, best: Outcome) -> Proposal:
        safer = self._pool[fc.at[k]]
        self._remember(fc, k)
        return Proposal(dict(safer), why=(
            f"{self._role(safer, best.candidate)}: predicted {self._shown(fc.pred[k])} could beat best "
            f"{self._shown(self._speed(best))}; {self._fits(safer, self.fit)[1]}; the memory edge approached from "
            f"the safe side: first, with one OOM of max_ooms={self.max_ooms} left, the variant of "
            f"{_rec_desc(cand)} (a {100 * r:.0f} % risk of running out) needing least risk "
            f"({100 * self._risk(safer)[0]:.0f} %) that is still predicted to beat the best"))

    def _before_stopping(self, best: Outcome, tried: set[tuple], reps: dict[tuple, Outcome],
                         probe: Proposal | None, long_shot: Proposal | None = None,
                         chance_probe: Proposal | None = None) -> Proposal | None:
        """When nothing the screen allows could beat the best: the best's own tests (those that could not
        spend the last OOM at more than `last_oom_risk` first), the memory probe, the layouts never measured,
        the long shot held for the last OOM. A second probe, or one after an OOM, comes last: it may spend
        the last OOM `max_ooms` allows, after which only proven fits run, so it goes only where nothing else
        is left to learn and the learned model still predicts a gain past the screen (a first probe that ran
        out on one split leaves the others untried); it is the candidate most likely to fit and beat the best
        (`chance_probe`), where one has the chance the stop rule asks, else the one of largest expected gain
        per risk. After all of them, with no OOM spent, the probe of a candidate hopeful only through its
        uncertainty (`chance_probe`). (robustness.py, Mixtral on the plain trainer with noise, seed 1: with one
        OOM left, the probe of largest gain per risk, TP1 PP4 CP2 at an 80 % risk, ran out; the study then
        could launch only proven fits, all on the TP2 splits it had measured, and stopped at 0.901. The one
        most likely to fit and beat the best, TP4 PP1 CP2 EP8, opened the optimum's split: 0.992.)"""
        tests = self._bests_tests(best, tried, reps, self.last_oom_risk if self._one_oom_left() else 1.0)
        if self._ooms() or any(o.probe for o in self.history):  # this probe may spend the last OOM
            return tests or self._unmeasured_layout(tried, reps) or long_shot or chance_probe or probe
        return tests or probe or self._unmeasured_layout(tried, reps) or long_shot or chance_probe

    def _novelty(self, at: np.ndarray, reps: dict[tuple, Outcome]) -> np.ndarray:
        """Per candidate, sqrt(share of its parallel sizes, alone and in pairs, that no measured run has)."""
        seen = {p for k in reps if k in self._index for p in self._pairs[self._index[k]]}
        return np.array([math.sqrt(sum(p not in seen for p in self._pairs[i]) / len(self._pairs[i]))
                         if self._pairs[i] else 0.0 for i in at])

    def _widened(self, sd: np.ndarray, reps: dict[tuple, Outcome], at: np.ndarray) -> tuple[np.ndarray, str]:
        """Measurements that contradict the prior's ranking (not only its scale) make every prediction
        less certain, so the search explores what it has not measured instead of trusting the prior:
        most where no measured run has its parallel sizes (NOVEL_SD)."""
        tau = self._agreement(reps)
        widen = 1.0 + max(0.0, CONTRADICTED - tau)
        if widen == 1:
            return sd, ""
        sd = np.sqrt(sd ** 2 + (NOVEL_SD * self._novelty(at, reps)) ** 2)
        return sd * widen, f"; prior's ranking contradicted (tau {tau:+.2f}), uncertainty x{widen:.1f}"

    def _unmeasured_layout(self, tried: set[tuple], reps: dict[tuple, Outcome]) -> Proposal | None:
        """Before stopping, when the predictions proved wrong (EXPLORE_MISSED): the layout no run measured
        whose best candidate has the highest (corrected) prior, that candidate; at most
        `explore_layouts` per study. The prior's ranking of layouts is what such a trainer contradicts."""
        missed = self._missed(reps)
        if missed < EXPLORE_MISSED or \
                sum(1 for o in self.history if (o.why or "").startswith(EXPLORE_WHY)) >= self.explore_layouts:
            return None
        measured = {_lay(o.candidate, vp=False) for o in self.history if o.launched} | \
            {_lay(c, vp=False) for c in self._pending}
        for i in np.argsort(-self._prior, kind="stable"):
            cand = self._pool[i]
            if _lay(cand, vp=False) in measured or self._keys[i] in tried or self._ruled_out(cand, reps):
                continue
            fits, mem = self._fits(cand, self.fit)
            if fits and self._one_oom_left() and self._risk(cand)[0] > self.last_oom_risk:
                continue  # not the last OOM max_ooms allows: a variant of the layout needing less memory
            if fits:
                return Proposal(dict(cand), why=f"{EXPLORE_WHY}: predictions missed by {100 * missed:.0f} %, so "
                                f"layout {self._layout_note(cand)} is measured although the prior ranks it low; "
                                f"{mem}")
            measured.add(_lay(cand, vp=False))  # its best by the prior does not fit: the next layout
        return None

    def _missed(self, reps: dict[tuple, Outcome]) -> float:
        """How far (log, median, x1.25: about one sd) measurements landed from what the search predicted
        when it launched them."""
        off = [abs(math.log(self._speed(o) / self._predicted[k][0])) for k, o in reps.items() if k in self._predicted]
        return 1.25 * float(np.median(off)) if off else 0.0

    def _chance(self) -> float:
        """The chance a candidate must have to beat the best by `min_gain` for the study not to stop: that
        of a prediction `kappa` standard deviations above its mean (16 % at kappa 1)."""
        return chance_above(self.kappa)

    def _nothing_left(self, hopeful: int, ruled: int, unfit: int, target: float) -> str:
        """Why no unmeasured candidate is launched (the study's stop reason, unless a confirmation follows)."""
        chance = 100 * self._chance()
        if not hopeful:
            return (f"no unmeasured candidate has a {chance:.0f} % chance to beat the best "
                    f"({self._shown(target)}) by {100 * self.min_gain:g} %")
        return (f"{hopeful} candidates could beat the best by {100 * self.min_gain:g} %, but "
                + ", ".join(p for p in (f"{ruled} are ruled out by measured runs" if ruled else "",
                                        f"{unfit} are not launchable (memory)" if unfit else "") if p))

    # --- noise: repeats -----------------------------------------------------------------------------
    def _reps(self) -> dict[tuple, Outcome]:
        """One outcome per measured candidate, in the order the candidates were first measured; one
        measured more than once carries `record.central` of its usable measurements as its value (the
        mean of those no straggler slowed)."""
        groups: dict[tuple, list[Outcome]] = {}
        for o in self.history:
            if o.usable:
                groups.setdefault(self.space.key(o.candidate), []).append(o)
        return {k: g[0] if len(g) == 1 else replace(g[-1], value=central([float(o.value) for o in g], self.direction))  # type: ignore[arg-type]
                for k, g in groups.items()}

    def _counts(self) -> dict[tuple, int]:
        counts: dict[tuple, int] = {}
        for o in self.history:
            if o.launched:
                k = self.space.key(o.candidate)
                counts[k] = counts.get(k, 0) + 1
        for c in self._pending:
            counts[self.space.key(c)] = counts.get(self.space.key(c), 0) + 1
        return counts

    def _runs(self) -> dict[tuple, list[float]]:
        """Each measured candidate's usable measurements, as rates."""
        groups: dict[tuple, list[float]] = {}
        for o in self.history:
            if o.usable:
                groups.setdefault(self.space.key(o.candidate), []).append(self._speed(o))
        return groups

    def _noise_sd(self) -> float:
        """Run-to-run noise as a relative sd (`record.noise_sd`: measured once three candidates were
        repeated, over their runs no straggler slowed; else the assumed `noise`)."""
        return noise_sd(self._runs().values(), "maximize", self.noise)  # (rates: higher is better)

    def _repeats_left(self) -> int:
        return self.repeats - sum(1 for o in self.history if o.launched and o.repeat_of is not None)

    def _in_reserve(self) -> bool:
        """Are the repeats left only those kept for the confirmations before stopping (CONFIRM_RESERVE,
        at most a third of `repeats`)?"""
        return self._repeats_left() <= min(CONFIRM_RESERVE, self.repeats // 3)

    def _again(self, o: Outcome, why: str) -> Proposal:
        return Proposal(dict(o.candidate), why=f"measure again (noise): {why}", repeat=True)

    def _surprise(self, reps: dict[tuple, Outcome], target: float, noise: float) -> Proposal | None:
        """A result that would steer the search on one measurement: far from its prediction (a slow
        outlier hides what could beat the best, a fast one crowns a loser) or reversing a micro-batch
        ladder (which ends it) is measured again first, within the `repeats` budget less what is kept
        for the confirmations before stopping (CONFIRM_RESERVE)."""
        if self._in_reserve():
            return None
        counts = self._counts()
        for k, o in reversed(list(reps.items())):
            values = [self._speed(h) for h in self.history if h.usable and self.space.key(h.candidate) == k]
            if len(values) == 2 and counts.get(k, 0) == 2 and abs(math.log(values[0] / values[1])) > 3 * noise and \
                    max(values) >= target * (1 - 3 * noise):
                return self._again(o, f"its two measurements {self._shown(values[0])} and {self._shown(values[1])} "
                                      f"disagree beyond the noise ({100 * noise:.1f} %): a third decides")
            if counts.get(k, 0) > 1:
                continue
            speed, pr = self._speed(o), self._predicted.get(k)
            if pr is None and k in self._index and len(reps) >= 3:
                # launched without a prediction (the first run): the prior at the level the others show
                # (none where the others lie outside this pool: staged_blackbox's stage-1 runs it asks about)
                others = [math.log(self._speed(r) / self._prior0[self._index[kk]]) for kk, r in reps.items()
                          if kk != k and kk in self._index]
                if others:
                    pr = (float(self._prior0[self._index[k]] * math.exp(float(np.median(others)))), UNANCHORED_SD)
            if pr is not None:
                off = math.log(speed / pr[0])
                steers = speed >= target * (1 - 3 * noise) or pr[0] * math.exp(self.kappa * pr[1]) > target
                if steers and abs(off) > max(3 * noise, 2 * pr[1]):
                    far = f"{100 * math.expm1(off):+.0f} %" if abs(off) < 0.7 else f"x{math.exp(off):.2g}"
                    return self._again(o, f"trial {o.trial_number} measured {self._shown(speed)}, "
                                          f"{far} from its prediction {self._shown(pr[0])}")
            reversed_ = self._reverses(o, k, reps, target)
            if reversed_ is not None:
                return self._again(o, reversed_)
        return None

    def _reverses(self, o: Outcome, k: tuple, reps: dict[tuple, Outcome], target: float) -> str | None:
        """Why `o` (key `k`, measured once) reverses a ladder's trend, or None: a larger MBS slower than a
        smaller one (which ends the MBS ladder), or a run without recompute slower than one with any (or
        one with recompute faster than one without) at the same layout, MBS and switches: recomputing adds
        forward work and nothing else, so such a result is the noise's until a repeat says otherwise
        (selective and full recompute are not ranked: full recompute of a few layers can be less work than
        selective recompute of every layer). Only where it steers: the faster of the two is within 5 % of
        the best. (robustness.py, GQA-13B on 8 A100 with the speed trainer and noise, seed 2: TP1 PP4 CP2
        without recompute came back 6 % below the same with core attention recomputed, the reverse of the
        truth's 3 %; the study never measured the optimum, TP1 PP2 CP2 without recompute: 0.930.)"""
        c, speed = o.candidate, self._speed(o)
        lost: list[tuple[float, str]] = []
        for kk, r in reps.items():
            rc, rs = r.candidate, self._speed(r)
            if kk == k or max(rs, speed) < target * 0.95:
                continue
            if self._ladder(rc) == self._ladder(c) and rc.get("mbs", 1) < c.get("mbs", 1) and rs > speed:
                lost.append((rs, f"mbs {c.get('mbs')} (trial {o.trial_number}) came back slower than mbs "
                                 f"{rc.get('mbs')} (trial {r.trial_number}), which ends its ladder"))
            none, rnone = no_recompute(c), no_recompute(rc)
            same = (_lay(rc), rc.get("mbs"), settings(rc)) == (_lay(c), c.get("mbs"), settings(c))
            if same and none != rnone and none == (speed < rs):
                lost.append((max(rs, speed), f"{_rec_desc(c)} (trial {o.trial_number}) came back "
                                             f"{'slower' if speed < rs else 'faster'} than {_rec_desc(rc)} "
                                             f"(trial {r.trial_number}) on the same layout and mbs: recompute "
                                             f"only adds work"))
        return max(lost)[1] if lost else None

    def _confirm(self, reps: dict[tuple, Outcome], best: Outcome, noise: float, why: str) -> Proposal | None:
        """Before stopping: while the noise cannot tell a candidate from the best, the rival it rules out
        least, or the best, whichever ran fewer times, is measured again (within `repeats`); else stop,
        saying why."""
        counts = self._counts()
        others = [o for k, o in reps.items() if o is not best]
        if others and self._repeats_left() > 0:
            # a candidate the noise cannot yet tell from the best (within 2 standard errors of the difference
            # of their means, while those could still hide `min_gain`) could be the best
            n = lambda o: max(counts.get(self.space.key(o.candidate), 0), 1)  # noqa: E731
            if n(best) < 2:  # one run could be a lucky one: it is confirmed before it is called the best
                return self._again(best, f"the best (trial {best.trial_number}) ran once: confirmed before it is "
                                         f"called the best")
            if shows_no_noise(self._runs().values()):  # repeats agreed exactly: another run returns what is known
                others = []
            se = lambda o: noise * math.sqrt(1 / n(best) + 1 / n(o))  # noqa: E731
            near = [o for o in others if self._speed(best) / self._speed(o) - 1 < 2 * se(o)
                    and 2 * se(o) > self.min_gain]
            # the rival the noise rules out least (the smallest gap in standard errors) is settled first:
            # the fewer-measured of it and the best runs again; repeats spread over every near tie leave
            # each pair as undecided as before when they run out. Until repeats of three candidates
            # measured the noise, the fewest-measured near tie goes first: a trainer without noise shows
            # it then, and its near ties stop needing runs
            if measured_noise(self._runs().values(), "maximize") is None:
                rivals = sorted(near, key=lambda o: (n(o), -self._speed(o)))
            else:
                rivals = sorted(near, key=lambda o: gap_in_se(self._speed(best), n(best), self._speed(o), n(o), noise))
            for other in rivals:
                o = min([best, other], key=lambda o: (n(o), -self._speed(o)))
                if n(o) < CONFIRM_RUNS:
                    gap = self._speed(best) / self._speed(other) - 1
                    return self._again(o, f"the best (trial {best.trial_number}) and trial {other.trial_number} are "
                                          f"{100 * gap:.1f} % apart, which {n(best)} and {n(other)} measurement"
                                          f"{'s' if n(other) > 1 else ''} do not tell from the noise "
                                          f"({100 * noise:.1f} %)")
        self.stop_reason = why
        return None

    @staticmethod
    def _ladder(c: dict) -> tuple:
        """What a micro-batch ladder keeps fixed: layout, recompute, ViT checkpointing, the overlap switches."""
        return (_lay(c), _rec(c), c.get("recompute_num_layers"), settings(c))

    def _agreement(self, reps: dict[tuple, Outcome]) -> float:
        """How far the measurements agree with the prior's ranking: Kendall's tau over the pairs of
        measured candidates that the prior ranks clearly (> 5 % apart) and the measurements too (beyond
        twice the noise); 1 while fewer than 4 such pairs exist."""
        noise = self._noise_sd()
        pts = [(self._prior0[self._index[k]], self._speed(o)) for k, o in reps.items() if k in self._index]
        agree = disagree = 0
        for i in range(len(pts)):
            for j in range(i + 1, len(pts)):
                (pa, ma), (pb, mb) = pts[i], pts[j]
                if abs(math.log(pa / pb)) < 0.05 or abs(math.log(ma / mb)) < 2 * noise:
                    continue
                if (pa > pb) == (ma > mb):
                    agree += 1
                else:
                    disagree += 1
        if agree + disagree < 4:
            return 1.0
        return (agree - disagree) / (agree + disagree)

    def _probe_ok(self, c: dict) -> bool:
        """May this candidate, screened only by the memory estimate, be launched as a probe? Up to
        `memory_probes` per study, only while `max_ooms` has an OOM left (a probe after an OOM spends the last
        one: `_before_stopping` runs it last), and only just past the limit (`probe_reach`)."""
        if self.memory_probes <= 0 or self._ooms() >= self.max_ooms or \
                sum(1 for o in self.history if o.probe) >= self.memory_probes:
            return False
        gb = self.judge.assess(c).predicted_gb
        return gb is not None and gb <= self.judge.capacity_gb * (1 + self.probe_reach)

    def _first(self, tried: set[tuple]) -> Proposal | None:
        for i in np.argsort(-self._prior, kind="stable"):
            cand = self._pool[i]
            if self._keys[i] in tried or self._ruled_out(cand, {}):
                continue
            fits, mem = self._fits(cand, self.first_fit)
            if fits:
                return Proposal(dict(cand), why=f"first run: highest prior ({self._prior[i]:.0f}) that surely fits "
                                f"({mem}); {self._layout_note(cand)}")
        # Nothing fits with the wide margin (a space whose every layout is near the memory limit, e.g.
        # 7 GPUs): rather than give up while valid candidates remain, start with the one predicted to
        # need the least memory among those the study's screen lets through.
        fallback = [(self.judge.assess(c).predicted_gb or 0.0, i) for i, c in enumerate(self._pool)
                    if self._keys[i] not in tried and not self._ruled_out(c, {}) and self._fits(c, None)[0]]
        if fallback:
            gb, i = min(fallback)
            cand = self._pool[i]
            return Proposal(dict(cand), why=f"first run: nothing is predicted under {100 * self.first_fit:.0f} % of "
                            f"memory, so the least memory ({gb:.0f} GB) of what may fit; {self._layout_note(cand)}")
        return None

    def _before_last_oom(self, cand: dict, best: Outcome, tried: set[tuple],
                         reps: dict[tuple, Outcome]) -> Proposal | None:
        """The last OOM `max_ooms` allows is not risked (above RISK_DONE, the risk a launch may carry once it
        is spent) while the best's own tests -- its other recompute granularity, the layouts one step from
        it -- can run at no more than `last_oom_risk`: after that OOM only proven fits run, and the layout
        next to the best, where a trainer the prior misjudges hides its optimum, would then be out of reach
        whenever no run that fit proves it fits. (Held only above `last_oom_risk`, a TP8 / EP8 launch at a
        23 % risk on the stand-in Qwen3 study went first, ran out, and the optimum one CP step from the
        best could not be proven: 0.571.)"""
        if not self._one_oom_left() or self._last_free_launch():
            return None
        risk = self._risk(cand)[0]
        if risk <= RISK_DONE:
            return None
        test = self._bests_tests(best, tried, reps, self.last_oom_risk)
        if test is None:
            return None
        return replace(test, why=f"{test.why}; first, before the last OOM max_ooms={self.max_ooms} allows is risked "
                                 f"({100 * risk:.0f} %) on {_at(cand)} {_rec_desc(cand)}")

    def _before_staking(self, cand: dict, r: float, j: int, fc: _Forecast,
                        state: tuple[Outcome, set[tuple], dict[tuple, Outcome]], first: bool,
                        why: str) -> Proposal | None:
        """What goes before `cand`, a launch the screen admits at risk `r`, is launched or staked: for the walk's
        first such launch, the best's tests it waits for (`_before_last_oom`); at the budget's last free launch
        with one OOM left, `cand` itself when it is over `last_oom_risk`, not staked behind a safer launch (nor
        the safe side's variant): nothing follows that the last OOM could be kept for (`_last_free_launch`)."""
        if first:
            test = self._before_last_oom(cand, *state)
            if test is not None:
                return test
        if self._one_oom_left() and r > self.last_oom_risk and self._last_free_launch():
            self._remember(fc, j)
            return Proposal(dict(cand), why=f"{why}; the budget's last launch before its confirmations: nothing "
                            f"follows that the last OOM max_ooms={self.max_ooms} allows could be kept for, so it is "
                            f"staked ({100 * r:.0f} %)")
        return None

    def _last_free_launch(self) -> bool:
        """Is this the budget's last launch before the study loop's confirmations (`free_launches`)? The last
        OOM `max_ooms` allows is kept for the launches that may follow it; here none does, so a launch held
        back for it (behind the best's tests, `_before_last_oom`; staked behind a safer launch or the safe
        side's variant, `_walk`) goes now. robustness.py, the stand-in 128-expert MoE with noise, seed 1:
        TP1 PP2 VP6 EP8 with selective recompute (layernorm, moe_act), at a 47 % risk (the optimum is that
        layout without recompute, 0.3 GB under the cap), waited behind the best's tests and then safer
        launches until the budget's confirmations took its last six launches: 0.881; launched at the last
        free launch, it measured 249 and the study ended at 0.988 (with only the tests' wait lifted, a safer
        launch went instead: 0.900)."""
        return self.free_launches is not None and self.free_launches <= 1

    def _stake(self, cand: dict, fits: bool, mem: str, risk: float, gain: float) -> tuple[bool, str]:
        """`_fits`'s verdict on a launch of `cand` predicted at `gain` x the best, carrying `risk` of running
        out of memory: the last OOM `max_ooms` allows is a memory probe's stake (after it only proven fits
        run), so a launch that could spend it at more than `last_oom_risk` must be predicted, not only hoped
        by its optimistic bound, to beat the best by `probe_gain`. A launch predicted below the best is a
        long shot its uncertainty alone keeps hopeful: with one OOM left it runs only where a run that fit
        proves it fits or the learned model all but rules an OOM out (LONG_SHOT_RISK). A few per cent is the
        learned model's word at the edge of what it measured, and on a trainer it was not built on that
        word is what fails (robustness.py, the stand-in 128-expert MoE with noise: a TP2 PP8 VP6 MBS 4
        layout predicted 16 % below the best spent the last OOM at a 3 % risk, and the optimum, one CP step
        from the best, could then not be proven; before, a TP4 EP4 layout predicted 25 % below spent it
        at 20 %)."""
        if fits and risk > max(RISK_DONE, self.last_oom_risk) and self._one_oom_left() and gain < 1 + self.probe_gain:
            return False, (f"{mem}: a {100 * risk:.0f} % risk of spending the last OOM max_ooms={self.max_ooms} "
                           f"allows, for a predicted gain under {100 * self.probe_gain:g} %")
        if fits and gain < 1 and risk > LONG_SHOT_RISK and self._one_oom_left():
            a = self.judge.assess(cand)
            if not (a.fits_surely or a.proven_fit):
                return False, (f"{mem}: predicted {100 * (1 - gain):.0f} % below the best and not proven to fit "
                               f"by a run that fit, so the last OOM max_ooms={self.max_ooms} allows is not "
                               f"risked ({100 * risk:.0f} %) on it")
        return fits, mem

    def _safe_side(self, cand: dict, risk: float, bar: float, at: np.ndarray, pred: np.ndarray,
                   tried: set[tuple], reps: dict[tuple, Outcome]) -> int | None:
        """With one OOM of `max_ooms` left, the memory edge is approached from the safe side: before `cand`
        (carrying `risk` of running out, at least EDGE_RISK), the variant of its layout and MBS (another
        recompute) that carries the least risk, less than `cand`'s, and is still predicted above `bar` (the
        best plus `min_gain`); its index into `at`, or None. Once it ran, the learned model knows this layout at
        this MBS, so the heavier variants next to it are judged on a measurement, not on a guess (the
        64-expert MoE on the stand-in trainer: MBS 2 fits with 7 or 8 of 28 layers recomputed, not 6;
        the last OOM went to 6)."""
        if not self._one_oom_left() or risk < EDGE_RISK:
            return None
        lay, mbs, sets = _lay(cand), cand.get("mbs"), settings(cand)
        found: tuple[float, float, int] | None = None
        for k, i in enumerate(at):
            c = self._pool[i]
            if c is cand or _lay(c) != lay or c.get("mbs") != mbs or settings(c) != sets or pred[k] <= bar or \
                    self._keys[i] in tried:
                continue
            r = self._risk(c)[0]
            if r >= risk or self._ruled_out(c, reps) or not self._fits(c, self.fit)[0]:
                continue
            if found is None or (r, -pred[k]) < found[:2]:
                found = (r, -float(pred[k]), k)
        return None if found is None else found[2]

    def _bests_tests(self, best: Outcome, tried: set[tuple], reps: dict[tuple, Outcome],
                     max_risk: float = 1.0) -> Proposal | None:
        """Test, don't assume: the best layout's other recompute granularity, its MBS doubled and halved, then
        its one-step neighbours -- once the noise has had its say on which layout is the best (`_settle_best`)."""
        return self._settle_best(best, reps) or self._granularity_check(best, tried, reps, max_risk) or \
            self._mbs_check(best, tried, reps, max_risk) or self._neighbour(best, tried, reps, max_risk)

    def _settle_best(self, best: Outcome, reps: dict[tuple, Outcome]) -> Proposal | None:
        """The best's tests go to its layout's neighbourhood, so which layout is the best is decided first:
        once the best ran more than once, a candidate of another layout that ran once and that the noise
        cannot tell from it (within two standard errors of the difference) is measured again (within `repeats`, less CONFIRM_RESERVE). On
        the stand-in Qwen3 study with noise the first run came in 1.5x slow (an outlier), a neighbour's
        three runs beat it by 0.2 % and took every test; the optimum, one CP step from the first layout,
        was never measured (0.566)."""
        if self._in_reserve():
            return None
        counts, noise = self._counts(), self._noise_sd()
        lay, nb = _lay(best.candidate, vp=False), counts.get(self.space.key(best.candidate), 0)
        if nb < 2 or shows_no_noise(self._runs().values()):  # a best that ran once is no firmer than its rival:
            return None  # it is confirmed before the study stops; repeats that agreed exactly settle nothing more
        near = [o for k, o in reps.items() if o is not best and counts.get(k, 0) == 1
                and _lay(o.candidate, vp=False) != lay
                and self._speed(best) / self._speed(o) - 1 < 2 * noise * math.sqrt(1 / nb + 1)]
        if not near:
            return None
        o = max(near, key=self._speed)
        gap = self._speed(best) / self._speed(o) - 1
        return self._again(o, f"trial {o.trial_number}, another layout, ran once {100 * gap:.1f} % below the best "
                              f"(trial {best.trial_number}), within the noise ({100 * noise:.1f} %): which layout is "
                              f"the best decides whose neighbourhood is tested")

    def _granularity_check(self, best: Outcome, tried: set[tuple], reps: dict[tuple, Outcome],
                           max_risk: float = 1.0) -> Proposal | None:
        """Test, don't assume: the best layout is also measured with full recompute when it won without
        it, and without full recompute when it won with it (some trainers make full the faster)."""
        if not self.test_both_granularities:
            return None
        b = best.candidate
        lay, full = _lay(b), b.get("recompute_granularity") == "full"
        if any(_lay(o.candidate) == lay and (o.candidate.get("recompute_granularity") == "full") != full
               for o in self.history if o.launched):
            return None
        options = [i for i, c in enumerate(self._pool) if self._keys[i] not in tried and _lay(c) == lay
                   and (c.get("recompute_granularity") == "full") != full and c.get("mbs") == b.get("mbs")]
        for i in sorted(options, key=lambda i: -self._prior[i]):
            cand = self._pool[i]
            if self._ruled_out(cand, reps) or not self._fits(cand, self.fit)[0] or self._risk(cand)[0] > max_risk:
                continue
            return Proposal(dict(cand), why=f"test, don't assume: recompute {_rec_desc(cand)} on the best layout "
                            f"(trial {best.trial_number} won with {_rec_desc(b)})")
        return None

    def _mbs_check(self, best: Outcome, tried: set[tuple], reps: dict[tuple, Outcome],
                   max_risk: float = 1.0) -> Proposal | None:
        """Test, don't assume: the best layout is also measured at twice the best's MBS and at half of it,
        where no run on that layout had that MBS: how GEMMs gain with a larger micro-batch, and what its
        activations cost, are what trainers differ in most (on the stand-in 64-expert MoE the optimum is
        the best layout at MBS 2 with 7 layers recomputed, 8 % faster than MBS 1; the prior predicted it
        15 % slower, and no MBS 2 ran on that layout: 0.925). Its variant of highest prior x (1 - OOM risk)
        that may be launched: the learned memory model decides how much recompute the larger MBS takes."""
        if not self.test_mbs:
            return None
        b = best.candidate
        lay, mbs = _lay(b), b.get("mbs")
        if not isinstance(mbs, int):
            return None
        ran = {o.candidate.get("mbs") for o in self.history if o.launched and _lay(o.candidate) == lay}
        ran |= {c.get("mbs") for c in self._pending if _lay(c) == lay}
        for m in (2 * mbs, mbs // 2):
            if m < 1 or m == mbs or m in ran:
                continue
            found = self._worth_most([i for i, c in enumerate(self._pool) if self._keys[i] not in tried
                                      and _lay(c) == lay and c.get("mbs") == m], reps, max_risk)
            if found is not None:
                cand, mem = found
                return Proposal(dict(cand), why=f"test, don't assume: mbs {mbs}->{m} on the best layout "
                                f"(trial {best.trial_number}), never measured there, with {_rec_desc(cand)}; {mem}")
        return None

    def _neighbour(self, best: Outcome, tried: set[tuple], reps: dict[tuple, Outcome],
                   max_risk: float = 1.0) -> Proposal | None:
        """Test, don't assume: before stopping, each layout one parallel size away from the best layout's
        (TP, PP, CP or EP halved or doubled) that no run measured is measured once, its variant with the
        highest prior that may be launched first (`neighbours` such launches per study). A trainer whose
        law the prior lacks (an all-to-all that leaves the node once CP x EP does) hides its optimum
        exactly there: a prediction, however confident, is not a measurement of the next layout. Once no
        such layout is left to launch, the trades of one model-parallel size for another (below)."""
        if sum(1 for o in self.history if (o.why or "").startswith(NEIGHBOUR_WHY)) >= self.neighbours:
            return None
        b = best.candidate
        # A step keeps expert TP where the stepped layout can run it; where it cannot (expert TP above the
        # halved TP, or an expert grid it does not divide), the step is to the parallel sizes with any
        # expert TP: else an MoE best with expert TP 2+ has no TP neighbour at all.
        exact = {_lay(c, vp=False) for c in self._pool}
        ran = [o.candidate for o in self.history if o.launched] + list(self._pending)
        measured = {_lay(c, vp=False) for c in ran} | {_sizes(c) for c in ran}
        sizes: dict[str, int] = {k: b[k] for k in ("tp", "pp", "cp", "ep") if isinstance(b.get(k), int)}
        one = [((k, v, n),) for k, v in sizes.items() for n in (v // 2, 2 * v) if n >= 1 and n != v]
        # then trades between the model-parallel sizes that keep their product (TP for PP, CP for PP, ...):
        # each GPU holds about the same share of the weights, so where every one-step neighbour needs more
        # memory than fits, a trade may still fit -- and a trainer whose TP or pipeline costs differ from the
        # prior's puts its optimum there (Megatron users trade TP for PP this way)
        mp = [k for k in ("tp", "pp", "cp") if k in sizes]
        trades = [((a, sizes[a], sizes[a] // 2), (c, sizes[c], 2 * sizes[c])) for a in mp for c in mp
                  if a != c and sizes[a] >= 2]
        for tier in (one, trades):
            steps: dict[tuple, str] = {}
            for step in tier:
                moved = {**b, **{k: n for k, _, n in step}}
                lay = _lay(moved, vp=False)
                steps.setdefault(lay if lay in exact else _sizes(moved), ", ".join(f"{k} {v}->{n}" for k, v, n in step))
            step_of = lambda c: _lay(c, vp=False) if _lay(c, vp=False) in steps else _sizes(c)  # noqa: E731,B023
            # of each such layout, the variant worth most once the risk of running out of memory is priced in
            options = [i for i, c in enumerate(self._pool) if step_of(c) in steps and step_of(c) not in measured
                       and self._keys[i] not in tried]
            found = self._worth_most(options, reps, max_risk)
            if found is not None:
                cand, mem = found
                return Proposal(dict(cand), why=f"{NEIGHBOUR_WHY}: layout {self._layout_note(cand)}, "
                                f"{steps[step_of(cand)]} from the best layout (trial {best.trial_number}), "
                                f"never measured; {mem}")
        return None

    def _worth_most(self, options: list[int], reps: dict[tuple, Outcome], max_risk: float) -> tuple[dict, str] | None:
        """Of these pool indices, the variant worth most once the risk of running out of memory is priced in
        (prior x (1 - risk): an OOM would spend the study's `max_ooms` and teach nothing of speed) that may be
        launched -- at most `max_risk`, not ruled out by measured runs, fitting -- with `_fits`'s note."""
        risk = {i: self._risk(self._pool[i])[0] for i in options}
        for i in sorted(options, key=lambda i: -self._prior[i] * (1 - risk[i])):
            cand = self._pool[i]
            if risk[i] > max_risk or self._ruled_out(cand, reps):
                continue
            fits, mem = self._fits(cand, self.fit)
            if fits:
                return cand, mem
        return None

    # --- one line of why ----------------------------------------------------------------------------
    def _role(self, c: dict, best: dict) -> str:
        parts = []
        if _lay(c, vp=False) != _lay(best, vp=False):
            return f"layout {self._layout_note(c)}"
        if c.get("vp") != best.get("vp"):
            v = int(c.get("vp") or 1)
            parts.append(f"vp {best.get('vp')}->{c.get('vp')}" + (f" (interleaved: bubble /{v}, {v}x the p2p sends)"
                                                                  if v > 1 else " (not interleaved)"))
        if c.get("mbs") != best.get("mbs"):
            parts.append(f"mbs {best.get('mbs')}->{c.get('mbs')}")
        if _rec(c) != _rec(best) or c.get("recompute_num_layers") != best.get("recompute_num_layers"):
            parts.append(f"recompute {_rec_desc(best)}->{_rec_desc(c)}")
        if c.get("vit_gradient_checkpointing") != best.get("vit_gradient_checkpointing"):
            parts.append(f"vit checkpointing {c.get('vit_gradient_checkpointing')}")
        for n in SWITCH_PARAMS:
            if bool(c.get(n)) != bool(best.get(n)):
                parts.append(f"{n} {'on' if c.get(n) else 'off'}")
        return "best layout, " + ", ".join(parts)

    def _layout_note(self, c: dict) -> str:
        ctx, m = self.ctx, self.ctx.model
        notes = [" ".join(f"{k}={c[k]}" for k in LAYOUT_KEYS if k in c)]
        if c.get("tp", 1) > 1:
            notes.append(f"tp{c['tp']} inside a node")
        if c.get("pp", 1) > 1:
            notes.append(f"pp{c['pp']} to fit" + (" / cross nodes" if ctx.n_gpus > ctx.gpus_per_node else ""))
        if (c.get("vp") or 1) > 1:
            notes.append(f"vp{c['vp']} interleaved: bubble /{c['vp']}")
        if c.get("cp", 1) > 1:
            notes.append(f"cp{c['cp']} for {m.seq_length} tokens" if m.seq_length else f"cp{c['cp']}")
        if c.get("ep", 1) > 1:
            notes.append(f"ep{c['ep']} spreads {m.num_experts} experts")
        return ", ".join(notes)


def _at(c: dict) -> str:
    """A candidate's layout and MBS, as `name=value` pairs."""
    return " ".join(f"{k}={c[k]}" for k in (*LAYOUT_KEYS, "mbs") if c.get(k) is not None)


def _rec_desc(c: dict) -> str:
    if c.get("recompute_granularity") == "selective" and c.get("recompute_modules"):
        return f"selective/{c['recompute_modules']}"
    if c.get("recompute_granularity") != "full":
        return str(c.get("recompute_granularity"))
    return f"full/{c.get('recompute_method')}/{c.get('recompute_num_layers')}"
