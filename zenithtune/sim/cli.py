"""Replay a SimResult as a process would: lines on stdout/stderr, paced by --sim-time-scale, exit code."""
from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable

from zenithtune.sim.trainer import SimResult


def main(simulate: Callable[[list[str], dict[str, str] | None], SimResult], argv: list[str]) -> int:
    res = simulate(argv, dict(os.environ))
    # under a launcher every rank runs this; like Megatron, only rank 0 prints the log (errors: all ranks)
    quiet = os.environ.get("RANK", "0") != "0"
    scale = res.config.time_scale if res.config is not None else 0.0
    clock = 0.0
    try:
        for event in sorted(res.events, key=lambda e: e.at):
            if scale > 0 and event.at > clock:
                time.sleep((event.at - clock) * scale)
                clock = event.at
            if quiet and event.stream == "stdout":
                continue
            stream = sys.stdout if event.stream == "stdout" else sys.stderr
            stream.write(event.text + "\n")
            stream.flush()
    except BrokenPipeError:  # `| head`: the reader left; say nothing more
        sys.stdout = sys.stderr = None
        os._exit(res.exit_code)
    if scale > 0 and res.wall_seconds > clock:
        time.sleep((res.wall_seconds - clock) * scale)
    return res.exit_code
