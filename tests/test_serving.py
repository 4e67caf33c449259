"""Server lifecycle pieces: the health-only listener that kubelet probes use."""
from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

import drafter.service
from specdec.serving import channel, serve_health
from specdec.v1 import common_pb2, drafter_pb2_grpc
from tests.conftest import rpc_error


def test_health_port_answers_health_only_and_follows_the_service(tiny_draft):
    running = drafter.service.serve(tiny_draft)
    port = serve_health(running, "127.0.0.1", 0)
    try:
        with channel(f"127.0.0.1:{port}") as ch:
            health = health_pb2_grpc.HealthStub(ch)
            for service in ("", "specdec.v1.Drafter"):
                reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
            # The model's API is not on this port.
            error = rpc_error(drafter_pb2_grpc.DrafterStub(ch).Info, common_pb2.InfoRequest(), timeout=5)
            assert error.code() == grpc.StatusCode.UNIMPLEMENTED
            running.set_serving(False)  # as on SIGTERM
            reply = health.Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        running.stop(0)
