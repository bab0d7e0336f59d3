"""One trial's record: what became of a candidate, and the only code that writes or reads it.

Every proposal of a study becomes one Optuna trial, and its facts travel as one type, `Outcome`:
  - a strategy receives it (`Strategy.tell`) and a resumed study rebuilds it (`outcome_of`);
  - the study loop stores it in the trial's user_attrs (`store`), keyed by the `Attr` constants;
  - a launched run reports its part of it as `Launched`, which the entry function also leaves in
    `<trial dir>/trial.json` (`write_run` / `read_run`) for a sweeper in another process.
Optuna's state says where it ended: COMPLETE (a score), FAIL (launched, no score: `kind` says why),
PRUNED (never launched: `rules` and `reasons` say why). `analyze` also shows trials still RUNNING, and
reads a study made by the stock `hydra/sweeper=optuna` (`baseline=stock_tpe`), whose trials carry none
of our attributes, from each trial's trial.json (`review`).
"""
from __future__ import annotations

import datetime as _dt
import json
import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from zenithtune.run import FailureKind
from zenithtune.space import RECOMPUTE_PARAMS

if TYPE_CHECKING:
    import optuna
    from optuna.trial import FrozenTrial

State = Literal["complete", "failed", "pruned", "running"]  # running: only in `review` (analyze)

TRIAL_LOG = "trial.log"  # per launched trial: exact argv, then the command's output
TRIAL_INFO = "trial.json"  # per launched trial: a `Launched`, for the sweeper


class Attr:
    """Keys of a zenithtune trial's user_attrs (the study is Optuna's; these are our fields)."""

    CANDIDATE = "candidate"  # every parameter value, including those the sampler did not choose
    LAUNCHED = "launched"  # bool: the command ran (PRUNED trials: False)
    KIND = "kind"  # FailureKind of a FAIL trial
    REASONS = "reasons"  # list of str: why pruned / failed
    RULES = "rules"  # list of str: the pruning rules' names
    ARGV = "argv"  # the exact argv run
    ENV = "env"  # environment variables added to it
    LOG = "log"  # trial.log path
    DURATION = "duration"  # wall seconds
    TIMEOUT = "timeout"  # the limit the trial ran under
    PREDICTED_GB = "predicted_gb"
    MEASURED_GB = "measured_gb"  # Megatron's "max allocated" (GB)
    RESERVED_GB = "reserved_gb"  # Megatron's "max reserved" (GB)
    NEEDED_GB = "needed_gb"  # an OOM message's memory in use + the failed allocation (GB)
    OUTSIDE_GB = "outside_gb"  # an OOM message's memory in use outside PyTorch's allocator (GB)
    STAGE = "stage"  # staged strategies: which stage proposed it
    WHY = "why"  # the strategy's one-line reason
    DUPLICATE_OF = "duplicate_of"
    MEMORY_PROBE = "memory_probe"  # launched past the memory screen on purpose: the screen's reason
    SLURM_JOBS = "slurm_jobs"  # list of str: the Slurm job ids that ran it (zenithtune.slurm)
    RETRY_OF = "retry_of"  # the trial (cancelled under it) whose candidate this one runs again
    RECOVERED_FROM = "recovered_from"  # the dead tuner's trial whose finished Slurm job this one records
    REPEAT_OF = "repeat_of"  # a measured candidate launched again (noise): the trial it repeats
    SPREAD = "spread"  # how much the trial's values after warm-up moved: their MAD / median (evaluate.spread)
    N_VALUES = "n_values"  # how many values after warm-up the score was taken from
    STOPPED_AFTER = "stopped_after"  # stop_when_stable ended the command after this many values (a success)
    SAVED_S = "saved_s"  # seconds the stopped command would still have run (its iterations left x median time)
    LATE_FAILURE = "late_failure"  # scored although it failed: after its training loop finished (run.late_failure)


