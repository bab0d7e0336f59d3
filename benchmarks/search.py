"""How fast does each strategy find the fastest configuration? Scenarios on the built-in simulator.

    python benchmarks/search.py                      # every scenario x strategy, prints the tables
    python benchmarks/search.py --write              # also write benchmarks/results/search.md
    python benchmarks/search.py --quick              # 3 scenarios, one seed: a smoke run (~30 s)
    python benchmarks/search.py --scenarios llama3-8b-8xh100 --strategies heuristic,tpe --trace
    python benchmarks/search.py --strategies heuristic --override memory_safety_margin=0.1

Each study is the real thing, in-process: the scenario's Job is built from conf/ with Hydra's
compose API and `build_job` (strategy, memory model, space), an in-memory Optuna study runs the same
`StudyLoop` as `python -m zenithtune -m`, and the launch function injects the candidate into the
scenario's simulator command (`inject` + `Space.options`) and calls `zenithtune.sim.simulate`; the
score is read from its stdout by the configured evaluator. The scenario commands carry
--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather, as NVIDIA's recipes do.

The exhaustive sweep simulates every valid candidate (`Space.walk`) once: the optimum, the best the
memory model lets a study launch at all, and grid's row (grid launches every unscreened candidate,
least predicted memory first; --grid-loop pushes those thousands of trials through the loop instead).

Columns: best found / optimum, where "best" is the incumbent a user would deploy (best measured so
far) valued at its steady-state throughput; launches to reach 0.99 of the optimum (">N" = never in N
launches); launched trials; failed launches (OOM / crash); simulated GPU-hours spent (simulated
wall time of each launched trial, startup included, x n_gpus). Stochastic strategies (random, tpe,
staged_blackbox) run with 3 seeds and report the median. The output ends with the goals set for
the strategies, each a yes/no question on these numbers (e.g. "heuristic >= 0.99 of the optimum on every
scenario: yes").
Work is spread over --jobs processes (default 2).
"""
from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import statistics
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
warnings.filterwarnings("ignore")  # Hydra/OmegaConf deprecation chatter

import optuna  # noqa: E402

from zenithtune import settings  # noqa: E402
from zenithtune.job import Job, build_job  # noqa: E402
from zenithtune.loop import Callbacks, Launched, StudyLoop  # noqa: E402
from zenithtune.sim import inprocess, simulate  # noqa: E402
from zenithtune.study import best as called_best  # noqa: E402
from zenithtune.validate import required_env  # noqa: E402

optuna.logging.set_verbosity(optuna.logging.ERROR)

RESULTS = ROOT / "benchmarks" / "results" / "search.md"
_LLAMA3_8B = ("--num-layers=32 --hidden-size=4096 --ffn-hidden-size=14336 --num-attention-heads=32 "
              "--group-query-attention --num-query-groups=8 --vocab-size=128256 --swiglu --disable-bias-linear "
              "--untie-embeddings-and-output-weights --position-embedding-type=rope")
_LLAMA3_70B = ("--num-layers=80 --hidden-size=8192 --ffn-hidden-size=28672 --num-attention-heads=64 "
               "--group-query-attention --num-query-groups=8 --vocab-size=128256 --swiglu --disable-bias-linear "
               "--untie-embeddings-and-output-weights --position-embedding-type=rope")
_QWEN3_30B_A3B = ("--num-layers=48 --hidden-size=2048 --ffn-hidden-size=6144 --num-attention-heads=32 "
                  "--group-query-attention --num-query-groups=4 --kv-channels=128 --num-experts=128 "
                  "--moe-router-topk=8 --moe-ffn-hidden-size=768 --vocab-size=151936 --swiglu "
                  "--disable-bias-linear --untie-embeddings-and-output-weights --position-embedding-type=rope")
_MIXTRAL_8X7B = ("--num-layers=32 --hidden-size=4096 --ffn-hidden-size=14336 --num-attention-heads=32 "
                 "--group-query-attention --num-query-groups=8 --num-experts=8 --moe-router-topk=2 "
                 "--vocab-size=32000 --swiglu --disable-bias-linear --untie-embeddings-and-output-weights "
                 "--position-embedding-type=rope")
