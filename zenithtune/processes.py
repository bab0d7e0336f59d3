"""A trial's processes: find every one of them, kill them all, and find them again after a crash.

A process group is not enough to hold a distributed job: launchers and data loaders call
``setsid``/``setpgid`` or double-fork, and those processes leave the group while still holding GPU
memory. So every trial carries a *marker* in its environment (``ZENITHTUNE_TRIAL=<id>``), which
every descendant inherits and which stays readable in ``/proc/<pid>/environ`` whatever group,
session or parent the process ends up in. A trial's processes are then:

* its process group (the leader's pid), plus
* every process whose environment carries the marker, plus
* every descendant of those (for the rare child started with a cleaned environment).

The same marker finds what a killed tuner left behind: :func:`kill_leftovers`, given the
:class:`TrialProcess` record stored with the trial (or only the marker), kills the orphans before
a resumed study launches anything. Without ``/proc`` (macOS) only the process group is known.
"""
from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = ["MARKER_ENV", "TrialProcess", "members", "kill_tree", "kill_leftovers"]

MARKER_ENV = "ZENITHTUNE_TRIAL"
"""Environment variable set in every trial; its value identifies the trial's processes."""

_PROC = Path("/proc")


def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def _stat(pid: int) -> tuple[str, int, int, int] | None:
    """(state, ppid, pgid, start time in clock ticks since boot), None when the process is gone."""
    try:
        raw = (_PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rfind(")") + 2:].split()  # after "pid (comm) ": comm may hold spaces and ')'
    try:
        return fields[0], int(fields[1]), int(fields[2]), int(fields[19])
    except (IndexError, ValueError):
        return None


def _environ_has(pid: int, entry: bytes) -> bool:
    try:
        data = (_PROC / str(pid) / "environ").read_bytes()
    except OSError:  # gone, a zombie, or another user's process (not ours to kill anyway)
        return False
    return entry in data.split(b"\0")


@dataclass(frozen=True)
class TrialProcess:
    """What identifies a trial's processes once the tuner that started them is gone.

    Stored with the trial (``to_dict``) as soon as the command starts, so that a resumed study can
    call :func:`kill_leftovers` with it.
    """

    marker: str  # value of ZENITHTUNE_TRIAL in every process of the trial
    pid: int | None = None  # the command's own pid (its process group id too)
    start_ticks: int | None = None  # its start time (/proc/<pid>/stat): tells it from a later process reusing the pid
    host: str = ""  # the trial ran here; processes on another host cannot be seen from this one
    boot_id: str | None = None  # a reboot kills everything: nothing can be left behind across one

    @classmethod
    def started(cls, marker: str, pid: int) -> TrialProcess:
        st = _stat(pid)
        return cls(marker, pid, st[3] if st else None, socket.gethostname(), _boot_id())

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrialProcess:
        kw: dict[str, Any] = {k: data[k] for k in ("marker", "pid", "start_ticks", "host", "boot_id")
                              if data.get(k) is not None}
        return cls(**kw)

    def here(self) -> bool:
        """Whether its processes could still be on this machine (same host, no reboot since)."""
        same_host = not self.host or self.host == socket.gethostname()
        same_boot = self.boot_id is None or self.boot_id == _boot_id()
        return same_host and same_boot

    def leader_alive(self) -> bool:
        """The command's own process still runs (not a later process that got the same pid)."""
        if self.pid is None:
            return False
        st = _stat(self.pid)
        return st is not None and st[0] not in "ZX" and (self.start_ticks is None or st[3] == self.start_ticks)


def members(marker: str, leader: int | None = None) -> dict[int, str]:
    """Every process of the trial, pid -> state letter (``Z`` for zombies), never this process."""
    if not (_PROC / "self" / "stat").exists():
        return _group_only(leader)
    entry = f"{MARKER_ENV}={marker}".encode()
    table: dict[int, tuple[str, int, int]] = {}
    for d in _PROC.iterdir():
        if d.name.isdigit():
            st = _stat(int(d.name))
            if st is not None:
                table[int(d.name)] = st[:3]
    me = os.getpid()
    found = {pid for pid, (state, _, pgid) in table.items()
             if pid != me and ((leader is not None and pgid == leader) or
                               (state not in "ZX" and _environ_has(pid, entry)))}
    # descendants of any member: a child started with a cleaned environment is still theirs
    grew = True
    while grew:
        kids = {pid for pid, (_, ppid, _) in table.items() if ppid in found and pid not in found and pid != me}
        found |= kids
        grew = bool(kids)
    return {pid: table[pid][0] for pid in found}


def _group_only(leader: int | None) -> dict[int, str]:
    if leader is None:
        return {}
    try:
        os.killpg(leader, 0)
    except (ProcessLookupError, PermissionError):
        return {}
    return {leader: "R"}


def _signal(pids: dict[int, str], leader: int | None, sig: signal.Signals) -> None:
    if leader is not None:
        try:
            os.killpg(leader, sig)
        except (ProcessLookupError, PermissionError):
            pass
    for pid, state in pids.items():
        if state not in "ZX":
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass


def _reap(pids: dict[int, str]) -> None:
    """Collect our own zombie children among them (the command itself is reaped by its Popen)."""
    for pid, state in pids.items():
        if state in "ZX":
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass


def kill_tree(marker: str, leader: int | None, grace: float,
              poll: Callable[[], object] = lambda: None) -> list[int]:
    """SIGTERM every process of the trial, ``grace`` seconds to exit, then SIGKILL what is left;
    returns once none runs (or after 5 s more: a process in uninterruptible sleep may outlast it).
    ``poll`` is called while waiting (e.g. ``Popen.poll`` to reap the command). A Ctrl-C during the
    grace period skips straight to SIGKILL. Returns the pids that were signalled."""
    seen: set[int] = set()

    def alive() -> dict[int, str]:
        poll()
        found = members(marker, leader)
        _reap({p: s for p, s in found.items() if p != leader})
        running = {p: s for p, s in found.items() if s not in "ZX"}
        seen.update(running)
        return running

    running = alive()
    if not running:
        return []
    _signal(running, leader, signal.SIGTERM)
    deadline = time.monotonic() + grace
    try:
        while running and time.monotonic() < deadline:
            time.sleep(0.05)
            running = alive()
            _signal(running, None, signal.SIGTERM)  # new children started during the grace period
    except KeyboardInterrupt:
        running = alive()
    deadline = time.monotonic() + 5.0
    while running and time.monotonic() < deadline:
        _signal(running, leader, signal.SIGKILL)  # delivered asynchronously: wait until really gone
        time.sleep(0.02)
        running = alive()
    return sorted(seen)


def kill_leftovers(record: TrialProcess | dict[str, Any] | str, grace: float = 5.0) -> list[int]:
    """Kill what a killed tuner left of a trial; returns the pids found (empty: nothing was left).

    ``record`` is the stored :class:`TrialProcess` (or its dict), or only the marker. Call it on
    every trial a previous tuner left RUNNING before a resumed study launches anything. A record
    from another host or an earlier boot finds nothing here (check :meth:`TrialProcess.here` to say
    so to the user).
    """
    if isinstance(record, str):
        record = TrialProcess(record)
    elif isinstance(record, dict):
        record = TrialProcess.from_dict(record)
    if not record.here():
        return []
    # the process group only counts while its leader is the trial's own command: a pid reused by an
    # unrelated process must not get its group killed
    leader = record.pid if record.leader_alive() else None
    return kill_tree(record.marker, leader, grace)
