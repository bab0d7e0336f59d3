"""Run one trial's command: own process group, live log, timeout, and what went wrong.

A trial is a distributed job (torchrun and its workers, or ms-swift's launcher and its workers).
Everything it starts must be gone before the next trial starts, or the leftovers hold GPU memory
and the next trial OOMs for reasons that have nothing to do with its configuration. So the command
runs in its own session/process group and every exit path — normal exit, timeout, Ctrl-C — ends
with the whole group gone: SIGTERM, ``grace`` seconds to clean up, then SIGKILL.

The output is read line by line (stdout and stderr merged, as a user sees them in a terminal) and
goes to three places: the trial's log file (everything, flushed per line so it can be tailed),
the ``echo`` callback (live display), and memory (the last few MB, which is what the evaluator
and :func:`classify` look at).
"""
from __future__ import annotations

import collections
import datetime as _dt
import os
import re
import shlex
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import IO, Callable

__all__ = ["FailureKind", "RunResult", "run", "classify", "command_problem", "OUTPUT_CAP"]

OUTPUT_CAP = 2 * 1024 * 1024
"""Characters of output kept in memory (the tail); the log file always gets everything."""

_REASON_MAX = 300  # a reason is one line in a table; the log has the rest


class FailureKind(str, Enum):
    """Why a trial produced no score. Strings so they store as-is in study user_attrs."""

    OOM = "oom"
    TIMEOUT = "timeout"
    CRASH = "crash"
    NO_METRIC = "no_metric"  # decided by the evaluator: exit 0 but nothing to read
    INVALID_ARGS = "invalid_args"
    INTERRUPTED = "interrupted"


@dataclass
class RunResult:
    """What one run of a command left behind."""

    argv: list[str]
    returncode: int | None  # None: the command never started (see output for why); <0: killed by signal
    output: str  # merged stdout+stderr, at most OUTPUT_CAP characters (the tail)
    duration: float  # seconds, start to the whole group gone
    timed_out: bool
    interrupted: bool  # Ctrl-C arrived while it ran; the caller decides whether to stop the study
    log_path: Path | None

    @property
    def succeeded(self) -> bool:
        return self.returncode == 0 and not self.timed_out and not self.interrupted


# ---------------------------------------------------------------------------------------------
# process group handling


def _group_alive(pgid: int) -> bool:
    """Whether any process of the group is still running. Zombies do not count: an orphan reaped late
    by init holds no GPU memory, and in containers init may never reap it at all."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    proc = Path("/proc")
    if not (proc / "self" / "stat").exists():
        return True  # no /proc (macOS): killpg's answer is the best we have
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()  # after "pid (comm) "
        if len(fields) > 2 and fields[2] == str(pgid) and fields[0] not in ("Z", "X"):
            return True
    return False


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _kill_group(proc: subprocess.Popen, grace: float) -> None:
    """SIGTERM the group, give it ``grace`` seconds, SIGKILL whatever is left. A second Ctrl-C during
    the grace period skips straight to SIGKILL."""
    pgid = proc.pid
    _signal_group(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    try:
        while time.monotonic() < deadline:
            proc.poll()  # reap the leader so it does not linger as a zombie
            if not _group_alive(pgid):
                return
            time.sleep(0.02)
    except KeyboardInterrupt:
        pass
    _signal_group(pgid, signal.SIGKILL)
    # SIGKILL is delivered asynchronously: wait until the group is really gone, so the next trial
    # never starts next to a dying worker. A process in uninterruptible sleep (D state) may outlast
    # this; nothing more can be done about it from here.
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        proc.poll()
        if not _group_alive(pgid):
            break
        time.sleep(0.01)
    try:
        proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass


# ---------------------------------------------------------------------------------------------
# output handling


class _Sink:
    """Where output lines go: log file, echo, bounded in-memory tail. Shared with the reader thread."""

    def __init__(self, log: IO[str] | None, echo: Callable[[str], None] | None) -> None:
        self.log = log
        self.echo = echo
        self.lock = threading.Lock()
        self.tail: collections.deque[str] = collections.deque()
        self.size = 0
        self.dropped = 0

    def line(self, text: str) -> None:
        with self.lock:
            if self.log is not None and not self.log.closed:
                self.log.write(text)
                self.log.flush()
            self.tail.append(text)
            self.size += len(text)
            while self.size > OUTPUT_CAP and len(self.tail) > 1:
                self.size -= len(self.tail[0])
                self.dropped += len(self.tail.popleft())
        if self.echo is not None:
            try:
                self.echo(text.rstrip("\r\n"))
            except Exception as exc:  # a broken display must not stop the pipe from draining
                self.echo = None
                self.note(f"# zenithtune: echo failed ({exc!r}); live output off for this run")

    def note(self, text: str) -> None:
        """A zenithtune line in the log (header/footer); not part of the command's output."""
        with self.lock:
            if self.log is not None and not self.log.closed:
                self.log.write(text + "\n")
                self.log.flush()

    def output(self) -> str:
        with self.lock:
            head = (f"[zenithtune: first {self.dropped} characters of output dropped from memory; "
                    f"the log file has them]\n" if self.dropped else "")
            return head + "".join(self.tail)


