"""What the heuristic believes about a candidate's speed before it runs: a coarse throughput prior.

A back-of-the-envelope model of one training iteration, written from MEGATRON.md §Time model
ingredients (not from the simulator, which the tuner must never read): the model FLOPs every GPU
does, at a GEMM efficiency that falls for small per-GPU matrices, plus the communication each
parallel dimension puts on the critical path, inside a pipeline with its bubble:

* TP: 4 collectives of b·s·h per layer per micro-batch, on NVLink inside a node, on the network
  across nodes (which is why TP stays inside a node);
* CP: a ring of KV exchanges, hidden behind attention when the sequence is long enough;
* EP: 4 all-to-alls of the routed tokens per MoE layer; more EP means fuller expert GEMMs;
* PP: bubble (p−1)/m and small point-to-point sends; the slowest stage sets the pace. Interleaving
  (v virtual stages per rank, Narayanan et al. 2021 §2.2.2) shrinks the bubble to (p−1)/(v·m) and
  multiplies the sends by v (each as large as before: one activation per chunk boundary);
* DP: gradient reduce-scatter and parameter all-gather, hidden behind the last micro-batch's
  backward and the first one's forward as far as they are long enough;
* overlap switches: --tp-comm-overlap hides most of TP's collectives behind the neighbouring GEMMs
  (TE userbuffers); --overlap-moe-expert-parallel-comm runs one micro-batch's all-to-alls beside another
  micro-batch's compute, hiding them as far as that compute is long;
* recompute: a recomputed layer runs its forward (and its TP forward traffic) twice;
* a VLM's vision tower runs unsharded on the first pipeline stage.

The absolute value is only roughly right; the heuristic calibrates it against measured trials and
uses it to order candidates. Hardware defaults are an H100 node (989 TFLOP/s bf16, 450 GB/s NVLink,
50 GB/s network per GPU); only their ratios matter for the ordering.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from zenithtune.modelinfo import ModelInfo
from zenithtune.shape import Shape
from zenithtune.validate import candidate_modules

PEAK_FLOPS = 989e12
# What real runs reach of this model's ideal: kernels below roofline, launch gaps, stragglers, the
# optimizer step. Only the level of the prior; each study learns its own (see _calibration).
TYPICAL_EFFICIENCY = 0.65
NVLINK_BYTES_S = 450e9
NETWORK_BYTES_S = 50e9
GEMM_HALF = 128.0  # a GEMM dimension this small halves the efficiency (eff = 1/(1 + Σ X/dim))
ATTENTION_EFF = 0.65  # flash attention runs below GEMM efficiency
GROUPED_GEMM_EFF = 0.9  # MoE grouped GEMMs run below a plain GEMM of the same shape
LATENCY_S = 15e-6  # per collective
TP_EXPOSED = 0.75  # share of TP traffic on the critical path (forward all of it, backward half)
TP_OVERLAP_EXPOSED = 0.35  # ... with --tp-comm-overlap
A2A_OVERLAP_LEFT = 0.2  # --overlap-moe-expert-parallel-comm: share of the all-to-alls never hidden
A2A_OVERLAP_HIDE = 0.8  # ... behind this share of the other micro-batch's layer compute
EP_EXPOSED = 0.9
A2A_EFF = 0.6  # all-to-all reaches less of the link than a ring
DP_MIN_EXPOSED = 0.12  # the last gradient bucket is never hidden
SELECTIVE_EXTRA = 1 / 3  # selective recompute re-runs the attention core's forward (of its fwd+bwd)
FULL_EXTRA = 1 / 3  # full recompute re-runs the whole layer's forward
LIGHT_EXTRA = 0.005  # an output-discarding module (layernorm, moe_act) re-runs an elementwise kernel


def model_flops_per_token(x: Shape) -> float:
    """Model FLOPs per token per iteration (MEGATRON.md §Model FLOPs; recompute not counted)."""
    attn = 6 * x.h * x.d * (2 * x.a + 2 * x.g) + 6 * x.s * x.a * x.d
    dense = 6 * x.mlp_mats * x.h * x.F
    moe = 6 * x.mlp_mats * x.h * (x.Fm * x.k + x.Fs)
    return x.L * attn + (x.L - x.n_moe) * dense + x.n_moe * moe + 6 * x.h * x.V


def _eff(*dims: float) -> float:
    return 1.0 / (1.0 + sum(GEMM_HALF / max(dim, 1.0) for dim in dims))


def _ring(nbytes: float, size: int, bw: float) -> float:
    return 0.0 if size <= 1 else nbytes * (size - 1) / size / bw + LATENCY_S


def _a2a(nbytes: float, span: int, gpus_per_node: int) -> float:
    """All-to-all over `span` consecutive ranks: the share sent to other nodes goes over the network."""
    remote = max(0.0, (span - gpus_per_node) / span)
    return max(nbytes * (1 - remote) / NVLINK_BYTES_S, nbytes * remote / NETWORK_BYTES_S) / A2A_EFF


# The prior's time components, each with a multiplier (1.0: the model as written) that a study can learn
# from its measurements (`_speed.SpeedModel`): seconds of GEMMs (layers, logits, vision tower), of the
# attention core (flash attention's score and value products), of TP collectives (with SP, and the output
# layer's), of the CP ring, of the MoE token dispatcher (EP all-to-alls and ETP gathers), of the DP
# gradient/parameter sync, and of the pipeline (bubble and point-to-point sends).
COMPONENTS = ("gemm", "attention", "tp", "cp", "ep", "dp", "pp")


def _bandwidth(span: int, gpus_per_node: int) -> float:
    """Bytes/s of a collective over `span` consecutive ranks: NVLink inside a node, else the network."""
    return NVLINK_BYTES_S if span <= gpus_per_node else NETWORK_BYTES_S


def _layer_compute(x: Shape, tok: float, t: int, e: int, et: int) -> dict[str, float]:
    """Seconds of one layer's GEMMs and attention core, forward + backward, one micro-batch."""
    attn_lin = tok * 6 * x.h * x.d * (2 * x.a + 2 * x.g) / t / (PEAK_FLOPS * _eff(tok, x.h / t))
    scores = tok * 6 * x.s * x.a * x.d / t / (PEAK_FLOPS * ATTENTION_EFF * _eff(tok, x.a * x.d / t))
    dense_mlp = tok * 6 * x.mlp_mats * x.h * x.F / t / (PEAK_FLOPS * _eff(tok, x.F / t))
    moe_mlp = 0.0
    if x.E:
        per_expert_tokens = tok * x.k * e * et / (t * x.E)
        moe_mlp = (tok * x.k * 6 * x.mlp_mats * x.h * x.Fm / t
                   / (PEAK_FLOPS * GROUPED_GEMM_EFF * _eff(per_expert_tokens, x.Fm / et, x.h)))
        if x.Fs:
            moe_mlp += tok * 6 * x.mlp_mats * x.h * x.Fs / t / (PEAK_FLOPS * _eff(tok, x.Fs / t))
    return {"attn_lin": attn_lin, "scores": scores, "dense_mlp": dense_mlp, "moe_mlp": moe_mlp}


