"""Fidelity to Megatron-LM and ms-swift: real command lines (tests/fixtures/commands, copied from the
upstream example scripts) through the space, the validator and the injector, asserting the exact argv;
then one test per user flag whose meaning a candidate changes (issue 12, issue 15 item 2)."""
from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

from zenithtune.command import facts, trainer_problem
from zenithtune.inject import inject
from zenithtune.modelinfo import ModelInfo, from_argv
from zenithtune.space import Context, Space, options_for

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).parent / "fixtures" / "commands"
PRESET: dict[str, Any] = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "preset" / "megatron.yaml"))  # type: ignore
QWEN3_32B = ModelInfo(name="Qwen/Qwen3-32B", num_layers=64, hidden_size=5120, num_attention_heads=64,
                      num_query_groups=8, kv_channels=128, seq_length=8192, num_experts=0, swiglu=True,
                      disable_bias_linear=True, vocab_size=151936)
QWEN3_30B_A3B = ModelInfo(name="Qwen/Qwen3-30B-A3B", num_layers=48, hidden_size=2048, num_attention_heads=32,
                          num_query_groups=4, kv_channels=128, seq_length=2048, num_experts=128, moe_router_topk=8,
                          moe_ffn_hidden_size=768, swiglu=True, disable_bias_linear=True, vocab_size=151936)


