"""Issue 19 item 1d: a trial's spread is recorded with it, and stop_when_stable ends a trial whose metric
is stable (a success, not a timeout), with the time it saved in the study footer."""
from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState
from test_faults import REPO, SHAPE_ARGS, zt  # tests/ is on sys.path under pytest

from zenithtune.app import stable_rule
from zenithtune.evaluate import IterationTime, MegatronThroughput, NoMetric, SwiftSpeed, TrainingClock, spread, stable
from zenithtune.progress import saved_line
from zenithtune.record import Attr, Launched, Outcome, facts, outcome_of, read_run
from zenithtune.run import classify, run
from zenithtune.settings import StableConf

STABLE = str(REPO / "tests" / "fixtures" / "stable_trainer.py")


def meg(it: int, tflops: float, ms: float = 100.0, total: int = 10) -> str:
    return (f" [2026-11-29 10:15:00] iteration {it:8d}/{total:8d} | consumed samples: {it * 64:12d} | "
            f"elapsed time per iteration (ms): {ms} | throughput per GPU (TFLOP/s/GPU): {tflops} | "
            f"global batch size:    64 |")


# --- pure functions, by tables -------------------------------------------------------------------
@pytest.mark.parametrize("values, expected", [
    ([100.0, 100.0, 100.0], 0.0),
    ([98.0, 100.0, 102.0], 0.02),          # median 100, deviations 2, 0, 2 -> MAD 2
    ([100.0, 101.0, 99.0, 100.0, 150.0], 0.01),  # one slow-down outlier barely moves it
    ([100.0], None),                        # one value: no spread
    ([], None),
])
def test_spread_is_mad_over_median(values: list[float], expected: float | None) -> None:
    assert spread(values) == (None if expected is None else pytest.approx(expected))


@pytest.mark.parametrize("values, k, within, expected", [
    ([50.0, 100.0, 101.0, 100.0], 3, 0.02, True),   # the warm-up value is not among the last 3
    ([50.0, 100.0, 101.0], 3, 0.02, False),         # it is
    ([100.0, 103.0, 100.0], 3, 0.02, False),        # 3 % from the median
    ([100.0, 103.0, 100.0], 3, 0.05, True),
    ([100.0, 100.0], 3, 0.02, False),               # fewer than k values: never
    ([100.0] * 5, 0, 0.02, False),                  # k=0: off
])
def test_stable_needs_the_last_k_values_within_x_of_their_median(values, k, within, expected) -> None:
    assert stable(values, k, within) is expected


def test_megatron_throughput_scores_the_median_after_warm_up_by_default() -> None:
    # few logged values, the first one warm-up: the median of all four would lean on it (402.5), the last
    # value alone on one interval; the default drops it and takes the median of the rest
    out = "\n".join([meg(1, 300.0), meg(2, 400.0), meg(3, 410.0), meg(4, 405.0)])
    ev = MegatronThroughput()
    assert ev.evaluate(out) == 405.0 and ev.kept() == [400.0, 410.0, 405.0] and ev.kept(2) == [410.0, 405.0]
    assert MegatronThroughput(skip_first=0).evaluate(out) == 402.5
    with pytest.raises(NoMetric, match="found 1 TFLOP/s/GPU value\\(s\\) but skip_first=1 drops them all"):
        MegatronThroughput().evaluate(meg(1, 300.0))  # a single logged value is warm-up: refused, not scored
    it = IterationTime(64, 8, skip_first=1)
    it.evaluate(out)
    assert it.kept() == [80.0, 80.0, 80.0]  # 64 samples / 0.1 s / 8 GPUs each


def test_swift_keeps_its_per_interval_speeds() -> None:
    ev = SwiftSpeed()
    ev.evaluate("{'iteration': '1/10', 'train_speed(s/it)': 10.0}\n{'iteration': '2/10', 'train_speed(s/it)': 6.0}\n")
    assert ev.kept() == [10.0, 2.0]


@pytest.mark.parametrize("lines, expected", [
    ([meg(4, 1.0, ms=200.0, total=1000), meg(5, 1.0, ms=100.0, total=1000), meg(6, 1.0, ms=100.0, total=1000)],
     994 * 0.1),                                    # (M - N) x the median iteration time
    ([meg(10, 1.0, total=10)], 0.0),               # ran to its end
    (["no iteration lines at all"], None),
])
def test_training_clock_estimates_the_time_left(lines: list[str], expected: float | None) -> None:
    clock = TrainingClock()
    for line in lines:
        clock.feed(line)
    assert clock.left_s() == (None if expected is None else pytest.approx(expected))


