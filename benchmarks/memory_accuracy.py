"""How good is the tuner's memory estimate? Compared with the built-in simulator's memory "truth".

    python benchmarks/memory_accuracy.py                 # print the summary
    python benchmarks/memory_accuracy.py --write         # also write benchmarks/results/memory_accuracy.md
    python benchmarks/memory_accuracy.py --margin 0.05 --overhead 3   # try other estimator settings

A grid of layouts (TP, PP, CP, EP, MBS, recompute, distributed optimizer) for Llama-3-8B, Llama-3-70B,
Qwen3-30B-A3B and Mixtral-8x7B on simulated H100-80GB nodes. Each layout is run through the
simulator (`zenithtune.sim.simulate`, its peak memory and OOM verdict are the truth) and through the
tuner's view: the shape read from the same command (`modelinfo.from_argv`), `memory.estimate`, and a
fresh `MemoryModel(80 GB)` deciding "predicted OOM" exactly as a study's first trial would.

Targets (the issue): no false prune of a layout that fits with >= 10 % headroom; <= 5 % of the real
OOMs missed (launched although they run out of memory). Only the estimator's own constants
(overhead, safety margin) are tuned against this; the simulator's code is never imported for that.
"""
from __future__ import annotations

import argparse
import itertools
import statistics
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from zenithtune.memory import DEFAULT_OVERHEAD_GB, DEFAULT_SAFETY_MARGIN, FRAGMENTATION, MemoryModel, estimate  # noqa: E402
from zenithtune.modelinfo import ModelInfo, from_argv, from_hf  # noqa: E402
from zenithtune.sim import simulate  # noqa: E402  (the truth; only its results are used)
from zenithtune.validate import Layout, check, required_env  # noqa: E402

FIXTURES = ROOT / "tests" / "fixtures" / "models"
SEQ = 4096
GBS = 256
TUNER_CAPACITY_GB = 80.0  # what the tuner assumes for --sim-gpu h100 (zenithtune.job)
HEADROOM = 0.10  # "fits with headroom": truth peak <= (1 - HEADROOM) x capacity

# model label -> (fixture directory, GPU counts)
MODELS: dict[str, tuple[str, tuple[int, ...]]] = {
    "Llama-3-8B": ("Meta-Llama-3-8B", (8, 16)),
    "Llama-3-70B": ("Meta-Llama-3-70B", (32, 64)),
    "Qwen3-30B-A3B": ("Qwen3-30B-A3B", (8, 16, 32)),
    "Mixtral-8x7B": ("Mixtral-8x7B-v0.1", (16, 32, 64)),
}
RECOMPUTE = {
    "none": {},
    "selective": {"recompute_granularity": "selective"},
    "full/uniform/1": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
    "full/block/half": {"recompute_granularity": "full", "recompute_method": "block"},  # n = half a stage
}


def shape_argv(m: ModelInfo) -> list[str]:
    """The Megatron options that state `m`'s shape (what a user's pretrain_gpt.py command carries)."""
    argv = ["--num-layers", m.num_layers, "--hidden-size", m.hidden_size, "--ffn-hidden-size", m.ffn_hidden_size,
            "--num-attention-heads", m.num_attention_heads, "--seq-length", SEQ, "--max-position-embeddings", SEQ,
            "--position-embedding-type", "rope", "--vocab-size", m.vocab_size]
    if m.num_query_groups and m.num_query_groups != m.num_attention_heads:
        argv += ["--group-query-attention", "--num-query-groups", m.num_query_groups]
    if m.kv_channels:
        argv += ["--kv-channels", m.kv_channels]
    argv += ["--swiglu"] * bool(m.swiglu) + ["--disable-bias-linear"] * bool(m.disable_bias_linear)
    argv += ["--untie-embeddings-and-output-weights"] * (m.tie_embeddings is False)
    if m.is_moe:
        argv += ["--num-experts", m.num_experts, "--moe-router-topk", m.moe_router_topk,
                 "--moe-ffn-hidden-size", m.moe_ffn_hidden_size]
        if m.moe_shared_expert_size:
            argv += ["--moe-shared-expert-intermediate-size", m.moe_shared_expert_size]
    return [str(a) for a in argv]


def layout_argv(lay: Layout, dist_opt: bool) -> list[str]:
    argv = ["--micro-batch-size", lay.mbs, "--global-batch-size", lay.gbs, "--train-iters", 2, "--bf16",
            "--tensor-model-parallel-size", lay.tp, "--pipeline-model-parallel-size", lay.pp,
            "--context-parallel-size", lay.cp, "--expert-model-parallel-size", lay.ep,
            "--sim-gpu", "h100", "--sim-world-size", lay.n_gpus]
    if lay.etp is not None:
        argv += ["--expert-tensor-parallel-size", lay.etp]
    if lay.sequence_parallel:
        argv += ["--sequence-parallel"]
    if dist_opt:
        argv += ["--use-distributed-optimizer"]
    if lay.recompute_granularity:
        argv += ["--recompute-granularity", lay.recompute_granularity]
    if lay.recompute_method:
        argv += ["--recompute-method", lay.recompute_method, "--recompute-num-layers", lay.recompute_num_layers]
    return [str(a) for a in argv]


