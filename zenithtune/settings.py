"""The typed configuration: the schema conf/config.yaml is checked against, and the one conversion
from Hydra's DictConfig into plain typed objects.

`ZenithtuneConf` is registered in Hydra's ConfigStore as `zenithtune_schema` and heads
conf/config.yaml's defaults list, so Hydra refuses a value of the wrong type (`n_gpus=abc`) or an
unknown key while it composes the config. The values and their comments live in conf/config.yaml
(users read and copy it); the schema holds the types only.

`load(cfg)` is the boundary: it turns a composed config into a `ZenithtuneConf` instance, checks every
range (positive sizes, timeouts > 0, ...) and raises `UserError` naming the key and the fix. Nothing
below it reads a DictConfig.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, fields
from typing import Any, Optional

from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from zenithtune import resolvers  # noqa: F401  (registers ${zt.command:}, ${zt.python:}, ${zt.started:})
from zenithtune.errors import UserError
from zenithtune.space import MAX_GPUS

# A tuned config's name (save_tuned=NAME -> conf/tuned/NAME.yaml): no path separators, no `..`.
TUNED_NAME = re.compile(r"(?!\.)[A-Za-z0-9_.-]+")


@dataclass
class SlurmConf:
    """hydra/launcher=slurm: what a trial's job asks Slurm for, and how long a wave may wait in the queue."""

    gpus: bool = True  # request GPUs (--gpus-per-node); False on CPU-only or GRES-less clusters
    cpus_per_task: Optional[int] = None  # CPU cores per node; None = 4 per requested GPU (1 without GPUs)
    queue_timeout: Optional[float] = None  # seconds a wave may wait in the queue; None = forever


@dataclass
class StableConf:
    """stop_when_stable: end a trial once its metric is stable instead of running the command to its end."""

    k: int = 0  # values after warm-up that must agree; 0 = off (every command runs to its end)
    within: float = 0.02  # how closely: each of the last k values within this fraction of their median


@dataclass
class ZenithtuneConf:
    """Every top-level key of conf/config.yaml with its type (values and comments: config.yaml)."""

    # --- the job
    n_gpus: int = MISSING  # world size of one trial (required)
    gbs: int = MISSING  # global batch size (required)
    model: Optional[str] = None  # HF id or local dir for the shape; None = from the command
    num_layers: Optional[int] = None  # shape overrides (else from the command or model=)
    num_query_groups: Optional[int] = None
    seq_length: Optional[int] = None
    mbs_max: int = MISSING  # largest micro-batch size tried
    gpus_per_node: int = MISSING  # TP beyond a node crosses the network
    gpu_memory_gb: Optional[float] = None  # per-GPU memory for the OOM estimate; None = detect
    sim_gpu: str = MISSING  # GPU the default simulator command plays
    memory_safety_margin: float = MISSING  # prune only past capacity x (1 + margin)
    prune: dict[str, Any] = field(default_factory=dict)  # prune.policy.<rule>: bool, zenithtune's own preferences
    # --- the study
    n_trials: int = MISSING  # launched trials at most
    fail_fast: int = MISSING  # stop when the first N launches all fail; 0 = never
    max_ooms: int = 2  # launches that may run out of memory per study; then only proven fits
    stage1_trials: Optional[int] = None  # staged_blackbox: launches on the layout before stage 2; None = a share of n_trials
    timeout: Optional[float] = None  # seconds per trial; None = no limit
    timeout_dynamic: bool = MISSING  # derive each trial's limit from the fastest success
    timeout_dynamic_factor: float = MISSING
    timeout_dynamic_floor: float = MISSING
    storage: Optional[str] = None  # Optuna storage URL or a study.db path; None = <sweep dir>/study.db
    parallel_trials: int = 1  # trials launched together per wave
    heartbeat_interval: int = 10  # seconds between beats for a worker's running trials
    heartbeat_grace: int = 60  # a running trial not beaten for this long is failed (its worker died)
    study_name: str = MISSING
    save_tuned: Optional[str] = None  # also write conf/tuned/<name>.yaml
    echo: bool = MISSING  # stream each trial's output to the console
    log_max_mb: Optional[float] = None  # cap on each trial.log (head + tail kept); None = no cap
    stop_when_stable: StableConf = field(default_factory=lambda: StableConf())  # end a trial once its metric is stable
    slurm: SlurmConf = field(default_factory=lambda: SlurmConf())  # hydra/launcher=slurm: what each job asks for
    # --- the wrapped command
    command: list[str] = MISSING
    default_command: list[str] = MISSING
    # --- config groups (plain nodes: a strategy/evaluator is instantiated from its `_target_`)
    preset: dict[str, Any] = field(default_factory=dict)
    strategy: dict[str, Any] = field(default_factory=dict)
    evaluator: dict[str, Any] = field(default_factory=dict)
    # --- per trial
    params: dict[str, Any] = field(default_factory=dict)  # the candidate (sweeper or tuned config)
    validate_in_task: bool = False  # the stock Optuna sweeper baseline: screen inside the entry function
    result: Optional[dict[str, Any]] = None  # a tuned config's provenance (score, study); informational


