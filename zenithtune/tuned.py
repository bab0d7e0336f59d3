"""Tuned configs: the best configuration of a study as a YAML file a user commits to git.

`conf/tuned/NAME.yaml` (and `best.yaml` in every study folder) holds `params` (the candidate), the
job it was tuned for (n_gpus, gbs), the evaluator that scored it (so a run with it prints the same
score) and its provenance; `python -m zenithtune tuned=NAME -- cmd` and `zenithtune apply --tuned NAME`
run it. Paths in the provenance are written relative to the working directory (the interpreter as
`python`), so a committed file holds no machine's absolute paths.
"""
from __future__ import annotations

import datetime as _dt
import os
import shlex
import sys
from pathlib import Path

from omegaconf import OmegaConf

from zenithtune.record import Outcome


def portable(word: str) -> str:
    """A word of a command or a path as a user types it in the working directory: an absolute path
    inside it relative to it (also after `--opt=`), this interpreter as `python`; anything else as is."""
    key, eq, value = word.partition("=") if word.startswith("-") else ("", "", word)
    if value == sys.executable:
        return f"{key}{eq}python"
    if os.path.isabs(value):
        try:
            return f"{key}{eq}{Path(value).relative_to(Path.cwd())}"
        except ValueError:
            pass
    return word


def tuned_yaml(best: Outcome, *, command: list[str], n_gpus: int, gbs: int, model: str | None, metric: str,
               strategy: str, study: str, name: str | None, evaluator: dict | None = None) -> str:
    """A tuned config (stable key order, headed by its provenance). `command`: the command as the user
    wrote it, with the tuned options taken out (they live in params); `model`: the model to name, if any;
    `evaluator`: the evaluator config that scored the study (a run with it prints the same score)."""
    assert best.value is not None and best.trial_number is not None  # best() returns complete trials only
    command = [portable(w) for w in command]
    study = portable(study)
    stamp = _dt.datetime.now().strftime("%Y-%m-%d %H:%M")
    head = [
        "# @package _global_",
        f"# zenithtune tuned config{' ' + name if name else ''}: {best.value:g} {metric} "
        f"(trial {best.trial_number} of {study})",
        f"# made {stamp} by strategy {strategy} for n_gpus={n_gpus} gbs={gbs}"
        + (f" model={model}" if model else ""),
        f"# command (before injection): {shlex.join(command)}",
        f"# apply: python -m zenithtune tuned={name or 'NAME'} -- <your training command>",
    ]
    body = OmegaConf.to_yaml({"n_gpus": n_gpus, "gbs": gbs, "params": best.candidate,
                              **({"evaluator": evaluator} if evaluator else {}),
                              "result": {"score": float(best.value), "metric": metric, "trial": best.trial_number,
                                         "study": study, "strategy": strategy}}, sort_keys=False)
    return "\n".join(head) + "\n" + body
