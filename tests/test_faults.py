"""Faults a user's environment throws at the tuner: stop signals, hostile stored inputs, bad values.

Each test drives `python -m zenithtune` (or the `zenithtune` CLI) in a subprocess as a user would and
asserts what they see: the exit code, the one-line error, what the study recorded.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
from fixtures.waiting import wait_for  # tests/ is on sys.path under pytest
from optuna.trial import TrialState

REPO = Path(__file__).resolve().parents[1]
FAKE = str(REPO / "tests" / "fixtures" / "fake_trainer.py")
# A Llama-3-8B-like shape so the space has something to search (the fake trainer ignores it).
SHAPE_ARGS = ["--num-layers=32", "--hidden-size=4096", "--ffn-hidden-size=14336", "--num-attention-heads=32",
              "--group-query-attention", "--num-query-groups=8", "--seq-length=8192",
              "--max-position-embeddings=8192", "--vocab-size=128256", "--swiglu", "--bf16",
              "--use-distributed-optimizer", "--log-throughput"]


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("ZENITHTUNE_")}


def zt(cwd: Path, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zenithtune", *args], cwd=cwd, env=_env(),
                          capture_output=True, text=True, timeout=timeout)


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


# --- issue 10 item 1: SIGTERM / SIGHUP take Ctrl-C's path ------------------------------------------
@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGHUP, 129)])
def test_sigterm_and_sighup_stop_the_trial_record_it_and_write_best_yaml(tmp_path, sig, code):
    counter = tmp_path / "count"
    args = ["-m", "n_gpus=8", "gbs=64", "strategy=grid", "n_trials=3", "storage=r/study.db",
            "--", sys.executable, FAKE, "--counter", str(counter), "--hang-at", "1", *SHAPE_ARGS]
    out = tmp_path / "out.txt"
    with out.open("w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "zenithtune", *args], cwd=tmp_path, env=_env(),
                                stdout=f, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: counter.exists() and len(counter.read_text().splitlines()) == 2, 90,
                  "the second trial to start")
        hung = int(counter.read_text().splitlines()[1])
        time.sleep(0.5)
        proc.send_signal(sig)  # what scancel / kill / timeout (SIGTERM) or an ssh drop (SIGHUP) sends
        assert proc.wait(timeout=30) == code, out.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    text = out.read_text()
    assert "Traceback" not in text, text[-3000:]
    assert "resume" in text and "storage=" in text, text[-3000:]
    assert not _alive(hung)  # the running trial's process was killed with the tuner
    assert (tmp_path / "r" / "best.yaml").is_file()  # the first trial completed: a best exists
    trials = optuna.load_study(study_name="zenithtune", storage=f"sqlite:///{tmp_path / 'r' / 'study.db'}").get_trials()
    assert not [t for t in trials if t.state == TrialState.RUNNING]
    stopped = [t for t in trials if t.user_attrs.get("kind") == "interrupted"]
    assert len(stopped) == 1 and signal.Signals(sig).name in stopped[0].user_attrs["reasons"][0]


# --- issue 10 item 9: storage a user points at, one line each; a foreign study is never written -----
def _foreign(path: Path) -> None:
    s = optuna.create_study(storage=f"sqlite:///{path}", study_name="zenithtune", direction="maximize")
    s.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=2)


def _multi(path: Path) -> None:
    optuna.create_study(storage=f"sqlite:///{path}", study_name="zenithtune", directions=["maximize", "minimize"])


def _garbage(path: Path) -> None:
    path.write_bytes(os.urandom(5000))


def _truncated(path: Path) -> None:
    _foreign(path)
    with path.open("r+b") as f:
        f.truncate(3000)


def _content(db: Path) -> bytes | list[str]:
    """What the database holds (every table's rows, as SQL): opening it in WAL mode, as every zenithtune
    storage is opened, rewrites header bytes without writing any data. A file that is no database
    is compared byte for byte."""
    import sqlite3

    try:
        with sqlite3.connect(db) as conn:
            return list(conn.iterdump())
    except sqlite3.DatabaseError:
        return db.read_bytes()


@pytest.mark.parametrize("make, storage, expected", [
    (_foreign, "db/study.db", "was not made by zenithtune"),
    (_multi, "db/study.db", "is multi-objective"),
    (_garbage, "db/study.db", "is not a SQLite database"),
    (_truncated, "db/study.db", "cannot open sqlite storage"),
    (None, "foo://bar", "storage=foo://bar is not a storage URL zenithtune can open"),
])
def test_a_storage_that_is_not_ours_is_one_line_and_left_untouched(tmp_path, make, storage, expected):
    db = tmp_path / "db" / "study.db"
    db.parent.mkdir()
    if make:
        make(db)
    before = _content(db) if db.exists() else None
    r = zt(tmp_path, "-m", "n_gpus=8", "gbs=64", "n_trials=1", f"storage={storage}")
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert r.stderr.startswith("zenithtune: error: ") and expected in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stdout
    if before is not None:
        assert _content(db) == before  # nothing was asked, told or written into it


# --- issue 10 item 7: resume refuses another command or model, naming what differs -------------------
def test_resume_refuses_another_command_or_model_but_not_other_injected_options(tmp_path):
    base = ["-m", "n_gpus=8", "gbs=64", "strategy=grid", "n_trials=1", "storage=r/study.db"]
    r = zt(tmp_path, *base, "--", sys.executable, FAKE, *SHAPE_ARGS)
    assert r.returncode == 0, r.stderr[-2000:]
    other = [a if a != "--num-layers=32" else "--num-layers=48" for a in SHAPE_ARGS]
    r = zt(tmp_path, *base[:-2], "n_trials=2", "storage=r/study.db", "--", sys.executable, FAKE, *other)
    assert r.returncode == 2 and "made for another command" in r.stderr, r.stderr
    assert "--num-layers=32" in r.stderr and "--num-layers=48" in r.stderr
    model = str(REPO / "tests" / "fixtures" / "models" / "Meta-Llama-3-8B")
    r = zt(tmp_path, *base, f"model={model}", "--", sys.executable, FAKE, *SHAPE_ARGS)
    assert r.returncode == 2 and "made for model=None" in r.stderr and "Meta-Llama-3-8B" in r.stderr, r.stderr
    # What the tuner injects itself (TP, MBS, ...) does not make it another command.
    r = zt(tmp_path, *base[:-2], "n_trials=2", "storage=r/study.db",
           "--", sys.executable, FAKE, *SHAPE_ARGS, "--tensor-model-parallel-size", "4", "--micro-batch-size=2")
    assert r.returncode == 0 and "resumed with" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]


# --- issue 10 item 6: a study db or tuned file brings only parameters --------------------------------
def _tuned(tmp_path: Path, name: str, text: str) -> None:
    (tmp_path / "conf" / "tuned").mkdir(parents=True, exist_ok=True)
    (tmp_path / "conf" / "tuned" / f"{name}.yaml").write_text("# @package _global_\n" + text)


def test_a_tuned_file_that_sets_a_command_or_hydra_settings_is_refused(tmp_path):
    _tuned(tmp_path, "evil", "n_gpus: 8\ngbs: 64\nparams: {tp: 2}\ncommand: [bash, -c, 'touch pwned']\n"
                             "hydra: {job: {env_set: {LD_PRELOAD: /tmp/x.so}}}\n")
    r = zt(tmp_path, "tuned=evil", "--", sys.executable, FAKE, *SHAPE_ARGS)
    assert r.returncode == 2 and "also sets command, hydra" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "pwned").exists()


def test_tuned_parameters_megatron_rejects_are_refused_with_the_rule(tmp_path):
    _tuned(tmp_path, "tp3", "n_gpus: 8\ngbs: 64\nparams: {tp: 3, pp: 1}\n")
    r = zt(tmp_path, "tuned=tp3", "--", sys.executable, FAKE, "--counter", "count", *SHAPE_ARGS)
    assert r.returncode == 2 and "world size (8) is not divisible by tensor model parallel size (3)" in r.stderr, r.stderr
    assert not (tmp_path / "count").exists()  # nothing was launched
    r = zt(tmp_path, "n_gpus=8", "gbs=64", "+params.nosuch=1", "--", sys.executable, FAKE, *SHAPE_ARGS)
    assert r.returncode == 2 and "params.nosuch is not a parameter" in r.stderr, r.stderr


def test_apply_never_replays_a_stored_command_or_hydra_settings(tmp_path):
    r = zt(tmp_path, "-m", "n_gpus=8", "gbs=64", "strategy=grid", "n_trials=1", "storage=r/study.db",
           "--", sys.executable, FAKE, *SHAPE_ARGS)
    assert r.returncode == 0, r.stderr[-2000:]
    study = optuna.load_study(study_name="zenithtune", storage=f"sqlite:///{tmp_path / 'r' / 'study.db'}")
    meta = dict(study.user_attrs["zenithtune"])
    evil = ["bash", "-c", "touch pwned"]
    meta["overrides"] = meta["overrides"] + ["command=[bash,-c,'touch pwned2']",
                                             "++hydra.job.env_set.LD_PRELOAD=/tmp/x.so"]
    meta["command"] = evil
    study.set_user_attr("zenithtune", meta)
    cli = [sys.executable, "-m", "zenithtune.cli", "apply", "--db-path", "r/study.db"]
    # Without `--`: the stored command is shown, and nothing runs without --yes.
    r = subprocess.run(cli, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "bash -c 'touch pwned'" in r.stderr and "--yes" in r.stderr, r.stderr
    # With an explicit command: that command runs, the stored Hydra settings and command= are not replayed.
    r = subprocess.run([*cli, "--", sys.executable, FAKE, "--counter", "count", *SHAPE_ARGS], cwd=tmp_path,
                       env=_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "not replayed" in r.stderr and "command" in r.stderr and "hydra.job.env_set.LD_PRELOAD" in r.stderr
    assert (tmp_path / "count").exists() and "LD_PRELOAD" not in r.stdout
    assert not (tmp_path / "pwned").exists() and not (tmp_path / "pwned2").exists()


# --- issue 14 item 11: exhaustive means all ------------------------------------------------------------
def test_grid_is_never_stopped_by_proposals_it_cannot_launch():
    from hydra import compose, initialize_config_module
    from omegaconf import open_dict

    from zenithtune import settings
    from zenithtune.job import build_job
    from zenithtune.loop import Launched, StudyLoop

    with initialize_config_module("zenithtune.conf"):
        cfg = compose("config", overrides=["n_gpus=8", "gbs=32", "strategy=grid", "strategy.order=space",
                                           "mbs_max=4", "gpu_memory_gb=30"])
    with open_dict(cfg):
        cfg.command = [sys.executable, "-m", "zenithtune.sim", "--num-layers=12", "--hidden-size=2048",
                       "--num-attention-heads=16", "--group-query-attention", "--num-query-groups=4",
                       "--seq-length=4096", "--vocab-size=32000", "--log-throughput", "--sim-world-size=8"]
    job = build_job(settings.load(cfg))
    launchable = [c for c in job.space.walk() if job.assess(c).launchable]
    assert 0 < len(launchable) < len(list(job.space.walk()))  # some candidates are screened out
    study = optuna.create_study(direction="maximize", sampler=job.strategy.sampler())
    loop = StudyLoop(job, study, lambda n, cand, t: Launched(100.0 + n), max_consecutive_skips=1)
    loop.start([])
    why = loop.run(10_000)
    assert why.startswith("strategy exhausted")
    assert len([o for o in loop.outcomes if o.launched]) == len(launchable)  # every launchable one, once


# The simulator paced so each trial lasts seconds: the study is still running whenever the signal lands,
# however fast the machine (unpaced, a 2-trial study can end before a 2 s signal on a fast machine).
PACED_SIM = [sys.executable, "-m", "zenithtune.sim", "--num-layers=32", "--hidden-size=4096",
             "--ffn-hidden-size=14336", "--num-attention-heads=32", "--group-query-attention", "--num-query-groups=8",
             "--seq-length=8192", "--max-position-embeddings=8192", "--vocab-size=128256", "--swiglu",
             "--disable-bias-linear", "--micro-batch-size=1", "--global-batch-size=64", "--train-iters=10", "--bf16",
             "--use-distributed-optimizer", "--log-throughput", "--sim-world-size=8", "--sim-time-scale=0.1"]


@pytest.mark.parametrize("after", [0.5, 2.0, "trial"])
def test_a_stop_signal_at_any_moment_is_one_line_and_128_plus_signal(tmp_path, after):
    """Importing (0.5 s), composing / building the job or the first trial (2 s), inside a trial (signalled
    on the event: the line saying why the first trial is launched, so a busy machine cannot make it early)."""
    proc = subprocess.Popen([sys.executable, "-m", "zenithtune", "-m", "n_gpus=8", "gbs=64", "n_trials=3", "--",
                             *PACED_SIM], cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    head = ""
    if after == "trial":
        assert proc.stdout is not None
        for line in proc.stdout:  # the first trial starts right after its why-line; paced, it runs for seconds
            head += line
            if line.startswith("  why:"):
                break
    else:
        time.sleep(float(after))
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    out = head + out
    # Before the handler is installed (importing), the default action ends it (-15): nothing started yet.
    assert proc.returncode in (143, -signal.SIGTERM) and "Traceback" not in out, out[-3000:]
    assert proc.returncode == -signal.SIGTERM or "SIGTERM" in out, out[-3000:]
    if after == "trial" or "\n  why:" in out:  # a trial had begun: recorded as interrupted, resume hint printed
        assert "1 interrupted)" in out, out[-3000:]
        assert "interrupted: the tuner received SIGTERM; the running trial's process group was stopped" in out
        assert "storage=" in out.splitlines()[-1]
    elif "done (interrupted)" in out:  # the study had begun, no trial yet (a busy machine): nothing lost, resumable
        assert "done (interrupted): 0 launched" in out and "storage=" in out.splitlines()[-1], out[-3000:]


# A stop arriving while the garbage collector runs a weakref callback (sqlalchemy's, in a CI run): Python
# cannot let the KeyboardInterrupt out of the callback, printed "Exception ignored ... Traceback" and lost it.
GC_STOP = """
import gc, os, signal, sys, weakref
from zenithtune import signals

class Thing:
    pass

def callback(ref):
    os.kill(os.getpid(), signal.SIGTERM)
    for _ in range(1000):  # the handler runs at a bytecode boundary: here, inside the callback
        pass

with signals.handled(), signals.armed():
    thing = Thing()
    ref = weakref.ref(thing, callback)
    del thing
    gc.collect()
    print("held:", signals.pending(), flush=True)
    try:
        signals.check()
    except KeyboardInterrupt:
        print("raised at the loop's next step:", signals.reason(), flush=True)
"""


def test_a_stop_the_garbage_collector_swallows_is_held_then_raised_without_a_traceback():
    out = subprocess.run([sys.executable, "-c", GC_STOP], env=_env(), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "Traceback" not in out.stderr and "Exception ignored" not in out.stderr, out.stderr
    assert "held: True" in out.stdout, out.stdout
    assert "raised at the loop's next step: interrupted: the tuner received SIGTERM" in out.stdout, out.stdout


def test_a_model_config_with_a_negative_size_is_one_line(tmp_path):
    import json

    config = json.loads((REPO / "tests" / "fixtures" / "models" / "Meta-Llama-3-8B" / "config.json").read_text())
    config["num_hidden_layers"] = -3
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    r = zt(tmp_path, "-m", "n_gpus=8", "gbs=64", "n_trials=1", f"model={tmp_path / 'm'}")
    assert r.returncode == 2 and "num_layers=-3 is not a valid size" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not list(tmp_path.glob("outputs/*/trial_*"))


def test_an_unwritable_study_folder_is_one_line(tmp_path):
    (tmp_path / "blocker").write_text("a file where the study folder should go\n")
    r = zt(tmp_path, "-m", "n_gpus=8", "gbs=64", "n_trials=1", "hydra.sweep.dir=blocker/study")
    assert r.returncode == 2 and "cannot write the study folder" in r.stderr, r.stdout[-2000:] + r.stderr
    assert "Traceback" not in r.stdout + r.stderr


# --- issue 10 item 1: a tuner killed with SIGKILL leaves its trial running; the resume kills it -----
def test_a_resumed_study_kills_what_a_killed_tuner_left_running(tmp_path):
    counter = tmp_path / "count"
    args = ["-m", "n_gpus=8", "gbs=64", "strategy=grid", "n_trials=3", "storage=r/study.db",
            "heartbeat_interval=1", "heartbeat_grace=2",
            "--", sys.executable, FAKE, "--counter", str(counter), "--hang-at", "1", *SHAPE_ARGS]
    proc = subprocess.Popen([sys.executable, "-m", "zenithtune", *args], cwd=tmp_path, env=_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_for(lambda: counter.exists() and len(counter.read_text().splitlines()) == 2, 90,
                  "the second trial to start")
        orphan = int(counter.read_text().splitlines()[1])
        proc.kill()  # SIGKILL: no handler runs, the trial's process outlives the tuner
        proc.wait(timeout=30)
        assert _alive(orphan)
        r = zt(tmp_path, *args)  # the same command: its launch counter is past the hang now
        assert r.returncode == 0, r.stderr[-2000:]
        assert not _alive(orphan)  # found by its trial marker and killed before the study went on
    finally:
        if proc.poll() is None:
            proc.kill()
    trials = optuna.load_study(study_name="zenithtune", storage=f"sqlite:///{tmp_path / 'r' / 'study.db'}").get_trials()
    assert not [t for t in trials if t.state == TrialState.RUNNING]
    assert [t for t in trials if t.user_attrs.get("launched") and t.state == TrialState.FAIL]  # the stale one
