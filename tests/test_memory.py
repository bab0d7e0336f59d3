"""The per-GPU memory estimate: the monotonic behaviours a user relies on, and per-study learning."""
from __future__ import annotations

import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from zenithtune import memory
from zenithtune.memory import MemoryEstimate, MemoryModel, estimate, gpu_capacity_gb
from zenithtune.modelinfo import ModelInfo, from_hf
from zenithtune.validate import Layout

MODELS = Path(__file__).parent / "fixtures" / "models"
LLAMA8 = replace(from_hf(str(MODELS / "Meta-Llama-3-8B")), seq_length=4096)
LLAMA70 = replace(from_hf(str(MODELS / "Meta-Llama-3-70B")), seq_length=4096)
QWEN_MOE = replace(from_hf(str(MODELS / "Qwen3-30B-A3B")), seq_length=4096)
VLM = replace(from_hf(str(MODELS / "Qwen2.5-VL-7B-Instruct")), seq_length=4096)

SEL = {"recompute_granularity": "selective"}
FULL = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}


def gb(model: ModelInfo = LLAMA8, n: int = 8, gbs: int = 64, **kw) -> float:
    kw.setdefault("sequence_parallel", kw.get("tp", 1) > 1)
    est = estimate(Layout(n_gpus=n, gbs=gbs, **kw), model)
    assert est is not None
    return est.total_gb


def test_unknown_shape_gives_no_estimate():
    assert estimate(Layout(8, 64), ModelInfo(num_query_groups=8)) is None
    assert MemoryModel(ModelInfo(), 80).predicted_oom(Layout(8, 64)) is None


def test_breakdown_adds_up():
    est = estimate(Layout(8, 64, **SEL), LLAMA8)
    parts = est.weights_gb + est.grads_gb + est.optimizer_gb + est.activations_gb + est.overhead_gb
    assert est.total_gb == pytest.approx(parts)
    assert est.breakdown().startswith(f"{est.total_gb:.1f} GB = weights")


@pytest.mark.parametrize("model", [LLAMA8, QWEN_MOE])
def test_more_tp_or_pp_needs_less(model):
    assert gb(model, tp=1, **SEL) > gb(model, tp=2, **SEL) > gb(model, tp=4, **SEL)
    assert gb(model, n=16, gbs=64, pp=1, **SEL) > gb(model, n=16, gbs=64, pp=2, **SEL) > gb(model, n=16, gbs=64, pp=4, **SEL)


def test_more_ep_needs_less_for_moe():
    assert gb(QWEN_MOE, n=16, ep=2, **SEL) > gb(QWEN_MOE, n=16, ep=4, **SEL) > gb(QWEN_MOE, n=16, ep=8, **SEL)


@pytest.mark.parametrize("model", [LLAMA8, QWEN_MOE, VLM])
def test_full_less_than_selective_less_than_none(model):
    assert gb(model, tp=2, **FULL) < gb(model, tp=2, **SEL) <= gb(model, tp=2)
    # with unfused attention the scores are stored unless selective recompute drops them
    lay = {"n_gpus": 8, "gbs": 64, "tp": 2, "sequence_parallel": True}
    unfused = [estimate(Layout(**lay, **r), model, flash_attention=False).total_gb for r in (FULL, SEL, {})]
    assert unfused[0] < unfused[1] < unfused[2]


def test_distributed_optimizer_saves():
    lay = Layout(8, 64, tp=2, sequence_parallel=True, **SEL)
    assert estimate(lay, LLAMA8, distributed_optimizer=True).total_gb < estimate(
        lay, LLAMA8, distributed_optimizer=False).total_gb


def test_bigger_mbs_needs_more():
    assert gb(mbs=1, **SEL) < gb(mbs=2, **SEL) < gb(mbs=4, **SEL)


def test_longer_sequence_and_less_cp_need_more():
    long = replace(LLAMA8, seq_length=8192)
    assert gb(long, **SEL) > gb(LLAMA8, **SEL)
    assert gb(long, cp=2, **SEL) < gb(long, **SEL)


def test_vit_checkpointing_saves_for_vlms():
    lay = Layout(8, 64, tp=2, sequence_parallel=True, **FULL)
    assert estimate(lay, VLM, vit_checkpointing=True).total_gb < estimate(lay, VLM, vit_checkpointing=False).total_gb
    assert estimate(lay, VLM).total_gb > estimate(lay, replace(VLM, is_vlm=False)).total_gb


def test_llama70b_tp1_without_distributed_optimizer_is_predicted_oom():
    reason = MemoryModel(LLAMA70, 80, distributed_optimizer=False).predicted_oom(Layout(8, 64, **SEL))
    assert reason and reason.startswith("predicted ") and "GB > 80 GB capacity x 1.02 margin" in reason
    assert "x 1.10 margin" in MemoryModel(LLAMA70, 80, distributed_optimizer=False, margin=0.10).predicted_oom(
        Layout(8, 64, **SEL))


def test_llama8b_tp1_selective_with_distributed_optimizer_fits():
    # at s=2048; at s=4096 MEGATRON.md's own numbers (7.5 bytes/param + 34·s·b·h per layer) put it at
    # ~80 GB before any overhead, and the simulator runs out of memory there too
    lay = Layout(8, 64, mbs=1, **SEL)
    short = replace(LLAMA8, seq_length=2048)
    assert MemoryModel(short, 80, distributed_optimizer=True).predicted_oom(lay) is None
    assert estimate(lay, short).total_gb < 80
    assert MemoryModel(short, 80, distributed_optimizer=False).predicted_oom(lay)  # 18 bytes/param: no


