"""Tracing: the span tree in memory, spans from all three services at a real
OTLP gRPC receiver under one trace id, and `specdec traces` on the file the
same run recorded."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from concurrent import futures

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from specdec.rpc import telemetry
from specdec_tools import traces
from specdec.v1 import common_pb2, coordinator_pb2 as pb
from tests.conftest import free_port, pair_stub

SECRET = "the launch code is 0000"


@pytest.fixture
def traced(tiny_target, tiny_draft):
    exporter = InMemorySpanExporter()
    assert telemetry.configure("specdec-test", extra_exporter=exporter)
    try:
        with pair_stub(tiny_draft, tiny_target, gamma=3) as stub:
            yield stub, exporter
    finally:
        telemetry.shutdown()


def test_span_tree_and_attributes(traced):
    stub, exporter = traced
    exporter.clear()  # start-up calls (Info, GetTokenizer) are traces of their own
    time.sleep(2.5)  # idle: the health watch and the lease renewals (each second) leave no trace
    assert exporter.get_finished_spans() == ()
    response = stub.Generate(pb.GenerateRequest(prompt=SECRET, max_new_tokens=20,
                                                sampling=common_pb2.SamplingParams(temperature=0.7, seed=5)),
                             timeout=60)
    spans = exporter.get_finished_spans()
    by_id = {s.context.span_id: s for s in spans}
    (generate,) = [s for s in spans if s.name == "generate"]
    assert generate.parent is None and generate.kind == SpanKind.SERVER
    assert all(s.context.trace_id == generate.context.trace_id for s in spans)  # one trace per Generate
    a = generate.attributes
    assert a["gen_ai.operation.name"] == "text_completion" and a["gen_ai.request.model"] == "tiny-target"
    assert a["gen_ai.request.temperature"] == pytest.approx(0.7) and a["gen_ai.request.seed"] == 5
    assert a["gen_ai.request.max_tokens"] == 20 and a["gen_ai.request.top_k"] == 0
    assert a["gen_ai.usage.input_tokens"] == response.stats.prompt_tokens
    assert a["gen_ai.usage.output_tokens"] == len(response.token_ids)
    assert tuple(a["gen_ai.response.finish_reasons"]) == (pb.FinishReason.Name(response.finish_reason)
                                                          .removeprefix("FINISH_REASON_").lower(),)

    rounds = sorted((s for s in spans if s.name == "round"), key=lambda s: s.attributes["specdec.round.index"])
    assert len(rounds) == response.stats.rounds and all(r.parent.span_id == generate.context.span_id for r in rounds)
    assert sum(r.attributes["specdec.accepted_tokens"] for r in rounds) == response.stats.accepted_tokens
    for r in rounds:
        ra = r.attributes
        accepted, drafted = ra["specdec.accepted_tokens"], ra["specdec.draft_tokens"]
        assert ra["specdec.first_rejected_position"] == (accepted if accepted < drafted else -1)
        assert isinstance(ra["specdec.bonus"], bool) and ra["specdec.gamma"] == drafted
        children = [s for s in spans if s.parent and s.parent.span_id == r.context.span_id]
        # Where the drafts came from: lookups first (free: no drafter call), then the model.
        ngram, model = ra.get("specdec.draft.ngram.draft_tokens", 0), ra.get("specdec.draft.model.draft_tokens", 0)
        assert ngram + model == drafted and ra["specdec.draft_bytes"] > 0
        assert ra["specdec.draft.source"] == "+".join(n for n, k in (("ngram", ngram), ("model", model)) if k)
        assert ra.get("specdec.draft.ngram.accepted_tokens", 0) + ra.get("specdec.draft.model.accepted_tokens", 0) \
            == accepted
        # A round of γ = 0 (the last token of a request, or drafting off) verifies without proposing.
        proposed = ("/specdec.v1.Drafter/Propose",) if model else ()
        assert ra["specdec.gamma"] or r is rounds[-1]  # here, only the last can have nothing to draft
        for method in (*proposed, "/specdec.v1.Verifier/Verify"):
            (client,) = [c for c in children if c.name == method and c.kind == SpanKind.CLIENT]
            (server,) = [s for s in spans if s.kind == SpanKind.SERVER and s.parent
                         and s.parent.span_id == client.context.span_id]
            assert server.name == method  # both sides of the call, so network time shows
            assert server.start_time >= client.start_time and server.end_time <= client.end_time
    # No prompt text (or token ids) anywhere unless opted in.
    for s in spans:
        for value in s.attributes.values():
            assert SECRET not in str(value)
    assert by_id  # (the index was built from real spans)


def test_tracing_is_off_by_default():
    assert not telemetry.enabled()
    assert telemetry.server_interceptors() == []
    with telemetry.tracer.start_as_current_span("round") as span:
        assert not span.is_recording()


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self):
        self.requests: list[trace_service_pb2.ExportTraceServiceRequest] = []
        self.lock = threading.Lock()

    def Export(self, request, context):
        with self.lock:
            self.requests.append(request)
        return trace_service_pb2.ExportTraceServiceResponse()


@pytest.mark.integration
def test_all_three_services_export_one_trace_over_otlp_grpc_and_to_the_trace_file(tmp_path):
    receiver = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    otlp_port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    trace_file = tmp_path / "spans.jsonl"
    port = free_port()
    env = {**__import__("os").environ, "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{otlp_port}",
           "OTEL_EXPORTER_OTLP_INSECURE": "true", "OTEL_BSP_SCHEDULE_DELAY": "200"}
    up = subprocess.Popen([sys.executable, "-m", "specdec_tools.cli", "up", "--pair", "tiny", "--port", str(port),
                           "--gamma", "3", "--trace-file", str(trace_file)], env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.DEVNULL, text=True)
    try:
        for line in up.stdout:
            if "coordinator on" in line:
                break
        result = subprocess.run([sys.executable, "-m", "specdec_tools.cli", "generate", "--addr", f"127.0.0.1:{port}",
                                 "--prompt", SECRET, "--max-new-tokens", "24", "--json"],
                                capture_output=True, text=True, timeout=120, check=True)
        response = json.loads(result.stdout)
    finally:
        up.send_signal(signal.SIGTERM)  # services flush their spans on the way out
        up.wait(60)
    deadline = time.monotonic() + 10
    services: dict[str, set[str]] = {}
    generate_traces: set[str] = set()
    while time.monotonic() < deadline:
        with receiver.lock:
            services, generate_traces = {}, set()
            for request in receiver.requests:
                for rs in request.resource_spans:
                    name = next(a.value.string_value for a in rs.resource.attributes if a.key == "service.name")
                    for ss in rs.scope_spans:
                        for span in ss.spans:
                            services.setdefault(name, set()).add(span.trace_id.hex())
                            if span.name == "generate":
                                generate_traces.add(span.trace_id.hex())
        if set(services) >= {"coordinator", "drafter", "verifier"} and generate_traces:
            break
        time.sleep(0.2)
    server.stop(0)
    (trace_id,) = generate_traces  # one Generate, one trace
    for service in ("coordinator", "drafter", "verifier"):
        assert trace_id in services.get(service, set()), services

    # The same run's trace file, read back by `specdec traces`.
    spans = traces.read_spans(str(trace_file))
    assert {s.service for s in spans} >= {"coordinator", "drafter", "verifier"}
    assert not any("grpc.health.v1.Health" in s.name for s in spans)  # probes are not traced
    (generate,) = [s for s in spans if s.name == "generate"]
    assert generate.trace_id == trace_id
    rows = traces.rounds_of(generate)
    assert len(rows) == int(response["stats"]["rounds"])
    assert sum(r.accepted for r in rows) == int(response["stats"]["acceptedTokens"])
    assert all(r.verify_ms > 0 and r.rpc_ms >= 0 for r in rows)
    assert all(r.draft_ms > 0 for r in rows if r.drafted)
    plot = tmp_path / "rounds.png"
    out = subprocess.run([sys.executable, "-m", "specdec_tools.cli", "traces", str(trace_file), "--request", trace_id[:8],
                          "--plot", str(plot)], capture_output=True, text=True, timeout=60, check=True).stdout
    assert f"request {trace_id}" in out and "round" in out and "acceptance by position" in out
    assert "tok/s" in out and plot.read_bytes()[:4] == b"\x89PNG"
    assert SECRET not in trace_file.read_text()
