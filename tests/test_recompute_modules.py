"""Selective recompute's module sets (--recompute-modules): searched where the model has the parts,
injected as one option with several values, kept when the command states its own, and weighed by the
memory estimate and the simulator the way Megatron-core's TransformerLayer runs them."""
from __future__ import annotations

import subprocess
import sys

from test_space import LLAMA8B, PRESET, QWEN_MOE, space

from zenithtune.command import facts
from zenithtune.inject import inject
from zenithtune.memory import estimate
from zenithtune.sim import simulate
from zenithtune.sim.models import MODELS, layout_args
from zenithtune.space import Context, Space
from zenithtune.validate import Layout

SIM = [sys.executable, "-m", "zenithtune.sim"]


def test_a_dense_model_searches_the_mlp_and_says_which_sets_do_nothing_for_it():
    s = space(LLAMA8B)
    assert s.params["recompute_modules"].choices == ("core_attn", "mlp")
    notes = " ".join(s.notes())
    assert ("recompute module sets not searched: layernorm, layernorm+moe_act, moe (layernorm: Transformer Engine "
            "fuses a dense layer's norms into its linears; moe_act, moe: the model has no MoE layers)") in notes
    sets = {c.get("recompute_modules") for c in s.walk() if c["recompute_granularity"] == "selective"}
    assert sets == {"core_attn", "mlp"}
    assert not any("recompute_modules" in c for c in s.walk() if c["recompute_granularity"] != "selective")


def test_with_the_local_implementation_only_megatrons_default_module_is_searched():
    # megatron-core 0.19, real pretrain_gpt.py on CPU, --transformer-impl local: --recompute-modules layernorm
    # crashed in CheckpointWithoutOutput.forward (NameError FP8GlobalStateManager, a TE class) and
    # --recompute-modules mlp did not finish its first iteration in 5 minutes (the grid study of tests/megatron)
    ctx = Context(n_gpus=16, gbs=64, model=QWEN_MOE, flags=facts([*SIM, "--transformer-impl", "local",
                                                                  "--moe-grouped-gemm"]))
    s = Space.from_preset(PRESET, ctx)
    assert s.params["recompute_modules"].choices == ("core_attn",)
    assert "with --transformer-impl local layernorm crashed and mlp hung" in " ".join(s.notes())


def test_a_set_naming_a_module_the_model_lacks_runs_as_the_rest_of_it():
    preset = {**PRESET, "params": {**PRESET["params"], "recompute_modules": {
        **PRESET["params"]["recompute_modules"], "values": ["core_attn", "layernorm+mlp", "moe_act"]}}}
    s = Space.from_preset(preset, Context(n_gpus=8, gbs=64, model=LLAMA8B))
    assert s.params["recompute_modules"].choices == ("core_attn", "mlp")
    notes = " ".join(s.notes())
    assert ("recompute module sets not searched: moe_act; layernorm+mlp runs as mlp (layernorm: Transformer Engine "
            "fuses a dense layer's norms into its linears; moe_act: the model has no MoE layers)") in notes


def test_a_moe_model_searches_the_moe_sets_and_moe_act_needs_grouped_gemm():
    s = space(QWEN_MOE, n_gpus=16)
    assert s.params["recompute_modules"].choices == ("core_attn", "layernorm", "layernorm+moe_act", "moe")
    cand = {"tp": 1, "ep": 8, "etp": 1, "mbs": 1, "recompute_granularity": "selective",
            "recompute_modules": "layernorm+moe_act"}
    assert [r for r, _ in s.reasons(cand)] == ["recompute_modules"]  # Megatron: moe_act needs grouped GEMM
    gg = Space.from_preset(PRESET, Context(n_gpus=16, gbs=64, model=QWEN_MOE,
                                           flags=facts([*SIM, "--moe-grouped-gemm"])))
    assert gg.reasons(cand) == []


