"""Per-session state with a time to live, an owner's lease, and a cap on how many may exist.

A session holds a KV cache, so an abandoned one is memory lost: the store reaps
sessions idle for longer than the TTL, and refuses new ones beyond the cap with
RESOURCE_EXHAUSTED rather than running out of memory. A session may name its
owner (a coordinator's instance id) and a lease: the owner renews it for all its
sessions at once (KeepAlive, about every second), and when it lapses (the owner
crashed, restarted under a new id, or lost the network) its sessions end within
the reaper's interval, not at the TTL, which must cover a request's longest gap
between calls and so is minutes.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Generic, Iterator, TypeVar
from contextlib import contextmanager

from specdec.rpc.errors import AlreadyExists, InvalidArgument, NotFound, ResourceExhausted

T = TypeVar("T")
MAX_SESSION_ID_LEN = 128  # session ids and owners alike
MAX_LEASE_S = 3600.0
REAP_INTERVAL_S = 1.0  # leases lapse within this of their end


def check_id(value: str, what: str, empty_ok: bool = False) -> None:
    if (not value and not empty_ok) or len(value) > MAX_SESSION_ID_LEN:
        raise InvalidArgument(f"{what} must be {0 if empty_ok else 1}..{MAX_SESSION_ID_LEN} characters, "
                              f"got {len(value)}")


def check_lease(owner: str, lease_s: float) -> None:
    check_id(owner, "owner", empty_ok=True)
    if owner and not 0 < lease_s <= MAX_LEASE_S:
        raise InvalidArgument(f"lease_s must be in (0, {MAX_LEASE_S:g}] with an owner, got {lease_s:g}")


@dataclass
class _Entry(Generic[T]):
    value: T
    last_used: float
    owner: str = ""
    lock: threading.Lock = field(default_factory=threading.Lock)


class SessionStore(Generic[T]):
    def __init__(self, ttl_s: float = 600.0, max_sessions: int = 256, clock: Callable[[], float] = time.monotonic):
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self._clock = clock
        self._entries: dict[str, _Entry[T]] = {}
        self._leases: dict[str, float] = {}  # owner -> when its lease lapses (clock)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.ended_by_lease = 0
        self.reaped_idle = 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def create(self, session_id: str, factory: Callable[[], T], owner: str = "", lease_s: float = 0.0) -> T:
        check_id(session_id, "session_id")
        check_lease(owner, lease_s)
        self.reap()
        if owner:
            self.renew(owner, lease_s)
        with self._lock:
            if session_id in self._entries:
                raise AlreadyExists(f"session {session_id!r} already exists")
            if len(self._entries) >= self.max_sessions:
                raise ResourceExhausted(
                    f"{len(self._entries)} sessions are open, the limit (--max-sessions) is {self.max_sessions}; "
                    "retry later")
            # Reserve the id while the (slow) factory runs, outside the store lock.
            entry: _Entry = _Entry(value=None, last_used=self._clock(), owner=owner)
            entry.lock.acquire()
            self._entries[session_id] = entry
        try:
            entry.value = factory()
            # Idle from now, not from when the id was reserved: a prefill longer
            # than the TTL must not leave a session the reaper takes at once.
            entry.last_used = self._clock()
        except BaseException:
            with self._lock:
                self._entries.pop(session_id, None)
            raise
        finally:
            entry.lock.release()
        return entry.value

    @contextmanager
    def use(self, session_id: str) -> Iterator[T]:
        """The session's state, held exclusively for the duration of the call."""
        check_id(session_id, "session_id")
        with self._lock:
            entry = self._entries.get(session_id)
        if entry is None:
            raise NotFound(f"unknown session {session_id!r}: never started, already ended, "
                           f"reaped after {self.ttl_s:g} s idle, or ended when its owner's lease lapsed")
        with entry.lock:
            if self._entries.get(session_id) is not entry:
                raise NotFound(f"session {session_id!r} ended while this call waited for it")
            entry.last_used = self._clock()
            try:
                yield entry.value
            finally:
                entry.last_used = self._clock()

    def touch(self, session_id: str) -> bool:
        """Renew a session's time to live without waiting for a call that holds it."""
        with self._lock:
            entry = self._entries.get(session_id)
            if entry is not None:
                entry.last_used = self._clock()
            return entry is not None

    def renew(self, owner: str, lease_s: float) -> int:
        """The owner's lease runs lease_s from now; returns how many sessions it holds."""
        check_lease(owner, lease_s)
        with self._lock:
            self._leases[owner] = self._clock() + lease_s
            return sum(e.owner == owner for e in self._entries.values())

    def remove(self, session_id: str) -> bool:
        with self._lock:
            return self._entries.pop(session_id, None) is not None

    def reap(self) -> int:
        """Drop sessions idle past the TTL, and those whose owner's lease lapsed (not
        those in use: a call holds them; the next reap does). Returns how many."""
        now = self._clock()
        with self._lock:
            idle = [k for k, e in self._entries.items() if now - e.last_used > self.ttl_s and not e.lock.locked()]
            for key in idle:
                del self._entries[key]
            lapsed = {owner for owner, until in self._leases.items() if until < now}
            ended = [k for k, e in self._entries.items() if e.owner in lapsed and not e.lock.locked()]
            for key in ended:
                del self._entries[key]
            held = {e.owner for e in self._entries.values()}
            for owner in lapsed - held:   # forgotten once none of its sessions is left
                del self._leases[owner]
            self.reaped_idle += len(idle)
            self.ended_by_lease += len(ended)
        return len(idle) + len(ended)

    def start_reaper(self, interval_s: float | None = None) -> threading.Thread:
        interval = interval_s if interval_s is not None else REAP_INTERVAL_S

        def loop() -> None:
            while not self._stop.wait(interval):
                self.reap()

        thread = threading.Thread(target=loop, name="session-reaper", daemon=True)
        thread.start()
        return thread

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            self._entries.clear()
