"""Stop signals: SIGTERM and SIGHUP take the same path as Ctrl-C.

Slurm's scancel, Kubernetes, `timeout` and a dropped ssh session stop the tuner with SIGTERM or SIGHUP,
not SIGINT. While a front end runs (`handled()`), those signals raise `KeyboardInterrupt` in the main
thread, so the runner kills the trial's process group, the loop records the trial as interrupted,
the sweeper writes best.yaml and prints the resume hint: exactly what Ctrl-C does. Only the exit code
and the recorded reason tell them apart (the shell's 128 + signal number: 130 Ctrl-C, 129 SIGHUP,
143 SIGTERM). SIGKILL cannot be caught; a resumed study closes what it left RUNNING.

Where a result is being written (`deferred()`: a trial from its command's start to its trial.json, the
loop recording a wave), a stop signal (Ctrl-C included) is held instead: the runner polls `pending()`
and kills the command, and the held stop is raised when the section ends, once the result is safe. A
signal landing just after a trial finished used to abort the study in the middle of recording it.

A stop raised where Python cannot let an exception out (a weakref callback or `__del__` that the garbage
collector runs, sqlalchemy's among them) would be printed as "Exception ignored ... Traceback" and lost;
while `handled()` is in force it is held instead, like a stop inside a deferred section: the running
trial's command is killed at once and the loop raises it at its next step (`check()`).
"""
from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator

# The signals handled like Ctrl-C; SIGINT already raises KeyboardInterrupt (ours only adds deferral).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)

_received: int | None = None  # the last stop signal that arrived (None: none, or Ctrl-C)
_armed = False  # inside `armed()`: a trial may be running and the study has something to save
_deferring = 0  # depth of `deferred()` sections
_pending = False  # a stop arrived inside a deferred section and is not raised yet
_count = 0  # stops received (any handled signal): a caller can tell one was swallowed on its way


def _raise(signum: int, frame: object) -> None:
    global _received, _pending, _count
    _count += 1
    if signum != signal.SIGINT:
        _received = signum
    if _deferring:
        _pending = True
        return
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    if not _armed:
        # Composing the config, building the job, writing the summary: nothing runs that needs killing,
        # and an exception raised in the middle of Hydra or OmegaConf would surface as a traceback.
        import os
        import sys

        print(f"zenithtune: {reason()}; stopped", file=sys.stderr, flush=True)
        os._exit(exit_code())
    raise KeyboardInterrupt


@contextlib.contextmanager
def armed() -> Iterator[None]:
    """While inside (the study loop, a single run), a stop signal raises KeyboardInterrupt so the running
    trial is killed and recorded; outside, it ends the process at once with a one-line message."""
    global _armed
    before, _armed = _armed, True
    try:
        yield
    finally:
        _armed = before


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """While inside, a stop signal is held (see `pending()`); leaving the outermost section raises it as
    KeyboardInterrupt, after the result it protects is written."""
    global _deferring, _pending
    _deferring += 1
    try:
        yield
    except KeyboardInterrupt:
        if _deferring == 1:
            _pending = False  # the stop is on its way out already
        raise
    finally:
        _deferring -= 1
    if not _deferring and _pending:
        _pending = False
        raise KeyboardInterrupt


def check() -> None:
    """At a safe point between trials: raise a stop that was held (see the module's note) and not raised yet."""
    global _pending
    if _pending and not _deferring:
        _pending = False
        raise KeyboardInterrupt


def _unraisable(previous: object) -> object:
    """A `sys.unraisablehook` that holds our own stop (raised inside a garbage-collector callback) instead
    of printing it; everything else goes to the hook that was in place."""
    def hook(unraisable: object) -> None:
        global _pending
        exc_type = getattr(unraisable, "exc_type", None)
        if _count and isinstance(exc_type, type) and issubclass(exc_type, KeyboardInterrupt):
            _pending = True
            return
        previous(unraisable)  # type: ignore[operator]
    return hook


def count() -> int:
    """How many stop signals arrived so far. Code that runs a library which may swallow the
    KeyboardInterrupt (Hydra wraps what is raised while OmegaConf resolves) compares it before and after."""
    return _count


def pending() -> bool:
    """Whether a stop signal is held by a deferred section (the runner polls this to stop the command)."""
    return _pending


def acknowledge() -> None:
    """The caller has dealt with the held stop itself (a single run reports it and exits): do not raise it."""
    global _pending
    _pending = False


@contextlib.contextmanager
def handled() -> Iterator[None]:
    """While inside, SIGTERM / SIGHUP raise KeyboardInterrupt, and every stop (Ctrl-C too) waits for a
    deferred section to end; the previous handlers come back after."""
    global _received, _pending
    _received, _pending = None, False
    if threading.current_thread() is not threading.main_thread():
        yield  # Python delivers signals to the main thread only; its own handlers apply
        return
    saved = {s: signal.signal(s, _raise) for s in (*STOP_SIGNALS, signal.SIGINT)}
    hook, sys.unraisablehook = sys.unraisablehook, _unraisable(sys.unraisablehook)  # type: ignore[assignment]
    try:
        yield
    finally:
        sys.unraisablehook = hook
        for s, h in saved.items():
            signal.signal(s, h)


def received() -> int | None:
    """The stop signal (SIGTERM / SIGHUP) that interrupted this process; None for Ctrl-C or none."""
    return _received


def reason() -> str:
    """How an interrupted trial's record says it was stopped."""
    if _received is None:
        return "interrupted by the user (Ctrl-C)"
    return f"interrupted: the tuner received {signal.Signals(_received).name}"


def exit_code() -> int:
    """The shell's convention, 128 + signal number: 130 after Ctrl-C, 143 SIGTERM, 129 SIGHUP."""
    return 128 + (_received if _received is not None else signal.SIGINT)
