"""Evaluators: realistic Megatron / ms-swift output -> one score, tested by tables."""
from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
from hydra.utils import instantiate
from omegaconf import OmegaConf

from zenithtune.evaluate import (
    SELECTORS,
    BadMetric,
    Evaluator,
    IterationTime,
    MegatronThroughput,
    NoMetric,
    PeakMemory,
    Regex,
    SwiftSpeed,
    peak_memory_mb,
    select,
)
from zenithtune.run import FailureKind, run

CONF = Path(__file__).resolve().parents[1] / "conf" / "evaluator"


def meg_line(it: int, tflops: float, ms: float = 1234.5) -> str:
    return (f" [2026-11-29 10:15:0{it % 10}] iteration {it:8d}/      10 | consumed samples: {it * 64:12d} | "
            f"elapsed time per iteration (ms): {ms} | throughput per GPU (TFLOP/s/GPU): {tflops} | "
            f"learning rate: 1.0E-04 | global batch size:    64 | lm loss: 1.0E+01 | loss scale: 1.0 | "
            f"grad norm: 1.234 | number of skipped iterations:   0 | number of nan iterations:   0 |")


MEM_LINE = ("[Rank 0] (after 1 iterations) memory (MB) | allocated: 31250.5 | max allocated: 52311.25 | "
            "reserved: 60012.0 | max reserved: 60012.0")
MEGATRON_LOG = "\n".join([
    "using world size: 8, data-parallel size: 4, context-parallel size: 1, tensor-model-parallel size: 2",
    "> building GPT model ...",
    meg_line(1, 301.2, 9000.0),
    MEM_LINE,
    meg_line(2, 410.0),
    meg_line(3, 412.3),
    meg_line(4, 420.0),
    "[after training is done] datetime: 2026-11-29 10:15:09",
]) + "\n"

# ms-swift Megatron mode: running average since start, with the iteration next to it
SWIFT_MEGATRON_LOG = "\n".join([
    "[INFO:swift] logging_path: /out/v0-20261129-101500/logging.jsonl",
    "{'loss': 1.23, 'grad_norm': 0.5, 'learning_rate': 1e-05, 'iteration': '1/10', 'elapsed_time': '10s', "
    "'remaining_time': '1m 30s', 'memory(GiB)': 35.2, 'train_speed(s/it)': 10.0}",
    "{'loss': 1.1, 'grad_norm': 0.4, 'learning_rate': 1e-05, 'iteration': '2/10', 'elapsed_time': '12s', "
    "'remaining_time': '48s', 'memory(GiB)': 36.5, 'train_speed(s/it)': 6.0}",
    "{'loss': 1.0, 'grad_norm': 0.4, 'learning_rate': 1e-05, 'iteration': '4/10', 'elapsed_time': '16s', "
    "'remaining_time': '24s', 'memory(GiB)': 36.5, 'train_speed(s/it)': 4.0}",
]) + "\n"

# the brief's older key layout, no per-interval information needed when per_interval=False
SWIFT_GLOBAL_STEP_LOG = (
    "{'loss': 1.23, 'grad_norm': 0.5, 'learning_rate': 1e-05, 'memory(GiB)': 35.2, 'train_speed(s/it)': 2.0, "
    "'epoch': 0.1, 'global_step/max_steps': '5/10', 'percentage': '50.00%'}\n"
    "{'loss': 1.20, 'grad_norm': 0.5, 'learning_rate': 1e-05, 'memory(GiB)': 35.2, 'train_speed(s/it)': 1.5, "
    "'epoch': 0.2, 'global_step/max_steps': '10/10', 'percentage': '100.00%'}\n")

