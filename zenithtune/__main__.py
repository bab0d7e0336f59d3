"""`python -m zenithtune [hydra overrides] [-- command ...]`, or `python -m zenithtune optimize|apply|analyze ...`
(the original CLI, zenithtune.cli).

Everything after the first lone `--` is the wrapped training command, kept as an argv list and
handed to the config through the environment (see zenithtune.resolvers); the rest goes to Hydra.
"""
from __future__ import annotations

import sys
from pathlib import Path

from zenithtune.errors import ZenithtuneError, report
from zenithtune.overrides import hydra_quote, key, split_command, unquote
from zenithtune.resolvers import export_command


def _search_path_override(hydra_args: list[str]) -> list[str]:
    """A user's own ./conf (e.g. conf/tuned/NAME.yaml) is on the search path next to ours."""
    local = Path.cwd() / "conf"
    if local.is_dir() and not any(a.startswith("hydra.searchpath") for a in hydra_args):
        return [f"hydra.searchpath=[file://{local}]"]
    return []


def _sweep_dir_override(hydra_args: list[str]) -> list[str]:
    """`storage=<a sqlite file or its folder>` makes the study's folder the db's folder: trial_N/ and
    best.yaml go next to study.db, so re-running with the same storage resumes the study in place.
    An explicit hydra.sweep.dir wins."""
    from zenithtune.study import db_path, storage_url

    if any(key(a) == "hydra.sweep.dir" for a in hydra_args):
        return []
    value = None
    for a in hydra_args:
        if key(a) == "storage":
            value = unquote(a.partition("=")[2])
    if not value or value == "null":
        return []
    path = db_path(storage_url(value))
    if path is None:
        return []  # a database server: trial folders stay under outputs/
    return [f"hydra.sweep.dir={hydra_quote(str(path.parent))}"]


def _baseline_appended(hydra_args: list[str]) -> list[str]:
    """`baseline=stock_tpe` as `+baseline=stock_tpe`. The baseline replaces our sweeper with the stock
    Optuna one, and Hydra lets a config do that only when it is appended after conf/config.yaml's own
    `override hydra/sweeper: zenithtune` (a `baseline: null` slot in the defaults list would lose to
    it). So the group is written like the others on the command line and appended here."""
    return [f"+{a}" if key(a) == "baseline" and not a.startswith(("+", "~")) else a for a in hydra_args]


# the original CLI's subcommands (zenithtune.cli): `python -m zenithtune analyze DB` runs them too
SUBCOMMANDS = ("optimize", "apply", "analyze")
# Hydra's own options that take the next word as their value (`--cfg job`, `-cn config`)
_HYDRA_VALUED = frozenset({"--cfg", "-c", "--package", "-p", "--info", "-i", "--config-path", "-cp",
                           "--config-name", "-cn", "--config-dir", "-cd", "--experimental-rerun"})


def _bare_word(hydra_args: list[str]) -> str | None:
    """The first argument that is neither an override (`key=value`, `~key`) nor an option or its value:
    Hydra would answer it with a parse error about a missing '='."""
    prev = None
    for a in hydra_args:
        if not a.startswith(("-", "~")) and "=" not in a and prev not in _HYDRA_VALUED:
            return a
        prev = a
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in SUBCOMMANDS:
        from zenithtune.cli import main as cli_main

        return cli_main(argv)
    hydra_args, command = split_command(argv)
    word = _bare_word(hydra_args)
    if word is not None:
        if word in SUBCOMMANDS:
            why = f"`{word}` is a subcommand of the original CLI: put it first (python -m zenithtune {word} ...)"
        else:
            why = (f"`{word}` is not an override (key=value) nor a subcommand ({', '.join(SUBCOMMANDS)}); "
                   f"e.g. python -m zenithtune -m preset=megatron n_gpus=8 gbs=64 -- <command>")
        print(f"zenithtune: error: {why}", file=sys.stderr)
        return 2
    if command is not None:
        if not command:
            print("zenithtune: error: nothing after `--`: give the training command, "
                  "e.g. -- torchrun --nproc-per-node 8 pretrain_gpt.py ...", file=sys.stderr)
            return 2
        export_command(command)
    try:
        from zenithtune.settings import check_overrides

        check_overrides([a for a in hydra_args if not a.startswith("-")])
        hydra_args = _baseline_appended(hydra_args) + _search_path_override(hydra_args) + _sweep_dir_override(hydra_args)
    except ZenithtuneError as e:
        return report(e)
    from zenithtune import signals
    from zenithtune.hydra_main import run_hydra

    # SIGTERM / SIGHUP (scancel, kill, timeout, a dropped ssh) take Ctrl-C's path: the running trial's
    # process group is killed, the trial recorded as interrupted, best.yaml written, exit 128 + signal.
    with signals.handled():
        try:
            return run_hydra(hydra_args)
        except KeyboardInterrupt:  # stopped before or after the study loop (composing, building the job)
            print(f"zenithtune: {signals.reason()}", file=sys.stderr, flush=True)
            return signals.exit_code()


if __name__ == "__main__":
    sys.exit(main())
