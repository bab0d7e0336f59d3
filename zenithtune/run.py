"""Run one trial's command: every process it starts, a capped live log, timeout, what went wrong.

A trial is a distributed job (torchrun and its workers, or ms-swift's launcher and its workers).
Everything it starts must be gone before the next trial starts, or the leftovers hold GPU memory
and the next trial OOMs for reasons that have nothing to do with its configuration. So the command
runs in its own session, carries a marker in its environment (:mod:`zenithtune.processes`), and
every exit path — normal exit, timeout, Ctrl-C, a failed log write — ends with all of its processes
gone, including those that left the group (setsid, double fork): SIGTERM, ``grace`` seconds to
clean up, then SIGKILL.

The output (stdout and stderr merged, as a user sees them in a terminal) is read in chunks and
split into lines (``\\n``, ``\\r\\n`` or a lone ``\\r`` as progress bars print), each line cut at
:data:`LINE_MAX` bytes. Each line goes to:

* the trial's log file, flushed as it comes so it can be tailed, capped at ``log_max_mb``: the
  first and last halves are kept with a marker line saying how much was cut between them;
* ``on_line`` (the evaluator, fed as the run goes, so a metric anywhere in the output counts);
* ``echo`` (live display);
* memory: only the last :data:`OUTPUT_CAP` characters, for :func:`classify` and the error tail.

Memory stays flat whatever the command prints. A log that cannot be written (full disk) stops the
trial with kind ``log_write`` instead of blocking the command on a pipe nobody drains.
"""
from __future__ import annotations

import collections
import datetime as _dt
import errno
import os
import re
import shlex
import shutil
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import IO

from zenithtune.command import env_prefix
from zenithtune.processes import MARKER_ENV, TrialProcess, kill_tree, members

__all__ = ["FailureKind", "RunResult", "run", "classify", "command_problem", "OUTPUT_CAP", "LINE_MAX",
           "LOG_MAX_MB"]

OUTPUT_CAP = 512 * 1024
"""Characters of output kept in memory (the tail), for the failure reason; the evaluator sees every line."""

LINE_MAX = 64 * 1024
"""Bytes of one line kept; the rest of a longer line is skipped (counted in the log), all but its
last :data:`LINE_TAIL` bytes, which follow as a line of their own: a trainer that appends its metric
to a long line (a progress bar without newlines, a dump) still has it read."""

LINE_TAIL = 16 * 1024

LOG_MAX_MB = 50.0
"""Default cap on trial.log (MB): the first and the last half are kept."""

_CHUNK = 64 * 1024
_REASON_MAX = 300  # a reason is one line in a table; the log has the rest


class FailureKind(str, Enum):
    """Why a trial produced no score. Strings so they store as-is in study user_attrs."""

    OOM = "oom"
    TIMEOUT = "timeout"
    CRASH = "crash"
    NO_METRIC = "no_metric"  # decided by the evaluator: exit 0 but nothing to read
    BAD_METRIC = "bad_metric"  # decided by the evaluator: a metric, but not a finite positive score (0, nan, inf)
    INVALID_ARGS = "invalid_args"
    INTERRUPTED = "interrupted"
    CANCELLED = "cancelled"  # its Slurm job was cancelled under it (scancel): measured nothing, retried once
    LOG_WRITE = "log_write"  # trial.log could not be written (full disk, read-only folder): stopped, not hung


@dataclass
class RunResult:
    """What one run of a command left behind."""

    argv: list[str]
    returncode: int | None  # None: the command never started (see output for why); <0: killed by signal
    output: str  # merged stdout+stderr, at most OUTPUT_CAP characters (the tail)
    duration: float  # seconds, start to every process gone
    timed_out: bool
    interrupted: bool  # Ctrl-C arrived while it ran; the caller decides whether to stop the study
    log_path: Path | None
    process: TrialProcess | None = None  # what finds its processes again (store it with the trial)
    log_error: str | None = None  # why trial.log could not be written; the run was stopped
    oom_line: str | None = None  # the first out-of-memory line anywhere in the output (the tail may not have it)
    feed_error: str | None = None  # on_line raised: the evaluator saw only part of the output
    lines: int = 0  # lines read
    stopped_early: str | None = None  # why ``enough`` ended it (its metric was stable): a success, not a timeout

    @property
    def succeeded(self) -> bool:
        return ((self.returncode == 0 or self.stopped_early is not None) and not self.timed_out
                and not self.interrupted and self.log_error is None)


