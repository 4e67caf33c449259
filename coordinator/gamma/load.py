"""How many requests share the model services' forwards now."""
from __future__ import annotations

import math
import threading
import time

from specdec.spec.types import BatchLoad


class ServiceLoad:
    """How many requests share the model services now: the coordinator's own
    requests in flight, or (another coordinator's too) the calls per verifier
    forward its responses report, an EWMA fading back to 1 while no response
    comes; whichever is more. Shared by the requests of a coordinator."""

    def __init__(self, rate: float = 0.3, fade_s: float = 2.0, clock=time.monotonic):
        self.rate, self.fade_s, self._clock = rate, fade_s, clock
        self._calls, self._at = 1.0, clock()
        self._lock = threading.Lock()
        self.in_flight = 0

    def enter(self) -> None:
        with self._lock:
            self.in_flight += 1

    def leave(self) -> None:
        with self._lock:
            self.in_flight -= 1

    def observe(self, batch: BatchLoad) -> None:
        if batch.forwards == 0:
            return
        calls = self._reported()  # faded to now, then moved toward what was seen
        self._calls, self._at = calls + self.rate * (batch.mean_calls - calls), self._clock()

    def _reported(self) -> float:
        return 1.0 + (self._calls - 1.0) * math.exp(-(self._clock() - self._at) / self.fade_s)

    @property
    def calls(self) -> float:
        return max(self._reported(), float(self.in_flight))
