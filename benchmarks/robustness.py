"""Does the search stay good on trainers whose physics the tuner's models do not share?

    python benchmarks/robustness.py                  # 12 scenarios x 4 flavours x noise off/on x heuristic, staged_blackbox
    python benchmarks/robustness.py --write          # also write benchmarks/results/robustness.md
    python benchmarks/robustness.py --quick          # 3 scenarios x 2 flavours, noisy, heuristic, 1 seed (~2-3 min on one core)
    python benchmarks/robustness.py --strategies heuristic --flavours stand_in --noise on --seeds 3 --trace
    python benchmarks/robustness.py --strategies heuristic --noise on --first-seed 1 --seeds 1   # seed 1 alone

The tuner's memory model and throughput prior were written from the same notes as the simulator, and
scaling the simulator's components (zenithtune/sim/perturb.py) keeps what grows with what. Here each
study runs against a *flavoured* trainer (zenithtune/sim/flavours.py, `--sim-flavour`) whose laws differ
in structure, written from published descriptions: activation memory that grows faster than the
micro-batch size, fragmentation that depends on recompute and MBS, a fixed overhead outside the
allocator, expert activations that ETP (not TP) divides (`memory`); TP communication not overlapped,
expert parallelism carved out of data parallelism so the all-to-all leaves the node earlier, a pipeline
warm-up that waits for the slowest stage, GEMM efficiency by tile and wave quantization (`speed`); both
(`stand_in`); and the plain simulator. Two scenarios add a flavour of their own: 20 % more memory, a 4x
slower network. With noise on (zenithtune/sim/noise.py) every run's iteration times are multiplied by
exp(N(0, 0.03)) and one run in ten is 1.5x slower.

Every study is compared with the exhaustive optimum of its own trainer (every valid candidate of the
scenario, simulated noise-free with the same flavour). "best" is the configuration the study called
best (the incumbent by measured score), valued at its TRUE, noise-free throughput: with noise a study
that believed an outlier-free lucky run is charged what that configuration really gives.

Per strategy: best / optimum (median and worst); launches until the incumbent was worth 0.99 of the
optimum (median; "never" if the median study did not get there); launches that ran out of memory
(median and worst) and the studies that spent more than max_ooms=2 of them; for studies that stopped
on their own below 0.99, the launches they left unused. Deterministic strategies run once per
scenario x flavour without noise and once per noise seed with it; stochastic ones once per seed
(strategy seed = noise seed).

The scenarios, the in-process launcher and the study loop are benchmarks/search.py's (imported, not
copied). Exhaustive optima and finished studies are cached in benchmarks/results/robustness_optima.json
(keyed by hashes of the simulator's and the tuner's code): a re-run after a tuner change re-runs only
the studies. Work is spread over --jobs processes (default 2).

Run time, measured on a shared 2-core machine at load ~10: the full run (44 sweeps + 308 studies)
took 53 min on 2 processes, the sweeps about 6 of them; after a tuner change only the studies re-run
(heuristic ~1-2 s each, staged_blackbox ~5-15 s on an idle core). To iterate, narrow it: --quick
(6 heuristic studies whose sweeps are cached: well under a minute), or e.g. --seeds 1 --noise on
--flavours stand_in. tpe is not in the default run (it would double the time).
"""
from __future__ import annotations

import argparse
import ast
import functools
import hashlib
import json
import math
import multiprocessing
import os
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from search import (  # noqa: E402,I001
    _LLAMA3_8B, _LLAMA3_70B, _MIXTRAL_8X7B, _QWEN3_30B_A3B, ROOT, Scenario, StudyResult, cand_str, make_job, run_study,
    sim_argv)

