"""`zenithtune optimize | apply | analyze`: the seed's command line, translated into one Hydra call.

There is one implementation. Each subcommand turns its options into the override list of
`python -m zenithtune` and calls the same `zenithtune.hydra_main.main` (analyze only reads a study):

  zenithtune optimize --preset megatron --args n_gpus=8,gbs=64 --strategy megatron-staged-blackbox \\
      --n-trials 50 --timeout-dynamic --db-path runs/llama/study.db -- python pretrain_gpt.py ...
  is  python -m zenithtune -m preset=megatron n_gpus=8 gbs=64 strategy=staged_blackbox n_trials=50 \\
      timeout_dynamic=true storage=/abs/runs/llama/study.db -- python pretrain_gpt.py ...

`--dry-run` prints that Hydra command instead of running it.
"""
from __future__ import annotations

import argparse
import re
import shlex
import sys
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any, NoReturn

from zenithtune import study as zstudy
from zenithtune.errors import UserError, ZenithtuneError
from zenithtune.overrides import SUBCOMMANDS, hydra_quote, remember_invocation, split_command
from zenithtune.overrides import key as _key
from zenithtune.overrides import merge as _merge
from zenithtune.overrides import value as _param_value
from zenithtune.settings import group_choices as _group_names

# Keys of a study's own overrides that `apply` does not replay: they steer the search, not the run
# (a trial's timeout must not cut the long training run a user applies the result to).
STUDY_ONLY = ("n_trials", "fail_fast", "stage1_trials", "timeout", "timeout_dynamic", "timeout_dynamic_factor",
              "timeout_dynamic_floor", "storage", "study_name", "save_tuned", "echo", "tuned")
# The seed's strategy names -> ours (conf/strategy/<name>.yaml); our own names are accepted as they are.
STRATEGY_ALIASES = {"megatron-staged-blackbox": "staged_blackbox", "megatron-heuristic": "heuristic",
                    "megatron-grid": "grid", "megatron-random": "random", "megatron-tpe": "tpe"}
# config.yaml keys that are not `--args` material (the command, the per-trial params, Hydra's own).
_NOT_ARGS = ("defaults", "hydra", "params", "command", "default_command")


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage error in one line (exit 2), pointing at --help."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


# --- what conf/ offers ---------------------------------------------------------------------------
def config_keys() -> list[str]:
    import yaml

    text = resources.files("zenithtune.conf").joinpath("config.yaml").read_text()
    return [k for k in yaml.safe_load(text) if k not in _NOT_ARGS]


def strategy_name(value: str) -> str:
    """The seed's `megatron-staged-blackbox` or our `staged_blackbox` / `staged-blackbox`."""
    name = STRATEGY_ALIASES.get(value, value.replace("-", "_"))
    known = _group_names("strategy")
    if name not in known:
        seed = [a for a, n in STRATEGY_ALIASES.items() if n in known]
        raise UserError(f"--strategy {value!r} is not a strategy: choose one of {', '.join(known + seed)}")
    return name


def preset_name(value: str) -> str:
    known = _group_names("preset")
    if value not in known:
        raise UserError(f"--preset {value!r} is not a preset: choose one of {', '.join(known)}")
    return value


def parse_kv(text: str) -> list[tuple[str, str]]:
    """`--args n_gpus=8,gbs=64,model=Qwen/Qwen3-30B-A3B` -> pairs. A comma only starts a new pair when a
    `key=` follows it, so a value may itself hold commas."""
    known = config_keys()
    pairs = []
    for part in re.split(r",(?=\s*[A-Za-z_][\w.]*=)", text.strip()):
        key, eq, value = part.strip().partition("=")
        if not eq or not key:
            raise UserError(f"--args {text!r}: {part!r} is not key=value (e.g. --args n_gpus=8,gbs=64)")
        if key not in known:
            import difflib

            close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
            raise UserError(f"--args: unknown key {key!r}" + (f"; did you mean {close[0]}={value.strip()}?" if close
                                                               else f"; known keys: {', '.join(known)}"))
        pairs.append((key, value.strip()))
    return pairs


def _overrides(values: Sequence[str]) -> list[str]:
    for o in values:
        if "=" not in o and not o.startswith("~"):
            raise UserError(f"{o!r} is neither an option nor a Hydra override (key=value)")
    return list(values)


