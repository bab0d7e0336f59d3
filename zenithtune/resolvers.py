"""OmegaConf resolvers used by conf/config.yaml.

The wrapped command arrives as an argv list (everything after a lone `--`). It is passed from
`__main__` to the config through an environment variable holding JSON rather than through Hydra's
override grammar, so quotes, `$`, `=` and commas in a user's command survive untouched; the
environment also reaches jobs that a launcher runs in another process.
"""
from __future__ import annotations

import datetime
import json
import os
import sys
from typing import Any

from omegaconf import OmegaConf

COMMAND_ENV = "ZENITHTUNE_COMMAND"
# Linux refuses to start a process with any one environment string over 128 KiB (MAX_ARG_STRLEN), so a
# long command is split over ZENITHTUNE_COMMAND, ZENITHTUNE_COMMAND_1, _2, ... of at most this many bytes.
_ENV_PIECE = 100_000


def export_command(command: list[str], environ: Any = os.environ) -> None:
    """Put the command after `--` into the environment, for this process and every job a launcher starts."""
    raw = json.dumps(command)  # ASCII: json escapes the rest, so characters are bytes
    for key in [k for k in environ if k == COMMAND_ENV or k.startswith(COMMAND_ENV + "_")]:
        if key == COMMAND_ENV or key[len(COMMAND_ENV) + 1:].isdigit():
            del environ[key]
    pieces = [raw[i:i + _ENV_PIECE] for i in range(0, len(raw), _ENV_PIECE)] or [raw]
    for n, piece in enumerate(pieces):
        environ[COMMAND_ENV if n == 0 else f"{COMMAND_ENV}_{n}"] = piece


def _command(default: Any = None) -> Any:
    raw = os.environ.get(COMMAND_ENV)
    if raw is None:
        return default
    n = 1
    while f"{COMMAND_ENV}_{n}" in os.environ:
        raw += os.environ[f"{COMMAND_ENV}_{n}"]
        n += 1
    return json.loads(raw)


def environ_command() -> list[str] | None:
    """The command given after `--` (None: the config's default command)."""
    return _command(None)


OmegaConf.register_resolver("zt.command", _command, replace=True, annotation_validation="off")


def _mkdir(path: str) -> str:
    """Create a folder (e.g. the sweep dir before a stock sweeper opens its sqlite file there)."""
    os.makedirs(path, exist_ok=True)
    return os.path.abspath(path)


_STARTED = datetime.datetime.now()


def _started(pattern: str) -> str:
    """This process's start time, formatted. Unlike Hydra's ${now:}, every config composed in the
    process agrees on it, so a study's db (opened by a sweeper from its own copy of the config) and
    its trial folders (composed per job by the launcher) land in the same study folder even when
    the clock ticks between the two."""
    return _STARTED.strftime(pattern)


OmegaConf.register_resolver("zt.started", _started, replace=True, annotation_validation="off")
# With the microseconds of ${zt.started:...%f}, the pid makes a study folder this process's own: two
# studies started in the same second (or on two hosts sharing outputs/) never share a study.db. A
# launcher's job process composes its config anew; the sweeper passes it the resolved folder.
OmegaConf.register_resolver("zt.pid", lambda: str(os.getpid()), replace=True, annotation_validation="off")
OmegaConf.register_resolver("zt.mkdir", _mkdir, replace=True, annotation_validation="off")
OmegaConf.register_resolver("zt.python", lambda: sys.executable, replace=True, annotation_validation="off")


def _tuned_names() -> str:
    """The tuned configs in ./conf/tuned/ (for --help: Hydra lists config groups from its search
    path as it was before the command line's hydra.searchpath, so it never sees them)."""
    folder = os.path.join(os.getcwd(), "conf", "tuned")
    names = sorted(f[:-5] for f in os.listdir(folder) if f.endswith(".yaml")) if os.path.isdir(folder) else []
    return ", ".join(names) if names else "(none yet: save_tuned=NAME writes conf/tuned/NAME.yaml)"


OmegaConf.register_resolver("zt.tuned_names", _tuned_names, replace=True, annotation_validation="off")


# --- conf/hydra/launcher/slurm.yaml: one trial's allocation, from the study's own keys ---------------
def _nodes(n_gpus: int, gpus_per_node: int) -> int:
    """Nodes one trial needs: n_gpus spread over full nodes (a partial node for n_gpus < gpus_per_node)."""
    return max(1, -(-int(n_gpus) // int(gpus_per_node)))


def _node_gpus(n_gpus: int, gpus_per_node: int, gpus: Any = True) -> int | None:
    """GPUs to request per node: all of a node, or n_gpus when one trial needs less than a node; None
    (no --gpus-per-node at all) when slurm.gpus=false: a CPU-only or GRES-less cluster refuses any."""
    if gpus is False or str(gpus).lower() == "false":
        return None
    return min(int(n_gpus), int(gpus_per_node))


def _node_cpus(cpus_per_task: Any, gpus: Any) -> int:
    """CPU cores per task (one task per node): slurm.cpus_per_task, else 4 per requested GPU (data
    loading workers), 1 without GPUs."""
    if cpus_per_task not in (None, "None"):
        return int(cpus_per_task)
    return 4 * int(gpus) if gpus not in (None, "None") else 1


def _job_minutes(timeout: Any, margin_min: int = 10, unlimited_min: int = 24 * 60) -> int:
    """Slurm's time limit for a trial job: the trial's own timeout (which ends the command cleanly and
    records the trial as `timeout`) plus a margin for start-up and the allocation, so Slurm's kill is
    only the backstop. No timeout: `unlimited_min`."""
    if timeout is None or timeout == "None":
        return int(unlimited_min)
    return int(-(-float(timeout) // 60)) + int(margin_min)


OmegaConf.register_resolver("zt.nodes", _nodes, replace=True, annotation_validation="off")
OmegaConf.register_resolver("zt.node_gpus", _node_gpus, replace=True, annotation_validation="off")
OmegaConf.register_resolver("zt.node_cpus", _node_cpus, replace=True, annotation_validation="off")
OmegaConf.register_resolver("zt.job_minutes", _job_minutes, replace=True, annotation_validation="off")
