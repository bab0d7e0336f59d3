"""Which configuration surely needs no more GPU memory than another, on any Megatron-like trainer.

The memory estimate (memory.py) can be wrong by any factor on a trainer it was not written from (other
kernels, allocator, FP8 buffers). What does not depend on it is structure: the same run with a smaller
micro-batch, or split wider by TP, PP or CP, holds no more of anything on any GPU. Two
uses, both independent of the estimate:

* a proof of fit: a candidate needing no more than a run that completed fits (the study loop launches
  only such candidates once the study has spent its `max_ooms`);
* an OOM rule-out: a candidate needing at least as much as a run that ran out of memory runs out too.

Each claim, against MEGATRON.md's memory formulas (per GPU, the busiest pipeline stage):
* weights, grads: dense params / (tp·pp), experts / (etp·ep·pp), embedding V·h / tp: none grows when
  tp, pp or etp grows; the distributed optimizer's shard, 12·params / (dp·cp) with dp = N / (tp·pp·cp),
  is 12·params / N whatever the split (without it: 12 bytes per held parameter, which only shrinks).
* activations per micro-batch and layer: ∝ mbs / cp, and / tp with sequence parallelism (without it
  TP leaves a part unsplit, so a wider TP still holds no more); recompute must be the same (below).
* pipeline: the first stage keeps min(pp, m) micro-batches of pp's share of the layers in flight, where
  m = gbs / (mbs·dp) grows as dp shrinks: checked as a number, not assumed. A VLM's vision tower sits
  whole on the first stage (neither TP nor CP splits it), so its in-flight copies are checked apart.
* routed MoE tokens: a GPU processes on average mbs·s·k·etp / (tp·cp) routed token copies whatever
  the EP (EP moves experts, not tokens), but drop-less routing's busiest rank carries more the more
  ranks share the experts: EP must be equal. Full recompute with other settings, interleaving and
  EP changes are never compared (the allocator fragments differently, the working set differs).
* overlap switches: TP communication overlap (userbuffers) must be equal; EP all-to-all overlap holds
  one more micro-batch in flight, so a run without it needs no more than the same run with it.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from zenithtune.validate import Layout

if TYPE_CHECKING:
    from zenithtune.record import Outcome
    from zenithtune.space import Space

def _recomputes_alike(a: Layout, b: Layout) -> bool:
    """The same recompute settings. More recompute stores fewer activations, but it frees and re-allocates
    every recomputed layer's working set, and a caching allocator may then reserve more than it saves
    (a trainer whose selective recompute ran out of memory where no recompute fit, at the same layout
    and MBS, is in benchmarks/robustness.py's `memory` flavour): recompute is never compared."""
    return (a.recompute_granularity, a.recompute_method, a.recompute_num_layers, a.recompute_modules) == \
        (b.recompute_granularity, b.recompute_method, b.recompute_num_layers, b.recompute_modules)


def _in_flight(lay: Layout) -> float:
    """Micro-batches the first stage holds at once, times its share of the layers (1/pp). EP all-to-all
    overlap's combined 1F1B schedule holds one more (one extra warm-up forward; two without a pipeline)."""
    m = lay.microbatches or lay.pp
    return min(lay.pp + (1 if lay.moe_a2a_overlap else 0), m) / lay.pp


def needs_no_more(a: Layout, b: Layout, *, num_layers: int | None = None, vlm: bool = False,
                  vit_a: bool | None = None, vit_b: bool | None = None) -> bool:
    """Does `a` surely need no more memory than `b` on every GPU (see the module docstring)?
    `vit_*`: ViT gradient checkpointing (None: ms-swift's default, on)."""
    if (a.n_gpus, a.gbs, a.ep) != (b.n_gpus, b.gbs, b.ep):
        return False
    if (a.pipeline_extra_layers, a.tp_comm_overlap, a.distribute_saved_activations, a.local_impl) != \
            (b.pipeline_extra_layers, b.tp_comm_overlap, b.distribute_saved_activations, b.local_impl):
        return False
    if a.moe_a2a_overlap and not b.moe_a2a_overlap:  # its paired micro-batches' buffers, beyond activations
        return False
    if a.tp < b.tp or a.pp < b.pp or a.cp < b.cp or a.expert_tp < b.expert_tp or a.mbs > b.mbs:
        return False
    if b.sp_active and not a.sp_active:
        return False
    if a.virtual_stages(num_layers) != 1 or b.virtual_stages(num_layers) != 1:
        if (a.pp, a.vpp_size, a.layers_per_virtual_stage) != (b.pp, b.vpp_size, b.layers_per_virtual_stage):
            return False
    if not _recomputes_alike(a, b):
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


def dominated_by(space: Space, cand: Mapping[str, Any], runs: Iterable[Outcome], *,
                 below: bool = True) -> Outcome | None:
    """The first of `runs` that `cand` needs no more memory than (`below`), or at least as much as
    (`below=False`), by structure; None if none."""
    model = space.ctx.model
    lay, vit = space.layout(cand), space.vit_checkpointing(cand)
    for o in runs:
        other, vit_o = space.layout(o.candidate), space.vit_checkpointing(o.candidate)
        a, b, va, vb = (lay, other, vit, vit_o) if below else (other, lay, vit_o, vit)
        if needs_no_more(a, b, num_layers=model.num_layers, vlm=model.is_vlm, vit_a=va, vit_b=vb):
            return o
    return None
