"""A model service's cost curve: what it publishes (measured at warm-up and kept
current from its forwards, or pinned), and reading it as ms of one forward over
any number of rows. Shared by
the batching scheduler (how many rows to run at once) and the coordinator's γ
controller (what a share of a batched forward costs); no torch, so the
coordinator can use it."""
from __future__ import annotations

import os
import statistics
import threading
from collections import deque
from dataclasses import dataclass
from typing import Sequence


class RowCost:
    """ms of one forward over n rows, from a measured curve [1..N rows]; between
    measured row counts, interpolated. Past N: the curve's mean slope over its
    upper half per extra row (prefill chunks run far past the measured rows, at
    about that rate), but never more per row than the best the upper half
    measured. Kernels that take rows in passes (int4: 4) make the last measured
    row look dear (a new pass), and a batch past the curve would then be cut back
    to the rows measured."""

    def __init__(self, forward_ms: Sequence[float]):
        self.ms = [float(v) for v in forward_ms]
        n = len(self.ms)
        half = n // 2
        if n >= 2:  # the last step alone can be a whole kernel pass, or noise
            self.slope = max((self.ms[-1] - self.ms[half - 1]) / (n - half), 0.0)
        else:
            self.slope = self.ms[0] if n else 0.0
        self.best_per_row = min(self.ms[i] / (i + 1) for i in range(half, n)) if n else 0.0

    def __call__(self, rows: float) -> float:
        if not self.ms:
            return float(rows)
        rows, n = max(rows, 1.0), len(self.ms)
        if rows >= n:
            return min(self.ms[-1] + (rows - n) * self.slope, rows * self.best_per_row)
        lo = int(rows)
        return self.ms[lo - 1] + (rows - lo) * (self.ms[lo] - self.ms[lo - 1])


def gathered_cost(one_row_ms: float, costs: dict[int, float]) -> RowCost | None:
    """The scheduler's cost of a batch of several sessions' rows, from what such batches took
    at warm-up, {rows: ms} (warm_up.time_gathered_buckets; one row: a session's own
    forward), linear between the row counts timed; None where none were."""
    if not costs:
        return None
    points = sorted({1: one_row_ms, **costs}.items())
    ms = []
    for (lo, lo_ms), (hi, hi_ms) in zip(points, points[1:]):
        ms += [lo_ms + (hi_ms - lo_ms) * (r - lo) / (hi - lo) for r in range(lo, hi)]
    ms.append(points[-1][1])
    # A batch never costs more than two smaller ones making it up (it could be run as them):
    # a bucket timed high once at warm-up (a neighbour's burst) is held to that, where a
    # start profile would otherwise keep it splitting batches of its rows for good.
    for n in range(1, len(ms)):
        ms[n] = min([ms[n], *(ms[a] + ms[n - 1 - a] for a in range(n))])
    return RowCost(ms)


@dataclass(frozen=True)
class CostCurve:
    forward_ms: list[float]        # [rows] one forward over 1..rows new rows after the prefix
    prefill_ms_per_token: float    # the prefix's prefill, per token

    @classmethod
    def parse(cls, text: str) -> "CostCurve":
        """'MS,MS,...[:PREFILL_MS]': ms of one forward over 1, 2, ... rows, and
        optionally the prefill's ms per prompt token (default: the 1-row ms)."""
        curve, _, prefill = text.strip().partition(":")
        try:
            forward = [float(v) for v in curve.split(",") if v.strip()]
            per_token = float(prefill) if prefill.strip() else (forward[0] if forward else 0.0)
        except ValueError:
            forward, per_token = [], -1.0
        if not forward or per_token < 0 or any(not ms > 0 for ms in forward):
            raise ValueError(f"a cost curve is 'MS,MS,...[:PREFILL_MS]' with positive ms, got {text!r}")
        return cls(forward, per_token)


class LiveCurve:
    """A measured curve kept current from the forwards the service runs: a curve
    timed once at warm-up would govern the service for its whole life, though a
    neighbour that was busy then (or has come since) moves every forward's cost.

    Each row count's recent forwards (a window) give its cost, by their median:
    a few forwards slowed by a neighbour or a page fault do not move it. A row
    count with too few recent forwards takes its warm-up cost scaled as the
    others have moved (the median of their ratios), so a machine that got busier
    or quieter moves the whole curve. Recent is by the service's forwards, not a
    row count's own: a forward more than `horizon` forwards back no longer counts,
    so the one-row forwards of a busy minute do not stand for one row's cost while
    the service runs only verifications of several (a request drafting at γ = 1).
    A forward of prefill chunks alone, past the curve's rows, gives the prefill's
    ms per token (its window kept whole: a request makes a chunk or two). Prefill
    chunks teach the row counts nothing: they may run another path than the
    kernels a decode or a verification runs (`dense_rows`: a dense fp32 matmul on an AVX2 CPU, some
    times cheaper per row), and a curve that took a short prompt's prefill for a
    verification of as many rows would make batched drafting under load look
    cheaper than it is."""

    def __init__(self, measured: CostCurve, window: int = 32, min_samples: int = 5, horizon: int | None = None):
        self.measured = measured
        self.min_samples = min_samples
        self.horizon = horizon or 8 * window      # forwards of any rows after which one no longer counts
        self._rows = [deque(maxlen=window) for _ in measured.forward_ms]   # (forward index, ms)
        self._prefill: deque = deque(maxlen=window)
        self._lock = threading.Lock()
        self.observed = 0

    def observe(self, rows: int, ms: float, prefill_rows: int = 0) -> None:
        """A forward of `rows` rows took `ms`; `prefill_rows` of them were prefill chunks'."""
        if rows < 1 or not ms > 0:
            return
        with self._lock:
            self.observed += 1
            if prefill_rows == 0 and rows <= len(self._rows):
                self._rows[rows - 1].append((self.observed, ms))
            elif prefill_rows == rows >= 2 * len(self._rows):   # chunks alone, not a batch just past the curve
                self._prefill.append(ms / rows)

    def current(self) -> CostCurve:
        with self._lock:
            since = self.observed - self.horizon
            recent = [[ms for index, ms in w if index > since] for w in self._rows]
            medians = [statistics.median(r) if len(r) >= self.min_samples else None for r in recent]
            prefill = statistics.median(self._prefill) if len(self._prefill) >= self.min_samples else None
        ratios = [m / w for m, w in zip(medians, self.measured.forward_ms) if m is not None and w > 0]
        scale = statistics.median(ratios) if ratios else 1.0
        forward = [m if m is not None else w * scale for m, w in zip(medians, self.measured.forward_ms)]
        return CostCurve(forward, prefill if prefill is not None else self.measured.prefill_ms_per_token * scale)


# A pinned curve for each service, read where no --cost-curve is given: set for a
# whole test run (or a fleet's start), it reaches every service, in-process or not.
COST_CURVE_ENV = {"Drafter": "SPECDEC_DRAFTER_COST_CURVE", "Verifier": "SPECDEC_VERIFIER_COST_CURVE"}


def pinned_curve(service_name: str) -> CostCurve | None:
    """The curve the environment pins for this service (its COST_CURVE_ENV variable), if any."""
    value = os.environ.get(COST_CURVE_ENV.get(service_name.rsplit(".", 1)[-1], ""), "")
    return CostCurve.parse(value) if value.strip() else None
