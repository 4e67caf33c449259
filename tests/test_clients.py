"""coordinator.clients alone: the verifier and drafter clients and the remote
proposer against scripted model services, real gRPC servers on loopback whose
answers and failures each test sets (the model services' own behaviour is
tested against the real ones elsewhere)."""
from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc
import numpy as np
import pytest

from coordinator import clients
from coordinator.clients import DrafterClient, RemoteDraftProposer, VerifierClient
from specdec.rpc.errors import RemoteError
from specdec.runtime.cost_curve import CostCurve
from specdec.spec.proposers import MODEL
from specdec.spec.proposers.model import ProposerUnavailable
from specdec.spec.proposers.ngram import NGRAM
from specdec.spec.types import Commit, Proposal
from specdec.spec.sampling import SamplingConfig
from specdec.spec.wire import Truncation
from specdec.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc, verifier_pb2, verifier_pb2_grpc

FINGERPRINT = "f" * 64
SAMPLED = SamplingConfig(temperature=0.7, seed=3)


class Script:
    """What a scripted service answers: per method, a list of replies or
    (code, details) failures, taken in order (the last one repeats)."""

    def __init__(self):
        self.replies: dict[str, list] = {}
        self.requests: dict[str, list] = {}
        self.lock = threading.Lock()

    def answer(self, method: str, request, context):
        with self.lock:
            self.requests.setdefault(method, []).append(request)
            queue = self.replies.get(method, [])
            reply = queue.pop(0) if len(queue) > 1 else (queue[0] if queue else None)
        if isinstance(reply, tuple):
            context.abort(*reply)
        if callable(reply):
            return reply(request)
        return reply


class ScriptedVerifier(verifier_pb2_grpc.VerifierServicer):
    def __init__(self, script: Script):
        self.script = script

    def StartSession(self, request, context):
        return self.script.answer("StartSession", request, context) or common_pb2.StartSessionResponse()

    def Verify(self, request, context):
        return self.script.answer("Verify", request, context)

    def Decode(self, request, context):
        return self.script.answer("Decode", request, context)

    def EndSession(self, request, context):
        return self.script.answer("EndSession", request, context) or common_pb2.EndSessionResponse()


class ScriptedDrafter(drafter_pb2_grpc.DrafterServicer):
    def __init__(self, script: Script):
        self.script = script

    def StartSession(self, request, context):
        return self.script.answer("StartSession", request, context) or common_pb2.StartSessionResponse(
            tokenizer_fingerprint=FINGERPRINT)

    def Propose(self, request, context):
        return self.script.answer("Propose", request, context)

    def KeepAlive(self, request, context):
        return self.script.answer("KeepAlive", request, context) or common_pb2.KeepAliveResponse(existed=True)

    def EndSession(self, request, context):
        return self.script.answer("EndSession", request, context) or common_pb2.EndSessionResponse()


