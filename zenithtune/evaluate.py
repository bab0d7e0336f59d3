"""Evaluators: turn one trial's output into one score.

Training commands print a metric per logging interval; an evaluator finds those values, drops the
warm-up, and reduces the rest to one number with a *selector*:

* ``last``     — the last value (the seed's rule; Megatron's own per-interval numbers are already averages)
* ``mean``     — arithmetic mean
* ``median``   — robust to one slow interval (a checkpoint save, a straggler)
* ``harmonic`` — the right mean for rates (TFLOP/s, it/s): the rate of the whole run at equal work
  per interval

Evaluators are instantiated by Hydra from ``conf/evaluator/*.yaml`` (``_target_``).
"""
from __future__ import annotations

import abc
import logging
import math
import re
import statistics
from typing import Literal, Sequence, get_args

__all__ = ["Evaluator", "NoMetric", "MegatronThroughput", "SwiftSpeed", "Regex", "select",
           "peak_memory_mb", "Direction", "Selector", "SELECTORS"]

log = logging.getLogger(__name__)

Direction = Literal["maximize", "minimize"]
Selector = Literal["last", "mean", "median", "harmonic"]
SELECTORS: tuple[str, ...] = get_args(Selector)
_NUMBER = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?"


class NoMetric(Exception):
    """The command ran but its output has no usable metric (the trial fails as ``no_metric``)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _check_selector(selector: str) -> None:
    if selector not in SELECTORS:
        raise ValueError(f"selector {selector!r} is not one of {', '.join(SELECTORS)}: "
                         f"set e.g. evaluator.selector=mean")


def _check_skip_first(skip_first: int) -> None:
    if isinstance(skip_first, bool) or not isinstance(skip_first, int) or skip_first < 0:
        raise ValueError(f"skip_first={skip_first!r} must be a whole number >= 0 "
                         f"(logged values to drop as warm-up)")


def select(values: Sequence[float], selector: Selector = "last", skip_first: int = 0, *,
           what: str = "metric") -> float:
    """Drop the first ``skip_first`` values (warm-up), reduce the rest with ``selector``.

    Too few values is a failed measurement, not a reason to quietly use the warm-up: NoMetric.
    """
    _check_selector(selector)
    _check_skip_first(skip_first)
    if not values:
        raise NoMetric(f"no {what} values found")
    if skip_first >= len(values):
        raise NoMetric(f"found {len(values)} {what} value(s) but skip_first={skip_first} drops them all: "
                       f"set skip_first below {len(values)} or run more iterations")
    kept = [float(v) for v in values[skip_first:]]
    if selector == "last":
        return kept[-1]
    if selector == "mean":
        return statistics.fmean(kept)
    if selector == "median":
        return float(statistics.median(kept))
    if any(v <= 0 for v in kept):
        raise NoMetric(f"harmonic mean needs positive {what} values, got {min(kept)}: use selector=mean")
    return statistics.harmonic_mean(kept)


class Evaluator(abc.ABC):
    """Reads one trial's output and returns its score.

    Life of an evaluator:

    1. **Construction.** Hydra instantiates it once per run from the ``evaluator`` config group
       (``_target_`` + keyword arguments). Bad settings (unknown selector, broken regex) raise
       ``ValueError`` here, before any trial is launched.
    2. **Study setup.** The sweeper reads :attr:`direction` to create the Optuna study and
       :attr:`metric_name` to label values in progress lines, tables and plots.
    3. **Each trial.** After the command exits with status 0, the entry function calls
       :meth:`evaluate` with the trial's output (stdout and stderr merged, possibly only the tail of a
       long run). It returns one float, or raises :class:`NoMetric` with a one-line reason, and the
       trial is recorded as failed with kind ``no_metric``. Output of failed commands is never
       evaluated.

    Evaluators keep no state between calls: the same output always gives the same score, so a study
    can be resumed or a trial re-evaluated from its log file.
    """

    direction: Direction = "maximize"
    metric_name: str = "value"

    @abc.abstractmethod
    def evaluate(self, output: str) -> float:
        """The trial's score from its output; raises NoMetric when there is none."""

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({args})"


