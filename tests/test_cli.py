"""`zenithtune optimize | apply | analyze` as a user runs them, on the built-in simulator.

The workflow tests drive the real console script (or `python -m zenithtune.cli` where it is not
installed) in a subprocess; translation and usage errors are checked in-process, by table.
"""
from __future__ import annotations

import io
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
import yaml
from fixtures.waiting import wait_for  # tests/ is on sys.path under pytest
from optuna.trial import TrialState

from zenithtune import cli
from zenithtune.overrides import remember_invocation, resume_command
from zenithtune.progress import Progress
from zenithtune.strategies import Outcome

SCRIPT = Path(sys.executable).with_name("zenithtune")
ZT = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "zenithtune.cli"]
# The simulator as a user's command: a Llama-3-8B-like GPT on 8 simulated H100s (the default command's shape).
SIM_ARGS = ["--num-layers=32", "--hidden-size=4096", "--ffn-hidden-size=14336", "--num-attention-heads=32",
            "--group-query-attention", "--num-query-groups=8", "--seq-length=8192", "--max-position-embeddings=8192",
            "--vocab-size=128256", "--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
            "--micro-batch-size=1", "--global-batch-size=64", "--train-iters=10", "--bf16",
            "--use-distributed-optimizer", "--log-throughput", "--sim-gpu=h100", "--sim-world-size=8"]
SIM = [sys.executable, "-m", "zenithtune.sim", *SIM_ARGS]
SHAPE = ["--preset", "megatron", "--args", "n_gpus=8,gbs=64"]


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("ZENITHTUNE_")}


def run(cwd: Path, *args: str, exe: list[str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*(exe or ZT), *args], cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout)


def load(db: Path) -> optuna.Study:
    return optuna.load_study(study_name="zenithtune", storage=f"sqlite:///{db}")