# ---------------------------------------------------------------------------------------------
# the log file


def _open_log(path: Path) -> IO[bytes]:
    return open(path, "wb")


class _CappedLog:
    """trial.log, at most ``max_bytes``: the head is written in place; past half the cap, output
    goes to two rotating ``.tail`` segment files next to it, and at close the marker line and the
    last segments are appended. Disk use never exceeds the cap (plus one line), memory holds none
    of it. Any OSError propagates: the caller stops the run."""

    def __init__(self, path: Path, max_bytes: int | None) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.file = _open_log(path)
        self.head_left = max_bytes // 2 if max_bytes else None
        self.segment_max = (max_bytes - max_bytes // 2) // 2 if max_bytes else 0
        self.segments: list[Path] = []
        self.segment: IO[bytes] | None = None
        self.segment_size = 0
        self.cut = 0
        self.rotations = 0

    def write(self, data: bytes) -> None:
        if self.head_left is None or (self.segment is None and len(data) <= self.head_left):
            self.file.write(data)
            if self.head_left is not None:
                self.head_left -= len(data)
            return
        if self.segment is None or self.segment_size >= self.segment_max:
            self.segment = self._rotate()
        self.segment.write(data)
        self.segment_size += len(data)

    def _rotate(self) -> IO[bytes]:
        if self.segment is None:
            self.file.write(f"# zenithtune: trial.log reached half of log_max_mb={(self.max_bytes or 0) / 1e6:g}; "
                            f"the rest goes to {self.path.name}.tail* and its end is appended here when "
                            f"the run ends\n".encode())
            self.file.flush()
        else:
            self.segment.close()
        if len(self.segments) == 2:
            old = self.segments.pop(0)
            self.cut += old.stat().st_size
            old.unlink()
        self.rotations += 1
        seg = self.path.with_name(f"{self.path.name}.tail{self.rotations % 2}")
        self.segments.append(seg)
        self.segment_size = 0
        return _open_log(seg)

    def flush(self) -> None:
        self.file.flush()
        if self.segment is not None:
            self.segment.flush()

    def close(self) -> None:
        """Put the tail back into trial.log, with the marker saying how much was cut."""
        try:
            if self.segment is not None:
                self.segment.close()
                if self.cut:
                    self.file.write(f"# zenithtune: {self.cut} bytes of output cut here "
                                    f"(log_max_mb={(self.max_bytes or 0) / 1e6:g} keeps the first and the last part)\n"
                                    .encode())
                for seg in self.segments:
                    with open(seg, "rb") as src:
                        shutil.copyfileobj(src, self.file)
            self.file.close()
        finally:
            self.discard()

    def discard(self) -> None:
        for seg in self.segments:
            try:
                seg.unlink()
            except OSError:
                pass
        self.segments = []
        for f in (self.file, self.segment):
            if f is not None and not f.closed:
                try:
                    f.close()
                except OSError:  # flushing a full disk fails again: nothing more to save
                    pass


# ---------------------------------------------------------------------------------------------
# output handling


class _Sink:
    """Where output lines go: log file, on_line, echo, bounded in-memory tail. Shared with the reader
    thread; nothing here may raise into it (a dead reader leaves the command blocked on a full pipe)."""

    def __init__(self, log: _CappedLog | None, echo: Callable[[str], None] | None,
                 on_line: Callable[[str], None] | None) -> None:
        self.log = log
        self.echo = echo
        self.on_line = on_line
        self.lock = threading.Lock()
        self.tail: collections.deque[str] = collections.deque()
        self.size = 0
        self.dropped = 0
        self.lines = 0
        self.log_error: str | None = None
        self.feed_error: str | None = None
        self.oom_line: str | None = None
        self.failed = threading.Event()  # set when the log cannot be written: the run must stop
        self.closed = False

    def _log_write(self, data: bytes, flush: bool) -> None:
        if self.log is None or self.log_error is not None or self.closed:
            return
        try:
            self.log.write(data)
            if flush:
                self.log.flush()
        except OSError as exc:
            self.log_error = f"cannot write {self.log.path}: {exc.strerror or exc}" + (
                "; free disk space or lower log_max_mb" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else "")
            self.log.discard()
            self.failed.set()

    def line(self, raw: bytes) -> None:
        """One line of the command's output, with its terminator."""
        self.batch([raw])

    def batch(self, raws: list[bytes]) -> None:
        """Lines read together (one pipe read): one log write, one OOM search, one lock for them all."""
        if not raws:
            return
        texts = [raw.decode("utf-8", errors="replace").rstrip("\r\n") for raw in raws]
        joined = "\n".join(texts) + "\n"
        with self.lock:
            self._log_write(b"".join(raws), True)
            self.lines += len(raws)
            self.tail.append(joined)
            self.size += len(joined)
            while self.size > OUTPUT_CAP and len(self.tail) > 1:
                self.size -= len(self.tail[0])
                self.dropped += len(self.tail.popleft())
            if self.size > OUTPUT_CAP:  # one read alone is over the cap: keep its last whole lines
                first = self.tail[0]
                cut = first.find("\n", self.size - OUTPUT_CAP - 1) + 1 or len(first)
                self.tail[0] = first[cut:]
                self.size -= cut
                self.dropped += cut
            if self.oom_line is None:
                m = _OOM.search(joined)
                if m:
                    self.oom_line = _short(joined[joined.rfind("\n", 0, m.start()) + 1:joined.find("\n", m.end())])
        if self.on_line is not None:
            done = self.lines - len(raws)
            try:
                for text in texts:
                    done += 1
                    self.on_line(text)
            except Exception as exc:  # a broken evaluator must not stop the pipe from draining
                self.on_line = None
                self.feed_error = f"the evaluator failed on output line {done}: {exc!r}"
                self.note(f"# zenithtune: {self.feed_error}; not evaluating the rest")
        if self.echo is not None:
            try:
                for raw, text in zip(raws, texts):
                    if not raw.endswith(b"\r"):  # \r: a progress-bar frame, for the log only
                        self.echo(text)
            except Exception as exc:  # a broken display must not stop the pipe from draining
                self.echo = None
                self.note(f"# zenithtune: echo failed ({exc!r}); live output off for this run")

    def note(self, text: str) -> None:
        """A zenithtune line in the log (header/footer); not part of the command's output."""
        with self.lock:
            self._log_write(text.encode("utf-8", errors="replace") + b"\n", True)

    def output(self) -> str:
        with self.lock:
            head = (f"[zenithtune: first {self.dropped} characters of output dropped from memory; "
                    f"the log file has them]\n" if self.dropped else "")
            return head + "".join(self.tail)


def _pump(fd: int, sink: _Sink) -> None:
    """Read the pipe to its end, in chunks, whatever happens downstream. Lines end at \\n, \\r\\n or
    a lone \\r; a line longer than LINE_MAX is cut there and the rest of it skipped."""
    buf = b""
    skipping = 0  # bytes of an over-long line past its kept head so far
    tail = b""  # the last LINE_TAIL bytes of that line so far (they may overlap the head)

    def long_line_ends(rest: bytes) -> None:
        kept = (tail + rest)[-LINE_TAIL:]
        skipped = max(0, skipping + len(rest) - len(kept))
        sink.note(f"# zenithtune: {skipped} more bytes of that line skipped; its last {len(kept)} bytes follow")
        sink.line(kept)

    try:
        while True:
            try:
                chunk = os.read(fd, _CHUNK)
            except InterruptedError:
                continue
            except OSError:
                chunk = b""
            buf += chunk
            batch: list[bytes] = []
            start = 0
            while True:
                nl = buf.find(b"\n", start)
                cr = buf.find(b"\r", start, nl if nl >= 0 else len(buf))
                if cr >= 0 and (cr + 1 < len(buf) or not chunk):  # a \r followed by \n is one \r\n
                    end = cr + 2 if buf[cr + 1:cr + 2] == b"\n" else cr + 1
                elif nl >= 0 and cr < 0:
                    end = nl + 1
                else:
                    break
                if skipping:
                    sink.batch(batch)
                    batch = []
                    long_line_ends(buf[start:end])
                    skipping, tail = 0, b""
                else:
                    batch.append(buf[start:end])
                start = end
            buf = buf[start:]
            if skipping:
                skipping += len(buf)
                tail = (tail + buf)[-LINE_TAIL:]
                buf = b""
            elif len(buf) > LINE_MAX:
                batch.append(buf[:LINE_MAX] + b"\n")
                skipping = len(buf) - LINE_MAX
                tail = buf[-LINE_TAIL:]
                buf = b""
            if not chunk and buf:
                batch.append(buf)
            sink.batch(batch)
            if not chunk:
                if skipping:
                    long_line_ends(b"")
                break
    finally:
        os.close(fd)


def _added_env(env: dict[str, str] | None) -> dict[str, str]:
    return {k: v for k, v in (env or {}).items() if os.environ.get(k) != v}


def run(argv: list[str], *, log_path: Path | None, timeout: float | None,
        env: dict[str, str] | None = None, cwd: str | os.PathLike[str] | None = None,
        echo: Callable[[str], None] | None = None, grace: float = 5.0,
        on_line: Callable[[str], None] | None = None, log_max_mb: float | None = LOG_MAX_MB,
        trial_id: str | None = None, on_start: Callable[[TrialProcess], None] | None = None,
        stop: Callable[[], bool] | None = None, enough: Callable[[], str | None] | None = None) -> RunResult:
    """Run ``argv`` (no shell) to completion, timeout or Ctrl-C; never leaves a process behind.

    ``env`` is merged over ``os.environ``; PYTHONUNBUFFERED=1 is added unless set, so Python trainers
    stream their lines as they happen instead of in 8 kB blocks (it shows in the log header), and
    ``ZENITHTUNE_TRIAL=<trial_id>`` (a fresh id when None) marks every process of the trial.
    ``timeout`` (seconds, None = none) kills them all. Ctrl-C kills them the same way and returns
    ``interrupted=True`` instead of raising: the caller decides whether the study stops.
    ``on_line`` gets every output line (no terminator) as it comes, on the reader thread.
    ``on_start`` gets the :class:`TrialProcess` record right after the start: store it, so that a
    resumed study can kill what this run leaves behind if the tuner itself is killed.
    ``log_max_mb`` caps ``log_path`` (None = no cap).
    ``stop`` is polled while the command runs: True kills it the same way (``interrupted=True``); a
    caller that holds a stop signal instead of raising it (:func:`zenithtune.signals.deferred`) passes
    :func:`zenithtune.signals.pending`, so a signal landing after the command exited leaves its result whole.
    ``enough`` is polled the same way: a reason (``stop_when_stable``: the metric is stable) ends the
    command as a timeout does (SIGTERM, ``grace``, SIGKILL) and the run counts as a success, with
    ``stopped_early`` set to that reason.
    """
    _check_limits(timeout, log_max_mb)
    marker = trial_id or uuid.uuid4().hex
    # `NPROC_PER_NODE=8 megatron sft ...`: the leading assignments are the command's environment, as a
    # shell would make them (they win over zenithtune's own additions: the command is the user's)
    assigned, program = env_prefix(argv)
    extra, added = _trial_env({**(env or {}), **assigned}, marker)
    start = time.monotonic()
    log, log_error = _open_log_file(log_path, log_max_mb)
    log_path = log.path if log is not None else (Path(log_path) if log_path is not None else None)
    sink = _Sink(log, echo, on_line)
    _header(sink, argv, added, cwd, marker)
    log_error = log_error or sink.log_error
    if log_error:  # no log, no trial: a run nobody can read back is wasted GPU time
        sink.line(f"zenithtune: not started: {log_error}\n".encode())
        return RunResult(list(argv), None, sink.output(), time.monotonic() - start, False, False, log_path,
                         log_error=log_error)
    try:
        if not program:
            raise FileNotFoundError("no program to run")
        proc = subprocess.Popen(program, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env={**os.environ, **extra}, cwd=cwd,
                                start_new_session=True)
    except OSError as exc:
        sink.line(f"zenithtune: cannot start {program[0] if program else '(empty command)'}: {exc}\n".encode())
        sink.note("# result: never started")
        if log:
            log.close()
        return RunResult(list(argv), None, sink.output(), time.monotonic() - start, False, False, log_path)

    process = TrialProcess.started(marker, proc.pid)
    reader = _start_reader(proc, sink)
    ended = _supervise(proc, reader, sink, process, deadline=None if timeout is None else start + timeout,
                       timeout=timeout, grace=grace, stop=stop, on_start=on_start, enough=enough)
    timed_out, interrupted = ended == "timeout", ended == "interrupted"
    early = ended if ended not in (None, "timeout", "interrupted") else None
    duration = time.monotonic() - start
    _footer(sink, log, ended, proc.returncode, duration)
    return RunResult(list(argv), proc.returncode, sink.output(), duration, timed_out, interrupted, log_path,
                     process=process, log_error=sink.log_error, oom_line=sink.oom_line,
                     feed_error=sink.feed_error, lines=sink.lines, stopped_early=early)


def _check_limits(timeout: float | None, log_max_mb: float | None) -> None:
    if timeout is not None and timeout <= 0:
        raise ValueError(f"timeout={timeout} must be a positive number of seconds, or None for no limit")
    if log_max_mb is not None and (isinstance(log_max_mb, bool) or not isinstance(log_max_mb, (int, float))
                                   or not log_max_mb > 0):
        raise ValueError(f"log_max_mb={log_max_mb!r} must be a positive number of MB, or null for no cap")


def _trial_env(env: dict[str, str] | None, marker: str) -> tuple[dict[str, str], dict[str, str]]:
    """What the command's environment adds to ours (with the trial's marker), and what of it differs
    from ours (for the log header: the marker has its own line)."""
    extra = dict(env or {})
    if "PYTHONUNBUFFERED" not in os.environ and "PYTHONUNBUFFERED" not in extra:
        extra["PYTHONUNBUFFERED"] = "1"
    added = _added_env(extra)
    extra[MARKER_ENV] = marker
    return extra, added


def _open_log_file(log_path: Path | None, log_max_mb: float | None) -> tuple[_CappedLog | None, str | None]:
    """trial.log, opened (its folder made); or why it cannot be."""
    if log_path is None:
        return None, None
    log_path = Path(log_path)
    try:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        return _CappedLog(log_path, int(log_max_mb * 1e6) if log_max_mb else None), None
    except OSError as exc:
        return None, f"cannot create {log_path}: {exc.strerror or exc}"


def _header(sink: _Sink, argv: list[str], added: dict[str, str], cwd: str | os.PathLike[str] | None,
            marker: str) -> None:
    """The log's head: what ran, where, with what, when, and the marker that finds its processes."""
    sink.note(f"# command: {shlex.join(argv)}")
    sink.note("# env added: " + (" ".join(f"{k}={shlex.quote(v)}" for k, v in added.items()) or "(none)"))
    sink.note(f"# cwd: {Path(cwd or os.getcwd()).resolve()}")
    sink.note(f"# started: {_dt.datetime.now().isoformat(timespec='seconds')}")
    sink.note(f"# {MARKER_ENV}={marker}")
    sink.note("# " + "-" * 70)


def _start_reader(proc: subprocess.Popen[bytes], sink: _Sink) -> threading.Thread:
    """The thread that drains the command's output into the sink until the pipe closes."""
    assert proc.stdout is not None  # stdout=PIPE
    fd = os.dup(proc.stdout.fileno())  # the reader owns its descriptor; the Popen object keeps its own
    proc.stdout.close()
    reader = threading.Thread(target=_pump, args=(fd, sink), daemon=True, name="zenithtune-output")
    reader.start()
    return reader


def _supervise(proc: subprocess.Popen[bytes], reader: threading.Thread, sink: _Sink, process: TrialProcess, *,
               deadline: float | None, timeout: float | None, grace: float, stop: Callable[[], bool] | None,
               on_start: Callable[[TrialProcess], None] | None,
               enough: Callable[[], str | None] | None = None) -> str | None:
    """Hand ``on_start`` the trial's processes, wait for the command's exit, its deadline, a stop,
    ``enough`` or a failed log write; then make sure every process of the trial is gone and the output
    read. Returns how it ended when zenithtune ended it: "timeout", "interrupted", or ``enough``'s
    reason; None when the command exited (or the log failed)."""
    ended: str | None = None
    marker = process.marker
    try:
        try:
            if on_start is not None:
                try:
                    on_start(process)
                except Exception as exc:  # not being able to record it is no reason to lose the trial
                    sink.note(f"# zenithtune: could not record the trial's processes ({exc!r})")
            ended = _wait(proc, sink, deadline, timeout, grace, stop, enough)
        except KeyboardInterrupt:
            ended = "interrupted"
            sink.note("# zenithtune: interrupted (Ctrl-C): killing every process of the trial")
        if proc.returncode is not None and not sink.failed.is_set():
            reader.join(timeout=0.5)  # let the last lines arrive before looking for leftovers
            if any(s not in "ZX" for p, s in members(marker, proc.pid).items() if p != proc.pid):
                sink.note("# zenithtune: the command exited but left processes behind; killing them")
        kill_tree(marker, proc.pid, grace, poll=proc.poll)  # after a normal exit this only reaps leftovers
    except KeyboardInterrupt:  # Ctrl-C while killing: finish the kill, then report
        ended = "interrupted"
        kill_tree(marker, proc.pid, 0.0, poll=proc.poll)
    proc.wait()
    reader.join(timeout=max(grace, 1.0))
    if reader.is_alive():
        sink.note("# zenithtune: output pipe still held by a process that is not the trial's; not waiting for it")
    return ended


def _wait(proc: subprocess.Popen[bytes], sink: _Sink, deadline: float | None, timeout: float | None, grace: float,
          stop: Callable[[], bool] | None, enough: Callable[[], str | None] | None = None) -> str | None:
    """Until the command exits, the log fails, ``stop`` says so (KeyboardInterrupt), ``enough`` gives a
    reason (returned) or the deadline passes (returns "timeout")."""
    while proc.poll() is None:
        if sink.failed.is_set():
            sink.note("# zenithtune: stopping the command: the log cannot be written")
            return None
        if stop is not None and stop():
            raise KeyboardInterrupt
        reason = enough() if enough is not None else None
        if reason:
            sink.note(f"# zenithtune: {reason}: SIGTERM to every process of the trial, SIGKILL after {grace:g} s")
            return reason
        if deadline is not None and time.monotonic() >= deadline:
            sink.note(f"# zenithtune: no exit after {timeout:g} s: SIGTERM to every process of the "
                      f"trial, SIGKILL after {grace:g} s")
            return "timeout"
        sink.failed.wait(0.05)
    return None


def _footer(sink: _Sink, log: _CappedLog | None, ended: str | None, code: int | None, duration: float) -> None:
    """The log's last lines (how the run ended), then the log closed with its tail put back."""
    status = (f"timed out after {duration:.1f} s" if ended == "timeout" else
              "interrupted" if ended == "interrupted" else
              f"stopped: {sink.log_error}" if sink.log_error else
              f"stopped early after {duration:.1f} s ({ended})" if ended else f"exit code {code} after {duration:.1f} s")
    sink.note("# " + "-" * 70)
    sink.note(f"# result: {status}")
    with sink.lock:
        sink.closed = True
        if log and sink.log_error is None:
            try:
                log.close()
            except OSError as exc:
                sink.log_error = f"cannot write {log.path}: {exc.strerror or exc}"


# ---------------------------------------------------------------------------------------------
# classification

_OOM = re.compile(r"CUDA out of memory|OutOfMemoryError|CUDA error: out of memory|"
                  r"CUBLAS_STATUS_ALLOC_FAILED|HIP out of memory")
_ARGPARSE = re.compile(r"error: (unrecognized arguments|argument |the following arguments are required|"
                       r"ambiguous option|invalid choice)")
_DIVISIBLE = re.compile(r"(is not|must be|should be) divisible by")
_VALIDATE_CONTEXT = re.compile(r"validate_args|arguments\.py")
_EXCEPTION = re.compile(r"\b\w*(Error|Exception)\b(:|\s*$)|Segmentation fault|core dumped|"
                        r"\bFATAL\b|\bfatal:|\berror:", re.IGNORECASE)
# Launcher wrappers repeat a failure with less information than the worker's own message.
_NOISE = re.compile(r"ChildFailedError|torch\.distributed\.elastic|To enable traceback see|"
                    r"^\W*$|^Traceback \(most recent call last\)|^\s*(error_file|traceback)\s*:|"
                    r"^(\[\w+\]:\s*)?Traceback \(most recent call last\)")
# A rank's echo of another rank's failure: its peer vanished, so its collective broke. Never the cause.
_ECHO = re.compile(r"Connection closed by peer|Connection reset by peer|Broken pipe|remote process exited|"
                   r"NCCL communicator was aborted|ProcessGroupNCCL.*(aborted|Watchdog caught)|"
                   r"Socket Timeout|Timed out waiting .* for (the )?(store|peer)", re.IGNORECASE)
# The worker-line prefix of a rank: "[rank0]: " (PyTorch >= 2.2) or torchrun --tee's "[default0]:".
_RANK = re.compile(r"^\s*\[(?:rank|default)(\d+)\]:")
# torchrun's summary names the first rank to fail: "Root Cause (first observed failure):" ... "rank : 0".
_ROOT_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)")


