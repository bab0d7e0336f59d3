"""Everything a study needs that is fixed for its whole life, built once from the config.

`build_job(cfg)` checks the user's input (one clear line per problem), resolves the model shape,
the GPU memory, the search space, the strategy, the evaluator and the memory model. The sweeper asks
`Job` for memory predictions, pruning and per-trial timeouts, and feeds it every outcome.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, OmegaConf

from zenithtune.app import UserError, build, wrapped_command
from zenithtune.command import facts, trainer_problem
from zenithtune.inject import find_option
from zenithtune.space import Context, Space, Survey, mbs_values, policy_off
from zenithtune.strategies import Outcome, Strategy

# Memory of the GPUs the built-in simulator can play (`--sim-gpu`), as PyTorch reports it (GiB), so a
# simulated study needs no gpu_memory_gb.
SIM_GPU_MEMORY_GB = {"h100": 79.1, "h200": 139.7, "a100-80g": 79.2, "a100-40g": 39.4}


@dataclass
class Job:
    cfg: DictConfig
    command: list[str]
    ctx: Context
    space: Space
    survey: Survey
    strategy: Strategy
    evaluator: Any
    memory: Any  # zenithtune.memory.MemoryModel
    memory_source: str
    predicted_oom_count: int = 0
    durations: list[float] = field(default_factory=list)  # successful trials' wall times

    # --- memory ------------------------------------------------------------------------------------
    def _mem_kw(self, cand: dict) -> dict:
        return {"distributed_optimizer": self.ctx.distributed_optimizer,
                "vit_checkpointing": self.space.vit_checkpointing(cand)}

    def predict_gb(self, cand: dict) -> float | None:
        if self.memory is None:
            return None
        return self.memory.predict(self.space.layout(cand), self.ctx.model, **self._mem_kw(cand))

    def predicted_oom(self, cand: dict) -> str | None:
        if self.memory is None:
            return None
        return self.memory.predicted_oom(self.space.layout(cand), self.ctx.model, **self._mem_kw(cand))

    def observe(self, o: Outcome) -> None:
        """Learn from a launched trial: memory evidence and (for dynamic timeouts) its duration."""
        if not o.launched:
            return
        lay = self.space.layout(o.candidate)
        kw = self._mem_kw(o.candidate)
        if self.memory is not None:
            if o.state == "complete":
                self.memory.observe_success(lay, self.ctx.model, o.measured_gb, **kw)
            elif o.kind == "oom":
                self.memory.observe_oom(lay, self.ctx.model, **kw)
        if o.state == "complete" and o.duration:
            self.durations.append(float(o.duration))

    # --- timeouts ----------------------------------------------------------------------------------
    def trial_timeout(self) -> float | None:
        """Fixed `timeout`, or with `timeout_dynamic`: factor x the fastest successful trial's wall
        time, at least the floor, never above the fixed timeout. No limit before a first success."""
        fixed = self.cfg.get("timeout")
        fixed = float(fixed) if fixed else None
        if not self.cfg.get("timeout_dynamic") or not self.durations:
            return fixed
        dyn = max(float(self.cfg.get("timeout_dynamic_floor", 60.0)),
                  float(self.cfg.get("timeout_dynamic_factor", 3.0)) * min(self.durations))
        return min(dyn, fixed) if fixed else dyn

    @property
    def strategy_name(self) -> str:
        """The name the user selects (strategy=heuristic), not the class behind it."""
        return (OmegaConf.select(self.cfg, "hydra.runtime.choices.strategy", default=None)
                or type(self.strategy).__name__)

    # --- results -----------------------------------------------------------------------------------
    def tuned_yaml(self, best: Any, study: str, name: str | None) -> str:
        from zenithtune.inject import inject
        from zenithtune.study import tuned_yaml

        cand = best.user_attrs.get("candidate") or dict(best.params)
        # The command as the user wrote it, with the tuned options taken out (they live in params).
        plain = inject(self.command, {o: None for o in self.space.options(cand)})
        strategy = self.strategy_name
        model = self.cfg.get("model") or (self.ctx.model.name if self.ctx.model.name != "command" else None)
        return tuned_yaml(params=cand, n_gpus=self.ctx.n_gpus, gbs=self.ctx.gbs, score=best.value,
                          metric=self.evaluator.metric_name, trial=best.number, study=study,
                          strategy=strategy, model=model,
                          command=plain, name=name)


def _positive_int(cfg: DictConfig, key: str, example: str) -> int:
    if OmegaConf.is_missing(cfg, key):
        raise UserError(f"{key} is required: add {key}=N to the command line (e.g. {example})")
    value = cfg.get(key)
    try:
        n = int(value)
        if n != float(value) or n <= 0:
            raise ValueError
    except (TypeError, ValueError):
        raise UserError(f"{key}={value!r} must be a positive whole number (e.g. {example})") from None
    return n


def gpu_memory(cfg: DictConfig, command: list[str]) -> tuple[float, str]:
    from zenithtune.memory import gpu_capacity_gb

    if cfg.get("gpu_memory_gb"):
        return float(cfg.gpu_memory_gb), "gpu_memory_gb"
    sim_gpu = find_option(command, "--sim-gpu")
    if isinstance(sim_gpu, str) and sim_gpu.lower() in SIM_GPU_MEMORY_GB:
        return SIM_GPU_MEMORY_GB[sim_gpu.lower()], f"--sim-gpu {sim_gpu}"
    return gpu_capacity_gb(None), "nvidia-smi or the 80 GB default"


@dataclass
class Setting:
    """The job's fixed facts, checked: what both a study and a screened single trial need."""

    command: list[str]
    ctx: Context
    space: Space
    memory: Any  # zenithtune.memory.MemoryModel
    memory_source: str


