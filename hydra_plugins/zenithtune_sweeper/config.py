"""Config node of the zenithtune sweeper, registered as `hydra/sweeper=zenithtune`.

The study's settings (n_trials, timeout, strategy, evaluator, storage, ...) are top-level keys of
zenithtune's config.yaml so users override them as `n_trials=20`; the sweeper node only names the
implementation and the few knobs that are about the loop itself.
"""
from __future__ import annotations

from dataclasses import dataclass

from hydra.core.config_store import ConfigStore


@dataclass
class ZenithtuneSweeperConf:
    _target_: str = "hydra_plugins.zenithtune_sweeper.zenithtune_sweeper.ZenithtuneSweeper"
    # Stop when this many proposals in a row were not launched (invalid, predicted OOM, or already
    # measured): the strategy has converged or only proposes what cannot run.
    max_consecutive_skips: int = 300


ConfigStore.instance().store(group="hydra/sweeper", name="zenithtune", node=ZenithtuneSweeperConf,
                             provider="zenithtune")
