"""A real study on Megatron-LM's unmodified pretrain_gpt.py: a tiny GPT, 2 ranks on CPU (gloo).

This is the end-to-end check that the simulator cannot give: zenithtune's injected options must be
ones Megatron itself parses and runs, and every failure must be recorded with what Megatron printed.
Prerequisites (tests/megatron/install.sh): torch CPU, megatron-core 0.19.0; the test is skipped,
saying which is missing, without them. 7 launches of 40-90 s each on 2 cores, nearly all of it
Megatron's start-up (9 min measured on a busy machine). Run alone with ``python -m pytest -q -m megatron tests/megatron``.
"""
from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
LAUNCHER = HERE / "cpu_launch.py"
PRETRAIN_GPT = HERE / "upstream" / "pretrain_gpt.py"

# Scored by iteration time: a model this small prints "throughput per GPU (TFLOP/s/GPU): 0.0".
# The single quotes make the value one Hydra string, so Hydra's grammar leaves ( ) \ alone.
ITERATION_TIME = [
    "evaluator=regex",
    r"evaluator.pattern='elapsed time per iteration \(ms\): ([0-9.]+)'",
    "evaluator.direction=minimize",
    "evaluator.metric_name=ms/iter",
    "evaluator.skip_first=1",  # the first iteration includes warm-up
]

# Failure kinds zenithtune records; a failed launch must carry one of them and Megatron's own words.
KNOWN_KINDS = {"invalid_args", "unsupported", "oom", "crash", "timeout", "no_metric"}

# What torchrun and gloo print when some other rank died: never the cause of a failure.
LAUNCHER_NOISE = ("ChildFailedError", "Connection closed by peer", "SIGTERM")


def _quotes_log(reason: str, log: str) -> bool:
    """True when the reason carries text from the log: zenithtune may prefix it ("exit code 1: ")
    and shorten it, so some tail of it, cut at a ': ', must start a passage of the log."""
    parts = reason.split(": ")
    tails = (": ".join(parts[i:]).strip() for i in range(len(parts)))
    return any(len(tail) >= 12 and tail[:40].rstrip("…") in log for tail in tails)


pytestmark = [pytest.mark.megatron, pytest.mark.slow]


def _missing() -> str | None:
    for module, fix in (("torch", "the torch CPU wheel"), ("megatron.core", "megatron-core 0.19.0")):
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            return f"{module} is not importable: install {fix} with `bash tests/megatron/install.sh`"
    if shutil.which("make") is None or shutil.which("g++") is None:
        return "make and g++ are needed: Megatron compiles its dataset helper at start-up"
    return None


if (why := _missing()) is not None:
    pytest.skip(why, allow_module_level=True)


def tiny_gpt(*extra: str) -> list[str]:
    """torchrun with 2 CPU ranks on pretrain_gpt.py: 4 layers, hidden 64, mock data, 3 iterations."""
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        str(LAUNCHER), str(PRETRAIN_GPT),
        "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "64", "--max-position-embeddings", "64",
        "--micro-batch-size", "1", "--global-batch-size", "8",
        "--train-iters", "3", "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "1000",
        "--lr", "1e-4", "--lr-decay-style", "constant",
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1024",
        # CPU: no Transformer Engine, gloo, and Megatron's own switches for its CUDA-only fusions.
        "--transformer-impl", "local", "--distributed-backend", "gloo", "--use-cpu-initialization",
        "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion", "--no-bias-dropout-fusion",
        "--no-bias-gelu-fusion", "--no-rope-fusion", "--no-persist-layer-norm",
        "--log-throughput",
        *extra,
    ]


def run_study(workdir: Path, overrides: list[str], command: list[str]) -> tuple[list, str]:
    study_dir = workdir / "study"
    argv = [sys.executable, "-m", "zenithtune", "-m", "n_gpus=2", "gbs=8", "strategy=grid",
            "strategy.order=space", "timeout=300", "fail_fast=0", "gpu_memory_gb=16",
            f"hydra.sweep.dir={study_dir}", *ITERATION_TIME, *overrides, "--", *command]
    proc = subprocess.run(argv, cwd=workdir, capture_output=True, text=True, timeout=1500)
    printed = proc.stdout + proc.stderr
    (workdir / "zenithtune.out").write_text(printed)
    assert proc.returncode == 0, printed
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.load_study(study_name="zenithtune", storage=f"sqlite:///{study_dir}/study.db")
    launched = [t for t in study.trials if t.user_attrs.get("launched")]
    return launched, printed


