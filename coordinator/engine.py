"""The speculative loop.

One round: the proposer drafts gamma tokens (a free source's first, such as an
n-gram lookup's, then the draft model's; the previous round's commit rides along), the verifier
scores them in one target forward pass and runs the rejection sampler, and the
accepted drafts plus the target's recovered or bonus token are the round's
output. With speculation off, the verifier decodes alone.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator, Sequence

from specdec.rpc.errors import Cancelled, DeadlineExceeded
from specdec.spec.proposers import MODEL
from specdec.spec.proposers.drafts import Drafts
from specdec.spec.proposers.model import ProposerUnavailable
from specdec.spec.types import Commit, Decoded, Lookup, Proposal, RejectionOutput
from specdec.spec.sampling import SamplingConfig
from specdec.rpc import telemetry

from coordinator.clients import VerifierClient
from coordinator.gamma import CostModel, GammaController, GammaPriors, Plan, ServiceLoad
from coordinator.gamma.explore import PREFILL, Exploration
from coordinator.metrics import Metrics
from coordinator.output import Delta, FinishReason, OutputAccumulator
from coordinator.rounds import RoundRecord
from coordinator.stats import Stats

# A round's output: its tokens, and (when the request asks) their TokenLogprobs, one each.
Emitted = tuple[list[int], tuple]
DECODE_CHUNK = 16  # target-only tokens per Decode call (one streamed message each)
FIXED_MIN_MATCH = 3  # fixed γ: a lookup backed by this many context tokens drafts before the model


def fixed_plan(lookups: Sequence[Lookup], gamma: int, model: bool) -> Plan:
    """A fixed γ's round: γ tokens, the best-backed candidate's first when its match
    is long enough (any candidate, without a model), the model's after them."""
    # A grammar's forced tokens first: only a tokenization the target does not share rejects them.
    best = next((lookup for lookup in lookups if lookup.forced), None) or \
        max(lookups, key=lambda lookup: lookup.match_length, default=Lookup())
    free = min(len(best.token_ids), gamma) if best.forced or \
        best.match_length >= (FIXED_MIN_MATCH if model else 0) else 0
    return Plan.of(free, gamma - free if model else 0, best.source)


@dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    sampling: SamplingConfig
    gamma_max: int                  # draft tokens a round may ask for: every round's γ when fixed,
                                    # the bound of the controller's choice when adaptive; 0 = target-only
    stop: tuple[str, ...] = ()
    adaptive: bool = False          # γ chosen per round by a GammaController
    ignore_eos: bool = False        # keep going past EOS (load tests, benchmarks)
    confidence_stop: bool = False   # adaptive: the drafter may end a round early (GammaController.min_confidence)
    proposer: str = ""              # "hybrid", "model" or "ngram"; "": the server's default
    cache_salt: bytes = b""         # the prefix caches reuse only blocks kept under the same salt
    logprobs: int | None = None     # each output token's TokenLogprob, with this many top tokens (None: not asked)
    sources: tuple[str, ...] = ()   # the draft sources by name, overriding `proposer`
    free_only: bool = False         # its free sources draft, never the model (a seeded sample: requests.py)
    grammar: str = ""               # a structured output's compiled grammar (sampling.constraint: its fingerprint)


@dataclass
class Update:
    delta: Delta
    stats: Stats


