"""The physics a tuner depends on, each on a concrete model (zenithtune.sim)."""
from __future__ import annotations

import itertools

import pytest

from zenithtune.sim import simulate
from zenithtune.sim.models import MODELS, layout_args

LLAMA8B = MODELS["llama3-8b"]
LLAMA70B = MODELS["llama3-70b"]
QWEN_MOE = MODELS["qwen3-30b-a3b"]


def run(model, *extra: str, **layout):
    return simulate([*model, *layout_args(**layout), *extra])


def tflops(model, *extra: str, **layout) -> float:
    res = run(model, *extra, **layout)
    assert res.kind == "ok", (layout, res.stderr[-400:])
    return res.tflops


def test_tp16_across_two_nodes_is_much_slower_than_tp8():
    # Llama-3-70B, s=4096, on 16 H200 (two 8-GPU nodes): TP16 puts every TP collective on InfiniBand
    tp8 = tflops(LLAMA70B, "--seq-length", "4096", n_gpus=16, gbs=64, tp=8, gpu="h200")
    tp16 = tflops(LLAMA70B, "--seq-length", "4096", n_gpus=16, gbs=64, tp=16, gpu="h200")
    assert tp16 < 0.5 * tp8


def test_selective_beats_full_recompute_when_both_fit():
    # Llama-3-8B, s=8192, 8 H100, GBS 64, TP2 MBS1: both fit; full recompute re-runs every forward
    sel = run(LLAMA8B, n_gpus=8, gbs=64, tp=2, recompute="selective")
    full = run(LLAMA8B, n_gpus=8, gbs=64, tp=2, recompute="full")
    assert sel.kind == full.kind == "ok"
    assert sel.tflops > 1.1 * full.tflops
    assert full.peak_memory_gb < sel.peak_memory_gb


def test_larger_micro_batch_helps_until_it_runs_out_of_memory():
    # Llama-3-8B, 8 H100, TP4 selective: MBS 1 < 2 < 4, MBS 8 OOMs
    results = [run(LLAMA8B, n_gpus=8, gbs=64, tp=4, mbs=mbs) for mbs in (1, 2, 4, 8)]
    assert [r.kind for r in results] == ["ok", "ok", "ok", "oom"]
    speeds = [r.tflops for r in results[:3]]
    assert speeds == sorted(speeds) and speeds[-1] > speeds[0] * 1.02


def test_full_recompute_fits_where_selective_runs_out_of_memory():
    # Llama-3-8B, 8 H100, TP1: selective keeps every layer's activations (~100 GiB), full keeps inputs only
    assert run(LLAMA8B, n_gpus=8, gbs=64, tp=1, recompute="selective").kind == "oom"
    assert run(LLAMA8B, n_gpus=8, gbs=64, tp=1, recompute="full").kind == "ok"


def test_context_parallelism_helps_at_32k_tokens():
    # Llama-3-8B at s=32768 on 8 H100, GBS 16: the best layout with CP > 1 beats the best without
    best: dict[bool, float] = {False: 0.0, True: 0.0}
    for tp, cp, rc in itertools.product((1, 2, 4, 8), (1, 2, 4, 8), ("selective", "full")):
        if tp * cp > 8:
            continue
        res = run(LLAMA8B, "--seq-length", "32768", n_gpus=8, gbs=16, tp=tp, cp=cp, recompute=rc)
        if res.kind == "ok":
            best[cp > 1] = max(best[cp > 1], res.tflops)
    assert best[True] > 1.02 * best[False] > 0


def test_expert_parallelism_inside_a_node_beats_across_nodes():
    # Qwen3-30B-A3B on 16 H200: EP8's all-to-all on NVLink vs the same EP8 split over 4-GPU nodes,
    # and vs EP16 spanning both 8-GPU nodes
    inside = tflops(QWEN_MOE, n_gpus=16, gbs=64, ep=8, gpu="h200")
    split = tflops(QWEN_MOE, n_gpus=16, gbs=64, ep=8, gpu="h200", gpus_per_node=4)
    across = tflops(QWEN_MOE, n_gpus=16, gbs=64, ep=16, gpu="h200")
    assert inside > 1.2 * split
    assert inside > 1.2 * across


def test_pipeline_bubble_shrinks_with_more_micro_batches():
    # Llama-3-70B, s=4096, TP8 PP4 on 32 H100 (DP 1): 8 micro-batches per iteration vs 64
    few = tflops(LLAMA70B, "--seq-length", "4096", n_gpus=32, gbs=8, tp=8, pp=4)
    many = tflops(LLAMA70B, "--seq-length", "4096", n_gpus=32, gbs=64, tp=8, pp=4)
    assert many > 1.2 * few  # bubble (p-1)/m: 3/8 -> 3/64
    # interleaving (2 virtual stages per rank) shrinks it at the same micro-batch count
    inter = tflops(LLAMA70B, "--seq-length", "4096", n_gpus=32, gbs=8, tp=8, pp=4, vp=10)
    assert inter > 1.1 * few


