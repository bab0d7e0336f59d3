"""The study loop, independent of how a trial is launched.

propose (strategy) -> sample what is left open (Optuna ask) -> screen (rules, predicted OOM, already
measured) -> launch -> record (Optuna tell) -> tell the strategy and the job.
Screened-out proposals are recorded as PRUNED, never launched, and do not count against n_trials.

The zenithtune Hydra sweeper launches through the Hydra launcher; the benchmark launches the
simulator in-process. Both run this same loop.
"""
from __future__ import annotations

import time
from dataclasses import replace
from typing import Callable

import optuna
from optuna.trial import TrialState

from zenithtune import record, signals
from zenithtune.job import Job
from zenithtune.record import Attr, Launched, Outcome
from zenithtune.run import FailureKind
from zenithtune.strategies import Proposal

__all__ = ["Callbacks", "LaunchFn", "Launched", "StudyLoop"]

LaunchFn = Callable[[int, dict, "float | None"], Launched]  # (trial number, candidate, timeout) -> result


class Callbacks:
    """Hooks for progress output (all optional)."""

    def launching(self, number: int, cand: dict, why: str, n: int) -> None: ...
    def result(self, outcome: Outcome, n: int) -> None: ...
    def skipped(self, outcome: Outcome) -> None: ...


class StudyLoop:
    def __init__(self, job: Job, study: optuna.Study, launch: LaunchFn, callbacks: Callbacks | None = None,
                 max_consecutive_skips: int = 300):
        self.job = job
        self.study = study
        self.launch = launch
        self.cb = callbacks or Callbacks()
        self.max_consecutive_skips = max_consecutive_skips
        self.measured: dict[tuple, Outcome] = {}
        self.outcomes: list[Outcome] = []
        self.durations: list[float] = []  # successful trials' wall times (dynamic timeouts)

    def start(self, prior: list[Outcome]) -> None:
        """Hand the strategy and the job what a resumed study already knows."""
        # An interrupted trial (Ctrl-C, or the tuner died) measured nothing: the strategy does not see
        # it and the duplicate check does not count it, so the candidate may be launched again.
        prior = [o for o in prior if o.kind != FailureKind.INTERRUPTED.value]
        strategy = self.job.strategy
        strategy.direction = self.job.evaluator.direction
        strategy.setup(self.job.space, self.job.memory, prior)
        for o in prior:
            self._learn(o)

    def _learn(self, o: Outcome) -> None:
        self.job.observe(o)
        if o.launched:
            self.measured[self.job.space.key(o.candidate)] = o
            if o.ok and o.duration:
                self.durations.append(float(o.duration))

    def run(self, n_trials: int, launched: int = 0, fail_fast: int = 0) -> str:
        """Propose and launch until n_trials are launched in all; returns why it stopped.

        With fail_fast=k, stop when the first k launches of the study all failed: a broken command
        should cost k trials, not n_trials."""
        strategy = self.job.strategy
        skips = 0
        while launched < n_trials:
            proposal = strategy.ask()
            if proposal is None:
                return "strategy exhausted"
            trial, cand = self._ask(proposal)
            outcome = self._screen(trial, cand, proposal)
            if outcome is not None:
                self.outcomes.append(outcome)
                strategy.tell(outcome)
                self.cb.skipped(outcome)
                skips += 1
                if self.max_consecutive_skips and not strategy.exhaustive and skips >= self.max_consecutive_skips:
                    return (f"{skips} proposals in a row could not be launched "
                            f"(invalid, predicted OOM or already measured)")
                continue
            skips = 0
            launched += 1
            outcome = self._launch(trial, cand, proposal, launched)
            self.outcomes.append(outcome)
            self._learn(outcome)
            strategy.tell(outcome)
            self.cb.result(outcome, launched)
            if fail_fast and launched == fail_fast and not any(o.ok for o in self.measured.values()):
                return f"the first {fail_fast} launched trials all failed (fail_fast={fail_fast})"
        return f"n_trials={n_trials} launched"

    # --- one proposal ------------------------------------------------------------------------------
    def _ask(self, proposal: Proposal) -> tuple[optuna.Trial, dict]:
        space = self.job.space
        fixed = space.normalize(proposal.fixed) if proposal.fixed else {}
        if fixed:
            self.study.enqueue_trial(fixed, skip_if_exists=False)
        trial = self.study.ask()
        names = None if proposal.sample is None else tuple(proposal.sample) + tuple(fixed)
        cand = space.suggest(trial, names=names)
        if proposal.complete is not None:
            cand = space.normalize({**proposal.complete(dict(cand)), **cand})
        trial.set_user_attr(Attr.CANDIDATE, cand)
        if proposal.stage:
            trial.set_user_attr(Attr.STAGE, proposal.stage)
        if proposal.why:
            trial.set_user_attr(Attr.WHY, proposal.why)
        return trial, cand

    def _screen(self, trial: optuna.Trial, cand: dict, proposal: Proposal) -> Outcome | None:
        """Record and return the outcome of a candidate that must not be launched; None to launch."""
        job = self.job
        predicted = job.predict_gb(cand)
        if predicted is not None:
            trial.set_user_attr(Attr.PREDICTED_GB, round(predicted, 2))
        broken = job.screen(cand)
        if broken and broken[0][0] == "predicted_oom" and proposal.probe_memory:
            trial.set_user_attr(Attr.MEMORY_PROBE, broken[0][1])  # launched on purpose; the outcome teaches
            broken = []
        dup = self.measured.get(job.space.key(cand))
        if not broken and dup is not None:
            broken = [("duplicate", f"already measured as trial {dup.trial_number}")]
            trial.set_user_attr(Attr.DUPLICATE_OF, dup.trial_number)
        if not broken:
            return None
        outcome = Outcome(candidate=cand, state="pruned", reasons=[w for _, w in broken], rules=[r for r, _ in broken],
                          predicted_gb=predicted, trial_number=trial.number, stage=proposal.stage, why=proposal.why)
        record.store(trial, outcome)
        self.study.tell(trial, state=TrialState.PRUNED)
        return outcome

    def _launch(self, trial: optuna.Trial, cand: dict, proposal: Proposal, n: int) -> Outcome:
        trial.set_user_attr(Attr.LAUNCHED, True)
        self.cb.launching(trial.number, cand, proposal.why, n)
        started = time.time()
        limit = self.job.timeouts.limit(self.durations)
        outcome = Outcome(candidate=cand, state="failed", launched=True, trial_number=trial.number,
                          predicted_gb=trial.user_attrs.get(Attr.PREDICTED_GB), stage=proposal.stage,
                          probe=Attr.MEMORY_PROBE in trial.user_attrs, why=proposal.why,
                          timeout=None if limit is None else round(limit, 1))
        try:
            res = self.launch(trial.number, cand, limit)
        except KeyboardInterrupt:
            outcome = replace(outcome, kind=FailureKind.INTERRUPTED.value, duration=time.time() - started,
                              reasons=[signals.reason()])
            record.store(trial, outcome)
            self.study.tell(trial, state=TrialState.FAIL)
            raise
        outcome = replace(outcome, duration=res.duration if res.duration is not None else time.time() - started,
                          measured_gb=res.measured_gb, argv=res.argv, env=res.env, log=res.log)
        if res.value is not None:
            outcome = replace(outcome, state="complete", value=float(res.value))
            record.store(trial, outcome)
            self.study.tell(trial, outcome.value)
            return outcome
        reason = res.reason
        if res.kind == FailureKind.TIMEOUT.value and self.job.timeouts.is_dynamic_cut(limit):
            reason = f"cut at the dynamic limit {limit:.1f} s (from the fastest success): {reason}"
        outcome = replace(outcome, kind=res.kind or FailureKind.CRASH.value, reasons=[reason])
        record.store(trial, outcome)
        self.study.tell(trial, state=TrialState.FAIL)
        return outcome
