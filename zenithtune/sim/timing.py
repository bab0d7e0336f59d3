"""The simulator's time per iteration (MEGATRON.md §Time model ingredients).

Every rank runs its pipeline stage's layers for each micro-batch. A layer costs its GEMMs (efficiency
saturates with every GEMM dimension: eff = peak_frac / (1 + X0/m + X0/n + X0/k), X0 per GPU), flash
attention, memory-bound elementwise work at HBM speed, launch gaps, and the part of its TP / CP / EP
traffic that is not hidden behind compute (TP inside a node on NVLink, across nodes on InfiniBand).
Recompute re-runs forward work. Stages form a 1F1B pipeline (bubble (p-1)/v micro-batch times), the
first stage adds the embedding (and a vision tower), the last the output layer and the loss.
Data-parallel gradient reduce-scatter / parameter all-gather (hidden behind one micro-batch when
overlapped) and the optimizer step close the iteration.

Constants were fitted once against MEGATRON.md §Calibration; `python -m zenithtune.sim.calibrate`
shows the fit.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from zenithtune.sim.arguments import SimConfig
from zenithtune.sim.physics import MOE_IMBALANCE, Shape, shape_of, stage_params

GROUPED_GEMM_FACTOR = 0.88  # MoE grouped GEMMs run below a plain GEMM of the same shape
ATTN_BWD_RATIO = 0.78  # flash-attention backward runs at this fraction of its forward efficiency
ATTN_SEQ_HALF = 384.0  # attention efficiency halves at this many tokens per rank
HBM_EFFICIENCY = 0.75  # memory-bound kernels reach this fraction of HBM bandwidth
SEQ_ELEMENTWISE_BYTES = 36.0  # per token x h per layer fwd: norms, residual adds, dropouts
NORM_BYTES = 12.0  # of those, the two norms' (read and write bf16, fp32 statistics)
LAYER_OVERHEAD_S = 35e-6  # per layer per micro-batch forward: launch gaps and syncs (backward 2x)
LINK_EFFICIENCY = 0.80  # achieved bus bandwidth of a collective, of the link's rated bandwidth
A2A_EFFICIENCY = 0.60  # all-to-all reaches less of the link than a ring collective
LATENCY_NVLINK_S = 12e-6  # one collective inside a node
LATENCY_NETWORK_S = 35e-6  # one collective across nodes
TP_EXPOSED = (1.0, 0.5)  # (forward, backward) fraction of TP traffic on the critical path
TP_EXPOSED_OVERLAP = (0.4, 0.3)  # the same with --tp-comm-overlap
EP_EXPOSED = 0.85  # MoE all-to-all is mostly on the critical path
A2A_OVERLAP_LEFT = 0.15  # --overlap-moe-expert-parallel-comm: share of the all-to-alls never hidden
A2A_OVERLAP_HIDE = 0.9  # ... behind at most this share of the paired micro-batch's GEMMs of the layer
A2A_OVERLAP_TAX = 1.03  # ... whose kernels share the SMs with the communication kernels
P2P_EXPOSED = 0.5  # pipeline send/recv partly overlaps the next micro-batch
DP_MIN_EXPOSED = 0.12  # the last gradient bucket and the final sync are never hidden
OPTIMIZER_FIXED_S = 4e-3  # grad-norm, clipping, loss-scale bookkeeping
ITERATION_FIXED_S = 12e-3  # data loader, logging, host syncs
LOSS_TRAFFIC_BYTES = 28.0  # HBM bytes moved per logit by the unfused cross-entropy, forward + backward
# --- flavours (sim/flavours.py) ---
TILE_M, TILE_N = 128.0, 256.0  # gemm_waves: output tile of a large bf16 GEMM
SMS = {"h100": 132, "h200": 132, "a100-80g": 108, "a100-40g": 108}  # gemm_waves: SMs a wave fills
WAVES_K_HALF = 256.0  # gemm_waves: efficiency halves at this K (the main loop's pipeline fill)
TP_LINK_EXPOSED = 0.75  # tp_exposed: share of a large ring's bus bandwidth TP's small collectives reach
WARMUP_INTERLEAVE_KEPT = 0.3  # sync_warmup: share of the bubble interleaving does not remove


@dataclass(frozen=True)
class IterationTime:
    """Seconds of one steady-state iteration and where they go (for explanations and tests)."""

    total: float
    pipeline: float  # all micro-batches through the pipeline, bubble included
    bubble: float  # idle part of `pipeline`
    stage_fwd: float  # one micro-batch forward on the slowest stage
    stage_bwd: float  # one micro-batch backward (+ recompute) on the slowest stage
    tp_comm: float  # exposed TP seconds of one micro-batch through one stage (fwd + bwd)
    cp_comm: float  # the same for the CP ring
    ep_comm: float  # the same for the EP all-to-alls
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
        self.gemm_frac *= cfg.perturb.gemm  # a perturbed trainer's kernels (sim/perturb.py)
        self.network *= cfg.flavour.network_scale
        self.waves = cfg.flavour.gemm_curve == "waves"
        self.sms = SMS.get(gpu.name, 132)

    def gemm(self, m: float, n: float, k: float, factor: float = 1.0) -> float:
        if self.waves:  # tiles over SMs: a partial tile or a partial last wave idles SMs; K fills the pipeline
            tiles = math.ceil(m / TILE_M) * math.ceil(n / TILE_N)
            used = m * n / (math.ceil(tiles / self.sms) * self.sms * TILE_M * TILE_N)
            eff = self.gemm_frac * factor * used * k / (k + WAVES_K_HALF)
            return 2.0 * m * n * k / (self.peak * eff)
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
    # what each of Megatron's --recompute-modules re-runs in the backward (forward seconds, its traffic in)
    modules: tuple[tuple[str, float], ...] = ()

    def module_fwd(self, names: tuple[str, ...]) -> float:
        return sum(sec for name, sec in self.modules if name in names)

    @property
    def comm_fwd(self) -> float:
        return self.tp_fwd + self.cp_fwd + self.ep

    @property
    def comm_bwd(self) -> float:
        return self.tp_bwd + self.cp_bwd + self.ep


def _all_to_all(cfg: SimConfig, clk: _Clock, x: Shape, nbytes: float) -> float:
    """One EP all-to-all sending `nbytes` per rank; across nodes the network share is the bottleneck."""
    span = x.et * x.e  # EP peers are et ranks apart
    peers = 1.0
    if cfg.flavour.a2a_layout == "dp_carved":  # EP carved out of DP: peers are TP x CP ranks apart
        span = max(x.t * x.c, x.et) * x.e
        peers = float(x.e - 1)  # and every peer is a message with its own latency
    if span <= x.gpn:
        return nbytes / (clk.nvlink * A2A_EFFICIENCY) + LATENCY_NVLINK_S * peers
    outside = 1.0 - min(1.0, x.gpn / span)  # share of peers on other nodes
    return max(nbytes * (1 - outside) / (clk.nvlink * A2A_EFFICIENCY),
               nbytes * outside / (clk.network * A2A_EFFICIENCY)) + LATENCY_NETWORK_S * peers


def layer_time(cfg: SimConfig, x: Shape, clk: _Clock, moe: bool) -> LayerTime:
    tok = float(x.tok)
    seq_split = x.t if x.sp else 1
    gemm = clk.gemm(tok, x.a * x.d / x.t + 2 * x.d * x.g_rank, x.h) + clk.gemm(tok, x.h, x.a * x.d / x.t)
    elem = SEQ_ELEMENTWISE_BYTES * x.h / seq_split + 4.0 * (x.a * x.d / x.t + x.d * x.g_rank)  # + rotary
    ep = 0.0
    modules: tuple[tuple[str, float], ...]
    # the two norms read and write tok x h (bf16, fp32 statistics): what layernorm recompute re-runs
    norms = NORM_BYTES * x.h / seq_split * tok / clk.hbm * (1.0 if cfg.layout.local_impl else 0.5 if moe else 0.0)
    if moe:
        expert_tok = tok * x.k * x.et * x.e / (x.t * x.E)  # tokens per local expert on this rank
        experts = MOE_IMBALANCE * (x.E / x.e) * (
            clk.gemm(expert_tok, (x.gated - 1) * x.Fm / x.et, x.h, GROUPED_GEMM_FACTOR)
            + clk.gemm(expert_tok, x.h, x.Fm / x.et, GROUPED_GEMM_FACTOR))
        router = clk.gemm(tok / seq_split, x.E, x.h, 0.5)  # a skinny GEMM
        shared = clk.gemm(tok, (x.gated - 1) * x.Fs / x.t, x.h) + clk.gemm(tok, x.h, x.Fs / x.t) if x.Fs else 0.0
        gemm += experts + router + shared
        act = x.k * MOE_IMBALANCE * 2.0 * x.gated * x.Fm / x.t * tok / clk.hbm  # the experts' activation function
        moe_elem = x.k * MOE_IMBALANCE * (8.0 * x.h + 2.0 * x.gated * x.Fm / x.et) * x.et / x.t  # permute + act
        elem += moe_elem
        if x.e > 1:
            nbytes = (tok / seq_split) * x.k * x.h * 2.0 * (x.e - 1) / x.e
            ep = 2 * _all_to_all(cfg, clk, x, nbytes) * EP_EXPOSED * cfg.perturb.ep_comm  # dispatch + combine
            if cfg.layout.moe_a2a_overlap:
                # combined 1F1B: one micro-batch's all-to-alls run beside another's compute; the unpaired
                # first forward and last backward of the iteration keep theirs
                paired = ep - min(ep * (1 - A2A_OVERLAP_LEFT), A2A_OVERLAP_HIDE * gemm)
                ep = paired + (ep - paired) / max(1, x.m)
                gemm *= A2A_OVERLAP_TAX
        # moe re-runs the whole layer's MoE part, its token dispatch included
        modules = (("layernorm", norms), ("moe_act", act), ("shared_experts", shared),
                   ("moe", experts + router + shared + moe_elem * tok / clk.hbm + ep))
    else:
        mlp = clk.gemm(tok, (x.gated - 1) * x.F / x.t, x.h) + clk.gemm(tok, x.h, x.F / x.t)
        gemm += mlp
        elem += 2.0 * x.gated * x.F / x.t
        modules = (("layernorm", norms), ("mlp", mlp + 2.0 * x.gated * x.F / x.t * tok / clk.hbm))
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
        comm *= cfg.perturb.tp_comm
        if not cfg.flavour.tp_overlap:  # on the compute stream, nothing hidden, at a small message's bandwidth
            exp_f, exp_b = 1.0, 1.0
            comm /= TP_LINK_EXPOSED
        tp_f = comm - min((1 - exp_f) * comm, 0.8 * gemm)
        tp_b = comm - min((1 - exp_b) * comm, 1.6 * gemm)

    # CP: a ring of c-1 K/V exchanges per layer, each hidden behind one step of attention
    cp_f = cp_b = 0.0
    if x.c > 1:
        kv = 2.0 * 2.0 * tok * x.d * x.g_rank  # K and V, bf16
        bw, lat = clk.link(x.t * x.c)
        step = kv / bw + lat
        step *= cfg.perturb.cp_comm
        cp_f = (x.c - 1) * max(lat, step - attn_fwd / x.c)
        cp_b = (x.c - 1) * max(lat, 2 * step - attn_bwd / x.c)  # dK, dV travel back too

    fwd = gemm + attn_fwd + elem_time + LAYER_OVERHEAD_S
    bwd = 2 * gemm + attn_bwd + 2 * elem_time + 2 * LAYER_OVERHEAD_S
    if not moe and x.t > 1:  # a recomputed dense MLP gathers its sequence-split input again (half the TP traffic)
        modules = (modules[0], ("mlp", modules[1][1] + tp_f / 2))
    return LayerTime(fwd, bwd, attn_fwd, tp_f, tp_b, cp_f, cp_b, ep,
                     modules=(("core_attn", attn_fwd), *modules))


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

    fwd, bwd = total("fwd"), total("bwd")
    comm_f, comm_b = total("comm_fwd"), total("comm_bwd")
    # recompute: full re-runs the forward (with its traffic) of recomputed layers; selective re-runs attention
    if lay.recompute_granularity == "full":
        n = lay.recompute_num_layers or 1
        share = 1.0 if lay.recompute_method == "uniform" else min(n, ls) / ls
        recompute = share * (fwd + comm_f)
    elif lay.recompute_granularity == "selective":  # the modules' forwards (Megatron's default: core_attn)
        recompute = sum(count * lt.module_fwd(lay.selective_modules) for count, lt in parts)
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
        p2p = x.v * 2 * (2.0 * tok * x.h / seq_split / bw + lat) * P2P_EXPOSED * cfg.perturb.pp_comm

    stage_f = [layer_fwd] * x.p
    stage_b = [layer_bwd] * x.p
    stage_f[0] += first_f
    stage_b[0] += first_b
    stage_f[-1] += last_f
    stage_b[-1] += last_b
    per_mb = [f + b + p2p for f, b in zip(stage_f, stage_b, strict=True)]
    slowest = max(per_mb)
    mean = sum(per_mb) / len(per_mb)
    bubble = (x.p - 1) / x.v * mean * cfg.perturb.pp_comm  # a perturbed trainer's pipeline schedule
    if cfg.flavour.pipeline == "sync_warmup" and x.p > 1:
        # warm-up and cool-down wait for the slowest stage and send synchronously; interleaving keeps part
        kept = 1.0 / x.v + WARMUP_INTERLEAVE_KEPT * (1.0 - 1.0 / x.v)
        bubble = (x.p - 1) * kept * (slowest + p2p / P2P_EXPOSED) * cfg.perturb.pp_comm
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
    dp_comm = (rs_exposed + ag_exposed) * cfg.perturb.dp_comm

    shards = dense_group if cfg.distributed_optimizer else 1
    eshards = expert_group if cfg.distributed_optimizer else 1
    opt_params = prm0.dense / shards + prm0.expert / eshards
    optimizer = 30.0 * opt_params / clk.hbm + OPTIMIZER_FIXED_S  # Adam reads/writes ~30 B per param

    iteration = pipeline + dp_comm + optimizer + ITERATION_FIXED_S
    return IterationTime(total=iteration, pipeline=pipeline, bubble=bubble, stage_fwd=max(stage_f),
                         stage_bwd=max(stage_b), tp_comm=total("tp_fwd") + total("tp_bwd"),
                         cp_comm=total("cp_fwd") + total("cp_bwd"), ep_comm=2 * total("ep"), dp_comm=dp_comm,
                         optimizer=optimizer)
