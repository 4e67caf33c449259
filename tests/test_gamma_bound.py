"""What speculation can pay on a verifier's cost curve: the ceiling of a perfect
free draft and the break-even acceptances (coordinator/gamma/bound.py)."""
import logging

import pytest

from coordinator.gamma.bound import best_speedup, break_even_acceptance, describe, expected_tokens, speedup
from tests.conftest import coordinator_stub, pinned_services


def test_expected_tokens_is_leviathans_sum():
    assert expected_tokens(0, 0.3) == 1.0
    assert expected_tokens(4, 1.0) == 5.0
    assert expected_tokens(3, 0.0) == 1.0
    assert expected_tokens(3, 0.8) == pytest.approx((1 - 0.8 ** 4) / (1 - 0.8))


def test_flat_rows_let_a_perfect_draft_pay_its_length_and_a_row_a_step_pays_nothing():
    flat = [10.0] * 9
    assert best_speedup(flat) == (pytest.approx(9.0), 8)
    assert speedup(flat, 3, draft_ms=2.0, acceptance=1.0) == pytest.approx(4 * 10 / (3 * 2 + 10))
    a_step_a_row = [10.0 * rows for rows in range(1, 6)]
    assert best_speedup(a_step_a_row)[0] == pytest.approx(1.0)
    assert break_even_acceptance(a_step_a_row, draft_ms=1.0) is None     # nothing to pay a draft step with
    assert "at no acceptance" in describe(a_step_a_row, 1.0)


def test_the_break_even_acceptance_is_where_the_best_gamma_reaches_one():
    curve = [37.3, 61.6, 82.0, 119.7, 142.4]     # each verified row about 0.6 to 1 of a step
    ceiling, gamma = best_speedup(curve)
    assert gamma == 2 and ceiling == pytest.approx(3 * 37.3 / 82.0)
    free, model = break_even_acceptance(curve), break_even_acceptance(curve, draft_ms=11.8)
    assert free < model < 1.0                    # a draft that costs needs more acceptance
    for draft_ms, alpha in ((0.0, free), (11.8, model)):
        assert best_speedup(curve, draft_ms, alpha)[0] >= 1.0
        assert best_speedup(curve, draft_ms, alpha - 0.002)[0] < 1.0


def test_a_one_row_step_dearer_than_more_rows_never_promises_more_than_a_row_a_draft():
    """A curve timed while other processes held the cores: one row 8.1 ms, sixteen 6.5. The
    bound prices target-only at the least point, so a perfect draft of γ gives at most γ + 1."""
    noisy = [8.1, 47.1, 54.3] + [30.0] * 12 + [6.5]
    ceiling, gamma = best_speedup(noisy)
    assert ceiling == pytest.approx(16.0) and gamma == 15       # (γ + 1) · 6.5 / 6.5, not 16 · 8.1 / 6.5
    assert speedup(noisy, 2) == pytest.approx(3 * 6.5 / 54.3)


def test_past_the_curve_the_rows_follow_its_extrapolation_only_when_asked():
    curve = [10.0, 11.0, 12.0]
    assert best_speedup(curve)[1] <= 2                           # the rows measured: γ + 1 <= 3
    assert best_speedup(curve, gamma_max=6)[1] > 2               # flat on: longer drafts verify cheaply
    assert "at least 2 rows" in describe([10.0])


def test_the_coordinator_logs_the_bound_of_its_services_curves(tiny_draft, tiny_target, caplog):
    target_ms = [10.0, 12.0, 14.0, 16.0]
    with caplog.at_level(logging.INFO, logger="coordinator"):
        with pinned_services(tiny_draft, tiny_target, draft_ms=[4.0, 4.5], target_ms=target_ms) as addresses, \
                coordinator_stub(**addresses, learn_costs=False):
            pass
    lines = [r.getMessage() for r in caplog.records if "speculation on the services' cost curves" in r.getMessage()]
    # By hand: 4 rows verified in 16 ms carry 4 tokens of a perfect draft, 2.5 steps of 10 ms.
    # The break-evens are γ = 1's: 10 (1 + α) = 12 for free lookups (α = 0.2), and with a
    # 4 ms draft step 10 (1 + α) = 4 + 12 (α = 0.6); longer drafts need more.
    assert len(lines) == 1
    assert "at most 2.50x target-only (γ=3: 4 rows verified in 16.0 ms, one in 10.0)" in lines[0]
    assert "free lookups: from acceptance 0.20" in lines[0]
    assert "the draft model (4.0 ms a step): from acceptance 0.60" in lines[0]
