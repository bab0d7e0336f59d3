"""Learning from a refusal: the trainer's message -> the injected options it refused -> which later
candidates carry them (tested by table, with real Megatron / argparse messages)."""
from __future__ import annotations

import pytest

from zenithtune.traits import refused

TP2 = {"--tensor-model-parallel-size": "2", "--pipeline-model-parallel-size": "1", "--micro-batch-size": "1",
       "--recompute-granularity": "full", "--recompute-method": "block", "--recompute-num-layers": "1",
       "--global-batch-size": "8", "--sequence-parallel": True}
TP1 = {**TP2, "--tensor-model-parallel-size": "1", "--sequence-parallel": False}


@pytest.mark.parametrize("message,refused_options", [
    ("AssertionError: sequence parallel not supported by torch LayerNorm when instantiating TransformerLayer",
     [("--sequence-parallel", "true")]),
    ("pretrain_gpt.py: error: unrecognized arguments: --recompute-method block --recompute-num-layers 1",
     [("--recompute-method", "*"), ("--recompute-num-layers", "*")]),
    ("NotImplementedError: recompute_method block is not supported with the local transformer implementation",
     [("--recompute-method", "block")]),
])
def test_a_refusal_names_the_injected_features(message, refused_options):
    trait = refused(message, TP2, trial=3)
    assert trait is not None and list(trait.options) == refused_options
    assert trait.describe().startswith("the trainer refused ") and "trial 3" in trait.describe()


@pytest.mark.parametrize("message", [
    "RuntimeError: NCCL error in: ProcessGroupNCCL.cpp:1191, unhandled system error",  # broke, refused nothing
    "exit code 1: Traceback (most recent call last):",
    # sizes are the validator's business: no trait from a divisibility message
    "AssertionError: global batch size (8) is not divisible by micro batch size (1) times data parallel size (3)",
    "",
])
def test_a_failure_that_names_no_injected_feature_teaches_nothing(message):
    assert refused(message, TP2) is None


def test_the_trait_prunes_only_candidates_that_carry_it():
    trait = refused("AssertionError: sequence parallel not supported by torch LayerNorm", TP2, trial=0)
    assert trait.matches(TP2) and trait.matches({**TP2, "--micro-batch-size": "2"})
    assert not trait.matches(TP1)  # TP1 runs without sequence parallelism
    unknown = refused("error: unrecognized arguments: --recompute-method uniform", TP2, trial=1)
    assert unknown.matches({**TP2, "--recompute-method": "uniform"})  # refused whatever its value
    assert not unknown.matches({**TP2, "--recompute-method": None})  # selective: the option is removed


@pytest.mark.slow
def test_one_refused_feature_costs_one_launch(tmp_path):
    """A trainer that refuses sequence parallelism: the first TP>1 launch fails as invalid_args with
    Megatron's words, every other TP>1 candidate (which would carry --sequence-parallel) is pruned with
    that reason, and the TP=1 candidates still run."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import optuna

    toy = str(Path(__file__).parent / "fixtures" / "toy_trainer.py")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZENITHTUNE_")}
    r = subprocess.run([sys.executable, "-m", "zenithtune", "-m", "n_gpus=4", "gbs=8", "strategy=grid", "mbs_max=1",
                        "n_trials=40", "--", sys.executable, toy, "--some-user-opt", "1", "--refuse-sp", "--num-layers", "2"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    db = next((tmp_path / "outputs").glob("study_*/study.db"))
    trials = optuna.load_study(study_name="zenithtune", storage=f"sqlite:///{db}").trials
    launched_tp2 = [t for t in trials if t.user_attrs.get("launched") and t.user_attrs["candidate"]["tp"] > 1]
    assert len(launched_tp2) == 1
    assert launched_tp2[0].user_attrs["kind"] == "invalid_args"
    assert "sequence parallel not supported" in launched_tp2[0].user_attrs["reasons"][0]
    refused = [t for t in trials if "refused" in (t.user_attrs.get("rules") or [])]
    assert refused and all(t.user_attrs["candidate"]["tp"] > 1 for t in refused)
    assert "the trainer refused --sequence-parallel in trial" in refused[0].user_attrs["reasons"][0]
    assert any(t.value and t.user_attrs["candidate"]["tp"] == 1 for t in trials)
