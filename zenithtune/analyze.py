"""`zenithtune analyze DB`: what a study found, as tables and pictures.

Reads the study without changing it, so it works while the study is still running and after an
interruption. Prints a table of the launched trials (one column per parameter, state, score, failure
kind, duration), the best configuration and its argv, best vs the first launched trial, how many
candidates were pruned before launch and by which rule, and the parameter importances (Optuna's
fANOVA, seeded). Writes next to study.db:
  history.png       score per trial, best so far, failed trials marked
  importances.png   parameter importances (needs 2+ complete trials that differ)
  parallel.png      parallel coordinates of the complete trials, coloured by score
  timeline.png      each launched trial as a bar from start to end, coloured by outcome
  report.html       one self-contained page: the table, the plots (embedded), the best command
Each plot is drawn here with matplotlib (not optuna.visualization) so it stays readable from 5 to a
few hundred trials: integer trial ticks, seconds since the study started, legends outside the data.

A study made by the stock `hydra/sweeper=optuna` (`baseline=stock_tpe`) has none of our trial
attributes; every finished trial of it was a job (screened-out ones included), its parameters are
named `params.<name>`, and the outcome of each is read from the trial_<n>/trial.json next to study.db.
"""
from __future__ import annotations

import base64
import copy
import datetime as _dt
import html
import json
import shlex
import sys
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

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


def _is_stock(study: optuna.Study, trials: list[FrozenTrial]) -> bool:
    """Made by the stock Optuna sweeper: no study record of ours and no trial with our attributes."""
    return not study.user_attrs.get(zstudy.STUDY_ATTR) and not any("launched" in t.user_attrs for t in trials)


def _stock_trials(trials: list[FrozenTrial], folder: Path | None) -> list[FrozenTrial]:
    """Copies of a stock study's trials with the attributes our own sweeper records (never written back)."""
    out = []
    for t in trials:
        t = copy.deepcopy(t)
        attrs: dict[str, Any] = {"candidate": {k.removeprefix("params."): v for k, v in t.params.items()}}
        info: dict[str, Any] = {}
        if folder is not None:
            try:
                info = json.loads((folder / f"trial_{t.number}" / "trial.json").read_text())
            except (OSError, ValueError):
                info = {}
        if t.state in (TrialState.COMPLETE, TrialState.FAIL):
            attrs["launched"] = True  # a job the stock sweeper ran and counted, screened out or not
        failure = info.get("failure") or {}
        if t.state == TrialState.FAIL:
            attrs["kind"] = failure.get("kind") or "failed"
            attrs["reasons"] = [failure.get("reason") or "no trial.json next to study.db says why"]
        if isinstance(info.get("duration"), (int, float)):
            attrs["duration"] = info["duration"]
        if info.get("argv") and "returncode" in info:
            attrs["argv"] = info["argv"]
        t.user_attrs = attrs
        out.append(t)
    return out


def _best(trials: list[FrozenTrial], maximize: bool) -> FrozenTrial | None:
    done = [t for t in trials if t.state == TrialState.COMPLETE and t.user_attrs.get("launched") and t.value is not None]
    return (max if maximize else min)(done, key=lambda t: float(t.value or 0.0)) if done else None


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
def _save(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=110, bbox_inches="tight")  # tight: long tick labels are never cut
    plt.close(fig)
    return path


def _trial_axis(ax: Any) -> None:
    """Trial numbers are integers: no 0.5 ticks, and at most ~12 of them however many trials."""
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(nbins=12, integer=True))


def _history(trials: list[FrozenTrial], metric: str, maximize: bool) -> Any:
    import matplotlib.pyplot as plt

    done = [t for t in trials if t.user_attrs.get("launched") and t.state == TrialState.COMPLETE and t.value is not None]
    failed = [t for t in trials if t.user_attrs.get("launched") and t.state == TrialState.FAIL]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    xs, ys = [t.number for t in done], [float(t.value or 0.0) for t in done]
    ax.scatter(xs, ys, s=18 if len(done) > 50 else 36, color="tab:blue", zorder=3, label="complete trial")
    best, run_x, run_y = None, [], []
    for x, y in zip(xs, ys):
        best = y if best is None or (y > best if maximize else y < best) else best
        run_x.append(x)
        run_y.append(best)
    if run_x:
        ax.step(run_x, run_y, where="post", color="tab:green", linewidth=2, label="best so far", zorder=2)
    if failed:
        # failed trials have no score: a mark on the bottom edge, one colour per failure kind
        lo = min(ys) if ys else 0.0
        hi = max(ys) if ys else 1.0
        y0 = lo - 0.08 * (hi - lo or max(abs(lo), 1.0))
        for kind in sorted({_state(t) for t in failed}):
            fx = [t.number for t in failed if _state(t) == kind]
            ax.scatter(fx, [y0] * len(fx), marker="x", s=30, color=_COLOURS.get(kind, "tab:purple"),
                       label=f"{kind} (no score)", zorder=3)
    _trial_axis(ax)
    ax.set_xlabel("trial number")
    ax.set_ylabel(metric or "score")
    ax.grid(alpha=0.3)
    ax.set_title(f"Score per trial ({metric or 'value'}, {'higher' if maximize else 'lower'} is better): "
                 f"{len(done)} complete, {len(failed)} failed")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", frameon=False)
    return fig


