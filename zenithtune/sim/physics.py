"""The simulator's memory truth per GPU (and the model's shape, FLOPs and parameters it rests on).

This is what the simulated GPU *holds*, not what a tuner can know: it carries allocator fragmentation,
NCCL buffers, MoE load imbalance and workspaces a tuner never sees. The tuner's own estimate lives in
zenithtune/memory.py and must never import this module (only the simulator and benchmarks do).
Time per iteration is zenithtune.sim.timing.

Per GPU (MEGATRON.md §Memory): bf16 weights, fp32 main grads, fp32 master weights + Adam moments
(sharded over DP x CP with the distributed optimizer; expert parameters over expert-DP), activations of
the micro-batches in flight on the stage (Korthikanti et al. generalised to GQA / SwiGLU / MoE, with
sequence parallelism, selective / full recompute, CP and interleaving), the logits and loss on the last
stage, the vision tower on the first; then the caching allocator's fragmentation, the CUDA context
and NCCL buffers on top.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from zenithtune.sim.arguments import SimConfig

GIB = 1024 ** 3

# --- constants of the simulated GPU's memory ----------------------------------------------------------
MOE_IMBALANCE = 1.12  # busiest expert rank's load over the mean (dropless routing)
LOGITS_BYTES = 8.0  # bytes per logit element held at the loss: bf16 logits + fp32 softmax + its gradient
CUDA_CONTEXT_GIB = 0.55  # CUDA context + cuBLAS/TE workspaces, outside the caching allocator
NCCL_GIB_PER_GROUP = 0.18  # NCCL buffers per communicator a rank belongs to
WORKSPACE_GIB = 0.35  # TE/cuBLAS workspaces and small tensors inside the allocator


@dataclass(frozen=True)
class Shape:
    """The model and layout reduced to the numbers the physics uses (one rank's view)."""

    L: int  # layers
    h: int  # hidden size
    F: int  # FFN hidden size (dense layers)
    a: int  # attention heads
    g: int  # query groups
    d: int  # head dim
    V: int  # padded vocabulary
    s: int  # sequence length
    E: int  # experts (0: dense)
    k: int  # router top-k
    Fm: int  # expert FFN hidden size
    Fs: int  # shared-expert FFN hidden size (0: none)
    L_moe: int  # MoE layers
    gated: int  # weight matrices per MLP: 3 with SwiGLU, else 2
    t: int  # tensor parallel
    p: int  # pipeline parallel
    c: int  # context parallel
    e: int  # expert parallel
    et: int  # expert tensor parallel
    dp: int  # data parallel (N / t·p·c)
    edp: int  # expert data parallel (N / et·e·p)
    b: int  # micro-batch size
    m: int  # micro-batches per iteration
    v: int  # model chunks per pipeline rank (interleaving)
    sp: bool  # sequence parallelism active
    gpn: int  # GPUs per node

    @property
    def tok(self) -> int:
        """Tokens of one micro-batch on one CP rank (the M dimension of every GEMM)."""
        return self.b * self.s // self.c

    @property
    def layers_per_stage(self) -> int:
        return self.L // self.p

    @property
    def moe_per_stage(self) -> float:
        return self.L_moe / self.p

    @property
    def g_rank(self) -> float:
        """KV groups held by one TP rank (replicated when TP exceeds the groups)."""
        return max(self.g / self.t, 1.0)


def shape_of(cfg: SimConfig) -> Shape:
    mod, lay = cfg.model, cfg.layout
    L, h, a = mod.num_layers, mod.hidden_size, mod.num_attention_heads
    E = mod.num_experts or 0
    freq = mod.moe_layer_freq or 1
    L_moe = len(range(0, L or 0, freq)) if E > 1 else 0
    # The simulator's arguments resolve every size (sim.arguments), so none is None here.
    return Shape(
        L=L, h=h, F=mod.ffn_hidden_size, a=a, g=mod.num_query_groups or a, d=mod.head_dim, V=mod.vocab_size,  # type: ignore[arg-type]
        s=mod.seq_length, E=E, k=mod.moe_router_topk or 0, Fm=mod.moe_ffn_hidden_size or 0,  # type: ignore[arg-type]
        Fs=mod.moe_shared_expert_size or 0, L_moe=L_moe, gated=3 if mod.swiglu else 2,
        t=lay.tp, p=lay.pp, c=lay.cp, e=lay.ep, et=lay.expert_tp, dp=lay.dp, edp=max(lay.expert_dp, 1),
        b=lay.mbs, m=lay.microbatches, v=lay.virtual_stages(L), sp=lay.sp_active, gpn=cfg.gpus_per_node)


# --- FLOPs -------------------------------------------------------------------------------------------

def model_flops(cfg: SimConfig) -> float:
    """Model FLOPs of one iteration, Megatron's formula (MEGATRON.md): causal attention once, no recompute."""
    x = shape_of(cfg)
    B = cfg.layout.gbs
    L_dense = x.L - x.L_moe
    mlp = x.gated * x.F * L_dense + x.gated * (x.Fm * x.k + x.Fs) * x.L_moe
    attn = x.L * (x.h * (x.a * x.d + 2 * x.g * x.d) + x.a * x.d * x.h)
    return 6.0 * B * x.s * (x.h * mlp + attn + x.h * x.V) + 6.0 * B * x.s * x.s * x.L * x.a * x.d


# --- parameters and memory ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Params:
    """Parameters held by one rank of a pipeline stage."""

    dense: float  # replicated over the DP x CP group
    expert: float  # replicated over the expert-DP group


def _layer_dense_params(x: Shape, bias: bool, moe: bool) -> float:
    attn = x.h * (x.a * x.d + 2 * x.g * x.d) + x.a * x.d * x.h + (x.a * x.d + 2 * x.g * x.d + x.h if bias else 0)
    per_rank = attn / x.t + 2 * x.h
    if moe:
        per_rank += x.h * x.E + x.gated * x.h * x.Fs / x.t
    else:
        per_rank += (x.gated * x.h * x.F + (x.F + x.h if bias else 0)) / x.t
    return per_rank


def stage_params(cfg: SimConfig, stage: int) -> Params:
    x = shape_of(cfg)
    bias = not cfg.model.disable_bias_linear
    ls = x.layers_per_stage
    moe_layers = x.moe_per_stage
    dense = (ls - moe_layers) * _layer_dense_params(x, bias, False) + moe_layers * _layer_dense_params(x, bias, True)
    first, last = stage == 0, stage == x.p - 1
    if first:
        dense += x.V * x.h / x.t
        if cfg.vision is not None:
            vis = cfg.vision
            dense += vis.num_layers * (4 * vis.hidden_size ** 2 + 2 * vis.hidden_size * vis.ffn_hidden_size) / x.t
            dense += vis.hidden_size * 4 * x.h / x.t  # projector
    if last and (not cfg.model.tie_embeddings or x.p > 1):
        dense += x.V * x.h / x.t  # output layer (a tied copy lives on the last stage too)
    if last:
        dense += x.h  # final norm
    expert = moe_layers * (x.E / x.e) * x.gated * x.h * x.Fm / x.et
    return Params(dense=dense, expert=expert)


def total_params(cfg: SimConfig) -> float:
    """Whole-model parameter count (what Megatron reports summed over ranks)."""
    x = shape_of(cfg)
    bias = not cfg.model.disable_bias_linear
    one = Shape(**{**x.__dict__, "t": 1, "p": 1, "e": 1, "et": 1})
    dense = (x.L - x.L_moe) * _layer_dense_params(one, bias, False) + x.L_moe * _layer_dense_params(one, bias, True)
    dense += x.V * x.h * (1 if cfg.model.tie_embeddings else 2) + x.h
    return dense + x.L_moe * x.E * x.gated * x.h * x.Fm


@dataclass(frozen=True)
class StageMemory:
    """Bytes on the most loaded rank of one pipeline stage."""

    stage: int
    weights: float  # bf16 (or fp32) parameters
    grads: float  # fp32 main grads (Megatron accumulates and reduces bf16 runs in fp32)
    optimizer: float  # fp32 master weights + Adam moments (sharded with the distributed optimizer)
    activations: float  # saved activations of the micro-batches in flight
    transient: float  # peak working set on top: logits + loss, recompute chunk, workspaces
    largest_alloc: float  # the single biggest allocation of the step (the one that fails first)
    largest_site: str  # the Megatron source file that makes it (for the OOM traceback)

    @property
    def static(self) -> float:
        return self.weights + self.grads + self.optimizer

    @property
    def peak_allocated(self) -> float:
        return self.static + self.activations + self.transient


def _layer_activation_bytes(cfg: SimConfig, x: Shape, moe: bool, stored: str) -> float:
    """Saved bytes of one layer for one micro-batch on one rank (Korthikanti et al., generalised to
    GQA, SwiGLU, MoE and dropout-free runs). stored: "all" | "selective" | "input" (full recompute)."""
    seq_split = x.t if x.sp else 1
    act = cfg.perturb.activations
    if stored == "input":
        return act * 2.0 * x.h * x.tok / seq_split
    masks = (2 if cfg.hidden_dropout > 0 else 0)  # two 1-byte dropout masks per token x h
    seq_part = (8.0 + masks) * x.h  # LN inputs, QKV and FC1 inputs (2 bytes each) + masks
    qkv = 2.0 * (x.a * x.d / x.t + 2 * x.d * x.g_rank)
    tensor_part = qkv + 2.0 * x.a * x.d / x.t + 4.0 * x.a / x.t  # Q,K,V + attention output + softmax stats
    # selective recompute drops what its modules re-run (Megatron-core --recompute-modules; default core_attn)
    mods = cfg.layout.selective_modules if stored == "selective" else ()
    if "layernorm" in mods:
        # the norms' outputs (the QKV and FC1 inputs) are re-made in the backward where a norm is a module
        # of its own: both with the local implementation; with TE only a MoE layer's pre-MLP norm (TE fuses
        # the others into the next linear, which keeps its input)
        seq_part -= 4.0 * x.h if cfg.layout.local_impl else 2.0 * x.h if moe else 0.0
    if moe:
        if "moe" not in mods:  # (recomputing `moe` re-runs the whole MoE part from its input, kept above)
            # FC1 output(s) and, unless moe_act re-runs it, the activation output (Fm wide) per routed copy
            kept = 2.0 * x.gated * x.Fm - (2.0 * x.Fm if "moe_act" in mods else 0.0)
            if cfg.flavour.expert_split == "etp":  # tokens gathered over TP, the expert FFN split over ETP
                expert = x.k * MOE_IMBALANCE * (4.0 * x.h + kept / x.et)
            else:
                expert = x.k * MOE_IMBALANCE * (4.0 * x.h + kept) / x.t  # routed copies, FC1, act
            shared = 2.0 * x.gated * x.Fs / x.t if x.Fs and "shared_experts" not in mods else 0.0
            # the perturbation scales the routed part on its own; `act` below scales the rest
            tensor_part += expert * cfg.perturb.expert_activations / act + shared + 4.0 * x.E / x.t
    elif "mlp" not in mods:
        tensor_part += 2.0 * x.gated * x.F / x.t  # FC1 output(s) + activation output
    per_token = seq_part / seq_split + tensor_part
    if not cfg.flash_attention and (stored == "all" or (stored == "selective" and "core_attn" not in mods)):
        # unfused attention keeps softmax (2), its dropout mask (1) and output (2) per score
        per_score = 5.0 if cfg.attention_dropout > 0 else 2.0
        per_token += per_score * x.a * (x.s / x.c) / x.t
    return act * per_token * x.tok


def stage_memory(cfg: SimConfig, stage: int) -> StageMemory:
    x = shape_of(cfg)
    lay = cfg.layout
    prm = stage_params(cfg, stage)
    if cfg.bf16:
        w_bytes, g_bytes, o_bytes = 2.0, 4.0, 12.0
    else:
        w_bytes, g_bytes, o_bytes = 4.0, 4.0, 8.0
    dense_shards = x.dp * x.c if cfg.distributed_optimizer else 1
    expert_shards = x.edp if cfg.distributed_optimizer else 1
    pert = cfg.perturb
    weights = (prm.dense + prm.expert) * w_bytes * pert.weights
    grads = (prm.dense + prm.expert) * g_bytes * pert.weights
    optimizer = o_bytes * (prm.dense / dense_shards + prm.expert / expert_shards)
    if cfg.distributed_optimizer:
        optimizer += 0.02 * (prm.dense + prm.expert) * g_bytes  # shard padding and bucket alignment
    optimizer *= pert.optimizer

    # micro-batches whose activations stage `stage` holds at the 1F1B peak
    if x.v > 1:
        in_flight = min(float(x.m), (x.p - stage) + (x.p - 1) / x.v)
    else:
        in_flight = float(min(x.m, x.p - stage))
    in_flight = max(in_flight, 1.0)
    if lay.moe_a2a_overlap:  # the combined 1F1B schedule warms up one more micro-batch (schedules.py)
        in_flight = min(float(x.m), in_flight + 1.0) if x.m > 1 else in_flight
    ls = x.layers_per_stage
    moe_frac = x.moe_per_stage / ls if ls else 0.0

    def per_layer(stored: str) -> float:
        return ((1 - moe_frac) * _layer_activation_bytes(cfg, x, False, stored)
                + moe_frac * _layer_activation_bytes(cfg, x, True, stored))

    granularity = lay.recompute_granularity
    full_layer = per_layer("all")
    if granularity == "full":
        n = lay.recompute_num_layers or 1
        if lay.recompute_method == "uniform":
            saved = math.ceil(ls / n) * per_layer("input")
            working = min(n, ls) * full_layer
        else:  # block: the first n layers of the stage keep only their input
            n = min(n, ls)
            saved = n * per_layer("input") + (ls - n) * full_layer
            working = full_layer if n else 0.0
    else:
        saved = ls * (per_layer("selective") if granularity == "selective" else full_layer)
        working = 0.5 * full_layer  # the backward of one layer allocates its gradients
    seq_split = x.t if x.sp else 1
    embed_out = (2.0 + (1 if cfg.hidden_dropout > 0 else 0)) * x.h * x.tok / seq_split if stage == 0 else 0.0
    embed_out *= pert.activations
    activations = in_flight * (saved + embed_out)
    if stage == 0 and cfg.vision is not None:
        vis = cfg.vision
        vtok = x.b * vis.tokens
        per_vit_layer = (30.0 * vis.hidden_size + 4.0 * vis.ffn_hidden_size) * vtok / x.t
        vit = (vis.num_layers * 2.0 * vis.hidden_size * vtok / x.t + per_vit_layer) if vis.checkpointing \
            else vis.num_layers * per_vit_layer
        activations += in_flight * vit * pert.activations

    flav = cfg.flavour
    if flav.mbs_growth:  # per-micro-batch buffers that grow faster than b (sim/flavours.py)
        growth = 1.0 + flav.mbs_growth * (x.b - 1)
        activations *= growth
        working *= growth
    logits = LOGITS_BYTES * x.tok * x.V / x.t * pert.logits if stage == x.p - 1 else 0.0
    transient = working + logits + WORKSPACE_GIB * GIB
    if flav.memory_scale != 1.0:
        scale = flav.memory_scale
        weights, grads, optimizer = weights * scale, grads * scale, optimizer * scale
        activations, transient = activations * scale, transient * scale
    candidates = {  # the single biggest allocations of a step, by where they happen
        "megatron/core/tensor_parallel/cross_entropy.py": 4.0 * x.tok * x.V / x.t * pert.logits if logits else 0.0,
        "megatron/core/transformer/mlp.py": 2.0 * x.tok * max(x.gated - 1, 1) * (x.F or x.Fm) / x.t,
        "megatron/core/transformer/transformer_layer.py": 2.0 * x.tok * x.h,
    }
    site = max(candidates, key=lambda k: candidates[k])
    return StageMemory(stage, weights, grads, optimizer, activations, transient, candidates[site], site)


@dataclass(frozen=True)
class MemoryReport:
    """What the most loaded GPU sees (and what `torch.cuda` would say about it)."""

    stages: tuple[StageMemory, ...]
    worst: StageMemory  # the stage whose GPU needs the most
    reserved_peak: float  # caching allocator's peak reservation on that GPU
    non_torch: float  # CUDA context and NCCL buffers
    capacity: float

    @property
    def in_use_peak(self) -> float:
        return self.reserved_peak + self.non_torch

    @property
    def oom(self) -> bool:
        return self.in_use_peak > self.capacity


def fragmentation(cfg: SimConfig) -> float:
    """Reserved over allocated at the peak: varied tensor sizes fragment the caching allocator."""
    x = shape_of(cfg)
    if cfg.flavour.fragmentation == "recompute_mbs":  # sim/flavours.py: the law depends on recompute and MBS
        granularity = cfg.layout.recompute_granularity
        return (1.02 + 0.035 * math.log2(x.b) + {"full": 0.10, "selective": 0.04}.get(granularity or "", 0.0)
                + (0.05 if x.E > 1 else 0.0))
    frag = 1.04
    if x.E > 1:
        frag += 0.05  # per-expert token counts change every step
    if x.v > 1:
        frag += 0.02
    if cfg.layout.recompute_granularity == "full":
        frag += 0.02
    return frag


def nccl_groups(cfg: SimConfig) -> int:
    x = shape_of(cfg)
    sizes = (x.t, x.p, x.c, x.dp * x.c, x.e if x.E > 1 else 1, x.et if x.E > 1 else 1, x.edp if x.E > 1 else 1)
    return sum(1 for n in sizes if n > 1)


def memory(cfg: SimConfig) -> MemoryReport:
    x = shape_of(cfg)
    stages = tuple(stage_memory(cfg, i) for i in sorted({0, x.p - 1}))
    frag = fragmentation(cfg)
    worst = max(stages, key=lambda st: st.peak_allocated)
    reserved = worst.peak_allocated * frag + 0.25 * GIB
    non_torch = (CUDA_CONTEXT_GIB + NCCL_GIB_PER_GROUP * nccl_groups(cfg) + cfg.flavour.overhead_gib) * GIB
    if cfg.tp_comm_overlap and x.t > 1:
        # Transformer Engine's userbuffers (registered outside the caching allocator): the gathered
        # sequence at hidden width for QKV, projection and FC2 forward and backward, FC1's at ffn/t
        width = (x.F or x.Fm) * (x.gated - 1) / x.t
        non_torch += 2.0 * x.b * x.s / x.c * (7 * x.h + 2 * width)
    return MemoryReport(stages, worst, reserved, non_torch, cfg.gpu.capacity_gib * GIB)
