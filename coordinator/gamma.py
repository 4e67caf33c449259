"""Choosing γ, the number of draft tokens per round, per request.

Goodput is E[tokens per round] / E[round time]. With conditional acceptance
a_i (draft i accepted, given drafts before it were),

    E[tokens | γ] = 1 + sum_{k=1..γ} prod_{i=1..k} a_i,

which is Leviathan et al.'s (1 - α^(γ+1)) / (1 - α) when every a_i = α. Round
time is draft(γ) + verify(γ), each a line in γ fitted online from measured
rounds (drafting costs per token; verifying γ tokens costs about one forward
plus a little per token). γ = 0 is plain target decoding: no drafter call.

* acceptance is an EWMA over per-position observations; per-position estimates
  are shrunk toward the pooled one until they have data of their own;
* hysteresis: γ moves only when the best γ beats the current one by a margin;
* at γ = 0 nothing is observed, so a probe round drafts `probe_gamma` tokens
  after `probe_every` rounds, with the interval doubling while probes fail;
* a prior shared across requests, one per sampling regime (greedy, or a
  temperature bucket): a request starts from the recent average, worth a few
  rounds of its own, and returns what it learned when it ends;
* positions a round did not reach lose weight, so a stretch at small γ does
  not freeze the estimates of the deeper positions;
* within a round, γ is an upper bound: the drafter stops after a token it is
  unsure of (`min_confidence`), so easy stretches get long drafts and hard ones
  short drafts, which no fixed γ can do;
* under load, the model services batch the rows of many requests into one
  forward (continuous batching), and the drafter's forwards take the cores the
  verifier's need. A round's cost is then its share of the work when all n
  requests in flight draft as this one does: γ·draft_curve(n)/n for its draft
  steps and verify_curve(n·(γ+1))/n for its verify (`ServiceLoad`: the
  coordinator's requests in flight, or the calls per forward the verifier
  reports, whichever is more). A forward's fixed cost is shared, its rows are
  not: as n grows, rejected drafts cost more than they save and γ falls to 0;
  it rises again as n falls;
* free drafts (n-gram lookups, `plan`): a lookup token costs only its verify
  row, a model token a draft step too. Acceptance of lookup tokens is learned
  per match length (how many tokens of context back the lookup), and each round
  takes the number of lookup tokens, then of model tokens after them, that
  maximizes goodput; a lookup that does not pay is still tried now and then.
"""
from __future__ import annotations

import copy
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Sequence

from specdec.cost_curve import RowCost
from specdec.proposer import BatchLoad, Lookup
from specdec.sampling import SamplingConfig

from coordinator.rounds import RoundRecord


class EwLinearFit:
    """y ≈ a + b·x, fitted with exponential forgetting.

    While x does not vary (a fixed γ), a and b cannot be told apart, so a weak
    prior on their ratio decides the split: `b_over_a` (verifying: each extra
    token costs a small fraction of the forward) or `a_over_b` (drafting: the
    fixed cost is a small fraction of a token's)."""

    def __init__(self, *, default: tuple[float, float], b_over_a: float | None = None,
                 a_over_b: float | None = None, decay: float = 0.98, weight: float = 0.1):
        assert (b_over_a is None) != (a_over_b is None)
        # The prior penalizes u·(a, b): b - r·a, or a - r·b.
        self.u = (-b_over_a, 1.0) if b_over_a is not None else (1.0, -a_over_b)
        self.default, self.decay, self.weight = default, decay, weight
        self.sw = self.sx = self.sxx = self.sy = self.sxy = 0.0

    def observe(self, x: float, y: float) -> None:
        d = self.decay
        self.sw, self.sx, self.sxx = d * self.sw + 1, d * self.sx + x, d * self.sxx + x * x
        self.sy, self.sxy = d * self.sy + y, d * self.sxy + x * y

    def coefficients(self) -> tuple[float, float]:
        if self.sw == 0:
            return self.default
        # Normal equations of sum w (y - a - b x)^2 + λ S (u·(a, b))^2, S ~ x² (tokens²).
        lam = self.weight * 16.0
        ua, ub = self.u
        m11, m12, m22 = self.sw + lam * ua * ua, self.sx + lam * ua * ub, self.sxx + lam * ub * ub
        det = m11 * m22 - m12 * m12
        return (self.sy * m22 - m12 * self.sxy) / det, (m11 * self.sxy - m12 * self.sy) / det

    def __call__(self, x: float) -> float:
        a, b = self.coefficients()
        return max(0.0, a + b * x)