# `swift sft` (HF trainer): iterations per second, running average
SWIFT_SFT_LOG = (
    "{'loss': 1.6, 'token_acc': 0.63, 'grad_norm': 1.9, 'learning_rate': 0.0001, 'memory(GiB)': 2.44, "
    "'train_speed(iter/s)': 0.25, 'epoch': 0.0, 'global_step/max_steps': '1/4', 'percentage': '25.00%', "
    "'elapsed_time': '4s', 'remaining_time': '12s'}\n"
    "{'loss': 1.5, 'token_acc': 0.64, 'grad_norm': 1.8, 'learning_rate': 0.0001, 'memory(GiB)': 2.5, "
    "'train_speed(iter/s)': 0.5, 'epoch': 0.0, 'global_step/max_steps': '4/4', 'percentage': '100.00%', "
    "'elapsed_time': '8s', 'remaining_time': '0s'}\n"
    "{'train_runtime': 8.1, 'train_samples_per_second': 3.9, 'train_steps_per_second': 0.49, 'train_loss': 1.55}\n")

JSON_LOG = '{"loss": 1.2, "memory(GiB)": 3.0, "train_speed(s/it)": 0.75, "iteration": "3/3"}\n'


@pytest.mark.parametrize("values, selector, skip_first, expected", [
    ([1.0, 2.0, 4.0], "last", 0, 4.0),
    ([1.0, 2.0, 4.0], "mean", 0, 7 / 3),
    ([1.0, 2.0, 4.0], "median", 0, 2.0),
    ([1.0, 2.0, 4.0], "harmonic", 0, 3 / (1 + 0.5 + 0.25)),
    ([100.0, 2.0, 4.0], "mean", 1, 3.0),
    ([100.0, 2.0, 4.0, 6.0], "median", 1, 4.0),
    ([7.0], "last", 0, 7.0),
])
def test_select(values: list[float], selector: str, skip_first: int, expected: float) -> None:
    assert select(values, selector, skip_first) == pytest.approx(expected)  # type: ignore[arg-type]


@pytest.mark.parametrize("values, selector, skip_first, message", [
    ([], "last", 0, "no metric values found"),
    ([1.0, 2.0], "last", 2, "found 2 metric value(s) but skip_first=2 drops them all: set skip_first below 2"),
    ([1.0, 0.0], "harmonic", 0, "harmonic mean needs positive"),
])
def test_select_no_metric(values: list[float], selector: str, skip_first: int, message: str) -> None:
    with pytest.raises(NoMetric) as err:
        select(values, selector, skip_first)  # type: ignore[arg-type]
    assert err.value.reason.startswith(message)


