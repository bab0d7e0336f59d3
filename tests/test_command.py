"""The one argv reader (zenithtune.command), shared by inject and modelinfo: tested by tables."""
from __future__ import annotations

import shlex

import pytest

from zenithtune.command import CommandFacts, env_prefix, facts, options, options_start, trainer
from zenithtune.inject import inject
from zenithtune.modelinfo import from_argv


def cmd(text: str) -> list[str]:
    return shlex.split(text)


@pytest.mark.parametrize("argv, start, kind", [
    ("torchrun --nproc-per-node 8 pretrain_gpt.py --x 1", 4, "megatron"),
    ("torchrun --standalone --nproc_per_node=2 pretrain_gpt.py --x 1", 4, "megatron"),
    # the launcher module's own options are skipped (it used to take `8 pretrain_gpt.py` as a value)
    ("python -m torch.distributed.run --nproc-per-node 8 pretrain_gpt.py --x 1", 6, "megatron"),
    ("python3 -u -m torch.distributed.launch --nproc_per_node 8 --use_env train.py --x 1", 8, "megatron"),
    ("deepspeed --num_gpus 8 --master_port 29500 pretrain_gpt.py --x 1", 6, "megatron"),
    ("torchrun --nproc-per-node 2 -m zenithtune.sim --x 1", 5, "megatron"),
    ("env CUDA_DEVICE_MAX_CONNECTIONS=1 torchrun --nnodes 2 pretrain_gpt.py --x 1", 6, "megatron"),
    ("NPROC_PER_NODE=8 megatron sft --model m", 3, "swift"),
    ("megatron rlhf --rlhf_type dpo", 2, "swift"),
    ("python -m zenithtune.sim.swift --x 1", 3, "swift"),
    ("torchrun --nproc-per-node 8 /sp/swift/cli/_megatron/sft.py --x 1", 4, "swift"),
    ("swift sft --model m", 2, "swift_native"),
    ("CUDA_VISIBLE_DEVICES=0 swift pt --model m", 3, "swift_native"),
    ("python -m swift.cli.sft --model m", 3, "swift_native"),
    ("./train --x 1", 1, "megatron"),
])
def test_trainer_and_option_start(argv: str, start: int, kind: str) -> None:
    assert options_start(cmd(argv)) == start
    assert trainer(cmd(argv)) == kind


def test_launcher_options_are_never_edited_or_read() -> None:
    argv = cmd("python -m torch.distributed.run --nproc-per-node 8 pretrain_gpt.py --num-layers 4")
    assert inject(argv, {"--tensor-model-parallel-size": 2}) == argv + ["--tensor-model-parallel-size", "2"]
    assert inject(argv, {"--nproc-per-node": None}) == argv
    assert options(argv) == {"num-layers": "4"}
    assert from_argv(argv).num_layers == 4


def test_options_last_wins_like_argparse() -> None:
    assert options(cmd("x.py --num_layers 4 --num-layers=8 --swiglu")) == {"num-layers": "8", "swiglu": None}


@pytest.mark.parametrize("argv, expected", [
    ("pretrain_gpt.py --num-layers 4", CommandFacts()),
    ("pretrain_gpt.py --transformer-impl local --sequence-parallel --use-distributed-optimizer",
     CommandFacts(transformer_impl="local", sequence_parallel=True, distributed_optimizer=True)),
    ("pretrain_gpt.py --num-layers-per-virtual-pipeline-stage 2 --no-overlap-p2p-communication "
     "--recompute-activations --tp-comm-overlap --distribute-saved-activations "
     "--account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split",
     CommandFacts(layers_per_virtual_stage=2, overlap_p2p=False, recompute_activations=True, tp_comm_overlap=True,
                  distribute_saved_activations=True, account_for_embedding=True, account_for_loss=True)),
    ("megatron sft --sequence_parallel false --virtual_pipeline_model_parallel_size 2",
     CommandFacts(trainer="swift", sequence_parallel=False, virtual_stages=2, distributed_optimizer=True,
                  moe_grouped_gemm=True)),
    ("megatron sft --use_distributed_optimizer false --moe_grouped_gemm false", CommandFacts(trainer="swift")),
    # current Megatron's layout flags (issue 23), both spellings
    ("pretrain_gpt.py --cp-comm-type a2a+p2p --hierarchical-context-parallel-sizes 2 2 --hybrid-context-parallel "
     "--calculate-per-token-loss --recompute-modules core_attn moe_act --moe-grouped-gemm "
     "--pipeline-model-parallel-layout Et*3|t*3|t*3|t*3L --decoder-first-pipeline-num-layers 2 "
     "--decoder-last-pipeline-num-layers=3 --overlap-param-gather --overlap-grad-reduce --dataloader-type cyclic",
     CommandFacts(cp_comm_types=("a2a+p2p",), hierarchical_cp=(2, 2), hybrid_cp=True, per_token_loss=True,
                  recompute_modules=("core_attn", "moe_act"), moe_grouped_gemm=True,
                  pipeline_layout="Et*3|t*3|t*3|t*3L", first_stage_layers=2, last_stage_layers=3,
                  overlap_param_gather=True, overlap_grad_reduce=True, dataloader_type="cyclic")),
    # the command's own sizes: what runs where a preset does not search them
    ("NPROC_PER_NODE=8 megatron sft --expert_model_parallel_size 2 --tensor_model_parallel_size=4 "
     "--micro_batch_size 2 --decoder_first_pipeline_num_layers 6",
     CommandFacts(trainer="swift", distributed_optimizer=True, moe_grouped_gemm=True, first_stage_layers=6,
                  sizes=(("tp", 4), ("ep", 2), ("mbs", 2)))),
])
def test_facts(argv: str, expected: CommandFacts) -> None:
    assert facts(cmd(argv)) == expected


@pytest.mark.parametrize("argv, env, rest", [
    ("NPROC_PER_NODE=2 CUDA_VISIBLE_DEVICES=0,1 megatron sft --model m",
     {"NPROC_PER_NODE": "2", "CUDA_VISIBLE_DEVICES": "0,1"}, "megatron sft --model m"),
    ("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True torchrun x.py --a=b", {"PYTORCH_CUDA_ALLOC_CONF":
     "expandable_segments:True"}, "torchrun x.py --a=b"),
    # `env` is a program of its own: it runs as written; an assignment after the program is an argument
    ("env A=1 torchrun x.py", {}, "env A=1 torchrun x.py"),
    ("torchrun x.py A=1", {}, "torchrun x.py A=1"),
])
def test_env_prefix(argv: str, env: dict, rest: str) -> None:
    assert env_prefix(cmd(argv)) == (env, cmd(rest))