# --- learning ---------------------------------------------------------------------------------------

def test_after_an_oom_the_same_and_bigger_configs_are_predicted_oom():
    mm = MemoryModel(LLAMA8, 80)
    small = Layout(8, 64, tp=4, sequence_parallel=True, **SEL)
    bigger = Layout(8, 64, tp=2, sequence_parallel=True, **SEL)
    assert mm.predicted_oom(small) is None and mm.predicted_oom(bigger) is None
    mm.observe_oom(small)
    assert mm.predicted_oom(small)
    assert mm.predicted_oom(bigger)
    assert mm.predicted_oom(Layout(8, 64, tp=4, mbs=2, sequence_parallel=True, **SEL))
    assert mm.predict(small) > mm.capacity_gb  # the scales moved so it maps above what the GPU has
    assert mm.predicted_oom(Layout(8, 64, tp=8, sequence_parallel=True, **FULL)) is None


def test_a_config_no_bigger_than_a_success_is_never_pruned():
    mm = MemoryModel(LLAMA8, 40)
    big = Layout(8, 64, mbs=2, **SEL)
    small = Layout(8, 64, mbs=1, **SEL)
    assert mm.predicted_oom(small)  # on a 40 GB GPU it looks hopeless...
    mm.observe_success(big, measured_peak_gb=None)  # ...but something bigger ran
    assert mm.predicted_oom(big) is None and mm.predicted_oom(small) is None
    mm.observe_oom(Layout(8, 64, mbs=1, **SEL))  # conflicting evidence: the success still wins
    assert mm.predicted_oom(small) is None
    assert mm.predicted_oom(Layout(8, 64, mbs=4, **SEL))


def _truth(est, weights=1.0, optimizer=1.0, activations=1.0) -> float:
    """What a trainer whose components differ from the estimate by these factors would allocate."""
    return (est.weights_gb + est.grads_gb) * weights + est.optimizer_gb * optimizer + est.activations_gb * activations


def test_a_measured_config_is_predicted_at_what_it_measured():
    mm = MemoryModel(LLAMA8, 80)
    lay = Layout(8, 64, tp=2, sequence_parallel=True, **SEL)
    est = estimate(lay, LLAMA8)
    before = mm.predict(lay)
    mm.observe_success(lay, measured_peak_gb=0.7 * est.allocated_gb)
    after = mm.predict(lay)
    fixed = est.overhead_gb - memory.FRAGMENTATION * est.allocated_gb
    assert after < before
    assert after == pytest.approx(fixed + (1 + memory.FRAGMENTATION) * 0.7 * est.allocated_gb, rel=0.03)
    mm.observe_success(lay, measured_peak_gb=est.allocated_gb * 1000)  # MB passed as GB: ignored
    assert mm.predict(lay) == pytest.approx(after)


def test_components_are_fitted_apart_when_runs_differ_in_what_dominates():
    # a trainer whose activations take 40 % more than estimated, weights and optimizer as estimated:
    # one run at mbs 1 and one at mbs 4 tell the components apart, and an unseen mbs 2 is predicted
    # (on a 141 GB GPU: on 80 GB, a run allocating 78 GB would also prove less than 4 GB outside PyTorch)
    mm = MemoryModel(LLAMA8, 141)
    runs = [Layout(8, 64, tp=2, sequence_parallel=True, mbs=b, **SEL) for b in (1, 4)]
    for lay in runs:
        mm.observe_success(lay, measured_peak_gb=_truth(estimate(lay, LLAMA8), activations=1.4))
    # (two runs cannot tell a 40 % larger activation from one that grows faster than the MBS: what they
    # pin is the activations at mbs 4, x1.4)
    assert mm.scales["activations"] + 3 * mm.per_sample == pytest.approx(1.4, abs=0.1)
    assert mm.scales["weights"] == pytest.approx(1.0, abs=0.15)
    unseen = Layout(8, 64, tp=2, sequence_parallel=True, mbs=2, **SEL)
    est = estimate(unseen, LLAMA8)
    fixed = est.overhead_gb - memory.FRAGMENTATION * est.allocated_gb
    true_total = fixed + (1 + memory.FRAGMENTATION) * _truth(est, activations=1.4)
    assert mm.predict(unseen) == pytest.approx(true_total, rel=0.03)
    # one global scale could not do this: it would split the difference between the two runs


def test_a_run_that_fit_bounds_what_lies_outside_pytorch():
    # the default assumes 4 GB of CUDA context and NCCL buffers; PyTorch's own OOM messages typically
    # show 1-2 GB. A run reserving all but 3 GB of the GPU fitted: at most 3 GB is outside the allocator,
    # and every prediction drops by the difference (a config the default puts just past the limit may run).
    ran = Layout(8, 64, tp=2, sequence_parallel=True, mbs=1, recompute_granularity="none")
    alloc = estimate(ran, LLAMA8).allocated_gb  # this trainer allocates as estimated...
    reserved = 1.05 * alloc  # ...fragments 5 %
    capacity = reserved + 3.0
    mm, fresh = MemoryModel(LLAMA8, capacity), MemoryModel(LLAMA8, capacity)
    mm.observe_success(ran, measured_peak_gb=alloc, reserved_gb=reserved)
    assert mm.fixed_cap_gb == pytest.approx(3.0)
    assert mm.predict(ran) == pytest.approx(capacity, rel=0.01)  # it fit: predicted at the GPU, not past
    assert fresh.predict(ran) > capacity + 1.0 + 0.04 * alloc
    assert "non-PyTorch <= 3.0 GB" in (mm.predicted_oom(replace(ran, mbs=4)) or "")
    plain = MemoryModel(LLAMA8, capacity)
    plain.observe_success(ran, measured_peak_gb=alloc)  # no "max reserved" line
    assert plain.fixed_cap_gb == pytest.approx(capacity - alloc)  # allocated <= reserved: a looser proof


