"""Bad input gets a precise status and an actionable message; services keep
serving and no session leaks."""
from __future__ import annotations

import math

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.v1 import common_pb2, coordinator_pb2 as pb, drafter_pb2, verifier_pb2
from tests.conftest import wait_for, rpc_error

INVALID, NOT_FOUND = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND


def sampling(**kw) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(**kw)


BAD_GENERATE = {
    "no input": (pb.GenerateRequest(), "set one of prompt, messages or token_ids"),
    "empty prompt": (pb.GenerateRequest(prompt=""), "prompt is empty"),
    "empty messages": (pb.GenerateRequest(messages=pb.ChatMessages()), "messages is empty"),
    "bad role": (pb.GenerateRequest(messages=pb.ChatMessages(messages=[pb.ChatMessage(role="wizard", content="x")])),
                 "messages[0].role is 'wizard'"),
    "empty token ids": (pb.GenerateRequest(token_ids=pb.TokenIds()), "token_ids is empty"),
    "token id outside vocab": (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 100000])),
                               "token id 100000, outside the vocabulary (0..511)"),
    "max_new_tokens 0": (pb.GenerateRequest(prompt="hi", max_new_tokens=0), "max_new_tokens must be > 0, got 0"),
    "max_new_tokens negative": (pb.GenerateRequest(prompt="hi", max_new_tokens=-5), "max_new_tokens must be > 0"),
    "beyond context": (pb.GenerateRequest(prompt="hi", max_new_tokens=5000), "exceeds the target's context window (1024)"),
    "prompt longer than context": (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5] * 1100), max_new_tokens=1),
                                   "exceeds the target's context window"),
    "negative temperature": (pb.GenerateRequest(prompt="hi", sampling=sampling(temperature=-1)), "temperature"),
    "NaN temperature": (pb.GenerateRequest(prompt="hi", sampling=sampling(temperature=math.nan)), "temperature"),
    "top_p 0": (pb.GenerateRequest(prompt="hi", sampling=sampling(temperature=1, top_p=0.0)), "top_p must be in (0, 1]"),
    "top_p above 1": (pb.GenerateRequest(prompt="hi", sampling=sampling(top_p=1.5)), "top_p must be in (0, 1], got 1.5"),
    "negative top_k": (pb.GenerateRequest(prompt="hi", sampling=sampling(top_k=-1)), "top_k must be between 0"),
    "zero repetition penalty": (pb.GenerateRequest(prompt="hi", sampling=sampling(repetition_penalty=0)),
                                "repetition_penalty"),
    "gamma over limit": (pb.GenerateRequest(prompt="hi", speculation=pb.Speculation(gamma=1000)),
                         "speculation.gamma=1000 is over the proposer's limit of 32"),
    "empty stop string": (pb.GenerateRequest(prompt="hi", stop=[""]), "stop takes at most"),
    "huge max_new_tokens": (pb.GenerateRequest(prompt="hi", max_new_tokens=2**31 - 1),
                            "exceeds the target's context window"),
    "huge prompt": (pb.GenerateRequest(prompt="the cat sat on the mat. " * 20_000, max_new_tokens=1),
                    "shorten the prompt"),
    "infinite temperature": (pb.GenerateRequest(prompt="hi", sampling=sampling(temperature=math.inf)),
                             "temperature must be a finite number"),
    "NaN top_p": (pb.GenerateRequest(prompt="hi", sampling=sampling(temperature=1, top_p=math.nan)), "top_p"),
    "empty role": (pb.GenerateRequest(messages=pb.ChatMessages(messages=[pb.ChatMessage(role="", content="x")])),
                   "messages[0].role is ''"),
    # A long bad string is echoed clipped, its length said: whole, it overflowed gRPC's 16 KB
    # metadata and came back as RESOURCE_EXHAUSTED.
    "a 1 MB role": (pb.GenerateRequest(messages=pb.ChatMessages(messages=[pb.ChatMessage(role="r" * 2**20,
                                                                                          content="x")])),
                    "... (1,048,576 characters); expected one of system"),
    "a 1 MB draft source": (pb.GenerateRequest(prompt="hi", speculation=pb.Speculation(sources=["s" * 2**20])),
                            "characters as text): name each source once"),
    # Refused by their size before the chat template runs (its own errors would read otherwise).
    "too many messages": (pb.GenerateRequest(messages=pb.ChatMessages(
        messages=[pb.ChatMessage(role="user", content="hi")] * 5000)), "messages has 5,000 entries; at most 4,096"),
    "more messages than the context has tokens": (pb.GenerateRequest(max_new_tokens=24, messages=pb.ChatMessages(
        messages=[pb.ChatMessage(role="wizard", content="hi")] * 1001)), "messages has 1,001 entries, at least a token"),
    "messages longer than the context": (pb.GenerateRequest(max_new_tokens=24, messages=pb.ChatMessages(
        messages=[pb.ChatMessage(role="wizard", content="z" * 200_000)] * 2)), "the messages' contents (400,000"),
    "a temperature below float32's normal range": (
        pb.GenerateRequest(prompt="hi", sampling=sampling(temperature=1e-40)),
        "below the smallest one taken (1.175e-38"),
    "a repetition penalty below float32's normal range": (
        pb.GenerateRequest(prompt="hi", sampling=sampling(temperature=0.7, repetition_penalty=1e-39)),
        "repetition_penalty 1e-39 is below the smallest one taken"),
}
# Over the public port's message limit (4 MiB): gRPC itself refuses them.
OVERSIZED = {
    "prompt over the message limit": pb.GenerateRequest(prompt="x" * (5 << 20)),
    "messages over the message limit": pb.GenerateRequest(messages=pb.ChatMessages(
        messages=[pb.ChatMessage(role="user", content="y" * (1 << 20)) for _ in range(5)])),
}


