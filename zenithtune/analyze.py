"""`zenithtune analyze DB`: what a study found, as tables and pictures.

Reads the study without changing it, so it works while the study is still running and after an
interruption. Prints a table of the launched trials (one column per parameter, state, score, failure
kind, duration), the best configuration and its argv, best vs the first launched trial, how many
candidates were pruned before launch and by which rule, and the parameter importances (Optuna's
fANOVA, seeded). Writes PNGs next to study.db:
  history.png       score per trial and best so far (optuna.visualization.matplotlib)
  importances.png   parameter importances (needs 2+ complete trials that differ)
  parallel.png      parallel coordinates of the complete trials
  timeline.png      each launched trial as a bar from start to end, coloured by outcome
"""
from __future__ import annotations

import datetime as _dt
import shlex
import sys
import warnings
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import optuna
from optuna.trial import FrozenTrial, TrialState

from zenithtune import study as zstudy
from zenithtune.progress import SHORT

PLOTS = ("history.png", "importances.png", "parallel.png", "timeline.png")
_COLOURS = {"complete": "tab:green", "running": "tab:blue", "timeout": "tab:orange", "oom": "tab:red",
            "interrupted": "tab:gray"}  # other failure kinds: tab:purple


def load(db: str, study_name: str | None = None) -> tuple[optuna.Study, str]:
    return zstudy.load_existing(db, study_name)


def _state(t: FrozenTrial) -> str:
    if t.state == TrialState.COMPLETE:
        return "complete"
    if t.state == TrialState.FAIL:
        return str(t.user_attrs.get("kind") or "failed")
    if t.state == TrialState.PRUNED:
        return "pruned"
    return t.state.name.lower()  # running (a live study), waiting


def _cand(t: FrozenTrial) -> dict[str, Any]:
    return dict(t.user_attrs.get("candidate") or t.params)


def _ratio(best: FrozenTrial, first: FrozenTrial, maximize: bool) -> str:
    if not first.value or not best.value:
        return "-"
    r = best.value / first.value if maximize else first.value / best.value
    return f"x{r:.2f}"


# --- text ----------------------------------------------------------------------------------------
def _table(trials: list[FrozenTrial], best: FrozenTrial | None, metric: str) -> Any:
    from rich.table import Table

    keys: list[str] = []
    for t in trials:
        keys += [k for k in _cand(t) if k not in keys]
    table = Table(title=f"{len(trials)} trials", show_lines=False, header_style="bold")
    table.add_column("#", justify="right")
    table.add_column("state")
    for k in keys:
        table.add_column(SHORT.get(k, k), justify="right")
    table.add_column(metric or "value", justify="right")
    table.add_column("s", justify="right")
    table.add_column("failure / reason", overflow="ellipsis", no_wrap=True, max_width=70)
    for t in trials:
        cand = _cand(t)
        state = _state(t)
        reasons = t.user_attrs.get("reasons") or []
        value = f"{t.value:g}" if t.state == TrialState.COMPLETE and t.value is not None else ""
        dur = t.user_attrs.get("duration")
        style = "bold green" if best is not None and t.number == best.number else (
            "red" if t.state == TrialState.FAIL else ("dim" if t.state == TrialState.PRUNED else None))
        table.add_row(str(t.number) + (" *" if style == "bold green" else ""), state,
                      *[str(cand.get(k, "")) for k in keys], value,
                      f"{dur:.1f}" if isinstance(dur, (int, float)) else "",
                      "; ".join(str(r) for r in reasons) if state != "complete" else "", style=style)
    return table


def _evaluator() -> tuple[Any, str]:
    """fANOVA (seeded) when scikit-learn is installed, else PED-ANOVA (Optuna's, no extra package)."""
    from optuna.importance import FanovaImportanceEvaluator, PedAnovaImportanceEvaluator

    try:
        import sklearn  # noqa: F401
    except ImportError:
        return PedAnovaImportanceEvaluator(), "PED-ANOVA; pip install scikit-learn for fANOVA"
    return FanovaImportanceEvaluator(seed=0), "fANOVA"


