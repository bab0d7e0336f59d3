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
  backend (flash/fused) they never exist, so selective recompute saves about nothing there; full
  recompute keeps each layer's 2·s·b·h input plus the working set of the chunk being recomputed.
  1F1B keeps min(pp, micro-batches) in flight on the first stage (× 1 + (p−1)/(p·v) when
  interleaved); the last stage holds one plus the logits (bf16 and their fp32 copy: 6·s·b·V/tp).
  Context parallelism divides everything by cp; TP without sequence parallelism leaves Korthikanti's
  10·s·b·h unsplit.
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

import logging
import math
import statistics
import subprocess
from dataclasses import dataclass
from typing import Any

import numpy as np

from zenithtune.modelinfo import ModelInfo
from zenithtune.validate import Layout

log = logging.getLogger(__name__)

GIB = float(2**30)
DEFAULT_OVERHEAD_GB = 4.0  # CUDA context + NCCL/workspace buffers, per GPU
FRAGMENTATION = 0.10  # the caching allocator reserves this much more than it hands out (share of allocated)
DEFAULT_SAFETY_MARGIN = 0.02  # prune only above capacity x (1 + margin); tuned in benchmarks/memory_accuracy.py
DEFAULT_CAPACITY_GB = 80.0  # H100 / A100-80GB when nothing else is known
_ASSUMED_SEQ = 4096  # when the command does not say --seq-length
_ASSUMED_VOCAB = 131072  # when the vocab comes from a tokenizer we cannot see
_ASSUMED_VISION_PARAMS = 600e6  # a VLM whose vision tower we know nothing about
_LOGIT_BYTES = 6  # bf16 logits + their fp32 copy for the vocab-parallel cross entropy coexist at the peak
_REPLICATED_WITHOUT_SP = 10  # Korthikanti: bytes/(s·b·h) that TP does not split without SP


@dataclass(frozen=True)
class MemoryEstimate:
    """Estimated peak memory of the busiest GPU, in GB (GiB)."""

    weights_gb: float
    grads_gb: float
    optimizer_gb: float
    activations_gb: float
    overhead_gb: float
    stage: str = "only"  # the pipeline stage that peaks: "only" (pp=1), "first" or "last"

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


