"""The wrapped training command: where the launcher ends, which trainer runs, what its options say.

This is the one reader of the user's argv; `inject` edits it and `modelinfo` reads the model shape
from it, both through `scan`. A command has three parts:

    [env VAR=value ...] [launcher and its options] <trainer> <training options>

* launchers: ``torchrun``, ``python -m torch.distributed.run|launch``, ``deepspeed``, ``python``;
  their own options (``--nproc-per-node 8``, ``--standalone``) are never read or edited;
* trainer: a script (``pretrain_gpt.py``, ``*.sh``), a module (``-m zenithtune.sim``), ms-swift's
  Megatron mode (``megatron sft|pt|rlhf``) or ms-swift's own trainer (``swift sft|pt|rlhf``);
* training options: everything after the trainer up to a lone ``--``.

`CommandFacts` is what the validator and the injector need to know about the user's own flags
(``--transformer-impl local``, ``--recompute-activations``, the account-for-* pipeline split, ...).
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Literal

__all__ = ["Occurrence", "Trainer", "CommandFacts", "BOOL_WORDS", "parse_bool", "canonical", "options_start",
           "option_region", "scan", "find_option", "options", "is_swift_command", "trainer", "facts",
           "env_prefix", "SIZE_OPTIONS"]

# Tokens after which the training options begin. A launcher never takes these as its own values.
_SCRIPT_SUFFIXES = (".py", ".sh")
_SWIFT_PROGRAMS = {"megatron", "swift"}
_SWIFT_SUBCOMMANDS = {"sft", "pt", "rlhf"}
# `python -m <one of these>` is a launcher: its own options come before the real script.
_LAUNCHER_MODULES = {"torch.distributed.run", "torch.distributed.launch"}
_ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
# How ms-swift (and argparse's str2bool helpers) spell booleans; Megatron uses bare flags.
BOOL_WORDS: dict[str, bool] = {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}

Trainer = Literal["megatron", "swift", "swift_native"]
"""megatron: a Megatron-LM script (or the simulator); swift: ms-swift's Megatron mode
(`megatron sft|pt|rlhf`, its `swift/cli/_megatron/*.py`, `zenithtune.sim.swift`); swift_native:
ms-swift's own (non-Megatron) trainer, `swift sft|pt|rlhf`, which accepts none of Megatron's options."""


def parse_bool(text: str | None) -> bool | None:
    """``true/false`` (any case), ``yes/no``, ``1/0`` -> bool; anything else -> None."""
    return None if text is None else BOOL_WORDS.get(text.lower())


def canonical(name: str) -> str:
    """One key per option: argparse treats ``--a_b`` and ``--a-b`` alike, so we compare dashed names.

    >>> canonical("--tensor_model_parallel_size")
    '--tensor-model-parallel-size'
    """
    body = name[2:] if name.startswith("--") else name.lstrip("-")
    return "--" + body.split("=", 1)[0].replace("_", "-")


def _is_option(token: str) -> bool:
    """``--name`` or ``--name=value``; a token whose name part holds whitespace is a quoted value."""
    if not token.startswith("--") or token == "--":
        return False
    name = token.split("=", 1)[0]
    return not any(ch.isspace() for ch in name)


def _program_index(argv: list[str]) -> int:
    """Index of the first token that is neither ``env`` nor a ``VAR=value`` assignment."""
    i = 0
    while i < len(argv) and (argv[i] == "env" or _ENV_ASSIGNMENT.match(argv[i])):
        i += 1
    return i


def env_prefix(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """Leading ``VAR=value`` tokens as an environment, and the argv that runs.

    ms-swift's examples start ``NPROC_PER_NODE=8 CUDA_VISIBLE_DEVICES=0,1 megatron sft ...``; pasted
    after ``--`` they arrive as plain tokens (no shell reads them), so zenithtune does what the shell
    would have done: the assignments go into the command's environment, the rest is executed. A
    command starting with ``env`` runs ``env`` itself, which does the same."""
    i = 0
    assigned: dict[str, str] = {}
    while i < len(argv) and _ENV_ASSIGNMENT.match(argv[i]):
        name, value = argv[i].split("=", 1)
        assigned[name] = value
        i += 1
    return assigned, list(argv[i:])


def _trainer_index(argv: list[str]) -> tuple[int, int] | None:
    """(index of the trainer token, index of the first training option), or None when no trainer is
    recognisable. The trainer is the first script (``*.py``/``*.sh``), the module of ``-m module``
    (skipping launcher modules such as ``torch.distributed.run``, whose options follow), or
    ``megatron|swift`` followed by a subcommand (or as the program itself)."""
    program = _program_index(argv)
    i = program
    while i < len(argv):
        tok = argv[i]
        if tok in ("-m", "--module"):
            if i + 1 < len(argv) and argv[i + 1] in _LAUNCHER_MODULES:
                i += 2  # `python -m torch.distributed.run --nproc-per-node 8 train.py`: keep looking
                continue
            return (i + 1, min(i + 2, len(argv))) if i + 1 < len(argv) else (i, len(argv))
        if tok.startswith("-"):
            i += 1  # a launcher option or its value: scripts are told apart by their suffix
            continue
        base = os.path.basename(tok)
        if base.endswith(_SCRIPT_SUFFIXES):
            return i, i + 1
        if base in _SWIFT_PROGRAMS and (i == program or (i + 1 < len(argv) and argv[i + 1] in _SWIFT_SUBCOMMANDS)):
            has_sub = i + 1 < len(argv) and not argv[i + 1].startswith("-")
            return i, (i + 2 if has_sub else i + 1)
        i += 1
    return None


def options_start(argv: list[str]) -> int:
    """Index of the first training option (see the module docstring). Tokens before it belong to
    launchers (torchrun, python, env). Without a recognisable trainer every token after argv[0] is an
    option."""
    found = _trainer_index(argv)
    return found[1] if found else min(1, len(argv))


def option_region(argv: list[str]) -> tuple[int, int]:
    """[start, end) of the option tokens; a lone ``--`` ends argparse options, so it ends ours."""
    start = options_start(argv)
    end = argv.index("--", start) if "--" in argv[start:] else len(argv)
    return start, end


def trainer(argv: list[str]) -> Trainer:
    """Which trainer the command runs (see `Trainer`)."""
    found = _trainer_index(argv)
    if found is not None:
        tok = argv[found[0]]
        base = os.path.basename(tok)
        sub = argv[found[0] + 1] if found[0] + 1 < len(argv) else ""
        if base == "swift" and sub in _SWIFT_SUBCOMMANDS:
            return "swift_native"
        if base == "megatron" and (sub in _SWIFT_SUBCOMMANDS or found[0] == _program_index(argv)):
            return "swift"
        if found[0] > 0 and argv[found[0] - 1] in ("-m", "--module"):
            parts = tok.split(".")
            if parts[0] == "swift":
                # `python -m swift.cli.sft` is ms-swift's own trainer; `swift.cli._megatron.sft` its Megatron mode
                return "swift" if "_megatron" in parts or "megatron" in parts else "swift_native"
            return "swift" if "swift" in parts else "megatron"  # zenithtune.sim.swift plays `megatron sft`
        # what `megatron sft` itself runs: torchrun ... <site-packages>/swift/cli/_megatron/sft.py
        dirs = tok.replace("\\", "/").split("/")[:-1]
        if base.endswith(".py") and "swift" in dirs:
            return "swift" if "_megatron" in dirs or "megatron" in dirs else "swift_native"
    if _program_index(argv) < len(argv) and os.path.basename(argv[_program_index(argv)]) == "swift":
        return "swift_native"
    return "megatron"


def is_swift_command(argv: list[str]) -> bool:
    """ms-swift style (underscores, ``true``/``false`` booleans): either of ms-swift's trainers."""
    return trainer(argv) != "megatron"


