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