def test_fragmentation_is_learned_per_recompute_kind():
    # full recompute frees and re-allocates each layer's working set: its runs fragment more. A run of
    # each kind; a new config is predicted with its own kind's measured fragmentation, not the median.
    mm = MemoryModel(LLAMA8, 141)
    none = Layout(8, 64, tp=2, sequence_parallel=True, mbs=1, recompute_granularity="none")
    full = Layout(8, 64, tp=2, sequence_parallel=True, mbs=1, recompute_granularity="full",
                  recompute_method="uniform", recompute_num_layers=1)
    for lay, frag in ((none, 1.02), (full, 1.20), (replace(full, mbs=2), 1.20)):
        est = estimate(lay, LLAMA8)
        mm.observe_success(lay, measured_peak_gb=est.allocated_gb, reserved_gb=frag * est.allocated_gb)
    assert mm.fragmentation == pytest.approx(0.20)  # the median of all three
    unseen = replace(none, mbs=2)
    est = estimate(unseen, LLAMA8)
    fixed = est.overhead_gb - memory.FRAGMENTATION * est.allocated_gb
    assert mm.predict(unseen) == pytest.approx(fixed + 1.02 * est.allocated_gb, rel=0.02)


def test_an_oom_rules_out_other_layouts_whose_learned_estimate_is_as_large():
    mm = MemoryModel(LLAMA8, 80)
    oom = Layout(8, 64, tp=2, sequence_parallel=True, mbs=2, **SEL)
    mm.observe_oom(oom)
    bound = mm.predict(oom)
    assert bound > mm.capacity_gb
    others = [Layout(8, 64, tp=t, pp=p, sequence_parallel=t > 1, mbs=b, **SEL)
              for t in (1, 2, 4) for p in (1, 2) for b in (1, 2, 4)]
    for lay in others:
        if mm.predict(lay) >= bound:
            assert mm.predicted_oom(lay), lay
    assert any(lay.tp != 2 and mm.predicted_oom(lay) for lay in others)  # not only its own layout
    assert mm.predicted_oom(Layout(8, 64, tp=4, sequence_parallel=True, mbs=1, **SEL)) is None


def test_the_oom_message_raises_the_bound_and_reserved_memory_the_fragmentation():
    lay = Layout(8, 64, tp=2, sequence_parallel=True, mbs=2, **SEL)
    plain, told = MemoryModel(LLAMA8, 80), MemoryModel(LLAMA8, 80)
    plain.observe_oom(lay)
    told.observe_oom(lay, needed_gb=95.0)  # "79 GiB in use" + "tried to allocate 16 GiB"
    assert told.predict(lay) >= 95.0 > plain.predict(lay)
    mm = MemoryModel(LLAMA8, 80)
    est = estimate(lay, LLAMA8)
    mm.observe_success(lay, measured_peak_gb=est.allocated_gb, reserved_gb=1.3 * est.allocated_gb)
    assert mm.fragmentation == pytest.approx(0.3)


def test_an_oom_message_measures_what_lies_outside_pytorch_both_ways():
    """The default assumes 4 GB outside the allocator (CUDA context, NCCL). PyTorch's OOM message shows it:
    in use minus allocated minus reserved-but-unallocated. A plain H100 shows ~1.5 GB, and every prediction
    drops by the difference, so a configuration the guess put past the GPU near its edge may run; a trainer
    with CUDA graphs or large NCCL buffers shows 7 GB, and every prediction rises (sim/flavours.py's
    `overhead`)."""
    # an OOM far past the GPU as estimated: what it proves, the estimate already holds
    lay = Layout(8, 64, tp=1, mbs=8, recompute_granularity="none")
    other = Layout(8, 64, tp=4, pp=2, sequence_parallel=True, mbs=1, **FULL)
    fresh, small, large = (MemoryModel(LLAMA8, 80) for _ in range(3))
    small.observe_oom(lay, outside_gb=1.5)
    large.observe_oom(lay, outside_gb=7.0)
    plain = MemoryModel(LLAMA8, 80)
    plain.observe_oom(lay)  # no message: the guess stands
    assert (small.outside_gb, large.outside_gb, plain.outside_gb) == (1.5, 7.0, None)
    # the same OOM, the same lesson on the allocator's components: the predictions move by the difference
    assert plain.predict(other) - small.predict(other) == pytest.approx(memory.DEFAULT_OVERHEAD_GB - 1.5, abs=0.05)
    assert large.predict(other) - plain.predict(other) == pytest.approx(7.0 - memory.DEFAULT_OVERHEAD_GB, abs=0.05)
    assert fresh.predict(other) == pytest.approx(plain.predict(other), abs=0.05)
    assert "non-PyTorch 1.5 GB as an OOM message showed" in (small.predicted_oom(replace(lay, mbs=4)) or "")
    # TE's userbuffers are carried over as the estimate puts them outside the allocator
    ub = replace(other, tp_comm_overlap=True)
    assert small.predict(ub) - small.predict(other) == pytest.approx(
        memory.userbuffers_gb(ub, LLAMA8), abs=0.05)
    # a value no GPU can hold outside the allocator is not evidence
    odd = MemoryModel(LLAMA8, 80)
    odd.observe_oom(lay, outside_gb=500.0)
    assert odd.outside_gb is None


