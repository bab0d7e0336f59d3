"""Evaluators: turn one trial's output into one score.

Training commands print a metric per logging interval; an evaluator finds those values, drops the
warm-up, and reduces the rest to one number with a *selector*:

* ``last``     — the last value (the seed's rule; Megatron's own per-interval numbers are already averages)
* ``mean``     — arithmetic mean
* ``median``   — robust to one slow interval (a checkpoint save, a straggler); the default of
  ``megatron_throughput``
* ``harmonic`` — the right mean for rates (TFLOP/s, it/s): the rate of the whole run at equal work
  per interval

Built in: ``megatron_throughput`` (TFLOP/s/GPU, needs --log-throughput), ``iteration_time``
(samples or tokens per second per GPU from Megatron's elapsed time per iteration, always printed),
``swift_speed`` (ms-swift's s/it) and ``regex`` (any number, your pattern). They are fed the output
line by line while the command runs and keep only the values, so a metric anywhere in gigabytes of
output counts. A score is a finite number > 0, or the trial fails (``no_metric`` / ``bad_metric``).

Besides the score, a trial records how much its values moved: :func:`spread` of the values after
warm-up (:meth:`Evaluator.kept`), and how many there were. :func:`stable` is the rule
``stop_when_stable`` ends a trial by (its last k values within x of their median), and
:class:`TrainingClock` reads Megatron's ``iteration N/ M`` lines to say how long a trial stopped
that way would still have run.

Evaluators are instantiated by Hydra from ``conf/evaluator/*.yaml`` (``_target_``).
"""
from __future__ import annotations

import abc
import logging
import math
import re
import statistics
from array import array
from collections.abc import Sequence
from typing import Literal, get_args

from zenithtune.run import FailureKind

__all__ = ["Evaluator", "NoMetric", "BadMetric", "below_precision", "MegatronThroughput", "IterationTime", "SwiftSpeed", "Regex",
           "select", "spread", "stable", "peak_memory_mb", "PeakMemory", "TrainingClock", "Direction", "Selector",
           "SELECTORS"]

log = logging.getLogger(__name__)

Direction = Literal["maximize", "minimize"]
Selector = Literal["last", "mean", "median", "harmonic"]
SELECTORS: tuple[str, ...] = get_args(Selector)
_NUMBER = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?"
# A number that goes on past what the pattern matched (1,234.5 / 1 234 / 12.5.3 / 1_000): the token
# is no plain number, and a prefix of it (1, 12.5) is no measurement.
_GOES_ON = re.compile(r"(?:[.,'_]|\s(?=\d{3}(?!\d)))\d")
_TOKEN = re.compile(r"[-+]?\.?\d(?:[.,'_]?\d|\s\d{3}(?!\d))*")


_BELOW_PRECISION = "0: below the printed precision"


def below_precision(reason: str, metric: str) -> bool:
    """Whether a bad_metric reason says every logged value of ``metric`` printed as 0 (a model too small
    for the printed precision, e.g. 0.04 TFLOP/s/GPU shown as 0.0): every other candidate prints 0 too."""
    return reason.startswith(f"{metric} was 0 in all ") and _BELOW_PRECISION in reason


class NoMetric(Exception):
    """The command ran but its output has no usable metric (the trial fails as ``no_metric``)."""

    kind = FailureKind.NO_METRIC

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class BadMetric(NoMetric):
    """The output has the metric, but it cannot be a score: nan, inf, zero or negative (the trial fails
    as ``bad_metric``). Strategies compare, divide and take logs of scores; only finite positive
    numbers survive that."""

    kind = FailureKind.BAD_METRIC


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
        raise BadMetric(f"harmonic mean needs positive {what} values, got {min(kept)}: use selector=mean")
    return statistics.harmonic_mean(kept)


def spread(values: Sequence[float]) -> float | None:
    """How much a trial's values moved: their median absolute deviation over their median (0.01 = the
    typical value lies 1 % from the median). Robust to the one slow interval a checkpoint save makes.
    None for fewer than two values or a median that is not > 0 (no relative spread)."""
    if len(values) < 2:
        return None
    mid = statistics.median(values)
    if not math.isfinite(mid) or mid <= 0:
        return None
    return float(statistics.median(abs(v - mid) for v in values) / mid)


