"""Everything a study needs that is fixed for its whole life, built once from the typed config.

`build_job(conf)` checks the user's input (one clear line per problem), resolves the model shape, the
GPU memory, the search space, the strategy, the evaluator and the memory model. The study loop asks
`Job` for memory predictions and feeds it every outcome so the memory model learns.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, replace

from zenithtune import modelinfo, preflight
from zenithtune.command import facts, trainer_problem
from zenithtune.errors import UserError
from zenithtune.evaluate import Evaluator
from zenithtune.inject import find_option
from zenithtune.memory import DEFAULT_CAPACITY_GB, MemoryModel, gpu_capacity_gb
from zenithtune.record import Outcome
from zenithtune.run import FailureKind, command_problem
from zenithtune.settings import TimeoutPolicy, ZenithtuneConf, build, timeouts, trial_params, wrapped_command
from zenithtune.space import Candidate, Context, Space, Survey, mbs_values, policy_off
from zenithtune.strategies import Strategy

# Memory of the GPUs the built-in simulator can play (`--sim-gpu`), as PyTorch reports it (GiB), so a
# simulated study needs no gpu_memory_gb.
OOM_COUNT_SAMPLE = 4000  # candidates screened to count the predicted OOMs in the space report

SIM_GPU_MEMORY_GB = {"h100": 79.1, "h200": 139.7, "a100-80g": 79.2, "a100-40g": 39.4}


@dataclass
class Setting:
    """The job's fixed facts, checked: what both a study and a screened single trial need."""

    command: list[str]
    ctx: Context
    space: Space
    memory: MemoryModel
    memory_source: str  # where the GPU's capacity came from, for the report

    def predict_gb(self, cand: Candidate) -> float | None:
        return self.memory.predict(**self.space.memory_args(cand))

    def predicted_oom(self, cand: Candidate) -> str | None:
        return self.memory.predicted_oom(**self.space.memory_args(cand))

    def screen(self, cand: Candidate) -> list[tuple[str, str]]:
        """(rule, reason) pairs that keep a candidate from being launched: Megatron's rules, then
        the memory estimate. Empty: launch it."""
        broken = self.space.reasons(cand)
        if broken:
            return broken
        oom = self.predicted_oom(cand)
        return [("predicted_oom", oom)] if oom else []


@dataclass
class Job(Setting):
    """A study's setting plus what searches it: the strategy, the evaluator, the time limits."""

    conf: ZenithtuneConf
    survey: Survey
    strategy: Strategy
    evaluator: Evaluator
    timeouts: TimeoutPolicy
    strategy_name: str = ""  # as the user selects it (strategy=heuristic), not the class behind it
    predicted_oom_count: int = 0
    predicted_oom_estimated: bool = False  # the count comes from a sample of the valid candidates

    def observe(self, o: Outcome) -> None:
        """Learn from a launched trial's memory evidence."""
        if not o.launched:
            return
        args = self.space.memory_args(o.candidate)
        if o.state == "complete":
            self.memory.observe_success(measured_peak_gb=o.measured_gb, reserved_gb=o.reserved_gb, **args)
        elif o.kind == FailureKind.OOM.value:
            self.memory.observe_oom(needed_gb=o.needed_gb, **args)


def gpu_memory(conf: ZenithtuneConf, command: list[str]) -> tuple[float, str]:
    if conf.gpu_memory_gb:
        return float(conf.gpu_memory_gb), "gpu_memory_gb"
    sim_gpu = find_option(command, "--sim-gpu")
    if isinstance(sim_gpu, str) and sim_gpu.lower() in SIM_GPU_MEMORY_GB:
        return SIM_GPU_MEMORY_GB[sim_gpu.lower()], f"--sim-gpu {sim_gpu}"
    gb = gpu_capacity_gb(None)  # nvidia-smi's GPU 0, else the default: say which one it was
    return gb, "nvidia-smi" if gb != DEFAULT_CAPACITY_GB else "the default (no gpu_memory_gb given, nvidia-smi gave none)"


