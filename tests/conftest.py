"""Shared fixtures: the tiny models, and the three services as real gRPC servers
on loopback ports (in this process, so a test run stays fast)."""
from __future__ import annotations

import contextlib
import os
import socket
import time
from dataclasses import dataclass
from typing import Iterator

import grpc
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import drafter.service
import verifier.service
from coordinator.backends import Backends
from coordinator.service import CoordinatorConfig, serve as serve_coordinator
from specdec.runtime.cost_curve import COST_CURVE_ENV, CostCurve
from specdec.runtime.models import LoadedModel, load_model
from specdec.rpc.serving import RunningServer, channel
from specdec.v1 import coordinator_pb2_grpc, drafter_pb2_grpc, verifier_pb2_grpc


# A machine on which drafting never pays: a draft step at ten target steps, and a
# drafter prefill dearer than what drafting could save. `pytest --slow-draft-curves`
# pins these in every model service of the run (in-process and subprocesses), so
# that no test can pass only because this machine's timings made the adaptive γ draft.
SLOW_DRAFT_CURVES = {COST_CURVE_ENV["Drafter"]: "200,210,220,230,240:50",
                     COST_CURVE_ENV["Verifier"]: "20,21,22,23,24,25,26,27,28:2"}


def pytest_addoption(parser):
    parser.addoption("--slow-draft-curves", action="store_true",
                     help="pin cost curves on which the adaptive γ never drafts with the model (see conftest)")


def pytest_configure(config):
    if config.getoption("--slow-draft-curves"):
        os.environ.update(SLOW_DRAFT_CURVES)


def pytest_collection_modifyitems(config, items):
    """The --slow-draft-curves pass is for what the curves decide: a test that pins γ and
    its sources (`fixed_policy`) would run the same work again, and is left out of it."""
    if not config.getoption("--slow-draft-curves"):
        return
    kept = [item for item in items if item.get_closest_marker("fixed_policy") is None]
    if len(kept) < len(items):
        config.hook.pytest_deselected(items=[item for item in items if item not in kept])
        items[:] = kept


@pytest.fixture(scope="session")
def tiny_target() -> LoadedModel:
    return load_model("tiny-target")


@pytest.fixture(scope="session")
def tiny_draft() -> LoadedModel:
    return load_model("tiny-draft")


@dataclass
class Stack:
    drafter: RunningServer
    verifier: RunningServer
    coordinator: RunningServer
    coordinator_stub: coordinator_pb2_grpc.CoordinatorStub
    drafter_stub: drafter_pb2_grpc.DrafterStub
    verifier_stub: verifier_pb2_grpc.VerifierStub

    def address(self, server: RunningServer) -> str:
        return f"127.0.0.1:{server.port}"


@pytest.fixture(scope="session")
def stack(tiny_target, tiny_draft):
    d = drafter.service.serve(tiny_draft)
    v = verifier.service.serve(tiny_target)
    c, backends = serve_coordinator(CoordinatorConfig(drafter=f"127.0.0.1:{d.port}", verifier=f"127.0.0.1:{v.port}",
                                                      gamma=4, connect_timeout_s=30))
    channels = [channel(f"127.0.0.1:{s.port}") for s in (c, d, v)]
    yield Stack(d, v, c, coordinator_pb2_grpc.CoordinatorStub(channels[0]),
                drafter_pb2_grpc.DrafterStub(channels[1]), verifier_pb2_grpc.VerifierStub(channels[2]))
    for ch in channels:
        ch.close()
    backends.close()
    for server in (c, d, v):
        server.stop(0)


# Curves on which drafting with the model pays: a draft step at a tenth of a target step.
CHEAP_DRAFT_MS, TARGET_MS = [1.0, 1.1], [10.0, 10.5, 11.0, 11.5, 12.0, 12.5, 13.0, 13.5, 14.0]


