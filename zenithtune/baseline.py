"""Readable output for the stock Hydra + Optuna baseline (`baseline=stock_tpe`).

The stock `hydra/sweeper=optuna` prints nothing per trial except, for every failed one, Hydra's
"Error executing job with overrides: [...]" on stderr, and nothing at the end. For a comparison a
user can follow, this Hydra callback (selected in conf/baseline/stock_tpe.yaml) prints one line per
trial and a summary, in the same words as our sweeper's progress. It changes nothing in the study:
the point of the baseline is to show what plain Hydra + Optuna records.

Each trial's outcome is read from the trial.json the entry function writes in the trial's folder
(score, or failure kind and reason), so no private Hydra attribute is touched.
"""
from __future__ import annotations

import logging
import sys
import warnings
from collections import Counter
from pathlib import Path
from typing import Any, TextIO

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from zenithtune.progress import clip, describe
from zenithtune.record import TRIAL_INFO, read_run
from zenithtune.run import FailureKind

_HYDRA_FAILED_JOB = "Error executing job with overrides:"

# Hydra 1.4 warns (7 lines each) when config-named targets are instantiated without an execution
# whitelist; the stock sweeper and Hydra's callback loader do that for this class and for
# zenithtune.space.stock_search_space, targets we ship ourselves. Hydra imports this module before it
# warns, so filtering here (and only for zenithtune targets) silences exactly those.
warnings.filterwarnings("ignore", message=r"hydra\.utils\.instantiate\(\) resolved _target_='zenithtune\.")


class _DropLines:
    """stderr without Hydra's per-failure "Error executing job" line: the trial line says it better."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        if text.startswith(_HYDRA_FAILED_JOB):
            return len(text)
        return self._stream.write(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _params(overrides: list[str]) -> dict[str, str]:
    """`params.tp=2` overrides of one job -> {"tp": "2"} in the order the sweeper gave them."""
    out: dict[str, str] = {}
    for o in overrides:
        key, _, value = o.lstrip("+").partition("=")
        if key.startswith("params."):
            out[key[len("params."):]] = value
    return out


def outcome(trial_dir: Path) -> dict[str, Any]:
    """What the entry function recorded for one trial: {"score": float|None, "kind", "reason", "duration"}."""
    run = read_run(trial_dir / TRIAL_INFO)
    if run is None:
        return {"score": None, "kind": FailureKind.CRASH.value,
                "reason": "no trial.json (the entry function did not finish)"}
    return {"score": run.value, "kind": run.kind, "reason": run.reason, "duration": run.duration}


class StockProgress(Callback):
    """One line per trial and a summary for the stock Optuna sweeper."""

    def __init__(self, metric: str = "value", maximize: bool = True) -> None:
        self.metric = metric                # label of the score, e.g. TFLOP/s/GPU
        self.maximize = maximize            # the sweeper's direction
        self.n = 0                          # trials finished in this process
        self.best: tuple[float, int, str] | None = None   # (score, job number, candidate)
        self.kinds: Counter[str] = Counter()
        self.total: Any = "?"

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        logging.getLogger("optuna").setLevel(logging.WARNING)  # "A new study created": the summary says where
        if not isinstance(sys.stderr, _DropLines):
            sys.stderr = _DropLines(sys.stderr)
        self.total = config.hydra.sweeper.get("n_trials", "?")
        print(f"stock hydra/sweeper=optuna ({config.hydra.sweeper.sampler.get('_target_', '').rsplit('.', 1)[-1]}): "
              f"{self.total} trials, every one counts, invalid ones included", flush=True)

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        self.n += 1
        num = config.hydra.job.num
        cand = describe(_params(list(config.hydra.overrides.task)))
        res = outcome(Path(config.hydra.runtime.output_dir))
        if res["score"] is not None:
            score = float(res["score"])
            better = self.best is None or (score > self.best[0] if self.maximize else score < self.best[0])
            if better:
                self.best = (score, num, cand)
            self.kinds["complete"] += 1
            result = f"{score:g} {self.metric}"
        else:
            self.kinds[res["kind"] or "failed"] += 1
            result = clip(f"{res['kind']}: {res['reason']}")
        best = f"  best {self.best[0]:g}" if self.best else ""
        print(f"[{self.n}/{self.total}] trial {num}  {cand} -> {result}{best}", flush=True)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if isinstance(sys.stderr, _DropLines):
            sys.stderr = sys.stderr._stream
        counts = ", ".join(f"{n} {k}" for k, n in self.kinds.most_common())
        print(f"done: {self.n} trials ({counts or 'none'}); each failed one used up n_trials", flush=True)
        if self.best:
            print(f"best: trial {self.best[1]}  {self.best[2]}  {self.best[0]:g} {self.metric}", flush=True)
        else:
            print("best: none (no trial completed)", flush=True)
        storage = str(config.hydra.sweeper.get("storage") or "")
        if storage.startswith("sqlite:///"):
            print(f"analyze: zenithtune analyze {storage[len('sqlite:///'):]}", flush=True)