def build_setting(conf: ZenithtuneConf, *, quiet: bool = False) -> Setting:
    if not mbs_values(conf.mbs_max, conf.gbs):
        raise UserError(f"gbs={conf.gbs} is not divisible by any micro-batch size 1..{conf.mbs_max}")
    command = wrapped_command(conf)
    problem = trainer_problem(command) or command_problem(command)
    if problem:
        raise UserError(problem)
    preflight.check_command(command, n_gpus=conf.n_gpus, evaluator_target=str(conf.evaluator.get("_target_", "")))
    if conf.model:
        preflight.check_model(command, conf.model)
    explicit = {k: getattr(conf, k) for k in ("num_layers", "num_query_groups", "seq_length")
                if getattr(conf, k) is not None}
    model = modelinfo.resolve(explicit=explicit, argv=command, model=conf.model)
    if conf.model and model.name == "command":  # the command agrees with model= (checked above): say which
        model = replace(model, name=conf.model)
    from_cmd = modelinfo.from_argv(command)
    for key, value in explicit.items():
        theirs = getattr(from_cmd, key, None)
        if not quiet and theirs is not None and int(theirs) != int(value):
            print(f"zenithtune: warning: {key}={value} is used for pruning but the command says {theirs}; "
                  f"the command's value is what the trainer will run with", file=sys.stderr)
    capacity, source = gpu_memory(conf, command)
    flags = facts(command)
    ctx = Context(n_gpus=conf.n_gpus, gbs=conf.gbs, model=model, mbs_max=conf.mbs_max,
                  gpus_per_node=conf.gpus_per_node, gpu_memory_gb=capacity,
                  distributed_optimizer=flags.distributed_optimizer,
                  vlm_full_uniform_only=bool(conf.preset.get("vlm_full_uniform_only", True)),
                  flags=flags, policy_off=policy_off(conf.prune))
    space = Space.from_preset(conf.preset, ctx)
    # Megatron's default attention (flash / fused) never stores the s x s scores; the unfused and
    # local backends do, which changes the activation estimate.
    flash = find_option(command, "--attention-backend") not in ("unfused", "local")
    memory = MemoryModel(capacity, safety_margin=conf.memory_safety_margin,
                         distributed_optimizer=ctx.distributed_optimizer, flash_attention=flash)
    return Setting(command, ctx, space, memory, source)


def screen_params(conf: ZenithtuneConf) -> str | None:
    """Why this config's params must not be launched (rules, predicted OOM), or None.

    Used by the entry function when a sweeper that cannot screen before launch drives it
    (the stock `hydra/sweeper=optuna` baseline): the trial then fails fast instead of running."""
    st = build_setting(conf, quiet=True)
    broken = st.screen(st.space.normalize(trial_params(conf)))
    return "; ".join(f"{rule}: {why}" for rule, why in broken) or None


def build_job(conf: ZenithtuneConf, strategy_name: str | None = None) -> Job:
    st = build_setting(conf)
    survey = Survey()
    valid = list(st.space.walk(survey))
    if not valid:
        top = "; ".join(f"{rule} removed {n} (e.g. {survey.reasons[rule]})"
                        for rule, n in survey.removed.most_common(3))
        hint = " Choose a gbs that the data-parallel sizes divide." if "gbs" in survey.removed else ""
        raise UserError(f"no valid configuration for n_gpus={conf.n_gpus}, gbs={conf.gbs}: {top}.{hint}")
    strategy = build(conf.strategy)
    job = Job(command=st.command, ctx=st.ctx, space=st.space, memory=st.memory, memory_source=st.memory_source,
              conf=conf, survey=survey, strategy=strategy, evaluator=build(conf.evaluator),
              timeouts=timeouts(conf), strategy_name=strategy_name or type(strategy).__name__)
    # The count is for the space report only: past a few thousand candidates (MoE on thousands of
    # GPUs: tens of thousands) an evenly spaced sample says the same in a fraction of the start-up.
    stride = max(1, len(valid) // OOM_COUNT_SAMPLE)
    sample = valid[::stride]
    job.predicted_oom_count = round(sum(1 for c in sample if job.predicted_oom(c)) * len(valid) / len(sample))
    job.predicted_oom_estimated = stride > 1
    return job