class RowCurve:
    """Verify time by rows (γ + 1 per round), starting from the verifier's measured
    cost curve and learned per row count: a row count seen in rounds has its own
    EWMA; one not seen yet is its measured forward plus the offset the seen ones
    show over theirs (the RPC and the rejection sampler, which the curve leaves
    out). Rows are not free in every precision (int4 takes 4 a kernel pass, so the
    5th costs as much again), which a line in γ cannot represent."""

    def __init__(self, measured: Sequence[float], rate: float = 0.1):
        assert measured, "a curve needs at least the 1-row forward"
        self.measured = [float(ms) for ms in measured]          # [rows - 1] -> ms
        self.forward_ms = RowCost(self.measured)                # a forward over any rows: a batch's
        self.estimate = list(self.measured)
        self.seen = [0] * len(self.measured)
        self.offset, self.offset_count, self.rate = 0.0, 0, rate

    def observe(self, rows: int, ms: float) -> None:
        i = rows - 1
        if not 0 <= i < len(self.measured):
            return
        self.seen[i] += 1
        self.estimate[i] += max(self.rate, 1 / self.seen[i]) * (ms - self.estimate[i])
        self.offset_count += 1
        self.offset += max(self.rate, 1 / self.offset_count) * (ms - self.measured[i] - self.offset)

    def __call__(self, rows: int) -> float:
        i = min(max(rows, 1), len(self.measured)) - 1
        value = self.estimate[i] if self.seen[i] else self.measured[i] + self.offset
        if rows > len(self.measured):
            value += (rows - len(self.measured)) * self.forward_ms.slope
        return max(value, 0.0)


