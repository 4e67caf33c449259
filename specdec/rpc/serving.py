"""gRPC server lifecycle shared by the three services.

By the book: health reports NOT_SERVING until the service has warmed up; on
SIGTERM or SIGINT it turns NOT_SERVING, stops gracefully (in-flight calls get a
grace period), and flushes telemetry. Message sizes are set explicitly.
"""
from __future__ import annotations

import logging
import os
import signal
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from typing import Callable, Iterable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from specdec.rpc import telemetry
from specdec.rpc.errors import StatusInterceptor
from specdec.rpc.security import BearerToken, BearerTokenInterceptor, ClientTls, ServerTls, warn_if_token_in_clear

log = logging.getLogger(__name__)

# Set explicitly rather than left to gRPC's defaults (4 MB in, unlimited out).
# Between the services: a Qwen2 tokenizer.json is ~7 MB, draft probs ~1.5 MB a round.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# The public API: a prompt beyond the context window of any model here is far smaller.
MAX_PUBLIC_MESSAGE_BYTES = 4 * 1024 * 1024
# A backend that restarts is found again within a couple of seconds, not gRPC's default 2 minutes.
RECONNECT_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                     ("grpc.max_reconnect_backoff_ms", 2000)]


def message_options(max_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    return [("grpc.max_send_message_length", max_bytes), ("grpc.max_receive_message_length", max_bytes)]



def channel(address: str, tls: ClientTls | None = None, token: str | None = None,
            max_message_bytes: int = MAX_MESSAGE_BYTES) -> grpc.Channel:
    """A channel to one of our services: TLS when `tls` is given, the bearer token on every call."""
    options = message_options(max_message_bytes) + RECONNECT_OPTIONS
    if tls is None and token is None:
        return grpc.insecure_channel(address, options=options)
    credentials = tls.credentials() if tls else grpc.local_channel_credentials()
    if token is not None:
        credentials = grpc.composite_channel_credentials(
            credentials, grpc.metadata_call_credentials(BearerToken(token)))
    return grpc.secure_channel(address, credentials, options=options)


class CallsInFlight(grpc.ServerInterceptor):
    """Counts the calls of the served services (`prefixes`: not health, not reflection) in
    progress, from the handler's start to its end: work in the background (a model service's
    kernels made while serving) waits while a request is being served."""

    def __init__(self, prefixes: tuple[str, ...]):
        self._prefixes = prefixes
        self._lock = threading.Lock()
        self._count = 0

    @property
    def count(self) -> int:
        return self._count

    def _add(self, change: int) -> None:
        with self._lock:
            self._count += change

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith(self._prefixes):
            return handler

        def unary(request, context):
            self._add(1)
            try:
                return handler.unary_unary(request, context)
            finally:
                self._add(-1)

        def stream(request, context):
            self._add(1)
            try:
                yield from handler.unary_stream(request, context)
            finally:
                self._add(-1)

        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(unary, handler.request_deserializer,
                                                       handler.response_serializer)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(stream, handler.request_deserializer,
                                                        handler.response_serializer)
        return handler


@dataclass
class RunningServer:
    server: grpc.Server
    health: health.HealthServicer
    port: int                       # the TCP port; 0 when serving on a Unix domain socket
    service_names: tuple[str, ...]
    address: str = ""               # what clients dial: HOST:PORT, or unix:PATH
    metrics_port: int | None = None  # the coordinator's Prometheus endpoint, when on
    http_port: int | None = None     # the coordinator's OpenAI-compatible HTTP front, when on
    # Waits (up to the given seconds) for handlers still unwinding after the server stopped.
    drain: Callable[[float], bool] | None = None
    health_server: grpc.Server | None = None  # the health-only listener, when --health-port is set
    health_port: int | None = None
    on_stop: Callable[[], None] | None = None  # after the server has stopped (a model service: drop its sessions)
    # Told of every change of the serving status (the coordinator's HTTP front, which has no gRPC health).
    on_serving: Callable[[bool], None] | None = None
    stopped: threading.Event = field(default_factory=threading.Event)   # set once `stop` has begun: its helpers end
    in_flight: CallsInFlight | None = None   # the served services' calls in progress

    def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("",) + self.service_names:
            self.health.set(name, status)
        if self.on_serving is not None:
            self.on_serving(serving)

    def stop(self, grace_s: float = 5.0) -> None:
        self.stopped.set()
        self.set_serving(False)
        self.server.stop(grace_s).wait()
        if self.health_server is not None:
            self.health_server.stop(0)
        # Calls cut off at the grace period stop within a round; let them end their sessions.
        if self.drain is not None and not self.drain(10.0):
            log.warning("requests still running 10 s after the server stopped")
        if self.on_stop is not None:
            self.on_stop()


def start_server(
    register: Callable[[grpc.Server], None],
    service_names: Iterable[str],
    host: str = "127.0.0.1",
    port: int = 0,
    max_workers: int = 16,
    traced: bool = True,
    tls: ServerTls | None = None,
    auth_token: str | None = None,
    max_message_bytes: int = MAX_MESSAGE_BYTES,
    uds: str | None = None,
) -> RunningServer:
    """Start a server with the status interceptor, health (NOT_SERVING) and reflection.

    traced: a server span per call when tracing is on (the coordinator says no:
    its `generate` span is the root of each trace).
    max_workers: calls served at once; keep it above the session limit so that
    health checks are answered while every session is busy.
    uds: serve on this Unix domain socket instead of HOST:PORT (sidecar mode: only
    who can enter its directory can call; no TCP port at all)."""
    names = tuple(service_names)
    in_flight = CallsInFlight(tuple(f"/{name}/" for name in names))
    interceptors = [*(telemetry.server_interceptors() if traced else []), StatusInterceptor(), in_flight]
    if auth_token is not None:
        interceptors.insert(0, BearerTokenInterceptor(auth_token))  # refused before any work or span
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grpc"),
        interceptors=interceptors,
        options=message_options(max_message_bytes),
    )
    register(server)
    health_servicer = health.HealthServicer(experimental_non_blocking=True)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(names + (health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    warn_if_token_in_clear(host, tls, auth_token, uds)
    address = f"unix:{uds}" if uds else f"{host}:{port}"
    bound = server.add_secure_port(address, tls.credentials()) if tls else server.add_insecure_port(address)
    if bound == 0:
        raise OSError(f"cannot bind {address}")
    server.start()
    running = RunningServer(server, health_servicer, 0 if uds else bound, names,
                            address if uds else f"{host}:{bound}", in_flight=in_flight)
    running.set_serving(False)
    return running


def serve_health(running: RunningServer, host: str, port: int) -> int:
    """A second, plaintext listener with only grpc.health.v1, sharing the main
    server's status. Kubelet gRPC probes reach it on the pod IP while the service
    itself stays on loopback, or behind TLS, which those probes cannot speak."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="health"))
    health_pb2_grpc.add_HealthServicer_to_server(running.health, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind the health port {host}:{port}")
    server.start()
    running.health_server, running.health_port = server, bound
    return bound


def catch_stop_signals() -> threading.Event:
    """SIGTERM/SIGINT set the returned event from now on. Called before a service
    starts serving, so that a signal right after it reports SERVING is not missed."""
    stopping = threading.Event()

    def handle(signum, _frame) -> None:
        log.info("signal %d: NOT_SERVING, draining", signum)
        stopping.set()

    signal.signal(signal.SIGTERM, handle)
    signal.signal(signal.SIGINT, handle)
    return stopping


# Set by the launcher (specdec up, bench, load) in the services it starts: its pid. A
# service whose launcher is gone (killed, or ended by a native fault) stops as on SIGTERM
# rather than serving on with no one to stop it.
PARENT_PID_ENV = "SPECDEC_PARENT_PID"


def run_until_signal(running: RunningServer, grace_s: float = 10.0, on_stop: Callable[[], None] | None = None,
                     stopping: threading.Event | None = None) -> None:
    """Block until SIGTERM/SIGINT (`stopping`, from catch_stop_signals) or the end of the
    launcher that started this process, then NOT_SERVING, graceful stop (in-flight calls get
    grace_s), flush spans."""
    stopping = stopping or catch_stop_signals()
    launcher = int(os.environ.get(PARENT_PID_ENV) or 0)
    # Waking now and then: a signal delivered to another thread only sets a flag,
    # and Python runs the handler when the main thread next runs Python code.
    while not stopping.wait(0.2):
        if launcher and os.getppid() != launcher:
            log.warning("the launcher that started this service (pid %d) is gone: NOT_SERVING, draining", launcher)
            break
    running.stop(grace_s)
    if on_stop:
        on_stop()
    telemetry.shutdown()


def wait_until_serving(address: str, timeout_s: float, service: str = "", tls: ClientTls | None = None) -> None:
    """Block until `address` reports SERVING, or raise TimeoutError."""
    deadline = time.monotonic() + timeout_s
    with channel(address, tls) as ch:
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
