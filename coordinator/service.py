"""The Coordinator servicer, and its start-up: connect to both model services,
refuse to run unless their tokenizers are identical, then serve."""
from __future__ import annotations

import functools
import logging
import threading
import uuid
from collections import OrderedDict
from dataclasses import dataclass, replace

import grpc

from opentelemetry import propagate
from opentelemetry.trace import SpanKind

from specdec.rpc import telemetry
from specdec.rpc.errors import FailedPrecondition, ResourceExhausted, Unavailable, unavailable_message
from specdec.spec.grammar import GrammarCompiler
from specdec.spec.limits import MAX_PROPOSE_TOKENS
from specdec.spec.proposers import MODEL
from specdec.spec.proposers.drafts import Drafts
from specdec.spec.proposers.model import ProposerUnavailable
from specdec.spec.proposers.ngram import RecentOutputs
from specdec.spec.wire import Truncation
from specdec.rpc.security import ClientTls, ServerTls, caller_identity
from specdec.rpc.serving import MAX_PUBLIC_MESSAGE_BYTES, RunningServer, start_server
from specdec.v1 import coordinator_pb2, coordinator_pb2_grpc

from coordinator.backends import Backends, WatchSettings
from coordinator.clients import RemoteDraftProposer
from coordinator.engine import GenerationRequest, SpeculativeEngine
from coordinator.gamma import Acceptance, CostModel
from coordinator.gamma.bound import describe as describe_bound, fixed_gamma
from coordinator.metrics import Metrics
from coordinator.proposers import KINDS, build as build_drafts, needs_drafter
from coordinator.settings import DEFAULT_DRAFT_TOP_K, DEFAULT_DRAFT_TOP_P, HttpLimits
from coordinator.requests import (Limits, max_token_chars, prefix_salt, request_attributes, response_attributes,
                                  to_domain, update_to_proto)

log = logging.getLogger("coordinator")
SERVICE_NAME = coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"].full_name
# A drafter failing this way is dead, hung (our --drafter-timeout), broken, or serving another model.
# (A refusal such as RESOURCE_EXHAUSTED is none of these; nor is NOT_FOUND, which one session's
# loss gives: that request goes on without the model, every other request as it was.)
DRAFTER_DOWN_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                                grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN,
                                grpc.StatusCode.FAILED_PRECONDITION})




@dataclass
class CoordinatorConfig:
    drafter: str | None             # address; None = no draft model
    verifier: str
    # Who drafts, unless a request says: "hybrid" (n-gram lookups, free, and the
    # draft model where they find nothing or beyond them), "model" (the drafter
    # service alone) or "ngram" (the lookups alone: no drafter needed).
    proposer: str = "hybrid"
    gamma: int | None = None         # None: adaptive per request; N: fixed
    gamma_max: int = 0               # adaptive γ ranges over [0, gamma_max]; 0: from the verifier's cost curve
    max_new_tokens: int = 128
    connect_timeout_s: float = 300.0
    metrics_port: int | None = None  # Prometheus /metrics on this port (0 picks one); None = off
    http_port: int | None = None     # the OpenAI-compatible HTTP front on this port (0 picks one); None = off
    http_limits: HttpLimits = HttpLimits()  # its body size, time and connection limits
    max_sessions: int = 64           # Generate calls served at once; beyond, RESOURCE_EXHAUSTED
    max_message_bytes: int = MAX_PUBLIC_MESSAGE_BYTES
    tls: ServerTls | None = None     # the public port's TLS (mutual with tls.client_ca)
    auth_token: str | None = None    # bearer token required on Generate calls
    backend_tls: ClientTls | None = None  # to reach a drafter/verifier that serves TLS
    backend_auth_token: str | None = None  # the bearer token the drafter and the verifier require
    log_prompts: bool = False        # prompt text in the logs (off: only counts and timings)
    drafter_timeout_s: float = 30.0  # a drafter call slower than this: the request goes on without it
    watch: WatchSettings = WatchSettings()
    # The draft distribution's support sent when sampling (specdec.spec.wire.Truncation;
    # the default from measuring acceptance against bytes: docs/free-drafts.md).
    draft_truncation: Truncation = Truncation(top_k=DEFAULT_DRAFT_TOP_K, top_p=DEFAULT_DRAFT_TOP_P)
    lookup_history_tokens: int = 0  # recent outputs searched by a caller's lookups (0: none)
    share_prefix_cache: bool = False  # callers reuse each other's cached prompt prefixes (with auth on)
    # False: adaptive γ plans on the services' published cost curves alone and never
    # learns from measured rounds, so it decides alike on every machine (tests pin
    # the services' curves too, and get the same γ wherever they run).
    learn_costs: bool = True

    def __post_init__(self) -> None:
        if self.proposer not in KINDS:
            raise ValueError(f"unknown proposer {self.proposer!r}; expected one of {', '.join(KINDS)}")
        self.draft_truncation.validate()
        if self.lookup_history_tokens < 0:
            raise ValueError(f"lookup_history_tokens must be >= 0, got {self.lookup_history_tokens}")
        if self.max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {self.max_sessions}")