def _common(ns: argparse.Namespace) -> list[str]:
    out = [f"preset={preset_name(ns.preset)}"] if ns.preset else []
    for text in ns.args or []:
        out += [f"{k}={hydra_quote(v)}" for k, v in parse_kv(text)]
    return out


# --- optimize ------------------------------------------------------------------------------------
def optimize_overrides(ns: argparse.Namespace) -> list[str]:
    """The `python -m zenithtune` overrides for `zenithtune optimize` (pure; tested by table)."""
    out = ["-m"] + _common(ns)
    if ns.strategy:
        out.append(f"strategy={strategy_name(ns.strategy)}")
    if ns.n_trials is not None:
        out.append(f"n_trials={ns.n_trials}")
    if ns.timeout is not None:
        if not ns.timeout > 0:
            raise UserError(f"--timeout {ns.timeout:g} must be a positive number of seconds (leave it out for no limit)")
        out.append(f"timeout={ns.timeout:g}")
    if ns.timeout_dynamic:
        out.append("timeout_dynamic=true")
    if ns.timeout_dynamic_factor is not None:
        out.append(f"timeout_dynamic_factor={ns.timeout_dynamic_factor:g}")
    if ns.timeout_dynamic_floor is not None:
        out.append(f"timeout_dynamic_floor={ns.timeout_dynamic_floor:g}")
    if ns.db_path:
        out.append(f"storage={hydra_quote(zstudy.where(zstudy.storage_url(ns.db_path)))}")
    if ns.output_dir:
        out.append("hydra.sweep.dir=" + hydra_quote(f"{Path(ns.output_dir).expanduser()}/study_${{zt.started:%Y%m%d_%H%M%S}}"))
    if ns.study_name:
        out.append(f"study_name={hydra_quote(ns.study_name)}")
    if ns.save_tuned:
        out.append(f"save_tuned={hydra_quote(ns.save_tuned)}")
    if ns.echo:
        out.append("echo=true")
    return _merge(out, _overrides(ns.overrides))


# --- apply ---------------------------------------------------------------------------------------
def _load_best(db: str, study_name: str | None) -> tuple[Any, Any, str]:
    study, url = zstudy.load_existing(db, study_name)
    best = zstudy.best_trial(study)
    if best is None:
        raise UserError(f"{zstudy.where(url)} has no completed trial yet: nothing to apply "
                        f"(zenithtune analyze {db} shows why)")
    return study, best, url


def apply_overrides(ns: argparse.Namespace, command: list[str] | None) -> tuple[list[str], list[str] | None, str]:
    """Overrides, command and a one-line description for `zenithtune apply`."""
    user = _common(ns) + ([f"timeout={ns.timeout:g}"] if ns.timeout is not None else []) + _overrides(ns.overrides)
    if ns.tuned:
        if ns.tuned not in _group_names("tuned"):
            known = _group_names("tuned")
            raise UserError(f"--tuned {ns.tuned!r}: no conf/tuned/{ns.tuned}.yaml in {Path.cwd()}"
                             + (f"; found: {', '.join(known)}" if known else
                                "; write one with zenithtune optimize ... --save-tuned NAME"))
        return _merge([f"tuned={ns.tuned}"], user), command, f"tuned config {ns.tuned}"
    study, best, url = _load_best(ns.db_path, ns.study_name)
    meta = study.user_attrs.get(zstudy.STUDY_ATTR) or {}
    replay = replayable(meta.get("overrides", []), f"the study in {zstudy.where(url)}")
    if not meta:  # a study from before the sweeper stored its overrides: best.yaml knows the shape
        replay = _best_yaml_shape(url)
    cand = best.candidate
    params = [f"++params.{k}={_param_value(v)}" for k, v in cand.items()]
    if command is None and meta.get("command"):
        # A study file may come from anyone: its command runs only when the user has seen it and says so.
        stored = [str(w) for w in meta["command"]]
        if not ns.yes and not ns.dry_run:
            raise UserError(f"the study's stored command is `{shlex.join(stored)}`: give your command after `--`, "
                            f"or add --yes to run that one")
        command = stored
    from zenithtune.progress import describe

    where = zstudy.where(url)
    what = f"trial {best.trial_number} of {where} ({best.value:g} {meta.get('metric', '')}".rstrip() + f"): {describe(cand)}"
    return _merge(replay + params, user), command, what


