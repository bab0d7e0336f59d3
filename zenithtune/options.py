"""The options one candidate puts into the user's command, and what it does to the user's own flags.

`options_for` turns a candidate (or a tuned config) into the option dict `inject` writes; `adjust`
decides, in one place, how a candidate runs the flags the user already wrote (``--recompute-activations``,
virtual pipeline options, ``--tp-comm-overlap``, ``--distribute-saved-activations``, sequence
parallelism, ms-swift's differing defaults). `Space.layout` reads the same decision, so the rules
check what will really run. See docs/fidelity.md.
"""
from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from zenithtune.command import CommandFacts, facts
from zenithtune.validate import module_set

__all__ = ["SequenceParallelMode", "SWIFT_DEFAULTS", "Adjusted", "adjust", "options_for",
           "sequence_parallel_for", "sequence_parallel_note", "layout_fields", "layout_notes", "command_sizes",
           "states_virtual", "states_modules", "states_switch", "dp_overlap_options", "dp_overlap_note", "dp_overlap_mode",
           "DP_OVERLAP_MODES", "SWITCH_OPTIONS", "VPP_OPTIONS", "SWIFT_VPP_OPTION"]

SequenceParallelMode = Literal["auto", "command"]
DP_OVERLAP_MODES = ("auto", "command")


def dp_overlap_mode(preset: Mapping[str, Any]) -> str:
    """The preset's `dp_overlap` (default command: a trainer not knowing the flags would refuse every trial)."""
    return str(preset.get("dp_overlap", "command"))

# Options whose ms-swift default differs from Megatron's, for the options zenithtune injects (ms-swift
# MegatronArguments, swift/megatron/arguments/megatron_args.py; the table is in docs/fidelity.md).
# Leaving such an option out would run ms-swift's default, not the candidate's, so it is written out.
SWIFT_DEFAULTS = {"--recompute-granularity": "selective", "--expert-tensor-parallel-size": "1"}
VPP_OPTIONS = ("--num-layers-per-virtual-pipeline-stage", "--num-virtual-stages-per-pipeline-rank",
               "--virtual-pipeline-model-parallel-size")
# ms-swift's name for Megatron's --num-virtual-stages-per-pipeline-rank (MegatronArguments knows only this one
# and --num_layers_per_virtual_pipeline_stage); inject writes it with underscores in an ms-swift command.
SWIFT_VPP_OPTION = "--virtual-pipeline-model-parallel-size"
# Megatron switches (store_true flags) a preset may search: option -> the CommandFacts / Layout field. A
# searched True writes the bare flag (ms-swift: `--k true`), False leaves it out; a command stating the
# switch itself keeps it, and the preset does not search it (`states_switch`).
SWITCH_OPTIONS = {"--tp-comm-overlap": "tp_comm_overlap", "--overlap-moe-expert-parallel-comm": "moe_a2a_overlap"}
# Options taking several values (argparse nargs): a searched value joins them with "+" (module_set).
LIST_OPTIONS = ("--recompute-modules",)
# The pipeline's own split: meaningless without a pipeline, and refused or mis-built by Megatron at pp=1
# (first only: "Mismatch"; first and last: only the first stage's layers are built), refused by ms-swift
# ("pipeline_model_parallel_size must be greater than 1 if you want to set decoder_first_..."), and a
# layout listing several stages interleaves them on the one rank, which Megatron refuses.
SPLIT_OPTIONS = ("--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers",
                 "--pipeline-model-parallel-layout")


def states_virtual(flags: CommandFacts) -> bool:
    """Does the command fix its own virtual pipeline size (either spelling, or a pipeline layout, which
    implies one)? Then the preset's virtual pipeline parameter is not searched and never injected."""
    return bool(flags.layers_per_virtual_stage or flags.virtual_stages or flags.pipeline_layout)


def states_modules(flags: CommandFacts) -> bool:
    """Does the command name its own --recompute-modules? Then selective recompute runs that set: the
    preset's module sets are not searched and never injected."""
    return flags.recompute_modules is not None


def states_switch(flags: CommandFacts, option: str) -> bool:
    """Does the command already turn on this searched switch (`SWITCH_OPTIONS`)? Then it runs in every
    trial (adjusted like any flag of the user's) and is not searched."""
    field = SWITCH_OPTIONS.get(option)
    return bool(field and getattr(flags, field))


