"""The policy: each round's draft (a free source's tokens, then model tokens) from
the cost, load and acceptance estimates (what requests learned before, shared per
sampling regime, is priors.py's)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from specdec.spec.proposers import MODEL, SOURCES
from specdec.spec.types import Lookup, Runs, runs

from coordinator.gamma.acceptance import (Acceptance, Calibration, cumulative, lookup_acceptances,
                                          match_bucket)
from coordinator.gamma.cost import LOAD_ALONE, CostModel
from coordinator.gamma.explore import LOOKUP_ROUND, LOOKUP_WAIT, MODEL_ROUND, Exploration, break_even, within_reach
from coordinator.gamma.load import ServiceLoad
from coordinator.rounds import RoundRecord



@dataclass(frozen=True)
class Plan:
    """A round's draft by source, in draft order: a free source's tokens first,
    then the model's drafted after them; and what exploring it takes (`begin`)."""
    sources: Runs = ()
    probe: bool = False                 # the model's tokens probe γ > 0 after rounds at γ = 0
    # The (source, match bucket) of each candidate weighed, taken or skipped
    considered: tuple[tuple[str, int], ...] = ()
    lookup_probe: bool = False          # a free source's bucket judged bad, tried again

    @classmethod
    def of(cls, free: int = 0, model: int = 0, source: str = "", **exploring) -> "Plan":
        return cls(runs((source, free), (MODEL, model)), **exploring)

    def __getitem__(self, source: str) -> int:
        return sum(n for name, n in self.sources if name == source)

    @property
    def free_source(self) -> str:
        """The free source whose tokens lead the round ("": none)."""
        return self.sources[0][0] if self.sources and self.sources[0][0] != MODEL else ""

    @property
    def drafted(self) -> int:
        return sum(n for _, n in self.sources)


def source_prior(name: str) -> float | None:
    """The acceptance prior a free source registered (None: the lookups' by match length)."""
    spec = SOURCES.get(name)
    return spec.prior if spec is not None else None


@dataclass
class ControllerState:
    acceptance: Acceptance = field(default_factory=Acceptance)   # the model's drafts
    cost: CostModel = field(default_factory=CostModel)
    calibration: Calibration = field(default_factory=Calibration)
    rounds: int = 0
    # Per free source, by name: [match bucket] the acceptance of its drafts
    lookup: dict[str, list[Acceptance]] = field(default_factory=dict)
    # Per free source: an EWMA over rounds of its tokens kept, less their rows' verify cost
    # in target steps (0 in a round without its tokens); optimistic (1) until measured
    lookup_yield: dict[str, float] = field(default_factory=dict)
    # The model's acceptance as this regime showed it before the request, with all of its
    # evidence (`acceptance` is capped, for planning): with the request's own, what a probe
    # may hope for (explore.py).
    reach: Acceptance = field(default_factory=Acceptance)

    def lookups(self, source: str) -> list[Acceptance]:
        """[match bucket] what `source`'s drafts showed (the priors, before any)."""
        return self.lookup.get(source) or lookup_acceptances(source_prior(source))