def check_recorded(launched: list, printed: str) -> list[dict]:
    """Every launch either completed with a score or failed with a known kind and Megatron's text."""
    from optuna.trial import TrialState

    done = []
    for t in launched:
        cand = t.user_attrs["candidate"]
        if t.state == TrialState.COMPLETE:
            assert t.value is not None and t.value > 0, (cand, t.value)
            done.append(cand)
            continue
        assert t.state == TrialState.FAIL, (cand, t.state)
        kind, reasons = t.user_attrs.get("kind"), t.user_attrs.get("reasons") or []
        assert kind in KNOWN_KINDS, (cand, kind)
        # The recorded reason is Megatron's own line from the trial log, not torchrun's or gloo's
        # echo of another rank's death, and not only an exit code.
        log = Path(t.user_attrs.get("log") or "")
        text = log.read_text() if log.is_file() else printed
        assert reasons and all(_quotes_log(r, text) for r in reasons), (cand, kind, reasons)
        assert not any(noise in r for r in reasons for noise in LAUNCHER_NOISE), (cand, reasons)
    return done


def test_grid_on_real_pretrain_gpt(tmp_path: Path) -> None:
    # TP 1/2 x PP 1/2 (TP2·PP2 > 2 ranks is pruned) x {full, selective} at MBS 2, and at PP 2 the searched
    # virtual pipeline size: vp 1 and 2 (2 layers per stage; vp 3..8 are pruned): eight launches, the two
    # interleaved ones run by Megatron's interleaved 1F1B schedule from the injected flag. Selective recompute
    # runs Megatron's default module set only: with --transformer-impl local on megatron-core 0.19,
    # --recompute-modules layernorm crashed (NameError FP8GlobalStateManager) and mlp did not finish an
    # iteration in 5 minutes, so the preset's other sets are not searched there (validate.module_idle).
    launched, printed = run_study(tmp_path, [
        "preset.params.tp.values=[1,2]", "preset.params.pp.values=[1,2]",
        "preset.params.cp.values=[1]", "preset.params.mbs.values=[2]",
        "preset.params.recompute_granularity.values=[full,selective]",
        "preset.params.recompute_method.values=[uniform]",
        "preset.params.recompute_num_layers.values=[1]",
    ], tiny_gpt())
    assert len(launched) == 8, printed
    done = check_recorded(launched, printed)
    layouts = {(c["tp"], c["pp"], c.get("vp", 1)) for c in done}
    assert {(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 2, 2)} <= layouts, printed
    interleaved = [t for t in launched if t.user_attrs["candidate"].get("vp") == 2]
    for t in interleaved:
        argv = t.user_attrs.get("argv") or []
        assert argv[argv.index("--num-virtual-stages-per-pipeline-rank") + 1] == "2", argv
    assert {c["recompute_granularity"] for c in done} == {"full", "selective"}, printed
    assert not any("--recompute-modules" in (t.user_attrs.get("argv") or []) for t in launched), printed
    assert {c["mbs"] for c in done} == {2}, printed
    assert "best: trial" in printed


def test_virtual_pipeline_stages_on_real_pretrain_gpt(tmp_path: Path) -> None:
    # The user's command asks for interleaving (4 layers = 2 stages x 2 virtual stages of 1 layer);
    # PP2 must keep it and run Megatron's interleaved 1F1B schedule, at MBS 1 without recompute.
    launched, printed = run_study(tmp_path, [
        "preset.params.tp.values=[1]", "preset.params.pp.values=[2]",
        "preset.params.cp.values=[1]", "preset.params.mbs.values=[1]",
        "preset.params.recompute_granularity.values=[none]",
    ], tiny_gpt("--num-layers-per-virtual-pipeline-stage", "1"))
    assert len(launched) == 1, printed
    (cand,) = check_recorded(launched, printed)
    assert (cand["tp"], cand["pp"], cand["mbs"]) == (1, 2, 1)
    argv = launched[0].user_attrs.get("argv") or []
    assert "--num-layers-per-virtual-pipeline-stage" in argv, argv