@dataclass
class CostModel:
    """Round time in ms as a function of γ, learned from measured rounds."""
    # Before any round is measured: a draft token at 1/4 of a target step,
    # verifying γ tokens at one step plus 5% per token.
    draft: EwLinearFit = field(default_factory=lambda: EwLinearFit(default=(1.0, 25.0), a_over_b=0.05))
    verify: EwLinearFit = field(default_factory=lambda: EwLinearFit(default=(100.0, 5.0), b_over_a=0.05))
    verify_curve: RowCurve | None = None  # from the verifier's Info; the line above is the fallback
    draft_curve: RowCurve | None = None   # from the drafter's Info: its batched draft steps under load
    # The proposer's prefill, ms per prompt token (0: free or unknown): from the
    # drafter's Info, then an EWMA over measured prefills.
    draft_prefill: float = 0.0
    draft_prefills_seen: int = 0
    # Plan on the services' published curves alone, never on measured rounds: the
    # choice of γ is then the same on every machine (tests, policy comparisons).
    frozen: bool = False

    @classmethod
    def from_curves(cls, draft_ms: Sequence[float], verify_ms: Sequence[float],
                    draft_prefill_ms_per_token: float = 0.0) -> "CostModel":
        """Start from the services' measured curves (either may be empty: not measured)."""
        model = cls(draft_prefill=float(draft_prefill_ms_per_token))
        if draft_ms:  # a draft token: one 1-row forward, plus a little for sampling and the RPC
            model.draft = EwLinearFit(default=(1.0, float(draft_ms[0]) * 1.1), a_over_b=0.05)
            model.draft_curve = RowCurve(draft_ms)
        if verify_ms:
            model.verify_curve = RowCurve(verify_ms)
        return model

    def observe_draft_prefill(self, tokens: int, ms: float, rate: float = 0.2) -> None:
        if tokens <= 0 or self.frozen:
            return
        self.draft_prefills_seen += 1
        self.draft_prefill += max(rate, 1 / self.draft_prefills_seen) * (ms / tokens - self.draft_prefill)

    def draft_prefill_ms(self, tokens: int) -> float:
        return self.draft_prefill * tokens

    def observe(self, gamma: int, draft_ms: float, verify_ms: float, draft_alone: bool = True,
                verify_alone: bool = True, model_tokens: int | None = None) -> None:
        """A round's timings: `gamma` tokens verified, `model_tokens` of them drafted
        by the model (the rest were free lookups; None: all). Only calls that ran
        alone in their forwards teach the cost of γ: a batched call's time is the
        batch's, which the load accounts for."""
        if self.frozen:
            return
        model_tokens = gamma if model_tokens is None else model_tokens
        if model_tokens > 0 and draft_alone:
            self.draft.observe(model_tokens, draft_ms)
        if not verify_alone:
            return
        if self.verify_curve is not None:
            self.verify_curve.observe(gamma + 1, verify_ms)
        else:
            self.verify.observe(gamma, verify_ms)

    def verify_ms(self, gamma: int, calls: float = 1.0) -> float:
        """A round's verify cost at γ when `calls` calls share each forward, all of
        them with γ + 1 rows: this call's share of the batch."""
        if self.verify_curve is None:
            return self.verify(gamma)
        if calls <= LOAD_ALONE:
            return self.verify_curve(gamma + 1)
        return self.verify_curve.forward_ms(calls * (gamma + 1)) / calls + self.verify_curve.offset

    def draft_ms(self, gamma: int, calls: float = 1.0) -> float:
        """A round's draft cost at γ: alone, the fitted line; when `calls` requests
        all draft, its share of γ batched draft steps of that many rows."""
        if gamma <= 0:
            return 0.0
        alone = self.draft(gamma)
        if calls <= LOAD_ALONE or self.draft_curve is None:
            return alone
        # The forwards are shared; what a call costs beyond them (RPC, sampling) is not.
        forward = gamma * self.draft_curve.forward_ms(1)
        return gamma * self.draft_curve.forward_ms(calls) / calls + max(alone - forward, 0.0)

    def round_ms(self, gamma: int, calls: float = 1.0) -> float:
        return self.draft_ms(gamma, calls) + self.verify_ms(gamma, calls)

    def call_overhead_ms(self) -> float:
        """What a verifier call costs beyond its forward (RPC, sampling): the offset
        measured rounds show over the curve (0 without a curve)."""
        return max(self.verify_curve.offset, 0.0) if self.verify_curve is not None else 0.0

    def marginal_verify_ms(self, gamma: int, calls: float = 1.0) -> float:
        """What verifying one more draft token costs on top of γ of them."""
        return max(self.verify_ms(gamma + 1, calls) - self.verify_ms(gamma, calls), 0.0)


LOAD_ALONE = 1.05  # calls per forward at or below which a call counts as having run alone


class ServiceLoad:
    """How many requests share the model services now: the coordinator's own
    requests in flight, or (another coordinator's too) the calls per verifier
    forward its responses report, an EWMA fading back to 1 while no response
    comes; whichever is more. Shared by the requests of a coordinator."""

    def __init__(self, rate: float = 0.3, fade_s: float = 2.0, clock=time.monotonic):
        self.rate, self.fade_s, self._clock = rate, fade_s, clock
        self._calls, self._at = 1.0, clock()
        self._lock = threading.Lock()
        self.in_flight = 0

    def enter(self) -> None:
        with self._lock:
            self.in_flight += 1

    def leave(self) -> None:
        with self._lock:
            self.in_flight -= 1

    def observe(self, batch: BatchLoad) -> None:
        if batch.forwards == 0:
            return
        calls = self._reported()  # faded to now, then moved toward what was seen
        self._calls, self._at = calls + self.rate * (batch.mean_calls - calls), self._clock()

    def _reported(self) -> float:
        return 1.0 + (self._calls - 1.0) * math.exp(-(self._clock() - self._at) / self.fade_s)

    @property
    def calls(self) -> float:
        return max(self._reported(), float(self.in_flight))


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
        for kept in _cumulative(self.by_positions(gamma))[1:]:
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


def lookup_acceptances() -> list[Acceptance]:
    return [Acceptance(alpha=prior, count=5.0) for prior in LOOKUP_PRIORS]


@dataclass(frozen=True)
class Plan:
    """A round's draft: `ngram` lookup tokens first, then `model` tokens drafted after them."""
    ngram: int = 0
    model: int = 0

    @property
    def drafted(self) -> int:
        return self.ngram + self.model


