"""Every Megatron rule (MEGATRON.md §Rules, zenithtune.validate) rejects with a message naming the numbers,
both in the tuner's validator (`validate.check`) and in the simulated `pretrain_gpt.py` (CLI, exit 1)."""
from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field

import pytest

from zenithtune.modelinfo import ModelInfo
from zenithtune.sim import simulate
from zenithtune.validate import RULES, Layout, check, env_errors

DENSE = ModelInfo(num_layers=32, hidden_size=4096, num_attention_heads=32, num_query_groups=8, seq_length=4096,
                  vocab_size=32000, num_experts=0, swiglu=True, disable_bias_linear=True)
MOE = ModelInfo(num_layers=16, hidden_size=2048, num_attention_heads=32, num_query_groups=4, seq_length=4096,
                vocab_size=32000, num_experts=64, moe_router_topk=8, moe_ffn_hidden_size=768, swiglu=True,
                disable_bias_linear=True)


def argv_for(lay: Layout, model: ModelInfo) -> list[str]:
    """The pretrain_gpt.py options stating this layout and model (what the tuner would launch)."""
    out = ["--num-layers", model.num_layers, "--hidden-size", model.hidden_size,
           "--num-attention-heads", model.num_attention_heads, "--seq-length", model.seq_length,
           "--vocab-size", model.vocab_size, "--position-embedding-type", "rope",
           "--micro-batch-size", lay.mbs, "--global-batch-size", lay.gbs, "--train-iters", 2, "--bf16",
           "--tensor-model-parallel-size", lay.tp, "--pipeline-model-parallel-size", lay.pp,
           "--context-parallel-size", lay.cp, "--expert-model-parallel-size", lay.ep,
           "--sim-world-size", lay.n_gpus]
    if model.num_query_groups != model.num_attention_heads:
        out += ["--group-query-attention", "--num-query-groups", model.num_query_groups]
    if model.kv_channels:
        out += ["--kv-channels", model.kv_channels]
    if model.ffn_hidden_size:
        out += ["--ffn-hidden-size", model.ffn_hidden_size]
    if model.swiglu:
        out.append("--swiglu")
    if model.disable_bias_linear:
        out.append("--disable-bias-linear")
    if model.is_moe:
        out += ["--num-experts", model.num_experts, "--moe-router-topk", model.moe_router_topk,
                "--moe-ffn-hidden-size", model.moe_ffn_hidden_size]
    if lay.etp is not None:
        out += ["--expert-tensor-parallel-size", lay.etp]
    if lay.sequence_parallel:
        out.append("--sequence-parallel")
    if lay.layers_per_virtual_stage:
        out += ["--num-layers-per-virtual-pipeline-stage", lay.layers_per_virtual_stage]
    if not lay.overlap_p2p:
        out.append("--no-overlap-p2p-communication")
    if lay.vpp_size:
        out += ["--num-virtual-stages-per-pipeline-rank", lay.vpp_size]
    out += ["--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split"][:lay.pipeline_extra_layers]
    if lay.pipeline_layout:
        out += ["--pipeline-model-parallel-layout", lay.pipeline_layout]
    for opt, n in (("--decoder-first-pipeline-num-layers", lay.first_stage_layers),
                   ("--decoder-last-pipeline-num-layers", lay.last_stage_layers)):
        if n is not None:
            out += [opt, n]
    if lay.hierarchical_cp:
        out += ["--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes", *lay.hierarchical_cp]
    if lay.hybrid_cp:
        out += ["--hybrid-context-parallel", "--calculate-per-token-loss"]
    if lay.recompute_modules:
        out += ["--recompute-modules", *lay.recompute_modules]
    if lay.moe_grouped_gemm:
        out.append("--moe-grouped-gemm")
    for opt, value in (("--recompute-granularity", lay.recompute_granularity),
                       ("--recompute-method", lay.recompute_method),
                       ("--recompute-num-layers", lay.recompute_num_layers)):
        if value is not None:
            out += [opt, value]
    return [str(x) for x in out]


def m(base: ModelInfo, **kw) -> ModelInfo:
    return ModelInfo(**{**base.__dict__, **kw})