def test_what_an_oom_message_showed_outside_the_allocator_lets_a_bound_prove_more():
    """A bound from a measured run proves a candidate fits when it stays under the fullest run's "max
    reserved" (that run fit, with whatever lay outside the allocator), or under the capacity less what an
    OOM message showed outside it (with a cushion for communicators set up later): a study whose runs
    all reserved far less than the GPU holds can still prove what lies between."""
    mm, told = MemoryModel(LLAMA8, 80), MemoryModel(LLAMA8, 80)
    ran = Layout(8, 64, tp=2, pp=2, sequence_parallel=True, mbs=1, **SEL)
    e = mm.estimate(ran)
    for m in (mm, told):
        m.observe_success(ran, measured_peak_gb=e.allocated_gb, reserved_gb=60.0, tag=3)
    oom = Layout(8, 64, tp=1, mbs=4, recompute_granularity="none")
    mm.observe_oom(oom)
    told.observe_oom(oom, outside_gb=1.5)
    assert mm.bound_limit(ran) == pytest.approx(70.0)  # capacity less the most outside it could be
    # (the run that ran out had only a data-parallel group; `ran` adds a TP and a PP one)
    assert told.bound_limit(ran) == pytest.approx(80 - 1.5 - memory.OUTSIDE_CUSHION_GB - 2 * memory.NCCL_CUSHION_GB)
    # more communicators than the run that ran out: NCCL buffers of each
    more = replace(ran, cp=2)
    assert told.bound_limit(more) == pytest.approx(told.bound_limit(ran) - memory.NCCL_CUSHION_GB * (
        memory.communicators(more) - memory.communicators(ran)))


def test_memory_model_rejects_bad_settings():
    with pytest.raises(ValueError, match="capacity_gb"):
        MemoryModel(LLAMA8, 0)
    with pytest.raises(ValueError, match="margin=-0.1"):
        MemoryModel(LLAMA8, 80, margin=-0.1)


# --- capacity ---------------------------------------------------------------------------------------

def test_gpu_capacity(monkeypatch):
    assert gpu_capacity_gb(141) == 141.0

    def smi(*a, **k):
        return subprocess.CompletedProcess(a, 0, stdout="81559\n", stderr="")

    monkeypatch.setattr(memory.subprocess, "run", smi)
    assert gpu_capacity_gb(None) == pytest.approx(81559 / 1024)

    def missing(*a, **k):
        raise FileNotFoundError("nvidia-smi")

    monkeypatch.setattr(memory.subprocess, "run", missing)
    assert gpu_capacity_gb(None) == 80.0


def test_estimate_is_a_value():
    est = MemoryEstimate(1, 2, 3, 4, 5)
    assert est.total_gb == 15 and est.allocated_gb == 10


def test_memory_evidence_reads_megatron_memory_lines_and_the_oom_message():
    from zenithtune.evaluate import memory_evidence
    from zenithtune.sim import simulate
    from zenithtune.sim.models import MODELS, layout_args

    ok = simulate([*MODELS["llama3-8b"], *layout_args(n_gpus=8, gbs=64, tp=2)], {"CUDA_DEVICE_MAX_CONNECTIONS": "1"})
    ev = memory_evidence(ok.stdout)
    assert ev["allocated_gb"] == pytest.approx(ok.max_allocated_mb / 1024, rel=1e-3)
    assert ev["allocated_gb"] < ev["reserved_gb"] < ok.capacity_gb and "needed_gb" not in ev
    oom = simulate([*MODELS["llama3-8b"], *layout_args(n_gpus=8, gbs=64, tp=1, mbs=4, recompute="none")],
                   {"CUDA_DEVICE_MAX_CONNECTIONS": "1"})
    assert oom.kind == "oom"
    assert memory_evidence(oom.stderr)["needed_gb"] > oom.capacity_gb
    assert 0.5 < memory_evidence(oom.stderr)["outside_gb"] < 4
    assert memory_evidence("no memory here") == {}
    # PyTorch 2.x's message, units mixed: 79.06 GiB in use - 76.87 GiB allocated - 300 MiB reserved, unallocated
    real = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB. GPU 3 has a total capacity "
            "of 79.11 GiB of which 5.31 MiB is free. Including non-PyTorch memory, this process has 79.06 GiB "
            "memory in use. Of the allocated memory 76.87 GiB is allocated by PyTorch, and 300.00 MiB is "
            "reserved by PyTorch but unallocated. If reserved but unallocated memory is large try setting "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.")
    ev = memory_evidence(real)
    assert ev["outside_gb"] == pytest.approx(79.06 - 76.87 - 300 / 1024)
    assert ev["needed_gb"] == pytest.approx(79.06 + 20 / 1024)


def test_two_ooms_that_differ_in_activations_do_not_erase_the_activations():
    # An OOM says "at least"; two of them at one layout (none, then full recompute of some layers) must
    # not be held as equalities, which would force the activations that tell them apart to zero and let
    # the next, activation-heavy layout through as tiny.
    mm = MemoryModel(LLAMA8, 80)
    base = Layout(8, 64, tp=2, sequence_parallel=True, mbs=2, **SEL)
    mm.observe_oom(base)
    mm.observe_oom(Layout(8, 64, tp=2, sequence_parallel=True, mbs=2, recompute_granularity="full",
                          recompute_method="block", recompute_num_layers=4))
    assert mm.scales["activations"] >= 0.9
    assert mm.predicted_oom(Layout(8, 64, tp=2, sequence_parallel=True, mbs=4, **SEL))


