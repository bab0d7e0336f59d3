"""The search space: values per job, applicability, options for injection, enumeration, Optuna."""
from __future__ import annotations

import optuna
import pytest
import yaml

from zenithtune.modelinfo import ModelInfo
from zenithtune.space import Context, Space, Survey, mbs_values, options_for, parallel_values
from zenithtune.validate import Layout

PRESET = yaml.safe_load(open(__import__("pathlib").Path(__file__).parents[1] / "conf/preset/megatron.yaml"))
LLAMA8B = ModelInfo(num_layers=32, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32,
                    num_query_groups=8, vocab_size=128256, seq_length=8192, swiglu=True)
QWEN_MOE = ModelInfo(num_layers=48, hidden_size=2048, num_attention_heads=32, num_query_groups=4,
                     kv_channels=128, vocab_size=151936, seq_length=4096, num_experts=128,
                     moe_router_topk=8, moe_ffn_hidden_size=768, disable_bias_linear=True)
VLM = ModelInfo(num_layers=28, hidden_size=3584, num_attention_heads=28, num_query_groups=4,
                seq_length=4096, is_vlm=True)


@pytest.mark.parametrize("n,expected", [
    (1, (1,)), (8, (1, 2, 4, 8)), (16, (1, 2, 4, 8, 16)),
    (12, (1, 2, 3, 4, 6, 12)), (24, (1, 2, 3, 4, 6, 8, 12, 24)),
])
def test_parallel_values_are_powers_of_two_or_divisors(n, expected):
    assert parallel_values(n) == expected


@pytest.mark.parametrize("mbs_max,gbs,expected", [(8, 64, (1, 2, 4, 8)), (8, 12, (1, 2, 4)),
                                                  (4, 7, (1,)), (16, 48, (1, 2, 4, 8, 16))])
def test_mbs_values_divide_gbs(mbs_max, gbs, expected):
    assert mbs_values(mbs_max, gbs) == expected


def space(model: ModelInfo, n_gpus: int = 8, gbs: int = 64, **kw) -> Space:
    return Space.from_preset(PRESET, Context(n_gpus=n_gpus, gbs=gbs, model=model, **kw))


def test_options_for_sets_applicable_and_removes_the_rest():
    opts = options_for(PRESET, {"tp": 2, "pp": 1, "cp": 1, "mbs": 4, "recompute_granularity": "selective"}, 64)
    assert opts["--tensor-model-parallel-size"] == "2"
    assert opts["--micro-batch-size"] == "4"
    assert opts["--recompute-granularity"] == "selective"
    assert opts["--recompute-method"] is None and opts["--recompute-num-layers"] is None
    assert opts["--expert-model-parallel-size"] is None  # dense model: EP not in the candidate
    assert opts["--vit-gradient-checkpointing"] is None  # never injected for non-VLMs
    assert opts["--global-batch-size"] == "64"
    assert opts["--sequence-parallel"] is True


def test_sequence_parallel_is_removed_at_tp1_and_bools_become_words():
    opts = options_for(PRESET, {"tp": 1, "vit_gradient_checkpointing": False}, 8)
    assert opts["--sequence-parallel"] is False
    assert opts["--vit-gradient-checkpointing"] == "false"


def test_no_recompute_removes_the_granularity_option():
    opts = options_for(PRESET, {"tp": 1, "mbs": 1, "recompute_granularity": "none"}, 64)
    assert opts["--recompute-granularity"] is None and opts["--recompute-method"] is None
    lay = space(LLAMA8B).layout({"tp": 1, "mbs": 1, "recompute_granularity": "none"})
    assert lay.recompute_granularity is None


def test_normalize_drops_parameters_that_do_not_apply():
    s = space(LLAMA8B)
    cand = {"tp": 2, "ep": 4, "mbs": 1, "recompute_granularity": "selective", "recompute_method": "block",
            "vit_gradient_checkpointing": True}
    # a selective candidate naming no module set runs Megatron's default one, core_attn
    # ... and a candidate from before the overlap switches runs them off
    assert s.normalize(cand) == {"tp": 2, "mbs": 1, "recompute_granularity": "selective", "recompute_modules": "core_attn",
                                 "tp_comm_overlap": False}
    moe = space(QWEN_MOE, n_gpus=16)
    assert moe.normalize({"tp": 1, "ep": 8, "etp": 1})["ep"] == 8


