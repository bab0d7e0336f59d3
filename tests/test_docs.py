"""The newcomer-facing text: --help, and (below) every rendered output block of README.md and docs/."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _help(cwd: Path) -> str:
    res = subprocess.run([sys.executable, "-m", "zenithtune", "--help"], cwd=cwd, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    return res.stdout


def test_help_shows_usage_examples_groups_and_keys(tmp_path: Path) -> None:
    (tmp_path / "conf" / "tuned").mkdir(parents=True)
    (tmp_path / "conf" / "tuned" / "llama8b_8xh100.yaml").write_text("# @package _global_\nparams: {tp: 2}\n")
    out = _help(tmp_path)
    assert out.startswith("zenithtune: find the fastest")
    assert "powered by Hydra" not in out  # not Hydra's stock header
    assert "python -m zenithtune -m [key=value ...]" in out          # -m for a study
    assert "[-- COMMAND ...]" in out and "-- torchrun --nproc-per-node 8" in out
    assert "strategy: grid, heuristic, random, staged_blackbox, tpe, upstream" in out
    assert "evaluator: megatron_throughput, regex, swift_speed" in out
    assert "tuned: llama8b_8xh100" in out                          # the user's own tuned configs
    assert "n_gpus, gbs" in out and "n_trials" in out and "save_tuned=NAME" in out
    assert len(out.splitlines()) < 60  # a screen, not a config dump


def test_help_without_tuned_configs_says_how_to_make_one(tmp_path: Path) -> None:
    assert "tuned: (none yet: save_tuned=NAME writes conf/tuned/NAME.yaml)" in _help(tmp_path)
