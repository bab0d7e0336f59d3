"""The one error class a user sees as a single line.

Anything zenithtune raises because of what a user gave it (a bad value, a missing file, a study that
cannot be resumed) derives from `ZenithtuneError`. The front ends (`python -m zenithtune`, the
`zenithtune` CLI, the Hydra sweeper) print such an error as one line, `zenithtune: error: ...`, and
exit with its `exit_code`; every other exception is a bug and keeps its traceback.
"""
from __future__ import annotations


class ZenithtuneError(Exception):
    """Bad input or a state a user can fix; printed as one line, never with a traceback."""

    exit_code = 2  # usage-style errors; a study that ran and found nothing uses 1


class UserError(ZenithtuneError, ValueError):
    """A value the user gave is wrong: the message names the key, the value and the fix."""


class StudyFailed(ZenithtuneError):
    """A study ran but has no result to report (every launch failed, nothing could be launched)."""

    exit_code = 1


class StudyInterrupted(ZenithtuneError):
    """The tuner was stopped (Ctrl-C, SIGTERM, SIGHUP); the running trial was recorded as interrupted."""

    exit_code = 130


def report(error: ZenithtuneError) -> int:
    """Print a project error as one line on stderr; returns the exit code to use."""
    import sys

    text = str(error)
    if text:
        print(f"zenithtune: error: {text}", file=sys.stderr, flush=True)
    return error.exit_code
