"""specdec.service.model_service: a call that fails leaves its session exactly as it was.

A property over every failing case on both model services: of two twin sessions,
one gets the failing call; then both get the same valid calls (greedy and
seeded sampling, so the random generator's state counts too) and must answer
byte for byte alike. The malformed-bytes cases are here too: every service
refuses bytes that do not parse with INVALID_ARGUMENT, not INTERNAL."""
from __future__ import annotations

import itertools

import grpc
import pytest

from specdec.v1 import common_pb2, drafter_pb2, verifier_pb2
from tests.conftest import rpc_error

PROMPT = [57, 84, 275, 71, 261]
HOT = common_pb2.SamplingParams(temperature=0.9, seed=7)
GREEDY = common_pb2.SamplingParams()
_ids = itertools.count()


def start_twins(stub, prompt=PROMPT) -> tuple[str, str]:
    twins = tuple(f"twin-{next(_ids)}" for _ in range(2))
    for session_id in twins:
        stub.StartSession(common_pb2.StartSessionRequest(session_id=session_id, prompt_token_ids=prompt), timeout=10)
    return twins


def end(stub, *session_ids) -> None:
    for session_id in session_ids:
        stub.EndSession(common_pb2.EndSessionRequest(session_id=session_id), timeout=5)


def commit(num_accepted: int, ids) -> drafter_pb2.Commit:
    return drafter_pb2.Commit(num_accepted=num_accepted, target_token_ids=list(ids))


# Each: (request fields, the code it must fail with). Sent after a first Propose of 3 tokens.
FAILING_PROPOSE = {
    "commit of 5,000 ids (the probe's repro)": (dict(num_tokens=2, commit=commit(1, [5] * 5000)), "INVALID_ARGUMENT"),
    "commit of 1,019 ids (the probe's repro)": (dict(num_tokens=2, commit=commit(1, [5] * 1019)), "INVALID_ARGUMENT"),
    "commit that fits, draft that does not": (dict(num_tokens=8, commit=commit(3, [5] * 1010)), "INVALID_ARGUMENT"),
    "accepted more than drafted": (dict(num_tokens=2, commit=commit(4, [5])), "INVALID_ARGUMENT"),
    "commit id outside the vocabulary": (dict(num_tokens=2, commit=commit(1, [5, 9999])), "INVALID_ARGUMENT"),
    "no commit": (dict(num_tokens=2), "FAILED_PRECONDITION"),
    "too many tokens": (dict(num_tokens=33, commit=commit(1, [5])), "INVALID_ARGUMENT"),
    "min_confidence above 1": (dict(num_tokens=2, commit=commit(1, [5]), min_confidence=2.0), "INVALID_ARGUMENT"),
    "bad sampling": (dict(num_tokens=2, commit=commit(1, [5]),
                          sampling=common_pb2.SamplingParams(temperature=-1)), "INVALID_ARGUMENT"),
}


@pytest.mark.parametrize("case", list(FAILING_PROPOSE))
def test_a_failed_propose_leaves_the_drafter_session_as_it_was(stack, case):
    stub = stack.drafter_stub
    fields, code = FAILING_PROPOSE[case]
    twins = start_twins(stub)
    try:
        for session_id in twins:
            stub.Propose(drafter_pb2.ProposeRequest(session_id=session_id, num_tokens=3, sampling=HOT), timeout=10)
        error = rpc_error(stub.Propose, drafter_pb2.ProposeRequest(
            **{"session_id": twins[0], "sampling": HOT, **fields}), timeout=10)
        assert error.code().name == code, error.details()
        # The same valid rounds on both twins: a sampled one, a greedy one.
        for request in (dict(num_tokens=4, sampling=HOT, commit=commit(2, [11])),
                        dict(num_tokens=3, sampling=GREEDY, commit=commit(1, [12, 13]))):
            a, b = (stub.Propose(drafter_pb2.ProposeRequest(session_id=s, **request), timeout=10) for s in twins)
            assert without_batch(a) == without_batch(b), case
    finally:
        end(stub, *twins)


def without_batch(response):
    """The response less what the scheduler reports (its timings differ from call to call)."""
    response.ClearField("batch")
    return response


def probs_fp16(rows: int, vocab: int = 512, value: float = 1.0) -> list[common_pb2.DraftProbs]:
    """`rows` dense proposals, each `value` / vocab everywhere."""
    import numpy as np
    row = np.full(vocab, value / vocab, dtype="<f2").tobytes()
    return [common_pb2.DraftProbs(probs_fp16=row) for _ in range(rows)]


