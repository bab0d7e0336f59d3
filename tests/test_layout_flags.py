"""Current Megatron's layout flags in the user's command (issue 23 item 2): one test per flag.

Each builds the space from a command carrying the flag and checks every candidate of the full product
against `megatron_refuses`, a transcription of what Megatron-LM (d98e8a64) does with that command,
written here independently of zenithtune's rules: no launchable candidate may be one Megatron refuses
(or one it silently builds with the wrong layers), and no candidate Megatron accepts may be pruned by
a Megatron rule (no over-pruning: the uneven first/last split stays where Megatron allows it).
"""
from __future__ import annotations

import math
import re
import sys
from pathlib import Path
from typing import Any

import pytest
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf, open_dict
from test_fidelity import fixture

from zenithtune import settings
from zenithtune.app import compose as app_compose
from zenithtune.command import facts, options
from zenithtune.errors import UserError
from zenithtune.inject import inject
from zenithtune.modelinfo import ModelInfo, from_argv
from zenithtune.options import options_for
from zenithtune.preflight import check_command
from zenithtune.run import command_problem, run
from zenithtune.sim.arguments import parse_megatron
from zenithtune.sim.swift import parse_swift
from zenithtune.space import Context, Space
from zenithtune.validate import RULE_KINDS

ROOT = Path(__file__).resolve().parents[1]
PRESET: dict[str, Any] = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "preset" / "megatron.yaml"))  # type: ignore
# The full product is walked candidate by candidate: one full-recompute setting and two expert sizes keep it
# to a few thousand (the layout flags do not read the recompute method or the layer count).
SMALL: dict[str, Any] = {**PRESET, "params": {**PRESET["params"],
                                              "recompute_method": {**PRESET["params"]["recompute_method"], "values": ["uniform"]},
                                              "recompute_num_layers": {**PRESET["params"]["recompute_num_layers"], "values": [1]},
                                              "ep": {**PRESET["params"]["ep"], "values": [1, 2]},
                                              "etp": {**PRESET["params"]["etp"], "values": [1]}}}
MODELS = Path(__file__).parent / "fixtures" / "models"
N_GPUS, GBS = 16, 64
SIM = [sys.executable, "-m", "zenithtune.sim", "--hidden-size", "1024", "--num-attention-heads", "16",
       "--seq-length", "4096", "--position-embedding-type", "rope", "--micro-batch-size", "1",
       "--global-batch-size", str(GBS), "--train-iters", "2", "--bf16", "--log-throughput",
       "--sim-world-size", str(N_GPUS)]
MOE = ["--num-experts", "8", "--moe-router-topk", "2", "--disable-bias-linear"]
# the rules that judge the layout flags: a candidate Megatron accepts must never be pruned by one of them
LAYOUT_RULES = {"pp_layers", "virtual_pipeline", "pipeline_layout", "uneven_pipeline", "hierarchical_cp",
                "hybrid_cp", "recompute_modules"}


# --- Megatron, transcribed -------------------------------------------------------------------------

def _stages(layout: str) -> list[str]:
    """pipeline_parallel_layer_layout.py PipelineParallelLayerLayout.parse_str_to_list."""
    text = layout.replace(",", "")
    for pattern in (r"\(([^)]+)\)\*(\d+)", r"(.)\*(\d+)"):
        text = re.sub(pattern, lambda m: m.group(1) * int(m.group(2)), text)
    return text.split("|")