def test_a_model_shown_wrong_widens_its_uncertainty():
    mm = MemoryModel(LLAMA8, 80)
    lay = Layout(8, 64, tp=2, sequence_parallel=True, **SEL)
    before = mm.predict_sd(lay)
    est = estimate(lay, LLAMA8)
    mm.observe_success(lay, measured_peak_gb=est.allocated_gb)  # as estimated: the fit is pinned
    pinned = mm.predict_sd(lay)
    assert pinned < before
    assert mm.model_error == pytest.approx(memory.MODEL_ERROR)
    wrong = Layout(8, 64, tp=1, mbs=2, **SEL)
    mm.observe_oom(wrong, needed_gb=1.5 * mm.predict(wrong))  # 50 % more than predicted
    assert mm.model_error >= 0.4
    assert mm.predict_sd(lay) > 5 * pinned


def test_a_bound_from_a_measured_run_proves_a_neighbour_fits_and_proves_nothing_once_an_oom_refutes_it():
    """The bound trusts a run's measured peak and inflates only the estimate's difference: MBS 2 and PP 1
    next to a measured PP 2 / MBS 1 are proven to fit on a 141 GB GPU; MBS 4 (more than doubled) and TP 1
    (how TP splits a layer is where trainers differ by whole factors) are not bounded; once MBS 2 runs out
    of memory, no inflation explains it and the bound proves nothing."""
    mm = MemoryModel(LLAMA8, 141)
    one, two, four = (Layout(8, 64, tp=2, pp=2, sequence_parallel=True, mbs=m, **SEL) for m in (1, 2, 4))
    pp1 = replace(one, pp=1)
    e1 = mm.estimate(one)
    mm.observe_success(one, measured_peak_gb=e1.allocated_gb, reserved_gb=e1.allocated_gb * 1.05, tag=7)
    found = mm.bound(two)
    assert found is not None and found[1] == 7 and mm.bound_growth == 2.0
    assert found[0] > mm.estimate(two).allocated_gb  # pessimistic: above the estimate itself
    assert found[0] <= mm.bound_limit(two)  # ... and still a proof on a 141 GB GPU
    assert mm.bound(pp1)[0] <= mm.bound_limit(pp1)
    assert mm.bound(four) is None  # MBS x4: laws the estimate lacks could compound
    assert mm.bound(replace(one, tp=1, sequence_parallel=False)) is None
    mm.observe_oom(two)  # it did not fit: a trainer far from the estimate
    assert mm.bound_growth is None and mm.bound(two) is None and mm.bound(pp1) is None


def test_an_oom_refutes_the_inflation_that_proved_it_even_when_its_lesson_moves_the_bound():
    """MBS 2 is proven at x2 from a measured MBS 1 on a 70 GB GPU and runs out of memory, saying it needed
    84 GB. What the OOM teaches (activations x3) puts the same bound above the limit now, so re-checking the
    OOM against today's bound finds nothing wrong with x2; the inflation that proved it was wrong all the
    same, and the next bound uses x3 (robustness.py's memory trainer ran a 4th OOM at x2 after a 3rd at x2)."""
    mm = MemoryModel(LLAMA8, 70)
    one, two = (Layout(8, 64, tp=2, pp=2, sequence_parallel=True, mbs=m, **SEL) for m in (1, 2))
    e1 = mm.estimate(one)
    mm.observe_success(one, measured_peak_gb=e1.allocated_gb, reserved_gb=e1.allocated_gb * 1.05, tag=7)
    assert mm.bound_growth == 2.0 and mm.bound(two)[0] <= mm.bound_limit(two)  # proven: it is launched
    mm.observe_oom(two, needed_gb=84)
    assert mm.bound(two)[0] > mm.bound_limit(two)  # today's bound no longer proves it ...
    assert mm.bound_growth == 3.0  # ... and x2 is refuted anyway


def test_a_bound_does_not_trust_changes_that_cancel_in_the_estimate():
    """CP 2 at MBS 2 holds what CP 1 at MBS 1 holds, by the estimate; the bound walks one size at a time
    and takes the worse order (MBS first: the activations double before CP halves them)."""
    mm = MemoryModel(LLAMA8, 141)
    ref = Layout(8, 64, tp=2, sequence_parallel=True, mbs=1, **SEL)
    both = replace(ref, cp=2, mbs=2)
    e = mm.estimate(ref)
    assert abs(mm.estimate(both).activations_gb - e.activations_gb) < 0.05 * e.activations_gb
    mm.observe_success(ref, measured_peak_gb=e.allocated_gb, reserved_gb=e.allocated_gb * 1.05)
    act = e.activations_gb
    assert mm.bound(both)[0] >= (e.allocated_gb + 2 * act - 0.5 * act) * 1.05


def test_a_bound_is_only_taken_from_runs_that_printed_both_peaks():
    mm = MemoryModel(LLAMA8, 80)
    one = Layout(8, 64, tp=2, sequence_parallel=True, mbs=1, **SEL)
    mm.observe_success(one, measured_peak_gb=20.0)  # no "max reserved": the allocator's share is unknown
    assert mm.bound(Layout(8, 64, tp=2, sequence_parallel=True, mbs=2, **SEL)) is None


def test_interleaving_holds_1_plus_p_minus_1_over_p_v_times_the_activations():
    # Llama-3-70B, TP4 PP8 on 64 GPUs, gbs 128 (DP 2: 64 micro-batches): the first stage's in-flight
    # activations grow by (1 + 7/(8v)) when interleaved (Korthikanti et al. 2022 §4.2.3)
    def act(v: int | None) -> float:
        est = estimate(Layout(n_gpus=64, gbs=128, tp=4, pp=8, vpp_size=v, sequence_parallel=True, **SEL), LLAMA70)
        assert est is not None
        return est.activations_gb
    plain, v2, v5 = act(None), act(2), act(5)
    assert plain < v5 < v2
    assert v5 / plain == pytest.approx(1 + 7 / 40, rel=0.05)
    assert v2 / plain == pytest.approx(1 + 7 / 16, rel=0.05)