FAILING_VERIFY = {
    "beyond the context window": (dict(draft_token_ids=[5] * 30, sampling=GREEDY), "INVALID_ARGUMENT"),
    "draft id outside the vocabulary": (dict(draft_token_ids=[5, 9999], sampling=GREEDY), "INVALID_ARGUMENT"),
    "rows that do not sum to 1": (dict(draft_token_ids=[5, 6], draft_probs=probs_fp16(2, value=512.0),
                                       sampling=HOT), "INVALID_ARGUMENT"),
    "probabilities of the wrong shape": (dict(draft_token_ids=[5, 6], draft_probs=probs_fp16(3),
                                              sampling=HOT), "INVALID_ARGUMENT"),
    "probabilities when greedy": (dict(draft_token_ids=[5], draft_probs=probs_fp16(1), sampling=GREEDY),
                                  "INVALID_ARGUMENT"),
    "too many drafts": (dict(draft_token_ids=[5] * 33, sampling=GREEDY), "INVALID_ARGUMENT"),
}
FAILING_DECODE = {
    "no tokens": (dict(num_tokens=0, sampling=HOT), "INVALID_ARGUMENT"),
    "beyond the context window": (dict(num_tokens=100, sampling=HOT), "INVALID_ARGUMENT"),
}
# Long enough that 30 more tokens, or 100, overflow the tiny target's 1,024.
LONG_PROMPT = (PROMPT * 200)[:1000]


@pytest.mark.parametrize("case", [*(("Verify", c) for c in FAILING_VERIFY), *(("Decode", c) for c in FAILING_DECODE)])
def test_a_failed_verify_or_decode_leaves_the_verifier_session_as_it_was(stack, case):
    stub = stack.verifier_stub
    method, name = case
    fields, code = (FAILING_VERIFY if method == "Verify" else FAILING_DECODE)[name]
    twins = start_twins(stub, LONG_PROMPT)
    try:
        for session_id in twins:  # one round each first, so there is state to keep
            stub.Verify(verifier_pb2.VerifyRequest(session_id=session_id, draft_token_ids=[5, 6], sampling=GREEDY),
                        timeout=10)
        request_cls = verifier_pb2.VerifyRequest if method == "Verify" else verifier_pb2.DecodeRequest
        error = rpc_error(getattr(stub, method), request_cls(session_id=twins[0], **fields), timeout=10)
        assert error.code().name == code, error.details()
        for call, request in ((stub.Verify, dict(draft_token_ids=[7, 8, 9], draft_probs=probs_fp16(3),
                                                 sampling=HOT)),
                              (stub.Decode, dict(num_tokens=5, sampling=HOT)),
                              (stub.Verify, dict(draft_token_ids=[10], sampling=GREEDY))):
            request_cls = verifier_pb2.VerifyRequest if call is stub.Verify else verifier_pb2.DecodeRequest
            a, b = (call(request_cls(session_id=s, **request), timeout=10) for s in twins)
            assert without_batch(a) == without_batch(b), (name, call)
    finally:
        end(stub, *twins)


# Field 1 (a string in every request below) holding invalid UTF-8: the probe's bytes.
MALFORMED = b"\x0a\x04\xff\xfe\xc0\x80"


@pytest.mark.parametrize("server, method, streaming", [
    ("coordinator", "/specdec.v1.Coordinator/Generate", False),
    ("coordinator", "/specdec.v1.Coordinator/GenerateStream", True),
    ("drafter", "/specdec.v1.Drafter/Propose", False),
    ("drafter", "/specdec.v1.Drafter/StartSession", False),
    ("verifier", "/specdec.v1.Verifier/Verify", False),
    ("verifier", "/specdec.v1.Verifier/Decode", False),
])
def test_malformed_request_bytes_get_invalid_argument(stack, server, method, streaming):
    with grpc.insecure_channel(stack.address(getattr(stack, server))) as ch:
        call = (ch.unary_stream if streaming else ch.unary_unary)(method)  # raw bytes in and out

        def send():
            reply = call(MALFORMED, timeout=10)
            return list(reply) if streaming else reply
        error = rpc_error(send)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert "not a valid protobuf message" in error.details() and method in error.details()