def stable(values: Sequence[float], k: int, within: float) -> bool:
    """Whether the last ``k`` values all lie within ``within`` (a fraction: 0.02 = 2 %) of their median:
    the rule ``stop_when_stable`` ends a trial by. Fewer than ``k`` values are never stable."""
    if k < 1 or len(values) < k:
        return False
    last = list(values[-k:])
    mid = statistics.median(last)
    return math.isfinite(mid) and mid > 0 and all(abs(v - mid) <= within * mid for v in last)


class Evaluator(abc.ABC):
    """Reads one trial's output, line by line as the command prints it, and returns its score.

    Life of an evaluator:

    1. **Construction.** Hydra instantiates it from the ``evaluator`` config group (``_target_`` +
       keyword arguments; ``${gbs}``-style interpolations give it the job's values). Bad settings
       (unknown selector, broken regex, gbs=0) raise ``ValueError`` here, before any trial is launched.
    2. **Study setup.** The sweeper reads :attr:`direction` to create the Optuna study and
       :attr:`metric_name` to label values in progress lines, tables and plots.
    3. **Each trial.** :meth:`begin` forgets the previous trial. While the command runs,
       :meth:`feed` gets every output line (stdout and stderr merged, no line terminator, at most
       64 kB of a line), on the runner's reader thread: it must be quick, keep only what it needs (the
       values, never the lines: the output may be gigabytes) and not raise — a value it cannot use
       is remembered and reported by :meth:`result`.
    4. **Score.** After the command exits with status 0 (output of failed commands is never
       scored), :meth:`result` returns the score: a finite number > 0. Otherwise it raises
       :class:`NoMetric` (nothing to read: kind ``no_metric``) or :class:`BadMetric` (a metric that
       is no score: nan, inf, 0 or below: kind ``bad_metric``), with a one-line reason that says how
       to get a usable metric. Subclasses implement :meth:`measure`; :meth:`result` checks it.
    5. **Spread.** :meth:`kept` returns the values after warm-up the score came from: their
       :func:`spread` is recorded with the trial, and ``stop_when_stable`` polls the last k of them
       while the command runs (an evaluator that keeps none is never stopped early).

    :meth:`evaluate` runs steps 3–4 over a whole output at once (tests, re-scoring a trial.log): the
    same output always gives the same score.
    """

    direction: Direction = "maximize"
    metric_name: str = "value"

    def begin(self) -> None:  # noqa: B027  (a hook: most evaluators keep nothing between trials)
        """Forget everything fed so far: a new trial starts."""

    @abc.abstractmethod
    def feed(self, line: str) -> None:
        """One line of the trial's output; remember what the score needs."""

    @abc.abstractmethod
    def measure(self) -> float:
        """The score from what was fed; raises NoMetric / BadMetric when there is none."""

    def kept(self, last: int | None = None) -> list[float]:
        """The values after warm-up the score is made of, as fed so far, or only the ``last`` of them
        (their :func:`spread` is recorded with the trial; ``stop_when_stable`` watches the last k while
        the command runs, from another thread). An evaluator that keeps no values returns [] (no spread,
        never stopped early)."""
        return []

    def result(self) -> float:
        """:meth:`measure`, refused unless it is a finite number > 0 (BadMetric)."""
        score = float(self.measure())
        if not math.isfinite(score) or score <= 0:
            raise BadMetric(f"{self.metric_name} score {score:g} is not a finite number > 0")
        return score

    def evaluate(self, output: str) -> float:
        """The score of a whole output (begin, feed every line, result)."""
        self.begin()
        for line in output.splitlines():
            self.feed(line)
        return self.result()

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({args})"


