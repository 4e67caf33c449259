"""A bound on what all of a model service's KV caches hold together.

Each session's cache is one buffer that grows in pages of `lean.CHUNK` tokens
as its sequence does; the pool counts the pages every live cache holds and
refuses growth past its budget with RESOURCE_EXHAUSTED, so many long sessions
are turned away instead of running the process out of memory. A cache's pages
return to the pool when the cache is dropped (the session ended, or was reaped),
through a weakref finalizer, so no path that forgets a session leaks them.
"""
from __future__ import annotations

import threading
import weakref

from specdec.rpc.errors import ResourceExhausted


class KVPool:
    def __init__(self, budget_tokens: int, token_bytes: int):
        assert budget_tokens > 0 and token_bytes > 0, (budget_tokens, token_bytes)
        self.budget_tokens = budget_tokens
        self.token_bytes = token_bytes
        self.used_tokens = 0
        self.holders = 0
        self._lock = threading.Lock()

    @classmethod
    def of_bytes(cls, budget_bytes: int, token_bytes: int) -> "KVPool":
        return cls(max(1, budget_bytes // token_bytes), token_bytes)

    def hold(self, cache: object) -> list[int]:
        """Register a cache; returns its holding ([tokens]), given back when the cache is dropped."""
        holding = [0]
        with self._lock:
            self.holders += 1
        weakref.finalize(cache, self._release, holding)
        return holding

    def grow(self, holding: list[int], needed: int, wanted: int) -> int:
        """Grow a holding to `wanted` tokens if the budget allows, else to `needed`
        (never less than it already holds); returns the tokens it now holds."""
        with self._lock:
            held = holding[0]
            free = self.budget_tokens - self.used_tokens
            if needed - held > free:
                raise ResourceExhausted(
                    f"the KV cache pool is full: {self.used_tokens} of {self.budget_tokens} tokens "
                    f"({self.used_tokens * self.token_bytes / 2**20:.0f} of "
                    f"{self.budget_tokens * self.token_bytes / 2**20:.0f} MiB) are held by {self.holders} sessions, "
                    f"and this one needs {needed - held} more; retry later, or start the service with a larger "
                    "--kv-cache-mb")
            granted = max(needed, min(wanted, held + free))
            self.used_tokens += granted - held
            holding[0] = granted
            return granted

    def _release(self, holding: list[int]) -> None:
        with self._lock:
            self.used_tokens -= holding[0]
            self.holders -= 1
            holding[0] = 0
