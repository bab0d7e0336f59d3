"""The study loop, independent of how a trial is launched.

One wave: learn what other workers measured -> propose up to `parallel` candidates (strategy) ->
sample what is left open (Optuna ask) -> screen (rules, predicted OOM, already measured) -> claim
(no other worker launches it) -> launch the wave together -> record (Optuna tell) -> tell the
strategy and the job. Screened-out proposals are recorded as PRUNED, never launched, and do not
count against n_trials. n_trials counts the whole study (every worker sharing the storage), re-read
right before each launch.

The zenithtune Hydra sweeper launches a wave through the Hydra launcher (one `launch` call: the
basic launcher runs it in turn, submitit as parallel Slurm jobs); the benchmark launches the
simulator in-process. Both run this same loop.
"""
from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace

import optuna
from optuna.trial import TrialState

from zenithtune import record, signals
from zenithtune import study as zstudy
from zenithtune.assessment import MEMORY_RULE, OOM_DOMINATED_RULE
from zenithtune.evaluate import below_precision
from zenithtune.job import Job
from zenithtune.record import Attr, Launched, Outcome
from zenithtune.run import FailureKind
from zenithtune.strategies import Proposal

__all__ = ["Callbacks", "LaunchFn", "LaunchBatchFn", "Launched", "Pending", "StudyLoop", "WaveInterrupted"]

# Outcomes that measured nothing: not told to the strategy, not a duplicate, not counted in n_trials.
_NOTHING_MEASURED = (FailureKind.INTERRUPTED.value, FailureKind.CANCELLED.value)

LaunchFn = Callable[[int, dict, "float | None"], Launched]  # (trial number, candidate, timeout) -> result
# The last launches of a budget confirm the best, whatever the strategy (one that confirms its best
# itself does it when it stops on its own, not when the budget runs out under it: for such a strategy the
# loop steps in once repeats showed the trainer noisy, beyond NOISE / 4): while the noise cannot
# tell a candidate from the best, the best and its likeliest rival are measured again (up to CONFIRM_RUNS
# runs each), and a candidate whose two runs disagree beyond record.STRAGGLER gets a third, which decides.
# At most CONFIRM_AT_END launches (an eighth of the budget, at least 2); the noise is NOISE (relative sd)
# until repeats measure it (record.noise_sd). Once repeats showed the noise (beyond NOISE / 4), up to
# NOISY_CONFIRM_RUNS runs each, as the heuristic's own confirmations: at 3 % noise the mean of 4 runs is
# within 1.5 %, and two near ties run 3 times each may still be 4 % apart in truth (robustness.py, the
# 64-expert MoE on 16 H100, stand-in trainer with noise: the optimum and a configuration 4.4 % slower had
# 3 runs each, the slower one ahead, and the budget's last launch went to a rival run once).
CONFIRM_AT_END = 6
CONFIRM_SHARE = 8
CONFIRM_RUNS = 3
NOISY_CONFIRM_RUNS = 4
NOISE = 0.03


