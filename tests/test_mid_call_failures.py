"""Failures after a call has changed its session: the KV pool refusing a page at
draft step 3, a forward raising inside a batch. The call fails alone; its session
is as it was (a twin that never saw the failure answers the same calls alike);
the other calls of the batch, and the scheduler, go on."""
from __future__ import annotations

import concurrent.futures
import threading

import pytest
import torch

import drafter.service
import verifier.service
from specdec.runtime import torch_thread
from specdec.runtime.batching import Scheduler, lean_batch_forward
from specdec.runtime.kv_cache import CHUNK
from specdec.spec.sampling import SamplingConfig
from specdec.rpc.serving import channel
from specdec.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc, verifier_pb2, verifier_pb2_grpc
from tests.conftest import rpc_error, wait_for
from tests.test_batching import PROMPTS, run_concurrently
from tests.test_model_service import GREEDY, HOT, commit, end, start_twins, without_batch
from verifier.target_session import TargetSession

# Its prefill caches 254 tokens of a 256-token page: draft steps 1 and 2 fit, step 3 needs a second page.
PAGE_EDGE_PROMPT = [(13 * i + 5) % 500 + 3 for i in range(CHUNK - 1)]


def test_the_kv_pool_refusing_at_draft_step_3_leaves_the_session_as_it_was(tiny_draft):
    # A pool of exactly the twins' first pages: the third step of a 6-token draft is refused.
    pages_mb = 2 * CHUNK * tiny_draft.lean.token_bytes() / 2**20
    running = drafter.service.serve(tiny_draft, kv_cache_mb=pages_mb)
    try:
        with channel(f"127.0.0.1:{running.port}") as ch:
            stub = drafter_pb2_grpc.DrafterStub(ch)
            twins = start_twins(stub, PAGE_EDGE_PROMPT)
            error = rpc_error(stub.Propose, drafter_pb2.ProposeRequest(session_id=twins[0], num_tokens=6,
                                                                       sampling=HOT), timeout=10)
            assert error.code().name == "RESOURCE_EXHAUSTED", error.details()
            assert "KV cache" in error.details()
            info = stub.Info(common_pb2.InfoRequest(), timeout=5)
            assert info.kv_tokens_used == 2 * CHUNK  # no page taken by the failed call
            # Two steps had run (tokens appended, KV written, the generator drawn twice): all undone.
            for request in (dict(num_tokens=2, sampling=HOT), dict(num_tokens=1, sampling=GREEDY,
                                                                 commit=commit(0, []))):
                a, b = (stub.Propose(drafter_pb2.ProposeRequest(session_id=s, **request), timeout=10) for s in twins)
                assert without_batch(a) == without_batch(b), request
            end(stub, *twins)
    finally:
        running.stop(0)


class FailingHead:
    """The LM head, raising whenever the rows it gets include `rows` or more (one
    call's kept rows): in a batch with that call, and for that call alone."""

    def __init__(self, head, rows: int):
        self.head, self.rows, self.raised = head, rows, 0

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        if hidden.shape[0] >= self.rows:
            self.raised += 1
            raise RuntimeError("injected: the LM head ran out of memory")
        return self.head(hidden)


def test_a_forward_raising_inside_a_batch_fails_only_its_call(tiny_target, monkeypatch):
    running = verifier.service.serve(tiny_target)
    try:
        with channel(f"127.0.0.1:{running.port}") as ch:
            stub = verifier_pb2_grpc.VerifierStub(ch)
            twins, others = start_twins(stub), start_twins(stub)
            head = FailingHead(tiny_target.lean.lm_head, rows=4)  # twin 0's 3 drafts keep 4 rows; others' 1
            monkeypatch.setattr(tiny_target.lean, "lm_head", head)
            release, busy = threading.Event(), threading.Event()
            torch_thread.submit(lambda: (busy.set(), release.wait(30)))  # both calls pending: one batch
            busy.wait(10)
            failing = stub.Verify.future(verifier_pb2.VerifyRequest(session_id=twins[0], draft_token_ids=[7, 8, 9],
                                                                    sampling=GREEDY), timeout=30)
            fine = stub.Verify.future(verifier_pb2.VerifyRequest(session_id=others[0], draft_token_ids=[],
                                                                 sampling=HOT), timeout=30)
            assert wait_for(lambda: stub.Info(common_pb2.InfoRequest(), timeout=5).pending_calls == 2, 10)
            release.set()
            with pytest.raises(Exception) as failed:
                failing.result()
            assert failed.value.code().name == "INTERNAL"
            assert "injected" not in failed.value.details() and "error id" in failed.value.details()
            assert head.raised == 2  # the batch, then the call alone
            # The call co-batched with it ran alone and answered as its twin does.
            twin = stub.Verify(verifier_pb2.VerifyRequest(session_id=others[1], draft_token_ids=[], sampling=HOT),
                               timeout=10)
            assert without_batch(fine.result()) == without_batch(twin)
            monkeypatch.setattr(tiny_target.lean, "lm_head", head.head)
            # The failed call's session is whole: its twin and it answer alike.
            for request in (dict(draft_token_ids=[7, 8, 9], sampling=GREEDY), dict(draft_token_ids=[], sampling=HOT)):
                a, b = (stub.Verify(verifier_pb2.VerifyRequest(session_id=s, **request), timeout=10) for s in twins)
                assert without_batch(a) == without_batch(b), request
            end(stub, *twins, *others)
    finally:
        running.stop(0)



