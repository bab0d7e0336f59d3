"""The perturbed simulator (sim/perturb.py): a trainer that disagrees with the tuner's models, seeded."""
from __future__ import annotations

import pytest

from zenithtune.sim import simulate
from zenithtune.sim.models import MODELS, layout_args
from zenithtune.sim.perturb import COMPONENTS, Perturbation

ENV = {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
MOE = ["--num-layers=8", "--hidden-size=1024", "--ffn-hidden-size=2816", "--num-attention-heads=8",
       "--num-experts=8", "--moe-router-topk=2", "--seq-length=2048", "--max-position-embeddings=2048",
       "--vocab-size=32000", "--swiglu", "--disable-bias-linear", "--micro-batch-size=2", "--global-batch-size=32",
       "--train-iters=4", "--bf16", "--use-distributed-optimizer", "--log-throughput", "--sim-world-size=8",
       "--expert-model-parallel-size=4", "--tensor-model-parallel-size=2", "--sequence-parallel"]
DENSE_PP = [*MODELS["llama3-8b"], *layout_args(n_gpus=8, gbs=8, tp=2, pp=2)]  # 4 micro-batches: a big bubble


def test_a_seed_draws_every_component_within_the_scale_and_always_the_same():
    a, b = Perturbation.draw(7, 0.3), Perturbation.draw(7, 0.3)
    assert a == b and a != Perturbation.draw(8, 0.3)
    factors = [getattr(a, n) for n in COMPONENTS]
    assert all(0.7 <= f <= 1.3 for f in factors) and len(set(factors)) == len(factors)


@pytest.mark.parametrize("spec, grows", [("expert_activations=1.5", "memory"), ("activations=1.3", "memory"),
                                         ("weights=1.3", "memory"), ("optimizer=1.3", "memory"),
                                         ("logits=1.5", "memory"), ("ep_comm=2", "time"), ("tp_comm=2", "time"),
                                         ("gemm=0.8", "time")])
def test_each_factor_moves_its_own_component(spec, grows):
    base, pert = simulate(MOE, ENV), simulate([*MOE, f"--sim-perturb={spec}"], ENV)
    assert base.kind == pert.kind == "ok"
    if grows == "memory":
        assert pert.max_allocated_mb > base.max_allocated_mb * 1.01
        assert pert.tflops == pytest.approx(base.tflops, rel=0.01)  # only the noise seed moved
    else:
        assert pert.tflops < base.tflops * 0.98
        assert pert.max_allocated_mb == pytest.approx(base.max_allocated_mb)
    assert f"perturbed trainer: {spec.split('=')[0]} x" in pert.stdout


def test_pipeline_costs_follow_pp_comm():
    base, pert = simulate(DENSE_PP, ENV), simulate([*DENSE_PP, "--sim-perturb=pp_comm=1.3"], ENV)
    assert pert.tflops < base.tflops * 0.99


def test_bad_perturbation_options_fail_in_one_line_naming_the_value():
    res = simulate([*MOE, "--sim-perturb=foo=2"], ENV)
    assert res.kind == "invalid" and "'foo=2'" in res.stderr.splitlines()[-1]
    res = simulate([*MOE, "--sim-perturb-seed=1", "--sim-perturb-scale=2"], ENV)
    assert res.kind == "invalid" and "--sim-perturb-scale 2.0 must be in" in res.stderr.splitlines()[-1]


def test_the_swift_flavour_takes_the_same_perturbation():
    from test_sim import SWIFT

    from zenithtune.sim import simulate_swift

    base = simulate_swift(SWIFT, ENV)
    pert = simulate_swift([*SWIFT, "--sim_perturb", "gemm=0.7,activations=1.3"], ENV)
    assert pert.kind == base.kind == "ok"
    assert pert.iter_seconds > base.iter_seconds * 1.05 and pert.peak_memory_gb > base.peak_memory_gb
