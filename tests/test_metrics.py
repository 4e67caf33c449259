"""The coordinator's Prometheus endpoint, scraped over HTTP after real requests."""
from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from coordinator.service import CoordinatorConfig, serve
from specdec.rpc.serving import channel
from specdec.v1 import common_pb2, coordinator_pb2 as pb, coordinator_pb2_grpc


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_count_rounds_drafts_and_acceptance_by_position(stack):
    running, backends = serve(CoordinatorConfig(drafter=stack.address(stack.drafter),
                                                verifier=stack.address(stack.verifier), gamma=3, metrics_port=0,
                                                connect_timeout_s=30))
    try:
        with channel(f"127.0.0.1:{running.port}") as ch:
            stub = coordinator_pb2_grpc.CoordinatorStub(ch)
            responses = [stub.Generate(pb.GenerateRequest(prompt=p, max_new_tokens=25,
                                                          sampling=common_pb2.SamplingParams(temperature=0)),
                                       timeout=60) for p in ("The quick brown fox", "def fibonacci(n):")]
        m = scrape(running.metrics_port)
    finally:
        backends.close()
        running.stop(0)
    rounds = sum(r.stats.rounds for r in responses)
    drafted = sum(r.stats.draft_tokens for r in responses)
    accepted = sum(r.stats.accepted_tokens for r in responses)
    assert m[("specdec_rounds_total", ())] == rounds
    assert m[("specdec_draft_tokens_total", ())] == drafted
    assert m[("specdec_accepted_tokens_total", ())] == accepted
    assert m[("specdec_output_tokens_total", ())] == sum(len(r.token_ids) for r in responses)
    by_source = {source: sum(s.draft_tokens for r in responses for s in r.stats.draft_sources if s.source == source)
                 for source in ("ngram", "model")}
    for source, drafted_by in by_source.items():
        assert m.get(("specdec_source_draft_tokens_total", (("source", source),)), 0) == drafted_by
    assert sum(by_source.values()) == drafted
    assert m[("specdec_draft_bytes_sum", ())] == sum(r.stats.draft_bytes for r in responses) > 0
    assert m[("specdec_round_seconds_count", ())] == rounds and m[("specdec_round_seconds_sum", ())] > 0
    assert m[("specdec_gamma_count", ())] == rounds
    assert m[("specdec_accepted_length_sum", ())] == accepted + rounds
    assert m[("specdec_request_tokens_per_second_count", ())] == 2
    for position in range(3):  # conditional: a position is only reached when the ones before it were accepted
        key = (("position", str(position)),)
        assert m.get(("specdec_position_accepted_total", key), 0) <= m[("specdec_position_drafted_total", key)]
    assert sum(v for (name, _), v in m.items() if name == "specdec_position_accepted_total") == accepted
    assert sum(v for (name, _), v in m.items() if name == "specdec_position_drafted_total") == drafted
