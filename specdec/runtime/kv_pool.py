"""A bound on what all of a model service's KV caches hold together.

Each session's cache is one buffer that grows in pages of `kv_cache.CHUNK` tokens
as its sequence does; the pool counts the pages every live cache holds and
refuses growth past its budget with RESOURCE_EXHAUSTED, so many long sessions
are turned away instead of running the process out of memory. A cache's pages
return to the pool when the cache is dropped (the session ended, or was reaped),
through a weakref finalizer, so no path that forgets a session leaks them.

The prefix cache (specdec.runtime.prefix_cache) keeps its blocks under the same
budget (`take`, `give`): when a session needs room the pool does not have, the
cache gives back blocks no session is copying (`reclaim`), least recently used
first, before the session is refused.
"""
from __future__ import annotations

import threading
import weakref
from typing import Callable

from specdec.rpc.errors import ResourceExhausted


class KVPool:
    def __init__(self, budget_tokens: int, token_bytes: int):
        assert budget_tokens > 0 and token_bytes > 0, (budget_tokens, token_bytes)
        self.budget_tokens = budget_tokens
        self.token_bytes = token_bytes
        self.used_tokens = 0
        self.holders = 0
        self.reclaim: Callable[[int], int] | None = None  # (tokens wanted) -> tokens it gave back
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
        short = self._short(holding, needed)
        if short > 0 and self.reclaim is not None:
            self.reclaim(short)  # outside the lock: the cache gives its blocks back through `give`
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

    def _short(self, holding: list[int], needed: int) -> int:
        with self._lock:
            return needed - holding[0] - (self.budget_tokens - self.used_tokens)

    def take(self, tokens: int) -> bool:
        """Hold `tokens` more for the prefix cache, if they are free (never reclaims)."""
        with self._lock:
            if self.used_tokens + tokens > self.budget_tokens:
                return False
            self.used_tokens += tokens
            return True

    def give(self, tokens: int) -> None:
        with self._lock:
            self.used_tokens -= tokens

    def _release(self, holding: list[int]) -> None:
        with self._lock:
            self.used_tokens -= holding[0]
            self.holders -= 1
            holding[0] = 0