def register() -> None:
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="zenithtune_schema", node=ZenithtuneConf, provider="zenithtune")


register()


@dataclass(frozen=True)
class TimeoutPolicy:
    """Per-trial time limits: a fixed `timeout`, and with `dynamic` a limit of factor x the fastest
    successful trial's wall time (at least `floor`, never above the fixed one). No dynamic limit
    before the first success."""

    fixed: float | None = None
    dynamic: bool = False
    factor: float = 3.0
    floor: float = 60.0

    def limit(self, durations: list[float]) -> float | None:
        if not self.dynamic or not durations:
            return self.fixed
        dyn = max(self.floor, self.factor * min(durations))
        return min(dyn, self.fixed) if self.fixed else dyn

    def is_dynamic_cut(self, limit: float | None) -> bool:
        """Whether a trial cut at `limit` was cut by the dynamic rule (not the fixed timeout)."""
        return limit is not None and limit != self.fixed


def timeouts(conf: ZenithtuneConf) -> TimeoutPolicy:
    return TimeoutPolicy(fixed=conf.timeout, dynamic=conf.timeout_dynamic,
                         factor=conf.timeout_dynamic_factor, floor=conf.timeout_dynamic_floor)


def load(cfg: DictConfig) -> ZenithtuneConf:
    """The composed config as a checked `ZenithtuneConf` (Hydra's own `hydra` node is left out)."""
    names = {f.name for f in fields(ZenithtuneConf)}
    for key in ("n_gpus", "gbs"):
        if OmegaConf.is_missing(cfg, key):
            from zenithtune.resolvers import environ_command

            # `... -- python train.py n_gpus=8 gbs=64`: the values went into the training command.
            late = [w for w in environ_command() or [] if w.split("=")[0] in ("n_gpus", "gbs", "--args", "--preset")]
            if late:
                raise UserError(f"{key} is required, and {late[0]} came after `--` (the training command): put "
                                f"zenithtune's values before `--`, e.g. python -m zenithtune -m n_gpus=8 gbs=64 -- ...")
            raise UserError(f"{key} is required: add {key}=N (e.g. n_gpus=8 gbs=64)")
    if "params" in cfg and OmegaConf.is_config(cfg.params):
        # A candidate (the sweeper's, a tuned file's, a study db's) is plain values: an interpolation there
        # came from a file, and resolving it could run a resolver with side effects (${zt.mkdir:...}).
        found = _interpolation(OmegaConf.to_container(cfg.params, resolve=False), "params")
        if found:
            raise UserError(f"{found}: a parameter value is a plain number or word, not an interpolation")
    try:
        data: dict[str, Any] = {k: OmegaConf.to_container(cfg[k], resolve=True, throw_on_missing=True)
                if OmegaConf.is_config(cfg[k]) else cfg[k] for k in cfg if k in names}
    except MissingMandatoryValue as e:  # e.g. evaluator=regex without evaluator.pattern
        key = getattr(e, "full_key", None) or "a value"
        raise UserError(f"{key} is required: add {key}=... (see the comments in conf/{key.split('.')[0]}/)"
                        if "." in key else f"{key} is required: add {key}=...") from None
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "config"
        raise UserError(f"{key}: {str(e).splitlines()[0]}") from None
    if isinstance(data.get("slurm"), dict):
        data["slurm"] = SlurmConf(**data["slurm"])
    if isinstance(data.get("stop_when_stable"), dict):
        data["stop_when_stable"] = StableConf(**data["stop_when_stable"])
    conf = ZenithtuneConf(**data)
    check(conf)
    return conf


