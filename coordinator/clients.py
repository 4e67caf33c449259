"""Typed clients for the drafter and the verifier (proto <-> domain).

A failed call becomes a `RemoteError` whose message is fit for public clients:
what failed and what to do, never the backend's address. The address and gRPC's
own details go to the log and to the current span."""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Sequence

import grpc
from opentelemetry import trace

from specdec.rpc.errors import TRANSPORT_CODES, RemoteError, public_message
from specdec.spec.proposers import MODEL
from specdec.spec.proposers.model import ModelProposer, ProposerUnavailable
from specdec.spec.types import BatchLoad, Commit, Decoded, Proposal, RejectionOutput, runs
from specdec.spec.sampling import SamplingConfig
from specdec.rpc import telemetry
from specdec.rpc.security import ClientTls
from specdec.rpc.serving import channel
from specdec.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc, verifier_pb2, verifier_pb2_grpc
from specdec.spec.wire import Truncation, sampling_to_proto

log = logging.getLogger("coordinator")
Timeout = Callable[[], "float | None"]  # seconds left of the caller's deadline
END_SESSION_TIMEOUT_S, END_SESSION_ATTEMPTS, END_SESSION_BACKOFF_S = 5.0, 8, 0.5  # retried for about 3 min
RETRIED_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
KEEP_ALIVE_TIMEOUT_S = 5.0
MATCH_TIMEOUT_S = 2.0  # MatchPrefix: one hash lookup per 16 prompt tokens


def _no_deadline() -> None:
    return None


class ModelClient:
    service = "model"

    def __init__(self, address: str, stub_cls, tls: ClientTls | None = None, token: str | None = None):
        self.address = address
        self.channel = channel(address, tls, token)
        self.stub = stub_cls(telemetry.traced_channel(self.channel))
        self._untraced = stub_cls(self.channel)  # for the lease's renewal each second: no trace of its own
        self._ending: set[grpc.Future] = set()  # EndSession calls in flight: close() lets them land
        self._ending_lock = threading.Lock()
        # The sessions' owner (this coordinator's instance id) and its lease (Backends sets
        # them): StartSession names them, and renew_lease keeps them all alive at once.
        self.owner, self.lease_s = "", 0.0

    def renew_lease(self, timeout: float) -> None:
        """The owner's lease on every session it holds there, from now (not waited for:
        a backend that does not answer is the watch's to find)."""
        if self.owner and self.lease_s > 0:
            try:
                self._untraced.KeepAlive.future(common_pb2.KeepAliveRequest(owner=self.owner, lease_s=self.lease_s),
                                                timeout=timeout)
            except ValueError:  # the channel is closed: this client is shutting down
                pass

    def session_request(self, session_id: str, prompt_ids: Sequence[int], cache_salt: bytes,
                        grammar: str = "", grammar_start: int = 0) -> common_pb2.StartSessionRequest:
        return common_pb2.StartSessionRequest(session_id=session_id, prompt_token_ids=prompt_ids,
                                              cache_salt=cache_salt, owner=self.owner, lease_s=self.lease_s,
                                              grammar=grammar, grammar_start=grammar_start)

    def failure(self, method: str, exc: grpc.RpcError) -> RemoteError:
        """The public error for a failed call; the details stay in the log and the trace."""
        code, details = exc.code(), exc.details() or ""
        log.warning("%s at %s: %s: %s: %s", self.service, self.address, method, code.name, details)
        trace.get_current_span().add_event("backend_error", {
            "specdec.backend": self.service, "specdec.backend.address": self.address, "rpc.method": method,
            "rpc.grpc.status_code": code.value[0], "specdec.backend.details": details})
        return RemoteError(code, public_message(self.service, code, details))

    def call(self, method: str, request, timeout: float | None = None):
        try:
            return getattr(self.stub, method)(request, timeout=timeout)
        except grpc.RpcError as exc:
            raise self.failure(method, exc) from exc

    def info(self, timeout: float = 10.0) -> common_pb2.ModelInfo:
        return self.call("Info", common_pb2.InfoRequest(), timeout)

    def tokenizer_files(self, timeout: float = 60.0) -> dict[str, bytes]:
        return dict(self.call("GetTokenizer", common_pb2.GetTokenizerRequest(), timeout).files)

    def end_session(self, session_id: str, attempt: int = 0) -> None:
        """Ends a session off the caller's path: the request that held it has its
        answer already, whatever the service does now. A service that does not
        answer (hung, restarting) is asked again with backoff, so its sessions do not
        wait for their TTL; one that is gone for good reaps them by it."""
        try:
            future = self.stub.EndSession.future(common_pb2.EndSessionRequest(session_id=session_id),
                                                 timeout=END_SESSION_TIMEOUT_S)
        except ValueError:  # the channel is closed: this client is shutting down
            return

        with self._ending_lock:
            self._ending.add(future)

        def done(call: grpc.Future) -> None:
            with self._ending_lock:
                self._ending.discard(call)
            error = call.exception()
            if error is None or attempt + 1 >= END_SESSION_ATTEMPTS or error.code() not in RETRIED_CODES:
                return
            retry = threading.Timer(min(END_SESSION_BACKOFF_S * 2 ** attempt, 60.0), self.end_session,
                                    (session_id, attempt + 1))
            retry.daemon = True
            retry.start()
        future.add_done_callback(done)

    def close(self, grace_s: float = 2.0) -> None:
        """Closes the channel once the sessions being ended are (at most `grace_s`):
        a coordinator that stops right after its last request leaves no session behind."""
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            with self._ending_lock:
                if not self._ending:
                    break
            time.sleep(0.01)
        self.channel.close()


