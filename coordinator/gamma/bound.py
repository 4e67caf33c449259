"""What speculation can pay on the services' cost curves, before any round runs.

A round of γ drafts, each kept with probability α, yields E = 1 + α + … + α^γ
tokens for γ draft steps and one verification of γ + 1 rows, so over
target-only decoding it speeds a token up by

    speedup(γ, α) = E · T(1) / (γ · draft_ms + T(γ + 1)),

T the verifier's forward by rows. With a perfect free draft (α = 1, draft_ms = 0)
this is (γ + 1) · T(1) / T(γ + 1): where each verified row costs nearly a step,
no draft, however good, pays much. The break-even acceptance is the least α at
which some γ reaches 1×: free lookups need α past it, the draft model past its
own (its steps cost). The coordinator logs these at start; `specdec bench`
reports them from the curves of its run."""
from __future__ import annotations

from typing import Callable, Sequence

from coordinator.gamma.cost import RowCurve


def expected_tokens(gamma: int, acceptance: float) -> float:
    """Tokens a round of `gamma` drafts yields, each draft kept with probability
    `acceptance` given the ones before it were: 1 + α + … + α^γ."""
    assert gamma >= 0 and 0.0 <= acceptance <= 1.0, (gamma, acceptance)
    return sum(acceptance ** i for i in range(gamma + 1))


def speedup(verify_ms: Sequence[float], gamma: int, draft_ms: float = 0.0, acceptance: float = 1.0) -> float:
    """Target-only's ms per token over speculation's at `gamma` drafts a round, on a
    verifier cost curve `verify_ms` [ms of a forward over 1..N rows]; `draft_ms` a
    draft step."""
    assert verify_ms and draft_ms >= 0.0, (verify_ms, draft_ms)
    forward = RowCurve(verify_ms)   # as the controller plans verify time before any round
    # A one-row step dearer than a forward of more rows is noise (a curve timed while other
    # processes held the cores read 8.1 ms for one row, 6.5 for sixteen, and promised 24.7x):
    # target-only is priced at the least of them, so no γ promises more than γ + 1 tokens a step.
    one = min(forward(1), min(verify_ms))
    return expected_tokens(gamma, acceptance) * one / (gamma * draft_ms + forward(gamma + 1))


def best_speedup(verify_ms: Sequence[float], draft_ms: float = 0.0, acceptance: float = 1.0,
                 gamma_max: int | None = None) -> tuple[float, int]:
    """The best speedup over γ in [1, gamma_max] (default: the curve's rows - 1, at
    least 1), and that γ."""
    top = gamma_max if gamma_max is not None else max(len(verify_ms) - 1, 1)
    return max((speedup(verify_ms, g, draft_ms, acceptance), g) for g in range(1, top + 1))


def fixed_gamma(verify_ms: Sequence[float], draft_ms: float, acceptance: float, gamma_max: int) -> int:
    """The γ of best expected speedup on these curves at this acceptance, 0 where none
    beats target-only decoding: a fixed γ that does not follow timing."""
    if not verify_ms or gamma_max < 1:
        return 0
    speed, gamma = best_speedup(verify_ms, draft_ms, acceptance, gamma_max)
    return gamma if speed > 1.0 else 0


def least_acceptance(speedup_at: Callable[[float], float], tolerance: float = 1e-3) -> float | None:
    """The least acceptance at which speedup_at(α) reaches 1 (None: not even at α = 1).
    Speedup grows with acceptance, so a bisection."""
    if speedup_at(1.0) < 1.0:
        return None
    low, high = 0.0, 1.0
    while high - low > tolerance:
        mid = (low + high) / 2
        low, high = (low, mid) if speedup_at(mid) >= 1.0 else (mid, high)
    return high


def break_even_acceptance(verify_ms: Sequence[float], draft_ms: float = 0.0,
                          gamma_max: int | None = None, tolerance: float = 1e-3) -> float | None:
    """The least acceptance at which some γ reaches target-only's speed (None: not
    even a perfect draft does)."""
    return least_acceptance(lambda alpha: best_speedup(verify_ms, draft_ms, alpha, gamma_max)[0], tolerance)


def describe(verify_ms: Sequence[float], draft_ms: float | None = None) -> str:
    """One line for the log and the bench: the ceiling and the break-even acceptances."""
    if len(verify_ms) < 2:
        return "speculation's bound needs the verifier's cost curve over at least 2 rows"
    ceiling, gamma = best_speedup(verify_ms)
    drafts = [("free lookups", 0.0)] + ([] if draft_ms is None else
                                        [(f"the draft model ({draft_ms:.1f} ms a step)", draft_ms)])
    pays = []
    for name, cost in drafts:
        alpha = break_even_acceptance(verify_ms, cost)
        pays.append(f"{name}: from acceptance {alpha:.2f}" if alpha is not None else f"{name}: at no acceptance")
    return (f"speculation on the services' cost curves: a perfect free draft would give at most {ceiling:.2f}x "
            f"target-only (γ={gamma}: {gamma + 1} rows verified in {RowCurve(verify_ms)(gamma + 1):.1f} ms, one in "
            f"{verify_ms[0]:.1f}); it pays with " + ", ".join(pays))
