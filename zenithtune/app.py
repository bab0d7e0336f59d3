"""THE entry function: config -> inject options -> run the command -> evaluate -> score.

Every trial of a study (launched by the zenithtune sweeper through a Hydra launcher) and every single
run (`python -m zenithtune tuned=NAME -- cmd`, `zenithtune apply`) goes through `task`. It returns
the score (e.g. TFLOP/s/GPU) or raises `TrialFailure` naming the failure kind and the log; the facts
of the run (exact argv, added env, duration, measured memory) land in `<trial dir>/trial.json` for
the sweeper to store in the study.
"""
from __future__ import annotations

import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from zenithtune import resolvers  # noqa: F401  (registers ${zt.command:} and ${zt.python:})
from zenithtune.inject import inject
from zenithtune.run import LOG_MAX_MB, FailureKind, classify, run
from zenithtune.space import options_for
from zenithtune.validate import Layout, required_env

TRIAL_LOG = "trial.log"
TRIAL_INFO = "trial.json"


class UserError(ValueError):
    """Bad input a user can fix; printed as one line, never with a traceback."""


class TrialFailure(Exception):
    """A launched trial that produced no score: kind is a FailureKind value."""

    def __init__(self, kind: str, reason: str, log_path: str | None = None):
        super().__init__(f"{kind}: {reason}" + (f" (log: {log_path})" if log_path else ""))
        self.kind = kind
        self.reason = reason
        self.log_path = log_path

    def __reduce__(self):  # picklable across launchers (submitit)
        return (TrialFailure, (self.kind, self.reason, self.log_path))


def wrapped_command(cfg: DictConfig) -> list[str]:
    cmd = cfg.get("command")
    if cmd is None or len(cmd) == 0:
        raise UserError("command is empty: put the training command after a lone `--`, "
                        "e.g. python -m zenithtune -m n_gpus=8 gbs=64 -- torchrun ... pretrain_gpt.py ...")
    return [str(x) for x in cmd]


def trial_params(cfg: DictConfig) -> dict[str, Any]:
    params = cfg.get("params") or {}
    return {str(k): v for k, v in OmegaConf.to_container(params, resolve=True).items() if v is not None}


def compose(cfg: DictConfig) -> tuple[list[str], dict[str, str]]:
    """The exact argv and the added environment for this config's parameters."""
    argv = wrapped_command(cfg)
    params = trial_params(cfg)
    preset = OmegaConf.to_container(cfg.preset, resolve=True)
    argv = inject(argv, options_for(preset, params, int(cfg.gbs)))
    lay = Layout(n_gpus=int(cfg.n_gpus), gbs=int(cfg.gbs), tp=int(params.get("tp", 1)),
                 cp=int(params.get("cp", 1)))
    return argv, required_env(lay)


def _timeout(cfg: DictConfig) -> float | None:
    t = cfg.get("timeout")
    return float(t) if t not in (None, "", 0) else None


# Targets a config may instantiate (strategies, evaluators, samplers). Hydra 1.4 wants an execution
# whitelist from trusted code; users who plug in their own evaluator or strategy add its package via
# ZENITHTUNE_TRUSTED_TARGETS="mypkg.*,other.module.Class".
TRUSTED_TARGETS = ("zenithtune.*", "optuna.samplers.*", "hydra_plugins.hydra_optuna_sweeper.*")
TRUSTED_ENV = "ZENITHTUNE_TRUSTED_TARGETS"


def build(node: Any) -> Any:
    """Instantiate a `_target_` config node (strategy, evaluator) under the execution whitelist."""
    from hydra.utils import instantiate

    extra = [t.strip() for t in os.environ.get(TRUSTED_ENV, "").split(",") if t.strip()]
    target = str(node.get("_target_", "")) if hasattr(node, "get") else ""
    allowed = list(TRUSTED_TARGETS) + extra
    if target and not any(target == a or (a.endswith(".*") and target.startswith(a[:-1])) for a in allowed):
        raise UserError(f"_target_ {target!r} is not trusted: add its package to {TRUSTED_ENV} "
                        f"(e.g. {TRUSTED_ENV}='{target.rsplit('.', 1)[0]}.*')")
    return instantiate(node, _execution_whitelist_=allowed)


def evaluate_output(cfg: DictConfig, output: str) -> float:
    return float(build(cfg.evaluator).evaluate(output))


