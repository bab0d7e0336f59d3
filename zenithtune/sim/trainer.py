"""One simulated training run: parse, validate, check memory, then log iterations like Megatron.

`simulate(argv, env)` returns a `SimResult` holding what the process would print (as timed events,
so the CLI can replay them with `--sim-time-scale`), its exit code, and the numbers behind it.
The ms-swift flavour (zenithtune.sim.swift) reuses `run_config` with its own log format.
"""
from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from datetime import datetime, timedelta
from typing import Literal

from zenithtune.sim import physics, timing
from zenithtune.sim.arguments import ArgumentError, ConfigError, SimConfig, parse_megatron
from zenithtune.sim.noise import RUN_ENV
from zenithtune.validate import env_errors, megatron_errors

Kind = Literal["ok", "oom", "invalid"]
Stream = Literal["stdout", "stderr"]

MIB = 1024 ** 2
EPOCH = datetime(2025, 1, 1, 8, 0, 0)  # fake wall clock of every run: logs are deterministic
PARSE_SECONDS = 3.0  # importing torch + megatron before argparse runs
WARMUP = (2.6, 1.08)  # iteration 1 and 2 run slower than steady state (autotuning, NCCL setup, allocator)
JITTER = 0.004  # deterministic per-iteration wobble, so "last" and "mean" differ like on a cluster


@dataclass(frozen=True)
class Event:
    at: float  # simulated seconds since the process started
    stream: Stream
    text: str  # one line, no newline


@dataclass
class SimResult:
    """What one simulated run did. Memory in GiB (as PyTorch reports it), times in seconds."""

    exit_code: int
    kind: Kind
    events: list[Event] = field(default_factory=list)
    wall_seconds: float = 0.0  # simulated wall time of the whole run, startup included
    tflops: float | None = None  # steady-state model TFLOP/s per GPU (no recompute, as Megatron prints)
    true_tflops: float | None = None  # the same without --sim-noise-sigma's measurement noise
    iter_seconds: float | None = None  # steady-state seconds per iteration (noise included)
    iteration_seconds: list[float] = field(default_factory=list)  # every iteration, warm-up included
    peak_memory_gb: float | None = None  # GiB in use on the fullest GPU at its peak (needed, if OOM)
    capacity_gb: float | None = None  # GiB the GPU has (torch's "total capacity")
    max_allocated_mb: float | None = None  # Megatron's "max allocated" of the fullest GPU
    errors: list[str] = field(default_factory=list)  # every broken Megatron rule (invalid runs)
    config: SimConfig | None = None

    @property
    def stdout(self) -> str:
        return "".join(e.text + "\n" for e in self.events if e.stream == "stdout")

    @property
    def stderr(self) -> str:
        return "".join(e.text + "\n" for e in self.events if e.stream == "stderr")


