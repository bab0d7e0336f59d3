"""Trials as Slurm jobs: submit a wave, watch it in the queue, collect it, cancel it.

With `hydra/launcher=slurm` the zenithtune sweeper does not hand a wave to hydra-submitit-launcher's
`launch` (which blocks until every job returns and knows nothing of the study); it uses the same
launcher object as the job's callable and drives submitit itself, so that
  - each trial's job id is stored in its record the moment sbatch accepts it (`Attr.SLURM_JOBS`);
  - a request sbatch refuses stops the study at its first wave with sbatch's own words
    (`NotStarted`), nothing launched, no budget spent;
  - a wave waiting in the queue shows squeue's reason ("waiting in queue: Resources"), and
    `slurm.queue_timeout` ends the wait with one line;
  - a job's end is read from Slurm (squeue, then sacct): TIMEOUT is the trial's `timeout`, CANCELLED
    (scancel) is `cancelled`, which measured nothing and is retried once (zenithtune.loop);
  - a stopped tuner (Ctrl-C, SIGTERM, SIGHUP) cancels its wave's jobs and waits until squeue no longer
    lists them; a resumed study cancels the jobs of trials whose tuner died (SIGKILL), by the ids in
    their records, before anything is launched, so no candidate ever runs twice at once.
In the job, submitit's preemption signal (USR2, sent `signal_delay_s` before the time limit to every
process of the job) is ignored: a trial is not checkpointable, Slurm's own kill at the limit ends it
and says TIMEOUT.
Multi-node trials: node k > 0 writes trial.node<k>.log / trial.node<k>.json (`node_suffix`), and the
trial's score is the node that printed the metric (`collect`).
"""
from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zenithtune import record
from zenithtune.errors import ZenithtuneError
from zenithtune.record import TRIAL_INFO, Launched
from zenithtune.run import FailureKind

__all__ = ["NotStarted", "Finished", "TrialJob", "cancel", "collect", "node_suffix", "queue", "run_wave",
           "uses_slurm"]

POLL_S = 1.0  # seconds between squeue calls while a wave runs
QUIET_POLLS = 3  # polls a wave may pend before its queue reason is shown
ALIVE = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "RESIZING", "SUSPENDED", "SIGNALING",
         "STAGE_OUT", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD", "STOPPED"}


# squeue reasons of a job that can never start as asked (no EnforcePartLimits: sbatch accepted it)
NEVER = {"PartitionConfig", "PartitionNodeLimit", "PartitionTimeLimit", "BadConstraints", "InvalidAccount",
         "InvalidQOS", "QOSMaxGRESPerJob", "QOSMaxCpuPerJobLimit", "QOSMaxNodePerJobLimit"}


class NotStarted(ZenithtuneError):
    """A wave that never ran: sbatch refused it, or it waited past slurm.queue_timeout. Its trials are
    recorded as not launched (no budget spent) and the study stops with this one line."""


@dataclass
class Finished:
    """How one trial's job ended: Slurm's state and, when the entry function returned, its JobReturn."""

    job_id: str
    state: str  # COMPLETED, FAILED, TIMEOUT, CANCELLED, NODE_FAIL, OUT_OF_MEMORY, ...
    ret: Any = None  # hydra JobReturn (node 0's), None when the job left no result
    error: str = ""  # what submitit reported when there is no result


def uses_slurm(launcher: object) -> bool:
    """Whether a Hydra launcher is hydra-submitit-launcher's Slurm one (hydra/launcher=slurm)."""
    try:
        from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher
    except ImportError:
        return False
    return isinstance(launcher, SlurmLauncher)


# --- in the job --------------------------------------------------------------------------------------
class TrialJob:
    """The callable a trial's job runs: the Hydra launcher's own job (compose the trial's config, run
    the entry function), with submitit's USR2 requeue handler replaced (see the module docstring)."""

    def __init__(self, launcher: Any) -> None:
        self.launcher = launcher

    def __call__(self, *args: Any) -> Any:
        # Slurm sends submitit's USR2 to every process of the job, the trainer included, whose default is to
        # die of it: ignored here, and so in the trainer (an ignored signal stays ignored across exec)
        signal.signal(signal.SIGUSR2, signal.SIG_IGN)
        return self.launcher(*args)


