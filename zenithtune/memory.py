"""Per-GPU memory estimate for one layout, and a per-study model that learns from outcomes.

The estimate follows MEGATRON.md §Memory (bf16 training with Adam) and is deliberately simple: it is
what the tuner can know before launching, not what the GPU will do. Approximations, all of them:

* Parameters are counted from the shape (attention with GQA, dense or SwiGLU MLP, experts, shared
  experts, router, embedding/output); biases and norms are ignored, vocab is padded to 128·tp.
* Bytes per parameter: 18 (bf16 weight 2, fp32 grad 4, fp32 master + Adam 12) without the
  distributed optimizer; 6 + 12/(dp·cp) with it (experts: 6 + 12/expert_dp).
* Activations per layer per micro-batch after Korthikanti et al. 2022, generalised to GQA, SwiGLU
  and the real ffn width (at GPT shapes it is exactly 34·s·b·h + 5·a·s²·b bytes). A MoE layer keeps,
  for each of its top-k routed copies of a token, the permuted input, the expert's ffn intermediates
  and its output, plus the router's fp32 logits and probabilities.
  Attention scores (5·a·s²·b) are stored only without recompute and without flash/fused attention
  (`flash_attention=False`: Megatron's `--attention-backend unfused|local`); with Megatron's default
  backend (flash/fused) they never exist, so selective recompute of the default core_attn saves about
  nothing there; other `--recompute-modules` drop what they re-run (`_module_saving`: layernorm the outputs
  of the norms that are modules of their own, mlp a dense MLP's intermediates, moe_act the experts'
  activation output, moe a whole MoE layer's);
  full recompute keeps each layer's 2·s·b·h input plus the working set of the chunk being recomputed.
  1F1B keeps min(pp, micro-batches) in flight on the first stage (about L layers' worth). Interleaved
  with v model chunks per rank (the searched `vp`; Narayanan et al. 2021 §2.2.2, Korthikanti et al.
  2022 §4.2.3) the first rank warms up 2·(p−1) + (v−1)·p chunk micro-batches of L/(p·v) layers each,
  so it holds L·(1 + (p−1)/(p·v)) layers' worth: the 1F1B figure × (1 + (p−1)/(p·v)), most at v=2
  and tending to plain 1F1B's as v grows. The last stage holds one plus the logits (bf16 and their
  fp32 copy: 6·s·b·V/tp).
  Context parallelism divides everything by cp; TP without sequence parallelism leaves Korthikanti's
  10·s·b·h unsplit.
* Communication overlap (the searched switches): EP all-to-all overlap holds one more micro-batch of
  activations (the combined 1F1B schedule warms up one extra, or pairs two without a pipeline);
  TP communication overlap adds Transformer Engine's userbuffers (`_USERBUFFERS` full-sequence
  s·b/cp x h bf16 buffers) to the fixed overhead. DP overlap (--overlap-grad-reduce/-param-gather)
  costs nothing here: Megatron's gradient and parameter buffers exist either way.
* A VLM's vision tower is replicated on the first stage (not TP-sharded) and encodes
  `vision_seq_length` patches per sample (unknown: about seq_length, a rough guess); ViT
  checkpointing keeps only each vision layer's input plus one layer's working set.
* `overhead_gb` (fixed: CUDA context, NCCL and workspace buffers) plus FRAGMENTATION x the allocated
  memory (what PyTorch's caching allocator reserves beyond what it hands out) is the overhead.
* Unknown shape details fall back to conservative guesses (seq_length 4096, vocab 131072, MHA,
  SwiGLU); with no layers or hidden size there is no estimate at all (None).

"GB" here is GiB (2**30 bytes), the unit of nvidia-smi's MiB and Megatron's "memory (MB)" lines.
The simulator's memory is a separate "truth" on purpose (DESIGN.md); this module never imports it.
benchmarks/memory_accuracy.py compares the two from the simulator's results only (median ratio
~1.0, 0 false prunes, < 5 % missed OOMs); FRAGMENTATION and DEFAULT_SAFETY_MARGIN were tuned there.
`MemoryModel` corrects the estimate per study from what trials really used.
"""
from __future__ import annotations

import itertools
import logging
import math
import statistics
import subprocess
from dataclasses import dataclass, replace

import numpy as np

from zenithtune.modelinfo import ModelInfo
from zenithtune.record import chance_above
from zenithtune.shape import Shape
from zenithtune.validate import Layout

log = logging.getLogger(__name__)

GIB = float(2**30)
DEFAULT_OVERHEAD_GB = 4.0  # CUDA context + NCCL/workspace buffers, per GPU
FRAGMENTATION = 0.10  # the caching allocator reserves this much more than it hands out (share of allocated)
DEFAULT_SAFETY_MARGIN = 0.02  # prune only above capacity x (1 + margin); tuned in benchmarks/memory_accuracy.py
DEFAULT_CAPACITY_GB = 80.0  # H100 / A100-80GB when nothing else is known
_ASSUMED_VISION_PARAMS = 600e6  # a VLM whose vision tower we know nothing about
_LOGIT_BYTES = 6  # bf16 logits + their fp32 copy for the vocab-parallel cross entropy coexist at the peak
_REPLICATED_WITHOUT_SP = 10  # Korthikanti: bytes/(s·b·h) that TP does not split without SP
# --tp-comm-overlap: Transformer Engine's userbuffers, one full-sequence s·b/cp x h bf16 buffer per
# overlapped GEMM input/output (QKV, projection, FC1, FC2, forward and backward), outside the allocator
_USERBUFFERS = 10


@dataclass(frozen=True)
class MemoryEstimate:
    """Estimated peak memory of the busiest GPU, in GB (GiB)."""

    weights_gb: float
    grads_gb: float
    optimizer_gb: float
    activations_gb: float
    overhead_gb: float
    stage: str = "only"  # the pipeline stage that peaks: "only" (pp=1), "first" or "last"
    # parts of activations_gb that differ most between trainers, so MemoryModel learns them apart:
    # the routed tokens' copies and expert FFN intermediates of MoE layers, and the output logits
    expert_activations_gb: float = 0.0
    logits_gb: float = 0.0
    full_recompute: bool = False  # the caching allocator fragments differently when layers are recomputed
    micro_batch: int = 1  # the MBS: activations may grow faster than it (`MemoryModel`'s per-sample growth)
    # how many times expert_activations_gb a rank holds if expert TP, not TP, splits the routed tokens
    # (Megatron-Core's MoE parallel folding): tp / expert tp where that is above 1
    expert_folding: float = 1.0

    @property
    def total_gb(self) -> float:
        return self.weights_gb + self.grads_gb + self.optimizer_gb + self.activations_gb + self.overhead_gb

    @property
    def allocated_gb(self) -> float:
        """What PyTorch's allocator would report (everything but the fixed overhead)."""
        return self.total_gb - self.overhead_gb

    def breakdown(self) -> str:
        where = "" if self.stage == "only" else f", {self.stage} pipeline stage"
        return (f"{self.total_gb:.1f} GB = weights {self.weights_gb:.1f} + grads {self.grads_gb:.1f} + "
                f"optimizer {self.optimizer_gb:.1f} + activations {self.activations_gb:.1f} + "
                f"overhead {self.overhead_gb:.1f}{where}")


# --- one layer of the shape: parameters, and activation bytes per token (s·b) before TP/CP splits --
def _attn_params(sh: Shape) -> int:
    return sh.h * sh.d * (2 * sh.a + 2 * sh.g)  # Q, K, V (GQA) and the output projection


def _mlp_params(sh: Shape, width: int) -> int:
    return sh.mlp_mats * sh.h * width


def _attn_act(sh: Shape) -> float:
    # Korthikanti's 11·h + 4·h for the two norms; Q/K/V/output at their real widths (GQA)
    return (7 + 4 * sh.a * sh.d / sh.h + 4 * sh.g * sh.d / sh.h) * sh.h