@dataclass
class Outcome:
    """What became of one candidate."""

    candidate: dict[str, Any]
    state: State
    value: float | None = None  # the score, for complete trials
    kind: str | None = None  # a FailureKind value, for failed trials
    reasons: list[str] = field(default_factory=list)  # why pruned / failed
    rules: list[str] = field(default_factory=list)  # names of the rules that pruned it
    launched: bool = False
    duration: float | None = None
    predicted_gb: float | None = None
    measured_gb: float | None = None
    reserved_gb: float | None = None
    needed_gb: float | None = None
    outside_gb: float | None = None
    trial_number: int | None = None
    stage: str | None = None
    probe: bool = False  # launched past the memory screen on purpose (Proposal.probe_memory)
    repeat_of: int | None = None  # a repeated measurement of this trial's candidate (Proposal.repeat)
    spread: float | None = None  # MAD / median of the values after warm-up (0.01: they lie ~1 % apart)
    n_values: int | None = None  # values after warm-up the score was taken from
    stopped_after: int | None = None  # stop_when_stable ended it after this many values; None: ran to its end
    saved_s: float | None = None  # seconds a stopped trial would still have run (estimated; None: unknown)
    late_failure: str | None = None  # scored, but it failed after its training loop finished (run.late_failure)
    why: str = ""  # the strategy's reason for proposing it
    argv: list[str] | None = None
    env: dict[str, str] | None = None
    log: str | None = None
    timeout: float | None = None
    started: _dt.datetime | None = None  # when the trial started and ended (Optuna's record of it)
    finished: _dt.datetime | None = None

    @property
    def ok(self) -> bool:
        return self.state == "complete" and self.value is not None

    @property
    def usable(self) -> bool:
        """A score a search can learn from: finite and positive. Throughput and seconds per iteration are
        both; anything else (0 from a broken log line, nan, a value stored by an older tuner in a resumed
        study) carries no information about speed."""
        return self.ok and math.isfinite(float(self.value)) and float(self.value) > 0  # type: ignore[arg-type]

    @property
    def counts(self) -> bool:
        """Uses up one of n_trials: launched and finished; an interrupted or cancelled trial measured nothing."""
        return self.launched and self.kind not in (FailureKind.INTERRUPTED.value, FailureKind.CANCELLED.value)


@dataclass
class Launched:
    """What one launched run reports: the score, or why there is none, and the facts of the run."""

    value: float | None  # the score; None when the trial failed
    kind: str | None = None  # FailureKind value when value is None
    reason: str = ""
    duration: float | None = None  # wall seconds of the run
    measured_gb: float | None = None  # peak memory the run printed (max allocated)
    reserved_gb: float | None = None  # max reserved the run printed
    needed_gb: float | None = None  # what an OOM message proves the run needed
    outside_gb: float | None = None  # what an OOM message shows in use outside PyTorch's allocator
    argv: list[str] | None = None
    env: dict[str, str] | None = None
    log: str | None = None
    process: dict[str, Any] | None = None  # processes.TrialProcess: finds the trial's processes again
    metric: str | None = None  # the score's unit (the evaluator's metric_name), e.g. TFLOP/s/GPU
    spread: float | None = None  # MAD / median of the values after warm-up
    n_values: int | None = None  # values after warm-up
    stopped_after: int | None = None  # stop_when_stable ended the command after this many values
    saved_s: float | None = None  # seconds it would still have run (iterations left x median iteration time)
    note: str | None = None  # how the run ended when that is no failure, e.g. "stopped early after 5 values, 42.0 s"
    late_failure: str | None = None  # scored, but it failed after its training loop finished (run.late_failure)


def write_run(path: Path, run: Launched) -> None:
    path.write_text(json.dumps(asdict(run), indent=1))


def read_run(path: Path) -> Launched | None:
    """The run a trial's entry function reported, or None when it left nothing readable."""
    try:
        data = json.loads(path.read_text())
        return Launched(**{k: data.get(k) for k in Launched.__dataclass_fields__})
    except (OSError, ValueError, TypeError):
        return None