class VerifierClient(ModelClient):
    service = "verifier"

    def __init__(self, address: str, tls: ClientTls | None = None, token: str | None = None):
        super().__init__(address, verifier_pb2_grpc.VerifierStub, tls, token)

    def start_session(self, session_id: str, prompt_ids: Sequence[int], timeout: float | None = None,
                      cache_salt: bytes = b"", grammar: str = "", grammar_start: int = 0) -> int:
        """Opens the session (under `grammar` from position `grammar_start`, for a
        structured output); returns the prompt tokens taken from the prefix cache."""
        return self.call("StartSession", self.session_request(session_id, prompt_ids, cache_salt, grammar,
                                                              grammar_start), timeout).prefix_cached_tokens

    def verify(self, session_id: str, proposal: Proposal, sampling: SamplingConfig,
               timeout: float | None = None, logprobs: int | None = None) -> RejectionOutput:
        """`logprobs` set: the output tokens' TokenLogprobs come back too, with that many top tokens."""
        draft = verifier_pb2.VerifyRequest(draft_token_ids=proposal.token_ids, free_tokens=proposal.free_tokens,
                                           draft_probs=proposal.draft_probs)
        draft_bytes = draft.ByteSize()  # the draft's share of the request: its ids and probabilities
        draft.session_id = session_id
        draft.sampling.CopyFrom(sampling_to_proto(sampling))
        if logprobs is not None:
            draft.logprobs = logprobs
        reply = self.call("Verify", draft, timeout)
        return RejectionOutput(reply.num_accepted, reply.next_token_id, reply.bonus, BatchLoad.from_proto(reply.batch),
                               draft_bytes, tuple(reply.logprobs))

    def decode(self, session_id: str, num_tokens: int, sampling: SamplingConfig,
               timeout: float | None = None, logprobs: int | None = None) -> Decoded:
        request = verifier_pb2.DecodeRequest(session_id=session_id, num_tokens=num_tokens,
                                             sampling=sampling_to_proto(sampling))
        if logprobs is not None:
            request.logprobs = logprobs
        reply = self.call("Decode", request, timeout)
        return Decoded(list(reply.token_ids), BatchLoad.from_proto(reply.batch), tuple(reply.logprobs))