class _PatternEvaluator(Evaluator):
    """A regex finds every logged value; ``select`` reduces them. Shared by all built-in evaluators."""

    _hint = ""  # appended to the NoMetric reason when nothing matches: how the user gets the metric printed
    _wanted = ""  # what a matching line looks like, for that reason; empty = show the regex

    def __init__(self, pattern: str, *, selector: Selector = "last", skip_first: int = 0,
                 group: int | str = 1) -> None:
        _check_selector(selector)
        _check_skip_first(skip_first)
        try:
            compiled = re.compile(pattern)
        except re.error as exc:
            raise ValueError(f"evaluator pattern {pattern!r} is not a valid regular expression ({exc}): "
                             f"fix it, or escape literal characters such as ( ) [ ] . with a backslash") from None
        if isinstance(group, int) and not 0 <= group <= compiled.groups:
            raise ValueError(f"evaluator pattern {pattern!r} has {compiled.groups} group(s) but group={group}: "
                             f"put ( ) around the number or set group=0 for the whole match")
        if isinstance(group, str) and group not in compiled.groupindex:
            raise ValueError(f"evaluator pattern {pattern!r} has no group named {group!r}: "
                             f"add (?P<{group}>...) or give the group's number")
        self.selector = selector
        self.skip_first = skip_first
        self._pattern = compiled
        self._group = group

    def values(self, output: str) -> list[float]:
        """Every value the pattern finds, in order of appearance."""
        found: list[float] = []
        for m in self._pattern.finditer(output):
            text = m.group(self._group)
            try:
                value = float(text)
            except (TypeError, ValueError):
                raise NoMetric(f"pattern {self._pattern.pattern!r} matched {text!r}, which is not a number") from None
            if not math.isfinite(value):
                raise NoMetric(f"{self.metric_name} is {text} in the output (the run diverged or measured nothing)")
            found.append(value)
        return found

    def evaluate(self, output: str) -> float:
        values = self.values(output)
        if not values:
            wanted = self._wanted or f"pattern {self._pattern.pattern!r} matched"
            raise NoMetric(f"no {self.metric_name} in the output: {wanted} none of "
                           f"{len(output.splitlines())} lines{self._hint}")
        return select(values, self.selector, self.skip_first, what=self.metric_name)


class MegatronThroughput(_PatternEvaluator):
    """Megatron's ``throughput per GPU (TFLOP/s/GPU): X`` (model FLOPs per GPU per second), maximized."""

    direction: Direction = "maximize"
    metric_name = "TFLOP/s/GPU"
    _hint = "; Megatron prints throughput only with --log-throughput: add it to the command"
    _wanted = "'throughput per GPU (TFLOP/s/GPU): X' in"

    def __init__(self, selector: Selector = "last", skip_first: int = 0) -> None:
        super().__init__(rf"throughput per GPU \(TFLOP/s/GPU\):\s*({_NUMBER})",
                         selector=selector, skip_first=skip_first)


class SwiftSpeed(_PatternEvaluator):
    """ms-swift's ``train_speed(s/it)`` (Megatron mode) or ``train_speed(iter/s)`` (``swift sft``),
    as seconds per iteration, minimized (at a fixed global batch, fewer s/it is more throughput).

    ms-swift logs a *running* average since training started, so its last value still carries the
    warm-up. With ``per_interval`` (default) each logged value is turned back into the speed of its own
    logging interval — elapsed_k = speed_k · step_k, interval = Δelapsed / Δstep — using the step
    ms-swift logs next to it (``'iteration': '5/10'`` or ``'global_step/max_steps': '5/10'``). Then
    ``skip_first`` really drops warm-up and ``last`` is the steady-state speed. Without step fields the
    running averages are used as logged (with a warning).
    """

    direction: Direction = "minimize"
    metric_name = "s/it"
    _hint = "; ms-swift logs train_speed with each training log line (every --logging_steps)"
    _wanted = "'train_speed(s/it)' or 'train_speed(iter/s)' in"
    _STEP = re.compile(r"""['"](?:iteration|global_step/max_steps)['"]\s*:\s*['"](\d+)/\d+['"]""")

    def __init__(self, selector: Selector = "last", skip_first: int = 0, per_interval: bool = True) -> None:
        super().__init__(rf"""['"]train_speed\((s/it|iter/s)\)['"]\s*:\s*({_NUMBER})""",
                         selector=selector, skip_first=skip_first, group=2)
        self.per_interval = per_interval

    def values(self, output: str) -> list[float]:
        points: list[tuple[int | None, float]] = []  # (step, running s/it)
        for line in output.splitlines():
            m = self._pattern.search(line)
            if not m:
                continue
            speed = float(m.group(2))
            if speed <= 0 or not math.isfinite(speed):
                continue  # 0.0 is logged before the first step completes: no measurement yet
            s_per_it = speed if m.group(1) == "s/it" else 1.0 / speed
            step = self._STEP.search(line)
            points.append((int(step.group(1)) if step else None, s_per_it))
        if not self.per_interval or not points:
            return [s for _, s in points]
        if any(step is None for step, _ in points):
            log.warning("SwiftSpeed: no step field next to train_speed; using ms-swift's running averages as logged")
            return [s for _, s in points]
        intervals: list[float] = []
        prev_step, prev_elapsed = 0, 0.0
        for step, s_per_it in [(int(n or 0), s) for n, s in points]:
            if step <= prev_step:
                continue  # a repeated line (e.g. printed by two ranks): no new interval
            elapsed = s_per_it * step
            intervals.append((elapsed - prev_elapsed) / (step - prev_step))
            prev_step, prev_elapsed = step, elapsed
        return intervals