def _axis_values(values: list[Any]) -> tuple[list[float], list[str]]:
    """A parameter's values as positions 0..n-1 on its axis and the tick labels (numbers sorted)."""
    distinct = sorted({repr(v) for v in values}, key=lambda r: (0, float(r)) if _number(r) else (1, r))
    index = {r: i for i, r in enumerate(distinct)}
    return [float(index[repr(v)]) for v in values], [r.strip("'") for r in distinct]


def _number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _parallel(trials: list[FrozenTrial], metric: str, maximize: bool) -> Any:
    import matplotlib.pyplot as plt
    from matplotlib import cm, colors

    done = [t for t in trials if t.user_attrs.get("launched") and t.state == TrialState.COMPLETE and t.value is not None]
    keys: list[str] = []
    for t in done:
        keys += [k for k in _cand(t) if k not in keys]
    # one axis per parameter that varies (a parameter missing in a trial, e.g. method under
    # selective recompute, shows as "-")
    cols = [k for k in keys if len({repr(_cand(t).get(k, "-")) for t in done}) > 1] or keys[:1]
    scores = [float(t.value or 0.0) for t in done]
    fig, ax = plt.subplots(figsize=(max(7.0, 1.5 * (len(cols) + 1)), 5))
    pos = {}
    for j, k in enumerate(cols):
        ys, labels = _axis_values([_cand(t).get(k, "-") for t in done])
        top = max(len(labels) - 1, 1)
        pos[k] = [y / top for y in ys]
        for i, lab in enumerate(labels):
            ax.text(j, i / top, f" {lab}", fontsize=8, va="center", ha="left", color="black", zorder=5,
                    bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.7, "pad": 0.5})
    lo, hi = min(scores), max(scores)
    span = (hi - lo) or 1.0
    score_pos = [(v - lo) / span for v in scores]
    # plasma without its pale yellow end: the worst trials stay dark enough to see on white
    cmap = colors.LinearSegmentedColormap.from_list("zt", cm.plasma(list(i / 20 for i in range(0, 18))))
    norm = colors.Normalize(lo, hi)
    order = sorted(range(len(done)), key=lambda i: scores[i] if maximize else -scores[i])  # best drawn last
    alpha = 0.9 if len(done) <= 30 else 0.45
    best_i = order[-1]
    for i in order:
        ys = [pos[k][i] for k in cols] + [score_pos[i]]
        ax.plot(range(len(cols) + 1), ys, color=cmap(norm(scores[i])), alpha=1.0 if i == best_i else alpha,
                linewidth=3 if i == best_i else 1.2, zorder=4 if i == best_i else 2)
    for j in range(len(cols) + 1):
        ax.axvline(j, color="0.3", linewidth=0.8, zorder=1)
    ax.text(len(cols), 0, f" {lo:g}", fontsize=8, va="center", ha="left")
    ax.text(len(cols), 1, f" {hi:g}", fontsize=8, va="center", ha="left")
    ax.set_xticks(range(len(cols) + 1), [SHORT.get(k, k) for k in cols] + [metric or "score"])
    ax.set_xlim(-0.2, len(cols) + 0.4)
    ax.set_ylim(-0.06, 1.06)
    ax.set_yticks([])
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    fig.colorbar(cm.ScalarMappable(norm=norm, cmap=cmap), ax=ax, pad=0.02, label=metric or "score")
    ax.set_title(f"Parameters of the {len(done)} complete trials, coloured by {metric or 'score'} "
                 f"(thick: best, trial {done[best_i].number})")
    return fig


