"""The fault matrix: fake trainers attack the runner and the evaluators; print tried / survived / lost.

    python benchmarks/faults.py            # every case
    python benchmarks/faults.py -k disk    # the cases whose name contains "disk"

A case is one function decorated with ``@case("name", "issue item")`` that returns ``None`` when
zenithtune survived the fault (no hang, no orphan, the right kind and reason, flat memory) or a
one-line description of what was lost. Adding a case is adding a function; the orchestration
faults (tuner killed, resume, hostile db) go next to these. The fake trainers live in
tests/fixtures/ (printer.py prints what it is told; escape_tree.py leaves the process group).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from zenithtune.evaluate import Evaluator, IterationTime, MegatronThroughput, NoMetric  # noqa: E402
from zenithtune.processes import kill_leftovers  # noqa: E402
from zenithtune.run import FailureKind, RunResult, classify, run  # noqa: E402

FIXTURES = ROOT / "tests" / "fixtures"
sys.path.insert(0, str(ROOT / "tests"))
from fixtures.filling_disk import FillingDisk  # noqa: E402

PRINTER = [sys.executable, str(FIXTURES / "printer.py")]
ESCAPE = [sys.executable, str(FIXTURES / "escape_tree.py")]


@dataclass
class Case:
    name: str
    item: str  # where the fault was reported, e.g. "#10.2"
    check: Callable[[Path], str | None]


CASES: list[Case] = []


def case(name: str, item: str) -> Callable[[Callable[[Path], str | None]], Callable[[Path], str | None]]:
    def register(fn: Callable[[Path], str | None]) -> Callable[[Path], str | None]:
        CASES.append(Case(name, item, fn))
        return fn
    return register


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] not in "ZX"


def scored(evaluator: Evaluator, steps: list[str], tmp: Path, **kw: object) -> tuple[RunResult, object]:
    """Run printer.py with ``steps``, feeding ``evaluator``; (result, score or (kind, reason))."""
    evaluator.begin()
    res = run([*PRINTER, *steps], log_path=tmp / "trial.log", timeout=120, grace=0.5,
              on_line=evaluator.feed, **kw)  # type: ignore[arg-type]
    failure = classify(res)
    if failure is not None:
        return res, failure
    try:
        return res, evaluator.result()
    except NoMetric as e:
        return res, (e.kind, e.reason)


# --- #10.2: children that leave the process group ----------------------------------------------

def _escape(mode: str, leader_exits: bool, tmp: Path) -> str | None:
    argv = [*ESCAPE, mode] + (["--leader-exits"] if leader_exits else [])
    res = run(argv, log_path=tmp / "trial.log", timeout=None if leader_exits else 2, grace=0.5)
    pids = [int(p) for p in re.findall(r"^escaped (\d+)$", res.output, re.M)]
    if not pids:
        return f"the worker never started: {res.output[-200:]!r}"
    return f"{mode} worker {pids[0]} survived" if alive(pids[0]) else None


for _mode in ("setsid", "setpgid", "double-fork"):
    case(f"timeout kills a {_mode} worker", "#10.2")(lambda tmp, m=_mode: _escape(m, False, tmp))
    case(f"exit 0 leaves a {_mode} worker: killed", "#10.2")(lambda tmp, m=_mode: _escape(m, True, tmp))


_TUNER = """
import json, sys
from pathlib import Path
from zenithtune.run import run
run(sys.argv[2:], log_path=None, timeout=60, trial_id=sys.argv[1],
    on_start=lambda p: Path(sys.argv[1]).write_text(json.dumps(p.to_dict())))
