"""The study setting as the judge of every candidate: one `Assessment` per candidate (rules first,
then memory, then what the trainer refused), memoised until the judge learns, and what a strategy is
handed (the judge at `setup`, the wave's pending candidates at `ask`)."""
from __future__ import annotations

import warnings

import optuna
from test_strategies import make_job

from zenithtune.assessment import MEMORY_RULE, REFUSED_RULE
from zenithtune.loop import Launched, StudyLoop
from zenithtune.record import Outcome
from zenithtune.run import FailureKind
from zenithtune.strategies import Proposal, Strategy

warnings.filterwarnings("ignore", category=DeprecationWarning)
optuna.logging.set_verbosity(optuna.logging.ERROR)


def _launched(cand: dict, **kw) -> Outcome:
    return Outcome(candidate=cand, launched=True, **{"trial_number": 0, **kw})


def test_rules_come_first_then_memory_and_the_answer_is_memoised_until_the_judge_learns():
    job = make_job("grid", extra=("gpu_memory_gb=16",))
    broken = {"tp": 3, "pp": 1, "mbs": 1, "recompute_granularity": "none"}  # 3 does not divide 8 GPUs
    assert job.assess(broken).reasons[0][0] == "choices" and not job.assess(broken).valid
    fits = next(c for c in job.space.walk() if job.assess(c).launchable and not job.assess(c).proven_fit)
    first = job.assess(fits)
    assert first is job.assess(dict(fits))  # memoised per candidate
    assert first.predicted_gb and 0 <= first.oom_risk < 1 and first.sd
    # it ran out of memory: the same candidate is now screened by the memory model, and said so
    job.observe(_launched(fits, state="failed", kind=FailureKind.OOM.value, reasons=["CUDA out of memory"]))
    after = job.assess(fits)
    assert after is not first and after.reasons[0][0] == MEMORY_RULE and after.valid
    assert after.predicted_oom and after.predicted_gb > first.predicted_gb
    # a candidate that ran is proven to fit: no risk, whatever the estimate says
    ran = next(c for c in job.space.walk() if job.assess(c).launchable)
    job.observe(_launched(ran, state="complete", value=100.0, measured_gb=5.0))
    assert job.assess(ran).proven_fit and job.assess(ran).oom_risk == 0.0


def test_a_refused_feature_screens_every_candidate_that_carries_it():
    job = make_job("grid")
    cands = list(job.space.walk())
    tp2 = next(c for c in cands if c.get("tp") == 2 and job.assess(c).launchable)
    message = "AssertionError: sequence parallel not supported by torch LayerNorm when instantiating TransformerLayer"
    job.observe(_launched(tp2, state="failed", kind=FailureKind.CRASH.value, reasons=[message], trial_number=3))
    other = next(c for c in cands if c.get("tp") == 4 and job.assess(c).predicted_oom is None)
    rule, why = job.assess(other).reasons[0]
    assert rule == REFUSED_RULE and "--sequence-parallel" in why and "trial 3" in why
    tp1 = next(c for c in cands if c.get("tp") == 1 and job.assess(c).predicted_oom is None)
    assert job.assess(tp1).reasons == ()  # no sequence parallelism at tp=1: not refused


class _Recorder(Strategy):
    """Proposes the space in order, skipping what is pending; records what it was handed."""

    def __init__(self) -> None:
        self.pendings: list[list[dict]] = []

    def ask(self, pending=()):
        self.pendings.append([dict(c) for c in pending])
        for cand in self.space.walk():
            if not self.tried(cand, pending):
                return Proposal(cand, why="recorder")
        return None


def test_a_strategy_is_handed_the_judge_the_evaluator_and_the_pending_wave():
    job = make_job("grid")
    job.strategy = strategy = _Recorder()
    study = optuna.create_study(direction="maximize")
    loop = StudyLoop(job, study, lambda n, cand, t: Launched(100.0 + n), parallel=3)
    loop.start([])
    assert strategy.judge is job and strategy.direction == "maximize" and strategy.metric == job.evaluator.metric_name
    loop.run(3)
    first_wave = [o.candidate for o in loop.outcomes if o.launched]
    assert len(first_wave) == 3 and len({str(c) for c in first_wave}) == 3  # three distinct candidates
    # each ask saw the wave's candidates proposed before it (none is proposed twice)
    assert all(p == first_wave[:len(p)] for p in strategy.pendings)
    assert [len(p) for p in strategy.pendings][-1] == 2


