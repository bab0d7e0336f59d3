"""The communication-overlap switches zenithtune searches (issue 23): TP communication overlap
(--tp-comm-overlap) and expert-parallel all-to-all overlap (--overlap-moe-expert-parallel-comm).
Each is injected as Megatron's bare flag, searched only where Megatron accepts it (checked against
megatron-core 0.19's TransformerConfig in tests/megatron), weighed by the memory estimate, and kept
when the command turns it on itself."""
from __future__ import annotations

import sys

from test_space import LLAMA8B, PRESET, QWEN_MOE, space

from zenithtune.command import facts
from zenithtune.dominance import needs_no_more
from zenithtune.inject import inject
from zenithtune.memory import estimate
from zenithtune.sim import simulate
from zenithtune.sim.models import MODELS, layout_args
from zenithtune.space import Context, Space
from zenithtune.validate import Layout, check

SIM = [sys.executable, "-m", "zenithtune.sim"]
A2A = ["--moe-token-dispatcher-type", "alltoall", "--moe-grouped-gemm"]


def _moe_space(*extra: str, n_gpus: int = 16) -> Space:
    return Space.from_preset(PRESET, Context(n_gpus=n_gpus, gbs=128, model=QWEN_MOE, flags=facts([*SIM, *extra])))


def test_tp_overlap_is_searched_only_where_sequence_parallelism_runs():
    s = space(LLAMA8B)
    walked = list(s.walk())
    assert {c["tp_comm_overlap"] for c in walked if c["tp"] > 1} == {False, True}
    assert {c["tp_comm_overlap"] for c in walked if c["tp"] == 1} == {False}  # Megatron: it needs SP
    cand = {"tp": 2, "mbs": 1, "recompute_granularity": "none", "tp_comm_overlap": True}
    argv = inject([*SIM, "--bf16"], s.options(cand))
    assert "--tp-comm-overlap" in argv and "--sequence-parallel" in argv
    assert "--tp-comm-overlap" not in inject([*SIM, "--bf16"], s.options({**cand, "tp_comm_overlap": False}))
    assert "--tp-comm-overlap" not in inject([*SIM, "--bf16", "--tp-comm-overlap"], s.options({**cand, "tp": 1,
                                                                                                "tp_comm_overlap": False}))
    assert [r for r, _ in s.reasons({**cand, "tp": 1})] == ["tp_comm_overlap"]


def test_a_candidate_from_before_the_switches_runs_them_off():
    s = space(LLAMA8B)
    old = {"tp": 2, "mbs": 1, "recompute_granularity": "none"}
    assert s.key(old) == s.key({**old, "tp_comm_overlap": False}) != s.key({**old, "tp_comm_overlap": True})
    assert not s.layout(old).tp_comm_overlap


def test_the_commands_own_tp_overlap_runs_and_is_not_searched():
    argv = [*SIM, "--tp-comm-overlap", "--bf16"]
    s = Space.from_preset(PRESET, Context(n_gpus=8, gbs=64, model=LLAMA8B, flags=facts(argv)))
    assert "tp_comm_overlap" not in s.params
    assert any("tp_comm_overlap: --tp-comm-overlap is the command's" in n for n in s.notes())
    out = inject(argv, s.options({"tp": 2, "mbs": 1, "recompute_granularity": "none"}))
    assert out.count("--tp-comm-overlap") == 1
    assert "--tp-comm-overlap" not in inject(argv, s.options({"tp": 1, "mbs": 1, "recompute_granularity": "none"}))


def test_the_local_implementation_searches_no_tp_overlap():
    s = Space.from_preset(PRESET, Context(n_gpus=8, gbs=64, model=LLAMA8B,
                                          flags=facts([*SIM, "--transformer-impl", "local"])))
    assert "tp_comm_overlap" not in s.params
    assert any("tp_comm_overlap: not searched: --transformer-impl local" in n for n in s.notes())


def test_ep_overlap_needs_an_all_to_all_dispatcher_and_says_how_to_search_it():
    s = _moe_space()  # Megatron's default dispatcher, allgather, has nothing to overlap
    assert "moe_a2a_overlap" not in s.params
    assert any("add --moe-token-dispatcher-type alltoall to search it" in n for n in s.notes())
    swift = Space.from_preset(PRESET, Context(n_gpus=16, gbs=128, model=QWEN_MOE,
                                              flags=facts(["megatron", "sft", "--model", "Qwen/Qwen3-30B-A3B"])))
    assert "moe_a2a_overlap" not in swift.params
    assert "moe_a2a_overlap" not in space(LLAMA8B).params  # a dense model has no all-to-alls