# What `apply` takes from a study's stored overrides: the job's shape and the config group choices,
# all typed and checked like the user's own. Anything else in a study file (a `command=`, Hydra
# settings such as hydra.job.env_set.LD_PRELOAD, a `_target_`) is never replayed.
REPLAYED = ("n_gpus", "gbs", "model", "num_layers", "num_query_groups", "seq_length", "mbs_max",
            "gpus_per_node", "gpu_memory_gb", "sim_gpu", "preset", "evaluator", "memory_safety_margin")


def replayable(overrides: Sequence[str], source: str) -> list[str]:
    """The stored overrides `apply` replays; a warning names each one it leaves out."""
    keep: list[str] = []
    dropped: list[str] = []
    for o in overrides:
        k = _key(str(o))
        if k in STUDY_ONLY or k.startswith("params."):
            continue  # steers the search, not the run
        ok = k in REPLAYED or (k.startswith("evaluator.") and "_target_" not in k and k.count(".") == 1)
        (keep if ok and not str(o).startswith("~") else dropped).append(str(o))
    if dropped:
        print(f"zenithtune: warning: {source} also stores {', '.join(sorted({_key(o) for o in dropped}))}; "
              f"not replayed (only the tuned parameters and the job's shape are taken from a study)",
              file=sys.stderr, flush=True)
    return keep


def _best_yaml_shape(url: str) -> list[str]:
    import yaml

    path = zstudy.db_path(url)
    best = path.parent / "best.yaml" if path else None
    if best is None or not best.is_file():
        return []
    data = yaml.safe_load(best.read_text()) or {}
    return [f"{k}={int(data[k])}" for k in ("n_gpus", "gbs")
            if isinstance(data.get(k), int) and not isinstance(data.get(k), bool)]


# --- the parser ----------------------------------------------------------------------------------
_FMT = argparse.RawDescriptionHelpFormatter

OPTIMIZE_EXAMPLES = """\
examples:
  # a study on the built-in simulator (no GPU needed)
  zenithtune optimize --preset megatron --args n_gpus=8,gbs=64 --n-trials 20
  # your training command, the seed's staged strategy, a dynamic per-trial timeout, a fixed db
  zenithtune optimize --preset megatron --args n_gpus=8,gbs=64,model=Qwen/Qwen3-30B-A3B \\
      --strategy megatron-staged-blackbox --n-trials 50 --timeout-dynamic \\
      --db-path outputs/qwen3/study.db --save-tuned qwen3_8xh100 \\
      -- torchrun --nproc-per-node 8 pretrain_gpt.py --num-layers 48 ... --train-iters 10
  # resume it after Ctrl-C or a crash: the same command (finished trials are not re-run)

Stopping: Ctrl-C, SIGTERM (scancel, kill, timeout) and SIGHUP (a dropped ssh session) all kill the
running trial's processes, record it as interrupted, write best.yaml and print the resume command;
the exit code is 128 + the signal: 130 (Ctrl-C), 143 (SIGTERM), 129 (SIGHUP).

Every option maps to a key of conf/config.yaml; --dry-run prints the python -m zenithtune call.
--timeout-dynamic: once a trial has succeeded, each trial's limit is timeout_dynamic_factor (3) x the
fastest successful trial's wall time, at least timeout_dynamic_floor (60 s) and at most --timeout;
the first trial (nothing succeeded yet) only has the fixed --timeout, if any.
"""

APPLY_EXAMPLES = """\
examples:
  # the best trial of a study, on your real (longer) run
  zenithtune apply --db-path outputs/qwen3/study.db \\
      -- torchrun --nproc-per-node 8 pretrain_gpt.py ... --train-iters 5000
  # a tuned config committed to git (conf/tuned/qwen3_8xh100.yaml in this folder)
  zenithtune apply --tuned qwen3_8xh100 -- torchrun --nproc-per-node 8 pretrain_gpt.py ...
  #   same as: python -m zenithtune tuned=qwen3_8xh100 -- torchrun ...

Without `-- command`, the study's own command is printed and run only with --yes. The command's output streams live and
its exit code is zenithtune's; n_gpus/gbs come from the study (override with --args).
"""