def test_no_bound_reaches_across_full_recompute():
    # a stand-in trainer (benchmarks/robustness.py) ran out of memory at tp4 pp4 mbs8 full/block/2 where a bound
    # from its selective run said it fit: the allocator's law under full recompute is the trainer's own
    from zenithtune.memory import steps
    sel = Layout(n_gpus=16, gbs=128, tp=4, pp=4, mbs=8, sequence_parallel=True, recompute_granularity="selective")
    full = Layout(**{**sel.__dict__, "recompute_granularity": "full", "recompute_method": "block",
                     "recompute_num_layers": 2})
    other_full = Layout(**{**full.__dict__, "recompute_num_layers": 1})
    assert steps(full, sel) is None and steps(sel, full) is None
    assert steps(other_full, full) is not None  # within full recompute a bound still reaches
    # ... but not across its methods: a bound from full/uniform/1 proved full/block/6 fits on that trainer, which
    # ran out of memory: a 3rd OOM in a study with max_ooms=2
    uniform = Layout(**{**full.__dict__, "recompute_method": "uniform", "recompute_num_layers": 1})
    assert steps(full, uniform) is None and steps(uniform, full) is None


def test_an_oom_at_a_folded_expert_split_rules_out_only_what_needs_more_under_either_law():
    # Expert activations: the estimate divides the routed tokens by TP; under MoE parallel folding a
    # trainer divides them by expert TP, tp/etp times more. An OOM at TP 8 / expert TP 2 (x4 folded) rules
    # out a candidate only where it needs at least as much under both laws.
    moe = ModelInfo(num_layers=16, hidden_size=2048, ffn_hidden_size=6144, num_attention_heads=16,
                    num_query_groups=4, seq_length=4096, vocab_size=32000, num_experts=64, moe_router_topk=8,
                    moe_ffn_hidden_size=768, swiglu=True)
    folded = Layout(16, 128, tp=8, pp=1, ep=2, etp=2, sequence_parallel=True, **SEL)
    est = estimate(folded, moe)
    assert est.expert_folding == 4.0 and est.expert_activations_gb > 0
    assert estimate(Layout(16, 128, tp=2, ep=8, etp=2, sequence_parallel=True, **SEL), moe).expert_folding == 1.0
    mm = MemoryModel(moe, 80)
    mm.observe_oom(folded)
    assert mm.predicted_oom(replace(folded, mbs=2))  # the same split at a larger MBS needs more under both
    # TP 8 / EP 1 / expert TP 4: by the estimate's law it needs exactly what the OOM needed, component by
    # component (so it was ruled out: "predicted >= the OOM's"); under folding half the OOM's routed tokens
    other = Layout(16, 128, tp=8, pp=1, ep=1, etp=4, sequence_parallel=True, **SEL)
    assert mm._x(estimate(other, moe)) == pytest.approx(mm._x(est))
    assert mm.predicted_oom(other) is None



def test_a_bound_grows_expert_activations_as_a_folding_trainer_would():
    # A CP step from TP 4 / expert TP 1 doubles the routed tokens per rank; a trainer that splits them by
    # expert TP (MoE parallel folding) holds 4x what the estimate's TP split says, so the bound's growth
    # of that component must be the folded one (a stand-in trainer ran out of memory past max_ooms where
    # the unfolded bound proved the step fits).
    moe = ModelInfo(num_layers=16, hidden_size=2048, ffn_hidden_size=6144, num_attention_heads=16,
                    num_query_groups=4, seq_length=4096, vocab_size=32000, num_experts=64, moe_router_topk=8,
                    moe_ffn_hidden_size=768, swiglu=True)
    ran = Layout(16, 128, tp=4, cp=2, ep=8, etp=1, sequence_parallel=True, **SEL)
    step = replace(ran, cp=1)
    mm = MemoryModel(moe, 80)
    mm.observe_success(ran, measured_peak_gb=30.0, reserved_gb=33.0)
    found = mm.bound(step)
    assert found is not None
    a, b = estimate(ran, moe), estimate(step, moe)
    folded_growth = (mm._x_folded(b) - mm._x_folded(a))[3]
    assert folded_growth > 3 * (mm._x(b) - mm._x(a))[3] > 0
    assert found[0] >= (30.0 + memory.GROWTHS[0] * folded_growth) * 33.0 / 30.0


def _folding_trainer_runs(capacity: float) -> tuple[MemoryModel, ModelInfo]:
    """A MoE model on a trainer that splits the routed tokens by expert TP (MoE parallel folding), whose
    peaks are the estimate's components with the routed part folded; two runs at TP 1 (where both laws agree)."""
    moe = ModelInfo(num_layers=16, hidden_size=2048, ffn_hidden_size=6144, num_attention_heads=16,
                    num_query_groups=4, seq_length=4096, vocab_size=32000, num_experts=64, moe_router_topk=8,
                    moe_ffn_hidden_size=768, swiglu=True)
    mm = MemoryModel(moe, capacity)
    for m in (1, 2):
        ran = Layout(16, 128, tp=1, ep=8, etp=1, mbs=m, **SEL)
        peak = float(mm._x_folded(mm.estimate(ran)).sum())
        mm.observe_success(ran, measured_peak_gb=peak, reserved_gb=peak * 1.1)
    return mm, moe


