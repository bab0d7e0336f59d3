"""Simulator flavours (sim/flavours.py) and measurement noise (sim/noise.py): each flavour changes the law it
claims to change, and nothing else; noise is seeded per run and leaves the true value known."""
from __future__ import annotations

import re

import pytest

from zenithtune.sim import simulate
from zenithtune.sim.models import MODELS, layout_args

ENV = {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
SMALL_MOE = ["--num-layers=8", "--hidden-size=1024", "--ffn-hidden-size=2816", "--num-attention-heads=8",
             "--num-experts=8", "--moe-router-topk=2", "--moe-ffn-hidden-size=2816", "--seq-length=4096",
             "--max-position-embeddings=4096", "--vocab-size=32000", "--swiglu", "--disable-bias-linear"]


def run(*argv: str, flavour: str | None = None, env: dict[str, str] | None = None):
    res = simulate([*argv, *([f"--sim-flavour={flavour}"] if flavour else [])], {**ENV, **(env or {})})
    assert res.kind == "ok", res.stderr
    return res


def memory_line(res) -> dict[str, float]:
    """Megatron's memory report of the first stage, as the log prints it (MB)."""
    line = next(x for x in res.stdout.splitlines() if "memory (MB)" in x)
    return {k.strip(): float(v) for k, v in re.findall(r"\| ([a-z ]+): ([0-9.]+)", line)}


def dense(mbs: int = 1, recompute: str | None = None, **kw) -> tuple[str, ...]:
    return (*MODELS["llama3-8b"], *layout_args(n_gpus=8, gbs=64, tp=kw.pop("tp", 4), mbs=mbs, recompute=recompute,
                                               gpu="h200", **kw))


def activations(res) -> float:
    mem = memory_line(res)
    return mem["max allocated"] - mem["allocated"]


def test_mbs_buffers_make_activation_memory_grow_faster_than_the_micro_batch():
    def growth(flavour: str | None) -> float:
        a1, a2, a4 = (activations(run(*dense(b), flavour=flavour)) for b in (1, 2, 4))
        return (a4 - a1) / (a2 - a1)  # 3 when the bytes are linear in b

    assert growth(None) == pytest.approx(3.0, rel=0.02)
    assert growth("mbs_buffers") > 3.3
    assert growth("mbs_buffers=0.2") > growth("mbs_buffers")


def test_fragmentation_flavour_depends_on_recompute_and_micro_batch():
    def reserved_share(flavour: str | None, mbs: int, recompute: str | None) -> float:
        mem = memory_line(run(*dense(mbs, recompute), flavour=flavour))
        return mem["max reserved"] / mem["max allocated"]

    plain = [reserved_share(None, b, None) for b in (1, 4)]
    assert plain[0] == pytest.approx(plain[1], abs=0.01)  # the plain law ignores MBS
    low = reserved_share("fragmentation", 1, None)
    assert reserved_share("fragmentation", 4, None) > low + 0.05
    assert reserved_share("fragmentation", 1, "full") > low + 0.08


@pytest.mark.parametrize("spec, gib", [("overhead", 5.0), ("overhead=2", 2.0), ("overhead=8", 8.0)])
def test_a_fixed_overhead_outside_the_allocator_adds_its_gib_to_the_peak(spec, gib):
    base, flav = run(*dense()), run(*dense(), flavour=spec)
    assert flav.peak_memory_gb - base.peak_memory_gb == pytest.approx(gib, abs=0.01)
    assert flav.max_allocated_mb == pytest.approx(base.max_allocated_mb)  # outside PyTorch's allocator


def test_a_fixed_overhead_turns_a_near_fit_into_an_oom_at_the_gpus_capacity():
    near = (*MODELS["llama3-8b"], *layout_args(n_gpus=8, gbs=64, tp=4, mbs=4, recompute=None))
    base = run(*near)
    assert base.capacity_gb - base.peak_memory_gb < 8.0
    res = simulate([*near, "--sim-flavour=overhead=8"], ENV)
    assert res.kind == "oom" and "CUDA out of memory" in res.stderr
    assert "Including non-PyTorch memory" in res.stderr.splitlines()[-1]


def test_etp_experts_divide_expert_activations_by_etp_not_tp():
    def act(flavour: str | None, etp: int) -> float:
        return activations(run(*SMALL_MOE, *layout_args(n_gpus=8, gbs=32, tp=2, ep=4, etp=etp, recompute=None),
                               flavour=flavour))

    plain_drop = act(None, 1) - act(None, 2)
    flav_drop = act("etp_experts", 1) - act("etp_experts", 2)
    assert abs(plain_drop) < 0.02 * act(None, 1)  # the plain law: TP divides them, ETP does not
    assert flav_drop > 0.1 * act("etp_experts", 1)


def test_more_memory_scales_every_allocated_byte():
    base, flav = run(*dense()), run(*dense(), flavour="more_memory")
    assert flav.max_allocated_mb == pytest.approx(1.2 * base.max_allocated_mb, rel=1e-6)


def test_tp_exposed_makes_tp8_slower_relative_to_tp1_than_the_plain_simulator():
    def ratio(flavour: str | None) -> float:
        return run(*dense(tp=8), flavour=flavour).true_tflops / run(*dense(tp=1), flavour=flavour).true_tflops

    assert ratio("tp_exposed") < 0.93 * ratio(None)
    assert run(*dense(tp=1), flavour="tp_exposed").true_tflops == pytest.approx(run(*dense(tp=1)).true_tflops,
                                                                              rel=0.01)


def test_a2a_dp_carved_sends_the_all_to_all_across_nodes_once_tp_times_ep_leaves_the_node():
    def tflops(flavour: str | None, tp: int) -> float:
        return run(*SMALL_MOE, *layout_args(n_gpus=16, gbs=64, tp=tp, ep=8, etp=1, recompute=None),
                   flavour=flavour).true_tflops

    inside = tflops("a2a_dp_carved", 1) / tflops(None, 1)  # EP 8 inside a node: only per-peer latency
    across = tflops("a2a_dp_carved", 2) / tflops(None, 2)  # TP 2 x EP 8 = 16 ranks: two nodes
    assert inside > 0.9 and across < 0.8 * inside


def test_slow_network_only_slows_what_crosses_nodes():
    one_node = layout_args(n_gpus=8, gbs=64, tp=2, recompute=None, gpu="h200")
    two_nodes = layout_args(n_gpus=16, gbs=64, tp=2, recompute=None, gpu="h200")
    m = MODELS["llama3-8b"]
    assert run(*m, *one_node, flavour="slow_network").true_tflops == pytest.approx(run(*m, *one_node).true_tflops,
                                                                                  rel=0.01)
    assert run(*m, *two_nodes, flavour="slow_network").true_tflops < 0.97 * run(*m, *two_nodes).true_tflops


def test_sync_warmup_makes_the_pipeline_bubble_costlier():
    def ratio(flavour: str | None) -> float:
        few = dict(n_gpus=8, gbs=8, tp=2, recompute=None, gpu="h200")  # 8 micro-batches: the bubble matters
        pp4 = run(*MODELS["llama3-8b"], *layout_args(pp=4, **few), flavour=flavour).true_tflops
        return pp4 / run(*MODELS["llama3-8b"], *layout_args(pp=1, **few), flavour=flavour).true_tflops

    assert ratio("sync_warmup") < 0.97 * ratio(None)


def test_gemm_waves_follow_wave_quantization():
    from zenithtune.sim.arguments import parse_megatron
    from zenithtune.sim.timing import _Clock

    cfg = parse_megatron([*dense(), "--sim-flavour=gemm_waves"], ENV)
    clk = _Clock(cfg)
    # 132 output tiles of 128 x 256 fill the H200's SMs once; one more tile needs a second wave
    full, spill = clk.gemm(128 * 132, 256, 4096), clk.gemm(128 * 133, 256, 4096)
    assert spill > 1.9 * full
    plain = _Clock(parse_megatron(list(dense()), ENV))
    assert plain.gemm(128 * 133, 256, 4096) < 1.1 * plain.gemm(128 * 132, 256, 4096)


def test_flavours_compose_and_say_so_in_the_log():
    res = run(*dense(), "--sim-flavour=memory", flavour="slow_network=0.5")
    assert "[zenithtune.sim] flavoured trainer: memory, slow_network=0.5" in res.stdout
    assert res.config is not None and res.config.flavour.network_scale == 0.5
    assert res.config.flavour.overhead_gib == 5.0


@pytest.mark.parametrize("spec, says", [
    ("bogus", "--sim-flavour 'bogus': unknown flavour; known: mbs_buffers,"),
    ("tp_exposed=2", "--sim-flavour 'tp_exposed=2': tp_exposed takes no value (write just 'tp_exposed')"),
    ("overhead=20", "--sim-flavour 'overhead=20': overhead must be in [0, 16]"),
    ("overhead=lots", "--sim-flavour 'overhead=lots': 'lots' is not a number"),
])
def test_a_bad_flavour_fails_in_one_line_naming_it(spec, says):
    res = simulate([*dense(), f"--sim-flavour={spec}"], ENV)
    assert res.kind == "invalid" and res.exit_code == 1
    assert res.stderr.splitlines()[-1].startswith(f"ValueError: {says}")


def test_the_swift_front_end_takes_flavours_and_noise():
    from test_sim import SWIFT

    from zenithtune.sim import simulate_swift

    base = simulate_swift(SWIFT, ENV)
    flav = simulate_swift([*SWIFT, "--sim_flavour", "overhead=3", "--sim_noise_sigma", "0.05"], ENV)
    assert flav.kind == base.kind == "ok"
    assert flav.peak_memory_gb == pytest.approx(base.peak_memory_gb + 3.0, abs=0.01)
    assert flav.true_tflops == pytest.approx(base.true_tflops, rel=0.01) and flav.tflops != flav.true_tflops


# --- measurement noise -----------------------------------------------------------------------------------
NOISY = ("--sim-noise-sigma=0.05", "--sim-outlier-rate=0.1")


def noisy(seed: int, trial: str, *extra: str):
    return run(*dense(), *NOISY, f"--sim-noise-seed={seed}", *extra, env={"ZENITHTUNE_TRIAL": trial})


def test_noise_is_the_same_for_the_same_seed_and_run_and_differs_between_runs():
    a, again = noisy(1, "t1"), noisy(1, "t1")
    assert a.stdout == again.stdout
    others = {noisy(1, f"t{i}").tflops for i in range(2, 6)} | {noisy(2, "t1").tflops}
    assert a.tflops not in others and len(others) == 5


def test_noise_leaves_the_true_value_that_of_the_quiet_trainer():
    quiet = run(*dense())
    for i in range(5):
        res = noisy(0, str(i))
        assert res.true_tflops == pytest.approx(quiet.tflops, rel=1e-9)
        assert res.tflops == pytest.approx(quiet.tflops, rel=0.3)
    assert "[zenithtune.sim] measurement noise: sigma 0.05, outlier rate 0.1, seed 0" in res.stdout


def test_every_iteration_varies_so_a_median_after_warm_up_has_something_to_work_with():
    quiet = run(*dense()).iteration_seconds[2:]
    res = noisy(3, "x").iteration_seconds[2:]
    spread = lambda xs: (max(xs) - min(xs)) / min(xs)  # noqa: E731
    assert spread(res) > 3 * spread(quiet)


def test_an_outlier_run_is_one_and_a_half_times_slower_in_every_iteration():
    quiet = run(*dense())
    res = run(*dense(), "--sim-outlier-rate=1")
    assert res.iteration_seconds == pytest.approx([1.5 * t for t in quiet.iteration_seconds])
    assert res.tflops == pytest.approx(quiet.tflops / 1.5)


@pytest.mark.parametrize("opt, says", [("--sim-noise-sigma=0.9", "--sim-noise-sigma 0.9: must be in [0, 0.5]"),
                                       ("--sim-outlier-rate=2", "--sim-outlier-rate 2.0: must be in [0, 1]")])
def test_bad_noise_options_fail_in_one_line(opt, says):
    res = simulate([*dense(), opt], ENV)
    assert res.kind == "invalid" and res.stderr.splitlines()[-1] == f"ValueError: {says}" + (
        " (0.03 = about 3 % per run)" if "sigma" in opt else " (0.1 = one run in ten)")
