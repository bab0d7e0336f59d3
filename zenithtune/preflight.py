"""Checks of the wrapped command against the settings, before anything is launched.

A mismatch here would otherwise cost every trial of the study (a world size the command does not
have, a simulator without its world size, a Megatron run that never prints the throughput the
evaluator reads), so each one is an error, one line naming both values and the fix. Only a command
this module recognises is checked (torchrun's options, Megatron's `pretrain_*.py`, the simulator);
anything else passes untouched.

Also here: `model=` with the default (simulator) command puts that model's shape into the command,
and `model=` that disagrees with the shape a user's command states is refused.
"""
from __future__ import annotations

import os
from typing import Any

from zenithtune.command import env_prefix, facts, trainer
from zenithtune.errors import UserError
from zenithtune.inject import find_option, inject
from zenithtune.modelinfo import _INT_OPTIONS, ModelInfo, from_argv, from_hf
from zenithtune.validate import command_errors

# The shape fields a model and a command must agree on (the others follow from them or the command).
_COMPARED = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "num_experts")
_SIM_MODULES = ("zenithtune.sim", "zenithtune.sim.swift")


def _module(argv: list[str]) -> str | None:
    for i, tok in enumerate(argv[:-1]):
        if tok == "-m":
            return argv[i + 1]
    return None


def is_simulator(argv: list[str]) -> bool:
    return _module(argv) in _SIM_MODULES


def is_megatron(argv: list[str]) -> bool:
    """Megatron-LM's training scripts (pretrain_gpt.py, pretrain_vlm.py, ...) or the simulator playing them."""
    return _module(argv) == "zenithtune.sim" or any(
        os.path.basename(t).startswith("pretrain_") and t.endswith(".py") for t in argv)


def _int(value: Any) -> int | None:
    try:
        return int(str(value))
    except ValueError:
        return None  # `--nproc-per-node gpu`, `--nnodes 1:4`: decided at run time, not checked


def _launcher_option(argv: list[str], name: str) -> str | None:
    """An option of torchrun (or python -m torch.distributed.run) itself: before the training script,
    in either spelling (--nproc-per-node 8, --nproc_per_node=8)."""
    if not argv or not (os.path.basename(argv[0]) == "torchrun" or "torch.distributed.run" in argv[:3]):
        return None
    spellings = (f"--{name}", f"--{name.replace('-', '_')}")
    for i, tok in enumerate(argv[1:], start=1):
        if tok.endswith(".py") or (tok == "-m" and argv[i + 1:i + 2] != ["torch.distributed.run"]
                                   and i > 1):
            return None  # the training script's own options are not torchrun's
        if tok in spellings and i + 1 < len(argv):
            return argv[i + 1]
        for sp in spellings:
            if tok.startswith(sp + "="):
                return tok[len(sp) + 1:]
    return None


def check_command(argv: list[str], *, n_gpus: int, evaluator_target: str) -> None:
    """Refuse a command that cannot run with these settings; one line each. A command Megatron refuses
    whatever the candidate (`validate.command_errors`: ``--overlap-param-gather`` without the
    distributed optimizer, ...) would fail every trial the same way: it is refused here."""
    errors = command_errors(facts(argv))
    if errors:
        more = f" (and {len(errors) - 1} more problem(s) of the command)" if len(errors) > 1 else ""
        raise UserError(f"the command cannot run under Megatron with any candidate: {errors[0]}{more}")
    assigned, program = env_prefix(argv)  # `NPROC_PER_NODE=8 megatron sft ...`: the command's environment
    nproc = _launcher_option(program, "nproc-per-node")
    if nproc is not None:
        nodes_opt = _launcher_option(program, "nnodes")
        per, nodes = _int(nproc), _int(nodes_opt) if nodes_opt is not None else 1
        if per is not None and nodes is not None and per * nodes != n_gpus:
            raise UserError(f"n_gpus={n_gpus} but the command starts {per * nodes} processes (torchrun "
                            f"--nproc-per-node {per} x --nnodes {nodes}): make them agree, e.g. n_gpus={per * nodes}")
    if "NPROC_PER_NODE" in assigned and trainer(program) == "swift":
        # ms-swift's `megatron sft` launches NPROC_PER_NODE x NNODES processes
        per, nodes = _int(assigned["NPROC_PER_NODE"]), _int(assigned.get("NNODES", "1"))
        if per is not None and nodes is not None and per * nodes != n_gpus:
            raise UserError(f"n_gpus={n_gpus} but the command starts {per * nodes} processes (NPROC_PER_NODE={per} "
                            f"x NNODES={nodes}): make them agree, e.g. n_gpus={per * nodes}")
    if is_simulator(program):
        world = find_option(program, "--sim-world-size")
        if world is None and not {"WORLD_SIZE", "NPROC_PER_NODE"} & (set(os.environ) | set(assigned)):
            raise UserError(f"the simulator command has no --sim-world-size: add --sim-world-size {n_gpus} "
                            f"(it would otherwise play 1 GPU and every trial would fail)")
        if world not in (None, True) and _int(world) != n_gpus:
            raise UserError(f"n_gpus={n_gpus} but the simulator command says --sim-world-size {world}: "
                            f"make them agree")
    if evaluator_target.endswith("MegatronThroughput") and is_megatron(argv) and not find_option(argv, "--log-throughput"):
        raise UserError("the command has no --log-throughput, so Megatron prints no throughput and every trial "
                        "would fail as no_metric: add --log-throughput (or choose another evaluator=)")


def check_model(argv: list[str], model: str) -> None:
    """`model=` and a shape stated by the command must describe the same model."""
    theirs = from_argv(argv)
    if theirs.name != "command":
        return  # the command states no shape (or names its own --model): nothing to disagree with
    ours = from_hf(model)
    differ = [f for f in _COMPARED
              if getattr(theirs, f) is not None and getattr(ours, f) is not None
              and int(getattr(theirs, f) or 0) != int(getattr(ours, f) or 0)]
    if differ:
        show = "; ".join(f"{f}: model {getattr(ours, f)}, command {getattr(theirs, f)}" for f in differ[:3])
        raise UserError(f"model={model} disagrees with the command's shape ({show}): drop model= or fix the "
                        f"command's options (the command is what the trainer runs)")


def shape_options(info: ModelInfo) -> dict[str, Any]:
    """The Megatron options that state `info`'s shape, for `inject` (None removes an option)."""
    out: dict[str, Any] = {}
    for option, field in _INT_OPTIONS.items():
        if field in ("seq_length", "vision_seq_length"):
            continue  # the command's sequence length is the run's choice, not the model's
        value = getattr(info, field)
        if field == "num_experts" and not info.is_moe:
            value = None
        if field == "kv_channels" and info.hidden_size and info.num_attention_heads \
                and value == info.hidden_size // info.num_attention_heads:
            value = None
        if field in ("moe_shared_expert_size",) and not value:
            value = None
        out[f"--{option}"] = None if value is None else str(value)
    gqa = bool(info.num_query_groups and info.num_attention_heads and info.num_query_groups < info.num_attention_heads)
    out["--group-query-attention"] = gqa or None
    if not gqa:
        out["--num-query-groups"] = None
    out["--swiglu"] = bool(info.swiglu) or None
    out["--disable-bias-linear"] = bool(info.disable_bias_linear) or None
    out["--untie-embeddings-and-output-weights"] = (info.tie_embeddings is False) or None
    return out


def with_model(default_command: list[str], model: str) -> list[str]:
    """The default simulator command playing `model` (a HF id in the cache or a local dir)."""
    return inject(default_command, shape_options(from_hf(model)))
