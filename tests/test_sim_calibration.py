"""The simulator's throughput against published Megatron numbers (MEGATRON.md §Calibration)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from zenithtune.sim.calibrate import ROWS, simulated

DENSE_H100 = [row for row in ROWS if row.source == "h100"]


def test_every_dense_h100_row_of_the_table_is_calibrated():
    assert [row.published for row in DENSE_H100] == [408.8, 465.9, 489.1, 459.6, 419.7, 432.8]


@pytest.mark.parametrize("row", ROWS, ids=[row.name for row in ROWS])
def test_simulated_throughput_is_within_tolerance_of_published(row):
    sim, res = simulated(row)
    assert res.kind == "ok", res.stderr[-300:]
    assert abs(sim / row.published - 1) <= row.tolerance, f"{row.name}: simulated {sim:.1f}, published {row.published}"
    if row.source == "h100":
        assert row.tolerance == 0.15


def test_calibrate_prints_the_table():
    out = subprocess.run([sys.executable, "-m", "zenithtune.sim.calibrate"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("| model | GPUs | published TFLOP/s/GPU | simulated | ratio |")
    assert len(lines) == 2 + len(ROWS)
    assert "| GPT 1.7B TP1 | 64 | 408.8 |" in out.stdout
