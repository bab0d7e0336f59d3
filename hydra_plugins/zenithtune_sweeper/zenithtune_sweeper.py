"""Public sweeper class: forwards to `_impl` so Hydra's plugin discovery stays cheap."""
from __future__ import annotations

from typing import Any

from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig

from . import config as config  # noqa: F401  (registers the config node)


class ZenithtuneSweeper(Sweeper):
    """Runs a zenithtune study: strategy proposes, validator prunes, launcher runs, Optuna records."""

    def __init__(self, max_consecutive_skips: int = 300) -> None:
        self.max_consecutive_skips = max_consecutive_skips
        self._impl: Any = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        from ._impl import StudyRunner

        self._impl = StudyRunner(hydra_context=hydra_context, task_function=task_function, config=config,
                                 max_consecutive_skips=self.max_consecutive_skips)

    def sweep(self, arguments: list[str]) -> Any:
        from zenithtune.errors import ZenithtuneError, report

        try:
            return self._impl.sweep(arguments)
        except ZenithtuneError as e:
            # The front end's boundary: a user's mistake is one line and an exit code, no traceback.
            raise SystemExit(report(e)) from None