def command_sizes(flags: CommandFacts, searched: Collection[str]) -> dict[str, int]:
    """The command's own layout sizes for the parameters a preset does not search: those are what
    runs (`options_for` leaves an option the preset does not name untouched), so the layout the rules
    and the memory estimate judge must hold them (ms-swift `--expert_model_parallel_size 2` in a
    command whose preset searches no expert size runs EP=2)."""
    return {name: value for name, value in flags.sizes if name not in searched}


def layout_fields(flags: CommandFacts, pp: int | None = None) -> dict[str, Any]:
    """The `Layout` fields the user's layout flags set. With `pp` (a candidate's pipeline size), as
    `adjust` runs them: the split options are dropped at pp=1 (`SPLIT_OPTIONS`); without it (the
    simulator, which plays Megatron on the command as written) as written."""
    piped = pp is None or pp > 1
    return {"hierarchical_cp": flags.hierarchical_cp, "hybrid_cp": flags.hybrid_cp,
            "recompute_modules": flags.recompute_modules, "moe_grouped_gemm": flags.moe_grouped_gemm,
            "pipeline_layout": flags.pipeline_layout if piped else None,
            "first_stage_layers": flags.first_stage_layers if piped else None,
            "last_stage_layers": flags.last_stage_layers if piped else None,
            "moe_a2a_overlap": flags.moe_a2a_overlap, "moe_dispatcher": flags.moe_dispatcher,
            "moe_shared_expert_overlap": flags.moe_shared_expert_overlap}


def layout_notes(flags: CommandFacts, searched: Collection[str]) -> list[str]:
    """One line per layout flag of the command in effect, for the space report (what each does to the
    candidates: constrained by a Megatron rule, or dropped where it cannot run)."""
    out: list[str] = []
    split = [o for o, on in zip(SPLIT_OPTIONS, (flags.first_stage_layers is not None,
                                                flags.last_stage_layers is not None, bool(flags.pipeline_layout)))
             if on]
    if split:
        out.append(f"{' and '.join(split)} dropped at pp=1 (no pipeline to split; Megatron and ms-swift refuse "
                   f"or mis-build them there); kept at pp > 1, where candidates Megatron refuses are pruned "
                   f"(rules uneven_pipeline, pipeline_layout, virtual_pipeline)")
    if flags.hierarchical_cp:
        out.append("--hierarchical-context-parallel-sizes " + " ".join(map(str, flags.hierarchical_cp))
                   + f": only cp={math.prod(flags.hierarchical_cp)} is searched (rule hierarchical_cp)")
    if flags.hybrid_cp:
        out.append("--hybrid-context-parallel: only pp=1 is searched (rule hybrid_cp)")
    if flags.recompute_modules and "moe_act" in flags.recompute_modules and not flags.moe_grouped_gemm:
        out.append("--recompute-modules moe_act without --moe-grouped-gemm: selective recompute candidates are "
                   "pruned (rule recompute_modules); add --moe-grouped-gemm to search them")
    searched_set = set(searched)
    kept = [f"{name}={value}" for name, value in flags.sizes if name not in searched_set]
    if kept:
        out.append(f"the command's own {', '.join(kept)} run in every trial (the preset does not search them)")
    return out


def sequence_parallel_for(tp: int, moe: bool, flags: CommandFacts,
                          mode: SequenceParallelMode = "auto") -> bool:
    """Whether a candidate runs with sequence parallelism (the reason is `sequence_parallel_note`).

    Never at tp == 1 (Megatron turns it off) nor with ``--transformer-impl local`` (torch LayerNorm
    asserts); always for MoE with tp > 1 (MoELayer raises without it). Otherwise ``command`` keeps the
    user's own choice (``--sequence-parallel`` present or not) and ``auto`` adds it at tp > 1 unless the
    user said no (ms-swift ``--sequence_parallel false``) or chose ``--distribute-saved-activations``,
    which Megatron refuses together with it."""
    if tp <= 1 or flags.local_impl:
        return False
    if moe:
        return True
    if mode == "command":
        return bool(flags.sequence_parallel)
    if flags.sequence_parallel is False:
        return False
    return not (flags.distribute_saved_activations and flags.sequence_parallel is None)


