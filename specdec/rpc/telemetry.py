"""Tracing for the three services, off by default and then free.

Off: the module's tracer is the API's no-op one and no interceptor is added.
On (`configure`): an SDK TracerProvider of our own (not the global one, so a
test can configure it more than once), exporting through

* the standard OTEL_* environment: OTLP over gRPC or HTTP to a collector,
  when OTEL_EXPORTER_OTLP_ENDPOINT / OTEL_EXPORTER_OTLP_TRACES_ENDPOINT is set
  (OTEL_EXPORTER_OTLP_PROTOCOL picks grpc, the default, or http/protobuf);
* `--trace-file PATH`: OTLP-JSON lines (one ExportTraceServiceRequest per
  line, ids in hex as the OTLP/JSON spec has them), for offline reading with
  `specdec traces`. Several services may append to one file;
* any extra exporter given (the tests' in-memory one).

W3C trace context crosses gRPC through opentelemetry-instrumentation-grpc's
client and server interceptors, so drafter and verifier spans join the
coordinator's trace and both sides of each call show.
"""
from __future__ import annotations

import base64
import json
import os
import threading
from typing import Any, Sequence

import grpc
from google.protobuf import json_format
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter, SpanExportResult

tracer: trace.Tracer = trace.NoOpTracer()
_provider: TracerProvider | None = None

_ID_FIELDS = ("traceId", "spanId", "parentSpanId")


class OtlpJsonLinesExporter(SpanExporter):
    """Appends each batch as one OTLP/JSON ExportTraceServiceRequest line."""

    def __init__(self, path: str):
        self.path = path
        self.lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

        message = json_format.MessageToDict(encode_spans(spans))
        for resource_spans in message.get("resourceSpans", []):
            for scope_spans in resource_spans.get("scopeSpans", []):
                for span in scope_spans.get("spans", []):
                    for key in _ID_FIELDS:  # protobuf JSON writes bytes as base64; OTLP/JSON wants hex
                        if span.get(key):
                            span[key] = _b64_to_hex(span[key])
        line = (json.dumps(message, separators=(",", ":")) + "\n").encode()
        with self.lock:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, line)  # one write per batch: appends from several processes stay whole lines
            finally:
                os.close(fd)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass


def _b64_to_hex(value: str) -> str:
    return base64.b64decode(value).hex()


def _env_exporter() -> SpanExporter | None:
    if not (os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")):
        return None
    protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get(
        "OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    if protocol.startswith("http"):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter
        return HttpExporter()
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
    return GrpcExporter()


def configure(service_name: str, trace_file: str | None = None, extra_exporter: SpanExporter | None = None) -> bool:
    """Turn tracing on if anything asks for it; returns whether it is on."""
    global tracer, _provider
    exporters: list[tuple[SpanExporter, bool]] = []  # (exporter, batched)
    if trace_file:
        exporters.append((OtlpJsonLinesExporter(trace_file), True))
    if (env := _env_exporter()) is not None:
        exporters.append((env, True))
    if extra_exporter is not None:
        exporters.append((extra_exporter, False))
    if not exporters:
        return False
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    for exporter, batched in exporters:
        provider.add_span_processor(BatchSpanProcessor(exporter) if batched else SimpleSpanProcessor(exporter))
    _provider, tracer = provider, provider.get_tracer("specdec")
    return True


def enabled() -> bool:
    return _provider is not None


def server_interceptors() -> list[Any]:
    if _provider is None:
        return []
    from opentelemetry.instrumentation.grpc import filters, server_interceptor
    # Health probes (every few seconds under Kubernetes) and the coordinator's lease renewals
    # (KeepAlive, each second) would each be a trace of their own.
    background = filters.any_of(filters.health_check(), filters.method_name("KeepAlive"))
    return [server_interceptor(tracer_provider=_provider, filter_=filters.negate(background))]


def traced_channel(channel: grpc.Channel) -> grpc.Channel:
    """A client channel that starts a span per call and sends W3C context."""
    if _provider is None:
        return channel
    from opentelemetry.instrumentation.grpc import client_interceptor, intercept_channel
    return intercept_channel(channel, client_interceptor(tracer_provider=_provider))


def shutdown() -> None:
    """Flush and stop exporting; tracing is off afterwards."""
    global tracer, _provider
    if _provider is not None:
        _provider.shutdown()
    _provider, tracer = None, trace.NoOpTracer()
