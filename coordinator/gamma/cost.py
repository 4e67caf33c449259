"""What a round costs: the draft a line in the model tokens drafted, fitted
online; verification on the verifier's published cost curve by rows (γ + 1),
learned per row count; under load, a round's share of batched forwards."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from specdec.runtime.cost_curve import RowCost


class EwLinearFit:
    """y ≈ a + b·x, fitted with exponential forgetting.

    While x does not vary (a fixed γ), a and b cannot be told apart, so a weak
    prior on their ratio decides the split: `b_over_a` (verifying: each extra
    token costs a small fraction of the forward) or `a_over_b` (drafting: the
    fixed cost is a small fraction of a token's)."""

    def __init__(self, *, default: tuple[float, float], b_over_a: float | None = None,
                 a_over_b: float | None = None, decay: float = 0.98, weight: float = 0.1):
        assert (b_over_a is None) != (a_over_b is None)
        # The prior penalizes u·(a, b): b - r·a, or a - r·b.
        self.u = (-b_over_a, 1.0) if b_over_a is not None else (1.0, -a_over_b)
        self.default, self.decay, self.weight = default, decay, weight
        self.sw = self.sx = self.sxx = self.sy = self.sxy = 0.0

    def observe(self, x: float, y: float) -> None:
        d = self.decay
        self.sw, self.sx, self.sxx = d * self.sw + 1, d * self.sx + x, d * self.sxx + x * x
        self.sy, self.sxy = d * self.sy + y, d * self.sxy + x * y

    def coefficients(self) -> tuple[float, float]:
        if self.sw == 0:
            return self.default
        # Normal equations of sum w (y - a - b x)^2 + λ S (u·(a, b))^2, S ~ x² (tokens²).
        lam = self.weight * 16.0
        ua, ub = self.u
        m11, m12, m22 = self.sw + lam * ua * ua, self.sx + lam * ua * ub, self.sxx + lam * ub * ub
        det = m11 * m22 - m12 * m12
        return (self.sy * m22 - m12 * self.sxy) / det, (m11 * self.sxy - m12 * self.sy) / det

    def __call__(self, x: float) -> float:
        a, b = self.coefficients()
        return max(0.0, a + b * x)


class RowCurve:
    """Verify time by rows (γ + 1 per round), starting from the verifier's measured
    cost curve and learned per row count: a row count seen in rounds has its own
    EWMA of what its rounds took over its published forward (the RPC and the
    rejection sampler, which the curve leaves out); one not seen yet is its
    published forward plus the offset the seen ones show over theirs. Rows are not
    free in every precision (int4 takes 4 a kernel pass, so the 5th costs as much
    again), which a line in γ cannot represent.

    Learned as a ratio to the published forward, a row count's estimate moves with the
    curve the verifier publishes again (a machine busier or quieter than when its rounds
    ran), whether or not its rounds run now: a request at γ = 1 never measures γ = 0's
    one-row rounds, and their cost measured while other processes took the cores (the
    standbys' imports at a stack's start) would keep it drafting once they are done."""

    def __init__(self, measured: Sequence[float], rate: float = 0.1):
        assert measured, "a curve needs at least the 1-row forward"
        self.measured = [float(ms) for ms in measured]          # [rows - 1] -> ms
        self.forward_ms = RowCost(self.measured)                # a forward over any rows: a batch's
        self.ratio = [1.0] * len(self.measured)                 # [rows - 1] -> rounds' ms over the forward's
        self.seen = [0] * len(self.measured)
        self.offset, self.offset_count, self.rate = 0.0, 0, rate

    def rebase(self, measured: Sequence[float]) -> None:
        """A newer published curve: every row count's estimate on it, seen or not."""
        before = len(self.seen)
        self.measured = [float(ms) for ms in measured]
        self.forward_ms = RowCost(self.measured)
        self.ratio = [self.ratio[i] if i < before else 1.0 for i in range(len(self.measured))]
        self.seen = [self.seen[i] if i < before else 0 for i in range(len(self.measured))]

    def observe(self, rows: int, ms: float) -> None:
        i = rows - 1
        if not 0 <= i < len(self.measured) or not self.measured[i] > 0:
            return
        self.seen[i] += 1
        self.ratio[i] += max(self.rate, 1 / self.seen[i]) * (ms / self.measured[i] - self.ratio[i])
        self.offset_count += 1
        self.offset += max(self.rate, 1 / self.offset_count) * (ms - self.measured[i] - self.offset)

    def __call__(self, rows: int) -> float:
        i = min(max(rows, 1), len(self.measured)) - 1
        value = self.measured[i] * self.ratio[i] if self.seen[i] else self.measured[i] + self.offset
        if rows > len(self.measured):
            value += (rows - len(self.measured)) * self.forward_ms.slope
        return max(value, 0.0)


@dataclass
class CostModel:
    """Round time in ms as a function of γ, learned from measured rounds."""
    # Before any round is measured: a draft token at 1/4 of a target step,
    # verifying γ tokens at one step plus 5% per token.
    draft: EwLinearFit = field(default_factory=lambda: EwLinearFit(default=(1.0, 25.0), a_over_b=0.05))
    verify: EwLinearFit = field(default_factory=lambda: EwLinearFit(default=(100.0, 5.0), b_over_a=0.05))
    verify_curve: RowCurve | None = None  # from the verifier's Info; the line above is the fallback
    draft_curve: RowCurve | None = None   # from the drafter's Info: its batched draft steps under load
    # The proposer's prefill: a line in the tokens prefilled, a + b·n (None: free or
    # unknown). It starts from the drafter's Info (a 1-row forward for the call, its
    # published ms per token) and is fitted to measured prefills: a StartSession's
    # fixed cost (the RPC, the session, the first token) is most of a short prompt's.
    draft_prefill: EwLinearFit | None = None
    # A Decode call of n target tokens (a round that drafts nothing), a + b·n: a is what
    # a call costs beyond its steps (the RPC, the round's bookkeeping), which decoding a
    # token a call, to look a lookup up before each, pays per token. Rounds of one token
    # and chunks of many tell a from b; the curve's offset cannot (a curve measured high
    # at warm-up reads as a call that costs nothing, and every token then took a call).
    decode_calls: EwLinearFit = field(default_factory=lambda: decode_line(()))
    # What a Decode call took outside the verifier (its time at the coordinator less the
    # service's own: the RPC), an EWMA over calls: the least a call costs beyond its steps,
    # measured on each call, where the line's fixed part is the difference of two large
    # figures. On a noisy 2-core CPU that fit went under 0 and a call a token looked free:
    # requests whose lookups kept nothing went on decoding a token a call (coding prompts:
    # 63 calls for 64 tokens, each charged under 1 ms, so the budget never ran out).
    call_rpc_ms: float = 0.0
    call_rpc_count: int = 0
    # Plan on the services' published curves alone, never on measured rounds: the
    # choice of γ is then the same on every machine (tests, policy comparisons).
    frozen: bool = False

    @classmethod
    def from_curves(cls, draft_ms: Sequence[float], verify_ms: Sequence[float],
                    draft_prefill_ms_per_token: float = 0.0) -> "CostModel":
        """Start from the services' measured curves (either may be empty: not measured)."""
        model = cls(draft_prefill=prefill_line(draft_ms, draft_prefill_ms_per_token))
        if draft_ms:  # a draft token: one 1-row forward, plus a little for sampling and the RPC
            model.draft = EwLinearFit(default=(1.0, float(draft_ms[0]) * 1.1), a_over_b=0.05)
            model.draft_curve = RowCurve(draft_ms)
        if verify_ms:
            model.verify_curve = RowCurve(verify_ms)
            model.decode_calls = decode_line(verify_ms)
        return model

    def follow(self, draft_ms: Sequence[float] | None = None, verify_ms: Sequence[float] | None = None,
               draft_prefill_ms_per_token: float | None = None) -> None:
        """The services published their curves again (they follow their forwards):
        plan on them. A row count seen in rounds keeps what they took over its published
        forward (RowCurve); the draft's line and the Decode calls', learned from rounds
        alone, stay."""
        if self.frozen:
            return
        if verify_ms:
            if self.verify_curve is None:
                self.verify_curve = RowCurve(verify_ms)
            else:
                self.verify_curve.rebase(verify_ms)
            if self.decode_calls.sw == 0:  # no Decode call measured yet: the line starts from the curve
                self.decode_calls = decode_line(verify_ms)
        if draft_ms:
            self.draft_curve = RowCurve(draft_ms)
            if self.draft.sw == 0:  # no measured draft round yet: the line starts from the curve
                self.draft = EwLinearFit(default=(1.0, float(draft_ms[0]) * 1.1), a_over_b=0.05)
        if draft_prefill_ms_per_token and (self.draft_prefill is None or self.draft_prefill.sw == 0):
            # no measured prefill yet: the line starts from the newer figures
            curve = draft_ms or (self.draft_curve.measured if self.draft_curve is not None else ())
            self.draft_prefill = prefill_line(curve, draft_prefill_ms_per_token)

    def observe_draft_prefill(self, tokens: int, ms: float) -> None:
        if tokens <= 0 or self.frozen or self.draft_prefill is None:
            return
        self.draft_prefill.observe(tokens, ms)

    def draft_prefill_ms(self, tokens: int) -> float:
        return self.draft_prefill(tokens) if self.draft_prefill is not None and tokens > 0 else 0.0

    def observe(self, gamma: int, draft_ms: float, verify_ms: float, draft_alone: bool = True,
                verify_alone: bool = True, model_tokens: int | None = None) -> None:
        """A round's timings: `gamma` tokens verified, `model_tokens` of them drafted
        by the model (the rest were free lookups; None: all). Only calls that ran
        alone in their forwards teach the cost of γ: a batched call's time is the
        batch's, which the load accounts for."""
        if self.frozen:
            return
        model_tokens = gamma if model_tokens is None else model_tokens
        if model_tokens > 0 and draft_alone:
            self.draft.observe(model_tokens, draft_ms)
        if not verify_alone:
            return
        if self.verify_curve is not None:
            self.verify_curve.observe(gamma + 1, verify_ms)
        else:
            self.verify.observe(gamma, verify_ms)

    def observe_decode(self, steps: int, ms: float, rpc_ms: float = 0.0) -> None:
        """A Decode call of `steps` target tokens, run alone in its forwards, took `ms`,
        `rpc_ms` of it outside the verifier (0: not measured)."""
        if steps <= 0 or self.frozen:
            return
        self.decode_calls.observe(steps, ms)
        if rpc_ms > 0:
            self.call_rpc_count += 1
            self.call_rpc_ms += max(RPC_RATE, 1 / self.call_rpc_count) * (rpc_ms - self.call_rpc_ms)

    def verify_ms(self, gamma: int, calls: float = 1.0) -> float:
        """A round's verify cost at γ when `calls` calls share each forward, all of
        them with γ + 1 rows: this call's share of the batch."""
        if self.verify_curve is None:
            return self.verify(gamma)
        if calls <= LOAD_ALONE:
            return self.verify_curve(gamma + 1)
        return self.verify_curve.forward_ms(calls * (gamma + 1)) / calls + self.verify_curve.offset

    def draft_ms(self, gamma: int, calls: float = 1.0) -> float:
        """A round's draft cost at γ: alone, the fitted line; when `calls` requests
        all draft, its share of γ batched draft steps of that many rows."""
        if gamma <= 0:
            return 0.0
        alone = self.draft(gamma)
        if calls <= LOAD_ALONE or self.draft_curve is None:
            return alone
        # The forwards are shared; what a call costs beyond them (RPC, sampling) is not.
        forward = gamma * self.draft_curve.forward_ms(1)
        return gamma * self.draft_curve.forward_ms(calls) / calls + max(alone - forward, 0.0)

    def round_ms(self, gamma: int, calls: float = 1.0) -> float:
        return self.draft_ms(gamma, calls) + self.verify_ms(gamma, calls)

    def forward_ms(self) -> float:
        """The verifier's own one-row forward as it publishes it (its warm-up or live curve),
        not a round's time: what a target step costs without a call around it."""
        return self.verify_curve.measured[0] if self.verify_curve is not None else self.verify(0)

    def decode_token_ms(self) -> float:
        """What a token costs decoding in chunks, as target-only does: the Decode calls' slope
        once calls of different lengths have told it from their fixed part, never above the
        published one-row forward (which a line of one-token calls alone cannot undercut)."""
        _, per_token = self.decode_calls.coefficients()
        return min(self.forward_ms(), per_token) if per_token > 0 else self.forward_ms()

    def call_overhead_ms(self) -> float:
        """What a verifier call costs beyond its forwards (RPC, sampling, the round's
        bookkeeping): the fixed part of the Decode calls' line, and never less than
        the calls' measured RPC."""
        return max(self.decode_calls.coefficients()[0], self.call_rpc_ms, 0.0)

    def marginal_verify_ms(self, gamma: int, calls: float = 1.0) -> float:
        """What verifying one more draft token costs on top of γ of them."""
        return max(self.verify_ms(gamma + 1, calls) - self.verify_ms(gamma, calls), 0.0)


def decode_line(verify_ms: Sequence[float]) -> EwLinearFit:
    """A Decode call's cost before any is measured: a 1-row forward a token (100 ms
    without a curve) and a twentieth of one for the call, that split the fit's weak
    prior until calls of different lengths tell them apart."""
    step = float(verify_ms[0]) if verify_ms else 100.0
    return EwLinearFit(default=(0.05 * step, step), a_over_b=0.05)


def prefill_line(draft_ms: Sequence[float], ms_per_token: float) -> EwLinearFit | None:
    """The drafter's prefill before any is measured: a 1-row forward for the call
    (without a curve, 20 tokens' worth) plus the published ms per token; fitted with
    that split as its weak prior (prompt lengths vary, and a prefill is not quite a
    line: a prior as strong as the draft line's would bend the fit). None: no model
    prefill."""
    if ms_per_token <= 0:
        return None
    fixed = float(draft_ms[0]) if draft_ms else 20.0 * ms_per_token
    return EwLinearFit(default=(fixed, float(ms_per_token)), a_over_b=fixed / ms_per_token, decay=0.95, weight=0.01)


RPC_RATE = 0.1     # the EWMA's weight for a Decode call's RPC time, after its first ten calls
LOAD_ALONE = 1.05  # calls per forward at or below which a call counts as having run alone