@dataclass(frozen=True)
class Case:
    rule: str
    lay: Layout
    model: ModelInfo
    numbers: tuple[str, ...]  # what the message must name
    id: str = field(default="")


CASES = (
    Case("world_divisible", Layout(n_gpus=8, gbs=64, tp=3), DENSE,
         ("world size (8)", "tensor model parallel size (3)", "= 3")),
    Case("world_divisible", Layout(n_gpus=12, gbs=48, tp=4, pp=2), DENSE,
         ("world size (12)", "(4)", "pipeline model parallel size (2)", "= 8"), "tp-pp"),
    Case("expert_grid", Layout(n_gpus=8, gbs=64, tp=2, ep=8, sequence_parallel=True), MOE,
         ("world size (8)", "expert tensor parallel size (2)", "expert model parallel size (8)", "= 16")),
    Case("experts", Layout(n_gpus=8, gbs=64, ep=2), DENSE, ("expert model parallel size (2)",), "dense"),
    Case("experts", Layout(n_gpus=8, gbs=64, ep=4), m(MOE, num_experts=6),
         ("number of experts (6)", "expert model parallel size (4)"), "indivisible"),
    Case("tp_heads", Layout(n_gpus=8, gbs=64, tp=8), m(DENSE, num_attention_heads=12, num_query_groups=12,
                                                         hidden_size=1536),
         ("number of attention heads (12)", "tensor model parallel size (8)")),
    Case("tp_query_groups", Layout(n_gpus=8, gbs=64, tp=4), m(DENSE, num_attention_heads=24, num_query_groups=6,
                                                                hidden_size=3072),
         ("number of query groups (6)", "tensor model parallel size (4)")),
    Case("tp_ffn", Layout(n_gpus=8, gbs=64, tp=8, sequence_parallel=True), m(DENSE, ffn_hidden_size=5460),
         ("ffn hidden size (5460)", "tensor model parallel size (8)"), "dense"),
    # Mixtral-like on 24 GPUs: expert TP 3 divides the world but not the experts' width
    Case("tp_ffn", Layout(n_gpus=24, gbs=96, tp=4, ep=4, etp=3, sequence_parallel=True),
         m(MOE, moe_ffn_hidden_size=1024), ("moe ffn hidden size (1024)", "expert tensor parallel size (3)"), "experts"),
    Case("hidden_heads", Layout(n_gpus=8, gbs=64), m(DENSE, hidden_size=1000, num_attention_heads=16,
                                                       num_query_groups=16),
         ("hidden size (1000)", "number of attention heads (16)")),
    Case("cp_seq", Layout(n_gpus=8, gbs=64, cp=4), m(DENSE, seq_length=4100),
         ("sequence length (4100)", "(8)")),
    Case("gbs", Layout(n_gpus=8, gbs=60, mbs=1), DENSE,
         ("global batch size (60)", "micro batch size (1)", "data parallel size (8)")),
    Case("gbs", Layout(n_gpus=8, gbs=64, mbs=16), DENSE,
         ("global batch size (64)", "micro batch size (16)", "data parallel size (8)", "= 128"), "mbs"),
    Case("pp_layers", Layout(n_gpus=8, gbs=64, pp=4), m(DENSE, num_layers=30),
         ("number of layers (30)", "pipeline model parallel size (4)")),
    Case("virtual_pipeline", Layout(n_gpus=8, gbs=64, layers_per_virtual_stage=4), DENSE,
         ("greater than 1", "got 1"), "pp1"),
    Case("virtual_pipeline", Layout(n_gpus=8, gbs=64, pp=2, layers_per_virtual_stage=4, overlap_p2p=False), DENSE,
         ("greater than 2", "got 2"), "no-overlap"),
    Case("virtual_pipeline", Layout(n_gpus=8, gbs=64, pp=2, layers_per_virtual_stage=3), DENSE,
         ("layers per pipeline stage (16)", "virtual pipeline stage (3)"), "chunks"),
    Case("virtual_pipeline", Layout(n_gpus=8, gbs=2, tp=2, pp=4, layers_per_virtual_stage=4,
                                    sequence_parallel=True), DENSE,
         ("pipeline-model-parallel size (4)", "got 2"), "microbatches"),
    Case("recompute", Layout(n_gpus=8, gbs=64, recompute_granularity="selective", recompute_method="block"),
         DENSE, ("recompute method (block)", "selective"), "selective-method"),
    Case("recompute", Layout(n_gpus=8, gbs=64, recompute_granularity="selective", recompute_num_layers=2),
         DENSE, ("recompute num layers (2)", "selective"), "selective-layers"),
    Case("recompute", Layout(n_gpus=8, gbs=64, recompute_granularity="full", recompute_num_layers=1), DENSE,
         ("uniform|block", "got None"), "full-no-method"),
    Case("recompute", Layout(n_gpus=8, gbs=64, recompute_granularity="full", recompute_method="uniform"), DENSE,
         ("layers per pipeline stage (32)", "got None"), "full-no-layers"),
    Case("virtual_pipeline", Layout(n_gpus=8, gbs=12, pp=4, layers_per_virtual_stage=4), DENSE,
         ("pipeline-model-parallel size (4)", "got 6"), "microbatch-groups"),
    Case("moe_sequence_parallel", Layout(n_gpus=8, gbs=64, tp=2, ep=4), MOE,
         ("64 experts", "tensor model parallel size 2")),
    # current Megatron's layout flags (issue 23)
    Case("pipeline_layout", Layout(n_gpus=8, gbs=64, pp=8, pipeline_layout="Et*7|t*8|t*8|t*9L"), DENSE,
         ("(4 stages)", "pipeline model parallel size (8)", "pp in [2, 4]"), "stages"),
    Case("pipeline_layout", Layout(n_gpus=8, gbs=64, pp=2, pipeline_layout="Et*3|t*3|t*3|t*3L"), DENSE,
         ("decoder layers in --pipeline-model-parallel-layout (12)", "num_layers (32)"), "decoders"),
    Case("virtual_pipeline", Layout(n_gpus=8, gbs=64, pipeline_layout="Et*8|t*8|t*8|t*8L"), DENSE,
         ("greater than 1", "got 1", "4 stages"), "layout-pp1"),
    Case("virtual_pipeline", Layout(n_gpus=8, gbs=64, pp=4, vpp_size=4), m(DENSE, num_layers=24),
         ("num_layers_per_pipeline_rank (6)", "vp_size (4)"), "vpp-size"),
    Case("uneven_pipeline", Layout(n_gpus=8, gbs=64, pp=2, first_stage_layers=6, last_stage_layers=6),
         m(DENSE, num_layers=30), ("18 middle layers", "0 middle pipeline stages"), "mismatch"),
    Case("uneven_pipeline", Layout(n_gpus=8, gbs=64, pp=4, first_stage_layers=2), m(DENSE, num_layers=24),
         ("middle stage (22)", "parallel size (3)"), "middle"),
    Case("uneven_pipeline", Layout(n_gpus=8, gbs=64, pp=4, vpp_size=2, first_stage_layers=3, last_stage_layers=3),
         m(DENSE, num_layers=30), ("first stage (3)", "degree (2)"), "vpp"),
    Case("hierarchical_cp", Layout(n_gpus=8, gbs=64, cp=2, hierarchical_cp=(2, 2)), DENSE,
         ("context parallel size (2)", "sizes 2 2 (4)")),
    Case("hybrid_cp", Layout(n_gpus=8, gbs=64, pp=2, hybrid_cp=True), DENSE, ("pipeline model parallel size 2",)),
    Case("recompute_modules", Layout(n_gpus=8, gbs=64, ep=4, recompute_granularity="selective",
                                     recompute_modules=("core_attn", "moe_act")), MOE,
         ("moe_act", "moe_grouped_gemm", "core_attn moe_act")),
    Case("moe_etp_bias", Layout(n_gpus=8, gbs=64, ep=4, etp=2), m(MOE, disable_bias_linear=False),
         ("expert tensor parallel size (2)",)),
)
IDS = [f"{c.rule}-{c.id}" if c.id else c.rule for c in CASES]