from zenithtune.sim import flavours  # noqa: E402
from zenithtune.sim.arguments import SimConfig  # noqa: E402
from zenithtune.sim.trainer import Outcome as SimOutcome  # noqa: E402
from zenithtune.sim.trainer import prepare, run_config  # noqa: E402
from zenithtune.validate import required_env  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "robustness.md"
CACHE = Path(os.environ.get("ZT_ROBUSTNESS_CACHE", ROOT / "benchmarks" / "results" / "robustness_optima.json"))
STRATEGIES = ("heuristic", "staged_blackbox", "upstream", "random", "tpe")
STOCHASTIC = ("staged_blackbox", "random", "tpe")
DEFAULT_STRATEGIES = ("heuristic", "staged_blackbox")
# the benchmark's flavours: name -> --sim-flavour spec (zenithtune/sim/flavours.py)
FLAVOURS = {"plain": "", "memory": "memory", "speed": "speed", "stand_in": "stand_in"}
NOISE_SIGMA, OUTLIER_RATE = 0.03, 0.1
MAX_OOMS = 2  # the heuristic's default max_ooms: a study that spent more broke its promise

_GQA_13B = ("--num-layers=40 --hidden-size=5120 --ffn-hidden-size=13824 --num-attention-heads=40 "
            "--group-query-attention --num-query-groups=8 --vocab-size=32000 --swiglu --disable-bias-linear "
            "--untie-embeddings-and-output-weights --position-embedding-type=rope")
_DENSE_34B = ("--num-layers=48 --hidden-size=8192 --ffn-hidden-size=22016 --num-attention-heads=64 "
              "--group-query-attention --num-query-groups=8 --vocab-size=32000 --swiglu --disable-bias-linear "
              "--untie-embeddings-and-output-weights --position-embedding-type=rope")
_MOE_8E = ("--num-layers=16 --hidden-size=4096 --ffn-hidden-size=14336 --num-attention-heads=32 "
           "--group-query-attention --num-query-groups=8 --num-experts=8 --moe-router-topk=2 "
           "--moe-ffn-hidden-size=8192 --vocab-size=32000 --swiglu --disable-bias-linear "
           "--untie-embeddings-and-output-weights --position-embedding-type=rope")
_MOE_16E = ("--num-layers=24 --hidden-size=4096 --ffn-hidden-size=14336 --num-attention-heads=32 "
            "--group-query-attention --num-query-groups=8 --num-experts=16 --moe-router-topk=2 "
            "--moe-ffn-hidden-size=8192 --vocab-size=32000 --swiglu --disable-bias-linear "
            "--untie-embeddings-and-output-weights --position-embedding-type=rope")
_MOE_64E = ("--num-layers=16 --hidden-size=2048 --ffn-hidden-size=8192 --num-attention-heads=16 "
            "--num-experts=64 --moe-router-topk=8 --moe-ffn-hidden-size=1024 --vocab-size=50304 --swiglu "
            "--disable-bias-linear --untie-embeddings-and-output-weights --position-embedding-type=rope")
_MOE_64E_WIDE = ("--num-layers=28 --hidden-size=2048 --ffn-hidden-size=10944 --num-attention-heads=16 "
                 "--num-experts=64 --moe-router-topk=8 --moe-ffn-hidden-size=1408 --vocab-size=102400 --swiglu "
                 "--disable-bias-linear --untie-embeddings-and-output-weights --position-embedding-type=rope")


@dataclass(frozen=True)
class Case:
    """A scenario with the flavour of its own trainer (added to every benchmark flavour)."""

    scenario: Scenario
    extra: str = ""  # --sim-flavour spec of the scenario itself (more_memory, slow_network)

    @property
    def name(self) -> str:
        return self.scenario.name

    @property
    def title(self) -> str:
        return self.scenario.title

    def spec(self, flavour: str) -> str:
        return ",".join(filter(None, (self.extra, FLAVOURS[flavour])))