class DrafterClient(ModelClient):
    """The drafter's calls that a request waits on (StartSession, Propose) are kept while
    in flight: when the watch marks the drafter down, `abandon_in_flight` cancels them,
    and each such request goes on target-only from where it is at once, rather than
    after its call's timeout (a stopped drafter held four streams 33-36 s for a
    30 s --drafter-timeout)."""
    service = "drafter"

    def __init__(self, address: str, tls: ClientTls | None = None, token: str | None = None):
        super().__init__(address, drafter_pb2_grpc.DrafterStub, tls, token)
        self._in_flight: set[grpc.Future] = set()
        self._in_flight_lock = threading.Lock()
        self.abandoned = 0  # calls cancelled by abandon_in_flight, over the client's life

    def _track(self, future: grpc.Future) -> grpc.Future:
        with self._in_flight_lock:
            self._in_flight.add(future)

        def done(call: grpc.Future) -> None:
            with self._in_flight_lock:
                self._in_flight.discard(call)
        future.add_done_callback(done)
        return future

    def abandon_in_flight(self) -> int:
        """Cancel every call a request waits on; their waits raise grpc.FutureCancelledError."""
        with self._in_flight_lock:
            calls = list(self._in_flight)
        cancelled = sum(call.cancel() for call in calls)
        with self._in_flight_lock:
            self.abandoned += cancelled
        return cancelled

    def start_session_async(self, session_id: str, prompt_ids: Sequence[int], timeout: float | None,
                            cache_salt: bytes = b"", grammar: str = "", grammar_start: int = 0) -> grpc.Future:
        """StartSession without waiting (its prefill overlaps the verifier's); the
        future's result is the StartSessionResponse."""
        request = self.session_request(session_id, prompt_ids, cache_salt, grammar, grammar_start)
        return self._track(self.stub.StartSession.future(request, timeout=timeout))

    def match_prefix(self, prompt_ids: Sequence[int], cache_salt: bytes, timeout: float | None) -> int:
        """Leading tokens of the prompt the drafter's prefix cache holds (raises grpc.RpcError)."""
        return self.stub.MatchPrefix(common_pb2.MatchPrefixRequest(prompt_token_ids=prompt_ids, cache_salt=cache_salt),
                                     timeout=timeout).cached_tokens

    def propose(self, session_id: str, num_tokens: int, sampling: SamplingConfig, commit: Commit | None,
                min_confidence: float, timeout: float | None, prefix: Sequence[int] = (),
                truncation: Truncation = Truncation()) -> Proposal:
        """Raises grpc.RpcError as it is (grpc.FutureCancelledError where it was abandoned):
        the proposer decides what a failure means.
        The drafter takes `prefix` (a free source's tokens) as drafted; the proposal is its drafts after them."""
        request = drafter_pb2.ProposeRequest(session_id=session_id, num_tokens=num_tokens,
                                             sampling=sampling_to_proto(sampling), min_confidence=min_confidence,
                                             draft_prefix_ids=prefix, truncation_top_k=truncation.top_k)
        if truncation.top_p < 1.0:
            request.truncation_top_p = truncation.top_p
        if commit is not None:
            request.commit.num_accepted = commit.num_accepted
            request.commit.target_token_ids.extend(commit.target_token_ids)
        reply = self._track(self.stub.Propose.future(request, timeout=timeout)).result()
        # The draft's distributions pass through as the drafter sent them: the coordinator never reads them.
        return Proposal(tuple(reply.draft_token_ids), tuple(reply.draft_probs),
                        tuple(reply.draft_confidences), BatchLoad.from_proto(reply.batch),
                        runs((MODEL, len(reply.draft_token_ids))))


def _abandoned(method: str) -> ProposerUnavailable:
    return ProposerUnavailable(f"the drafter became unavailable (it stopped answering its health checks while this "
                               f"request waited on its {method})", grpc.StatusCode.UNAVAILABLE)