def test_ep_overlap_is_searched_where_megatron_accepts_it():
    s = _moe_space(*A2A)
    on = [c for c in s.walk() if c.get("moe_a2a_overlap")]
    assert on, "EP overlap should be searched with the alltoall dispatcher"
    for c in on:
        assert c["ep"] > 1 and c["recompute_granularity"] != "full"
        assert c.get("recompute_modules") != "moe"
        assert c["pp"] == 1 or c["vp"] > 1
    base = {"tp": 2, "pp": 1, "ep": 8, "etp": 1, "mbs": 1, "recompute_granularity": "none", "moe_a2a_overlap": True}
    assert s.reasons(base) == []
    for bad, words in (({"ep": 1}, "only supported with expert model parallelism"),
                       ({"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
                        "disable full recomputation"),
                       ({"recompute_granularity": "selective", "recompute_modules": "moe"}, "disable moe in recompute_modules"),
                       ({"pp": 2, "vp": 1}, "virtual_pipeline_model_parallel_size must be specified")):
        reasons = s.reasons({**base, **bad})
        assert [r for r, _ in reasons] == ["moe_a2a_overlap"], (bad, reasons)
        assert words in reasons[0][1]
    assert s.reasons({**base, "pp": 2, "vp": 2}) == []
    argv = inject([*SIM, *A2A], s.options(base))
    assert "--overlap-moe-expert-parallel-comm" in argv
    assert "--overlap-moe-expert-parallel-comm" not in inject([*SIM, *A2A], s.options({**base, "moe_a2a_overlap": False}))


def test_the_simulator_refuses_ep_overlap_as_megatron_does():
    argv = [*MODELS["qwen3-30b-a3b"], *A2A, *layout_args(n_gpus=16, gbs=128, tp=2, pp=2, ep=8, etp=1, recompute=None),
            "--overlap-moe-expert-parallel-comm"]
    res = simulate(argv)
    assert res.kind == "invalid" and "virtual_pipeline_model_parallel_size must be specified" in res.stderr


def test_ep_overlap_hides_the_all_to_alls_for_a_micro_batch_of_memory():
    # Qwen3-30B-A3B on 16 H100, TP2 PP2 VP2 EP8 (NVIDIA's tuning notes: EP overlap took this model on 16 H100
    # from 244 to 287 TFLOP/s/GPU): faster with the overlap, and it holds more memory
    def run(on: bool):
        argv = [*MODELS["qwen3-30b-a3b"], *A2A, "--overlap-grad-reduce",
                *layout_args(n_gpus=16, gbs=128, tp=2, pp=2, vp=2, ep=8, etp=1, recompute=None)]
        return simulate(argv + (["--overlap-moe-expert-parallel-comm"] if on else []))
    off, on = run(False), run(True)
    assert off.tflops and on.tflops and on.tflops > 1.05 * off.tflops
    assert on.peak_memory_gb > off.peak_memory_gb
    lay = Layout(n_gpus=16, gbs=128, tp=2, pp=2, ep=8, etp=1, vpp_size=2, sequence_parallel=True,
                 moe_dispatcher="alltoall")
    with_overlap = Layout(**{**lay.__dict__, "moe_a2a_overlap": True})
    a, b = estimate(lay, QWEN_MOE), estimate(with_overlap, QWEN_MOE)
    assert a is not None and b is not None and b.activations_gb > a.activations_gb
    # by structure: the run without it needs no more than the same run with it, never the reverse
    assert needs_no_more(lay, with_overlap, num_layers=48) and not needs_no_more(with_overlap, lay, num_layers=48)
    assert check(with_overlap, QWEN_MOE) == []


def test_tp_overlap_costs_userbuffers_in_the_estimate_and_the_simulator():
    lay = Layout(n_gpus=8, gbs=64, tp=4, mbs=1, sequence_parallel=True)
    a, b = estimate(lay, LLAMA8B), estimate(Layout(**{**lay.__dict__, "tp_comm_overlap": True}), LLAMA8B)
    assert a is not None and b is not None and b.overhead_gb > a.overhead_gb and b.activations_gb == a.activations_gb
    argv = [*MODELS["llama3-8b"], *layout_args(n_gpus=8, gbs=64, tp=4, recompute=None)]
    off, on = simulate(argv), simulate(argv + ["--tp-comm-overlap"])
    assert off.tflops and on.tflops and on.tflops > off.tflops and on.peak_memory_gb > off.peak_memory_gb


def test_dp_overlap_is_added_to_every_trial_when_the_preset_says_auto():
    # preset dp_overlap=auto (opt-in): Megatron-core's gradient and parameter buffers exist either way
    cand = {"tp": 2, "mbs": 1, "recompute_granularity": "none", "tp_comm_overlap": False}
    dist = [*SIM, "--bf16", "--use-distributed-optimizer"]
    auto = {**PRESET, "dp_overlap": "auto"}
    s = Space.from_preset(auto, Context(n_gpus=8, gbs=64, model=LLAMA8B, flags=facts(dist)))
    out = inject(dist, s.options(cand))
    assert out.count("--overlap-grad-reduce") == 1 and out.count("--overlap-param-gather") == 1
    assert any(n.startswith("data-parallel overlap: --overlap-grad-reduce and --overlap-param-gather added")
               for n in s.notes())
    # without the distributed optimizer Megatron refuses the parameter gather: only the gradient reduce
    plain = [*SIM, "--bf16"]
    s = Space.from_preset(auto, Context(n_gpus=8, gbs=64, model=LLAMA8B, flags=facts(plain)))
    out = inject(plain, s.options(cand))
    assert "--overlap-grad-reduce" in out and "--overlap-param-gather" not in out
    # the command's own flags stay as written, once; dp_overlap=command adds nothing
    own = [*dist, "--overlap-grad-reduce"]
    s = Space.from_preset(auto, Context(n_gpus=8, gbs=64, model=LLAMA8B, flags=facts(own)))
    out = inject(own, s.options(cand))
    assert out.count("--overlap-grad-reduce") == 1 and out.count("--overlap-param-gather") == 1
    # the default, dp_overlap=command, adds nothing (a trainer not knowing the flags would refuse every trial)
    # and says what the command lacks
    s = Space.from_preset(PRESET, Context(n_gpus=8, gbs=64, model=LLAMA8B, flags=facts(plain)))
    assert "--overlap-grad-reduce" not in inject(plain, s.options(cand))
    assert any(n.startswith("data-parallel overlap: the command lacks --overlap-grad-reduce; preset.dp_overlap=auto")
               for n in s.notes())
    # ms-swift: booleans take a value (its MegatronArguments use the distributed optimizer by default)
    swift = ["megatron", "sft", "--model", "Qwen/Qwen3-8B"]
    s = Space.from_preset(auto, Context(n_gpus=8, gbs=64, model=LLAMA8B, flags=facts(swift)))
    out = inject(swift, s.options(cand))
    assert out[out.index("--overlap_grad_reduce") + 1] == "true"
    assert out[out.index("--overlap_param_gather") + 1] == "true"


def test_dp_overlap_hides_the_gradient_sync_in_the_simulator():
    argv = [*MODELS["llama3-8b"], *layout_args(n_gpus=8, gbs=64, tp=2, recompute=None)]
    off, on = simulate(argv), simulate([*argv, "--overlap-grad-reduce", "--overlap-param-gather"])
    assert off.tflops and on.tflops and on.tflops > off.tflops and on.peak_memory_gb == off.peak_memory_gb


def test_a_dp_overlap_mode_that_does_not_exist_is_one_line(tmp_path):
    import subprocess
    out = subprocess.run([sys.executable, "-m", "zenithtune", "-m", "n_gpus=8", "gbs=64", "preset.dp_overlap=always"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "Traceback" not in out.stderr + out.stdout
    assert "preset.dp_overlap='always' is not one of auto|command" in out.stderr + out.stdout


def test_a_bound_leaves_room_for_the_userbuffers_a_run_did_not_have():
    from zenithtune.memory import MemoryModel, userbuffers_gb
    lay = Layout(n_gpus=8, gbs=64, tp=4, mbs=1, sequence_parallel=True)
    on = Layout(**{**lay.__dict__, "tp_comm_overlap": True})
    mm = MemoryModel(LLAMA8B, 80.0)
    mm.observe_success(lay, 70.0, reserved_gb=72.0)
    assert userbuffers_gb(on, LLAMA8B) > 0 == userbuffers_gb(lay, LLAMA8B)
    assert mm.bound_limit(on) < mm.bound_limit(lay)
