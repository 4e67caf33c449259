"""Telemetry hooks. Off by default, and then free: the OpenTelemetry API without
an SDK configured hands out no-op spans. (Exporters and gRPC instrumentation are
set up by `configure`, which later work fills in.)"""
from __future__ import annotations

from typing import Any

from opentelemetry import trace

tracer = trace.get_tracer("specdec")


def server_interceptors() -> list[Any]:
    return []


def shutdown() -> None:
    provider = trace.get_tracer_provider()
    if hasattr(provider, "shutdown"):
        provider.shutdown()