def test_a_module_set_is_injected_as_one_option_with_several_values():
    s = space(QWEN_MOE, n_gpus=16)
    cand = {"tp": 1, "ep": 8, "etp": 1, "mbs": 1, "recompute_granularity": "selective",
            "recompute_modules": "layernorm+moe_act"}
    argv = inject([*SIM, "--recompute-modules", "core_attn", "--bf16"], s.options(cand))
    assert argv[argv.index("--recompute-modules"):][:3] == ["--recompute-modules", "layernorm", "moe_act"]
    assert argv.count("--recompute-modules") == 1
    # Megatron's default set leaves the option out; so does any other granularity
    for other in ({**cand, "recompute_modules": "core_attn"}, {**cand, "recompute_granularity": "none"}):
        assert "--recompute-modules" not in inject([*SIM, "--bf16"], s.options(other))
    swift = ["megatron", "sft", "--model", "Qwen/Qwen3-30B-A3B"]
    out = inject(swift, s.options(cand))
    assert out[out.index("--recompute_modules"):][:3] == ["--recompute_modules", "layernorm", "moe_act"]


def test_the_commands_own_modules_run_and_are_not_searched():
    argv = [*SIM, "--recompute-modules", "mlp", "--bf16"]
    s = Space.from_preset(PRESET, Context(n_gpus=8, gbs=64, model=LLAMA8B, flags=facts(argv)))
    assert "recompute_modules" not in s.params
    assert any("--recompute-modules mlp is the command's" in n for n in s.notes())
    cand = {"tp": 2, "mbs": 1, "recompute_granularity": "selective"}
    assert s.layout(cand).recompute_modules == ("mlp",)
    assert inject(argv, s.options(cand)).count("mlp") == 1


def test_a_preset_value_naming_no_megatron_module_is_one_line(tmp_path):
    out = subprocess.run([sys.executable, "-m", "zenithtune", "-m", "n_gpus=8", "gbs=64",
                          "preset.params.recompute_modules.values=[core_attn,attn]"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "Traceback" not in out.stderr + out.stdout
    line = [x for x in (out.stderr + out.stdout).splitlines() if "attn" in x]
    assert line and "recompute module set 'attn': attn is not one of Megatron's modules" in line[0], out.stderr


def _gb(model, gran, modules=None, **kw):
    lay = Layout(n_gpus=8, gbs=64, tp=2, mbs=1, sequence_parallel=True, recompute_granularity=gran,
                 recompute_modules=modules, recompute_method="uniform" if gran == "full" else None,
                 recompute_num_layers=1 if gran == "full" else None, **kw)
    est = estimate(lay, model)
    assert est is not None
    return est.total_gb


def test_the_estimate_orders_module_sets_by_what_they_keep():
    # flash attention: the default core_attn keeps what no recompute keeps; the MLP is most of a layer
    none, core, mlp, full = (_gb(LLAMA8B, None), _gb(LLAMA8B, "selective"), _gb(LLAMA8B, "selective", ("mlp",)),
                             _gb(LLAMA8B, "full"))
    assert none == core > mlp > full
    assert _gb(LLAMA8B, "selective", ("layernorm",)) == core  # fused into TE's linears
    moe = [_gb(QWEN_MOE, "selective", m, ep=8, etp=1) for m in (None, ("layernorm",), ("layernorm", "moe_act"),
                                                                   ("moe",))]
    assert moe == sorted(moe, reverse=True) and len(set(moe)) == 4


def _sim(model: str, modules: tuple[str, ...] | None, **kw) -> float | None:
    argv = [*MODELS[model], *layout_args(**kw)]
    if modules:
        argv += ["--recompute-modules", *modules]
    return simulate(argv).tflops


def test_the_simulator_trades_recompute_time_for_memory_module_by_module():
    # Llama-3-70B, 64 H100, TP4 PP4, gbs 128: no recompute does not fit; re-running the MLPs fits and
    # costs less than re-running whole layers
    at = dict(n_gpus=64, gbs=128, tp=4, pp=4)
    assert _sim("llama3-70b", None, recompute=None, **at) is None
    mlp, full = _sim("llama3-70b", ("mlp",), **at), _sim("llama3-70b", None, recompute="full", **at)
    assert mlp is not None and full is not None and mlp > full
    # where everything fits, more recompute is only slower
    small = dict(n_gpus=8, gbs=64, tp=2)
    speeds = [_sim("llama3-8b", None, recompute=None, **small), _sim("llama3-8b", ("core_attn",), **small),
              _sim("llama3-8b", ("mlp",), **small), _sim("llama3-8b", None, recompute="full", **small)]
    assert all(v is not None for v in speeds) and speeds == sorted(speeds, reverse=True), speeds

