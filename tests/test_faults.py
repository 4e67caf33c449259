"""Faults with real processes: a drafter or a verifier killed mid-request (SIGKILL),
then restarted on its port; the coordinator draining on SIGTERM."""
from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from coordinator.backends import WatchSettings
from specdec_tools import launcher
from specdec.rpc.errors import unavailable_message
from specdec.rpc.serving import channel
from specdec.v1 import common_pb2, coordinator_pb2 as pb, coordinator_pb2_grpc, drafter_pb2_grpc, verifier_pb2_grpc
from tests.conftest import served_coordinator, free_port, rpc_error, wait_for

LONG = 600  # tokens: a few seconds of tiny-model rounds, so a fault lands mid-request

pytestmark = pytest.mark.integration  # real processes or real weights


class ModelProcess:
    """A drafter or verifier subprocess on a fixed port, which can be killed and restarted."""

    def __init__(self, name: str, model: str):
        self.name, self.model, self.port = name, model, free_port()
        self.child: launcher.Child | None = None
        self.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        self.child = launcher.wait_serving(launcher.spawn(self.name, self.name, [
            "--model", self.model, "--port", str(self.port), "--threads", "1"]), 120)

    def kill(self) -> None:
        self.child.process.send_signal(signal.SIGKILL)
        self.child.process.wait(10)

    def active_sessions(self) -> int:
        stub_cls = drafter_pb2_grpc.DrafterStub if self.name == "drafter" else verifier_pb2_grpc.VerifierStub
        with channel(self.address) as ch:
            return stub_cls(ch).Info(common_pb2.InfoRequest(), timeout=5).active_sessions


@pytest.fixture(scope="module")
def models():
    processes = [ModelProcess("drafter", "tiny-draft"), ModelProcess("verifier", "tiny-target")]
    yield processes
    launcher.stop([p.child for p in processes if p.child], grace_s=5)


@pytest.fixture(autouse=True)
def alive(models):
    """Each test starts with both processes up, even after one that failed mid-fault."""
    for process in models:
        process.child.process.send_signal(signal.SIGCONT)
        if process.child.process.poll() is not None:
            process.start()
    yield models


def long_request(speculate: bool = True, tokens: int = LONG,
                 proposer: int = pb.PROPOSER_KIND_MODEL) -> pb.GenerateRequest:
    # The draft model alone by default: these are its faults (the tiny model's
    # loops would otherwise be drafted by lookups, and the drafter rarely asked).
    return pb.GenerateRequest(prompt="Once upon a time", max_new_tokens=tokens, ignore_eos=True,
                              speculation=pb.Speculation(enabled=speculate, gamma=4, proposer=proposer))


def test_drafter_killed_mid_request_finishes_without_it_and_exact(models):
    draft, target = models
    with served_coordinator(drafter=draft.address, verifier=target.address) as c:
        stub, backends = c.stub, c.backends
        reference = list(stub.Generate(long_request(speculate=False), timeout=60).token_ids)
        assert len(reference) == LONG
        stream = stub.GenerateStream(long_request(), timeout=60)
        # The target's first token alone, then a speculative round: the drafter is in use.
        received = list(next(stream).token_ids) + list(next(stream).token_ids)
        draft.kill()
        final = None
        for message in stream:  # no error reaches the client
            received += message.token_ids
            final = message
        assert received == reference
        assert final.stats.draft_tokens > 0 and "drafter became unavailable" in final.stats.fallback
        assert draft.address not in final.stats.fallback and "127.0.0.1" not in final.stats.fallback
        assert wait_for(lambda: not backends.drafter_up, 10)
        # While the drafter is down, new requests go on at once with n-gram lookups
        # alone (the hybrid proposer's), or target-only (the model alone), and say why.
        down = stub.Generate(long_request(proposer=pb.PROPOSER_KIND_HYBRID), timeout=60)
        assert list(down.token_ids) == reference and {s.source for s in down.stats.draft_sources} <= {"ngram"}
        assert "the drafter was down when this request started" in down.stats.fallback
        down = stub.Generate(long_request(), timeout=60)
        assert list(down.token_ids) == reference and down.stats.draft_tokens == 0
        assert "the drafter was down when this request started" in down.stats.fallback
        # It comes back: the watcher reconnects, checks the tokenizer again, speculation resumes.
        draft.start()
        assert wait_for(lambda: backends.drafter_up, 20)
        back = stub.Generate(long_request(), timeout=60)
        assert list(back.token_ids) == reference and back.stats.draft_tokens > 0 and not back.stats.fallback
        assert wait_for(lambda: target.active_sessions() == 0 and draft.active_sessions() == 0, 10)