@dataclass(frozen=True)
class Occurrence:
    """One option as the user wrote it."""

    start: int  # index of the name token
    end: int  # index after its last value token
    name: str  # as spelled, e.g. "--tensor_model_parallel_size"
    inline: bool  # written "--k=v"
    values: tuple[str, ...]  # value tokens; () for a bare flag

    @property
    def key(self) -> str:
        return canonical(self.name)

    @property
    def bool_value(self) -> str | None:
        """The true/false word when the option is written as a boolean word, else None (``1``/``0``
        are numbers here: ``--recompute-num-layers 1`` is not a boolean)."""
        if len(self.values) == 1 and not self.values[0].isdigit() and parse_bool(self.values[0]) is not None:
            return self.values[0]
        return None

    def rendered(self) -> str | None:
        """The value as one string (None for a bare flag)."""
        return " ".join(self.values) if self.values else None


def scan(argv: list[str]) -> list[Occurrence]:
    """Every option in the option region, in order. A value is every following token up to the next
    option: negative numbers and quoted strings (even ``"--a 1"``) are values, and ``nargs`` options
    such as ``--data-path 0.5 a 0.5 b`` keep all of theirs."""
    start, end = option_region(argv)
    found: list[Occurrence] = []
    i = start
    while i < end:
        tok = argv[i]
        if not _is_option(tok):
            i += 1
            continue
        if "=" in tok:
            name, value = tok.split("=", 1)
            found.append(Occurrence(i, i + 1, name, True, (value,)))
            i += 1
            continue
        j = i + 1
        while j < end and not _is_option(argv[j]):
            j += 1
        found.append(Occurrence(i, j, tok, False, tuple(argv[i + 1:j])))
        i = j
    return found