# --- the study side ------------------------------------------------------------------------------
def store(trial: optuna.Trial, o: Outcome) -> None:
    """Write an outcome's facts into its (still running) trial's user_attrs."""
    attrs: dict[str, Any] = {
        Attr.LAUNCHED: o.launched, Attr.KIND: o.kind, Attr.REASONS: o.reasons or None, Attr.RULES: o.rules or None,
        Attr.ARGV: o.argv, Attr.ENV: o.env, Attr.LOG: o.log, Attr.TIMEOUT: o.timeout,
        Attr.DURATION: None if o.duration is None else round(o.duration, 3),
        Attr.MEASURED_GB: None if o.measured_gb is None else round(o.measured_gb, 2),
        Attr.RESERVED_GB: None if o.reserved_gb is None else round(o.reserved_gb, 2),
        Attr.NEEDED_GB: None if o.needed_gb is None else round(o.needed_gb, 2),
        Attr.OUTSIDE_GB: None if o.outside_gb is None else round(o.outside_gb, 2),
        Attr.SPREAD: None if o.spread is None else round(o.spread, 5), Attr.N_VALUES: o.n_values,
        Attr.STOPPED_AFTER: o.stopped_after, Attr.SAVED_S: None if o.saved_s is None else round(o.saved_s, 1),
        Attr.LATE_FAILURE: o.late_failure,
    }
    for key, value in attrs.items():
        if value is not None:
            trial.set_user_attr(key, value)


def _amount(value: Any) -> float | None:
    """A stored size or duration, or None: a study db is untrusted input, and a string, a bool or a
    negative or infinite number in it must not reach the memory model or the timeouts."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        return None
    return float(value)


def _count(value: Any) -> int | None:
    """A stored count, or None unless it is a whole number >= 0 (a study db is untrusted input)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _text(value: Any) -> str | None:
    """A stored line, or None unless it is a string (a study db is untrusted input)."""
    return value if isinstance(value, str) else None


def facts(run: Launched) -> dict[str, Any]:
    """The measurement facts of a launched run an Outcome carries as they are (`replace(outcome, **facts(run))`)."""
    return {"spread": _amount(run.spread), "n_values": _count(run.n_values),
            "stopped_after": _count(run.stopped_after), "saved_s": _amount(run.saved_s),
            "late_failure": _text(run.late_failure)}


def outcome_of(t: FrozenTrial) -> Outcome | None:
    """A stored trial as a strategy sees it (None for one still running)."""
    from optuna.trial import TrialState

    state: State | None = {TrialState.COMPLETE: "complete", TrialState.FAIL: "failed",
                           TrialState.PRUNED: "pruned"}.get(t.state)  # type: ignore[assignment]
    if state is None:
        return None
    a = t.user_attrs
    launched = bool(a.get(Attr.LAUNCHED))
    kind, reasons = a.get(Attr.KIND), list(a.get(Attr.REASONS) or [])
    if state == "failed" and launched and kind is None:
        # Failed by someone else than the loop that launched it (a stale trial of a tuner that died).
        kind, reasons = FailureKind.INTERRUPTED.value, reasons or ["the tuner stopped while this trial was running"]
    return Outcome(
        candidate=dict(a.get(Attr.CANDIDATE) or t.params), state=state,
        value=t.value if state == "complete" else None, kind=kind, reasons=reasons,
        rules=list(a.get(Attr.RULES) or []), launched=launched, duration=_amount(a.get(Attr.DURATION)),
        predicted_gb=_amount(a.get(Attr.PREDICTED_GB)), measured_gb=_amount(a.get(Attr.MEASURED_GB)),
        reserved_gb=_amount(a.get(Attr.RESERVED_GB)), needed_gb=_amount(a.get(Attr.NEEDED_GB)),
        outside_gb=_amount(a.get(Attr.OUTSIDE_GB)), trial_number=t.number,
        stage=a.get(Attr.STAGE), probe=Attr.MEMORY_PROBE in a, why=a.get(Attr.WHY) or "",
        repeat_of=a.get(Attr.REPEAT_OF) if isinstance(a.get(Attr.REPEAT_OF), int) else None,
        spread=_amount(a.get(Attr.SPREAD)), n_values=_count(a.get(Attr.N_VALUES)),
        stopped_after=_count(a.get(Attr.STOPPED_AFTER)), saved_s=_amount(a.get(Attr.SAVED_S)),
        late_failure=_text(a.get(Attr.LATE_FAILURE)),
        argv=a.get(Attr.ARGV), env=a.get(Attr.ENV), log=a.get(Attr.LOG), timeout=a.get(Attr.TIMEOUT),
        started=t.datetime_start, finished=t.datetime_complete)