def test_layout_uses_ep_and_etp_only_for_moe_and_sp_with_tp():
    lay = space(QWEN_MOE, n_gpus=8).layout({"tp": 2, "ep": 8, "etp": 1, "mbs": 1})
    assert (lay.tp, lay.ep, lay.etp, lay.dp, lay.expert_dp, lay.sequence_parallel) == (2, 8, 1, 4, 1, True)
    dense = space(LLAMA8B).layout({"tp": 1, "ep": 8})
    assert dense.ep == 1 and dense.sequence_parallel is False


def test_tp2_ep8_on_8_gpus_is_valid_with_etp1_unlike_upstream():
    # Upstream computes DP = N/(tp*pp*cp*ep*etp) and rejects this layout; Megatron accepts it.
    s = space(QWEN_MOE, n_gpus=8, gbs=64)
    assert s.reasons({"tp": 2, "pp": 1, "cp": 1, "ep": 8, "etp": 1, "mbs": 1,
                      "recompute_granularity": "selective"}) == []


def test_reasons_name_the_rule_and_the_numbers():
    s = space(LLAMA8B, n_gpus=12, gbs=48)
    names = [r for r, _ in s.reasons({"tp": 8, "pp": 1, "cp": 1, "mbs": 1, "recompute_granularity": "selective"})]
    assert "choices" in names  # 8 is not a divisor of 12
    (rule, why), *_ = s.reasons({"tp": 3, "pp": 1, "cp": 1, "mbs": 1, "recompute_granularity": "selective"})
    assert rule == "tp_heads" and "(32)" in why and "(3)" in why


def test_walk_yields_only_valid_candidates_and_survey_adds_up():
    s = space(LLAMA8B, n_gpus=8, gbs=64)
    survey = Survey()
    cands = list(s.walk(survey))
    assert cands and all(s.reasons(c) == [] for c in cands)
    assert survey.valid == len(cands)
    assert survey.total == survey.valid + sum(survey.removed.values())
    assert len({s.key(c) for c in cands}) == len(cands)
    # selective candidates carry no method/num_layers; full ones carry both
    for c in cands:
        assert ("recompute_method" in c) == (c["recompute_granularity"] == "full")


def test_walk_handles_12_gpus_with_tp3_out_for_32_heads():
    cands = list(space(LLAMA8B, n_gpus=12, gbs=48).walk())
    assert {c["tp"] for c in cands} <= {1, 2, 4}
    assert any(c["pp"] in (4,) for c in cands)


def test_vlm_searches_vit_checkpointing_and_only_full_uniform_by_default():
    cands = list(space(VLM, n_gpus=8, gbs=16).walk())
    assert {c["vit_gradient_checkpointing"] for c in cands} == {True, False}
    assert {c["recompute_granularity"] for c in cands} == {"full", "none"}
    assert all(c["recompute_method"] == "uniform" for c in cands if c["recompute_granularity"] == "full")
    relaxed = list(space(VLM, n_gpus=8, gbs=16, vlm_full_uniform_only=False).walk())
    assert any(c["recompute_granularity"] == "selective" for c in relaxed)


def test_suggest_replays_an_enqueued_candidate_exactly():
    s = space(QWEN_MOE, n_gpus=16, gbs=64)
    study = optuna.create_study(direction="maximize")
    cand = {"tp": 2, "pp": 2, "vp": 1, "cp": 1, "ep": 4, "etp": 1, "mbs": 2, "recompute_granularity": "full",
            "recompute_method": "uniform", "recompute_num_layers": 2, "tp_comm_overlap": False}
    study.enqueue_trial(cand)
    trial = study.ask()
    assert s.suggest(trial) == cand
    assert trial.params == cand


def test_suggest_partial_enqueue_samples_only_the_rest():
    s = space(LLAMA8B)
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.RandomSampler(seed=1))
    study.enqueue_trial({"tp": 2, "pp": 1, "cp": 1})
    got = s.suggest(study.ask())
    assert (got["tp"], got["pp"], got["cp"]) == (2, 1, 1)
    assert got["mbs"] in (1, 2, 4, 8)


