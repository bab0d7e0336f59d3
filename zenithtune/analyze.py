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

Trials are read only through `record` (`record.review`: one `Outcome` per trial, running ones
included). A study made by the stock `hydra/sweeper=optuna` (`baseline=stock_tpe`) has none of our
trial attributes; `record` reads each of its trials from the trial_<n>/trial.json next to study.db
(every finished one was a job, screened-out ones included).
"""
from __future__ import annotations

import base64
import datetime as _dt
import html
import shlex
import sys
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from zenithtune import record
from zenithtune import study as zstudy
from zenithtune.progress import SHORT
from zenithtune.record import Outcome

PLOTS = ("history.png", "importances.png", "parallel.png", "timeline.png")
_COLOURS = {"complete": "tab:green", "running": "tab:blue", "timeout": "tab:orange", "oom": "tab:red",
            "interrupted": "tab:gray"}  # other failure kinds: tab:purple


def load(db: str, study_name: str | None = None) -> tuple[optuna.Study, str]:
    return zstudy.load_existing(db, study_name)


def _state(o: Outcome) -> str:
    """complete, pruned, running, or a failed trial's kind."""
    return (o.kind or "failed") if o.state == "failed" else o.state


def _scored(outcomes: list[Outcome]) -> list[Outcome]:
    """The launched trials with a score."""
    return [o for o in outcomes if o.launched and o.ok]


def _best(outcomes: list[Outcome], maximize: bool) -> Outcome | None:
    done = _scored(outcomes)
    return (max if maximize else min)(done, key=lambda o: float(o.value or 0.0)) if done else None


def _ratio(best: Outcome, first: Outcome, maximize: bool) -> str:
    if not first.value or not best.value:
        return "-"
    r = best.value / first.value if maximize else first.value / best.value
    return f"x{r:.2f}"


def _keys(outcomes: list[Outcome]) -> list[str]:
    """Every parameter name, in the order the trials first name them."""
    keys: list[str] = []
    for o in outcomes:
        keys += [k for k in o.candidate if k not in keys]
    return keys


def _row(o: Outcome, keys: list[str]) -> tuple[list[str], str, str, str]:
    """A trial's parameter cells, score, seconds and failure / reason, as the table and the page show them."""
    value = f"{o.value:g}" if o.ok and o.value is not None else ""
    dur = f"{o.duration:.1f}" if o.duration is not None else ""
    reasons = "; ".join(str(r) for r in o.reasons) if o.state in ("failed", "pruned") else ""
    if o.ok and o.stopped_after is not None:
        reasons = f"stopped once stable after {o.stopped_after} values (stop_when_stable)"
    if o.ok and o.late_failure:
        reasons = f"scored, though it failed after its training loop: {o.late_failure}"
    return [str(o.candidate.get(k, "")) for k in keys], value, dur, reasons


# --- text ----------------------------------------------------------------------------------------
def _table(outcomes: list[Outcome], best: Outcome | None, metric: str) -> Any:
    from rich.table import Table

    keys = _keys(outcomes)
    table = Table(title=f"{len(outcomes)} trials", show_lines=False, header_style="bold")
    table.add_column("#", justify="right")
    table.add_column("state")
    for k in keys:
        table.add_column(SHORT.get(k, k), justify="right")
    table.add_column(metric, justify="right")
    spreads = any(o.spread is not None for o in outcomes)  # studies recorded before spreads were: no column
    if spreads:
        table.add_column("spread", justify="right")  # MAD / median of the trial's values after warm-up
    table.add_column("s", justify="right")
    table.add_column("failure / reason", overflow="ellipsis", no_wrap=True, max_width=70)
    for o in outcomes:
        cells, value, dur, reasons = _row(o, keys)
        is_best = best is not None and o.trial_number == best.trial_number
        style = "bold green" if is_best else {"failed": "red", "pruned": "dim"}.get(o.state)
        spread = [f"{o.spread:.1%}" if o.spread is not None and o.ok else ""] if spreads else []
        table.add_row(f"{o.trial_number}{' *' if is_best else ''}", _state(o), *cells, value, *spread, dur, reasons,
                      style=style)
    return table


def _evaluator() -> tuple[Any, str]:
    """fANOVA (seeded) when scikit-learn is installed, else PED-ANOVA (Optuna's, no extra package)."""
    from optuna.importance import FanovaImportanceEvaluator, PedAnovaImportanceEvaluator

    try:
        import sklearn  # noqa: F401
    except ImportError:
        return PedAnovaImportanceEvaluator(), "PED-ANOVA; pip install scikit-learn for fANOVA"
    return FanovaImportanceEvaluator(seed=0), "fANOVA"