def test_a_model_service_publishes_its_cost_curve_in_info(tiny_target, monkeypatch):
    import verifier.service
    from specdec.runtime.cost_curve import COST_CURVE_ENV
    from specdec.v1 import verifier_pb2_grpc
    for variable in COST_CURVE_ENV.values():  # measured here, whatever the run pins
        monkeypatch.delenv(variable, raising=False)
    running = verifier.service.serve(tiny_target, cost_curve_rows=5)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{running.port}") as ch:
            info = verifier_pb2_grpc.VerifierStub(ch).Info(common_pb2.InfoRequest())
            assert len(info.forward_ms) == 5 and all(ms > 0 for ms in info.forward_ms)
            assert info.prefill_ms_per_token > 0
            # Served forwards keep it current: 1-row decode steps give row 1 its cost, and the rows
            # not served move with it (one scale for all), so a busy warm-up does not govern for good.
            stub = verifier_pb2_grpc.VerifierStub(ch)
            stub.StartSession(common_pb2.StartSessionRequest(session_id="live", prompt_token_ids=list(range(3, 9))))
            for _ in range(2):
                stub.Decode(verifier_pb2.DecodeRequest(session_id="live", num_tokens=8,
                                                       sampling=common_pb2.SamplingParams()))
            live = stub.Info(common_pb2.InfoRequest())
        scale = live.forward_ms[0] / info.forward_ms[0]
        assert [ms / was for ms, was in zip(live.forward_ms[1:], info.forward_ms[1:])] == pytest.approx([scale] * 4,
                                                                                                      rel=1e-2)
        assert live.prefill_ms_per_token / info.prefill_ms_per_token == pytest.approx(scale, rel=1e-2)
    finally:
        running.stop(0)


def test_a_pinned_cost_curve_is_published_instead_of_a_measured_one(tiny_target, monkeypatch):
    import verifier.service
    from specdec.runtime.cost_curve import CostCurve
    from specdec.v1 import verifier_pb2_grpc
    monkeypatch.setenv("SPECDEC_VERIFIER_COST_CURVE", "20, 21.5,23:2.5")
    assert CostCurve.parse("7,8") == CostCurve([7.0, 8.0], 7.0)
    for bad in ("", "fast", "1,-2", "3:x"):
        with pytest.raises(ValueError, match="MS,MS"):
            CostCurve.parse(bad)
    running = verifier.service.serve(tiny_target, cost_curve_rows=5)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{running.port}") as ch:
            stub = verifier_pb2_grpc.VerifierStub(ch)
            stub.StartSession(common_pb2.StartSessionRequest(session_id="pinned", prompt_token_ids=[3, 4, 5]))
            stub.Decode(verifier_pb2.DecodeRequest(session_id="pinned", num_tokens=8,
                                                   sampling=common_pb2.SamplingParams()))
            info = stub.Info(common_pb2.InfoRequest())
        # Pinned stays pinned, however the forwards went: the policy tests plan on it.
        assert list(info.forward_ms) == [20.0, 21.5, 23.0] and info.prefill_ms_per_token == 2.5
    finally:
        running.stop(0)


def test_start_session_answers_once_the_device_has_done_its_prefill(tiny_draft, monkeypatch):
    """A GPU runs a prefill's chunks after they are queued, and nothing reads them: StartSession
    waits, on its own thread, for a mark the torch thread made after the last chunk, so its
    latency is the prefill's (the coordinator prices the drafter's prefill by it)."""
    import drafter.service
    from specdec.runtime import torch_thread
    from specdec.runtime.batching import Scheduler
    from specdec.runtime.device import DevicePolicy
    from specdec.v1 import drafter_pb2_grpc
    log: list[tuple[str, bool]] = []

    class Mark:                       # the device's side: where it was made and waited
        def __init__(self):
            log.append(("mark", torch_thread.on_it()))

        def wait(self):
            log.append(("wait", torch_thread.on_it()))

    forwarded = Scheduler._forwarded
    monkeypatch.setattr(Scheduler, "_forwarded",
                        lambda self, *args: (log.append(("forward", torch_thread.on_it())), forwarded(self, *args)))
    monkeypatch.setattr(DevicePolicy, "mark", lambda self: Mark())
    running = drafter.service.serve(tiny_draft, cost_curve_rows=0, prefill_chunk=16)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{running.port}") as ch:
            log.clear()
            reply = drafter_pb2_grpc.DrafterStub(ch).StartSession(
                common_pb2.StartSessionRequest(session_id="marked", prompt_token_ids=list(range(3, 43))))
            log.append(("answered", False))
        assert reply.cached_tokens == 39
        assert log == [("forward", True)] * 3 + [("mark", True), ("wait", False), ("answered", False)]
    finally:
        running.stop(0)
