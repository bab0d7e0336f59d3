"""zenithtune's rule for expert-parallel all-to-all overlap against megatron-core's own check.

megatron-core 0.19's TransformerConfig.__post_init__ decides whether --overlap-moe-expert-parallel-comm
can run with a layout (EP size, token dispatcher, recompute, virtual pipeline, shared-expert overlap).
This builds that config for every combination zenithtune's rule `moe_a2a_overlap` reads and asserts
the two agree, accept and refuse alike. No launch: seconds, on CPU. Skipped without megatron-core
(tests/megatron/install.sh)."""
from __future__ import annotations

import itertools
import warnings

import pytest

from zenithtune.modelinfo import ModelInfo
from zenithtune.validate import Layout, moe_a2a_overlap

pytestmark = pytest.mark.megatron

MOE = ModelInfo(num_layers=8, hidden_size=64, num_attention_heads=4, num_experts=8, moe_router_topk=2,
                moe_ffn_hidden_size=128, seq_length=128, vocab_size=1024)


def _megatron_refuses(lay: Layout) -> str | None:
    torch = pytest.importorskip("torch")
    config = pytest.importorskip("megatron.core.transformer.transformer_config")
    kw = dict(num_layers=8, hidden_size=64, num_attention_heads=4, num_moe_experts=8, moe_router_topk=2,
              moe_ffn_hidden_size=128, bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16,
              expert_model_parallel_size=lay.ep, pipeline_model_parallel_size=lay.pp,
              virtual_pipeline_model_parallel_size=lay.vpp_size, moe_token_dispatcher_type=lay.moe_dispatcher,
              moe_shared_expert_overlap=lay.moe_shared_expert_overlap, moe_shared_expert_intermediate_size=128,
              overlap_moe_expert_parallel_comm=lay.moe_a2a_overlap)
    if lay.recompute_granularity == "full":
        kw.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    elif lay.recompute_granularity == "selective":
        kw.update(recompute_granularity="selective", recompute_modules=list(lay.selective_modules))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            config.TransformerConfig(**kw)
        except (AssertionError, ValueError) as err:
            return str(err)
    return None


def test_the_ep_overlap_rule_agrees_with_megatron_cores_transformer_config():
    disagree = []
    cases = 0
    for ep, dispatcher, (pp, vpp), rec, shared in itertools.product(
            (1, 2), ("allgather", "alltoall", "flex"), ((1, None), (2, None), (2, 2)),
            ((None, None), ("full", None), ("selective", ("moe",)), ("selective", ("layernorm",))), (False, True)):
        lay = Layout(n_gpus=16, gbs=64, ep=ep, pp=pp, vpp_size=vpp, recompute_granularity=rec[0],
                     recompute_method="uniform" if rec[0] == "full" else None,
                     recompute_num_layers=1 if rec[0] == "full" else None, recompute_modules=rec[1],
                     moe_a2a_overlap=True, moe_dispatcher=dispatcher, moe_shared_expert_overlap=shared)
        ours, theirs = moe_a2a_overlap(lay, MOE), _megatron_refuses(lay)
        if theirs is not None and "flex" in theirs:  # the flex dispatcher needs DeepEP/HybridEP, not a rule of ours
            continue
        cases += 1
        if (ours is None) != (theirs is None):
            disagree.append((ep, dispatcher, pp, vpp, rec, shared, ours, theirs))
    assert cases > 50 and not disagree, disagree
