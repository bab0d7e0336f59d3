"""The study loop, independent of how a trial is launched.

propose (strategy) -> sample what is left open (Optuna ask) -> screen (rules, predicted OOM, already
measured) -> launch -> record (Optuna tell) -> tell the strategy and the job.
Screened-out proposals are recorded as PRUNED, never launched, and do not count against n_trials.

The zenithtune Hydra sweeper launches through the Hydra launcher; the benchmark launches the
simulator in-process. Both run this same loop.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import optuna
from optuna.trial import TrialState

from zenithtune.strategies import Outcome, Proposal, Strategy


@dataclass
class Launched:
    """What a launch function reports for one trial."""

    value: float | None  # the score; None when the trial failed
    kind: str | None = None  # failure kind when value is None
    reason: str = ""
    duration: float | None = None  # wall seconds of the run
    measured_gb: float | None = None  # peak memory the run printed
    attrs: dict[str, Any] = field(default_factory=dict)  # argv, env, log ... stored on the trial


LaunchFn = Callable[[int, dict, "float | None"], Launched]  # (trial number, candidate, timeout) -> result


class Callbacks:
    """Hooks for progress output (all optional)."""

    def launching(self, number: int, cand: dict, why: str, n: int) -> None: ...
    def result(self, outcome: Outcome, n: int) -> None: ...
    def skipped(self, outcome: Outcome) -> None: ...


class StudyLoop:
    def __init__(self, job: Any, study: optuna.Study, launch: LaunchFn, callbacks: Callbacks | None = None,
                 max_consecutive_skips: int = 300):
        self.job = job
        self.study = study
        self.launch = launch
        self.cb = callbacks or Callbacks()
        self.max_consecutive_skips = max_consecutive_skips
        self.measured: dict[tuple, Outcome] = {}
        self.outcomes: list[Outcome] = []

    def start(self, prior: list[Outcome]) -> None:
        """Hand the strategy and the job what a resumed study already knows."""
        # An interrupted trial (Ctrl-C, or the tuner died) measured nothing: the strategy does not see
        # it and the duplicate check does not count it, so the candidate may be launched again.
        prior = [o for o in prior if o.kind != "interrupted"]
        strategy: Strategy = self.job.strategy
        strategy.direction = self.job.evaluator.direction
        strategy.setup(self.job.space, self.job.memory, prior)
        for o in prior:
            self.job.observe(o)
            if o.launched:
                self.measured[self.job.space.key(o.candidate)] = o

    def run(self, n_trials: int, launched: int = 0, fail_fast: int = 0) -> str:
        """Propose and launch until n_trials are launched in all; returns why it stopped.

        With fail_fast=k, stop when the first k launches of the study all failed: a broken command
        should cost k trials, not n_trials."""
        strategy: Strategy = self.job.strategy
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
                if skips >= self.max_consecutive_skips:
                    return (f"{skips} proposals in a row could not be launched "
                            f"(invalid, predicted OOM or already measured)")
                continue
            skips = 0
            launched += 1
            outcome = self._launch(trial, cand, proposal, launched)
            self.outcomes.append(outcome)
            self.measured[self.job.space.key(cand)] = outcome
            self.job.observe(outcome)
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
        trial.set_user_attr("candidate", cand)
        if proposal.stage:
            trial.set_user_attr("stage", proposal.stage)
        if proposal.why:
            trial.set_user_attr("why", proposal.why)
        return trial, cand

    def _screen(self, trial: optuna.Trial, cand: dict, proposal: Proposal) -> Outcome | None:
        """Record and return the outcome of a candidate that must not be launched; None to launch."""
        job = self.job
        predicted = job.predict_gb(cand)
        if predicted is not None:
            trial.set_user_attr("predicted_gb", round(predicted, 2))
        broken = job.space.reasons(cand)
        if not broken:
            oom = job.predicted_oom(cand)
            if oom and proposal.probe_memory:
                trial.set_user_attr("memory_probe", oom)  # launched on purpose; the outcome teaches the estimate
            elif oom:
                broken = [("predicted_oom", oom)]
        dup = self.measured.get(job.space.key(cand))
        if not broken and dup is not None:
            broken = [("duplicate", f"already measured as trial {dup.trial_number}")]
            trial.set_user_attr("duplicate_of", dup.trial_number)
        if not broken:
            return None
        trial.set_user_attr("launched", False)
        trial.set_user_attr("rules", [r for r, _ in broken])
        trial.set_user_attr("reasons", [why for _, why in broken])
        self.study.tell(trial, state=TrialState.PRUNED)
        return Outcome(candidate=cand, state="pruned", reasons=[w for _, w in broken], rules=[r for r, _ in broken],
                       predicted_gb=predicted, trial_number=trial.number, stage=proposal.stage)

    def _launch(self, trial: optuna.Trial, cand: dict, proposal: Proposal, n: int) -> Outcome:
        trial.set_user_attr("launched", True)
        self.cb.launching(trial.number, cand, proposal.why, n)
        started = time.time()
        limit = self.job.trial_timeout()
        if limit is not None:
            trial.set_user_attr("timeout", round(limit, 1))
        try:
            res = self.launch(trial.number, cand, limit)
        except KeyboardInterrupt:
            trial.set_user_attr("kind", "interrupted")
            trial.set_user_attr("reasons", ["interrupted by the user (Ctrl-C)"])
            trial.set_user_attr("duration", round(time.time() - started, 3))
            self.study.tell(trial, state=TrialState.FAIL)
            raise
        for key, value in res.attrs.items():
            trial.set_user_attr(key, value)
        duration = res.duration if res.duration is not None else time.time() - started
        trial.set_user_attr("duration", round(duration, 3))
        if res.measured_gb is not None:
            trial.set_user_attr("measured_gb", round(res.measured_gb, 2))
        common = dict(candidate=cand, launched=True, duration=duration, trial_number=trial.number,
                      predicted_gb=trial.user_attrs.get("predicted_gb"), measured_gb=res.measured_gb,
                      stage=proposal.stage, probe="memory_probe" in trial.user_attrs)
        if res.value is not None:
            self.study.tell(trial, float(res.value))
            return Outcome(state="complete", value=float(res.value), **common)
        reason = res.reason
        if res.kind == "timeout" and limit is not None and limit != _fixed_timeout(self.job):
            reason = f"cut at the dynamic limit {limit:.1f} s (from the fastest success): {reason}"
        trial.set_user_attr("kind", res.kind or "crash")
        trial.set_user_attr("reasons", [reason])
        self.study.tell(trial, state=TrialState.FAIL)
        return Outcome(state="failed", kind=res.kind or "crash", reasons=[reason], **common)


def _fixed_timeout(job: Any) -> float | None:
    cfg = getattr(job, "cfg", None)
    fixed = cfg.get("timeout") if cfg is not None else None
    return float(fixed) if fixed else None
