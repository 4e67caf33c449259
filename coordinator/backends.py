"""The drafter and the verifier as the coordinator sees them: connected,
checked to share one tokenizer, and watched.

A watcher per backend polls `grpc.health.v1`. A backend that stops answering is
marked down at once (or when a call to it fails); while it is down the watcher
retries with exponential backoff, and a backend that comes back is checked
again before it is trusted: same tokenizer as the target, or it stays down.
- drafter down: requests decode target-only (same output, just slower), those
  waiting on one of its calls included: the calls are abandoned at once;
- verifier down: requests fail fast with UNAVAILABLE, and the coordinator's
  own health turns NOT_SERVING until it is back.
Each check also renews this coordinator's lease on its sessions there (its
instance id, `Backends.owner`): if the coordinator dies, the services end them
within `lease_s`.
"""
from __future__ import annotations

import logging
import threading
import uuid
from dataclasses import dataclass
from typing import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.rpc.errors import FailedPrecondition, InvalidArgument, SpecdecError
from specdec.rpc.security import ClientTls
from specdec.rpc.serving import wait_until_serving
from specdec.weights.tokenizer_fingerprint import describe, first_difference, load_tokenizer_files

from coordinator.clients import DrafterClient, VerifierClient, ModelClient

log = logging.getLogger("coordinator")


class TokenizerMismatch(FailedPrecondition):
    pass


@dataclass(frozen=True)
class WatchSettings:
    interval_s: float = 1.0        # between checks while up
    info_every: int = 30           # every this many checks while up, Info read again (its cost curve moves)
    timeout_s: float = 2.0         # a check slower than this counts as down
    min_backoff_s: float = 0.1     # between checks while down, doubling ...
    max_backoff_s: float = 5.0     # ... up to this
    # The lease on this coordinator's sessions, renewed at every check: a coordinator
    # that crashed has them ended within this (0: none, the services' TTL alone).
    lease_s: float = 10.0


MIN_LEASE_CHECKS = 3  # a lease lasts at least this many checks: one late renewal must not end the sessions


def watch_settings(lease_s: float) -> WatchSettings:
    """The default watch with this lease (--session-lease); InvalidArgument when too short."""
    settings = WatchSettings(lease_s=lease_s)
    if lease_s != 0 and lease_s < MIN_LEASE_CHECKS * settings.interval_s:
        raise InvalidArgument(f"--session-lease must be 0 (none) or at least {MIN_LEASE_CHECKS * settings.interval_s:g} "
                              f"s ({MIN_LEASE_CHECKS} health checks), got {lease_s:g}")
    return settings


class BackendWatch:
    """Up/down state of one backend, kept by a daemon thread."""

    def __init__(self, name: str, client: ModelClient, recheck: Callable[[], None],
                 settings: WatchSettings = WatchSettings()):
        self.name = name
        self.client = client
        self.settings = settings
        self._recheck = recheck  # raises when a backend that came back is not the one we checked
        self._health = health_pb2_grpc.HealthStub(client.channel)
        self._up = True
        self.reason = ""
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._listeners: list[Callable[[bool], None]] = []
        self._info_listeners: list[Callable[[object], None]] = []
        self._checks = 0
        self._thread = threading.Thread(target=self._loop, name=f"watch-{name}", daemon=True)

    @property
    def up(self) -> bool:
        return self._up

    def on_change(self, listener: Callable[[bool], None]) -> None:
        self._listeners.append(listener)

    def on_info(self, listener: Callable[[object], None]) -> None:
        """`listener(ModelInfo)` each time the watcher reads Info again while the backend is up."""
        self._info_listeners.append(listener)

    def _read_info(self) -> None:
        try:
            info = self.client.info(timeout=self.settings.timeout_s)
        except (SpecdecError, grpc.RpcError) as exc:  # the health check decides up or down, not this
            log.debug("%s: Info failed: %s", self.name, exc)
            return
        for listener in self._info_listeners:
            try:
                listener(info)
            except Exception:
                log.exception("an Info listener of the %s failed", self.name)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(self.settings.timeout_s + 1)

    def mark_down(self, reason: str) -> None:
        """A call to the backend failed: stop using it now, and let the watcher find it again."""
        self._set(False, reason)
        self._wake.set()

    def _set(self, up: bool, reason: str = "") -> None:
        if self._stop.is_set():
            return  # shutting down: the channel closing is not the backend failing
        changed = up != self._up
        self._up, self.reason = up, reason
        if not changed:
            return
        if up:
            log.info("%s at %s is back", self.name, self.client.address)
        else:
            log.warning("%s at %s is down: %s", self.name, self.client.address, reason)
        for listener in self._listeners:
            listener(up)

    def _serving(self) -> tuple[bool, str]:
        try:
            reply = self._health.Check(health_pb2.HealthCheckRequest(), timeout=self.settings.timeout_s)
        except grpc.RpcError as exc:
            return False, f"{exc.code().name}: {exc.details()}"
        if reply.status != health_pb2.HealthCheckResponse.SERVING:
            return False, f"health is {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}"
        return True, ""

    def check_once(self) -> bool:
        serving, reason = self._serving()
        if serving and not self._up:
            try:
                self._recheck()
            except (SpecdecError, grpc.RpcError) as exc:
                serving, reason = False, f"came back but failed the identity check: {exc}"
                log.error("%s at %s %s", self.name, self.client.address, reason)
        self._set(serving, reason)
        return serving

    def _loop(self) -> None:
        backoff = self.settings.min_backoff_s
        while not self._stop.is_set():
            self.client.renew_lease(self.settings.timeout_s)  # up or not: a lapse would end every session
            if self.check_once():
                backoff, delay = self.settings.min_backoff_s, self.settings.interval_s
                self._checks += 1
                if self._info_listeners and self._checks % self.settings.info_every == 0:
                    self._read_info()
            else:
                delay, backoff = backoff, min(backoff * 2, self.settings.max_backoff_s)
            self._wake.wait(delay)
            self._wake.clear()