def history(study: optuna.Study) -> list[Outcome]:
    return [o for o in (outcome_of(t) for t in study.get_trials(deepcopy=False)) if o is not None]


def is_stock(study: optuna.Study) -> bool:
    """Made by the stock Optuna sweeper (`baseline=stock_tpe`): no trial carries our attributes."""
    return not any(Attr.LAUNCHED in t.user_attrs or Attr.CANDIDATE in t.user_attrs
                   for t in study.get_trials(deepcopy=False))


def _stock_outcome(t: FrozenTrial, folder: Path | None) -> Outcome:
    """A stock sweeper's trial: parameters named `params.<name>`, and every finished one was a job (one
    the entry function screened out included); what became of it is in its trial_<n>/trial.json."""
    from optuna.trial import TrialState

    state: State = {TrialState.COMPLETE: "complete", TrialState.FAIL: "failed",
                    TrialState.PRUNED: "pruned"}.get(t.state, "running")  # type: ignore[assignment]
    path = folder / f"trial_{t.number}" / TRIAL_INFO if folder is not None else None
    run = read_run(path) if path is not None else None
    o = Outcome(candidate={k.removeprefix("params."): v for k, v in t.params.items()}, state=state,
                value=t.value if state == "complete" else None, launched=state in ("complete", "failed"),
                trial_number=t.number, started=t.datetime_start, finished=t.datetime_complete)
    if run is not None:
        o.duration, o.argv, o.env, o.log = _amount(run.duration), run.argv, run.env, run.log
        o.measured_gb = _amount(run.measured_gb)
        o = replace(o, **facts(run))
    if state == "failed":
        o.kind = (run.kind if run is not None else None) or FailureKind.CRASH.value
        o.reasons = [run.reason if run is not None and run.reason else
                     f"no readable {path or TRIAL_INFO} says why (the entry function did not finish)"]
    return o


def review(study: optuna.Study, folder: Path | None = None) -> list[Outcome]:
    """Every trial of a study as `analyze` shows it, running ones included (state "running"). A
    stock sweeper's study is read from the trial.json files in `folder` (the study.db's folder)."""
    trials = study.get_trials(deepcopy=False)
    if is_stock(study):
        return [_stock_outcome(t, folder) for t in trials]
    out = []
    for t in trials:
        o = outcome_of(t)
        if o is None:  # running (a live study) or waiting
            o = Outcome(candidate=dict(t.user_attrs.get(Attr.CANDIDATE) or t.params), state="running",
                        launched=bool(t.user_attrs.get(Attr.LAUNCHED)), trial_number=t.number, why=t.user_attrs.get(Attr.WHY) or "",
                        started=t.datetime_start)
        out.append(o)
    return out


def stock_metric(study: optuna.Study, folder: Path | None) -> str | None:
    """The unit a stock sweeper's study scored in, from the first trial.json that names it."""
    if folder is None or not is_stock(study):
        return None
    for t in study.get_trials(deepcopy=False):
        run = read_run(folder / f"trial_{t.number}" / TRIAL_INFO)
        if run is not None and run.metric:
            return run.metric
    return None


def launched(outcomes: Iterable[Outcome]) -> list[Outcome]:
    """The outcomes whose command ran (the only filter of its kind: pruned ones never ran)."""
    return [o for o in outcomes if o.launched]


def kind_counts(outcomes: Iterable[Outcome]) -> Counter[str]:
    """Failed launches per failure kind, most common first when iterated with most_common()."""
    return Counter(o.kind or FailureKind.CRASH.value for o in outcomes if o.launched and not o.ok)


def budget_used(outcomes: Iterable[Outcome]) -> int:
    """Launched trials that count against n_trials."""
    return sum(1 for o in outcomes if o.counts)


STRAGGLER = 0.10  # a gap this wide between a candidate's runs parts the runs a straggler slowed from the rest