# --- records ------------------------------------------------------------------------------------
def test_spread_and_early_stop_go_through_the_study_record_sanitised(tmp_path: Path) -> None:
    study = optuna.create_study(storage=f"sqlite:///{tmp_path / 'db'}")
    trial = study.ask()
    o = Outcome({"tp": 1}, "complete", 100.0, launched=True,
                **facts(Launched(100.0, spread=0.0123456, n_values=4, stopped_after=4, saved_s=99.64)))
    from zenithtune.record import store
    store(trial, o)
    study.tell(trial, 100.0)
    back = outcome_of(study.trials[0])
    assert back is not None
    assert (back.spread, back.n_values, back.stopped_after, back.saved_s) == (0.01235, 4, 4, 99.6)
    bad = study.ask()  # a study db is untrusted: nonsense reads back as unknown
    for key, value in ((Attr.SPREAD, "x"), (Attr.N_VALUES, -1), (Attr.STOPPED_AFTER, True), (Attr.SAVED_S, float("inf"))):
        bad.set_user_attr(key, value)
    study.tell(bad, 1.0)
    back = outcome_of(study.trials[1])
    assert back is not None and (back.spread, back.n_values, back.stopped_after, back.saved_s) == (None,) * 4


def test_footer_line_sums_the_time_saved() -> None:
    stopped = [Outcome({}, "complete", 1.0, launched=True, stopped_after=4, saved_s=s) for s in (99.6, 60.0, None)]
    assert saved_line(stopped[:2]) == ("stop_when_stable: 2 trials stopped once stable, about 0:02:39 of trial "
                                       "time saved (their iterations left x median iteration time)")
    assert "1 without 'iteration N/ M' lines not counted" in saved_line(stopped)
    assert saved_line(stopped[2:]).endswith("time saved unknown (no 'iteration N/ M' lines with an iteration time)")


# --- run(): the trainer is stopped as a timeout would be, and the run is a success ------------------
def test_a_stable_metric_stops_a_command_that_would_hang(tmp_path: Path) -> None:
    ev = MegatronThroughput()
    ev.begin()
    # the warm-up value (skipped), an outlier, then three stable values; then the trainer sleeps for an
    # hour: only the rule ends it
    res = run([sys.executable, STABLE, "--values", "10,50,100,101,100", "--hang"], log_path=tmp_path / "trial.log",
              timeout=600, on_line=ev.feed, enough=stable_rule(StableConf(k=3, within=0.02), ev))
    assert res.stopped_early == ("stop_when_stable: the last 3 of 4 TFLOP/s/GPU values after warm-up lie "
                                 "within 2.0% of their median")
    assert not res.timed_out and not res.interrupted and res.succeeded and classify(res) is None
    assert ev.result() == 105.0  # median of 52.5, 105, 106.0, 105 (the fixture's scale 1.05)
    log = (tmp_path / "trial.log").read_text()
    assert "# zenithtune: stop_when_stable: the last 3 of 4" in log and "# result: stopped early after" in log


def test_an_unstable_metric_runs_to_its_end(tmp_path: Path) -> None:
    ev = MegatronThroughput()
    ev.begin()
    res = run([sys.executable, STABLE, "--values", "10,50,100,130,80,120"], log_path=tmp_path / "trial.log",
              timeout=600, on_line=ev.feed, enough=stable_rule(StableConf(k=3, within=0.02), ev))
    assert res.stopped_early is None and res.returncode == 0 and classify(res) is None
    assert ev.result() == 105.0 and len(ev.kept()) == 5


def test_stop_when_stable_off_is_no_rule() -> None:
    assert stable_rule(StableConf(k=0), MegatronThroughput()) is None


# --- a study ------------------------------------------------------------------------------------
def _trials(db: Path) -> list[optuna.trial.FrozenTrial]:
    return optuna.load_study(study_name="zenithtune", storage=f"sqlite:///{db}").get_trials()


def _printed(log: Path) -> list[float]:
    return [float(line.split("(TFLOP/s/GPU): ")[1].split()[0]) for line in log.read_text().splitlines()
            if "(TFLOP/s/GPU): " in line and not line.startswith("#")]