def confirm_window(n_trials: int) -> int:
    """The budget's last launches the loop may spend confirming the best (CONFIRM_AT_END, CONFIRM_SHARE)."""
    return max(2, min(CONFIRM_AT_END, n_trials // CONFIRM_SHARE))


@dataclass
class Pending:
    """A screened, claimed candidate about to be launched in this wave."""

    trial: optuna.Trial
    cand: dict
    proposal: Proposal
    limit: float | None  # its time limit
    n: int  # its place in the study's budget (1..n_trials)

    @property
    def number(self) -> int:
        return self.trial.number


LaunchBatchFn = Callable[[list[Pending]], list[Launched]]  # one wave -> one result per trial, in order


class WaveInterrupted(KeyboardInterrupt):
    """A stop arrived while a wave ran: what each trial had reported by then (None: nothing), in order.
    A trial that finished before the stop keeps its result."""

    def __init__(self, results: list[Launched | None]) -> None:
        super().__init__()
        self.results = results


class Callbacks:
    """Hooks for progress output (all optional)."""

    def launching(self, number: int, cand: dict, why: str, n: int) -> None: ...
    def result(self, outcome: Outcome, n: int) -> None: ...
    def skipped(self, outcome: Outcome) -> None: ...


class StudyLoop:
    def __init__(self, job: Job, study: optuna.Study, launch: LaunchFn | None = None,
                 callbacks: Callbacks | None = None, max_consecutive_skips: int = 300, *,
                 launch_batch: LaunchBatchFn | None = None, parallel: int = 1,
                 liveness: zstudy.Liveness | None = None):
        if launch is None and launch_batch is None:
            raise TypeError("StudyLoop needs launch or launch_batch")
        self.job = job
        self.study = study
        self.launch = launch
        self.launch_batch = launch_batch or self._one_by_one
        self.parallel = max(1, int(parallel))
        self.cb = callbacks or Callbacks()
        self.max_consecutive_skips = max_consecutive_skips
        # Shared studies: liveness beats for our running trials; claims keep workers from launching
        # the same candidate twice.
        self.liveness = liveness
        self.claims = zstudy.Claims(study)
        self.measured: dict[tuple, Outcome] = {}
        self.outcomes: list[Outcome] = []
        self.durations: list[float] = []  # successful trials' wall times (dynamic timeouts)
        self.waves = 0
        # The OOM budget (`max_ooms`), whatever the strategy: past it only what is proven to fit launches
        # (the judge keeps the runs that fit and those that ran out: `Setting.fit_runs`, `oom_runs`).
        self.max_ooms = job.max_ooms
        self._unproven_in_wave = 0  # launches of this wave that may run out of memory
        self._unproven = False  # the candidate just screened is one of those
        self._known: set[int] = set()  # trial numbers the strategy has been told about
        self._open: dict[int, optuna.Trial] = {}  # asked here, not yet told
        self.retries: list[tuple[Proposal, int]] = []  # (candidate, trial) whose Slurm job was cancelled: run once more

    def start(self, prior: list[Outcome]) -> None:
        """Hand the strategy and the job what a resumed study already knows."""
        # An interrupted trial (Ctrl-C, or the tuner died) measured nothing: the strategy does not see
        # it and the duplicate check does not count it, so the candidate may be launched again.
        self._known |= {o.trial_number for o in prior if o.trial_number is not None}
        prior = [o for o in prior if o.kind not in _NOTHING_MEASURED]
        self.job.strategy.setup(self.job, prior, self.job.evaluator.direction, self.job.evaluator.metric_name)
        for o in prior:
            self._learn(o)

    def _learn(self, o: Outcome) -> None:
        self.job.observe(o)  # the judge learns (memory, refused features) before the strategy is told
        if o.launched:
            self.measured.setdefault(self.job.space.key(o.candidate), o)  # a repeat names the first
            if o.ok and o.duration and o.stopped_after is None:  # stopped once stable: says nothing of a whole run
                self.durations.append(float(o.duration))

    def _sync(self) -> None:
        """Tell the strategy what other workers measured since the last wave (a shared study)."""
        if self.liveness is None:
            return
        for t in self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.FAIL)):
            if t.number in self._known or t.number in self._open:
                continue
            o = record.outcome_of(t)
            if o is None or not o.launched or o.kind in _NOTHING_MEASURED:
                continue  # still beating elsewhere, or measured nothing
            self._known.add(t.number)
            self._learn(o)
            self.job.strategy.tell(o)

    def _used(self, launched_here: int) -> int:
        """Budget used by the whole study: with a shared storage, recounted from it."""
        if self.liveness is None:
            return launched_here
        return zstudy.budget_in_use(self.study)

    def run(self, n_trials: int, launched: int = 0, fail_fast: int = 0) -> str:
        """Propose and launch until n_trials are launched in all; returns why it stopped.

        With fail_fast=k, stop when the first k launches of the study all failed: a broken command
        should cost k trials, not n_trials."""
        strategy = self.job.strategy
        skips = 0
        first_used: int | None = None
        while True:
            signals.check()  # a stop the garbage collector swallowed (held by signals) ends the study here
            if self.liveness is not None:
                self.liveness.fail_stale()
            self._sync()
            used = self._used(launched)
            first_used = used if first_used is None else first_used
            if used >= n_trials:
                return f"n_trials={n_trials} launched"
            failing = self._failing(fail_fast, first_used, used)
            if failing:
                return failing
            wave: list[Pending] = []
            self._unproven_in_wave = 0
            exhausted = False
            stop: str | None = None
            width = 1 if strategy.sequential else self.parallel
            while len(wave) < min(width, n_trials - used):
                # a cancelled Slurm trial's retry first; then a confirmation the loop owes the budget's end;
                # then the strategy (the next ask proposes something else than the wave)
                proposal: Proposal | None
                retry_of: int | None = None
                if self.retries:
                    proposal, retry_of = self.retries.pop(0)
                else:
                    left = n_trials - used - len(wave)
                    strategy.free_launches = left - confirm_window(n_trials)
                    proposal = self._confirmation(left, n_trials, wave) or strategy.ask([p.cand for p in wave])
                if proposal is None:
                    exhausted = True
                    break
                trial, cand = self._ask(proposal)
                outcome = self._screen(trial, cand, proposal)
                if outcome is None:
                    outcome = self._claim(trial, cand, proposal)
                if outcome is not None:
                    self.outcomes.append(outcome)
                    strategy.tell(outcome)
                    self.cb.skipped(outcome)
                    skips += 1
                    if self.max_consecutive_skips and not strategy.exhaustive and skips >= self.max_consecutive_skips:
                        stop = (f"{skips} proposals in a row could not be launched "
                                f"(invalid, predicted OOM or already measured)")
                        break  # the candidates already in this wave are launched first
                    continue
                skips = 0
                # A shared study: another worker may have launched since the count above.
                if len(wave) == 0 and self.liveness is not None:
                    used = self._used(launched)
                    if used >= n_trials:
                        self._abandon_wave([Pending(trial, cand, proposal, None, 0)])
                        return f"n_trials={n_trials} launched"
                trial.set_user_attr(Attr.LAUNCHED, True)
                if retry_of is not None:
                    trial.set_user_attr(Attr.RETRY_OF, retry_of)
                self._unproven_in_wave += self._unproven
                wave.append(Pending(trial, cand, proposal, self.job.timeouts.limit(self.durations),
                                    n=used + len(wave) + 1))
            if not wave:
                if stop:
                    return stop
                if exhausted:
                    why = strategy.stop_reason
                    return f"strategy exhausted: {why}" if why else "strategy exhausted"
                continue
            launched += len(wave)
            self._launch_wave(wave)  # an exhausted strategy may have more to say once it knows the results
            if stop:
                return stop

    def _failing(self, fail_fast: int, first_used: int, used: int) -> str | None:
        """Why a study whose launches all failed stops now (fail_fast), or None."""
        if not fail_fast or any(o.ok for o in self.measured.values()):
            return None
        # only when this run's launches reached the k-th (a resumed study is given its chance)
        if first_used < fail_fast <= used:
            return f"the first {fail_fast} launched trials all failed (fail_fast={fail_fast})"
        metric = self.job.evaluator.metric_name
        zero = next((o for o in self.measured.values() if o.kind == FailureKind.BAD_METRIC.value
                     and below_precision(" ".join(o.reasons), metric)), None)
        if zero:  # the metric is below the printed precision for this model: it is for every candidate
            return (f"trial {zero.trial_number} printed {metric} as 0 (below the printed "
                    f"precision), as every candidate would: rerun with evaluator=iteration_time, which scores by "
                    f"'elapsed time per iteration' (the same ranking at a fixed model and gbs)")
        return None

    def _confirmation(self, left: int, n_trials: int, wave: list[Pending]) -> Proposal | None:
        """Within the budget's last CONFIRM_AT_END launches (fewer in a small budget), one lucky run must
        not decide the study (issue 19 1d): a best that ran once is measured again; a candidate the noise
        cannot tell from the best (within two standard errors of the difference of their scores) whose two
        runs disagree beyond record.STRAGGLER gets a third (one run is set aside as slowed, so the other
        alone, perhaps a lucky one, would decide); then the best and its likeliest rival, the one of the
        two measured fewer times, up to CONFIRM_RUNS each (NOISY_CONFIRM_RUNS once repeats showed the noise
        beyond NOISE / 4). Every strategy: one that confirms its best
        itself (`Strategy.confirms_best`, the heuristic) does so when it stops on its own, not when the
        budget runs out under it; for it the loop steps in once three repeated candidates showed noise
        beyond NOISE / 4."""
        if left > confirm_window(n_trials):
            return None
        direction = self.job.evaluator.direction
        runs: dict[tuple, list[Outcome]] = {}
        for o in self.outcomes:
            if o.launched and o.usable:
                runs.setdefault(self.job.space.key(o.candidate), []).append(o)
        if len(runs) < 2:
            return None
        values = {k: [float(o.value) for o in g] for k, g in runs.items()}  # type: ignore[arg-type]
        if record.shows_no_noise(values.values()):
            return None  # repeats agreed exactly: another run returns what is known
        shown = record.measured_noise(values.values(), direction)
        noisy = shown is not None and shown > NOISE / 4
        if self.job.strategy.confirms_best and not noisy:
            # it confirms its best itself when it stops on its own; when the budget runs out under it first,
            # the loop does, on a trainer whose repeats showed noise (not for ties that repeats showed exact)
            return None
        most = NOISY_CONFIRM_RUNS if noisy else CONFIRM_RUNS
        in_wave = [self.job.space.key(p.cand) for p in wave]
        count = {k: len(v) + in_wave.count(k) for k, v in values.items()}
        score = {k: record.central(v, direction) for k, v in values.items()}
        sign = 1.0 if direction == "maximize" else -1.0
        ranked = sorted(score, key=lambda k: -sign * score[k])
        best = ranked[0]
        noise = record.noise_sd(values.values(), direction, NOISE)
        near = [k for k in ranked[1:] if record.gap_in_se(score[best], count[best], score[k], count[k], noise) < 2]
        tied = [best, *near]
        split = [k for k in tied if count[k] == len(values[k]) == 2 and len(record.unslowed(values[k], direction)) < 2]
        if count[best] < 2:
            k, why = best, "the best ran once: confirmed before it is called the best"
        elif split:
            k = split[0]
            a, b = values[k]
            why = f"its two runs ({a:.4g}, {b:.4g}) disagree beyond {100 * record.STRAGGLER:.0f} %: a third decides"
        else:
            # The few launches left go where the call is likeliest to be wrong: the rival the noise leaves the
            # best chance of being the better one (the smallest gap in standard errors of the difference),
            # and of the two, the one measured fewer times. Spread over every near tie instead, they went
            # to rivals run once and the best's closest rival, the optimum, never got its third run (the
            # 64-expert MoE on 16 H100 with noise: 0.953).
            rivals = [k for k in near if min(count[k], count[best]) < most]
            if not rivals:
                return None
            other = min(rivals, key=lambda k: (record.gap_in_se(score[best], count[best], score[k], count[k], noise),
                                               ranked.index(k)))
            k = min((other, best), key=count.__getitem__)  # fewer runs (a tie: the rival); below `most`
            gap = abs(math.log(score[best] / score[other]))
            why = (f"the best two are {100 * gap:.1f} % apart, which the noise ({100 * noise:.1f} %) does not "
                   f"decide after {count[best]} and {count[other]} run{'s' if count[other] > 1 else ''}")
        first = runs[k][0]
        return Proposal(dict(first.candidate), repeat=True, stage="confirm",
                        why=f"confirm (noise): {why}; trial {first.trial_number} measured again")

    def abandon(self) -> None:
        """Close what this worker asked but did not tell (Ctrl-C, an error): launched ones are
        recorded as interrupted, the rest as pruned."""
        for number, trial in list(self._open.items()):
            launched = bool(trial.user_attrs.get(Attr.LAUNCHED)) if hasattr(trial, "user_attrs") else False
            try:
                self.study.tell(trial, state=TrialState.FAIL if launched else TrialState.PRUNED, skip_if_finished=True)
            except Exception:  # noqa: BLE001  the storage may be what failed; liveness will catch it later
                pass
            self._close(number)
        if self.liveness is not None:
            self.liveness.stop()

    def _abandon_wave(self, wave: list[Pending]) -> None:
        for p in wave:
            p.trial.set_user_attr(Attr.LAUNCHED, False)
            p.trial.set_user_attr(Attr.REASONS, ["not launched: the study's budget was used by other workers"])
            self.study.tell(p.trial, state=TrialState.PRUNED)
            self._close(p.number)

    def _close(self, number: int) -> None:
        self._open.pop(number, None)
        self._known.add(number)
        if self.liveness is not None:
            self.liveness.release(number)

    # --- one proposal ------------------------------------------------------------------------------
    def _ask(self, proposal: Proposal) -> tuple[optuna.Trial, dict]:
        space = self.job.space
        fixed = space.normalize(proposal.fixed, fill=False) if proposal.fixed else {}  # the rest is sampled
        # Fixed values go through this worker's sampler, not the study's queue: an enqueued trial
        # could be popped by another worker's ask().
        base = self.study.sampler
        if fixed:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                self.study.sampler = optuna.samplers.PartialFixedSampler(fixed, base)
        try:
            with warnings.catch_warnings():
                # Optuna says its heartbeat is meant for Study.optimize: Liveness beats for ask/tell trials
                warnings.filterwarnings("ignore", message="Heartbeat of storage")
                trial = self.study.ask()
            self._open[trial.number] = trial
            if self.liveness is not None:
                self.liveness.hold(trial)
            names = None if proposal.sample is None else tuple(proposal.sample) + tuple(fixed)
            cand = space.suggest(trial, names=names)
        finally:
            self.study.sampler = base
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
        verdict = job.assess(cand)  # the judge: rules, policies, memory, refused features
        predicted = verdict.predicted_gb
        if predicted is not None:
            trial.set_user_attr(Attr.PREDICTED_GB, round(predicted, 2))
        broken = list(verdict.reasons)
        vetoed = None if broken or proposal.veto is None else proposal.veto(cand)  # Megatron's word first
        if vetoed:
            broken = [("strategy", vetoed)]
        if broken and broken[0][0] == MEMORY_RULE and proposal.probe_memory:
            trial.set_user_attr(Attr.MEMORY_PROBE, broken[0][1])  # launched on purpose; the outcome teaches
            # ... but never past what an OOM proves
            broken = [(OOM_DOMINATED_RULE, verdict.oom_dominated)] if verdict.oom_dominated else []
        self._unproven = False
        if not broken:
            broken = self._oom_budget(cand)
        if not broken and proposal.max_risk is not None and verdict.oom_risk > proposal.max_risk:
            self._unproven = False
            broken = [("oom_risk", f"{100 * verdict.oom_risk:.0f} % risk of running out of memory, above the "
                                   f"{100 * proposal.max_risk:.0f} % its strategy allows here")]
        dup = self.measured.get(job.space.key(cand))
        if not broken and dup is not None and proposal.repeat:
            trial.set_user_attr(Attr.REPEAT_OF, dup.trial_number)  # measured again on purpose (noise)
        elif not broken and dup is not None:
            broken = [("duplicate", f"already measured as trial {dup.trial_number}")]
            trial.set_user_attr(Attr.DUPLICATE_OF, dup.trial_number)
        if not broken:
            return None
        return self._prune(trial, cand, proposal, broken, predicted)

    # --- the OOM budget, for every strategy ---------------------------------------------------------
    def proof_of_fit(self, cand: dict) -> str | None:
        """Why `cand` surely fits, or None: it needs no more memory than a run that fit, by structure
        (the judge's `fit_proof`), or a measured run's peak plus the estimate's difference, inflated,
        stays within what a run that fit held (`bound_proof`). Before any run fit, the learned memory
        model's 3 sd under the GPU's capacity stands in (nothing else can start a study); after, not:
        the estimate's formulas may not be the trainer's (activations growing faster than the
        micro-batch, experts that TP does not split), and a memory model fitted to them can be
        confidently wrong about the whole; the bound trusts it only for what differs."""
        a = self.job.assess(cand)
        if a.fits_surely is not None:
            return a.fits_surely
        if self.job.fit_runs or a.predicted_gb is None or a.sd is None:
            return None
        if a.predicted_gb + 3 * a.sd <= self.job.capacity_gb:
            return f"learned {a.predicted_gb:.0f} +- {a.sd:.1f} GB, 3 sd under {self.job.capacity_gb:g} GB"
        return None

    def _oom_budget(self, cand: dict) -> list[tuple[str, str]]:
        """The study's OOM budget, whatever the strategy: once `max_ooms` launches ran out of memory
        (counting this wave's launches not proven to fit), only what `proof_of_fit` proves fits is
        launched. (What an OOM proves, `oom_dominated`, is among the judge's reasons already.)"""
        if self.proof_of_fit(cand) is not None:
            return []
        ooms = len(self.job.oom_runs)
        if ooms + self._unproven_in_wave >= self.max_ooms:
            gb = self.job.assess(cand).predicted_gb
            est = "" if gb is None else f" (predicted {gb:.0f} GB)"
            return [("oom_budget", f"the study spent its max_ooms={self.max_ooms} launches that may run out of "
                                   f"memory ({ooms} ran out); this candidate{est} is not proven to fit")]
        self._unproven = True
        return []

    def _prune(self, trial: optuna.Trial, cand: dict, proposal: Proposal, broken: list[tuple[str, str]],
               predicted: float | None) -> Outcome:
        outcome = Outcome(candidate=cand, state="pruned", reasons=[w for _, w in broken], rules=[r for r, _ in broken],
                          predicted_gb=predicted, trial_number=trial.number, stage=proposal.stage, why=proposal.why)
        record.store(trial, outcome)
        self.study.tell(trial, state=TrialState.PRUNED)
        self._close(trial.number)
        return outcome

    def _claim(self, trial: optuna.Trial, cand: dict, proposal: Proposal) -> Outcome | None:
        """Claim the candidate for this trial in the storage; a duplicate outcome if another holds it.
        A repeat is launched under the claim its first measurement holds."""
        if proposal.repeat and Attr.REPEAT_OF in trial.user_attrs:
            return None
        held = self.claims.claim(zstudy.claim_key(self.job.space.key(cand)), trial.number, self._measured_nothing)
        if held is None or held == trial.number:
            return None
        trial.set_user_attr(Attr.DUPLICATE_OF, held)
        return self._prune(trial, cand, proposal, [("duplicate", f"claimed by trial {held} (another worker)")],
                           trial.user_attrs.get(Attr.PREDICTED_GB))

    def _measured_nothing(self, number: int) -> bool:
        """Trial `number` ended without a measurement a claim should protect (interrupted, or never
        launched): its candidate may be launched again."""
        for t in self.study.get_trials(deepcopy=False):
            if t.number == number:
                if t.state == TrialState.RUNNING:
                    return False
                o = record.outcome_of(t)
                return o is not None and (not o.launched or o.kind in _NOTHING_MEASURED)
        return True

    # --- one wave ----------------------------------------------------------------------------------
    def _one_by_one(self, wave: list[Pending]) -> list[Launched]:
        assert self.launch is not None
        return [self.launch(p.number, p.cand, p.limit) for p in wave]

    def _launch_wave(self, wave: list[Pending]) -> None:
        self.waves += 1
        if len(wave) == 1:
            p = wave[0]
            self.cb.launching(p.number, p.cand, p.proposal.why, p.n)
        started = time.time()
        results: list[Launched | None] = [None] * len(wave)
        try:
            results = list(self.launch_batch(wave))
            with signals.deferred():  # a stop signal waits until the wave is recorded
                for p, res in zip(wave, results):
                    assert res is not None  # launch_batch returned one result per trial
                    if len(wave) > 1:
                        self.cb.launching(p.number, p.cand, p.proposal.why, p.n)
                    outcome = self._record(p, res, started)
                    self.outcomes.append(outcome)
                    if outcome.kind == FailureKind.CANCELLED.value and Attr.RETRY_OF not in p.trial.user_attrs:
                        # scancel'd under it: it measured nothing and does not count; run it once more, then let it go
                        self.retries.append((replace(p.proposal, fixed=dict(p.cand), sample=None, complete=None,
                                                     why=f"retry: trial {p.number}'s Slurm job was cancelled"), p.number))
                    else:
                        self._learn(outcome)
                        self.job.strategy.tell(outcome)
                    self.cb.result(outcome, p.n)
        except KeyboardInterrupt as stop:
            results = stop.results if isinstance(stop, WaveInterrupted) else results
            with signals.deferred():  # a second signal must not cut this short either
                for p, res in zip(wave, results):
                    if p.number not in self._open:
                        continue  # recorded before the stop
                    if res is not None and (res.value is not None or res.kind not in (None, FailureKind.INTERRUPTED.value)):
                        self.cb.result(self._record(p, res, started), p.n)  # it finished before the stop
                        continue
                    outcome = replace(self._base(p), kind=FailureKind.INTERRUPTED.value,
                                      duration=time.time() - started, reasons=[signals.reason()])
                    record.store(p.trial, outcome)
                    self.study.tell(p.trial, state=TrialState.FAIL)
                    self._close(p.number)
            raise

    def _base(self, p: Pending) -> Outcome:
        return Outcome(candidate=p.cand, state="failed", launched=True, trial_number=p.number,
                       predicted_gb=p.trial.user_attrs.get(Attr.PREDICTED_GB), stage=p.proposal.stage,
                       probe=Attr.MEMORY_PROBE in p.trial.user_attrs, why=p.proposal.why,
                       repeat_of=p.trial.user_attrs.get(Attr.REPEAT_OF),
                       timeout=None if p.limit is None else round(p.limit, 1))

    def _record(self, p: Pending, res: Launched, started: float) -> Outcome:
        outcome = replace(self._base(p), duration=res.duration if res.duration is not None else time.time() - started,
                          measured_gb=res.measured_gb, reserved_gb=res.reserved_gb, needed_gb=res.needed_gb,
                          outside_gb=res.outside_gb,
                          argv=res.argv, env=res.env, log=res.log, **record.facts(res))
        if res.value is not None:
            outcome = replace(outcome, state="complete", value=float(res.value))
            record.store(p.trial, outcome)
            self.study.tell(p.trial, outcome.value, skip_if_finished=True)
        else:
            reason = res.reason
            if res.kind == FailureKind.TIMEOUT.value and self.job.timeouts.is_dynamic_cut(p.limit):
                reason = f"cut at the dynamic limit {p.limit:.1f} s (from the fastest success): {reason}"
            outcome = replace(outcome, kind=res.kind or FailureKind.CRASH.value, reasons=[reason])
            if self.job.refusal(outcome) is not None:  # a trait of the configuration, not bad luck
                outcome = replace(outcome, kind=FailureKind.INVALID_ARGS.value)
            record.store(p.trial, outcome)
            self.study.tell(p.trial, state=TrialState.FAIL, skip_if_finished=True)
        self._close(p.number)
        return outcome
