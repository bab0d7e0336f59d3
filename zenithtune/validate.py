"""Megatron's structural rules and zenithtune's pruning policy, in one place.

Each rule is one function `(layout, model) -> reason | None`. The tuner's validator runs them on every
candidate before launch; the built-in simulator (zenithtune.sim) runs the `megatron` rules on its own
parsed arguments, so the two always agree on what Megatron accepts (see shared MEGATRON.md §Rules).

Every rule says where it comes from:

* ``megatron``: Megatron itself rejects the configuration; the docstring cites the check (file and
  function of Megatron-LM / megatron-core, checked against the sources of Aug 2026, core 0.19).
  These are not optional, and they prune nothing Megatron accepts.
* ``policy``: zenithtune's own preference (never launch something pointless or duplicate). Each is a
  switch, on by default: ``prune.policy.<name>=false`` in the config turns it off
  (``check(layout, model, skip=(name,))``).

Rules whose inputs are unknown (a None field in ModelInfo) do not fire.
"""
from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Literal

from zenithtune.command import CommandFacts
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
    vpp_size: int | None = None  # --num-virtual-stages-per-pipeline-rank (ms-swift: --virtual_pipeline_model_parallel_size)
    pipeline_extra_layers: int = 0  # --account-for-embedding/loss-in-pipeline-split: each counts as one layer
    local_impl: bool = False  # --transformer-impl local: torch LayerNorm, which refuses sequence parallelism
    tp_comm_overlap: bool = False  # --tp-comm-overlap
    distribute_saved_activations: bool = False  # --distribute-saved-activations
    # Current Megatron's layout flags (issue 23). Left out of repr: the simulator seeds its run-to-run
    # jitter from repr(config), and a run without these flags keeps the numbers it always had.
    hierarchical_cp: tuple[int, ...] | None = field(default=None, repr=False)  # --hierarchical-context-parallel-sizes
    hybrid_cp: bool = field(default=False, repr=False)  # --hybrid-context-parallel
    recompute_modules: tuple[str, ...] | None = field(default=None, repr=False)  # --recompute-modules (None: core_attn)
    moe_grouped_gemm: bool = field(default=False, repr=False)  # --moe-grouped-gemm
    pipeline_layout: str | None = field(default=None, repr=False)  # --pipeline-model-parallel-layout
    first_stage_layers: int | None = field(default=None, repr=False)  # --decoder-first-pipeline-num-layers
    last_stage_layers: int | None = field(default=None, repr=False)  # --decoder-last-pipeline-num-layers
    # expert-parallel all-to-all overlap (--overlap-moe-expert-parallel-comm) and what it needs of the command
    moe_a2a_overlap: bool = field(default=False, repr=False)
    moe_dispatcher: str = field(default="allgather", repr=False)  # --moe-token-dispatcher-type (core's default)
    moe_shared_expert_overlap: bool = field(default=False, repr=False)  # --moe-shared-expert-overlap

    @property
    def selective_modules(self) -> tuple[str, ...]:
        """What selective recompute re-runs (the modules given, else Megatron's default); () otherwise."""
        if self.recompute_granularity != "selective":
            return ()
        return self.recompute_modules or DEFAULT_MODULES

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

    def layers_per_stage(self, num_layers: int | None) -> int | None:
        """Layers in the pipeline split per stage, the account-for-* extras included (as Megatron
        counts them: arguments.py validate_args)."""
        if not num_layers or self.pp <= 0:
            return None
        return (num_layers + self.pipeline_extra_layers) // self.pp

    @property
    def uneven(self) -> bool:
        """--decoder-first/last-pipeline-num-layers: the split is not L / pp."""
        return self.first_stage_layers is not None or self.last_stage_layers is not None

    def virtual_stages(self, num_layers: int | None) -> int:
        """Model chunks per pipeline stage (1 without interleaving). A pipeline layout listing more
        stages than pp interleaves: 4 stages at pp=2 run 2 chunks per rank (arguments.py validate_args)."""
        if self.pp <= 1:
            return 1
        if self.pipeline_layout:
            stages = pipeline_stages(self.pipeline_layout)
            return len(stages) // self.pp if stages and len(stages) % self.pp == 0 else 1
        if self.vpp_size:
            return self.vpp_size
        per_stage = self.layers_per_stage(num_layers)
        if not self.layers_per_virtual_stage or not per_stage:
            return 1
        return max(1, per_stage // self.layers_per_virtual_stage)


_UNROLL = (re.compile(r"\(([^)]+)\)\*(\d+)"), re.compile(r"(.)\*(\d+)"))
_LAYER_CHARS = frozenset("ELtm")  # embedding, loss, transformer (decoder) layer, MTP layer


@lru_cache(maxsize=64)
def pipeline_stages(layout: str) -> tuple[str, ...] | None:
    """The stages of a ``--pipeline-model-parallel-layout`` string, one string of layer letters each
    (``"Et*3|(tt|)*2L"`` -> ``("Ettt", "tt", "ttL")``), parsed as megatron/core/transformer/
    pipeline_parallel_layer_layout.py PipelineParallelLayerLayout.parse_str_to_list does (commas are
    cosmetic; ``(...)*n`` and ``x*n`` repeat). None when a character is not a layer letter."""
    text = layout.replace(",", "")
    for pattern in _UNROLL:
        text = pattern.sub(lambda m: m.group(1) * int(m.group(2)), text)
    stages = tuple(text.split("|"))
    return None if any(ch not in _LAYER_CHARS for st in stages for ch in st) else stages


def layout_problem(layout: str) -> str | None:
    """What PipelineParallelLayerLayout refuses in a layout string whatever the candidate (its
    parse_str_to_list and validate_layer_layout): an unknown layer letter, the embedding not first or
    the loss not last, either not exactly once."""
    stages = pipeline_stages(layout)
    if stages is None:
        bad = sorted({ch for ch in layout.replace(",", "") if ch not in _LAYER_CHARS | set("|()*0123456789")})
        return (f"--pipeline-model-parallel-layout {layout!r}: invalid layer character(s) {bad}; known layer "
                f"characters: E (embedding), L (loss), t (transformer layer), m (MTP layer)")
    flat = "".join(stages)
    if not flat.startswith("E") or flat.count("E") != 1:
        return f"--pipeline-model-parallel-layout {layout!r}: the embedding (E) must be the first layer, exactly once"
    if not flat.endswith("L") or flat.count("L") != 1:
        return f"--pipeline-model-parallel-layout {layout!r}: the loss (L) must be the last layer, exactly once"
    return None


RuleKind = Literal["megatron", "policy"]
RuleFn = Callable[[Layout, ModelInfo], "str | None"]


@dataclass(frozen=True)
class Rule:
    name: str  # short id used in reports and user_attrs
    kind: RuleKind
    check: RuleFn
    why: str  # one line: why the rule exists


def divisors(n: int) -> list[int]:
    """Every divisor of n, ascending (trial division up to sqrt(n): fast for any world size)."""
    small, large = [], []
    k = 1
    while k * k <= n:
        if n % k == 0:
            small.append(k)
            if k * k != n:
                large.append(n // k)
        k += 1
    return small + large[::-1]


# --- Megatron's rules (kind "megatron"): each docstring cites the check it mirrors --------------

def world_divisible(lay: Layout, model: ModelInfo) -> str | None:
    """megatron/core/parallel_state.py initialize_model_parallel: `world_size % (tp·pp·cp) != 0`
    raises "world_size (N) is not divisible by ..."."""
    mp = lay.model_parallel
    if mp <= 0 or lay.n_gpus % mp:
        ok = [t for t in divisors(lay.n_gpus) if (lay.n_gpus % (t * lay.pp * lay.cp) == 0)]
        return (f"world size ({lay.n_gpus}) is not divisible by tensor model parallel size ({lay.tp}) "
                f"times pipeline model parallel size ({lay.pp}) times context parallel size ({lay.cp}) "
                f"= {mp}" + (f"; tp in {ok} would divide it at pp={lay.pp}, cp={lay.cp}" if ok else ""))
    return None


def expert_grid_divisible(lay: Layout, model: ModelInfo) -> str | None:
    """megatron/core/parallel_state.py initialize_model_parallel: `world_size % (etp·ep·pp) != 0`
    raises "... is not divisible by expert_tensor_model_pipeline_parallel size"."""
    grid = lay.expert_tp * lay.ep * lay.pp
    if grid <= 0 or lay.n_gpus % grid:
        return (f"world size ({lay.n_gpus}) is not divisible by expert tensor parallel size "
                f"({lay.expert_tp}) times expert model parallel size ({lay.ep}) times pipeline model "
                f"parallel size ({lay.pp}) = {grid}")
    return None


def experts_divisible(lay: Layout, model: ModelInfo) -> str | None:
    """megatron/core/transformer/moe/moe_layer.py BaseMoELayer.__init__: `assert num_moe_experts %
    ep_size == 0`; EP without experts has no expert layers to place."""
    if lay.ep <= 1:
        return None
    if model.num_experts is None:
        return None if model.num_layers is None else (
            f"expert model parallel size ({lay.ep}) > 1 needs a MoE model (--num-experts); this model is dense")
    if not model.is_moe:
        return f"expert model parallel size ({lay.ep}) > 1 needs a MoE model (--num-experts); this model is dense"
    if model.num_experts % lay.ep:
        return (f"number of experts ({model.num_experts}) must be divisible by expert model parallel size "
                f"({lay.ep}); ep in {divisors(model.num_experts)} would")
    return None


def tp_divides_heads(lay: Layout, model: ModelInfo) -> str | None:
    """megatron/core/transformer/transformer_config.py TransformerConfig.__post_init__:
    "num_attention_heads must be a multiple of tensor_model_parallel_size"."""
    a = model.num_attention_heads
    if a and a % lay.tp:
        return (f"number of attention heads ({a}) must be divisible by tensor model parallel size ({lay.tp})")
    return None


def tp_fits_query_groups(lay: Layout, model: ModelInfo) -> str | None:
    """megatron/core/transformer/transformer_config.py TransformerConfig.__post_init__:
    "num_query_groups must be a multiple or divisor of tensor_model_parallel_size"."""
    g = model.num_query_groups
    if g and g % lay.tp and lay.tp % g:
        return (f"number of query groups ({g}) must be divisible by tensor model parallel size ({lay.tp}), "
                f"or tensor model parallel size a multiple of it")
    return None


def tp_divides_ffn(lay: Layout, model: ModelInfo) -> str | None:
    """megatron/core/tensor_parallel/layers.py ColumnParallelLinear / RowParallelLinear (and Transformer
    Engine's linears, megatron/core/extensions/transformer_engine.py): `divide(output_size, tp)` asserts
    "{ffn} is not divisible by {tp}" when the model is built: a dense MLP (and a shared expert) splits its
    width over TP; the routed experts' width (--moe-ffn-hidden-size, else the dense one) over expert TP
    (megatron/core/transformer/moe/experts.py)."""
    widths = []
    if not model.is_moe or (model.moe_layer_freq or 1) > 1:
        widths.append(("ffn hidden size", model.ffn, "tensor model parallel size", lay.tp))
    if model.is_moe:
        routed = model.moe_ffn_hidden_size or model.ffn
        widths.append(("moe ffn hidden size", routed, "expert tensor parallel size", lay.expert_tp))
        if model.moe_shared_expert_size:
            widths.append(("shared expert ffn size", model.moe_shared_expert_size, "tensor model parallel size",
                           lay.tp))
    for name, width, by, size in widths:
        if width and size > 1 and width % size:
            fits = [d for d in divisors(width) if d <= max(size, 8)]
            return f"{name} ({width}) is not divisible by {by} ({size}); sizes in {fits} would"
    return None


def hidden_divides_heads(lay: Layout, model: ModelInfo) -> str | None:
    """megatron/training/arguments.py validate_args: without --kv-channels, `assert hidden_size %
    num_attention_heads == 0`."""
    h, a = model.hidden_size, model.num_attention_heads
    if h and a and not model.kv_channels and h % a:
        return (f"hidden size ({h}) must be divisible by number of attention heads ({a}) "
                f"unless --kv-channels is given")
    return None


def cp_divides_seq(lay: Layout, model: ModelInfo) -> str | None:
    """megatron/training/arguments.py validate_args: "seq-length should be a multiple of 2 *
    context-parallel-size if context-parallel-size > 1"."""
    s = model.seq_length
    if lay.cp > 1 and s and s % (2 * lay.cp):
        return (f"sequence length ({s}) must be divisible by 2 x context parallel size "
                f"({2 * lay.cp}) for load-balanced context parallelism")
    return None


def gbs_divisible(lay: Layout, model: ModelInfo) -> str | None:
    """megatron/core/num_microbatches_calculator.py ConstantNumMicroBatchesCalculator: "global batch
    size (B) is not divisible by micro batch size (b) times data parallel size (d)"."""
    d = lay.dp
    if d <= 0:
        return None  # world_divisible reports it
    if lay.gbs % (lay.mbs * d):
        return (f"global batch size ({lay.gbs}) is not divisible by micro batch size ({lay.mbs}) times "
                f"data parallel size ({d}) = {lay.mbs * d}")
    return None


def pp_divides_layers(lay: Layout, model: ModelInfo) -> str | None:
    """megatron/training/arguments.py validate_args: "Number of layers should be divisible by the
    pipeline-model-parallel size", where --account-for-embedding/loss-in-pipeline-split each add one
    layer to the count (30 layers with both split evenly over pp=4). Megatron makes this check only
    for an even split: not with --decoder-first/last-pipeline-num-layers (`uneven_pipeline` checks
    those) nor with --pipeline-model-parallel-layout (`pipeline_layout`)."""
    L = model.num_layers
    if not L or lay.pp <= 1 or lay.uneven or lay.pipeline_layout:
        return None
    total = L + lay.pipeline_extra_layers
    if total % lay.pp:
        extra = f" + {lay.pipeline_extra_layers} (account-for-* in the pipeline split)" if lay.pipeline_extra_layers else ""
        ok = [p for p in divisors(total) if p <= lay.n_gpus]
        return (f"number of layers ({L}{extra}) must be divisible by pipeline model parallel size ({lay.pp}) "
                f"for an even pipeline; pp in {ok} would")
    return None


def virtual_pipeline(lay: Layout, model: ModelInfo) -> str | None:
    """Interleaved (virtual) pipeline stages.

    megatron/training/arguments.py validate_args: the layers per stage (account-for-* extras included)
    must be divisible by --num-layers-per-virtual-pipeline-stage; with more than one chunk per stage
    "pipeline-model-parallel size should be greater than 1" (> 2 without p2p overlap).
    megatron/core/pipeline_parallel/schedules.py forward_backward_pipelining_with_interleaving: the
    micro-batches come in groups of pp (microbatch_group_size_per_vp_stage defaults to pp), so fewer
    than pp micro-batches, or a remainder 0 < m % pp < pp, raise.

    The virtual size comes from one of three spellings: --num-layers-per-virtual-pipeline-stage,
    --num-virtual-stages-per-pipeline-rank, or a --pipeline-model-parallel-layout listing more stages
    than pp (validate_args: `virtual_pipeline_model_parallel_size = num_stages // pp`; 4 stages at
    pp=1 interleave 4 chunks and are refused). With --num-virtual-stages-per-pipeline-rank on an even
    split, megatron/core/transformer/transformer_block.py get_num_layers_to_build asserts when the
    model is built: "num_layers_per_pipeline_rank ... should be divisible by vp_size"."""
    v = lay.layers_per_virtual_stage
    if not v and not lay.vpp_size and not lay.pipeline_layout:
        return None
    L = model.num_layers
    total = (L or 0) + lay.pipeline_extra_layers
    even = not lay.uneven and not lay.pipeline_layout
    if v and L and even and lay.pp > 0 and total % lay.pp == 0:
        per_stage = total // lay.pp
        if per_stage % v:
            return (f"number of layers per pipeline stage ({per_stage}) must be divisible by number of "
                    f"layers per virtual pipeline stage ({v})")
    stages = pipeline_stages(lay.pipeline_layout) if lay.pipeline_layout else None
    if lay.pipeline_layout:
        if not stages or len(stages) % max(lay.pp, 1):
            return None  # `pipeline_layout` reports it
        chunks = len(stages) // max(lay.pp, 1)
        what = f"--pipeline-model-parallel-layout with {len(stages)} stages"
    else:
        chunks = lay.vpp_size or ((total // max(lay.pp, 1)) // v if v and L else 2)
        what = f"--num-layers-per-virtual-pipeline-stage {v}" if v else f"{lay.vpp_size} virtual stages"
    if chunks <= 1:
        return None  # Megatron sets the virtual size to None: no interleaving
    if lay.overlap_p2p and lay.pp <= 1:
        return (f"when interleaved schedule is used, pipeline-model-parallel size should be greater than 1 "
                f"(got {lay.pp}, {what})")
    if not lay.overlap_p2p and lay.pp <= 2:
        return (f"when interleaved schedule is used and p2p communication overlap is disabled, "
                f"pipeline-model-parallel size should be greater than 2 (got {lay.pp}, {what})")
    if lay.vpp_size and L and even and lay.pp > 0 and total % lay.pp == 0 and (total // lay.pp) % chunks:
        return (f"num_layers_per_pipeline_rank ({total // lay.pp}) should be divisible by vp_size ({chunks}) "
                f"(--num-virtual-stages-per-pipeline-rank {lay.vpp_size} on {L} layers at pp={lay.pp})")
    if lay.dp > 0:
        m = lay.microbatches
        if m < lay.pp or m % lay.pp:
            return (f"interleaved schedule runs micro-batches in groups of pipeline-model-parallel size "
                    f"({lay.pp}): the micro-batches per iteration must be a multiple of it (got {m})")
    return None


def pipeline_layout(lay: Layout, model: ModelInfo) -> str | None:
    """megatron/training/arguments.py validate_args: "The length of pipeline_model_parallel_layout must
    be divisible by pipeline_model_parallel_size"; megatron/core/transformer/pipeline_parallel_layer_layout.py
    PipelineParallelLayerLayout.validate_layer_layout: "Number of decoder layers ... must match
    num_layers". (A layout string that no candidate can run is refused before launch: `command_errors`.)"""
    if not lay.pipeline_layout:
        return None
    stages = pipeline_stages(lay.pipeline_layout)
    if not stages:
        return None
    if len(stages) % max(lay.pp, 1):
        ok = [p for p in divisors(len(stages)) if p > 1]
        return (f"the length of pipeline_model_parallel_layout ({len(stages)} stages) must be divisible by "
                f"pipeline model parallel size ({lay.pp}); pp in {ok} would")
    decoders = sum(st.count("t") for st in stages)
    if model.num_layers and decoders != model.num_layers:
        return (f"number of decoder layers in --pipeline-model-parallel-layout ({decoders}) must match "
                f"num_layers ({model.num_layers})")
    return None


def uneven_pipeline(lay: Layout, model: ModelInfo) -> str | None:
    """Uneven pipeline split (--decoder-first/last-pipeline-num-layers).

    megatron/core/transformer/transformer_config.py TransformerConfig.__post_init__ (Uneven PP): with
    interleaving the first/last stage's layers must divide by the virtual size; the layers left
    for the middle stages and the middle stages must both be zero or both not ("Mismatch: ... middle
    layers remaining but ... middle PP stages available"), the middle layers divide by the middle
    stages, and each middle rank's layers by the virtual size. megatron/training/arguments.py
    validate_args: with --num-layers-per-virtual-pipeline-stage "please use
    --num-virtual-stages-per-pipeline-rank to specify virtual pipeline parallel degree when enable
    uneven pipeline parallelism". megatron/core/transformer/transformer_block.py
    get_num_layers_to_build: a negative middle share cannot be built.

    At pp=1 with both first and last Megatron accepts the command (and builds only the first stage's
    layers); zenithtune never launches that: `options.adjust` drops both flags at pp=1."""
    first, last = lay.first_stage_layers, lay.last_stage_layers
    if first is None and last is None:
        return None
    if lay.layers_per_virtual_stage:
        return ("please use --num-virtual-stages-per-pipeline-rank to specify virtual pipeline parallel degree "
                f"when enable uneven pipeline parallelism (got --num-layers-per-virtual-pipeline-stage "
                f"{lay.layers_per_virtual_stage} with --decoder-first/last-pipeline-num-layers)")
    L = model.num_layers
    if not L:
        return None
    v = lay.virtual_stages(L)
    for name, n in (("first", first), ("last", last)):
        if n is not None and v > 1 and n % v:
            return (f"number of layers at {name} stage ({n}) must be divisible by virtual pipeline parallel "
                    f"degree ({v})")
    middle = L - (first or 0) - (last or 0)
    stages = lay.pp - (first is not None) - (last is not None)
    split = f"{L} layers, first {first}, last {last}, pp={lay.pp}"
    if bool(middle) != bool(stages):
        return (f"mismatch: {middle} middle layers remaining but {stages} middle pipeline stages available "
                f"({split})")
    if stages and middle % stages:
        return (f"number of layers at middle stage ({middle}) must be divisible by the middle pipeline model "
                f"parallel size ({stages}) ({split})")
    if stages > 0 and middle < 0:
        return f"the first and last stages hold more layers than the model has ({split})"
    if stages > 0 and v > 1 and (middle // stages) % v:
        return (f"number of layers on each middle pipeline rank ({middle // stages}) must be divisible by "
                f"virtual pipeline parallel degree ({v}) ({split})")
    return None


def hierarchical_cp(lay: Layout, model: ModelInfo) -> str | None:
    """megatron/training/arguments.py validate_args: `assert args.context_parallel_size ==
    prod(args.hierarchical_context_parallel_sizes)` (hierarchical CP, --cp-comm-type a2a+p2p)."""
    sizes = lay.hierarchical_cp
    if sizes and lay.cp != math.prod(sizes):
        return (f"context parallel size ({lay.cp}) must equal the product of --hierarchical-context-parallel-sizes "
                f"{' '.join(map(str, sizes))} ({math.prod(sizes)})")
    return None


def hybrid_cp_pipeline(lay: Layout, model: ModelInfo) -> str | None:
    """megatron/training/arguments.py validate_args: "Hybrid context parallelism not supported with
    pipeline parallelism" (--hybrid-context-parallel with pp > 1)."""
    if lay.hybrid_cp and lay.pp > 1:
        return (f"hybrid context parallelism (--hybrid-context-parallel) not supported with pipeline parallelism "
                f"(pipeline model parallel size {lay.pp})")
    return None


# Megatron-core's --recompute-modules choices (TransformerConfig.__post_init__, 0.19), and what each
# needs of the model to recompute anything. A searched value names a set joined by "+" ("layernorm+mlp"),
# injected as one option with several values (--recompute-modules layernorm mlp).
RECOMPUTE_MODULES = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts",
                     "gdn_norm_out")
# Not searchable: zenithtune does not read multi-latent or gated-delta-net attention from a model's shape.
UNMODELLED_MODULES = ("mla_up_proj", "gdn_norm_out")
MODULE_SEPARATOR = "+"
DEFAULT_MODULES = ("core_attn",)  # what Megatron-core recomputes under selective when no module is named


def module_set(value: object) -> tuple[str, ...]:
    """A searched module-set value ("layernorm+mlp") as Megatron's list of modules."""
    return tuple(part for part in str(value).split(MODULE_SEPARATOR) if part)


def candidate_modules(cand: Mapping[str, object]) -> tuple[str, ...]:
    """What a candidate's selective recompute re-runs (its module set, else Megatron's default); () when its
    recompute is not selective."""
    if cand.get("recompute_granularity") != "selective":
        return ()
    value = cand.get("recompute_modules")
    return module_set(value) if value else DEFAULT_MODULES


def module_set_problem(value: object) -> str | None:
    """Why a preset's module-set value cannot be searched (None: it can), one line naming the fix."""
    mods = module_set(value)
    unknown = [m for m in mods if m not in RECOMPUTE_MODULES]
    if not mods or unknown:
        return (f"recompute module set {value!r}: {unknown[0] if unknown else 'empty'} is not one of Megatron's "
                f"modules {list(RECOMPUTE_MODULES)}; join several with '{MODULE_SEPARATOR}' (layernorm+mlp)")
    odd = [m for m in mods if m in UNMODELLED_MODULES]
    if odd:
        return (f"recompute module set {value!r}: {odd[0]} is not searched (zenithtune does not model that "
                f"attention); write --recompute-modules in the command instead, which is then kept")
    return None


def module_idle(module: str, model: ModelInfo, local_impl: bool = False) -> str | None:
    """Why recomputing `module` re-runs nothing of this model, or cannot run (None: it acts): mlp on a model
    whose every layer is MoE, MoE modules on a dense model, shared_experts without them, layernorm on a
    dense model (TransformerLayer recomputes only a norm that is not an IdentityOp; TE's layer spec fuses
    both norms of a dense layer into the next linear, which keeps its input for the weight gradient, and
    only a MoE layer's pre-MLP norm is a norm of its own), and every module but core_attn with
    --transformer-impl local (real pretrain_gpt.py runs on CPU crashed or hung)."""
    moe = model.is_moe
    if module != "core_attn" and local_impl:
        # real pretrain_gpt.py, megatron-core 0.19, CPU, --transformer-impl local (tests/megatron): layernorm's
        # output-discarding checkpoint needs TE (CheckpointWithoutOutput: NameError FP8GlobalStateManager), and
        # mlp never finished its first iteration (CheckpointFunction.backward re-entering itself)
        return ("Megatron's module recompute beyond core_attn is built for Transformer Engine layers; with "
                "--transformer-impl local layernorm crashed and mlp hung (megatron-core 0.19)")
    if module == "layernorm" and not moe:
        return "Transformer Engine fuses a dense layer's norms into its linears"
    if module in ("moe", "moe_act", "shared_experts") and not moe:
        return "the model has no MoE layers"
    if module == "shared_experts" and not model.moe_shared_expert_size:
        return "the model has no shared experts"
    if module == "mlp" and moe and (model.moe_layer_freq or 1) == 1:
        return "every layer is MoE (no dense MLP to recompute)"
    return None


def recompute_modules(lay: Layout, model: ModelInfo) -> str | None:
    """megatron/core/transformer/transformer_config.py TransformerConfig.__post_init__: with selective
    recompute, "moe_act in recompute_modules is only supported with moe_grouped_gemm" (the modules are
    read only under selective granularity)."""
    if (lay.recompute_granularity == "selective" and lay.recompute_modules
            and "moe_act" in lay.recompute_modules and not lay.moe_grouped_gemm):
        return ("moe_act in recompute_modules is only supported with moe_grouped_gemm (selective recompute with "
                "--recompute-modules " + " ".join(lay.recompute_modules) + "; add --moe-grouped-gemm)")
    return None


def recompute_options(lay: Layout, model: ModelInfo) -> str | None:
    """megatron/core/transformer/transformer_config.py TransformerConfig.__post_init__: granularity
    full|selective; full needs a method (uniform|block) and --recompute-num-layers; selective forbids
    --recompute-num-layers; arguments.py validate_args: selective forbids a method.

    Megatron does NOT check --recompute-num-layers against the layers per stage: a uniform chunk that
    does not divide the stage and a block count above it run (the runtime clips them); see the
    `recompute_chunk` policy. A method without a granularity is ignored by Megatron."""
    g, m, n = lay.recompute_granularity, lay.recompute_method, lay.recompute_num_layers
    if g is None:
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
    if n is None:
        per_stage = lay.layers_per_stage(model.num_layers)
        return ("full recompute needs --recompute-num-layers"
                + (f" between 1 and the layers per pipeline stage ({per_stage})" if per_stage else "") + " (got None)")
    return None


def moe_needs_sequence_parallel(lay: Layout, model: ModelInfo) -> str | None:
    """megatron/core/transformer/moe/moe_layer.py MoELayer.forward raises "During training,
    performance may degrade if MoE and tensor parallelism are enabled without also enabling sequence
    parallelism" (sequence parallelism is silently off at tp == 1)."""
    if model.is_moe and lay.tp > 1 and not lay.sequence_parallel:
        why = " (the command's --transformer-impl local cannot run it)" if lay.local_impl else " (add --sequence-parallel)"
        return (f"during training, performance may degrade if MoE ({model.num_experts} experts) and tensor "
                f"parallelism (tensor model parallel size {lay.tp}) are enabled without also enabling sequence "
                f"parallelism{why}")
    return None


def local_impl_sequence_parallel(lay: Layout, model: ModelInfo) -> str | None:
    """megatron/core/transformer/torch_norm.py WrappedTorchNorm: `assert not config.sequence_parallel,
    "sequence parallel not supported by torch LayerNorm"` (--transformer-impl local)."""
    if lay.local_impl and lay.sp_active:
        return ("sequence parallel not supported by torch LayerNorm (--transformer-impl local); "
                "drop --sequence-parallel or use --transformer-impl transformer_engine")
    return None


def local_impl_context_parallel(lay: Layout, model: ModelInfo) -> str | None:
    """megatron/core/transformer/dot_product_attention.py DotProductAttention.__init__: `assert
    self.config.context_parallel_size == 1, "Context parallelism is only supported by
    TEDotProductAttention!"`: --transformer-impl local builds its attention from this class (the
    local layer spec); only Transformer Engine's attention runs a CP ring (Megatron-LM main, Dec 2026)."""
    if lay.local_impl and lay.cp > 1:
        return (f"context parallelism (context parallel size {lay.cp}) is only supported by TEDotProductAttention; "
                "the command's --transformer-impl local cannot run it (cp=1, or --transformer-impl transformer_engine)")
    return None


def tp_comm_overlap_needs_sp(lay: Layout, model: ModelInfo) -> str | None:
    """megatron/training/arguments.py validate_args: "Tensor parallel communication/GEMM overlap can
    happen only when sequence parallelism is enabled" (sequence parallelism is off at tp == 1)."""
    if lay.tp_comm_overlap and not lay.sp_active:
        return (f"tensor parallel communication/GEMM overlap (--tp-comm-overlap) can happen only when "
                f"sequence parallelism is enabled (tp={lay.tp}, sequence parallel "
                f"{'on' if lay.sequence_parallel else 'off'})")
    return None


def moe_a2a_overlap(lay: Layout, model: ModelInfo) -> str | None:
    """megatron/core/transformer/transformer_config.py TransformerConfig.__post_init__, under
    `if self.overlap_moe_expert_parallel_comm` (core 0.19): "only supported with expert model
    parallelism"; "supported with alltoall/flex token dispatcher"; "disable full recomputation"
    (and any recompute method / layer count, which only full recompute sets); "disable moe in
    recompute_modules"; "disable moe_shared_expert_overlap"; and at pp > 1 "virtual_pipeline_model_
    parallel_size must be specified" (the combined 1F1B schedule pairs one micro-batch's forward with
    another's backward inside the interleaved schedule)."""
    if not lay.moe_a2a_overlap:
        return None
    what = "overlap_moe_expert_parallel_comm (--overlap-moe-expert-parallel-comm)"
    if not model.is_moe or lay.ep <= 1:
        return f"{what} is only supported with expert model parallelism (ep={lay.ep})"
    if lay.moe_dispatcher not in ("alltoall", "flex"):
        return (f"{what} is supported with alltoall/flex token dispatcher (--moe-token-dispatcher-type "
                f"{lay.moe_dispatcher}): add --moe-token-dispatcher-type alltoall to search it")
    if lay.recompute_granularity == "full":
        return f"disable full recomputation when enabling {what}"
    if "moe" in lay.selective_modules:
        return f"disable moe in recompute_modules when enabling {what}"
    if lay.moe_shared_expert_overlap:
        return f"disable moe_shared_expert_overlap when enabling {what}"
    if lay.pp > 1 and lay.virtual_stages(model.num_layers) <= 1:
        return (f"if enabling EP A2A overlap ({what}), virtual_pipeline_model_parallel_size must be specified "
                f"when pipeline_model_parallel_size > 1 (pp={lay.pp})")
    return None


def distribute_saved_activations(lay: Layout, model: ModelInfo) -> str | None:
    """megatron/training/arguments.py validate_args: --distribute-saved-activations needs tp > 1, full
    recompute and a recompute method; transformer_config.py TransformerConfig.__post_init__: "must be
    false when sequence parallel is enabled"."""
    if not lay.distribute_saved_activations:
        return None
    if lay.tp <= 1:
        return "can distribute recomputed activations (--distribute-saved-activations) only across tensor model parallel groups (tp=1)"
    if lay.recompute_granularity != "full" or lay.recompute_method is None:
        return ("distributed recompute activations (--distribute-saved-activations) is only applicable to full "
                f"recompute granularity with a method (got {lay.recompute_granularity or 'none'})")
    if lay.sp_active:
        return "--distribute-saved-activations must be off when sequence parallel is enabled"
    return None


def moe_etp_bias(lay: Layout, model: ModelInfo) -> str | None:
    """megatron/core/transformer/transformer_config.py TransformerConfig.__post_init__: "Bias in Moe
    is only supported when ETP==1" (add_bias_linear is on unless --disable-bias-linear)."""
    if model.is_moe and lay.expert_tp > 1 and model.disable_bias_linear is False:
        return (f"expert tensor parallel size ({lay.expert_tp}) > 1 does not support bias in linear "
                f"layers; add --disable-bias-linear")
    return None


# --- zenithtune's policy (kind "policy"): preferences, each switchable with prune.policy.<name> ------

def etp_not_above_tp(lay: Layout, model: ModelInfo) -> str | None:
    """Policy: expert TP wider than dense TP only adds communication. Megatron accepts it."""
    if lay.etp is not None and lay.etp > lay.tp:
        return f"etp ({lay.etp}) > tp ({lay.tp}): expert TP wider than dense TP only adds communication"
    return None


def etp_only_for_moe(lay: Layout, model: ModelInfo) -> str | None:
    """Policy: ETP has no effect on a dense model (a duplicate run). Megatron accepts it."""
    if lay.etp not in (None, lay.tp) and model.num_experts is not None and not model.is_moe:
        return f"etp ({lay.etp}) has no effect on a dense model"
    return None


def cp_only_when_seq_known_fits(lay: Layout, model: ModelInfo) -> str | None:
    """Policy: fewer than 1024 tokens per CP rank cannot hide the ring's traffic. Megatron accepts it."""
    s = model.seq_length
    if lay.cp > 1 and s and s // lay.cp < 1024:
        return f"cp ({lay.cp}) leaves {s // lay.cp} tokens per rank (< 1024): the ring cannot hide its traffic"
    return None


def recompute_chunk(lay: Layout, model: ModelInfo) -> str | None:
    """Policy: a block count above the layers per stage runs exactly like the whole stage (Megatron
    clips it: a duplicate run), and a uniform chunk that does not divide the stage leaves a ragged last
    chunk. Megatron accepts both."""
    if lay.recompute_granularity != "full" or not lay.recompute_num_layers:
        return None
    per_stage = lay.layers_per_stage(model.num_layers)
    if not per_stage:
        return None
    n = lay.recompute_num_layers
    if lay.recompute_method == "block" and n > per_stage:
        return (f"block recompute of {n} layers exceeds the layers per pipeline stage ({per_stage}): it runs "
                f"like {per_stage} (Megatron clips it)")
    if lay.recompute_method == "uniform" and per_stage % n:
        return f"uniform recompute chunk ({n}) does not divide the layers per pipeline stage ({per_stage})"
    return None


def vlm_full_uniform_only(lay: Layout, model: ModelInfo) -> str | None:
    """Policy (upstream ZenithTune): VLMs recompute only with full/uniform. Megatron accepts the rest."""
    if not model.is_vlm:
        return None
    if lay.recompute_granularity == "selective":
        return ("VLM: selective recompute is not tried (upstream disables it for VLMs; "
                "set prune.policy.vlm_full_uniform_only=false to allow it)")
    if lay.recompute_method == "block":
        return ("VLM: only the uniform recompute method is tried (upstream disables block for VLMs; "
                "set prune.policy.vlm_full_uniform_only=false to allow it)")
    return None


RULES: tuple[Rule, ...] = (
    Rule("world_divisible", "megatron", world_divisible, "every GPU needs a place on the tp x pp x cp x dp grid"),
    Rule("expert_grid", "megatron", expert_grid_divisible, "experts live on a second grid etp x ep x pp x expert-dp"),
    Rule("experts", "megatron", experts_divisible, "each EP rank holds num_experts/ep whole experts"),
    Rule("tp_heads", "megatron", tp_divides_heads, "TP splits attention heads across ranks"),
    Rule("tp_query_groups", "megatron", tp_fits_query_groups, "TP splits (or replicates) KV groups"),
    Rule("tp_ffn", "megatron", tp_divides_ffn, "TP splits the MLP width, expert TP the experts' width"),
    Rule("hidden_heads", "megatron", hidden_divides_heads, "head dim is hidden/heads without --kv-channels"),
    Rule("cp_seq", "megatron", cp_divides_seq, "CP splits the sequence into 2·cp balanced chunks"),
    Rule("gbs", "megatron", gbs_divisible, "each iteration is a whole number of micro-batches per DP rank"),
    Rule("pp_layers", "megatron", pp_divides_layers, "an even pipeline gives every stage the same layers"),
    Rule("virtual_pipeline", "megatron", virtual_pipeline, "interleaving splits each stage into equal chunks"),
    Rule("pipeline_layout", "megatron", pipeline_layout, "a pipeline layout lists a whole number of stages per pp rank"),
    Rule("uneven_pipeline", "megatron", uneven_pipeline,
         "the middle stages share what the first and last stages leave, evenly"),
    Rule("hierarchical_cp", "megatron", hierarchical_cp, "hierarchical CP fixes cp to the product of its levels"),
    Rule("hybrid_cp", "megatron", hybrid_cp_pipeline, "hybrid CP has no pipeline schedule"),
    Rule("recompute", "megatron", recompute_options, "recompute options must be consistent"),
    Rule("recompute_modules", "megatron", recompute_modules, "moe_act recompute works on grouped GEMM experts"),
    Rule("moe_sequence_parallel", "megatron", moe_needs_sequence_parallel, "MoE with TP requires SP"),
    Rule("local_impl_sequence_parallel", "megatron", local_impl_sequence_parallel,
         "the local implementation's torch LayerNorm refuses SP"),
    Rule("local_impl_context_parallel", "megatron", local_impl_context_parallel,
         "the local implementation's attention has no CP ring"),
    Rule("tp_comm_overlap", "megatron", tp_comm_overlap_needs_sp, "TP comm overlap works on SP's collectives"),
    Rule("moe_a2a_overlap", "megatron", moe_a2a_overlap,
         "EP all-to-all overlap pairs micro-batches: EP, an all-to-all dispatcher, no full recompute, VPP at pp > 1"),
    Rule("distribute_saved_activations", "megatron", distribute_saved_activations,
         "distributing the saved layer input needs TP, full recompute and no SP"),
    Rule("moe_etp_bias", "megatron", moe_etp_bias, "expert TP cannot shard biases"),
    Rule("etp_le_tp", "policy", etp_not_above_tp, "ETP beyond TP adds traffic and never saves memory the dense part needs"),
    Rule("etp_dense", "policy", etp_only_for_moe, "ETP only applies to expert layers"),
    Rule("cp_short_seq", "policy", cp_only_when_seq_known_fits, "CP on short sequences is pure overhead"),
    Rule("recompute_chunk", "policy", recompute_chunk,
         "block counts above the stage duplicate the whole stage; uniform chunks should divide it"),
    Rule("vlm_full_uniform_only", "policy", vlm_full_uniform_only,
         "upstream ZenithTune recomputes VLMs only with full/uniform"),
)

POLICIES: tuple[str, ...] = tuple(r.name for r in RULES if r.kind == "policy")
"""The switchable rules, in report order: `prune.policy.<name>: true|false` (all on by default)."""

RULE_KINDS: dict[str, RuleKind] = {r.name: r.kind for r in RULES}


def check(lay: Layout, model: ModelInfo, *, kinds: tuple[RuleKind, ...] = ("megatron", "policy"),
          rules: tuple[Rule, ...] | None = None, skip: Collection[str] = ()) -> list[tuple[str, str]]:
    """Every broken rule as (rule name, reason); empty means valid.

    `skip` names rules the caller has switched off (only ``policy`` rules may be: Megatron's own
    rules are not optional)."""
    unknown = set(skip) - set(POLICIES)
    if unknown:
        raise ValueError(f"check(skip={sorted(unknown)}): only policy rules can be switched off; they are "
                         f"{list(POLICIES)}")
    out: list[tuple[str, str]] = []
    for rule in rules if rules is not None else RULES:
        if rule.kind not in kinds or rule.name in skip:
            continue
        reason = rule.check(lay, model)
        if reason:
            out.append((rule.name, reason))
    return out


def command_errors(flags: CommandFacts) -> list[str]:
    """What Megatron refuses in the command itself, whatever the candidate: the tuner refuses such a
    command before launch (preflight), the simulator exits as Megatron does. Each names the fix.

    megatron/training/arguments.py validate_args: "--overlap-param-gather only supported with
    distributed optimizer ..." and "Must use --overlap-param-gather with --overlap-grad-reduce";
    "--hierarchical-context-parallel-sizes must be set when a2a+p2p is used in cp comm"; "No more
    than one of the following arguments can be set at the same time: --num-layers-per-virtual-
    pipeline-stage, --num-virtual-stages-per-pipeline-rank, --pipeline-model-parallel-layout"; hybrid
    context parallelism "only supported with single dataloader type" and "must be used with
    --calculate-per-token-loss". megatron/core/transformer/transformer_config.py
    TransformerConfig.__post_init__: "pipeline_model_parallel_layout cannot be set with other pipeline
    layout arguments"; first/last stage layers "cannot be set at the same time with
    account_for_embedding_in_pipeline_split and account_for_loss_in_pipeline_split"; "...must be larger
    than 0". PipelineParallelLayerLayout: the layout string itself (`layout_problem`).

    ms-swift (`megatron sft`) defaults to the distributed optimizer, so there only
    `--use_distributed_optimizer false` makes --overlap_param_gather invalid."""
    out: list[str] = []
    if flags.overlap_param_gather and not flags.distributed_optimizer:
        out.append("--overlap-param-gather only supported with distributed optimizer: add "
                   "--use-distributed-optimizer or drop --overlap-param-gather")
    if flags.overlap_param_gather and not flags.overlap_grad_reduce:
        out.append("must use --overlap-param-gather with --overlap-grad-reduce: add --overlap-grad-reduce or "
                   "drop --overlap-param-gather")
    if any("a2a+p2p" in t for t in flags.cp_comm_types) and not flags.hierarchical_cp:
        out.append("--hierarchical-context-parallel-sizes must be set when a2a+p2p is used in cp comm "
                   "(--cp-comm-type " + " ".join(flags.cp_comm_types) + ")")
    vpp = [name for name, on in (("--num-layers-per-virtual-pipeline-stage", flags.layers_per_virtual_stage),
                                 ("--num-virtual-stages-per-pipeline-rank", flags.virtual_stages),
                                 ("--pipeline-model-parallel-layout", flags.pipeline_layout)) if on]
    if len(vpp) > 1 and flags.trainer == "megatron":
        out.append(f"no more than one of {', '.join(vpp)} can be set at the same time: keep one")
    uneven = [name for name, n in (("--decoder-first-pipeline-num-layers", flags.first_stage_layers),
                                   ("--decoder-last-pipeline-num-layers", flags.last_stage_layers))
              if n is not None]
    for name, n in (("first", flags.first_stage_layers), ("last", flags.last_stage_layers)):
        if n is not None and n <= 0:
            out.append(f"num_layers_in_{name}_pipeline_stage must be larger than 0 "
                       f"(--decoder-{name}-pipeline-num-layers {n})")
    account = [name for name, on in (("--account-for-embedding-in-pipeline-split", flags.account_for_embedding),
                                     ("--account-for-loss-in-pipeline-split", flags.account_for_loss)) if on]
    if flags.pipeline_layout:
        problem = layout_problem(flags.pipeline_layout)
        if problem:
            out.append(problem)
        if uneven or account:
            out.append(f"pipeline_model_parallel_layout cannot be set with other pipeline layout arguments "
                       f"({', '.join(uneven + account)}): keep the layout or drop it")
    elif uneven and account:
        out.append(f"{' and '.join(uneven)} cannot be set at the same time with {' and '.join(account)}: "
                   f"keep one way of splitting the pipeline")
    if flags.hybrid_cp:
        if flags.dataloader_type not in (None, "single"):
            out.append(f"hybrid context parallelism only supported with single dataloader type "
                       f"(--dataloader-type {flags.dataloader_type})")
        if not flags.per_token_loss:
            out.append("hybrid context parallelism must be used with --calculate-per-token-loss: add it")
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
    seen: Mapping[str, str] = os.environ if env is None else env
    missing = {k: v for k, v in required_env(lay, gpu).items() if seen.get(k) != v}
    return [f"using tensor/context parallelism (tp={lay.tp}, cp={lay.cp}) requires setting the environment "
            f"variable {k} to {v}" for k, v in missing.items()]
