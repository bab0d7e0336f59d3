"""How long a study takes to start, per world size: space enumeration to the first proposal.

    python benchmarks/startup.py                    # table on stdout and in benchmarks/results/startup.md
    python benchmarks/startup.py --n-gpus 8 16384   # a subset

For each model (a Llama-3-70B-like dense GPT and a DeepSeek-V3-like MoE with 256 experts) and each
n_gpus, a fresh Python process composes the config, builds the job (model shape, space walk, memory
screen of every valid candidate), sets the default strategy up and asks it for the first candidate;
each phase is timed. A second run goes through the real front end (`python -m zenithtune -m ...
n_trials=1`) and reports the seconds until the study is open (space report printed, `study:` line,
just before the first launch; interpreter and Hydra start-up included). An absurd world size (10^9) must be refused in one line, fast.

Speed targets live here as measurements, not as test assertions (machines differ).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "startup.md"

MODELS: dict[str, list[str]] = {
    "dense 80L (Llama-3-70B-like)": [
        "--num-layers=80", "--hidden-size=8192", "--ffn-hidden-size=28672", "--num-attention-heads=64",
        "--group-query-attention", "--num-query-groups=8", "--seq-length=8192", "--max-position-embeddings=8192",
        "--vocab-size=128256", "--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights"],
    "MoE 256 experts (DeepSeek-V3-like)": [
        "--num-layers=61", "--hidden-size=7168", "--ffn-hidden-size=18432", "--num-attention-heads=128",
        "--seq-length=4096", "--max-position-embeddings=4096", "--vocab-size=129280", "--swiglu",
        "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--num-experts=256",
        "--moe-router-topk=8", "--moe-ffn-hidden-size=2048"],
}
N_GPUS = (8, 64, 512, 2048, 16384)


def gbs_for(n_gpus: int) -> int:
    return max(64, n_gpus // 4)


def command(model: str, n_gpus: int, gbs: int) -> list[str]:
    return [sys.executable, "-m", "zenithtune.sim", *MODELS[model], "--micro-batch-size=1",
            f"--global-batch-size={gbs}", "--train-iters=3", "--bf16", "--use-distributed-optimizer",
            "--log-throughput", "--sim-gpu=h100", "--sim-gpus-per-node=8", f"--sim-world-size={n_gpus}"]


def one(model: str, n_gpus: int) -> dict:
    """The phases of one start, in this process (run it in a fresh one)."""
    t0 = time.perf_counter()
    from hydra import compose, initialize_config_module
    from omegaconf import open_dict

    from zenithtune.job import build_job

    gbs = gbs_for(n_gpus)
    with initialize_config_module("zenithtune.conf"):
        cfg = compose("config", overrides=[f"n_gpus={n_gpus}", f"gbs={gbs}"])
    with open_dict(cfg):
        cfg.command = command(model, n_gpus, gbs)
    t1, c1 = time.perf_counter(), time.process_time()
    job = build_job(cfg)
    t2, c2 = time.perf_counter(), time.process_time()
    job.strategy.setup(job, [])
    proposal = job.strategy.ask()
    t3, c3 = time.perf_counter(), time.process_time()
    return {"imports+compose": t1 - t0, "build_job": c2 - c1, "strategy setup+ask": c3 - c2,
            "start": c3 - c1, "start_wall": t3 - t1, "build_job_wall": t2 - t1, "candidates": job.survey.total, "valid": job.survey.valid,
            "first": None if proposal is None else proposal.fixed}


def front_end(model: str, n_gpus: int, timeout: float) -> tuple[tuple[float, float] | None, str]:
    """Seconds until `python -m zenithtune -m ...` has printed its space report and opened the study
    (the `study:` line, just before the first launch); None when it did not get there."""
    gbs = gbs_for(n_gpus)
    argv = [sys.executable, "-m", "zenithtune", "-m", f"n_gpus={n_gpus}", f"gbs={gbs}", "n_trials=1",
            "hydra.sweep.dir=/tmp/zenithtune_startup/${zt.started:%Y%m%d_%H%M%S_%f}", "--",
            *command(model, n_gpus, gbs)]
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    wall, line = None, f"no study line within {timeout:.0f} s"
    assert proc.stdout is not None
    for text in proc.stdout:
        if text.startswith("study:") or text.startswith("zenithtune: error"):
            wall, line = (time.perf_counter() - t0 if text.startswith("study:") else None), text.strip()
            break
        if time.perf_counter() - t0 > timeout:
            break
    proc.kill()
    _, _, usage = os.wait4(proc.pid, 0)  # CPU of the tuner process itself (the machine may be shared)
    proc.returncode = -9
    return (None if wall is None else (usage.ru_utime + usage.ru_stime, wall)), line


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n-gpus", type=int, nargs="*", default=list(N_GPUS))
    ap.add_argument("--one", nargs=2, metavar=("MODEL", "N_GPUS"), help=argparse.SUPPRESS)
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per measurement before giving up")
    ap.add_argument("--no-write", action="store_true", help="print only; do not rewrite the results file")
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.one[0], int(args.one[1]))))
        return
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    rows = ["| model | n_gpus | gbs | candidates | valid | build_job CPU s | strategy setup + first ask CPU s | "
            "start CPU s (wall) | front end until the study is open, CPU s (wall) |",
            "|---|---|---|---|---|---|---|---|---|"]
    for model in MODELS:
        for n in args.n_gpus:
            out = subprocess.run([sys.executable, __file__, "--one", model, str(n)], capture_output=True, text=True,
                                 timeout=args.timeout, env=env, cwd=ROOT)
            if out.returncode:
                rows.append(f"| {model} | {n} | {gbs_for(n)} | error: {out.stderr.strip().splitlines()[-1][:80]} |")
                print(rows[-1], flush=True)
                continue
            r = json.loads(out.stdout.strip().splitlines()[-1])
            fe, _ = front_end(model, n, args.timeout)
            rows.append(f"| {model} | {n} | {gbs_for(n)} | {r['candidates']} | {r['valid']} | {r['build_job']:.2f} | "
                        f"{r['strategy setup+ask']:.2f} | {r['start']:.2f} ({r['start_wall']:.2f}) | "
                        + (f"{fe[0]:.2f} ({fe[1]:.2f}) |" if fe else "- |"))
            print(rows[-1], flush=True)
    # an absurd world size: refused in one line, fast
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "zenithtune", "-m", "n_gpus=1000000000", "gbs=64"], capture_output=True,
                         text=True, timeout=args.timeout, env=env, cwd=ROOT)
    refused = f"n_gpus=10^9: exit {out.returncode} after {time.perf_counter() - t0:.2f} s: `{out.stderr.strip()}`"
    print(refused)
    text = "\n".join([
        "# Study start-up time per world size (benchmarks/startup.py)", "",
        "Start = build_job (model shape, space walk, memory screen of every valid candidate) + the default",
        "(heuristic) strategy's setup and first proposal, in a fresh process after imports. The last column",
        "is the real front end (`python -m zenithtune -m ... n_trials=1`) until the study is open (space",
        "report printed, just before the first launch), interpreter and Hydra start-up included. "
        "gbs = max(64, n_gpus / 4); simulated H100, 8 per node.", "",
        f"Machine: {os.cpu_count()} CPUs, Python {sys.version.split()[0]}, load average {os.getloadavg()[0]:.1f} at the end:",
        "CPU seconds are the comparable figure; wall seconds include waiting for a shared CPU.", "", *rows, "",
        refused, ""])
    if not args.no_write:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(text)
        print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