def test_a_hung_drafter_is_given_up_on_after_the_drafter_timeout(models):
    draft, target = models
    with served_coordinator(drafter=draft.address, verifier=target.address, drafter_timeout_s=1.0) as c:
        # Long enough that it is still streaming well after the drafter is given up on.
        reference = list(c.stub.Generate(long_request(speculate=False, tokens=1000), timeout=60).token_ids)
        stream = c.stub.GenerateStream(long_request(tokens=1000), timeout=60)
        received = list(next(stream).token_ids) + list(next(stream).token_ids)  # the first token, a round
        draft.child.process.send_signal(signal.SIGSTOP)  # alive, connected, and silent
        stopped_at, final = time.monotonic(), None
        try:
            for message in stream:
                received += message.token_ids
                final = message
                if time.monotonic() - stopped_at > 1.5:  # given up on by now: let it answer EndSession
                    draft.child.process.send_signal(signal.SIGCONT)
        finally:
            draft.child.process.send_signal(signal.SIGCONT)
        assert received == reference
        assert "DEADLINE_EXCEEDED" in final.stats.fallback
        assert wait_for(lambda: c.backends.drafter_up, 20)
        assert c.stub.Generate(long_request(), timeout=60).stats.draft_tokens > 0
        # Sessions end after the last message is sent: give the EndSession calls a moment.
        assert wait_for(lambda: draft.active_sessions() == 0 and target.active_sessions() == 0, 10)


def test_requests_waiting_on_a_hung_drafter_leave_it_when_the_watch_marks_it_down(models):
    """Four streams in flight, the drafter stopped (SIGSTOP) under the default 30 s
    --drafter-timeout: the watch marks it down within its check interval and timeout
    (1 + 2 s), and every call waiting on it is abandoned then, not 30 s later; each
    stream goes on target-only from where it was, with the same tokens."""
    draft, target = models
    watch = WatchSettings()
    with served_coordinator(drafter=draft.address, verifier=target.address, watch=watch) as c:
        request = long_request(tokens=400)
        reference = list(c.stub.Generate(long_request(speculate=False, tokens=400), timeout=60).token_ids)
        started = time.monotonic()
        assert list(c.stub.Generate(request, timeout=60).token_ids) == reference
        alone_s = time.monotonic() - started
        streams = [c.stub.GenerateStream(request, timeout=90) for _ in range(4)]
        received = [list(next(s).token_ids) + list(next(s).token_ids) for s in streams]  # a round each
        draft.child.process.send_signal(signal.SIGSTOP)
        stopped_at = time.monotonic()
        finals: list = [None] * 4
        ended: list[float] = [0.0] * 4

        def drain(i: int) -> None:
            for message in streams[i]:
                received[i] += message.token_ids
                finals[i] = message
            ended[i] = time.monotonic() - stopped_at
        try:
            threads = [threading.Thread(target=drain, args=(i,)) for i in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(90)
        finally:
            draft.child.process.send_signal(signal.SIGCONT)
        assert all(r == reference for r in received)
        assert all("stopped answering its health checks" in f.stats.fallback for f in finals), \
            [f.stats.fallback for f in finals]
        # Detection (interval + timeout) and then the rest of a stream alone, with a loaded
        # machine's margin; the 30 s --drafter-timeout is far above it.
        bound = watch.interval_s + watch.timeout_s + alone_s + 3.0
        assert max(ended) < bound < 30, (ended, alone_s)
        assert c.backends.drafter.abandoned >= 1
        assert wait_for(lambda: draft.active_sessions() == 0 and target.active_sessions() == 0, 20)


def test_a_stalled_drafter_holds_no_answer_up_and_its_sessions_end_when_it_is_back(models):
    """SIGSTOP the drafter during a hybrid request: the request finishes without
    it (and says so), its answer is not held up by ending the drafter's session,
    and that session is ended once the drafter runs again, not at its TTL."""
    draft, target = models
    with served_coordinator(drafter=draft.address, verifier=target.address, drafter_timeout_s=1.0) as c:
        request = long_request(tokens=400, proposer=pb.PROPOSER_KIND_HYBRID)
        reference = list(c.stub.Generate(long_request(speculate=False, tokens=400), timeout=60).token_ids)
        stream = c.stub.GenerateStream(request, timeout=60)
        received = list(next(stream).token_ids) + list(next(stream).token_ids)
        draft.child.process.send_signal(signal.SIGSTOP)
        try:
            final = None
            for message in stream:
                received += message.token_ids
                final, last_at = message, time.monotonic()
            ended_at = time.monotonic()
            assert received == reference
            # The stream ends right after its last message: EndSession is not waited for
            # (a synchronous one waited out its 5 s timeout here).
            assert ended_at - last_at < 1.0, ended_at - last_at
            assert final.stats.fallback and "drafter" in final.stats.fallback  # the request says why
        finally:
            draft.child.process.send_signal(signal.SIGCONT)
        assert wait_for(lambda: draft.active_sessions() == 0, 20)  # the retried EndSession landed


def coordinator_health(address: str) -> int:
    with channel(address) as ch:
        try:
            return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2).status
        except grpc.RpcError:
            return -1