def _importances(study: optuna.Study) -> tuple[dict[str, float] | None, str]:
    """Parameter -> importance over the parameters that vary, or None and the reason there is none.
    Optuna computes them from its own record of the complete trials (their distributions)."""
    complete: list[FrozenTrial] = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
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


def _history(outcomes: list[Outcome], metric: str, maximize: bool) -> Any:
    import matplotlib.pyplot as plt

    done = _scored(outcomes)
    failed = [o for o in outcomes if o.launched and o.state == "failed"]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    xs, ys = [int(o.trial_number or 0) for o in done], [float(o.value or 0.0) for o in done]
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
        for kind in sorted({_state(o) for o in failed}):
            fx = [int(o.trial_number or 0) for o in failed if _state(o) == kind]
            ax.scatter(fx, [y0] * len(fx), marker="x", s=30, color=_COLOURS.get(kind, "tab:purple"),
                       label=f"{kind} (no score)", zorder=3)
    _trial_axis(ax)
    ax.set_xlabel("trial number")
    ax.set_ylabel(metric)
    ax.grid(alpha=0.3)
    ax.set_title(f"Score per trial ({metric}, {'higher' if maximize else 'lower'} is better): "
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


def _parallel(outcomes: list[Outcome], metric: str, maximize: bool) -> Any:
    import matplotlib.pyplot as plt
    from matplotlib import cm, colors

    done = _scored(outcomes)
    keys = _keys(done)
    # one axis per parameter that varies (a parameter missing in a trial, e.g. method under
    # selective recompute, shows as "-")
    cols = [k for k in keys if len({repr(o.candidate.get(k, "-")) for o in done}) > 1] or keys[:1]
    scores = [float(o.value or 0.0) for o in done]
    fig, ax = plt.subplots(figsize=(max(7.0, 1.5 * (len(cols) + 1)), 5))
    pos = {}
    for j, k in enumerate(cols):
        ys, labels = _axis_values([o.candidate.get(k, "-") for o in done])
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
    ax.set_xticks(range(len(cols) + 1), [SHORT.get(k, k) for k in cols] + [metric])
    ax.set_xlim(-0.2, len(cols) + 0.4)
    ax.set_ylim(-0.06, 1.06)
    ax.set_yticks([])
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    fig.colorbar(cm.ScalarMappable(norm=norm, cmap=cmap), ax=ax, pad=0.02, label=metric)
    ax.set_title(f"Parameters of the {len(done)} complete trials, coloured by {metric} "
                 f"(thick: best, trial {done[best_i].trial_number})")
    return fig


def _timeline(outcomes: list[Outcome]) -> Any:
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch
    from matplotlib.ticker import MaxNLocator

    now = _dt.datetime.now()
    launched = [o for o in outcomes if (o.launched or o.state == "running") and o.started is not None]
    if not launched:
        raise ValueError("no launched trial has a start time")
    t0 = min(o.started or now for o in launched)
    fig, ax = plt.subplots(figsize=(9, min(12.0, max(2.8, 0.22 * len(launched) + 1.5))))
    seen: dict[str, str] = {}
    for i, o in enumerate(launched):
        start = ((o.started or t0) - t0).total_seconds()
        end = ((o.finished or now) - t0).total_seconds()
        state = _state(o)
        colour = _COLOURS.get(state, "tab:purple")
        seen.setdefault(state, colour)
        ax.barh(i, max(end - start, 1e-3), left=start, color=colour, height=0.7)
    ax.yaxis.set_major_locator(MaxNLocator(nbins=min(len(launched), 20), integer=True))
    ax.set_yticks([i for i in ax.get_yticks() if 0 <= i < len(launched)])
    ax.set_yticklabels([f"trial {launched[int(i)].trial_number}" for i in ax.get_yticks()])
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


def plot(outcomes: list[Outcome], out_dir: Path, metric: str, maximize: bool,
         importances: dict[str, float] | None, how: str = "") -> tuple[list[Path], list[str]]:
    """Write the PNGs; returns the files written and one line per plot that could not be drawn."""
    import matplotlib

    matplotlib.use("Agg")
    complete = _scored(outcomes)
    jobs: list[tuple[str, Callable[[], Any], str | None]] = [
        ("history.png", lambda: _history(outcomes, metric, maximize), None if complete else "needs a complete trial"),
        ("importances.png", lambda: _importance_bars(importances or {}, how),
         None if complete and importances is not None else "see importances above"),
        ("parallel.png", lambda: _parallel(outcomes, metric, maximize), None if complete else "needs a complete trial"),
        ("timeline.png", lambda: _timeline(outcomes), None),
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
def report_html(title: str, lines: list[str], outcomes: list[Outcome], best: Outcome | None,
                metric: str, images: list[Path]) -> str:
    """One self-contained HTML page (no network, no files beside it): what analyze printed, the
    trial table, the best command, and the plots as data URIs."""
    esc = html.escape
    keys = _keys(outcomes)
    head = "".join(f"<th>{esc(SHORT.get(k, k))}</th>" for k in keys)
    rows = []
    for o in outcomes:
        cells, value, dur, reasons = _row(o, keys)
        cls = "best" if best is not None and o.trial_number == best.trial_number else _state(o)
        tds = "".join(f"<td>{esc(c)}</td>" for c in cells)
        rows.append(f'<tr class="{esc(cls)}"><td>{o.trial_number}{" *" if cls == "best" else ""}</td>'
                    f"<td>{esc(_state(o))}</td>{tds}<td>{esc(value)}</td><td>{dur}</td><td>{esc(reasons)}</td></tr>")
    if best is not None:
        best_html = (f"<p id=\"best\">Best: trial {best.trial_number}, {best.value:g} {esc(metric)}: "
                     f"{esc(' '.join(f'{SHORT.get(k, k)}={v}' for k, v in best.candidate.items()))}</p>"
                     + (f"<pre id=\"best-command\">{esc(shlex.join(best.argv))}</pre>" if best.argv else ""))
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
<table id="trials"><thead><tr><th>#</th><th>state</th>{head}<th>{esc(metric)}</th><th>s</th>
<th>failure / reason</th></tr></thead>
<tbody>
{chr(10).join(rows)}
</tbody></table>
<h2>Plots</h2>
{figures}
</body></html>
"""


# --- the command ---------------------------------------------------------------------------------
@dataclass
class _Study:
    """One study as analyze reads it: its trials as `record.Outcome`s and what the study says of itself."""

    study: optuna.Study
    url: str
    outcomes: list[Outcome]
    meta: dict[str, Any]  # what our sweeper recorded about the study (n_gpus, gbs, model, strategy, metric)
    metric: str  # the score's unit, e.g. TFLOP/s/GPU ("score" when the study does not say)
    maximize: bool
    stock: bool  # made by the stock hydra/sweeper=optuna

    @property
    def folder(self) -> Path | None:
        path = zstudy.db_path(self.url)
        return path.parent if path else None

    @property
    def launched(self) -> list[Outcome]:
        return record.launched(self.outcomes)


def _read(db: str, study_name: str | None) -> _Study:
    study, url = load(db, study_name)  # a ZenithtuneError is the CLI's one line
    path = zstudy.db_path(url)
    folder = path.parent if path else None
    meta = study.user_attrs.get(zstudy.STUDY_ATTR) or {}
    metric = meta.get("metric") or record.stock_metric(study, folder) or "score"
    return _Study(study, url, record.review(study, folder), meta, metric,
                  study.direction == optuna.study.StudyDirection.MAXIMIZE, record.is_stock(study))


def _overview(s: _Study) -> list[str]:
    """Where the study is, what made it, what still runs."""
    shape = " ".join(f"{k}={s.meta[k]}" for k in ("n_gpus", "gbs", "model", "strategy") if s.meta.get(k) is not None)
    lines = [f"study {s.study.study_name!r} in {zstudy.db_path(s.url) or s.url}" + (f"  ({shape})" if shape else "")]
    if s.stock:
        lines.append("made by the stock hydra/sweeper=optuna: every job counts as launched (screened-out ones "
                     "included); outcomes from trial_<n>/trial.json")
    running = [o for o in s.outcomes if o.state == "running"]
    if running:
        lines.append(f"still running: trial {', '.join(str(o.trial_number) for o in running)} in progress "
                     "(or the tuner died; resuming records it as interrupted)")
    return lines


def _counts(s: _Study) -> list[str]:
    """Launches by outcome, time spent, and what was pruned before launch, by rule."""
    launched = s.launched
    complete = sum(1 for o in launched if o.ok)
    running = sum(1 for o in s.outcomes if o.state == "running")
    failed = Counter(_state(o) for o in launched if o.state == "failed")
    lines = [f"launched {len(launched)}: {complete} complete" + "".join(f", {n} {k}" for k, n in failed.most_common())
             + (f", {running} running" if running else ""),
             f"time in trials: {sum(o.duration or 0.0 for o in launched):.1f} s"]
    pruned = [o for o in s.outcomes if o.state == "pruned"]
    if not pruned:
        return lines + ["pruned before launch: 0"]
    lines.append(f"pruned before launch (never run, not counted in n_trials): {len(pruned)}")
    for rule, n in Counter(r for o in pruned for r in (o.rules or ["?"])).most_common():
        example = next((o.reasons[0] for o in pruned if rule in (o.rules or ["?"]) and o.reasons), "")
        lines.append(f"  {n:5d} {rule}: e.g. {example}")
    return lines


def _verdict(s: _Study, best: Outcome | None) -> list[str]:
    """The best trial, its command, and how much better it is than the first launch."""
    if best is None:
        return ["best: none yet (no complete trial)"]
    lines = ["", f"best: trial {best.trial_number}  {best.value:g} {s.metric}"]
    lines += [f"  {k}: {v}" for k, v in best.candidate.items()]
    if best.argv:
        lines.append(f"  argv: {shlex.join(best.argv)}")
    first = next((o for o in s.launched if o.state != "running"), None)
    if first is not None and first.ok:
        lines.append(f"best vs first launched trial (trial {first.trial_number}, {first.value:g}): "
                     f"{_ratio(best, first, s.maximize)}")
    elif first is not None:
        first_ok = _scored(s.outcomes)[0]
        lines.append(f"first launched trial {first.trial_number} failed ({_state(first)}); best vs first complete "
                     f"(trial {first_ok.trial_number}, {first_ok.value:g}): {_ratio(best, first_ok, s.maximize)}")
    return lines


def _importance_lines(imp: dict[str, float] | None, how: str) -> list[str]:
    if imp is None:
        return [f"parameter importances: not available, {how}"]
    lines = [f"parameter importances over the complete trials ({how}):"]
    for k, v in imp.items():
        name = k.removeprefix("params.")  # a stock study names them params.<name>
        lines.append(f"  {SHORT.get(name, name):>12s}  {v:5.2f}  {'#' * round(v * 40)}")
    return lines


def analyze(db: str, study_name: str | None = None, plots: bool = True, show_all: bool = False,
            out: Any = None) -> int:
    """Print what a study found and write its plots and report.html next to its study.db."""
    from rich.console import Console

    console = Console(file=out or sys.stdout, highlight=False, soft_wrap=False,
                      width=None if (out or sys.stdout).isatty() else 200)
    said: list[str] = []  # the same lines go into report.html

    def say(*lines: str) -> None:
        for text in lines:
            said.append(text)
            console.print(text, markup=False, soft_wrap=True)

    s = _read(db, study_name)
    if not s.outcomes:
        print(f"zenithtune analyze: error: study {s.study.study_name!r} in {s.url} has no trials yet", file=sys.stderr)
        return 1
    best = _best(s.outcomes, s.maximize)
    say(*_overview(s))
    shown = s.outcomes if show_all else [o for o in s.outcomes if o.launched or o.state == "running"]
    if shown:
        console.print(_table(shown, best, s.metric))
    say(*_counts(s), *_verdict(s, best))
    imp, how = _importances(s.study)
    say(*_importance_lines(imp, how))
    if plots:
        out_dir = s.folder or Path.cwd()
        written, skipped = plot(s.outcomes, out_dir, s.metric, s.maximize, imp, how)
        say("", *[f"wrote {p}" for p in written], *[f"no {x}" for x in skipped])
        page = out_dir / "report.html"
        wrote = f"wrote {page}  (one self-contained page: table, plots, best command)"
        html = report_html(f"zenithtune study {s.study.study_name!r}", [*said, wrote], shown, best, s.metric, written)
        try:
            page.write_text(html, encoding="utf-8")
            say(wrote)
        except OSError as e:  # a study kept in a read-only folder: everything above was still shown
            say(f"no report.html: cannot write {page} ({e.strerror or e}); analyze a writable copy of the folder "
                f"for the page")
    say(f"interactive view: optuna-dashboard {s.url}  (pip install optuna-dashboard)")
    return 0
