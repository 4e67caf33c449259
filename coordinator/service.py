"""The Coordinator servicer, and its start-up: connect to both model services,
refuse to run unless their tokenizers are identical, then serve."""
from __future__ import annotations

import logging
from dataclasses import dataclass

from opentelemetry import propagate
from opentelemetry.trace import SpanKind

from specdec import telemetry
from specdec.errors import FailedPrecondition
from specdec.model_service import MAX_PROPOSE_TOKENS
from specdec.ngram import NgramProposer
from specdec.proposer import Proposer
from specdec.serving import RunningServer, start_server, wait_until_serving
from specdec.tokenizer_fingerprint import describe, first_difference, load_tokenizer_files, tokenizer_fingerprint
from specdec.v1 import coordinator_pb2, coordinator_pb2_grpc

from coordinator.clients import DrafterClient, RemoteDraftProposer, VerifierClient
from coordinator.engine import SpeculativeEngine
from coordinator.metrics import Metrics
from coordinator.requests import Limits, request_attributes, response_attributes, to_domain, update_to_proto

log = logging.getLogger("coordinator")
SERVICE_NAME = coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"].full_name


class TokenizerMismatch(FailedPrecondition):
    pass


@dataclass
class CoordinatorConfig:
    drafter: str | None             # address; None = no draft model
    verifier: str
    proposer: str = "drafter"       # "drafter" (the draft model service) or "ngram" (prompt lookup)
    gamma: int | None = None         # None: adaptive per request; N: fixed
    gamma_max: int = 8               # adaptive γ ranges over [0, gamma_max]
    max_new_tokens: int = 128
    connect_timeout_s: float = 300.0
    metrics_port: int | None = None  # Prometheus /metrics on this port (0 picks one); None = off

    def __post_init__(self) -> None:
        if self.proposer not in ("drafter", "ngram"):
            raise ValueError(f"unknown proposer {self.proposer!r}; expected 'drafter' or 'ngram'")


class Backends:
    """The two model services, checked to be compatible."""

    def __init__(self, config: CoordinatorConfig):
        self.verifier = VerifierClient(config.verifier)
        self.drafter = DrafterClient(config.drafter) if config.drafter else None
        for client in filter(None, (self.verifier, self.drafter)):
            wait_until_serving(client.address, config.connect_timeout_s)
        self.target_info = self.verifier.info()
        self.tokenizer = load_tokenizer_files(self.verifier.tokenizer_files())
        if tokenizer_fingerprint(self.tokenizer) != self.target_info.tokenizer_fingerprint:
            raise FailedPrecondition("the verifier's tokenizer changed in transfer: fingerprints differ")
        self.draft_info = self.drafter.info() if self.drafter else None
        if self.draft_info is not None:
            self.check_tokenizers()

    def check_tokenizers(self) -> None:
        if self.draft_info.tokenizer_fingerprint == self.target_info.tokenizer_fingerprint:
            return
        draft_tokenizer = load_tokenizer_files(self.drafter.tokenizer_files())
        difference = first_difference(describe(draft_tokenizer), describe(self.tokenizer)) or (
            "fingerprints differ but no field does (different tokenizer library versions?)")
        raise TokenizerMismatch(
            f"draft ({self.draft_info.model}) and target ({self.target_info.model}) tokenizers differ: {difference}. "
            "Speculative decoding needs identical tokenizers; pick a draft model from the target's family.")

    def close(self) -> None:
        for client in filter(None, (self.verifier, self.drafter)):
            client.close()


class CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServicer):
    def __init__(self, backends: Backends, config: CoordinatorConfig):
        self.backends = backends
        self.config = config
        target, draft = backends.target_info, backends.draft_info
        max_gamma = MAX_PROPOSE_TOKENS if config.proposer == "ngram" else (draft.max_propose_tokens if draft else 0)
        self.limits = Limits(
            vocab_size=target.vocab_size, max_context=target.max_context,
            default_max_new_tokens=config.max_new_tokens, default_gamma=config.gamma or None, max_gamma=max_gamma,
            gamma_max=config.gamma_max)
        self.metrics = Metrics()
        self.engine = SpeculativeEngine(backends.verifier, backends.tokenizer, tuple(target.eos_token_ids),
                                        self.metrics)

    def _proposer(self, timeout) -> Proposer:
        if self.config.proposer == "ngram":
            return NgramProposer(self.limits.vocab_size)
        return RemoteDraftProposer(self.backends.drafter, self.backends.target_info.tokenizer_fingerprint, timeout)

    def _updates(self, request, context):
        # One trace per Generate, rooted here (or under the client's span if it sent W3C context).
        parent = propagate.extract({k: v for k, v in context.invocation_metadata() if isinstance(v, str)})
        with telemetry.tracer.start_as_current_span("generate", context=parent, kind=SpanKind.SERVER) as span:
            domain = to_domain(request, self.backends.tokenizer, self.limits, self.limits.max_gamma > 0)
            span.set_attributes(request_attributes(request, domain, self.backends.target_info.model,
                                                   self.backends.draft_info.model if self.backends.draft_info else ""))

            def timeout() -> float | None:
                remaining = context.time_remaining()
                if remaining is None or remaining > 1e6:  # no deadline set by the client
                    return None
                return remaining
            last = None
            for last in self.engine.generate(domain, self._proposer(timeout) if domain.gamma > 0 else None, timeout):
                yield last
            if last is not None:
                span.set_attributes(response_attributes(last))

    def Generate(self, request, context) -> coordinator_pb2.GenerateResponse:
        text, token_ids, last = [], [], None
        for update in self._updates(request, context):
            text.append(update.delta.text)
            token_ids += update.delta.token_ids
            last = update
        response = update_to_proto(last, with_stats=True)
        response.text, response.token_ids[:] = "".join(text), token_ids
        return response

    def GenerateStream(self, request, context):
        for update in self._updates(request, context):
            if update.delta.text or update.delta.token_ids:
                yield update_to_proto(update, with_stats=False)
            if update.delta.finish_reason is not None:
                yield coordinator_pb2.GenerateResponse(
                    finish_reason=int(update.delta.finish_reason),
                    stats=update_to_proto(update, with_stats=True).stats)


def serve(config: CoordinatorConfig, host: str = "127.0.0.1", port: int = 0) -> tuple[RunningServer, Backends]:
    """Connect and check the backends (raises TokenizerMismatch), then serve."""
    backends = Backends(config)
    servicer = CoordinatorServicer(backends, config)
    running = start_server(lambda s: coordinator_pb2_grpc.add_CoordinatorServicer_to_server(servicer, s),
                           [SERVICE_NAME], host=host, port=port, traced=False)
    if config.metrics_port is not None:
        http_server, _ = servicer.metrics.serve(config.metrics_port, host)
        running.metrics_port = http_server.server_port
        log.info("metrics on http://%s:%d/metrics", host, running.metrics_port)
    running.set_serving(True)
    return running, backends