@pytest.mark.parametrize("make, message", [
    (lambda: select([1.0], "avg"), "selector 'avg' is not one of last, mean, median, harmonic"),
    (lambda: MegatronThroughput(selector="max"), "selector 'max' is not one of last, mean, median, harmonic"),
    (lambda: SwiftSpeed(skip_first=-1), "skip_first=-1 must be a whole number >= 0"),
    (lambda: Regex("tokens/s: ([0-9.]+"), "evaluator pattern 'tokens/s: ([0-9.]+' is not a valid regular"),
    (lambda: Regex("tokens/s: [0-9.]+"), "has 0 group(s) but group=1"),
    (lambda: Regex("(?P<v>[0-9]+)", group="w"), "has no group named 'w'"),
    (lambda: Regex("([0-9]+)", direction="max"), "direction 'max' is not one of maximize, minimize"),
])
def test_bad_settings(make, message: str) -> None:
    with pytest.raises(ValueError) as err:
        make()
    assert message in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("evaluator, output, expected", [
    (MegatronThroughput(), MEGATRON_LOG, 412.3),  # the median after the first (warm-up) value: one slow interval moves it not
    (MegatronThroughput(selector="last"), MEGATRON_LOG, 420.0),
    (MegatronThroughput(selector="mean", skip_first=1), MEGATRON_LOG, (410.0 + 412.3 + 420.0) / 3),
    (MegatronThroughput(selector="median", skip_first=0), MEGATRON_LOG, 411.15),
    (MegatronThroughput(selector="harmonic", skip_first=1), MEGATRON_LOG,
     3 / (1 / 410.0 + 1 / 412.3 + 1 / 420.0)),
    (MegatronThroughput(skip_first=0), meg_line(1, 1.5e2), 150.0),
    # per interval: elapsed 10, 12, 16 s at steps 1, 2, 4 -> 10, 2, 2 s/it
    (SwiftSpeed(), SWIFT_MEGATRON_LOG, 2.0),
    (SwiftSpeed(selector="mean"), SWIFT_MEGATRON_LOG, 14 / 3),
    (SwiftSpeed(selector="mean", skip_first=1), SWIFT_MEGATRON_LOG, 2.0),
    (SwiftSpeed(per_interval=False), SWIFT_MEGATRON_LOG, 4.0),
    (SwiftSpeed(per_interval=False, selector="mean"), SWIFT_MEGATRON_LOG, 20 / 3),
    # global_step/max_steps: elapsed 10 s at step 5, 15 s at step 10 -> 2, 1 s/it
    (SwiftSpeed(), SWIFT_GLOBAL_STEP_LOG, 1.0),
    (SwiftSpeed(per_interval=False), SWIFT_GLOBAL_STEP_LOG, 1.5),
    # iter/s: 4 s at step 1, 8 s at step 4 -> 4, 4/3 s/it
    (SwiftSpeed(), SWIFT_SFT_LOG, 4 / 3),
    (SwiftSpeed(per_interval=False), SWIFT_SFT_LOG, 2.0),
    (SwiftSpeed(), JSON_LOG, 0.75),
    # a line without a step falls back to the logged running averages (with a warning)
    (SwiftSpeed(), "{'train_speed(s/it)': 3.5}\n", 3.5),
    (Regex(r"tokens/s: ([0-9.]+)"), "step 1 tokens/s: 100\nstep 2 tokens/s: 250.5\n", 250.5),
    (Regex(r"step time ([0-9.]+) ms", direction="minimize", selector="mean", skip_first=1),
     "step time 900 ms\nstep time 100 ms\nstep time 300 ms\n", 200.0),
    (Regex(r"(?P<tps>[0-9.]+) tok/s", group="tps"), "12.5 tok/s\n", 12.5),
    (Regex(r"[0-9]+ tok/s", group=0), "12 tok/s\n", None),  # group 0: whole match is not a number
])
def test_evaluate(evaluator: Evaluator, output: str, expected: float | None) -> None:
    if expected is None:
        with pytest.raises(NoMetric, match="not a number"):
            evaluator.evaluate(output)
        return
    assert evaluator.evaluate(output) == pytest.approx(expected)


@pytest.mark.parametrize("evaluator, output, message", [
    (MegatronThroughput(skip_first=0), meg_line(1, 1.0).split("| throughput")[0] + "\n",
     "no TFLOP/s/GPU in the output: 'throughput per GPU (TFLOP/s/GPU): X' in none of 1 lines; Megatron"),
    (MegatronThroughput(skip_first=0), "", "add it to the command"),
    (MegatronThroughput(skip_first=5), MEGATRON_LOG, "found 4 TFLOP/s/GPU value(s) but skip_first=5"),
    (SwiftSpeed(), "{'loss': 1.0}\n", "no s/it in the output: 'train_speed(s/it)' or 'train_speed(iter/s)' in"),
    (Regex(r"tok/s: ([0-9.]+)"), "x\n", "no value in the output: pattern 'tok/s: ([0-9.]+)' matched none of 1 lines"),
    (Regex(r"tokens/s: ([0-9.]+)", metric_name="tokens/s"), "nothing\n", "no tokens/s in the output"),
    (IterationTime(64, 8), "no iteration lines\n", "no samples/s/GPU in the output: 'elapsed time per iteration (ms): X'"),
    (IterationTime(64, 8), meg_line(1, 1.0), "found 1 samples/s/GPU value(s) but skip_first=1 drops them all"),
])
def test_no_metric(evaluator: Evaluator, output: str, message: str) -> None:
    with pytest.raises(NoMetric) as err:
        evaluator.evaluate(output)
    assert message in err.value.reason