def _positive(conf: ZenithtuneConf, key: str, example: str, *, zero_ok: bool = False) -> None:
    value = getattr(conf, key)
    if isinstance(value, bool) or not isinstance(value, int) or value < (0 if zero_ok else 1):
        what = "a whole number >= 0" if zero_ok else "a positive whole number"
        raise UserError(f"{key}={value!r} must be {what} (e.g. {example})")


def _positive_float(conf: ZenithtuneConf, key: str, example: str, *, optional: bool = False,
                    unit: str = "seconds") -> None:
    value = getattr(conf, key)
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        shown = f"{value:g}" if isinstance(value, (int, float)) and not isinstance(value, bool) else repr(value)
        raise UserError(f"{key}={shown} must be a positive number{' of ' + unit if unit else ''} (e.g. {example})"
                        + (("; leave it out (null) for no limit" if unit == "seconds" else "; or leave it out (null)")
                           if optional else ""))


MIN_TIMEOUT_S = 1.0  # a trial limit below this kills every command before it prints anything


def check(conf: ZenithtuneConf) -> None:
    """Range checks the schema's types cannot express; one line naming the key and the fix."""
    _positive(conf, "n_gpus", "n_gpus=8")
    if conf.n_gpus > MAX_GPUS:
        raise UserError(f"n_gpus={conf.n_gpus} is larger than zenithtune supports ({MAX_GPUS}); "
                        f"give the world size of one trial, e.g. n_gpus=1024")
    _positive(conf, "gbs", "gbs=64")
    _positive(conf, "mbs_max", "mbs_max=8")
    _positive(conf, "gpus_per_node", "gpus_per_node=8")
    _positive(conf, "n_trials", "n_trials=50")
    _positive(conf, "fail_fast", "fail_fast=5", zero_ok=True)
    _positive(conf, "max_ooms", "max_ooms=2", zero_ok=True)
    if conf.stage1_trials is not None:
        _positive(conf, "stage1_trials", "stage1_trials=30; or leave it out (null) for 60 % of n_trials")
    _positive(conf, "parallel_trials", "parallel_trials=4")
    _positive(conf, "heartbeat_interval", "heartbeat_interval=10")
    _positive(conf, "heartbeat_grace", "heartbeat_grace=60")
    if conf.slurm.cpus_per_task is not None and conf.slurm.cpus_per_task < 1:
        raise UserError(f"slurm.cpus_per_task={conf.slurm.cpus_per_task} must be at least 1 (or null: 4 per GPU)")
    if conf.slurm.queue_timeout is not None and conf.slurm.queue_timeout <= 0:
        raise UserError(f"slurm.queue_timeout={conf.slurm.queue_timeout} must be > 0 seconds (or null: wait forever)")
    if conf.heartbeat_grace <= conf.heartbeat_interval:
        raise UserError(f"heartbeat_grace={conf.heartbeat_grace} must be longer than heartbeat_interval="
                        f"{conf.heartbeat_interval} (e.g. 6x), or a live worker's trials would be failed as stale")
    for key in ("num_layers", "num_query_groups", "seq_length"):
        if getattr(conf, key) is not None:
            _positive(conf, key, f"{key}=32 or leave it out")
    _positive_float(conf, "timeout", "timeout=600", optional=True)
    _positive_float(conf, "timeout_dynamic_factor", "timeout_dynamic_factor=3", unit="")
    _positive_float(conf, "timeout_dynamic_floor", "timeout_dynamic_floor=60")
    for key in ("timeout", "timeout_dynamic_floor"):
        value = getattr(conf, key)
        if value is not None and value < MIN_TIMEOUT_S:
            raise UserError(f"{key}={value:g} s is shorter than any training command takes to start: give seconds, "
                            f"at least {MIN_TIMEOUT_S:g} (e.g. {key}=600)"
                            + ("; leave it out (null) for no limit" if key == "timeout" else ""))
    _positive_float(conf, "gpu_memory_gb", "gpu_memory_gb=80", optional=True, unit="GB")
    _positive_float(conf, "log_max_mb", "log_max_mb=50", optional=True, unit="MB")
    _check_stable(conf.stop_when_stable)
    margin = conf.memory_safety_margin
    if not (math.isfinite(margin) and -0.5 < margin < 1.0):
        raise UserError(f"memory_safety_margin={margin!r} must be a fraction between -0.5 and 1 (e.g. 0.02)")
    if conf.save_tuned is not None and not TUNED_NAME.fullmatch(str(conf.save_tuned)):
        # The name becomes conf/tuned/<name>.yaml: a path would write outside conf/tuned/.
        raise UserError(f"save_tuned={conf.save_tuned!r} must be a plain name (letters, digits, _ . -), "
                        f"e.g. save_tuned=llama8b_8xh100; it is written to conf/tuned/<name>.yaml")
    if not conf.study_name:
        raise UserError("study_name is empty: give the Optuna study a name (default zenithtune)")