def assert_healthy_and_empty(stack):
    for server in (stack.coordinator, stack.drafter, stack.verifier):
        with grpc.insecure_channel(stack.address(server)) as ch:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
    ok = stack.coordinator_stub.Generate(pb.GenerateRequest(prompt="still fine?", max_new_tokens=4), timeout=30)
    assert len(ok.token_ids) > 0
    for stub in (stack.drafter_stub, stack.verifier_stub):  # sessions end right after the answer
        assert wait_for(lambda: stub.Info(common_pb2.InfoRequest(), timeout=5).active_sessions == 0, 5)


@pytest.mark.parametrize("name", list(BAD_GENERATE))
def test_bad_generate_requests(stack, name):
    request, message = BAD_GENERATE[name]
    for call in (stack.coordinator_stub.Generate, lambda r, **kw: list(stack.coordinator_stub.GenerateStream(r, **kw))):
        error = rpc_error(call, request, timeout=30)
        assert error.code() == INVALID, (name, error.details())
        assert message in error.details(), (name, error.details())
        assert len(error.details()) < 1000, (name, len(error.details()))
    assert_healthy_and_empty(stack)


@pytest.mark.parametrize("name", list(OVERSIZED))
def test_messages_over_the_size_limit_get_resource_exhausted(stack, name):
    error = rpc_error(stack.coordinator_stub.Generate, OVERSIZED[name], timeout=30)
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "larger than max" in error.details()
    assert_healthy_and_empty(stack)


def test_internal_calls_with_unknown_session_get_not_found(stack):
    greedy = sampling()
    calls = [
        (stack.drafter_stub.Propose, drafter_pb2.ProposeRequest(session_id="nope", num_tokens=2, sampling=greedy)),
        (stack.verifier_stub.Verify, verifier_pb2.VerifyRequest(session_id="nope", draft_token_ids=[1], sampling=greedy)),
        (stack.verifier_stub.Decode, verifier_pb2.DecodeRequest(session_id="nope", num_tokens=2, sampling=greedy)),
    ]
    for call, request in calls:
        error = rpc_error(call, request, timeout=5)
        assert error.code() == NOT_FOUND and "unknown session 'nope'" in error.details()
    assert not stack.verifier_stub.EndSession(common_pb2.EndSessionRequest(session_id="nope")).existed