_QWEN25_VL_7B = ("--num-layers=28 --hidden-size=3584 --ffn-hidden-size=18944 --num-attention-heads=28 "
                 "--group-query-attention --num-query-groups=4 --vocab-size=152064 --swiglu "
                 "--untie-embeddings-and-output-weights --position-embedding-type=rope "
                 "--vision-num-layers=32 --vision-hidden-size=1280 --vision-ffn-hidden-size=3420 "
                 "--vision-seq-length=1024")


@dataclass(frozen=True)
class Scenario:
    name: str
    title: str
    shape: str  # the model's Megatron options
    n_gpus: int
    gbs: int
    seq: int
    gpu: str = "h100"
    quick: bool = False  # part of --quick
    sim_options: tuple[str, ...] = ()  # more --sim-* options (benchmarks/robustness.py: the perturbation)

    def command(self) -> list[str]:
        return [sys.executable, "-m", "zenithtune.sim", *self.shape.split(), f"--seq-length={self.seq}",
                f"--max-position-embeddings={self.seq}", "--micro-batch-size=1", f"--global-batch-size={self.gbs}",
                "--train-iters=10", "--bf16", "--use-distributed-optimizer", "--overlap-grad-reduce",
                "--overlap-param-gather", "--log-throughput",
                f"--sim-gpu={self.gpu}", "--sim-gpus-per-node=8", f"--sim-world-size={self.n_gpus}",
                *self.sim_options]


SCENARIOS = (
    Scenario("llama3-8b-8xh100", "Llama-3-8B, s=8k, 8 H100, gbs 64", _LLAMA3_8B, 8, 64, 8192, quick=True),
    Scenario("llama3-70b-32xh100", "Llama-3-70B, s=8k, 32 H100, gbs 128", _LLAMA3_70B, 32, 128, 8192),
    Scenario("llama3-70b-64xh100", "Llama-3-70B, s=8k, 64 H100, gbs 256", _LLAMA3_70B, 64, 256, 8192),
    # NVIDIA's published layouts for Llama-3-70B on 64 H100 interleave (MEGATRON.md: TP4 PP4 CP2 VP5 at gbs 128,
    # TP4 PP8 VP5 at gbs 256): at gbs 128 a deep pipeline has few micro-batches, so the bubble decides
    Scenario("llama3-70b-64xh100-gbs128", "Llama-3-70B, s=8k, 64 H100, gbs 128 (virtual pipeline)", _LLAMA3_70B, 64,
             128, 8192),
    Scenario("qwen3-30b-a3b-16xh100", "Qwen3-30B-A3B MoE, s=4k, 16 H100, gbs 128", _QWEN3_30B_A3B, 16, 128, 4096),
    # Selective recompute's module sets decide it (issue 23): without recompute only wide layouts fit (best 165),
    # full recompute re-runs every GEMM (166); recomputing the MoE layer's norm and the experts' activation
    # function (--recompute-modules layernorm moe_act, grouped GEMM as MoE users run it) wins: 177 (TP4 PP2 EP4).
    Scenario("qwen3-30b-a3b-8xh100", "Qwen3-30B-A3B MoE, s=4k, 8 H100, gbs 64, grouped GEMM (recompute modules)",
             _QWEN3_30B_A3B + " --moe-grouped-gemm", 8, 64, 4096),
    # Expert-parallel communication overlap decides it (issue 23; NVIDIA's tuning notes: 244 -> 287 TFLOP/s/GPU for
    # this model on 16 H100): with the alltoall dispatcher the all-to-alls of TP2 PP2 VP2 EP8 hide behind the
    # paired micro-batch's compute, which only a virtual pipeline allows at pp > 1
    Scenario("qwen3-30b-a3b-16xh100-a2a", "Qwen3-30B-A3B MoE, s=4k, 16 H100, gbs 128, alltoall dispatcher (EP overlap)",
             _QWEN3_30B_A3B + " --moe-grouped-gemm --moe-token-dispatcher-type=alltoall", 16, 128, 4096),
    Scenario("mixtral-8x7b-24xh100", "Mixtral-8x7B MoE, s=4k, 24 H100 (3 nodes), gbs 96", _MIXTRAL_8X7B, 24, 96,
             4096, quick=True),
    Scenario("dense-32k-16xh100", "Llama-3-8B shape, s=32k, 16 H100, gbs 32", _LLAMA3_8B, 16, 32, 32768),
    Scenario("vlm-8xh200", "Qwen2.5-VL-7B (ViT 32x1280), s=4k, 8 H200, gbs 64", _QWEN25_VL_7B, 8, 64, 4096,
             gpu="h200", quick=True),
)
# strategy -> seeds (None: deterministic, one run)
STRATEGIES: dict[str, tuple[int, ...] | None] = {
    "heuristic": None, "staged_blackbox": (0, 1, 2), "upstream": None, "tpe": (0, 1, 2), "random": (0, 1, 2),
    "grid": None,
}