def _short(line: str) -> str:
    line = " ".join(line.split())
    return line if len(line) <= _REASON_MAX else line[:_REASON_MAX - 1] + "…"


def _oom_reason(lines: list[str]) -> str | None:
    """The first OOM line: with several ranks, the first to run out is the cause."""
    return next((_short(ln) for ln in lines if _OOM.search(ln)), None)


def _invalid_args_reason(lines: list[str]) -> str | None:
    """argparse's own error, else Megatron's validate_args assertion, else a divisibility message."""
    for ln in lines:
        if _ARGPARSE.search(ln):
            return _short(ln)
    for k, ln in enumerate(lines):
        if "AssertionError" in ln and any(_VALIDATE_CONTEXT.search(c) for c in lines[max(0, k - 40):k]):
            if ln.strip().endswith("AssertionError"):  # bare assert: the source line says what failed
                src = next((c for c in reversed(lines[max(0, k - 5):k]) if c.strip().startswith("assert")), None)
                if src:
                    return _short(f"{ln.strip()}: {src.strip()}")
            return _short(ln)
    return next((_short(ln) for ln in lines if _DIVISIBLE.search(ln)), None)


def _root_rank(lines: list[str]) -> int | None:
    """The rank torchrun's ChildFailedError summary names as the root cause (first observed failure)."""
    for k, ln in enumerate(lines):
        if "Root Cause (first observed failure)" in ln:
            for nxt in lines[k + 1:k + 8]:
                m = _ROOT_RANK.match(nxt)
                if m:
                    return int(m.group(1))
    return None


