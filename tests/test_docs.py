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
    assert "evaluator: iteration_time, megatron_throughput, regex, swift_speed" in out
    assert "tuned: llama8b_8xh100" in out                          # the user's own tuned configs
    assert "n_gpus, gbs" in out and "n_trials" in out and "save_tuned=NAME" in out
    assert len(out.splitlines()) < 60  # a screen, not a config dump


def test_help_without_tuned_configs_says_how_to_make_one(tmp_path: Path) -> None:
    assert "tuned: (none yet: save_tuned=NAME writes conf/tuned/NAME.yaml)" in _help(tmp_path)


# --- rendered output blocks (docs/render.py) -------------------------------------------------------
sys.path.insert(0, str(ROOT / "docs"))
import pytest  # noqa: E402
import render  # noqa: E402  (docs/render.py: the script that writes the blocks)


def test_render_keeps_line_ranges_and_normalises_volatile_parts(tmp_path: Path) -> None:
    assert render.keep([str(i) for i in range(1, 8)], "1-2,-2") == ["1", "2", "...", "6", "7"]
    text = (f"{tmp_path}/outputs/study_20991231_235959/study.db {sys.executable} -m x\n"
            "[1/5] trial 0  tp=2 -> 530.6 TFLOP/s/GPU  best 530.6  (1.7 s, 0:03:12)\n"
            " [2025-01-01 08:00:41] iteration 1\n# made 2099-12-31 23:59 by strategy heuristic")
    assert render.normalise(text, tmp_path).split("\n") == [
        "/tmp/demo/outputs/study_20261129_101500/study.db python -m x",
        "[1/5] trial 0  tp=2 -> 530.6 TFLOP/s/GPU  best 530.6  (0.2 s, 0:00:01)",
        " [2025-01-01 08:00:41] iteration 1",  # simulated time: stable, kept
        "# made 2026-11-29 10:15 by strategy heuristic"]


@pytest.mark.slow
@pytest.mark.parametrize("doc", [p.name for p in render.DOCS if render.parse(p.read_text())],
                         ids=lambda name: name)
def test_rendered_blocks_match_what_the_commands_print(doc: str) -> None:
    path = next(p for p in render.DOCS if p.name == doc)
    problems = render.render(path, check=True)
    assert not problems, "\n\n".join(problems)
