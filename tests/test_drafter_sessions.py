"""A request's drafter session over its whole life: renewed while the request
drafts without it, ended off the request's path, and lost without taking the
drafter down for anyone else."""
from __future__ import annotations

import time
import uuid

import grpc
import pytest

import drafter.service
from coordinator.clients import DrafterClient, RemoteDraftProposer
from coordinator.service import DRAFTER_DOWN_CODES
from specdec.spec.proposers.model import ProposerUnavailable
from specdec.spec.sampling import SamplingConfig
from specdec.rpc.serving import channel
from specdec.v1 import common_pb2, coordinator_pb2 as pb, drafter_pb2_grpc
from tests.conftest import free_port, served_coordinator, wait_for

PROMPT = [11, 12, 13, 14, 15]
TTL = 1.0  # the drafter's --session-ttl here; its reaper looks every second


@pytest.fixture
def short_lived(tiny_draft):
    """A drafter whose idle sessions are reaped after TTL seconds."""
    running = drafter.service.serve(tiny_draft, session_ttl_s=TTL)
    yield running
    running.stop(0)


def proposer_on(running, **kwargs) -> tuple[RemoteDraftProposer, DrafterClient]:
    client = DrafterClient(f"127.0.0.1:{running.port}")
    info = client.info()
    assert info.session_ttl_s == TTL  # what the coordinator renews by
    return RemoteDraftProposer(client, info.tokenizer_fingerprint, keep_alive_s=info.session_ttl_s / 4,
                               **kwargs), client


def test_a_session_idle_past_the_ttl_is_kept_by_its_requests_renewals(short_lived):
    proposer, client = proposer_on(short_lived)
    try:
        proposer.start(uuid.uuid4().hex, PROMPT)
        proposer.ready()
        client.start_session_async(uuid.uuid4().hex, PROMPT, 10).result()  # a session nobody renews
        until = time.monotonic() + 3 * TTL  # rounds of lookups alone: no Propose, for three TTLs
        while time.monotonic() < until:
            proposer.keep_alive()
            time.sleep(0.05)
        assert client.info().active_sessions == 1  # the other one was reaped meanwhile
        assert len(proposer.propose(2, SamplingConfig(), None).token_ids) == 2  # this one is still there
    finally:
        proposer.end()
        client.close()


def test_a_lost_session_ends_model_drafting_for_its_request_only(short_lived):
    proposer, client = proposer_on(short_lived)
    try:
        session = uuid.uuid4().hex
        proposer.start(session, PROMPT)
        proposer.ready()
        client.stub.EndSession(common_pb2.EndSessionRequest(session_id=session))  # gone behind its back
        time.sleep(TTL / 4)
        proposer.keep_alive()  # sends the renewal
        with pytest.raises(ProposerUnavailable, match="lost this request's session") as lost:
            until = time.monotonic() + 5
            while time.monotonic() < until:
                proposer.keep_alive()
                time.sleep(0.02)
        assert lost.value.code == grpc.StatusCode.NOT_FOUND and lost.value.code not in DRAFTER_DOWN_CODES
    finally:
        proposer.end()
        client.close()


def test_a_drafter_that_the_watch_finds_down_ends_model_drafting_between_rounds(short_lived):
    up = {"drafter": True}
    proposer, client = proposer_on(short_lived, is_up=lambda: up["drafter"])
    try:
        proposer.start(uuid.uuid4().hex, PROMPT)
        proposer.ready()
        proposer.keep_alive()
        up["drafter"] = False
        with pytest.raises(ProposerUnavailable, match="drafter became unavailable"):
            proposer.keep_alive()
    finally:
        proposer.end()
        client.close()


def test_a_request_whose_drafter_session_vanishes_goes_on_and_the_drafter_stays_up(stack, tiny_draft):
    running = drafter.service.serve(tiny_draft)
    store = running.on_stop.__self__  # the drafter's session store
    try:
        with served_coordinator(drafter=f"127.0.0.1:{running.port}", verifier=stack.address(stack.verifier)) as c:
            request = pb.GenerateRequest(prompt="Once upon a time", max_new_tokens=300, ignore_eos=True,
                                         speculation=pb.Speculation(gamma=4, proposer=pb.PROPOSER_KIND_MODEL))
            reference = list(c.stub.Generate(pb.GenerateRequest(prompt="Once upon a time", max_new_tokens=300,
                                                                ignore_eos=True,
                                                                speculation=pb.Speculation(enabled=False)),
                                             timeout=60).token_ids)
            stream = c.stub.GenerateStream(request, timeout=60)
            received = list(next(stream).token_ids) + list(next(stream).token_ids)  # a round has drafted
            store.close()  # every drafter session lost at once, as in a restart
            final = None
            for message in stream:
                received += message.token_ids
                final = message
            assert received == reference
            assert "NOT_FOUND" in final.stats.fallback
            assert c.backends.drafter_up  # one session's loss is not the drafter's
            after = c.stub.Generate(request, timeout=60)
            assert list(after.token_ids) == reference and after.stats.draft_tokens > 0 and not after.stats.fallback
    finally:
        running.stop(0)


def test_an_end_session_that_fails_is_sent_again(stack):
    """EndSession is sent, not waited for, and a drafter that did not answer it
    (stopped, restarting) is asked again until it does."""
    calls = []
    client = DrafterClient(stack.address(stack.drafter))
    nowhere = channel(f"127.0.0.1:{free_port()}")  # nothing listens: UNAVAILABLE
    unreachable = drafter_pb2_grpc.DrafterStub(nowhere).EndSession
    original = client.stub.EndSession

    class FirstAttemptFails:
        def future(self, request, timeout=None):
            calls.append(request.session_id)
            return (unreachable if len(calls) == 1 else original).future(request, timeout=timeout)
    client.stub.EndSession = FirstAttemptFails()
    try:
        session = uuid.uuid4().hex
        client.start_session_async(session, PROMPT, 10).result()
        client.end_session(session)
        assert wait_for(lambda: stack.drafter_stub.Info(common_pb2.InfoRequest()).active_sessions == 0, 10)
        assert calls == [session, session]  # retried after its backoff
    finally:
        client.close()
        nowhere.close()
