"""gRPC server lifecycle shared by the three services.

By the book: health reports NOT_SERVING until the service has warmed up; on
SIGTERM or SIGINT it turns NOT_SERVING, stops gracefully (in-flight calls get a
grace period), and flushes telemetry. Message sizes are set explicitly.
"""
from __future__ import annotations

import logging
import signal
import threading
import time
from concurrent import futures
from dataclasses import dataclass
from typing import Callable, Iterable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from specdec import telemetry
from specdec.errors import StatusInterceptor

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # a Qwen2 tokenizer.json is ~7 MB; draft probs ~1.5 MB/round
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


def channel(address: str) -> grpc.Channel:
    return grpc.insecure_channel(address, options=GRPC_OPTIONS)


@dataclass
class RunningServer:
    server: grpc.Server
    health: health.HealthServicer
    port: int
    service_names: tuple[str, ...]
    metrics_port: int | None = None  # the coordinator's Prometheus endpoint, when on

    def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("",) + self.service_names:
            self.health.set(name, status)

    def stop(self, grace_s: float = 5.0) -> None:
        self.set_serving(False)
        self.server.stop(grace_s).wait()

    def wait(self) -> None:
        self.server.wait_for_termination()


def start_server(
    register: Callable[[grpc.Server], None],
    service_names: Iterable[str],
    host: str = "127.0.0.1",
    port: int = 0,
    max_workers: int = 16,
    traced: bool = True,
) -> RunningServer:
    """Start a server with the status interceptor, health (NOT_SERVING) and reflection.

    traced: a server span per call when tracing is on (the coordinator says no:
    its `generate` span is the root of each trace)."""
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grpc"),
        interceptors=[*(telemetry.server_interceptors() if traced else []), StatusInterceptor()],
        options=GRPC_OPTIONS,
    )
    register(server)
    health_servicer = health.HealthServicer(experimental_non_blocking=True)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = tuple(service_names)
    reflection.enable_server_reflection(names + (health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind {host}:{port}")
    server.start()
    running = RunningServer(server, health_servicer, bound, names)
    running.set_serving(False)
    return running


def run_until_signal(running: RunningServer, grace_s: float = 10.0, on_stop: Callable[[], None] | None = None) -> None:
    """Block until SIGTERM/SIGINT, then NOT_SERVING, graceful stop, flush spans."""
    stopping = threading.Event()

    def handle(signum, _frame) -> None:
        log.info("signal %d: NOT_SERVING, draining for up to %.0f s", signum, grace_s)
        stopping.set()

    signal.signal(signal.SIGTERM, handle)
    signal.signal(signal.SIGINT, handle)
    stopping.wait()
    running.stop(grace_s)
    if on_stop:
        on_stop()
    telemetry.shutdown()


def wait_until_serving(address: str, timeout_s: float, service: str = "") -> None:
    """Block until `address` reports SERVING, or raise TimeoutError."""
    deadline = time.monotonic() + timeout_s
    with channel(address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        last = "no answer"
        while time.monotonic() < deadline:
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
                last = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            except grpc.RpcError as exc:
                last = f"{exc.code().name}: {exc.details()}"
            time.sleep(0.1)
    raise TimeoutError(f"{address} not SERVING after {timeout_s:.0f} s (last: {last})")