def _check_stable(st: StableConf) -> None:
    if isinstance(st.k, bool) or not isinstance(st.k, int) or st.k < 0 or st.k == 1:
        raise UserError(f"stop_when_stable.k={st.k!r} must be 0 (off) or a whole number >= 2 of values that must "
                        f"agree (e.g. stop_when_stable.k=5)")
    within = st.within
    if isinstance(within, bool) or not isinstance(within, (int, float)) or not (math.isfinite(within) and 0 < within < 1):
        raise UserError(f"stop_when_stable.within={within!r} must be a fraction between 0 and 1: how close the last k "
                        f"values must lie to their median (e.g. stop_when_stable.within=0.02 for 2 %)")


def wrapped_command(conf: ZenithtuneConf) -> list[str]:
    if not conf.command:
        raise UserError("command is empty: put the training command after a lone `--`, "
                        "e.g. python -m zenithtune -m n_gpus=8 gbs=64 -- torchrun ... pretrain_gpt.py ...")
    argv = [str(x) for x in conf.command]
    if conf.model and conf.command == conf.default_command:
        # model= with the built-in simulator: the simulator plays that model, not the default Llama.
        from zenithtune.preflight import with_model

        argv = with_model(argv, conf.model)
    return argv


def trial_params(conf: ZenithtuneConf) -> dict[str, Any]:
    """The candidate this config carries (a sweeper's trial or a tuned config), without unset keys."""
    return {str(k): v for k, v in conf.params.items() if v is not None}


# Targets a config may instantiate (strategies, evaluators, samplers). Hydra 1.4 wants an execution
# whitelist from trusted code; users who plug in their own evaluator or strategy add its package via
# ZENITHTUNE_TRUSTED_TARGETS="mypkg.*,other.module.Class".
TRUSTED_TARGETS = ("zenithtune.*", "optuna.samplers.*", "hydra_plugins.hydra_optuna_sweeper.*")
TRUSTED_ENV = "ZENITHTUNE_TRUSTED_TARGETS"


