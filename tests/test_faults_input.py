"""Hostile input a user hands the tuner: evaluator settings, tuned files, damaged or read-only studies,
numbers that are not numbers, commands too long for the environment. Each is one line or a right
answer, never a traceback (issue 21)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_faults import FAKE, SHAPE_ARGS, _env, _tuned, zt  # tests/ is on sys.path under pytest


def _one_line(r: subprocess.CompletedProcess, expected: str) -> None:
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert "Traceback" not in r.stdout + r.stderr, r.stderr[-3000:]
    assert r.stderr.startswith("zenithtune: error: ") and len(r.stderr.strip().splitlines()) == 1, r.stderr[-3000:]
    assert expected in r.stderr, r.stderr


# --- item 6: evaluator settings, a parameter of the wrong type, a damaged study db -------------------
@pytest.mark.parametrize("args, expected", [
    (["evaluator.selector=bogus"], "selector 'bogus' is not one of last, mean, median, harmonic"),
    (["evaluator.skip_first=-1"], "skip_first=-1 must be a whole number >= 0"),
    (["evaluator=regex", "evaluator.pattern=\"(\""], "evaluator pattern '(' is not a valid regular expression"),
    (["evaluator=regex", "evaluator.pattern=abc"], "evaluator pattern 'abc' has 0 group(s) but group=1"),
])
def test_a_bad_evaluator_setting_is_one_line(tmp_path, args, expected):
    _one_line(zt(tmp_path, "-m", "n_gpus=8", "gbs=64", "n_trials=1", *args), expected)
    assert not list(tmp_path.glob("outputs/*/study.db"))  # refused before the study exists


def test_a_parameter_of_the_wrong_type_is_one_line_and_runs_nothing(tmp_path):
    _tuned(tmp_path, "semi", "n_gpus: 8\ngbs: 64\nparams: {tp: '1; touch pwned', pp: 1}\n")
    r = zt(tmp_path, "tuned=semi", "--", sys.executable, FAKE, "--counter", "count", *SHAPE_ARGS)
    _one_line(r, "params.tp='1; touch pwned' is not a value tp can take; it takes one of 1, 2, 4, 8")
    r = zt(tmp_path, "n_gpus=8", "gbs=64", "+params.tp=\"1; x\"", "--", sys.executable, FAKE, "--counter", "count",
           *SHAPE_ARGS)
    _one_line(r, "params.tp='1; x' is not a value tp can take")
    assert not (tmp_path / "count").exists() and not (tmp_path / "pwned").exists()


def _study(tmp_path: Path) -> Path:
    r = zt(tmp_path, "-m", "n_gpus=8", "gbs=64", "strategy=grid", "n_trials=3", "storage=s/study.db",
           "--", sys.executable, FAKE, *SHAPE_ARGS)
    assert r.returncode == 0, r.stderr[-2000:]
    return tmp_path / "s" / "study.db"


def test_a_study_db_with_a_damaged_page_is_one_line(tmp_path):
    db = _study(tmp_path)
    size = db.stat().st_size
    with db.open("r+b") as f:  # 4 KB of garbage in the middle: the header still says SQLite
        f.seek(size // 2 - 2048)
        f.write(b"\xa5" * 4096)
    r = zt(tmp_path, "-m", "n_gpus=8", "gbs=64", "strategy=grid", "n_trials=5", "storage=s/study.db",
           "--", sys.executable, FAKE, *SHAPE_ARGS)
    # where the garbage lands depends on the db's size: a damaged page, or the first page (no longer a
    # SQLite file); either way one line naming the file (the full CI run once saw the second)
    _one_line(r, str(db))
    assert f"{db} is damaged (" in r.stderr or f"{db} is not a SQLite database" in r.stderr, r.stderr
    r = subprocess.run([sys.executable, "-m", "zenithtune.cli", "analyze", str(db)], cwd=tmp_path, env=_env(),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and str(db) in r.stderr and len(r.stderr.strip().splitlines()) == 1 and \
        "Traceback" not in r.stderr, r.stderr[-3000:]


# --- item 5: analyze reads a study kept in a read-only folder -----------------------------------------
def _read_only(folder: Path) -> list[str]:
    """A command prefix that sees `folder` read-only: a read-only bind mount for root (who ignores
    permissions), the folder's permissions otherwise."""
    if os.geteuid() != 0:
        folder.chmod(0o555)
        for f in folder.iterdir():
            f.chmod(0o444)
        return []
    if not shutil.which("unshare") or subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode:
        pytest.skip("root without mount namespaces: cannot make a read-only folder")
    return ["unshare", "-m", "sh", "-c", f"mount --bind {folder} {folder} && mount -o remount,bind,ro {folder} "
                                         f"&& exec \"$@\"", "sh"]


