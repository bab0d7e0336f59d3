"""The built-in simulator as a user and a tuner see it: API, log format, failures, CLI, ms-swift flavour."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from zenithtune.sim import SimResult, simulate, simulate_swift
from zenithtune.sim.models import MODELS, layout_args
from zenithtune.sim.physics import model_flops
from zenithtune.sim.trainer import prepare

FIXTURES = Path(__file__).parent / "fixtures" / "models"
LLAMA8B = [*MODELS["llama3-8b"]]
GOOD = [*LLAMA8B, *layout_args(n_gpus=8, gbs=64, tp=2)]
ITER = re.compile(r"^ \[[0-9-]+ [0-9:]+\] iteration +(\d+)/ +(\d+) \| consumed samples: +\d+ \| "
                  r"elapsed time per iteration \(ms\): ([0-9.]+) \| throughput per GPU \(TFLOP/s/GPU\): ([0-9.]+) \|"
                  r" learning rate: [0-9.E+-]+ \| global batch size: +(\d+) \| lm loss: [0-9.E+-]+ \|")
MEMORY = re.compile(r"^\[Rank \d+\] \(after 1 iterations\) memory \(MB\) \| allocated: [0-9.]+ \| "
                    r"max allocated: [0-9.]+ \| reserved: [0-9.]+ \| max reserved: [0-9.]+$")
ENV = {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}


def cli(module: str, *args: str, env: dict[str, str] | None = None, timeout: float = 30):
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True,
                          env=full_env, timeout=timeout)


# --- the Megatron log --------------------------------------------------------------------------------

def test_a_good_run_prints_megatron_iteration_lines_and_the_memory_line_after_iteration_1():
    res = simulate(GOOD, ENV)
    assert (res.exit_code, res.kind) == (0, "ok")
    lines = res.stdout.splitlines()
    iters = [ITER.match(line) for line in lines if " iteration " in line]
    assert [int(m.group(1)) for m in iters] == list(range(1, 11))
    assert all(m.group(5) == "64" for m in iters)
    first = next(i for i, line in enumerate(lines) if ITER.match(line))
    assert MEMORY.match(lines[first + 1])
    assert sum(1 for line in lines if MEMORY.match(line)) == 1  # pp=1: one stage, one report
    assert lines[-1] == f"[zenithtune.sim] simulated wall time of the run: {res.wall_seconds:.1f} s"
    assert res.stderr == ""


def test_printed_throughput_is_model_flops_over_time_and_world_size():
    res = simulate(GOOD, ENV)
    flops = model_flops(prepare(GOOD, ENV))
    for m in (ITER.match(line) for line in res.stdout.splitlines()):
        if m:
            ms, printed = float(m.group(3)), float(m.group(4))
            assert printed == pytest.approx(flops / (ms / 1000 * 1e12 * 8), rel=2e-3)
    assert res.tflops == pytest.approx(flops / (res.iter_seconds * 1e12 * 8))


def test_model_flops_follow_megatrons_formula():
    # Llama-3-8B, B=64, s=8192: MEGATRON.md's formula written out by hand
    B, s, L, h, a, g, F, V = 64, 8192, 32, 4096, 32, 8, 14336, 128256
    d = h // a
    expected = (6 * B * s * (h * 3 * F * L + L * (h * (a * d + 2 * g * d) + a * d * h) + h * V)
                + 6 * B * s * s * L * a * d)
    assert model_flops(prepare(GOOD, ENV)) == pytest.approx(expected)


def test_throughput_is_printed_only_with_log_throughput():
    res = simulate([a for a in GOOD if a != "--log-throughput"], ENV)
    assert res.kind == "ok" and "throughput per GPU" not in res.stdout
    assert "elapsed time per iteration (ms)" in res.stdout and res.tflops is not None


def test_warm_up_iterations_are_slower_so_last_and_mean_differ_slightly():
    res = simulate(GOOD, ENV)
    it = res.iteration_seconds
    assert it[0] > 1.5 * it[-1] and it[1] > it[-1]
    steady = it[2:]
    mean = sum(steady) / len(steady)
    assert it[-1] != mean and abs(it[-1] / mean - 1) < 0.01
    assert res.iter_seconds == pytest.approx(mean)


def test_log_interval_averages_elapsed_time_over_the_interval():
    res = simulate([*GOOD, "--log-interval", "5"], ENV)
    ms = [float(m.group(3)) for m in map(ITER.match, res.stdout.splitlines()) if m]
    assert len(ms) == 2
    assert ms[0] == pytest.approx(sum(res.iteration_seconds[:5]) / 5 * 1000, abs=0.06)


def test_deterministic_for_an_argv_and_noise_is_seeded():
    assert simulate(GOOD, ENV).stdout == simulate(GOOD, ENV).stdout
    a = simulate([*GOOD, "--sim-noise", "5", "--sim-seed", "1"], ENV)
    b = simulate([*GOOD, "--sim-noise", "5", "--sim-seed", "2"], ENV)
    again = simulate([*GOOD, "--sim-noise", "5", "--sim-seed", "1"], ENV)
    assert a.tflops != b.tflops and a.tflops == again.tflops
    base = simulate(GOOD, ENV).tflops
    assert abs(a.tflops / base - 1) < 0.3


def test_wall_time_covers_startup_and_every_iteration():
    res = simulate(GOOD, ENV)
    assert res.wall_seconds > sum(res.iteration_seconds) + 10
    events = [e.at for e in res.events]
    assert events == sorted(events) and events[-1] == res.wall_seconds


def test_a_run_is_fast():
    start = time.perf_counter()
    for _ in range(50):
        simulate(GOOD, ENV)
    assert (time.perf_counter() - start) / 50 < 0.02  # ~1 ms on a laptop


# --- failures ----------------------------------------------------------------------------------------

def test_out_of_memory_prints_the_pytorch_error_and_exits_1():
    res = simulate([*LLAMA8B, *layout_args(n_gpus=8, gbs=64, tp=1, mbs=2)], ENV)
    assert (res.exit_code, res.kind) == (1, "oom")
    last = res.stderr.splitlines()[-1]
    m = re.match(r"torch\.OutOfMemoryError: CUDA out of memory\. Tried to allocate ([0-9.]+) GiB\. GPU 0 has a "
                 r"total capacity of 79\.11 GiB of which ([0-9.]+) GiB is free\. Including non-PyTorch memory, "
                 r"this process has ([0-9.]+) GiB memory in use\.", last)
    assert m, last
    tried, free, used = map(float, m.groups())
    assert free < tried and used + free == pytest.approx(79.11, abs=0.02)
    assert " iteration " not in res.stdout and res.tflops is None
    assert res.peak_memory_gb > res.capacity_gb == pytest.approx(79.11)


def test_a_broken_megatron_rule_is_an_assertion_error_exit_1():
    res = simulate([*LLAMA8B, *layout_args(n_gpus=8, gbs=64, tp=3)], ENV)
    assert (res.exit_code, res.kind) == (1, "invalid")
    assert ("AssertionError: world size (8) is not divisible by tensor model parallel size (3) times pipeline "
            "model parallel size (1) times context parallel size (1)") in res.stderr
    assert res.errors and res.stdout == ""


def test_unknown_option_is_an_argparse_error_exit_2():
    res = simulate([*GOOD, "--no-such-option", "3"], ENV)
    assert (res.exit_code, res.kind) == (2, "invalid")
    assert "pretrain_gpt.py: error: unrecognized arguments: --no-such-option 3" in res.stderr
    assert simulate([*GOOD, "--recompute-granularity", "sometimes"], ENV).exit_code == 2


def test_common_megatron_options_are_accepted_and_ignored():
    extra = ["--lr", "3e-4", "--min-lr", "3e-5", "--mock-data", "--tokenizer-type", "NullTokenizer",
             "--data-path", "a", "b", "--split", "99,1,0", "--save-interval", "1000", "--weight-decay", "0.1",
             "--transformer-impl", "transformer_engine", "--use-mcore-models", "--clip-grad", "1.0"]
    res = simulate([*GOOD, *extra], ENV)
    assert res.kind == "ok" and res.tflops == simulate(GOOD, ENV).tflops


def test_cuda_device_max_connections_is_a_warning_not_a_failure():
    res = simulate(GOOD, {})
    assert res.kind == "ok"
    assert "WARNING: using tensor/context parallelism (tp=2, cp=1) requires setting the environment variable " \
           "CUDA_DEVICE_MAX_CONNECTIONS to 1" in res.stderr
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in simulate(GOOD, ENV).stderr


def test_sequence_parallel_at_tp1_is_switched_off_with_a_warning():
    res = simulate([*LLAMA8B, *layout_args(n_gpus=8, gbs=64, recompute="full"), "--sequence-parallel"], ENV)
    assert res.kind == "ok"
    assert "Disabling sequence parallelism because tensor model parallelism is disabled" in res.stderr


def test_world_size_comes_from_the_environment_without_sim_world_size():
    args = [a for a in GOOD]
    i = args.index("--sim-world-size")
    del args[i:i + 2]
    assert "using world size: 16," in simulate(args, {**ENV, "WORLD_SIZE": "16"}).stdout
    assert simulate(args, ENV).kind == "invalid"  # world size 1 cannot hold tp=2


# --- vision tower --------------------------------------------------------------------------------------

def test_vit_gradient_checkpointing_exists_only_with_a_vision_tower():
    res = simulate([*GOOD, "--vit-gradient-checkpointing", "true"], ENV)
    assert res.exit_code == 2 and "unrecognized arguments: --vit-gradient-checkpointing" in res.stderr
    vlm = [*GOOD, "--vision-num-layers", "32", "--vision-hidden-size", "1280", "--vision-seq-length", "4096"]
    on = simulate([*vlm, "--vit-gradient-checkpointing", "true"], ENV)
    off = simulate([*vlm, "--vit-gradient-checkpointing", "false"], ENV)
    assert on.kind == off.kind == "ok"
    assert off.peak_memory_gb > on.peak_memory_gb and off.iter_seconds < on.iter_seconds


# --- the command line ----------------------------------------------------------------------------------

def test_cli_exit_codes_and_streams():
    ok = cli("zenithtune.sim", *GOOD, env=ENV)
    assert ok.returncode == 0 and "throughput per GPU (TFLOP/s/GPU)" in ok.stdout
    oom = cli("zenithtune.sim", *LLAMA8B, *layout_args(n_gpus=8, gbs=64, tp=1))
    assert oom.returncode == 1 and "torch.OutOfMemoryError: CUDA out of memory." in oom.stderr
    bad = cli("zenithtune.sim", *GOOD, "--bogus")
    assert bad.returncode == 2 and "pretrain_gpt.py: error: unrecognized arguments: --bogus" in bad.stderr


def test_cli_under_a_launcher_prints_the_log_on_rank_0_only():
    quiet = cli("zenithtune.sim", *GOOD, env={**ENV, "RANK": "3"})
    assert quiet.returncode == 0 and quiet.stdout == ""
    assert " iteration " in cli("zenithtune.sim", *GOOD, env={**ENV, "RANK": "0"}).stdout


def test_cli_sleeps_the_scaled_wall_time():
    res = simulate(GOOD, ENV)
    scale = 0.6 / res.wall_seconds
    start = time.monotonic()
    out = cli("zenithtune.sim", *GOOD, "--sim-time-scale", f"{scale:.6f}", env=ENV)
    elapsed = time.monotonic() - start
    assert out.returncode == 0 and elapsed >= 0.55


# --- ms-swift flavour ----------------------------------------------------------------------------------

SWIFT = ["sft", "--model", str(FIXTURES / "Meta-Llama-3-8B"), "--tensor_model_parallel_size", "2",
         "--sequence_parallel", "true", "--micro_batch_size", "1", "--global_batch_size", "16",
         "--max_length", "4096", "--train_iters", "5", "--recompute_granularity", "selective",
         "--dataset", "a.jsonl", "b.jsonl", "--lr", "1e-5", "--sim_world_size", "8"]
SWIFT_LOG = re.compile(r"^\{'loss': [0-9.]+, .*'iteration': '(\d+)/5', 'elapsed_time': '\d+s', .*"
                       r"'memory\(GiB\)': ([0-9.]+), 'train_speed\(s/it\)': ([0-9.]+)\}$")


def test_swift_logs_train_speed_and_memory_not_megatron_throughput():
    res = simulate_swift(SWIFT, ENV)
    assert res.kind == "ok", res.stderr
    logs = [SWIFT_LOG.match(line) for line in res.stdout.splitlines() if line.startswith("{")]
    assert [int(m.group(1)) for m in logs] == [1, 2, 3, 4, 5]
    assert "throughput per GPU" not in res.stdout and "elapsed time per iteration" not in res.stdout
    # train_speed is ms-swift's running average since training began, warm-up included
    speeds = [float(m.group(3)) for m in logs]
    assert speeds == sorted(speeds, reverse=True)
    assert speeds[-1] == pytest.approx(sum(res.iteration_seconds) / 5, rel=1e-4)
    assert float(logs[0].group(2)) < res.capacity_gb


def test_swift_accepts_dashed_aliases_and_bare_booleans():
    dashed = [a.replace("_", "-") if a.startswith("--") else a for a in SWIFT]
    bare = [a for a in SWIFT if a != "true"]
    ref = simulate_swift(SWIFT, ENV)
    assert simulate_swift(dashed, ENV).stdout == ref.stdout
    assert simulate_swift(bare, ENV).stdout == ref.stdout


def test_swift_rejects_what_megatron_rejects():
    bad = simulate_swift([*SWIFT, "--tensor_model_parallel_size", "3"], ENV)
    assert bad.exit_code == 1 and "world size (8) is not divisible" in bad.stderr
    unknown = simulate_swift([*SWIFT, "--not_an_option", "1"], ENV)
    assert unknown.exit_code == 2 and "unrecognized arguments: --not_an_option" in unknown.stderr
    missing = simulate_swift(["sft", "--model", "/nonexistent/model", "--sim_world_size", "8"], ENV)
    assert missing.exit_code == 1 and "config.json" in missing.stderr


def test_swift_vlm_vit_gradient_checkpointing_trades_memory_for_time():
    vlm = ["sft", "--model", str(FIXTURES / "Qwen2.5-VL-7B-Instruct"), "--tensor_model_parallel_size", "2",
           "--sequence_parallel", "--max_length", "8192", "--train_iters", "4", "--sim_world_size", "8"]
    on = simulate_swift([*vlm, "--vit_gradient_checkpointing", "true"], ENV)
    off = simulate_swift([*vlm, "--vit_gradient_checkpointing", "false"], ENV)
    assert on.kind == off.kind == "ok"
    assert off.peak_memory_gb > on.peak_memory_gb and off.iter_seconds < on.iter_seconds


def test_swift_cli_takes_the_world_size_from_nproc_per_node():
    args = SWIFT[:-2]
    out = cli("zenithtune.sim.swift", *args, env={**ENV, "NPROC_PER_NODE": "8"})
    assert out.returncode == 0, out.stderr
    assert "'train_speed(s/it)'" in out.stdout and "using world size: 8," in out.stdout
    assert "RuntimeWarning" not in out.stderr


def test_simresult_fields():
    res: SimResult = simulate(GOOD, ENV)
    for name in ("exit_code", "stdout", "stderr", "wall_seconds", "tflops", "iter_seconds", "peak_memory_gb",
                 "capacity_gb", "kind"):
        assert getattr(res, name) is not None


def test_any_layout_ends_in_ok_oom_or_invalid_never_a_crash():
    import random

    rng = random.Random(7)
    kinds = set()
    for _ in range(300):
        model = rng.choice(list(MODELS))
        tp, pp, cp, d = rng.choice([1, 2, 3, 4, 8]), rng.choice([1, 2, 4]), rng.choice([1, 2]), rng.choice([1, 2, 4])
        mbs = rng.choice([1, 2, 4])
        layout = layout_args(n_gpus=tp * pp * cp * d, gbs=mbs * d * rng.choice([1, 4, 16]), tp=tp, pp=pp, cp=cp,
                             ep=rng.choice([1, 2, 8]), etp=rng.choice([None, 1, 2]), mbs=mbs,
                             recompute=rng.choice([None, "selective", "full"]),
                             recompute_method=rng.choice(["uniform", "block"]),
                             recompute_num_layers=rng.choice([1, 2, 4]), vp=rng.choice([None, 2, 4]),
                             gpu=rng.choice(["h100", "h200", "a100-80g", "a100-40g"]))
        res = simulate([*MODELS[model], *layout], ENV)
        kinds.add(res.kind)
        assert res.exit_code == {"ok": 0, "oom": 1, "invalid": 1}[res.kind]
        if res.kind == "ok":
            assert 0 < res.tflops < 700 and res.peak_memory_gb < res.capacity_gb
    assert kinds == {"ok", "oom", "invalid"}