def _timeline(trials: list[FrozenTrial]) -> Any:
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch
    from matplotlib.ticker import MaxNLocator

    now = _dt.datetime.now()
    launched = [t for t in trials if (t.user_attrs.get("launched") or t.state == TrialState.RUNNING)
                and t.datetime_start is not None]
    if not launched:
        raise ValueError("no launched trial has a start time")
    t0 = min(t.datetime_start or now for t in launched)
    fig, ax = plt.subplots(figsize=(9, min(12.0, max(2.8, 0.22 * len(launched) + 1.5))))
    seen: dict[str, str] = {}
    for i, t in enumerate(launched):
        start = ((t.datetime_start or t0) - t0).total_seconds()
        end = ((t.datetime_complete or now) - t0).total_seconds()
        state = _state(t)
        colour = _COLOURS.get(state, "tab:purple")
        seen.setdefault(state, colour)
        ax.barh(i, max(end - start, 1e-3), left=start, color=colour, height=0.7)
    ax.yaxis.set_major_locator(MaxNLocator(nbins=min(len(launched), 20), integer=True))
    ax.set_yticks([i for i in ax.get_yticks() if 0 <= i < len(launched)])
    ax.set_yticklabels([f"trial {launched[int(i)].number}" for i in ax.get_yticks()])
    ax.set_ylim(len(launched) - 0.5, -0.5)  # first launch at the top
    ax.set_xlim(left=0)
    ax.set_xlabel(f"seconds since the first trial started ({t0:%Y-%m-%d %H:%M:%S})")
    ax.grid(axis="x", alpha=0.3)
    ax.set_title(f"When each of the {len(launched)} launched trials ran (s), coloured by outcome")
    ax.legend(handles=[Patch(color=c, label=s) for s, c in seen.items()], loc="upper left",
              bbox_to_anchor=(1.01, 1.0), fontsize="small", frameon=False)
    return fig


def _importance_bars(imp: dict[str, float], how: str) -> Any:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 0.45 * len(imp) + 1.5))
    names = list(imp)[::-1]
    ax.barh([SHORT.get(k.removeprefix("params."), k) for k in names], [imp[k] for k in names], color="tab:blue")
    ax.set_xlabel("importance (share of the score's variation, sums to 1)")
    ax.set_title(f"Parameter importances ({how.split(';')[0]})")
    return fig


def plot(study: optuna.Study, out_dir: Path, metric: str, importances: dict[str, float] | None,
         trials: list[FrozenTrial] | None = None, how: str = "") -> tuple[list[Path], list[str]]:
    """Write the PNGs; returns the files written and one line per plot that could not be drawn."""
    import matplotlib

    matplotlib.use("Agg")
    trials = study.get_trials(deepcopy=False) if trials is None else trials
    maximize = study.direction == optuna.study.StudyDirection.MAXIMIZE
    complete = [t for t in trials if t.state == TrialState.COMPLETE and t.user_attrs.get("launched")]
    jobs: list[tuple[str, Callable[[], Any], str | None]] = [
        ("history.png", lambda: _history(trials, metric, maximize), None if complete else "needs a complete trial"),
        ("importances.png", lambda: _importance_bars(importances or {}, how),
         None if complete and importances is not None else "see importances above"),
        ("parallel.png", lambda: _parallel(trials, metric, maximize), None if complete else "needs a complete trial"),
        ("timeline.png", lambda: _timeline(trials), None),
    ]
    written, skipped = [], []
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, draw, missing in jobs:
        if missing:
            skipped.append(f"{name}: {missing}")
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                written.append(_save(draw(), out_dir / name))
        except Exception as e:  # a plot is a bonus: say why it is missing, keep the rest
            skipped.append(f"{name}: {type(e).__name__}: {e}")
    return written, skipped


