"""What the study knows about one candidate, in one answer: the `Assessment` a `Judge` gives.

The study setting (`job.Setting`) is the judge: it checks Megatron's rules and zenithtune's policies,
asks the study's memory model and remembers which injected features the trainer refused. The study
loop screens with it and every strategy reads it, so both see the same answer, memoised per candidate
until the judge learns something new (`Setting.observe`). This module holds only the types, so that
strategies (domain) depend on them and never on the study layer.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from zenithtune.space import Context, Space
    from zenithtune.validate import Layout

MEMORY_RULE = "predicted_oom"  # the rule name a memory screen is recorded under
REFUSED_RULE = "refused"  # ... and a feature the trainer already refused
OOM_DOMINATED_RULE = "oom_dominated"  # ... and a candidate needing at least as much as one that ran out


@dataclass(frozen=True)
class Assessment:
    """One candidate as the study sees it now."""

    layout: Layout  # what the rules and the memory model read of it
    # (rule, reason) pairs that keep it from being launched, from the first check that objects, the
    # checks in order: the job's choices, Megatron's rules and the policies (`Space.reasons`), the
    # memory model, the features the trainer refused. Empty: launch it.
    reasons: tuple[tuple[str, str], ...]
    predicted_gb: float | None  # the memory model's prediction (None: the model's shape is too unknown)
    sd: float | None  # its uncertainty (1 sd, GB)
    oom_risk: float  # probability it runs out of memory (0 when proven to fit)
    proven_fit: bool  # a configuration needing at least as much of every memory component already ran
    predicted_oom: str | None  # why the memory model says it surely runs out of memory, whatever the rules say
    # Proofs by structure (dominance.py), whatever the trainer: why it surely fits (it needs no more
    # memory than a run that fit; then it is never screened for memory and its risk is 0), and why it
    # surely runs out (it needs at least as much as a run that did).
    fit_proof: str | None = None
    oom_dominated: str | None = None
    # A proof by a measured run's peak (memory.MemoryModel.bound): only what differs from that run rests
    # on the estimate, inflated; it stands in for `fit_proof` once a study spent its `max_ooms`.
    bound_proof: str | None = None

    @property
    def fits_surely(self) -> str | None:
        """Why it surely fits (by structure, else by a measured run's bound), or None."""
        return self.fit_proof or self.bound_proof

    @property
    def launchable(self) -> bool:
        return not self.reasons

    @property
    def valid(self) -> bool:
        """Megatron and the policies accept it (memory and refused features aside)."""
        return not self.reasons or self.reasons[0][0] in (MEMORY_RULE, REFUSED_RULE, OOM_DOMINATED_RULE)


class Judge(Protocol):
    """What a strategy is handed at `setup`: the study's facts and its verdict on any candidate."""

    space: Space  # the search space (candidates, keys, layouts, options)
    ctx: Context  # the job: GPUs, batch, model shape

    @property
    def capacity_gb(self) -> float:
        """GPU memory (GB) the memory model judges against."""
        ...

    def assess(self, cand: Mapping[str, Any]) -> Assessment: ...
