"""The Hydra application: compose conf/, then sweep (-m) or run once.

A trial launched by the zenithtune sweeper (through any Hydra launcher) and a single run both land in
`_hydra_task`, which converts the composed config into the typed `ZenithtuneConf` once and calls the
entry function in `zenithtune.app`.
"""
from __future__ import annotations

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from zenithtune import app, settings
from zenithtune.errors import ZenithtuneError, report
from zenithtune.record import TRIAL_LOG

_exit_code = 0


@hydra.main(config_path="pkg://zenithtune.conf", config_name="config")
def _hydra_task(cfg: DictConfig) -> float | None:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    global _exit_code
    hc = HydraConfig.get()
    out_dir = Path(hc.runtime.output_dir)
    if hc.mode == RunMode.MULTIRUN:
        # A trial launched by a sweeper: a bad value is the trial's failure, reported by the sweeper.
        try:
            return app.task(settings.load(cfg), out_dir)
        except (app.TrialFailure, ZenithtuneError):
            raise
        except Exception as err:  # a bug (ours, or a user's evaluator): its traceback goes where the trial's output is
            keep_traceback(err, out_dir / TRIAL_LOG)
            raise
    try:
        _exit_code = app.single_run(settings.load(cfg), out_dir)
    except ZenithtuneError as e:
        _exit_code = report(e)
    return None


def keep_traceback(err: BaseException, log: Path) -> None:
    """Append an exception's traceback to the trial's log: the study's table shows one line, this says
    where it came from. Never raises (a full disk must not hide the original error)."""
    import traceback

    try:
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("a", encoding="utf-8") as f:
            f.write("# zenithtune: the entry function failed (a bug in zenithtune or in the evaluator); traceback:\n")
            f.write("".join(traceback.format_exception(type(err), err, err.__traceback__)))
    except OSError:
        pass


def run_hydra(args: list[str]) -> int:
    global _exit_code
    _exit_code = 0
    saved = sys.argv
    sys.argv = [saved[0] if saved else "zenithtune"] + args
    try:
        _hydra_task()
    finally:
        sys.argv = saved
    return _exit_code