ANALYZE_EXAMPLES = """\
examples:
  zenithtune analyze outputs/study_20261129_101500_123456_4242/study.db
  zenithtune analyze outputs/study_20261129_101500_123456_4242   # the folder works too
  zenithtune analyze outputs/qwen3/study.db --all --no-plots

Prints every launched trial, the best configuration, best vs first, why candidates were pruned and
the parameter importances; writes history.png, importances.png, parallel.png and timeline.png next
to study.db. Works while the study runs and after an interruption. For an interactive view:
  optuna-dashboard sqlite:///outputs/study_20261129_101500_123456_4242/study.db
"""


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="zenithtune", formatter_class=_FMT,
                description="Find the fastest Megatron-LM / ms-swift parallel configuration for a training "
                            "command.\nEverything after a lone `--` is the training command.",
                epilog="run `zenithtune SUBCOMMAND --help` for the options and examples of each")
    sub = p.add_subparsers(dest="subcommand", metavar="{optimize,apply,analyze}", parser_class=_Parser)

    o = sub.add_parser("optimize", help="run a study (one trial per candidate) and write best.yaml",
                       formatter_class=_FMT, epilog=OPTIMIZE_EXAMPLES,
                       description="Run a tuning study: propose, prune, launch, record; "
                                   "resume with the same --db-path.")
    _add_shape(o)
    o.add_argument("--strategy", metavar="NAME",
                   help="heuristic (default), staged_blackbox (= megatron-staged-blackbox), grid, random, tpe, ...")
    o.add_argument("--n-trials", type=int, metavar="N", help="launched trials at most, counted over the whole "
                   "study (pruned candidates do not count); default 50")
    o.add_argument("--timeout", type=float, metavar="SECONDS", help="fixed limit per trial; cut trials are "
                   "recorded as timeout")
    o.add_argument("--timeout-dynamic", action="store_true",
                   help="derive each trial's limit from the fastest successful trial (see below)")
    o.add_argument("--timeout-dynamic-factor", type=float, metavar="X", help="dynamic limit = X x fastest (default 3)")
    o.add_argument("--timeout-dynamic-floor", type=float, metavar="SECONDS",
                   help="the dynamic limit is never below this (default 60)")
    o.add_argument("--db-path", metavar="PATH", help="study database (file, folder or Optuna URL); trial folders "
                   "and best.yaml go next to it; an existing one is resumed")
    o.add_argument("--output-dir", metavar="DIR", help="folder the study folder study_<date>_<time>/ is made in "
                   "(default: outputs)")
    o.add_argument("--study-name", metavar="NAME", help="study name inside the database (default zenithtune)")
    o.add_argument("--save-tuned", metavar="NAME", help="also write conf/tuned/NAME.yaml here, to commit")
    o.add_argument("--echo", action="store_true", help="stream each trial's output (always kept in trial.log)")
    o.add_argument("--dry-run", action="store_true", help="print the equivalent python -m zenithtune call and exit")
    o.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="any further Hydra override "
                   "(e.g. mbs_max=4 hydra/launcher=submitit_slurm)")

    a = sub.add_parser("apply", help="run the command once with the best or a tuned configuration",
                       formatter_class=_FMT, epilog=APPLY_EXAMPLES,
                       description="Run the training command once with a study's best or a tuned "
                                   "configuration injected.")
    src = a.add_mutually_exclusive_group(required=True)
    src.add_argument("--db-path", metavar="PATH", help="apply the best trial of this study (file, folder or URL)")
    src.add_argument("--tuned", metavar="NAME", help="apply conf/tuned/NAME.yaml (in this folder)")
    _add_shape(a)
    a.add_argument("--study-name", metavar="NAME", help="study name when the database holds several")
    a.add_argument("--timeout", type=float, metavar="SECONDS", help="limit for the run (default: none)")
    a.add_argument("--yes", action="store_true", help="without `-- command`: run the command stored in the study "
                   "(it is printed first; without --yes nothing runs)")
    a.add_argument("--dry-run", action="store_true", help="print the equivalent python -m zenithtune call and exit")
    a.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="any further Hydra override")

    z = sub.add_parser("analyze", help="tables, importances and plots of a study (running or finished)",
                       formatter_class=_FMT, epilog=ANALYZE_EXAMPLES,
                       description="Summarize a study: trials, best, best vs first, pruning, importances, plots.")
    z.add_argument("db_path", metavar="DB", help="study.db, its folder, or an Optuna storage URL")
    z.add_argument("--study-name", metavar="NAME", help="study name when the database holds several")
    z.add_argument("--all", action="store_true", help="also list the pruned (never launched) candidates")
    z.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    return p