@dataclass
class StudyResult:
    scenario: str
    strategy: str
    seed: int | None
    curve: list[float | None]  # after each launch: the incumbent's steady-state TFLOP/s (None: nothing yet)
    failed: int  # launches that ended without a score (OOM, crash)
    hours: list[float]  # after each launch: simulated GPU-hours so far (wall time x n_gpus, summed)
    stop: str
    seconds: float
    trace: list[str] = field(default_factory=list)
    optimum: float = 0.0  # filled once the scenario's sweep is known

    @property
    def launched(self) -> int:
        return len(self.curve)

    @property
    def gpu_hours(self) -> float:
        return self.hours[-1] if self.hours else 0.0

    def hours_to(self, value: float) -> float:
        """GPU-hours until the incumbent was worth `value` (inf if never)."""
        return next((h for v, h in zip(self.curve, self.hours) if v is not None and v >= value), math.inf)

    @property
    def best(self) -> float:
        return next((v for v in reversed(self.curve) if v is not None), 0.0)

    @property
    def ratio(self) -> float:
        return self.best / self.optimum if self.optimum else 0.0

    def reached(self, share: float) -> int | None:
        """Launches until the incumbent was within `share` of the optimum; None if never."""
        return next((i + 1 for i, v in enumerate(self.curve) if v is not None and v >= share * self.optimum), None)


EXTRA_OVERRIDES: list[str] = []  # --override: more Hydra overrides for every job (e.g. memory_safety_margin=0.1)


def _applies(override: str, strategy: str) -> bool:
    """A `strategy.X=...` override is for the strategies that have a setting X: the sweep's grid has
    none of the heuristic's, and `--override strategy.neighbours=0` must not stop it."""
    key = override.lstrip("+~").split("=", 1)[0]
    if not key.startswith("strategy."):
        return True
    from omegaconf import OmegaConf

    conf = OmegaConf.load(ROOT / "conf" / "strategy" / f"{strategy}.yaml")
    return key.split(".", 1)[1] in conf


def make_job(sc: Scenario, strategy: str, seed: int | None, n_trials: int) -> Job:
    from hydra import compose, initialize_config_module
    from omegaconf import open_dict

    overrides = [f"n_gpus={sc.n_gpus}", f"gbs={sc.gbs}", f"strategy={strategy}", f"n_trials={n_trials}",
                 f"sim_gpu={sc.gpu}", *(o for o in EXTRA_OVERRIDES if _applies(o, strategy))]
    if seed is not None:
        overrides.append(f"strategy.seed={seed}")
    with initialize_config_module("zenithtune.conf"):
        cfg = compose("config", overrides=overrides)
    with open_dict(cfg):
        cfg.command = sc.command()
    return build_job(settings.load(cfg))




@dataclass
class Sweep:
    """Every valid candidate simulated once (the exhaustive optimum), in grid's order."""

    value: float  # best TFLOP/s/GPU over every valid candidate (Space.walk)
    candidate: dict
    count: int  # valid candidates
    screened_value: float  # best over those a fresh memory model does not predict to run out of memory
    screened_candidate: dict
    grid: StudyResult  # the grid baseline's row, read off the sweep


def sim_argv(job: Job, cand: dict) -> list[str]:
    """The simulator's own arguments for a candidate of this job (robustness.py uses it too)."""
    return inprocess.sim_argv(job.command, job.space.options(cand))


