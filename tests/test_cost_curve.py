"""specdec.runtime.cost_curve: a published curve, parsed or pinned, and read as
the cost of one forward over any number of rows."""
from __future__ import annotations

import pytest

from specdec.runtime.cost_curve import COST_CURVE_ENV, CostCurve, LiveCurve, RowCost, pinned_curve


def test_between_measured_rows_the_cost_is_interpolated():
    cost = RowCost([10.0, 12.0, 14.0, 16.0])
    assert cost(1) == 10.0 and cost(4) == 16.0
    assert cost(2.5) == pytest.approx(13.0)
    assert cost(0) == 10.0  # never below one row


def test_past_the_curve_a_row_costs_the_upper_halfs_slope_but_never_more_than_its_best_per_row():
    # An int4-like curve: 4 rows a kernel pass, the 5th row as dear as a new pass.
    int4 = RowCost([36.0, 40.0, 45.0, 49.0, 91.0])
    assert int4.slope == pytest.approx((91.0 - 40.0) / 3)
    assert int4(8) == pytest.approx(min(91.0 + 3 * int4.slope, 8 * int4.best_per_row))
    assert int4(64) <= 64 * (49.0 / 4) * 1.0001  # per row, no dearer than the best the upper half measured
    flat = RowCost([20.0, 20.5, 21.0])
    assert flat(10) == pytest.approx(21.0 + 7 * flat.slope)


def test_no_curve_counts_rows():
    assert RowCost([])(7) == 7.0


def test_a_curve_parses_from_its_flag_and_refuses_what_is_not_one():
    assert CostCurve.parse(" 20, 21.5,23 :2.5") == CostCurve([20.0, 21.5, 23.0], 2.5)
    assert CostCurve.parse("7") == CostCurve([7.0], 7.0)  # the prefill defaults to the 1-row forward
    for bad in ("", ":3", "x,1", "1,0", "1,-2", "3:x", "3:-1"):
        with pytest.raises(ValueError, match="MS,MS"):
            CostCurve.parse(bad)


def test_the_environment_pins_each_services_curve(monkeypatch):
    monkeypatch.setenv(COST_CURVE_ENV["Drafter"], "5,6:0.5")
    monkeypatch.delenv(COST_CURVE_ENV["Verifier"], raising=False)
    assert pinned_curve("specdec.v1.Drafter") == CostCurve([5.0, 6.0], 0.5)
    assert pinned_curve("specdec.v1.Verifier") is None
    assert pinned_curve("specdec.v1.Coordinator") is None


def test_a_live_curve_follows_the_forwards_by_their_median_and_moves_what_it_has_not_seen():
    # Warm-up beside a busy neighbour: every forward read four times its cost.
    live = LiveCurve(CostCurve([80.0, 84.0, 88.0, 92.0], 8.0), window=16, min_samples=5)
    assert live.current() == CostCurve([80.0, 84.0, 88.0, 92.0], 8.0)   # nothing served yet
    for ms in (20.0, 21.0, 19.0, 20.0, 20.0, 400.0):                      # one outlier among quiet 1-row forwards
        live.observe(1, ms)
    for ms in (22.0, 22.0, 21.0, 22.0, 23.0):
        live.observe(2, ms)
    curve = live.current()
    assert curve.forward_ms[:2] == [20.0, 22.0]                  # medians: the outlier does not move them
    scale = ((20.0 / 80.0) + (22.0 / 84.0)) / 2                 # rows 3 and 4 unseen: moved as the others moved
    assert curve.forward_ms[2:] == pytest.approx([88.0 * scale, 92.0 * scale], abs=1e-3)
    assert curve.prefill_ms_per_token == pytest.approx(8.0 * scale, abs=1e-3)
    for _ in range(5):
        live.observe(64, 64 * 2.0, prefill_rows=64)  # prefill chunks alone: ms per row is the prefill's per token
    live.observe(6, 1e6)                # a batch just past the curve is neither
    assert live.current().prefill_ms_per_token == 2.0 and live.current().forward_ms[:2] == [20.0, 22.0]
    for _ in range(5):
        live.observe(2, 1.0, prefill_rows=2)     # a short prompt's prefill chunk: not a 2-row verification
        live.observe(3, 1.0, prefill_rows=2)     # nor a chunk beside another call's row
        live.observe(64, 1.0, prefill_rows=63)   # nor the prefill's cost per token
    assert live.current() == CostCurve([20.0, 22.0, 88.0 * scale, 92.0 * scale], 2.0)


def test_a_live_curve_forgets_what_the_window_has_passed():
    live = LiveCurve(CostCurve([20.0], 2.0), window=8, min_samples=3)
    for _ in range(8):
        live.observe(1, 80.0)           # a neighbour came
    assert live.current().forward_ms == [80.0]
    for _ in range(5):
        live.observe(1, 20.0)           # and went: the median follows within half a window
    assert live.current().forward_ms == [20.0]


def test_a_row_count_no_longer_served_moves_with_the_others_once_its_forwards_are_old():
    live = LiveCurve(CostCurve([20.0, 22.0], 2.0), window=8, min_samples=3, horizon=40)
    for _ in range(8):
        live.observe(1, 80.0)           # one-row forwards while a neighbour took the cores
    for _ in range(20):
        live.observe(2, 23.0)           # then only 2-row verifications, the machine quiet again
    assert live.current().forward_ms == [80.0, 23.0]   # within the horizon the busy forwards still count
    for _ in range(20):
        live.observe(2, 23.0)
    # Past it, one row is its warm-up cost moved as the 2-row forwards moved (23 / 22).
    assert live.current().forward_ms == pytest.approx([20.0 * 23.0 / 22.0, 23.0])