def test_an_oom_the_estimates_law_cannot_explain_switches_the_law_instead_of_inflating_every_prediction():
    # TP 8 / expert TP 1 runs out of memory: the folding trainer holds 8x the routed tokens the estimate's TP
    # split says, which no multiplier in range gives. Scaling every component up to meet it (as before)
    # contradicted the runs that fit: on robustness.py's 64-expert MoE every prediction doubled and the
    # optimum, ~50 GB, was predicted 114 GB and never launched. The folded law explains the OOM with the
    # multipliers where they were, so a candidate both laws agree on is predicted as before.
    mm, _ = _folding_trainer_runs(40)
    cand = Layout(16, 128, tp=1, ep=4, etp=1, mbs=2, **SEL)
    before = mm.predict(cand)
    assert not mm.folds and before < 40
    oom = Layout(16, 128, tp=8, ep=2, etp=1, sequence_parallel=True, mbs=4, **SEL)
    assert mm.predict(oom) < 30  # the estimate's law: it would fit
    mm.observe_oom(oom)
    assert mm.folds
    assert mm.predict(cand) == pytest.approx(before, rel=0.02)
    assert mm.predicted_oom(cand) is None
    assert mm.predict(oom) >= 40  # and the OOM itself is explained


def test_a_trainer_that_does_not_fold_keeps_the_estimates_law():
    # the same runs plus a measured TP 2 / expert TP 1 run at what the estimate's law says: no evidence to fold
    mm, moe = _folding_trainer_runs(80)
    tp2 = Layout(16, 128, tp=2, ep=8, etp=1, sequence_parallel=True, mbs=1, **SEL)
    est = mm.estimate(tp2)
    mm.observe_success(tp2, measured_peak_gb=est.allocated_gb, reserved_gb=est.allocated_gb * 1.1)
    assert not mm.folds
    # ... and one at what the folded law says switches it
    mm2, _ = _folding_trainer_runs(80)
    peak = float(mm2._x_folded(est).sum())
    mm2.observe_success(tp2, measured_peak_gb=peak, reserved_gb=peak * 1.1)
    assert mm2.folds


def test_a_run_proves_nothing_for_one_holding_more_outside_the_allocator():
    """TE's userbuffers (--tp-comm-overlap, s·mbs/cp) are registered outside PyTorch's allocator: a run
    that fit without them, or with CP halving them, does not prove a run holding more of them fits."""
    seq = replace(LLAMA70, seq_length=8192)
    mm = MemoryModel(seq, 80)
    plain = Layout(32, 128, tp=4, pp=4, cp=2, sequence_parallel=True, **FULL)
    mm.observe_success(plain, measured_peak_gb=None)
    assert mm.proven_fit(plain) and not mm.proven_fit(replace(plain, tp_comm_overlap=True))
    mm = MemoryModel(seq, 80)
    mm.observe_success(replace(plain, tp_comm_overlap=True), measured_peak_gb=None)
    assert mm.proven_fit(plain)  # the same run without the buffers holds less
    # search.py's Llama-3-70B on 32 H100: less of every allocator component than a full-recompute run
    # at CP 2, but twice its userbuffers at CP 1 (it ran out of memory where that run fit)
    mm = MemoryModel(seq, 80)
    fit = Layout(32, 128, tp=4, pp=4, cp=2, sequence_parallel=True, tp_comm_overlap=True,
                 recompute_granularity="full", recompute_method="block", recompute_num_layers=2)
    mm.observe_success(fit, measured_peak_gb=None)
    trade = Layout(32, 128, tp=4, pp=4, cp=1, vpp_size=5, sequence_parallel=True, tp_comm_overlap=True,
                   recompute_granularity="selective", recompute_modules=("mlp",))
    assert not mm.proven_fit(trade) and mm.oom_risk(trade) > 0


def _growing(est, per_sample: float) -> float:
    """What a trainer whose activations grow `per_sample` per micro-batch sample beyond the first allocates
    (sim/flavours.py's mbs_buffers: 1F1B's p2p buffers, attention workspaces growing with b·s)."""
    dense = est.activations_gb - est.logits_gb
    return est.weights_gb + est.grads_gb + est.optimizer_gb + est.logits_gb + \
        dense * (1 + per_sample * (est.micro_batch - 1))


def test_activations_that_grow_faster_than_the_mbs_are_learned_as_such():
    # A trainer adding 8 % of the activations per sample beyond the first (1F1B's p2p buffers, attention
    # workspaces growing with b·s): runs at mbs 1, 2 and 4 show the growth, and mbs 8, never run, is
    # predicted within 10 % (177.5 GB; the estimate says 133, a multiplier fitted to the same three runs
    # 152.5: 14 % low) and screened as out of memory on a 141 GB GPU, the learned growth named.
    mm = MemoryModel(LLAMA8, 141)
    lay = {b: Layout(8, 64, tp=2, sequence_parallel=True, mbs=b, **SEL) for b in (1, 2, 4, 8)}
    truth = {b: _growing(estimate(lay[b], LLAMA8), 0.08) for b in lay}
    for b in (1, 2, 4):
        mm.observe_success(lay[b], measured_peak_gb=truth[b])
    assert mm.per_sample > 0.02
    est = estimate(lay[8], LLAMA8)
    fixed = est.overhead_gb - memory.FRAGMENTATION * est.allocated_gb
    assert mm.predict(lay[8]) == pytest.approx(fixed + (1 + memory.FRAGMENTATION) * truth[8], rel=0.10)
    assert "per sample beyond the first" in (mm.predicted_oom(lay[8]) or "")
    for b in (1, 2, 4):  # and what ran is still predicted at what it measured
        e = estimate(lay[b], LLAMA8)
        fixed = e.overhead_gb - memory.FRAGMENTATION * e.allocated_gb
        assert mm.predict(lay[b]) == pytest.approx(fixed + (1 + memory.FRAGMENTATION) * truth[b], rel=0.03), b