def find_option(argv: list[str], name: str) -> str | bool | None:
    """Current value of an option in any spelling: ``--k v``/``--k=v`` → ``"v"`` (several value tokens
    joined by a space), bare flag → True, absent → None. The first occurrence wins (inject keeps
    the first and drops later duplicates)."""
    key = canonical(name)
    for occ in scan(argv):
        if occ.key == key:
            text = occ.rendered()
            return True if text is None else text
    return None


def options(argv: list[str]) -> dict[str, str | None]:
    """Every training option, ``{dashed name without --: value or None for a bare flag}``; for a
    repeated option the last one wins, as in argparse. nargs values are joined by a space."""
    return {occ.key[2:]: occ.rendered() for occ in scan(argv)}


def _flag(opts: dict[str, str | None], name: str) -> bool:
    """A Megatron flag (bare) or its ms-swift spelling (``--flag true|false``)."""
    if name not in opts:
        return False
    value = opts[name]
    return True if value is None else bool(parse_bool(value.split()[0]) if value.split() else True)


def _int(opts: dict[str, str | None], name: str) -> int | None:
    value = opts.get(name)
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


@dataclass(frozen=True)
class CommandFacts:
    """The user's own flags that decide what Megatron accepts or what an injected option means.

    Every field has Megatron's default when the command does not give the flag."""

    trainer: Trainer = "megatron"
    transformer_impl: str | None = None  # --transformer-impl (None: Megatron's default, transformer_engine)
    sequence_parallel: bool | None = None  # the user's own --sequence-parallel; None = not stated
    layers_per_virtual_stage: int | None = None  # --num-layers-per-virtual-pipeline-stage
    virtual_stages: int | None = None  # --num-virtual-stages-per-pipeline-rank / ms-swift's --virtual_pipeline_model_parallel_size
    overlap_p2p: bool = True  # False with --no-overlap-p2p-communication
    recompute_activations: bool = False  # --recompute-activations: Megatron turns it into selective
    tp_comm_overlap: bool = False  # --tp-comm-overlap: needs sequence parallelism
    distribute_saved_activations: bool = False  # --distribute-saved-activations
    account_for_embedding: bool = False  # --account-for-embedding-in-pipeline-split
    account_for_loss: bool = False  # --account-for-loss-in-pipeline-split
    distributed_optimizer: bool = False  # --use-distributed-optimizer (ms-swift: on unless `false`)
    # --- layout flags of current Megatron (issue 23): each is honoured per candidate (options.adjust,
    # validate's rules) or refused before launch when no candidate can run it (preflight) -----------
    overlap_param_gather: bool = False  # --overlap-param-gather: needs the distributed optimizer
    overlap_grad_reduce: bool = False  # --overlap-grad-reduce: --overlap-param-gather needs it too
    cp_comm_types: tuple[str, ...] = ("p2p",)  # --cp-comm-type (one per layer, or one for all)
    hierarchical_cp: tuple[int, ...] | None = None  # --hierarchical-context-parallel-sizes: their product is cp
    hybrid_cp: bool = False  # --hybrid-context-parallel: refuses pp > 1
    per_token_loss: bool = False  # --calculate-per-token-loss: --hybrid-context-parallel needs it
    dataloader_type: str | None = None  # --dataloader-type (None: Megatron's "single")
    recompute_modules: tuple[str, ...] | None = None  # --recompute-modules (None: Megatron's core_attn)
    moe_grouped_gemm: bool = False  # --moe-grouped-gemm (ms-swift: on unless `false`)
    pipeline_layout: str | None = None  # --pipeline-model-parallel-layout, e.g. "Et*3|t*3|t*3|t*3L"
    first_stage_layers: int | None = None  # --decoder-first-pipeline-num-layers
    last_stage_layers: int | None = None  # --decoder-last-pipeline-num-layers
    moe_a2a_overlap: bool = False  # --overlap-moe-expert-parallel-comm (core >= 0.14)
    moe_dispatcher: str = "allgather"  # --moe-token-dispatcher-type (megatron-core's default)
    moe_shared_expert_overlap: bool = False  # --moe-shared-expert-overlap: EP overlap refuses it
    sizes: tuple[tuple[str, int], ...] = ()  # the command's own tp/pp/cp/ep/etp/mbs: what runs where a preset does not search them

    @property
    def swift(self) -> bool:
        return self.trainer != "megatron"

    @property
    def local_impl(self) -> bool:
        """Megatron's local (non Transformer-Engine) layers: torch LayerNorm refuses sequence parallel."""
        return self.transformer_impl == "local"

    @property
    def pipeline_extra_layers(self) -> int:
        """Layers the account-for-* flags add to the pipeline split (Megatron counts the embedding and
        the loss as one layer each)."""
        return int(self.account_for_embedding) + int(self.account_for_loss)