def _importances(study: optuna.Study, complete: list[FrozenTrial]) -> tuple[dict[str, float] | None, str]:
    """Parameter -> importance over the parameters that vary, or None and the reason there is none."""
    if len(complete) < 2:
        return None, f"needs at least 2 complete trials (this study has {len(complete)})"
    common = [k for k in complete[0].params if all(k in t.params for t in complete)]
    varying = [k for k in common if len({repr(t.params[k]) for t in complete}) > 1]
    if not varying:
        return None, "the parameters shared by all complete trials have the same values in each"
    evaluator, name = _evaluator()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            imp = optuna.importance.get_param_importances(study, evaluator=evaluator, params=varying)
    except (RuntimeError, ValueError) as e:
        return None, f"Optuna could not compute them: {e}"
    return dict(imp), name


# --- pictures ------------------------------------------------------------------------------------
def _save(drawn: Any, path: Path) -> Path:
    """Save what a plot function returned (a Figure, an Axes, or an array of Axes) and close it."""
    import matplotlib.pyplot as plt
    import numpy as np

    if hasattr(drawn, "savefig"):
        fig = drawn
    else:
        fig = (drawn if hasattr(drawn, "figure") else np.asarray(drawn).flat[0]).figure
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _timeline(trials: list[FrozenTrial], path: Path) -> Path:
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    now = _dt.datetime.now()
    launched = [t for t in trials if t.user_attrs.get("launched") or t.state == TrialState.RUNNING]
    fig, ax = plt.subplots(figsize=(9, max(2.5, 0.28 * len(launched) + 1.2)))
    seen: dict[str, str] = {}
    for i, t in enumerate(launched):
        start = t.datetime_start or now
        end = t.datetime_complete or now
        state = _state(t)
        colour = _COLOURS.get(state, "tab:purple")
        seen.setdefault(state, colour)
        ax.barh(i, (end - start).total_seconds() / 86400.0, left=start, color=colour, height=0.7)
    ax.set_yticks(range(len(launched)), [f"trial {t.number}" for t in launched])
    ax.invert_yaxis()
    ax.xaxis_date()
    ax.set_xlabel("time")
    ax.set_title("Timeline of launched trials")
    ax.legend(handles=[Patch(color=c, label=s) for s, c in seen.items()], loc="lower right", fontsize="small")
    fig.autofmt_xdate()
    return _save(fig, path)


def _importance_bars(imp: dict[str, float]) -> Any:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 0.45 * len(imp) + 1.5))
    names = list(imp)[::-1]
    ax.barh([SHORT.get(k, k) for k in names], [imp[k] for k in names], color="tab:blue")
    ax.set_xlabel("importance (share of the score's variation)")
    ax.set_title("Parameter importances")
    return fig