class RemoteDraftProposer(ModelProposer):
    """The drafter service as the draft model of one request. StartSession is sent
    without waiting, so it overlaps the verifier's prefill; the first Propose
    waits for it. A drafter failure becomes ProposerUnavailable (the loop goes
    on target-only); the caller's cancellation or deadline stays what it is."""

    def __init__(self, client: DrafterClient, expected_fingerprint: str, timeout: Timeout = _no_deadline,
                 call_timeout_s: float = 30.0, truncation: Truncation = Truncation(),
                 keep_alive_s: float = 150.0, is_up: Callable[[], bool] = lambda: True, cache_salt: bytes = b"",
                 grammar: tuple[str, int] = ("", 0)):
        self.client = client
        self.cache_salt = cache_salt          # the request's prefix-cache salt
        self.grammar = grammar                # the request's compiled grammar and the output's start ("": none)
        self.truncation = truncation  # the draft distribution's support sent (sparse) when sampling
        self.expected_fingerprint = expected_fingerprint
        self._caller_timeout = timeout
        self.call_timeout_s = call_timeout_s  # a hung drafter must not hang the request
        self.keep_alive_s = keep_alive_s      # renew the session after this long without a call
        self._is_up = is_up                   # the coordinator's watch of the drafter
        self._session_id: str | None = None
        self._started: grpc.Future | None = None
        self._last_call = time.monotonic()
        self._renewal: grpc.Future | None = None

    def _timeout(self) -> float:
        remaining = self._caller_timeout()
        return self.call_timeout_s if remaining is None else min(remaining, self.call_timeout_s)

    def start(self, session_id: str, prompt_ids: Sequence[int]) -> None:
        self._session_id = session_id
        self._started = self.client.start_session_async(session_id, prompt_ids, self._timeout(), self.cache_salt,
                                                        *self.grammar)

    def ready(self) -> None:
        self._await_start()

    def _await_start(self) -> None:
        if self._started is None:
            return
        future, self._started = self._started, None
        try:
            reply = future.result()
        except grpc.FutureCancelledError as exc:
            raise _abandoned("StartSession") from exc
        except grpc.RpcError as exc:
            raise self._failure("StartSession", exc) from exc
        self.prefix_cached_tokens = reply.prefix_cached_tokens
        # Checked on every session, so a drafter that came back with another model is caught.
        if reply.tokenizer_fingerprint != self.expected_fingerprint:
            log.error("drafter at %s now has tokenizer %s, not the target's %s", self.client.address,
                      reply.tokenizer_fingerprint, self.expected_fingerprint)
            raise ProposerUnavailable(
                "the drafter now serves another tokenizer than the target's; model drafting is off until it serves "
                "the target's again",
                grpc.StatusCode.FAILED_PRECONDITION)

    def cached_prefix(self, prompt_ids: Sequence[int]) -> int:
        # For the prefill's price only: a drafter that does not answer quickly counts as holding nothing.
        try:
            return self.client.match_prefix(prompt_ids, self.cache_salt, min(self._timeout(), MATCH_TIMEOUT_S))
        except grpc.RpcError as exc:
            log.debug("drafter MatchPrefix failed: %s", exc)
            return 0

    def _failure(self, method: str, exc: grpc.RpcError) -> Exception:
        remaining = self._caller_timeout()
        callers_own = exc.code() == grpc.StatusCode.CANCELLED or (
            exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and remaining is not None and remaining <= 0)
        error = self.client.failure(method, exc)
        if callers_own:
            return error
        code = exc.code()
        what = (f"the drafter became unavailable ({code.name})" if code in TRANSPORT_CODES else
                f"the drafter refused {method} ({code.name}: {exc.details()})")
        return ProposerUnavailable(what, code)

    def keep_alive(self) -> None:
        """Between rounds. A request drafting from lookups alone, or at γ = 0, makes
        no drafter call for a while: its session is renewed before the drafter's
        TTL would reap it (without waiting for the answer). A drafter that the
        watch found down, or that lost the session, ends model drafting for this
        request (ProposerUnavailable), which its stats then report."""
        if self._session_id is None or self._started is not None:
            return
        if self._renewal is not None and self._renewal.done():
            renewal, self._renewal = self._renewal, None
            error = renewal.exception()
            if error is not None:
                raise self._failure("KeepAlive", error)
            if not renewal.result().existed:
                raise ProposerUnavailable("the drafter lost this request's session (restarted, or reaped it)",
                                          grpc.StatusCode.NOT_FOUND)
        if not self._is_up():
            raise ProposerUnavailable("the drafter became unavailable (it stopped answering its health checks)",
                                      grpc.StatusCode.UNAVAILABLE)
        if self._renewal is None and time.monotonic() - self._last_call >= self.keep_alive_s:
            self._last_call = time.monotonic()
            self._renewal = self.client.stub.KeepAlive.future(
                common_pb2.KeepAliveRequest(session_id=self._session_id), timeout=KEEP_ALIVE_TIMEOUT_S)

    def propose(self, num_tokens: int, sampling: SamplingConfig, commit: Commit | None,
                min_confidence: float = 0.0, prefix: Sequence[int] = ()) -> Proposal:
        self._await_start()
        if not self._is_up():   # marked down since the last round: no new call that would wait on it
            raise ProposerUnavailable("the drafter became unavailable (it stopped answering its health checks)",
                                      grpc.StatusCode.UNAVAILABLE)
        self._last_call = time.monotonic()
        try:
            return self.client.propose(self._session_id, num_tokens, sampling, commit, min_confidence,
                                       self._timeout(), prefix, self.truncation)
        except grpc.FutureCancelledError as exc:
            raise _abandoned("Propose") from exc
        except grpc.RpcError as exc:
            raise self._failure("Propose", exc) from exc

    def end(self) -> None:
        """Never waits: a session still being started is ended once its start
        returns (a hung drafter must not hold the request's answer up)."""
        if self._session_id is None:
            return
        session_id, started = self._session_id, self._started
        self._session_id = self._started = None
        if started is not None and not started.done():
            started.add_done_callback(lambda _: self.client.end_session(session_id))
        else:
            self.client.end_session(session_id)
