"""The command checked against the settings before any launch (issue 14 items 2 and 6), by table,
plus `model=` end to end: the simulator plays it, or a disagreeing command is refused."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from zenithtune.errors import UserError
from zenithtune.preflight import check_command, check_model, with_model

MODELS = Path(__file__).parent / "fixtures" / "models"
MEGATRON = "zenithtune.evaluate.MegatronThroughput"
SIM = [sys.executable, "-m", "zenithtune.sim", "--num-layers=32", "--log-throughput"]


@pytest.mark.parametrize("argv, n_gpus, message", [
    (["torchrun", "--nproc-per-node", "4", "pretrain_gpt.py", "--log-throughput"], 8,
     "n_gpus=8 but the command starts 4 processes (torchrun --nproc-per-node 4 x --nnodes 1)"),
    (["torchrun", "--nnodes=2", "--nproc_per_node=8", "pretrain_gpt.py", "--log-throughput"], 8,
     "n_gpus=8 but the command starts 16 processes"),
    ([*SIM, "--sim-world-size=4"], 8, "n_gpus=8 but the simulator command says --sim-world-size 4"),
    (SIM, 8, "the simulator command has no --sim-world-size: add --sim-world-size 8"),
    (["torchrun", "--nproc-per-node", "8", "pretrain_gpt.py", "--num-layers", "4"], 8, "has no --log-throughput"),
])
def test_a_command_that_cannot_match_the_settings_is_refused_in_one_line(argv, n_gpus, message, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(UserError) as err:
        check_command(argv, n_gpus=n_gpus, evaluator_target=MEGATRON)
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("argv", [
    ["torchrun", "--nproc-per-node", "8", "pretrain_gpt.py", "--log-throughput"],
    ["torchrun", "--nnodes", "2", "--nproc-per-node", "4", "pretrain_gpt.py", "--log-throughput"],
    ["torchrun", "--nproc-per-node", "gpu", "pretrain_gpt.py", "--log-throughput"],  # decided at run time
    [*SIM, "--sim-world-size", "8"],
    ["python", "train.py", "--lr", "1"],  # not a command this module knows: passes
])
def test_a_matching_or_unknown_command_passes(argv):
    check_command(argv, n_gpus=8, evaluator_target=MEGATRON)


def test_other_evaluators_do_not_need_log_throughput():
    check_command(["python", "pretrain_gpt.py"], n_gpus=8, evaluator_target="zenithtune.evaluate.Regex")


def test_a_model_that_disagrees_with_the_commands_shape_names_both():
    argv = ["python", "pretrain_gpt.py", "--num-layers", "32", "--hidden-size", "4096", "--num-attention-heads", "32"]
    with pytest.raises(UserError) as err:
        check_model(argv, str(MODELS / "Qwen3-30B-A3B"))
    assert "disagrees with the command's shape (num_layers: model 48, command 32; hidden_size: model 2048, " \
           "command 4096" in str(err.value)
    check_model(argv + ["--group-query-attention", "--num-query-groups", "8"], str(MODELS / "Meta-Llama-3-8B"))


def test_the_default_simulator_command_plays_the_model():
    argv = with_model([sys.executable, "-m", "zenithtune.sim", "--num-layers=32", "--hidden-size=4096", "--swiglu",
                       "--sim-world-size=8"], str(MODELS / "Qwen3-30B-A3B"))
    text = " ".join(argv)
    assert "--num-layers=48" in text and "--hidden-size=2048" in text and "--num-experts 128" in text
    assert "--moe-router-topk 8" in text and "--swiglu" in text and "--sim-world-size=8" in text


def _zt(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZENITHTUNE_")}
    return subprocess.run([sys.executable, "-m", "zenithtune", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=180)


def test_model_with_the_default_command_tunes_that_model_on_the_simulator(tmp_path):
    r = _zt(tmp_path, "-m", "n_gpus=8", "gbs=64", "strategy=grid", "n_trials=1", f"model={MODELS / 'Qwen3-30B-A3B'}")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "Qwen3-30B-A3B: 48 layers, h=2048, 32 heads / 4 groups, 128 experts top-8" in r.stdout
    assert "--num-experts 128" in r.stdout and "PyTorch was not found" not in r.stderr


def test_model_and_command_that_disagree_or_a_model_offline_are_one_line(tmp_path):
    sim = [sys.executable, "-m", "zenithtune.sim", "--num-layers=32", "--hidden-size=4096", "--num-attention-heads=32",
           "--seq-length=4096", "--vocab-size=32000", "--log-throughput", "--sim-world-size=8"]
    r = _zt(tmp_path, "-m", "n_gpus=8", "gbs=64", f"model={MODELS / 'Qwen3-30B-A3B'}", "--", *sim)
    assert r.returncode == 2 and "disagrees with the command's shape" in r.stderr, r.stderr
    r = _zt(tmp_path, "-m", "n_gpus=8", "gbs=64", "model=acme/NoSuchModel-7B")
    assert r.returncode == 2 and "hf download acme/NoSuchModel-7B config.json" in r.stderr, r.stderr
    assert "PyTorch was not found" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