DEFAULT_GAMMA_MAX = 8  # without a measured cost curve
SEEDED_GAMMA = 4       # the most drafts a seeded sampled request's fixed γ takes
DEFAULT_KEEP_ALIVE_S = 30.0  # a drafter that does not say its session TTL: renew this often
MAX_HISTORY_CALLERS = 256  # (caller, salt) histories kept (the least recently seen dropped)


def curve_gamma_max(forward_ms) -> int:
    """The adaptive γ's bound from the verifier's cost curve: the most drafts whose
    verification it measured (rows - 1). Where rows are nearly free the controller
    may then draft long; where they are not, goodput keeps it short anyway."""
    return max(len(forward_ms) - 1, 1) if forward_ms else DEFAULT_GAMMA_MAX


def seeded_gamma(verify_ms, draft_ms, max_propose: int) -> int:
    """The fixed γ of seeded sampled requests: chosen once, on the curves the services
    published at start and the prior acceptance, so a seed gives the same sample whatever
    the load later; 0 where the draft model cannot pay on them (on a 2-core CPU a seeded
    translation at γ = 4 ran at 0.47x target-only). Without curves: up to 4, as before."""
    if not verify_ms or not draft_ms:
        return min(SEEDED_GAMMA, max_propose)
    return fixed_gamma(list(verify_ms), float(draft_ms[0]), Acceptance().alpha, min(SEEDED_GAMMA, max_propose))


class CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServicer):
    def __init__(self, backends: Backends, config: CoordinatorConfig):
        self.backends = backends
        self.config = config
        target, draft = backends.target_info, backends.draft_info
        max_propose = draft.max_propose_tokens if draft else 0 if KINDS[config.proposer].needs_drafter else \
            MAX_PROPOSE_TOKENS
        self.limits = Limits(
            vocab_size=target.vocab_size, max_context=target.max_context,
            default_max_new_tokens=config.max_new_tokens, default_gamma=config.gamma or None,
            max_propose_tokens=max_propose, gamma_max=config.gamma_max or curve_gamma_max(target.forward_ms),
            max_token_chars=max_token_chars(backends.tokenizer),
            seeded_gamma=seeded_gamma(target.forward_ms, draft.forward_ms if draft else (), max_propose))
        self.metrics = Metrics()
        cost = CostModel.from_curves(list(draft.forward_ms) if draft else [], list(target.forward_ms),
                                     draft.prefill_ms_per_token if draft else 0.0)
        cost.frozen = not config.learn_costs
        if len(target.forward_ms) >= 2:  # what the services' speed allows any draft, in the operator's log
            log.info("%s", describe_bound(list(target.forward_ms),
                                          draft.forward_ms[0] if draft and draft.forward_ms else None))
        if target.synthetic_acceptance:
            log.warning("the verifier runs the BENCHMARK SETTING --synthetic-acceptance %.2f: drafts are accepted at "
                        "that rate whatever the models say, so output is not the target's; every response's stats "
                        "carry synthetic_acceptance", target.synthetic_acceptance)
        # Structured outputs: each request's constraint compiled once, here (specdec.spec.grammar).
        self.grammars = GrammarCompiler(backends.tokenizer, tuple(target.eos_token_ids))
        self.grammars.prepare_in_background()
        self.engine = SpeculativeEngine(backends.verifier, backends.tokenizer, tuple(target.eos_token_ids),
                                        self.metrics, on_proposer_failure=self._proposer_failed, cost=cost,
                                        synthetic_acceptance=target.synthetic_acceptance)
        # Recent outputs, one history per authenticated caller and cache_salt (LRU-bounded):
        # a lookup drafts from them, which shows in timing and stats, so a caller searches its own.
        self._recent: OrderedDict[tuple[str, bytes], RecentOutputs] = OrderedDict()
        self._recent_lock = threading.Lock()
        self._in_flight = 0  # Generate calls admitted and not yet finished
        self._idle = threading.Condition()
        # The services keep their curves current from their forwards: plans follow them.
        priors = self.engine.gamma_priors
        backends.verifier_watch.on_info(lambda info: priors.follow(verify_ms=list(info.forward_ms)))
        if backends.drafter_watch is not None:
            backends.drafter_watch.on_info(lambda info: priors.follow(
                draft_ms=list(info.forward_ms), draft_prefill_ms_per_token=info.prefill_ms_per_token))
        for name, watch in (("verifier", backends.verifier_watch), ("drafter", backends.drafter_watch)):
            if watch is not None:
                watch.on_info(lambda info, name=name: self.metrics.observe_info(name, info))
                gauge = self.metrics.backend_up.labels(name)
                gauge.set(1)
                watch.on_change(lambda up, gauge=gauge: gauge.set(int(up)))

    def recent_outputs(self, history: tuple[str, bytes]) -> RecentOutputs | None:
        """The recent outputs the lookups of a caller's requests under one cache_salt
        search, (caller, salt) (None: none are kept). Kept apart by salt as the prefix
        caches are: what a lookup drafts shows in timing, and a salt is the caller's
        way to say which requests may see each other."""
        if self.config.lookup_history_tokens <= 0:
            return None
        with self._recent_lock:
            recent = self._recent.pop(history, None) or RecentOutputs(self.config.lookup_history_tokens)
            self._recent[history] = recent  # the most recently used last
            while len(self._recent) > MAX_HISTORY_CALLERS:
                self._recent.popitem(last=False)
            return recent

    def _proposer(self, domain: GenerationRequest, timeout,
                  history: tuple[str, bytes] = ("", b"")) -> tuple[Drafts | None, str]:
        """The request's drafts (its sources as it names them, or its kind's, or the
        server's), or None and why not."""
        kind = KINDS[domain.proposer or self.config.proposer]
        sources = domain.sources or kind.sources()
        # A seeded sample must not depend on what other requests wrote: its drafts
        # (and so its draws) come from its own tokens only.
        seeded = domain.sampling.seed is not None and not domain.sampling.greedy
        recent = None if seeded else self.recent_outputs(history)
        # A structured output's grammar, as its free sources and lookups follow it.
        grammar = self.grammars.cursor(domain.grammar, len(domain.prompt_ids)) if domain.grammar else None
        build = functools.partial(build_drafts, grammar=grammar)
        if MODEL not in sources:
            return build(sources, None, recent), ""
        if self.backends.drafter is None:
            if needs_drafter(sources):
                asked = f"the {kind.name} proposer" if not domain.sources else "the model source"
                raise FailedPrecondition(f"this coordinator runs without a drafter (--proposer ngram); {asked} "
                                         "needs one: ask for another, or leave it unset")
            return build(sources, None, recent), ""
        if domain.free_only:   # a seeded sample where the model cannot pay: its free sources alone
            return build(sources, None, recent), ""
        if not self.backends.drafter_up:
            # Go on without the model until the watcher finds the drafter again.
            self.metrics.fallbacks.inc()
            free = build(sources, None, recent)
            why = "the drafter was down when this request started; "
            return (free, why + ("it drafted with its free sources alone (same output)" if free is not None else
                                 "it went target-only (same output, slower)"))
        ttl = self.backends.draft_info.session_ttl_s if self.backends.draft_info else 0.0
        model = RemoteDraftProposer(self.backends.drafter, self.backends.target_info.tokenizer_fingerprint, timeout,
                                    self.config.drafter_timeout_s, self.config.draft_truncation,
                                    keep_alive_s=ttl / 4 if ttl > 0 else DEFAULT_KEEP_ALIVE_S,
                                    is_up=lambda: self.backends.drafter_up, cache_salt=domain.cache_salt,
                                    grammar=(domain.grammar, len(domain.prompt_ids)))
        return build(sources, model, recent), ""

    def _proposer_failed(self, exc: ProposerUnavailable) -> None:
        # Stop using it until the watcher has checked it again.
        watch = self.backends.drafter_watch
        if watch is not None and exc.code in DRAFTER_DOWN_CODES:
            watch.mark_down(str(exc))

    def _admit(self) -> None:
        verifier = self.backends.verifier_watch
        if not verifier.up:
            self.metrics.rejected.labels("verifier_down").inc()
            log.info("refused a request: the verifier at %s is down (%s)", verifier.client.address, verifier.reason)
            raise Unavailable(unavailable_message("verifier"))
        with self._idle:
            if self._in_flight >= self.config.max_sessions:
                self.metrics.rejected.labels("max_sessions").inc()
                raise ResourceExhausted(f"{self.config.max_sessions} requests are in flight, the limit "
                                        "(--max-sessions); retry with backoff")
            self._in_flight += 1
            self.metrics.in_flight.set(self._in_flight)

    def updates(self, request, context):
        """A GenerateRequest's updates, one per round (the last with its finish reason):
        what Generate, GenerateStream and the HTTP front (coordinator.http_server, with
        an HttpCall for `context`) all serve."""
        self._admit()
        try:
            yield from self._generate(request, context)
        finally:
            with self._idle:
                self._in_flight -= 1
                self.metrics.in_flight.set(self._in_flight)
                self._idle.notify_all()

    def drain(self, timeout_s: float) -> bool:
        """Wait until no request is running; False if some still are after `timeout_s`."""
        with self._idle:
            return self._idle.wait_for(lambda: self._in_flight == 0, timeout_s)

    def _generate(self, request, context):
        # One trace per Generate, rooted here (or under the client's span if it sent W3C context).
        parent = propagate.extract({k: v for k, v in context.invocation_metadata() if isinstance(v, str)})
        with telemetry.tracer.start_as_current_span("generate", context=parent, kind=SpanKind.SERVER) as span:
            domain = to_domain(request, self.backends.tokenizer, self.limits, self.limits.max_propose_tokens > 0,
                               self.grammars)
            span.set_attributes(request_attributes(request, domain, self.backends.target_info.model,
                                                   self.backends.draft_info.model if self.backends.draft_info else ""))

            def timeout() -> float | None:
                remaining = context.time_remaining()
                if remaining is None or remaining > 1e6:  # no deadline set by the client
                    return None
                return remaining
            request_id = uuid.uuid4().hex
            caller = caller_identity(context)
            history = (caller, domain.cache_salt)  # lookups search what this caller wrote under this salt
            domain = replace(domain, cache_salt=prefix_salt(domain.cache_salt, caller,
                                                            self.config.share_prefix_cache))
            proposer, fallback = self._proposer(domain, timeout, history) if domain.gamma_max > 0 else (None, "")
            last = None
            for last in self.engine.generate(domain, proposer, timeout, lambda: not context.is_active(), request_id,
                                             fallback):
                yield last
            span.set_attributes(response_attributes(last))
            self._log(request_id, request, domain, last)

    def _log(self, request_id, request, domain, last) -> None:
        s = last.stats
        line = (f"request {request_id[:12]}: {s.prompt_tokens} prompt tokens -> {s.output_tokens} tokens "
                f"({last.delta.finish_reason.name.lower()}) in {s.total_ms:.0f} ms, {s.tokens_per_second:.1f} tok/s, "
                f"{s.rounds} rounds, acceptance {s.acceptance_rate:.2f}")
        if s.fallback:
            line += f", without the draft model: {s.fallback}"
        if self.config.log_prompts:  # opt-in: prompts are the users' data
            kind = request.WhichOneof("input")
            line += f", {kind}: {str(getattr(request, kind))[:500]!r}"
        log.info("%s", line)

    def Generate(self, request, context) -> coordinator_pb2.GenerateResponse:
        text, token_ids, logprobs, last = [], [], [], None
        for update in self.updates(request, context):
            text.append(update.delta.text)
            token_ids += update.delta.token_ids
            logprobs += update.delta.logprobs
            last = update
        response = update_to_proto(last, with_stats=True)
        response.text, response.token_ids[:] = "".join(text), token_ids
        del response.logprobs[:]
        response.logprobs.extend(logprobs)
        return response

    def GenerateStream(self, request, context):
        for update in self.updates(request, context):
            if update.delta.text or update.delta.token_ids:
                yield update_to_proto(update, with_stats=False)
            if update.delta.finish_reason is not None:
                yield coordinator_pb2.GenerateResponse(
                    finish_reason=int(update.delta.finish_reason),
                    stats=update_to_proto(update, with_stats=True).stats)


