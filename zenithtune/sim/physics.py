"""The simulator's physics: memory truth per GPU and time per iteration (MEGATRON.md is the spec).

This is what the simulated GPU *does*, not what a tuner can know: it carries allocator fragmentation,
NCCL buffers, load imbalance and efficiencies a tuner never sees. The tuner's own estimate lives in
zenithtune/memory.py and must never import this module (only the simulator and benchmarks do).

Time: every rank runs its pipeline stage's layers for each micro-batch; a layer costs its GEMMs (the
efficiency of a GEMM saturates with its size), attention, memory-bound elementwise work, and the part
of its TP / CP / EP communication that is not hidden. Stages form a 1F1B (or interleaved) pipeline;
data-parallel gradient sync and the optimizer step close the iteration.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from zenithtune.sim.arguments import SimConfig

GIB = 1024 ** 3

# --- calibration constants (fitted once against MEGATRON.md §Calibration; see sim/calibrate.py) ------
GROUPED_GEMM_FACTOR = 0.88  # MoE grouped GEMMs run below a plain GEMM of the same shape
ATTN_BWD_RATIO = 0.78  # flash-attention backward runs at this fraction of its forward efficiency
ATTN_SEQ_HALF = 384.0  # attention efficiency halves at this many tokens per rank
HBM_EFFICIENCY = 0.75  # memory-bound kernels reach this fraction of HBM bandwidth
SEQ_ELEMENTWISE_BYTES = 36.0  # per token x h per layer fwd: norms, residual adds, dropouts
LAYER_OVERHEAD_S = 35e-6  # per layer per micro-batch forward: launch gaps and syncs (backward 2x)
LINK_EFFICIENCY = 0.80  # achieved bus bandwidth of a collective, of the link's rated bandwidth
A2A_EFFICIENCY = 0.60  # all-to-all reaches less of the link than a ring collective
LATENCY_NVLINK_S = 12e-6  # one collective inside a node
LATENCY_NETWORK_S = 35e-6  # one collective across nodes
TP_EXPOSED = (1.0, 0.5)  # (forward, backward) fraction of TP traffic on the critical path
TP_EXPOSED_OVERLAP = (0.4, 0.3)  # the same with --tp-comm-overlap
EP_EXPOSED = 0.85
P2P_EXPOSED = 0.5
DP_MIN_EXPOSED = 0.12  # the last gradient bucket and the final sync are never hidden
MOE_IMBALANCE = 1.12  # busiest expert rank's load over the mean (dropless routing)
OPTIMIZER_FIXED_S = 4e-3  # grad-norm, clipping, loss-scale bookkeeping
ITERATION_FIXED_S = 12e-3  # data loader, logging, host syncs
LOGITS_BYTES = 8.0  # bytes per logit element held at the loss: bf16 logits + fp32 softmax + its gradient
LOSS_TRAFFIC_BYTES = 28.0  # HBM bytes moved per logit by the unfused cross-entropy, forward + backward
CUDA_CONTEXT_GIB = 0.55  # CUDA context + cuBLAS/TE workspaces, outside the caching allocator
NCCL_GIB_PER_GROUP = 0.18  # NCCL buffers per communicator a rank belongs to
WORKSPACE_GIB = 0.35  # TE/cuBLAS workspaces and small tensors inside the allocator


@dataclass(frozen=True)
class Shape:
    """The model and layout reduced to the numbers the physics uses (one rank's view)."""

    L: int; h: int; F: int; a: int; g: int; d: int; V: int; s: int
    E: int; k: int; Fm: int; Fs: int; L_moe: int; gated: int  # gated: 3 matrices per MLP (SwiGLU) else 2
    t: int; p: int; c: int; e: int; et: int; dp: int; edp: int; b: int; m: int; v: int
    sp: bool; gpn: int

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
    L_moe = len(range(0, L, freq)) if E > 1 else 0
    return Shape(
        L=L, h=h, F=mod.ffn_hidden_size, a=a, g=mod.num_query_groups or a, d=mod.head_dim, V=mod.vocab_size,
        s=mod.seq_length, E=E, k=mod.moe_router_topk or 0, Fm=mod.moe_ffn_hidden_size or 0,
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
    if stored == "input":
        return 2.0 * x.h * x.tok / seq_split
    masks = (2 if cfg.hidden_dropout > 0 else 0)  # two 1-byte dropout masks per token x h
    seq_part = (8.0 + masks) * x.h  # LN inputs, QKV and FC1 inputs (2 bytes each) + masks
    qkv = 2.0 * (x.a * x.d / x.t + 2 * x.d * x.g_rank)
    tensor_part = qkv + 2.0 * x.a * x.d / x.t + 4.0 * x.a / x.t  # Q,K,V + attention output + softmax stats
    if moe:
        expert = x.k * MOE_IMBALANCE * (4.0 * x.h + 2.0 * x.gated * x.Fm) / x.t  # routed copies, FC1, act
        shared = 2.0 * x.gated * x.Fs / x.t if x.Fs else 0.0
        tensor_part += expert + shared + 4.0 * x.E / x.t
    else:
        tensor_part += 2.0 * x.gated * x.F / x.t  # FC1 output(s) + activation output
    per_token = seq_part / seq_split + tensor_part
    if stored == "all" and not cfg.flash_attention:
        # unfused attention keeps softmax (2), its dropout mask (1) and output (2) per score
        per_score = 5.0 if cfg.attention_dropout > 0 else 2.0
        per_token += per_score * x.a * (x.s / x.c) / x.t
    return per_token * x.tok


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
    weights = (prm.dense + prm.expert) * w_bytes
    grads = (prm.dense + prm.expert) * g_bytes
    optimizer = o_bytes * (prm.dense / dense_shards + prm.expert / expert_shards)
    if cfg.distributed_optimizer:
        optimizer += 0.02 * (prm.dense + prm.expert) * g_bytes  # shard padding and bucket alignment

    # micro-batches whose activations stage `stage` holds at the 1F1B peak
    if x.v > 1:
        in_flight = min(float(x.m), (x.p - stage) + (x.p - 1) / x.v)
    else:
        in_flight = float(min(x.m, x.p - stage))
    in_flight = max(in_flight, 1.0)
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
    activations = in_flight * (saved + embed_out)
    if stage == 0 and cfg.vision is not None:
        vis = cfg.vision
        vtok = x.b * vis.tokens
        per_vit_layer = (30.0 * vis.hidden_size + 4.0 * vis.ffn_hidden_size) * vtok / x.t
        vit = (vis.num_layers * 2.0 * vis.hidden_size * vtok / x.t + per_vit_layer) if vis.checkpointing \
            else vis.num_layers * per_vit_layer
        activations += in_flight * vit

    logits = LOGITS_BYTES * x.tok * x.V / x.t if stage == x.p - 1 else 0.0
    transient = working + logits + WORKSPACE_GIB * GIB
    largest = max(4.0 * x.tok * x.V / x.t if logits else 0.0,
                  2.0 * x.tok * max(x.gated - 1, 1) * (x.F or x.Fm) / x.t,
                  2.0 * x.tok * x.h)
    return StageMemory(stage, weights, grads, optimizer, activations, transient, largest)


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
    non_torch = (CUDA_CONTEXT_GIB + NCCL_GIB_PER_GROUP * nccl_groups(cfg)) * GIB
    return MemoryReport(stages, worst, reserved, non_torch, cfg.gpu.capacity_gib * GIB)


# --- time --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class IterationTime:
    """Seconds of one steady-state iteration and where they go (for explanations and tests)."""

    total: float
    pipeline: float  # all micro-batches through the pipeline, bubble included
    bubble: float  # idle part of `pipeline`
    stage_fwd: float  # one micro-batch forward on the slowest stage
    stage_bwd: float  # one micro-batch backward (+ recompute) on the slowest stage
    tp_comm: float  # exposed TP seconds per micro-batch on the slowest stage
    cp_comm: float
    ep_comm: float
    dp_comm: float  # exposed gradient/parameter sync per iteration
    optimizer: float


class _Clock:
    """Compute and link speeds of one rank."""

    def __init__(self, cfg: SimConfig):
        gpu = cfg.gpu
        self.peak = gpu.peak_tflops * 1e12 * (1.0 if cfg.bf16 else 0.5)
        self.gemm_frac = gpu.gemm_peak_fraction
        self.attn_frac = gpu.attn_fraction
        self.half_dim = gpu.gemm_half_dim
        self.hbm = gpu.hbm_gbps * 1e9 * HBM_EFFICIENCY
        self.nvlink = gpu.nvlink_gbps * 1e9
        self.network = gpu.network_gbps * 1e9
        self.gpn = cfg.gpus_per_node

    def gemm(self, m: float, n: float, k: float, factor: float = 1.0) -> float:
        # efficiency saturates with every dimension: eff = peak_frac / (1 + X0/m + X0/n + X0/k)
        eff = self.gemm_frac * factor / (1.0 + self.half_dim / m + self.half_dim / n + self.half_dim / k)
        return 2.0 * m * n * k / (self.peak * eff)

    def attention(self, flops: float, tokens: float) -> float:
        eff = self.attn_frac * tokens / (tokens + ATTN_SEQ_HALF)
        return flops / (self.peak * eff)

    def link(self, span: int) -> tuple[float, float]:
        """(bandwidth, latency) of a group whose members span `span` consecutive ranks."""
        if span > self.gpn:
            return self.network * LINK_EFFICIENCY, LATENCY_NETWORK_S
        return self.nvlink * LINK_EFFICIENCY, LATENCY_NVLINK_S

    def ring(self, nbytes: float, size: int, span: int) -> float:
        """One all-gather or reduce-scatter of `nbytes` (the full tensor) over `size` ranks."""
        if size <= 1:
            return 0.0
        bw, lat = self.link(span)
        return nbytes * (size - 1) / size / bw + lat * math.log2(size)


@dataclass(frozen=True)
class LayerTime:
    """Seconds of one transformer layer for one micro-batch on one rank."""

    fwd: float  # forward compute (GEMMs, attention, elementwise, launch gaps)
    bwd: float  # backward compute
    attn_fwd: float  # the attention part of `fwd` (what selective recompute re-runs)
    tp_fwd: float  # exposed TP communication, forward
    tp_bwd: float
    cp_fwd: float  # exposed CP ring traffic, forward
    cp_bwd: float
    ep: float  # exposed EP all-to-all per direction (same forward and backward)

    @property
    def comm_fwd(self) -> float:
        return self.tp_fwd + self.cp_fwd + self.ep

    @property
    def comm_bwd(self) -> float:
        return self.tp_bwd + self.cp_bwd + self.ep


def _all_to_all(clk: _Clock, x: Shape, nbytes: float) -> float:
    """One EP all-to-all sending `nbytes` per rank; across nodes the network share is the bottleneck."""
    span = x.et * x.e  # EP peers are et ranks apart
    if span <= x.gpn:
        return nbytes / (clk.nvlink * A2A_EFFICIENCY) + LATENCY_NVLINK_S
    outside = 1.0 - min(1.0, (x.gpn / x.et) / x.e)  # share of peers on other nodes
    return max(nbytes * (1 - outside) / (clk.nvlink * A2A_EFFICIENCY),
               nbytes * outside / (clk.network * A2A_EFFICIENCY)) + LATENCY_NETWORK_S


def layer_time(cfg: SimConfig, x: Shape, clk: _Clock, moe: bool) -> LayerTime:
    tok = float(x.tok)
    seq_split = x.t if x.sp else 1
    gemm = clk.gemm(tok, x.a * x.d / x.t + 2 * x.d * x.g_rank, x.h) + clk.gemm(tok, x.h, x.a * x.d / x.t)
    elem = SEQ_ELEMENTWISE_BYTES * x.h / seq_split + 4.0 * (x.a * x.d / x.t + x.d * x.g_rank)  # + rotary
    ep = 0.0
    if moe:
        expert_tok = tok * x.k * x.et * x.e / (x.t * x.E)  # tokens per local expert on this rank
        gemm += MOE_IMBALANCE * (x.E / x.e) * (
            clk.gemm(expert_tok, (x.gated - 1) * x.Fm / x.et, x.h, GROUPED_GEMM_FACTOR)
            + clk.gemm(expert_tok, x.h, x.Fm / x.et, GROUPED_GEMM_FACTOR))
        gemm += clk.gemm(tok / seq_split, x.E, x.h, 0.5)  # router: a skinny GEMM
        if x.Fs:
            gemm += clk.gemm(tok, (x.gated - 1) * x.Fs / x.t, x.h) + clk.gemm(tok, x.h, x.Fs / x.t)
        elem += x.k * MOE_IMBALANCE * (8.0 * x.h + 2.0 * x.gated * x.Fm / x.et) * x.et / x.t  # permute + act
        if x.e > 1:
            nbytes = (tok / seq_split) * x.k * x.h * 2.0 * (x.e - 1) / x.e
            ep = 2 * _all_to_all(clk, x, nbytes) * EP_EXPOSED  # dispatch + combine
    else:
        gemm += clk.gemm(tok, (x.gated - 1) * x.F / x.t, x.h) + clk.gemm(tok, x.h, x.F / x.t)
        elem += 2.0 * x.gated * x.F / x.t
    elem_time = elem * tok / clk.hbm

    seq = tok / x.b  # query tokens per sequence on this rank
    attn_flops = 2.0 * x.b * x.s * seq * x.a * x.d / x.t  # causal: half of 4·b·s·s_r·a·d
    if cfg.flash_attention:
        attn_fwd = clk.attention(attn_flops, seq)
        attn_bwd = 2.0 * clk.attention(attn_flops, seq) / ATTN_BWD_RATIO
    else:  # unfused: two batched GEMMs over the full s x s scores, softmax/mask/dropout through HBM
        scores = x.b * (x.a / x.t) * seq * x.s
        attn_fwd = 2 * attn_flops / (clk.peak * clk.gemm_frac * 0.6) + 10.0 * scores / clk.hbm
        attn_bwd = 2 * attn_fwd

    # TP: 2 all-gathers + 2 reduce-scatters with SP (2 all-reduces without) per direction, of tok·h bf16
    tp_f = tp_b = 0.0
    if x.t > 1:
        one = clk.ring(2.0 * tok * x.h, x.t, x.t)
        if moe:  # the MLP's TP traffic is replaced by the experts' own (ETP gathers routed tokens)
            comm = 2 * one + (2 * clk.ring(2.0 * tok * x.h * x.k * x.et / x.t, x.et, x.et) if x.et > 1 else 0.0)
        else:
            comm = 4 * one
        exp_f, exp_b = TP_EXPOSED_OVERLAP if cfg.tp_comm_overlap else TP_EXPOSED
        tp_f = comm - min((1 - exp_f) * comm, 0.8 * gemm)
        tp_b = comm - min((1 - exp_b) * comm, 1.6 * gemm)

    # CP: a ring of c-1 K/V exchanges per layer, each hidden behind one step of attention
    cp_f = cp_b = 0.0
    if x.c > 1:
        kv = 2.0 * 2.0 * tok * x.d * x.g_rank  # K and V, bf16
        bw, lat = clk.link(x.t * x.c)
        step = kv / bw + lat
        cp_f = (x.c - 1) * max(lat, step - attn_fwd / x.c)
        cp_b = (x.c - 1) * max(lat, 2 * step - attn_bwd / x.c)  # dK, dV travel back too

    fwd = gemm + attn_fwd + elem_time + LAYER_OVERHEAD_S
    bwd = 2 * gemm + attn_bwd + 2 * elem_time + 2 * LAYER_OVERHEAD_S
    return LayerTime(fwd, bwd, attn_fwd, tp_f, tp_b, cp_f, cp_b, ep)


def iteration_time(cfg: SimConfig) -> IterationTime:
    x = shape_of(cfg)
    lay = cfg.layout
    clk = _Clock(cfg)
    ls = x.layers_per_stage
    moe_layers = x.moe_per_stage
    parts = [(count, layer_time(cfg, x, clk, moe))
             for moe, count in ((False, ls - moe_layers), (True, moe_layers)) if count]

    def total(field: str) -> float:
        return sum(count * getattr(lt, field) for count, lt in parts)

    fwd, bwd, attn = total("fwd"), total("bwd"), total("attn_fwd")
    comm_f, comm_b = total("comm_fwd"), total("comm_bwd")
    # recompute: full re-runs the forward (with its traffic) of recomputed layers; selective re-runs attention
    if lay.recompute_granularity == "full":
        n = lay.recompute_num_layers or 1
        share = 1.0 if lay.recompute_method == "uniform" else min(n, ls) / ls
        recompute = share * (fwd + comm_f)
    elif lay.recompute_granularity == "selective":
        recompute = attn
    else:
        recompute = 0.0
    layer_fwd = fwd + comm_f
    layer_bwd = bwd + comm_b + recompute

    tok = float(x.tok)
    seq_split = x.t if x.sp else 1
    # first stage: embedding (+ vision tower); last stage: output layer and the loss
    first_f = 6.0 * x.h * tok / seq_split / clk.hbm
    if cfg.vision is not None:
        vis = cfg.vision
        vtok = float(x.b * vis.tokens)
        vit_layer = (clk.gemm(vtok, 3 * vis.hidden_size / x.t, vis.hidden_size)
                     + clk.gemm(vtok, vis.hidden_size, vis.hidden_size / x.t)
                     + clk.gemm(vtok, vis.ffn_hidden_size / x.t, vis.hidden_size)
                     + clk.gemm(vtok, vis.hidden_size, vis.ffn_hidden_size / x.t)
                     + clk.attention(4.0 * x.b * vis.tokens ** 2 * vis.hidden_size / x.t, vtok / x.b)
                     + SEQ_ELEMENTWISE_BYTES * vis.hidden_size * vtok / clk.hbm + LAYER_OVERHEAD_S)
        first_f += vis.num_layers * vit_layer
        first_b = 2 * vis.num_layers * vit_layer + (vis.num_layers * vit_layer if vis.checkpointing else 0.0)
    else:
        first_b = 2 * first_f
    logits = clk.gemm(tok, x.V / x.t, x.h)
    loss = LOSS_TRAFFIC_BYTES * tok * x.V / x.t / clk.hbm
    last_f = logits + loss / 2 + (clk.ring(2.0 * tok * x.h, x.t, x.t) if x.sp else 0.0)
    last_b = 2 * logits + loss / 2 + (clk.ring(2.0 * tok * x.h, x.t, x.t) if x.sp else 0.0)

    # pipeline p2p: one activation each way per micro-batch per stage boundary (per chunk when interleaved)
    p2p = 0.0
    if x.p > 1:
        bw, lat = clk.link(x.t * x.c * x.dp + 1)
        p2p = x.v * 2 * (2.0 * tok * x.h / seq_split / bw + lat) * P2P_EXPOSED

    stage_f = [layer_fwd] * x.p
    stage_b = [layer_bwd] * x.p
    stage_f[0] += first_f
    stage_b[0] += first_b
    stage_f[-1] += last_f
    stage_b[-1] += last_b
    per_mb = [f + b + p2p for f, b in zip(stage_f, stage_b)]
    slowest = max(per_mb)
    mean = sum(per_mb) / len(per_mb)
    bubble = (x.p - 1) / x.v * mean
    pipeline = x.m * slowest + bubble

    # data parallel: grads reduce-scattered (all-reduced) and params all-gathered over DP x CP
    prm0 = stage_params(cfg, 0)
    dense_group, expert_group = x.dp * x.c, x.edp
    grad_bytes = 4.0  # bf16 runs accumulate and reduce gradients in fp32
    if cfg.distributed_optimizer:
        rs = clk.ring(grad_bytes * prm0.dense, dense_group, x.t * dense_group)
        ag = clk.ring(2.0 * prm0.dense, dense_group, x.t * dense_group)
        if x.E > 1:
            rs += clk.ring(grad_bytes * prm0.expert, expert_group, x.et * x.e * expert_group)
            ag += clk.ring(2.0 * prm0.expert, expert_group, x.et * x.e * expert_group)
    else:
        rs = 2 * clk.ring(grad_bytes * prm0.dense, dense_group, x.t * dense_group)
        if x.E > 1:
            rs += 2 * clk.ring(grad_bytes * prm0.expert, expert_group, x.et * x.e * expert_group)
        ag = 0.0
    if cfg.overlap_grad_reduce:
        rs_exposed = max(DP_MIN_EXPOSED * rs, rs - 0.9 * stage_b[0])
    else:
        rs_exposed = rs
    if cfg.overlap_param_gather:
        ag_exposed = max(DP_MIN_EXPOSED * ag, ag - 0.9 * stage_f[0])
    else:
        ag_exposed = ag
    dp_comm = rs_exposed + ag_exposed

    shards = dense_group if cfg.distributed_optimizer else 1
    eshards = expert_group if cfg.distributed_optimizer else 1
    opt_params = prm0.dense / shards + prm0.expert / eshards
    optimizer = 30.0 * opt_params / clk.hbm + OPTIMIZER_FIXED_S  # Adam reads/writes ~30 B per param

    iteration = pipeline + dp_comm + optimizer + ITERATION_FIXED_S
    return IterationTime(total=iteration, pipeline=pipeline, bubble=bubble, stage_fwd=max(stage_f),
                         stage_bwd=max(stage_b), tp_comm=total("tp_fwd") + total("tp_bwd"),
                         cp_comm=total("cp_fwd") + total("cp_bwd"), ep_comm=2 * total("ep"), dp_comm=dp_comm,
                         optimizer=optimizer)