@pytest.fixture
def scripted():
    """(verifier script, drafter script, address) of one loopback server holding both services."""
    verifier, drafter = Script(), Script()
    server = grpc.server(futures.ThreadPoolExecutor(8))
    verifier_pb2_grpc.add_VerifierServicer_to_server(ScriptedVerifier(verifier), server)
    drafter_pb2_grpc.add_DrafterServicer_to_server(ScriptedDrafter(drafter), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield verifier, drafter, f"127.0.0.1:{port}"
    server.stop(0)


def eventually(condition, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return condition()


def test_verify_sends_the_draft_and_reads_the_rejection_output_with_its_batching(scripted):
    verifier, _, address = scripted
    verifier.replies["Verify"] = [verifier_pb2.VerifyResponse(
        num_accepted=2, next_token_id=42, bonus=False,
        batch=common_pb2.BatchStats(forwards=2, rows=12, calls=6, queue_ms=3.5))]
    client = VerifierClient(address)
    probs = common_pb2.DraftProbs(token_ids=(5, 9), probs_fp16=np.array([0.75, 0.25], np.float16).tobytes())
    last = common_pb2.DraftProbs(token_ids=(8,), probs_fp16=np.array([1.0], np.float16).tobytes())
    proposal = Proposal((7, 5, 8), (probs, last), sources=((NGRAM, 1), (MODEL, 2)), free_tokens=1)
    result = client.verify("s1", proposal, SAMPLED)
    (sent,) = verifier.requests["Verify"]
    assert (sent.session_id, list(sent.draft_token_ids), sent.free_tokens) == ("s1", [7, 5, 8], 1)
    assert [list(p.token_ids) for p in sent.draft_probs] == [[5, 9], [8]]   # none for the lookup's token
    assert sent.sampling.temperature == pytest.approx(0.7) and sent.sampling.seed == 3
    assert (result.num_accepted, result.next_token_id, result.bonus) == (2, 42, False)
    assert (result.batch.forwards, result.batch.mean_rows, result.batch.mean_calls) == (2, 6.0, 3.0)
    # The draft's bytes are its ids and probabilities, serialized: the session id and sampling are not counted.
    alone = verifier_pb2.VerifyRequest(draft_token_ids=[7, 5, 8], draft_probs=sent.draft_probs, free_tokens=1)
    assert result.draft_bytes == alone.ByteSize() > 0
    assert result.output_token_ids(proposal.token_ids) == [7, 5, 42]
    client.close()


def test_a_refusal_keeps_its_code_and_says_what_to_do_while_transport_details_stay_out(scripted):
    verifier, _, address = scripted
    client = VerifierClient(address)
    verifier.replies["Decode"] = [(grpc.StatusCode.RESOURCE_EXHAUSTED, "the KV cache budget is spent; retry later")]
    with pytest.raises(RemoteError) as refused:
        client.decode("s1", 4, SamplingConfig())
    assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "KV cache budget" in str(refused.value)
    verifier.replies["Decode"] = [(grpc.StatusCode.UNAVAILABLE, "connect failed: 10.0.0.7:50052")]
    with pytest.raises(RemoteError) as unavailable:
        client.decode("s1", 4, SamplingConfig())
    assert unavailable.value.code == grpc.StatusCode.UNAVAILABLE and "10.0.0.7" not in str(unavailable.value)
    client.close()


def test_end_session_is_retried_while_the_service_is_unavailable_and_never_blocks(scripted, monkeypatch):
    verifier, _, address = scripted
    monkeypatch.setattr(clients, "END_SESSION_BACKOFF_S", 0.01)
    verifier.replies["EndSession"] = [(grpc.StatusCode.UNAVAILABLE, "restarting"),
                                      (grpc.StatusCode.UNAVAILABLE, "restarting"), common_pb2.EndSessionResponse()]
    client = VerifierClient(address)
    started = time.perf_counter()
    client.end_session("s1")
    assert time.perf_counter() - started < 0.5   # off the caller's path
    assert eventually(lambda: len(verifier.requests.get("EndSession", [])) == 3)
    time.sleep(0.1)
    assert len(verifier.requests["EndSession"]) == 3   # answered: no more attempts
    # A refusal that retrying cannot change is not retried.
    verifier.replies["EndSession"] = [(grpc.StatusCode.INVALID_ARGUMENT, "bad id")]
    client.end_session("bad")
    assert eventually(lambda: len(verifier.requests["EndSession"]) == 4)
    time.sleep(0.1)
    assert len(verifier.requests["EndSession"]) == 4
    client.close()


def remote(address: str, **options) -> RemoteDraftProposer:
    return RemoteDraftProposer(DrafterClient(address), FINGERPRINT, **options)


def test_the_drafter_takes_the_lookups_tokens_and_the_proposal_is_its_own_drafts(scripted):
    _, drafter, address = scripted
    probs = [common_pb2.DraftProbs(token_ids=[11, 12], probs_fp16=np.array([0.5, 0.5], np.float16).tobytes())] * 2
    drafter.replies["Propose"] = [drafter_pb2.ProposeResponse(draft_token_ids=[11, 12], draft_confidences=[0.9, 0.5],
                                                              draft_probs=probs)]
    proposer = remote(address, truncation=Truncation(top_k=8, top_p=0.9))
    proposer.start("s1", [1, 2, 3])
    proposer.ready()
    proposal = proposer.propose(2, SAMPLED, Commit(1, (4,)), 0.25, prefix=(7,))
    (sent,) = drafter.requests["Propose"]
    assert list(sent.draft_prefix_ids) == [7] and sent.num_tokens == 2 and sent.min_confidence == 0.25
    assert (sent.commit.num_accepted, list(sent.commit.target_token_ids)) == (1, [4])
    assert sent.truncation_top_k == 8 and sent.truncation_top_p == pytest.approx(0.9)
    assert proposal.token_ids == (11, 12) and proposal.sources == ((MODEL, 2),) and proposal.free_tokens == 0
    assert list(proposal.draft_probs) == probs   # passed through as the drafter sent them
    assert proposal.confidences == pytest.approx((0.9, 0.5))
    proposer.end()
    assert eventually(lambda: [r.session_id for r in drafter.requests.get("EndSession", [])] == ["s1"])


def test_a_drafter_with_another_tokenizer_is_refused_before_any_draft(scripted):
    _, drafter, address = scripted
    drafter.replies["StartSession"] = [common_pb2.StartSessionResponse(tokenizer_fingerprint="0" * 64)]
    proposer = remote(address)
    proposer.start("s1", [1, 2, 3])
    with pytest.raises(ProposerUnavailable) as refused:
        proposer.ready()
    assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION and "tokenizer" in str(refused.value)
    assert "Propose" not in drafter.requests


def test_a_failing_drafter_becomes_unavailable_but_the_callers_own_deadline_stays_the_callers(scripted):
    _, drafter, address = scripted
    drafter.replies["Propose"] = [(grpc.StatusCode.INTERNAL, "error id 1234"),
                                  (grpc.StatusCode.INVALID_ARGUMENT, "num_tokens must be at most 16")]
    proposer = remote(address)
    proposer.start("s1", [1, 2, 3])
    with pytest.raises(ProposerUnavailable) as failed:
        proposer.propose(2, SamplingConfig(), None)
    assert failed.value.code == grpc.StatusCode.INTERNAL and "became unavailable" in str(failed.value)
    with pytest.raises(ProposerUnavailable) as refused:
        proposer.propose(40, SamplingConfig(), None)
    assert "refused Propose" in str(refused.value) and "at most 16" in str(refused.value)
    # The caller's deadline passed: that is the request's error, not a drafter failure to fall back from.
    drafter.replies["Propose"] = [(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline")]
    late = remote(address, timeout=lambda: 0.0)
    late.start("s2", [1])
    with pytest.raises(RemoteError) as deadline:
        late.propose(2, SamplingConfig(), None)
    assert not isinstance(deadline.value, ProposerUnavailable)
    assert deadline.value.code == grpc.StatusCode.DEADLINE_EXCEEDED


def test_keep_alive_renews_an_idle_session_and_reports_one_the_drafter_lost(scripted):
    _, drafter, address = scripted
    proposer = remote(address, keep_alive_s=0.0)
    proposer.start("s1", [1, 2, 3])
    proposer.ready()
    proposer.keep_alive()                       # idle past keep_alive_s: a renewal goes out, unawaited
    assert eventually(lambda: len(drafter.requests.get("KeepAlive", [])) == 1)
    drafter.replies["KeepAlive"] = [common_pb2.KeepAliveResponse(existed=False)]
    time.sleep(0.05)
    proposer.keep_alive()                       # reads the first renewal (existed), sends a second
    assert eventually(lambda: len(drafter.requests["KeepAlive"]) == 2)
    time.sleep(0.05)
    with pytest.raises(ProposerUnavailable) as lost:
        proposer.keep_alive()
    assert lost.value.code == grpc.StatusCode.NOT_FOUND
    # The coordinator's health watch saw the drafter go: no call needed to know.
    down = remote(address, is_up=lambda: False)
    down.start("s2", [1])
    down.ready()
    with pytest.raises(ProposerUnavailable, match="health checks"):
        down.keep_alive()


def test_the_watch_reads_info_again_while_the_backend_is_up(tiny_target):
    """A model service's curve follows its forwards: the coordinator's watch hands
    each newer Info to its listeners (the γ priors)."""
    import verifier.service
    from coordinator.backends import BackendWatch, WatchSettings
    running = verifier.service.serve(tiny_target, cost_curve=CostCurve.parse("5,6,7:1"))
    client = VerifierClient(f"127.0.0.1:{running.port}")
    watch = BackendWatch("verifier", client, lambda: None, WatchSettings(interval_s=0.01, info_every=3))
    seen = []
    watch.on_info(seen.append)
    watch.start()
    try:
        assert eventually(lambda: len(seen) >= 2)
        assert list(seen[0].forward_ms) == [5.0, 6.0, 7.0] and watch.up
    finally:
        watch.stop()
        client.close()
        running.stop(0)
