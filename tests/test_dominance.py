"""Which layout surely needs no more memory than another, whatever the trainer (a pure-function table)."""
from __future__ import annotations

import pytest

from zenithtune.dominance import needs_no_more
from zenithtune.validate import Layout


def lay(**kw) -> Layout:
    base = dict(n_gpus=16, gbs=64, sequence_parallel=True)
    return Layout(**{**base, **kw})


L = 32  # layers


@pytest.mark.parametrize("a, b, expected, why", [
    (lay(tp=2, mbs=2), lay(tp=2, mbs=2), True, "the same run"),
    (lay(tp=2, mbs=1), lay(tp=2, mbs=2), True, "a smaller micro-batch"),
    (lay(tp=2, mbs=4), lay(tp=2, mbs=2), False, "a larger micro-batch"),
    (lay(tp=4, mbs=2), lay(tp=2, mbs=2), True, "wider TP: weights and (with SP) activations split further"),
    (lay(tp=1, mbs=2), lay(tp=2, mbs=2), False, "narrower TP"),
    (lay(tp=2, cp=2, mbs=2), lay(tp=2, mbs=2), True, "wider CP: activations split, optimizer shard unchanged"),
    (lay(tp=2, pp=2, mbs=2), lay(tp=2, mbs=2), True, "wider PP, m >= pp: the first stage keeps L layers' worth"),
    (lay(tp=2, pp=4, mbs=2, n_gpus=8, gbs=8), lay(tp=2, pp=2, mbs=2, n_gpus=8, gbs=8), True,
     "wider PP with few micro-batches: fewer layers in flight"),
    (lay(tp=2, mbs=2, recompute_granularity="selective"), lay(tp=2, mbs=2), False,
     "more recompute: the allocator may reserve more than it saves"),
    (lay(tp=2, mbs=2), lay(tp=2, mbs=2, recompute_granularity="selective"), False, "less recompute"),
    (lay(tp=2, mbs=1, recompute_granularity="selective"), lay(tp=2, mbs=2, recompute_granularity="selective"),
     True, "a smaller micro-batch at the same recompute"),
    (lay(tp=2, mbs=2, recompute_granularity="full", recompute_method="block", recompute_num_layers=8),
     lay(tp=2, mbs=2, recompute_granularity="full", recompute_method="block", recompute_num_layers=4), False,
     "more layers recomputed in block mode"),
    (lay(tp=2, mbs=2, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
     lay(tp=2, mbs=2), False, "full recompute against none: the allocator fragments otherwise"),
    (lay(tp=2, ep=8, etp=1, mbs=2), lay(tp=2, ep=4, etp=1, mbs=2), False,
     "wider EP: drop-less routing's busiest rank may carry more tokens"),
    (lay(tp=4, ep=4, etp=1, mbs=2), lay(tp=2, ep=4, etp=1, mbs=2), True,
     "wider TP at the same EP and ETP: fewer routed tokens per GPU"),
    (lay(tp=4, ep=4, mbs=2), lay(tp=2, ep=4, etp=1, mbs=2), False,
     "ETP following TP to 4: routed copies per GPU do not fall (inputs are gathered over ETP)"),
    (lay(tp=2, mbs=2, sequence_parallel=False), lay(tp=2, mbs=2), False, "sequence parallelism off"),
    (lay(tp=2, pp=2, mbs=2, vpp_size=2), lay(tp=2, mbs=2), False, "interleaving multiplies what is in flight"),
    (lay(tp=2, pp=4, mbs=1, vpp_size=4), lay(tp=2, pp=4, mbs=1, vpp_size=2), False,
     "another virtual size is never compared (the searched vp: a fit at vp=2 proves nothing at vp=4)"),
    (lay(tp=2, pp=4, mbs=1), lay(tp=2, pp=4, mbs=1, vpp_size=2), False, "interleaved against not interleaved"),
    (lay(tp=2, pp=4, mbs=1, vpp_size=4), lay(tp=2, pp=4, mbs=2, vpp_size=4), True,
     "the same virtual size at a smaller micro-batch"),
])
def test_needs_no_more(a, b, expected, why):
    assert needs_no_more(a, b, num_layers=L) is expected, why


def test_a_vlm_vision_tower_is_not_split_by_pipeline_stages():
    # the vision tower sits whole on the first stage: pp2 keeps two samples' vision activations in flight
    a, b = lay(tp=2, pp=2, mbs=2), lay(tp=2, mbs=2)
    assert needs_no_more(a, b, num_layers=L)
    assert not needs_no_more(a, b, num_layers=L, vlm=True)
    assert not needs_no_more(lay(tp=2, mbs=2), lay(tp=2, mbs=2), num_layers=L, vlm=True, vit_a=False, vit_b=True)