class _PatternEvaluator(Evaluator):
    """A regex finds every logged value, line by line; ``select`` reduces them. Shared by the built-in
    evaluators. Patterns match within one line."""

    _hint = ""  # appended to the NoMetric reason when nothing matches: how the user gets the metric printed
    _wanted = ""  # what a matching line looks like, for that reason; empty = show the regex
    _bad_hint = ""  # appended to the BadMetric reason: what else can score this run

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
        self.begin()

    def begin(self) -> None:  # noqa: B027  (a hook: most evaluators keep nothing between trials)
        self._values = array("d")  # 8 bytes a value: flat even for a million logged intervals
        self._lines = 0
        self._not_number: str | None = None
        self._cut: tuple[str, int] | None = None  # the first number with separators, and its line

    def feed(self, line: str) -> None:
        self._lines += 1
        for m in self._pattern.finditer(line):
            if self._whole(m, line, self._group):
                self._add(m, line)

    def _whole(self, m: re.Match[str], line: str, group: int | str) -> bool:
        """Whether the captured number is the whole token on the line; a number that goes on (a
        separator, a second decimal point) is remembered and refused as bad_metric by result()."""
        text, start, end = m.group(group), m.start(group), m.end(group)
        if text is None or end != m.end() or not _GOES_ON.match(line, end):
            return True
        if self._cut is None:
            token = _TOKEN.match(line, start)
            self._cut = ((token.group() if token else text).strip(), self._lines)
        return False

    def _add(self, m: re.Match[str], line: str) -> None:
        text = m.group(self._group)
        try:
            if "_" in (text or ""):  # float() reads 1_000 as 1000; the built-in patterns refuse it: so do we
                raise ValueError(text)
            self._values.append(float(text))
        except (TypeError, ValueError):
            if self._not_number is None:
                self._not_number = text
            if self._cut is None and text and re.fullmatch(r"[-+]?[\d.,'_ ]*\d[\d.,'_ ]*", text):
                self._cut = (text, self._lines)  # the user's group captured separators: no number either

    def values(self, output: str) -> list[float]:
        """Every value the pattern finds in a whole output, in order of appearance."""
        self.begin()
        for line in output.splitlines():
            self.feed(line)
        return list(self._values)

    def _no_values(self) -> NoMetric:
        if self._not_number is not None:
            return NoMetric(f"pattern {self._pattern.pattern!r} matched {self._not_number!r}, which is not a number")
        wanted = self._wanted or f"pattern {self._pattern.pattern!r} matched"
        return NoMetric(f"no {self.metric_name} in the output: {wanted} none of {self._lines} lines{self._hint}")

    def _kept(self, values: Sequence[float]) -> list[float]:
        """The values after warm-up; BadMetric when any of them is no measurement."""
        if self._cut is not None:
            token, line = self._cut
            raise BadMetric(f"{self.metric_name} printed as {token!r} (output line {line}) is not a plain number "
                            f"(a thousands separator or a second decimal point?): zenithtune reads the whole "
                            f"number or none of it; print plain numbers, e.g. 1234.5")
        if not values:
            raise self._no_values()
        if self.skip_first >= len(values):
            select(values, self.selector, self.skip_first, what=self.metric_name)  # raises its NoMetric
        kept = list(values[self.skip_first:])
        odd = [v for v in kept if not math.isfinite(v) or v <= 0]
        if odd:
            shown = ", ".join(sorted({f"{v:g}" for v in odd}))
            where = (f"all {len(kept)} logged values" if len(odd) == len(kept)
                     else f"{len(odd)} of {len(kept)} logged values")
            why = [text for test, text in (
                (any(not math.isfinite(v) for v in odd), "nan/inf: the run diverged or measured nothing"),
                (0.0 in odd, _BELOW_PRECISION),
                (any(v < 0 for v in odd), "below 0: no rate or time can be")) if test]
            raise BadMetric(f"{self.metric_name} was {shown} in {where} after warm-up ({'; '.join(why)})"
                            f"{self._bad_hint}")
        return kept

    def _series(self) -> Sequence[float]:
        """The values the score is selected from (SwiftSpeed: its per-interval speeds)."""
        return self._values

    def kept(self, last: int | None = None) -> list[float]:
        series = self._series()
        n = len(series)  # the reader thread may append meanwhile: slice up to what was there
        start = self.skip_first if last is None else max(self.skip_first, n - last)
        return list(series[start:n])

    def measure(self) -> float:
        return select(self._kept(self._values), self.selector, 0, what=self.metric_name)