def build(node: dict[str, Any]) -> Any:
    """Instantiate a `_target_` config node (strategy, evaluator) under the execution whitelist."""
    import os

    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    extra = [t.strip() for t in os.environ.get(TRUSTED_ENV, "").split(",") if t.strip()]
    target = str(node.get("_target_", ""))
    allowed = list(TRUSTED_TARGETS) + extra
    if target and not any(target == a or (a.endswith(".*") and target.startswith(a[:-1])) for a in allowed):
        raise UserError(f"_target_ {target!r} is not trusted: add its package to {TRUSTED_ENV} "
                        f"(e.g. {TRUSTED_ENV}='{target.rsplit('.', 1)[0]}.*')")
    try:
        return instantiate(node, _execution_whitelist_=allowed)
    except (InstantiationException, TypeError, ValueError, OmegaConfBaseException) as e:
        # A wrong or missing option of a strategy/evaluator (evaluator=regex without a pattern, an
        # unknown keyword, selector=bogus): the class's own ValueError names the key and the fix.
        # Hydra 1.4 raises what the constructor raised; older Hydras wrap it in InstantiationException.
        cause = e.__cause__ if isinstance(e, InstantiationException) and e.__cause__ is not None else e
        if isinstance(cause, (TypeError, ValueError, OmegaConfBaseException)):
            raise UserError(f"{target}: {str(cause).splitlines()[0]}") from None
        raise


# --- what conf/ offers, checked before Hydra composes (one line instead of Hydra's report) ---------
GROUPS = ("preset", "strategy", "evaluator", "tuned", "baseline")


def group_choices(group: str) -> list[str]:
    """Choices of a config group: ours (shipped in the package) and the user's ./conf/<group>/."""
    from importlib import resources
    from pathlib import Path

    ours = resources.files("zenithtune.conf").joinpath(group)
    names = {p.name[:-5] for p in ours.iterdir() if p.name.endswith(".yaml")} if ours.is_dir() else set()
    local = Path.cwd() / "conf" / group
    if local.is_dir():
        names |= {p.stem for p in local.glob("*.yaml")}
    return sorted(names)


def check_overrides(overrides: list[str]) -> None:
    """Refuse, in one line, a config group choice that does not exist or a top-level value of the
    wrong type, before Hydra composes (its own report is many lines)."""
    names = {f.name: f for f in fields(ZenithtuneConf)}
    schema = OmegaConf.structured(ZenithtuneConf)
    for o in overrides:
        key, eq, value = o.lstrip("+~").partition("=")
        if not eq or o.startswith("~"):
            continue
        value = value.strip()
        if not o.startswith("+"):
            _check_known(key, value, names)
        if key in GROUPS:
            known = group_choices(key)
            if value not in known and value != "null":
                noun = {"tuned": "tuned config (./conf/tuned/NAME.yaml)"}.get(key, key)
                choose = (f"choose one of {', '.join(known)}" if known else
                          "there is none yet (save_tuned=NAME writes conf/tuned/NAME.yaml)")
                raise UserError(f"{key}={value} is not {'an' if noun[0] in 'aeiou' else 'a'} {noun}: {choose}")
            if key == "tuned" and value != "null":
                check_tuned_file(value)
        elif key in names and key not in ("command", "default_command", "params", "preset", "strategy",
                                          "evaluator", "result", "prune") and not value.startswith("${"):
            try:
                OmegaConf.merge(schema, OmegaConf.from_dotlist([f"{key}={value}"]))
            except OmegaConfBaseException:
                kind = str(names[key].type).replace("Optional[", "").rstrip("]")
                raise UserError(f"{key}={value} is not a valid {kind}: {key} takes "
                                + ("a number" if kind in ("int", "float") else f"a {kind}")
                                + " (see conf/config.yaml)") from None


