"""The trial runner: process-group kill, log file, failure classification."""
from __future__ import annotations

import os
import re
import shlex
import signal
import sys
import threading
from pathlib import Path

import pytest
from fixtures.filling_disk import FillingDisk  # tests/ is on sys.path under pytest

from zenithtune import signals
from zenithtune.processes import kill_leftovers
from zenithtune.run import FailureKind, RunResult, classify, command_problem, late_failure, run

FIXTURES = Path(__file__).parent / "fixtures"
TREE = str(FIXTURES / "spawn_tree.py")
ESCAPE = str(FIXTURES / "escape_tree.py")
PRINTER = str(FIXTURES / "printer.py")


def alive(pid: int) -> bool:
    """Running (zombies waiting for a reaper count as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat[stat.rfind(")") + 2] not in "ZX"


def pids(output: str) -> dict[str, int]:
    return {m[1]: int(m[2]) for m in re.finditer(r"^(leader|worker|grandchild) (\d+)$", output, re.M)}


def test_success_streams_to_log_and_echo(tmp_path: Path) -> None:
    argv = [sys.executable, "-c", "import sys; print('hello world'); print('oops', file=sys.stderr)"]
    seen: list[str] = []
    log = tmp_path / "trial_0" / "log.txt"
    res = run(argv, log_path=log, timeout=30, env={"ZT_TEST_VAR": "a b"}, echo=seen.append)
    assert res.returncode == 0 and res.succeeded and classify(res) is None
    assert seen == ["hello world", "oops"]
    assert res.output == "hello world\noops\n"
    text = log.read_text()
    assert text.splitlines()[0] == f"# command: {shlex.join(argv)}"
    assert "ZT_TEST_VAR='a b'" in text and "# started: " in text
    assert "hello world\noops\n" in text and "# result: exit code 0" in text


def test_env_is_merged_over_os_environ(tmp_path: Path) -> None:
    res = run([sys.executable, "-c", "import os; print(os.environ['ZT_A'], 'PATH' in os.environ)"],
              log_path=None, timeout=30, env={"ZT_A": "1"})
    assert res.output == "1 True\n"


def test_every_trial_process_carries_the_marker(tmp_path: Path) -> None:
    started: list = []
    res = run([sys.executable, "-c", "import os; print(os.environ['ZENITHTUNE_TRIAL'], os.getpid())"],
              log_path=tmp_path / "log.txt", timeout=30, trial_id="outputs/study_x/trial_7", on_start=started.append)
    marker, pid = res.output.split()
    assert marker == "outputs/study_x/trial_7" and int(pid) == res.process.pid
    assert started == [res.process] and res.process.to_dict()["marker"] == marker
    assert "# ZENITHTUNE_TRIAL=outputs/study_x/trial_7" in (tmp_path / "log.txt").read_text()


def test_timeout_kills_grandchildren(tmp_path: Path) -> None:
    res = run([sys.executable, TREE, "--stubborn"], log_path=tmp_path / "log.txt", timeout=1.5, grace=0.3)
    tree = pids(res.output)
    assert set(tree) == {"leader", "worker", "grandchild"}, res.output
    assert res.timed_out and not res.interrupted
    assert not any(alive(p) for p in tree.values()), "a process of the timed-out trial survived"
    kind, reason = classify(res)
    assert kind is FailureKind.TIMEOUT and re.match(r"timed out after \d+ s; last output: grandchild", reason)
    assert "no exit after 1.5 s" in (tmp_path / "log.txt").read_text()


def test_leftovers_of_a_finished_command_are_killed(tmp_path: Path) -> None:
    res = run([sys.executable, TREE, "--leader-exits", "--stubborn"], log_path=tmp_path / "log.txt",
              timeout=20, grace=0.3)
    tree = pids(res.output)
    assert "grandchild" in tree, res.output
    assert res.returncode == 0 and not res.timed_out
    assert not any(alive(p) for p in tree.values())
    assert "left processes behind" in (tmp_path / "log.txt").read_text()


def test_ctrl_c_kills_the_group_and_returns(tmp_path: Path) -> None:
    # Ctrl-C once the whole tree is up (the grandchild's line, not a timer: a timer fired before the tree
    # started on a loaded machine)
    main = threading.main_thread().ident
    sent = threading.Event()

    def on_line(line: str) -> None:
        if "grandchild ready" in line and not sent.is_set():
            sent.set()
            signal.pthread_kill(main, signal.SIGINT)

    # As the front ends run it: inside signals.handled(), polling signals.pending(). Python raises Ctrl-C's
    # KeyboardInterrupt at the main thread's next bytecode, which can be a finalizer the garbage collector
    # runs; there it cannot get out and is lost ("Exception ignored"), and in the full CI run (a session
    # full of sqlalchemy garbage) the tree then ran to its 20 s timeout (-15). handled() holds such a stop
    # and the runner's `stop` poll acts on it.
    with signals.handled():
        res = run([sys.executable, TREE], log_path=tmp_path / "log.txt", timeout=20, grace=0.3, on_line=on_line,
                  stop=signals.pending)
        signals.acknowledge()
    assert sent.is_set(), res.output
    tree = pids(res.output)
    assert set(tree) == {"leader", "worker", "grandchild"}, res.output
    assert res.interrupted and not res.timed_out
    assert not any(alive(p) for p in tree.values())
    assert classify(res) == (FailureKind.INTERRUPTED, "interrupted (Ctrl-C); process group killed")


def test_ctrl_c_landing_in_a_finalizer_still_kills_the_group(tmp_path: Path) -> None:
    # Python runs Ctrl-C's handler at the main thread's next bytecode. When that bytecode belongs to a
    # finalizer the garbage collector runs, the KeyboardInterrupt cannot get out: Python prints
    # "Exception ignored" and the Ctrl-C is gone. Here the SIGINT is sent from inside such a finalizer,
    # once the tree is up; handled() holds it, and the runner's poll of signals.pending() kills the group.
    ready = threading.Event()

    class Garbage:
        def __del__(self) -> None:
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
            sum(range(1000))  # bytecode for the handler to run in

    def enough() -> None:  # polled by the main thread while the command runs
        if ready.is_set() and not getattr(enough, "done", False):
            enough.done = True  # type: ignore[attr-defined]
            Garbage()  # collected at once: its finalizer runs here, in the main thread
        return None

    with signals.handled():
        res = run([sys.executable, TREE], log_path=tmp_path / "log.txt", timeout=20, grace=0.3,
                  on_line=lambda line: ready.set() if "grandchild ready" in line else None,
                  stop=signals.pending, enough=enough)
        signals.acknowledge()
    assert getattr(enough, "done", False), res.output
    tree = pids(res.output)
    assert res.interrupted and not res.timed_out, res.output
    assert not any(alive(p) for p in tree.values())


def test_missing_command_does_not_raise(tmp_path: Path) -> None:
    res = run(["zt-no-such-command-xyz"], log_path=tmp_path / "log.txt", timeout=5)
    assert res.returncode is None
    kind, reason = classify(res)
    assert kind is FailureKind.CRASH and "cannot start zt-no-such-command-xyz" in reason


def test_output_in_memory_is_capped(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr("zenithtune.run.OUTPUT_CAP", 1000)
    res = run([sys.executable, "-c", "for i in range(500): print(f'line {i:04d}')"],
              log_path=tmp_path / "log.txt", timeout=30)
    assert res.output.startswith("[zenithtune: first ") and res.output.endswith("line 0499\n")
    assert len(res.output) < 1200
    assert "line 0000" in (tmp_path / "log.txt").read_text()


def test_bad_timeout() -> None:
    with pytest.raises(ValueError, match="timeout=0"):
        run(["true"], log_path=None, timeout=0)
    with pytest.raises(ValueError, match="log_max_mb=0 must be a positive number"):
        run(["true"], log_path=None, timeout=1, log_max_mb=0)
    with pytest.raises(ValueError, match="log_max_mb='abc' must be a positive number of MB, or null for no cap"):
        run(["true"], log_path=None, timeout=1, log_max_mb="abc")  # type: ignore[arg-type]


# --- processes that leave the group -------------------------------------------------------------

@pytest.mark.parametrize("mode", ["setsid", "setpgid", "double-fork"])
def test_timeout_kills_children_that_left_the_group(tmp_path: Path, mode: str) -> None:
    res = run([sys.executable, ESCAPE, mode], log_path=tmp_path / "log.txt", timeout=2, grace=0.3)
    escaped = [int(p) for p in re.findall(r"^escaped (\d+)$", res.output, re.M)]
    assert res.timed_out and len(escaped) == 1, res.output
    assert not alive(escaped[0]), f"the {mode} worker survived the timeout"


@pytest.mark.parametrize("mode", ["setsid", "double-fork"])
def test_leftovers_outside_the_group_are_killed_after_exit(tmp_path: Path, mode: str) -> None:
    res = run([sys.executable, ESCAPE, mode, "--leader-exits"], log_path=tmp_path / "log.txt", timeout=20,
              grace=0.3)
    escaped = [int(p) for p in re.findall(r"^escaped (\d+)$", res.output, re.M)]
    assert res.returncode == 0 and len(escaped) == 1, res.output
    assert not alive(escaped[0])
    assert "left processes behind" in (tmp_path / "log.txt").read_text()


TUNER = """
import json, sys
from pathlib import Path
from zenithtune.run import run
run(sys.argv[2:], log_path=None, timeout=60, trial_id=sys.argv[1],
    on_start=lambda p: Path(sys.argv[1]).write_text(json.dumps(p.to_dict())))