# Megatron rules on flags the simulator does not parse yet (its argument parser rejects them as unknown):
# checked in the validator only.
TUNER_ONLY_CASES = (
    Case("local_impl_sequence_parallel", Layout(n_gpus=8, gbs=64, tp=2, sequence_parallel=True, local_impl=True),
         DENSE, ("sequence parallel not supported by torch LayerNorm", "--transformer-impl local")),
    Case("moe_sequence_parallel", Layout(n_gpus=8, gbs=64, tp=2, ep=4, local_impl=True), MOE,
         ("tensor model parallel size 2", "--transformer-impl local cannot run it"), "local"),
    Case("local_impl_context_parallel", Layout(n_gpus=8, gbs=64, cp=2, local_impl=True), DENSE,
         ("context parallelism (context parallel size 2) is only supported by TEDotProductAttention",
          "--transformer-impl local")),
    Case("tp_comm_overlap", Layout(n_gpus=8, gbs=64, tp=1, tp_comm_overlap=True), DENSE,
         ("--tp-comm-overlap", "tp=1")),
    Case("moe_a2a_overlap", Layout(n_gpus=8, gbs=64, ep=8, pp=2, moe_a2a_overlap=True, moe_dispatcher="alltoall"), MOE,
         ("virtual_pipeline_model_parallel_size must be specified", "pp=2")),
    Case("distribute_saved_activations", Layout(n_gpus=8, gbs=64, distribute_saved_activations=True,
                                                recompute_granularity="full", recompute_method="uniform",
                                                recompute_num_layers=1), DENSE, ("tp=1",), "tp1"),
    Case("distribute_saved_activations", Layout(n_gpus=8, gbs=64, tp=2, distribute_saved_activations=True,
                                                recompute_granularity="selective"), DENSE,
         ("full", "got selective"), "selective"),
    Case("distribute_saved_activations", Layout(n_gpus=8, gbs=64, tp=2, distribute_saved_activations=True,
                                                sequence_parallel=True, recompute_granularity="full",
                                                recompute_method="block", recompute_num_layers=2), DENSE,
         ("sequence parallel",), "sp"),
    Case("pp_layers", Layout(n_gpus=8, gbs=64, pp=4, pipeline_extra_layers=1), m(DENSE, num_layers=30),
         ("number of layers (30 + 1", "pipeline model parallel size (4)"), "account-for-one"),
    Case("virtual_pipeline", Layout(n_gpus=8, gbs=64, pp=4, layers_per_virtual_stage=2, pipeline_extra_layers=2),
         m(DENSE, num_layers=26), ("layers per pipeline stage (7)", "virtual pipeline stage (2)"), "account-for"),
)