def test_verifier_killed_fails_fast_with_unavailable_and_recovers(models):
    draft, target = models
    with served_coordinator(drafter=draft.address, verifier=target.address) as c:
        stub, backends = c.stub, c.backends
        stream = stub.GenerateStream(long_request(), timeout=60)
        next(stream)
        target.kill()
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as failed:
            for _ in stream:
                pass
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE, failed.value.details()
        # Public messages say what failed and what to do, never where the verifier is.
        assert failed.value.details() == unavailable_message("verifier")
        # Fails, not hangs: well inside the call's own 60 s deadline, however slow this machine.
        assert time.monotonic() - started < 30, "the in-flight request must fail, not hang"
        # New requests fail fast while it is down, and the coordinator reports NOT_SERVING.
        assert wait_for(lambda: not backends.verifier_watch.up, 10)
        error = rpc_error(stub.Generate, long_request(), timeout=30)
        # Refused at admission (a request that tried the verifier would say so in its own words, or time out).
        assert error.code() == grpc.StatusCode.UNAVAILABLE and error.details() == unavailable_message("verifier")
        assert c.backends.verifier_watch.up is False
        assert wait_for(lambda: draft.active_sessions() == 0, 10)  # the failed request's draft session was ended
        # It comes back on its port: no coordinator restart needed.
        target.start()
        assert wait_for(lambda: backends.verifier_watch.up, 20)
        ok = stub.Generate(pb.GenerateRequest(prompt="Once upon a time", max_new_tokens=16), timeout=30)
        assert len(ok.token_ids) > 0
        assert wait_for(lambda: target.active_sessions() == 0 and draft.active_sessions() == 0, 10)


def test_coordinator_health_follows_the_verifier(models):
    draft, target = models
    with served_coordinator(drafter=draft.address, verifier=target.address) as c:
        address = c.address
        assert coordinator_health(address) == health_pb2.HealthCheckResponse.SERVING
        target.kill()
        assert wait_for(lambda: coordinator_health(address) == health_pb2.HealthCheckResponse.NOT_SERVING, 10)
        target.start()
        assert wait_for(lambda: coordinator_health(address) == health_pb2.HealthCheckResponse.SERVING, 20)


def spawn_coordinator(models, grace_s: float, *flags: str) -> launcher.Child:
    draft, target = models
    return launcher.wait_serving(launcher.spawn("coordinator", "coordinator", [
        "--drafter", draft.address, "--verifier", target.address, "--port", "0",
        "--grace-period", str(grace_s), *flags]), 120)


def ended_by_lease(process: ModelProcess) -> int:
    stub_cls = drafter_pb2_grpc.DrafterStub if process.name == "drafter" else verifier_pb2_grpc.VerifierStub
    with channel(process.address) as ch:
        return stub_cls(ch).Info(common_pb2.InfoRequest(), timeout=5).sessions_ended_by_lease