def test_more_samples_per_rank_at_the_same_tokens_are_not_proven_to_fit():
    # TP2 CP2 at MBS 4 holds the tokens per rank of TP2 CP1 at MBS 2, and the estimate's components are
    # no larger; but activations that grow faster than the MBS (learned, within [0, PER_SAMPLE_MAX]) may
    # be: robustness.py's 64-expert MoE on the memory trainer ran it as "needs no more memory than
    # trial 2" and ran out. The same layout at a smaller MBS, or a smaller MBS at more CP, stays proven.
    mm = MemoryModel(LLAMA8, 80)
    ran = Layout(8, 64, tp=2, sequence_parallel=True, mbs=2, **SEL)
    mm.observe_success(ran, measured_peak_gb=estimate(ran, LLAMA8).allocated_gb)
    more = Layout(8, 64, tp=2, cp=2, sequence_parallel=True, mbs=4, **SEL)
    assert estimate(more, LLAMA8).activations_gb <= estimate(ran, LLAMA8).activations_gb + 1e-9
    assert not mm.proven_fit(more)
    assert mm.proven_fit(replace(ran, mbs=1))
    assert mm.proven_fit(replace(more, mbs=2))


def test_a_miss_the_fit_learned_to_predict_stops_widening_every_prediction():
    # A trainer whose activations take 2.2x the estimate's: its first run, activation-heavy, lands 40 % over
    # the prediction -- beyond the prior's doubt, so every later prediction is doubted by 40 %
    # (model_error). Runs that vary the activations' share then teach the fit that scale, and the fit
    # without the first run predicts it; its miss stops counting. A doubt kept for good hid the 64-expert
    # MoE's optimum, 78 of 79 GB, behind a coin toss (robustness.py, stand-in trainer: 0.925 of optimum).
    mm = MemoryModel(LLAMA8, 141)

    def run(lay: Layout) -> None:
        x = mm._x(mm.estimate(lay))
        peak = float(x.sum() + 1.2 * x[2])
        mm.observe_success(lay, measured_peak_gb=peak, reserved_gb=peak * 1.1)

    unseen = Layout(8, 64, tp=1, mbs=2)
    run(Layout(8, 64, tp=2, sequence_parallel=True, mbs=2))
    assert mm.model_error > 0.3
    for lay in (Layout(8, 64, tp=4, sequence_parallel=True, mbs=1), Layout(8, 64, tp=2, sequence_parallel=True, mbs=1)):
        run(lay)
    assert mm.model_error > 0.3  # two other runs: too few to judge the first as a prediction
    assert mm.predict_sd(unseen) > 0.3 * mm.predict(unseen)
    run(Layout(8, 64, tp=2, pp=2, sequence_parallel=True, mbs=4))
    assert mm.model_error == pytest.approx(memory.MODEL_ERROR)
    assert mm.predict_sd(unseen) < 0.05 * mm.predict(unseen)


@pytest.mark.parametrize("odd", [1.0, 1.8])
def test_a_miss_the_law_now_favoured_predicts_stops_widening_every_prediction(odd):
    # A folding trainer's first run at TP 4 / expert TP 1 holds 4x the routed tokens the estimate's law
    # says: 80 % over its prediction, so every prediction is doubted by 80 % (model_error). The folded law
    # then predicts every run. Once MIN_REJUDGE other configurations ran, that law -- fitted without the
    # first run -- predicts it too, and the doubt returns to MODEL_ERROR (robustness.py's 64-expert MoE: a
    # doubt of +-46 % kept for good held the optimum at MBS 2 at a 40 % risk). A first run 1.8x what even the
    # folded law says stays a miss: no law explains it away.
    moe = ModelInfo(num_layers=16, hidden_size=2048, ffn_hidden_size=6144, num_attention_heads=16,
                    num_query_groups=4, seq_length=4096, vocab_size=32000, num_experts=64, moe_router_topk=8,
                    moe_ffn_hidden_size=768, swiglu=True)
    mm = MemoryModel(moe, 80)

    def run(lay: Layout, factor: float = 1.0) -> None:
        peak = factor * float(mm._x_folded(mm.estimate(lay)).sum())
        mm.observe_success(lay, measured_peak_gb=peak, reserved_gb=peak * 1.1)

    run(Layout(16, 128, tp=4, ep=8, etp=1, sequence_parallel=True, mbs=2, **SEL), odd)
    assert mm.model_error >= 0.5
    others = [Layout(16, 128, tp=1, ep=8, etp=1, mbs=1, **SEL), Layout(16, 128, tp=1, ep=4, etp=1, mbs=2, **SEL),
              Layout(16, 128, tp=2, ep=4, etp=1, sequence_parallel=True, mbs=1, **SEL)]
    for lay in others[:2]:
        run(lay)
    assert mm.folds and mm.model_error >= 0.5  # two other runs: too few to take the first run's miss back
    run(others[2])
    assert mm.folds
    if odd == 1.0:
        assert mm.model_error == pytest.approx(memory.MODEL_ERROR)
    else:  # still a miss, judged now by how far off the folded law is (the multipliers moved towards it)
        assert mm.model_error >= 0.3
