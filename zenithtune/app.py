"""THE entry function: config -> inject options -> run the command -> evaluate -> score.

Every trial of a study (launched by the zenithtune sweeper through a Hydra launcher) and every single
run (`python -m zenithtune tuned=NAME -- cmd`, `zenithtune apply`) goes through here. `task` returns
the score (e.g. TFLOP/s/GPU) or raises `TrialFailure` naming the failure kind and the log; the facts
of the run (exact argv, added env, duration, measured memory) land in `<trial dir>/trial.json`
(`record.write_run`) for the sweeper to store in the study.
"""
from __future__ import annotations

import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from zenithtune import signals
from zenithtune.errors import UserError
from zenithtune.evaluate import Evaluator, NoMetric, PeakMemory, TrainingClock, memory_evidence, spread, stable
from zenithtune.inject import inject
from zenithtune.job import build_setting, screen_params
from zenithtune.record import TRIAL_INFO, TRIAL_LOG, Launched, write_run
from zenithtune.run import FailureKind, classify, late_failure, run
from zenithtune.settings import StableConf, ZenithtuneConf, build, trial_params, wrapped_command
from zenithtune.slurm import node_suffix
from zenithtune.space import options_for
from zenithtune.validate import Layout, required_env


class TrialFailure(Exception):
    """A launched trial that produced no score: kind is a FailureKind value."""

    def __init__(self, kind: str, reason: str, log_path: str | None = None):
        super().__init__(f"{kind}: {reason}" + (f" (log: {log_path})" if log_path else ""))
        self.kind = kind
        self.reason = reason
        self.log_path = log_path

    def __reduce__(self) -> tuple[Any, ...]:  # picklable across launchers (submitit)
        return (TrialFailure, (self.kind, self.reason, self.log_path))


def compose(conf: ZenithtuneConf) -> tuple[list[str], dict[str, str]]:
    """The exact argv and the added environment for this config's parameters."""
    argv = wrapped_command(conf)
    params = trial_params(conf)
    argv = inject(argv, options_for(conf.preset, params, conf.gbs, argv))
    lay = Layout(n_gpus=conf.n_gpus, gbs=conf.gbs, tp=int(params.get("tp", 1)), cp=int(params.get("cp", 1)))
    return argv, required_env(lay)


def _feed_all(evaluator: Any, memory: PeakMemory, clock: TrainingClock, line: str) -> None:
    evaluator.feed(line)
    memory.feed(line)
    clock.feed(line)


def stable_rule(rule: StableConf, evaluator: Evaluator) -> Callable[[], str | None] | None:
    """What run() polls to end a trial whose metric is stable (stop_when_stable); None when it is off."""
    if not rule.k:
        return None

    def enough() -> str | None:
        if not stable(evaluator.kept(rule.k), rule.k, rule.within):
            return None
        return (f"stop_when_stable: the last {rule.k} of {len(evaluator.kept())} {evaluator.metric_name} values "
                f"after warm-up lie within {rule.within:.1%} of their median")

    return enough


def task(conf: ZenithtuneConf, out_dir: Path) -> float:
    """Run one trial: inject this config's params into the command, run it, return its score."""
    out_dir.mkdir(parents=True, exist_ok=True)
    argv, env = compose(conf)
    node = node_suffix()  # node k > 0 of a multi-node Slurm job: trial.node<k>.log / .json beside node 0's
    log_path = out_dir / TRIAL_LOG.replace(".log", f"{node}.log")
    info_path = out_dir / TRIAL_INFO.replace(".json", f"{node}.json")
    if conf.validate_in_task:  # a sweeper that cannot screen before launch drives us
        problem = screen_params(conf)
        if problem:
            write_run(info_path, Launched(None, FailureKind.INVALID_ARGS.value, problem, argv=argv, env=env))
            raise TrialFailure(FailureKind.INVALID_ARGS.value, f"not launched: {problem}")
    evaluator, memory = build(conf.evaluator), PeakMemory()
    evaluator.begin()
    started = time.time()
    # A stop signal is held until trial.json is written (then raised as KeyboardInterrupt): while the
    # command runs, run() sees it and kills the trial's process group (recorded as interrupted); once the
    # command has exited by itself, its result is kept whole.
    with signals.deferred():
        return _measure(conf, out_dir, argv, env, evaluator, memory, started, log_path, info_path)


