"""Prometheus metrics of the coordinator (`--metrics-port`): what rounds draft,
what gets accepted (also per draft position), and how fast it all goes."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from coordinator.rounds import RoundRecord


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        # A registry of our own, so several coordinators (tests) never collide.
        self.registry = r = registry or CollectorRegistry()
        self.rounds = Counter("specdec_rounds", "Rounds (one verifier call each)", registry=r)
        self.drafts = Counter("specdec_drafts", "Rounds that called the proposer", registry=r)
        self.draft_tokens = Counter("specdec_draft_tokens", "Draft tokens proposed", registry=r)
        self.accepted_tokens = Counter("specdec_accepted_tokens", "Draft tokens accepted", registry=r)
        self.drafted_at = Counter("specdec_position_drafted", "Draft tokens proposed, by position (0-based)",
                                  ["position"], registry=r)
        self.accepted_at = Counter("specdec_position_accepted", "Draft tokens accepted, by position (0-based)",
                                   ["position"], registry=r)
        self.output_tokens = Counter("specdec_output_tokens", "Tokens returned to clients", registry=r)
        self.requests = Counter("specdec_requests", "Finished requests", ["finish_reason"], registry=r)
        self.fallbacks = Counter("specdec_drafter_fallbacks", "Requests that went on target-only after the "
                                 "proposer failed", registry=r)
        self.rejected = Counter("specdec_requests_rejected", "Requests refused before any work", ["reason"],
                                registry=r)
        self.in_flight = Gauge("specdec_requests_in_flight", "Generate calls being served", registry=r)
        self.backend_up = Gauge("specdec_backend_up", "1 while the backend answers its health checks",
                                ["backend"], registry=r)
        # Prefix caching: the hit rate is prefix_cached_tokens / prompt_tokens, per model.
        self.prompt_tokens = Counter("specdec_prefill_prompt_tokens", "Prompt tokens a model service's sessions "
                                     "started with, by model (target, draft)", ["model"], registry=r)
        self.prefix_cached_tokens = Counter("specdec_prefix_cached_tokens", "Of them, those taken from the "
                                            "service's prefix cache instead of prefilled", ["model"], registry=r)
        self.prefix_cache_blocks = Gauge("specdec_prefix_cache_blocks", "KV blocks the backend's prefix cache "
                                         "holds (from its Info)", ["backend"], registry=r)
        self.prefix_cache_tokens = Gauge("specdec_prefix_cache_tokens", "Tokens those blocks hold", ["backend"],
                                         registry=r)
        self.round_seconds = Histogram("specdec_round_seconds", "Round latency (draft + verify)", registry=r,
                                       buckets=(.005, .01, .025, .05, .1, .2, .3, .5, .75, 1, 2, 5))
        self.gamma = Histogram("specdec_gamma", "Draft tokens asked for per round", registry=r,
                               buckets=tuple(range(0, 17)))
        self.accepted_length = Histogram("specdec_accepted_length", "Tokens per round (accepted + 1)", registry=r,
                                         buckets=tuple(range(1, 18)))
        rows = (1, 2, 3, 4, 5, 8, 12, 16, 24, 32, 48, 64, 128, 256, 512)
        self.verify_batch_rows = Histogram("specdec_verify_batch_rows", "Rows per verifier forward that a Verify "
                                           "or Decode call shared (continuous batching)", registry=r, buckets=rows)
        self.draft_batch_rows = Histogram("specdec_draft_batch_rows", "Rows per drafter forward that a Propose "
                                          "call shared", registry=r, buckets=rows)
        waits = (.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5)
        self.verify_queue_seconds = Histogram("specdec_verify_queue_seconds", "Time a Verify or Decode call "
                                              "waited for its forwards to start", registry=r, buckets=waits)
        self.draft_queue_seconds = Histogram("specdec_draft_queue_seconds", "Time a Propose call waited for "
                                             "its forwards to start", registry=r, buckets=waits)
        self.source_draft_tokens = Counter("specdec_source_draft_tokens", "Draft tokens proposed, by source "
                                           "(model: the draft model; ngram: lookups, free)", ["source"], registry=r)
        self.source_accepted_tokens = Counter("specdec_source_accepted_tokens", "Draft tokens accepted, by source",
                                              ["source"], registry=r)
        self.draft_bytes = Histogram("specdec_draft_bytes", "Draft data sent to the verifier per round that drafted "
                                     "(token ids and probabilities)", registry=r,
                                     buckets=(0, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1 << 20, 4 << 20))
        self.probes = Counter("specdec_probes", "Probes taken (a draft source tried where its estimates said it "
                              "would not pay), by kind", ["kind"], registry=r)
        self.probe_seconds = Counter("specdec_probe_seconds", "What those probes cost beyond target-only decoding, "
                                     "by kind", ["kind"], registry=r)
        self.tokens_per_second = Histogram("specdec_request_tokens_per_second", "Output tokens/s per request",
                                           registry=r, buckets=(.5, 1, 2, 3, 5, 7.5, 10, 15, 20, 30, 50, 100, 200))

    def observe_probes(self, probes: dict) -> None:
        """A finished request's probes ({kind: ProbeCount})."""
        for kind, probe in probes.items():
            self.probes.labels(kind).inc(probe.count)
            self.probe_seconds.labels(kind).inc(probe.ms / 1e3)

    def observe_round(self, round: RoundRecord) -> None:
        self.observe_batch(round.verify_batch_rows, round.verify_queue_ms)
        if round.drafted:
            self.draft_batch_rows.observe(round.draft_batch_rows)
            self.draft_queue_seconds.observe(round.draft_queue_ms / 1e3)
        self.rounds.inc()
        self.gamma.observe(round.gamma)
        self.round_seconds.observe((round.draft_ms + round.verify_ms) / 1e3)
        self.accepted_length.observe(round.accepted + 1)
        if round.drafted:
            self.drafts.inc()
            self.draft_tokens.inc(round.drafted)
            self.accepted_tokens.inc(round.accepted)
            self.draft_bytes.observe(round.draft_bytes)
            for source, drafted, accepted in round.by_source():
                self.source_draft_tokens.labels(source).inc(drafted)
                self.source_accepted_tokens.labels(source).inc(accepted)
            for position, accepted in enumerate(round.accepted_by_position):
                self.drafted_at.labels(str(position)).inc()
                if accepted:
                    self.accepted_at.labels(str(position)).inc()

    def observe_batch(self, verify_rows: float, verify_queue_ms: float) -> None:
        """A verifier call's batching (every round's, and target-only Decode calls')."""
        if verify_rows:
            self.verify_batch_rows.observe(verify_rows)
            self.verify_queue_seconds.observe(verify_queue_ms / 1e3)

    def observe_prefix(self, model: str, prompt_tokens: int, cached_tokens: int) -> None:
        self.prompt_tokens.labels(model).inc(prompt_tokens)
        self.prefix_cached_tokens.labels(model).inc(cached_tokens)

    def observe_info(self, backend: str, info) -> None:
        self.prefix_cache_blocks.labels(backend).set(info.prefix_cache_blocks)
        self.prefix_cache_tokens.labels(backend).set(info.prefix_cache_tokens)

    def observe_request(self, output_tokens: int, seconds: float, finish_reason: str) -> None:
        self.output_tokens.inc(output_tokens)
        self.requests.labels(finish_reason).inc()
        if seconds > 0:
            self.tokens_per_second.observe(output_tokens / seconds)

    def serve(self, port: int, host: str = "127.0.0.1"):
        """Expose /metrics over HTTP; returns (server, thread)."""
        return start_http_server(port, addr=host, registry=self.registry)