def _layer_comm(x: Shape, tok: float, t: int, c: int, e: int, et: int, gpus_per_node: int) -> dict[str, float]:
    """Seconds of one layer's TP, CP and MoE dispatcher traffic on the critical path, one micro-batch."""
    bw = lambda span: _bandwidth(span, gpus_per_node)  # noqa: E731
    # TP with SP: all-gather + reduce-scatter around attention and around the MLP, forward and backward
    tp_half = 4 * _ring(2 * tok * x.h, t, bw(t)) * TP_EXPOSED  # attention's (or the dense MLP's) share
    cp_ring = 0.0
    if c > 1:
        kv = 2 * 2 * tok * x.g * x.d / max(1, min(t, x.g))  # K and V, bf16
        cp_ring = 3 * (c - 1) * (kv / bw(t * c) + LATENCY_S)  # forward once, backward twice (dK, dV)
    ep_comm = 0.0
    if x.E and e > 1:
        routed = 2 * tok / t * x.k * x.h  # bytes of this rank's routed token copies, bf16
        ep_comm = 4 * (_a2a(routed * (e - 1) / e, e * et, gpus_per_node) + LATENCY_S) * EP_EXPOSED
    if x.E and et > 1:  # expert TP gathers the routed token copies inside the ETP group (adjacent ranks)
        ep_comm += 4 * _ring(2 * tok / t * x.k * x.h * et, et, bw(et)) * TP_EXPOSED
    return {"tp_half": tp_half, "cp_ring": cp_ring, "ep_comm": ep_comm}


def _vision_seconds(x: Shape, b: int, cand: Mapping[str, Any]) -> float:
    """A VLM's vision tower, unsharded on the first stage (twice its forward with ViT checkpointing)."""
    if not x.vision_layers:
        return 0.0
    vt = b * x.vision_tokens
    vflops = vt * 6 * x.vision_layers * (4 * x.vision_hidden ** 2 + 2 * x.vision_hidden * x.vision_ffn)
    ckpt = cand.get("vit_gradient_checkpointing", True) is not False
    return vflops / (PEAK_FLOPS * _eff(vt, x.vision_hidden)) * (1 + (FULL_EXTRA if ckpt else 0.0))