def _measure(conf: ZenithtuneConf, out_dir: Path, argv: list[str], env: dict[str, str], evaluator: Any,
             memory: PeakMemory, started: float, log_path: Path, info_path: Path) -> float:
    """Run the command, score it, write log_path and info_path (trial.log / trial.json, or node k's);
    the score, or TrialFailure / KeyboardInterrupt."""
    # The trial dir marks every process of the trial (ZENITHTUNE_TRIAL): a resumed study finds what a
    # killed tuner left running with processes.kill_leftovers(<trial dir>). Node k > 0 of a multi-node job
    # adds its suffix: its clean-up after its own command exits must not kill node 0's command when two
    # "nodes" share a host (one machine running several slurmd, or a node's tasks sharing a host).
    clock = TrainingClock()  # how many iterations a trial stopped early had left
    res = run(argv, log_path=log_path, timeout=conf.timeout, env=env,
              echo=(lambda line: print(line, flush=True)) if conf.echo else None,
              on_line=lambda line: _feed_all(evaluator, memory, clock, line),
              trial_id=str(out_dir) + node_suffix(), log_max_mb=conf.log_max_mb, stop=signals.pending,
              enough=stable_rule(conf.stop_when_stable, evaluator))
    failure = classify(res)
    score = None
    if res.interrupted:
        failure = (FailureKind.INTERRUPTED, signals.reason())
    if failure is None:
        try:
            score = float(evaluator.result())
        except NoMetric as e:
            failure = (e.kind, str(e))
    peak = memory.result()
    evidence = memory_evidence(res.output)  # the output's tail: the OOM message, the last memory lines
    report = Launched(score, failure[0].value if failure else None, failure[1] if failure else "",
                      duration=res.duration if res.duration is not None else time.time() - started,
                      measured_gb=peak / 1024.0 if peak else None, reserved_gb=evidence.get("reserved_gb"),
                      needed_gb=evidence.get("needed_gb"), outside_gb=evidence.get("outside_gb"), argv=argv, env=env, log=str(log_path),
                      process=res.process.to_dict() if res.process else None, metric=evaluator.metric_name)
    kept = evaluator.kept()
    report.spread, report.n_values = spread(kept), len(kept) or None
    report.late_failure = late_failure(res) if failure is None else None  # scored: every iteration had run
    if res.stopped_early:  # a success: the score is the median of what it printed so far
        report.stopped_after, report.saved_s = len(kept), clock.left_s()
        report.note = f"stopped early after {len(kept)} values, {res.duration:.1f} s: {res.stopped_early}"
    write_run(info_path, report)
    if res.interrupted:
        raise KeyboardInterrupt
    if failure is not None:
        raise TrialFailure(failure[0].value, failure[1], str(log_path))
    assert score is not None  # set whenever there is no failure
    return score


def _same_kind(value: Any, choice: Any) -> bool:
    """Whether a value could be compared with a choice (a number with a number, a string with a string)."""
    if isinstance(choice, bool) or isinstance(value, bool):
        return isinstance(choice, bool) and isinstance(value, bool)
    if isinstance(choice, (int, float)):
        return isinstance(value, (int, float))
    return type(value) is type(choice)


def check_params(conf: ZenithtuneConf) -> None:
    """Refuse parameters (from a tuned file or a study db: untrusted) that this job's space does not
    know or that break a Megatron rule, before anything runs; a predicted OOM is only a warning (the
    estimate can be wrong, the run itself will tell)."""
    st = build_setting(conf, quiet=True)
    params = trial_params(conf)
    unknown = sorted(k for k in params if k not in st.space.params)
    if unknown:
        raise UserError(f"params.{unknown[0]} is not a parameter of this preset; it has: {', '.join(st.space.params)}")
    for name, val in params.items():  # a value of the wrong type would reach int() in the rules
        choices = st.space.params[name].choices
        if val not in choices and not any(_same_kind(val, c) for c in choices):
            raise UserError(f"params.{name}={val!r} is not a value {name} can take; it takes one of "
                            f"{', '.join(map(str, choices))}")
    cand = st.space.normalize(params)
    broken = st.space.reasons(cand)
    structural = [b for b in broken if b[0] != "choices"]  # the rule Megatron would cite, first
    if broken:
        raise UserError(f"these parameters cannot run with n_gpus={conf.n_gpus} gbs={conf.gbs}: "
                        + "; ".join(why for _, why in (structural or broken)[:2]))
    oom = st.assess(cand).predicted_oom
    if oom:
        print(f"zenithtune: warning: {oom}; running it anyway", file=sys.stderr, flush=True)


def single_run(conf: ZenithtuneConf, out_dir: Path) -> int:
    """A single (non -m) run: apply the config's params once, stream the output, return the exit code."""
    if not trial_params(conf):
        raise UserError("nothing to apply: a study needs -m (python -m zenithtune -m n_gpus=8 gbs=64); "
                        "a single run needs tuned=NAME (a conf/tuned/NAME.yaml) or +params.tp=... values")
    check_params(conf)
    argv, env = compose(conf)
    out_dir.mkdir(parents=True, exist_ok=True)
    print("zenithtune: running " + shlex.join(argv), flush=True)
    for k, v in env.items():
        print(f"zenithtune: with {k}={v}", flush=True)
    evaluator = build(conf.evaluator)
    evaluator.begin()
    with signals.deferred():  # SIGTERM / SIGHUP / Ctrl-C: run() kills the command's process group
        res = run(argv, log_path=out_dir / TRIAL_LOG, timeout=conf.timeout, env=env,
                  echo=lambda line: print(line, flush=True), on_line=evaluator.feed,
                  trial_id=str(out_dir), log_max_mb=conf.log_max_mb, stop=signals.pending)
        stopped = signals.pending() or res.interrupted
        signals.acknowledge()  # reported here, not raised
    if res.interrupted:
        print(f"zenithtune: {signals.reason()}; the command's process group was stopped", file=sys.stderr, flush=True)
        return signals.exit_code()
    if res.returncode == 0:
        try:
            score = evaluator.result()
            print(f"zenithtune: score {score:g} {evaluator.metric_name} (log: {out_dir / TRIAL_LOG})", flush=True)
        except NoMetric:
            pass
    if stopped:  # the signal came after the command had exited: its result is shown, the exit code says stopped
        print(f"zenithtune: {signals.reason()}", file=sys.stderr, flush=True)
        return signals.exit_code()
    return 124 if res.timed_out else int(res.returncode or 0)
