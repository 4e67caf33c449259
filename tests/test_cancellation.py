"""Client cancellation and deadlines stop the work within one round and free
both sessions; admission control refuses what is over --max-sessions."""
from __future__ import annotations

import concurrent.futures
import threading
import time

import grpc
import pytest

from specdec.v1 import common_pb2, coordinator_pb2 as pb
from tests.conftest import rpc_error, served_coordinator, wait_for
from tests.test_metrics import scrape

LONG = 1000


def long_request(max_new_tokens: int = LONG, **kw) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt="Once upon a time", max_new_tokens=max_new_tokens, ignore_eos=True,
                              speculation=pb.Speculation(gamma=2), **kw)


def sessions(stack) -> tuple[int, int]:
    return tuple(stub.Info(common_pb2.InfoRequest(), timeout=5).active_sessions
                 for stub in (stack.drafter_stub, stack.verifier_stub))


@pytest.fixture
def coordinator(stack):
    with served_coordinator(drafter=stack.address(stack.drafter), verifier=stack.address(stack.verifier),
                            metrics_port=0, max_sessions=3) as served:
        yield served


def rounds(coordinator) -> float:
    return scrape(coordinator.running.metrics_port)[("specdec_rounds_total", ())]


def test_cancelled_stream_stops_within_a_round_and_frees_both_sessions(stack, coordinator):
    stream = coordinator.stub.GenerateStream(long_request(), timeout=60)
    seen = 0
    for message in stream:
        seen += 1  # the first token alone, then one message per round (no stop strings, EOS ignored)
        if seen == 5:
            break
    stream.cancel()
    assert wait_for(lambda: sessions(stack) == (0, 0), 5)
    done = rounds(coordinator)
    assert wait_for(lambda: coordinator.running.drain(0), 5)
    assert rounds(coordinator) == done            # nothing runs on after the sessions are gone
    # The first message is not a speculation round; then the round in flight, at most one more.
    assert seen - 1 <= done <= seen + 1, (seen, done)


def test_deadline_stops_the_request_and_frees_both_sessions(stack, coordinator):
    # The deadline is set by what this machine takes for a short request (its prefill
    # and a few rounds), not in seconds: twice that is past the first round of the
    # long one, and far from its end, on any machine.
    started = time.monotonic()
    short = coordinator.stub.Generate(long_request(max_new_tokens=8), timeout=60)
    short_s = time.monotonic() - started
    before = rounds(coordinator)
    assert short.stats.rounds >= 2 and before > 0
    error = rpc_error(coordinator.stub.Generate, long_request(), timeout=2 * short_s)
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert wait_for(lambda: sessions(stack) == (0, 0), 5)
    assert wait_for(lambda: coordinator.running.drain(0), 5)
    done = rounds(coordinator) - before
    # A whole request is ~LONG/3 rounds; twice a short request's time must be far fewer, and nothing after.
    assert 0 < done < LONG / 6, done
    assert rounds(coordinator) - before == done


def test_requests_over_max_sessions_get_resource_exhausted(stack, coordinator):
    release = threading.Event()

    def hold() -> int:
        stream = coordinator.stub.GenerateStream(long_request(), timeout=60)
        next(stream)
        release.wait(30)
        stream.cancel()
        return 1

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        held = [pool.submit(hold) for _ in range(3)]
        assert wait_for(lambda: sessions(stack) == (3, 3), 10)
        error = rpc_error(coordinator.stub.Generate, long_request(), timeout=10)
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "3 requests are in flight, the limit (--max-sessions)" in error.details()
        release.set()
        assert sum(f.result() for f in held) == 3
    assert wait_for(lambda: sessions(stack) == (0, 0), 5)
    ok = coordinator.stub.Generate(pb.GenerateRequest(prompt="hi", max_new_tokens=4), timeout=30)
    assert len(ok.token_ids) == 4 or ok.finish_reason == pb.FINISH_REASON_EOS
    assert scrape(coordinator.running.metrics_port)[("specdec_requests_rejected_total",
                                                      (("reason", "max_sessions"),))] == 1