def sweep(sc: Scenario) -> Sweep:
    """Grid's order is least predicted memory first; what a grid study with a fresh memory model
    launches is every candidate it does not screen, so its row comes from this sweep without pushing
    thousands of trials through the loop (--grid-loop does that)."""
    started = time.time()
    job = make_job(sc, "grid", None, 1)
    cands = sorted(job.space.walk(), key=lambda c: job.assess(c).predicted_gb or 0.0)
    best, arg, sbest, sarg = 0.0, {}, 0.0, {}
    curve: list[float | None] = []
    hours: list[float] = []
    failed, incumbent = 0, None
    for cand in cands:
        res = simulate(sim_argv(job, cand), required_env(job.space.layout(cand)))
        value = res.tflops if res.kind == "ok" and res.tflops else None
        if not job.assess(cand).predicted_oom:
            hours.append((hours[-1] if hours else 0.0) + res.wall_seconds * sc.n_gpus / 3600.0)
            failed += value is None
            if value is not None and (incumbent is None or value > incumbent):
                incumbent = value
                if value > sbest:
                    sbest, sarg = value, cand
            curve.append(incumbent)
        if value is not None and value > best:
            best, arg = value, cand
    grid = StudyResult(sc.name, "grid", None, curve, failed, hours, "every candidate not predicted to run out of "
                       "memory (read off the exhaustive sweep)", time.time() - started, optimum=best)
    return Sweep(best, arg, len(cands), sbest, sarg, grid)


class _Trace(Callbacks):
    def __init__(self) -> None:
        self.lines: list[str] = []
        self._why = ""

    def launching(self, number: int, cand: dict, why: str, n: int) -> None:
        self._why = why

    def result(self, outcome, n: int) -> None:
        got = f"{outcome.value:.1f}" if outcome.ok else (outcome.kind or "failed")
        self.lines.append(f"{n:3d}. {got:>7}  {cand_str(outcome.candidate)}  <- {self._why}")


def cand_str(c: dict) -> str:
    short = {"recompute_granularity": "rc", "recompute_method": "m", "recompute_num_layers": "n",
             "vit_gradient_checkpointing": "vit"}
    return " ".join(f"{short.get(k, k)}={v}" for k, v in c.items())


def run_study(sc: Scenario, strategy: str, seed: int | None, n_trials: int) -> StudyResult:
    """One study through the real StudyLoop, launching the simulator in-process."""
    started = time.time()
    job = make_job(sc, strategy, seed, n_trials)
    truth: dict[int, float] = {}  # trial number -> the simulator's steady-state TFLOP/s (no log jitter)

    launch = inprocess.launcher(job.command, job.space, job.evaluator, truth=truth)

    study = optuna.create_study(storage=None, direction=job.evaluator.direction, sampler=job.strategy.sampler())
    trace = _Trace()
    loop = StudyLoop(job, study, launch, trace)
    loop.start([])
    stop = loop.run(n_trials)
    # the incumbent is what a user would deploy (what the tuner calls best so far: zenithtune.study.best),
    # valued at its steady-state truth so one jittery log line (or, on a noisy trainer, one lucky run)
    # neither flatters nor hurts a strategy
    curve: list[float | None] = []
    hours: list[float] = []
    failed = 0
    so_far: list = []
    for o in loop.outcomes:
        if not o.launched:
            continue
        so_far.append(o)
        hours.append((hours[-1] if hours else 0.0) + (o.duration or 0.0) * sc.n_gpus / 3600.0)
        failed += not o.ok
        incumbent = called_best(so_far, job.evaluator.direction)
        curve.append(None if incumbent is None else truth.get(incumbent.trial_number, incumbent.value))
    return StudyResult(sc.name, strategy, seed, curve, failed, hours, stop, time.time() - started, trace.lines)


def _task(task: tuple) -> tuple:
    """One unit of work for the pool: a scenario's sweep or one study."""
    kind, name, overrides, *rest = task
    EXTRA_OVERRIDES[:] = list(overrides)
    sc = next(s for s in SCENARIOS if s.name == name)
    if kind == "sweep":
        return task, sweep(sc)
    strategy, seed, budget = rest
    return task, run_study(sc, strategy, seed, budget)