def _mlp_act(sh: Shape, moe: bool) -> float:
    per_width = 6 if sh.glu else 4  # fc1 output(s) + activation output, bf16
    if not moe:
        return (3 + per_width * sh.F / sh.h) * sh.h
    # every routed copy keeps its permuted input, its ffn intermediates and its output (the
    # prob-weighted combine needs it); the router keeps fp32 logits and probabilities
    routed = _routed_act(sh) / sh.h
    router = 8 * sh.E / sh.h
    return (3 + routed + router + per_width * sh.Fs / sh.h) * sh.h


def _routed_act(sh: Shape) -> float:
    """The part of a MoE layer's _mlp_act held per routed copy (permuted input, expert intermediates,
    output): what the token dispatcher and grouped GEMMs of a given build allocate."""
    per_width = 6 if sh.glu else 4
    return sh.k * (4 + per_width * sh.Fm / sh.h) * sh.h


def _module_saving(sh: Shape, modules: tuple[str, ...], moe: bool, local_impl: bool = False) -> tuple[float, float]:
    """Bytes per token (before any split) that selective recompute of `modules` does not keep for one
    layer, and the routed copies' part of them (Megatron-core's --recompute-modules, TransformerLayer):
    layernorm discards the norms' outputs (2·h each) where a norm is a module of its own: both with
    --transformer-impl local, only a MoE layer's pre-MLP norm with Transformer Engine (which fuses the
    others into the next linear); mlp keeps only a dense MLP's input; moe only a MoE layer's input (routed
    copies, router, shared experts all re-run); moe_act discards the experts' activation output (2·Fm per
    routed copy); shared_experts keeps only the shared experts' input."""
    per_width = 6 if sh.glu else 4
    saved = routed = 0.0
    if "layernorm" in modules:
        saved += 4 * sh.h if local_impl else 2 * sh.h if moe else 0.0
    if moe:
        if "moe" in modules:
            routed = _routed_act(sh)
            return saved + _mlp_act(sh, True) - 2 * sh.h, routed
        if "moe_act" in modules:
            routed = sh.k * 2 * sh.Fm
            saved += routed
        if "shared_experts" in modules and sh.Fs:
            saved += per_width * sh.Fs
    elif "mlp" in modules:
        saved += _mlp_act(sh, False) - 2 * sh.h
    return saved, routed


def _score_act(sh: Shape) -> float:
    return 5 * sh.a * sh.s  # softmax, its dropout mask and output, per token (no flash)


