"""Optuna study helpers: storage, what a trial records, resume, the best trial, tuned-config export.

Every proposal becomes one Optuna trial. Its user_attrs say what happened:
  launched (bool), kind (failure kind), reasons (list of str), rules (pruning rule names),
  argv (the exact argv run), env (added env), duration (s), log (trial.log path),
  predicted_gb / measured_gb (memory), stage, why (the strategy's one-line reason), duplicate_of.
PRUNED = never launched (invalid, predicted OOM, or already measured); FAIL = launched, no score.
"""
from __future__ import annotations

import datetime as _dt
import os
from pathlib import Path
from typing import Any, Iterable

import optuna
from optuna.trial import FrozenTrial, TrialState

from zenithtune.strategies import Outcome

optuna.logging.set_verbosity(optuna.logging.WARNING)

# Study user attr the sweeper sets: {overrides, command, n_gpus, gbs, model, preset, strategy, metric}
# — what `zenithtune apply --db-path` and `zenithtune analyze` need to re-create and describe a trial.
STUDY_ATTR = "zenithtune"


def default_storage(sweep_dir: str | os.PathLike) -> str:
    return f"sqlite:///{Path(sweep_dir).resolve() / 'study.db'}"


def storage_url(value: str) -> str:
    """Accept a path to a study.db as well as an Optuna storage URL."""
    if "://" in value:
        return value
    return f"sqlite:///{Path(value).resolve()}"


def db_path(url: str) -> Path | None:
    return Path(url[len("sqlite:///"):]) if url.startswith("sqlite:///") else None


def open_study(url: str, name: str, direction: str, sampler: optuna.samplers.BaseSampler | None = None,
               create: bool = True) -> optuna.Study:
    if create:
        return optuna.create_study(storage=url, study_name=name, direction=direction,
                                   sampler=sampler, load_if_exists=True)
    return optuna.load_study(storage=url, study_name=name, sampler=sampler)


def only_study_name(url: str) -> str:
    """The single study in a storage (analyze/apply on a db with one study need no name)."""
    names = [s.study_name for s in optuna.get_all_study_summaries(storage=url)]
    if not names:
        raise ValueError(f"{url} holds no study: run `zenithtune optimize` (or python -m zenithtune -m) first")
    if len(names) > 1:
        raise ValueError(f"{url} holds several studies ({', '.join(names)}): pass --study-name")
    return names[0]


def close_stale(study: optuna.Study) -> list[int]:
    """Trials left RUNNING (or WAITING) by a tuner that died are recorded as interrupted failures,
    so a resumed study neither loses nor double-counts them."""
    closed = []
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING, TrialState.WAITING)):
        was_launched = bool(t.user_attrs.get("launched"))
        study._storage.set_trial_user_attr(t._trial_id, "kind", "interrupted")
        study._storage.set_trial_user_attr(t._trial_id, "reasons",
                                           ["the tuner stopped while this trial was running"])
        study._storage.set_trial_state_values(t._trial_id, TrialState.FAIL if was_launched else TrialState.PRUNED)
        closed.append(t.number)
    return closed


def outcome_of(t: FrozenTrial) -> Outcome | None:
    """A stored trial as a strategy sees it."""
    cand = t.user_attrs.get("candidate") or dict(t.params)
    state = {TrialState.COMPLETE: "complete", TrialState.FAIL: "failed", TrialState.PRUNED: "pruned"}.get(t.state)
    if state is None:
        return None
    return Outcome(
        candidate=dict(cand), state=state, value=t.value if t.state == TrialState.COMPLETE else None,
        kind=t.user_attrs.get("kind"), reasons=list(t.user_attrs.get("reasons") or []),
        rules=list(t.user_attrs.get("rules") or []), launched=bool(t.user_attrs.get("launched")),
        duration=t.user_attrs.get("duration"), predicted_gb=t.user_attrs.get("predicted_gb"),
        measured_gb=t.user_attrs.get("measured_gb"), trial_number=t.number, stage=t.user_attrs.get("stage"),
        probe="memory_probe" in t.user_attrs,
    )


def history(study: optuna.Study) -> list[Outcome]:
    return [o for o in (outcome_of(t) for t in study.get_trials(deepcopy=False)) if o is not None]


def launched_count(study: optuna.Study) -> int:
    """Launched trials that count against n_trials: an interrupted one measured nothing and does not."""
    return sum(1 for t in study.get_trials(deepcopy=False) if t.user_attrs.get("launched")
               and t.state in (TrialState.COMPLETE, TrialState.FAIL) and t.user_attrs.get("kind") != "interrupted")


def best_trial(study: optuna.Study) -> FrozenTrial | None:
    done = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)) if t.user_attrs.get("launched")]
    if not done:
        return None
    maximize = study.direction == optuna.study.StudyDirection.MAXIMIZE
    return (max if maximize else min)(done, key=lambda t: t.value)


def tuned_yaml(*, params: dict[str, Any], n_gpus: int, gbs: int, score: float, metric: str,
               trial: int, study: str, strategy: str, model: str | None, command: Iterable[str],
               name: str | None = None) -> str:
    """A tuned config a user commits to git and applies with `tuned=NAME` (stable, commented)."""
    import shlex

    from omegaconf import OmegaConf

    stamp = _dt.datetime.now().strftime("%Y-%m-%d %H:%M")
    head = [
        "# @package _global_",
        f"# zenithtune tuned config{' ' + name if name else ''}: {score:g} {metric} (trial {trial} of {study})",
        f"# made {stamp} by strategy {strategy} for n_gpus={n_gpus} gbs={gbs}" + (f" model={model}" if model else ""),
        f"# command (before injection): {shlex.join(list(command))}",
        f"# apply: python -m zenithtune tuned={name or 'NAME'} -- <your training command>",
    ]
    body = OmegaConf.to_yaml({"n_gpus": n_gpus, "gbs": gbs, "params": params,
                              "result": {"score": float(score), "metric": metric, "trial": trial,
                                         "study": study, "strategy": strategy}}, sort_keys=False)
    return "\n".join(head) + "\n" + body