def test_analyze_reads_a_study_in_a_read_only_folder(tmp_path):
    db = _study(tmp_path)
    before = db.read_bytes()
    prefix = _read_only(db.parent)
    r = subprocess.run([*prefix, sys.executable, "-m", "zenithtune.cli", "analyze", "--no-plots", str(db)],
                       cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "best: trial" in r.stdout and "3 complete" in r.stdout, r.stdout[-2000:]
    assert db.read_bytes() == before
    # with plots on: what cannot be written is one line each, the analysis itself is whole
    r = subprocess.run([*prefix, sys.executable, "-m", "zenithtune.cli", "analyze", str(db)],
                       cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stdout[-2000:] + r.stderr[-2000:]
    assert "best: trial" in r.stdout and "no report.html: cannot write" in r.stdout, r.stdout[-2000:]
    assert not (db.parent / "report.html").exists()


def test_a_finished_study_leaves_its_db_whole_and_unmerged_writes_are_one_line_when_read_only(tmp_path):
    # A sqlite study's writes sit in its -wal file until the last connection closes; a read-only reader
    # cannot merge them and saw a db without tables (CI: "attempt to write a readonly database"). A study
    # closes its connections when it ends, so nothing is left to merge; a -wal that is (a study still
    # running, or killed) is one line when the folder is read-only.
    import sqlite3
    db = _study(tmp_path)
    assert not db.with_name("study.db-wal").exists()
    conn = sqlite3.connect(db)  # a study still writing: its -wal holds what the file does not
    try:
        conn.execute("PRAGMA wal_autocheckpoint=0")
        conn.execute("CREATE TABLE pending (x)")
        conn.commit()
        assert db.with_name("study.db-wal").stat().st_size > 0
        r = subprocess.run([*_read_only(db.parent), sys.executable, "-m", "zenithtune.cli", "analyze", "--no-plots",
                            str(db)], cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=120)
    finally:
        conn.close()
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert f"{db} has writes not yet merged from study.db-wal" in r.stderr and "copy the folder" in r.stderr, r.stderr


# --- items 3 and 4: a tuned file is small and holds plain values; nothing in it resolves -------------
def test_a_huge_tuned_file_is_refused_before_it_is_parsed(tmp_path):
    _tuned(tmp_path, "big", "n_gpus: 8\ngbs: 64\nparams: {tp: 2}\nresult:\n"
           + "".join(f"  k{i}: {i}\n" for i in range(200_000)))  # 3.4 MB
    _one_line(zt(tmp_path, "tuned=big", "--", sys.executable, FAKE, *SHAPE_ARGS), "big.yaml is 3.4 MB")
    r = subprocess.run([sys.executable, "-m", "zenithtune.cli", "apply", "--tuned", "big", "--", sys.executable, FAKE,
                        *SHAPE_ARGS], cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "big.yaml is 3.4 MB" in r.stderr and "a tuned config holds a few parameters" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr[-2000:]


@pytest.mark.parametrize("body", ["params: {tp: '${zt.mkdir:%s}'}", "params: {tp: 2}\nresult: {study: '${zt.mkdir:%s}'}"])
def test_a_resolver_in_a_tuned_file_never_runs(tmp_path, body):
    made = tmp_path / "made_by_the_file"
    _tuned(tmp_path, "mk", "n_gpus: 8\ngbs: 64\n" + body % made)
    _one_line(zt(tmp_path, "tuned=mk", "--", sys.executable, FAKE, *SHAPE_ARGS), "holds an interpolation")
    _one_line(zt(tmp_path, "n_gpus=8", "gbs=64", f"+params.tp=${{zt.mkdir:{made}}}", "--", sys.executable, FAKE,
                 *SHAPE_ARGS), "a parameter value is a plain number or word, not an interpolation")
    assert not made.exists()


# --- item 7: a too-short timeout before anything exists; a command longer than one environment string ---
@pytest.mark.parametrize("arg", ["timeout=0.001", "timeout_dynamic_floor=0.04"])
def test_a_timeout_too_short_to_start_anything_is_refused_before_the_study(tmp_path, arg):
    r = zt(tmp_path, "-m", "n_gpus=8", "gbs=64", "n_trials=2", "storage=s/study.db", "timeout_dynamic=true", arg)
    _one_line(r, f"{arg} s is shorter than any training command takes to start: give seconds, at least 1")
    assert not (tmp_path / "s").exists()


def test_a_command_of_300_kb_runs(tmp_path):
    """Each environment string is capped at 128 KiB by Linux: the command used to travel in one."""
    notes = [f"--note-{i}=" + "x" * 1000 for i in range(300)]
    r = zt(tmp_path, "-m", "n_gpus=8", "gbs=64", "strategy=grid", "n_trials=1", "storage=s/study.db",
           "--", sys.executable, FAKE, "--counter", "count", *SHAPE_ARGS, *notes)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "1 complete" in r.stdout and (tmp_path / "count").exists()
    log = (tmp_path / "s" / "trial_0" / "trial.log").read_text()
    assert notes[-1] in log.splitlines()[0]  # the whole command, as given, reached the trial


# --- the two front ends mixed up ------------------------------------------------------------------------
@pytest.mark.parametrize("args, expected", [
    (["n_gpus=8", "gbs=64", "nproc8"], "`nproc8` is not an override (key=value) nor a subcommand"),
    (["-m", "n_gpus=8", "analyze"], "`analyze` is a subcommand of the original CLI: put it first"),
])
def test_a_word_that_is_no_override_is_one_line(tmp_path, args, expected):
    _one_line(zt(tmp_path, *args), expected)
    assert not list(tmp_path.glob("outputs/*/study.db"))


def test_python_m_zenithtune_runs_the_original_subcommands(tmp_path):
    db = _study(tmp_path)
    r = zt(tmp_path, "analyze", "--no-plots", str(db))
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert "best: trial" in r.stdout and "launched 3" in r.stdout
    r = zt(tmp_path, "analyze", "--help")
    assert r.returncode == 0 and r.stdout.startswith("usage: zenithtune analyze"), r.stdout[:500] + r.stderr[-2000:]
    # Hydra's options that take a value keep working (`--cfg job` is not a bare word)
    r = zt(tmp_path, "--cfg", "job", "n_gpus=8", "gbs=64")
    assert r.returncode == 0 and "n_gpus: 8" in r.stdout, r.stderr[-2000:]