CASES = (
    Case(Scenario("dense-8b-8xh100", "Llama-3-8B, s=8k, 8 H100, gbs 64", _LLAMA3_8B, 8, 64, 8192, quick=True)),
    Case(Scenario("gqa-13b-16xa100", "dense GQA-13B (40 L, h 5120, 40 heads / 8 groups), s=4k, 16 A100-80GB, gbs 128",
                  _GQA_13B, 16, 128, 4096, gpu="a100-80g")),
    Case(Scenario("gqa-13b-8xa100-mem120", "the same 13B on 8 A100-80GB, gbs 64, a trainer needing 20 % more memory",
                  _GQA_13B, 8, 64, 4096, gpu="a100-80g"), "more_memory=1.2"),
    Case(Scenario("dense-34b-32xh100-slownet", "dense 34B (48 L, h 8192, GQA 8), s=4k, 32 H100, gbs 128, "
                  "4x slower network", _DENSE_34B, 32, 128, 4096), "slow_network=0.25"),
    Case(Scenario("llama3-70b-64xh100", "Llama-3-70B, s=4k, 64 H100, gbs 128", _LLAMA3_70B, 64, 128, 4096)),
    Case(Scenario("llama3-70b-64xh100-s8k", "Llama-3-70B, s=8k, 64 H100, gbs 128 (plain simulator: TP4 PP4 CP2 VP5 wins)",
                  _LLAMA3_70B, 64, 128, 8192)),
    Case(Scenario("dense-32k-16xh100", "Llama-3-8B shape, s=32k (needs CP), 16 H100, gbs 16", _LLAMA3_8B, 16, 16,
                  32768, quick=True)),
    Case(Scenario("moe-8e-top2-8xh200", "MoE 8 experts top-2 (16 L, h 4096, expert ffn 8192), s=8k, 8 H200, gbs 64",
                  _MOE_8E, 8, 64, 8192, gpu="h200")),
    Case(Scenario("moe-16e-top2-32xh100", "MoE 16 experts top-2 (24 L, h 4096, expert ffn 8192), s=4k, 32 H100, "
                  "gbs 128", _MOE_16E, 32, 128, 4096, quick=True)),
    Case(Scenario("mixtral-8x7b-24xh100", "Mixtral-8x7B (8 experts top-2), s=4k, 24 H100 (3 nodes), gbs 96",
                  _MIXTRAL_8X7B, 24, 96, 4096)),
    Case(Scenario("moe-64e-top8-16xh100", "MoE 64 experts top-8 (16 L, h 2048, expert ffn 1024), s=4k, 16 H100, "
                  "gbs 128", _MOE_64E, 16, 128, 4096)),
    # the overlap switches decide it on the plain simulator (issue 23): TP2 PP2 VP3 EP8 with EP all-to-all overlap
    Case(Scenario("qwen3-30b-a3b-16xh100-a2a", "Qwen3-30B-A3B (128 experts top-8), s=4k, 16 H100, gbs 128, alltoall "
                  "dispatcher (EP overlap searched)", _QWEN3_30B_A3B + " --moe-grouped-gemm --moe-token-dispatcher-type=alltoall",
                  16, 128, 4096)),
    Case(Scenario("moe-64e-top8-64xh100", "MoE 64 experts top-8 (28 L, h 2048, expert ffn 1408), s=4k, 64 H100, "
                  "gbs 256", _MOE_64E_WIDE, 64, 256, 4096)),
)
QUICK_FLAVOURS = ("memory", "stand_in")


def case(name: str) -> Case:
    return next(c for c in CASES if c.name == name)


def trainer(c: Case, flavour: str, noise_seed: int | None) -> Scenario:
    """The scenario whose command runs on the flavoured (and, with a noise seed, noisy) trainer."""
    opts = []
    spec = c.spec(flavour)
    if spec:
        opts.append(f"--sim-flavour={spec}")
    if noise_seed is not None:
        opts += [f"--sim-noise-sigma={NOISE_SIGMA}", f"--sim-outlier-rate={OUTLIER_RATE}",
                 f"--sim-noise-seed={noise_seed}"]
    return replace(c.scenario, sim_options=tuple(opts))


@dataclass
class Optimum:
    value: float  # the flavoured trainer's best noise-free TFLOP/s/GPU over every valid candidate
    candidate: dict