def _rank_of(line: str) -> int | None:
    m = _RANK.match(line)
    return int(m.group(1)) if m else None


def _last_meaningful(lines: list[str]) -> str | None:
    """The error line that says why: in a multi-rank job, the root-cause rank's last error (torchrun's
    summary names it), else the last error that is no echo of another rank's failure."""
    errors = [ln for ln in lines if _EXCEPTION.search(ln) and not _NOISE.search(ln)]
    if errors:
        root = _root_rank(lines)
        own = [ln for ln in errors if root is not None and _rank_of(ln) == root]
        causes = own or [ln for ln in errors if not _ECHO.search(ln)] or errors
        return _short(causes[-1])
    rest = [ln for ln in lines if ln.strip() and not _NOISE.search(ln) and not ln.startswith("# ")]
    return _short(rest[-1]) if rest else None


def _exit_text(code: int | None) -> str:
    if code is None:
        return "never started"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        hint = " (host out of memory? the kernel's OOM killer sends SIGKILL)" if -code == signal.SIGKILL else ""
        return f"killed by {name}{hint}"
    return f"exit code {code}"


TRAINING_DONE = "[after training is done]"  # Megatron's pretrain() prints it once its training loop returned


def late_failure(result: RunResult) -> str | None:
    """Why a run failed only after Megatron's training loop had finished (it printed TRAINING_DONE): a
    crash or a hang in the teardown (gloo / NCCL process groups destroyed at exit: "terminate called
    without an active exception" on real Megatron-LM, benchmarks/results/real_megatron.md) or in a final
    save. Every iteration was measured, so the trial keeps its score and carries this line as a note;
    None when the run succeeded or failed before the loop ended. An out-of-memory message anywhere still
    fails the run (`classify`): a configuration whose final evaluation runs out of memory is no answer."""
    if result.succeeded or result.interrupted or result.log_error is not None or result.returncode is None:
        return None
    lines = result.output.splitlines()
    done = next((k for k, ln in enumerate(lines) if ln.startswith(TRAINING_DONE)), None)
    if done is None:
        return None
    if result.timed_out:
        return f"timed out after {result.duration:.0f} s, after Megatron's {TRAINING_DONE}: the training loop had finished"
    last = _last_meaningful(lines[done + 1:])
    return _short(f"{_exit_text(result.returncode)} after Megatron's {TRAINING_DONE}"
                  + (f": {last}" if last else "") + "; the training loop had finished")