class MegatronThroughput(_PatternEvaluator):
    """Megatron's ``throughput per GPU (TFLOP/s/GPU): X`` (model FLOPs per GPU per second), maximized.

    By default the median of the values after the first logged one (``skip_first=1``: it carries
    compilation, allocator growth and NCCL setup; a median over few values would still lean on it).
    A command that logs a single value needs ``skip_first=0``: it is refused, not quietly scored by its
    warm-up."""

    direction: Direction = "maximize"
    metric_name = "TFLOP/s/GPU"
    _hint = "; Megatron prints throughput only with --log-throughput: add it to the command"
    _wanted = "'throughput per GPU (TFLOP/s/GPU): X' in"
    _bad_hint = ("; use evaluator=iteration_time, which scores by 'elapsed time per iteration (ms)' "
                 "(always printed) instead")

    def __init__(self, selector: Selector = "median", skip_first: int = 1) -> None:
        super().__init__(rf"throughput per GPU \(TFLOP/s/GPU\):\s*({_NUMBER}|nan|inf|-inf)",
                         selector=selector, skip_first=skip_first)


class IterationTime(_PatternEvaluator):
    """Samples (or tokens) per second per GPU from Megatron's ``elapsed time per iteration (ms)``,
    maximized.

    Megatron prints the elapsed time on every log line whatever the flags, while its TFLOP/s/GPU
    needs ``--log-throughput`` and rounds to 0.0 on small models. A value is
    ``gbs / (ms / 1000) / n_gpus`` samples/s/GPU, times ``seq_length`` for tokens/s/GPU when that
    is given; the global batch size printed on the same line (``global batch size: N``) wins over
    ``gbs``, so a batch-size ramp-up is measured right. Within one study gbs, n_gpus and seq_length
    are fixed, so either unit ranks configurations exactly as the iteration time does; the unit
    only makes the numbers comparable across studies. ``skip_first`` drops warm-up log lines (the
    first carries compilation, allocator growth and NCCL setup).
    """

    direction: Direction = "maximize"
    _hint = "; Megatron prints it on every log line (every --log-interval iterations): is this Megatron's output?"
    _wanted = "'elapsed time per iteration (ms): X' in"
    _GBS = re.compile(r"global batch size:\s*(\d+)")

    def __init__(self, gbs: int, n_gpus: int, seq_length: int | None = None, selector: Selector = "harmonic",
                 skip_first: int = 1) -> None:
        for key, value in (("gbs", gbs), ("n_gpus", n_gpus), ("seq_length", seq_length)):
            if value is None and key == "seq_length":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"evaluator.{key}={value!r} must be a whole number > 0 "
                                 f"(iteration_time divides the batch by the time: set {key}=N)")
        super().__init__(rf"elapsed time per iteration \(ms\):\s*({_NUMBER}|nan|inf)",
                         selector=selector, skip_first=skip_first)
        self.gbs = gbs
        self.n_gpus = n_gpus
        self.seq_length = seq_length
        self.metric_name = "tokens/s/GPU" if seq_length else "samples/s/GPU"

    def _add(self, m: re.Match[str], line: str) -> None:
        batch = self._GBS.search(line)
        if batch is not None and not self._whole(batch, line, 1):
            return
        ms = float(m.group(1))
        samples = int(batch.group(1)) if batch else self.gbs
        # 0 ms is no measurement: it becomes inf and is reported as a bad metric
        rate = samples / (ms / 1000.0) / self.n_gpus if ms > 0 else (math.inf if ms == 0 else ms)
        self._values.append(rate * (self.seq_length or 1))


