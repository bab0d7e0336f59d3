"""The search space: which parameters a preset tunes, their values for this job, and the pruner.

A *candidate* is a plain dict `{param name: value}` holding only the parameters that apply to it
(`recompute_method` only under full recompute, `ep`/`etp` only for MoE models, ViT checkpointing only
for VLMs, the virtual pipeline size `vp` only at pp > 1). `Space` turns a candidate into a `Layout` (for the
rules and the memory estimate) and into the option dict that `inject` writes into the user's command.
"""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from zenithtune.command import CommandFacts
from zenithtune.errors import UserError
from zenithtune.modelinfo import ModelInfo
from zenithtune.options import (
    DP_OVERLAP_MODES,
    SWITCH_OPTIONS,
    Adjusted,
    adjust,
    command_sizes,
    dp_overlap_mode,
    dp_overlap_note,
    layout_fields,
    layout_notes,
    options_for,
    sequence_parallel_note,
    states_modules,
    states_switch,
    states_virtual,
)
from zenithtune.validate import (
    MODULE_SEPARATOR,
    POLICIES,
    RULE_KINDS,
    RULES,
    Layout,
    Rule,
    check,
    divisors,
    module_idle,
    module_set,
    module_set_problem,
)

Candidate = dict[str, Any]
When = Literal["always", "moe", "vlm", "full_recompute", "selective_recompute", "pipeline"]
WHENS = ("always", "moe", "vlm", "full_recompute", "selective_recompute", "pipeline")
# Applicability that depends on the candidate (the rest is known from the model alone).
_DEPENDENT: tuple[When, ...] = ("full_recompute", "selective_recompute", "pipeline")

LAYOUT_PARAMS = ("tp", "pp", "cp", "ep", "etp")
# The layout as the heuristic groups candidates (a crash, an MBS ladder, the granularity check): the
# parallel sizes and the virtual pipeline size, which changes the schedule (bubble, p2p sends, activation
# memory). The enumeration fixes `vp` with mbs, since its rule reads the micro-batch count, and
# staged_blackbox and the calibration's per-layout term treat it as a setting: LAYOUT_PARAMS stays the sizes.
LAYOUT_KEYS = ("tp", "pp", "vp", "cp", "ep", "etp")
RECOMPUTE_PARAMS = ("recompute_granularity", "recompute_method", "recompute_num_layers", "recompute_modules")
# Searched communication-overlap switches (conf/preset/megatron.yaml): on, they trade memory for hidden
# communication; the strategies keep them fixed along a ladder like ViT checkpointing (`settings`).
SWITCH_PARAMS = tuple(SWITCH_OPTIONS.values())  # the preset's names are the Layout fields they set


def settings(c: Mapping[str, Any]) -> tuple:
    """What a candidate sets besides its layout, MBS and recompute: ViT checkpointing and the switches."""
    return (c.get("vit_gradient_checkpointing"), *(bool(c.get(n)) for n in SWITCH_PARAMS))


def switches_at_least(c: Mapping[str, Any], ref: Mapping[str, Any]) -> bool:
    """Does `c` turn on every switch `ref` does (so it needs at least `ref`'s memory, all else equal)?"""
    return all(bool(c.get(n)) or not ref.get(n) for n in SWITCH_PARAMS)
# What each rule reads of a candidate, so the enumeration runs it as soon as that much is fixed:
# layout dimensions by name, "mbs" (the micro-batch size and the virtual pipeline size, which are
# enumerated together), and "rest" (the recompute/ViT parameters); expert_grid waits for cp
# so that a dense model's report names world_divisible, the rule a user expects. A rule missing here is
# run on every whole candidate (correct, only slower).
_LAYOUT = frozenset(("tp", "pp", "cp"))
RULE_NEEDS: dict[str, frozenset[str]] = {
    "world_divisible": _LAYOUT, "expert_grid": _LAYOUT | {"ep", "etp"}, "experts": frozenset(("ep",)),
    "tp_heads": frozenset(("tp",)), "tp_query_groups": frozenset(("tp",)), "hidden_heads": frozenset(),
    "tp_ffn": frozenset(("tp", "etp")),
    "cp_seq": frozenset(("cp",)), "gbs": _LAYOUT | {"mbs"}, "pp_layers": frozenset(("pp",)),
    "virtual_pipeline": _LAYOUT | {"mbs"}, "recompute": frozenset(("pp", "rest")),
    "moe_sequence_parallel": frozenset(("tp",)), "local_impl_sequence_parallel": frozenset(("tp",)),
    "tp_comm_overlap": frozenset(("tp", "rest")), "moe_a2a_overlap": _LAYOUT | {"ep", "mbs", "rest"},
    "distribute_saved_activations": frozenset(("tp", "rest")),
    "moe_etp_bias": frozenset(("tp", "etp")), "etp_le_tp": frozenset(("tp", "etp")),
    "etp_dense": frozenset(("tp", "etp")), "cp_short_seq": frozenset(("cp",)),
    "recompute_chunk": frozenset(("pp", "rest")), "vlm_full_uniform_only": frozenset(("rest",)),
    "pipeline_layout": frozenset(("pp",)), "uneven_pipeline": frozenset(("pp", "mbs")),
    "hierarchical_cp": frozenset(("cp",)), "hybrid_cp": frozenset(("pp",)), "recompute_modules": frozenset(("rest",)),
    "local_impl_context_parallel": frozenset(("cp",)),
}
MAX_GPUS = 1 << 20  # the largest world size a study plans for (today's largest runs use ~100k GPUs)
# Defaults for parameters a preset does not search (Megatron's own defaults).
DEFAULTS: Candidate = {"tp": 1, "pp": 1, "cp": 1, "ep": 1, "mbs": 1}


