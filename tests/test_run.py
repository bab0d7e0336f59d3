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

from zenithtune.run import FailureKind, RunResult, classify, command_problem, run

TREE = str(Path(__file__).parent / "fixtures" / "spawn_tree.py")


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
    assert "left processes in its group" in (tmp_path / "log.txt").read_text()


def test_ctrl_c_kills_the_group_and_returns(tmp_path: Path) -> None:
    main = threading.main_thread().ident
    timer = threading.Timer(1.5, signal.pthread_kill, args=(main, signal.SIGINT))
    timer.start()
    try:
        res = run([sys.executable, TREE], log_path=tmp_path / "log.txt", timeout=20, grace=0.3)
    finally:
        timer.cancel()
    tree = pids(res.output)
    assert set(tree) == {"leader", "worker", "grandchild"}, res.output
    assert res.interrupted and not res.timed_out
    assert not any(alive(p) for p in tree.values())
    assert classify(res) == (FailureKind.INTERRUPTED, "interrupted (Ctrl-C); process group killed")


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
