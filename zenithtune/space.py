"""The search space: which parameters a preset tunes, their values for this job, and the pruner.

A *candidate* is a plain dict `{param name: value}` holding only the parameters that apply to it
(`recompute_method` only under full recompute, `ep`/`etp` only for MoE models, ViT checkpointing only
for VLMs). `Space` turns a candidate into a `Layout` (for the rules and the memory estimate) and into
the option dict that `inject` writes into the user's command.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterator, Literal, Mapping

from zenithtune.modelinfo import ModelInfo
from zenithtune.validate import Layout, check

Candidate = dict[str, Any]
When = Literal["always", "moe", "vlm", "full_recompute"]

LAYOUT_PARAMS = ("tp", "pp", "cp", "ep", "etp")
RECOMPUTE_PARAMS = ("recompute_granularity", "recompute_method", "recompute_num_layers")
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
    gpu_memory_gb: float = 80.0
    distributed_optimizer: bool = True  # the command has --use-distributed-optimizer
    vlm_full_uniform_only: bool = True  # see conf/preset/megatron.yaml

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
    return tuple(k for k in range(1, n + 1) if n % k == 0)


def mbs_values(mbs_max: int, gbs: int) -> tuple[int, ...]:
    """Micro-batch sizes: powers of two up to mbs_max that divide gbs."""
    out = []
    b = 1
    while b <= mbs_max:
        if gbs % b == 0:
            out.append(b)
        b *= 2
    return tuple(out)


def options_for(preset: Mapping[str, Any], params: Mapping[str, Any], gbs: int) -> dict[str, Any]:
    """Option name -> value for `inject`: a value sets the option; None removes it.

    `params` must hold exactly the parameters that apply (a normalized candidate or a tuned config):
    every preset option it does not name is removed from the command, so a stale
    `--recompute-method` never reaches a selective-recompute run. Needs no model info, so the entry
    function can call it cheaply in every trial."""
    out: dict[str, Any] = {}
    for name, spec in (preset.get("params") or {}).items():
        v = params.get(name)
        if v is not None and "absent" in spec and v == spec["absent"]:
            v = None
        if isinstance(v, bool):
            v = "true" if v else "false"
        out[str(spec["option"])] = None if v is None else str(v)
    fixed = preset.get("fixed") or {}
    if fixed.get("global_batch_size"):
        out[str(fixed["global_batch_size"])] = str(gbs)
    if fixed.get("sequence_parallel"):
        out[str(fixed["sequence_parallel"])] = int(params.get("tp", 1) or 1) > 1
    return out


def _choices(spec: Any, ctx: Context) -> tuple[Any, ...]:
    if spec == "parallel":
        return parallel_values(ctx.n_gpus)
    if spec == "mbs":
        return mbs_values(ctx.mbs_max, ctx.gbs)
    if isinstance(spec, str):
        raise ValueError(f"preset values {spec!r} is not a list and not one of 'parallel', 'mbs'")
    return tuple(spec)


@dataclass
class Survey:
    """How the pruner shrinks the space (the report printed at study start)."""

    total: int = 0
    removed: Counter = field(default_factory=Counter)  # rule name -> candidates removed
    reasons: dict[str, str] = field(default_factory=dict)  # rule name -> one example reason
    valid: int = 0


class Space:
    """The parameters of a preset, instantiated for one job (`Context`)."""

    def __init__(self, params: list[Param], preset: Mapping[str, Any], ctx: Context):
        self.params = {p.name: p for p in params}
        self.preset = preset
        self.ctx = ctx
        self._walked: tuple[list[Candidate], Survey] | None = None

    @classmethod
    def from_preset(cls, preset: Mapping[str, Any], ctx: Context) -> Space:
        params = []
        for name, spec in (preset.get("params") or {}).items():
            when = spec.get("when", "always")
            if when not in ("always", "moe", "vlm", "full_recompute"):
                raise ValueError(f"preset parameter {name}: when={when!r} is not one of always|moe|vlm|full_recompute")
            params.append(Param(name, str(spec["option"]), _choices(spec.get("values"), ctx), when))
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
        return cand.get("recompute_granularity") == "full"

    def normalize(self, cand: Mapping[str, Any]) -> Candidate:
        """Keep only the parameters that apply, in the preset's order."""
        return {k: cand[k] for k in self.params if k in cand and self.applies(k, cand)}

    def key(self, cand: Mapping[str, Any]) -> tuple:
        """Identity of a candidate (two proposals with the same key are the same run)."""
        n = self.normalize(cand)
        return tuple((k, n.get(k)) for k in self.params)

    # --- translations ----------------------------------------------------------------------------
    def layout(self, cand: Mapping[str, Any]) -> Layout:
        c = {**DEFAULTS, **self.normalize(cand)}
        moe = self.ctx.model.is_moe
        return Layout(
            n_gpus=self.ctx.n_gpus, gbs=self.ctx.gbs,
            tp=int(c["tp"]), pp=int(c["pp"]), cp=int(c["cp"]),
            ep=int(c["ep"]) if moe else 1,
            etp=int(c["etp"]) if moe and c.get("etp") is not None else None,
            mbs=int(c["mbs"]),
            recompute_granularity=None if c.get("recompute_granularity") in (None, "none") else c["recompute_granularity"],
            recompute_method=c.get("recompute_method"),
            recompute_num_layers=c.get("recompute_num_layers"),
            sequence_parallel=int(c["tp"]) > 1,
        )

    def options(self, cand: Mapping[str, Any]) -> dict[str, Any]:
        """Option name -> value for `inject` (see `options_for`)."""
        return options_for(self.preset, self.normalize(cand), self.ctx.gbs)

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
        skip = () if self.ctx.vlm_full_uniform_only else ("vlm_full_uniform_only",)
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
        return (dict(c) for c in valid)

    def _enumerate(self, survey: Survey) -> Iterator[Candidate]:
        lay_names = tuple(n for n in LAYOUT_PARAMS if n in self.params)
        rest_names = tuple(n for n in self.params if n not in lay_names and n != "mbs")
        rest = self._sub(rest_names, {})
        mbs_choices = self.params["mbs"].choices if "mbs" in self.params else (1,)
        per_layout = len(mbs_choices) * len(rest)
        for lay_c in self._sub(lay_names, {}):
            base = {**lay_c, "mbs": 1} if "mbs" in self.params else dict(lay_c)
            survey.total += per_layout
            bad = self._check(self.layout(base))
            if bad:
                survey.removed[bad[0][0]] += per_layout
                survey.reasons.setdefault(bad[0][0], bad[0][1])
                continue
            for mbs in mbs_choices:
                for r in rest:
                    cand = self.normalize({**lay_c, "mbs": mbs, **r} if "mbs" in self.params else {**lay_c, **r})
                    bad = self._check(self.layout(cand))
                    if bad:
                        survey.removed[bad[0][0]] += 1
                        survey.reasons.setdefault(bad[0][0], bad[0][1])
                        continue
                    survey.valid += 1
                    yield cand

    def suggest(self, trial: Any, names: tuple[str, ...] | None = None,
                fixed: Mapping[str, Any] | None = None) -> Candidate:
        """Ask an Optuna trial for a candidate, conditionally (a param is only suggested when it
        applies). `fixed` values are taken as they are and `names` limits what is suggested."""
        cand: Candidate = dict(fixed or {})
        for name, p in self.params.items():
            if name in cand or (names is not None and name not in names):
                continue
            if self.applies(name, cand):
                cand[name] = trial.suggest_categorical(name, list(p.choices))
        return self.normalize(cand)

    def memory_args(self, cand: Mapping[str, Any]) -> dict[str, Any]:
        """What the memory model needs to judge a candidate: `memory.predict(**space.memory_args(c))`."""
        return {"layout": self.layout(cand), "model": self.ctx.model,
                "distributed_optimizer": self.ctx.distributed_optimizer,
                "vit_checkpointing": self.vit_checkpointing(cand)}



def stock_search_space(cfg: Any, trial: Any) -> None:
    """`custom_search_space` for the stock hydra-optuna-sweeper baseline (conf/baseline/stock_tpe.yaml):
    the recompute method and layer count exist only under full recompute, which the stock sweeper's
    flat `params` cannot express."""
    if trial.params.get("params.recompute_granularity") == "full":
        trial.suggest_categorical("params.recompute_method", ["uniform", "block"])
        trial.suggest_categorical("params.recompute_num_layers", [1, 2, 4, 8])