# --- the report ----------------------------------------------------------------------------------
def report_html(title: str, lines: list[str], trials: list[FrozenTrial], best: FrozenTrial | None,
                metric: str, images: list[Path]) -> str:
    """One self-contained HTML page (no network, no files beside it): what analyze printed, the
    trial table, the best command, and the plots as data URIs."""
    esc = html.escape
    keys: list[str] = []
    for t in trials:
        keys += [k for k in _cand(t) if k not in keys]
    head = "".join(f"<th>{esc(SHORT.get(k, k))}</th>" for k in keys)
    rows = []
    for t in trials:
        state = _state(t)
        value = f"{t.value:g}" if t.state == TrialState.COMPLETE and t.value is not None else ""
        dur = t.user_attrs.get("duration")
        reasons = "; ".join(str(r) for r in t.user_attrs.get("reasons") or []) if state != "complete" else ""
        cls = "best" if best is not None and t.number == best.number else state
        cells = "".join(f"<td>{esc(str(_cand(t).get(k, '')))}</td>" for k in keys)
        rows.append(f'<tr class="{esc(cls)}"><td>{t.number}{" *" if cls == "best" else ""}</td><td>{esc(state)}</td>'
                    f"{cells}<td>{esc(value)}</td><td>{f'{dur:.1f}' if isinstance(dur, (int, float)) else ''}</td>"
                    f"<td>{esc(reasons)}</td></tr>")
    if best is not None:
        argv = best.user_attrs.get("argv")
        best_html = (f"<p id=\"best\">Best: trial {best.number}, {best.value:g} {esc(metric)}: "
                     f"{esc(' '.join(f'{SHORT.get(k, k)}={v}' for k, v in _cand(best).items()))}</p>"
                     + (f"<pre id=\"best-command\">{esc(shlex.join(argv))}</pre>" if argv else ""))
    else:
        best_html = '<p id="best">Best: none yet (no complete trial)</p>'
    figures = "".join(
        f'<figure><img alt="{esc(p.name)}" src="data:image/png;base64,{base64.b64encode(p.read_bytes()).decode()}">'
        f"<figcaption>{esc(p.name)}</figcaption></figure>" for p in images)
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{esc(title)}</title>
<style>
body {{ font-family: sans-serif; margin: 1.5em; color: #222; }}
table {{ border-collapse: collapse; font-size: 0.9em; }}
th, td {{ border: 1px solid #ccc; padding: 2px 6px; text-align: right; }}
td:last-child {{ text-align: left; max-width: 50em; overflow: hidden; text-overflow: ellipsis; white-space: nowrap; }}
tr.best {{ background: #d8f5d8; font-weight: bold; }}
tr.pruned {{ color: #888; }}
tr.oom, tr.timeout, tr.crash, tr.no_metric, tr.invalid_args, tr.interrupted, tr.failed {{ color: #b00; }}
pre {{ background: #f4f4f4; padding: 0.6em; white-space: pre-wrap; word-break: break-all; }}
figure {{ margin: 1em 0; }} img {{ max-width: 100%; }}
</style></head><body>
<h1>{esc(title)}</h1>
{best_html}
<pre id="summary">{esc(chr(10).join(lines))}</pre>
<h2>Trials</h2>
<table id="trials"><thead><tr><th>#</th><th>state</th>{head}<th>{esc(metric or 'value')}</th><th>s</th>
<th>failure / reason</th></tr></thead>
<tbody>
{chr(10).join(rows)}
</tbody></table>
<h2>Plots</h2>
{figures}
</body></html>
"""


# --- the command ---------------------------------------------------------------------------------
def analyze(db: str, study_name: str | None = None, plots: bool = True, show_all: bool = False,
            out: Any = None) -> int:
    from rich.console import Console

    console = Console(file=out or sys.stdout, highlight=False, soft_wrap=False,
                      width=None if (out or sys.stdout).isatty() else 200)
    said: list[str] = []  # the same lines go into report.html

    def say(text: str = "") -> None:
        said.append(text)
        console.print(text, markup=False, soft_wrap=True)

    study, url = load(db, study_name)  # a ZenithtuneError is the CLI's one line
    trials = study.get_trials(deepcopy=False)
    if not trials:
        print(f"zenithtune analyze: error: study {study.study_name!r} in {url} has no trials yet", file=sys.stderr)
        return 1
    meta = study.user_attrs.get(zstudy.STUDY_ATTR) or {}
    metric = meta.get("metric", "")
    maximize = study.direction == optuna.study.StudyDirection.MAXIMIZE
    folder = zstudy.db_path(url)
    stock = _is_stock(study, trials)
    if stock:
        trials = _stock_trials(trials, folder.parent if folder else None)
    launched = [t for t in trials if t.user_attrs.get("launched")]
    running = [t for t in trials if t.state == TrialState.RUNNING]
    pruned = [t for t in trials if t.state == TrialState.PRUNED]
    complete = [t for t in launched if t.state == TrialState.COMPLETE]
    best = _best(trials, maximize)
    first = next((t for t in launched if t.state != TrialState.RUNNING), None)

    shape = " ".join(f"{k}={meta[k]}" for k in ("n_gpus", "gbs", "model", "strategy") if meta.get(k) is not None)
    say(f"study {study.study_name!r} in {zstudy.db_path(url) or url}" + (f"  ({shape})" if shape else ""))
    if stock:
        say("made by the stock hydra/sweeper=optuna: every job counts as launched (screened-out ones "
            "included); outcomes from trial_<n>/trial.json")
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
            name = k.removeprefix("params.")  # a stock study names them params.<name>
            say(f"  {SHORT.get(name, name):>12s}  {v:5.2f}  {'#' * round(v * 40)}")

    if plots:
        out_dir = folder.parent if folder else Path.cwd()
        written, skipped = plot(study, out_dir, metric, imp, trials, why)
        say("")
        for p in written:
            say(f"wrote {p}")
        for s in skipped:
            say(f"no {s}")
        page = out_dir / "report.html"
        say(f"wrote {page}  (one self-contained page: table, plots, best command)")
        table_rows = trials if show_all else shown
        page.write_text(report_html(f"zenithtune study {study.study_name!r}", said, table_rows, best, metric, written),
                        encoding="utf-8")
    say(f"interactive view: optuna-dashboard {url}  (pip install optuna-dashboard)")
    return 0
