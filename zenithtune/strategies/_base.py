"""The strategy interface: propose the next candidate from what the study has seen so far.

A strategy asks what it is handed, like an Optuna sampler: the study's judge (`assessment.Judge`,
the study setting) answers everything about a candidate in one `Assessment` (rules, predicted memory,
its uncertainty, OOM risk, proof of fit, refused features), so a strategy keeps no memory model, no
screen and no memo of its own.

Life of a strategy in a study (the zenithtune sweeper drives it):

1. ``Strategy(**cfg)`` — Hydra instantiates it from ``conf/strategy/<name>.yaml``.
2. ``sampler()`` — the Optuna sampler the study is created with. It only fills the parameters a
   proposal leaves open (staged_blackbox, tpe); deterministic strategies leave nothing open.
3. ``setup(judge, history, direction, metric)`` — once, before the first proposal: the judge (its
   ``space``, ``ctx`` and ``capacity_gb``, and ``assess(cand)``), the outcomes already in the study (a
   resumed study), and what the evaluator scores (``direction`` "maximize" or "minimize", the
   ``metric`` name). Default: keep them.
4. ``ask(pending)`` — the next `Proposal`, or None when the strategy has nothing left to try.
   ``pending`` holds the candidates already proposed for this wave and not yet told (parallel trials):
   ``tried(cand, pending)`` counts them as tried, so each ask proposes the next best one (the constant
   liar idea: a candidate in flight is treated as known). A proposal fixes some or all parameters; the
   sweeper samples the rest through the study's sampler, screens the candidate (the judge's reasons,
   already measured) and launches it or not.
5. ``tell(outcome)`` — every proposal's `Outcome`, launched or not (hook; default: remember it).
   In a study shared by several workers, also the outcomes other workers measured, as they come. The
   judge has learned from a launched outcome before it is told, so assessments after `tell` use it.

Parallel trials (``parallel_trials: K``): the sweeper calls ``ask`` up to K times before it launches
the wave. A strategy whose next proposal depends on the last outcome sets ``sequential = True`` and is
asked once per wave.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from zenithtune.record import Outcome, best_of
from zenithtune.run import FailureKind

if TYPE_CHECKING:
    import optuna

    from zenithtune.assessment import Judge
    from zenithtune.space import Candidate, Context, Space

@dataclass
class Proposal:
    fixed: dict[str, Any]  # parameters the strategy chose; the rest are sampled
    why: str = ""  # one line shown with the launch ("largest TP inside a node, ...")
    stage: str | None = None  # staged strategies: which stage proposed it
    # Only these parameters go to the sampler (None: every one not fixed); `complete` then fills the
    # rest from what was sampled (staged_blackbox: TPE picks the layout, the strategy its safe settings).
    # Parameters it fills are not Optuna params of the trial, so they never bias the sampler.
    sample: tuple[str, ...] | None = None
    complete: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    # Launch even though the study's memory estimate predicts OOM: a deliberate, budgeted test of the
    # estimate at its edge (the fastest layouts often use 95+ % of the GPU, where an estimate that
    # must never miss an OOM is a few GB pessimistic). Megatron's structural rules still apply.
    probe_memory: bool = False
    # Measure an already measured candidate again (noise): the loop launches it although it ran, records
    # it as a repeat, and a candidate's score is then the mean of its measurements no straggler slowed
    # (`Strategy.best`, `record.central`).
    # A repeat is a launch: it counts against n_trials.
    repeat: bool = False
    # Launch only while the judge gives it at most this risk of running out of memory (None: any risk the
    # study's screen and OOM budget allow); above it the loop prunes it ("oom_risk") and the sampler
    # learns so. staged_blackbox keeps the study's last OOM from its memory-safe layout runs this way.
    max_risk: float | None = None
    # The strategy's own word on a sampled candidate, before the judge's: a reason it must not run (its
    # domain rules: staged_blackbox's TP across nodes), or None. The loop prunes it with that reason
    # (rule "strategy"), and the sampler learns so.
    veto: Callable[[dict[str, Any]], str | None] | None = None


class Strategy(ABC):
    """Base class of every search strategy (see the module docstring for its life)."""

    direction: Literal["maximize", "minimize"] = "maximize"
    max_ooms = 0  # the study's OOM budget, for strategies that plan around it (the loop enforces it)
    metric: str = "TFLOP/s/GPU"  # the evaluator's unit
    sequential: bool = False  # True: one proposal per wave (the next depends on the last outcome)
    # An exhaustive strategy proposes each candidate once and ends by itself: the study loop never stops
    # it for proposals it could not launch (a sampler may repeat; an exhaustive one must mean all).
    exhaustive: bool = False
    # Why ask() returned None, in a few words for the study's footer ("nothing left could beat ...").
    stop_reason: str = ""
    # True: the strategy measures its best again itself when noise could have decided it (repeats), before
    # it stops on its own; the study loop's last launches (loop.CONFIRM_AT_END) do it for the others, and
    # for it only where the budget runs out under it on a trainer whose repeats showed noise.
    confirms_best: bool = False
    # Launches the budget has left before the study loop's confirmations at its end (loop.CONFIRM_AT_END),
    # set by the loop before each ask; None where no loop runs the strategy (its own tests, a replay).
    free_launches: int | None = None
    judge: Judge
    space: Space
    ctx: Context

    @property
    def past_screen(self) -> int:
        """Launches per study this strategy may make past the memory screen on purpose (memory probes);
        every other launch passes the study's screen and OOM budget."""
        return 0

    def sampler(self) -> optuna.samplers.BaseSampler:
        import optuna

        return optuna.samplers.RandomSampler(seed=0)

    def setup(self, judge: Judge, history: list[Outcome], direction: Literal["maximize", "minimize"] = "maximize",
              metric: str = "TFLOP/s/GPU") -> None:
        self.judge = judge
        self.space = judge.space
        self.ctx = judge.ctx
        self.history: list[Outcome] = list(history)
        self.direction = direction
        self.metric = metric

    @abstractmethod
    def ask(self, pending: Sequence[Candidate] = ()) -> Proposal | None:
        """The next proposal (none of `pending`), or None when exhausted."""

    def _oom_runs(self) -> list[Outcome]:
        """Launches of this study that ran out of memory."""
        return [o for o in self.history if o.launched and o.kind == FailureKind.OOM]

    def _ooms(self) -> int:
        return len(self._oom_runs())

    def _one_oom_left(self) -> bool:
        """The next OOM would spend the last `max_ooms` allows."""
        return self.max_ooms > 0 and self._ooms() == self.max_ooms - 1

    def _budget_spent(self) -> bool:
        """Has the study spent its `max_ooms`, with a run that fit to prove fits from? Then the loop
        launches only what is proven to fit (`StudyLoop.proof_of_fit`)."""
        return self._ooms() >= self.max_ooms and any(o.ok for o in self.history)

    def tell(self, outcome: Outcome) -> None:
        self.history.append(outcome)

    # --- helpers for subclasses ------------------------------------------------------------------
    def better(self, a: float, b: float) -> bool:
        return a > b if self.direction == "maximize" else a < b

    def best(self) -> Outcome | None:
        """The best measured candidate, by `record.central` of its measurements (one per launch: repeats
        are launches of the same candidate: the mean of those no straggler slowed); its outcome nearest
        that value."""
        return best_of(self.history, self.direction)

    def measurements(self, cand: Candidate) -> list[float]:
        """Every score measured for this candidate (several when repeated), in launch order."""
        key = self.space.key(cand)
        return [float(o.value) for o in self.history if o.ok and self.space.key(o.candidate) == key]  # type: ignore[arg-type]

    def tried_keys(self, pending: Sequence[Candidate] = ()) -> set[tuple]:
        """Keys of every candidate told (launched or not) or pending in the current wave."""
        return {self.space.key(o.candidate) for o in self.history} | {self.space.key(c) for c in pending}

    def tried(self, cand: Candidate, pending: Sequence[Candidate] = ()) -> bool:
        return self.space.key(cand) in self.tried_keys(pending)

    def rate(self, value: float) -> float:
        """A measured value as a rate, higher is better (s/it, as ms-swift reports it, is the inverse of one)."""
        return value if self.direction == "maximize" else 1.0 / max(value, 1e-12)


def tpe_sampler(seed: int, n_startup_trials: int, multivariate: bool = True) -> optuna.samplers.BaseSampler:
    """Optuna's TPE for a conditional space (recompute_method exists only under full recompute):
    multivariate with `group`, which Optuna still marks experimental; its warning says nothing a
    zenithtune user can act on, so it is silenced here. `constant_liar`: trials still running (a
    parallel wave, other workers) count as bad results, so concurrent asks spread out instead of
    proposing the same region K times."""
    import warnings

    import optuna

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return optuna.samplers.TPESampler(seed=seed, n_startup_trials=n_startup_trials,
                                          multivariate=multivariate, group=multivariate,
                                          constant_liar=True)