# The command's own layout sizes (`CommandFacts.sizes`), by the preset's parameter names.
SIZE_OPTIONS = {"tp": "tensor-model-parallel-size", "pp": "pipeline-model-parallel-size",
                "cp": "context-parallel-size", "ep": "expert-model-parallel-size",
                "etp": "expert-tensor-parallel-size", "mbs": "micro-batch-size"}


def _ints(opts: dict[str, str | None], name: str) -> tuple[int, ...] | None:
    """An ``nargs='+'`` integer option (``--hierarchical-context-parallel-sizes 2 2``); None when absent
    or not all integers (argparse would refuse it: not ours to judge)."""
    value = opts.get(name)
    try:
        return tuple(int(v) for v in value.split()) if value else None
    except ValueError:
        return None


def facts(argv: list[str]) -> CommandFacts:
    """Read `CommandFacts` from the wrapped command (both spellings, bare or ``true/false`` flags)."""
    opts = options(argv)
    kind = trainer(argv)
    sp: bool | None = None
    if "sequence-parallel" in opts:
        sp = _flag(opts, "sequence-parallel")
    impl = opts.get("transformer-impl")
    dist_opt = _flag(opts, "use-distributed-optimizer")
    grouped_gemm = _flag(opts, "moe-grouped-gemm")
    if kind != "megatron":
        # ms-swift's MegatronArguments defaults: use_distributed_optimizer=True, moe_grouped_gemm=True
        dist_opt = dist_opt if "use-distributed-optimizer" in opts else True
        grouped_gemm = grouped_gemm if "moe-grouped-gemm" in opts else True
    modules = opts.get("recompute-modules")
    layout = opts.get("pipeline-model-parallel-layout")
    dispatcher = (opts.get("moe-token-dispatcher-type") or "").split()
    sizes = tuple((name, value) for name, option in SIZE_OPTIONS.items()
                  if (value := _int(opts, option)) is not None)
    return CommandFacts(
        trainer=kind, transformer_impl=impl.split()[0] if impl else None, sequence_parallel=sp,
        layers_per_virtual_stage=_int(opts, "num-layers-per-virtual-pipeline-stage"),
        virtual_stages=_int(opts, "num-virtual-stages-per-pipeline-rank") or _int(opts, "virtual-pipeline-model-parallel-size"),
        overlap_p2p="no-overlap-p2p-communication" not in opts,
        recompute_activations=_flag(opts, "recompute-activations"),
        tp_comm_overlap=_flag(opts, "tp-comm-overlap"),
        distribute_saved_activations=_flag(opts, "distribute-saved-activations"),
        account_for_embedding=_flag(opts, "account-for-embedding-in-pipeline-split"),
        account_for_loss=_flag(opts, "account-for-loss-in-pipeline-split"),
        distributed_optimizer=dist_opt,
        overlap_param_gather=_flag(opts, "overlap-param-gather"),
        overlap_grad_reduce=_flag(opts, "overlap-grad-reduce"),
        cp_comm_types=tuple((opts.get("cp-comm-type") or "p2p").split()) or ("p2p",),
        hierarchical_cp=_ints(opts, "hierarchical-context-parallel-sizes"),
        hybrid_cp=_flag(opts, "hybrid-context-parallel"),
        per_token_loss=_flag(opts, "calculate-per-token-loss"),
        dataloader_type=(opts.get("dataloader-type") or "").split()[0] if opts.get("dataloader-type") else None,
        recompute_modules=tuple(modules.split()) if modules is not None else None,
        moe_grouped_gemm=grouped_gemm,
        pipeline_layout=layout or None,
        first_stage_layers=_int(opts, "decoder-first-pipeline-num-layers"),
        last_stage_layers=_int(opts, "decoder-last-pipeline-num-layers"),
        moe_a2a_overlap=_flag(opts, "overlap-moe-expert-parallel-comm"),
        moe_dispatcher=dispatcher[0] if dispatcher else "allgather",
        moe_shared_expert_overlap=_flag(opts, "moe-shared-expert-overlap"),
        sizes=sizes,
    )


def trainer_problem(argv: list[str]) -> str | None:
    """Why the Megatron preset cannot drive this command, or None: ms-swift's own trainer (`swift sft`)
    accepts none of the Megatron options the preset injects."""
    if trainer(argv) != "swift_native":
        return None
    start = options_start(argv)
    shown = " ".join(argv[max(0, start - 2):start]) or argv[0]
    return (f"`{shown}` is ms-swift's own (non-Megatron) trainer, which rejects the Megatron options the "
            f"megatron preset injects (--tensor_model_parallel_size, ...); run ms-swift's Megatron mode "
            f"instead: `megatron sft|pt|rlhf` with the same arguments")