def central(values: list[float], direction: str) -> float:
    """One candidate's score from its repeated measurements: the mean of those no straggler slowed
    (`unslowed`). Noise on a throughput is one-sided where it is large: a straggler node, a checkpoint, a
    busy filesystem slow a run down, nothing speeds one up past its configuration, so two slowed runs out
    of three must not outvote the healthy one (a median would). What is left is run-to-run noise around
    the configuration's value, whose best estimate is the mean: a median of three or four runs throws away
    what their spread knows and misjudges near ties more often (robustness.py, the heuristic on 88 noisy
    studies: mean best/optimum 0.9920 -> 0.9936, worst 0.943 -> 0.961, below 0.98 13 -> 10;
    benchmarks/results/robustness-heuristic-mean-call.md)."""
    kept = unslowed(values, direction)
    return float(sum(kept) / len(kept))


def unslowed(values: list[float], direction: str) -> list[float]:
    """The measurements of one candidate no straggler slowed: sorted best first, those before the widest
    gap between neighbours when that gap exceeds STRAGGLER; all of them when none does. A window of
    STRAGGLER below the fastest run, the rule before, was anchored at the luckiest run: the more a
    candidate was repeated, the luckier its fastest (+1.4 sd at 8 runs), and genuine runs at the other
    tail fell out of the window, raising the score of exactly the candidates repeated most (3 % noise,
    8 runs: ranges of 8-12 % are common; a 1.5x straggler leaves a gap of 33 %). Where the runs above the
    gap are fewer than half, the gap must exceed twice STRAGGLER."""
    maximize = direction == "maximize"
    ordered = sorted(values, reverse=maximize)
    cut, widest = None, 1.0
    for i in range(1, len(ordered)):
        better, worse = ordered[i - 1], ordered[i]
        slowed = worse < better * (1 - STRAGGLER) if maximize else worse > better * (1 + STRAGGLER)
        ratio = better / worse if maximize else worse / better
        if slowed and ratio > widest:
            cut, widest = ordered[i - 1], ratio
    if cut is None:
        return list(values)
    kept = [v for v in values if (v >= cut if maximize else v <= cut)]
    if 2 * len(kept) < len(values) and widest < 1 + 2 * STRAGGLER:
        # most runs slowed is a strong claim, made only on a gap no noise leaves (twice STRAGGLER): below
        # it, a lone fast run above runs that agree is the lucky one (robustness.py, GQA-13B on the speed
        # trainer with 3 % noise: 215.4 / 185.8 / 180.5 scored 215.4, its true value 192.4)
        return list(values)
    return kept


def chance_above(z: float) -> float:
    """The chance a standard normal draw lands above `z` (an OOM risk: the capacity's distance above the
    predicted peak in sd; a candidate's chance to beat a target)."""
    return 0.5 * math.erfc(z / math.sqrt(2))


def gap_in_se(a: float, runs_a: int, b: float, runs_b: int, noise: float) -> float:
    """How far apart two candidates' scores `a` and `b` (of `runs_a` and `runs_b` runs, `noise` the relative
    sd of one run) are, in standard errors of their difference: the smallest is the rival the noise
    leaves the best chance of being the better one."""
    return abs(math.log(a / b)) / (noise * math.sqrt(1 / runs_a + 1 / runs_b))


def noise_sd(groups: Iterable[list[float]], direction: str, assumed: float) -> float:
    """Run-to-run noise as a relative sd, from repeated candidates' measurements (each group one
    candidate's positive values): pooled over every group's runs no straggler slowed (`unslowed`), once
    three candidates were repeated (a median of a few pairs' spreads is itself so noisy that two lucky
    pairs called 3 % noise 0.5 %); before that, `assumed`. Never below a quarter of `assumed`: repeats
    that agree exactly still leave near ties below that worth another run."""
    measured = measured_noise(groups, direction)
    return assumed if measured is None else max(assumed / 4, measured)


def shows_no_noise(groups: Iterable[list[float]]) -> bool:
    """Did the repeats show a trainer without run-to-run noise: two or more candidates repeated, and every
    repeated candidate's runs the same value? A value is read as printed (Megatron's TFLOP/s to 0.1), and
    at 1 % noise two runs agree that closely about once in a hundred, two pairs once in ten thousand. Then
    another run of a candidate measured twice, or of a near tie, returns what is known: `noise_sd`'s floor
    is for trainers whose repeats did differ (robustness.py, the 64-expert MoE on 64 H100 without noise:
    staged_blackbox's last 5 launches re-ran three candidates whose runs had agreed exactly)."""
    repeated = [values for values in groups if len(values) > 1]
    return len(repeated) >= 2 and all(len(set(values)) == 1 for values in repeated)