def test_layout_matches_a_hand_built_one():
    lay = space(LLAMA8B).layout({"tp": 2, "pp": 2, "cp": 1, "mbs": 2, "recompute_granularity": "full",
                                  "recompute_method": "block", "recompute_num_layers": 4})
    assert lay == Layout(n_gpus=8, gbs=64, tp=2, pp=2, cp=1, mbs=2, recompute_granularity="full",
                         recompute_method="block", recompute_num_layers=4, sequence_parallel=True)
    assert (lay.dp, lay.microbatches) == (2, 16)


# --- scale: the enumeration prunes prefixes, so large worlds stay cheap (timings: benchmarks/startup.py) ---

SMALL_MOE = ModelInfo(num_layers=12, hidden_size=1024, num_attention_heads=8, num_query_groups=4, seq_length=4096,
                      vocab_size=32000, num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=512,
                      disable_bias_linear=False)


@pytest.mark.parametrize("model, n_gpus, gbs, kw", [
    (LLAMA8B, 8, 64, {}), (LLAMA8B, 12, 48, {"mbs_max": 2}), (SMALL_MOE, 4, 16, {"mbs_max": 2}), (VLM, 8, 16, {}),
    (SMALL_MOE, 4, 16, {"mbs_max": 2, "policy_off": frozenset({"etp_le_tp", "recompute_chunk"})}),
])
def test_walk_is_exactly_the_valid_part_of_the_full_product(model, n_gpus, gbs, kw):
    s = space(model, n_gpus=n_gpus, gbs=gbs, **kw)
    survey = Survey()
    walked = [s.key(c) for c in s.walk(survey)]
    every = [s.normalize(c) for c in s._sub(tuple(s.params), {})]
    assert sorted(walked) == sorted(s.key(c) for c in every if not s._check(s.layout(c)))
    assert survey.total == len(every) == survey.valid + sum(survey.removed.values())


def test_a_16384_gpu_world_with_256_experts_walks():
    deepseek = ModelInfo(num_layers=61, hidden_size=7168, num_attention_heads=128, num_query_groups=128,
                         seq_length=4096, vocab_size=129280, num_experts=256, moe_router_topk=8,
                         moe_ffn_hidden_size=2048, swiglu=True, disable_bias_linear=True)
    s = space(deepseek, n_gpus=16384, gbs=4096)
    survey = Survey()
    cands = list(s.walk(survey))
    # tp, cp, ep, etp x pp (pp=1, or 14 sizes x 7 virtual sizes) x mbs x recompute choices: none, full
    # (2 methods x 8 layer counts), selective with 4 module sets (mlp left out: every layer is MoE)
    assert survey.total == 15 ** 4 * (1 + 14 * 7) * 4 * (1 + 16 + 4) * 2  # x2: tp_comm_overlap off/on
    assert survey.total == survey.valid + sum(survey.removed.values())
    assert survey.valid == len(cands) > 0
    assert all(s.reasons(c) == [] for c in cands[:: max(1, len(cands) // 200)])
    assert {c["ep"] for c in cands} <= {1, 2, 4, 8, 16, 32, 64, 128, 256}


def test_an_absurd_world_size_is_refused_naming_the_limit():
    assert len(parallel_values(10 ** 9)) == 100  # divisors by trial division: instant
    with pytest.raises(ValueError, match=r"n_gpus=1000000000 is above .* \(1048576 GPUs\)"):
        Context(n_gpus=10 ** 9, gbs=64)


def test_survey_groups_megatron_rules_and_policy():
    s = space(LLAMA8B, n_gpus=8, gbs=64)
    survey = Survey()
    list(s.walk(survey))
    megatron = dict(survey.removed_by("megatron"))
    policy = dict(survey.removed_by("policy"))
    assert "world_divisible" in megatron and "recompute_chunk" in policy
    assert sum(megatron.values()) + sum(policy.values()) == sum(survey.removed.values())
    relaxed = Survey()
    list(space(LLAMA8B, n_gpus=8, gbs=64, policy_off=frozenset({"recompute_chunk"})).walk(relaxed))
    assert relaxed.valid == survey.valid + policy["recompute_chunk"]
    with pytest.raises(ValueError, match="prune.policy.gbs: no such policy"):
        Context(n_gpus=8, gbs=64, policy_off=frozenset({"gbs"}))
