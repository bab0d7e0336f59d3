"""The Hydra application: compose conf/, then sweep (-m) or run once."""
from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from zenithtune import app

_exit_code = 0


@hydra.main(config_path="pkg://zenithtune.conf", config_name="config")
def _hydra_task(cfg: DictConfig) -> float | None:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    global _exit_code
    if HydraConfig.get().mode == RunMode.MULTIRUN:
        return app.task(cfg)  # a trial launched by the zenithtune sweeper
    try:
        _exit_code = app.single_run(cfg)
    except app.UserError as e:
        app.fail(str(e))
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