def serve(config: CoordinatorConfig, host: str = "127.0.0.1", port: int = 0) -> tuple[RunningServer, Backends]:
    """Connect and check the backends (raises TokenizerMismatch), then serve."""
    backends = Backends(config.verifier, config.drafter if KINDS[config.proposer].uses_drafter else None,
                        config.connect_timeout_s, config.backend_tls, config.watch, config.backend_auth_token)
    servicer = CoordinatorServicer(backends, config)
    running = start_server(lambda s: coordinator_pb2_grpc.add_CoordinatorServicer_to_server(servicer, s),
                           [SERVICE_NAME], host=host, port=port, traced=False, tls=config.tls,
                           auth_token=config.auth_token, max_message_bytes=config.max_message_bytes,
                           max_workers=config.max_sessions + 8)  # spare workers answer health checks under load
    if config.metrics_port is not None:
        http_server, _ = servicer.metrics.serve(config.metrics_port, host)
        running.metrics_port = http_server.server_port
        log.info("metrics on http://%s:%d/metrics", host, running.metrics_port)
    running.drain = servicer.drain
    if config.http_port is not None:   # the OpenAI-compatible front: the same servicer, its own port
        from coordinator.http_server import HttpFront, build_app
        serving = threading.Event()   # follows the gRPC health status: down with the verifier, and on SIGTERM
        running.on_serving = lambda up: serving.set() if up else serving.clear()
        front = HttpFront(build_app(servicer, backends.target_info.model, serving), host, config.http_port,
                          config.tls, config.http_limits, config.auth_token)
        running.http_port = front.port
        running.on_stop = front.stop   # after the drain: the requests under way have ended
        log.info("OpenAI-compatible HTTP API on http%s://%s:%d/v1", "s" if config.tls else "", host, front.port)
    # The coordinator is ready exactly when its verifier is.
    backends.verifier_watch.on_change(running.set_serving)
    running.set_serving(backends.verifier_watch.up)
    return running, backends