def fixture(name: str) -> list[str]:
    lines = [ln for ln in (FIXTURES / name).read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    return shlex.split(" ".join(lines))


def study(argv: list[str], n_gpus: int, gbs: int, model: ModelInfo | None = None, preset: dict | None = None) -> Space:
    ctx = Context(n_gpus=n_gpus, gbs=gbs, model=model or from_argv(argv), flags=facts(argv))
    return Space.from_preset(preset or PRESET, ctx)


def run(space: Space, argv: list[str], cand: dict) -> list[str]:
    """What a trial launches: the validator must accept the candidate, then the options are injected."""
    assert space.reasons(cand) == []
    return inject(argv, space.options(cand))


def edited(argv: list[str], replace: dict[str, str], append: str = "", drop: tuple[str, ...] = ()) -> list[str]:
    """The expected argv: the fixture's text with some `--opt old` replaced, some removed, some appended."""
    text = shlex.join(argv)
    for old, new in replace.items():
        assert old in text, old
        text = text.replace(old, new)
    for old in drop:
        assert f" {old}" in text, old
        text = text.replace(f" {old}", "")
    return shlex.split(text) + shlex.split(append)


# --- real command lines ---------------------------------------------------------------------------

def test_gpt3_175b_on_128_gpus() -> None:
    argv = fixture("megatron_gpt3_175b.cmd")
    space = study(argv, n_gpus=128, gbs=1536)
    cand = {"tp": 8, "pp": 8, "cp": 1, "mbs": 2, "recompute_granularity": "full", "recompute_method": "uniform",
            "recompute_num_layers": 2}
    assert run(space, argv, cand) == edited(
        argv, {"--micro-batch-size 1": "--micro-batch-size 2", "--pipeline-model-parallel-size 16":
               "--pipeline-model-parallel-size 8"},
        "--context-parallel-size 1 --recompute-granularity full --recompute-method uniform "
        "--recompute-num-layers 2 --sequence-parallel")
    # 96 layers split over pp=16 is what the script runs; pp=64 is not a divisor of 96
    assert space.reasons({**cand, "pp": 16}) == []
    assert [r for r, _ in space.reasons({"tp": 1, "pp": 64, "cp": 1, "mbs": 1})] == ["pp_layers"]


@pytest.mark.parametrize("cand, replace, append, drop", [
    # tp=1: the script's own --sequence-parallel goes (Megatron turns it off at tp=1 anyway)
    ({"tp": 1, "pp": 1, "cp": 2, "mbs": 1, "recompute_granularity": "selective"},
     {"--context-parallel-size 1": "--context-parallel-size 2"},
     "--pipeline-model-parallel-size 1 --recompute-granularity selective", ("--sequence-parallel",)),
    ({"tp": 2, "pp": 2, "cp": 1, "mbs": 2, "recompute_granularity": "none"},
     {"--tensor-model-parallel-size 1": "--tensor-model-parallel-size 2", "--micro-batch-size 1":
      "--micro-batch-size 2"},
     "--pipeline-model-parallel-size 2", ()),
])
def test_llama3_8b_fp8(cand: dict, replace: dict, append: str, drop: tuple) -> None:
    argv = fixture("megatron_llama3_8b_fp8.cmd")
    assert run(study(argv, n_gpus=8, gbs=128), argv, cand) == edited(argv, replace, append, drop)


def test_swift_qwen3_32b_none_is_written_out() -> None:
    """ms-swift's default recompute is selective: 'none' must say so, never leave the option out."""
    argv = fixture("swift_qwen3_32b.cmd")
    space = study(argv, n_gpus=8, gbs=16, model=QWEN3_32B)
    cand = {"tp": 4, "pp": 2, "cp": 1, "mbs": 1, "recompute_granularity": "none"}
    assert run(space, argv, cand) == edited(
        argv, {"--tensor_model_parallel_size 8": "--tensor_model_parallel_size 4",
               "--recompute_granularity full": "--recompute_granularity none"},
        "--pipeline_model_parallel_size 2 --context_parallel_size 1",
        ("--recompute_method uniform", "--recompute_num_layers 1"))


def test_swift_moe_lora() -> None:
    argv = fixture("swift_qwen3_30b_a3b_lora.cmd")
    space = study(argv, n_gpus=2, gbs=16, model=QWEN3_30B_A3B)
    cand = {"tp": 2, "pp": 1, "cp": 1, "ep": 1, "etp": 1, "mbs": 4, "recompute_granularity": "selective"}
    assert run(space, argv, cand) == edited(
        argv, {"--expert_model_parallel_size 2": "--expert_model_parallel_size 1",
               "--micro_batch_size 8": "--micro_batch_size 4",
               "--recompute_granularity full": "--recompute_granularity selective"},
        "--tensor_model_parallel_size 2 --pipeline_model_parallel_size 1 --context_parallel_size 1 "
        "--expert_tensor_parallel_size 1",
        ("--recompute_method uniform", "--recompute_num_layers 1"))
    # MoE with tp > 1 keeps sequence parallelism even if the command said false
    no_sp = [("false" if tok == "true" and prev == "--sequence_parallel" else tok) for prev, tok in zip([""] + argv, argv)]
    assert "--sequence_parallel true" in shlex.join(inject(no_sp, study(no_sp, 2, 16, QWEN3_30B_A3B).options(cand)))


def test_swift_sft_is_refused_in_one_line() -> None:
    argv = shlex.split("swift sft --model Qwen/Qwen3-8B --dataset d")
    msg = trainer_problem(argv)
    assert msg is not None and "`swift sft`" in msg and "megatron sft|pt|rlhf" in msg and "\n" not in msg
    assert trainer_problem(fixture("swift_qwen3_32b.cmd")) is None


# --- one test per user flag -------------------------------------------------------------------------

BASE = ("python -m torch.distributed.run --nproc-per-node 8 pretrain_gpt.py --num-layers 32 --hidden-size 4096 "
        "--num-attention-heads 32 --seq-length 4096 --micro-batch-size 1 --global-batch-size 64 --bf16")


def cmd(extra: str = "") -> list[str]:
    return shlex.split(f"{BASE} {extra}".strip())


def test_the_launcher_modules_options_are_left_alone() -> None:
    argv = cmd()
    out = run(study(argv, 8, 64), argv, {"tp": 2, "pp": 1, "cp": 1, "mbs": 1, "recompute_granularity": "none"})
    assert out[:6] == argv[:6]  # python -m torch.distributed.run --nproc-per-node 8 pretrain_gpt.py
    assert out[6:] == argv[6:] + shlex.split("--tensor-model-parallel-size 2 --pipeline-model-parallel-size 1 "
                                             "--context-parallel-size 1 --sequence-parallel")


@pytest.mark.parametrize("granularity", ["none", "selective", "full"])
def test_recompute_activations_gives_way_to_the_candidate(granularity: str) -> None:
    argv = cmd("--recompute-activations")
    space = study(argv, 8, 64)
    cand = {"tp": 1, "pp": 1, "cp": 1, "mbs": 1, "recompute_granularity": granularity}
    if granularity == "full":
        cand |= {"recompute_method": "block", "recompute_num_layers": 4}
    out = run(space, argv, cand)
    assert "--recompute-activations" not in out
    assert space.layout(cand).recompute_granularity == (None if granularity == "none" else granularity)


def test_virtual_pipeline_is_dropped_at_pp1_and_checked_above() -> None:
    argv = cmd("--num-layers-per-virtual-pipeline-stage 4")
    space = study(argv, 8, 48)
    at_pp1 = run(space, argv, {"tp": 1, "pp": 1, "cp": 1, "mbs": 1, "recompute_granularity": "none"})
    assert "--num-layers-per-virtual-pipeline-stage" not in at_pp1
    at_pp2 = run(space, argv, {"tp": 1, "pp": 2, "cp": 1, "mbs": 1, "recompute_granularity": "none"})
    assert "--num-layers-per-virtual-pipeline-stage 4" in shlex.join(at_pp2)
    # pp=4, dp=2, mbs=4: 6 micro-batches, not whole groups of 4 (Megatron's interleaved schedule raises)
    reasons = dict(space.reasons({"tp": 1, "pp": 4, "cp": 1, "mbs": 4, "recompute_granularity": "none"}))
    assert "micro-batches per iteration must be a multiple of it (got 6)" in reasons["virtual_pipeline"]
    # pp=8: one chunk of 4 layers per stage is no interleaving at all (Megatron sets the virtual size to None)
    assert space.reasons({"tp": 1, "pp": 8, "cp": 1, "mbs": 1, "recompute_granularity": "none"}) == []
    swift = shlex.split("megatron sft --num_layers 32 --hidden_size 4096 --num_attention_heads 32 "
                        "--virtual_pipeline_model_parallel_size 2")
    out = inject(swift, study(swift, 8, 64).options({"tp": 1, "pp": 1, "cp": 1, "mbs": 1, "recompute_granularity": "none"}))
    assert "--virtual_pipeline_model_parallel_size" not in out


def test_tp_comm_overlap_only_with_sequence_parallel() -> None:
    argv = cmd("--tp-comm-overlap")
    space = study(argv, 8, 64)
    assert "--tp-comm-overlap" not in run(space, argv, {"tp": 1, "pp": 1, "cp": 1, "mbs": 1,
                                                        "recompute_granularity": "none"})
    out = run(space, argv, {"tp": 2, "pp": 1, "cp": 1, "mbs": 1, "recompute_granularity": "none"})
    assert "--tp-comm-overlap" in out and "--sequence-parallel" in out


def test_distribute_saved_activations_kept_only_where_megatron_runs_it() -> None:
    argv = cmd("--distribute-saved-activations")
    space = study(argv, 8, 64)
    full = {"tp": 2, "pp": 1, "cp": 1, "mbs": 1, "recompute_granularity": "full", "recompute_method": "uniform",
            "recompute_num_layers": 1}
    out = run(space, argv, full)
    # the user chose distributing the saved input over sequence parallelism (Megatron refuses both)
    assert "--distribute-saved-activations" in out and "--sequence-parallel" not in out
    for cand in ({**full, "tp": 1}, {"tp": 2, "pp": 1, "cp": 1, "mbs": 1, "recompute_granularity": "selective"}):
        assert "--distribute-saved-activations" not in run(space, argv, cand)


@pytest.mark.parametrize("extra, valid", [
    ("", False), ("--account-for-embedding-in-pipeline-split", False),
    ("--account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split", True),
])
def test_account_for_flags_enter_the_layer_split(extra: str, valid: bool) -> None:
    argv = shlex.split(BASE.replace("--num-layers 32", "--num-layers 30") + " " + extra)
    space = study(argv, 8, 64)
    reasons = space.reasons({"tp": 1, "pp": 4, "cp": 1, "mbs": 1, "recompute_granularity": "none"})
    assert (reasons == []) is valid, reasons


def test_local_transformer_impl_never_gets_sequence_parallel() -> None:
    argv = cmd("--transformer-impl local")
    space = study(argv, 8, 64)
    out = run(space, argv, {"tp": 2, "pp": 1, "cp": 1, "mbs": 1, "recompute_granularity": "none"})
    assert "--sequence-parallel" not in out
    assert "--transformer-impl local" in space.notes()[0] or "transformer-impl local" in space.notes()[0]
    moe = cmd("--transformer-impl local --num-experts 8 --moe-router-topk 2 --disable-bias-linear")
    reasons = dict(study(moe, 8, 64).reasons({"tp": 2, "pp": 1, "cp": 1, "ep": 1, "etp": 2, "mbs": 1,
                                              "recompute_granularity": "none"}))
    assert "--transformer-impl local cannot run it" in reasons["moe_sequence_parallel"]


@pytest.mark.parametrize("extra, expect_sp", [("", False), ("--sequence-parallel", True)])
def test_sequence_parallel_command_mode_keeps_the_users_choice(extra: str, expect_sp: bool) -> None:
    argv = cmd(extra)
    space = study(argv, 8, 64, preset={**PRESET, "sequence_parallel": "command"})
    out = run(space, argv, {"tp": 2, "pp": 1, "cp": 1, "mbs": 1, "recompute_granularity": "none"})
    assert ("--sequence-parallel" in out) is expect_sp


def test_the_entry_function_path_reads_the_same_flags() -> None:
    """app.compose calls options_for with the command: the same adjustments as the study's Space."""
    argv = cmd("--recompute-activations --tp-comm-overlap")
    params = {"tp": 1, "pp": 1, "cp": 1, "mbs": 1, "recompute_granularity": "none"}
    out = inject(argv, options_for(PRESET, params, 64, argv))
    assert "--recompute-activations" not in out and "--tp-comm-overlap" not in out
    assert out == inject(argv, study(argv, 8, 64).options(params))
