"""A new user's first hour (issue 21): what a typo, the help's group list and the error lines say."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


def zt(cwd: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZENITHTUNE_")}
    return subprocess.run([sys.executable, "-m", "zenithtune", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.parametrize("typo,line", [
    ("n_trails=5", "zenithtune: error: n_trails=5: n_trails is not a zenithtune key; did you mean n_trials=5?"),
    ("gpu_memory=40", "zenithtune: error: gpu_memory=40: gpu_memory is not a zenithtune key; did you mean gpu_memory_gb=40?"),
    ("strategi=grid", "zenithtune: error: strategi=grid: strategi is not a zenithtune key; did you mean strategy=grid?"),
    ("xyzzy.a=1", "zenithtune: error: xyzzy.a=1: xyzzy is not a zenithtune key; the keys are listed by python -m zenithtune --help"),
])
def test_a_misspelled_key_is_one_line_naming_the_closest_key(tmp_path, typo, line):
    r = zt(tmp_path, "-m", "n_gpus=8", "gbs=64", typo, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip() == line  # not Hydra's five lines ending in the advice `+n_trails=5`
    assert not (tmp_path / "outputs").exists()


@pytest.mark.parametrize("args,line", [
    (["evaluator=xyz"], "zenithtune: error: evaluator=xyz is not an evaluator: choose one of"),
    (["tuned=nosuch"], "zenithtune: error: tuned=nosuch is not a tuned config (./conf/tuned/NAME.yaml): "
                       "there is none yet (save_tuned=NAME writes conf/tuned/NAME.yaml)"),
])
def test_an_unknown_group_option_reads_as_english(tmp_path, args, line):
    r = zt(tmp_path, "-m", "n_gpus=8", "gbs=64", *args, timeout=120)
    assert r.returncode == 2 and r.stderr.startswith(line), r.stderr


@pytest.mark.slow
def test_baseline_is_chosen_like_the_other_groups(tmp_path):
    """--help lists `baseline: stock_tpe` next to `strategy: ...`; `baseline=stock_tpe` runs it (the `+`
    spelling still works)."""
    assert "baseline: stock_tpe" in zt(tmp_path, "--help", timeout=120).stdout
    r = zt(tmp_path, "-m", "baseline=stock_tpe", "n_gpus=8", "gbs=64", "n_trials=2")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("stock hydra/sweeper=optuna (TPESampler): 2 trials"), r.stdout
    r = zt(tmp_path, "-m", "+baseline=stock_tpe", "n_gpus=8", "gbs=64", "n_trials=2")
    assert r.returncode == 0 and "stock hydra/sweeper=optuna" in r.stdout, r.stderr
