"""What a study prints while it runs: the space report, one line per launched trial, the result.

One line per launched trial, in a terminal and in a log alike:
  [3/50] trial 7  tp=2 pp=1 cp=1 mbs=2 recompute=selective -> 412.3 TFLOP/s/GPU  best 415  (12.3 s, 0:01:02)
  [4/50] trial 9  tp=1 pp=1 cp=1 mbs=8 recompute=selective -> oom: CUDA out of memory ...  best 415  (...)
In an interactive terminal a progress bar (launched/n_trials, best so far, elapsed, ETA) stays below
the lines (rich); when stdout is not a terminal (CI, `| tee`, a log file) only the plain lines are
written. `TTY_INTERACTIVE=0` forces plain lines in a terminal too. While proposals are screened out
for a while without a launch (a grid walking past thousands of candidates), a line every
`SCREEN_EVERY` seconds says so:
  screening: 392 proposals pruned before launch so far; latest: tp=1 pp=1 cp=1 mbs=8 recompute=none (predicted_oom)
"""
from __future__ import annotations

import atexit
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from zenithtune import record
from zenithtune.job import Setting, SpaceReport
from zenithtune.loop import Callbacks
from zenithtune.record import Outcome
from zenithtune.space import SWITCH_PARAMS

SHORT = {"recompute_granularity": "recompute", "recompute_method": "method",
         "recompute_num_layers": "layers", "recompute_modules": "modules",
         "vit_gradient_checkpointing": "vit_ckpt", "tp_comm_overlap": "tp_overlap",
         "moe_a2a_overlap": "a2a_overlap"}
_RESULT_MAX = 160  # characters of a failure reason on a trial line; trial.log has the rest
SCREEN_EVERY = 10.0  # seconds without a line while proposals are screened out before a screening line


def describe(cand: dict[str, Any]) -> str:
    """A candidate on one line; an overlap switch only when on (off is Megatron's default)."""
    return " ".join(f"{SHORT.get(k, k)}={v}" for k, v in cand.items() if not (k in SWITCH_PARAMS and v is False))


def clip(text: str, limit: int = _RESULT_MAX) -> str:
    """`text` shortened to about `limit` characters at the end of a clause ("; "): the last that fits,
    else the first when it is at most half as long again, else after a whole word; marked " ...". A
    reason is not cut mid-sentence where a clause ends near the limit (the whole one is in the study)."""
    if len(text) <= limit:
        return text
    head = text[:limit - 4]
    last, first = head.rfind("; "), text.find("; ")
    if last > limit // 2:
        cut = head[:last]
    elif 0 < first <= limit * 3 // 2:
        cut = text[:first]
    else:
        cut = head[:head.rfind(" ")] if " " in head else head
    return cut.rstrip(" ;,:") + " ..."


