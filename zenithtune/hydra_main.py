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
        return app.task(settings.load(cfg), out_dir)
    try:
        _exit_code = app.single_run(settings.load(cfg), out_dir)
    except ZenithtuneError as e:
        _exit_code = report(e)
    return None


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