@pytest.fixture
def sessions(stack):
    """One open session on each model service, ended afterwards."""
    start = common_pb2.StartSessionRequest(session_id="bad-input-test", prompt_token_ids=[57, 84, 275])
    stack.drafter_stub.StartSession(start, timeout=5)
    stack.verifier_stub.StartSession(start, timeout=5)
    yield "bad-input-test"
    for stub in (stack.drafter_stub, stack.verifier_stub):
        stub.EndSession(common_pb2.EndSessionRequest(session_id="bad-input-test"), timeout=5)


def test_internal_bad_arguments(stack, sessions):
    hot = sampling(temperature=1.0)
    nan_probs = bytes.fromhex("007e") * 512  # fp16 NaN
    uniform = np.full(512, 1 / 512, dtype="<f2").tobytes()
    zero_at_1 = np.array([0.5, 0.0, 0.5] + [0.0] * 509, dtype="<f2").tobytes()

    def dense(data: bytes) -> common_pb2.DraftProbs:
        return common_pb2.DraftProbs(probs_fp16=data)
    cases = [
        (stack.drafter_stub.Propose, drafter_pb2.ProposeRequest(session_id=sessions, num_tokens=33, sampling=hot),
         "num_tokens=33 is over the limit of 32"),
        (stack.drafter_stub.Propose, drafter_pb2.ProposeRequest(
            session_id=sessions, num_tokens=1, sampling=hot, commit=drafter_pb2.Commit(num_accepted=3)),
         "commit.num_accepted=3 but only 0 tokens were drafted"),
        (stack.verifier_stub.Verify, verifier_pb2.VerifyRequest(
            session_id=sessions, draft_token_ids=[1], draft_probs=[dense(b"\x00" * 100)], sampling=hot),
         "draft_probs[0] has 100 bytes; expected 1024"),
        (stack.verifier_stub.Verify, verifier_pb2.VerifyRequest(
            session_id=sessions, draft_token_ids=[1], draft_probs=[dense(nan_probs)], sampling=hot),
         "NaN"),
        (stack.verifier_stub.Verify, verifier_pb2.VerifyRequest(
            session_id=sessions, draft_token_ids=[9999], sampling=sampling()), "outside the vocabulary"),
        (stack.verifier_stub.Verify, verifier_pb2.VerifyRequest(
            session_id=sessions, draft_token_ids=[1], draft_probs=[dense(uniform)], sampling=sampling()),
         "must be empty when temperature is 0"),
        (stack.verifier_stub.Verify, verifier_pb2.VerifyRequest(  # 2 drafts, probabilities for 3
            session_id=sessions, draft_token_ids=[1, 2], draft_probs=[dense(uniform)] * 3, sampling=hot),
         "draft_probs has 3 entries for 2 draft tokens"),
        (stack.verifier_stub.Verify, verifier_pb2.VerifyRequest(  # 3 free tokens of 2 drafts
            session_id=sessions, draft_token_ids=[1, 2], free_tokens=3, sampling=hot),
         "free_tokens=3 is more than the 2 draft tokens"),
        (stack.verifier_stub.Verify, verifier_pb2.VerifyRequest(  # 1 free token: a row for the other only
            session_id=sessions, draft_token_ids=[1, 2], free_tokens=1, draft_probs=[dense(uniform)] * 2,
            sampling=hot),
         "draft_probs has 2 entries for 1 draft tokens after the 1 free ones"),
        (stack.verifier_stub.Verify, verifier_pb2.VerifyRequest(  # a vocabulary of the wrong size
            session_id=sessions, draft_token_ids=[1], draft_probs=[dense(b"\x00\x3c" * 520)], sampling=hot),
         "expected 1024 for 1 draft tokens x vocab 512"),
        (stack.verifier_stub.Verify, verifier_pb2.VerifyRequest(  # the drafted token could not have been drawn
            session_id=sessions, draft_token_ids=[1], draft_probs=[dense(zero_at_1)], sampling=hot),
         "draft_probs[0] gives its drafted token 1 probability 0"),
        (stack.verifier_stub.Verify,  # the dense field of old (3, reserved) is no proposal: nothing was sent
         verifier_pb2.VerifyRequest.FromString(
             verifier_pb2.VerifyRequest(session_id=sessions, draft_token_ids=[1], sampling=hot).SerializeToString()
             + b"\x1a\x04\x00\x3c\x00\x3c"),
         "draft_probs has 0 entries for 1 draft tokens"),
        (stack.verifier_stub.Verify, verifier_pb2.VerifyRequest(
            session_id=sessions, draft_token_ids=[1] * 40, sampling=sampling()), "40 draft tokens is over the limit"),
        (stack.drafter_stub.Propose, drafter_pb2.ProposeRequest(
            session_id=sessions, num_tokens=1, sampling=hot,
            commit=drafter_pb2.Commit(num_accepted=0, target_token_ids=[70000])),
         "commit.target_token_ids contains token id 70000, outside the vocabulary"),
        (stack.drafter_stub.Propose, drafter_pb2.ProposeRequest(
            session_id=sessions, num_tokens=2, sampling=hot, min_confidence=1.5),
         "min_confidence must be in [0, 1], got 1.5"),
        (stack.verifier_stub.Decode, verifier_pb2.DecodeRequest(session_id=sessions, num_tokens=0, sampling=hot),
         "num_tokens must be in 1..4096"),
        (stack.drafter_stub.StartSession, common_pb2.StartSessionRequest(session_id="x", prompt_token_ids=[]),
         "prompt_token_ids is empty"),
    ]
    for call, request, message in cases:
        error = rpc_error(call, request, timeout=5)
        assert error.code() == INVALID and message in error.details(), (message, error.details())
    duplicate = rpc_error(stack.verifier_stub.StartSession,
                          common_pb2.StartSessionRequest(session_id=sessions, prompt_token_ids=[1]), timeout=5)
    assert duplicate.code() == grpc.StatusCode.ALREADY_EXISTS
    # The session survived the bad calls and still works.
    ok = stack.verifier_stub.Decode(verifier_pb2.DecodeRequest(session_id=sessions, num_tokens=2, sampling=hot), timeout=5)
    assert len(ok.token_ids) >= 1


def test_an_unexpected_error_reaches_the_client_as_an_error_id_and_the_log_as_its_traceback(stack, monkeypatch,
                                                                                           caplog):
    import logging
    import re

    import coordinator.service
    from tests.conftest import coordinator_stub

    def broken(*args, **kwargs):
        raise RuntimeError("internal detail: /srv/models/secret-path")
    with coordinator_stub(drafter=stack.address(stack.drafter), verifier=stack.address(stack.verifier)) as stub:
        monkeypatch.setattr(coordinator.service, "to_domain", broken)
        with caplog.at_level(logging.ERROR):
            error = rpc_error(stub.Generate, pb.GenerateRequest(prompt="hi"), timeout=10)
    assert error.code() == grpc.StatusCode.INTERNAL
    assert "secret-path" not in error.details() and "RuntimeError" not in error.details()
    error_id = re.search(r"error id ([0-9a-f]{16})", error.details()).group(1)
    logged = [r for r in caplog.records if error_id in r.getMessage()]
    assert logged and "secret-path" in str(logged[0].exc_info[1])  # the operator can find it by the id
