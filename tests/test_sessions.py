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


def test_an_owners_sessions_end_when_its_lease_lapses_and_renewals_keep_them():
    clock = Clock()
    store: SessionStore[str] = SessionStore(ttl_s=600, max_sessions=8, clock=clock)
    store.create("a1", lambda: "A1", owner="coord-a", lease_s=5)
    store.create("a2", lambda: "A2", owner="coord-a", lease_s=5)
    store.create("b1", lambda: "B1", owner="coord-b", lease_s=5)
    store.create("free", lambda: "F")                       # no owner: the TTL alone
    clock.now = 4
    assert store.renew("coord-b", 5) == 1                  # b renews, a does not
    clock.now = 6
    with store.use("a2"):                                   # in use: kept until its call ends
        assert store.reap() == 1 and store.ended_by_lease == 1
    assert store.reap() == 1 and store.ended_by_lease == 2
    assert len(store) == 2 and store.reaped_idle == 0
    with pytest.raises(NotFound, match="owner's lease lapsed"):
        with store.use("a1"):
            pass
    clock.now = 10
    assert store.reap() == 1 and len(store) == 1           # b's lease ran to 9
    clock.now = 700
    assert store.reap() == 1 and store.reaped_idle == 1 and len(store) == 0
    # A lapsed owner with nothing left is forgotten: a renewal starts a new lease.
    assert store.renew("coord-a", 5) == 0


def test_owner_and_lease_and_ids_are_bounded():
    store: SessionStore[str] = SessionStore(ttl_s=60, max_sessions=2)
    with pytest.raises(InvalidArgument, match="lease_s"):
        store.create("a", lambda: "A", owner="c", lease_s=0)
    with pytest.raises(InvalidArgument, match="owner"):
        store.create("a", lambda: "A", owner="x" * 129, lease_s=5)
    with pytest.raises(InvalidArgument, match="session_id"):
        with store.use("x" * 100_000):
            pass
    assert len(store) == 0


def test_a_real_service_ends_a_vanished_owners_sessions_and_bounds_its_strings(tiny_draft):
    running = drafter.service.serve(tiny_draft, session_ttl_s=600)
    try:
        with channel(f"127.0.0.1:{running.port}") as ch:
            stub = drafter_pb2_grpc.DrafterStub(ch)
            for i in range(2):
                stub.StartSession(common_pb2.StartSessionRequest(session_id=f"s{i}", prompt_token_ids=[5, 6, 7],
                                                                 owner="gone", lease_s=1.0))
            assert stub.KeepAlive(common_pb2.KeepAliveRequest(owner="gone", lease_s=1.0)).owned_sessions == 2
            assert wait_for(lambda: stub.Info(common_pb2.InfoRequest()).active_sessions == 0, 10)
            assert stub.Info(common_pb2.InfoRequest()).sessions_ended_by_lease == 2
            for call, request in ((stub.StartSession, common_pb2.StartSessionRequest(
                                       session_id="s", prompt_token_ids=[5], cache_salt=b"x" * 1_000_000)),
                                  (stub.KeepAlive, common_pb2.KeepAliveRequest(session_id="x" * 100_000)),
                                  (stub.KeepAlive, common_pb2.KeepAliveRequest()),
                                  (stub.EndSession, common_pb2.EndSessionRequest(session_id="x" * 200))):
                assert rpc_error(call, request).code() == grpc.StatusCode.INVALID_ARGUMENT
            assert stub.Info(common_pb2.InfoRequest()).active_sessions == 0
    finally:
        running.stop(0)