def task(cfg: DictConfig) -> float:
    """Run one trial: inject this config's params into the command, run it, return its score."""
    from hydra.core.hydra_config import HydraConfig
    from zenithtune.evaluate import NoMetric, PeakMemory

    out_dir = Path(HydraConfig.get().runtime.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    argv, env = compose(cfg)
    log_path = out_dir / TRIAL_LOG
    if cfg.get("validate_in_task"):  # a sweeper that cannot screen before launch drives us
        from zenithtune.job import screen_params

        problem = screen_params(cfg)
        if problem:
            (out_dir / TRIAL_INFO).write_text(json.dumps({"argv": argv, "env": env, "score": None,
                                                          "failure": {"kind": "invalid_args", "reason": problem}}))
            raise TrialFailure("invalid_args", f"not launched: {problem}")
    started = time.time()
    evaluator, memory = build(cfg.evaluator), PeakMemory()
    evaluator.begin()
    # the trial dir marks every process of the trial (ZENITHTUNE_TRIAL): processes.kill_leftovers(<trial dir>)
    res = run(argv, log_path=log_path, timeout=_timeout(cfg), env=env,
              echo=(lambda line: print(line, flush=True)) if cfg.get("echo") else None,
              on_line=lambda line: (evaluator.feed(line), memory.feed(line)),
              trial_id=str(out_dir), log_max_mb=cfg.get("log_max_mb", LOG_MAX_MB))
    info: dict[str, Any] = {
        "argv": argv, "env": env, "returncode": res.returncode, "duration": res.duration,
        "started": started, "log": str(log_path), "timeout": _timeout(cfg),
        "peak_memory_mb": memory.result(), "process": res.process.to_dict() if res.process else None,
    }
    failure = classify(res)
    score = None
    if res.interrupted:
        failure = (FailureKind.INTERRUPTED, "interrupted by the user (Ctrl-C)")
    if failure is None:
        try:
            score = evaluator.result()
        except NoMetric as e:
            failure = (e.kind, str(e))
    info["score"] = score
    if failure is not None:
        info["failure"] = {"kind": failure[0].value, "reason": failure[1]}
    (out_dir / TRIAL_INFO).write_text(json.dumps(info, indent=1))
    if res.interrupted:
        raise KeyboardInterrupt
    if failure is not None:
        raise TrialFailure(failure[0].value, failure[1], str(log_path))
    return float(score)  # type: ignore[arg-type]


def single_run(cfg: DictConfig) -> int:
    """A single (non -m) run: apply the config's params once, stream the output, return the exit code."""
    from hydra.core.hydra_config import HydraConfig
    from zenithtune.evaluate import NoMetric

    for key in ("n_gpus", "gbs"):
        if OmegaConf.is_missing(cfg, key):
            raise UserError(f"{key} is required: add {key}=N (e.g. n_gpus=8 gbs=64)")
    if not trial_params(cfg):
        raise UserError("nothing to apply: pass tuned=NAME (a conf/tuned/NAME.yaml) or params.tp=... ; "
                        "add -m to run a study instead")
    argv, env = compose(cfg)
    out_dir = Path(HydraConfig.get().runtime.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    print("zenithtune: running " + shlex.join(argv), flush=True)
    for k, v in env.items():
        print(f"zenithtune: with {k}={v}", flush=True)
    evaluator = build(cfg.evaluator)
    evaluator.begin()
    res = run(argv, log_path=out_dir / TRIAL_LOG, timeout=_timeout(cfg), env=env,
              echo=lambda line: print(line, flush=True), on_line=evaluator.feed,
              trial_id=str(out_dir), log_max_mb=cfg.get("log_max_mb", LOG_MAX_MB))
    if res.interrupted:
        return 130
    if res.returncode == 0:
        try:
            score = evaluator.result()
            print(f"zenithtune: score {score:g} (log: {out_dir / TRIAL_LOG})", flush=True)
        except NoMetric:
            pass
    return 124 if res.timed_out else int(res.returncode or 0)


def environ_command() -> list[str] | None:
    raw = os.environ.get(resolvers.COMMAND_ENV)
    return None if raw is None else json.loads(raw)


def fail(message: str, code: int = 2) -> None:
    print(f"zenithtune: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(code)