def test_every_megatron_rule_has_a_case():
    megatron_rules = {r.name for r in RULES if r.kind == "megatron"}
    assert megatron_rules <= {c.rule for c in CASES + TUNER_ONLY_CASES}


def test_every_rule_says_where_it_comes_from():
    for rule in RULES:
        assert rule.kind in ("megatron", "policy")
        doc = rule.check.__doc__ or ""
        if rule.kind == "megatron":
            assert "megatron/" in doc, f"{rule.name} must cite the Megatron check it mirrors"
        else:
            assert doc.startswith("Policy"), f"{rule.name} must say it is zenithtune's policy"


@pytest.mark.parametrize("case", CASES + TUNER_ONLY_CASES,
                         ids=IDS + [f"{c.rule}-{c.id}" if c.id else c.rule for c in TUNER_ONLY_CASES])
def test_validator_rejects_naming_the_numbers(case):
    reasons = dict(check(case.lay, case.model, kinds=("megatron",)))
    assert case.rule in reasons, reasons
    for text in case.numbers:
        assert text in reasons[case.rule]


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_simulated_megatron_rejects_with_the_same_message(case):
    res = simulate(argv_for(case.lay, case.model), {"CUDA_DEVICE_MAX_CONNECTIONS": "1"})
    assert (res.exit_code, res.kind) == (1, "invalid"), res.stdout[-300:] + res.stderr[-300:]
    reason = dict(check(case.lay, case.model, kinds=("megatron",)))[case.rule]
    assert reason in res.errors
    # Megatron stops at its first assertion; the simulator reports the first broken rule the same way
    assert res.stderr.splitlines()[-1] == f"AssertionError: {res.errors[0]}"


