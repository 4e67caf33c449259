"""How many tokens a request is expected to generate, learned from the requests
that finished before it.

A request's `max_new_tokens` is a ceiling, not a forecast: a short answer
(qa, a one-line translation) ends by itself long before it. What a request may
spend on the drafter's prefill or on probes is priced against what it is
expected to generate (explore.py's budget, the controller's `prefill_pays`):
priced against its ceiling, a 7-token answer paid for a drafter prefill that
only a 64-token one could repay (qa at 0.92x target-only on the dev half, 1e3fc2d).

The estimate is E[min(L, limit)] over the last WINDOW finished requests: one
that ended by itself (EOS, a stop string) counts its length, capped at the new
request's limit; one its own limit cut counts the new limit in full (it would
have gone on, for all we know). With no history the limit is all there is, so
the first requests are priced as before; the prior of one request run to its
limit keeps a single short answer from closing the budget of the next.
"""
from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

WINDOW = 32        # recent finished requests: a workload's mix follows, one prompt does not swing it
PRIOR_REQUESTS = 1  # requests taken to have run to the new request's limit


@dataclass(frozen=True)
class Finished:
    tokens: int    # generated after the first (the first is the target's, speculating or not)
    ended: bool    # by itself (EOS, a stop string); else its own limit cut it


class OutputLengths:
    """Recent finished requests' lengths, shared by the requests that start after them."""

    def __init__(self, window: int = WINDOW):
        self._recent: deque[Finished] = deque(maxlen=window)
        self._lock = threading.Lock()

    def observe(self, tokens: int, ended: bool) -> None:
        with self._lock:
            self._recent.append(Finished(max(tokens, 0), ended))

    def expected(self, limit: int) -> float:
        """The tokens a request that may generate up to `limit` is expected to."""
        limit = max(limit, 0)
        with self._lock:
            counted = [min(f.tokens, limit) if f.ended else limit for f in self._recent]
        return (PRIOR_REQUESTS * limit + sum(counted)) / (PRIOR_REQUESTS + len(counted))