def optima(c: Case, names: list[str]) -> dict[str, Optimum]:
    """Every valid candidate on every flavour's trainer. Parsing dominates, so each candidate is parsed
    once and only the flavour is swapped; the value is the noise-free steady state, as a study's
    incumbent is valued."""
    job = make_job(c.scenario, "grid", None, 1)
    parsed = []
    for cand in job.space.walk():
        cfg = prepare(sim_argv(job, cand), required_env(job.space.layout(cand)))
        if isinstance(cfg, SimConfig):
            parsed.append((cand, cfg))
    out: dict[str, Optimum] = {}
    for name in names:
        flav = flavours.parse(c.spec(name))
        best = Optimum(0.0, {})
        for cand, cfg in parsed:
            _, res = run_config(replace(cfg, flavour=flav), required_env(cfg.layout))
            if isinstance(res, SimOutcome) and res.true_tflops > best.value:
                best = Optimum(res.true_tflops, cand)
        out[name] = best
    return out


def _code(f: Path) -> bytes:
    """What a file does, not how it is explained: Python without comments and docstrings, a YAML config as
    the values it sets and its `# @package` line (an edit to those comments keeps the cache), any other
    file as it is."""
    if f.suffix == ".yaml":
        text = f.read_text()
        package = [line for line in text.splitlines() if line.startswith("# @package")]
        return json.dumps([package, yaml.safe_load(text)], sort_keys=True, default=str).encode()
    if f.suffix != ".py":
        return f.read_bytes()
    tree = ast.parse(f.read_text())
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]
    return ast.dump(tree).encode()


def _hash(files: list[Path]) -> str:
    h = hashlib.sha256()
    for f in sorted(files):
        h.update(str(f.relative_to(ROOT)).encode() + _code(f))
    return h.hexdigest()[:16]


# What an exhaustive optimum depends on outside the simulator: which candidates are valid (the space, the
# rules) and how a command and a model are read (a new Megatron rule removes candidates, maybe the optimum)
SWEEP_DEPENDS = ("space.py", "validate.py", "options.py", "command.py", "modelinfo.py")


@functools.cache
def _sim_hash() -> str:
    return _hash([*(ROOT / "zenithtune" / "sim").glob("*.py"), *(ROOT / "zenithtune" / f for f in SWEEP_DEPENDS)])


@functools.cache  # once per run: an edit while it runs must not re-key (and so drop) what it already saved
def _code_hash() -> str:
    """The tuner's code and configs (the simulator's too): a study is reused only while they are unchanged."""
    return _hash([*(ROOT / "zenithtune").rglob("*.py"), *(ROOT / "zenithtune").rglob("*.yaml"),
                  *(ROOT / "conf").rglob("*.yaml"), ROOT / "benchmarks" / "search.py"])


def _sweep_key(c: Case, flavour: str) -> str:
    return f"{_sim_hash()}/{c.name}/{c.scenario.command()}/{c.spec(flavour)}"


def _study_key(task: tuple) -> str:
    return f"study/{_code_hash()}/{json.dumps([task[1], case(task[1]).scenario.command(), *task[2:]])}"


def load_cache() -> dict[str, dict]:
    try:
        return json.loads(CACHE.read_text())
    except (OSError, ValueError):
        return {}


def save_cache(cache: dict[str, dict]) -> None:
    """Keep only what this code can reuse: entries of other simulator or tuner versions would only grow
    the tracked file."""
    sim, code = _sim_hash(), _code_hash()
    keep = {k: v for k, v in cache.items()
            if (k.startswith("study/") and k.split("/")[1] == code) or k.split("/")[0] == sim}
    CACHE.write_text(json.dumps(keep, separators=(",", ":")))  # compact: the tracked file stays small


def _task(task: tuple) -> tuple:
    kind, name, *rest = task
    c = case(name)
    if kind == "sweep":
        (names,) = rest
        return task, optima(c, list(names))
    flavour, noise_seed, strategy, seed, budget = rest
    return task, run_study(trainer(c, flavour, noise_seed), strategy, seed, budget)


# --- the tables --------------------------------------------------------------------------------------
@dataclass
class Row:
    scenario: str
    flavour: str
    noisy: bool
    seed: int | None
    strategy: str
    result: StudyResult
    budget: int

    @property
    def ooms(self) -> int:
        """Launches that ran out of memory (the trace says each launch's outcome)."""
        return sum(1 for line in self.result.trace if line.split()[1] == "oom")

    @property
    def reach(self) -> float:
        return float(self.result.reached(0.99) or math.inf)

    @property
    def unused(self) -> int | None:
        """Launches left when the study stopped on its own below 0.99 (None: it did not)."""
        r = self.result
        if r.ratio >= 0.99 or r.launched >= self.budget:
            return None
        return self.budget - r.launched