def _clock(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def _interactive(out: TextIO) -> bool:
    from rich.console import Console

    try:
        tty = out.isatty()
    except (AttributeError, ValueError):
        tty = False
    return tty and Console(file=out).is_interactive


def saved_line(stopped: list[Outcome]) -> str:
    """The footer's line on trials stop_when_stable ended: how many, and the trial time saved, estimated
    from the iterations each had left ((M - N) x its median iteration time, from Megatron's lines)."""
    known = [o.saved_s for o in stopped if o.saved_s is not None]
    n = len(stopped)
    line = f"stop_when_stable: {n} trial{'s' if n > 1 else ''} stopped once stable"
    if not known:
        return line + "; time saved unknown (no 'iteration N/ M' lines with an iteration time)"
    unknown = f"; {n - len(known)} without 'iteration N/ M' lines not counted" if len(known) < n else ""
    return line + f", about {_clock(sum(known))} of trial time saved (their iterations left x median iteration time{unknown})"


class Progress(Callbacks):
    def __init__(self, total: int, metric: str, direction: str, out: TextIO | None = None,
                 interactive: bool | None = None, clock: Callable[[], float] = time.monotonic):
        from rich.console import Console

        self.total = total
        self.metric = metric
        self.direction = direction
        self.out = out or sys.stdout
        self.interactive = _interactive(self.out) if interactive is None else interactive
        self.console = Console(file=self.out, highlight=False, soft_wrap=True, markup=False, emoji=False,
                               force_terminal=True if self.interactive else None)
        self.start = time.time()
        self.best: float | None = None
        self.pruned = 0
        self._pending = ""
        self._why: str | None = None
        self._bar: Any = None  # rich.progress.Progress while trials run (interactive only)
        self._task: Any = None
        self._clock = clock
        self._last_line = clock()  # when the last line was written (screening lines fill long silences)

    # --- output ------------------------------------------------------------------------------------
    def line(self, text: str = "") -> None:
        self._last_line = self._clock()
        if self._bar is not None:
            self._bar.console.print(text)
        elif self.interactive:
            self.console.print(text)
        else:
            print(text, file=self.out, flush=True)

    def _start_bar(self, done: int) -> None:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            SpinnerColumn,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )
        from rich.progress import Progress as Bar

        self._bar = Bar(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(bar_width=24),
                        MofNCompleteColumn(), TextColumn("best {task.fields[best]}  pruned {task.fields[pruned]}"),
                        TextColumn("elapsed"), TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                        console=self.console, transient=True, redirect_stdout=True, redirect_stderr=True,
                        speed_estimate_period=7 * 24 * 3600.0)  # trials take minutes: use every one for the ETA
        self._task = self._bar.add_task("starting", total=self.total, completed=done,
                                        best=f"{self.best:g}" if self.best is not None else "-", pruned=self.pruned)
        self._bar.start()
        atexit.register(self.close)  # an error that ends the study must not leave the cursor hidden

    def close(self) -> None:
        """Take the progress bar down (the trial lines stay)."""
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def _update(self, **kw: Any) -> None:
        if self._bar is not None:
            self._bar.update(self._task, **kw)

    # --- the study ---------------------------------------------------------------------------------
    def header(self, setting: Setting, report: SpaceReport, strategy: str, url: str, resumed: int = 0,
               stale: list[int] | None = None, best: float | None = None, used: int = 0, limits: str = "") -> None:
        """The space report (`strategy`: its name as the user selected it; `limits`: what it may launch
        that can run out of memory, `job.memory_limits`); for a resumed study also its best so far and
        the launches already used."""
        self.best = best
        ctx, s = setting.ctx, report.survey
        self.line(f"zenithtune: {ctx.n_gpus} GPUs ({ctx.gpus_per_node}/node, {setting.capacity_gb:g} GB from "
                  f"{setting.memory_source}), gbs={ctx.gbs}, model: {ctx.model.summary()}")
        self.line(f"space: {s.total} candidates")
        groups = (("megatron", "Megatron would reject"),
                  ("policy", "zenithtune's policy (prune.policy.<rule>=false keeps them)"))
        for kind, title in groups:
            removed = s.removed_by(kind)
            if removed:
                self.line(f"  {title}:")
            for rule, n in removed:
                self.line(f"  - {n:6d} removed by {rule}: e.g. {s.reasons[rule]}")
        about = "~" if report.estimated else " "
        self.line(f"  -{about}{report.predicted_oom:6d} predicted to run out of memory (not launched)"
                  + (" (counted on a sample)" if report.estimated else ""))
        self.line(f"  ={about}{s.valid - report.predicted_oom} left to search; strategy "
                  f"{strategy}, n_trials={self.total}")
        if limits:
            self.line(f"  {limits}")
        for note in s.notes:
            self.line(f"  note: {note}")
        resume = ""
        if resumed:
            resume = (f" (resumed with {resumed} recorded trials; {used} of n_trials={self.total} used"
                      + (f", best {best:g}" if best is not None else "") + ")")
        self.line(f"study: {url}{resume}")
        if stale:
            self.line(f"  trials {stale} were running when the tuner stopped: recorded as interrupted")

    def launching(self, number: int, cand: dict, why: str, n: int) -> None:
        self._pending = f"[{n}/{self.total}] trial {number}  {describe(cand)}"
        if why and why != self._why:
            self.line(f"  why: {why}")
        self._why = why or self._why
        if self.interactive and self._bar is None:
            self._start_bar(done=n - 1)
        self._update(description=f"trial {number} {describe(cand)}"[:36])

    def result(self, o: Outcome, n: int) -> None:
        if o.ok and o.value is not None:
            if self.best is None or (o.value > self.best if self.direction == "maximize" else o.value < self.best):
                self.best = o.value
            res = f"-> {o.value:g} {self.metric}" + (f" (stopped once stable after {o.stopped_after} values)"
                                                     if o.stopped_after is not None else "")
            if o.late_failure:
                res = clip(f"{res} (scored, though it failed after its training loop: {o.late_failure})")
        else:
            res = clip(f"-> {o.kind}: {o.reasons[0] if o.reasons else ''}")
        best = f"best {self.best:g}" if self.best is not None else "best -"
        took = f"{o.duration:.1f} s, " if o.duration is not None else ""
        self.line(f"{self._pending or f'[{n}/{self.total}]'} {res}  {best}  ({took}{_clock(time.time() - self.start)})")
        self._pending = ""
        self._update(completed=n, best=f"{self.best:g}" if self.best is not None else "-")

    def waiting(self, reason: str, numbers: list[int]) -> None:
        """A wave of Slurm jobs not started yet: squeue's reason (Resources, Priority, ...)."""
        self.line(f"  waiting in queue: {reason} (trial{'s' if len(numbers) > 1 else ''} "
                  f"{', '.join(map(str, numbers))})")
        self._update(description=f"waiting in queue: {reason}"[:36])

    def skipped(self, o: Outcome) -> None:
        self.pruned += 1
        self._update(pruned=self.pruned)
        if self._clock() - self._last_line >= SCREEN_EVERY:
            self.line(f"  screening: {self.pruned} proposals pruned before launch so far; latest: "
                      f"{describe(o.candidate)} ({', '.join(o.rules) or 'screened out'})")

    def interrupted(self, url: str, hint: str | None, reason: str) -> None:
        """`reason` names the stop (signals.reason(): Ctrl-C, or the signal a scheduler sent)."""
        self.close()
        self.line(f"{reason}; the running trial's process group was stopped and the trial recorded as interrupted")
        self.line("resume (finished trials are kept, the interrupted one may be retried):")
        self.line(f"  {hint}" if hint else f"  the same command plus storage={url}")

    def footer(self, outcomes: list[Outcome], best: Outcome | None, why: str) -> None:
        self.close()
        launched = record.launched(outcomes)
        complete = sum(1 for o in launched if o.ok)
        fails = "".join(f", {n} {k}" for k, n in record.kind_counts(launched).most_common())
        self.line(f"done ({why}): {len(launched)} launched ({complete} complete{fails}), {self.pruned} proposals "
                  f"pruned before launch, {_clock(time.time() - self.start)}")
        stopped = [o for o in launched if o.ok and o.stopped_after is not None]
        if stopped:
            self.line(saved_line(stopped))
        if best is not None:
            self.line(f"best: trial {best.trial_number}  {describe(best.candidate)}  {best.value:g} {self.metric}")
            if best.argv:
                self.line(f"  argv: {shlex.join(best.argv)}")

    def wrote(self, path: Path, hint: str | None = None) -> None:
        self.line(f"wrote {path}" + (f"  ({hint})" if hint else ""))
