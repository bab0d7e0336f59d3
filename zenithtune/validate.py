"""Megatron's structural rules, in one place.

Each rule is one function `(layout, model) -> reason | None`. The tuner's validator runs them on every
candidate before launch; the built-in simulator (zenithtune.sim) runs the `megatron` rules on its own
parsed arguments, so the two always agree on what Megatron accepts (see shared MEGATRON.md §Rules).

Rules of kind ``megatron`` are what Megatron itself rejects. Rules of kind ``prune`` are the tuner's
own policy (never launch something pointless); the simulator does not apply those.
Rules whose inputs are unknown (a None field in ModelInfo) do not fire.

A ``prune`` rule that is a user-facing switch (e.g. preset ``vlm_full_uniform_only: false``) is turned
off by name: ``check(layout, model, skip=("vlm_full_uniform_only",))``. Rule functions keep the one
`(layout, model)` signature; the switch lives with the caller that owns the setting.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Collection, Literal

from zenithtune.modelinfo import ModelInfo

Granularity = Literal["full", "selective"]
Method = Literal["uniform", "block"]


@dataclass(frozen=True)
class Layout:
    """One training configuration: parallel sizes, batch and recompute. Derived sizes are properties."""

    n_gpus: int  # world size N
    gbs: int  # global batch size B
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int | None = None  # expert tensor parallel size; None = same as tp (Megatron's default)
    mbs: int = 1
    layers_per_virtual_stage: int | None = None  # --num-layers-per-virtual-pipeline-stage
    recompute_granularity: Granularity | None = None
    recompute_method: Method | None = None
    recompute_num_layers: int | None = None
    sequence_parallel: bool = False
    overlap_p2p: bool = True  # Megatron's default; --no-overlap-p2p-communication makes interleaving need pp > 2

    @property
    def expert_tp(self) -> int:
        return self.etp if self.etp is not None else self.tp

    @property
    def model_parallel(self) -> int:
        return self.tp * self.pp * self.cp

    @property
    def dp(self) -> int:
        """Data-parallel size d = N / (tp·pp·cp); EP and ETP do not divide it (they use a second grid)."""
        return self.n_gpus // self.model_parallel if self.model_parallel else 0

    @property
    def expert_dp(self) -> int:
        grid = self.expert_tp * self.ep * self.pp
        return self.n_gpus // grid if grid else 0

    @property
    def microbatches(self) -> int:
        """Micro-batches per iteration m = B / (b·d)."""
        denom = self.mbs * self.dp
        return self.gbs // denom if denom else 0

    @property
    def sp_active(self) -> bool:
        """Megatron silently turns sequence parallelism off at tp == 1."""
        return self.sequence_parallel and self.tp > 1

    def virtual_stages(self, num_layers: int | None) -> int:
        """Model chunks per pipeline stage (1 without interleaving)."""
        if not self.layers_per_virtual_stage or not num_layers or self.pp <= 0:
            return 1
        per_stage = num_layers // self.pp
        return max(1, per_stage // self.layers_per_virtual_stage)


RuleKind = Literal["megatron", "prune"]
RuleFn = Callable[[Layout, ModelInfo], "str | None"]


@dataclass(frozen=True)
class Rule:
    name: str  # short id used in reports and user_attrs
    kind: RuleKind
    check: RuleFn
    why: str  # one line: why the rule exists


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


# --- the rules -------------------------------------------------------------------------------------

def world_divisible(lay: Layout, model: ModelInfo) -> str | None:
    mp = lay.model_parallel
    if mp <= 0 or lay.n_gpus % mp:
        ok = [t for t in _divisors(lay.n_gpus) if (lay.n_gpus % (t * lay.pp * lay.cp) == 0)]
        return (f"world size ({lay.n_gpus}) is not divisible by tensor model parallel size ({lay.tp}) "
                f"times pipeline model parallel size ({lay.pp}) times context parallel size ({lay.cp}) "
                f"= {mp}" + (f"; tp in {ok} would divide it at pp={lay.pp}, cp={lay.cp}" if ok else ""))
    return None


def expert_grid_divisible(lay: Layout, model: ModelInfo) -> str | None:
    grid = lay.expert_tp * lay.ep * lay.pp
    if grid <= 0 or lay.n_gpus % grid:
        return (f"world size ({lay.n_gpus}) is not divisible by expert tensor parallel size "
                f"({lay.expert_tp}) times expert model parallel size ({lay.ep}) times pipeline model "
                f"parallel size ({lay.pp}) = {grid}")
    return None


def experts_divisible(lay: Layout, model: ModelInfo) -> str | None:
    if lay.ep <= 1:
        return None
    if model.num_experts is None:
        return None if model.num_layers is None else (
            f"expert model parallel size ({lay.ep}) > 1 needs a MoE model (--num-experts); this model is dense")
    if not model.is_moe:
        return f"expert model parallel size ({lay.ep}) > 1 needs a MoE model (--num-experts); this model is dense"
    if model.num_experts % lay.ep:
        return (f"number of experts ({model.num_experts}) must be divisible by expert model parallel size "
                f"({lay.ep}); ep in {_divisors(model.num_experts)} would")
    return None


def tp_divides_heads(lay: Layout, model: ModelInfo) -> str | None:
    a = model.num_attention_heads
    if a and a % lay.tp:
        return (f"number of attention heads ({a}) must be divisible by tensor model parallel size ({lay.tp})")
    return None


def tp_fits_query_groups(lay: Layout, model: ModelInfo) -> str | None:
    g = model.num_query_groups
    if g and g % lay.tp and lay.tp % g:
        return (f"number of query groups ({g}) must be divisible by tensor model parallel size ({lay.tp}), "
                f"or tensor model parallel size a multiple of it")
    return None


def hidden_divides_heads(lay: Layout, model: ModelInfo) -> str | None:
    h, a = model.hidden_size, model.num_attention_heads
    if h and a and not model.kv_channels and h % a:
        return (f"hidden size ({h}) must be divisible by number of attention heads ({a}) "
                f"unless --kv-channels is given")
    return None


def cp_divides_seq(lay: Layout, model: ModelInfo) -> str | None:
    s = model.seq_length
    if lay.cp > 1 and s and s % (2 * lay.cp):
        return (f"sequence length ({s}) must be divisible by 2 x context parallel size "
                f"({2 * lay.cp}) for load-balanced context parallelism")
    return None


def gbs_divisible(lay: Layout, model: ModelInfo) -> str | None:
    d = lay.dp
    if d <= 0:
        return None  # world_divisible reports it
    if lay.gbs % (lay.mbs * d):
        return (f"global batch size ({lay.gbs}) is not divisible by micro batch size ({lay.mbs}) times "
                f"data parallel size ({d}) = {lay.mbs * d}")
    return None


def pp_divides_layers(lay: Layout, model: ModelInfo) -> str | None:
    L = model.num_layers
    if L and lay.pp > 1 and L % lay.pp:
        return (f"number of layers ({L}) must be divisible by pipeline model parallel size ({lay.pp}) "
                f"for an even pipeline; pp in {[p for p in _divisors(L) if p <= lay.n_gpus]} would")
    return None


def virtual_pipeline(lay: Layout, model: ModelInfo) -> str | None:
    v = lay.layers_per_virtual_stage
    if not v:
        return None
    if lay.overlap_p2p and lay.pp <= 1:
        return (f"when interleaved schedule is used, pipeline-model-parallel size should be greater than 1 "
                f"(got {lay.pp}, --num-layers-per-virtual-pipeline-stage {v})")
    if not lay.overlap_p2p and lay.pp <= 2:
        return (f"when interleaved schedule is used and p2p communication overlap is disabled, "
                f"pipeline-model-parallel size should be greater than 2 (got {lay.pp})")
    L = model.num_layers
    if L and (L // lay.pp) % v:
        return (f"number of layers per pipeline stage ({L // lay.pp}) must be divisible by number of "
                f"layers per virtual pipeline stage ({v})")
    if lay.dp > 0 and lay.microbatches < lay.pp:
        return (f"interleaved schedule needs at least pipeline-model-parallel size ({lay.pp}) "
                f"micro-batches per iteration (got {lay.microbatches})")
    return None


def recompute_options(lay: Layout, model: ModelInfo) -> str | None:
    g, m, n = lay.recompute_granularity, lay.recompute_method, lay.recompute_num_layers
    if g is None:
        if m is not None or n is not None:
            return (f"--recompute-method ({m}) / --recompute-num-layers ({n}) need --recompute-granularity full "
                    f"(no granularity given)")
        return None
    if g == "selective":
        if m is not None:
            return (f"recompute method ({m}) is not yet supported for selective recomputing granularity; "
                    f"drop --recompute-method")
        if n is not None:
            return (f"recompute num layers ({n}) is not supported with selective recomputing granularity; "
                    f"drop --recompute-num-layers")
        return None
    if g != "full":
        return f"recompute granularity must be 'full' or 'selective' (got {g!r})"
    if m not in ("uniform", "block"):
        return f"full recompute needs --recompute-method uniform|block (got {m!r})"
    L = model.num_layers
    if not n or n < 1:
        per_stage_text = f" and the layers per pipeline stage ({L // lay.pp})" if L and lay.pp > 0 else ""
        return f"full recompute needs --recompute-num-layers between 1{per_stage_text} (got {n})"
    if L and lay.pp > 0:
        per_stage = L // lay.pp
        if m == "block" and n > per_stage:
            return (f"recompute num layers ({n}) exceeds the layers per pipeline stage ({per_stage}) "
                    f"with the block method")
        if m == "uniform" and per_stage % n:
            return (f"layers per pipeline stage ({per_stage}) are not divisible by the uniform recompute "
                    f"chunk ({n})")
    return None


def moe_needs_sequence_parallel(lay: Layout, model: ModelInfo) -> str | None:
    if model.is_moe and lay.tp > 1 and not lay.sequence_parallel:
        return (f"during training, performance may degrade if MoE ({model.num_experts} experts) and tensor "
                f"parallelism (tensor model parallel size {lay.tp}) are enabled without also enabling sequence "
                f"parallelism (add --sequence-parallel)")
    return None


def moe_etp_bias(lay: Layout, model: ModelInfo) -> str | None:
    if model.is_moe and lay.expert_tp > 1 and model.disable_bias_linear is False:
        return (f"expert tensor parallel size ({lay.expert_tp}) > 1 does not support bias in linear "
                f"layers; add --disable-bias-linear")
    return None


# --- the tuner's own pruning policy ----------------------------------------------------------------

def etp_not_above_tp(lay: Layout, model: ModelInfo) -> str | None:
    if lay.etp is not None and lay.etp > lay.tp:
        return f"etp ({lay.etp}) > tp ({lay.tp}): expert TP wider than dense TP only adds communication"
    return None


def etp_only_for_moe(lay: Layout, model: ModelInfo) -> str | None:
    if lay.etp not in (None, lay.tp) and model.num_experts is not None and not model.is_moe:
        return f"etp ({lay.etp}) has no effect on a dense model"
    return None


def cp_only_when_seq_known_fits(lay: Layout, model: ModelInfo) -> str | None:
    s = model.seq_length
    if lay.cp > 1 and s and s // lay.cp < 1024:
        return f"cp ({lay.cp}) leaves {s // lay.cp} tokens per rank (< 1024): the ring cannot hide its traffic"
    return None


def vlm_full_uniform_only(lay: Layout, model: ModelInfo) -> str | None:
    if not model.is_vlm:
        return None
    if lay.recompute_granularity == "selective":
        return ("VLM: selective recompute is not tried (upstream disables it for VLMs; "
                "set vlm_full_uniform_only=false to allow it)")
    if lay.recompute_method == "block":
        return ("VLM: only the uniform recompute method is tried (upstream disables block for VLMs; "
                "set vlm_full_uniform_only=false to allow it)")
    return None


RULES: tuple[Rule, ...] = (
    Rule("world_divisible", "megatron", world_divisible, "every GPU needs a place on the tp x pp x cp x dp grid"),
    Rule("expert_grid", "megatron", expert_grid_divisible, "experts live on a second grid etp x ep x pp x expert-dp"),
    Rule("experts", "megatron", experts_divisible, "each EP rank holds num_experts/ep whole experts"),
    Rule("tp_heads", "megatron", tp_divides_heads, "TP splits attention heads across ranks"),
    Rule("tp_query_groups", "megatron", tp_fits_query_groups, "TP splits (or replicates) KV groups"),
    Rule("hidden_heads", "megatron", hidden_divides_heads, "head dim is hidden/heads without --kv-channels"),
    Rule("cp_seq", "megatron", cp_divides_seq, "CP splits the sequence into 2·cp balanced chunks"),
    Rule("gbs", "megatron", gbs_divisible, "each iteration is a whole number of micro-batches per DP rank"),
    Rule("pp_layers", "megatron", pp_divides_layers, "an even pipeline gives every stage the same layers"),
    Rule("virtual_pipeline", "megatron", virtual_pipeline, "interleaving splits each stage into equal chunks"),
    Rule("recompute", "megatron", recompute_options, "recompute options must be consistent"),
    Rule("moe_sequence_parallel", "megatron", moe_needs_sequence_parallel, "MoE with TP requires SP"),
    Rule("moe_etp_bias", "megatron", moe_etp_bias, "expert TP cannot shard biases"),
    Rule("etp_le_tp", "prune", etp_not_above_tp, "ETP beyond TP adds traffic and never saves memory the dense part needs"),
    Rule("etp_dense", "prune", etp_only_for_moe, "ETP only applies to expert layers"),
    Rule("cp_short_seq", "prune", cp_only_when_seq_known_fits, "CP on short sequences is pure overhead"),
    Rule("vlm_full_uniform_only", "prune", vlm_full_uniform_only,
         "upstream ZenithTune recomputes VLMs only with full/uniform; a switch, see check(skip=...)"),
)

RULES_BY_NAME = {r.name: r for r in RULES}


def check(lay: Layout, model: ModelInfo, *, kinds: tuple[RuleKind, ...] = ("megatron", "prune"),
          rules: tuple[Rule, ...] | None = None, skip: Collection[str] = ()) -> list[tuple[str, str]]:
    """Every broken rule as (rule name, reason); empty means valid.

    `skip` names rules the caller has switched off (only ``prune`` rules may be: Megatron's own
    rules are not optional)."""
    unknown = set(skip) - {r.name for r in RULES if r.kind == "prune"}
    if unknown:
        raise ValueError(f"check(skip={sorted(unknown)}): only prune rules can be skipped; they are "
                         f"{[r.name for r in RULES if r.kind == 'prune']}")
    out: list[tuple[str, str]] = []
    for rule in rules if rules is not None else RULES:
        if rule.kind not in kinds or rule.name in skip:
            continue
        reason = rule.check(lay, model)
        if reason:
            out.append((rule.name, reason))
    return out


def megatron_errors(lay: Layout, model: ModelInfo) -> list[str]:
    """What Megatron itself would reject (the simulator's view)."""
    return [reason for _, reason in check(lay, model, kinds=("megatron",))]


def required_env(lay: Layout, gpu: str | None = None) -> dict[str, str]:
    """Environment Megatron needs for this layout: TP/CP comm overlap on pre-Blackwell GPUs needs
    CUDA_DEVICE_MAX_CONNECTIONS=1 (Megatron asserts it)."""
    if (lay.tp > 1 or lay.cp > 1) and not (gpu or "").lower().startswith(("b100", "b200", "gb200")):
        return {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    return {}


def env_errors(lay: Layout, env: dict[str, str] | None = None, gpu: str | None = None) -> list[str]:
    env = os.environ if env is None else env
    missing = {k: v for k, v in required_env(lay, gpu).items() if env.get(k) != v}
    return [f"using tensor/context parallelism (tp={lay.tp}, cp={lay.cp}) requires setting the environment "
            f"variable {k} to {v}" for k, v in missing.items()]