def test_a_killed_coordinators_sessions_end_when_its_lease_lapses(models):
    """SIGKILL a coordinator with 8 streams in flight: nobody ends their sessions, and
    the model services' TTL is 10 minutes; the lease (--session-lease, default 10 s,
    renewed with every health check) ends them in both services within it, and a
    coordinator started in its place serves at once."""
    before = [ended_by_lease(m) for m in models]
    child = spawn_coordinator(models, 5)
    with channel(child.address) as ch:
        stub = coordinator_pb2_grpc.CoordinatorStub(ch)
        streams = [stub.GenerateStream(long_request(tokens=1000), timeout=60) for _ in range(8)]
        for stream in streams:
            next(stream)
        assert wait_for(lambda: all(m.active_sessions() >= 8 for m in models), 10)
        child.process.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        child.process.wait(10)
    ended_at = [0.0, 0.0]

    def all_ended() -> bool:
        for i, m in enumerate(models):
            if not ended_at[i] and m.active_sessions() == 0:
                ended_at[i] = time.monotonic() - killed_at
        return all(ended_at)
    assert wait_for(all_ended, 30)
    assert max(ended_at) < 15, ended_at
    assert all(ended_by_lease(m) - b >= 8 for m, b in zip(models, before))
    again = spawn_coordinator(models, 5)
    try:
        with channel(again.address) as ch:
            reply = coordinator_pb2_grpc.CoordinatorStub(ch).Generate(long_request(tokens=50), timeout=60)
            assert len(reply.token_ids) == 50
    finally:
        launcher.stop([again], grace_s=5)


def test_a_lease_shorter_than_three_checks_is_refused(models):
    draft, target = models
    child = launcher.spawn("coordinator", "coordinator", ["--drafter", draft.address, "--verifier", target.address,
                                                          "--port", "0", "--session-lease", "1"])
    assert child.process.wait(60) == 2


def refused(stub) -> bool:
    """A short request is refused with UNAVAILABLE (the coordinator is draining)."""
    try:
        stub.Generate(pb.GenerateRequest(prompt="hi", max_new_tokens=1), timeout=10)
    except grpc.RpcError as exc:
        return exc.code() == grpc.StatusCode.UNAVAILABLE
    return False


def test_sigterm_drains_in_flight_requests_then_exits(models):
    child = spawn_coordinator(models, grace_s=30)
    with channel(child.address) as ch:
        stub = coordinator_pb2_grpc.CoordinatorStub(ch)
        stream = stub.GenerateStream(long_request(), timeout=60)
        received = list(next(stream).token_ids)  # the first token: SIGTERM as early into the request as can be
        child.process.send_signal(signal.SIGTERM)
        # Once it has taken the signal (whenever that is on this machine), new requests are refused.
        assert wait_for(lambda: refused(stub), 20)
        final = None
        for message in stream:
            received += message.token_ids
            final = message
        assert len(received) == LONG and final.finish_reason == pb.FINISH_REASON_LENGTH
    assert child.process.wait(20) == 0
    assert wait_for(lambda: all(m.active_sessions() == 0 for m in models), 10)


def test_sigterm_cancels_what_outlives_the_grace_period(models):
    child = spawn_coordinator(models, grace_s=0.5)
    with channel(child.address) as ch:
        stream = coordinator_pb2_grpc.CoordinatorStub(ch).GenerateStream(
            pb.GenerateRequest(prompt="Once upon a time", max_new_tokens=1000, ignore_eos=True,
                               speculation=pb.Speculation(gamma=1)), timeout=60)
        next(stream)  # the first token, streamed before the drafter has even prefilled
        started = time.monotonic()
        child.process.send_signal(signal.SIGTERM)
        with pytest.raises(grpc.RpcError):
            for _ in stream:
                pass
        try:
            assert child.process.wait(15) == 0
        except subprocess.TimeoutExpired:
            child.process.kill()
            raise
        assert time.monotonic() - started < 10
    assert wait_for(lambda: all(m.active_sessions() == 0 for m in models), 10)


@pytest.mark.integration
def test_a_service_whose_launcher_is_killed_outright_stops_by_itself():
    # A launcher (as `specdec up` or the bench) that starts a drafter, then dies of SIGKILL
    # (or a native fault): no signal reaches the drafter, which must not serve on, orphaned.
    script = ("import sys; from specdec_tools import launcher; "
              "child = launcher.wait_serving(launcher.spawn('drafter', 'drafter', "
              "['--model', 'tiny-draft', '--port', '0', '--cost-curve-rows', '0']), 120); "
              "print(child.process.pid, flush=True); import time; time.sleep(600)")
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        drafter = int(parent.stdout.readline())
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and pathlib.Path(f"/proc/{drafter}").exists() and \
            pathlib.Path(f"/proc/{drafter}/stat").read_text().split()[2] != "Z":
        time.sleep(0.2)
    gone = not pathlib.Path(f"/proc/{drafter}").exists() or \
        pathlib.Path(f"/proc/{drafter}/stat").read_text().split()[2] == "Z"
    if not gone:
        os.kill(drafter, signal.SIGKILL)
    assert gone, "the drafter outlived its launcher by 20 s"