def _med(xs: list[float]) -> float:
    return statistics.median(xs)


def _fmt(x: float) -> str:
    return "never" if math.isinf(x) else f"{x:g}"


def _stats(rows: list[Row]) -> str:
    """The columns every table shares."""
    stopped = [r.unused for r in rows if r.unused is not None]
    return (f"{len(rows)} | {_med([r.result.ratio for r in rows]):.3f} | {min(r.result.ratio for r in rows):.3f} "
            f"| {_fmt(_med([r.reach for r in rows]))} | {_med([r.ooms for r in rows]):g} | {max(r.ooms for r in rows)} "
            f"| {sum(r.ooms > MAX_OOMS for r in rows)} | {len(stopped)}"
            f"{f' ({_med(stopped):g} / {max(stopped)})' if stopped else ''} "
            f"| {_med([r.result.launched for r in rows]):g} |")


_HEAD = ("| studies | best/optimum median | best/optimum worst | launches to 0.99 median | OOM median | OOM worst "
         f"| studies > {MAX_OOMS} OOM | stopped below 0.99 (unused launches median / most) | launches median |")


def per_strategy(rows: list[Row], strategies: list[str]) -> str:
    out = ["| strategy " + _HEAD, "|---" * 10 + "|"]
    for strat in strategies:
        rs = [r for r in rows if r.strategy == strat]
        if rs:
            out.append(f"| {strat} | {_stats(rs)}")
    return "\n".join(out)


def per_flavour(rows: list[Row], strategies: list[str]) -> str:
    out = ["| strategy | flavour | noise " + _HEAD, "|---" * 12 + "|"]
    for strat in strategies:
        for flav in FLAVOURS:
            for noisy in (False, True):
                rs = [r for r in rows if r.strategy == strat and r.flavour == flav and r.noisy == noisy]
                if rs:
                    out.append(f"| {strat} | {flav} | {'on' if noisy else 'off'} | {_stats(rs)}")
    return "\n".join(out)


def per_scenario(rows: list[Row], strategies: list[str]) -> str:
    out = ["| scenario | strategy " + _HEAD + " worst study |", "|---" * 12 + "|"]
    for name in dict.fromkeys(r.scenario for r in rows):
        for strat in strategies:
            rs = [r for r in rows if r.scenario == name and r.strategy == strat]
            if rs:
                w = min(rs, key=lambda r: r.result.ratio)
                out.append(f"| {name} | {strat} | {_stats(rs)} {w.flavour}, noise {'on' if w.noisy else 'off'}"
                           f"{'' if w.seed is None else f', seed {w.seed}'} |")
    return "\n".join(out)