class SwiftSpeed(_PatternEvaluator):
    """ms-swift's ``train_speed(s/it)`` (Megatron mode) or ``train_speed(iter/s)`` (``swift sft``),
    as seconds per iteration, minimized (at a fixed global batch, fewer s/it is more throughput).

    ms-swift logs a *running* average since training started, so its last value still carries the
    warm-up. With ``per_interval`` (default) each logged value is turned back into the speed of its own
    logging interval — elapsed_k = speed_k · step_k, interval = Δelapsed / Δstep — using the step
    ms-swift logs next to it (``'iteration': '5/10'`` or ``'global_step/max_steps': '5/10'``). Then
    ``skip_first`` really drops warm-up and ``last`` is the steady-state speed. Without step fields the
    running averages are used as logged (with a warning). Fed line by line like the others: it keeps
    the running averages and the intervals, two numbers a logged step.
    """

    direction: Direction = "minimize"
    metric_name = "s/it"
    _hint = "; ms-swift logs train_speed with each training log line (every --logging_steps)"
    _wanted = "'train_speed(s/it)' or 'train_speed(iter/s)' in"
    _STEP = re.compile(r"""['"](?:iteration|global_step/max_steps)['"]\s*:\s*['"](\d+)/\d+['"]""")

    def __init__(self, selector: Selector = "last", skip_first: int = 0, per_interval: bool = True) -> None:
        super().__init__(rf"""['"]train_speed\((s/it|iter/s)\)['"]\s*:\s*['"]?({_NUMBER}|nan|inf)""",
                         selector=selector, skip_first=skip_first, group=2)
        self.per_interval = per_interval

    def begin(self) -> None:  # noqa: B027  (a hook: most evaluators keep nothing between trials)
        super().begin()
        self._intervals = array("d")
        self._stepless = False
        self._prev_step, self._prev_elapsed = 0, 0.0

    def feed(self, line: str) -> None:
        self._lines += 1
        m = self._pattern.search(line)
        if not m or not self._whole(m, line, 2):
            return
        speed = float(m.group(2))
        if speed <= 0 or not math.isfinite(speed):
            return  # 0.0 is logged before the first step completes: no measurement yet
        s_per_it = speed if m.group(1) == "s/it" else 1.0 / speed
        self._values.append(s_per_it)
        step_m = self._STEP.search(line)
        if step_m is None:
            self._stepless = True
            return
        step = int(step_m.group(1))
        if step <= self._prev_step:
            return  # a repeated line (e.g. printed by two ranks): no new interval
        elapsed = s_per_it * step
        self._intervals.append((elapsed - self._prev_elapsed) / (step - self._prev_step))
        self._prev_step, self._prev_elapsed = step, elapsed

    def _series(self) -> Sequence[float]:
        return self._intervals if self.per_interval and self._values and not self._stepless else self._values

    def measure(self) -> float:
        if self.per_interval and self._values and self._stepless:
            log.warning("SwiftSpeed: no step field next to train_speed; using ms-swift's running averages as logged")
        return select(self._kept(self._series()), self.selector, 0, what=self.metric_name)

    def values(self, output: str) -> list[float]:
        super().values(output)
        return list(self._intervals if self.per_interval and not self._stepless else self._values)


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
_SWIFT_MEMORY = re.compile(rf"""['"]memory\(GiB\)['"]\s*:\s*['"]?({_NUMBER})""")


class PeakMemory:
    """Peak GPU memory the run reported, in MB, fed line by line like an evaluator: the largest
    Megatron ``max allocated`` (from ``[Rank r] (after n iterations) memory (MB) | ...``, over all
    ranks and lines) or ms-swift ``memory(GiB)`` × 1024. Megatron prints it once, after the first
    iteration, so it must be caught as it goes by."""

    def __init__(self) -> None:
        self.peak: float | None = None

    def feed(self, line: str) -> None:
        if "memory" not in line:  # the common case, cheaply
            return
        found = [float(v) for v in _MEGATRON_MEMORY.findall(line)]
        found += [float(v) * 1024 for v in _SWIFT_MEMORY.findall(line)]
        if found:
            self.peak = max([*found, *([self.peak] if self.peak is not None else [])])

    def result(self) -> float | None:
        return self.peak


def peak_memory_mb(output: str) -> float | None:
    """:class:`PeakMemory` over a whole output; None when the output reports neither."""
    mem = PeakMemory()
    for line in output.splitlines():
        mem.feed(line)
    return mem.result()


