"""Everything a study needs that is fixed for its whole life, built once from the typed config.

`build_job(conf)` checks the user's input (one clear line per problem), resolves the model shape, the
GPU memory, the search space, the strategy, the evaluator and the memory model. The setting is the
judge of every candidate (`Setting.assess`): the study loop screens with it, the strategy reads it,
and the loop feeds it every outcome (`Setting.observe`) so its memory model learns.
"""
from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from zenithtune import modelinfo, preflight, traits
from zenithtune.assessment import MEMORY_RULE, OOM_DOMINATED_RULE, REFUSED_RULE, Assessment
from zenithtune.command import facts, trainer_problem
from zenithtune.dominance import dominated_by
from zenithtune.errors import UserError
from zenithtune.evaluate import Evaluator
from zenithtune.inject import find_option
from zenithtune.memory import DEFAULT_CAPACITY_GB, NON_TORCH_MAX_GB, MemoryModel, gpu_capacity_gb
from zenithtune.record import Outcome
from zenithtune.run import FailureKind, command_problem
from zenithtune.settings import TimeoutPolicy, ZenithtuneConf, build, timeouts, trial_params, wrapped_command
from zenithtune.space import Context, Space, Survey, mbs_values, policy_off
from zenithtune.strategies import Strategy
from zenithtune.validate import Layout

# Memory of the GPUs the built-in simulator can play (`--sim-gpu`), as PyTorch reports it (GiB), so a
# simulated study needs no gpu_memory_gb.
OOM_COUNT_SAMPLE = 4000  # candidates screened to count the predicted OOMs in the space report

SIM_GPU_MEMORY_GB = {"h100": 79.1, "h200": 139.7, "a100-80g": 79.2, "a100-40g": 39.4}


@dataclass
class Setting:
    """The job's fixed facts, checked, and the judge of every candidate: what both a study and a
    screened single trial need.

    `assess(cand)` is the one answer to "what do we know about this candidate?" (`Assessment`): the
    rules, the memory model's prediction, risk and proofs of fit, the features the trainer refused.
    Answers are memoised per candidate and forgotten whenever `observe` teaches something, so teach
    the memory model through `observe` only."""

    command: list[str]
    ctx: Context
    space: Space
    memory: MemoryModel
    memory_source: str  # where the GPU's capacity came from, for the report
    refused: list[traits.Trait] = field(default_factory=list)  # features the trainer refused
    fit_runs: list[Outcome] = field(default_factory=list)  # launched runs that completed (proofs of fit)
    oom_runs: list[Outcome] = field(default_factory=list)  # launched runs that ran out of memory
    _assessed: dict[tuple, Assessment] = field(default_factory=dict, init=False, repr=False)

    @property
    def capacity_gb(self) -> float:
        return self.memory.capacity_gb

    def assess(self, cand: Mapping[str, Any]) -> Assessment:
        key = self.space.key(cand)
        found = self._assessed.get(key)
        if found is None:
            found = self._assessed[key] = self._assess(cand)
        return found

    def _assess(self, cand: Mapping[str, Any]) -> Assessment:
        lay = self.space.layout(cand)
        mem = self.memory.verdict(lay, self.space.vit_checkpointing(cand))
        reasons = self.space.reasons(cand)  # the job's choices, Megatron's rules, the policies
        # evidence before the estimate: a candidate needing no more memory than a run that fit fits,
        # and one needing at least as much as a run that ran out does not (dominance.py)
        ran = dominated_by(self.space, cand, self.fit_runs)
        fit_proof = None if ran is None else f"needs no more memory than trial {ran.trial_number}, which fit"
        # a bound from a measured run's peaks stands in for structure (past the OOM budget too), and, as
        # evidence, beats the learned model's screen: a run far below its estimate makes its neighbours
        # launchable (issue 19 1b); an OOM it would have proven makes it more pessimistic, then silent
        bound_proof = None if fit_proof is not None else self._bound_proof(lay, cand)
        bad = None if ran is not None else dominated_by(self.space, cand, self.oom_runs, below=False)
        oom_dominated = None if bad is None else (f"needs at least as much memory as trial {bad.trial_number}, "
                                                  f"which ran out of memory (same or narrower split and "
                                                  f"recompute, mbs >= its)")
        if fit_proof is not None or bound_proof is not None:
            mem = replace(mem, oom_risk=0.0, oom=None)
        if not reasons and mem.oom:
            reasons = [(MEMORY_RULE, mem.oom)]
        if not reasons and oom_dominated:  # whatever the estimate says
            reasons = [(OOM_DOMINATED_RULE, oom_dominated)]
        if not reasons and self.refused:
            options = self.space.options(cand)
            reasons = [(REFUSED_RULE, t.describe()) for t in self.refused if t.matches(options)][:1]
        return Assessment(layout=lay, reasons=tuple(reasons), predicted_gb=mem.predicted_gb, sd=mem.sd,
                          oom_risk=mem.oom_risk, proven_fit=mem.proven_fit, predicted_oom=mem.oom,
                          fit_proof=fit_proof, oom_dominated=oom_dominated, bound_proof=bound_proof)

    def _bound_proof(self, lay: Layout, cand: Mapping[str, Any]) -> str | None:
        """Why `cand` surely fits by a bound from a measured run (`MemoryModel.bound`), or None."""
        found, limit = self.memory.bound(lay, self.space.vit_checkpointing(cand)), self.memory.bound_limit(lay)
        if found is None or limit is None or found[0] > limit:
            return None
        held = self.memory.held_gb or 0.0
        within = (f"within the {limit:.0f} GB a run that fit held" if held >= limit else
                  f"within {self.capacity_gb:g} GB less {NON_TORCH_MAX_GB:g} GB at most outside the allocator")
        return (f"reserves at most {found[0]:.0f} GB (trial {found[1]}'s measured peak + the estimate's "
                f"difference, x{self.memory.bound_growth:g}), {within}")

    def observe(self, o: Outcome) -> None:
        """Learn from a launched trial: its memory evidence, and a feature the trainer refused."""
        if not o.launched:
            return
        self._assessed.clear()
        lay, vit = self.space.layout(o.candidate), self.space.vit_checkpointing(o.candidate)
        if o.ok:
            self.fit_runs.append(o)
        elif o.kind == FailureKind.OOM.value:
            self.oom_runs.append(o)
        if o.state == "complete":
            self.memory.observe_success(lay, o.measured_gb, reserved_gb=o.reserved_gb, vit_checkpointing=vit,
                                        tag=o.trial_number)
        elif o.kind == FailureKind.OOM.value:
            self.memory.observe_oom(lay, needed_gb=o.needed_gb, outside_gb=o.outside_gb, vit_checkpointing=vit)
        trait = self.refusal(o)
        if trait is not None:
            self.refused.append(trait)

    def refusal(self, o: Outcome) -> traits.Trait | None:
        """The injected features a failed launch's message says the trainer refused."""
        if not o.launched or o.state != "failed" or o.kind not in (FailureKind.CRASH.value,
                                                                 FailureKind.INVALID_ARGS.value):
            return None
        return traits.refused(" ".join(o.reasons), self.space.options(o.candidate), o.trial_number)


