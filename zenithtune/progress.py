"""What a study prints while it runs: the space report, one line per launched trial, the result.

Plain lines (stable in CI and logs). A trial line reads:
  [3/50] trial 7  tp=2 pp=1 cp=1 mbs=2 recompute=selective -> 412.3 TFLOP/s/GPU  best 415.0  (0:00:12)
"""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any, TextIO

from zenithtune.loop import Callbacks
from zenithtune.strategies import Outcome

SHORT = {"recompute_granularity": "recompute", "recompute_method": "method",
         "recompute_num_layers": "layers", "vit_gradient_checkpointing": "vit_ckpt"}


def describe(cand: dict[str, Any]) -> str:
    return " ".join(f"{SHORT.get(k, k)}={v}" for k, v in cand.items())


def _clock(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


class Progress(Callbacks):
    def __init__(self, total: int, metric: str, direction: str, out: TextIO | None = None):
        self.total = total
        self.metric = metric
        self.direction = direction
        self.out = out or sys.stdout
        self.start = time.time()
        self.best: float | None = None
        self.pruned = 0

    def line(self, text: str = "") -> None:
        print(text, file=self.out, flush=True)

    def header(self, job: Any, url: str, resumed: int = 0, stale: list[int] | None = None) -> None:
        ctx, s = job.ctx, job.survey
        self.line(f"zenithtune: {ctx.n_gpus} GPUs ({ctx.gpus_per_node}/node, {ctx.gpu_memory_gb:g} GB from "
                  f"{job.memory_source}), gbs={ctx.gbs}, model: {ctx.model.summary()}")
        self.line(f"space: {s.total} candidates")
        for rule, n in s.removed.most_common():
            self.line(f"  - {n:6d} removed by {rule}: e.g. {s.reasons[rule]}")
        self.line(f"  - {job.predicted_oom_count:6d} predicted to run out of memory (not launched)")
        self.line(f"  = {s.valid - job.predicted_oom_count} left to search; strategy "
                  f"{type(job.strategy).__name__}, n_trials={self.total}")
        self.line(f"study: {url}" + (f" (resumed with {resumed} recorded trials)" if resumed else ""))
        if stale:
            self.line(f"  trials {stale} were running when the tuner stopped: recorded as interrupted")

    def launching(self, number: int, cand: dict, why: str, n: int) -> None:
        self._pending = f"[{n}/{self.total}] trial {number}  {describe(cand)}"
        if why:
            self.line(f"  why: {why}")

    def result(self, o: Outcome, n: int) -> None:
        if o.ok:
            if self.best is None or (o.value > self.best if self.direction == "maximize" else o.value < self.best):
                self.best = o.value
            res = f"-> {o.value:g} {self.metric}"
        else:
            res = f"-> FAILED {o.kind}: {o.reasons[0] if o.reasons else ''}"[:160]
        best = f"best {self.best:g}" if self.best is not None else "best -"
        self.line(f"{getattr(self, '_pending', f'[{n}/{self.total}]')} {res}  {best}  ({_clock(time.time() - self.start)})")

    def skipped(self, o: Outcome) -> None:
        self.pruned += 1

    def interrupted(self, url: str) -> None:
        self.line("interrupted: the running trial was stopped and recorded as interrupted")
        self.line(f"resume with the same command plus storage={url}")

    def footer(self, study: Any, best: Any, why: str) -> None:
        launched = sum(1 for t in study.get_trials(deepcopy=False) if t.user_attrs.get("launched"))
        self.line(f"done ({why}): {launched} launched, {self.pruned} proposals pruned before launch, "
                  f"{_clock(time.time() - self.start)}")
        if best is not None:
            cand = best.user_attrs.get("candidate") or best.params
            self.line(f"best: trial {best.number}  {describe(cand)}  {best.value:g} {self.metric}")
            if best.user_attrs.get("argv"):
                import shlex
                self.line(f"  argv: {shlex.join(best.user_attrs['argv'])}")

    def wrote(self, path: Path, hint: str | None = None) -> None:
        self.line(f"wrote {path}" + (f"  ({hint})" if hint else ""))