def classify(result: RunResult) -> tuple[FailureKind, str] | None:
    """None when the run succeeded (exit 0, not timed out, not interrupted, log written, no
    out-of-memory message; or it failed only after its training loop finished, `late_failure`); else the
    failure kind and one line saying why. OOM wins over everything
    the command did: after one rank runs out of memory the others fail with NCCL or timeout errors
    that only hide the cause, and a trainer that catches the OOM and exits 0 still measured nothing
    worth keeping."""
    if result.interrupted:
        return FailureKind.INTERRUPTED, "interrupted (Ctrl-C); process group killed"
    if result.log_error:
        return FailureKind.LOG_WRITE, _short(f"stopped: {result.log_error}")
    lines = result.output.splitlines()
    oom = result.oom_line or _oom_reason(lines)
    if oom:
        if result.returncode == 0 and not result.timed_out:
            return FailureKind.OOM, _short(f"exit code 0, but the output says: {oom}")
        return FailureKind.OOM, oom
    if result.succeeded or late_failure(result):
        if result.feed_error:
            return FailureKind.NO_METRIC, _short(result.feed_error)
        return None
    if result.timed_out:
        last = _last_meaningful(lines)
        tail = f"; last output: {last}" if last else "; no output"
        return FailureKind.TIMEOUT, _short(f"timed out after {result.duration:.0f} s{tail}")
    invalid = _invalid_args_reason(lines)
    if invalid:
        return FailureKind.INVALID_ARGS, invalid
    last = _last_meaningful(lines)
    return FailureKind.CRASH, _short(f"{_exit_text(result.returncode)}: {last}" if last
                                     else f"{_exit_text(result.returncode)} with no output")


