"""`python -m zenithtune [hydra overrides] [-- command ...]`.

Everything after the first lone `--` is the wrapped training command, kept as an argv list and
handed to the config through the environment (see zenithtune.resolvers); the rest goes to Hydra.
"""
from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

from zenithtune.resolvers import COMMAND_ENV


def split_command(argv: list[str]) -> tuple[list[str], list[str] | None]:
    if "--" not in argv:
        return argv, None
    i = argv.index("--")
    return argv[:i], argv[i + 1:]


def _search_path_override(hydra_args: list[str]) -> list[str]:
    """A user's own ./conf (e.g. conf/tuned/NAME.yaml) is on the search path next to ours."""
    local = Path.cwd() / "conf"
    if local.is_dir() and not any(a.startswith("hydra.searchpath") for a in hydra_args):
        return [f"hydra.searchpath=[file://{local}]"]
    return []


_SAFE = re.compile(r"[A-Za-z0-9_./:+@%-]*")


def hydra_quote(value: str) -> str:
    """A string as a Hydra override value: as is when the grammar takes it bare, else single-quoted
    (paths with spaces, commas, brackets, quotes)."""
    if _SAFE.fullmatch(value) and value not in ("", "null", "true", "false"):
        return value
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _unquote(value: str) -> str:
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
        return value[1:-1].replace("\\" + value[0], value[0]).replace("\\\\", "\\")
    return value


def _sweep_dir_override(hydra_args: list[str]) -> list[str]:
    """`storage=<a sqlite file>` makes the study's folder the db's folder: trial_N/ and best.yaml go
    next to study.db, so re-running with the same storage resumes the study in place. An explicit
    hydra.sweep.dir wins."""
    if any(a.lstrip("+").startswith("hydra.sweep.dir=") for a in hydra_args):
        return []
    value = None
    for a in hydra_args:
        key, eq, v = a.lstrip("+").partition("=")
        if eq and key == "storage":
            value = _unquote(v)
    if not value or value == "null":
        return []
    if value.startswith("sqlite:///"):
        value = value[len("sqlite:///"):]
    elif "://" in value:
        return []  # a database server: trial folders stay under outputs/
    return [f"hydra.sweep.dir={hydra_quote(str(Path(value).resolve().parent))}"]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    hydra_args, command = split_command(argv)
    if command is not None:
        if not command:
            print("zenithtune: error: nothing after `--`: give the training command, "
                  "e.g. -- torchrun --nproc-per-node 8 pretrain_gpt.py ...", file=sys.stderr)
            return 2
        os.environ[COMMAND_ENV] = json.dumps(command)
    hydra_args = hydra_args + _search_path_override(hydra_args) + _sweep_dir_override(hydra_args)
    from zenithtune.hydra_main import run_hydra

    return run_hydra(hydra_args)


if __name__ == "__main__":
    sys.exit(main())