def plot(study: optuna.Study, out_dir: Path, metric: str, importances: dict[str, float] | None
         ) -> tuple[list[Path], list[str]]:
    """Write the PNGs; returns the files written and one line per plot that could not be drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import optuna.visualization.matplotlib as ovm

    trials = study.get_trials(deepcopy=False)
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    jobs: list[tuple[str, Callable[[], Any], str]] = [
        ("history.png", lambda: ovm.plot_optimization_history(study, target_name=metric or "value"),
         "needs a complete trial"),
        ("importances.png", lambda: _importance_bars(importances or {}), "see importances above"),
        ("parallel.png", lambda: ovm.plot_parallel_coordinate(study, target_name=metric or "value"),
         "needs a complete trial"),
    ]
    written, skipped = [], []
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, draw, need in jobs:
        if not complete or (name == "importances.png" and importances is None):
            skipped.append(f"{name}: {need}")
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                written.append(_save(draw(), out_dir / name))
        except Exception as e:  # a plot is a bonus: say why it is missing, keep the rest
            skipped.append(f"{name}: {type(e).__name__}: {e}")
    try:
        written.append(_timeline(trials, out_dir / "timeline.png"))
    except Exception as e:
        skipped.append(f"timeline.png: {type(e).__name__}: {e}")
    return written, skipped


# --- the command ---------------------------------------------------------------------------------
def analyze(db: str, study_name: str | None = None, plots: bool = True, show_all: bool = False,
            out: Any = None) -> int:
    from rich.console import Console

    console = Console(file=out or sys.stdout, highlight=False, soft_wrap=False,
                      width=None if (out or sys.stdout).isatty() else 200)
    say = lambda text="": console.print(text, markup=False, soft_wrap=True)  # noqa: E731
    study, url = load(db, study_name)  # a ZenithtuneError is the CLI's one line
    trials = study.get_trials(deepcopy=False)
    if not trials:
        print(f"zenithtune analyze: error: study {study.study_name!r} in {url} has no trials yet", file=sys.stderr)
        return 1
    meta = study.user_attrs.get(zstudy.STUDY_ATTR) or {}
    metric = meta.get("metric", "")
    maximize = study.direction == optuna.study.StudyDirection.MAXIMIZE
    launched = [t for t in trials if t.user_attrs.get("launched")]
    running = [t for t in trials if t.state == TrialState.RUNNING]
    pruned = [t for t in trials if t.state == TrialState.PRUNED]
    complete = [t for t in launched if t.state == TrialState.COMPLETE]
    best_outcome = zstudy.best_trial(study)
    best = next((t for t in trials if best_outcome and t.number == best_outcome.trial_number), None)
    first = next((t for t in launched if t.state != TrialState.RUNNING), None)

    shape = " ".join(f"{k}={meta[k]}" for k in ("n_gpus", "gbs", "model", "strategy") if meta.get(k) is not None)
    say(f"study {study.study_name!r} in {zstudy.db_path(url) or url}" + (f"  ({shape})" if shape else ""))
    if running:
        say(f"still running: trial {', '.join(str(t.number) for t in running)} in progress "
            "(or the tuner died; resuming records it as interrupted)")
    shown = trials if show_all else [t for t in trials if t.user_attrs.get("launched") or t.state == TrialState.RUNNING]
    if shown:
        console.print(_table(shown, best, metric))

    failed = Counter(_state(t) for t in launched if t.state == TrialState.FAIL)
    say(f"launched {len(launched)}: {len(complete)} complete"
        + "".join(f", {n} {k}" for k, n in failed.most_common()) + (f", {len(running)} running" if running else ""))
    busy = sum(float(t.user_attrs.get("duration") or 0) for t in launched)
    say(f"time in trials: {busy:.1f} s")
    if pruned:
        rules = Counter(r for t in pruned for r in (t.user_attrs.get("rules") or ["?"]))
        say(f"pruned before launch (never run, not counted in n_trials): {len(pruned)}")
        for rule, n in rules.most_common():
            example = next((t.user_attrs.get("reasons", [""])[0] for t in pruned
                            if rule in (t.user_attrs.get("rules") or [])), "")
            say(f"  {n:5d} {rule}: e.g. {example}")
    else:
        say("pruned before launch: 0")

    if best is not None:
        say("")
        say(f"best: trial {best.number}  {best.value:g} {metric}".rstrip())
        for k, v in _cand(best).items():
            say(f"  {k}: {v}")
        if best.user_attrs.get("argv"):
            say(f"  argv: {shlex.join(best.user_attrs['argv'])}")
        if first is not None and first.state == TrialState.COMPLETE:
            say(f"best vs first launched trial (trial {first.number}, {first.value:g}): "
                f"{_ratio(best, first, maximize)}")
        elif first is not None:
            first_ok = complete[0]
            say(f"first launched trial {first.number} failed ({_state(first)}); best vs first complete "
                f"(trial {first_ok.number}, {first_ok.value:g}): {_ratio(best, first_ok, maximize)}")
    else:
        say("best: none yet (no complete trial)")

    imp, why = _importances(study, [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))])
    if imp is None:
        say(f"parameter importances: not available, {why}")
    else:
        say(f"parameter importances over the complete trials ({why}):")
        for k, v in imp.items():
            say(f"  {SHORT.get(k, k):>12s}  {v:5.2f}  {'#' * round(v * 40)}")

    if plots:
        path = zstudy.db_path(url)
        out_dir = path.parent if path else Path.cwd()
        written, skipped = plot(study, out_dir, metric, imp)
        say("")
        for p in written:
            say(f"wrote {p}")
        for s in skipped:
            say(f"no {s}")
    say(f"interactive view: optuna-dashboard {url}  (pip install optuna-dashboard)")
    return 0