@dataclass
class ControllerState:
    acceptance: Acceptance = field(default_factory=Acceptance)   # the model's drafts
    cost: CostModel = field(default_factory=CostModel)
    calibration: Calibration = field(default_factory=Calibration)
    rounds: int = 0
    lookup: list[Acceptance] = field(default_factory=lookup_acceptances)  # [match bucket] lookup drafts


class GammaController:
    """Per request: `next_gamma(limit)` before a round, `observe(...)` after it."""

    def __init__(self, gamma_max: int, state: ControllerState | None = None, *, initial_gamma: int = 4,
                 hysteresis: float = 0.04, probe_every: int = 8, probe_gamma: int = 2, warmup_rounds: int = 2,
                 aging: float = 0.8, max_confidence: float = 0.9, load: ServiceLoad | None = None):
        self.gamma_max = gamma_max
        self.state = state or ControllerState()
        self.load = load  # None: plan as if alone
        self.hysteresis, self.probe_gamma, self.warmup_rounds = hysteresis, probe_gamma, warmup_rounds
        self.aging = aging
        self.max_confidence = max_confidence  # the early stop never asks for more than this
        self.model = True                      # a draft model is there to draft with
        self.gamma = min(initial_gamma, gamma_max) if self.state.rounds < warmup_rounds else self.best()
        self.probe_every = self.base_probe_every = probe_every
        self.rounds_at_zero = 0
        self.probing = False
        self.lookup_skips = [0] * len(MATCH_BUCKETS)     # lookups not taken since one was, per bucket
        self.lookup_yield = 1.0  # EWMA: lookup tokens kept per round (a lookup each); optimistic until measured

    def without_model(self) -> None:
        """The request goes on with free drafts alone: the model's γ is 0 for good."""
        self.model, self.gamma, self.probing = False, 0, False

    def calls(self) -> float:
        return self.load.calls if self.load is not None else 1.0

    def goodput(self, gamma: int) -> float:
        """Expected tokens per second at this γ (under load: per second of this
        request's share of the verifier's forwards)."""
        round_ms = self.state.cost.round_ms(gamma, self.calls())
        return self.state.acceptance.expected_tokens(gamma) / max(round_ms, 1e-6) * 1e3

    def best(self) -> int:
        return max(range(self.gamma_max + 1 if self.model else 1), key=self.goodput)

    def plan(self, lookup: Lookup, limit: int) -> Plan:
        """This round's draft: the model's γ as `next_gamma` chooses it, unless
        taking k of the lookup's tokens (then j model tokens after them) is
        expected to give more tokens per second. A lookup token costs its verify
        row only; it is accepted as its match length's bucket says."""
        gamma = self.next_gamma(limit)
        k_max = min(len(lookup.token_ids), limit, self.gamma_max)
        if k_max <= 0:
            return Plan(0, gamma)
        bucket = match_bucket(lookup.match_length)
        cost, calls = self.state.cost, self.calls()
        free = _cumulative(self.state.lookup[bucket].by_positions(k_max))               # [k_max + 1] P(first i kept)
        model = _cumulative(self.state.acceptance.by_positions(self.gamma_max if self.model else 0))
        free_tokens, model_tokens = _running_sums(free), _running_sums(model)           # E[tokens kept | k], | j
        verify = [cost.verify_ms(rows, calls) for rows in range(self.gamma_max + 1)]
        draft = [cost.draft_ms(j, calls) for j in range(len(model))]

        def goodput(k: int, j: int) -> float:
            tokens = 1 + free_tokens[k] + free[k] * model_tokens[j]
            return tokens / max(draft[j] + verify[k + j], 1e-6)
        best, value = Plan(0, gamma), goodput(0, min(gamma, len(model) - 1))
        for k in range(1, k_max + 1):
            for j in range(min(len(model) - 1, self.gamma_max - k, limit - k) + 1):
                if goodput(k, j) > value:
                    best, value = Plan(k, j), goodput(k, j)
        if best.ngram:
            self.lookup_skips[bucket] = 0
        else:
            # Not expected to pay: try a short one now and then, or a bucket
            # judged bad once would never be judged again.
            self.lookup_skips[bucket] += 1
            if self.lookup_skips[bucket] >= 2 * self.base_probe_every:
                self.lookup_skips[bucket] = 0
                best = Plan(min(k_max, self.probe_gamma), 0)
        if best.model == 0 and self.probing:
            self.probing = False  # the model's probe waits for a round without a better lookup
        return best

    def prefill_pays(self, prompt_tokens: int, new_tokens: int) -> bool:
        """Whether drafting this request is expected to save more than the
        proposer's prefill of its prompt costs. A long prompt with few tokens to
        generate (rag, summarization) can cost the drafter more to read than
        drafting then saves, where the target is cheap per token (int4). A
        prefill of no more than one target step always pays: that keeps requests
        drafting, and so the estimates learning, wherever prompts are short."""
        cost, calls = self.state.cost, self.calls()
        prefill_ms = cost.draft_prefill_ms(prompt_tokens)
        if (prefill_ms <= cost.verify_ms(0) and calls <= LOAD_ALONE) or self.gamma_max < 1:
            return True
        best = max(range(1, self.gamma_max + 1), key=self.goodput)
        saving_ms = new_tokens * (cost.round_ms(0, calls) - 1e3 / max(self.goodput(best), 1e-9))
        return saving_ms > prefill_ms

    def required_acceptance(self) -> float:
        """How likely a drafted token must be accepted for drafting past it to pay.

        One more draft token costs a draft step and a verified position (ms). It
        pays off when the token before it and it are both accepted, P(prev)·α,
        which saves one token's share of the time, 1/goodput. So drafting goes on
        while P(prev accepted) > cost · goodput / α."""
        _, draft_per_token = self.state.cost.draft.coefficients()
        cost_ms = max(draft_per_token, 0.0) + self.state.cost.marginal_verify_ms(max(self.gamma, 1), self.calls())
        tokens_per_ms = self.goodput(max(self.gamma, 1)) / 1e3
        return cost_ms * tokens_per_ms / max(self.state.acceptance.alpha, 0.05)

    def min_confidence(self) -> float:
        """The draft-confidence threshold for this round's early stop: the
        required acceptance, turned into the drafter's confidence through the
        learned calibration."""
        return min(self.max_confidence, self.state.calibration.threshold(self.required_acceptance()))

    def decode_steps(self, chunk: int, looks_up: bool) -> int:
        """Target tokens to decode in a round that drafts nothing: one, so that the
        next lookup comes after it, where lookups keep more tokens than a verifier
        call costs beyond its forward (and no batch waits); else up to `chunk`, or
        to the next probe, in one call."""
        chunk = max(1, min(chunk, self.steps_until_probe()))
        if looks_up and self.calls() <= LOAD_ALONE:
            cost = self.state.cost
            if self.lookup_yield * cost.verify_ms(0) > cost.call_overhead_ms():
                return 1
        return chunk

    def steps_until_probe(self) -> int:
        """At γ = 0: target tokens to decode before the next probe round (at least 1)."""
        return max(1, self.probe_every - self.rounds_at_zero)

    def next_gamma(self, limit: int | None = None) -> int:
        gamma = self.gamma
        self.probing = False
        if gamma == 0 and self.rounds_at_zero >= self.probe_every:
            gamma, self.probing = self.probe_gamma, True
        if limit is not None:
            gamma = max(0, min(gamma, limit))
        return gamma

    def observe(self, round: RoundRecord) -> None:
        state = self.state
        state.rounds += 1
        # What was drafted, not what was asked for: a confidence stop may draft fewer.
        state.cost.observe(round.drafted, round.draft_ms, round.verify_ms / max(round.steps, 1),
                           draft_alone=round.draft_batch_calls <= LOAD_ALONE,
                           verify_alone=round.verify_batch_calls <= LOAD_ALONE, model_tokens=round.model_drafted)
        self.lookup_yield += 0.1 * (round.ngram_accepted - self.lookup_yield)
        if round.ngram_drafted:
            state.lookup[match_bucket(round.ngram_match)].observe(round.ngram_drafted, round.ngram_accepted)
        # The model's drafts were judged only if every lookup token before them was kept.
        if round.model_drafted > 0 and round.accepted >= round.ngram_drafted:
            state.acceptance.observe(round.model_drafted, round.model_accepted)
            state.calibration.observe(round.confidences, round.model_accepted)
        if state.rounds < self.warmup_rounds:
            return
        best = self.best()
        if self.probing:
            # The probe decides at once; failing probes back off exponentially.
            self.rounds_at_zero = 0
            if best == 0:
                self.probe_every = min(2 * self.probe_every, 4 * self.base_probe_every)
                return
            self.gamma, self.probe_every = best, self.base_probe_every
            return
        if self.gamma == 0:
            self.rounds_at_zero += max(round.steps, 1)  # a probe comes after so many target tokens
            state.acceptance.age(self.aging)
        if best != self.gamma and self.goodput(best) > self.goodput(self.gamma) * (1 + self.hysteresis):
            self.gamma = best
            self.rounds_at_zero = 0