def megatron_refuses(argv: list[str], n_gpus: int) -> str | None:
    """Why Megatron-LM refuses (or mis-builds) this command's layout flags, or None: arguments.py
    validate_args, TransformerConfig.__post_init__, transformer_block.get_num_layers_to_build and the
    interleaved schedule's micro-batch groups, in that order, for the flags of issue 23."""
    o = options(argv)

    def num(name: str, default: int | None = None) -> int | None:
        return int(o[name]) if o.get(name) is not None else default

    tp, pp, cp = num("tensor-model-parallel-size", 1), num("pipeline-model-parallel-size", 1), num("context-parallel-size", 1)
    assert tp and pp and cp
    L = num("num-layers")
    assert L
    if n_gpus % (tp * pp * cp) or GBS % (num("micro-batch-size", 1) * (n_gpus // (tp * pp * cp))):  # type: ignore[operator]
        return "world size or global batch not divisible (parallel_state, the micro-batch calculator)"
    first, last = num("decoder-first-pipeline-num-layers"), num("decoder-last-pipeline-num-layers")
    per_vstage, vstages = num("num-layers-per-virtual-pipeline-stage"), num("num-virtual-stages-per-pipeline-rank")
    layout = o.get("pipeline-model-parallel-layout")
    extra = ("account-for-embedding-in-pipeline-split" in o) + ("account-for-loss-in-pipeline-split" in o)
    # validate_args
    hier = [int(x) for x in (o.get("hierarchical-context-parallel-sizes") or "").split()]
    if hier and cp != math.prod(hier):
        return "context_parallel_size != prod(hierarchical_context_parallel_sizes)"
    if "a2a+p2p" in (o.get("cp-comm-type") or "p2p") and not hier:
        return "a2a+p2p needs --hierarchical-context-parallel-sizes"
    if sum(x is not None for x in (per_vstage, vstages, layout)) > 1:
        return "no more than one virtual pipeline spelling"
    vpp: int | None = None
    if layout is not None:
        if len(_stages(layout)) % pp:
            return "layout length not divisible by pp"
        vpp = len(_stages(layout)) // pp
    elif per_vstage is not None or vstages is not None:
        if vstages is None:
            if first is not None or last is not None:
                return "use --num-virtual-stages-per-pipeline-rank with uneven pp"
            if (L + extra) % pp:
                return "layers not divisible by pp"
            if ((L + extra) // pp) % per_vstage:  # type: ignore[operator]
                return "layers per stage not divisible by layers per virtual stage"
            vpp = ((L + extra) // pp) // per_vstage  # type: ignore[operator]
        else:
            vpp = vstages
    elif first is None and last is None and (L + extra) % pp:
        return "layers not divisible by pp"
    vpp = None if vpp == 1 else vpp
    if vpp is not None and pp <= 1:
        return "interleaved schedule needs pp > 1"
    if "overlap-param-gather" in o and ("use-distributed-optimizer" not in o or "overlap-grad-reduce" not in o):
        return "--overlap-param-gather needs the distributed optimizer and --overlap-grad-reduce"
    if "hybrid-context-parallel" in o and pp > 1:
        return "hybrid context parallelism not supported with pipeline parallelism"
    # TransformerConfig.__post_init__
    granularity = "selective" if "recompute-activations" in o else o.get("recompute-granularity")
    modules = (o.get("recompute-modules") or "core_attn").split()
    if granularity == "selective" and "moe_act" in modules and "moe-grouped-gemm" not in o:
        return "moe_act in recompute_modules is only supported with moe_grouped_gemm"
    built: list[int] = []
    if layout is not None:
        stages = _stages(layout)
        if (first, last, extra) != (None, None, 0):
            return "layout with other pipeline layout arguments"
        if "".join(stages).count("t") != L:
            return "layout's decoder layers != num_layers"
        built = [s.count("t") for s in stages]
    elif first is not None or last is not None:
        middle, stages_left = L - (first or 0) - (last or 0), pp - (first is not None) - (last is not None)
        for n in (first, last):
            if n is not None and vpp and n % vpp:
                return "first/last stage layers not divisible by vpp"
        if bool(middle) != bool(stages_left):
            return "mismatch of middle layers and middle stages"
        if stages_left and middle % stages_left:
            return "middle layers not divisible by middle stages"
        if stages_left > 0 and vpp and (middle // stages_left) % vpp:
            return "middle rank layers not divisible by vpp"
        # get_num_layers_to_build, rank by rank
        per_rank = middle // stages_left if stages_left > 0 else 0
        for rank in range(pp):
            n = per_rank
            if rank == 0 and first is not None:
                n = first
            if rank == pp - 1 and last is not None:
                n = last
            built.append(n)
    else:
        per = (L + extra) // pp
        if vpp and per % vpp:
            return "num_layers_per_pipeline_rank not divisible by vp_size"
        built = [per] * pp
        built[0] -= int("account-for-embedding-in-pipeline-split" in o)
        built[-1] -= int("account-for-loss-in-pipeline-split" in o)
    if sum(built) != L:
        return f"builds {sum(built)} of {L} layers"
    # the interleaved schedule runs micro-batches in groups of pp
    if vpp:
        dp = n_gpus // (tp * pp * cp)
        m = GBS // (num("micro-batch-size", 1) * dp)  # type: ignore[operator]
        if m % pp:
            return "micro-batches not a multiple of pp (interleaved schedule)"
    return None


# --- the space of a command, candidate by candidate -----------------------------------------------

def space_of(argv: list[str], preset: dict | None = None, model: ModelInfo | None = None) -> Space:
    ctx = Context(n_gpus=N_GPUS, gbs=GBS, model=model or from_argv(argv), flags=facts(argv), mbs_max=2)
    return Space.from_preset(preset or SMALL, ctx)


def verdicts(argv: list[str], preset: dict | None = None) -> tuple[Space, list[tuple[dict, list[str], str | None]]]:
    """Every candidate of the full product: (candidate, the Megatron rules that prune it, Megatron's verdict
    on the argv the trial would run)."""
    space = space_of(argv, preset)
    out = []
    seen = set()
    for raw in space._sub(tuple(space.params), {}):
        cand = space.normalize(raw)
        key = space.key(cand)
        if key in seen:
            continue
        seen.add(key)
        rules = [r for r, _ in space.reasons(cand) if RULE_KINDS.get(r) == "megatron"]
        out.append((cand, rules, megatron_refuses(inject(argv, space.options(cand)), N_GPUS)))
    return space, out


def assert_agrees(argv: list[str], preset: dict | None = None) -> tuple[Space, list[dict]]:
    """No launchable candidate that Megatron refuses; no candidate Megatron accepts pruned by a layout
    rule. Returns the launchable candidates."""
    space, rows = verdicts(argv, preset)
    launched_refused = [(c, why) for c, rules, why in rows if not rules and why]
    assert launched_refused == [], launched_refused[:3]
    over_pruned = [(c, rules) for c, rules, why in rows if why is None and set(rules) & LAYOUT_RULES]
    assert over_pruned == [], over_pruned[:3]
    launchable = [c for c, rules, _ in rows if not rules and not [r for r, _ in space.reasons(c)]]
    assert launchable, "the flag must leave something to search"
    return space, launchable


def cmd(layers: int, *flags: str, moe: bool = False) -> list[str]:
    return [*SIM, "--num-layers", str(layers), *(MOE if moe else []), *flags]


# --- one test per flag -----------------------------------------------------------------------------

def test_hierarchical_cp_fixes_cp_to_the_product_of_its_sizes():
    space, ok = assert_agrees(cmd(24, "--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes", "2", "2"))
    assert {c["cp"] for c in ok} == {4}
    assert any("only cp=4 is searched" in n for n in space.notes())


def test_hybrid_cp_searches_no_pipeline():
    space, ok = assert_agrees(cmd(24, "--hybrid-context-parallel", "--calculate-per-token-loss"))
    assert {c["pp"] for c in ok} == {1}
    assert {c["cp"] for c in ok} > {1}


def test_moe_act_recompute_without_grouped_gemm_prunes_selective_only():
    _, ok = assert_agrees(cmd(16, "--recompute-modules", "moe_act", moe=True))
    assert "selective" not in {c["recompute_granularity"] for c in ok}
    assert {"full", "none"} <= {c["recompute_granularity"] for c in ok}
    _, ok = assert_agrees(cmd(16, "--recompute-modules", "moe_act", "--moe-grouped-gemm", moe=True))
    assert "selective" in {c["recompute_granularity"] for c in ok}


def test_a_pipeline_layout_is_searched_where_its_stages_fit_and_dropped_at_pp1():
    argv = cmd(24, "--pipeline-model-parallel-layout", "Et*5|t*6|t*6|t*7L")
    space, ok = assert_agrees(argv)
    assert {c["pp"] for c in ok} == {1, 2, 4}
    at_pp1 = next(c for c in ok if c["pp"] == 1)
    assert "--pipeline-model-parallel-layout" not in inject(argv, space.options(at_pp1))
    # 4 stages at pp=2: two virtual stages per rank, as Megatron runs it
    at_pp2 = next(c for c in ok if c["pp"] == 2)
    assert space.layout(at_pp2).virtual_stages(24) == 2
    assert "--pipeline-model-parallel-layout" in inject(argv, space.options(at_pp2))


def test_decoder_first_is_dropped_at_pp1_and_said_in_the_report():
    argv = cmd(24, "--decoder-first-pipeline-num-layers", "2")
    space, ok = assert_agrees(argv)
    assert {c["pp"] for c in ok} >= {1, 2}
    at_pp1 = next(c for c in ok if c["pp"] == 1)
    assert "--decoder-first-pipeline-num-layers" not in inject(argv, space.options(at_pp1))
    assert any(n.startswith("--decoder-first-pipeline-num-layers dropped at pp=1") for n in space.notes())


def test_uneven_first_and_last_keep_the_valid_uneven_splits():
    # 30 layers, 6 on the first and the last stage: 18 middle layers over 2 (pp=4) or 6 (pp=8) stages; pp=2
    # leaves 18 layers for no middle stage; pp=1 would silently build 6 of 30 layers: dropped there
    argv = cmd(30, "--decoder-first-pipeline-num-layers", "6", "--decoder-last-pipeline-num-layers", "6")
    space, ok = assert_agrees(argv)
    assert {c["pp"] for c in ok} == {1, 4, 8}
    assert megatron_refuses(argv + ["--pipeline-model-parallel-size", "1"], N_GPUS) == "builds 6 of 30 layers"


def test_virtual_stages_per_rank_must_divide_each_stage():
    # 24 layers, 4 virtual stages: pp=2 (12 per stage) interleaves; pp=4 (6) and pp=8 (3) fail when built
    space, ok = assert_agrees(cmd(24, "--num-virtual-stages-per-pipeline-rank", "4"))
    assert {c["pp"] for c in ok} == {1, 2}
    reasons = dict(space.reasons({"tp": 1, "pp": 4, "cp": 1, "mbs": 1, "recompute_granularity": "none"}))
    assert "num_layers_per_pipeline_rank (6) should be divisible by vp_size (4)" in reasons["virtual_pipeline"]


@pytest.mark.parametrize("flags, message", [
    (["--overlap-param-gather", "--overlap-grad-reduce"],
     "--overlap-param-gather only supported with distributed optimizer: add --use-distributed-optimizer"),
    (["--overlap-param-gather", "--use-distributed-optimizer"], "must use --overlap-param-gather with --overlap-grad-reduce"),
    (["--cp-comm-type", "a2a+p2p"], "--hierarchical-context-parallel-sizes must be set when a2a+p2p is used"),
    (["--pipeline-model-parallel-layout", "Et*12|t*12L", "--decoder-first-pipeline-num-layers", "2"],
     "pipeline_model_parallel_layout cannot be set with other pipeline layout arguments"),
    (["--pipeline-model-parallel-layout", "t*12|t*12L"], "the embedding (E) must be the first layer"),
    (["--num-virtual-stages-per-pipeline-rank", "2", "--num-layers-per-virtual-pipeline-stage", "3"],
     "no more than one of --num-layers-per-virtual-pipeline-stage, --num-virtual-stages-per-pipeline-rank"),
    (["--hybrid-context-parallel"], "hybrid context parallelism must be used with --calculate-per-token-loss"),
])
def test_a_command_megatron_always_refuses_is_refused_before_launch_in_one_line(flags, message):
    argv = cmd(24, *flags)
    with pytest.raises(UserError) as err:
        check_command(argv, n_gpus=N_GPUS, evaluator_target="zenithtune.evaluate.MegatronThroughput")
    assert message in str(err.value) and "\n" not in str(err.value)
    assert megatron_refuses(argv, N_GPUS) is not None or "E)" in message or "calculate" in message


def test_the_simulator_refuses_the_same_commands_as_megatron():
    from zenithtune.sim.arguments import ConfigError
    with pytest.raises(ConfigError, match="--overlap-param-gather only supported with distributed optimizer"):
        parse_megatron(cmd(24, "--overlap-param-gather", "--overlap-grad-reduce")[3:], {})
    cfg = parse_megatron(cmd(30, "--pipeline-model-parallel-size", "4", "--decoder-first-pipeline-num-layers", "6",
                             "--decoder-last-pipeline-num-layers", "6")[3:], {})
    assert (cfg.layout.first_stage_layers, cfg.layout.last_stage_layers) == (6, 6)


# --- ms-swift -----------------------------------------------------------------------------------------

SWIFT = ["NPROC_PER_NODE=16", sys.executable, "-m", "zenithtune.sim.swift", "sft", "--model",
         str(MODELS / "Qwen3-30B-A3B"), "--train_iters", "2", "--global_batch_size", str(GBS), "--max_length", "4096"]


def test_swift_expert_sizes_of_the_command_are_what_the_layout_holds():
    """A preset that searches neither expert size keeps the command's --expert_model_parallel_size 2 and
    writes the expert TP zenithtune assumes (ETP = TP; ms-swift's own default would be 1), in the space
    and in the trial (which knows no model)."""
    preset = {**PRESET, "params": {k: v for k, v in PRESET["params"].items() if k not in ("ep", "etp")}}
    argv = [*SWIFT, "--expert_model_parallel_size", "2"]
    space = space_of(argv, preset)
    ran = []
    for cand in list(space.walk())[:40]:
        lay = space.layout(cand)
        trial_argv = inject(argv, options_for(preset, cand, GBS, argv))  # what app.compose runs
        sim = parse_swift(trial_argv[4:], {"NPROC_PER_NODE": "16"}).layout
        ran.append((sim.ep, sim.expert_tp) == (lay.ep, lay.expert_tp) == (2, lay.tp))
    assert ran and all(ran)
    assert "the command's own ep=2 run in every trial (the preset does not search them)" in space.notes()


def test_swift_decoder_first_is_dropped_at_pp1():
    argv = [*SWIFT, "--decoder_first_pipeline_num_layers", "12"]
    space = space_of(argv)
    cands = list(space.walk())
    at_pp1 = next(c for c in cands if c["pp"] == 1)
    assert "--decoder_first_pipeline_num_layers" not in inject(argv, space.options(at_pp1))
    at_pp2 = next(c for c in cands if c["pp"] == 2)
    assert "--decoder_first_pipeline_num_layers" in inject(argv, space.options(at_pp2))


def test_leading_assignments_are_the_commands_environment(tmp_path):
    """ms-swift's examples start `NPROC_PER_NODE=2 CUDA_VISIBLE_DEVICES=0,1 megatron sft ...`: the tokens set
    the environment of the program that follows, as a shell would, without a shell."""
    argv = ["ZT_PROBE=42", sys.executable, "-c", "import os; print('probe', os.environ['ZT_PROBE'])"]
    assert command_problem(argv) is None
    res = run(argv, log_path=tmp_path / "log", timeout=60)
    assert "probe 42" in res.output and res.returncode == 0
    assert "not found" in (command_problem(["A=1", "no-such-program-zt"]) or "")
    assert "only sets variables" in (command_problem(["A=1"]) or "")


def test_a_swift_fixture_is_refused_for_its_program_not_its_assignments():
    argv = fixture("swift_qwen3_32b.cmd")
    problem = command_problem(argv, env={"PATH": ""})
    assert problem is not None and problem.startswith("command 'megatron' not found on PATH")


def trial_argv(argv: list[str], params: dict) -> list[str]:
    """The argv the entry function composes for `params` on `argv` (the study's defaults otherwise)."""
    with initialize_config_module("zenithtune.conf"):
        cfg = compose("config", overrides=[f"n_gpus={N_GPUS}", f"gbs={GBS}"])
    with open_dict(cfg):
        cfg.command = argv
        cfg.params = params
    composed, _ = app_compose(settings.load(cfg))
    return composed


def test_a_trial_composes_the_same_argv_as_the_space():
    """The entry function (no model known) and the space (model known) agree on a layout flag's drop, and
    on the expert TP of an ms-swift command stating its expert size."""
    argv = cmd(24, "--decoder-first-pipeline-num-layers", "2")
    for pp in (1, 2):
        params = {"tp": 1, "pp": pp, "cp": 1, "mbs": 1, "recompute_granularity": "none"}
        composed = trial_argv(argv, params)
        space = space_of(argv)
        assert composed == inject(argv, space.options(params))
        assert ("--decoder-first-pipeline-num-layers" in composed) == (pp > 1)


def test_ms_swift_launcher_variables_are_checked_against_the_settings():
    """`NPROC_PER_NODE=2 ... megatron sft` starts 2 processes: n_gpus=8 is refused in one line, as torchrun's
    --nproc-per-node is; the simulator takes its world size from the same variable."""
    argv = fixture("swift_qwen3_30b_a3b_lora.cmd")
    with pytest.raises(UserError, match=r"n_gpus=8 but the command starts 2 processes \(NPROC_PER_NODE=2 x NNODES=1\)"):
        check_command(argv, n_gpus=8, evaluator_target="zenithtune.evaluate.SwiftSpeed")
    check_command(argv, n_gpus=2, evaluator_target="zenithtune.evaluate.SwiftSpeed")
    check_command(SWIFT, n_gpus=N_GPUS, evaluator_target="zenithtune.evaluate.SwiftSpeed")


# --- the virtual pipeline size as a searched parameter (issue 23 item 1) ------------------------------

def test_the_searched_virtual_size_offers_only_what_megatron_accepts():
    # 24 layers on 16 GPUs: 12 / 6 / 3 layers per stage at pp 2 / 4 / 8; vp must divide them
    argv = cmd(24)
    space, ok = assert_agrees(argv, SMALL)
    offered = {(c["pp"], c.get("vp")) for c in ok}
    assert {v for p, v in offered if p == 2} == {1, 2, 3, 4, 6}
    assert {v for p, v in offered if p == 4} == {1, 2, 3, 6}
    assert {v for p, v in offered if p == 8} == {1, 3}
    assert {v for p, v in offered if p == 1} == {None}  # no pipeline: no virtual size, never injected
    for c in ok:
        trial = inject(argv, options_for(SMALL, c, GBS, argv))  # what app.compose runs
        assert ("--num-virtual-stages-per-pipeline-rank" in trial) == (c.get("vp", 1) > 1)
    assert any(n.startswith("virtual pipeline size vp searched at pp > 1") for n in space.notes())


def test_an_uneven_split_offers_only_the_virtual_sizes_its_stages_divide():
    # 30 layers, first/last 6: pp=4 and pp=8 leave 9 and 3 layers per middle rank; vp must divide 6 and those
    space, ok = assert_agrees(cmd(30, "--decoder-first-pipeline-num-layers", "6", "--decoder-last-pipeline-num-layers", "6"))
    assert {c.get("vp") for c in ok if c["pp"] in (4, 8)} == {1, 3}


def test_vp4_at_pp4_is_injected_in_one_spelling_and_runs_interleaved():
    argv = cmd(32)
    cand = {"tp": 1, "pp": 4, "vp": 4, "cp": 1, "mbs": 1, "recompute_granularity": "none"}
    trial = inject(argv, options_for(PRESET, cand, GBS, argv))
    i = trial.index("--num-virtual-stages-per-pipeline-rank")
    assert trial[i + 1] == "4"
    assert "--num-layers-per-virtual-pipeline-stage" not in trial and "--virtual-pipeline-model-parallel-size" not in trial
    assert parse_megatron(trial[3:], {}).layout.virtual_stages(32) == 4
    at_vp1 = inject(argv, options_for(PRESET, {**cand, "vp": 1}, GBS, argv))
    assert "--num-virtual-stages-per-pipeline-rank" not in at_vp1


def test_a_command_stating_a_virtual_size_keeps_it_and_vp_is_not_searched():
    argv = cmd(24, "--num-virtual-stages-per-pipeline-rank", "2")
    space = space_of(argv)
    assert "vp" not in space.params
    at_pp2 = next(c for c in space.walk() if c["pp"] == 2)
    assert "vp" not in at_pp2
    for trial in (inject(argv, space.options(at_pp2)), inject(argv, options_for(PRESET, {**at_pp2, "vp": 4}, GBS, argv))):
        i = trial.index("--num-virtual-stages-per-pipeline-rank")
        assert trial[i + 1] == "2"
    assert any("the virtual pipeline size is the command's, not searched" in n for n in space.notes())


def test_swift_gets_the_virtual_size_under_its_own_name():
    preset = {**PRESET, "params": {k: v for k, v in PRESET["params"].items() if k not in ("ep", "etp")}}
    argv = [*SWIFT, "--expert_model_parallel_size", "1"]
    cand = {"tp": 1, "pp": 4, "vp": 2, "cp": 1, "mbs": 1, "recompute_granularity": "none"}
    trial = inject(argv, options_for(preset, cand, GBS, argv))
    assert "--num_virtual_stages_per_pipeline_rank" not in trial
    i = trial.index("--virtual_pipeline_model_parallel_size")
    assert trial[i + 1] == "2"
    assert parse_swift(trial[4:], {"NPROC_PER_NODE": "16"}).layout.vpp_size == 2
    stated = [*argv, "--virtual_pipeline_model_parallel_size", "3"]
    kept = inject(stated, options_for(preset, cand, GBS, stated))
    assert kept[kept.index("--virtual_pipeline_model_parallel_size") + 1] == "3"


def test_a_tuned_config_carries_vp_and_applying_it_reinjects_it():
    import yaml

    from zenithtune.record import Outcome
    from zenithtune.tuned import tuned_yaml
    argv = cmd(32)
    cand = {"tp": 1, "pp": 4, "vp": 4, "cp": 1, "mbs": 1, "recompute_granularity": "none"}
    text = tuned_yaml(Outcome(cand, "complete", value=400.0, trial_number=3), command=argv, n_gpus=N_GPUS,
                      gbs=GBS, model=None, metric="TFLOP/s/GPU", strategy="heuristic", study="s", name="vp")
    params = yaml.safe_load(text)["params"]
    assert params["vp"] == 4
    composed = trial_argv(argv, params)
    assert composed[composed.index("--num-virtual-stages-per-pipeline-rank") + 1] == "4"
    assert composed == inject(argv, space_of(argv).options(cand))
