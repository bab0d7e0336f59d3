"""Optuna storage for a study: where it lives, opening it, resuming it, its best trial.

What one trial records is `zenithtune.record`'s business; this module only deals with the study.
"""
from __future__ import annotations

import os
from pathlib import Path

import optuna
from optuna.trial import TrialState

from zenithtune import record
from zenithtune.errors import UserError
from zenithtune.record import Attr, Outcome

optuna.logging.set_verbosity(optuna.logging.WARNING)

# Study user attr the sweeper sets: {overrides, command, n_gpus, gbs, model, preset, strategy, metric}
# — what `zenithtune apply --db-path` and `zenithtune analyze` need to re-create and describe a trial.
STUDY_ATTR = "zenithtune"
DB_NAME = "study.db"


def storage_url(value: str | os.PathLike) -> str:
    """The one reader of a storage a user names (`storage=`, `--db-path`, `analyze DB`): an Optuna
    URL as it is; a study.db file, or a folder holding one, as a sqlite URL."""
    text = str(value)
    if "://" in text:
        return text
    path = Path(text).expanduser().resolve()
    if path.is_dir() or (not path.suffix and not path.exists() and text.endswith(("/", os.sep))):
        path = path / DB_NAME
    return f"sqlite:///{path}"


def default_storage(sweep_dir: str | os.PathLike) -> str:
    return storage_url(Path(sweep_dir).resolve() / DB_NAME)


def db_path(url: str) -> Path | None:
    return Path(url[len("sqlite:///"):]) if url.startswith("sqlite:///") else None


def where(url: str) -> str:
    """A storage as a user reads it: the db file for sqlite, else the URL."""
    return str(db_path(url) or url)


def open_study(url: str, name: str, direction: str, sampler: optuna.samplers.BaseSampler | None = None,
               create: bool = True) -> optuna.Study:
    if create:
        return optuna.create_study(storage=url, study_name=name, direction=direction,
                                   sampler=sampler, load_if_exists=True)
    return optuna.load_study(storage=url, study_name=name, sampler=sampler)


def load_existing(value: str, study_name: str | None = None) -> tuple[optuna.Study, str]:
    """An existing study a user points at (`analyze DB`, `apply --db-path DB`), read-only use."""
    url = storage_url(value)
    path = db_path(url)
    if path is not None and not path.is_file():
        raise UserError(f"{value}: no such study database ({path}); studies are in outputs/study_*/study.db")
    names = [s.study_name for s in optuna.get_all_study_summaries(storage=url)]
    if not names:
        raise UserError(f"{where(url)} holds no study: run `zenithtune optimize` (or python -m zenithtune -m) first")
    name = study_name
    if name is None:
        if len(names) > 1:
            raise UserError(f"{where(url)} holds several studies ({', '.join(names)}): pass --study-name")
        name = names[0]
    elif name not in names:
        raise UserError(f"{where(url)} has no study {name!r}; it holds: {', '.join(names)}")
    return open_study(url, name, "maximize", create=False), url


def close_stale(study: optuna.Study) -> list[int]:
    """Trials left RUNNING (or WAITING) by a tuner that died are recorded as failed (launched ones:
    read back as `interrupted`) or pruned (never launched), so a resumed study neither loses nor
    double-counts them."""
    closed = []
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        launched = bool(t.user_attrs.get(Attr.LAUNCHED))
        study.tell(t.number, state=TrialState.FAIL if launched else TrialState.PRUNED, skip_if_finished=True)
        closed.append(t.number)
    # A proposal enqueued but never asked would be handed to the next ask() in place of its own.
    for _ in study.get_trials(deepcopy=False, states=(TrialState.WAITING,)):
        trial = study.ask()
        study.tell(trial, state=TrialState.PRUNED)
        closed.append(trial.number)
    return closed


def launched_count(study: optuna.Study) -> int:
    """Launched trials that count against n_trials: an interrupted one measured nothing and does not."""
    return record.budget_used(record.history(study))


def best(outcomes: list[Outcome], direction: str) -> Outcome | None:
    done = [o for o in outcomes if o.ok and o.launched]
    if not done:
        return None
    pick = max if direction == "maximize" else min
    return pick(done, key=lambda o: o.value)  # type: ignore[arg-type, return-value]


def best_trial(study: optuna.Study) -> Outcome | None:
    maximize = study.direction == optuna.study.StudyDirection.MAXIMIZE
    return best(record.history(study), "maximize" if maximize else "minimize")
