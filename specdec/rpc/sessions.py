"""Per-session state with a time to live and a cap on how many may exist.

A session holds a KV cache, so an abandoned one is memory lost: the store reaps
sessions idle for longer than the TTL, and refuses new ones beyond the cap with
RESOURCE_EXHAUSTED rather than running out of memory.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Generic, Iterator, TypeVar
from contextlib import contextmanager

from specdec.rpc.errors import AlreadyExists, InvalidArgument, NotFound, ResourceExhausted

T = TypeVar("T")
MAX_SESSION_ID_LEN = 128


@dataclass
class _Entry(Generic[T]):
    value: T
    last_used: float
    lock: threading.Lock = field(default_factory=threading.Lock)


class SessionStore(Generic[T]):
    def __init__(self, ttl_s: float = 600.0, max_sessions: int = 256, clock: Callable[[], float] = time.monotonic):
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self._clock = clock
        self._entries: dict[str, _Entry[T]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def create(self, session_id: str, factory: Callable[[], T]) -> T:
        if not session_id or len(session_id) > MAX_SESSION_ID_LEN:
            raise InvalidArgument(f"session_id must be 1..{MAX_SESSION_ID_LEN} characters")
        self.reap()
        with self._lock:
            if session_id in self._entries:
                raise AlreadyExists(f"session {session_id!r} already exists")
            if len(self._entries) >= self.max_sessions:
                raise ResourceExhausted(
                    f"{len(self._entries)} sessions are open, the limit (--max-sessions) is {self.max_sessions}; "
                    "retry later")
            # Reserve the id while the (slow) factory runs, outside the store lock.
            entry: _Entry = _Entry(value=None, last_used=self._clock())
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
        with self._lock:
            entry = self._entries.get(session_id)
        if entry is None:
            raise NotFound(f"unknown session {session_id!r}: never started, already ended, "
                           f"or reaped after {self.ttl_s:g} s idle")
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

    def remove(self, session_id: str) -> bool:
        with self._lock:
            return self._entries.pop(session_id, None) is not None

    def reap(self) -> int:
        """Drop sessions idle past the TTL (not those in use). Returns how many."""
        now = self._clock()
        with self._lock:
            expired = [k for k, e in self._entries.items()
                       if now - e.last_used > self.ttl_s and not e.lock.locked()]
            for key in expired:
                del self._entries[key]
        return len(expired)

    def start_reaper(self, interval_s: float | None = None) -> threading.Thread:
        interval = interval_s if interval_s is not None else max(1.0, min(self.ttl_s / 4, 30.0))

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
