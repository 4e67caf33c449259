"""Exploration with a price and a ceiling.

Where a source does not pay on the current estimates the controller still
tries it now and then (a probe), or estimates learned from a bad stretch would
keep it off for good: the drafter's prefill for a request refused it, a model
round after rounds at γ = 0, a lookup bucket judged bad, a token a Decode call
(where a chunk would do) so that a lookup can follow it while lookups keep
nothing (charged its call's cost: policy.decode_steps). A probe is taken only

  - within reach: the acceptance at which the source would pay on the current
    cost curves (its break-even: the least α at which some γ beats target-only
    decoding) is below what this pair has shown in this regime, plus its
    uncertainty (an upper bound, `z` standard errors above the estimate). Where
    the curves change (a quieter machine, a GPU) the break-even moves and
    probes come back by themselves; where they cannot pay at any acceptance
    there is none;
  - within budget: each request may spend at most BUDGET_SHARE of its expected
    target-only time (its expected output, lengths.py) on probes, counted at what they cost beyond target-only
    decoding (a prefill probe all of its time, a probe round its time less the
    tokens it yielded at a target step each).

Every probe taken and its cost are in the request's stats (`probes`) and the
coordinator's metrics.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from coordinator.gamma.acceptance import Acceptance
from coordinator.gamma.bound import expected_tokens, least_acceptance
from coordinator.gamma.cost import CostModel

BUDGET_SHARE = 0.05  # of a request's expected target-only decode time
REACH_Z = 2.0        # standard errors above the acceptance estimate that a probe may hope for
PREFILL, MODEL_ROUND, LOOKUP_ROUND = "drafter_prefill", "model_round", "lookup_round"
LOOKUP_WAIT = "lookup_wait"   # a one-token Decode call kept for a lookup that is not yet keeping tokens


@dataclass
class ProbeCount:
    count: int = 0
    ms: float = 0.0


@dataclass
class Exploration:
    """One request's probes against its budget (None: no ceiling, as for a controller
    outside the engine). `ledger` is where they are counted: the request's stats."""
    budget_ms: float | None = None
    ledger: dict[str, ProbeCount] = field(default_factory=dict)

    @classmethod
    def for_request(cls, cost: CostModel, new_tokens: float, ledger: dict[str, ProbeCount]) -> "Exploration":
        return cls(BUDGET_SHARE * max(new_tokens, 1) * cost.verify_ms(0), ledger)

    @property
    def spent_ms(self) -> float:
        return sum(p.ms for p in self.ledger.values())

    def affordable(self, expected_ms: float) -> bool:
        return self.budget_ms is None or self.spent_ms + max(expected_ms, 0.0) <= self.budget_ms

    def charge(self, kind: str, ms: float) -> None:
        probe = self.ledger.setdefault(kind, ProbeCount())
        probe.count += 1
        probe.ms += max(ms, 0.0)


def upper_acceptance(acceptance: Acceptance, z: float = REACH_Z) -> float:
    """The acceptance this evidence does not rule out: Wilson's upper bound, z standard
    errors above the estimate, over the evidence's count (which ages while nothing is
    judged: with none left, anything up to 1 is in reach)."""
    p, n = acceptance.alpha, max(acceptance.count, 1e-9)
    centre, spread = p + z * z / (2 * n), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return min(1.0, (centre + spread) / (1 + z * z / n))


def break_even(cost: CostModel, gamma_max: int, calls: float = 1.0, drafts_cost: bool = True,
               tolerance: float = 1e-3) -> float | None:
    """The least acceptance α (each draft kept with α given the ones before it) at which
    some γ in 1..gamma_max gives more tokens per ms than target-only decoding, on these
    costs; None where no acceptance does. `drafts_cost`: the model's drafts (a draft step
    each); else free drafts (lookups), which cost only their verify rows."""
    step = max(cost.verify_ms(0, calls), 1e-9)

    def best_speedup(alpha: float) -> float:
        return max(expected_tokens(g, alpha) * step /
                   max((cost.draft_ms(g, calls) if drafts_cost else 0.0) + cost.verify_ms(g, calls), 1e-9)
                   for g in range(1, max(gamma_max, 1) + 1))
    return least_acceptance(best_speedup, tolerance)


def within_reach(acceptance: Acceptance, needed: float | None) -> bool:
    return needed is not None and upper_acceptance(acceptance) >= needed