@pytest.mark.parametrize("case", CASES[:: 4], ids=IDS[:: 4])
def test_the_cli_exits_1_with_the_assertion_on_stderr(case):
    out = subprocess.run([sys.executable, "-m", "zenithtune.sim", *argv_for(case.lay, case.model)],
                         capture_output=True, text=True, timeout=30,
                         env={**os.environ, "CUDA_DEVICE_MAX_CONNECTIONS": "1"})
    assert out.returncode == 1
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("AssertionError: ")
    assert any(text in last for text in case.numbers)


def test_the_valid_layouts_next_to_the_cases_run():
    ok = Layout(n_gpus=8, gbs=64, tp=2, ep=4, sequence_parallel=True, recompute_granularity="selective")
    assert check(ok, MOE, kinds=("megatron",)) == []
    assert simulate(argv_for(ok, MOE), {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}).kind in ("ok", "oom")
    tp_multiple_of_groups = Layout(n_gpus=8, gbs=64, tp=8, sequence_parallel=True)  # 8 groups, newer Megatron
    assert check(tp_multiple_of_groups, m(DENSE, num_query_groups=4), kinds=("megatron",)) == []
    pp2_interleaved = Layout(n_gpus=8, gbs=64, pp=2, layers_per_virtual_stage=4)  # p2p overlap is the default
    assert check(pp2_interleaved, DENSE, kinds=("megatron",)) == []
    ep_on_its_own_grid = Layout(n_gpus=8, gbs=64, tp=2, ep=4, etp=1, sequence_parallel=True)  # d = 8/2, not 8/8
    assert check(ep_on_its_own_grid, MOE, kinds=("megatron",)) == []


@pytest.mark.parametrize("lay, model", [
    # Megatron accepts these (its runtime clips the recompute count): only the recompute_chunk policy prunes them
    (Layout(n_gpus=8, gbs=64, pp=2, recompute_granularity="full", recompute_method="block", recompute_num_layers=20),
     DENSE),
    (Layout(n_gpus=8, gbs=64, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=5),
     DENSE),
    # a method without a granularity is ignored by Megatron
    (Layout(n_gpus=8, gbs=64, recompute_method="uniform", recompute_num_layers=1), DENSE),
    # 30 layers + embedding + loss split evenly over 4 stages
    (Layout(n_gpus=8, gbs=64, pp=4, pipeline_extra_layers=2), m(DENSE, num_layers=30)),
    # the local implementation without sequence parallelism; tp-comm-overlap with it; distribute without SP
    (Layout(n_gpus=8, gbs=64, tp=2, local_impl=True), DENSE),
    (Layout(n_gpus=8, gbs=64, cp=2), DENSE),  # CP under Transformer Engine (the default implementation)
    (Layout(n_gpus=8, gbs=64, tp=2, sequence_parallel=True, tp_comm_overlap=True), DENSE),
    (Layout(n_gpus=8, gbs=64, tp=2, distribute_saved_activations=True, recompute_granularity="full",
            recompute_method="uniform", recompute_num_layers=1), DENSE),
    # VPP flags whose chunk is the whole stage do not interleave (Megatron sets the virtual size to None)
    (Layout(n_gpus=8, gbs=64, layers_per_virtual_stage=32), DENSE),
    # uneven first/last 6 on 30 layers: 18 middle layers over 2 (pp=4) or 6 (pp=8) stages; pp_layers does not apply
    (Layout(n_gpus=8, gbs=64, pp=4, first_stage_layers=6, last_stage_layers=6), m(DENSE, num_layers=30)),
    (Layout(n_gpus=8, gbs=64, pp=8, first_stage_layers=6, last_stage_layers=6), m(DENSE, num_layers=30)),
    (Layout(n_gpus=8, gbs=64, pp=2, first_stage_layers=2), m(DENSE, num_layers=24)),
    (Layout(n_gpus=8, gbs=64, pp=4, vpp_size=2, first_stage_layers=4, last_stage_layers=6), m(DENSE, num_layers=30)),
    # a 4-stage layout at pp=4 (no interleaving) and at pp=2 (2 virtual stages each)
    (Layout(n_gpus=8, gbs=64, pp=4, pipeline_layout="Et*7|t*8|t*8|t*9L"), DENSE),
    (Layout(n_gpus=8, gbs=64, pp=2, pipeline_layout="Et*7|t*8|t*8|t*9L"), DENSE),
    # hierarchical CP at the product of its sizes; hybrid CP without a pipeline; moe_act with grouped GEMM,
    # or under full recompute (the modules are read only under selective)
    (Layout(n_gpus=8, gbs=64, cp=4, hierarchical_cp=(2, 2)), DENSE),
    (Layout(n_gpus=8, gbs=64, cp=2, hybrid_cp=True), DENSE),
    (Layout(n_gpus=8, gbs=64, ep=4, recompute_granularity="selective", recompute_modules=("moe_act",),
            moe_grouped_gemm=True), MOE),
    (Layout(n_gpus=8, gbs=64, ep=4, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1,
            recompute_modules=("moe_act",)), MOE),
])
def test_megatron_accepts(lay, model):
    assert check(lay, model, kinds=("megatron",)) == []
    # ... and so does the simulated pretrain_gpt.py, given the same flags
    res = simulate(argv_for(lay, model), {"CUDA_DEVICE_MAX_CONNECTIONS": "1"})
    assert res.kind in ("ok", "oom"), res.errors or res.stderr[-300:]