def sequence_parallel_note(flags: CommandFacts, mode: SequenceParallelMode, moe: bool) -> str:
    """One line for the space report: where sequence parallelism is on and why."""
    if flags.local_impl:
        tail = ("; MoE with tp > 1 needs it, so those layouts are pruned" if moe else "")
        return ("sequence parallel: never added: the command selects --transformer-impl local, whose torch "
                "LayerNorm refuses it" + tail)
    moe_part = "on with MoE at tp > 1 (Megatron requires it); " if moe else ""
    if mode == "command":
        return (f"sequence parallel: {moe_part}otherwise as the command says "
                f"({'on at tp > 1' if flags.sequence_parallel else 'off'}; preset sequence_parallel=command)")
    if flags.sequence_parallel is False:
        return f"sequence parallel: {moe_part}otherwise off, as the command says (--sequence_parallel false)"
    if flags.distribute_saved_activations and flags.sequence_parallel is None:
        return (f"sequence parallel: {moe_part}otherwise off: the command's --distribute-saved-activations "
                f"cannot run with it")
    return ("sequence parallel: added at tp > 1 (preset sequence_parallel=auto; it saves activation memory at "
            "no cost; sequence_parallel=command keeps the command's own choice)")


@dataclass(frozen=True)
class Adjusted:
    """How one candidate runs the user's own flags: what is kept, what is dropped (and why not)."""

    sequence_parallel: bool
    recompute_granularity: str | None  # what really runs ("none" -> None; --recompute-activations -> selective)
    drop: tuple[str, ...]  # the user's options removed for this candidate
    explicit: tuple[tuple[str, str], ...]  # options written out because ms-swift's default differs
    add: tuple[str, ...] = ()  # switches turned on for every candidate (preset dp_overlap=auto)

    def options(self) -> dict[str, Any]:
        return {**{o: None for o in self.drop}, **dict(self.explicit), **{o: True for o in self.add}}


def adjust(preset: Mapping[str, Any], params: Mapping[str, Any], flags: CommandFacts,
           moe: bool | None = None) -> Adjusted:
    """The user's flags that a candidate changes the meaning of, decided in one place for both the
    injected options (`options_for`) and the layout the rules check (`Space.layout`).

    * ``--recompute-activations`` is Megatron's shorthand for selective recompute: dropped whenever the
      preset tunes the granularity (with it a "none" candidate would run selective and a "full" one
      would be refused);
    * the virtual-pipeline options are dropped at pp == 1 (Megatron refuses interleaving there);
    * ``--tp-comm-overlap`` is dropped where sequence parallelism is off (tp == 1, local impl);
    * ``--distribute-saved-activations`` is dropped where Megatron refuses it (tp == 1, not full
      recompute, sequence parallelism on);
    * the pipeline split options (`SPLIT_OPTIONS`: ``--decoder-first/last-pipeline-num-layers``,
      ``--pipeline-model-parallel-layout``) are dropped at pp == 1, where there is no pipeline to split;
    * ms-swift: an option left out runs ms-swift's default, so where that differs from Megatron's
      (`SWIFT_DEFAULTS`) the Megatron value is written out (``--recompute_granularity none``; the expert
      TP unless the candidate or the command gives it).

    `moe` None: inferred from the candidate (``ep``/``etp`` apply only to MoE models); for ms-swift's
    expert TP, a command stating an expert size (``--expert_model_parallel_size 2``) is a MoE run too
    (a trial knows no model; on a dense model the option is harmless)."""
    stated = dict(flags.sizes)  # the command's own sizes: what runs where the preset does not search them
    moe = ("ep" in params or "etp" in params) if moe is None else moe
    spec = preset.get("params") or {}
    mode = str(preset.get("sequence_parallel", "auto"))
    tp = int(params.get("tp", stated.get("tp", 1)) or 1)
    pp = int(params.get("pp", stated.get("pp", 1)) or 1)
    granularity = params.get("recompute_granularity")
    if granularity == "none":
        granularity = None
    if "recompute_granularity" not in spec and flags.recompute_activations:
        granularity = "selective"
    sp = sequence_parallel_for(tp, moe, flags, mode)  # type: ignore[arg-type]
    drop: list[str] = []
    if flags.recompute_activations and "recompute_granularity" in spec:
        drop.append("--recompute-activations")
    if pp <= 1 and (flags.layers_per_virtual_stage or flags.virtual_stages):
        drop += VPP_OPTIONS
    if pp <= 1 and (flags.first_stage_layers is not None or flags.last_stage_layers is not None
                    or flags.pipeline_layout):
        drop += SPLIT_OPTIONS
    if flags.tp_comm_overlap and not sp:
        drop.append("--tp-comm-overlap")
    if flags.distribute_saved_activations and not (tp > 1 and granularity == "full" and not sp):
        drop.append("--distribute-saved-activations")
    explicit: list[tuple[str, str]] = []
    add = dp_overlap_options(flags, dp_overlap_mode(preset))
    if flags.trainer == "swift":
        if "recompute_granularity" in spec and granularity is None:
            explicit.append(("--recompute-granularity", "none"))
        if (moe or "ep" in stated) and params.get("etp") is None and "etp" not in stated:
            explicit.append(("--expert-tensor-parallel-size", str(tp)))  # Megatron's default: etp = tp
    return Adjusted(sp, granularity, tuple(drop), tuple(explicit), add)