def _add_shape(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", metavar="NAME", help="search space (conf/preset): megatron")
    p.add_argument("--args", action="append", metavar="K=V,...",
                   help="job keys: n_gpus, gbs, model, num_layers, num_query_groups, seq_length, mbs_max, "
                        "stage1_trials, gpu_memory_gb, ... (any key of conf/config.yaml)")




def _subcommand_not_first(own: Sequence[str]) -> str | None:
    """`zenithtune --preset megatron optimize ...`: argparse would say "invalid choice: 'megatron'"."""
    if not own or own[0] in SUBCOMMANDS or own[0] in ("-h", "--help"):
        return None
    sub = next((a for a in own if a in SUBCOMMANDS), None)
    if sub is None:
        return None
    rest = [a for a in own if a != sub]
    return f"put the subcommand first: zenithtune {sub} {shlex.join(rest)} ..."


def _require_shape(overrides: Sequence[str], command: Sequence[str] | None) -> None:
    """n_gpus and gbs, asked for in this CLI's own spelling; options typed after `--` are the command's."""
    given = {_key(o) for o in overrides}
    missing = [k for k in ("n_gpus", "gbs") if k not in given]
    if not missing:
        return
    ours = [w for w in (command or []) if w.split("=")[0] in _OUR_OPTIONS]
    if ours:
        raise UserError(f"{', '.join(sorted(set(w.split('=')[0] for w in ours)))} came after `--`, so it became "
                        f"part of the training command: put zenithtune's options before `--` "
                        f"(zenithtune optimize --preset megatron --args n_gpus=8,gbs=64 -- <command>)")
    raise UserError(f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} required: "
                    f"--args n_gpus=8,gbs=64 (the world size of one trial and the global batch size)")


# This CLI's options: found after `--` they were almost certainly meant for zenithtune.
_OUR_OPTIONS = ("--args", "--preset", "--strategy", "--n-trials", "--db-path", "--timeout", "--timeout-dynamic",
                "--save-tuned", "--study-name", "--output-dir")


def hydra_command(overrides: Sequence[str], command: Sequence[str] | None) -> str:
    return shlex.join(["python", "-m", "zenithtune", *overrides]) + (f" -- {shlex.join(command)}" if command else "")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    own, command = split_command(argv)
    parser = build_parser()
    misplaced = _subcommand_not_first(own)
    if misplaced:
        parser.error(misplaced)
    ns, extra = parser.parse_known_args(own)
    if ns.subcommand is None:
        parser.print_help()
        return 2
    sub = parser._subparsers._group_actions[0].choices[ns.subcommand]  # type: ignore[union-attr,index]
    if extra:
        sub.error(f"unrecognized arguments: {' '.join(extra)}")
    if command is not None and not command:
        sub.error("nothing after `--`: give the training command, e.g. -- torchrun ... pretrain_gpt.py ...")
    if ns.subcommand == "analyze":
        if command is not None:
            sub.error("analyze takes no command after `--`")
        from zenithtune.analyze import analyze

        try:
            return analyze(ns.db_path, study_name=ns.study_name, plots=not ns.no_plots, show_all=ns.all)
        except ZenithtuneError as e:
            sub.error(str(e))
    try:
        if ns.subcommand == "optimize":
            overrides, what = optimize_overrides(ns), None
            _require_shape(overrides, command)
        else:
            overrides, command, what = apply_overrides(ns, command)
    except ZenithtuneError as e:
        sub.error(str(e))
    if ns.dry_run:
        print(hydra_command(overrides, command))
        return 0
    if what:
        print(f"zenithtune: applying {what}", flush=True)
    from zenithtune.hydra_main import main as zenithtune_main

    with remember_invocation(own if ns.subcommand == "optimize" else None):
        return zenithtune_main(overrides + (["--", *command] if command else []))


if __name__ == "__main__":
    sys.exit(main())