def test_a_pipeline_layout_with_more_stages_than_pp_interleaves():
    lay = Layout(n_gpus=8, gbs=64, pp=2, pipeline_layout="Et*7|t*8|t*8|t*9L")
    assert lay.virtual_stages(32) == 2
    assert Layout(n_gpus=8, gbs=64, pp=4, pipeline_layout="Et*7|t*8|t*8|t*9L").virtual_stages(32) == 1
    # interleaving runs micro-batches in groups of pp: 6 micro-batches do not fill groups of 4
    eight = "Et*4|(t*4|)*6t*4L"
    assert Layout(n_gpus=8, gbs=16, pp=4, pipeline_layout=eight).virtual_stages(32) == 2
    assert check(Layout(n_gpus=8, gbs=16, pp=4, pipeline_layout=eight), DENSE, kinds=("megatron",)) == []
    reasons = dict(check(Layout(n_gpus=8, gbs=12, pp=4, pipeline_layout=eight), DENSE, kinds=("megatron",)))
    assert "groups of pipeline-model-parallel size (4)" in reasons["virtual_pipeline"]


def test_recompute_chunk_is_a_switchable_policy():
    lay = Layout(n_gpus=8, gbs=64, pp=2, recompute_granularity="full", recompute_method="block", recompute_num_layers=20)
    assert [name for name, _ in check(lay, DENSE)] == ["recompute_chunk"]
    assert "runs like 16" in check(lay, DENSE)[0][1]
    assert check(lay, DENSE, skip=("recompute_chunk",)) == []
    with pytest.raises(ValueError, match="only policy rules can be switched off"):
        check(lay, DENSE, skip=("gbs",))


def test_cuda_device_max_connections_is_required_for_tp_or_cp():
    lay = Layout(n_gpus=8, gbs=64, tp=2, sequence_parallel=True)
    (msg,) = env_errors(lay, {})
    assert "tp=2" in msg and "CUDA_DEVICE_MAX_CONNECTIONS to 1" in msg
    assert env_errors(lay, {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}) == []
    res = simulate(argv_for(lay, DENSE), {})
    assert res.kind == "ok" and f"WARNING: {msg}" in res.stderr  # users run the simulator by hand


def test_an_option_megatron_does_not_know_is_a_parse_error():
    res = simulate([*argv_for(Layout(n_gpus=8, gbs=64), DENSE), "--recompute-modules-typo", "core_attn"])
    assert res.exit_code == 2
    assert "pretrain_gpt.py: error: unrecognized arguments: --recompute-modules-typo core_attn" in res.stderr