"""


@case("tuner killed -9: a resumed study kills the orphans", "#10.1/#10.2")
def _killed_tuner(tmp: Path) -> str | None:
    record_file = tmp / "trial.json"
    tuner = subprocess.Popen([sys.executable, "-c", _TUNER, str(record_file), *ESCAPE, "double-fork"],
                             cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.DEVNULL)
    time.sleep(2.0)  # the worker is up
    tuner.kill()
    tuner.wait()
    record = json.loads(record_file.read_text())
    killed = kill_leftovers(record, grace=0.5)
    left = [p for p in killed if alive(p)]
    if len(killed) < 2:
        return f"found only {killed} of the leader and its double-forked worker"
    return f"still alive: {left}" if left else None


# --- #10.3: log size and full disk ----------------------------------------------------------------

@case("200 MB of output, log_max_mb=50", "#10.3")
def _big_log(tmp: Path) -> str | None:
    res, score = scored(MegatronThroughput(selector="last", skip_first=0), ["tflops=10.0", "noise=200e6", "tflops=20.0"], tmp)
    size = (tmp / "trial.log").stat().st_size
    if size > 50.2e6:
        return f"trial.log is {size / 1e6:.0f} MB"
    text_tail = (tmp / "trial.log").read_bytes()[-2000:].decode()
    return None if score == 20.0 and "# result: exit code 0" in text_tail else f"score {score}"


@case("full disk before the first line (/dev/full)", "#10.3")
def _dev_full(tmp: Path) -> str | None:
    res = run([*PRINTER, "tflops=1.0"], log_path=Path("/dev/full"), timeout=30)
    got = classify(res)
    return None if got and got[0] is FailureKind.LOG_WRITE else f"got {got}"


@case("disk fills up mid-run (trainer keeps printing, then sleeps)", "#10.3")
def _disk_fills(tmp: Path) -> str | None:
    import zenithtune.run as runmod

    saved = runmod._open_log
    runmod._open_log = lambda path: FillingDisk(path, 1_000_000)  # type: ignore[assignment]
    try:
        res = run([*PRINTER, "noise=5e6", "sleep=60", "tflops=1.0"], log_path=tmp / "trial.log", timeout=90,
                  grace=0.5)
    finally:
        runmod._open_log = saved
    got = classify(res)
    if res.timed_out:
        return "hung until the timeout"
    if res.process and alive(res.process.pid):
        return "the trainer still runs"
    return None if got and got[0] is FailureKind.LOG_WRITE else f"got {got}"


# --- #10.4: where the metric is, and how much memory reading it takes ------------------------------

@case("metric, then 3 MB of ordinary lines", "#10.4")
def _metric_then_noise(tmp: Path) -> str | None:
    _, score = scored(MegatronThroughput(selector="last", skip_first=0), ["tflops=321.0", "noise=3e6"], tmp)
    return None if score == 321.0 else f"got {score}"


_RSS = """
import resource, sys
from zenithtune.evaluate import MegatronThroughput
from zenithtune.run import run
ev = MegatronThroughput(selector="mean", skip_first=0)
run(sys.argv[1:], log_path=None, timeout=600, on_line=ev.feed)
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024, ev.result())
"""


@case("a 1 GB line without a newline between two metric lines", "#10.4")
def _huge_line(tmp: Path) -> str | None:
    out = subprocess.run([sys.executable, "-c", _RSS, *PRINTER, "tflops=100.0", "longline=1e9", "tflops=200.0"],
                         capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    if out.returncode:
        return out.stderr.strip().splitlines()[-1]
    rss, score = out.stdout.split()
    if float(score) != 150.0:
        return f"score {score} (expected the mean of 100 and 200)"
    return None if int(rss) < 150 else f"the tuner grew to {rss} MB"


# --- #10.10 and the score rule: misleading reasons ------------------------------------------------

def _bad(value: str) -> Callable[[Path], str | None]:
    def check(tmp: Path) -> str | None:
        _, got = scored(MegatronThroughput(selector="last", skip_first=0), [f"tflops={value}"] * 3, tmp)
        if not isinstance(got, tuple) or got[0] is not FailureKind.BAD_METRIC:
            return f"got {got}"
        return "misleading --log-throughput hint" if "--log-throughput" in got[1] else None
    return check


for _value in ("nan", "inf", "0.0", "-1.0"):
    case(f"throughput {_value} on every line", "#10.10/score")(_bad(_value))


@case("CUDA out of memory printed, exit 0", "#10.10")
def _oom_exit_0(tmp: Path) -> str | None:
    _, got = scored(MegatronThroughput(selector="last", skip_first=0), ["tflops=100.0", "oom", "noise=3e6"], tmp)
    return None if isinstance(got, tuple) and got[0] is FailureKind.OOM else f"got {got}"


@case("no --log-throughput: evaluator=iteration_time still scores", "#12.4")
def _iteration_time(tmp: Path) -> str | None:
    _, got = scored(IterationTime(gbs=64, n_gpus=8), ["iter=900", "iter=500", "iter=500"], tmp)
    return None if got == 16.0 else f"got {got}"


# --- #21: numbers with separators, a metric at the end of a long line, a multi-rank crash's reason ------

def _separated(value: str) -> Callable[[Path], str | None]:
    def check(tmp: Path) -> str | None:
        _, got = scored(MegatronThroughput(selector="last", skip_first=0), ["tflops=100.0", f"tflops={value}", "tflops=100.0"], tmp)
        if not isinstance(got, tuple) or got[0] is not FailureKind.BAD_METRIC or repr(value) not in got[1]:
            return f"got {got} (a prefix of {value!r} was read as a score)"
        return None
    return check


for _value in ("1,234.5", "1 234", "12.5.3"):
    case(f"throughput printed as {_value}", "#21.2")(_separated(_value))


@case("a metric at the end of a 3 MB line, no final newline", "#21.5")
def _metric_after_long_line(tmp: Path) -> str | None:
    ev = MegatronThroughput(selector="last", skip_first=0)
    code = "import sys; sys.stdout.write('x' * 3_000_000 + ' throughput per GPU (TFLOP/s/GPU): 123.4 |')"
    res = run([sys.executable, "-c", code], log_path=tmp / "trial.log", timeout=120, on_line=ev.feed)
    try:
        score = ev.result()
    except NoMetric as e:
        return f"exit {res.returncode}: {e.kind.value}: {e.reason[:80]}"
    return None if score == 123.4 else f"score {score}"


@case("torchrun crash: rank 0's error, not rank 1's gloo echo", "#21.15")
def _root_cause(tmp: Path) -> str | None:
    res = run([sys.executable, str(FIXTURES / "torchrun_crash.py")], log_path=tmp / "trial.log", timeout=60)
    got = classify(res)
    return None if got is not None and "[rank0]: ValueError" in got[1] else f"got {got}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-k", default="", help="only cases whose name contains this")
    args = ap.parse_args()
    chosen = [c for c in CASES if args.k in c.name]
    lost = 0
    for c in chosen:
        start = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="zt-fault-") as tmp:
            try:
                problem = c.check(Path(tmp))
            except Exception as exc:  # a crash of the case is a loss, shown as such
                problem = f"raised {exc!r}"
        lost += problem is not None
        verdict = "survived" if problem is None else f"LOST: {problem}"
        print(f"{c.item:12s} {c.name:62s} {time.monotonic() - start:6.1f} s  {verdict}", flush=True)
    print(f"tried {len(chosen)} / survived {len(chosen) - lost} / lost {lost}")
    return 1 if lost else 0


if __name__ == "__main__":
    sys.exit(main())