@contextlib.contextmanager
def pinned_services(tiny_draft, tiny_target, draft_ms=CHEAP_DRAFT_MS, target_ms=TARGET_MS,
                    draft_prefill_ms: float = 0.05) -> Iterator[dict]:
    """A drafter and a verifier publishing the given cost curves (not this machine's,
    nor the environment's): with a coordinator that does not learn costs
    (learn_costs=False), the adaptive γ decides alike on every machine. Yields the
    coordinator's drafter= and verifier= addresses."""
    servers = [drafter.service.serve(tiny_draft, cost_curve=CostCurve(list(draft_ms), draft_prefill_ms)),
               verifier.service.serve(tiny_target, cost_curve=CostCurve(list(target_ms), 1.0))]
    try:
        yield {"drafter": f"127.0.0.1:{servers[0].port}", "verifier": f"127.0.0.1:{servers[1].port}"}
    finally:
        for server in servers:
            server.stop(0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate, timeout_s: float = 20.0, interval_s: float = 0.05) -> bool:
    """Poll until `predicate()` holds; its last value."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return bool(predicate())


def rpc_error(call, *args, **kwargs) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call(*args, **kwargs)
    return info.value


@contextlib.contextmanager
def coordinator_stub(**config) -> Iterator[coordinator_pb2_grpc.CoordinatorStub]:
    """A coordinator on a loopback port over the given backends, stopped afterwards."""
    with served_coordinator(**config) as served:
        yield served.stub


@contextlib.contextmanager
def pair_stub(draft: LoadedModel, target: LoadedModel, **config) -> Iterator[coordinator_pb2_grpc.CoordinatorStub]:
    """A drafter and a verifier over these models, and a coordinator before them; all stopped afterwards."""
    servers = [drafter.service.serve(draft), verifier.service.serve(target)]
    try:
        with coordinator_stub(drafter=f"127.0.0.1:{servers[0].port}", verifier=f"127.0.0.1:{servers[1].port}",
                              **config) as stub:
            yield stub
    finally:
        for server in servers:
            server.stop(0)


@dataclass
class ServedCoordinator:
    stub: coordinator_pb2_grpc.CoordinatorStub
    backends: Backends        # the health watches
    running: RunningServer

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.running.port}"


@contextlib.contextmanager
def served_coordinator(**config) -> Iterator[ServedCoordinator]:
    """Like coordinator_stub, also giving the coordinator's server and backends."""
    running, backends = serve_coordinator(CoordinatorConfig(**{"connect_timeout_s": 30, **config}))
    try:
        with channel(f"127.0.0.1:{running.port}") as ch:
            yield ServedCoordinator(coordinator_pb2_grpc.CoordinatorStub(ch), backends, running)
    finally:
        backends.close()
        running.stop(0)


def model_draft_tokens(stats) -> int:
    """A response's tokens drafted by the draft model (not by n-gram lookups)."""
    return sum(s.draft_tokens for s in stats.draft_sources if s.source == "model")


@pytest.fixture
def registry(monkeypatch, kernel_state):
    """specdec.runtime.kernels with no backend registered: a test registers its own."""
    from specdec.runtime import kernels
    monkeypatch.setattr(kernels, "BACKENDS", [])
    return kernels


@pytest.fixture
def kernel_state():
    """A kernel state of the test's own (kernel_choices.KernelState): the choices it
    makes or pins, and the checks that fail in it, end with the test."""
    from specdec.runtime import kernel_choices
    with kernel_choices.scope() as state:
        yield state


class NoHostReads(TorchDispatchMode):
    """Within: an op that reads a tensor's value back to the host (int(), bool(), .item(),
    nonzero) raises. On a GPU each such read waits for all the work queued before it."""
    READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default,
             torch.ops.aten.is_nonzero.default, torch.ops.aten.nonzero.default}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.READS:
            raise AssertionError(f"{func} reads a value back to the host")
        return func(*args, **(kwargs or {}))
