"""Hydra override strings: splitting off the wrapped command, quoting values, the resume hint.

Shared by every front end (`python -m zenithtune`, the `zenithtune` CLI, the sweeper), so a value is
quoted the same way wherever an override is written.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
from collections.abc import Iterator, Sequence
from typing import Any

# How the user invoked the `zenithtune` CLI (JSON argv), so the sweeper's resume hint after Ctrl-C
# repeats their own syntax; the environment reaches a sweeper in this process and its launchers.
INVOCATION_ENV = "ZENITHTUNE_INVOCATION"

_SAFE = re.compile(r"[A-Za-z0-9_./:+@%-]*")


# the original CLI's subcommands (zenithtune.cli): `python -m zenithtune analyze DB` runs them too
SUBCOMMANDS = ("optimize", "apply", "analyze")

def split_command(argv: Sequence[str]) -> tuple[list[str], list[str] | None]:
    """Everything after the first lone `--` is the wrapped command."""
    argv = list(argv)
    if "--" not in argv:
        return argv, None
    i = argv.index("--")
    return argv[:i], argv[i + 1:]


def hydra_quote(value: str) -> str:
    """A string as a Hydra override value: as is when the grammar takes it bare, else single-quoted
    (paths with spaces, commas, brackets, quotes)."""
    if _SAFE.fullmatch(value) and value not in ("", "null", "true", "false"):
        return value
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def unquote(value: str) -> str:
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
        return value[1:-1].replace("\\" + value[0], value[0]).replace("\\\\", "\\")
    return value


def value(v: Any) -> str:
    """A parameter value as an override: booleans and null in Hydra's spelling, strings quoted."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    return hydra_quote(str(v))


def key(override: str) -> str:
    return override.lstrip("+~").partition("=")[0]


def merge(base: list[str], later: list[str]) -> list[str]:
    """`base` then `later`; a key set in `later` drops its earlier value (group overrides may not repeat)."""
    keys = {key(o) for o in later}
    return [o for o in base if key(o) not in keys] + later


@contextlib.contextmanager
def remember_invocation(argv: Sequence[str] | None) -> Iterator[None]:
    """While a CLI command runs, the sweeper can read how it was invoked (None: not a study)."""
    if argv is not None:
        os.environ[INVOCATION_ENV] = json.dumps(list(argv))
    try:
        yield
    finally:
        os.environ.pop(INVOCATION_ENV, None)


def resume_command(where: str, task_overrides: Sequence[str], hydra_overrides: Sequence[str],
                   command: Sequence[str] | None) -> str:
    """A command a user can paste to continue an interrupted study, in the syntax they typed."""
    tail = f" -- {shlex.join(command)}" if command else ""
    raw = os.environ.get(INVOCATION_ENV)
    if raw is not None:
        args, skip = [], False
        for a in json.loads(raw):
            if skip:
                skip = False
                continue
            if a in ("--db-path", "--output-dir"):
                skip = True
                continue
            if a.startswith(("--db-path=", "--output-dir=")):
                continue
            args.append(a)
        return shlex.join(["zenithtune", *args, "--db-path", where]) + tail
    keep = [o for o in task_overrides if key(o) != "storage"]
    keep += [o for o in hydra_overrides if key(o) not in ("hydra.searchpath", "hydra.sweep.dir", "hydra.mode")]
    return shlex.join(["python", "-m", "zenithtune", "-m", *keep, f"storage={hydra_quote(where)}"]) + tail