def dp_overlap_options(flags: CommandFacts, mode: str) -> tuple[str, ...]:
    """The data-parallel overlap switches preset ``dp_overlap: auto`` adds to every trial: --overlap-grad-reduce,
    and --overlap-param-gather where the command uses the distributed optimizer (Megatron refuses it without:
    `validate.command_errors`). Harmless without data parallelism (a group of one reduces nothing); the
    command's own flags are left as they are. ``command`` adds nothing."""
    if mode != "auto":
        return ()
    out = [] if flags.overlap_grad_reduce else ["--overlap-grad-reduce"]
    if flags.distributed_optimizer and not flags.overlap_param_gather:
        out.append("--overlap-param-gather")
    return tuple(out)


def dp_overlap_note(flags: CommandFacts, mode: str) -> str | None:
    """One line for the space report: which DP overlap switches every trial gets, or that the command lacks
    them (preset dp_overlap=command, the default)."""
    added = dp_overlap_options(flags, "auto")
    if not added:
        return None
    if mode != "auto":
        return (f"data-parallel overlap: the command lacks {' and '.join(added)}; preset.dp_overlap=auto adds "
                f"them to every trial (they hide the gradient and parameter syncs at no memory cost)")
    return (f"data-parallel overlap: {' and '.join(added)} added to every trial (preset dp_overlap=auto: it hides "
            f"the gradient and parameter syncs at no memory cost; dp_overlap=command keeps the command's choice)")


def options_for(preset: Mapping[str, Any], params: Mapping[str, Any], gbs: int,
                argv: list[str] | None = None, *, moe: bool | None = None,
                flags: CommandFacts | None = None) -> dict[str, Any]:
    """Option name -> value for `inject`: a value sets the option; None removes it.

    `params` must hold exactly the parameters that apply (a normalized candidate or a tuned config):
    every preset option it does not name is removed from the command, so a stale
    `--recompute-method` never reaches a selective-recompute run. With the wrapped command (`argv`)
    the user's own flags are adjusted for this candidate (`adjust`); `flags` gives them already read.
    Needs no model info, so the entry function can call it cheaply in every trial. The virtual pipeline
    size has one spelling per trainer (`SWIFT_VPP_OPTION` for ms-swift) and is left alone when the
    command states its own (`states_virtual`)."""
    out: dict[str, Any] = {}
    if flags is None:
        flags = facts(argv) if argv is not None else CommandFacts()
    for name, spec in (preset.get("params") or {}).items():
        v = params.get(name)
        option = str(spec["option"])
        if option in VPP_OPTIONS:
            if states_virtual(flags):
                continue  # the command's own virtual size runs (adjust drops it at pp=1); not searched
            if flags.trainer == "swift":
                option = SWIFT_VPP_OPTION
        if spec.get("when") == "selective_recompute" and states_modules(flags):
            continue  # the command's own --recompute-modules runs; the module sets are not searched
        if option in SWITCH_OPTIONS:
            if not states_switch(flags, option):  # the command's own switch runs (adjust may drop it)
                out[option] = True if v is True else None
            continue
        if v is not None and "absent" in spec and v == spec["absent"]:
            v = None
        if isinstance(v, bool):
            v = "true" if v else "false"
        if v is not None and option in LIST_OPTIONS:
            out[option] = module_set(v)
            continue
        out[option] = None if v is None else str(v)
    fixed = preset.get("fixed") or {}
    if fixed.get("global_batch_size"):
        out[str(fixed["global_batch_size"])] = str(gbs)
    adjusted = adjust(preset, params, flags, moe)
    if fixed.get("sequence_parallel"):
        out[str(fixed["sequence_parallel"])] = adjusted.sequence_parallel
    out.update(adjusted.options())
    return out
