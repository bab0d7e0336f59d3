"""Which configuration surely needs no more GPU memory than another, on any Megatron-like trainer.

The memory estimate (memory.py) can be wrong by any factor on a trainer it was not written from (other
kernels, allocator, FP8 buffers). What does not depend on it is structure: the same run with a smaller
micro-batch, more recompute, or split wider by TP, PP or CP holds no more of anything on any GPU. Two
uses, both independent of the estimate:

* a proof of fit: a candidate needing no more than a run that completed fits (the study loop launches
  only such candidates once the study has spent its `max_ooms`);
* an OOM rule-out: a candidate needing at least as much as a run that ran out of memory runs out too.

Each claim, against MEGATRON.md's memory formulas (per GPU, the busiest pipeline stage):
* weights, grads: dense params / (tp·pp), experts / (etp·ep·pp), embedding V·h / tp: none grows when
  tp, pp or etp grows; the distributed optimizer's shard, 12·params / (dp·cp) with dp = N / (tp·pp·cp),
  is 12·params / N whatever the split (without it: 12 bytes per held parameter, which only shrinks).
* activations per micro-batch and layer: ∝ mbs / cp, and / tp with sequence parallelism (without it
  TP leaves a part unsplit, so a wider TP still holds no more); None ⊇ selective recompute.
* pipeline: the first stage keeps min(pp, m) micro-batches of pp's share of the layers in flight, where
  m = gbs / (mbs·dp) grows as dp shrinks: checked as a number, not assumed. A VLM's vision tower sits
  whole on the first stage (neither TP nor CP splits it), so its in-flight copies are checked apart.
* routed MoE tokens: a GPU processes on average mbs·s·k·etp / (tp·cp) routed token copies whatever
  the EP (EP moves experts, not tokens), but drop-less routing's busiest rank carries more the more
  ranks share the experts: EP must be equal. Full recompute with other settings, interleaving and
  EP changes are never compared (the allocator fragments differently, the working set differs).
"""
from __future__ import annotations

from zenithtune.validate import Layout

_GRANULARITY_RANK = {None: 0, "selective": 1}


def _recomputes_at_least(a: Layout, b: Layout) -> bool:
    """a recomputes at least what b does, in a way whose memory is comparable."""
    ga, gb = a.recompute_granularity, b.recompute_granularity
    if ga == "full" or gb == "full":
        if ga != gb or a.recompute_method != b.recompute_method:
            return False
        if a.recompute_method == "block":  # the first n layers of each stage keep only their input
            return (a.recompute_num_layers or 0) >= (b.recompute_num_layers or 0) and a.pp == b.pp
        return a.recompute_num_layers == b.recompute_num_layers and a.pp == b.pp  # uniform: chunks move memory
    return _GRANULARITY_RANK.get(ga, -1) >= _GRANULARITY_RANK.get(gb, 99)


def _in_flight(lay: Layout) -> float:
    """Micro-batches the first stage holds at once, times its share of the layers (1/pp)."""
    m = lay.microbatches or lay.pp
    return min(lay.pp, m) / lay.pp


def needs_no_more(a: Layout, b: Layout, *, num_layers: int | None = None, vlm: bool = False,
                  vit_a: bool | None = None, vit_b: bool | None = None) -> bool:
    """Does `a` surely need no more memory than `b` on every GPU (see the module docstring)?
    `vit_*`: ViT gradient checkpointing (None: ms-swift's default, on)."""
    if (a.n_gpus, a.gbs, a.ep) != (b.n_gpus, b.gbs, b.ep):
        return False
    if (a.pipeline_extra_layers, a.tp_comm_overlap, a.distribute_saved_activations, a.local_impl) != \
            (b.pipeline_extra_layers, b.tp_comm_overlap, b.distribute_saved_activations, b.local_impl):
        return False
    if a.tp < b.tp or a.pp < b.pp or a.cp < b.cp or a.expert_tp < b.expert_tp or a.mbs > b.mbs:
        return False
    if b.sp_active and not a.sp_active:
        return False
    if a.virtual_stages(num_layers) != 1 or b.virtual_stages(num_layers) != 1:
        if (a.pp, a.vpp_size, a.layers_per_virtual_stage) != (b.pp, b.vpp_size, b.layers_per_virtual_stage):
            return False
    if not _recomputes_at_least(a, b):
        return False
    # the first stage's activations: in-flight share of the layers x tokens per GPU (TP's split only helps)
    if _in_flight(a) * a.mbs / a.cp > _in_flight(b) * b.mbs / b.cp * (1 + 1e-9):
        return False
    # routed token copies per GPU (MoE; 1 for a dense model, where expert_tp follows tp)
    if a.ep > 1 and a.mbs * a.expert_tp / (a.tp * a.cp) > b.mbs * b.expert_tp / (b.tp * b.cp) * (1 + 1e-9):
        return False
    if vlm:  # the vision tower's activations: whole on the first stage, min(pp, m) samples in flight
        if (True if vit_a is None else vit_a) < (True if vit_b is None else vit_b):
            return False
        fa, fb = min(a.pp, a.microbatches or a.pp), min(b.pp, b.microbatches or b.pp)
        if fa * a.mbs > fb * b.mbs:
            return False
    return True
