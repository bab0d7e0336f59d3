"""The simulator as a study's launch function, in-process: what the tests and the benchmarks launch
instead of a subprocess, so a study of fifty trials takes a second.

`launcher(command, space, evaluator)` injects a candidate's options (`Space.options`) into the
simulator command exactly as the entry function would, runs `simulate` on the result and reports it
as a `record.Launched` (score, failure kind, the memory the log printed), with no process, log file or
Hydra in between. It takes the values it uses, not the study's `Job`: the simulator is domain.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from zenithtune.evaluate import Evaluator, NoMetric, memory_evidence, spread
from zenithtune.inject import inject
from zenithtune.record import Launched
from zenithtune.run import FailureKind
from zenithtune.sim import simulate
from zenithtune.sim.noise import RUN_ENV
from zenithtune.space import Space
from zenithtune.validate import required_env


def sim_argv(command: list[str], options: dict[str, Any]) -> list[str]:
    """The simulator's own arguments for a candidate's `options` (the command after `-m zenithtune.sim`)."""
    argv = inject(command, options)
    return argv[argv.index("zenithtune.sim") + 1:]


def launcher(command: list[str], space: Space, evaluator: Evaluator, *, truth: dict[int, float] | None = None,
             oom_if: Callable[[dict[str, Any]], bool] | None = None
             ) -> Callable[[int, dict[str, Any], float | None], Launched]:
    """A launch function for `StudyLoop`. `truth` collects each trial's steady-state TFLOP/s by trial
    number (no log jitter, no --sim-noise-sigma measurement noise: what the candidate is really worth);
    `oom_if(cand)` forces an out-of-memory failure (tests)."""

    def launch(number: int, cand: dict[str, Any], timeout: float | None) -> Launched:
        if oom_if is not None and oom_if(cand):
            return Launched(None, FailureKind.OOM.value, "CUDA out of memory (forced)", 1.0)
        # the trial number tells two launches of one candidate apart, as the trial marker does in a subprocess
        env = {**required_env(space.layout(cand)), RUN_ENV: str(number)}
        res = simulate(sim_argv(command, space.options(cand)), env)
        if truth is not None and res.true_tflops:
            truth[number] = res.true_tflops
        if res.kind == "ok":
            try:
                run = Launched(evaluator.evaluate(res.stdout), duration=res.wall_seconds)
                kept = evaluator.kept()
                run.spread, run.n_values = spread(kept), len(kept) or None
            except NoMetric as e:
                run = Launched(None, e.kind.value, str(e), res.wall_seconds)
        else:
            kind = FailureKind.OOM if res.kind == "oom" else FailureKind.INVALID_ARGS
            run = Launched(None, kind.value, (res.stderr.strip().splitlines() or [res.kind])[-1][:200], res.wall_seconds)
        ev = memory_evidence(res.stdout + res.stderr)
        run.measured_gb, run.reserved_gb, run.needed_gb = (ev.get("allocated_gb"), ev.get("reserved_gb"),
                                                           ev.get("needed_gb"))
        run.outside_gb = ev.get("outside_gb")
        return run

    return launch