def _padded_vocab(V: int, tp: int) -> int:
    step = 128 * tp
    return -(-V // step) * step


# --- the parts of one stage's peak ----------------------------------------------------------------
@dataclass(frozen=True)
class _Params:
    """Parameters on one GPU of a pipeline stage, by where they live."""

    dense: float  # attention, dense MLPs, shared experts and the (replicated) router of the stage's layers
    experts: float  # routed experts (sharded over EP x ETP; their optimizer over the expert-data-parallel ranks)
    emb: float  # one embedding (or output layer) shard
    vision: float  # a VLM's vision tower (first stage, not TP-sharded)


def _params(sh: Shape, layout: Layout, model: ModelInfo) -> _Params:
    t, p = max(1, layout.tp), max(1, layout.pp)
    et, ep = max(1, layout.expert_tp), max(1, layout.ep)
    layers = sh.L / p
    moe_layers = sh.n_moe / p
    dense_layers = layers - moe_layers
    dense = (layers * _attn_params(sh) + dense_layers * _mlp_params(sh, sh.F)
             + moe_layers * _mlp_params(sh, sh.Fs)) / t + moe_layers * sh.h * sh.E  # router replicated
    experts = moe_layers * sh.E * _mlp_params(sh, sh.Fm) / (et * ep) if sh.E else 0.0
    return _Params(dense=dense, experts=experts, emb=_padded_vocab(sh.V, t) * sh.h / t,
                   vision=_vision_params(sh, model))


def _vision_params(sh: Shape, model: ModelInfo) -> float:
    if not model.is_vlm:
        return 0.0
    if model.vision_params:
        return float(model.vision_params)
    if model.vision_num_layers and model.vision_hidden_size:
        hv, fv = sh.vision_hidden, sh.vision_ffn
        return float(sh.vision_layers * (4 * hv * hv + 2 * hv * fv))
    return _ASSUMED_VISION_PARAMS


@dataclass(frozen=True)
class _Activations:
    """Activation bytes of the text layers of one stage, for one micro-batch."""

    tokens: float  # tokens per rank per micro-batch
    per_mb: float  # kept from the forward until the backward
    working: float  # held once while a fully recomputed chunk runs again
    per_mb_routed: float  # the MoE routed copies' part of per_mb
    working_routed: float  # ... and of working


def _activations(sh: Shape, layout: Layout, flash_attention: bool) -> _Activations:
    t, p, c = max(1, layout.tp), max(1, layout.pp), max(1, layout.cp)
    layers = sh.L / p
    tokens = sh.s * layout.mbs / c  # per rank
    split = t if layout.sp_active or t == 1 else None

    def layer_act(moe: bool, scores: bool, modules: tuple[str, ...] = ()) -> float:
        total = _attn_act(sh) + _mlp_act(sh, moe) + (_score_act(sh) if scores else 0.0)
        total -= _module_saving(sh, modules, moe, layout.local_impl)[0]
        if split is None:  # TP without SP keeps the norms' and inputs' activations whole
            rep = _REPLICATED_WITHOUT_SP * sh.h
            return tokens * (rep + (total - rep) / t)
        return tokens * total / split

    def routed(moe: bool, modules: tuple[str, ...] = ()) -> float:  # the routed part of layer_act (split like the rest)
        return tokens * (_routed_act(sh) - _module_saving(sh, modules, True)[1]) / (split or t) if moe and sh.E else 0.0

    gran = layout.recompute_granularity
    # selective recompute re-runs these modules (Megatron's default: the attention core alone)
    modules = layout.selective_modules
    moe_frac = sh.n_moe / sh.L
    routed_layer = moe_frac * routed(True)  # of a fully recomputed layer
    scores = not flash_attention and (gran is None or (gran == "selective" and "core_attn" not in modules))
    full_layer = (1 - moe_frac) * layer_act(False, not flash_attention) + moe_frac * layer_act(True, not flash_attention)
    stored_layer = ((1 - moe_frac) * layer_act(False, scores, modules)
                    + moe_frac * layer_act(True, scores, modules))
    layer_input = 2 * tokens * sh.h / (split or 1)
    working = 0.0
    if gran == "full":
        n = max(1, layout.recompute_num_layers or 1)
        if layout.recompute_method == "block":
            n = min(n, math.ceil(layers))
            per_mb = n * layer_input + (layers - n) * stored_layer
            working = full_layer
            per_mb_routed, working_routed = (layers - n) * routed_layer, routed_layer
        else:  # uniform: the input of each chunk of n layers; recomputing one chunk needs n layers
            per_mb = math.ceil(layers / n) * layer_input
            working = min(n, layers) * full_layer
            per_mb_routed, working_routed = 0.0, min(n, layers) * routed_layer
    else:
        per_mb = layers * stored_layer
        per_mb_routed, working_routed = layers * moe_frac * routed(True, modules), 0.0
    return _Activations(tokens=tokens, per_mb=per_mb, working=working, per_mb_routed=per_mb_routed,
                        working_routed=working_routed)


def _vision_act(sh: Shape, model: ModelInfo, mbs: int, vit_checkpointing: bool | None) -> float:
    if not model.is_vlm:
        return 0.0
    hv, fv, lv = sh.vision_hidden, sh.vision_ffn, sh.vision_layers
    # vision patches per sample: as stated, else about one per text position; CP does not split it
    v_tokens = sh.vision_tokens * mbs
    v_layer = v_tokens * hv * (18 + 4 * fv / hv)  # Korthikanti's 34 at fv = 4·hv (flash, no dropout masks kept)
    ckpt = True if vit_checkpointing is None else vit_checkpointing
    return (lv * 2 * v_tokens * hv + v_layer) if ckpt else lv * v_layer


def _stage(layout: Layout, params_dense: float, params_expert: float, act: float, name: str, *, routed_act: float,
           logits_act: float, distributed_optimizer: bool, overhead_gb: float) -> MemoryEstimate:
    """One stage's peak from its parameters and activations (bytes): 2 + 4 bytes per parameter for the
    bf16 weight and fp32 grad, 12 for fp32 master + Adam (sharded with the distributed optimizer)."""
    t, p = max(1, layout.tp), max(1, layout.pp)
    dc = max(1, layout.n_gpus // (t * p))  # the optimizer shards over dp·cp
    edp = max(1, layout.expert_dp)
    opt_dense = 12 / dc if distributed_optimizer else 12
    opt_expert = 12 / edp if distributed_optimizer else 12
    total_params = params_dense + params_expert
    optimizer = opt_dense * params_dense + opt_expert * params_expert
    allocated = 6 * total_params + optimizer + act
    return MemoryEstimate(
        weights_gb=2 * total_params / GIB, grads_gb=4 * total_params / GIB, optimizer_gb=optimizer / GIB,
        activations_gb=act / GIB, overhead_gb=overhead_gb + FRAGMENTATION * allocated / GIB, stage=name,
        expert_activations_gb=routed_act / GIB, logits_gb=logits_act / GIB,
        full_recompute=layout.recompute_granularity == "full", micro_batch=max(1, layout.mbs),
        expert_folding=max(1.0, t / max(1, layout.expert_tp)) if routed_act else 1.0)


def estimate(layout: Layout, model: ModelInfo, *, distributed_optimizer: bool = True,
             vit_checkpointing: bool | None = None, overhead_gb: float = DEFAULT_OVERHEAD_GB,
             flash_attention: bool = True) -> MemoryEstimate | None:
    """Peak per-GPU memory of `layout` training `model`, or None when the shape is too unknown.

    `vit_checkpointing` None means ms-swift's default (on). `flash_attention` False for Megatron's
    `--attention-backend unfused|local` (attention scores are then stored unless recomputed). See
    the module docstring for what is approximate. The busier of the first stage (embedding, vision
    tower, the most micro-batches in flight) and the last (output layer, logits) is the peak."""
    sh = Shape.of(model)
    if sh is None:
        return None
    t, p = max(1, layout.tp), max(1, layout.pp)
    par = _params(sh, layout, model)
    act = _activations(sh, layout, flash_attention)
    vision_act = _vision_act(sh, model, layout.mbs, vit_checkpointing)
    logits = _LOGIT_BYTES * act.tokens * _padded_vocab(sh.V, t) / t
    m = layout.microbatches or p
    in_flight: float = min(p, m) if p > 1 else 1  # 1F1B: micro-batches the first stage holds
    v = layout.virtual_stages(sh.L)
    if p > 1 and v > 1:
        in_flight *= 1 + (p - 1) / (p * v)
    # EP all-to-all overlap: the combined 1F1B schedule warms up one more micro-batch (schedules.py), and
    # without a pipeline runs one micro-batch's forward beside the previous one's backward
    extra = 1.0 if layout.moe_a2a_overlap else 0.0
    in_flight += extra
    opt, fixed = distributed_optimizer, overhead_gb
    fixed += userbuffers_gb(layout, model)
    if p == 1:
        emb_all = par.emb * (1 if sh.tied else 2)
        return _stage(layout, par.dense + emb_all + par.vision, par.experts,
                      (1 + extra) * act.per_mb + act.working + logits + vision_act, "only",
                      routed_act=(1 + extra) * act.per_mb_routed + act.working_routed, logits_act=logits,
                      distributed_optimizer=opt, overhead_gb=fixed)
    first = _stage(layout, par.dense + par.emb + par.vision, par.experts,
                   in_flight * act.per_mb + act.working + vision_act * min(p, m), "first",
                   routed_act=in_flight * act.per_mb_routed + act.working_routed, logits_act=0.0,
                   distributed_optimizer=opt, overhead_gb=fixed)
    last = _stage(layout, par.dense + par.emb, par.experts, act.per_mb + act.working + logits, "last",  # tied: a copy
                  routed_act=act.per_mb_routed + act.working_routed, logits_act=logits,  # for the output layer
                  distributed_optimizer=opt, overhead_gb=fixed)
    return first if first.total_gb >= last.total_gb else last


def userbuffers_gb(layout: Layout, model: ModelInfo) -> float:
    """Transformer Engine's userbuffers a --tp-comm-overlap run registers outside PyTorch's allocator (0 without)."""
    sh = Shape.of(model) if layout.tp_comm_overlap else None
    if sh is None:
        return 0.0
    return _USERBUFFERS * 2 * sh.s * layout.mbs / max(1, layout.cp) * sh.h / GIB


def gpu_capacity_gb(configured: float | None) -> float:
    """GPU memory in GB: the configured value, else GPU 0's total from nvidia-smi, else 80."""
    if configured:
        return float(configured)
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits", "-i", "0"],
                             capture_output=True, text=True, timeout=5, check=True).stdout
        return float(out.strip().splitlines()[0]) / 1024.0  # MiB -> GiB
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as exc:
        log.info("gpu memory: not configured and nvidia-smi gave none (%s); assuming %.0f GB",
                 type(exc).__name__, DEFAULT_CAPACITY_GB)
        return DEFAULT_CAPACITY_GB


# How far the estimate's components may be off before any evidence (the prior of the fit, 1 sd, as a
# share of each component), and how closely a measured peak pins the fit (share of the measured value).
COMPONENT_SD = 0.25
MEASURED_SD = 0.02
MODEL_ERROR = 0.02  # the least error of a learned prediction (allocator, workspaces), share of the prediction
MIN_REJUDGE = 3  # configurations measured besides a miss before the fit without it re-judges it
DOMINANCE_MARGIN = 0.03  # how much more (in total) than an OOM a configuration must need to be ruled out unseen


COMPONENTS = ("weights", "optimizer", "activations", "expert_activations", "logits")
W_MIN, W_MAX = 0.3, 3.0  # how far a learned multiplier may go: beyond, the trainer differs in structure, not scale
# Activations that grow faster than the micro-batch size: each sample beyond the first adds a share of
# the (dense and routed) activations -- 1F1B's p2p buffers of every micro-batch in flight, attention
# workspaces that grow with b·s, the caching allocator rounding larger blocks up. Korthikanti et al. 2022
# count only the saved tensors, linear in b, and so does the estimate: the share per extra sample is
# learned (prior 0 +- PER_SAMPLE_SD, within [0, PER_SAMPLE_MAX]) from runs at different MBS. A linear
# multiplier cannot do it: an OOM at MBS 8 then scales every MBS-1 prediction up by what MBS 8 needed.
PER_SAMPLE_SD = 0.05
PER_SAMPLE_MAX = 0.5
LEARNED = (*COMPONENTS, "per_sample")  # what the fit learns: the components' multipliers, then the growth
_PRIOR_MEAN = np.array([1.0] * len(COMPONENTS) + [0.0])
_PRIOR_SD = np.array([COMPONENT_SD] * len(COMPONENTS) + [PER_SAMPLE_SD])
_LOW = np.array([W_MIN] * len(COMPONENTS) + [0.0])
_HIGH = np.array([W_MAX] * len(COMPONENTS) + [PER_SAMPLE_MAX])
# How much better (in -2 log posterior) the folded law of expert splitting must explain the evidence to be
# believed over the estimate's own (a likelihood ratio of e^2): one measurement off by 3 sd decides, noise does not.
LAW_EVIDENCE = 4.0

# A bound from a measured run (`MemoryModel.bound`) trusts the run's own measurement and extrapolates
# only the estimate's difference to the candidate, pessimistically: growth x GROWTHS[0], more after an OOM
# it would have proven (`bound_growth`; and x the learned
# multiplier where that is larger), savings x SAVINGS; a reservation ratio as measured (+ RATIO_CUSHION
# at another MBS, + another RECOMPUTE_CUSHION at other recompute, which fragments the allocator
# differently); NCCL_CUSHION_GB per communicator the candidate has beyond the fullest run's (`bound_limit`).
GROWTHS = (2.0, 3.0, 4.0)
SAVINGS = 0.5
RATIO_CUSHION = 0.05
RECOMPUTE_CUSHION = 0.10
NCCL_CUSHION_GB = 0.5
# What lies outside PyTorch's allocator is at most this (GB): CUDA context and cuBLAS/TE workspaces
# (~1), NCCL buffers per communicator (~0.2-0.5 each, up to 7 communicators), CUDA graphs and TE
# userbuffers (Megatron-Bridge's "Memory Tuning" guide lists these as what its estimator leaves out;
# 2-8 GB in practice). A bound under capacity minus this fits even with nothing measured near it.
NON_TORCH_MAX_GB = 10.0
# What an OOM message showed outside the allocator is what had been set up by the failing step; a
# communicator first used later (a gradient reduce-scatter, a parameter all-gather) adds its buffers
# after it: a proof from that measurement (`bound_limit`) leaves this much besides NCCL_CUSHION_GB per
# communicator the candidate has beyond the run that ran out.
OUTSIDE_CUSHION_GB = 1.0


NEIGHBOUR_DIMS = 2  # ... from a run differing in at most this many of its sizes (parallel, MBS, recompute)


# Never bounded across: how TP, EP and expert TP split the experts' tokens and weights is where trainers
# differ by whole factors (MoE parallel folding: expert activations divided by expert TP, not TP, are 4x
# at tp4 etp1 what the estimate holds; drop-less routing's busiest EP rank), beyond any fixed inflation.
_SPLITS: tuple[tuple[str, ...], ...] = (("tp", "sequence_parallel"), ("ep",), ("etp",))
_STEPS: tuple[tuple[str, ...], ...] = (("tp", "sequence_parallel"), ("pp",), ("cp",), ("ep",), ("etp",), ("mbs",),
          ("recompute_granularity", "recompute_method", "recompute_num_layers", "recompute_modules"),
          ("vpp_size", "layers_per_virtual_stage"), ("tp_comm_overlap", "moe_a2a_overlap"))


def steps(a: Layout, b: Layout) -> list[tuple[str, ...]] | None:
    """The sizes (as groups of Layout fields) in which `a` differs from `b`, or None when a bound from b's
    measurement cannot hold for a: TP, EP or expert TP differ (_SPLITS), or more than NEIGHBOUR_DIMS of TP, PP, CP, EP, expert TP, MBS, the
    recompute settings and the virtual pipeline size differ, or the MBS more than doubles. Farther, laws the estimate does not have
    compound (expert activations that TP does not split, buffers per extra micro-batch sample,
    fragmentation that grows with both MBS and recompute) beyond any fixed factor."""
    diff = [g for g in _STEPS if any(getattr(a, f) != getattr(b, f) for f in g)]
    if any(g in diff for g in _SPLITS):
        return None
    if (a.recompute_granularity == "full") != (b.recompute_granularity == "full") or \
            (a.recompute_granularity == "full" and a.recompute_method != b.recompute_method):
        # full recompute frees and re-allocates every recomputed layer's working set: how much the caching
        # allocator then reserves is the trainer's law, not the estimate's (benchmarks/robustness.py: a
        # stand-in trainer's full/block/2 ran out where a bound from its selective run said it fit); so do
        # block (the last layers keep everything) and uniform (every chunk's input) against each other
        # (there a bound from full/uniform/1 proved full/block/6, which ran out: a 3rd OOM past max_ooms=2)
        return None
    return diff if len(diff) <= NEIGHBOUR_DIMS and a.mbs <= 2 * b.mbs else None


def communicators(lay: Layout) -> int:
    """Process groups of size > 1 a rank belongs to (each holds NCCL buffers outside the allocator)."""
    sizes = (lay.tp, lay.pp, lay.cp, lay.dp * lay.cp, lay.ep, lay.expert_tp if lay.ep > 1 else 1,
             lay.expert_dp if lay.ep > 1 else 1)
    return sum(1 for n in sizes if n > 1)


@dataclass(frozen=True)
class Verdict:
    """What the memory model says of one layout (`MemoryModel.verdict`)."""

    predicted_gb: float | None  # the learned prediction (None: the shape is too unknown)
    sd: float | None  # its uncertainty, 1 sd in GB
    oom_risk: float  # probability of running out of memory (0 when proven to fit)
    proven_fit: bool  # a configuration needing at least as much of every component already ran
    oom: str | None  # why it would surely run out of memory, or None


class MemoryModel:
    """The estimate, corrected per study by what trials really used (per component, not one scale).

    * Each component of the allocated memory -- weights and grads, optimizer state, activations,
      the MoE layers' routed-token activations, the output logits -- has its own multiplier, fitted
      from every measured peak (Megatron's "max allocated": what PyTorch handed out at the peak, the
      estimate's allocated part): a Bayesian linear fit with prior 1 +- COMPONENT_SD each, so one
      measurement moves mostly the component that dominates it, and runs that differ in what
      dominates (a larger MBS: activations; less TP: weights; more EP: expert activations) separate
      them. Activations may also grow faster than the MBS: a share per sample beyond the first is
      learned alongside (PER_SAMPLE_SD), from runs at different MBS. How an MoE's routed tokens are
      split (by TP as the estimate has it, or by expert TP under MoE parallel folding) is a law, not a
      scale: both are fitted and the one the evidence favours predicts (`folds`). A measured "max
      reserved" replaces the assumed fragmentation by the one measured on runs
      that recompute alike (full recompute fragments more), and proves that what lies outside the
      allocator (CUDA context, NCCL buffers) is at most what the run left of the GPU; an OOM message
      shows how much lies there (`outside_gb`), which then replaces the assumed DEFAULT_OVERHEAD_GB. The
      fit's posterior also says how uncertain a prediction still is (`predict_sd`).
    * An OOM adds what it proves: the config needed more than the GPU has (and more than the OOM
      message's "in use" + "tried to allocate" where known), as a lower bound the fit respects as far
      as multipliers within [W_MIN, W_MAX] can (beyond, it counts against the law, and the rules below
      hold it at what it proved);
      every config needing at least as much of every component is predicted OOM, and so is every
      config whose learned prediction is at least that config's, whatever its layout (TP, PP, EP, MBS
      or recompute).
    * Evidence beats the estimate: a config needing no more of any component than one that already
      ran is never pruned, whatever the fit says; a measured config is predicted at what it measured.
    Prune limit: capacity x (1 + margin), since the estimate errs on the high side.
    """

    def __init__(self, model: ModelInfo, capacity_gb: float, *, distributed_optimizer: bool = True,
                 flash_attention: bool = True, margin: float = DEFAULT_SAFETY_MARGIN,
                 overhead_gb: float = DEFAULT_OVERHEAD_GB):
        if capacity_gb <= 0:
            raise ValueError(f"capacity_gb={capacity_gb} must be positive (GPU memory in GB, e.g. 80)")
        if margin < 0:
            raise ValueError(f"margin={margin} must be >= 0 (0.10 = prune above capacity x 1.10)")
        # the study's constants, bound once: every call names only the layout (and ViT checkpointing)
        self.model = model
        self.capacity_gb = float(capacity_gb)
        self.margin = float(margin)
        self.distributed_optimizer = bool(distributed_optimizer)
        self.flash_attention = bool(flash_attention)
        self.overhead_gb = float(overhead_gb)
        self._estimates: dict[tuple[Layout, bool | None], MemoryEstimate | None] = {}  # the estimate never learns
        self._measured: list[tuple[MemoryEstimate, float]] = []  # (what ran, its measured allocated GB)
        self._bounds: list[tuple[MemoryEstimate, float]] = []  # (what ran out of memory, GB it needed at least)
        self._frag: list[tuple[bool, float]] = []  # (full recompute?, measured reserved / allocated)
        self._fixed_cap: float | None = None  # what runs that fit prove the non-PyTorch part is at most (GB)
        # what OOM messages showed in use outside the allocator: (estimate, layout, GB)
        self._outside: list[tuple[MemoryEstimate, Layout, float]] = []
        self._ok: list[MemoryEstimate] = []  # what ran
        # what ran and printed both its peaks: (estimate, layout, max allocated, max reserved, tag)
        self._held: list[tuple[MemoryEstimate, Layout, float, float, object]] = []
        self._oom_at: list[tuple[Layout, bool | None]] = []  # ... as (layout, ViT checkpointing)
        self._growth: tuple[int, float | None] | None = None  # (observations it was computed on, bound_growth)
        self._refuted = 0.0  # the largest growth a bound-proven run that ran out of memory refuted
        self._w = _PRIOR_MEAN.copy()  # learned multipliers in COMPONENTS' order, then the per-sample growth
        self._cov = np.diag(_PRIOR_SD ** 2)  # their posterior covariance
        self._folds = False  # the evidence says expert TP, not TP, splits the routed tokens (`folds`)
        # observations the model did not expect: (how far off, as a share; the estimate; what was seen, GB;
        # an OOM's lower bound?), each re-judged as the fit learns (`_rejudge`)
        self._misses: list[tuple[float, MemoryEstimate, float, bool]] = []

    @property
    def limit_gb(self) -> float:
        return self.capacity_gb * (1 + self.margin)

    @property
    def scales(self) -> dict[str, float]:
        """Learned multipliers on the estimate's components (1.0: as estimated)."""
        return {name: float(w) for name, w in zip(COMPONENTS, self._w)}

    @property
    def per_sample(self) -> float:
        """Learned share of the activations each micro-batch sample beyond the first adds (0.0: linear in
        MBS, as estimated)."""
        return float(self._w[-1])

    @property
    def fragmentation(self) -> float:
        """Reserved beyond allocated, as a share: measured (median), else FRAGMENTATION."""
        return statistics.median(f for _, f in self._frag) - 1 if self._frag else FRAGMENTATION

    def _fragmentation(self, est: MemoryEstimate) -> float:
        """The fragmentation measured on runs that recompute like this one (full recompute frees and
        re-allocates every layer's working set, which fragments the allocator differently), else on any."""
        alike = [f for full, f in self._frag if full == est.full_recompute]
        return statistics.median(alike) - 1 if alike else self.fragmentation

    @property
    def ooms(self) -> int:
        """Configurations observed to run out of memory in this study."""
        return len(self._bounds)

    def estimate(self, layout: Layout, vit_checkpointing: bool | None = None) -> MemoryEstimate | None:
        """The uncorrected estimate of `layout` for this study's model (None: the shape is too unknown)."""
        key = (layout, vit_checkpointing)
        if key not in self._estimates:
            self._estimates[key] = estimate(layout, self.model, distributed_optimizer=self.distributed_optimizer,
                                            vit_checkpointing=vit_checkpointing, overhead_gb=self.overhead_gb,
                                            flash_attention=self.flash_attention)
        return self._estimates[key]

    @staticmethod
    def _x(est: MemoryEstimate) -> np.ndarray:
        dense_act = est.activations_gb - est.expert_activations_gb - est.logits_gb
        return np.array([est.weights_gb + est.grads_gb, est.optimizer_gb, dense_act, est.expert_activations_gb,
                         est.logits_gb])

    @staticmethod
    def _assumed_fixed(est: MemoryEstimate) -> float:
        """The estimate's part outside PyTorch's allocator (CUDA context, NCCL): its overhead without
        its fragmentation share."""
        return est.overhead_gb - FRAGMENTATION * est.allocated_gb

    def _fixed(self, est: MemoryEstimate) -> float:
        """The part outside PyTorch's allocator as assumed, or as an OOM message showed it (`outside_gb`),
        or less where a run that fit proves it (`fixed_cap_gb`)."""
        seen = self._seen_outside(est)
        fixed = self._assumed_fixed(est) if seen is None else seen
        return fixed if self._fixed_cap is None else min(fixed, self._fixed_cap)

    def _seen_outside(self, est: MemoryEstimate) -> float | None:
        """What OOM messages showed in use outside the allocator, carried over to `est` by what the
        estimate puts there beyond each failed run (TE userbuffers): the largest. None before an OOM
        message said it. The assumed DEFAULT_OVERHEAD_GB is a guess for an unknown cluster (the plain
        simulator's H100 holds ~1.5 GB there, a trainer with CUDA graphs or large NCCL buffers 5-8): an
        OOM measures it, and the screen's last few GB, where fast configurations live, depend on it."""
        if not self._outside:
            return None
        return max(max(gb + self._assumed_fixed(est) - self._assumed_fixed(e), 0.0) for e, _, gb in self._outside)

    @property
    def outside_gb(self) -> float | None:
        """The most an OOM message showed in use outside PyTorch's allocator (GB); None before one did."""
        return max((gb for _, _, gb in self._outside), default=None)

    @property
    def fixed_cap_gb(self) -> float | None:
        """At most this much of the GPU is outside PyTorch's allocator, as proven by the fullest run that
        fit (capacity minus its "max reserved"); None before any run reported its memory."""
        return self._fixed_cap

    @property
    def folds(self) -> bool:
        """Does this trainer split the MoE layers' routed tokens by expert TP rather than TP (Megatron-Core's
        MoE parallel folding, `MemoryEstimate.expert_folding`)? Chosen by the evidence (`_fit`)."""
        return self._folds

    def _xl(self, est: MemoryEstimate, folded: bool | None = None) -> np.ndarray:
        """What the fit weighs (LEARNED): the components under a law of expert splitting (`folded`, else the
        one the evidence favours, `folds`), then the activations times the samples beyond the first."""
        x = self._x_folded(est) if (self._folds if folded is None else folded) else self._x(est)
        return np.append(x, (x[2] + x[3]) * (est.micro_batch - 1))

    def _fitted_sd(self, x: np.ndarray) -> float:
        """1 sd of the learned allocated GB of components `x`, from the multipliers' posterior."""
        return math.sqrt(max(float(x @ self._cov @ x), 0.0))

    def _corrected(self, est: MemoryEstimate, folded: bool | None = None) -> float:
        x = self._xl(est, folded)
        return self._fixed(est) + (1 + self._fragmentation(est)) * float(x @ self._w)

    @classmethod
    def _x_folded(cls, est: MemoryEstimate) -> np.ndarray:
        """The components if expert TP, not TP, split the routed tokens (`expert_folding`)."""
        x = cls._x(est)
        x[3] *= est.expert_folding
        return x

    def _fit(self) -> None:
        """Fit the multipliers under both laws of how expert TP splits the routed tokens (`expert_folding`)
        and keep the law the evidence favours: the estimate's own (TP splits them) unless the other
        explains the measured peaks and the OOMs clearly better (LAW_EVIDENCE). One law's fit cannot
        meet an OOM at TP 4 / expert TP 1 whose routed tokens a folding trainer holds 4x of without
        tripling every component, which the runs that fit contradict (robustness.py, 64-expert MoE on
        the stand-in trainer: every prediction doubled, the optimum hidden at 114 GB of its ~50)."""
        plain, folded = self._fit_law(False), self._fit_law(True)
        self._folds = folded[2] + LAW_EVIDENCE < plain[2]
        self._w, self._cov, _ = folded if self._folds else plain
        self._rejudge()

    def _rejudge(self) -> None:
        """A miss the model as it now stands predicts is no evidence that the model cannot describe this
        trainer: each is judged again as a prediction (by the current law fitted without that
        configuration's runs), and kept only as far off as that prediction still is, once MIN_REJUDGE other
        configurations ran (one run agrees with any fit). A miss recorded before the fit had learned what
        it showed stays out of date otherwise: the 64-expert MoE on the stand-in trainer kept every later
        prediction +-30 % uncertain from a TP2 MBS-4 run that came in before the per-sample growth was
        learned, though the fit without that run then predicted it within 2 %, and the optimum, at 78 of
        79 GB, stayed a coin toss; and a TP2 / expert TP1 run 46 % over its prediction under the estimate's
        law of expert splitting, which the folding law then predicted within 7 %."""
        if len({id(e) for e, _ in self._measured}) <= MIN_REJUDGE:
            return
        kept = []
        fits: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # a configuration's repeats share one fit without it
        for _, e, seen, least in self._misses:
            if id(e) not in fits:
                fits[id(e)] = self._without(e)
            off = self._off(e, seen, least, fits[id(e)])
            if off is not None:
                kept.append((off, e, seen, least))
        self._misses = kept

    def _without(self, est: MemoryEstimate) -> tuple[np.ndarray, np.ndarray]:
        """The multipliers and their covariance under the current law, fitted without `est`'s runs."""
        w, cov, _ = self._fit_law(self._folds, [m for m in self._measured if m[0] is not est],
                                  [b for b in self._bounds if b[0] is not est])
        return w, cov

    def _fit_law(self, fold: bool, measured: list[tuple[MemoryEstimate, float]] | None = None,
                 bounds: list[tuple[MemoryEstimate, float]] | None = None) -> tuple[np.ndarray, np.ndarray, float]:
        """Posterior mean of the multipliers given the measured peaks, subject to what every OOM proves
        (its components needed at least its bound): a small quadratic program solved by active sets,
        so a bound shapes the fit only where the others do not already imply it (two OOMs that differ
        in one component must not pin that component to zero by both being held as equalities).
        Returns (multipliers, covariance, misfit): the misfit is the fit's -2 log posterior (measured
        peaks in their sd, the multipliers' distance from 1) plus what an OOM the multipliers, clipped
        to [W_MIN, W_MAX], still cannot explain, in sd of its bound. An unexplained OOM is not made
        up by scaling every component (that contradicts every run that fit); it is evidence against
        the law, and `_oom_reason` judges by it directly. `measured` and `bounds` default to the study's own
        runs and OOMs (`_without` leaves one configuration's out)."""
        measured = self._measured if measured is None else measured
        bounds = self._bounds if bounds is None else bounds
        n = len(LEARNED)
        prior = 1 / _PRIOR_SD ** 2
        A, b = np.diag(prior), prior * _PRIOR_MEAN
        X = np.array([self._xl(e, fold) for e, _ in measured]).reshape(len(measured), n)
        y = np.array([v for _, v in measured])
        sd = np.maximum(MEASURED_SD * y, 1e-3)
        if measured:
            A = A + (X / sd[:, None] ** 2).T @ X
            b = b + (X / sd[:, None] ** 2).T @ y
        # in allocated terms: what the allocator must have handed out for the total to exceed the need
        # (converted now, with what is known now of the non-PyTorch part and the fragmentation)
        C = np.array([self._xl(e, fold) for e, _ in bounds]).reshape(len(bounds), n)
        d = np.array([(need - self._fixed(e)) / (1 + self._fragmentation(e)) for e, need in bounds])
        w = np.clip(_bounded_least_squares(A, b, C, d), _LOW, _HIGH)
        misfit = float((((w - _PRIOR_MEAN) / _PRIOR_SD) ** 2).sum() + (((y - X @ w) / sd) ** 2).sum())
        misfit += float(((np.clip(d - C @ w, 0, None) / np.maximum(MEASURED_SD * d, 1e-3)) ** 2).sum())
        return w, np.linalg.inv(A), misfit

    def predict(self, layout: Layout, vit_checkpointing: bool | None = None) -> float | None:
        """Predicted peak GB (the estimate, corrected by what the study measured), or None."""
        est = self.estimate(layout, vit_checkpointing)
        return None if est is None else self._corrected(est)

    def predict_sd(self, layout: Layout, vit_checkpointing: bool | None = None) -> float | None:
        """How uncertain `predict` still is (1 sd, GB): wide for what resembles nothing measured, narrow
        for configs made of the components the measured runs pinned down."""
        est = self.estimate(layout, vit_checkpointing)
        return None if est is None else self._sd(est)

    def _sd(self, est: MemoryEstimate) -> float:
        x = self._xl(est)
        fitted = (1 + self._fragmentation(est)) * self._fitted_sd(x)
        return math.hypot(fitted, self.model_error * self._corrected(est))

    @property
    def model_error(self) -> float:
        """What no learned component captures, as a share of a prediction: MODEL_ERROR, or as far off as
        the model is on a run it had to predict (a trainer it cannot describe widens it). Every miss is
        judged again as the fit learns (`_rejudge`), so one the model now predicts no longer counts."""
        return max([MODEL_ERROR, *(m[0] for m in self._misses)])

    @staticmethod
    def _within(a: np.ndarray, b: np.ndarray) -> bool:
        """Needs a (LEARNED's terms) no more than b whatever the fit (so a fits wherever b did): no more of
        every component, and what its samples beyond the first add to the activations (learned within
        [0, PER_SAMPLE_MAX]) beyond b's is no more than its smaller activations save at the least
        multiplier (W_MIN). Without that term, TP2 CP2 at MBS 4 "needed no more" than TP2 CP1 at MBS 2 (the
        same tokens per rank), and ran out of memory on a trainer whose activations grow with the MBS."""
        n = len(COMPONENTS)
        if not np.all(a[:n] <= b[:n] * (1 + 1e-6) + 1e-9):
            return False
        extra = a[n] - b[n]
        return bool(extra <= 1e-9 or PER_SAMPLE_MAX * extra <= W_MIN * (b[2] + b[3] - a[2] - a[3]))

    def _fits_like(self, est: MemoryEstimate, ok: MemoryEstimate) -> bool:
        """Does `est` surely fit because `ok` ran: no more of any component, inside the allocator and
        outside it, and, recomputing otherwise (the allocator fragments differently), no larger a
        reservation as learned."""
        if not self._needs_no_more(est, ok):
            return False
        if est.full_recompute == ok.full_recompute:
            return True
        return self._reserve(est) <= self._reserve(ok)

    def _needs_no_more(self, a: MemoryEstimate, b: MemoryEstimate) -> bool:
        """Does `a` need no more than `b` of every component, under either law of expert splitting, and
        no more outside the allocator? (TE's userbuffers, s·mbs/cp: TP4 PP4 VP5 CP1 with selective
        recompute holds less of every allocator component than TP4 PP4 CP2 with full recompute, but twice
        its userbuffers, and ran out where that run fit: search.py, Llama-3-70B on 32 H100.)"""
        return self._within(self._xl(a, False), self._xl(b, False)) and \
            self._within(self._xl(a, True), self._xl(b, True)) and self._assumed_fixed(a) <= self._assumed_fixed(b) + 1e-9

    def _reserve(self, est: MemoryEstimate) -> float:
        """What the allocator reserves for `est` as learned: its allocated part x its fragmentation."""
        return (1 + self._fragmentation(est)) * float(self._xl(est) @ self._w)

    def proven_fit(self, layout: Layout, vit_checkpointing: bool | None = None) -> bool:
        """Does a configuration that already ran need at least as much of every component?"""
        est = self.estimate(layout, vit_checkpointing)
        return est is not None and self._proven(est)

    def _proven(self, est: MemoryEstimate) -> bool:
        return any(self._fits_like(est, ok) for ok in self._ok)

    def oom_risk(self, layout: Layout, vit_checkpointing: bool | None = None) -> float:
        """Probability that `layout` runs out of memory, from the learned prediction and its uncertainty
        (`predict_sd`); 0 when a configuration needing at least as much of every component already ran,
        or without an estimate."""
        est = self.estimate(layout, vit_checkpointing)
        return 0.0 if est is None else self._risk(est, self._proven(est))

    def _risk(self, est: MemoryEstimate, proven: bool) -> float:
        if proven:
            return 0.0
        gb, sd = self._corrected(est), self._sd(est)
        if not sd:
            return 0.0
        return chance_above((self.capacity_gb - gb) / sd)

    def verdict(self, layout: Layout, vit_checkpointing: bool | None = None) -> Verdict:
        """Everything the model says of one layout at once (one estimate, one proof search)."""
        est = self.estimate(layout, vit_checkpointing)
        if est is None:
            return Verdict(None, None, 0.0, False, None)
        proven = self._proven(est)
        return Verdict(self._corrected(est), self._sd(est), self._risk(est, proven), proven,
                       None if proven else self._oom_reason(est))

    def predicted_oom(self, layout: Layout, vit_checkpointing: bool | None = None) -> str | None:
        """Why this config would surely run out of memory, or None."""
        est = self.estimate(layout, vit_checkpointing)
        if est is None or self._proven(est):
            return None  # (proven: something needing at least as much of everything already ran)
        return self._oom_reason(est)

    def _oom_reason(self, est: MemoryEstimate) -> str | None:
        # Both rules hold under either law of how expert tensor parallelism splits the routed tokens
        # (`expert_folding`): an OOM at TP 8 / expert TP 2 whose expert activations a folding trainer holds
        # 4x of says nothing of TP 1 / expert TP 1 by the unfolded estimate alone.
        x = self._x(est)
        for bad, _ in self._bounds:
            # ...and clearly more in total: fragmentation differs between configurations (full recompute,
            # MoE token counts), so one a hair above an OOM may still fit; the learned rules judge those
            # (recomputing otherwise, the allocator fragments otherwise: the reservation as learned decides,
            # as it does for a proof of fit, `_fits_like`)
            if self._needs_no_more(bad, est) and x.sum() >= (1 + DOMINANCE_MARGIN) * self._x(bad).sum() and \
                    (est.full_recompute == bad.full_recompute or self._reserve(est) >= self._reserve(bad)):
                return (f"needs at least as much of every memory component as a configuration that already "
                        f"ran out of memory ({self._corrected(bad):.1f} GB learned)")
        need = self._corrected(est)
        if self._bounds:
            # (an OOM the fit cannot explain is held at what it proved it needed, not at its prediction: the
            # ranking says nothing beyond the GPU's size where the model missed that run)
            smallest = min(max(self._corrected(e), need) for e, need in self._bounds)
            folded = min(max(self._corrected(e, folded=True), need) for e, need in self._bounds)
            if need >= smallest - 1e-9 and self._corrected(est, folded=True) >= folded - 1e-9:
                return (f"predicted {need:.1f} GB >= {smallest:.1f} GB of a configuration that already ran "
                        f"out of memory")
        if need > self.limit_gb:
            moved = [f"{k} x{v:.2f}" for k, v in self.scales.items() if abs(v - 1) >= 0.005]
            if self.per_sample >= 0.005:
                moved.append(f"activations +{100 * self.per_sample:.0f} % per sample beyond the first")
            if self._seen_outside(est) is not None and self._fixed(est) == self._seen_outside(est):
                moved.append(f"non-PyTorch {self._fixed(est):.1f} GB as an OOM message showed")
            elif self._fixed(est) < self._assumed_fixed(est):
                moved.append(f"non-PyTorch <= {self._fixed(est):.1f} GB")
            learned = f", learned {' '.join(moved)}" if moved and (self._measured or self._bounds) else ""
            return (f"predicted {need:.1f} GB > {self.capacity_gb:g} GB capacity x {1 + self.margin:.2f} "
                    f"margin ({est.breakdown()}{learned})")
        return None

    def _miss(self, est: MemoryEstimate, seen: float, *, at_least: bool = False) -> None:
        """Remember how far off the prediction was when its own uncertainty did not cover it (beyond 2
        sd): evidence that the model cannot describe this trainer, which widens `model_error`. `seen` is
        a measured "max allocated", or (`at_least`) what an OOM proved the whole GPU needed at least."""
        share = self._off(est, seen, at_least)
        if share is not None:
            self._misses.append((share, est, seen, at_least))

    def _off(self, est: MemoryEstimate, seen: float, at_least: bool,
             fit: tuple[np.ndarray, np.ndarray] | None = None) -> float | None:
        """How far off (share of the prediction) the model as it stands (or `fit`: multipliers and their
        covariance) is on `seen`, when beyond 2 sd."""
        w, cov = fit or (self._w, self._cov)
        x = self._xl(est)
        sd = math.sqrt(max(float(x @ cov @ x), 0.0))
        predicted = float(x @ w)
        if at_least:
            scale = 1 + self._fragmentation(est)
            predicted, sd = self._fixed(est) + scale * predicted, scale * sd
        off = seen - predicted if at_least else abs(seen - predicted)
        return off / max(predicted, 1e-9) if off > 2 * math.hypot(sd, MODEL_ERROR * predicted) else None

    def observe_success(self, layout: Layout, measured_peak_gb: float | None, *, reserved_gb: float | None = None,
                        vit_checkpointing: bool | None = None, tag: object = None) -> None:
        """A run that completed; `measured_peak_gb` is Megatron's "max allocated" (None if not
        printed), `reserved_gb` its "max reserved"; `tag` names the run in `bound`'s answer."""
        est = self.estimate(layout, vit_checkpointing)
        if est is None:
            return
        self._ok.append(est)
        if measured_peak_gb is None or measured_peak_gb <= 0 or est.allocated_gb <= 0:
            return
        ratio = measured_peak_gb / est.allocated_gb
        if not 0.2 <= ratio <= 5.0:
            log.warning("memory: ignoring measured %.1f GB against an estimate of %.1f GB (ratio %.2f is "
                        "implausible; wrong unit?)", measured_peak_gb, est.allocated_gb, ratio)
            return
        self._miss(est, float(measured_peak_gb))
        self._measured.append((est, float(measured_peak_gb)))
        footprint = float(measured_peak_gb)  # reserved >= allocated: without it, a looser proof
        if reserved_gb is not None and 1.0 <= reserved_gb / measured_peak_gb <= 2.0:
            self._frag.append((est.full_recompute, reserved_gb / measured_peak_gb))
            footprint = float(reserved_gb)
            self._held.append((est, layout, float(measured_peak_gb), float(reserved_gb), tag))
        # it fit, so everything outside the allocator took at most what its peak left of the GPU
        room = max(self.capacity_gb - footprint, 0.0)
        self._fixed_cap = room if self._fixed_cap is None else min(self._fixed_cap, room)
        self._fit()

    @property
    def held_gb(self) -> float | None:
        """The largest "max reserved" of a run that fit: with everything outside the allocator, it fit on
        the GPU, so any run reserving no more fits too (None before a run reported both peaks)."""
        return max((r for _, _, _, r, _ in self._held), default=None)

    def bound(self, layout: Layout, vit_checkpointing: bool | None = None) -> tuple[float, object] | None:
        """A conservative upper bound on what `layout` reserves (GB) and the run it is taken from, or
        None: the tightest over the runs that printed both peaks and are its `neighbours`, each its
        measured "max allocated"
        plus the estimate's difference to `layout`, growth inflated and savings discounted
        (`bound_growth`, SAVINGS), times its measured reservation ratio with cushions. Only the difference rests on the
        estimate, and pessimistically: a proof of fit (`bound <= bound_limit`) that survives a trainer
        whose formulas are not ours, within a factor 2 on what differs."""
        growth = self.bound_growth
        return None if growth is None else self._bound(layout, vit_checkpointing, growth)

    @property
    def bound_growth(self) -> float | None:
        """How much `bound` inflates the estimate's growth: the least of GROWTHS under which no run that
        ran out of memory would have been proven to fit (None: even the largest is refuted, and `bound`
        proves nothing in this study): a trainer whose memory grows faster than the estimate says (more
        buffers per micro-batch, another allocator) makes the bound more pessimistic, not wrong again."""
        if self._growth is None or self._growth[0] != len(self._oom_at) + len(self._held):
            found = next((g for g in GROWTHS if g > self._refuted
                          and not any(self._proves(lay, vit, g) for lay, vit in self._oom_at)), None)
            self._growth = (len(self._oom_at) + len(self._held), found)
        return self._growth[1]

    def _proves(self, layout: Layout, vit: bool | None, growth: float) -> bool:
        found, limit = self._bound(layout, vit, growth), self.bound_limit(layout)
        return found is not None and limit is not None and found[0] <= limit

    def _bound(self, layout: Layout, vit_checkpointing: bool | None, growth: float) -> tuple[float, object] | None:
        est = self.estimate(layout, vit_checkpointing)
        if est is None or not self._held:
            return None
        ratios = [r / a for _, _, a, r, _ in self._held]
        best: tuple[float, object] | None = None
        for ref, ref_layout, allocated, reserved, tag in self._held:
            diff = steps(layout, ref_layout)
            grown = None if diff is None else self._grown(ref_layout, layout, diff, vit_checkpointing, growth)
            if grown is None:
                continue
            alloc = allocated + grown
            ratio = reserved / allocated
            if diff:
                ratio += RATIO_CUSHION
            if est.full_recompute != ref.full_recompute or \
                    layout.recompute_granularity != ref_layout.recompute_granularity or \
                    layout.recompute_modules != ref_layout.recompute_modules:
                ratio = max(ratio, *ratios) + RECOMPUTE_CUSHION
            gb = max(alloc, 0.0) * ratio
            if best is None or gb < best[0]:
                best = (gb, tag)
        return best

    def _grown(self, ref: Layout, layout: Layout, diff: list[tuple[str, ...]], vit: bool | None,
               growth: float) -> float | None:
        """What the estimate says changes from `ref` to `layout` (which differ in `diff`), one size at a
        time, growth inflated (x `growth`, or the learned multiplier where larger) and savings discounted
        (x SAVINGS), in the worse of the orders: changes that cancel in the estimate (CP halving what a
        doubled MBS doubles) are not trusted to cancel in the trainer. None: a step has no estimate."""
        worst: float | None = None
        for order in itertools.permutations(diff):
            here, total = ref, 0.0
            for group in order:
                nxt = replace(here, **{f: getattr(layout, f) for f in group})
                a, b = self.estimate(here, vit), self.estimate(nxt, vit)
                if a is None or b is None:
                    return None
                # the larger growth (the smaller saving) of either law of how expert TP splits the routed
                # tokens (`expert_folding`): a CP step from TP 4 / expert TP 1 grows a folding trainer's
                # expert activations 4x what the estimate says
                d = np.maximum(self._xl(b, False) - self._xl(a, False), self._xl(b, True) - self._xl(a, True))
                n = len(COMPONENTS)
                total += float((np.maximum(growth, self._w[:n]) * np.clip(d[:n], 0, None)).sum())
                total += SAVINGS * float(np.clip(d[:n], None, 0).sum())
                # activations that grow faster than the MBS, as learned, inflated as the rest
                total += growth * self.per_sample * max(float(d[n]), 0.0)
                here = nxt
            worst = total if worst is None else max(worst, total)
        return 0.0 if worst is None else worst

    def bound_limit(self, layout: Layout) -> float | None:
        """What `bound` must stay under for `layout` to surely fit: the fullest run's "max reserved"
        (it fit with everything outside the allocator), less NCCL_CUSHION_GB per communicator `layout`
        has beyond that run's (NCCL's buffers are outside the allocator); or the capacity less the most
        that lies outside the allocator (NON_TORCH_MAX_GB), or the capacity less what an OOM message showed
        outside it (`outside_gb`, with OUTSIDE_CUSHION_GB), whichever is most."""
        if not self._held:
            return None
        _, top_layout, _, top, _ = max(self._held, key=lambda h: h[3])
        limits = [top - self._outside_growth(layout, top_layout), self.capacity_gb - NON_TORCH_MAX_GB]
        if self._outside:
            limits.append(self.capacity_gb - OUTSIDE_CUSHION_GB
                          - max(gb + self._outside_growth(layout, lay) for _, lay, gb in self._outside))
        return max(limits)

    def _outside_growth(self, layout: Layout, ref: Layout) -> float:
        """What `layout` may hold outside the allocator beyond `ref` (GB), pessimistically: NCCL_CUSHION_GB
        per communicator it has beyond ref's, and TE's userbuffers (--tp-comm-overlap) beyond ref's at the
        bound's first inflation."""
        return NCCL_CUSHION_GB * max(communicators(layout) - communicators(ref), 0) + \
            GROWTHS[0] * max(userbuffers_gb(layout, self.model) - userbuffers_gb(ref, self.model), 0.0)

    def observe_oom(self, layout: Layout, *, needed_gb: float | None = None, outside_gb: float | None = None,
                    vit_checkpointing: bool | None = None) -> None:
        """A run that ran out of memory; `needed_gb` is what the OOM message proves it needed at least
        (memory in use + the allocation that failed), `outside_gb` what it showed in use outside PyTorch's
        allocator (in use - allocated - reserved but unallocated), if known."""
        est = self.estimate(layout, vit_checkpointing)
        if est is None:
            return
        # A bound that proved this run fits is refuted as it stood then: what the OOM teaches the learned
        # model (a larger multiplier, a larger reservation ratio) can make the same bound no longer prove
        # this layout, while it still proves its neighbours at the same inflation (robustness.py, memory
        # trainer: a 4th OOM at x2 after a 3rd at x2).
        growth = self.bound_growth
        if growth is not None and self._proves(layout, vit_checkpointing, growth):
            self._refuted = max(self._refuted, growth)
        self._oom_at.append((layout, vit_checkpointing))
        if isinstance(outside_gb, (int, float)) and 0 <= outside_gb < self.capacity_gb:
            self._outside.append((est, layout, float(outside_gb)))
        need = max(self.capacity_gb, needed_gb or 0.0) * (1 + 1e-3)
        self._miss(est, need, at_least=True)
        self._bounds.append((est, need))
        self._fit()


def _bounded_least_squares(A: np.ndarray, b: np.ndarray, C: np.ndarray, d: np.ndarray) -> np.ndarray:
    """argmin ½·wᵀAw − bᵀw subject to C·w >= d (A positive definite; a handful of constraints), by the
    primal active-set method: hold the most violated constraint as an equality, release any whose
    multiplier turns negative, until every constraint holds and every held one pushes the right way."""
    active: list[int] = []
    w = np.linalg.solve(A, b)
    for _ in range(4 * len(d) + 4):
        if active:
            Ca = C[active]
            k = len(active)
            kkt = np.block([[A, -Ca.T], [Ca, np.zeros((k, k))]])
            sol = np.linalg.lstsq(kkt, np.concatenate([b, d[active]]), rcond=None)[0]
            w, lam = sol[: len(b)], sol[len(b):]
            if lam.min() < -1e-12:
                active.pop(int(lam.argmin()))
                continue
        else:
            w = np.linalg.solve(A, b)
        slack = C @ w - d if len(d) else np.zeros(0)
        violated = [i for i in np.argsort(slack) if slack[i] < -1e-9 * max(1.0, abs(d[i])) and i not in active]
        if not violated:
            return w
        active.append(int(violated[0]))
    return w