def test_a_study_stops_stable_trials_records_them_complete_and_reports_the_time_saved(tmp_path: Path) -> None:
    r = zt(tmp_path, "-m", "n_gpus=8", "gbs=64", "strategy=grid", "n_trials=2", "storage=s/study.db",
           "stop_when_stable.k=3", "--", sys.executable, STABLE, "--values", "10,50,100,101,100", "--hang", *SHAPE_ARGS)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    trials = _trials(tmp_path / "s" / "study.db")
    assert len(trials) >= 2
    launched = [t for t in trials if t.user_attrs.get("launched")]
    assert len(launched) == 2
    for t in launched:
        log = tmp_path / "s" / f"trial_{t.number}" / "trial.log"
        assert t.state == TrialState.COMPLETE and "kind" not in t.user_attrs, t.user_attrs
        assert t.value == statistics.median(_printed(log)[1:])  # the median of what it printed after warm-up
        assert t.user_attrs["stopped_after"] == 4 and t.user_attrs["n_values"] == 4
        assert t.user_attrs["saved_s"] == pytest.approx(99.5)  # (1000 - 5) iterations x 100 ms
        info = read_run(log.with_name("trial.json"))
        assert info is not None and info.note is not None and info.note.startswith("stopped early after 4 values, ")
        written = json.loads(log.with_name("trial.json").read_text())
        printed = _printed(log)[1:]
        mid = statistics.median(printed)
        assert written["stopped_after"] == 4 and written["n_values"] == 4
        assert written["spread"] == pytest.approx(statistics.median(abs(v - mid) for v in printed) / mid)
        assert t.user_attrs["spread"] == pytest.approx(written["spread"], abs=1e-5)
    assert "stop_when_stable: 2 trials stopped once stable, about 0:03:19 of trial time saved" in r.stdout, r.stdout  # 2 x 99.5 s
    assert re.search(r"\[1/2\] trial 0 .* -> [\d.]+ TFLOP/s/GPU \(stopped once stable after 4 values\)", r.stdout)


def test_a_study_runs_an_unstable_trial_to_its_end(tmp_path: Path) -> None:
    r = zt(tmp_path, "-m", "n_gpus=8", "gbs=64", "strategy=grid", "n_trials=1", "storage=s/study.db",
           "stop_when_stable.k=3", "--", sys.executable, STABLE, "--values", "10,50,100,130,80,120", *SHAPE_ARGS)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (t,) = [t for t in _trials(tmp_path / "s" / "study.db") if t.user_attrs.get("launched")]
    assert t.state == TrialState.COMPLETE and "stopped_after" not in t.user_attrs and t.user_attrs["n_values"] == 5
    assert "stop_when_stable:" not in r.stdout


@pytest.mark.parametrize("override, message", [
    ("stop_when_stable.k=1", "stop_when_stable.k=1 must be 0 (off) or a whole number >= 2"),
    ("stop_when_stable.within=1.5", "stop_when_stable.within=1.5 must be a fraction between 0 and 1"),
])
def test_bad_stop_when_stable_values_are_one_line(tmp_path: Path, override: str, message: str) -> None:
    r = zt(tmp_path, "-m", "n_gpus=8", "gbs=64", "n_trials=1", override)
    assert r.returncode != 0 and message in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr


def test_analyze_shows_the_spread_and_the_early_stop() -> None:
    from rich.console import Console

    from zenithtune.analyze import _table

    rows = [Outcome({"tp": 1}, "complete", 105.0, launched=True, trial_number=0, spread=0.0123, n_values=4,
                    stopped_after=4, duration=0.5),
            Outcome({"tp": 2}, "failed", kind="oom", reasons=["CUDA out of memory"], launched=True, trial_number=1)]
    console = Console(width=200, record=True, file=open("/dev/null", "w"))  # noqa: SIM115
    console.print(_table(rows, rows[0], "TFLOP/s/GPU"))
    text = console.export_text()
    header = next(line for line in text.splitlines() if "TFLOP/s/GPU" in line)
    assert header.index("TFLOP/s/GPU") < header.index("spread") < header.index("failure / reason")
    assert "1.2%" in text and "stopped once stable after 4 values (stop_when_stable)" in text
    old = [Outcome({"tp": 1}, "complete", 105.0, launched=True, trial_number=0)]  # recorded before spreads were
    console.print(_table(old, old[0], "TFLOP/s/GPU"))
    assert "spread" not in console.export_text()


def test_a_trial_stopped_early_sets_no_dynamic_time_limit() -> None:
    """Its short wall time says nothing about how long a whole run takes: were it the fastest success,
    timeout_dynamic would cut the next trial that runs to its end."""
    from test_strategies import make_job

    from zenithtune.loop import StudyLoop

    job = make_job("grid", extra=("timeout_dynamic=true", "timeout_dynamic_factor=3", "timeout_dynamic_floor=1"))
    limits: list[float | None] = []

    def launch(number: int, cand: dict, limit: float | None) -> Launched:
        limits.append(limit)
        if number == 0:  # stopped once stable after 2 s
            return Launched(100.0, duration=2.0, n_values=4, stopped_after=4, saved_s=60.0)
        return Launched(90.0, duration=10.0, n_values=8)  # ran to its end

    study = optuna.create_study(direction="maximize", sampler=job.strategy.sampler())
    loop = StudyLoop(job, study, launch)
    loop.start([])
    loop.run(3)
    assert limits == [None, None, 30.0]  # not 3 x 2 s after the stopped trial; 3 x 10 s after the whole one