_ITERATION = re.compile(r"\biteration\s+(\d+)\s*/\s*(\d+)\s*\|")
_ITERATION_MS = re.compile(rf"elapsed time per iteration \(ms\):\s*({_NUMBER})")


class TrainingClock:
    """How far a Megatron run got and how long its iterations take, fed line by line like an evaluator:
    the last ``iteration N/ M`` and every ``elapsed time per iteration (ms)``. A run stopped early
    would still have run (M - N) x the median iteration time (:meth:`left_s`)."""

    def __init__(self) -> None:
        self.done: int | None = None
        self.total: int | None = None
        self._ms = array("d")

    def feed(self, line: str) -> None:
        if "iteration" not in line:  # the common case, cheaply
            return
        it = _ITERATION.search(line)
        if it is not None:
            self.done, self.total = int(it.group(1)), int(it.group(2))
        ms = _ITERATION_MS.search(line)
        if ms is not None:
            self._ms.append(float(ms.group(1)))

    def left_s(self) -> float | None:
        """Seconds the iterations not run yet would take; None when the output said too little."""
        ms = [v for v in self._ms if math.isfinite(v) and v > 0]
        if self.done is None or self.total is None or not ms:
            return None
        return max(0, self.total - self.done) * statistics.median(ms) / 1000.0


# --- memory evidence for the memory model (zenithtune.memory.MemoryModel) ---------------------------
_MEGATRON_RESERVED = re.compile(rf"memory \(MB\).*?\|\s*max reserved:\s*({_NUMBER})")
# PyTorch's OOM message, and where it goes on "Of the allocated memory Y GiB is allocated by PyTorch, and Z MiB
# is reserved by PyTorch but unallocated", those two: what the process had in use beyond Y + Z lay outside
# PyTorch's allocator
_OOM = re.compile(rf"Tried to allocate ({_NUMBER}) ([GM]i?B).*?this process has ({_NUMBER}) ([GM]i?B) memory in use"
                  rf"(?:\.\s*Of the allocated memory ({_NUMBER}) ([GM]i?B) is allocated by PyTorch, and ({_NUMBER}) "
                  rf"([GM]i?B) is reserved by PyTorch but unallocated)?", re.DOTALL)


def _gib(value: str, unit: str) -> float:
    return float(value) / (1024 if unit.startswith("M") else 1)


def memory_evidence(output: str) -> dict[str, float]:
    """What a run's log says about memory, in GB (GiB), for the memory model to learn from:

    * ``allocated_gb``: the largest Megatron ``max allocated`` (or ms-swift ``memory(GiB)``);
    * ``reserved_gb``: the largest ``max reserved`` (the caching allocator's footprint);
    * ``needed_gb``: from PyTorch's OOM message, memory in use when it failed plus the allocation
      that failed ("Tried to allocate X GiB ... this process has Y GiB memory in use"): the run
      needed at least that much;
    * ``outside_gb``: from the same message, what the process had in use outside PyTorch's allocator
      (CUDA context, NCCL buffers, TE userbuffers): in use minus "allocated by PyTorch" minus "reserved
      by PyTorch but unallocated". No run that fits prints it.

    Keys are absent when the log does not say (an empty dict for a log without memory lines)."""
    out: dict[str, float] = {}
    peak = peak_memory_mb(output)
    if peak is not None:
        out["allocated_gb"] = peak / 1024
    reserved = [float(v) for v in _MEGATRON_RESERVED.findall(output)]
    if reserved:
        out["reserved_gb"] = max(reserved) / 1024
    needs, outside = [], []
    for tried, tried_unit, in_use, use_unit, alloc, alloc_unit, free, free_unit in _OOM.findall(output):
        needs.append(_gib(tried, tried_unit) + _gib(in_use, use_unit))
        if alloc:
            outside.append(_gib(in_use, use_unit) - _gib(alloc, alloc_unit) - _gib(free, free_unit))
    if needs:
        out["needed_gb"] = max(needs)
    if any(gb >= 0 for gb in outside):
        out["outside_gb"] = max(outside)
    return out
