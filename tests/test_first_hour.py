"""A new user's first hour (issue 21): what a typo, the help's group list and the error lines say."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest


def zt(cwd: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZENITHTUNE_")}
    return subprocess.run([sys.executable, "-m", "zenithtune", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.parametrize("typo,line", [
    ("n_trails=5", "zenithtune: error: n_trails=5: n_trails is not a zenithtune key; did you mean n_trials=5?"),
    ("gpu_memory=40", "zenithtune: error: gpu_memory=40: gpu_memory is not a zenithtune key; did you mean gpu_memory_gb=40?"),
    ("strategi=grid", "zenithtune: error: strategi=grid: strategi is not a zenithtune key; did you mean strategy=grid?"),
    ("xyzzy.a=1", "zenithtune: error: xyzzy.a=1: xyzzy is not a zenithtune key; the keys are listed by python -m zenithtune --help"),
])
def test_a_misspelled_key_is_one_line_naming_the_closest_key(tmp_path, typo, line):
    r = zt(tmp_path, "-m", "n_gpus=8", "gbs=64", typo, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip() == line  # not Hydra's five lines ending in the advice `+n_trails=5`
    assert not (tmp_path / "outputs").exists()


@pytest.mark.parametrize("args,line", [
    (["evaluator=xyz"], "zenithtune: error: evaluator=xyz is not an evaluator: choose one of"),
    (["tuned=nosuch"], "zenithtune: error: tuned=nosuch is not a tuned config (./conf/tuned/NAME.yaml): "
                       "there is none yet (save_tuned=NAME writes conf/tuned/NAME.yaml)"),
])
def test_an_unknown_group_option_reads_as_english(tmp_path, args, line):
    r = zt(tmp_path, "-m", "n_gpus=8", "gbs=64", *args, timeout=120)
    assert r.returncode == 2 and r.stderr.startswith(line), r.stderr


@pytest.mark.slow
def test_baseline_is_chosen_like_the_other_groups(tmp_path):
    """--help lists `baseline: stock_tpe` next to `strategy: ...`; `baseline=stock_tpe` runs it (the `+`
    spelling still works)."""
    assert "baseline: stock_tpe" in zt(tmp_path, "--help", timeout=120).stdout
    r = zt(tmp_path, "-m", "baseline=stock_tpe", "n_gpus=8", "gbs=64", "n_trials=2")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("stock hydra/sweeper=optuna (TPESampler): 2 trials"), r.stdout
    r = zt(tmp_path, "-m", "+baseline=stock_tpe", "n_gpus=8", "gbs=64", "n_trials=2")
    assert r.returncode == 0 and "stock hydra/sweeper=optuna" in r.stdout, r.stderr


# --- what real Megatron-LM taught (issue 21, items 16 and 18) ---------------------------------------
SIM = [sys.executable, "-m", "zenithtune.sim", "--num-layers", "32", "--hidden-size", "4096", "--ffn-hidden-size",
       "14336", "--num-attention-heads", "32", "--group-query-attention", "--num-query-groups", "8", "--seq-length",
       "8192", "--max-position-embeddings", "8192", "--vocab-size", "128256", "--swiglu", "--disable-bias-linear",
       "--micro-batch-size", "1", "--global-batch-size", "64", "--bf16", "--use-distributed-optimizer",
       "--log-throughput", "--sim-gpu", "h100", "--sim-world-size", "8", "--train-iters", "10"]


@pytest.mark.slow
def test_context_parallel_under_the_local_implementation_is_never_launched(tmp_path):
    """Megatron's DotProductAttention (what --transformer-impl local builds) asserts cp == 1: the space
    report names the rule and no CP candidate is launched (before: each crashed, one launch apiece)."""
    import optuna

    r = zt(tmp_path, "-m", "n_gpus=8", "gbs=64", "strategy=grid", "strategy.order=space", "storage=s/study.db",
           "preset.params.tp.values=[1]", "preset.params.pp.values=[2]", "preset.params.cp.values=[1,2]",
           "preset.params.mbs.values=[1]", "preset.params.recompute_granularity.values=[selective]",
           "--", *SIM, "--transformer-impl", "local")
    assert r.returncode == 0, r.stderr
    assert ("removed by local_impl_context_parallel: e.g. context parallelism (context parallel size 2) is only "
            "supported by TEDotProductAttention") in r.stdout, r.stdout
    study = optuna.load_study(study_name="zenithtune", storage=f"sqlite:///{tmp_path / 's' / 'study.db'}")
    launched = [t.user_attrs["candidate"] for t in study.trials if t.user_attrs.get("launched")]
    assert launched and all(c["cp"] == 1 for c in launched), launched


@pytest.mark.slow
def test_a_tuned_config_carries_its_evaluator_and_no_absolute_path(tmp_path):
    """A study scored by iteration time (no --log-throughput): `tuned=NAME` reads the score the same way
    and prints it (before: the default evaluator found no throughput line and printed no score); the
    committed file names the interpreter and the study relative to the working directory."""
    import yaml

    plain = [w for w in SIM if w != "--log-throughput"]
    r = zt(tmp_path, "-m", "n_gpus=8", "gbs=64", "n_trials=2", "evaluator=iteration_time", "save_tuned=it8",
           "storage=runs/a/study.db", "--", *plain)
    assert r.returncode == 0, r.stderr
    text = (tmp_path / "conf" / "tuned" / "it8.yaml").read_text()
    data = yaml.safe_load(text)
    assert data["evaluator"]["_target_"] == "zenithtune.evaluate.IterationTime"
    assert data["result"]["study"] == "runs/a/study.db" and f"(trial {data['result']['trial']} of runs/a/study.db)" in text
    assert "# command (before injection): python -m zenithtune.sim --num-layers" in text
    assert str(tmp_path) not in text and sys.executable not in text

    run = zt(tmp_path, "tuned=it8", "--", *plain)
    assert run.returncode == 0, run.stderr
    assert re.search(r"^zenithtune: score [0-9.]+ samples/s/GPU \(log: ", run.stdout, re.M), run.stdout[-1500:]


def test_a_long_screening_says_what_it_is_doing():
    """strategy=grid may screen out hundreds of proposals (minutes) before its next launch: a line every
    SCREEN_EVERY seconds of silence says so (before: nothing until the next launch). Time is a fake clock."""
    import io

    from zenithtune.progress import SCREEN_EVERY, Progress
    from zenithtune.record import Outcome

    now = [0.0]
    out = io.StringIO()
    progress = Progress(total=5, metric="TFLOP/s/GPU", direction="maximize", out=out, interactive=False,
                        clock=lambda: now[0])
    cand = {"tp": 1, "pp": 1, "cp": 2, "mbs": 8, "recompute_granularity": "none"}
    for step in range(300):
        now[0] = step * 0.1  # 300 proposals screened out in 30 s
        progress.skipped(Outcome(candidate=cand, state="pruned", rules=["predicted_oom"], reasons=["..."]))
    lines = out.getvalue().splitlines()
    assert len(lines) == int(29.9 // SCREEN_EVERY) == 2
    assert lines[0] == ("  screening: 101 proposals pruned before launch so far; latest: tp=1 pp=1 cp=2 mbs=8 "
                        "recompute=none (predicted_oom)")
    assert lines[1].startswith("  screening: 201 proposals pruned before launch so far")


@pytest.mark.slow
def test_a_staged_promotion_line_names_what_it_expects_against_the_best(tmp_path):
    """'measured 475.6 ...; it could beat the best by 1 %' read as a contradiction (475.6 is below the best):
    the line now gives the rate the lighter setting could reach and the best it is compared with."""
    r = zt(tmp_path, "-m", "n_gpus=8", "gbs=64", "strategy=staged_blackbox", "n_trials=40", "stage1_trials=10")
    assert r.returncode == 0, r.stderr
    found = re.findall(r"promotion: layout .* measured ([0-9.]+) with .*; with .* it does less work and could reach "
                       r"([0-9.]+), (\d+) % better than the best \(([0-9.]+)\), so it is measured", r.stdout)
    assert found, r.stdout
    for measured, reach, gain, best in found:
        assert float(reach) > float(best) > 0 and float(reach) > float(measured)
        assert abs(100 * (float(reach) / float(best) - 1) - int(gain)) <= 1


@pytest.mark.parametrize("text,shown", [
    # the first clause, whole, though past 160 characters: not "... times context parallel s"
    ("invalid_args: world_divisible: world size (8) is not divisible by tensor model parallel size (2) times pipeline "
     "model parallel size (8) times context parallel size (1) = 16; tp in [1] would divide it at pp=8, cp=1",
     "invalid_args: world_divisible: world size (8) is not divisible by tensor model parallel size (2) times pipeline "
     "model parallel size (8) times context parallel size (1) = 16 ..."),
    ("short; enough", "short; enough"),
    ("crash: " + "word " * 60, "crash: " + "word " * 28 + "word ..."),  # no clause: after a whole word
])
def test_a_long_reason_is_cut_where_a_clause_ends(text, shown):
    from zenithtune.progress import clip

    assert clip(text) == shown


def test_the_gpu_memory_line_says_which_source_it_came_from(tmp_path):
    """'80 GB from nvidia-smi or the 80 GB default' did not say which (no nvidia-smi here: the default)."""
    toy = str(Path(__file__).parent / "fixtures" / "toy_trainer.py")
    env_path = ":".join(p for p in os.environ.get("PATH", "").split(":") if not (Path(p) / "nvidia-smi").exists())
    r = subprocess.run([sys.executable, "-m", "zenithtune", "-m", "n_gpus=2", "gbs=8", "n_trials=1", "--",
                        sys.executable, toy], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                       env={**{k: v for k, v in os.environ.items() if not k.startswith("ZENITHTUNE_")}, "PATH": env_path})
    assert "(8/node, 80 GB from the default (no gpu_memory_gb given, nvidia-smi gave none))" in r.stdout, r.stdout[:500]
