"""Cluster-ready studies: storages a user names, several workers on one study, parallel waves.

The concurrency tests start 4 real tuner processes (`python -m zenithtune -m`) on one storage, against
the simulator paced by --sim-time-scale so their trials overlap, and check what a user would: every
worker exits 0, the study holds n_trials measurements (+ at most 3 in flight), no candidate was
launched twice, nothing was lost, and every worker reports the same best."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import optuna
import pytest
from fixtures.waiting import wait_for  # tests/ is on sys.path under pytest
from optuna.trial import TrialState

from zenithtune import study as zstudy
from zenithtune.errors import UserError

WORKERS = 4
N_TRIALS = 6


def zt_popen(cwd: Path, *args: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZENITHTUNE_")}
    return subprocess.Popen([sys.executable, "-m", "zenithtune", *args], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


# --- storages a user names --------------------------------------------------------------------------
def test_storage_forms_are_parsed_in_one_place(tmp_path):
    assert zstudy.storage_url(tmp_path / "x.db") == f"sqlite:///{tmp_path / 'x.db'}"
    assert zstudy.storage_url(f"{tmp_path}/") == f"sqlite:///{tmp_path / 'study.db'}"
    assert zstudy.storage_url(f"journal:{tmp_path}/s.journal") == f"journal:{tmp_path}/s.journal"
    assert zstudy.journal_path(zstudy.storage_url("journal:rel.journal")) == Path("rel.journal").resolve()
    assert zstudy.where("postgresql://tuner:secret@db:5432/zt") == "postgresql://tuner:***@db:5432/zt"


@pytest.mark.parametrize("url, says", [
    ("foo://x", "is not a storage URL zenithtune can open"),
    ("journal:", "names no file"),
    ("journal:/no/such/folder/s.journal", "does not exist"),
    ("postgresql://u:p@127.0.0.1:1/zt", "cannot open storage postgresql://u:***@127.0.0.1:1/zt"),
])
def test_a_storage_that_cannot_be_opened_is_one_line(url, says):
    with pytest.raises(UserError) as e:
        zstudy.open_study(zstudy.storage_url(url), "zt", "maximize")
    assert says in str(e.value) and "\n" not in str(e.value)


def test_unreachable_server_exits_with_one_line(tmp_path):
    p = zt_popen(tmp_path, "-m", "n_gpus=8", "gbs=64", "n_trials=2", "storage=postgresql://u:p@127.0.0.1:1/zt")
    out, err = p.communicate(timeout=120)
    assert p.returncode == 2, err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("zenithtune: error: cannot open storage postgresql://u:***@")


# --- liveness and claims, in one process -----------------------------------------------------------
def test_only_trials_of_dead_workers_are_failed(tmp_path):
    url = zstudy.storage_url(tmp_path / "s.db")
    study = zstudy.open_study(url, "zt", "maximize", heartbeat_interval=1, grace_period=2)
    live, dead = zstudy.Liveness(study, 1, 2), zstudy.Liveness(study, 1, 2)
    a, b = study.ask(), study.ask()
    for t in (a, b):
        t.set_user_attr("launched", True)
    live.hold(a)
    dead.hold(b)
    dead.stop()  # its worker dies: no more beats
    dead.release(b.number)
    time.sleep(3.5)
    assert live.fail_stale() == [b.number]
    states = {t.number: t.state for t in study.get_trials()}
    assert states == {a.number: TrialState.RUNNING, b.number: TrialState.FAIL}
    live.stop()
    # the dead worker's trial reads as interrupted: it measured nothing and may be retried
    from zenithtune.record import outcome_of
    assert outcome_of(study.get_trials()[b.number]).kind == "interrupted"


@pytest.mark.parametrize("kind", ["sqlite", "journal", "memory"])
def test_optunas_private_storage_is_where_internals_reads_it(tmp_path, kind):
    # Liveness and claims read what Optuna keeps private, all of it through study.Internals. Pinned to
    # the Optuna series it was written for: an upgrade fails here first, with what to check.
    assert optuna.__version__.startswith(zstudy.OPTUNA_WRITTEN_FOR), (
        f"Optuna {optuna.__version__}: check zenithtune.study.Internals against it, then OPTUNA_WRITTEN_FOR")
    url = {"sqlite": zstudy.storage_url(tmp_path / "s.db"), "journal": f"journal:{tmp_path}/s.journal"}.get(kind)
    study = zstudy.open_study(url, "zt", "maximize", heartbeat_interval=60 if kind == "sqlite" else None) if url \
        else optuna.create_study(study_name="zt")
    internals = zstudy.Internals(study)
    trial = study.ask()
    trial_id = zstudy.Internals.trial_id(trial)
    assert study._storage.get_trial(trial_id).number == trial.number  # the storage's public getters
    assert internals.study_id == study._storage.get_study_id_from_name("zt")
    assert internals.native_heartbeat() is (kind == "sqlite")
    assert (internals.engine() is not None) is (kind == "sqlite")
    assert internals.journal_file() == (tmp_path / "s.journal" if kind == "journal" else None)
    internals.beat(trial_id, internals.native_heartbeat())
    assert zstudy.BEAT_ATTR in study.get_trials()[0].system_attrs
    internals.fail(trial_id)
    assert study.get_trials()[0].state == TrialState.FAIL


@pytest.mark.parametrize("kind", ["sqlite", "journal", "memory"])
def test_a_candidate_is_claimed_once(tmp_path, kind):
    url = {"sqlite": zstudy.storage_url(tmp_path / "s.db"), "journal": f"journal:{tmp_path}/s.journal"}.get(kind)
    study = zstudy.open_study(url, "zt", "maximize") if url else optuna.create_study()
    first, second = zstudy.Claims(study), zstudy.Claims(study)  # two workers
    key = zstudy.claim_key((("tp", 2), ("pp", 1)))
    assert first.claim(key, 0, dead=lambda n: False) is None
    if kind != "memory":  # one process's memory is not shared
        assert second.claim(key, 1, dead=lambda n: False) == 0
        assert second.claim(key, 2, dead=lambda n: n == 0) is None  # trial 0 was interrupted: taken over
        assert first.claim(key, 3, dead=lambda n: False) == 2


# --- 4 workers, one study ----------------------------------------------------------------------------
def _postgres(tmp_path: Path) -> str:
    """A throw-away PostgreSQL server (initdb + pg_ctl, as the postgres user when run as root)."""
    binaries = [shutil.which("initdb")] + sorted(str(p) for p in Path("/usr/lib/postgresql").glob("*/bin/initdb"))
    initdb = next((b for b in binaries if b), None)
    if initdb is None:
        pytest.skip("PostgreSQL is not installed (initdb not found; .ci/run installs Debian's postgresql)")
    bindir = Path(initdb).resolve().parent  # /usr/local/bin holds links to some of them only
    as_user: list[str] = []
    if os.geteuid() == 0:  # initdb refuses root; pytest's tmp_path is private to root
        if shutil.which("runuser") is None:
            pytest.skip("running as root and runuser is missing: cannot start PostgreSQL as another user")
        data = Path(tempfile.mkdtemp(prefix="zenithtune-pg-"))
        shutil.chown(data, "postgres")
        as_user = ["runuser", "-u", "postgres", "--"]
    else:
        data = tmp_path / "pg"
        data.mkdir()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = subprocess.run(as_user + [str(bindir / "initdb"), "-D", str(data), "-U", "zt", "--auth=trust"],
                       capture_output=True, text=True, cwd="/")
    if r.returncode:
        pytest.skip(f"PostgreSQL's initdb failed here: {r.stderr.strip().splitlines()[-1:]}")
    r = subprocess.run(as_user + [str(bindir / "pg_ctl"), "-D", str(data), "-w", "-l", str(data / "log"),
                                  "-o", f"-p {port} -k {data} -c listen_addresses=127.0.0.1", "start"],
                       capture_output=True, text=True, cwd="/")
    if r.returncode:
        pytest.skip(f"PostgreSQL did not start: {r.stdout.strip()[-300:]}")
    _postgres.stop = (as_user + [str(bindir / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop"], data)  # type: ignore[attr-defined]
    r = subprocess.run(as_user + [str(bindir / "createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", "zt", "zt"],
                       capture_output=True, text=True, cwd="/")
    if r.returncode:
        subprocess.run(_postgres.stop[0], capture_output=True, cwd="/")  # type: ignore[attr-defined]
        pytest.fail(f"PostgreSQL started but createdb failed: {r.stderr.strip()}")
    return f"postgresql://zt@127.0.0.1:{port}/zt"


@pytest.fixture
def storage(request, tmp_path):
    kind = request.param
    if kind == "sqlite":
        yield str(tmp_path / "shared" / "study.db")
    elif kind == "journal":
        (tmp_path / "shared").mkdir()
        yield f"journal:{tmp_path / 'shared' / 'study.journal'}"
    else:
        pytest.importorskip("psycopg", reason="pip install 'zenithtune[cluster]' for PostgreSQL")
        url = _postgres(tmp_path)
        yield url
        stop, data = _postgres.stop  # type: ignore[attr-defined]
        subprocess.run(stop, capture_output=True, cwd="/")
        shutil.rmtree(data, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.parametrize("storage", ["sqlite", "journal", "postgres"], indirect=True)
def test_four_workers_share_one_study(tmp_path, storage):
    args = ["-m", "n_gpus=8", "gbs=64", "strategy=grid", f"n_trials={N_TRIALS}", f"storage={storage}",
            "heartbeat_interval=1", "heartbeat_grace=30", "--", sys.executable, "-m", "zenithtune.sim",
            "--num-layers=32", "--hidden-size=4096", "--ffn-hidden-size=14336", "--num-attention-heads=32",
            "--group-query-attention", "--num-query-groups=8", "--seq-length=8192", "--max-position-embeddings=8192",
            "--vocab-size=128256", "--swiglu", "--disable-bias-linear", "--micro-batch-size=1",
            "--global-batch-size=64", "--train-iters=10", "--bf16", "--use-distributed-optimizer",
            "--log-throughput", "--sim-world-size=8", "--sim-time-scale=0.02"]
    procs = [zt_popen(tmp_path, *args) for _ in range(WORKERS)]
    results = [p.communicate(timeout=400) for p in procs]
    for p, (_, err) in zip(procs, results):
        assert p.returncode == 0, err[-3000:]
        assert "Traceback" not in err
    study = optuna.load_study(study_name="zenithtune", storage=zstudy.open_storage(zstudy.storage_url(storage)))
    trials = study.get_trials()
    launched = [t for t in trials if t.user_attrs.get("launched")]
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    assert N_TRIALS <= len(complete) <= N_TRIALS + WORKERS - 1, [t.state for t in launched]
    assert all(t.state != TrialState.RUNNING for t in trials)
    keys = [json.dumps(t.user_attrs["candidate"], sort_keys=True) for t in launched]
    assert len(keys) == len(set(keys)), "a candidate was launched twice"
    assert len(complete) == len(launched), "a launched trial lost its result"
    # every worker reports the same, final best
    best_lines = {next(line for line in out.splitlines() if line.startswith("best: trial")) for out, _ in results}
    top = max(complete, key=lambda t: t.value)
    assert len(best_lines) == 1 and best_lines.pop().startswith(f"best: trial {top.number} "), best_lines


# --- trials as Slurm jobs -----------------------------------------------------------------------------
@pytest.mark.parametrize("n_gpus, timeout, extra, nodes, gpus, cpus, minutes", [
    (16, 900, [], 2, 8, 32, 25),
    (4, None, [], 1, 4, 16, 1440),  # less than a node: n_gpus GPUs, not the node's 8
    (64, 60, ["slurm.cpus_per_task=12"], 8, 8, 12, 11),
    (16, 900, ["slurm.gpus=false"], 2, None, 1, 25),  # a CPU-only / GRES-less cluster: no --gpus-per-node
    (2, None, ["gpus_per_node=1", "slurm.gpus=false", "slurm.cpus_per_task=2"], 2, None, 2, 1440)])
def test_slurm_launcher_sizes_one_trial_job(n_gpus, timeout, extra, nodes, gpus, cpus, minutes):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="pip install 'zenithtune[cluster]'")
    from hydra import compose, initialize_config_module

    with initialize_config_module(config_module="zenithtune.conf", version_base=None):
        cfg = compose("config", overrides=["hydra/launcher=slurm", f"n_gpus={n_gpus}", "gbs=128",
                                           f"timeout={timeout if timeout else 'null'}", *extra],
                      return_hydra_config=True)
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher")
    assert (launcher.nodes, launcher.gpus_per_node, launcher.tasks_per_node, launcher.cpus_per_task,
            launcher.timeout_min) == (nodes, gpus, 1, cpus, minutes)


@pytest.mark.parametrize("value, says", [("slurm.cpus_per_task=0", "slurm.cpus_per_task=0 must be at least 1"),
                                         ("slurm.queue_timeout=-5", "slurm.queue_timeout=-5.0 must be > 0 seconds")])
def test_bad_slurm_values_are_one_line(tmp_path, value, says):
    p = zt_popen(tmp_path, "-m", "n_gpus=8", "gbs=64", "n_trials=1", value)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith(f"zenithtune: error: {says}"), err


@pytest.mark.parametrize("state, kind", [("TIMEOUT", "timeout"), ("DEADLINE", "timeout"), ("CANCELLED", "cancelled"),
                                         ("OUT_OF_MEMORY", "crash"), ("COMPLETED", None), ("FAILED", None)])
def test_slurms_end_state_decides_the_kind_only_where_it_knows_better(state, kind):
    from zenithtune import slurm

    assert slurm.outcome_kind(state) == kind


def test_sbatchs_refusal_is_kept_in_its_own_words():
    from zenithtune import slurm

    err = RuntimeError("sbatch: error: Batch job submission failed: Invalid generic resource (gres) specification\n")
    assert slurm._sbatch_words(err) == \
        "sbatch: error: Batch job submission failed: Invalid generic resource (gres) specification"


def test_a_multi_node_trial_is_scored_by_the_node_that_printed_the_metric(tmp_path, monkeypatch):
    from zenithtune import record, slurm
    from zenithtune.record import Launched

    monkeypatch.setenv("SLURM_NNODES", "2")
    monkeypatch.setenv("SLURM_NODEID", "1")
    assert slurm.node_suffix() == ".node1"
    monkeypatch.setenv("SLURM_NODEID", "0")
    assert slurm.node_suffix() == ""
    assert slurm.collect(tmp_path) is None
    record.write_run(tmp_path / "trial.json", Launched(None, "no_metric", "no throughput line"))
    assert slurm.collect(tmp_path).kind == "no_metric"  # type: ignore[union-attr]
    record.write_run(tmp_path / "trial.node1.json", Launched(412.0, log=str(tmp_path / "trial.node1.log")))
    assert slurm.collect(tmp_path).value == 412.0  # type: ignore[union-attr]


def test_a_half_filled_wave_is_launched_when_the_proposals_run_dry():
    """parallel_trials=4 and a strategy that keeps proposing what the wave already holds (flat TPE on a
    small space does): the wave's one candidate runs; it is not dropped as 'used by other workers'."""
    from hydra import compose, initialize_config_module

    from zenithtune import record, settings
    from zenithtune.job import build_job
    from zenithtune.loop import Launched, StudyLoop
    from zenithtune.strategies import Proposal
    from zenithtune.strategies._base import Strategy

    with initialize_config_module("zenithtune.conf"):
        job = build_job(settings.load(compose("config", overrides=["n_gpus=8", "gbs=64", "strategy=grid"])))
    first = next(c for c in job.space.walk() if job.assess(c).launchable)

    class Same(Strategy):
        def ask(self, pending=()) -> Proposal | None:
            return Proposal(dict(first), why="the same again")

    job.strategy = Same()
    study = optuna.create_study(direction="maximize", sampler=job.strategy.sampler())
    loop = StudyLoop(job, study, lambda n, cand, t: Launched(100.0 + n), max_consecutive_skips=3, parallel=4)
    loop.start([])
    why = loop.run(8)
    assert why.startswith("3 proposals in a row could not be launched")
    outcomes = record.history(study)
    assert [(o.state, o.value) for o in record.launched(outcomes)] == [("complete", 100.0)]
    assert all(not o.launched for o in outcomes if o.state == "pruned")