def build_setting(cfg: DictConfig, *, quiet: bool = False) -> Setting:
    from zenithtune import modelinfo
    from zenithtune.memory import MemoryModel
    from zenithtune.run import command_problem

    n_gpus = _positive_int(cfg, "n_gpus", "n_gpus=8 gbs=64")
    gbs = _positive_int(cfg, "gbs", "n_gpus=8 gbs=64")
    mbs_max = _positive_int(cfg, "mbs_max", "mbs_max=8")
    _positive_int(cfg, "n_trials", "n_trials=50")
    if not mbs_values(mbs_max, gbs):
        raise UserError(f"gbs={gbs} is not divisible by any micro-batch size 1..{mbs_max}")
    command = wrapped_command(cfg)
    problem = trainer_problem(command) or command_problem(command)
    if problem:
        raise UserError(problem)
    explicit = {k: cfg.get(k) for k in ("num_layers", "num_query_groups", "seq_length") if cfg.get(k) is not None}
    model = modelinfo.resolve(explicit=explicit, argv=command, model=cfg.get("model"))
    from_cmd = modelinfo.from_argv(command)
    for key, value in explicit.items():
        theirs = getattr(from_cmd, key, None)
        if not quiet and theirs is not None and int(theirs) != int(value):
            print(f"zenithtune: warning: {key}={value} is used for pruning but the command says {theirs}; "
                  f"the command's value is what the trainer will run with", file=sys.stderr)
    capacity, source = gpu_memory(cfg, command)
    preset = OmegaConf.to_container(cfg.preset, resolve=True)
    flags = facts(command)
    ctx = Context(n_gpus=n_gpus, gbs=gbs, model=model, mbs_max=mbs_max,
                  gpus_per_node=int(cfg.get("gpus_per_node") or 8), gpu_memory_gb=capacity,
                  distributed_optimizer=flags.distributed_optimizer,
                  vlm_full_uniform_only=bool(preset.get("vlm_full_uniform_only", True)),
                  flags=flags, policy_off=policy_off(cfg.get("prune")))
    space = Space.from_preset(preset, ctx)
    # Megatron's default attention (flash / fused) never stores the s x s scores; the unfused and
    # local backends do, which changes the activation estimate.
    flash = find_option(command, "--attention-backend") not in ("unfused", "local")
    memory = MemoryModel(capacity, safety_margin=float(cfg.get("memory_safety_margin", 0.02)),
                         distributed_optimizer=ctx.distributed_optimizer, flash_attention=flash)
    return Setting(command, ctx, space, memory, source)


def screen_params(cfg: DictConfig) -> str | None:
    """Why this config's params must not be launched (rules, predicted OOM), or None.

    Used by the entry function when a sweeper that cannot screen before launch drives it
    (the stock `hydra/sweeper=optuna` baseline): the trial then fails fast instead of running."""
    st = build_setting(cfg, quiet=True)
    cand = {str(k): v for k, v in OmegaConf.to_container(cfg.params, resolve=True).items() if v is not None}
    cand = st.space.normalize(cand)
    broken = st.space.reasons(cand)
    if broken:
        return "; ".join(f"{rule}: {why}" for rule, why in broken)
    return st.memory.predicted_oom(st.space.layout(cand), st.ctx.model,
                                   distributed_optimizer=st.ctx.distributed_optimizer,
                                   vit_checkpointing=st.space.vit_checkpointing(cand))


def build_job(cfg: DictConfig) -> Job:
    st = build_setting(cfg)
    command, ctx, space, memory, source = st.command, st.ctx, st.space, st.memory, st.memory_source
    n_gpus, gbs = ctx.n_gpus, ctx.gbs
    survey = Survey()
    valid = list(space.walk(survey))
    if not valid:
        top = "; ".join(f"{rule} removed {n} (e.g. {survey.reasons[rule]})"
                        for rule, n in survey.removed.most_common(3))
        hint = " Choose a gbs that the data-parallel sizes divide." if "gbs" in survey.removed else ""
        raise UserError(f"no valid configuration for n_gpus={n_gpus}, gbs={gbs}: {top}.{hint}")
    strategy = build(cfg.strategy)
    evaluator = build(cfg.evaluator)
    job = Job(cfg=cfg, command=command, ctx=ctx, space=space, survey=survey, strategy=strategy,
              evaluator=evaluator, memory=memory, memory_source=source)
    job.predicted_oom_count = sum(1 for c in valid if job.predicted_oom(c))
    return job