def _seed(cfg: SimConfig, salt: int) -> int:
    """Seed from the parsed run (not its spelling): `--k v`, `--k=v`, ignored options and the ms-swift
    aliases give the same numbers. The measurement noise (sim/noise.py) is left out, so a noisy
    trainer's noise-free value is the quiet trainer's, and so is a plain flavour: the numbers of a
    plain run stay those it gave before flavours existed."""
    parts = (f"{f.name}={getattr(cfg, f.name)!r}" for f in fields(cfg)
             if f.name != "noise" and not (f.name == "flavour" and not cfg.flavour.active))
    digest = hashlib.blake2b(f"SimConfig({', '.join(parts)})".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") ^ salt


def _traceback(where: str) -> list[str]:
    return ["Traceback (most recent call last):",
            '  File "pretrain_gpt.py", line 301, in <module>',
            "    pretrain(",
            f'  File "megatron/training/{where}", in {"validate_args" if "arguments" in where else "train_step"}']


def _invalid(message: str, exc_type: str, at: float, config: SimConfig | None = None,
             errors: list[str] | None = None) -> SimResult:
    lines = _traceback("arguments.py") + [f"{exc_type}: {message}"]
    events = [Event(at, "stderr", line) for line in lines]
    return SimResult(exit_code=1, kind="invalid", events=events, wall_seconds=at,
                     errors=errors or [message], config=config)


def prepare(argv: list[str], env: dict[str, str] | None,
            parse: Callable[[list[str], dict[str, str]], SimConfig] = parse_megatron) -> SimConfig | SimResult:
    """The parsed config, or the SimResult of a run that stops before training (exit 2 or 1)."""
    env = {} if env is None else env
    try:
        return parse(argv, env)
    except ArgumentError as err:
        events = [Event(0.5, "stdout", line) for line in err.stdout.splitlines()]
        events += [Event(0.5, "stderr", line) for line in err.message.splitlines()]
        return SimResult(exit_code=err.status, kind="invalid" if err.status else "ok", events=events,
                         wall_seconds=0.5, errors=[err.message.strip()] if err.status else [])
    except ConfigError as err:
        return _invalid(err.message, err.exc_type, PARSE_SECONDS)


def banner(cfg: SimConfig) -> list[str]:
    lay = cfg.layout
    x = physics.shape_of(cfg)
    lines = [f"using world size: {lay.n_gpus}, data-parallel size: {lay.dp}, context-parallel size: {lay.cp}, "
             f"tensor-model-parallel size: {lay.tp}, pipeline-model-parallel size: {lay.pp}",
             f"[zenithtune.sim] {lay.n_gpus} x {cfg.gpu.label} ({cfg.gpus_per_node} per node), "
             f"expert-model-parallel size: {lay.ep}, expert-tensor-parallel size: {lay.expert_tp}, "
             f"micro-batches per iteration: {x.m}"]
    lines += list(cfg.notes)
    if cfg.perturb.active:
        lines.append(f"[zenithtune.sim] perturbed trainer: {cfg.perturb.describe()}")
    if cfg.flavour.active:
        lines.append(f"[zenithtune.sim] flavoured trainer: {cfg.flavour.describe()}")
    if cfg.noise.active:
        lines.append(f"[zenithtune.sim] measurement noise: {cfg.noise.describe()}")
    for stage in sorted({0, x.p - 1}):
        prm = physics.stage_params(cfg, stage)
        lines.append(f" > number of parameters on (tensor, pipeline) model parallel rank (0, {stage}): "
                     f"{int(prm.dense + prm.expert)}")
    return lines


def _oom_lines(cfg: SimConfig, mem: physics.MemoryReport, static_only: bool) -> list[str]:
    gib = physics.GIB
    st = mem.worst
    cap = mem.capacity
    tried = (st.grads if static_only else st.largest_alloc) / gib
    free = min(0.45 * tried, 0.5)  # the failing allocation is the first that does not fit
    in_use = cap / gib - free
    allocated = max(in_use - mem.non_torch / gib - 0.3, 0.1)
    gpu = stage_rank(cfg, st.stage) % cfg.gpus_per_node
    where = "megatron/core/distributed/param_and_grad_buffer.py" if static_only else st.largest_site
    message = (f"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate {tried:.2f} GiB. GPU {gpu} has a "
               f"total capacity of {cap / gib:.2f} GiB of which {free:.2f} GiB is free. Including non-PyTorch "
               f"memory, this process has {in_use:.2f} GiB memory in use. Of the allocated memory "
               f"{allocated:.2f} GiB is allocated by PyTorch, and 0.30 GiB is reserved by PyTorch but "
               f"unallocated. If reserved but unallocated memory is large try setting "
               f"PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation "
               f"for Memory Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)")
    return _traceback("training.py") + [f'  File "{where}"', "    ...", message]


def stage_rank(cfg: SimConfig, stage: int) -> int:
    """Global rank of TP/DP rank 0 of a pipeline stage (Megatron orders ranks tp-cp-dp-pp)."""
    return stage * (cfg.layout.n_gpus // cfg.layout.pp)


def startup_seconds(cfg: SimConfig) -> float:
    """Process start to the first iteration: imports, NCCL init, model build, data."""
    nodes = math.ceil(cfg.layout.n_gpus / cfg.gpus_per_node)
    params = physics.stage_params(cfg, 0)
    return 18.0 + 1.5 * math.sqrt(nodes) + 0.6 * (params.dense + params.expert) / 1e9


@dataclass(frozen=True)
class Outcome:
    """A run that got past validation: its memory and timing, before formatting."""

    memory: physics.MemoryReport
    flops: float  # model FLOPs per iteration
    iteration: timing.IterationTime
    iterations: list[float]  # seconds of each iteration, warm-up and noise included
    startup: float
    clean_iterations: list[float] = field(default_factory=list)  # the same without --sim-noise-sigma's noise
    n_gpus: int = 1  # the world size

    @property
    def true_tflops(self) -> float:
        """Steady-state TFLOP/s/GPU without measurement noise: what the configuration is really worth."""
        its = self.clean_iterations or self.iterations
        steady = its[len(WARMUP):] or its[-1:]
        return self.flops / (sum(steady) / len(steady) * 1e12 * self.n_gpus)


def run_config(cfg: SimConfig, env: dict[str, str] | None) -> tuple[list[str], Outcome | SimResult]:
    """Validate and simulate `cfg`: (warning lines, Outcome) or (warning lines, finished SimResult)."""
    env = {} if env is None else env
    warnings = [f"WARNING: {w}" for w in cfg.warnings]
    warnings += [f"WARNING: {w}" for w in env_errors(cfg.layout, env, cfg.gpu.name)]
    errors = megatron_errors(cfg.layout, cfg.model)
    if errors:
        res = _invalid(errors[0], "AssertionError", PARSE_SECONDS, cfg, errors)
        res.events[:0] = [Event(PARSE_SECONDS, "stderr", w) for w in warnings]
        return warnings, res
    mem = physics.memory(cfg)
    startup = startup_seconds(cfg)
    if mem.oom:
        static_only = mem.worst.static + mem.non_torch > mem.capacity
        at = startup * (0.8 if static_only else 1.0)
        it = timing.iteration_time(cfg)
        wall = at + (0.0 if static_only else 0.4 * it.total * WARMUP[0])
        res = SimResult(exit_code=1, kind="oom", wall_seconds=wall, config=cfg,
                        peak_memory_gb=mem.in_use_peak / physics.GIB, capacity_gb=mem.capacity / physics.GIB,
                        max_allocated_mb=mem.worst.peak_allocated / MIB)
        res.events = [Event(PARSE_SECONDS, "stderr", w) for w in warnings]
        res.events += [Event(PARSE_SECONDS, "stdout", line) for line in banner(cfg)]
        res.events += [Event(wall, "stderr", line) for line in _oom_lines(cfg, mem, static_only)]
        return warnings, res
    it = timing.iteration_time(cfg)
    rng = random.Random(_seed(cfg, cfg.seed))
    run_factor = 1.0 + (rng.gauss(0.0, cfg.noise_pct / 100.0) if cfg.noise_pct else 0.0)
    run_factor = max(run_factor, 0.5)
    jitter = random.Random(_seed(cfg, 0x5EED))
    clean = []
    for i in range(cfg.train_iters):
        warm = WARMUP[i] if i < len(WARMUP) else 1.0
        wobble = 1.0 + jitter.uniform(-JITTER, JITTER)
        if cfg.noise_pct:
            wobble += rng.gauss(0.0, cfg.noise_pct / 300.0)
        extra = 2.5 if i == 0 else 0.0  # first-iteration setup (NCCL communicators, cuDNN autotuning)
        clean.append(it.total * run_factor * warm * max(wobble, 0.5) + extra)
    # measurement noise (sim/noise.py): one draw per run, told apart by the tuner's trial marker
    drawn = cfg.noise.draw(str(_seed(cfg, 0)), env.get(RUN_ENV, ""), cfg.train_iters)
    times = [t * drawn.factor * f for t, f in zip(clean, drawn.per_iteration, strict=True)]
    return warnings, Outcome(mem, physics.model_flops(cfg), it, times, startup, clean, cfg.layout.n_gpus)


def megatron_lines(cfg: SimConfig, out: Outcome, at0: float) -> list[Event]:
    """Megatron's training_log lines (one per --log-interval) and the memory report."""
    lay = cfg.layout
    n = lay.n_gpus
    events: list[Event] = []
    now = at0
    x = physics.shape_of(cfg)
    loss0 = math.log(x.V)
    interval_start = 0
    for i, sec in enumerate(out.iterations, start=1):
        now += sec
        if i % cfg.log_interval and i != cfg.train_iters:
            continue
        window = out.iterations[interval_start:i]
        interval_start = i
        elapsed = sum(window) / len(window)
        stamp = (EPOCH + timedelta(seconds=now)).strftime("%Y-%m-%d %H:%M:%S")
        loss = loss0 - 0.9 * math.log1p(i / 3.0) + 0.02 * math.sin(i * 1.7)
        line = (f" [{stamp}] iteration {i:8d}/{cfg.train_iters:8d} | consumed samples: {i * lay.gbs:12d} | "
                f"elapsed time per iteration (ms): {elapsed * 1000.0:.1f} |")
        if cfg.log_throughput:
            line += f" throughput per GPU (TFLOP/s/GPU): {out.flops / (elapsed * 1e12 * n):.1f} |"
        line += (f" learning rate: {1.5e-4 * min(1.0, i / 100):.6E} | global batch size: {lay.gbs:5d} |"
                 f" lm loss: {loss:.6E} | loss scale: 1.0 | grad norm: {2.5 / math.sqrt(i):.3f} |"
                 f" number of skipped iterations:   0 | number of nan iterations:   0 |")
        events.append(Event(now, "stdout", line))
        if len(events) == 1:
            events.extend(Event(now, "stdout", text) for text in memory_lines(cfg, out.memory, i))
    return events


def memory_lines(cfg: SimConfig, mem: physics.MemoryReport, iteration: int) -> list[str]:
    lines = []
    frag = physics.fragmentation(cfg)
    for st in mem.stages:
        reserved = (st.peak_allocated * frag + 0.25 * physics.GIB) / MIB
        lines.append(f"[Rank {stage_rank(cfg, st.stage)}] (after {iteration} iterations) memory (MB) | "
                     f"allocated: {st.static / MIB:.2f} | max allocated: {st.peak_allocated / MIB:.2f} | "
                     f"reserved: {reserved:.2f} | max reserved: {reserved:.2f}")
    return lines


def finish(cfg: SimConfig, out: Outcome, warnings: list[str], body: list[Event], end: float) -> SimResult:
    steady = out.iterations[len(WARMUP):] or out.iterations[-1:]
    iter_s = sum(steady) / len(steady)
    mem = out.memory
    res = SimResult(exit_code=0, kind="ok", wall_seconds=end, config=cfg, iteration_seconds=list(out.iterations),
                    iter_seconds=iter_s, tflops=out.flops / (iter_s * 1e12 * cfg.layout.n_gpus),
                    true_tflops=out.true_tflops,
                    peak_memory_gb=mem.in_use_peak / physics.GIB, capacity_gb=mem.capacity / physics.GIB,
                    max_allocated_mb=mem.worst.peak_allocated / MIB)
    res.events = [Event(PARSE_SECONDS, "stderr", w) for w in warnings]
    res.events += [Event(PARSE_SECONDS, "stdout", line) for line in banner(cfg)]
    res.events += [Event(out.startup, "stdout", "[after dataloaders are built] datetime: "
                         + (EPOCH + timedelta(seconds=out.startup)).strftime("%Y-%m-%d %H:%M:%S")),
                   Event(out.startup, "stdout", "training ...")]
    res.events += body
    res.events.append(Event(end, "stdout", f"[zenithtune.sim] simulated wall time of the run: {end:.1f} s"))
    return res


def simulate(argv: list[str], env: dict[str, str] | None = None) -> SimResult:
    """Run `pretrain_gpt.py argv` on the simulated cluster, in-process (no sleeping, no printing)."""
    argv = [str(a) for a in argv]
    cfg = prepare(argv, env)
    if isinstance(cfg, SimResult):
        return cfg
    warnings, out = run_config(cfg, env)
    if isinstance(out, SimResult):
        return out
    body = megatron_lines(cfg, out, out.startup)
    end = out.startup + sum(out.iterations) + 2.0
    body.append(Event(end - 1.0, "stdout", "[after training is done] datetime: "
                      + (EPOCH + timedelta(seconds=end)).strftime("%Y-%m-%d %H:%M:%S")))
    return finish(cfg, out, warnings, body, end)