ZERO_TFLOPS = "".join(meg_line(i, 0.0) + "\n" for i in range(1, 4))


@pytest.mark.parametrize("evaluator, output, message", [
    # Megatron rounds a tiny model's throughput to 0.0: point at the evaluator that still works
    (MegatronThroughput(skip_first=0), ZERO_TFLOPS,
     "TFLOP/s/GPU was 0 in all 3 logged values after warm-up (0: below the printed precision); "
     "use evaluator=iteration_time"),
    (MegatronThroughput(selector="mean", skip_first=0), ZERO_TFLOPS, "TFLOP/s/GPU was 0 in all 3 logged values"),
    (MegatronThroughput(selector="mean", skip_first=1), meg_line(1, 0.0) + "\n" + meg_line(2, 400.0), None),
    (MegatronThroughput(selector="mean", skip_first=0), meg_line(1, 400.0) + "\n" + meg_line(2, math.nan),
     "TFLOP/s/GPU was nan in 1 of 2 logged values after warm-up (nan/inf: the run diverged or measured nothing)"),
    (MegatronThroughput(skip_first=0), meg_line(1, math.inf), "TFLOP/s/GPU was inf in all 1 logged values"),
    (MegatronThroughput(skip_first=0), meg_line(1, -3.0), "below 0"),
    (IterationTime(64, 8), meg_line(1, 1.0, ms=100.0) + "\n" + meg_line(2, 1.0, ms=0.0),
     "samples/s/GPU was inf in all 1 logged values"),
    (Regex(r"loss: (\S+)"), "loss: nan\n", "value was nan in all 1 logged values"),
    (Regex(r"step time ([0-9.]+) ms", direction="minimize"), "step time 0 ms\n", "value was 0 in all 1"),
    (Regex(r"step time ([0-9.]+) ms", direction="minimize", selector="mean"),
     "step time 0.0 ms\nstep time 0 ms\n", "0: below the printed precision"),
])
def test_bad_metric(evaluator: Evaluator, output: str, message: str | None) -> None:
    """A score must be finite and > 0; nan/inf/0 get kind bad_metric, never the --log-throughput hint."""
    if message is None:
        assert evaluator.evaluate(output) == 400.0
        return
    with pytest.raises(BadMetric) as err:
        evaluator.evaluate(output)
    assert err.value.kind is FailureKind.BAD_METRIC
    assert message in err.value.reason, err.value.reason
    assert "--log-throughput" not in err.value.reason and "\n" not in err.value.reason


def test_no_metric_kind() -> None:
    with pytest.raises(NoMetric) as err:
        MegatronThroughput().evaluate("nothing\n")
    assert err.value.kind is FailureKind.NO_METRIC and not isinstance(err.value, BadMetric)


@pytest.mark.parametrize("evaluator, output, expected", [
    # warm-up line (9000 ms) dropped; 64 samples / 1.2345 s / 8 GPUs on the three others
    (IterationTime(64, 8), MEGATRON_LOG, 64 / 1.2345 / 8),
    (IterationTime(64, 8, seq_length=8192), MEGATRON_LOG, 64 / 1.2345 / 8 * 8192),
    (IterationTime(64, 8, skip_first=0, selector="harmonic"), MEGATRON_LOG, 4 / (9.0 + 3 * 1.2345) * 64 / 8),
    # a printed global batch size wins over gbs (ramp-up); a line without one uses gbs
    (IterationTime(64, 8, skip_first=0, selector="last"), meg_line(1, 1.0, ms=500.0).replace("size:    64", "size:    32"),
     32 / 0.5 / 8),
    (IterationTime(16, 4, skip_first=0), " iteration 3/10 | elapsed time per iteration (ms): 250.0 |\n", 16.0),
    # without --log-throughput and with a rounded 0.0 the iteration time still ranks
    (IterationTime(64, 8, skip_first=0, selector="last"), ZERO_TFLOPS, 64 / 1.2345 / 8),
])
def test_iteration_time(evaluator: IterationTime, output: str, expected: float) -> None:
    assert evaluator.evaluate(output) == pytest.approx(expected)
    assert evaluator.direction == "maximize"


