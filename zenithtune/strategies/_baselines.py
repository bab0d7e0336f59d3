"""Baselines for the benchmark: flat TPE (what hydra-optuna-sweeper alone gives) and upstream
ZenithTune's heuristic (MEGATRON.md §Upstream), both behind the same interface as ours."""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from zenithtune.record import Outcome
from zenithtune.strategies._base import Proposal, Strategy, tpe_sampler

if TYPE_CHECKING:
    import optuna


class TPEStrategy(Strategy):
    """Optuna's TPE over the whole (flat) space: every parameter is left to the study's sampler.

    Invalid and predicted-OOM samples are screened by the loop (told to TPE as PRUNED), so this is
    already kinder than the stock sweeper, which would launch them. Exhausted when every valid
    candidate has been measured or screened."""

    def __init__(self, seed: int = 0, n_startup_trials: int = 10, multivariate: bool = True):
        self.seed = seed
        self.n_startup_trials = n_startup_trials
        self.multivariate = multivariate
        self._valid: int | None = None

    def sampler(self) -> optuna.samplers.BaseSampler:
        return tpe_sampler(self.seed, self.n_startup_trials, self.multivariate)

    def ask(self, pending: Sequence[dict] = ()) -> Proposal | None:
        if self._valid is None:
            self._valid = sum(1 for _ in self.space.walk())
        # valid candidates already measured or screened for memory/duplication; structural rejects
        # are not part of walk() and do not count
        seen = {self.space.key(o.candidate) for o in self.history
                if o.launched or set(o.rules) <= {"predicted_oom", "duplicate", "oom_dominated", "oom_budget"}}
        if len(seen) >= self._valid:
            self.stop_reason = "every valid candidate was measured or screened"
            return None
        return Proposal({}, why="tpe")


_RECOMPUTE: dict[str, dict[str, Any]] = {"selective": {"recompute_granularity": "selective"},
              "full": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}}


class UpstreamStrategy(Strategy):
    """The seed's heuristic, as documented (MEGATRON.md §Upstream ZenithTune):

    stage 1: TP descending x EP ascending at MBS 1 (selective recompute), PP = CP = ETP = 1;
    stage 2: per TP that ran, an MBS ladder with `selective`, then with `full` (uniform, 1 layer),
    each ladder stopped at its first failure. VLMs: `full` (uniform) only, as upstream. Powers of two only. Upstream's own layout check is
    kept, bug included: it takes DP = N/(tp·ep·etp) and so skips valid MoE layouts such as TP2·EP8 on
    8 GPUs. TP is capped at gpus_per_node (upstream tuned one node at a time)."""

    sequential = True  # each step reads the last step's outcome: one proposal per wave

    def __init__(self, mbs_ladder: tuple[int, ...] = (1, 2, 4, 8)):
        self.mbs_ladder = tuple(int(b) for b in mbs_ladder)
        self._plan: Iterator[Proposal] | None = None
        self._asked: tuple | None = None

    def ask(self, pending: Sequence[dict] = ()) -> Proposal | None:  # sequential: nothing is pending
        if self._plan is None:
            self._plan = self._steps()
        proposal = next(self._plan, None)
        if proposal is None:
            self.stop_reason = "its TP x EP plan and MBS ladders are done"
        self._asked = None if proposal is None else self.space.key(proposal.fixed)
        return proposal

    # --- the plan, one proposal at a time (each resumes after its outcome was told) -----------------
    def _pow2(self, name: str, cap: int | None = None) -> list[int]:
        p = self.space.params.get(name)
        vals = p.choices if p is not None else (1,)
        return [v for v in vals if v & (v - 1) == 0 and (cap is None or v <= cap)]

    def _upstream_ok(self, tp: int, ep: int, mbs: int) -> bool:
        n, gbs = self.ctx.n_gpus, self.ctx.gbs
        if n % (tp * ep):  # upstream: DP = N / (tp·pp·cp·ep·etp), with pp = cp = etp = 1
            return False
        return gbs % (mbs * (n // (tp * ep))) == 0

    def _last(self) -> bool:
        """Did the last proposal run? (A duplicate of a measured run counts as run.)"""
        o = self._last_outcome()
        return o is not None and (o.ok or (o.state == "pruned" and o.rules == ["duplicate"]))

    def _last_outcome(self) -> Outcome | None:
        """The outcome of the last proposal (other workers' outcomes may have been told after it)."""
        for o in reversed(self.history):
            if self._asked is None or self.space.key(o.candidate) == self._asked:
                return o
        return None

    def _steps(self) -> Iterator[Proposal]:
        moe = self.ctx.model.is_moe
        tps = sorted(self._pow2("tp", self.ctx.gpus_per_node), reverse=True)
        eps = sorted(self._pow2("ep")) if moe else [1]
        base: dict = {"pp": 1, "cp": 1}
        if self.ctx.model.is_vlm:
            base["vit_gradient_checkpointing"] = True
        grans = ("full",) if self.ctx.model.is_vlm else ("selective", "full")
        best_ep: dict[int, int] = {}
        for tp in tps:
            for ep in eps:
                if not self._upstream_ok(tp, ep, 1):
                    continue
                cand = {**base, "tp": tp, "mbs": 1, **_RECOMPUTE[grans[0]]}
                if moe:
                    cand.update(ep=ep, etp=1)
                yield Proposal(cand, why=f"upstream stage 1: tp={tp} (descending) x ep={ep} (ascending), mbs 1",
                               stage="upstream-1")
                if self._last():
                    o = self._last_outcome()
                    assert o is not None  # _last() found it
                    prev = best_ep.get(tp)
                    if prev is None or (o.value is not None and self._value(tp, prev) < o.value):
                        best_ep[tp] = ep
        for tp in tps:
            if tp not in best_ep:
                continue
            ep = best_ep[tp]
            for gran in grans:
                for mbs in self.mbs_ladder:
                    if mbs not in self.space.params["mbs"].choices or not self._upstream_ok(tp, ep, mbs):
                        break
                    cand = {**base, "tp": tp, "mbs": mbs, **_RECOMPUTE[gran]}
                    if moe:
                        cand.update(ep=ep, etp=1)
                    if mbs == 1 and gran == grans[0] and self.tried(cand):
                        continue
                    yield Proposal(cand, why=f"upstream stage 2: tp={tp} {gran} MBS ladder, mbs {mbs}",
                                   stage="upstream-2")
                    if not self._last():
                        break

    def _value(self, tp: int, ep: int) -> float:
        for o in self.history:
            if o.ok and o.candidate.get("tp") == tp and o.candidate.get("ep", 1) == ep:
                return float(o.value)  # type: ignore[arg-type]
        return float("-inf")