class GammaController:
    """Per request: `plan(...)` decides a round and `begin(plan)` moves the
    exploration state it takes (or `next_gamma` both, for the model alone);
    `observe(...)` learns from the round after it."""

    def __init__(self, gamma_max: int, state: ControllerState | None = None, *, initial_gamma: int = 4,
                 hysteresis: float = 0.04, probe_every: int = 8, probe_gamma: int = 2, warmup_rounds: int = 2,
                 aging: float = 0.8, max_confidence: float = 0.9, load: ServiceLoad | None = None,
                 exploration: Exploration | None = None, free_sources: Sequence[str] | None = None):
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
        # The request's free sources, by name (None: every registered one)
        self.free_sources = tuple(SOURCES if free_sources is None else free_sources)
        self.lookup_skips: dict[tuple[str, int], int] = {}  # (source, bucket): rounds not taken since it was
        self.exploration = exploration or Exploration()  # the probes' budget and ledger (none: no ceiling)
        self._probe_kind: str | None = None              # the round begun is a probe of this kind
        self._lookup_kept = False                        # the last round kept lookup tokens

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

    def plan(self, lookups: Sequence[Lookup], limit: int) -> Plan:
        """This round's draft: the model's γ as the controller holds it, unless
        taking k of a free source's candidate tokens (then j model tokens after
        them) is expected to give more tokens per second. A free token costs its
        verify row only; it is accepted as its source's match-length bucket says.
        Decides only: the probes it starts are `begin`'s to record."""
        gamma, probe = self._model_gamma(limit)
        cost, calls = self.state.cost, self.calls()
        model = cumulative(self.state.acceptance.by_positions(self.gamma_max if self.model else 0))
        model_tokens = _running_sums(model)                                              # E[tokens kept | j]
        verify = [cost.verify_ms(rows, calls) for rows in range(self.gamma_max + 1)]
        draft = [cost.draft_ms(j, calls) for j in range(len(model))]
        alone = min(gamma, len(model) - 1)
        (k, j, source), value = (0, gamma, ""), (1 + model_tokens[alone]) / max(draft[alone] + verify[alone], 1e-6)
        weighed = []  # (source, bucket, k_max) of each candidate
        for lookup in lookups:
            k_max = min(len(lookup.token_ids), limit, self.gamma_max)
            if k_max <= 0:
                continue
            bucket = match_bucket(lookup.match_length)
            weighed.append((lookup.source, bucket, k_max))
            free = cumulative(self.state.lookups(lookup.source)[bucket].by_positions(k_max))  # P(first i kept)
            free_tokens = _running_sums(free)                                                 # E[tokens kept | k]
            for free_k in range(1, k_max + 1):                  # k free tokens, then j model tokens
                for model_j in range(min(len(model) - 1, self.gamma_max - free_k, limit - free_k) + 1):
                    tokens = 1 + free_tokens[free_k] + free[free_k] * model_tokens[model_j]
                    got = tokens / max(draft[model_j] + verify[free_k + model_j], 1e-6)
                    if got > value:
                        (k, j, source), value = (free_k, model_j, lookup.source), got
        # A free source not expected to pay is tried short now and then, or a bucket
        # judged bad once would never be judged again.
        lookup_probe = False
        for name, bucket, k_max in weighed if k == 0 else ():
            if self.lookup_skips.get((name, bucket), 0) + 1 >= 2 * self.base_probe_every and \
                    self._lookup_probe_allowed(name, bucket, min(k_max, self.probe_gamma)):
                (k, j, source), lookup_probe = (min(k_max, self.probe_gamma), 0, name), True
                break
        # The model's probe waits for a round without a better free draft.
        return Plan.of(k, j, source, probe=probe and j > 0,
                       considered=tuple((name, bucket) for name, bucket, _ in weighed), lookup_probe=lookup_probe)

    def begin(self, plan: Plan) -> None:
        """The round of `plan` starts: record the probes it makes, and the candidates it skips."""
        self.probing = plan.probe
        self._probe_kind = MODEL_ROUND if plan.probe else LOOKUP_ROUND if plan.lookup_probe else None
        for key in plan.considered:
            self.lookup_skips[key] = 0 if key[0] == plan.free_source else self.lookup_skips.get(key, 0) + 1

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

    def decode_steps(self, chunk: int) -> int:
        """Target tokens to decode in a round that drafts nothing: one, so that the
        next lookup comes after it, where lookups keep more tokens (less what their
        rows cost) than a verifier call costs beyond its forward (and no batch
        waits); else up to `chunk`, or to the next probe, in one call.

        A one-token call is a wager on the next lookup. While lookups are keeping
        tokens it is paid for; else (the yield still its prior, or fading after a
        stretch of lookups) each such call is exploration, charged what it took beyond
        a target step against the request's budget (explore.py), so a request whose history never
        matches decodes in chunks once the budget is spent, not a call a token."""
        chunk = max(1, min(chunk, self.steps_until_probe(chunk)))
        if self.free_sources and self.calls() <= LOAD_ALONE:
            cost = self.state.cost
            overhead = cost.call_overhead_ms()
            best_yield = max(self.state.lookup_yield.get(name, 1.0) for name in self.free_sources)
            if best_yield * cost.verify_ms(0) > overhead:
                if self._lookup_kept:
                    return 1
                # Expected to cost what such calls cost so far (the fitted call overhead before
                # any); charged in `observe` at what it took beyond a token of chunked decoding.
                waits = self.exploration.ledger.get(LOOKUP_WAIT)
                expected = waits.ms / waits.count if waits is not None and waits.count else overhead
                if self.exploration.affordable(expected):
                    self._probe_kind = LOOKUP_WAIT
                    return 1
        return chunk

    def steps_until_probe(self, most: int) -> int:
        """At γ = 0: target tokens to decode before the next probe round (at least 1), or
        `most` where no probe could be taken now (no model, out of reach or budget): a probe
        due but refused must not cut every later Decode call to one token (at 78e3ecd,
        requests at γ = 0 made 56 calls for 64 tokens, target-only 5)."""
        if not self._model_probe_allowed():
            return most
        return max(1, self.probe_every - self.rounds_at_zero)

    def model_in_reach(self) -> bool:
        """Whether the model's drafts could pay, on the current costs, at an acceptance that
        neither this regime's requests before this one nor this request's own rounds (which
        age while nothing is judged) rule out (explore.py)."""
        if not self.model or self.gamma_max < 1:
            return False
        needed = break_even(self.state.cost, self.gamma_max, self.calls())
        return within_reach(self.state.reach, needed) and within_reach(self.state.acceptance, needed)

    def _model_probe_allowed(self) -> bool:
        # Expected to cost its round's time less its tokens at a target step each.
        cost, calls, gamma = self.state.cost, self.calls(), self.probe_gamma
        expected = cost.round_ms(gamma, calls) - self.state.acceptance.expected_tokens(gamma) * cost.verify_ms(0, calls)
        return self.exploration.affordable(expected) and self.model_in_reach()

    def _lookup_probe_allowed(self, source: str, bucket: int, k: int) -> bool:
        cost, calls = self.state.cost, self.calls()
        kept = self.state.lookups(source)[bucket]
        expected = cost.verify_ms(k, calls) - kept.expected_tokens(k) * cost.verify_ms(0, calls)
        return self.exploration.affordable(expected) and \
            within_reach(kept, break_even(cost, self.gamma_max, calls, drafts_cost=False))

    def prefill_probe_allowed(self, prompt_tokens: int) -> bool:
        """Whether the drafter's prefill of a request it was not expected to pay for may be
        taken all the same: the model within reach, and the prefill within the budget."""
        return self.exploration.affordable(self.state.cost.draft_prefill_ms(prompt_tokens)) and self.model_in_reach()

    def _model_gamma(self, limit: int | None) -> tuple[int, bool]:
        """The model's γ for the next round, and whether it is a probe."""
        gamma, probe = self.gamma, False
        if gamma == 0 and self.rounds_at_zero >= self.probe_every and self._model_probe_allowed():
            gamma, probe = self.probe_gamma, True
        if limit is not None:
            gamma = max(0, min(gamma, limit))
        return gamma, probe

    def next_gamma(self, limit: int | None = None) -> int:
        """A round of the model's drafts alone: plan it, begin it, and return its γ."""
        gamma, probe = self._model_gamma(limit)
        self.begin(Plan.of(model=gamma, probe=probe and gamma > 0))
        return gamma

    def observe(self, round: RoundRecord) -> None:
        state = self.state
        state.rounds += 1
        if self._probe_kind is not None:   # charged at what it cost beyond target-only decoding
            tokens, took = round.accepted + max(round.steps, 1), round.draft_ms + round.verify_ms
            if self._probe_kind == LOOKUP_WAIT:
                # A one-token call against what its token costs in target-only's chunks: the
                # call's whole overhead, where the published forward hid the part a chunk saves;
                # at least its RPC, which a chunk's tokens share.
                ms = max(took - tokens * state.cost.decode_token_ms(), round.rpc_ms)
            else:
                ms = took - tokens * state.cost.verify_ms(0, self.calls())
            self.exploration.charge(self._probe_kind, ms)
            self._probe_kind = None
        # What was drafted, not what was asked for: a confidence stop may draft fewer.
        state.cost.observe(round.drafted, round.draft_ms, round.verify_ms / max(round.steps, 1),
                           draft_alone=round.draft_batch_calls <= LOAD_ALONE,
                           verify_alone=round.verify_batch_calls <= LOAD_ALONE, model_tokens=round.drafted_by(MODEL))
        if round.drafted == 0 and round.verify_batch_calls <= LOAD_ALONE:
            state.cost.observe_decode(round.steps, round.verify_ms, round.rpc_ms)
        # What a free source keeps, less what its rows cost the verifier beyond one step, in
        # steps: where each row costs nearly a step (a kernel whose cost grows with the rows),
        # a lookup keeping half its tokens gains nothing, and decoding a token a round for it
        # loses the calls. Every free source of the request learns each round (0 without its tokens).
        self._lookup_kept = False
        for name in [n for n in dict.fromkeys((*self.free_sources, round.free_source)) if n]:
            drafted, accepted, rows_cost = round.drafted_by(name), round.accepted_by(name), 0.0
            if drafted:
                step = state.cost.verify_ms(0)
                rows_cost = (state.cost.verify_ms(drafted) - step) / step if step > 0 else 0.0
                state.lookup.setdefault(name, lookup_acceptances(source_prior(name)))[
                    match_bucket(round.lookup_match)].observe(
                    drafted, accepted)
            before = state.lookup_yield.get(name, 1.0)
            state.lookup_yield[name] = before + 0.1 * (accepted - rows_cost - before)
            self._lookup_kept |= accepted > 0
        # The model's drafts were judged only if every lookup token before them was kept.
        if round.judged_from(MODEL):
            state.acceptance.observe(round.drafted_by(MODEL), round.accepted_by(MODEL))
            state.calibration.observe(round.confidences, round.accepted_by(MODEL))
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


def _running_sums(kept: Sequence[float]) -> list[float]:
    """[n + 1] P(the first i kept) -> [n + 1] expected tokens kept of the first i."""
    out = [0.0]
    for p in kept[1:]:
        out.append(out[-1] + p)
    return out