def measured_noise(groups: Iterable[list[float]], direction: str) -> float | None:
    """`noise_sd` as the repeats measured it, with no floor; None before three candidates were repeated."""
    ss, dof, repeated = 0.0, 0, 0
    for values in groups:
        if len(values) < 2:
            continue
        repeated += 1
        kept = [math.log(v) for v in unslowed(values, direction)]
        mean = sum(kept) / len(kept)
        ss += sum((k - mean) ** 2 for k in kept)
        dof += len(kept) - 1
    return None if repeated < 3 or not dof else math.sqrt(ss / dof)


def best_of(outcomes: list[Outcome], direction: str, *, pool_recompute: bool = False) -> Outcome | None:
    """The complete outcome of the candidate with the best score. A candidate measured several times
    (`Proposal.repeat`) counts once, at `central` of its scores (the mean of its runs that no
    straggler slowed): returned as its measurement nearest that value, carrying it as its value.
    `pool_recompute`: the study's call, where recomputing only adds work (`_recompute_pooled`)."""
    groups: dict[str, list[Outcome]] = {}
    for o in outcomes:
        if o.ok:
            groups.setdefault(json.dumps(o.candidate, sort_keys=True, default=str), []).append(o)
    if not groups:
        return None
    sign = 1.0 if direction == "maximize" else -1.0
    values = {k: [float(o.value) for o in g] for k, g in groups.items()}  # type: ignore[arg-type]
    scores = {k: central(v, direction) for k, v in values.items()}
    if pool_recompute:
        scores = _recompute_pooled(values, scores, direction)
    # pooled, a tie goes to the candidate without recompute; unpooled, to the first measured
    key = max(groups, key=lambda k: (sign * scores[k], pool_recompute and no_recompute(groups[k][0].candidate)))
    group, score = groups[key], scores[key]
    if len(group) == 1 and score == group[0].value:
        return group[0]
    nearest = min(group, key=lambda o: abs(float(o.value) - score))  # type: ignore[arg-type]
    return replace(nearest, value=score)


def no_recompute(cand: dict) -> bool:
    """Does the candidate run without activation recompute?"""
    return (cand.get("recompute_granularity") or "none") == "none"


def _recompute_pooled(values: dict[str, list[float]], scores: dict[str, float], direction: str) -> dict[str, float]:
    """Recomputing only adds work: a candidate without recompute is at least as fast as its twin (the same
    layout, MBS and switches) with any recompute. Where the runs rank a twin better by less than the noise
    can explain (two standard errors of the difference, at the noise the repeats measured), both are scored
    by the `central` value of their runs pooled, and the tie goes to the one without recompute (the least
    squares fit under that order). Without measured noise (fewer than three candidates repeated) or with
    none (repeats that agree exactly) the scores stand. robustness.py with noise: a layout with one layer
    recomputed, its median 5 % above its truth, was called best over the same layout without recompute (truth
    2 % higher; Llama-3-8B at s=32k, speed trainer, 0.938 -> 0.955); over 171 cached studies, 19 calls change,
    18 for the better (benchmarks/results/robustness-heuristic-pooled-call.md)."""
    noise = measured_noise(values.values(), direction)
    if not noise:
        return scores
    sign = 1.0 if direction == "maximize" else -1.0
    out = dict(scores)
    cands = {k: json.loads(k) for k in values}
    twin = {k: json.dumps({n: v for n, v in c.items() if n not in RECOMPUTE_PARAMS}, sort_keys=True)
            for k, c in cands.items()}
    for a, ca in cands.items():
        if not no_recompute(ca):
            continue
        for b in cands:
            if b == a or twin[b] != twin[a] or sign * scores[b] <= sign * scores[a]:
                continue
            if gap_in_se(scores[b], len(values[b]), scores[a], len(values[a]), noise) >= 2:
                continue
            pooled = central(values[a] + values[b], direction)
            out[a] = pooled if sign * pooled > sign * out[a] else out[a]
            out[b] = pooled if sign * pooled < sign * out[b] else out[b]
    return out