def worst(rows: list[Row], sweeps: dict[tuple[str, str], Optimum], n: int = 8) -> str:
    out = []
    for r in sorted(rows, key=lambda r: (r.result.ratio, -r.ooms))[:n]:
        opt = sweeps[(r.scenario, r.flavour)]
        out.append(f"- {r.strategy} on {r.scenario}, {r.flavour}, noise {'on' if r.noisy else 'off'}"
                   f"{'' if r.seed is None else f' (seed {r.seed})'}: {r.result.ratio:.3f} after "
                   f"{r.result.launched} launches, {r.ooms} OOM; stop: {r.result.stop}. Optimum "
                   f"{opt.value:.1f} at {cand_str(opt.candidate)}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenarios", default=None, help="comma-separated scenario names (default: all)")
    ap.add_argument("--flavours", default=None, help=f"comma-separated, of {','.join(FLAVOURS)} (default: all)")
    ap.add_argument("--noise", choices=("off", "on", "both"), default="both", help="measurement noise (default both)")
    ap.add_argument("--strategies", default=",".join(DEFAULT_STRATEGIES),
                    help=f"comma-separated, of {','.join(STRATEGIES)} (default: %(default)s)")
    ap.add_argument("--seeds", type=int, default=2,
                    help="noise seeds (and strategy seeds of stochastic strategies), 0..N-1 (default 2)")
    ap.add_argument("--first-seed", type=int, default=0,
                    help="start the seeds here: --first-seed 1 --seeds 1 runs seed 1 alone (default 0)")
    ap.add_argument("--n-trials", type=int, default=50, help="launch budget per study")
    ap.add_argument("--quick", action="store_true",
                    help=f"3 scenarios x {', '.join(QUICK_FLAVOURS)}, noise on, heuristic, 1 seed")
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="processes (default 2)")
    ap.add_argument("--write", action="store_true", help=f"write {RESULTS.relative_to(ROOT)}")
    ap.add_argument("--trace", action="store_true", help="print every launch of studies below 0.99 or with more "
                                                         f"than {MAX_OOMS} OOM")
    args = ap.parse_args(argv)

    cases = [c for c in CASES if c.scenario.quick] if args.quick else list(CASES)
    if args.scenarios:
        names = args.scenarios.split(",")
        unknown = set(names) - {c.name for c in CASES}
        if unknown:
            ap.error(f"unknown scenario(s) {sorted(unknown)}; known: {[c.name for c in CASES]}")
        cases = [c for c in CASES if c.name in names]
    flavour_names = list(QUICK_FLAVOURS) if args.quick else list(FLAVOURS)
    if args.flavours:
        flavour_names = args.flavours.split(",")
        unknown = set(flavour_names) - set(FLAVOURS)
        if unknown:
            ap.error(f"unknown flavour(s) {sorted(unknown)}; known: {list(FLAVOURS)}")
    strategies = ["heuristic"] if args.quick and "--strategies" not in (argv or sys.argv) else args.strategies.split(",")
    unknown = set(strategies) - set(STRATEGIES)
    if unknown:
        ap.error(f"unknown strategy(ies) {sorted(unknown)}; known: {list(STRATEGIES)}")
    noise = "on" if args.quick and "--noise" not in (argv or sys.argv) else args.noise
    n_seeds = 1 if args.quick and "--seeds" not in (argv or sys.argv) else args.seeds
    if n_seeds < 1:
        ap.error(f"--seeds {n_seeds}: at least 1")
    if args.first_seed < 0:
        ap.error(f"--first-seed {args.first_seed}: at least 0")
    seeds = list(range(args.first_seed, args.first_seed + n_seeds))

    cache = load_cache()
    sweeps: dict[tuple[str, str], Optimum] = {}
    rows: list[Row] = []
    tasks: list[tuple] = []
    for c in cases:
        missing = []
        for flav in flavour_names:
            got = cache.get(_sweep_key(c, flav))
            if got:
                sweeps[(c.name, flav)] = Optimum(got["value"], got["candidate"])
            else:
                missing.append(flav)
        if missing:
            tasks.append(("sweep", c.name, tuple(missing)))
        for flav in flavour_names:
            for strat in strategies:
                runs: list[tuple[int | None, int | None]] = []  # (noise seed, strategy seed)
                if noise in ("off", "both"):
                    runs += [(None, s) for s in seeds] if strat in STOCHASTIC else [(None, None)]
                if noise in ("on", "both"):
                    runs += [(s, s if strat in STOCHASTIC else None) for s in seeds]
                for noise_seed, seed in runs:
                    task = ("study", c.name, flav, noise_seed, strat, seed, args.n_trials)
                    done = cache.get(_study_key(task))
                    if done:  # the same code already ran this study
                        rows.append(Row(c.name, flav, noise_seed is not None, noise_seed if noise_seed is not None
                                        else seed, strat, StudyResult(**done), args.n_trials))
                    else:
                        tasks.append(task)
    weight = {"sweep": 100, "staged_blackbox": 2, "tpe": 2}
    tasks.sort(key=lambda t: -weight.get(t[0] if t[0] == "sweep" else t[4], 1))

    started = time.time()
    ctx = multiprocessing.get_context("fork") if args.jobs > 1 else None
    pool = ctx.Pool(args.jobs) if ctx else None
    try:
        results = pool.imap_unordered(_task, tasks) if pool else map(_task, tasks)
        for i, (task, out) in enumerate(results, 1):
            cache = load_cache()
            if task[0] == "sweep":
                c = case(task[1])
                for flav, o in out.items():
                    sweeps[(c.name, flav)] = o
                    cache[_sweep_key(c, flav)] = {"value": o.value, "candidate": o.candidate}
                label = "sweep"
            else:
                _, name, flav, noise_seed, strat, seed, budget = task
                rows.append(Row(name, flav, noise_seed is not None, noise_seed if noise_seed is not None else seed,
                                strat, out, budget))
                cache[_study_key(task)] = dict(out.__dict__)
                label = f"{flav} noise={'off' if noise_seed is None else noise_seed} {strat} seed={seed}"
            save_cache(cache)
            print(f"[{i}/{len(tasks)}] {task[1]} {label} ({time.time() - started:.0f} s)", file=sys.stderr, flush=True)
    finally:
        if pool:
            pool.close()
            pool.join()

    order = {c.name: i for i, c in enumerate(cases)}
    rows.sort(key=lambda r: (order[r.scenario], strategies.index(r.strategy), list(FLAVOURS).index(r.flavour),
                             r.noisy, r.seed or 0))
    for r in rows:
        opt = sweeps[(r.scenario, r.flavour)]
        r.result.optimum = opt.value
        print(f"{r.scenario:26s} {r.flavour:8s} noise {'on ' if r.noisy else 'off'} seed={r.seed!s:4s} "
              f"{r.strategy:16s} best/opt {r.result.ratio:.3f}  to 0.99: {r.result.reached(0.99)!s:>5}  "
              f"launched {r.result.launched:3d}  oom {r.ooms}  ({r.result.seconds:.1f} s; {r.result.stop})")
        if args.trace and (r.result.ratio < 0.99 or r.ooms > MAX_OOMS):
            print(f"      optimum {opt.value:.1f} at {cand_str(opt.candidate)}")
            print("\n".join("      " + line for line in r.result.trace))
    elapsed = time.time() - started
    scen = "\n".join(f"- `{c.name}`: {c.title}{f' (`--sim-flavour {c.extra}` on every trainer)' if c.extra else ''}"
                     for c in cases)
    flav = "\n".join(f"- `{name}`: " + (f"`--sim-flavour {spec}`" if spec else "the plain simulator")
                     for name, spec in FLAVOURS.items() if name in flavour_names)
    command = "python benchmarks/robustness.py --write" + (" --quick" if args.quick else "")
    seed_text = f"seeds {seeds[0]}..{seeds[-1]}" if len(seeds) > 1 else f"seed {seeds[0]}"
    text = (f"# Search on trainers with other physics\n\nGenerated by `{command}` ({len(tasks)} tasks run in "
            f"{elapsed:.0f} s on {args.jobs} processes, the rest reused from {CACHE.name}). Every study runs "
            f"against a flavoured trainer (zenithtune/sim/flavours.py) and is compared with that trainer's "
            f"exhaustive noise-free optimum; with noise on, each run's iteration times are x exp(N(0, "
            f"{NOISE_SIGMA})) and {OUTLIER_RATE:.0%} of runs are 1.5x slower (zenithtune/sim/noise.py), and "
            f"the configuration a study called best is valued at its true, noise-free throughput. Launch "
            f"budget {args.n_trials} per study; noise {seed_text} (also the strategy seed of "
            f"stochastic strategies; deterministic ones run once without noise).\n\n{scen}\n\nFlavours:\n\n"
            f"{flav}\n\n## Per strategy (every scenario x flavour x noise)\n\n{per_strategy(rows, strategies)}\n\n"
            f"## Per flavour and noise\n\n{per_flavour(rows, strategies)}\n\n"
            f"## Per scenario (every flavour x noise; the worst study named)\n\n{per_scenario(rows, strategies)}\n\n"
            f"## The worst studies\n\n{worst(rows, sweeps)}\n")
    print()
    print(text)
    if args.write:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(text)
        print(f"wrote {RESULTS.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HYDRA_FULL_ERROR", "1")
    sys.exit(main())
