"""Named model shapes as Megatron options, and the layout options a tuner injects (for tests, benchmarks, docs).

    from zenithtune.sim import simulate
    from zenithtune.sim.models import MODELS, layout_args
    simulate([*MODELS["llama3-8b"], *layout_args(n_gpus=8, gbs=64, tp=2, recompute="selective")])
"""
from __future__ import annotations


def _shape(layers: int, hidden: int, heads: int, seq: int, vocab: int, *, ffn: int | None = None,
           groups: int | None = None, kv_channels: int | None = None, swiglu: bool = False,
           experts: int | None = None, topk: int | None = None, moe_ffn: int | None = None) -> tuple[str, ...]:
    out = ["--num-layers", str(layers), "--hidden-size", str(hidden), "--num-attention-heads", str(heads),
           "--seq-length", str(seq), "--max-position-embeddings", str(seq), "--vocab-size", str(vocab),
           "--untie-embeddings-and-output-weights"]
    if ffn:
        out += ["--ffn-hidden-size", str(ffn)]
    if groups:
        out += ["--group-query-attention", "--num-query-groups", str(groups)]
    if kv_channels:
        out += ["--kv-channels", str(kv_channels)]
    if swiglu:
        out += ["--swiglu", "--disable-bias-linear", "--position-embedding-type", "rope"]
    if experts:
        out += ["--num-experts", str(experts), "--moe-router-topk", str(topk), "--moe-ffn-hidden-size", str(moe_ffn)]
    return tuple(out)


MODELS: dict[str, tuple[str, ...]] = {
    # Llama-3-8B at s=8192 (the tuner's default demo model)
    "llama3-8b": _shape(32, 4096, 32, 8192, 128256, ffn=14336, groups=8, swiglu=True),
    "llama3-70b": _shape(80, 8192, 64, 8192, 128256, ffn=28672, groups=8, swiglu=True),
    # Qwen3-30B-A3B: 128 experts, top-8, expert FFN 768 (the tuner's MoE demo)
    "qwen3-30b-a3b": _shape(48, 2048, 32, 4096, 151936, ffn=6144, groups=4, kv_channels=128, swiglu=True,
                            experts=128, topk=8, moe_ffn=768),
    "mixtral-8x7b": _shape(32, 4096, 32, 4096, 32000, ffn=14336, groups=8, swiglu=True, experts=8, topk=2,
                           moe_ffn=14336),
    # GPT-3 family shapes (MHA, GELU 4h)
    "gpt-1.7b": _shape(24, 2048, 16, 4096, 131072),
    "gpt-7b": _shape(32, 4096, 32, 4096, 131072),
}


def layout_args(*, n_gpus: int, gbs: int, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1,
                etp: int | None = None, mbs: int = 1, recompute: str | None = "selective",
                recompute_method: str = "uniform", recompute_num_layers: int = 1, vp: int | None = None,
                gpu: str = "h100", gpus_per_node: int = 8, train_iters: int = 10) -> tuple[str, ...]:
    """The options a tuner injects for one candidate, plus the run's fixed ones (bf16, dist-opt, ...)."""
    out = ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
           "--context-parallel-size", str(cp), "--micro-batch-size", str(mbs), "--global-batch-size", str(gbs),
           "--train-iters", str(train_iters), "--bf16", "--use-distributed-optimizer", "--log-throughput",
           "--sim-world-size", str(n_gpus), "--sim-gpu", gpu, "--sim-gpus-per-node", str(gpus_per_node)]
    if tp > 1:
        out.append("--sequence-parallel")
    if ep > 1:
        out += ["--expert-model-parallel-size", str(ep)]
    if etp is not None:
        out += ["--expert-tensor-parallel-size", str(etp)]
    if recompute == "full":
        out += ["--recompute-granularity", "full", "--recompute-method", recompute_method,
                "--recompute-num-layers", str(recompute_num_layers)]
    elif recompute == "selective":
        out += ["--recompute-granularity", "selective"]
    if vp:
        out += ["--num-layers-per-virtual-pipeline-stage", str(vp)]
    return tuple(out)