def node_suffix() -> str:
    """'' on a job's first node (and outside Slurm), '.node<k>' on node k of a multi-node job: each node's
    entry function writes its own trial<suffix>.log / trial<suffix>.json in the shared trial folder."""
    try:
        nodes, node = int(os.environ.get("SLURM_NNODES", "1")), int(os.environ.get("SLURM_NODEID", "0"))
    except ValueError:
        return ""
    return f".node{node}" if nodes > 1 and node > 0 else ""


def collect(trial_dir: Path) -> Launched | None:
    """A trial's report from its folder: node 0's trial.json, or, when node 0 has no score and another
    node printed the metric (Megatron prints throughput on the last rank), that node's."""
    first = record.read_run(trial_dir / TRIAL_INFO)
    if first is not None and first.value is not None:
        return first
    for path in sorted(trial_dir.glob("trial.node*.json")):
        other = record.read_run(path)
        if other is not None and other.value is not None:
            return other
    return first


# --- in the tuner --------------------------------------------------------------------------------------
def _run(argv: list[str]) -> str:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""


def queue(job_ids: Sequence[str]) -> dict[str, tuple[str, str]]:
    """{job id: (state, reason)} for the jobs Slurm's controller still knows (squeue), the rest from
    the accounting database (sacct; reason '')."""
    if not job_ids:
        return {}
    ids = ",".join(job_ids)
    found: dict[str, tuple[str, str]] = {}
    for line in _run(["squeue", "-h", "-r", "--states=all", "-j", ids, "-o", "%i|%T|%r"]).splitlines():
        parts = line.strip().split("|")
        if len(parts) == 3 and parts[0] in job_ids:
            found[parts[0]] = (parts[1], "" if parts[2] in ("None", "(null)") else parts[2])
    missing = [j for j in job_ids if j not in found]
    if missing:
        for line in _run(["sacct", "-X", "-n", "-P", "-o", "JobID,State", "-j", ",".join(missing)]).splitlines():
            parts = line.strip().split("|")
            if len(parts) == 2 and parts[0] in missing:
                found[parts[0]] = (parts[1].split()[0], "")  # "CANCELLED by 0" -> CANCELLED
    return found


def cancel(job_ids: Sequence[str], wait_s: float = 60.0) -> list[str]:
    """scancel the jobs and wait until squeue no longer lists them as alive; the ids still alive after
    `wait_s` (Slurm's KillWait is the usual bound)."""
    if not job_ids:
        return []
    _run(["scancel", *job_ids])
    deadline = time.monotonic() + wait_s
    while True:
        alive = [j for j, (state, _) in queue(job_ids).items() if state in ALIVE]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.5)


def _sbatch_words(err: BaseException) -> str:
    """sbatch's own error lines from submitit's exception, as one line."""
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    words = [ln for ln in lines if "error:" in ln.lower()] or lines or [type(err).__name__]
    return " ".join(words)[:400]


def _executor(launcher: Any) -> Any:
    """submitit's Slurm executor with the launcher's parameters (conf/hydra/launcher/slurm.yaml)."""
    import submitit
    from omegaconf import OmegaConf

    from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf

    params = dict(launcher.params)
    executor = submitit.AutoExecutor(folder=params.pop("submitit_folder"), cluster="slurm",
                                     slurm_max_num_timeout=params.pop("max_num_timeout", 0))
    params.pop("_target_", None)
    base = set(OmegaConf.structured(BaseQueueConf).keys())
    executor.update_parameters(**{k if k in base else f"slurm_{k}": v for k, v in params.items()})
    return executor