def _dp_sync(x: Shape, n_gpus: int, t: int, p: int, c: int, e: int, et: int, d_: int,
             gpus_per_node: int) -> dict[str, float]:
    """Once per iteration: gradient sync over data (and context) parallel ranks; experts over their own
    expert-data-parallel ranks (their gradients are most of a MoE model's). fp32 gradients are
    reduce-scattered, bf16 parameters all-gathered."""
    dense_params = x.L / p * (x.h * x.d * (2 * x.a + 2 * x.g) + (x.mlp_mats * x.h * x.F if not x.E else 0)) / t
    expert_params = x.n_moe / p * x.E * x.mlp_mats * x.h * x.Fm / (e * et) if x.E else 0.0
    edp = max(1, n_gpus // (e * et * p))
    span = _bandwidth(n_gpus // p, gpus_per_node)
    return {"reduce": _ring(4 * dense_params, d_ * c, span) + _ring(4 * expert_params, edp, span),
            "gather": _ring(2 * dense_params, d_ * c, span) + _ring(2 * expert_params, edp, span)}


def pieces(cand: Mapping[str, Any], *, model: ModelInfo, n_gpus: int, gbs: int,
           gpus_per_node: int = 8) -> dict[str, float]:
    """The raw times (and counts) one candidate's iteration is assembled from (`assemble`)."""
    x = Shape.assumed(model)
    t, p, c = int(cand.get("tp", 1)), int(cand.get("pp", 1)), int(cand.get("cp", 1))
    e = int(cand.get("ep", 1)) if x.E else 1
    et = int(cand.get("etp") or t) if x.E else t
    b = int(cand.get("mbs", 1))
    v = int(cand.get("vp") or 1) if p > 1 else 1  # model chunks per pipeline rank
    d_ = max(1, n_gpus // (t * p * c))
    m = max(1, gbs // (b * d_))
    gran = cand.get("recompute_granularity")
    method, nrec = cand.get("recompute_method"), int(cand.get("recompute_num_layers") or 1)
    per_stage = max(1, x.L // p)
    if gran == "full":
        recomputed = per_stage if method == "uniform" else min(nrec, per_stage)
    else:
        recomputed = 0
    tok = b * x.s / c  # tokens per rank per micro-batch
    bw = lambda span: _bandwidth(span, gpus_per_node)  # noqa: E731
    return dict(
        **_layer_compute(x, tok, t, e, et), **_layer_comm(x, tok, t, c, e, et, gpus_per_node),
        vision=_vision_seconds(x, b, cand), frac=recomputed / per_stage, **_selective(cand),
        per_stage=float(per_stage), moe_share=x.n_moe / x.L,
        logits_gemm=tok * 6 * x.h * x.V / t / (PEAK_FLOPS * _eff(tok, x.V / t)),
        logits_comm=2 * _ring(4 * tok * x.h, t, bw(t)),
        p2p=0.0 if p == 1 else v * 2 * (2 * tok * x.h / t / bw(n_gpus // p + 1)) * 0.5,
        m=float(m), bubble=float(p - 1) / v, **_dp_sync(x, n_gpus, t, p, c, e, et, d_, gpus_per_node),
        tp_overlap=float(cand.get("tp_comm_overlap") is True),
        a2a_overlap=float(cand.get("moe_a2a_overlap") is True and e > 1))


def _selective(cand: Mapping[str, Any]) -> dict[str, float]:
    """Which parts of a layer selective recompute re-runs (Megatron's --recompute-modules; default core_attn)."""
    mods = candidate_modules(cand)  # () without selective recompute: every share 0
    return {"sel_attn": float("core_attn" in mods), "sel_mlp": float("mlp" in mods),
            "sel_moe": float("moe" in mods) + 0.5 * float("shared_experts" in mods),
            "sel_light": float(sum(m in mods for m in ("layernorm", "moe_act")))}


def _max(a: Any, b: Any) -> Any:
    # builtin max for one candidate (predict_tflops: numpy's scalar overhead would triple its cost)
    return max(a, b) if isinstance(a, float) and isinstance(b, float) else np.maximum(a, b)


def assemble(pc: Mapping[str, Any], mult: Mapping[str, Any] | None = None) -> Any:
    """Seconds of one iteration from `pieces` (floats, or numpy arrays: one element per candidate), each
    component's seconds times its multiplier in `mult` (missing: 1.0, which reproduces the model exactly;
    a multiplier may also be an array, one per candidate)."""
    mu = {k: 1.0 for k in COMPONENTS} | dict(mult or {})
    mg, ma = mu["gemm"], mu["attention"]
    scores = pc["scores"] * ma
    attn_lin = pc["attn_lin"] * mg
    tp_half = pc["tp_half"] * mu["tp"] * (1 + pc["tp_overlap"] * (TP_OVERLAP_EXPOSED / TP_EXPOSED - 1))
    ring = pc["cp_ring"] * mu["cp"]
    cp_comm = _max(ring - 0.8 * scores, 0.1 * ring)  # hidden behind attention as far as it is long
    ep_comm = pc["ep_comm"] * mu["ep"]
    frac = pc["frac"]

    def layer(moe: bool) -> Any:
        compute = attn_lin + scores + (pc["moe_mlp"] if moe else pc["dense_mlp"]) * mg
        # a MoE layer's MLP trades TP traffic for the token dispatcher's (EP all-to-all, ETP gathers);
        # overlapped, the all-to-alls hide behind the paired micro-batch's compute as far as it is long
        ep = ep_comm
        if moe:
            hidden = _max(A2A_OVERLAP_LEFT * ep_comm, ep_comm - A2A_OVERLAP_HIDE * compute)
            ep = ep_comm + pc["a2a_overlap"] * (hidden - ep_comm)
        comm = tp_half + cp_comm + (ep if moe else tp_half)
        # a recomputed layer runs its forward (and its forward traffic) twice; selective re-runs its modules:
        # the attention core, the dense MLP (with its TP gather) or the MoE part (with its token dispatch)
        extra = frac * (FULL_EXTRA * compute + comm / 2) + pc["sel_attn"] * (SELECTIVE_EXTRA * scores)
        if moe:
            extra = extra + pc["sel_moe"] * (FULL_EXTRA * pc["moe_mlp"] * mg + ep_comm / 2)
        else:
            extra = extra + pc["sel_mlp"] * (FULL_EXTRA * pc["dense_mlp"] * mg + tp_half / 2)
        extra = extra + pc["sel_light"] * LIGHT_EXTRA * compute
        return compute + comm + extra

    moe_share = pc["moe_share"]
    body = pc["per_stage"] * ((1 - moe_share) * layer(False) + moe_share * layer(True))
    logits = pc["logits_gemm"] * mg + pc["logits_comm"] * mu["tp"]
    vision = pc["vision"] * mg
    # the first stage carries the vision tower, the last the output layer: the slower sets the pace
    staged = _max(body + vision, body + logits) + pc["p2p"] * mu["pp"]
    flat = pc["bubble"] == 0
    if isinstance(flat, bool):  # one candidate
        stage = body + logits + vision if flat else staged
    else:
        stage = np.where(flat, body + logits + vision, staged)
    pipeline = (pc["m"] + pc["bubble"] * mu["pp"]) * stage
    reduce, gather = pc["reduce"] * mu["dp"], pc["gather"] * mu["dp"]
    # the reduce-scatter hides behind the last micro-batch's backward, the all-gather behind the first's
    # forward (--overlap-grad-reduce / --overlap-param-gather); a larger micro-batch hides more
    dp_sync = (_max(DP_MIN_EXPOSED * reduce, reduce - 0.9 * 2 / 3 * stage)
               + _max(DP_MIN_EXPOSED * gather, gather - 0.9 / 3 * stage))
    return pipeline + dp_sync


def tflops_of(seconds: Any, *, model: ModelInfo, n_gpus: int, gbs: int) -> Any:
    """Believed TFLOP/s per GPU (model FLOPs) of an iteration believed to take `seconds`."""
    x = Shape.assumed(model)
    return TYPICAL_EFFICIENCY * gbs * x.s * model_flops_per_token(x) / (n_gpus * seconds) / 1e12


def predict_tflops(cand: Mapping[str, Any], *, model: ModelInfo, n_gpus: int, gbs: int,
                   gpus_per_node: int = 8, mult: Mapping[str, float] | None = None) -> float:
    """Believed TFLOP/s per GPU (model FLOPs) of one candidate; see the module docstring. `mult`: per
    component multipliers of its seconds (COMPONENTS; default 1.0 each)."""
    seconds = assemble(pieces(cand, model=model, n_gpus=n_gpus, gbs=gbs, gpus_per_node=gpus_per_node), mult)
    return float(tflops_of(seconds, model=model, n_gpus=n_gpus, gbs=gbs))