def layouts(m: ModelInfo, n: int):
    eps = (1, 2, 4, 8) if m.is_moe else (1,)
    for tp, pp, cp, ep, mbs, rc in itertools.product((1, 2, 4, 8), (1, 2, 4, 8), (1, 2), eps, (1, 2, 4),
                                                     RECOMPUTE):
        rec = dict(RECOMPUTE[rc])
        if rec.get("recompute_method") == "block":
            rec["recompute_num_layers"] = max(1, m.num_layers // pp // 2)
        etps = (None, 1) if m.is_moe and tp > 1 else (None,)
        for etp in etps:
            lay = Layout(n_gpus=n, gbs=GBS, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp, mbs=mbs,
                         sequence_parallel=tp > 1, **rec)
            if not check(lay, m, kinds=("megatron",)):
                yield rc, lay


@dataclass
class Row:
    model: str
    recompute: str
    dist_opt: bool
    layout: Layout
    estimate_gb: float
    truth_gb: float
    capacity_gb: float
    truth_oom: bool
    predicted: str | None
    measured_gb: float | None  # the simulator's Megatron "max allocated" (what a real study can read)
    model_info: ModelInfo

    @property
    def ratio(self) -> float:
        return self.estimate_gb / self.truth_gb

    @property
    def fits_with_headroom(self) -> bool:
        return not self.truth_oom and self.truth_gb <= (1 - HEADROOM) * self.capacity_gb


def run(margin: float, overhead: float) -> tuple[list[Row], int]:
    rows: list[Row] = []
    rejected = 0
    for label, (fixture, counts) in MODELS.items():
        hf = from_hf(str(FIXTURES / fixture))
        shape = shape_argv(hf)
        for n in counts:
            for rc, lay in layouts(hf, n):
                for dist_opt in (True, False):
                    argv = shape + layout_argv(lay, dist_opt)
                    res = simulate(argv, {**required_env(lay, "h100"), "WORLD_SIZE": str(n)})
                    if res.kind not in ("ok", "oom") or res.peak_memory_gb is None:
                        rejected += 1
                        continue
                    model = from_argv(["python", "pretrain_gpt.py", *argv])  # the tuner's view of the command
                    est = estimate(lay, model, distributed_optimizer=dist_opt, overhead_gb=overhead)
                    mm = MemoryModel(model, TUNER_CAPACITY_GB, distributed_optimizer=dist_opt, margin=margin,
                                     overhead_gb=overhead)
                    rows.append(Row(label, rc, dist_opt, lay, est.total_gb, res.peak_memory_gb,
                                    res.capacity_gb or TUNER_CAPACITY_GB, res.kind == "oom",
                                    mm.predicted_oom(lay),
                                    res.max_allocated_mb / 1024 if res.kind == "ok" and res.max_allocated_mb else None,
                                    model))
    return rows, rejected


def learned(rows: list[Row], margin: float, overhead: float) -> tuple[list[float], int, int, int, int]:
    """Each (model, GPUs, optimizer) group as one study: the MemoryModel first sees one success with
    its measured "max allocated" (the first layout in grid order that ran at mbs 1 with selective
    recompute), then judges the rest of the group. Returns corrected/truth ratios, false prunes,
    fits with headroom, missed OOMs, OOMs."""
    groups: dict[tuple, list[Row]] = defaultdict(list)
    for r in rows:
        groups[(r.model, r.layout.n_gpus, r.dist_opt)].append(r)
    ratios: list[float] = []
    fp = nfit = miss = noom = 0
    for rs in groups.values():
        seen = next((r for r in rs if r.measured_gb and r.layout.mbs == 1 and r.recompute == "selective"), None)
        mm = MemoryModel(rs[0].model_info, TUNER_CAPACITY_GB, distributed_optimizer=rs[0].dist_opt, margin=margin,
                         overhead_gb=overhead)
        if seen is not None:
            mm.observe_success(seen.layout, seen.measured_gb)
        for r in rs:
            if r is seen:
                continue
            ratios.append(mm.predict(r.layout) / r.truth_gb)
            pruned = mm.predicted_oom(r.layout) is not None
            nfit += r.fits_with_headroom
            fp += r.fits_with_headroom and pruned
            noom += r.truth_oom
            miss += r.truth_oom and not pruned
    return ratios, fp, nfit, miss, noom


def _fmt_layout(r: Row) -> str:
    lay = r.layout
    etp = f" etp{lay.etp}" if lay.etp is not None else ""
    return (f"{r.model} n{lay.n_gpus} tp{lay.tp} pp{lay.pp} cp{lay.cp} ep{lay.ep}{etp} mbs{lay.mbs} "
            f"{r.recompute}{' distopt' if r.dist_opt else ''}")


def report(rows: list[Row], rejected: int, margin: float, overhead: float) -> str:
    ratios = [r.ratio for r in rows]
    fits = [r for r in rows if r.fits_with_headroom]
    ooms = [r for r in rows if r.truth_oom]
    tight = [r for r in rows if not r.truth_oom and not r.fits_with_headroom]
    false_prunes = [r for r in fits if r.predicted]
    missed = [r for r in ooms if not r.predicted]
    tight_pruned = [r for r in tight if r.predicted]
    # among layouts a tuner would actually care about (truth within 2x capacity)
    near = [r for r in rows if r.truth_gb <= 2 * r.capacity_gb]
    lines = [
        "# Memory estimate vs simulator truth",
        "",
        f"`python benchmarks/memory_accuracy.py --write` (estimator: overhead {overhead:g} GB + "
        f"{FRAGMENTATION:.0%} of allocated, safety margin "
        f"{margin:.2f}; tuner capacity {TUNER_CAPACITY_GB:g} GB for H100, simulator capacity "
        f"{rows[0].capacity_gb:g} GiB; s={SEQ}, GBS={GBS}).",
        "",
        f"- layouts run: {len(rows)} ({rejected} rejected by the simulator beyond validate's rules, skipped)",
        f"- ratio estimate/truth: median {statistics.median(ratios):.3f}, worst low {min(ratios):.3f}, "
        f"worst high {max(ratios):.3f}; within 2x capacity: median {statistics.median(r.ratio for r in near):.3f}, "
        f"range {min(r.ratio for r in near):.3f}..{max(r.ratio for r in near):.3f}",
        f"- false OOM prunes (fits with >= {HEADROOM:.0%} headroom, predicted OOM): "
        f"**{len(false_prunes)}** of {len(fits)} (target 0)",
        f"- missed OOMs (truth OOM, estimate says it fits): **{len(missed)}** of {len(ooms)} = "
        f"**{len(missed) / max(1, len(ooms)):.1%}** (target <= 5 %)",
        f"- tight fits (< {HEADROOM:.0%} headroom) predicted OOM: {len(tight_pruned)} of {len(tight)} (allowed)",
        "",
        "| model | layouts | median ratio | min | max | OOM (truth) | missed | fits w/ headroom | false prunes |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    by_model: dict[str, list[Row]] = defaultdict(list)
    for r in rows:
        by_model[r.model].append(r)
    for name, rs in by_model.items():
        rr = [r.ratio for r in rs]
        lines.append(f"| {name} | {len(rs)} | {statistics.median(rr):.3f} | {min(rr):.3f} | {max(rr):.3f} | "
                     f"{sum(r.truth_oom for r in rs)} | {sum(r.truth_oom and not r.predicted for r in rs)} | "
                     f"{sum(r.fits_with_headroom for r in rs)} | "
                     f"{sum(r.fits_with_headroom and bool(r.predicted) for r in rs)} |")
    l_ratios, l_fp, l_fit, l_miss, l_oom = learned(rows, margin, overhead)
    lines += ["", "After one measured success per (model, GPUs, optimizer) group (MemoryModel.observe_success "
              "with the simulator's \"max allocated\"): ratio corrected/truth median "
              f"{statistics.median(l_ratios):.3f}, range {min(l_ratios):.3f}..{max(l_ratios):.3f}; false prunes "
              f"{l_fp} of {l_fit}; missed OOMs {l_miss} of {l_oom} = {l_miss / max(1, l_oom):.1%}."]
    lines += ["", "| recompute | median ratio | min | max |", "|---|---|---|---|"]
    by_rc: dict[str, list[float]] = defaultdict(list)
    for r in rows:
        by_rc[r.recompute].append(r.ratio)
    for name, rr in by_rc.items():
        lines.append(f"| {name} | {statistics.median(rr):.3f} | {min(rr):.3f} | {max(rr):.3f} |")
    if false_prunes:
        lines += ["", "False prunes:"] + [f"- {_fmt_layout(r)}: truth {r.truth_gb:.1f}, estimate {r.estimate_gb:.1f}"
                                          for r in sorted(false_prunes, key=lambda r: r.ratio)[-10:]]
    if missed:
        lines += ["", "Missed OOMs (worst 10):"] + [
            f"- {_fmt_layout(r)}: truth {r.truth_gb:.1f}, estimate {r.estimate_gb:.1f}"
            for r in sorted(missed, key=lambda r: r.ratio)[:10]]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--margin", type=float, default=DEFAULT_SAFETY_MARGIN, help="MemoryModel safety margin")
    ap.add_argument("--overhead", type=float, default=DEFAULT_OVERHEAD_GB, help="estimate's fixed overhead, GB")
    ap.add_argument("--write", action="store_true", help="write benchmarks/results/memory_accuracy.md")
    args = ap.parse_args()
    rows, rejected = run(args.margin, args.overhead)
    text = report(rows, rejected, args.margin, args.overhead)
    print(text)
    if args.write:
        out = ROOT / "benchmarks" / "results" / "memory_accuracy.md"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        print(f"wrote {out.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