class Backends:
    """The two model services, checked to be compatible, then watched."""

    def __init__(self, verifier: str, drafter: str | None, connect_timeout_s: float,
                 tls: ClientTls | None = None, watch: WatchSettings = WatchSettings(), token: str | None = None):
        self.verifier = VerifierClient(verifier, tls, token)
        self.drafter = DrafterClient(drafter, tls, token) if drafter else None
        self.owner = uuid.uuid4().hex  # this coordinator's sessions, for their lease (a restart is a new owner)
        for client in filter(None, (self.verifier, self.drafter)):
            client.owner, client.lease_s = self.owner, watch.lease_s
        for client in filter(None, (self.verifier, self.drafter)):
            wait_until_serving(client.address, connect_timeout_s, tls=tls)
        self.target_info = self.verifier.info()
        # Checked against the fingerprint the verifier reported (FailedPrecondition if it changed in transfer).
        self.tokenizer = load_tokenizer_files(self.verifier.tokenizer_files(), self.target_info.tokenizer_fingerprint)
        self.draft_info = self.drafter.info() if self.drafter else None
        if self.draft_info is not None:
            self.check_tokenizers()
        self.verifier_watch = BackendWatch("verifier", self.verifier, self._recheck_verifier, watch)
        self.drafter_watch = BackendWatch("drafter", self.drafter, self._recheck_drafter, watch) \
            if self.drafter else None
        if self.drafter_watch is not None:  # requests waiting on a drafter found down go on without it, now
            self.drafter_watch.on_change(lambda up: up or self.drafter.abandon_in_flight())
        for w in filter(None, (self.verifier_watch, self.drafter_watch)):
            w.start()

    def check_tokenizers(self) -> None:
        if self.draft_info.tokenizer_fingerprint == self.target_info.tokenizer_fingerprint:
            return
        draft_tokenizer = load_tokenizer_files(self.drafter.tokenizer_files())  # only to name the difference
        difference = first_difference(describe(draft_tokenizer), describe(self.tokenizer)) or (
            "fingerprints differ but no field does (different tokenizer library versions?)")
        raise TokenizerMismatch(
            f"draft ({self.draft_info.model}) and target ({self.target_info.model}) tokenizers differ: {difference}. "
            "Speculative decoding needs identical tokenizers; pick a draft model from the target's family.")

    def _recheck_drafter(self) -> None:
        self.draft_info = self.drafter.info()
        self.check_tokenizers()

    def _recheck_verifier(self) -> None:
        info = self.verifier.info()
        if (info.tokenizer_fingerprint, info.vocab_size) != (self.target_info.tokenizer_fingerprint,
                                                             self.target_info.vocab_size):
            raise FailedPrecondition(f"the verifier now serves {info.model} with another tokenizer; restart the "
                                     "coordinator to serve it")
        if info.synthetic_acceptance != self.target_info.synthetic_acceptance:  # stamped on every response's stats
            raise FailedPrecondition("the verifier now runs another --synthetic-acceptance; restart the coordinator "
                                     "to serve it")

    @property
    def drafter_up(self) -> bool:
        return self.drafter_watch is not None and self.drafter_watch.up

    def close(self) -> None:
        for w in filter(None, (self.verifier_watch, self.drafter_watch)):
            w.stop()
        for client in filter(None, (self.verifier, self.drafter)):
            client.close()

