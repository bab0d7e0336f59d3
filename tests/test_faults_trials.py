"""What a trial leaves behind when things go wrong around it: a stop signal right after it finished, a
bug in the entry function, a multi-rank crash, a metric below the printed precision (issue 21)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState
from test_faults import FAKE, REPO, SHAPE_ARGS, _env, zt  # tests/ is on sys.path under pytest

from zenithtune.record import read_run
from zenithtune.run import FailureKind, classify, run

FIXTURES = REPO / "tests" / "fixtures"


def _trials(db: Path) -> list[optuna.trial.FrozenTrial]:
    return optuna.load_study(study_name="zenithtune", storage=f"sqlite:///{db}").get_trials()


# --- item 8: a bug inside the entry function keeps its traceback, and the table says where -------------
def test_an_exception_in_the_entry_function_keeps_its_traceback_in_trial_log(tmp_path):
    path = os.pathsep.join([str(FIXTURES), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = {**_env(), "PYTHONPATH": path, "ZENITHTUNE_TRUSTED_TARGETS": "buggy_evaluator.*"}
    r = subprocess.run([sys.executable, "-m", "zenithtune", "-m", "n_gpus=8", "gbs=64", "strategy=grid", "n_trials=1",
                        "storage=s/study.db", "evaluator._target_=buggy_evaluator.Buggy",
                        "--", sys.executable, FAKE, *SHAPE_ARGS], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=180)
    log = tmp_path / "s" / "trial_0" / "trial.log"
    assert f"crash: KeyError: 'bug'; traceback in {log}" in r.stdout, r.stdout[-3000:]
    text = log.read_text()
    assert "Traceback (most recent call last)" in text and 'buggy_evaluator.py", line' in text, text[-3000:]
    assert text.rstrip().endswith("KeyError: 'bug'")
    (trial,) = _trials(tmp_path / "s" / "study.db")
    assert trial.user_attrs["kind"] == "crash" and str(log) in trial.user_attrs["reasons"][0]


# --- item 1: a stop signal landing just after a trial finished keeps its result -------------------------
def test_sigterm_just_after_a_trial_finished_keeps_its_result(tmp_path):
    counter = tmp_path / "count"
    r = zt(tmp_path, "-m", "n_gpus=8", "gbs=64", "strategy=grid", "n_trials=3", "storage=s/study.db",
           "--", sys.executable, FAKE, "--counter", str(counter), "--term-tuner-at", "0", *SHAPE_ARGS)
    assert r.returncode == 143, r.stdout[-3000:] + r.stderr[-3000:]
    assert "Traceback" not in r.stdout + r.stderr, r.stderr[-3000:]
    trials = _trials(tmp_path / "s" / "study.db")
    first, measured = trials[0], read_run(tmp_path / "s" / "trial_0" / "trial.json")
    assert measured is not None and measured.value  # what the trial reported before the signal
    assert first.state == TrialState.COMPLETE and first.value == measured.value, (first.state, first.user_attrs)
    assert not [t for t in trials if t.state == TrialState.RUNNING]
    best = tmp_path / "s" / "best.yaml"
    assert best.is_file() and f"score: {measured.value}" in best.read_text()
    # A resume (the same command: the launch counter is past 0 now) does not run it again.
    r = zt(tmp_path, "-m", "n_gpus=8", "gbs=64", "strategy=grid", "n_trials=2", "storage=s/study.db",
           "--", sys.executable, FAKE, "--counter", str(counter), "--term-tuner-at", "0", *SHAPE_ARGS)
    assert r.returncode == 0, r.stderr[-2000:]
    done = [t for t in _trials(tmp_path / "s" / "study.db") if t.state == TrialState.COMPLETE]
    assert len(done) == 2 and done[0].params != done[1].params


# --- item 15: a multi-rank crash is explained by rank 0's error, not rank 1's echo of it ----------------
CRASH = [sys.executable, str(FIXTURES / "torchrun_crash.py")]
REAL_ERROR = "[rank0]: ValueError: the dataset index file /data/gpt_text_document.idx is truncated"


@pytest.mark.parametrize("flags", [[], ["--echo-first"], ["--no-root-cause"], ["--no-root-cause", "--echo-first"]])
def test_a_multi_rank_crash_names_the_root_cause_rank_s_error(flags):
    res = run([*CRASH, *flags], log_path=None, timeout=60)
    kind, reason = classify(res)  # type: ignore[misc]
    assert kind == FailureKind.CRASH and reason.startswith(f"exit code 1: {REAL_ERROR}"), reason


def test_a_study_shows_the_real_error_of_a_torchrun_crash(tmp_path):
    r = zt(tmp_path, "-m", "n_gpus=8", "gbs=64", "strategy=grid", "n_trials=1", "fail_fast=1", "storage=s/study.db",
           "--", *CRASH, *SHAPE_ARGS)
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
    assert f"-> crash: exit code 1: {REAL_ERROR}" in r.stdout, r.stdout[-2000:]
    assert "Connection closed by peer" not in _trials(tmp_path / "s" / "study.db")[0].user_attrs["reasons"][0]


# --- a rank aborting after Megatron's training loop finished: the measured run is kept, with a note ---------
def test_a_crash_in_the_teardown_after_training_keeps_the_trial_s_score(tmp_path):
    """Real Megatron-LM on 2 CPU ranks lost a grid run so (benchmarks/real_megatron.py): all iterations
    printed, "[after training is done]", then "terminate called without an active exception" and exit 1."""
    replay = FIXTURES / "megatron_cpu_replay.py"
    r = zt(tmp_path, "-m", "n_gpus=2", "gbs=8", "strategy=grid", "n_trials=2", "gpu_memory_gb=16",
           "evaluator=iteration_time", "storage=s/study.db", "preset.params.tp.values=[1]", "preset.params.pp.values=[1]",
           "preset.params.cp.values=[1]", "preset.params.mbs.values=[1,4]", "preset.params.recompute_granularity.values=[none]",
           "--", sys.executable, str(replay), "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
           "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "1", "--global-batch-size",
           "8", "--vocab-size", "1024", "--zt-teardown-crash")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "-> crash" not in r.stdout, r.stdout[-3000:]
    assert ("-> 26.9179 samples/s/GPU (scored, though it failed after its training loop: exit code 1 after "
            "Megatron's [after training is done]: terminate called without an active exception") in r.stdout, r.stdout
    trials = _trials(tmp_path / "s" / "study.db")
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 2
    # the replay's samples/s/GPU for tp1 pp1 mbs 1 and 4 (tests/fixtures/megatron_cpu_replay.py)
    assert sorted(round(t.value, 1) for t in trials) == [9.4, 26.9], [t.value for t in trials]
    late = read_run(tmp_path / "s" / "trial_0" / "trial.json").late_failure  # type: ignore[union-attr]
    assert late == ("exit code 1 after Megatron's [after training is done]: terminate called without an active "
                    "exception; the training loop had finished"), late
    assert trials[0].user_attrs["late_failure"] == late
    assert "mbs=4" in next(line for line in r.stdout.splitlines() if line.startswith("best:"))


# --- item 17: a metric below the printed precision stops the study at once, with the evaluator that works ---
def test_throughput_below_the_printed_precision_stops_after_one_launch_with_the_hint(tmp_path):
    command = ["--", sys.executable, FAKE, "--counter", "count", "--tiny", *SHAPE_ARGS]
    r = zt(tmp_path, "-m", "n_gpus=8", "gbs=64", "n_trials=10", "storage=s/study.db", *command)
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
    assert len((tmp_path / "count").read_text().splitlines()) == 1  # one launch, not fail_fast=5
    assert "zenithtune: error: all 1 launched trials failed (bad_metric: 1)" in r.stderr
    assert "printed TFLOP/s/GPU as 0 (below the printed precision), as every candidate would: rerun with " \
           "evaluator=iteration_time" in r.stderr, r.stderr
    # The hint works, on the same study: scored by the iteration time, it has a best.
    r = zt(tmp_path, "-m", "n_gpus=8", "gbs=64", "n_trials=3", "storage=s/study.db", "evaluator=iteration_time", *command)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "samples/s/GPU" in (tmp_path / "s" / "best.yaml").read_text()