class _Script(Strategy):
    """Proposes the given candidates in order, then stops."""

    def __init__(self, cands: list[dict], probes: list[dict] = ()) -> None:
        self.cands = list(cands)
        self.probes = list(probes)  # proposed as memory probes: launched past the memory screen
        self.proofs: list[str | None] = []  # what the judge said proves each proposal fits, when proposed

    def ask(self, pending=()) -> Proposal | None:
        if not self.cands:
            return None
        cand = self.cands.pop(0)
        self.proofs.append(self.judge.assess(cand).fits_surely)
        return Proposal(dict(cand), why="scripted", probe_memory=cand in self.probes)


def _budget_spent_then(reserved: float | None) -> tuple[Outcome, str | None]:
    """A trainer needing 2.5x the estimate on a 40 GB GPU: tp1 at the largest MBS spends max_ooms=2
    (at pp 1 and 2, launched as memory probes), after a pp2 run fit (reporting its peaks when `reserved` is
    given: reserved / allocated);
    then pp1 at MBS 1, which no run dominates by structure (one stage holds every layer) and which truly
    fits: what becomes of it?"""
    job = make_job("grid", extra=("max_ooms=2", "gpu_memory_gb=40"))
    truth = lambda c: 2.5 * job.memory.estimate(job.space.layout(c)).allocated_gb  # noqa: E731
    tp1 = [c for c in job.space.walk() if (c["tp"], c["pp"], c["cp"]) == (1, 1, 1)]
    ran = next(c for c in job.space.walk() if (c["tp"], c["pp"], c["cp"], c["mbs"]) == (1, 2, 1, 1)
               and c["recompute_granularity"] == "none" and c.get("vp", 1) == 1)
    wider = next(c for c in tp1 if c["mbs"] == 1 and c["recompute_granularity"] == "none")
    big = [next(c for c in job.space.walk() if (c["tp"], c["pp"], c["cp"], c["mbs"]) == (1, pp, 1, 4)
                and c["recompute_granularity"] == "none" and c.get("vp", 1) == 1) for pp in (1, 2)]
    assert all(truth(c) * 1.05 + 2 > 40 for c in big) and truth(wider) * 1.05 + 2 < 40
    assert job.assess(wider).fit_proof is None  # nothing proves it by structure
    job.strategy = script = _Script([ran, *big, wider], probes=big)  # the learned screen would keep big out

    def launch(n: int, cand: dict, timeout: float | None) -> Launched:
        if cand in big:
            return Launched(None, FailureKind.OOM.value, "CUDA out of memory")
        return Launched(100.0, measured_gb=truth(cand), reserved_gb=None if reserved is None else truth(cand) * reserved)

    loop = StudyLoop(job, optuna.create_study(direction="maximize"), launch)
    loop.start([])
    loop.run(10)
    assert sum(o.kind == FailureKind.OOM.value for o in loop.outcomes) == 2, [(o.rules, o.reasons) for o in loop.outcomes]
    return next(o for o in loop.outcomes if o.candidate == wider), script.proofs[-1]


def test_past_max_ooms_a_bound_from_a_measured_peak_proves_a_candidate_structure_cannot():
    o, proof = _budget_spent_then(reserved=1.05)
    assert o.launched and o.ok, o.reasons
    assert proof is not None and proof.startswith("reserves at most") and "trial 0's measured peak" in proof
    assert proof.endswith("within 40 GB less 10 GB at most outside the allocator")


def test_past_max_ooms_without_a_reserved_peak_nothing_unproven_launches():
    o, proof = _budget_spent_then(reserved=None)
    assert proof is None and not o.launched and o.rules == ["oom_budget"]
    assert "max_ooms=2" in o.reasons[0] and "not proven to fit" in o.reasons[0]


def test_a_study_says_up_front_how_many_launches_may_run_out_of_memory():
    from zenithtune.job import memory_limits

    assert memory_limits(make_job("grid")) == ("memory: at most 2 launches may run out of memory (max_ooms), none "
                                               "past the memory screen; after that only what a run that fit proves fits")
    assert "at most 2 launches may run out of memory (max_ooms), 2 of them past the memory screen (memory probes)" \
        in memory_limits(make_job("heuristic"))
    assert "at most 1 launch may run out of memory (max_ooms), 1 of them past" in \
        memory_limits(make_job("staged_blackbox", extra=("max_ooms=1",)))
