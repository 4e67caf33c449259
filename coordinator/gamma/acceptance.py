"""How likely drafts are kept: the model's per position, a lookup's per match
length, and the draft's confidence calibrated against acceptance."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence


@dataclass
class Acceptance:
    """Pooled and per-position conditional acceptance, as EWMAs.

    Each starts as a running mean (step 1/n) and becomes an EWMA once it has
    1/rate observations, so the first rounds count fully and later ones forget.
    """
    alpha: float = 0.6
    count: float = 10.0        # the prior alpha weighs like this many observations
    by_position: list[float] = field(default_factory=list)
    count_by_position: list[float] = field(default_factory=list)
    rate: float = 0.04         # EWMA step: about the last 25 drafted positions
    shrink: float = 5.0        # pseudo-observations pulling a position toward alpha
    stale: float = 0.9         # per round, what a position not judged keeps of its evidence

    def observe(self, drafted: int, accepted: int) -> None:
        # Positions 1..accepted were accepted; position accepted+1 (if drafted) rejected.
        judged = min(drafted, accepted + 1)
        # What was learned of the deeper positions goes stale: text changes. Without
        # this, a stretch at small γ would freeze them at whatever they were, and γ
        # could not grow back when the text gets easier (only judged positions move).
        for i in range(judged, len(self.count_by_position)):
            self.count_by_position[i] *= self.stale
        for i in range(judged):
            hit = 1.0 if i < accepted else 0.0
            self.count += 1
            self.alpha += max(self.rate, 1 / self.count) * (hit - self.alpha)
            while len(self.by_position) <= i:
                self.by_position.append(self.alpha)
                self.count_by_position.append(0.0)
            self.count_by_position[i] += 1
            self.by_position[i] += max(self.rate, 1 / self.count_by_position[i]) * (hit - self.by_position[i])

    def capped(self, weight: float) -> "Acceptance":
        """This estimate as a new request's prior: worth at most `weight` observations,
        so the request's own rounds take over within a few rounds (a running mean
        first, then the EWMA), whatever the text before it was."""
        self.count = min(self.count, weight)
        self.count_by_position = [min(n, weight) for n in self.count_by_position]
        return self

    def age(self, factor: float) -> None:
        """Forget a little while nothing is observed (γ = 0): the next probe's
        observations then weigh like fresh evidence, not like one more sample."""
        self.count *= factor
        self.count_by_position = [n * factor for n in self.count_by_position]

    def _shrunk(self, i: int, prior: float) -> float:
        if i >= len(self.by_position):
            return prior
        n = self.count_by_position[i]
        return (n * self.by_position[i] + self.shrink * prior) / (n + self.shrink)

    def by_positions(self, gamma: int) -> list[float]:
        """Acceptance at positions 0..gamma-1, each given the drafts before it were accepted.

        A position with little data leans on the one before it, not on the pooled
        rate: after a run of accepted drafts the next is at least as likely to be
        accepted (the text is in an easy stretch), while the pooled rate is pulled
        down by the first positions, where hard stretches end rounds. Leaning on
        the pooled rate would keep γ from growing past the positions it has seen."""
        values, prior = [], self.alpha
        for i in range(gamma):
            prior = self._shrunk(i, prior)
            values.append(prior)
        return values

    def at(self, i: int) -> float:
        return self.by_positions(i + 1)[i]

    def expected_tokens(self, gamma: int) -> float:
        total = 1.0
        for kept in cumulative(self.by_positions(gamma))[1:]:
            total += kept
        return total


@dataclass
class Calibration:
    """P(a draft token is accepted | the draft's own probability for it), by
    confidence bin, as EWMAs. A bin with no data yet assumes the draft is
    calibrated (its centre); data pulls it to what the verifier really does.
    Greedy drafts are roughly calibrated; sampled ones are not (a token drawn
    from a flat distribution has a low probability yet is accepted whenever the
    target is as flat), which is why this is learned rather than assumed."""
    bins: int = 10
    rate: float = 0.05
    shrink: float = 3.0
    rates: list[float] = field(default_factory=list)
    counts: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.rates:
            self.rates = [(b + 0.5) / self.bins for b in range(self.bins)]
            self.counts = [0.0] * self.bins

    def _bin(self, confidence: float) -> int:
        return min(self.bins - 1, max(0, int(confidence * self.bins)))

    def observe(self, confidences, accepted: int) -> None:
        for i in range(min(len(confidences), accepted + 1)):  # positions the verifier judged
            b = self._bin(confidences[i])
            self.counts[b] += 1
            self.rates[b] += max(self.rate, 1 / self.counts[b]) * ((1.0 if i < accepted else 0.0) - self.rates[b])

    def accept_probability(self, b: int) -> float:
        centre = (b + 0.5) / self.bins
        return (self.counts[b] * self.rates[b] + self.shrink * centre) / (self.counts[b] + self.shrink)

    def threshold(self, required: float) -> float:
        """The lowest confidence above which every bin is accepted at least
        `required` of the time. Once there is data, bins without any are no
        evidence either way and are skipped."""
        seen = any(n >= 1 for n in self.counts)
        for b in reversed(range(self.bins)):
            if seen and self.counts[b] < 1:
                continue
            if self.accept_probability(b) < required:
                return (b + 1) / self.bins
        return 0.0


# Lookup match lengths (tokens of context behind a lookup): bucket i from MATCH_BUCKETS[i] up.
MATCH_BUCKETS = (1, 2, 3, 5, 9)
# A lookup token's acceptance before any is measured: a longer match, a likelier copy.
LOOKUP_PRIORS = (0.15, 0.3, 0.45, 0.6, 0.75)


def match_bucket(match_length: int) -> int:
    return max(i for i, low in enumerate(MATCH_BUCKETS) if match_length >= low or i == 0)


def lookup_acceptances(prior: float | None = None) -> list[Acceptance]:
    """[match bucket] a free source's acceptance before any is measured: its own prior
    where it registered one (a grammar's forced tokens), else the lookups' by match length."""
    return [Acceptance(alpha=prior if prior is not None else by_match, count=5.0) for by_match in LOOKUP_PRIORS]


def cumulative(acceptance: Sequence[float]) -> list[float]:
    """[n] conditional acceptance -> [n + 1] P(the first i are all kept)."""
    out = [1.0]
    for a in acceptance:
        out.append(out[-1] * min(a, 0.999))
    return out