@dataclass(frozen=True)
class Context:
    """What the tuner knows about the job, fixed for a whole study."""

    n_gpus: int
    gbs: int
    model: ModelInfo = field(default_factory=ModelInfo)
    mbs_max: int = 8
    gpus_per_node: int = 8
    vlm_full_uniform_only: bool = True  # see conf/preset/megatron.yaml
    flags: CommandFacts = field(default_factory=CommandFacts)  # the user's own flags (command.facts)
    policy_off: frozenset[str] = frozenset()  # policy rules switched off (prune.policy.<name>=false)

    def __post_init__(self) -> None:
        if self.n_gpus > MAX_GPUS:
            raise UserError(f"n_gpus={self.n_gpus} is above the largest world size zenithtune plans for "
                             f"({MAX_GPUS} GPUs); give the GPUs of one training run")
        unknown = sorted(set(self.policy_off) - set(POLICIES))
        if unknown:
            raise UserError(f"prune.policy.{unknown[0]}: no such policy; the policies are {list(POLICIES)}")

    @property
    def nodes(self) -> int:
        return max(1, -(-self.n_gpus // self.gpus_per_node))


@dataclass(frozen=True)
class Param:
    name: str
    option: str  # Megatron option, dashed form
    choices: tuple[Any, ...]
    when: When = "always"


def parallel_values(n: int) -> tuple[int, ...]:
    """Sizes a parallel dimension can take on n GPUs: powers of two up to n when n is one, otherwise
    every divisor of n (12 GPUs allow TP 3 and 6; 24 allow PP 3)."""
    if n & (n - 1) == 0:
        return tuple(1 << k for k in range(n.bit_length()))
    return tuple(divisors(n))


def mbs_values(mbs_max: int, gbs: int) -> tuple[int, ...]:
    """Micro-batch sizes: powers of two up to mbs_max that divide gbs."""
    out = []
    b = 1
    while b <= mbs_max:
        if gbs % b == 0:
            out.append(b)
        b *= 2
    return tuple(out)


def policy_off(node: Mapping[str, Any] | None) -> frozenset[str]:
    """The policy rules a config's ``prune:`` node switches off (``prune.policy.<name>: false``).
    An unknown name is one clear error listing the policies."""
    policy = (node or {}).get("policy") or {}
    unknown = sorted(set(policy) - set(POLICIES))
    if unknown:
        raise UserError(f"prune.policy.{unknown[0]}: no such policy; the policies are {list(POLICIES)} "
                         f"(Megatron's own rules cannot be switched off)")
    for name, on in policy.items():
        if not isinstance(on, bool):
            raise UserError(f"prune.policy.{name}={on!r} must be true or false")
    return frozenset(name for name, on in policy.items() if not on)


def _choices(spec: Any, ctx: Context) -> tuple[Any, ...]:
    if spec == "parallel":
        return parallel_values(ctx.n_gpus)
    if spec == "mbs":
        return mbs_values(ctx.mbs_max, ctx.gbs)
    if isinstance(spec, str):
        raise UserError(f"preset values {spec!r} is not a list and not one of 'parallel', 'mbs'")
    return tuple(spec)


@dataclass
class Survey:
    """How the pruner shrinks the space (the report printed at study start)."""

    total: int = 0
    removed: Counter = field(default_factory=Counter)  # rule name -> candidates removed
    reasons: dict[str, str] = field(default_factory=dict)  # rule name -> one example reason
    valid: int = 0
    notes: list[str] = field(default_factory=list)  # how the user's own flags are run (Space.notes)

    def removed_by(self, kind: str) -> list[tuple[str, int]]:
        """(rule, count) removed by rules of one kind (`megatron` or `policy`), most first."""
        return [(rule, n) for rule, n in self.removed.most_common() if RULE_KINDS.get(rule, "megatron") == kind]


class Space:
    """The parameters of a preset, instantiated for one job (`Context`)."""

    def __init__(self, params: list[Param], preset: Mapping[str, Any], ctx: Context):
        if states_virtual(ctx.flags):
            # the command states its own virtual size: it runs (adjust keeps it at pp > 1), not searched
            params = [p for p in params if p.when != "pipeline"]
        # module sets the model cannot use: the preset's value -> what runs instead (None: not searched),
        # and why each idle module re-runs nothing
        self.idle_modules: dict[str, str | None] = {}
        self.idle_why: dict[str, str] = {}
        params = self._module_sets(params, ctx)
        # searched Megatron switches (tp_comm_overlap, moe_a2a_overlap): param name -> Layout field, and
        # why a preset's switch is not searched for this command (said in the report)
        self.switch_why: dict[str, str] = {}
        params = [p for p in params if p.option not in SWITCH_OPTIONS or self._switch_searched(p, ctx)]
        self.switches = {p.name: SWITCH_OPTIONS[p.option] for p in params if p.option in SWITCH_OPTIONS}
        self.params = {p.name: p for p in params}
        self.vp_name = next((p.name for p in params if p.when == "pipeline"), None)
        self.modules_name = next((p.name for p in params if p.when == "selective_recompute"), None)
        self.preset = preset
        self.ctx = ctx
        self._walked: tuple[list[Candidate], Survey] | None = None
        self._adjust_memo: dict[tuple, Adjusted] = {}
        self._layout_memo: dict[tuple, Layout] = {}  # the screen, the strategies and the report ask again and again
        # applicability known from the model alone (None: depends on the candidate: full recompute)
        self._applies_now: dict[str, bool] = {
            p.name: {"always": True, "moe": ctx.model.is_moe, "vlm": ctx.model.is_vlm}[p.when]
            for p in params if p.when not in _DEPENDENT}

    def _module_sets(self, params: list[Param], ctx: Context) -> list[Param]:
        """The selective-recompute module sets this model can use. A module the model lacks (mlp when every
        layer is MoE, moe_act on a dense model, layernorm fused into TE's linears) re-runs nothing: a set
        naming one runs as the set without it (`idle_modules`, said in the report), and a set left with
        nothing is not searched. A command stating its own --recompute-modules keeps it: not searched."""
        out = []
        for p in params:
            if p.when != "selective_recompute":
                out.append(p)
                continue
            if states_modules(ctx.flags):
                continue
            for v in p.choices:
                problem = module_set_problem(v)
                if problem:
                    raise UserError(f"preset parameter {p.name}: {problem}")
            kept: list[Any] = []
            for v in p.choices:
                mods = module_set(v)
                why = {m: module_idle(m, ctx.model, ctx.flags.local_impl) for m in mods}
                acting = [m for m in mods if why[m] is None]
                self.idle_why.update({m: w for m, w in why.items() if w is not None})
                value = MODULE_SEPARATOR.join(acting) if len(acting) < len(mods) else v
                if value != v:
                    self.idle_modules[str(v)] = value or None
                if value and value not in kept:
                    kept.append(value)
            if kept:
                out.append(replace(p, choices=tuple(kept)))
        return out

    def _switch_searched(self, p: Param, ctx: Context) -> bool:
        """Whether a switch of the preset is searched for this command; if not, `switch_why` says why."""
        flags, why = ctx.flags, None
        if states_switch(flags, p.option):
            why = f"{p.option} is the command's: it runs where Megatron allows it, not searched"
        elif p.option == "--tp-comm-overlap" and flags.local_impl:
            why = ("not searched: --transformer-impl local has no sequence parallelism, which TP "
                   "communication overlap needs (Transformer Engine's userbuffers)")
        elif p.option == "--overlap-moe-expert-parallel-comm":
            if not ctx.model.is_moe:
                return False  # `when: moe` would leave it out anyway; nothing to say
            if flags.trainer != "megatron":
                why = "not searched for ms-swift (its MegatronArguments do not list it)"
            elif flags.moe_dispatcher not in ("alltoall", "flex"):
                why = (f"not searched: Megatron overlaps only the alltoall/flex dispatchers' all-to-alls "
                       f"(the command's --moe-token-dispatcher-type is {flags.moe_dispatcher}; add "
                       f"--moe-token-dispatcher-type alltoall to search it)")
            elif flags.moe_shared_expert_overlap:
                why = "not searched: Megatron refuses it with the command's --moe-shared-expert-overlap"
        if why:
            self.switch_why[p.name] = why
        return why is None

    @classmethod
    def from_preset(cls, preset: Mapping[str, Any], ctx: Context) -> Space:
        params = []
        for name, spec in (preset.get("params") or {}).items():
            when = spec.get("when", "always")
            if when not in WHENS:
                raise UserError(f"preset parameter {name}: when={when!r} is not one of {'|'.join(WHENS)}")
            params.append(Param(name, str(spec["option"]), _choices(spec.get("values"), ctx), when))
        mode = preset.get("sequence_parallel", "auto")
        if mode not in ("auto", "command"):
            raise UserError(f"preset.sequence_parallel={mode!r} is not one of auto|command")
        overlap = dp_overlap_mode(preset)
        if overlap not in DP_OVERLAP_MODES:
            raise UserError(f"preset.dp_overlap={overlap!r} is not one of {'|'.join(DP_OVERLAP_MODES)}")
        return cls(params, preset, ctx)

    # --- applicability ---------------------------------------------------------------------------
    def applies(self, name: str, cand: Mapping[str, Any]) -> bool:
        when = self.params[name].when
        if when == "always":
            return True
        if when == "moe":
            return self.ctx.model.is_moe
        if when == "vlm":
            return self.ctx.model.is_vlm
        if when == "pipeline":
            return self._pp(cand) > 1
        if when == "selective_recompute":
            return cand.get("recompute_granularity") == "selective"
        return cand.get("recompute_granularity") == "full"

    def applies_vp(self, cand: Mapping[str, Any]) -> bool:
        """Does this space search a virtual pipeline size for this (partial) candidate?"""
        return self.vp_name is not None and self.applies(self.vp_name, cand)

    def _pp(self, cand: Mapping[str, Any]) -> int:
        """The pipeline size a candidate runs: its own, else the command's (a preset not searching pp)."""
        return int(cand.get("pp") or dict(self.ctx.flags.sizes).get("pp") or 1)

    def normalize(self, cand: Mapping[str, Any], fill: bool = True) -> Candidate:
        """Keep only the parameters that apply, in the preset's order. `fill`: a pipelined candidate
        without a virtual pipeline size runs vp=1 and says so (False for a partial candidate whose
        missing values are still to be chosen)."""
        ok = self._applies_now
        vp, mods = self.vp_name, self.modules_name
        piped = vp is not None and self._pp(cand) > 1
        gran = cand.get("recompute_granularity")
        if fill and vp is not None and piped and vp not in cand:
            # a hand-made candidate (a strategy's, a tuned file's from before vp existed) runs no interleaving
            cand = {**cand, vp: 1}
        if fill and mods is not None and gran == "selective" and mods not in cand:
            # ... and one from before module sets existed runs Megatron's default set
            cand = {**cand, mods: self._default_modules()}
        if fill:  # a candidate from before a switch was searched runs without it
            cand = {**{name: False for name in self.switches if name not in cand}, **cand}
        depends = {vp: piped, mods: gran == "selective"}
        return {k: cand[k] for k in self.params
                if k in cand and ok.get(k, depends.get(k, gran == "full"))}

    def _default_modules(self) -> Any:
        """The module set a selective candidate that names none runs: the preset's `absent` (Megatron's
        core_attn), else the first searched."""
        assert self.modules_name is not None
        spec = (self.preset.get("params") or {}).get(self.modules_name) or {}
        choices = self.params[self.modules_name].choices
        absent = spec.get("absent")
        return absent if absent in choices else choices[0]

    def key(self, cand: Mapping[str, Any]) -> tuple:
        """Identity of a candidate (two proposals with the same key are the same run)."""
        n = self.normalize(cand)
        return tuple((k, n.get(k)) for k in self.params)

    # --- translations ----------------------------------------------------------------------------
    def adjusted(self, cand: Mapping[str, Any]) -> Adjusted:
        """How this candidate runs the user's own flags (see `adjust`)."""
        return self._adjusted(self.normalize(cand))

    def _adjusted(self, norm: Mapping[str, Any]) -> Adjusted:
        # adjust() reads only these of a normalized candidate; memoized because the enumeration and the
        # memory screen build a layout for every candidate of a large space
        memo_key = (norm.get("tp", 1), norm.get("pp", 1), norm.get("recompute_granularity"), norm.get("etp") is None)
        found = self._adjust_memo.get(memo_key)
        if found is None:
            found = self._adjust_memo[memo_key] = adjust(self.preset, norm, self.ctx.flags, self.ctx.model.is_moe)
        return found

    def layout(self, cand: Mapping[str, Any]) -> Layout:
        norm = self.normalize(cand)
        memo_key = tuple(norm.items())
        found = self._layout_memo.get(memo_key)
        if found is None:
            found = self._layout_memo[memo_key] = self._layout(norm)
        return found

    def _layout(self, norm: Candidate) -> Layout:
        c = {**DEFAULTS, **command_sizes(self.ctx.flags, self.params), **norm}
        moe = self.ctx.model.is_moe
        flags = self.ctx.flags
        adj = self._adjusted(norm)
        pp = int(c["pp"])
        vp = int(norm.get(self.vp_name) or 1) if self.vp_name else 1
        fields = layout_fields(flags, pp)
        if self.modules_name and self.modules_name in norm:
            fields["recompute_modules"] = module_set(norm[self.modules_name])
        # the command's --tp-comm-overlap runs where sequence parallelism does (adjust drops it elsewhere)
        fields["tp_comm_overlap"] = flags.tp_comm_overlap and "--tp-comm-overlap" not in adj.drop
        for name, field_name in self.switches.items():
            if norm.get(name) is True:
                fields[field_name] = True
        return Layout(
            n_gpus=self.ctx.n_gpus, gbs=self.ctx.gbs,
            tp=int(c["tp"]), pp=pp, cp=int(c["cp"]),
            ep=int(c["ep"]) if moe else 1,
            etp=int(c["etp"]) if moe and c.get("etp") is not None else None,
            mbs=int(c["mbs"]),
            layers_per_virtual_stage=flags.layers_per_virtual_stage if pp > 1 else None,
            vpp_size=(vp if vp > 1 else None) if self.vp_name else (flags.virtual_stages if pp > 1 else None),
            recompute_granularity=adj.recompute_granularity,  # type: ignore[arg-type]
            recompute_method=c.get("recompute_method"),
            recompute_num_layers=c.get("recompute_num_layers"),
            sequence_parallel=adj.sequence_parallel,
            overlap_p2p=flags.overlap_p2p,
            pipeline_extra_layers=flags.pipeline_extra_layers,
            local_impl=flags.local_impl,
            distribute_saved_activations=(flags.distribute_saved_activations
                                          and "--distribute-saved-activations" not in adj.drop),
            **fields,
        )

    def options(self, cand: Mapping[str, Any]) -> dict[str, Any]:
        """Option name -> value for `inject` into the study's command (see `options_for`)."""
        out = options_for(self.preset, self.normalize(cand), self.ctx.gbs, moe=self.ctx.model.is_moe, flags=self.ctx.flags)
        adj = self.adjusted(cand)
        fixed = self.preset.get("fixed") or {}
        if fixed.get("sequence_parallel"):
            out[str(fixed["sequence_parallel"])] = adj.sequence_parallel
        out.update(adj.options())
        return out

    def notes(self) -> list[str]:
        """What the study does with the user's own flags, one line each, for the space report."""
        flags, moe = self.ctx.flags, self.ctx.model.is_moe
        mode = str(self.preset.get("sequence_parallel", "auto"))
        out = [sequence_parallel_note(flags, mode, moe)]  # type: ignore[arg-type]
        dp_note = dp_overlap_note(flags, dp_overlap_mode(self.preset))
        if dp_note:
            out.append(dp_note)
        if flags.recompute_activations and "recompute_granularity" in self.params:
            out.append("--recompute-activations (Megatron's selective shorthand) is dropped: the "
                       "recompute_granularity parameter decides recompute, so 'none' really runs none")
        if flags.layers_per_virtual_stage or flags.virtual_stages:
            out.append("virtual pipeline options are dropped at pp=1 and kept (and checked) at pp > 1"
                       + ("; the virtual pipeline size is the command's, not searched"
                          if any(p.get("when") == "pipeline" for p in (self.preset.get("params") or {}).values())
                          else ""))
        if self.modules_name:
            sets = list(self.params[self.modules_name].choices)
            out.append(f"selective recompute searched with the module sets {sets} (--recompute-modules; "
                       f"{self._default_modules()} is Megatron's default); switch it off with "
                       f"~preset.params.{self.modules_name}")
        if self.idle_modules:
            gone = [v for v, runs in self.idle_modules.items() if runs is None]
            runs_as = [f"{v} runs as {runs}" for v, runs in self.idle_modules.items() if runs is not None]
            whys: dict[str, list[str]] = {}
            for m, w in self.idle_why.items():
                whys.setdefault(w, []).append(m)
            out.append("recompute module sets " + "; ".join(
                ([f"not searched: {', '.join(gone)}"] if gone else []) + runs_as) + " ("
                + "; ".join(f"{', '.join(ms)}: {w}" for w, ms in whys.items()) + ")")
        if states_modules(flags) and any(
                (spec or {}).get("when") == "selective_recompute" for spec in (self.preset.get("params") or {}).values()):
            out.append("--recompute-modules " + " ".join(flags.recompute_modules or ())
                       + " is the command's: selective recompute runs it, the module sets are not searched")
        if self.vp_name:
            out.append(f"virtual pipeline size {self.vp_name} searched at pp > 1 among "
                       f"{list(self.params[self.vp_name].choices)} where Megatron accepts it (rule virtual_pipeline; "
                       f"{self.vp_name}=1: not interleaved); switch it off with ~preset.params.{self.vp_name}")
        if flags.tp_comm_overlap:
            out.append("--tp-comm-overlap is dropped where sequence parallelism is off (tp=1)")
        for name in self.switches:
            option = self.params[name].option
            where = ("where sequence parallelism runs (tp > 1); it costs Transformer Engine's userbuffers"
                     if option == "--tp-comm-overlap" else
                     "at ep > 1 without full recompute, with a virtual pipeline at pp > 1; it holds one more "
                     "micro-batch's activations")
            out.append(f"{name} searched on/off ({option}) {where}; switch it off with ~preset.params.{name}")
        for name, why in self.switch_why.items():
            out.append(f"{name}: {why}")
        if flags.distribute_saved_activations:
            out.append("--distribute-saved-activations is kept only with tp > 1, full recompute and no "
                       "sequence parallelism (Megatron refuses it otherwise)")
        if flags.pipeline_extra_layers:
            out.append(f"the pipeline split counts {flags.pipeline_extra_layers} extra layer(s) "
                       f"(--account-for-*-in-pipeline-split)")
        out += layout_notes(flags, self.params)
        if flags.trainer == "swift" and "recompute_granularity" in self.params:
            out.append("ms-swift: 'none' is injected as --recompute_granularity none (ms-swift's default is selective)")
        return out

    def vit_checkpointing(self, cand: Mapping[str, Any]) -> bool | None:
        v = self.normalize(cand).get("vit_gradient_checkpointing")
        return None if v is None else bool(v)

    # --- validation ------------------------------------------------------------------------------
    def reasons(self, cand: Mapping[str, Any]) -> list[tuple[str, str]]:
        """Broken rules (name, reason) for a candidate; empty = Megatron would accept it."""
        out = []
        for name in self.params:
            if name in cand and self.applies(name, cand) and cand[name] not in self.params[name].choices:
                out.append(("choices", f"{name}={cand[name]!r} is not in this job's choices "
                                       f"{list(self.params[name].choices)}"))
        return out + self._check(self.layout(cand))

    def _check(self, lay: Layout) -> list[tuple[str, str]]:
        skip = set(self.ctx.policy_off)
        if not self.ctx.vlm_full_uniform_only:
            skip.add("vlm_full_uniform_only")
        return check(lay, self.ctx.model, skip=skip)

    # --- enumeration -----------------------------------------------------------------------------
    def _sub(self, names: tuple[str, ...], base: Mapping[str, Any]) -> list[Candidate]:
        """All assignments of `names` (those that apply) on top of `base`."""
        present = [n for n in names if n in self.params]
        out: list[Candidate] = [dict(base)]
        for n in present:
            nxt = []
            for c in out:
                if self.applies(n, c):
                    nxt += [{**c, n: v} for v in self.params[n].choices]
                else:
                    nxt.append(c)
            out = nxt
        return out

    def walk(self, survey: Survey | None = None) -> Iterator[Candidate]:
        """Every valid candidate, pruning whole sub-trees as soon as the layout is invalid.

        With `survey`, counts how many candidates each rule removed (first broken rule wins). The
        enumeration runs once per Space (the study's report and its strategy both walk it; a MoE space
        has tens of thousands of candidates); later walks replay it."""
        if self._walked is None:
            counts = Survey()
            self._walked = (list(self._enumerate(counts)), counts)
        valid, counts = self._walked
        if survey is not None:
            survey.total += counts.total
            survey.valid += counts.valid
            survey.removed.update(counts.removed)
            for rule, why in counts.reasons.items():
                survey.reasons.setdefault(rule, why)
            survey.notes += [n for n in self.notes() if n not in survey.notes]
        return (dict(c) for c in valid)

    def _stage_rules(self) -> tuple[dict[str, tuple[Rule, ...]], tuple[Rule, ...], tuple[Rule, ...], tuple[Rule, ...]]:
        """The active rules split by the first enumeration stage at which all they read is fixed:
        after a layout dimension (by name), after mbs, after the recompute/ViT choices, or only on a
        whole candidate (a rule `RULE_NEEDS` does not know)."""
        skip = set(self.ctx.policy_off) | (set() if self.ctx.vlm_full_uniform_only else {"vlm_full_uniform_only"})
        active = [r for r in RULES if r.name not in skip]
        lay_names = [n for n in LAYOUT_PARAMS if n in self.params and self.applies(n, {})]
        by_dim: dict[str, tuple[Rule, ...]] = {}
        placed: set[str] = set()
        fixed: set[str] = set(LAYOUT_PARAMS) - set(lay_names)  # dimensions this job does not search
        for name in lay_names:
            fixed.add(name)
            now = tuple(r for r in active if r.name not in placed and r.name in RULE_NEEDS and RULE_NEEDS[r.name] <= fixed)
            by_dim[name] = now
            placed.update(r.name for r in now)
        if not lay_names:  # nothing searched: every layout-only rule runs once on the defaults
            by_dim[""] = tuple(r for r in active if r.name in RULE_NEEDS and RULE_NEEDS[r.name] <= fixed)
            placed.update(r.name for r in by_dim[""])
        left = [r for r in active if r.name not in placed]
        mbs_rules = tuple(r for r in left if r.name in RULE_NEEDS and "rest" not in RULE_NEEDS[r.name])
        rest_rules = tuple(r for r in left if r.name in RULE_NEEDS and "mbs" not in RULE_NEEDS[r.name]
                           and r not in mbs_rules)
        final = tuple(r for r in left if r not in mbs_rules and r not in rest_rules)
        return by_dim, mbs_rules, rest_rules, final

    def _enumerate(self, survey: Survey) -> Iterator[Candidate]:
        """Depth-first over tp, pp, cp, ep, etp, then mbs x the recompute/ViT choices. A rule runs at the
        first level where everything it reads is fixed (`RULE_NEEDS`), so a broken prefix removes its
        whole sub-tree at once (counted in the survey) and the enumeration costs what the valid part of
        the space costs, not the product of every dimension (16384 GPUs, 256 experts: milliseconds to
        seconds, see benchmarks/startup.py)."""
        order = list(self.params)
        lay_names = [n for n in LAYOUT_PARAMS if n in self.params and self.applies(n, {})]
        rest_names = tuple(n for n in self.params if n not in LAYOUT_PARAMS and n not in ("mbs", self.vp_name))
        rest = [self.normalize(r) for r in self._sub(rest_names, {})]
        has_mbs = "mbs" in self.params
        mbs_choices = self.params["mbs"].choices if has_mbs else (1,)
        vp, vp_choices = self.vp_name, self.params[self.vp_name].choices if self.vp_name else (None,)
        below = self._below(lay_names, len(mbs_choices) * len(rest))
        survey.total += below(0, {})
        by_dim, mbs_rules, rest_rules, final = self._stage_rules()
        if not lay_names and self._broken(survey, {}, by_dim.get("", ()), below(0, {})):
            return
        rest_dims = sorted(set().union(*(RULE_NEEDS[r.name] for r in rest_rules)) - {"rest"}) if rest_rules else []
        rest_memo: dict[tuple, list[str | None]] = {}
        for lay_c in self._layouts(survey, lay_names, by_dim, below, 0, {}):
            # the recompute/ViT rules do not read mbs (and only a few layout dimensions, RULE_NEEDS):
            # decide them once per distinct value of what they read
            memo_key = tuple(lay_c.get(n) for n in rest_dims)
            if memo_key not in rest_memo:
                rest_memo[memo_key] = self._rest_broken(survey, lay_c, rest, rest_rules)
            rest_bad = rest_memo[memo_key]
            # the virtual pipeline size is enumerated with mbs: its rule reads the micro-batch count
            sched = [(mbs, v) for mbs in mbs_choices
                     for v in (vp_choices if vp and self.applies(vp, lay_c) else (None,))]
            for mbs, v in sched:
                at_mbs = {**lay_c, "mbs": mbs} if has_mbs else dict(lay_c)
                if v is not None:
                    at_mbs[vp] = v  # type: ignore[index]
                if self._broken(survey, at_mbs, mbs_rules, len(rest)):
                    continue
                for r, bad_rule in zip(rest, rest_bad):
                    if bad_rule is not None:
                        survey.removed[bad_rule] += 1
                        continue
                    merged = {**at_mbs, **r}
                    cand = {k: merged[k] for k in order if k in merged}
                    if self._broken(survey, cand, final, 1):
                        continue
                    survey.valid += 1
                    yield cand

    def _broken(self, survey: Survey, cand: Mapping[str, Any], rules: tuple[Rule, ...], weight: int) -> bool:
        """Does `cand` (a prefix: its sub-tree of `weight` candidates) break one of `rules`? Counted."""
        if not rules:
            return False
        bad = check(self.layout(cand), self.ctx.model, rules=rules)
        if bad:
            survey.removed[bad[0][0]] += weight
            survey.reasons.setdefault(bad[0][0], bad[0][1])
        return bool(bad)

    def _below(self, lay_names: list[str], per_schedule: int) -> Callable[[int, Candidate], int]:
        """Candidates under a layout prefix fixing `lay_names[:depth]`: the product of the choices left,
        where a pipelined layout (pp > 1) multiplies its `per_schedule` (mbs x recompute/ViT choices) by
        the virtual pipeline sizes and a pp=1 layout does not."""
        n_vp = len(self.params[self.vp_name].choices) if self.vp_name else 1

        def count(depth: int, prefix: Candidate) -> int:
            left = lay_names[depth:]
            other = math.prod(len(self.params[n].choices) for n in left if n != "pp") * per_schedule
            pps = self.params["pp"].choices if "pp" in left else (self._pp(prefix),)
            return other * sum(n_vp if p > 1 else 1 for p in pps)
        return count

    def _layouts(self, survey: Survey, lay_names: list[str], by_dim: dict[str, tuple[Rule, ...]],
                 below: Callable[[int, Candidate], int], depth: int, prefix: Candidate) -> Iterator[Candidate]:
        """The valid layout prefixes below `prefix`, dimension `depth` onwards (depth first)."""
        if depth == len(lay_names):
            yield prefix
            return
        name = lay_names[depth]
        for v in self.params[name].choices:
            c = {**prefix, name: v}
            if not self._broken(survey, c, by_dim.get(name, ()), below(depth + 1, c)):
                yield from self._layouts(survey, lay_names, by_dim, below, depth + 1, c)

    def _rest_broken(self, survey: Survey, lay_c: Candidate, rest: list[Candidate],
                     rest_rules: tuple[Rule, ...]) -> list[str | None]:
        """For each recompute/ViT choice on layout `lay_c`: the first rule it breaks, or None."""
        out: list[str | None] = []
        for r in rest:
            bad = check(self.layout({**lay_c, **r}), self.ctx.model, rules=rest_rules) if rest_rules else []
            out.append(bad[0][0] if bad else None)
            if bad:
                survey.reasons.setdefault(bad[0][0], bad[0][1])
        return out

    def suggest(self, trial: Any, names: tuple[str, ...] | None = None) -> Candidate:
        """Ask an Optuna trial for a candidate, conditionally (a param is only suggested when it
        applies); `names` limits what is suggested."""
        cand: Candidate = {}
        # the virtual pipeline size last: whether it applies depends on the pp just suggested
        for name, p in sorted(self.params.items(), key=lambda item: item[1].when == "pipeline"):
            if name in cand or (names is not None and name not in names):
                continue
            if self.applies(name, cand):
                cand[name] = trial.suggest_categorical(name, list(p.choices))
        return self.normalize(cand)


def stock_search_space(cfg: Any, trial: Any) -> None:
    """`custom_search_space` for the stock hydra-optuna-sweeper baseline (conf/baseline/stock_tpe.yaml):
    the recompute method and layer count exist only under full recompute, which the stock sweeper's
    flat `params` cannot express."""
    if trial.params.get("params.recompute_granularity") == "full":
        trial.suggest_categorical("params.recompute_method", ["uniform", "block"])
        trial.suggest_categorical("params.recompute_num_layers", [1, 2, 4, 8])