TRAINER = '''
import os, signal, sys, time
slot = 0
while True:  # the first trial to start runs fine, the second past its timeout, the third is cancelled
    try:
        os.close(os.open(os.path.join(os.path.dirname(__file__), f"slot{slot}"), os.O_CREAT | os.O_EXCL))
        break
    except FileExistsError:
        slot += 1
if slot == 2:  # its job is cancelled under it (scancel; here: the job process is killed)
    os.kill(os.getppid(), signal.SIGKILL)
    time.sleep(60)
if slot == 1:
    time.sleep(60)
print(" iteration 3/3 | elapsed time per iteration (ms): 100.0 | throughput per GPU (TFLOP/s/GPU): "
      "101.0 | global batch size:     8 |", flush=True)
'''


@pytest.mark.slow
def test_trials_as_submitit_jobs_including_a_cancelled_and_a_timed_out_one(tmp_path):
    """submitit's local executor runs the code path of Slurm (pickled job, job folder, results)."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="pip install 'zenithtune[cluster]'")
    (tmp_path / "trainer.py").write_text(TRAINER)
    p = zt_popen(tmp_path, "-m", "hydra/launcher=submitit_local", "n_gpus=4", "gbs=8", "strategy=grid",
                 "n_trials=3", "parallel_trials=3", "timeout=8", "fail_fast=0",
                 # the trainer's model has no shape, so no candidate is proven to fit: with the default OOM
                 # budget (2) a wave could hold only 2 of them, and this test is about one wave of 3 jobs
                 "max_ooms=3", "evaluator.skip_first=0",  # its one metric line is no warm-up
                 "--", sys.executable, str(tmp_path / "trainer.py"))
    out, err = p.communicate(timeout=400)
    assert p.returncode == 0, err[-3000:]
    assert "Traceback" not in err
    db = next((tmp_path / "outputs").glob("study_*/study.db"))
    study = optuna.load_study(study_name="zenithtune", storage=f"sqlite:///{db}")
    launched = {t.user_attrs.get("kind"): t for t in study.get_trials() if t.user_attrs.get("launched")}
    assert set(launched) == {None, "timeout", "crash"}, [t.user_attrs for t in study.get_trials()]
    ok, cancelled = launched[None], launched["crash"]
    assert ok.state == TrialState.COMPLETE and ok.value == 101.0
    assert Path(ok.user_attrs["log"]).parent.name == f"trial_{ok.number}"
    assert cancelled.state == TrialState.FAIL and "the launcher lost the job" in cancelled.user_attrs["reasons"][0]
    assert "best: trial" in out


def test_a_nodes_clean_up_spares_the_other_nodes_of_its_trial_on_the_same_host(tmp_path, monkeypatch):
    """Two nodes of one multi-node trial on one host (as in a one-machine Slurm): node 1's command exits
    first, and its clean-up (which kills what carries its trial's marker) must leave node 0's command
    running. Synchronised on files: node 0's command writes `started`, then waits for `go`."""
    import threading

    from hydra import compose, initialize_config_module
    from omegaconf import open_dict

    from zenithtune import app, settings

    script = tmp_path / "trainer.py"
    script.write_text(
        "import os, sys, time\n"
        "here = os.path.dirname(os.path.abspath(__file__))\n"
        "if os.environ['SLURM_NODEID'] == '0':\n"
        "    open(os.path.join(here, 'started'), 'w').close()\n"
        "    while not os.path.exists(os.path.join(here, 'go')):\n"
        "        time.sleep(0.05)\n"
        "print(' throughput per GPU (TFLOP/s/GPU): 101.0 |', flush=True)\n")
    with initialize_config_module("zenithtune.conf"):
        cfg = compose("config", overrides=["n_gpus=8", "gbs=64", "evaluator.skip_first=0"])
    with open_dict(cfg):
        cfg.command = [sys.executable, str(script)]
        cfg.params = {"tp": 1, "pp": 1, "cp": 1, "mbs": 1, "recompute_granularity": "none"}
        cfg.timeout = 120.0
    conf = settings.load(cfg)
    monkeypatch.setenv("SLURM_NNODES", "2")
    results: dict[str, object] = {}

    def node(k: str) -> None:
        os.environ["SLURM_NODEID"] = k  # the threads run one at a time: node 0 starts, then node 1
        try:
            results[k] = app.task(conf, tmp_path / "trial_0")
        except BaseException as err:  # noqa: BLE001 - recorded for the assertion below
            results[k] = err

    monkeypatch.setenv("SLURM_NODEID", "0")
    first = threading.Thread(target=node, args=("0",))
    first.start()
    wait_for(lambda: (tmp_path / "started").exists(), 120, "node 0's command to start")
    node("1")  # exits at once; its clean-up runs before this returns
    assert results["1"] == 101.0
    (tmp_path / "go").touch()
    first.join(timeout=120)
    assert results["0"] == 101.0, results["0"]
    assert "exit code 0" in (tmp_path / "trial_0" / "trial.log").read_text()