@dataclass
class Job(Setting):
    """A study's setting plus what searches it: the strategy, the evaluator, the time limits."""

    strategy: Strategy = field(kw_only=True)
    evaluator: Evaluator = field(kw_only=True)
    timeouts: TimeoutPolicy = field(kw_only=True)
    max_ooms: int = field(kw_only=True, default=2)  # OOM launches the study may spend (the loop holds every strategy to it)


@dataclass(frozen=True)
class SpaceReport:
    """What the start of a study says about its space (`Progress.header`)."""

    survey: Survey  # how the rules shrank the space
    predicted_oom: int  # valid candidates the memory model screens before any launch
    estimated: bool  # ... counted on an evenly spaced sample of them


def gpu_memory(conf: ZenithtuneConf, command: list[str]) -> tuple[float, str]:
    if conf.gpu_memory_gb:
        return float(conf.gpu_memory_gb), "gpu_memory_gb"
    sim_gpu = find_option(command, "--sim-gpu")
    if isinstance(sim_gpu, str) and sim_gpu.lower() in SIM_GPU_MEMORY_GB:
        return SIM_GPU_MEMORY_GB[sim_gpu.lower()], f"--sim-gpu {sim_gpu}"
    gb = gpu_capacity_gb(None)  # nvidia-smi's GPU 0, else the default: say which one it was
    return gb, "nvidia-smi" if gb != DEFAULT_CAPACITY_GB else "the default (no gpu_memory_gb given, nvidia-smi gave none)"


def build_setting(conf: ZenithtuneConf, *, quiet: bool = False) -> Setting:
    """A study's (or a single run's) setting: the user's input checked first, one clear line per
    problem, then `screen_setting`."""
    if not mbs_values(conf.mbs_max, conf.gbs):
        raise UserError(f"gbs={conf.gbs} is not divisible by any micro-batch size 1..{conf.mbs_max}")
    command = wrapped_command(conf)
    problem = trainer_problem(command) or command_problem(command)
    if problem:
        raise UserError(problem)
    preflight.check_command(command, n_gpus=conf.n_gpus, evaluator_target=str(conf.evaluator.get("_target_", "")))
    if conf.model:
        preflight.check_model(command, conf.model)
    if not quiet:
        from_cmd = modelinfo.from_argv(command)
        for key, value in _explicit_shape(conf).items():
            theirs = getattr(from_cmd, key, None)
            if theirs is not None and int(theirs) != int(value):
                print(f"zenithtune: warning: {key}={value} is used for pruning but the command says {theirs}; "
                      f"the command's value is what the trainer will run with", file=sys.stderr)
    return screen_setting(conf, command)