class SpeculativeEngine:
    def __init__(self, verifier: VerifierClient, tokenizer, eos_token_ids: tuple[int, ...],
                 metrics: Metrics | None = None,
                 on_proposer_failure: Callable[[ProposerUnavailable], None] = lambda exc: None,
                 cost: CostModel | None = None, synthetic_acceptance: float = 0.0):
        self.verifier = verifier
        self.synthetic_acceptance = synthetic_acceptance  # the verifier's benchmark setting, stamped on every stats
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        # What earlier requests learned about γ, starting from the services' cost curves.
        self.gamma_priors = GammaPriors(cost=cost)
        # How many requests share the model services now: every request's γ plans with it.
        self.load = ServiceLoad()
        self.metrics = metrics or Metrics()
        self.on_proposer_failure = on_proposer_failure

    def generate(self, request: GenerationRequest, proposer: Drafts | None,
                 timeout: Callable[[], float | None] = lambda: None,
                 cancelled: Callable[[], bool] = lambda: False, session_id: str | None = None,
                 fallback: str = "") -> Iterator[Update]:
        """Yields one Update per round; the last one has delta.finish_reason set.

        `fallback`: why a request that asked to speculate has no proposer (it then
        decodes target-only and says so in its stats).
        Stops within one round of the caller cancelling or its deadline passing.
        Both sessions are ended however the generator is left (done, error, cancel)."""
        stats = Stats(prompt_tokens=len(request.prompt_ids), gamma=request.gamma_max if proposer else 0,
                      fallback=fallback, synthetic_acceptance=self.synthetic_acceptance)
        if self.synthetic_acceptance:
            # Drafts are kept at the set rate whatever their probabilities: the early stop, which
            # reads acceptance off them, has nothing to read (random weights: every draft
            # token is unsure, and rounds were cut to one token while the calibration learned).
            request = replace(request, confidence_stop=False)
        eos = () if request.ignore_eos else self.eos_token_ids
        g = Generation(session_id or uuid.uuid4().hex, request, stats,
                       OutputAccumulator(self.tokenizer, eos, request.max_new_tokens, request.stop), timeout, proposer)
        started = time.perf_counter()
        self.load.enter()
        try:
            for new_tokens, logprobs in self._all_rounds(g, started):
                delta = g.output.add(new_tokens, logprobs)
                stats.logprob_bytes += sum(entry.ByteSize() for entry in logprobs)
                stats.output_tokens = len(g.output.token_ids)
                stats.total_ms = (time.perf_counter() - started) * 1e3
                if not stats.first_token_ms:
                    stats.first_token_ms = stats.total_ms
                yield Update(delta, stats)
                if delta.finish_reason is not None:
                    self.gamma_priors.lengths.observe(stats.output_tokens - 1,
                                                      ended=delta.finish_reason != FinishReason.LENGTH)
                    self.metrics.observe_request(stats.output_tokens, stats.total_ms / 1e3,
                                                 delta.finish_reason.name.lower())
                    self.metrics.observe_probes(stats.probes)
                    return
                self._check_caller(cancelled, timeout, stats)
        finally:
            self.load.leave()
            if proposer is not None:  # the one the request started with: its session, whatever replaced it
                proposer.end()
            self.verifier.end_session(g.session_id)

    def _all_rounds(self, g: "Generation", started: float) -> Iterator[Emitted]:
        # 1. The target's prefill, and its first token alone: the time to the first
        #    token is target-only's. The proposer prefills after it, not at the same
        #    time: on the same cores each model's thread team oversubscribed them (the
        #    default pair's speculative prefill took a median 2.9 s on Spec-Bench
        #    against 0.69 s for the target's alone).
        grammar = (g.request.grammar, len(g.request.prompt_ids)) if g.request.grammar else ()  # from the output on
        g.stats.prefix_cached_tokens = self.verifier.start_session(
            g.session_id, g.request.prompt_ids, g.timeout(), g.request.cache_salt, *grammar)
        self.metrics.observe_prefix("target", len(g.request.prompt_ids), g.stats.prefix_cached_tokens)
        # The session caches all but the prompt's last token; the forward over it is the
        # rest of the prefill, and its token is the first (not a round), speculating or not.
        first = self._observe_load(self.verifier.decode(g.session_id, 1, g.request.sampling,
                                                        g.timeout(), g.request.logprobs))
        g.stats.prefill_ms = (time.perf_counter() - started) * 1e3
        yield first.token_ids, first.logprobs
        if g.proposer is not None:
            g.context = [*g.request.prompt_ids, *first.token_ids]
            # 2-3. Whether the model drafts at all, and the proposer's prefill.
            self._start_proposer(g)
        # 4. Speculative rounds, or target-only ones where nothing is left to draft with.
        yield from (self._speculative_rounds(g) if g.proposer is not None else self._target_only_rounds(g))

    def _start_proposer(self, g: "Generation") -> None:
        # 2. Adaptive γ: draft with the model only if that is expected to save more
        #    than the proposer's prefill of this prompt costs; free drafts need none.
        request = g.request
        if request.adaptive:
            state = self.gamma_priors.start(request.sampling)
            # Priced against what the request is expected to generate (lengths.py), not its ceiling.
            g.stats.expected_output_tokens = self.gamma_priors.lengths.expected(request.max_new_tokens - 1)
            budget = Exploration.for_request(state.cost, g.stats.expected_output_tokens, g.stats.probes)
            g.controller = GammaController(request.gamma_max, state, load=self.load, exploration=budget,
                                           free_sources=tuple(g.proposer.sources))
            if not g.proposer.drafts_with_model:   # free sources alone: plan no model tokens
                g.controller.without_model()
        probed = False  # the drafter's prefill was not expected to pay, and is taken as a probe
        if g.controller is not None and g.proposer.drafts_with_model:
            # What is left to prefill: the drafter's prefix cache may hold the prompt's start.
            uncached = len(g.context) - g.proposer.cached_prefix(g.context)
            if not g.controller.prefill_pays(uncached, g.stats.expected_output_tokens):
                probed = g.controller.prefill_probe_allowed(uncached) and \
                    self.gamma_priors.probe_prefill(g.controller.calls(), uncached)
                if not probed:
                    self._without_model(g, f"drafting was not expected to save what the drafter's prefill of the "
                                           f"{len(g.context)}-token prompt ({uncached} of them not in its prefix "
                                           f"cache) costs, over the {g.stats.expected_output_tokens:.0f} tokens it is "
                                           f"expected to generate (with {g.controller.calls():.1f} calls sharing "
                                           "each verifier forward)")
                    if g.proposer is None:
                        return
        # 3. The proposer's prefill: the prompt and the first token.
        started = time.perf_counter()
        g.proposer.start(g.session_id, g.context)
        try:
            g.proposer.ready()
        except ProposerUnavailable as exc:
            self._fall_back(g, exc)
        finally:
            prefill_ms = (time.perf_counter() - started) * 1e3
            g.stats.prefill_ms += prefill_ms
            if probed:
                g.controller.exploration.charge(PREFILL, prefill_ms)
        if g.proposer is None:
            return
        g.stats.draft_prefix_cached_tokens = cached = g.proposer.prefix_cached_tokens
        if g.proposer.drafts_with_model:
            self.metrics.observe_prefix("draft", len(g.context), cached)
        if g.controller is not None and g.proposer.drafts_with_model:
            # Priced by the tokens prefilled (what the prefix cache supplied cost next to
            # nothing): a few past a cached prefix time the call's fixed cost.
            g.controller.state.cost.observe_draft_prefill(len(g.context) - cached, prefill_ms)

    @staticmethod
    def _without_model(g: "Generation", why: str) -> None:
        """The request goes on without the proposer's model: its free drafts, or target-only."""
        free = g.proposer.free_only()
        if free is None:
            g.stats.gamma = 0
            g.stats.fallback = f"{why}; this request went target-only (same output, slower)"
        else:
            g.stats.fallback = f"{why}; this request drafted with its free sources alone (same output)"
            if g.controller is not None:
                g.controller.without_model()
        g.proposer = free

    @staticmethod
    def _check_caller(cancelled, timeout, stats: Stats) -> None:
        """Between rounds: stop if the caller has gone or its deadline has passed."""
        if cancelled():
            raise Cancelled(f"cancelled by the client after {stats.output_tokens} tokens")
        remaining = timeout()
        if remaining is not None and remaining <= 0:
            raise DeadlineExceeded(f"the deadline passed after {stats.output_tokens} tokens "
                                   f"({stats.rounds} rounds); raise the client's timeout or lower max_new_tokens")

    def _fall_back(self, g: "Generation", exc: ProposerUnavailable) -> None:
        """The proposer failed: go on without its model."""
        self.metrics.fallbacks.inc()
        self.on_proposer_failure(exc)
        self._without_model(g, str(exc))

    def _speculative_rounds(self, g: "Generation") -> Iterator[Emitted]:
        try:
            while g.proposer is not None:
                try:
                    yield from self._rounds(g)
                except ProposerUnavailable as exc:
                    # Raised before this round's Verify: the verifier's session is whole, and
                    # decoding carries on from exactly there, with the free drafts if the
                    # proposer has them, else target-only.
                    self._fall_back(g, exc)
            yield from self._target_only_rounds(g)
        finally:
            if g.controller is not None:
                self.gamma_priors.finish(g.request.sampling, g.controller.state)

    def _rounds(self, g: "Generation") -> Iterator[Emitted]:
        request, proposer, controller, stats = g.request, g.proposer, g.controller, g.stats
        commit: Commit | None = None  # what the proposer has not yet been told
        while True:
            with telemetry.tracer.start_as_current_span("round") as span:
                # 1. Plan the round: a free source's tokens first, then model drafts after
                #    them, by fixed γ or by the controller; the verifier always adds one token.
                #    (A proposer that cannot go on raises here, before anything is sent.)
                proposer.keep_alive()
                limit = max(0, request.max_new_tokens - len(g.output.token_ids) - 1)
                lookups = proposer.candidates(g.context, limit)
                if controller is not None:
                    plan = controller.plan(lookups, limit)
                    controller.begin(plan)
                else:
                    plan = fixed_plan(lookups, min(request.gamma_max, limit), proposer.drafts_with_model)
                taken = next((c for c in lookups if c.source == plan.free_source), Lookup())
                # 2. Propose; the previous round's commit rides on the call.
                proposal, draft_ms, min_confidence = Proposal(()), 0.0, 0.0
                if plan.drafted > 0:
                    started = time.perf_counter()
                    if controller is not None and request.confidence_stop and plan[MODEL]:
                        min_confidence = controller.min_confidence()  # the drafter may stop short of γ
                    proposal = proposer.propose(plan[MODEL], request.sampling, commit, min_confidence,
                                                Lookup(taken.token_ids[: plan[taken.source]], source=taken.source))
                    draft_ms = (time.perf_counter() - started) * 1e3
                    commit = None
                # 3. Verify: one target forward pass over the draft, then the rejection sampler.
                #    With nothing drafted, decode: up to the next probe in one call (a call a
                #    token would miss the verifier's batched forwards between round trips),
                #    or one token where lookups find enough after it to pay for the call.
                started = time.perf_counter()
                if not proposal.token_ids:
                    steps = 1 if controller is None else \
                        controller.decode_steps(min(DECODE_CHUNK, limit + 1))
                    decoded = self._observe_load(self.verifier.decode(g.session_id, steps, request.sampling,
                                                                      g.timeout(), request.logprobs))
                    target_ids = decoded.token_ids
                    result = RejectionOutput(0, decoded.token_ids[-1], False, decoded.batch, logprobs=decoded.logprobs)
                else:
                    result = self._observe_load(self.verifier.verify(g.session_id, proposal, request.sampling,
                                                                     g.timeout(), request.logprobs))
                    target_ids = [result.next_token_id]
                verify_ms = (time.perf_counter() - started) * 1e3
                # 4. The round's tokens: accepted drafts, then the recovered or bonus token (or the decoded ones).
                new_tokens = [*proposal.token_ids[: result.num_accepted], *target_ids]
                g.context += new_tokens
                # 5. Remember what the proposer must commit next time it is called
                #    (with no proposal this round, the target tokens pile up).
                commit = Commit(result.num_accepted, tuple(target_ids)) if commit is None else \
                    Commit(commit.num_accepted, commit.target_token_ids + tuple(target_ids))
                # 6. Record the round once: stats, metrics, the controller and the span read it.
                record = RoundRecord(
                    stats.rounds, gamma=plan.drafted, drafted=len(proposal.token_ids), accepted=result.num_accepted,
                    bonus=result.bonus, draft_ms=draft_ms, verify_ms=verify_ms, min_confidence=min_confidence,
                    confidences=proposal.confidences, steps=len(target_ids),
                    draft_batch_rows=proposal.batch.mean_rows, draft_batch_calls=proposal.batch.mean_calls,
                    draft_queue_ms=proposal.batch.queue_ms, verify_batch_rows=result.batch.mean_rows,
                    verify_batch_calls=result.batch.mean_calls, verify_queue_ms=result.batch.queue_ms,
                    sources=proposal.sources, lookup_match=taken.match_length if proposal.free_tokens else 0,
                    draft_bytes=result.draft_bytes,
                    rpc_ms=proposal.batch.rpc_ms(draft_ms) + result.batch.rpc_ms(verify_ms))
                self._record(record, stats, controller)
                span.set_attributes(record.span_attributes())
                if record.index == 0:  # what the prefills before it took from the prefix caches
                    span.set_attributes({"specdec.prefix_cached_tokens": stats.prefix_cached_tokens,
                                         "specdec.draft.prefix_cached_tokens": stats.draft_prefix_cached_tokens})
            yield new_tokens, result.logprobs

    def _observe_load(self, reply):
        """A verifier reply's batching: the load every request's γ plans with."""
        self.load.observe(reply.batch)
        return reply

    def _record(self, record: RoundRecord, stats: Stats, controller: GammaController | None) -> None:
        stats.record(record)
        self.metrics.observe_round(record)
        if controller is not None:
            stats.gamma = record.gamma  # adaptive: the γ of the latest round
            controller.observe(record)

    def _target_only_rounds(self, g: "Generation") -> Iterator[Emitted]:
        # After the first token (streamed alone, as soon as it is decided): chunks.
        while True:
            decoded = self._decode(g, min(DECODE_CHUNK, g.request.max_new_tokens - len(g.output.token_ids)))
            yield decoded.token_ids, decoded.logprobs

    def _decode(self, g: "Generation", num_tokens: int) -> Decoded:
        started = time.perf_counter()
        decoded = self._observe_load(self.verifier.decode(g.session_id, num_tokens, g.request.sampling,
                                                          g.timeout(), g.request.logprobs))
        verify_ms = (time.perf_counter() - started) * 1e3
        # Not a speculation round: the stats count it, the round metrics do not (but its batching).
        g.stats.record(RoundRecord(g.stats.rounds, 0, 0, 0, False, verify_ms=verify_ms,
                                   verify_batch_rows=decoded.batch.mean_rows,
                                   verify_batch_calls=decoded.batch.mean_calls,
                                   verify_queue_ms=decoded.batch.queue_ms, rpc_ms=decoded.batch.rpc_ms(verify_ms)))
        self.metrics.observe_batch(decoded.batch.mean_rows, decoded.batch.queue_ms)
        return decoded


@dataclass
class Generation:
    """One request through its rounds: what the loop's steps share."""
    session_id: str
    request: GenerationRequest
    stats: Stats
    output: OutputAccumulator
    timeout: Callable[[], float | None]        # seconds left of the caller's deadline (None: no deadline)
    proposer: Drafts | None                    # None: target-only from here on
    controller: GammaController | None = None  # adaptive γ's, once the first token is out
    context: list[int] = field(default_factory=list)  # every token decided: what lookups search