def _check_known(key: str, value: str, names: dict[str, Any]) -> None:
    """A key that is no config key (`n_trails=5`): one line naming the closest one, instead of Hydra's
    report that ends by advising `+n_trails=5` (which would add an unused key and run anyway)."""
    import difflib

    top = key.split(".", 1)[0]
    if top in names or top in GROUPS or top == "hydra" or "/" in top:  # hydra/launcher=...: a group path
        return
    close = difflib.get_close_matches(top, [*names, *GROUPS], n=1, cutoff=0.6)
    fix = f"did you mean {close[0]}={value}?" if close else "the keys are listed by python -m zenithtune --help"
    raise UserError(f"{key}={value}: {top} is not a zenithtune key; {fix}")


# What a tuned config may set. It is merged over the whole config (`# @package _global_`), so any
# other key (a `command:`, a `hydra:` node with env_set, a `defaults:` list) would silently change what
# runs: a tuned file from someone else must only bring the tuned parameters and the job they fit.
# The evaluator that scored the study comes along, so a run prints the same score; its `_target_` is
# instantiated only when trusted (`build`).
TUNED_KEYS = ("params", "n_gpus", "gbs", "evaluator", "result")
TUNED_MAX_BYTES = 1_000_000  # a tuned config is a few hundred bytes; parsing 100 MB of YAML takes minutes


def _interpolation(data: Any, where: str = "") -> str | None:
    """The first value holding a ${...} interpolation, as `key: value`; None when there is none."""
    if isinstance(data, dict):
        items: Any = data.items()
    elif isinstance(data, list):
        items = enumerate(data)
    else:
        return f"{where}: {data}" if isinstance(data, str) and "${" in data else None
    for k, v in items:
        found = _interpolation(v, f"{where}.{k}" if where else str(k))
        if found:
            return found
    return None


def check_tuned_file(name: str) -> None:
    """Refuse, in one line, a tuned config (./conf/tuned/NAME.yaml or ours) that sets more than it may."""
    from importlib import resources
    from pathlib import Path

    import yaml

    local = Path.cwd() / "conf" / "tuned" / f"{name}.yaml"
    ours = resources.files("zenithtune.conf").joinpath("tuned").joinpath(f"{name}.yaml")
    path = local if local.is_file() else ours
    try:
        size = path.stat().st_size if isinstance(path, Path) else len(path.read_bytes())
        if size > TUNED_MAX_BYTES:
            raise UserError(f"tuned={name}: {path} is {size / 1e6:.1f} MB; a tuned config holds a few parameters "
                            f"(at most {TUNED_MAX_BYTES / 1e6:g} MB): write it again with save_tuned={name}")
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise UserError(f"tuned={name}: cannot read {path}: {str(e).splitlines()[0]}") from None
    if not isinstance(data, dict) or not isinstance(data.get("params"), dict):
        raise UserError(f"tuned={name}: {path} holds no `params:` mapping (write one with save_tuned={name})")
    evaluator = data.get("evaluator")
    if evaluator is not None and not (isinstance(evaluator, dict) and isinstance(evaluator.get("_target_"), str)):
        raise UserError(f"tuned={name}: {path} has an `evaluator:` without a `_target_` (the evaluator class); "
                        "write the file again with save_tuned=NAME, or remove the evaluator key")
    extra = sorted(str(k) for k in data if k not in TUNED_KEYS)
    if extra:
        raise UserError(f"tuned={name}: {path} also sets {', '.join(extra)}; a tuned config may only hold "
                        f"{', '.join(TUNED_KEYS)} (remove the other keys; the command comes after `--`)")
    # Resolvers run when the config is composed: ${zt.mkdir:...} would create a folder, whatever is refused later.
    found = _interpolation(data)
    if found:
        raise UserError(f"tuned={name}: {path} holds an interpolation ({found}); a tuned config holds plain "
                        f"values only (write it again with save_tuned={name})")
