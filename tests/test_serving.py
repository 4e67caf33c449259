"""Server lifecycle pieces: the health-only listener that kubelet probes use."""
from __future__ import annotations

import argparse
import threading

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

import drafter.service
from specdec.rpc.serving import channel, serve_health, start_server
from specdec.v1 import common_pb2, drafter_pb2_grpc
from specdec.rpc.flags import add_settings, start_health
from tests.conftest import free_port, rpc_error, wait_for


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


def listening_address(port: int) -> str:
    """The address a port of this process listens on, IPv4-mapped and dual-stack read as IPv4."""
    (ip,) = {c.laddr.ip for c in psutil.Process().net_connections(kind="tcp")
             if c.status == psutil.CONN_LISTEN and c.laddr.port == port}
    return "0.0.0.0" if ip == "::" else ip.removeprefix("::ffff:")


@pytest.mark.parametrize("argv, expected", [
    (["--host", "127.0.0.1"], "127.0.0.1"),                     # the service's own address, not every interface
    (["--uds", "/tmp/x.sock"], "127.0.0.1"),                    # a socket-only service: loopback
    (["--host", "127.0.0.1", "--health-host", "0.0.0.0"], "0.0.0.0"),  # asked for (the chart's probes)
])
def test_the_health_port_binds_the_services_host_unless_told_otherwise(tiny_draft, argv, expected):
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--uds")
    add_settings(parser, ())
    port = free_port()
    args = parser.parse_args([*argv, "--health-port", str(port)])
    running = drafter.service.serve(tiny_draft)
    try:
        start_health(running, args)
        assert listening_address(port) == expected
    finally:
        running.stop(0)


def test_a_served_call_counts_in_flight_until_it_ends_and_health_checks_do_not(tiny_draft):
    # What a model service's background work waits on: its own API's calls, unary and streaming.
    started, release = threading.Event(), threading.Event()

    def slow(request, context):
        started.set()
        release.wait(10)
        return request

    def slow_stream(request, context):
        started.set()
        release.wait(10)
        yield request

    identity = lambda raw: raw   # noqa: E731
    handlers = grpc.method_handlers_generic_handler("specdec.v1.Slow", {
        "Call": grpc.unary_unary_rpc_method_handler(slow, identity, identity),
        "Stream": grpc.unary_stream_rpc_method_handler(slow_stream, identity, identity)})
    running = start_server(lambda server: server.add_generic_rpc_handlers((handlers,)), ["specdec.v1.Slow"],
                           traced=False)
    try:
        with channel(running.address) as ch:
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert running.in_flight.count == 0
            for method, read in (("Call", lambda future: future.result()), ("Stream", list)):
                started.clear()
                release.clear()
                rpc = ch.unary_unary if method == "Call" else ch.unary_stream
                pending = rpc(f"/specdec.v1.Slow/{method}")
                call = pending.future(b"x", timeout=10) if method == "Call" else pending(b"x", timeout=10)
                assert started.wait(5)
                assert running.in_flight.count == 1
                release.set()
                read(call)
                assert wait_for(lambda: running.in_flight.count == 0, 5)
    finally:
        release.set()
        running.stop(0)