def _cumulative(acceptance: Sequence[float]) -> list[float]:
    """[n] conditional acceptance -> [n + 1] P(the first i are all kept)."""
    out = [1.0]
    for a in acceptance:
        out.append(out[-1] * min(a, 0.999))
    return out


def _running_sums(kept: Sequence[float]) -> list[float]:
    """[n + 1] P(the first i kept) -> [n + 1] expected tokens kept of the first i."""
    out = [0.0]
    for p in kept[1:]:
        out.append(out[-1] + p)
    return out


def regime(sampling: SamplingConfig) -> str:
    """Acceptance depends on the sampling config: greedy, or a temperature bucket."""
    if sampling.greedy:
        return "greedy"
    return f"T{min(round(sampling.temperature * 4) / 4, 2.0):.2f}"


class GammaPriors:
    """What requests learned, shared across requests: one state per regime (the
    cost model is shared by all). A new request starts from a copy; when it ends
    its state is blended back in."""

    def __init__(self, blend: float = 0.5, prior_weight: float = 5.0, cost: CostModel | None = None):
        self.blend, self.prior_weight = blend, prior_weight
        self.lock = threading.Lock()
        self.acceptance: dict[str, Acceptance] = {}
        self.calibration: dict[str, Calibration] = {}
        self.lookup: dict[str, list[Acceptance]] = {}
        self.cost = cost or CostModel()
        self.rounds = 0

    def start(self, sampling: SamplingConfig) -> ControllerState:
        with self.lock:
            key = regime(sampling)
            acceptance = copy.deepcopy(self.acceptance.get(key, Acceptance())).capped(self.prior_weight)
            calibration = copy.deepcopy(self.calibration.get(key, Calibration()))
            lookup = [a.capped(self.prior_weight) for a in copy.deepcopy(self.lookup.get(key, lookup_acceptances()))]
            return ControllerState(acceptance, copy.deepcopy(self.cost), calibration, self.rounds, lookup)

    def finish(self, sampling: SamplingConfig, state: ControllerState) -> None:
        with self.lock:
            key = regime(sampling)
            if key not in self.acceptance:
                self.acceptance[key] = copy.deepcopy(state.acceptance)
            else:
                _blend_acceptance(self.acceptance[key], state.acceptance, self.blend)
            if key not in self.calibration:
                self.calibration[key] = copy.deepcopy(state.calibration)
            else:
                prior, new = self.calibration[key], state.calibration
                _blend_into(prior.rates, prior.counts, new.rates, new.counts, self.blend)
            if key not in self.lookup:
                self.lookup[key] = copy.deepcopy(state.lookup)
            else:
                for prior, new in zip(self.lookup[key], state.lookup):
                    _blend_acceptance(prior, new, self.blend)
            self.cost = copy.deepcopy(state.cost)  # timings are shared by every regime
            self.rounds = max(self.rounds, state.rounds)


def _blend_acceptance(prior: Acceptance, new: Acceptance, blend: float) -> None:
    prior.alpha += blend * (new.alpha - prior.alpha)
    prior.count = max(prior.count, new.count)
    _blend_into(prior.by_position, prior.count_by_position, new.by_position, new.count_by_position, blend)


def _blend_into(values: list[float], counts: list[float], new_values: list[float], new_counts: list[float],
                blend: float) -> None:
    """Move each prior EWMA `blend` of the way to a request's, keeping the larger
    evidence count; entries only the request has are taken as they are."""
    for i, value in enumerate(new_values):
        if i < len(values):
            values[i] += blend * (value - values[i])
            counts[i] = max(counts[i], new_counts[i])
        else:
            values.append(value)
            counts.append(new_counts[i])