# ---------------------------------------------------------------------------------------------
# before a study


def command_problem(argv: list[str], *, cwd: str | os.PathLike[str] | None = None,
                    env: dict[str, str] | None = None) -> str | None:
    """Why ``argv`` cannot start at all (checked once, before the first trial), with the fix; None if
    it can. Without this every trial of a study would fail the same way."""
    assigned, argv = env_prefix(argv)
    if not argv:
        return (("the command only sets variables (" + " ".join(f"{k}=..." for k in assigned) + "): " if assigned
                 else "empty command: ") + "put the training command after a lone ' -- ', e.g. "
                "'-- torchrun --nproc-per-node 8 pretrain_gpt.py ...'")
    prog = argv[0]
    base = Path(cwd) if cwd is not None else Path.cwd()
    if os.sep in prog or (os.altsep and os.altsep in prog):
        path = Path(prog) if os.path.isabs(prog) else base / prog
        if not path.exists():
            return f"command {prog!r} not found: no such file ({path}); check the path"
        if path.is_dir():
            return f"command {prog!r} is a directory, not a program; name the script inside it"
        if not os.access(path, os.X_OK):
            return (f"command {prog!r} is not executable: run 'chmod +x {prog}' "
                    f"or start it through its interpreter ('bash {prog}' / 'python {prog}')")
        return None
    search_path = (env or {}).get("PATH", os.environ.get("PATH", ""))
    if shutil.which(prog, path=search_path):
        return None
    if (base / prog).is_file():
        return (f"command {prog!r} not found on PATH; a file of that name is in {base}: "
                f"write './{prog}' (or 'bash {prog}')")
    return (f"command {prog!r} not found on PATH: install it, activate the environment that provides it, "
            f"or give its full path")