def _explicit_shape(conf: ZenithtuneConf) -> dict[str, int]:
    return {k: getattr(conf, k) for k in ("num_layers", "num_query_groups", "seq_length") if getattr(conf, k) is not None}


def screen_setting(conf: ZenithtuneConf, command: list[str] | None = None) -> Setting:
    """The small screen: the model's shape, the space and the bound memory model, nothing else (no
    check of the command, no warning, no walk of the space). What a trial screened inside the entry
    function needs (`screen_params`), and the end of `build_setting`."""
    command = wrapped_command(conf) if command is None else command
    model = modelinfo.resolve(explicit=_explicit_shape(conf), argv=command, model=conf.model)
    if conf.model and model.name == "command":  # the command agrees with model= (preflight checks it): say which
        model = replace(model, name=conf.model)
    capacity, source = gpu_memory(conf, command)
    flags = facts(command)
    ctx = Context(n_gpus=conf.n_gpus, gbs=conf.gbs, model=model, mbs_max=conf.mbs_max,
                  gpus_per_node=conf.gpus_per_node, vlm_full_uniform_only=bool(conf.preset.get("vlm_full_uniform_only", True)),
                  flags=flags, policy_off=policy_off(conf.prune))
    space = Space.from_preset(conf.preset, ctx)
    # Megatron's default attention (flash / fused) never stores the s x s scores; the unfused and
    # local backends do, which changes the activation estimate.
    flash = find_option(command, "--attention-backend") not in ("unfused", "local")
    memory = MemoryModel(model, capacity, distributed_optimizer=flags.distributed_optimizer,
                         flash_attention=flash, margin=conf.memory_safety_margin)
    return Setting(command, ctx, space, memory, source)


def screen_params(conf: ZenithtuneConf) -> str | None:
    """Why this config's params must not be launched (rules, predicted OOM), or None.

    Used by the entry function when a sweeper that cannot screen before launch drives it (the stock
    `hydra/sweeper=optuna` baseline): the trial then fails fast instead of running. Only the small
    screen is built: the command itself is the run's business."""
    st = screen_setting(conf)
    broken = st.assess(st.space.normalize(trial_params(conf))).reasons
    return "; ".join(f"{rule}: {why}" for rule, why in broken) or None


def build_job(conf: ZenithtuneConf) -> Job:
    st = build_setting(conf)
    survey = Survey()
    if not any(True for _ in st.space.walk(survey)):
        top = "; ".join(f"{rule} removed {n} (e.g. {survey.reasons[rule]})"
                        for rule, n in survey.removed.most_common(3))
        hint = " Choose a gbs that the data-parallel sizes divide." if "gbs" in survey.removed else ""
        raise UserError(f"no valid configuration for n_gpus={conf.n_gpus}, gbs={conf.gbs}: {top}.{hint}")
    return Job(command=st.command, ctx=st.ctx, space=st.space, memory=st.memory, memory_source=st.memory_source,
               strategy=build(conf.strategy), evaluator=build(conf.evaluator), timeouts=timeouts(conf),
               max_ooms=conf.max_ooms)


def memory_limits(job: Job) -> str:
    """What a study says up front about launches that may run out of memory: the OOM budget, and how many
    of those launches its strategy may make past the memory screen on purpose."""
    probes = min(job.strategy.past_screen, job.max_ooms)
    past = (f", {probes} of them past the memory screen (memory probes)" if probes else
            ", none past the memory screen")
    return (f"memory: at most {job.max_ooms} launch{'' if job.max_ooms == 1 else 'es'} may run out of memory "
            f"(max_ooms){past}; after that only what a run that fit proves fits")


def space_report(setting: Setting) -> SpaceReport:
    """The space report of a study about to start (the space's walk is replayed, not redone)."""
    survey = Survey()
    valid = list(setting.space.walk(survey))
    # Past a few thousand candidates (MoE on thousands of GPUs: tens of thousands) an evenly spaced
    # sample says the same in a fraction of the start-up.
    stride = max(1, len(valid) // OOM_COUNT_SAMPLE)
    sample = valid[::stride]
    count = round(sum(1 for c in sample if setting.assess(c).predicted_oom) * len(valid) / len(sample)) if valid else 0
    return SpaceReport(survey=survey, predicted_oom=count, estimated=stride > 1)

