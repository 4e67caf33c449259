"""The session store: TTL reaping and admission limits."""
from __future__ import annotations

import grpc
import pytest

import drafter.service
from specdec.rpc.errors import AlreadyExists, InvalidArgument, NotFound, ResourceExhausted
from specdec.rpc.serving import channel
from specdec.rpc.sessions import SessionStore
from specdec.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc
from tests.conftest import rpc_error, wait_for


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def test_idle_sessions_are_reaped_after_the_ttl():
    clock = Clock()
    store: SessionStore[str] = SessionStore(ttl_s=10, max_sessions=4, clock=clock)
    store.create("a", lambda: "A")
    store.create("b", lambda: "B")
    clock.now = 6
    with store.use("a") as value:
        assert value == "A"
    clock.now = 12
    assert store.reap() == 1 and len(store) == 1     # b idle 12 s, a only 6 s
    with pytest.raises(NotFound, match="unknown session 'b'"):
        with store.use("b"):
            pass


def test_limits_and_duplicates():
    store: SessionStore[int] = SessionStore(ttl_s=60, max_sessions=2)
    store.create("a", lambda: 1)
    with pytest.raises(AlreadyExists):
        store.create("a", lambda: 1)
    store.create("b", lambda: 2)
    with pytest.raises(ResourceExhausted, match="--max-sessions"):
        store.create("c", lambda: 3)
    assert store.remove("a") and not store.remove("a")
    store.create("c", lambda: 3)
    with pytest.raises(InvalidArgument):
        store.create("", lambda: 0)


def test_a_session_is_idle_from_when_its_prefill_ends_not_from_when_it_began():
    clock = Clock()
    store: SessionStore[str] = SessionStore(ttl_s=10, clock=clock)

    def long_prefill() -> str:
        clock.now += 30  # three TTLs of prefill
        return "S"
    store.create("slow", long_prefill)
    assert store.reap() == 0 and len(store) == 1  # not idle yet: it was just made
    clock.now += 11
    assert store.reap() == 1


def test_a_failing_factory_leaves_no_session():
    store: SessionStore[int] = SessionStore()

    def boom() -> int:
        raise ValueError("no")
    with pytest.raises(ValueError):
        store.create("a", boom)
    assert len(store) == 0


def test_a_real_service_reaps_an_abandoned_session(tiny_draft):
    """A client that starts a session and vanishes: the reaper frees it after the TTL."""
    running = drafter.service.serve(tiny_draft, session_ttl_s=0.5)
    try:
        with channel(f"127.0.0.1:{running.port}") as ch:
            stub = drafter_pb2_grpc.DrafterStub(ch)
            started = stub.StartSession(common_pb2.StartSessionRequest(session_id="abandoned",
                                                                       prompt_token_ids=[5, 6, 7]))
            assert started.session_id == "abandoned"  # (how soon the reaper looks is its own business)
            assert wait_for(lambda: stub.Info(common_pb2.InfoRequest()).active_sessions == 0, 10)
            error = rpc_error(stub.Propose, drafter_pb2.ProposeRequest(session_id="abandoned", num_tokens=2))
            assert error.code() == grpc.StatusCode.NOT_FOUND and "reaped after 0.5 s idle" in error.details()
    finally:
        running.stop(0)