def run_wave(launcher: Any, batch: list[list[str]], numbers: list[int], *,
             on_submitted: Callable[[int, str], None], on_queue: Callable[[str], None],
             queue_timeout: float | None, hint: str) -> list[Finished]:
    """Submit one wave (one job per trial, as one array), wait for every job to end, return how each
    ended, in order. Raises NotStarted (sbatch refused, or queue_timeout passed with no job started)
    and, on Ctrl-C / a stop signal, cancels the wave's jobs before re-raising KeyboardInterrupt."""
    from hydra.core.singleton import Singleton

    executor = _executor(launcher)
    params = [(list(ov), "hydra.sweep.dir", n, f"job_id_for_{n}", Singleton.get_state())
              for ov, n in zip(batch, numbers)]
    try:
        with contextlib.redirect_stderr(io.StringIO()):  # submitit prints sbatch's refusal; NotStarted says it
            jobs = executor.map_array(TrialJob(launcher), *zip(*params))
    except KeyboardInterrupt:
        raise
    except Exception as err:  # noqa: BLE001  submitit wraps sbatch's refusal in its own errors
        raise NotStarted(f"sbatch refused the trials' jobs: {_sbatch_words(err)} ({hint})") from None
    ids = [str(j.job_id) for j in jobs]
    for n, job_id in zip(numbers, ids):
        on_submitted(n, job_id)
    try:
        return _wait(jobs, ids, on_queue, queue_timeout, hint)
    except BaseException:
        cancel(ids)
        raise


def _wait(jobs: list[Any], ids: list[str], on_queue: Callable[[str], None],
          queue_timeout: float | None, hint: str) -> list[Finished]:
    submitted = time.monotonic()
    started = False
    said = ""
    polls = 0
    ends: dict[str, str] = {}
    while len(ends) < len(ids):
        states = queue([j for j in ids if j not in ends])
        for job_id, (state, _) in states.items():
            if state not in ALIVE:
                ends[job_id] = state
        waiting = [(j, r) for j, (s, r) in states.items() if s == "PENDING"]
        started = started or any(s not in ("PENDING",) for s, _ in states.values())
        polls += 1
        if waiting and not started:
            reason = waiting[0][1] or "Priority"
            if reason in NEVER:
                raise NotStarted(f"Slurm will never start the trials' jobs {', '.join(ids)}: squeue says {reason} "
                                 f"(the request exceeds what the partition has or allows); they were cancelled "
                                 f"({hint})")
            # a fresh job pends for a scheduler cycle on any cluster: say so only once it really waits
            if reason != said and polls > QUIET_POLLS:
                on_queue(reason)
                said = reason
            if queue_timeout is not None and time.monotonic() - submitted > queue_timeout:
                raise NotStarted(f"the trials' jobs {', '.join(ids)} waited {time.monotonic() - submitted:.0f} s "
                                 f"in Slurm's queue ({reason}), past slurm.queue_timeout={queue_timeout:g}: "
                                 f"they were cancelled; ask for less (nodes, GPUs, slurm.cpus_per_task), another "
                                 f"partition, or a longer slurm.queue_timeout")
        if len(ends) < len(ids):
            time.sleep(POLL_S)
    return [_finished(job, ends[job_id]) for job, job_id in zip(jobs, ids)]


def _finished(job: Any, state: str) -> Finished:
    """The job's result (node 0's JobReturn) when its entry function returned one."""
    if not Path(job.paths.result_pickle).exists():
        return Finished(str(job.job_id), state, error=f"the job left no result (Slurm: {state})")
    try:
        return Finished(str(job.job_id), state, ret=job.results()[0])
    except Exception as err:  # noqa: BLE001  submitit re-raises what the job raised outside the entry function
        first = (str(err).strip().splitlines() or [type(err).__name__])[-1]
        return Finished(str(job.job_id), state, error=f"{type(err).__name__}: {first[:200]}")


def outcome_kind(state: str) -> str | None:
    """The trial outcome Slurm's end state decides on its own (None: the entry function's report decides)."""
    if state == "TIMEOUT" or state == "DEADLINE":
        return FailureKind.TIMEOUT.value
    if state == "CANCELLED":
        return FailureKind.CANCELLED.value
    if state == "OUT_OF_MEMORY":
        return FailureKind.CRASH.value  # host memory: Slurm's cgroup killed it
    return None
