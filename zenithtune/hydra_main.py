"""The Hydra application: compose conf/, then sweep (-m) or run once.

A trial launched by the zenithtune sweeper (through any Hydra launcher) and a single run both land in
`_hydra_task`, which converts the composed config into the typed `ZenithtuneConf` once and calls the
entry function in `zenithtune.app`.
"""
from __future__ import annotations

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from zenithtune import app, settings
from zenithtune.errors import ZenithtuneError, report
from zenithtune.overrides import SUBCOMMANDS, hydra_quote, key, split_command, unquote
from zenithtune.record import TRIAL_LOG
from zenithtune.resolvers import export_command

_exit_code = 0


@hydra.main(config_path="pkg://zenithtune.conf", config_name="config")
def _hydra_task(cfg: DictConfig) -> float | None:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    global _exit_code
    hc = HydraConfig.get()
    out_dir = Path(hc.runtime.output_dir)
    if hc.mode == RunMode.MULTIRUN:
        # A trial launched by a sweeper: a bad value is the trial's failure, reported by the sweeper.
        try:
            return app.task(settings.load(cfg), out_dir)
        except (app.TrialFailure, ZenithtuneError):
            raise
        except Exception as err:  # a bug (ours, or a user's evaluator): its traceback goes where the trial's output is
            keep_traceback(err, out_dir / TRIAL_LOG)
            raise
    try:
        _exit_code = app.single_run(settings.load(cfg), out_dir)
    except ZenithtuneError as e:
        _exit_code = report(e)
    return None


def keep_traceback(err: BaseException, log: Path) -> None:
    """Append an exception's traceback to the trial's log: the study's table shows one line, this says
    where it came from. Never raises (a full disk must not hide the original error)."""
    import traceback

    try:
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("a", encoding="utf-8") as f:
            f.write("# zenithtune: the entry function failed (a bug in zenithtune or in the evaluator); traceback:\n")
            f.write("".join(traceback.format_exception(type(err), err, err.__traceback__)))
    except OSError:
        pass


def run_hydra(args: list[str]) -> int:
    global _exit_code
    _exit_code = 0
    saved = sys.argv
    sys.argv = [saved[0] if saved else "zenithtune"] + args
    try:
        _hydra_task()
    finally:
        sys.argv = saved
    return _exit_code


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
    """`python -m zenithtune [hydra overrides] [-- command ...]` (the subcommands are zenithtune.cli's)."""
    argv = sys.argv[1:] if argv is None else list(argv)
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

    # SIGTERM / SIGHUP (scancel, kill, timeout, a dropped ssh) take Ctrl-C's path: the running trial's
    # process group is killed, the trial recorded as interrupted, best.yaml written, exit 128 + signal.
    with signals.handled():
        try:
            return run_hydra(hydra_args)
        except KeyboardInterrupt:  # stopped before or after the study loop (composing, building the job)
            print(f"zenithtune: {signals.reason()}", file=sys.stderr, flush=True)
            return signals.exit_code()