def launched(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    return [t for t in study.get_trials() if t.user_attrs.get("launched")]


def applied_argv(stdout: str) -> list[str]:
    """The exact argv a single run executed: the `# command:` header of the log it names."""
    log = re.search(r"\(log: (.+trial\.log)\)", stdout)
    assert log, stdout[-2000:]
    first = Path(log.group(1)).read_text().splitlines()[0]
    assert first.startswith("# command: ")
    return shlex.split(first[len("# command: "):])


def options(argv: list[str]) -> dict[str, object]:
    """--k=v, --k v and --flag of an argv as a dict (argv[0] = the program)."""
    out: dict[str, object] = {"argv0": argv[0]}
    i = 1
    while i < len(argv):
        a = argv[i]
        if a.startswith("--") and "=" in a:
            k, v = a.split("=", 1)
            out[k] = v
        elif a.startswith("--") and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            out[a] = argv[i + 1]
            i += 1
        else:
            out[a] = True
        i += 1
    return out


# --- translation, by table (in-process, instant) -------------------------------------------------
def _overrides(argv: list[str]) -> list[str]:
    ns, extra = cli.build_parser().parse_known_args(["optimize", *argv])
    assert not extra
    return cli.optimize_overrides(ns)


@pytest.mark.parametrize("argv, expected", [
    (["--preset", "megatron", "--args", "n_gpus=8,gbs=64", "--n-trials", "50", "--timeout-dynamic"],
     ["-m", "preset=megatron", "n_gpus=8", "gbs=64", "n_trials=50", "timeout_dynamic=true"]),
    (["--args", "n_gpus=8,gbs=64,model=Qwen/Qwen3-30B-A3B,num_layers=48", "--strategy", "megatron-staged-blackbox"],
     ["-m", "n_gpus=8", "gbs=64", "model=Qwen/Qwen3-30B-A3B", "num_layers=48", "strategy=staged_blackbox"]),
    (["--args", "n_gpus=16", "--args", "gbs=128,mbs_max=4,stage1_trials=10,num_query_groups=8",
      "--strategy", "heuristic", "--timeout", "900"],
     ["-m", "n_gpus=16", "gbs=128", "mbs_max=4", "stage1_trials=10", "num_query_groups=8", "strategy=heuristic",
      "timeout=900"]),
    (["--strategy", "megatron-heuristic", "--save-tuned", "llama8b", "--study-name", "s1", "--echo"],
     ["-m", "strategy=heuristic", "study_name=s1", "save_tuned=llama8b", "echo=true"]),
    (["--strategy", "grid", "--db-path", "/data/my runs/study.db", "mbs_max=2"],
     ["-m", "strategy=grid", "storage='/data/my runs/study.db'", "mbs_max=2"]),
    (["--output-dir", "/runs", "--timeout-dynamic", "--timeout-dynamic-factor", "2", "--timeout-dynamic-floor", "30"],
     ["-m", "timeout_dynamic=true", "timeout_dynamic_factor=2", "timeout_dynamic_floor=30",
      "hydra.sweep.dir='/runs/study_${zt.started:%Y%m%d_%H%M%S}'"]),
])
def test_seed_options_become_hydra_overrides(argv, expected):
    assert _overrides(argv) == expected


def test_db_path_may_be_the_study_folder_or_a_url(tmp_path):
    assert _overrides(["--db-path", str(tmp_path)]) == ["-m", f"storage={tmp_path / 'study.db'}"]
    assert _overrides(["--db-path", "postgresql://u@h/db"]) == ["-m", "storage=postgresql://u@h/db"]


@pytest.mark.parametrize("argv, message", [
    (["optimize", "--bogus"], "unrecognized arguments: --bogus"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
    (["optimize", "--strategy", "simulated-annealing"], "is not a strategy: choose one of"),
    (["optimize", "--preset", "jax"], "is not a preset"),
    (["optimize", "--args", "n_gpu=8"], "unknown key 'n_gpu'; did you mean n_gpus=8?"),
    (["optimize", "--args", "xyzzy=8"], "unknown key 'xyzzy'; known keys: n_gpus, gbs"),
    (["optimize", "--args", "n_gpus"], "is not key=value"),
    (["optimize", "--n-trials", "many"], "invalid int value"),
    (["optimize", "--"], "nothing after `--`"),
    (["apply"], "one of the arguments --db-path --tuned is required"),
    (["apply", "--tuned", "nope"], "no conf/tuned/nope.yaml"),
    (["apply", "--db-path", "missing/study.db"], "no such study database"),
    (["--preset", "megatron", "optimize", "--args", "n_gpus=8,gbs=64"],
     "put the subcommand first: zenithtune optimize --preset megatron --args n_gpus=8,gbs=64"),
    (["optimize", "--preset", "megatron", "--", "python", "train.py", "--args", "n_gpus=8,gbs=64"],
     "--args came after `--`, so it became part of the training command"),
    (["optimize", "--args", "n_gpus=8"], "gbs is required: --args n_gpus=8,gbs=64"),
    (["optimize", "--args", "n_gpus=8,gbs=64", "--timeout", "-5"], "--timeout -5 must be a positive number"),
])
def test_usage_errors_are_one_line_and_exit_2(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("sub, shows", [
    ("optimize", ["--preset", "--args", "--strategy", "--n-trials", "--timeout-dynamic", "--db-path",
                  "--output-dir", "--save-tuned", "examples:", "megatron-staged-blackbox", "fastest successful"]),
    ("apply", ["--db-path", "--tuned", "--args", "examples:", "python -m zenithtune tuned="]),
    ("analyze", ["DB", "--all", "examples:", "optuna-dashboard"]),
])
def test_help_shows_options_and_examples(sub, shows, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main([sub, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for s in shows:
        assert s in out, s


def test_resume_command_is_pasteable_in_the_syntax_typed():
    with remember_invocation(["optimize", "--args", "n_gpus=8,gbs=64", "--output-dir", "o", "--db-path=x.db"]):
        assert resume_command("/r/study.db", [], [], ["python", "train.py", "--x", "a b"]) == \
            "zenithtune optimize --args n_gpus=8,gbs=64 --db-path /r/study.db -- python train.py --x 'a b'"
    assert resume_command("/r/study.db", ["n_gpus=8", "gbs=64", "storage=old.db"],
                          ["hydra.searchpath=[file:///c]", "hydra/launcher=basic"], None) == \
        "python -m zenithtune -m n_gpus=8 gbs=64 hydra/launcher=basic storage=/r/study.db"


# --- progress -------------------------------------------------------------------------------------
def _feed(p: Progress) -> None:
    p.launching(0, {"tp": 2, "pp": 1}, "largest TP in a node", 1)
    p.result(Outcome({"tp": 2, "pp": 1}, "complete", value=400.0, launched=True, duration=12.0), 1)
    p.skipped(Outcome({"tp": 1}, "pruned"))
    p.launching(2, {"tp": 1, "pp": 1}, "largest TP in a node", 2)
    p.result(Outcome({"tp": 1, "pp": 1}, "failed", kind="timeout", reasons=["timed out after 9 s"], launched=True,
                     duration=9.0), 2)
    p.close()


def test_progress_plain_lines_when_not_a_terminal():
    out = io.StringIO()
    _feed(Progress(total=3, metric="TFLOP/s/GPU", direction="maximize", out=out))
    lines = out.getvalue().splitlines()
    assert "\x1b" not in out.getvalue()  # no terminal codes in a log
    assert lines[0] == "  why: largest TP in a node"  # a repeated reason is shown once
    assert lines[1].startswith("[1/3] trial 0  tp=2 pp=1 -> 400 TFLOP/s/GPU  best 400  (12.0 s, 0:00:0")
    assert lines[2].startswith("[2/3] trial 2  tp=1 pp=1 -> timeout: timed out after 9 s  best 400  (9.0 s, ")
    assert len(lines) == 3


def test_progress_bar_with_eta_in_a_terminal():
    out = io.StringIO()
    _feed(Progress(total=3, metric="TFLOP/s/GPU", direction="maximize", out=out, interactive=True))
    text = out.getvalue()
    assert "[1/3] trial 0  tp=2 pp=1 -> 400 TFLOP/s/GPU" in text and "-> timeout" in text
    assert "ETA" in text and "1/3" in text and "best 400" in text


# --- the workflow on the simulator ---------------------------------------------------------------
@pytest.fixture(scope="module")
def seed_study(tmp_path_factory):
    """zenithtune optimize in the seed's syntax, with a tuned config saved for git."""
    cwd = tmp_path_factory.mktemp("work")
    r = run(cwd, "optimize", *SHAPE, "--strategy", "grid", "--n-trials", "3", "--db-path", "runs/seed/study.db",
            "--save-tuned", "llama8b_8xh100")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return cwd, cwd / "runs" / "seed" / "study.db", r


def test_optimize_writes_the_study_best_yaml_and_a_tuned_config(seed_study):
    cwd, db, r = seed_study
    assert "Traceback" not in r.stderr
    assert re.search(r"^\[1/3\] trial \d+ .* -> [\d.]+ TFLOP/s/GPU  best [\d.]+  \([\d.]+ s, \d:\d\d:\d\d\)$",
                     r.stdout, re.M), r.stdout
    study = load(db)
    assert len([t for t in launched(study) if t.state == TrialState.COMPLETE]) == 3
    assert sorted(p.name for p in db.parent.glob("trial_*")) == sorted(f"trial_{t.number}" for t in launched(study))
    best = yaml.safe_load((db.parent / "best.yaml").read_text())
    tuned_path = cwd / "conf" / "tuned" / "llama8b_8xh100.yaml"
    text = tuned_path.read_text()
    tuned = yaml.safe_load(text)
    assert list(tuned) == ["n_gpus", "gbs", "params", "evaluator", "result"]  # small, stable key order
    assert tuned["params"] == best["params"] == study.best_trial.user_attrs["candidate"]
    assert (tuned["n_gpus"], tuned["gbs"]) == (8, 64)
    head = "\n".join(line for line in text.splitlines() if line.startswith("#"))
    for fact in (f"{study.best_value:g} TFLOP/s/GPU", "n_gpus=8 gbs=64", "strategy grid", str(db.relative_to(cwd)),
                 "# command (before injection): python -m zenithtune.sim --num-layers=32", "tuned=llama8b_8xh100"):
        assert fact in head, fact
    assert str(cwd) not in text  # paths relative to the working directory: nothing machine-specific committed
    assert "--tensor-model-parallel-size" not in head  # the command is stored without the injected options
    assert f"zenithtune analyze {db}" in r.stdout


def test_seed_syntax_and_hydra_syntax_produce_the_same_study(seed_study, tmp_path):
    _, seed_db, _ = seed_study
    r = run(tmp_path, "-m", "preset=megatron", "n_gpus=8", "gbs=64", "strategy=grid", "n_trials=3",
            "storage=hydra/study.db", exe=[sys.executable, "-m", "zenithtune"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "hydra" / "best.yaml").is_file() and (tmp_path / "hydra" / "trial_0").is_dir()

    def facts(db: Path) -> list[tuple]:
        return [(t.number, t.state, t.value, t.user_attrs.get("candidate"), t.user_attrs.get("argv")[3:])
                for t in load(db).get_trials()]  # argv[0..2]: the interpreter path of each entry point

    assert facts(seed_db) == facts(tmp_path / "hydra" / "study.db")


def test_analyze_prints_the_summary_and_writes_pictures(seed_study):
    cwd, db, _ = seed_study
    r = run(cwd, "analyze", str(db.parent))
    assert r.returncode == 0, r.stderr
    out = r.stdout
    for s in ("3 trials", "TFLOP/s/GPU", "launched 3: 3 complete", "pruned before launch", "best: trial",
              "best vs first launched trial", "parameter importances", "optuna-dashboard sqlite:///"):
        assert s in out, s
    for name in ("history.png", "importances.png", "parallel.png", "timeline.png"):
        png = db.parent / name
        assert png.is_file() and png.stat().st_size > 1000, name
        assert png.read_bytes()[:4] == b"\x89PNG"


def test_analyze_one_line_errors(tmp_path):
    r = run(tmp_path, "analyze", "nowhere/study.db")
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "no such study database" in r.stderr
    optuna.create_study(study_name="zenithtune", storage=f"sqlite:///{tmp_path / 'empty.db'}")
    r = run(tmp_path, "analyze", "empty.db")
    assert r.returncode == 1 and "has no trials yet" in r.stderr and "Traceback" not in r.stderr


def test_apply_from_the_db_runs_the_best_trials_argv(seed_study):
    cwd, db, _ = seed_study
    best = load(db).best_trial
    r = run(cwd, "apply", "--db-path", str(db))  # no command: the study's own
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"applying trial {best.number} of {db}" in r.stdout
    assert "iteration       10/      10" in r.stdout  # the command's output is streamed
    assert applied_argv(r.stdout) == best.user_attrs["argv"]


def test_apply_a_committed_tuned_config_both_spellings(seed_study):
    cwd, db, _ = seed_study
    best = load(db).best_trial
    r = run(cwd, "apply", "--tuned", "llama8b_8xh100")  # no command: the config's default, as in the study
    assert r.returncode == 0, r.stderr[-3000:]
    assert applied_argv(r.stdout) == best.user_attrs["argv"]
    r = run(cwd, "tuned=llama8b_8xh100", exe=[sys.executable, "-m", "zenithtune"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert applied_argv(r.stdout)[1:] == best.user_attrs["argv"][1:]  # [0]: this entry point's interpreter
    # The command a user copies from the tuned config's header, given explicitly: same options.
    text = (cwd / "conf" / "tuned" / "llama8b_8xh100.yaml").read_text()
    plain = shlex.split(re.search(r"^# command \(before injection\): (.+)$", text, re.M).group(1))
    r = run(cwd, "apply", "--tuned", "llama8b_8xh100", "--", *plain)
    assert r.returncode == 0, r.stderr[-3000:]
    # the same options with the same values; the re-added ones come last, as `--k v`; the header names
    # the interpreter `python` (no machine's path in a committed file)
    applied, study = options(applied_argv(r.stdout)), options(best.user_attrs["argv"])
    assert applied.pop("argv0") == "python" and Path(study.pop("argv0")).is_absolute()
    assert applied == study


def test_apply_returns_the_commands_exit_code(seed_study):
    cwd, _, _ = seed_study
    r = run(cwd, "apply", "--tuned", "llama8b_8xh100", "--", sys.executable, "-c",
            "import sys; print('ran', sys.argv[1:3]); sys.exit(3)")
    assert r.returncode == 3
    assert "\nran ['--tensor-model-parallel-size', '" in r.stdout, r.stdout  # its output, live


SLOW_NTH = """\
import os, sys, pathlib
# The simulator, paced by --sim-time-scale: the launch numbered by the counter file's value is slow.
counter = pathlib.Path(sys.argv[1])
n = int(counter.read_text()) if counter.exists() else 0
counter.write_text(str(n + 1))
scale = {scales}.get(n, "0.001")
os.execv(sys.executable, [sys.executable, "-m", "zenithtune.sim", *sys.argv[2:], "--sim-time-scale", scale])
"""


def test_timeout_dynamic_cuts_a_far_slower_trial(tmp_path):
    # launch 0 is fast; launch 1 would sleep ~30 s (0.2 x the simulated wall time); launch 2 is fast.
    (tmp_path / "slow.py").write_text(SLOW_NTH.format(scales={1: "0.2"}))
    r = run(tmp_path, "optimize", *SHAPE, "--strategy", "grid", "--n-trials", "3", "--db-path", "s/study.db",
            "--timeout-dynamic", "--timeout-dynamic-factor", "5", "--timeout-dynamic-floor", "3",
            "--", sys.executable, "slow.py", "count", *SIM_ARGS)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    trials = launched(load(tmp_path / "s" / "study.db"))
    assert [t.state for t in trials] == [TrialState.COMPLETE, TrialState.FAIL, TrialState.COMPLETE]
    assert "timeout" not in trials[0].user_attrs  # the first trial is never cut by the dynamic rule
    cut = trials[1]
    limit = max(3.0, 5 * trials[0].user_attrs["duration"])
    assert cut.user_attrs["kind"] == "timeout"
    assert cut.user_attrs["timeout"] == pytest.approx(limit, abs=0.1)
    assert cut.user_attrs["duration"] < limit + 7  # SIGTERM, grace, gone: far below the 30 s it wanted
    assert "dynamic limit" in cut.user_attrs["reasons"][0]
    assert re.search(r"\[2/3\] trial \d+ .* -> timeout: cut at the dynamic limit [\d.]+ s", r.stdout)


def test_sigint_mid_trial_then_resume_completes_the_study(tmp_path):
    (tmp_path / "slow.py").write_text(SLOW_NTH.format(scales={1: "0.3"}))  # launch 1 runs long: Ctrl-C it
    db = tmp_path / "r" / "study.db"
    args = ["optimize", *SHAPE, "--strategy", "grid", "--n-trials", "3", "--db-path", "r/study.db",
            "--", sys.executable, "slow.py", "count", *SIM_ARGS]
    out = tmp_path / "out.txt"
    with out.open("w") as f:
        proc = subprocess.Popen([*ZT, *args], cwd=tmp_path, env=_env(), stdout=f, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: (tmp_path / "count").exists() and (tmp_path / "count").read_text() == "2", 60,
                  "the second trial to start")
        live = run(tmp_path, "analyze", "r/study.db")  # a study that is still running
        assert live.returncode == 0, live.stderr
        assert re.search(r"still running: trial \d+ in progress", live.stdout)
        assert (tmp_path / "r" / "timeline.png").stat().st_size > 1000
        proc.send_signal(signal.SIGINT)  # what Ctrl-C sends to the tuner (the trial has its own group)
        assert proc.wait(timeout=30) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
    text = out.read_text()
    assert "interrupted" in text and "best: trial" in text, text[-3000:]
    lines = text.splitlines()
    hint = lines[next(i for i, line in enumerate(lines) if line.startswith("resume")) + 1]
    assert hint.strip().startswith("zenithtune optimize") and f"--db-path {db}" in hint
    before = load(db).get_trials()
    done_before = {t.number: (t.value, t.datetime_complete) for t in before if t.state == TrialState.COMPLETE}
    assert len(done_before) == 1
    assert [t.user_attrs.get("kind") for t in before if t.state == TrialState.FAIL] == ["interrupted"]
    assert not _sims_running_in(tmp_path)  # the trial's whole process group is gone
    stopped = run(tmp_path, "analyze", "r/study.db", "--no-plots")  # an interrupted study
    assert stopped.returncode == 0 and "launched 2: 1 complete, 1 interrupted" in stopped.stdout, stopped.stdout

    resumed = run(tmp_path, *shlex.split(hint.strip())[1:])  # the printed command, as pasted
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "resumed with" in resumed.stdout
    after = load(db).get_trials()
    for number, (value, finished) in done_before.items():  # nothing finished is lost or re-run
        assert (after[number].value, after[number].datetime_complete) == (value, finished)
    complete = [t for t in after if t.state == TrialState.COMPLETE]
    keys = [tuple(sorted(t.user_attrs["candidate"].items())) for t in complete]
    assert len(complete) == 3 and len(set(keys)) == 3  # n_trials counts the whole study, no repeats
    interrupted = next(t for t in after if t.user_attrs.get("kind") == "interrupted")
    assert interrupted.user_attrs["candidate"] in [t.user_attrs["candidate"] for t in complete]  # retried


def _sims_running_in(cwd: Path) -> list[str]:
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if os.readlink(proc / "cwd") == str(cwd) and b"zenithtune.sim" in (proc / "cmdline").read_bytes():
                found.append(proc.name)
        except OSError:
            continue
    return found