@dataclass(frozen=True)
class _Shape:
    L: int
    h: int
    a: int
    g: int
    d: int  # head dim
    F: int  # dense ffn width
    V: int  # vocab before padding
    s: int
    E: int  # experts (0 = dense)
    k: int  # router top-k
    Fm: int  # expert ffn width
    Fs: int  # shared-expert ffn width (total)
    n_moe: int  # MoE layers
    glu: bool
    tied: bool

    @classmethod
    def of(cls, m: ModelInfo) -> _Shape | None:
        if not m.num_layers or not m.hidden_size:
            return None
        h = m.hidden_size
        a = m.num_attention_heads or max(1, h // 128)
        d = m.head_dim or h // a
        glu = m.swiglu is not False
        F = m.ffn_hidden_size or (int(8 * h / 3 / 64) * 64 if glu else 4 * h)
        E = (m.num_experts or 0) if m.is_moe else 0
        freq = m.moe_layer_freq or 1
        return cls(L=m.num_layers, h=h, a=a, g=m.num_query_groups or a, d=d, F=F,
                   V=m.vocab_size or _ASSUMED_VOCAB, s=m.seq_length or _ASSUMED_SEQ, E=E,
                   k=(m.moe_router_topk or 2) if E else 0, Fm=(m.moe_ffn_hidden_size or F) if E else 0,
                   Fs=(m.moe_shared_expert_size or 0) if E else 0,
                   n_moe=math.ceil(m.num_layers / freq) if E else 0, glu=glu,
                   tied=m.tie_embeddings is not False)

    # parameters ---------------------------------------------------------------------------------
    @property
    def attn_params(self) -> int:
        return self.h * self.d * (2 * self.a + 2 * self.g)  # Q, K, V (GQA) and the output projection

    def mlp_params(self, width: int) -> int:
        return (3 if self.glu else 2) * self.h * width

    # activations, bytes per token (s·b) of one layer before TP/CP splits --------------------------
    @property
    def attn_act(self) -> float:
        # Korthikanti's 11·h + 4·h for the two norms; Q/K/V/output at their real widths (GQA)
        return (7 + 4 * self.a * self.d / self.h + 4 * self.g * self.d / self.h) * self.h

    def mlp_act(self, moe: bool) -> float:
        per_width = 6 if self.glu else 4  # fc1 output(s) + activation output, bf16
        if not moe:
            return (3 + per_width * self.F / self.h) * self.h
        # every routed copy keeps its permuted input, its ffn intermediates and its output (the
        # prob-weighted combine needs it); the router keeps fp32 logits and probabilities
        routed = self.k * (4 + per_width * self.Fm / self.h)
        router = 8 * self.E / self.h
        return (3 + routed + router + per_width * self.Fs / self.h) * self.h

    @property
    def score_act(self) -> float:
        return 5 * self.a * self.s  # softmax, its dropout mask and output, per token (no flash)


def _padded_vocab(V: int, tp: int) -> int:
    step = 128 * tp
    return -(-V // step) * step


def estimate(layout: Layout, model: ModelInfo, *, distributed_optimizer: bool = True,
             vit_checkpointing: bool | None = None, overhead_gb: float = DEFAULT_OVERHEAD_GB,
             flash_attention: bool = True) -> MemoryEstimate | None:
    """Peak per-GPU memory of `layout` training `model`, or None when the shape is too unknown.

    `vit_checkpointing` None means ms-swift's default (on). `flash_attention` False for Megatron's
    `--attention-backend unfused|local` (attention scores are then stored unless recomputed). See
    the module docstring for what is approximate."""
    sh = _Shape.of(model)
    if sh is None:
        return None
    t, p, c = max(1, layout.tp), max(1, layout.pp), max(1, layout.cp)
    et, ep = max(1, layout.expert_tp), max(1, layout.ep)
    dc = max(1, layout.n_gpus // (t * p))  # the optimizer shards over dp·cp
    edp = max(1, layout.expert_dp)
    Vp = _padded_vocab(sh.V, t)

    # --- parameters on one GPU of a stage -------------------------------------------------------
    layers = sh.L / p
    moe_layers = sh.n_moe / p
    dense_layers = layers - moe_layers
    dense = (layers * sh.attn_params + dense_layers * sh.mlp_params(sh.F)
             + moe_layers * sh.mlp_params(sh.Fs)) / t + moe_layers * sh.h * sh.E  # router replicated
    experts = moe_layers * sh.E * sh.mlp_params(sh.Fm) / (et * ep) if sh.E else 0.0
    emb = Vp * sh.h / t
    vision = 0.0
    hv = model.vision_hidden_size or 1280
    lv = model.vision_num_layers or 32
    fv = model.vision_ffn_hidden_size or 4 * hv
    if model.is_vlm:
        if model.vision_params:
            vision = float(model.vision_params)
        elif model.vision_num_layers and model.vision_hidden_size:
            vision = float(lv * (4 * hv * hv + 2 * hv * fv))
        else:
            vision = _ASSUMED_VISION_PARAMS

    # --- activations ----------------------------------------------------------------------------
    b = layout.mbs
    tokens = sh.s * b / c  # per rank
    split = t if layout.sp_active or t == 1 else None

    def layer_act(moe: bool, scores: bool) -> float:
        total = sh.attn_act + sh.mlp_act(moe) + (sh.score_act if scores else 0.0)
        if split is None:  # TP without SP keeps the norms' and inputs' activations whole
            rep = _REPLICATED_WITHOUT_SP * sh.h
            return tokens * (rep + (total - rep) / t)
        return tokens * total / split

    gran = layout.recompute_granularity
    moe_frac = sh.n_moe / sh.L
    scores = gran is None and not flash_attention
    full_layer = (1 - moe_frac) * layer_act(False, not flash_attention) + moe_frac * layer_act(True, not flash_attention)
    stored_layer = (1 - moe_frac) * layer_act(False, scores) + moe_frac * layer_act(True, scores)
    layer_input = 2 * tokens * sh.h / (split or 1)
    working = 0.0
    if gran == "full":
        n = max(1, layout.recompute_num_layers or 1)
        if layout.recompute_method == "block":
            n = min(n, math.ceil(layers))
            per_mb = n * layer_input + (layers - n) * stored_layer
            working = full_layer
        else:  # uniform: the input of each chunk of n layers; recomputing one chunk needs n layers
            per_mb = math.ceil(layers / n) * layer_input
            working = min(n, layers) * full_layer
    else:
        per_mb = layers * stored_layer

    m = layout.microbatches or p
    in_flight: float = min(p, m) if p > 1 else 1
    v = layout.virtual_stages(sh.L)
    if p > 1 and v > 1:
        in_flight *= 1 + (p - 1) / (p * v)
    logits = _LOGIT_BYTES * tokens * Vp / t

    vision_act = 0.0
    if model.is_vlm:
        # vision patches per sample: as stated, else about one per text position; CP does not split it
        v_tokens = (model.vision_seq_length or sh.s) * b
        v_layer = v_tokens * hv * (18 + 4 * fv / hv)  # Korthikanti's 34 at fv = 4·hv (flash, no dropout masks kept)
        ckpt = True if vit_checkpointing is None else vit_checkpointing
        vision_act = (lv * 2 * v_tokens * hv + v_layer) if ckpt else lv * v_layer

    def stage(params_dense: float, params_expert: float, act: float, name: str) -> MemoryEstimate:
        opt_dense = 12 / dc if distributed_optimizer else 12
        opt_expert = 12 / edp if distributed_optimizer else 12
        total_params = params_dense + params_expert
        optimizer = opt_dense * params_dense + opt_expert * params_expert
        allocated = 6 * total_params + optimizer + act
        return MemoryEstimate(
            weights_gb=2 * total_params / GIB, grads_gb=4 * total_params / GIB, optimizer_gb=optimizer / GIB,
            activations_gb=act / GIB, overhead_gb=overhead_gb + FRAGMENTATION * allocated / GIB, stage=name)

    if p == 1:
        emb_all = emb * (1 if sh.tied else 2)
        return stage(dense + emb_all + vision, experts, per_mb + working + logits + vision_act, "only")
    first = stage(dense + emb + vision, experts, in_flight * per_mb + working + vision_act * min(p, m), "first")
    last = stage(dense + emb, experts, per_mb + working + logits, "last")  # tied: a copy for the output layer
    return first if first.total_gb >= last.total_gb else last


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


class MemoryModel:
    """The estimate, corrected per study by what trials really used (per component, not one scale).

    * Each component of the allocated memory -- weights and grads, optimizer state, activations --
      has its own multiplier, fitted from every measured peak (Megatron's "max allocated": what
      PyTorch handed out at the peak, the estimate's allocated part): a Bayesian linear fit with prior
      1 +- COMPONENT_SD each, so one measurement moves mostly the component that dominates it, and
      two runs that differ in what dominates (a larger MBS: activations; less TP: weights) separate
      them. A measured "max reserved" replaces the assumed fragmentation by the measured one.
    * An OOM adds what it proves: the config needed more than the GPU has (and more than the OOM
      message's "in use" + "tried to allocate" where known), as a lower bound the fit must respect;
      and every config whose learned prediction is at least that config's is predicted OOM from then
      on, whatever its layout (TP, PP, EP, MBS or recompute).
    * Evidence beats the estimate: a config predicted no larger than one that already ran is never
      pruned, and a measured config is predicted at what it measured.
    Prune limit: capacity x (1 + safety_margin), since the estimate errs on the high side.
    """

    def __init__(self, capacity_gb: float, safety_margin: float = DEFAULT_SAFETY_MARGIN, *,
                 distributed_optimizer: bool = True, overhead_gb: float = DEFAULT_OVERHEAD_GB,
                 flash_attention: bool = True):
        if capacity_gb <= 0:
            raise ValueError(f"capacity_gb={capacity_gb} must be positive (GPU memory in GB, e.g. 80)")
        if safety_margin < 0:
            raise ValueError(f"safety_margin={safety_margin} must be >= 0 (0.10 = prune above capacity x 1.10)")
        self.capacity_gb = float(capacity_gb)
        self.safety_margin = float(safety_margin)
        # estimate() keywords used unless a call passes its own
        self.defaults: dict[str, Any] = {"distributed_optimizer": distributed_optimizer, "overhead_gb": overhead_gb,
                                         "flash_attention": flash_attention}
        self._measured: list[tuple[np.ndarray, float]] = []  # (components, measured allocated GB)
        self._bounds: list[tuple[np.ndarray, float]] = []  # (components, allocated GB it needed at least)
        self._frag: list[float] = []  # measured reserved / allocated
        self._ok: list[MemoryEstimate] = []  # what ran
        self._oom: list[MemoryEstimate] = []  # what ran out of memory
        self._w = np.ones(3)  # learned multipliers: weights+grads, optimizer, activations

    @property
    def limit_gb(self) -> float:
        return self.capacity_gb * (1 + self.safety_margin)

    @property
    def scales(self) -> dict[str, float]:
        """Learned multipliers on the estimate's components (1.0: as estimated)."""
        return {"weights": float(self._w[0]), "optimizer": float(self._w[1]), "activations": float(self._w[2])}

    @property
    def fragmentation(self) -> float:
        return statistics.median(self._frag) - 1 if self._frag else FRAGMENTATION

    def _estimate(self, layout: Layout, model: ModelInfo, **kw: Any) -> MemoryEstimate | None:
        return estimate(layout, model, **{**self.defaults, **kw})

    @staticmethod
    def _x(est: MemoryEstimate) -> np.ndarray:
        return np.array([est.weights_gb + est.grads_gb, est.optimizer_gb, est.activations_gb])

    def _fixed(self, est: MemoryEstimate) -> float:
        """The part outside PyTorch's allocator (CUDA context, NCCL): the estimate's overhead without
        its fragmentation share."""
        return est.overhead_gb - FRAGMENTATION * est.allocated_gb

    def _corrected(self, est: MemoryEstimate) -> float:
        return self._fixed(est) + (1 + self.fragmentation) * float(self._x(est) @ self._w)

    def _fit(self) -> None:
        """Posterior mean of the multipliers given the measured peaks, with each OOM's lower bound as
        a tight observation while the fit would violate it (a few passes, since one bound's activation
        moves the others)."""
        prior = np.full(3, 1 / COMPONENT_SD ** 2)
        w = np.ones(3)
        active: set[int] = set()
        for _ in range(6):
            rows = [(x, y, MEASURED_SD) for x, y in self._measured]
            rows += [(*self._bounds[i], MEASURED_SD / 10) for i in sorted(active)]
            if rows:
                X = np.array([x for x, _, _ in rows])
                y = np.array([v for _, v, _ in rows])
                sd = np.maximum(np.array([r for _, _, r in rows]) * y, 1e-3)
                A = np.diag(prior) + (X / sd[:, None] ** 2).T @ X
                b = prior + (X / sd[:, None] ** 2).T @ y
                w = np.clip(np.linalg.solve(A, b), 0.3, 3.0)
            now = {i for i, (x, y) in enumerate(self._bounds) if float(x @ w) < y * (1 - 1e-4)}
            if now <= active:
                break
            active |= now
        # what an OOM proves is not negotiable: whatever the fit left short is made up uniformly
        short = max((y / float(x @ w) for x, y in self._bounds if float(x @ w) > 0), default=1.0)
        self._w = w * max(short, 1.0)

    def predict(self, layout: Layout, model: ModelInfo, **kw: Any) -> float | None:
        est = self._estimate(layout, model, **kw)
        return None if est is None else self._corrected(est)

    def predicted_oom(self, layout: Layout, model: ModelInfo, **kw: Any) -> str | None:
        """Why this config would surely run out of memory, or None."""
        est = self._estimate(layout, model, **kw)
        if est is None:
            return None
        need = self._corrected(est)
        if self._ok and need <= max(self._corrected(e) for e in self._ok) + 1e-9:
            return None  # something at least as big already ran
        if self._oom:
            smallest = min(self._corrected(e) for e in self._oom)
            if need >= smallest - 1e-9:
                return (f"predicted {need:.1f} GB >= {smallest:.1f} GB of a configuration that already ran "
                        f"out of memory")
        if need > self.limit_gb:
            learned = "" if not (self._measured or self._bounds) else \
                ", learned " + " ".join(f"{k} x{v:.2f}" for k, v in self.scales.items())
            return (f"predicted {need:.1f} GB > {self.capacity_gb:g} GB capacity x {1 + self.safety_margin:.2f} "
                    f"margin ({est.breakdown()}{learned})")
        return None

    def observe_success(self, layout: Layout, model: ModelInfo, measured_peak_gb: float | None, *,
                        reserved_gb: float | None = None, **kw: Any) -> None:
        """A run that completed; `measured_peak_gb` is Megatron's "max allocated" (None if not
        printed), `reserved_gb` its "max reserved"."""
        est = self._estimate(layout, model, **kw)
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
        self._measured.append((self._x(est), float(measured_peak_gb)))
        if reserved_gb is not None and 1.0 <= reserved_gb / measured_peak_gb <= 2.0:
            self._frag.append(reserved_gb / measured_peak_gb)
        self._fit()

    def observe_oom(self, layout: Layout, model: ModelInfo, *, needed_gb: float | None = None, **kw: Any) -> None:
        """A run that ran out of memory; `needed_gb` is what the OOM message proves it needed at least
        (memory in use + the allocation that failed), if known."""
        est = self._estimate(layout, model, **kw)
        if est is None:
            return
        self._oom.append(est)
        need = max(self.limit_gb, needed_gb or 0.0) * (1 + 1e-3)
        # in allocated terms: what the allocator must have handed out for the total to exceed `need`
        self._bounds.append((self._x(est), (need - self._fixed(est)) / (1 + self.fragmentation)))
        self._fit()