class Regex(_PatternEvaluator):
    """Any metric the command prints: a user regex whose ``group`` captures the number."""

    def __init__(self, pattern: str, direction: Direction = "maximize", selector: Selector = "last",
                 skip_first: int = 0, group: int | str = 1, metric_name: str = "value") -> None:
        if direction not in get_args(Direction):
            raise ValueError(f"direction {direction!r} is not one of maximize, minimize: "
                             f"set evaluator.direction=minimize for times/losses, maximize for rates")
        super().__init__(pattern, selector=selector, skip_first=skip_first, group=group)
        self.pattern = pattern
        self.direction = direction
        self.metric_name = metric_name
        self.group = group


_MEGATRON_MEMORY = re.compile(rf"memory \(MB\).*?\|\s*max allocated:\s*({_NUMBER})")
_SWIFT_MEMORY = re.compile(rf"""['"]memory\(GiB\)['"]\s*:\s*({_NUMBER})""")


def peak_memory_mb(output: str) -> float | None:
    """Peak GPU memory the run reported, in MB: the largest Megatron ``max allocated`` (from
    ``[Rank r] (after n iterations) memory (MB) | ...``, over all ranks and lines) or ms-swift
    ``memory(GiB)`` × 1024. None when the output reports neither."""
    found = [float(v) for v in _MEGATRON_MEMORY.findall(output)]
    found += [float(v) * 1024 for v in _SWIFT_MEMORY.findall(output)]
    return max(found) if found else None


# --- memory evidence for the memory model (zenithtune.memory.MemoryModel) ---------------------------
_MEGATRON_RESERVED = re.compile(rf"memory \(MB\).*?\|\s*max reserved:\s*({_NUMBER})")
_OOM = re.compile(rf"Tried to allocate ({_NUMBER}) ([GM]i?B).*?this process has ({_NUMBER}) ([GM]i?B) memory in use",
                  re.DOTALL)


def memory_evidence(output: str) -> dict[str, float]:
    """What a run's log says about memory, in GB (GiB), for the memory model to learn from:

    * ``allocated_gb``: the largest Megatron ``max allocated`` (or ms-swift ``memory(GiB)``);
    * ``reserved_gb``: the largest ``max reserved`` (the caching allocator's footprint);
    * ``needed_gb``: from PyTorch's OOM message, memory in use when it failed plus the allocation
      that failed ("Tried to allocate X GiB ... this process has Y GiB memory in use"): the run
      needed at least that much.

    Keys are absent when the log does not say (an empty dict for a log without memory lines)."""
    out: dict[str, float] = {}
    peak = peak_memory_mb(output)
    if peak is not None:
        out["allocated_gb"] = peak / 1024
    reserved = [float(v) for v in _MEGATRON_RESERVED.findall(output)]
    if reserved:
        out["reserved_gb"] = max(reserved) / 1024
    needs = []
    for tried, tried_unit, in_use, use_unit in _OOM.findall(output):
        gb = lambda v, unit: float(v) / (1024 if unit.startswith("M") else 1)  # noqa: E731
        needs.append(gb(tried, tried_unit) + gb(in_use, use_unit))
    if needs:
        out["needed_gb"] = max(needs)
    return out