# --- the tables --------------------------------------------------------------------------------------
def _med(values: list[float]) -> float:
    return statistics.median(values)


def _reached(runs: list[StudyResult], share: float = 0.99) -> float:
    """Median over seeds of launches to `share` of the optimum; inf when the median run never got there."""
    return _med([float(r.reached(share) or math.inf) for r in runs])


def _n(value: float, cap: int) -> str:
    return f">{cap}" if math.isinf(value) else f"{value:g}"


def _group(results: list[StudyResult]) -> dict[tuple[str, str], list[StudyResult]]:
    by: dict[tuple[str, str], list[StudyResult]] = {}
    for r in results:
        by.setdefault((r.scenario, r.strategy), []).append(r)
    return by


def table(results: list[StudyResult], sweeps: dict[str, Sweep]) -> str:
    out = ["| scenario | valid configs | optimum TFLOP/s/GPU | best the memory screen allows | strategy "
           "| best / optimum | launches to 0.99 | launched | failed | sim GPU-hours |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for (scn, strat), runs in _group(results).items():
        o = sweeps[scn]
        seeds = f" ({len(runs)} seeds)" if len(runs) > 1 else ""
        cap = max(r.launched for r in runs)
        out.append(f"| {scn} | {o.count} | {o.value:.1f} | {o.screened_value / o.value:.3f} | {strat}{seeds} "
                   f"| {_med([r.ratio for r in runs]):.3f} | {_n(_reached(runs), cap)} "
                   f"| {_med([r.launched for r in runs]):g} | {_med([r.failed for r in runs]):g} "
                   f"| {_med([r.gpu_hours for r in runs]):.1f} |")
    return "\n".join(out)


def summary(results: list[StudyResult]) -> str:
    """Per strategy, across scenarios (seeds reduced to their median first)."""
    lines = ["| strategy | scenarios at >= 0.99 | worst best/optimum | median launches to 0.99 "
             "| median launched | most failed launches in a study | total sim GPU-hours |",
             "|---|---|---|---|---|---|---|"]
    per: dict[str, list[tuple[float, float, float, int, float]]] = {}
    for (_, strat), runs in _group(results).items():
        per.setdefault(strat, []).append((_med([r.ratio for r in runs]), _reached(runs),
                                          _med([r.launched for r in runs]), max(r.failed for r in runs),
                                          _med([r.gpu_hours for r in runs])))
    for strat, rows in per.items():
        lines.append(f"| {strat} | {sum(r[0] >= 0.99 for r in rows)}/{len(rows)} | {min(r[0] for r in rows):.3f} "
                     f"| {_n(_med([r[1] for r in rows]), 0).replace('>0', 'never')} | {_med([r[2] for r in rows]):g} "
                     f"| {max(r[3] for r in rows)} | {sum(r[4] for r in rows):.1f} |")
    return "\n".join(lines)


def targets(results: list[StudyResult], sweeps: dict[str, Sweep]) -> str:
    """The goals set for the strategies, each a yes/no question on the numbers above, scenario by scenario."""
    by = _group(results)
    scen = list(dict.fromkeys(r.scenario for r in results))
    have = {s for _, s in by}
    out: list[str] = []

    def mark(ok: bool) -> str:
        return "yes" if ok else "no"

    if "heuristic" in have:
        h = {s: by[(s, "heuristic")][0] for s in scen}
        miss = [f"{s} {h[s].ratio:.3f} (the memory screen allows at most {sweeps[s].screened_value / sweeps[s].value:.3f})"
                for s in scen if h[s].ratio < 0.99]
        out.append(f"- heuristic >= 0.99 of the optimum on every scenario: {mark(not miss)}"
                   + (f"; below: {', '.join(miss)}" if miss else ""))
        med = _med([h[s].launched for s in scen])
        out.append(f"- heuristic median launched trials <= 12: {mark(med <= 12)} ({med:g}; most {max(h[s].launched for s in scen)})")
        worst = max(h[s].failed for s in scen)
        out.append(f"- heuristic <= 1 failed launch per study: {mark(worst <= 1)} (most {worst})")
        if "tpe" in have:
            parts, ok = [], True
            for s in scen:
                hr = _reached([h[s]])
                tr = _reached(by[(s, "tpe")])
                cap = max(r.launched for r in by[(s, "tpe")])
                if math.isinf(hr):
                    parts.append(f"{s}: heuristic never, tpe {_n(tr, cap)}")
                    ok = ok and math.isinf(tr)
                    continue
                ok = ok and (math.isinf(tr) or tr >= 3 * hr)
                parts.append(f"{s}: {hr:g} vs {_n(tr, cap)}")
            out.append(f"- heuristic >= 3x fewer launches to 0.99 than tpe: {mark(ok)} ({'; '.join(parts)})")
        if "upstream" in have:
            parts, ok = [], True
            for s in scen:
                u = by[(s, "upstream")][0]
                if not u.launched:
                    parts.append(f"{s}: upstream launched nothing (all it may try, PP=CP=ETP=1, was screened), heuristic "
                                 f"{h[s].gpu_hours:.1f}")
                    continue
                match = h[s].hours_to(u.best) if u.best else 0.0
                ok = ok and match <= u.gpu_hours
                parts.append(f"{s}: {h[s].gpu_hours:.1f} in all, {match:.1f} to match upstream's best, vs {u.gpu_hours:.1f}")
            out.append(f"- heuristic needs fewer simulated GPU-hours than upstream to reach upstream's result: "
                       f"{mark(ok)} ({'; '.join(parts)})")
    if "staged_blackbox" in have:
        miss = [f"{s} {_med([r.ratio for r in by[(s, 'staged_blackbox')]]):.3f}" for s in scen
                if _med([r.ratio for r in by[(s, "staged_blackbox")]]) < 0.98]
        out.append(f"- staged_blackbox >= 0.98 of the optimum within 50 trials (median over seeds): {mark(not miss)}"
                   + (f"; below: {', '.join(miss)}" if miss else ""))
    return "\n".join(out)


# --- parallel waves (issue 11): the same studies with parallel_trials=K ------------------------------
PARALLEL_RESULTS = ROOT / "benchmarks" / "results" / "parallel.md"


def parallel_study(sc: Scenario, strategy: str, seed: int | None, n_trials: int, k: int,
                   optimum: float) -> tuple[int | None, int | None, int]:
    """One study whose waves launch k trials together: (waves to 0.99, launches to 0.99, launches)."""
    job = make_job(sc, strategy, seed, n_trials)
    truth: dict[int, float] = {}

    launch = inprocess.launcher(job.command, job.space, job.evaluator, truth=truth)

    def one(p) -> Launched:
        return launch(p.number, p.cand, None)

    study = optuna.create_study(storage=None, direction=job.evaluator.direction, sampler=job.strategy.sampler())
    seen: list[tuple[int, object]] = []

    class Waves(Callbacks):
        def result(self, outcome, n: int) -> None:
            seen.append((loop.waves, outcome))

    loop = StudyLoop(job, study, callbacks=Waves(), launch_batch=lambda wave: [one(p) for p in wave], parallel=k)
    loop.start([])
    loop.run(n_trials)
    incumbent = None
    for i, (wave, o) in enumerate(seen):
        if o.ok and (incumbent is None or job.strategy.better(o.value, incumbent.value)):
            incumbent = o
        if incumbent is not None and truth.get(incumbent.trial_number, incumbent.value) >= 0.99 * optimum:
            return wave, i + 1, len(seen)
    return None, None, len(seen)


def parallel_table(k: int, scenarios: list[Scenario], strategies: list[str], n_trials: int, n_seeds: int) -> str:
    rows = [f"| scenario | strategy | waves to 0.99, K=1 | waves, K={k} | launches to 0.99, K=1 | launches, K={k} |",
            "|---|---|---|---|---|---|"]
    for sc in scenarios:
        optimum = sweep(sc).value
        for strat in strategies:
            seeds = [None] if strat in ("heuristic", "upstream", "grid") else list(range(n_seeds))
            cols: dict[int, list[tuple]] = {1: [], k: []}
            for width in (1, k):
                cols[width] = [parallel_study(sc, strat, seed, n_trials, width, optimum) for seed in seeds]

            def med(width: int, idx: int, cols: dict[int, list[tuple]] = cols) -> str:
                vals = [float(r[idx]) if r[idx] is not None else math.inf for r in cols[width]]
                m = _med(vals)
                return f">{n_trials}" if math.isinf(m) else f"{m:g}"

            rows.append(f"| {sc.name} | {strat} | {med(1, 0)} | {med(k, 0)} | {med(1, 1)} | {med(k, 1)} |")
    return "\n".join(rows)


def parallel_main(args: argparse.Namespace) -> int:
    scenarios = [s for s in SCENARIOS if s.quick] if not args.scenarios else \
        [s for s in SCENARIOS if s.name in args.scenarios.split(",")]
    strategies = args.strategies.split(",") if args.strategies else ["heuristic", "tpe", "random"]
    n_seeds = args.seeds if args.seeds is not None else 3
    started = time.time()
    table = parallel_table(args.parallel, scenarios, strategies, args.n_trials, n_seeds)
    text = (f"# Parallel waves on the simulator (parallel_trials)\n\nGenerated by `python benchmarks/search.py "
            f"--parallel {args.parallel} --write` in {time.time() - started:.0f} s. A wave launches K trials "
            f"together (K Slurm jobs at once), so wall time follows waves, cost follows launches. Strategies "
            f"propose K distinct candidates per wave (heuristic: its K best under the memory screen, the ones "
            f"in flight counted as tried; TPE: Optuna's constant liar). Median over {n_seeds} seeds for "
            f"stochastic strategies; budget {args.n_trials} launches; \">N\": not reached.\n\n{table}\n")
    print(text)
    if args.write:
        PARALLEL_RESULTS.parent.mkdir(parents=True, exist_ok=True)
        PARALLEL_RESULTS.write_text(text)
        print(f"wrote {PARALLEL_RESULTS.relative_to(ROOT)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenarios", default=None, help="comma-separated scenario names (default: all)")
    ap.add_argument("--strategies", default=None, help=f"comma-separated (default: {','.join(STRATEGIES)})")
    ap.add_argument("--n-trials", type=int, default=50, help="launch budget per study (grid: every candidate)")
    ap.add_argument("--seeds", type=int, default=None, help="seeds per stochastic strategy (default 3)")
    ap.add_argument("--quick", action="store_true", help="3 small scenarios, 1 seed")
    ap.add_argument("--parallel", type=int, default=0, metavar="K",
                    help=f"waves of K trials vs one at a time (writes {PARALLEL_RESULTS.relative_to(ROOT)})")
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="processes (default 2)")
    ap.add_argument("--write", action="store_true", help=f"write {RESULTS.relative_to(ROOT)}")
    ap.add_argument("--trace", action="store_true", help="print every launch with its why-line")
    ap.add_argument("--grid-loop", action="store_true",
                    help="run grid through the study loop too (minutes: thousands of trials) instead of "
                         "reading its row off the exhaustive sweep")
    ap.add_argument("--override", action="append", default=[],
                    help="a Hydra override for every study, e.g. --override memory_safety_margin=0.1; "
                         "strategy.X=... only for the strategies that have X")
    ap.add_argument("--json", type=Path, default=None, help="also dump every study's numbers as JSON here")
    args = ap.parse_args(argv)
    if args.parallel:
        return parallel_main(args)

    scenarios = [s for s in SCENARIOS if not args.quick or s.quick]
    if args.scenarios:
        names = args.scenarios.split(",")
        unknown = set(names) - {s.name for s in SCENARIOS}
        if unknown:
            ap.error(f"unknown scenario(s) {sorted(unknown)}; known: {[s.name for s in SCENARIOS]}")
        scenarios = [s for s in SCENARIOS if s.name in names]
    strategies = dict(STRATEGIES)
    if args.strategies:
        names = args.strategies.split(",")
        unknown = set(names) - set(STRATEGIES)
        if unknown:
            ap.error(f"unknown strategy(ies) {sorted(unknown)}; known: {list(STRATEGIES)}")
        strategies = {k: STRATEGIES[k] for k in names}
    n_seeds = args.seeds if args.seeds is not None else (1 if args.quick else 3)

    tasks: list[tuple] = []
    for sc in scenarios:
        tasks.append(("sweep", sc.name, tuple(args.override)))
        for strat, seeds in strategies.items():
            if strat == "grid" and not args.grid_loop:
                continue  # its row comes from the sweep
            budget = 10 ** 6 if strat == "grid" else args.n_trials
            for seed in ([None] if seeds is None else list(seeds)[:n_seeds]):
                tasks.append(("study", sc.name, tuple(args.override), strat, seed, budget))
    # the long ones first, so two workers finish together
    weight = {"sweep": 3, "tpe": 2, "staged_blackbox": 2}
    tasks.sort(key=lambda t: -weight.get(t[0] if t[0] == "sweep" else t[3], 1))

    started = time.time()
    sweeps: dict[str, Sweep] = {}
    studies: dict[tuple, StudyResult] = {}
    ctx = multiprocessing.get_context("fork") if args.jobs > 1 else None
    pool = ctx.Pool(args.jobs) if ctx else None
    try:
        results_iter = pool.imap_unordered(_task, tasks) if pool else map(_task, tasks)
        for i, (task, out) in enumerate(results_iter, 1):
            if task[0] == "sweep":
                sweeps[task[1]] = out
            else:
                studies[task] = out
            print(f"[{i}/{len(tasks)}] {task[1]} {task[0] if task[0] == 'sweep' else task[3]}"
                  f"{'' if task[0] == 'sweep' or task[4] is None else f' seed={task[4]}'} "
                  f"({time.time() - started:.0f} s)", file=sys.stderr, flush=True)
    finally:
        if pool:
            pool.close()
            pool.join()

    results: list[StudyResult] = []
    for sc in scenarios:
        o = sweeps[sc.name]
        print(f"== {sc.name}: {o.count} valid configs, optimum {o.value:.1f} TFLOP/s/GPU at {cand_str(o.candidate)}")
        if o.screened_value < o.value:
            print(f"   the memory model screens it out: best it allows {o.screened_value:.1f} "
                  f"({o.screened_value / o.value:.3f}) at {cand_str(o.screened_candidate)}")
        for strat in strategies:
            runs = [r for t, r in studies.items() if t[1] == sc.name and t[3] == strat]
            if strat == "grid" and not args.grid_loop:
                runs = [o.grid]
            for r in runs:
                r.optimum = o.value
                results.append(r)
                print(f"   {strat:16s} seed={r.seed!s:4s} best/opt {r.ratio:.3f}  to 0.99: {r.reached(0.99)!s:>5}  "
                      f"launched {r.launched:4d}  failed {r.failed}  {r.gpu_hours:7.1f} GPU-h  ({r.seconds:.1f} s; {r.stop})")
                if args.trace:
                    print("\n".join("      " + line for line in r.trace))
    elapsed = time.time() - started
    scen = "\n".join(f"- `{s.name}`: {s.title}" for s in scenarios)
    text = (f"# Search efficiency on the simulator\n\nGenerated by `python benchmarks/search.py --write` in "
            f"{elapsed:.0f} s on {args.jobs} processes{' with ' + ' '.join(args.override) if args.override else ''}. "
            f"Launch budget {args.n_trials} per study; grid launches every candidate the memory model does not "
            f"screen, in its order (least predicted memory first). Stochastic strategies: median over "
            f"{n_seeds} seed(s).\n\n{scen}\n\n## Per scenario\n\n{table(results, sweeps)}\n\n"
            f"## Across scenarios\n\n{summary(results)}\n\n## Goals checked on these numbers\n\n"
            f"Each line asks one question of the tables above and answers yes or no, with the numbers.\n\n"
            f"{targets(results, sweeps)}\n")
    print()
    print(text)
    if args.write:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(text)
        print(f"wrote {RESULTS.relative_to(ROOT)}")
    if args.json:
        args.json.write_text(json.dumps([{**r.__dict__, "ratio": r.ratio} for r in results], indent=1))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HYDRA_FULL_ERROR", "1")
    sys.exit(main())
