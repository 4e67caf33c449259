"""A model service's cost curve: what it publishes (measured at warm-up, or
pinned), and reading it as ms of one forward over any number of rows. Shared by
the batching scheduler (how many rows to run at once) and the coordinator's γ
controller (what a share of a batched forward costs); no torch, so the
coordinator can use it."""
from __future__ import annotations

import os
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


# A pinned curve for each service, read where no --cost-curve is given: set for a
# whole test run (or a fleet's start), it reaches every service, in-process or not.
COST_CURVE_ENV = {"Drafter": "SPECDEC_DRAFTER_COST_CURVE", "Verifier": "SPECDEC_VERIFIER_COST_CURVE"}


def pinned_curve(service_name: str) -> CostCurve | None:
    """The curve the environment pins for this service (its COST_CURVE_ENV variable), if any."""
    value = os.environ.get(COST_CURVE_ENV.get(service_name.rsplit(".", 1)[-1], ""), "")
    return CostCurve.parse(value) if value.strip() else None