"""


def test_a_resumed_study_kills_what_a_killed_tuner_left(tmp_path: Path) -> None:
    """kill -9 of the tuner leaves its trial running; the stored record finds and kills all of it."""
    import json
    import subprocess
    import time

    record_file = tmp_path / "trial_3.json"
    pid_file = tmp_path / "pids.txt"
    tuner = subprocess.Popen([sys.executable, "-c", TUNER, str(record_file), sys.executable, "-c",
                              f"import subprocess, sys, time; subprocess.Popen([sys.executable, {ESCAPE!r}, "
                              f"'double-fork'], stdout=open({str(pid_file)!r}, 'w')); time.sleep(30)"])
    deadline = time.monotonic() + 20
    while not (pid_file.exists() and "escaped" in pid_file.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    tuner.kill()
    tuner.wait()
    record = json.loads(record_file.read_text())
    escaped = int(pid_file.read_text().split()[1])
    assert alive(record["pid"]) and alive(escaped), "the fake trial should still run after kill -9 of the tuner"
    killed = kill_leftovers(record, grace=0.3)
    assert record["pid"] in killed and escaped in killed
    assert not alive(record["pid"]) and not alive(escaped)
    assert kill_leftovers(record, grace=0.3) == []
    assert kill_leftovers({**record, "host": "some-other-node"}) == []


# --- output: log cap, full disk, long lines, streaming -------------------------------------------

def test_log_is_capped_keeping_head_and_tail(tmp_path: Path) -> None:
    log = tmp_path / "trial.log"
    res = run([sys.executable, PRINTER, "tflops=1.0", "noise=3e6", "tflops=2.0"], log_path=log, timeout=60,
              log_max_mb=1)
    assert res.succeeded
    text = log.read_text()
    assert log.stat().st_size < 1.05e6
    assert "throughput per GPU (TFLOP/s/GPU): 1.0" in text and "throughput per GPU (TFLOP/s/GPU): 2.0" in text
    cut = re.search(r"^# zenithtune: (\d+) bytes of output cut here \(log_max_mb=1 keeps", text, re.M)
    assert cut and 1.9e6 < int(cut[1]) < 2.8e6, text[:2000]
    assert text.rstrip().endswith("# result: exit code 0 after " + text.rstrip().rsplit("after ", 1)[1])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trial.log"]


def test_full_disk_before_start_fails_clearly(tmp_path: Path) -> None:
    res = run([sys.executable, PRINTER, "tflops=1.0"], log_path=Path("/dev/full"), timeout=30)
    assert res.returncode is None and not res.succeeded
    assert classify(res) == (FailureKind.LOG_WRITE, "stopped: cannot write /dev/full: No space left on device; "
                                                    "free disk space or lower log_max_mb")


def test_full_disk_mid_run_stops_the_trial_instead_of_hanging(monkeypatch: pytest.MonkeyPatch,
                                                              tmp_path: Path) -> None:
    monkeypatch.setattr("zenithtune.run._open_log", lambda path: FillingDisk(path, 100_000))
    res = run([sys.executable, PRINTER, "noise=1e6", "sleep=30", "tflops=1.0"], log_path=tmp_path / "trial.log",
              timeout=60, grace=0.3)
    assert not res.timed_out and not res.succeeded
    kind, reason = classify(res)
    assert kind is FailureKind.LOG_WRITE
    assert reason == f"stopped: cannot write {tmp_path / 'trial.log'}: No space left on device; free disk space or lower log_max_mb"
    assert not alive(res.process.pid)


# The peak is this process's own VmHWM, not ru_maxrss: Linux carries ru_maxrss across fork+exec, so a child
# of a pytest grown to 400 MB would report 400 MB whatever it did (seen in the full suite).
LONG_LINE_TUNER = """
import re, sys
from pathlib import Path
from zenithtune.run import run
seen = []
res = run(sys.argv[1:], log_path=None, timeout=120, on_line=lambda l: seen.append(len(l)))
hwm_kb = int(re.search(r"VmHWM:\\s+(\\d+) kB", Path("/proc/self/status").read_text()).group(1))
print(hwm_kb // 1024, max(seen), len(seen), res.returncode)
"""


def test_a_huge_line_without_newline_takes_no_memory() -> None:
    import subprocess

    out = subprocess.run([sys.executable, "-c", LONG_LINE_TUNER, sys.executable, PRINTER, "tflops=1.0",
                          "longline=300e6", "tflops=2.0"], capture_output=True, text=True, check=True).stdout
    rss_mb, longest, lines, code = map(int, out.split())
    assert code == 0 and lines == 4  # the two metric lines, the long line's head and its last LINE_TAIL bytes
    assert longest <= 64 * 1024
    assert rss_mb < 250, f"the tuner grew to {rss_mb} MB reading a 300 MB line"  # not O(line): 1.7 GB before


def test_every_line_reaches_on_line_and_progress_bars_split(tmp_path: Path) -> None:
    seen: list[str] = []
    echoed: list[str] = []
    res = run([sys.executable, PRINTER, "tflops=1.0", "noise=3e6", "bar=1000", "swift=0.5"], log_path=None,
              timeout=60, on_line=seen.append, echo=echoed.append)
    assert res.succeeded and res.lines == len(seen)
    assert "throughput per GPU (TFLOP/s/GPU): 1.0" in seen[0]
    # the last frame has no terminator before the log line: they arrive as one line, metric intact
    assert seen[-1].endswith("]{'loss': '2.1', 'iteration': '2/100', 'train_speed(s/it)': '0.5'}")
    assert sum(line.startswith("998/1000 [") for line in seen) == 1
    assert not any(line.startswith("5/1000") for line in echoed), "progress-bar frames are not echoed"
    assert len(res.output) <= 512 * 1024 + 200


def test_oom_printed_with_exit_0_is_oom(tmp_path: Path) -> None:
    res = run([sys.executable, PRINTER, "oom", "noise=2e6", "tflops=1.0"], log_path=None, timeout=60)
    assert res.returncode == 0
    kind, reason = classify(res)
    assert kind is FailureKind.OOM
    assert reason.startswith("exit code 0, but the output says: torch.OutOfMemoryError: CUDA out of memory.")


def test_a_failing_on_line_does_not_stop_the_pipe(tmp_path: Path) -> None:
    def feed(line: str) -> None:
        raise ValueError("boom")

    res = run([sys.executable, PRINTER, "noise=1e6", "tflops=1.0"], log_path=tmp_path / "log.txt", timeout=60,
              on_line=feed)
    assert res.returncode == 0 and "throughput per GPU" in res.output
    assert classify(res) == (FailureKind.NO_METRIC, "the evaluator failed on output line 1: ValueError('boom')")


# --- classification ---------------------------------------------------------------------------

TORCH_OOM = """\
[rank3]: Traceback (most recent call last):
[rank3]:   File "/workspace/Megatron-LM/pretrain_gpt.py", line 280, in <module>
[rank3]:     pretrain(
[rank3]:   File "/workspace/Megatron-LM/megatron/training/training.py", line 386, in pretrain
[rank3]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 3 has a total capacity of 79.11 GiB of which 1.23 GiB is free. Including non-PyTorch memory, this process has 77.87 GiB memory in use. Of the allocated memory 74.02 GiB is allocated by PyTorch, and 2.11 GiB is reserved by PyTorch but unallocated. If reserved but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for Memory Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)
[rank0]: RuntimeError: NCCL communicator was aborted on rank 0.
E1129 10:15:09.123000 1234 torch/distributed/elastic/multiprocessing/api.py:869] failed (exitcode: 1) local_rank: 3 (pid: 4567) of binary: /usr/bin/python
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
pretrain_gpt.py FAILED
"""

OLD_OOM = """\
Traceback (most recent call last):
  File "train.py", line 10, in <module>
torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 15.78 GiB total capacity; 14.21 GiB already allocated)
"""

ARGPARSE = """\
usage: pretrain_gpt.py [-h] [--num-layers NUM_LAYERS] ...
pretrain_gpt.py: error: unrecognized arguments: --recompute-metod uniform
"""

ARGPARSE_VALUE = """\
usage: pretrain_gpt.py [-h] ...
pretrain_gpt.py: error: argument --micro-batch-size: invalid int value: 'x'
"""

MEGATRON_ASSERT = """\
Traceback (most recent call last):
  File "/workspace/Megatron-LM/pretrain_gpt.py", line 270, in <module>
    pretrain(
  File "/workspace/Megatron-LM/megatron/training/initialize.py", line 68, in initialize_megatron
    validate_args(args, args_defaults)
  File "/workspace/Megatron-LM/megatron/training/arguments.py", line 210, in validate_args
    assert args.world_size % total_model_size == 0, (
AssertionError: world size (8) is not divisible by total_model_size (tensor_model_parallel_size (3) * pipeline_model_parallel_size (1) * context_parallel_size (1))
"""

BARE_ASSERT = """\
  File "/workspace/Megatron-LM/megatron/training/arguments.py", line 420, in validate_args
    assert args.recompute_method is not None
AssertionError
"""

DIVISIBLE = "ValueError: num_layers (30) is not divisible by pipeline_model_parallel_size (4)\n"

GENERIC = """\
iteration 1/10 | ...
Traceback (most recent call last):
  File "/workspace/train.py", line 3, in <module>
    import apex
ModuleNotFoundError: No module named 'apex'
[2026-11-29 10:15:01] some trailing info line
"""

RUNTIME_ASSERT = """\
  File "/workspace/Megatron-LM/megatron/core/pipeline_parallel/schedules.py", line 40, in forward_step
    assert output_tensor is not None
AssertionError
"""


def result(output: str, returncode: int | None = 1, *, timed_out: bool = False, interrupted: bool = False,
           duration: float = 12.0) -> RunResult:
    return RunResult(["cmd"], returncode, output, duration, timed_out, interrupted, None)


@pytest.mark.parametrize("res, kind, reason", [
    (result("all good\n", 0), None, None),
    (result(TORCH_OOM), FailureKind.OOM, "[rank3]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB."),
    (result(OLD_OOM), FailureKind.OOM, "torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB"),
    (result(TORCH_OOM, timed_out=True), FailureKind.OOM, "[rank3]: torch.OutOfMemoryError"),
    (result("RuntimeError: CUDA error: out of memory\n"), FailureKind.OOM, "RuntimeError: CUDA error: out of memory"),
    (result(ARGPARSE, 2), FailureKind.INVALID_ARGS,
     "pretrain_gpt.py: error: unrecognized arguments: --recompute-metod uniform"),
    (result(ARGPARSE_VALUE, 2), FailureKind.INVALID_ARGS, "pretrain_gpt.py: error: argument --micro-batch-size"),
    (result(MEGATRON_ASSERT), FailureKind.INVALID_ARGS, "AssertionError: world size (8) is not divisible by"),
    (result(BARE_ASSERT), FailureKind.INVALID_ARGS, "AssertionError: assert args.recompute_method is not None"),
    (result(DIVISIBLE), FailureKind.INVALID_ARGS, "ValueError: num_layers (30) is not divisible by"),
    (result(GENERIC), FailureKind.CRASH, "exit code 1: ModuleNotFoundError: No module named 'apex'"),
    (result(RUNTIME_ASSERT), FailureKind.CRASH, "exit code 1: AssertionError"),
    (result("step 1\nstep 2\n\n", -9), FailureKind.CRASH, "killed by SIGKILL (host out of memory?"),
    (result("", 3), FailureKind.CRASH, "exit code 3 with no output"),
    (result("iteration 3/10 | throughput per GPU (TFLOP/s/GPU): 1.0 |\n", timed_out=True, returncode=-15),
     FailureKind.TIMEOUT, "timed out after 12 s; last output: iteration 3/10"),
    (result("", 0, timed_out=True), FailureKind.TIMEOUT, "timed out after 12 s; no output"),
    (result(TORCH_OOM, interrupted=True), FailureKind.INTERRUPTED, "interrupted"),
])
def test_classify(res: RunResult, kind: FailureKind | None, reason: str | None) -> None:
    got = classify(res)
    if kind is None:
        assert got is None
        return
    assert got is not None and got[0] is kind
    assert got[1].startswith(reason), got[1]
    assert "\n" not in got[1] and len(got[1]) <= 300


def test_crash_reason_skips_torchrun_noise() -> None:
    out = GENERIC + "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n=====\n"
    assert classify(result(out)) == (FailureKind.CRASH, "exit code 1: ModuleNotFoundError: No module named 'apex'")


# Megatron-LM on 2 CPU ranks (benchmarks/real_megatron.py's grid, TP2 MBS4 full recompute): all 6 iterations
# ran, then rank 1 aborted while gloo was torn down; torchrun exits 1 (its traceback trimmed here)
TEARDOWN = """\
 [2026-12-07 14:38:45.051926] iteration        6/       6 | consumed samples:           48 | elapsed time per iteration (ms): 247.8 |
[after training is done] datetime: 2026-12-07 14:38:45.055886
terminate called without an active exception
W1207 14:38:45.153000 14530 torch/distributed/elastic/multiprocessing/api.py:1028] Sending process 14553 closing signal SIGTERM
E1207 14:38:45.223000 14530 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: -6) local_rank: 1 (pid: 14554)
Traceback (most recent call last):
    raise ChildFailedError(
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
Root Cause (first observed failure):
[0]:
  rank      : 1 (local_rank: 1)
  exitcode  : -6 (pid: 14554)  (SIGABRT)
"""


def test_a_failure_after_the_training_loop_finished_keeps_the_run() -> None:
    """Every iteration was measured before Megatron printed "[after training is done]": a crash or a hang in
    the teardown after it is a note on a scored run, not a lost trial; before it, or with an OOM, a failure."""
    assert classify(result(TEARDOWN)) is None
    assert late_failure(result(TEARDOWN)) == ("exit code 1 after Megatron's [after training is done]: terminate called "
                                              "without an active exception; the training loop had finished")
    hung = result(TEARDOWN.split("terminate")[0], -15, timed_out=True, duration=600.0)
    assert classify(hung) is None
    assert late_failure(hung) == ("timed out after 600 s, after Megatron's [after training is done]: the training loop "
                                  "had finished")
    before = result(TEARDOWN.replace("[after training is done]", "[before the end]"))
    assert classify(before) == (FailureKind.CRASH, "exit code 1: terminate called without an active exception")
    assert late_failure(before) is None
    assert classify(result(TEARDOWN + TORCH_OOM))[0] is FailureKind.OOM  # a final evaluation out of memory
    assert late_failure(result(TEARDOWN, 0)) is None  # a success needs no note
    assert classify(result(TEARDOWN, interrupted=True))[0] is FailureKind.INTERRUPTED


# --- command_problem --------------------------------------------------------------------------

def test_command_problem(tmp_path: Path) -> None:
    script = tmp_path / "pretrain.sh"
    script.write_text("#!/bin/sh\necho hi\n")
    assert command_problem([sys.executable, "x.py"]) is None
    assert command_problem(["python3", "-V"]) is None
    assert "empty command" in command_problem([])
    msg = command_problem(["zt-no-such-command-xyz", "--x"])
    assert msg.startswith("command 'zt-no-such-command-xyz' not found on PATH: install it")
    assert "write './pretrain.sh'" in command_problem(["pretrain.sh"], cwd=tmp_path)
    assert "chmod +x ./pretrain.sh" in command_problem(["./pretrain.sh"], cwd=tmp_path)
    script.chmod(0o755)
    assert command_problem(["./pretrain.sh"], cwd=tmp_path) is None
    assert "no such file" in command_problem(["./missing.sh"], cwd=tmp_path)
    assert "is a directory" in command_problem([str(tmp_path)])


@pytest.mark.parametrize("size, newline", [(100_000, ""), (100_000, "\n"), (3_000_000, ""), (3_000_000, "\n")])
def test_a_metric_at_the_end_of_a_long_line_is_read(tmp_path, size, newline) -> None:
    """Issue 21 item 5: a line past LINE_MAX used to lose its end, and with it a metric printed there."""
    from zenithtune.evaluate import MegatronThroughput

    ev = MegatronThroughput(skip_first=0)
    code = f"import sys; sys.stdout.write('x' * {size} + ' throughput per GPU (TFLOP/s/GPU): 123.4 |' + {newline!r})"
    res = run([sys.executable, "-c", code], log_path=tmp_path / "trial.log", timeout=60, on_line=ev.feed)
    assert res.returncode == 0 and ev.result() == 123.4
    if size > 1_000_000:  # (a line that ends within a read or two is kept whole)
        log = (tmp_path / "trial.log").read_bytes()
        assert b"more bytes of that line skipped; its last 16384 bytes follow" in log
        assert len(log) < 64 * 1024 + 16 * 1024 + 2000  # the middle of the line is not kept