def test_iteration_time_ranks_like_the_iteration_time() -> None:
    fast = IterationTime(64, 8).evaluate(MEGATRON_LOG.replace("1234.5", "1000.0"))
    slow = IterationTime(64, 8).evaluate(MEGATRON_LOG)
    assert fast > slow


@pytest.mark.parametrize("kwargs, message", [
    ({"gbs": 0, "n_gpus": 8}, "evaluator.gbs=0 must be a whole number > 0"),
    ({"gbs": 64, "n_gpus": True}, "evaluator.n_gpus=True must be a whole number > 0"),
    ({"gbs": 64, "n_gpus": 8, "seq_length": -5}, "evaluator.seq_length=-5 must be a whole number > 0"),
    ({"gbs": 64, "n_gpus": 8, "selector": "max"}, "selector 'max' is not one of"),
])
def test_iteration_time_bad_settings(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        IterationTime(**kwargs)


FIXTURES = Path(__file__).parent / "fixtures"


@pytest.mark.parametrize("evaluator, steps, expected", [
    # the only metric line is followed by 3 MB of ordinary output: the tail alone would miss it
    (MegatronThroughput(skip_first=0), ["tflops=123.0", "noise=3e6"], 123.0),
    (IterationTime(64, 8, skip_first=0), ["iter=200", "noise=3e6"], 40.0),
    (SwiftSpeed(), ["swift=0.5", "noise=3e6"], 0.5),
    # a huge line between metric lines is cut, not a reason to lose the metric after it
    (MegatronThroughput(selector="mean", skip_first=0), ["tflops=100.0", "longline=5e6", "tflops=200.0"], 150.0),
])
def test_streamed_evaluation_sees_the_whole_output(evaluator: Evaluator, steps: list[str], expected: float) -> None:
    import sys

    evaluator.begin()
    mem = PeakMemory()
    res = run([sys.executable, str(FIXTURES / "printer.py"), *steps], log_path=None, timeout=60,
              on_line=lambda line: (evaluator.feed(line), mem.feed(line)))
    assert res.succeeded
    assert evaluator.result() == pytest.approx(expected)
    evaluator.begin()
    with pytest.raises(NoMetric):
        evaluator.result()  # begin() forgot the previous trial


def test_peak_memory_fed_line_by_line() -> None:
    mem = PeakMemory()
    for line in MEGATRON_LOG.splitlines():
        mem.feed(line)
    assert mem.result() == 52311.25


@pytest.mark.parametrize("evaluator, direction, metric_name", [
    (MegatronThroughput(), "maximize", "TFLOP/s/GPU"),
    (SwiftSpeed(), "minimize", "s/it"),
    (Regex("([0-9]+)"), "maximize", "value"),
    (IterationTime(64, 8), "maximize", "samples/s/GPU"),
    (IterationTime(64, 8, seq_length=4096), "maximize", "tokens/s/GPU"),
    (Regex("([0-9]+)", direction="minimize", metric_name="ms/step"), "minimize", "ms/step"),
])
def test_direction_and_name(evaluator: Evaluator, direction: str, metric_name: str) -> None:
    assert (evaluator.direction, evaluator.metric_name) == (direction, metric_name)


def test_repr_names_settings() -> None:
    assert repr(MegatronThroughput(skip_first=2)) == "MegatronThroughput(selector='median', skip_first=2)"


@pytest.mark.parametrize("output, expected", [
    (MEGATRON_LOG, 52311.25),
    (MEM_LINE + "\n" + MEM_LINE.replace("[Rank 0]", "[Rank 4]").replace("52311.25", "61000.5"), 61000.5),
    (SWIFT_MEGATRON_LOG, 36.5 * 1024),
    (JSON_LOG, 3.0 * 1024),
    ("no memory here\n", None),
])
def test_peak_memory_mb(output: str, expected: float | None) -> None:
    got = peak_memory_mb(output)
    assert got == (None if expected is None else pytest.approx(expected))


@pytest.mark.parametrize("name, overrides, cls, output, expected", [
    ("megatron_throughput", {}, MegatronThroughput, MEGATRON_LOG, 412.3),
    ("swift_speed", {}, SwiftSpeed, SWIFT_MEGATRON_LOG, 2.0),
    ("regex", {"pattern": r"tokens/s: ([0-9.]+)"}, Regex, "tokens/s: 3\n", 3.0),
    ("iteration_time", {"gbs": 64, "n_gpus": 8, "seq_length": None}, IterationTime, MEGATRON_LOG, 64 / 1.2345 / 8),
])
def test_yaml_instantiates(name: str, overrides: dict, cls: type, output: str, expected: float) -> None:
    text = (CONF / f"{name}.yaml").read_text()
    assert text.startswith("# ") and f"evaluator={name}" in text, "first lines give the command that selects it"
    cfg = OmegaConf.merge(OmegaConf.load(CONF / f"{name}.yaml"), overrides)
    for key in cfg:
        if key != "_target_":
            line = next(ln for ln in text.splitlines() if ln.startswith(f"{key}:"))
            assert "#" in line, f"{name}.yaml: key {key} has no comment"
    evaluator = instantiate(cfg, _execution_whitelist_="zenithtune.evaluate.*")
    assert isinstance(evaluator, cls)
    assert evaluator.evaluate(output) == pytest.approx(expected)


def test_all_selectors_listed() -> None:
    assert SELECTORS == ("last", "mean", "median", "harmonic")
    assert all(math.isfinite(select([1.0, 2.0], s)) for s in SELECTORS)  # type: ignore[arg-type]


# --- issue 21 item 2: a number with separators is read whole or refused, never cut to a prefix --------
MEGATRON_LINE = (" iteration 3/ 10 | elapsed time per iteration (ms): {ms} | throughput per GPU (TFLOP/s/GPU): {tf} |"
                 " global batch size: 64 |")


@pytest.mark.parametrize("printed", ["1,234.5", "1 234", "12.5.3", "1_000", "1'234"])
@pytest.mark.parametrize("make, line", [
    (lambda: MegatronThroughput(skip_first=0), MEGATRON_LINE.format(ms="100.0", tf="{}")),
    (lambda: IterationTime(gbs=64, n_gpus=8, skip_first=0), MEGATRON_LINE.format(ms="{}", tf="400.0")),
    (lambda: SwiftSpeed(per_interval=False), "{{'loss': 1.0, 'train_speed(s/it)': {}, 'iteration': '3/10'}}"),
    (lambda: Regex(r"loss: ([\d.,' _]+\d)"), "loss: {}"),
])
def test_a_number_with_separators_is_bad_metric_not_its_prefix(make, line, printed):
    ev = make()
    with pytest.raises(BadMetric, match=re.escape(f"printed as {printed!r} (output line 2) is not a plain number")):
        ev.evaluate(line.format("100.0") + "\n" + line.format(printed))
    assert ev.evaluate(line.format("100.0")) > 0  # a plain number still scores


@pytest.mark.parametrize("line, expected", [
    ("throughput per GPU (TFLOP/s/GPU): 512.3 | global batch size: 64 |", 512.3),
    ("throughput per GPU (TFLOP/s/GPU): 512.3, 12 tokens", 512.3),  # a comma then a space ends the number
    ("throughput per GPU (TFLOP/s/GPU): 5e2 |", 500.0),
    ("throughput per GPU (TFLOP/s/GPU): 512.3 1234567", 512.3),  # not a group of three digits
])
def test_plain_numbers_next_to_punctuation_still_score(line, expected):
    assert MegatronThroughput(skip_first=0).evaluate(line) == expected