@pytest.mark.parametrize("forward", ["lean", "paged"])
def test_a_call_failing_after_its_forward_leaves_a_session_that_answers_as_its_twin(tiny_target, forward,
                                                                                     monkeypatch):
    """The forward ran (the round's first token and the drafts now cached), then the verdict
    raised: the session is back at its tokens, and a cache that kept what still matches them
    must still give the next call a row for each of its positions."""
    import verifier.target_session as target_session
    from specdec.runtime.models import load_model
    running = verifier.service.serve(tiny_target if forward == "lean" else load_model("tiny-target", forward=forward))
    try:
        with channel(f"127.0.0.1:{running.port}") as ch:
            stub = verifier_pb2_grpc.VerifierStub(ch)
            twins = start_twins(stub)

            def failing(*args):
                raise RuntimeError("injected: the verdict failed")
            with monkeypatch.context() as patched:
                patched.setattr(target_session, "greedy_accept", failing)
                error = rpc_error(stub.Verify, verifier_pb2.VerifyRequest(
                    session_id=twins[0], draft_token_ids=[7, 8, 9], sampling=GREEDY), timeout=10)
                assert error.code().name == "INTERNAL", error.details()
            for request in (dict(draft_token_ids=[7, 8, 9], sampling=GREEDY), dict(draft_token_ids=[], sampling=HOT),
                            dict(draft_token_ids=[4, 5], sampling=GREEDY)):
                a, b = (stub.Verify(verifier_pb2.VerifyRequest(session_id=s, **request), timeout=10) for s in twins)
                assert without_batch(a) == without_batch(b), request
            end(stub, *twins)
    finally:
        running.stop(0)


def test_a_request_whose_verify_fails_mid_way_gets_internal_and_leaves_no_session(tiny_draft, tiny_target,
                                                                                  monkeypatch):
    """The third Verify of a request raises after its forward: the client is told which service
    failed (no internals), both services end the request's sessions, and the same request then
    gives what it gave before."""
    import verifier.target_session as target_session
    from specdec.v1 import coordinator_pb2
    from tests.conftest import coordinator_stub
    servers = [drafter.service.serve(tiny_draft), verifier.service.serve(tiny_target)]
    request = coordinator_pb2.GenerateRequest(prompt="the cat sat on", max_new_tokens=24, ignore_eos=True,
                                              speculation=coordinator_pb2.Speculation(enabled=True, gamma=3))
    try:
        with coordinator_stub(drafter=f"127.0.0.1:{servers[0].port}", verifier=f"127.0.0.1:{servers[1].port}",
                              gamma=3) as stub, channel(f"127.0.0.1:{servers[0].port}") as draft_channel, \
                channel(f"127.0.0.1:{servers[1].port}") as target_channel:
            infos = (drafter_pb2_grpc.DrafterStub(draft_channel).Info, verifier_pb2_grpc.VerifierStub(target_channel).Info)
            before = stub.Generate(request, timeout=30)
            assert before.stats.rounds >= 3
            calls, real = [], target_session.greedy_accept

            def third_fails(*args):
                calls.append(1)
                if len(calls) == 3:
                    raise RuntimeError("injected: the verdict failed")
                return real(*args)
            with monkeypatch.context() as patched:
                patched.setattr(target_session, "greedy_accept", third_fails)
                error = rpc_error(stub.Generate, request, timeout=30)
            assert error.code().name == "INTERNAL" and "verifier" in error.details(), error.details()
            assert "injected" not in error.details()
            assert wait_for(lambda: all(info(common_pb2.InfoRequest(), timeout=5).active_sessions == 0
                                        for info in infos), 10)
            assert stub.Generate(request, timeout=30).token_ids == before.token_ids
    finally:
        for server in servers:
            server.stop(0)

def test_a_failed_batch_reruns_each_call_alone_from_restored_caches(tiny_target, monkeypatch):
    """The batched forward fails after it wrote KV and moved the caches' lengths
    (in the LM head); each call then runs alone from where it was: the same
    tokens as decoding alone, which a cache left one forward ahead would not give."""
    greedy = SamplingConfig()
    alone = [TargetSession(tiny_target, p).decode(4, greedy) for p in PROMPTS[:4]]
    sessions = [TargetSession(tiny_target, p) for p in PROMPTS[:4]]
    head = FailingHead(tiny_target.lean.lm_head, rows=len(sessions))  # only the whole batch fails
    monkeypatch.setattr(tiny_target.lean, "lm_head", head)
    scheduler = Scheduler(lean_batch_forward(tiny_target.lean))
    results = run_concurrently(scheduler, [lambda s=s: s.decode_steps(4, greedy) for s in sessions])
    assert head.raised >= 1
    assert [tokens for tokens, _ in results] == alone


def test_the_scheduler_survives_an_exception_of_its_own(tiny_target):
    """An exception that escapes the scheduler's turn (here its cost curve) fails
    the calls it was running, and the next call is scheduled as usual."""
    broken = {"on": True}

    def cost(rows: int) -> float:
        if broken["on"]:
            raise ValueError("injected: a broken cost curve")
        return float(rows)
    scheduler = Scheduler(lean_batch_forward(tiny_target.lean), cost=cost)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # a scheduler left stuck would hang the call: bounded
        first = pool.submit(scheduler.run, TargetSession(tiny_target, PROMPTS[0]).decode_steps(2, SamplingConfig()))
        with pytest.raises(ValueError, match="broken cost curve"):
            first.result(timeout=30)
        assert scheduler.pending_calls == 0
        broken["on"] = False
        second = pool.submit(scheduler.run, TargetSession(tiny_target, PROMPTS[0]).decode_steps(2, SamplingConfig()))
        tokens, _ = second.result(timeout=30)
    assert tokens == TargetSession(tiny_target, PROMPTS[0]).decode(2, SamplingConfig())
