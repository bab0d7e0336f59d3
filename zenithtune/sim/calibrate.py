"""Calibration of the simulator against published Megatron throughput: `python -m zenithtune.sim.calibrate`.

Rows are MEGATRON.md §Calibration. Where a source does not publish a shape or a batch, the choice is
ours and written in the row (GPT shapes: MHA, GELU MLP 4h, untied embeddings):

- H100 (Megatron-Core weak scaling, s=4096, V=131072, selective recompute, distributed optimizer, TP/DP
  overlaps on, model FLOPs): 1.7B = 24 layers x 2048 (16 heads), 7.1B = 32 x 4096 (32), 16B = 40 x 5120
  (40), 32B = 48 x 7168 (56), 70B = Llama-2-70B (80 x 8192, 64 heads / 8 groups, SwiGLU 28672),
  177B = GPT-3 (96 x 12288, 96 heads). DP 64 on every row, GBS 1024 (GPT-3's 1536 for 177B),
  micro-batch sizes as listed.
- A100 (Narayanan et al. 2021, Table 1, shapes and GBS published; s=2048, V=51200, full recompute,
  unfused attention, no sequence parallelism, no distributed optimizer): the figures count the
  recompute pass (hardware FLOPs = 96·B·s·L·h²·(1 + s/6h + V/16Lh)), so the simulated iteration time is
  converted the same way before comparing. Micro-batch sizes and interleaving are our choice.
- Mixtral 8x7B on H100 (MCore 0.9, 468 TFLOP/s): layout ours; informational, not a test target.
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass

from zenithtune.sim.trainer import SimResult, simulate


@dataclass(frozen=True)
class Row:
    name: str
    published: float  # TFLOP/s/GPU as published
    argv: tuple[str, ...]
    metric: str = "model"  # "model": Megatron's model FLOPs; "hardware": Narayanan's (recompute counted)
    source: str = "h100"  # h100 | a100 | moe
    tolerance: float = 0.15  # the test's bound on |simulated/published - 1|

    @property
    def n_gpus(self) -> int:
        return int(self.argv[self.argv.index("--sim-world-size") + 1])


def _gpt(layers: int, hidden: int, heads: int, seq: int, vocab: int, tp: int, pp: int, n: int, mbs: int,
         gbs: int, *extra: str) -> tuple[str, ...]:
    return ("--num-layers", str(layers), "--hidden-size", str(hidden), "--num-attention-heads", str(heads),
            "--seq-length", str(seq), "--max-position-embeddings", str(seq), "--vocab-size", str(vocab),
            "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
            "--micro-batch-size", str(mbs), "--global-batch-size", str(gbs), "--train-iters", "6",
            "--bf16", "--log-throughput", "--sim-world-size", str(n), *extra)


_H100 = ("--sim-gpu", "h100", "--untie-embeddings-and-output-weights", "--recompute-granularity", "selective",
         "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather")
_SP = ("--sequence-parallel", "--tp-comm-overlap")
_A100 = ("--sim-gpu", "a100-80g", "--attention-backend", "unfused", "--recompute-granularity", "full",
         "--recompute-method", "uniform", "--recompute-num-layers", "1", "--overlap-grad-reduce")
_LLAMA70B = ("--ffn-hidden-size", "28672", "--swiglu", "--group-query-attention", "--num-query-groups", "8",
             "--disable-bias-linear")

ROWS: tuple[Row, ...] = (
    Row("GPT 1.7B TP1", 408.8, _gpt(24, 2048, 16, 4096, 131072, 1, 1, 64, 4, 1024, *_H100)),
    Row("GPT 7.1B TP2", 465.9, _gpt(32, 4096, 32, 4096, 131072, 2, 1, 128, 2, 1024, *_H100, *_SP)),
    Row("GPT 16B TP4", 489.1, _gpt(40, 5120, 40, 4096, 131072, 4, 1, 256, 1, 1024, *_H100, *_SP)),
    Row("GPT 32B TP8", 459.6, _gpt(48, 7168, 56, 4096, 131072, 8, 1, 512, 1, 1024, *_H100, *_SP)),
    Row("Llama 70B TP8 PP2", 419.7, _gpt(80, 8192, 64, 4096, 131072, 8, 2, 1024, 1, 1024, *_H100, *_SP, *_LLAMA70B)),
    Row("GPT 177B TP8 PP6", 432.8, _gpt(96, 12288, 96, 4096, 131072, 8, 6, 3072, 1, 1536, *_H100, *_SP)),
    Row("GPT 1.7B TP1 (A100)", 137, _gpt(24, 2304, 24, 2048, 51200, 1, 1, 32, 8, 512, *_A100), "hardware", "a100"),
    Row("GPT 3.6B TP2 (A100)", 138, _gpt(30, 3072, 32, 2048, 51200, 2, 1, 64, 8, 512, *_A100), "hardware", "a100"),
    Row("GPT 7.5B TP4 (A100)", 142, _gpt(36, 4096, 32, 2048, 51200, 4, 1, 128, 8, 512, *_A100), "hardware", "a100"),
    Row("GPT 18.4B TP8 (A100)", 135, _gpt(40, 6144, 48, 2048, 51200, 8, 1, 256, 4, 1024, *_A100), "hardware", "a100"),
    Row("GPT 39.1B TP8 PP2 (A100)", 138, _gpt(48, 8192, 64, 2048, 51200, 8, 2, 512, 2, 1536, *_A100),
        "hardware", "a100"),
    Row("GPT 76.1B TP8 PP4 (A100)", 140, _gpt(60, 10240, 80, 2048, 51200, 8, 4, 1024, 2, 1792, *_A100,
                                              "--num-layers-per-virtual-pipeline-stage", "5"), "hardware", "a100"),
    Row("GPT 145.6B TP8 PP8 (A100)", 148, _gpt(80, 12288, 96, 2048, 51200, 8, 8, 1536, 2, 2304, *_A100,
                                               "--num-layers-per-virtual-pipeline-stage", "5"), "hardware", "a100"),
    Row("GPT 310.1B TP8 PP16 (A100)", 155, _gpt(96, 16384, 128, 2048, 51200, 8, 16, 1920, 1, 2160, *_A100,
                                                "--num-layers-per-virtual-pipeline-stage", "3"), "hardware", "a100"),
    Row("GPT 529.6B TP8 PP35 (A100)", 163, _gpt(105, 20480, 128, 2048, 51200, 8, 35, 2520, 1, 2520, *_A100),
        "hardware", "a100"),
    Row("Mixtral 8x7B TP1 PP4 EP8 VP8", 468, _gpt(
        32, 4096, 32, 4096, 32000, 1, 4, 64, 1, 256, *_H100, "--ffn-hidden-size", "14336", "--swiglu",
        "--group-query-attention", "--num-query-groups", "8", "--disable-bias-linear", "--num-experts", "8",
        "--moe-router-topk", "2", "--expert-model-parallel-size", "8",
        "--num-layers-per-virtual-pipeline-stage", "1"), "model", "moe", tolerance=0.25),
)


def _arg(argv: tuple[str, ...], name: str) -> int:
    return int(argv[argv.index(name) + 1])


def hardware_tflops(row: Row, res: SimResult) -> float:
    """Narayanan's hardware TFLOP/s/GPU (recompute pass and full s² attention counted) for this run."""
    a = row.argv
    B, s, L, h, V = (_arg(a, k) for k in ("--global-batch-size", "--seq-length", "--num-layers",
                                           "--hidden-size", "--vocab-size"))
    flops = 96.0 * B * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))
    return flops / ((res.iter_seconds or math.inf) * 1e12 * row.n_gpus)


def simulated(row: Row) -> tuple[float | None, SimResult]:
    res = simulate(list(row.argv))
    if res.kind != "ok":
        return None, res
    return (hardware_tflops(row, res) if row.metric == "hardware" else res.tflops), res


def table() -> list[tuple[Row, float | None, SimResult]]:
    return [(row, *simulated(row)) for row in ROWS]


def render(rows: list[tuple[Row, float | None, SimResult]]) -> str:
    lines = ["| model | GPUs | published TFLOP/s/GPU | simulated | ratio | metric |",
             "|---|---|---|---|---|---|"]
    for row, sim, res in rows:
        sim_text = f"{sim:.1f}" if sim is not None else res.kind.upper()
        ratio = f"{sim / row.published:.2f}" if sim is not None else "-"
        lines.append(f"| {row.name} | {row.n_gpus} | {row.published:.1f} | {sim_text} | {ratio} | {row.metric} |")
    return "\n".join(lines)


def main() -> int:
    rows = table()
    print(render(rows))
    bad = [row.name for row, sim, _ in rows
           if sim is None or abs(sim / row.published - 1) > row.tolerance]
    if bad:
        print(f"outside tolerance: {', '.join(bad)}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