def _pump(stream: IO[bytes], sink: _Sink) -> None:
    for raw in iter(stream.readline, b""):
        sink.line(raw.decode("utf-8", errors="replace"))
    stream.close()


def _added_env(env: dict[str, str] | None) -> dict[str, str]:
    return {k: v for k, v in (env or {}).items() if os.environ.get(k) != v}


def run(argv: list[str], *, log_path: Path | None, timeout: float | None,
        env: dict[str, str] | None = None, cwd: str | os.PathLike[str] | None = None,
        echo: Callable[[str], None] | None = None, grace: float = 5.0) -> RunResult:
    """Run ``argv`` (no shell) to completion, timeout or Ctrl-C; never leaves a process behind.

    ``env`` is merged over ``os.environ``; PYTHONUNBUFFERED=1 is added unless set, so Python trainers
    stream their lines as they happen instead of in 8 kB blocks (it shows in the log header).
    ``timeout`` (seconds, None = none) kills the whole process group. Ctrl-C kills it the same way and
    returns ``interrupted=True`` instead of raising: the caller decides whether the study stops.
    """
    if timeout is not None and timeout <= 0:
        raise ValueError(f"timeout={timeout} must be a positive number of seconds, or None for no limit")
    extra = dict(env or {})
    if "PYTHONUNBUFFERED" not in os.environ and "PYTHONUNBUFFERED" not in extra:
        extra["PYTHONUNBUFFERED"] = "1"
    added = _added_env(extra)
    log: IO[str] | None = None
    if log_path is not None:
        log_path = Path(log_path)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(log_path, "w", encoding="utf-8", errors="replace")
    sink = _Sink(log, echo)
    sink.note(f"# command: {shlex.join(argv)}")
    sink.note("# env added: " + (" ".join(f"{k}={shlex.quote(v)}" for k, v in added.items()) or "(none)"))
    sink.note(f"# cwd: {Path(cwd or os.getcwd()).resolve()}")
    sink.note(f"# started: {_dt.datetime.now().isoformat(timespec='seconds')}")
    sink.note("# " + "-" * 70)

    start = time.monotonic()
    timed_out = interrupted = False
    try:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env={**os.environ, **extra}, cwd=cwd,
                                start_new_session=True)
    except OSError as exc:
        sink.line(f"zenithtune: cannot start {argv[0] if argv else '(empty command)'}: {exc}\n")
        sink.note("# result: never started")
        if log:
            log.close()
        return RunResult(list(argv), None, sink.output(), time.monotonic() - start, False, False, log_path)

    reader = threading.Thread(target=_pump, args=(proc.stdout, sink), daemon=True, name="zenithtune-output")
    reader.start()
    try:
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            sink.note(f"# zenithtune: no exit after {timeout:g} s: SIGTERM to the process group, "
                      f"SIGKILL after {grace:g} s")
        except KeyboardInterrupt:
            interrupted = True
            sink.note("# zenithtune: interrupted (Ctrl-C): killing the process group")
        if not timed_out and not interrupted and _group_alive(proc.pid):
            sink.note("# zenithtune: the command exited but left processes in its group; killing them")
        _kill_group(proc, grace)  # after a normal exit this only reaps leftovers
    except KeyboardInterrupt:  # Ctrl-C while killing: finish the kill, then report
        interrupted = True
        _signal_group(proc.pid, signal.SIGKILL)
        proc.wait()
    reader.join(timeout=max(grace, 1.0))
    if reader.is_alive():
        sink.note("# zenithtune: output pipe still held by a process outside the group; not waiting for it")
    duration = time.monotonic() - start

    code = proc.returncode
    status = (f"timed out after {duration:.1f} s" if timed_out else
              "interrupted" if interrupted else f"exit code {code} after {duration:.1f} s")
    sink.note("# " + "-" * 70)
    sink.note(f"# result: {status}")
    with sink.lock:
        if log:
            log.close()
    return RunResult(list(argv), code, sink.output(), duration, timed_out, interrupted, log_path)


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
                    r"^\W*$|^Traceback \(most recent call last\)|^\s*(error_file|traceback)\s*:")


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


def _last_meaningful(lines: list[str]) -> str | None:
    errors = [ln for ln in lines if _EXCEPTION.search(ln) and not _NOISE.search(ln)]
    if errors:
        return _short(errors[-1])
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


def classify(result: RunResult) -> tuple[FailureKind, str] | None:
    """None when the run succeeded (exit 0, not timed out, not interrupted); else the failure kind and
    one line saying why. OOM wins over everything: after one rank runs out of memory the others fail
    with NCCL or timeout errors that only hide the cause."""
    if result.succeeded:
        return None
    if result.interrupted:
        return FailureKind.INTERRUPTED, "interrupted (Ctrl-C); process group killed"
    lines = result.output.splitlines()
    oom = _oom_reason(lines)
    if oom:
        return FailureKind.OOM, oom
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
    if not argv:
        return ("empty command: put the training command after a lone ' -- ', e.g. "
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