def test_h200_fits_what_h100_runs_out_of_memory_on():
    assert run(LLAMA8B, n_gpus=8, gbs=64, tp=1, gpu="h100").kind == "oom"
    h200 = run(LLAMA8B, n_gpus=8, gbs=64, tp=1, gpu="h200")
    assert h200.kind == "ok" and 80 < h200.peak_memory_gb < h200.capacity_gb


def test_distributed_optimizer_saves_memory():
    args = [*LLAMA8B, *layout_args(n_gpus=8, gbs=64, tp=2)]
    with_dist = simulate(args)
    without = simulate([a for a in args if a != "--use-distributed-optimizer"])
    assert with_dist.kind == "ok" and without.peak_memory_gb > with_dist.peak_memory_gb + 20


def test_llama8b_on_8_h100_has_a_sensible_nontrivial_optimum():
    """The tuning problem of the default demo: some layouts OOM, the best is a small TP, TP8 is far off."""
    results = {}
    for tp, pp, cp, mbs, rc in itertools.product((1, 2, 4, 8), (1, 2), (1, 2), (1, 2, 4), ("selective", "full")):
        if tp * pp * cp > 8:
            continue
        results[(tp, pp, cp, mbs, rc)] = run(LLAMA8B, n_gpus=8, gbs=64, tp=tp, pp=pp, cp=cp, mbs=mbs, recompute=rc)
    ok = {k: r.tflops for k, r in results.items() if r.kind == "ok"}
    ooms = [k for k, r in results.items() if r.kind == "oom"]
    assert len(ooms) >= 5 and len(ok) >= 20
    best = max(ok, key=ok.get)
    assert best[0] in (1, 2) and best[4] == "selective"
    assert ok[(8, 1, 1, 1, "selective")] < 0.8 * ok[best]
    assert 350 < ok[best] < 600  # plausible H100 bf16 model TFLOP/s/GPU


def test_throughput_counts_model_flops_not_recompute():
    # same work per iteration, full recompute does ~4/3 of it: the printed number drops, it never rises
    sel = run(LLAMA8B, n_gpus=8, gbs=64, tp=4, mbs=1, recompute="selective")
    full = run(LLAMA8B, n_gpus=8, gbs=64, tp=4, mbs=1, recompute="full")
    assert 0.65 < full.tflops / sel.tflops < 0.85


@pytest.mark.parametrize("gpu", ["h100", "h200", "a100-80g", "a100-40g"])
def test_every_gpu_runs_and_reports_its_capacity(gpu):
    res = run(MODELS["gpt-1.7b"], n_gpus=8, gbs=32, tp=1, gpu=gpu)
    assert res.kind == "ok"
    assert res.capacity_gb == pytest.approx({"h100": 79.11, "h200": 139.72, "a100-80g": 79.15,
                                             "a100-40g": 39.39}[gpu])
    assert res.tflops < {"h100": 989, "h200": 989, "a100-80g": 312, "a100-40g": 312}[gpu] * 0.7


@pytest.mark.parametrize("name, billions", [("llama3-8b", 8.03), ("llama3-70b", 70.55), ("qwen3-30b-a3b", 30.53),
                                            ("mixtral-8x7b", 46.70)])
def test_parameter_counts_match_the_published_models(name, billions):
    from zenithtune.sim.physics import total_params
    from zenithtune.sim.trainer import prepare

    cfg = prepare([*MODELS[name], *layout_args(n_gpus=8, gbs=64)], {})
    assert total_params(cfg) / 1e9 == pytest.approx(billions, abs=0.01)


def test_interleaving_wins_where_the_bubble_matters_and_loses_where_p2p_dominates():
    # Llama-3-70B, s=8192, TP4 PP4 CP2 on 64 H100 (20 layers per stage). --num-layers-per-virtual-pipeline-stage
    # 4 runs 5 chunks per rank (VP5, NVIDIA's choice here). At gbs 128 (DP 2: 64 micro-batches) the bubble
    # (p-1)/(v m) is worth shrinking; at gbs 1024 (512) it is not, and the 5x p2p sends between nodes cost
    # more than the bubble they save
    def run70(gbs: int, vp: int | None):
        return run(LLAMA70B, "--seq-length", "8192", n_gpus=64, gbs=gbs, tp=4, pp=4, cp=2, recompute=None, vp=vp)
    plain, vp5 = run70(128, None), run70(128, 4)
    assert plain.kind == vp5.kind == "ok"
    assert vp5.tflops > 1.02 * plain.tflops
    assert vp5.peak_memory_gb > plain.peak_memory_gb  # the first rank holds 1 + 3/20 times the activations
    assert run70(1024, 4).tflops < run70(1024, None).tflops
    assert run70(1024, 2).tflops < run70(1024, 4).tflops  # VP10: twice the sends again
