"""The γ controller on the services' measured cost curves: how many rows a round
can afford, load, the drafter's prefill, n-gram lookups priced at their verify rows,
and decode calls. (test_gamma.py: the controller on synthetic acceptance streams.)"""
from __future__ import annotations

import copy
import random

import pytest

from coordinator.gamma import Acceptance, ControllerState, CostModel, GammaController, GammaPriors, RowCurve, \
    match_bucket, prefill_line
from coordinator.rounds import RoundRecord
from coordinator.service import curve_gamma_max
from specdec.spec.proposers import MODEL
from specdec.spec.proposers.ngram import NGRAM
from specdec.spec.types import Lookup, runs
from specdec.spec.sampling import SamplingConfig

GAMMA_MAX = 8


def round_record(gamma: int, accepted: int, draft_ms: float, verify_ms: float) -> RoundRecord:
    return RoundRecord(0, gamma, gamma, accepted, accepted == gamma, draft_ms, verify_ms)


# --- cost curves (the services' measured forward time by rows) -----------------


INT4_CURVE = [38, 42, 47, 52, 96, 100, 105, 110, 150, 155, 160, 165, 205, 210, 215, 220, 260]  # 4 rows a pass
BF16_CURVE = [150 + 2 * i for i in range(17)]                                                   # nearly flat
FP32_CURVE = [100 * (1 + i) for i in range(17)]                                                 # every row costs


def test_a_row_curve_learns_each_row_count_and_shifts_the_unseen_ones():
    curve = RowCurve([10.0, 11.0, 20.0])
    # Past the measured rows: the mean slope of the upper half, (20 - 10) / 2 a row.
    assert curve(2) == 11.0 and curve(5) == 20.0 + 2 * 5.0
    curve.observe(2, 14.0)                                          # 3 ms of RPC the curve did not see
    assert curve(2) == 14.0 and curve(1) == 13.0 and curve(3) == 23.0
    for _ in range(50):
        curve.observe(2, 12.0)
    assert abs(curve(2) - 12.0) < 0.1


def controller_on(curve: list[float], draft_ms_per_token: float, alpha: float, rounds: int = 120,
                  gamma_max: int = 16, seed: int = 0) -> GammaController:
    """A controller started from the curves, fed rounds whose times follow them."""
    state = ControllerState(cost=CostModel.from_curves([draft_ms_per_token], curve))
    controller = GammaController(gamma_max, state)
    rng = random.Random(seed)
    for _ in range(rounds):
        g = controller.next_gamma()
        accepted = 0
        while accepted < g and rng.random() < alpha:
            accepted += 1
        verify = RowCurve(curve)(g + 1) + 1.0
        controller.observe(round_record(g, accepted, draft_ms_per_token * g, verify))
    return controller


def test_where_the_fifth_row_costs_twice_the_fourth_gamma_stays_at_most_3():
    controller = controller_on(INT4_CURVE, draft_ms_per_token=8.0, alpha=0.8)
    assert 1 <= controller.best() <= 3


def test_where_rows_are_nearly_free_drafts_run_past_eight():
    controller = controller_on(BF16_CURVE, draft_ms_per_token=6.0, alpha=0.9)
    assert controller.best() > 8


def test_where_every_row_costs_a_forward_drafting_is_off():
    controller = controller_on(FP32_CURVE, draft_ms_per_token=50.0, alpha=0.5)
    assert controller.best() == 0


def test_the_gamma_bound_comes_from_the_measured_rows():
    assert curve_gamma_max(INT4_CURVE) == 16 and curve_gamma_max([]) == 8 and curve_gamma_max([5.0]) == 1


# The default pair at int4 as measured: a draft step about half a target step,
# drafts accepted 0.8 of the time, the drafter's prefill 1.2 ms a prompt token.
MEASURED_INT4 = [38.7, 41.5, 47.6, 52.3, 95.9]


def test_a_long_prompt_is_not_drafted_where_drafting_saves_less_than_the_drafters_prefill():
    controller = controller_on(MEASURED_INT4, draft_ms_per_token=22.0, alpha=0.8)
    controller.state.cost.draft_prefill = prefill_line([22.0], 1.2)
    best = max(range(1, 17), key=controller.goodput)
    saving_per_token = controller.state.cost.round_ms(0) - 1e3 / controller.goodput(best)
    assert 0 < saving_per_token < 6  # drafting pays a little here, per token
    assert controller.prefill_pays(prompt_tokens=100, new_tokens=512)
    assert not controller.prefill_pays(prompt_tokens=1500, new_tokens=64)   # rag: 1.8 s to save < 0.4 s
    assert controller.prefill_pays(prompt_tokens=1500, new_tokens=2048)     # ... unless there is much to generate
    assert controller.prefill_pays(prompt_tokens=10, new_tokens=1)          # within a target step: always
    assert not controller.prefill_pays(prompt_tokens=20, new_tokens=1)      # 46 ms: past it


def test_where_drafting_saves_much_a_long_prompt_is_drafted():
    controller = controller_on(BF16_CURVE, draft_ms_per_token=6.0, alpha=0.9)
    controller.state.cost.draft_prefill = prefill_line([6.0], 1.2)
    assert controller.prefill_pays(prompt_tokens=1500, new_tokens=64)


def test_the_drafters_prefill_cost_starts_from_its_info_and_follows_measured_prefills():
    cost = CostModel.from_curves([20.0], MEASURED_INT4, draft_prefill_ms_per_token=2.0)
    assert cost.draft_prefill_ms(100) == 220.0         # a 1-row forward for the call, 2 ms a token
    cost.observe_draft_prefill(100, 100.0)             # the first measurement replaces the prior
    assert cost.draft_prefill_ms(100) == pytest.approx(100.0, rel=0.02)
    for _ in range(40):
        cost.observe_draft_prefill(1000, 1500.0)
    assert cost.draft_prefill_ms(1000) == pytest.approx(1500.0, rel=0.01)
    assert CostModel().draft_prefill_ms(1000) == 0.0   # unknown (an n-gram proposer): free
    assert CostModel.from_curves([20.0], MEASURED_INT4).draft_prefill_ms(1000) == 0.0


def test_a_short_prompts_drafter_prefill_is_priced_with_the_calls_fixed_cost():
    # As measured on the AVX-512 EPYC: StartSession's time by prompt tokens, a fixed
    # ~90 ms (RPC, session, first token) and ~4 ms a token; the published per-token
    # figure (2.8) alone priced a 16-token prompt at a third of its cost.
    measured = {16: 154.0, 43: 262.0, 76: 388.0, 127: 610.0}
    cost = CostModel.from_curves([25.0], MEASURED_INT4, draft_prefill_ms_per_token=2.8)
    for _ in range(5):
        for tokens, ms in measured.items():
            cost.observe_draft_prefill(tokens, ms)
    for tokens, ms in measured.items():
        assert cost.draft_prefill_ms(tokens) == pytest.approx(ms, rel=0.05)
    # A per-token price fitted to the same prefills misses the short ones by far more.
    per_token = sum(measured.values()) / sum(measured)
    assert abs(per_token * 16 - 154.0) / 154.0 > 0.4


# The measured int4 1.5B and INT8 0.5B curves of this machine (ms for 1..17 rows).
LOADED_INT4 = [123.2, 151.5, 212.0, 214.3, 364.7, 376.6, 399.9, 370.9, 579.3, 598.0, 609.9, 556.5, 755.3, 783.2,
               785.5, 795.1, 843.0]
LOADED_DRAFT = [58.8, 63.8, 67.9, 73.1, 91.6, 69.2, 76.3, 71.7, 89.4, 90.9, 98.5, 120.1, 146.3, 151.8, 138.1,
                157.9, 142.1]


def test_speculation_turns_off_under_load_and_back_on_when_it_falls():
    from coordinator.gamma import ServiceLoad
    now = [0.0]
    load = ServiceLoad(clock=lambda: now[0])
    state = ControllerState(cost=CostModel.from_curves(LOADED_DRAFT, LOADED_INT4))
    state.acceptance = Acceptance(alpha=0.8, count=50)
    controller = GammaController(8, state, load=load)
    assert controller.best() >= 1                          # alone: drafting pays (α 0.8, a draft step 0.48 of a target's)
    for _ in range(8):
        load.enter()
    assert controller.calls() == 8 and controller.best() == 0   # 8 requests: their rejected rows cost the others
    assert not controller.prefill_pays(20, 64)             # and a new request does not start the drafter
    for _ in range(7):
        load.leave()
    assert controller.best() >= 1                          # alone again
    # Another coordinator's load, as the verifier reports it, fades once its replies stop.
    from specdec.spec.types import BatchLoad
    for _ in range(20):
        load.observe(BatchLoad(forwards=1, mean_rows=8.0, mean_calls=8.0))
    assert controller.calls() > 7 and controller.best() == 0
    now[0] += 20.0
    assert controller.calls() < 1.01 and controller.best() >= 1


def test_a_round_that_shared_its_forwards_teaches_the_cost_model_nothing():
    cost = CostModel.from_curves([20.0], [40.0, 42.0])
    before = cost.verify_ms(1)
    cost.observe(1, 500.0, 900.0, draft_alone=False, verify_alone=False)   # a batch's time, not this call's
    assert cost.verify_ms(1) == before and cost.draft(1) == pytest.approx(22.0 + 1.0, rel=0.2)
    assert cost.verify_ms(1, calls=4) == pytest.approx(RowCurve([40.0, 42.0]).forward_ms(8) / 4)


# --- free drafts: n-gram lookups priced at their verify rows only ------------

def ngram(token_ids=(), match_length=0) -> list[Lookup]:
    """A request's candidates: the n-gram source's, if it found any."""
    return [Lookup(tuple(token_ids), match_length, NGRAM)] if token_ids else []


def lookup_round(ngram: int, accepted: int, match: int, model: int = 0, verify_ms: float = 40.0) -> RoundRecord:
    return RoundRecord(0, ngram + model, ngram + model, accepted, accepted == ngram + model, 0.0, verify_ms,
                       sources=runs((NGRAM, ngram), (MODEL, model)), lookup_match=match)


def test_a_long_lookup_is_drafted_where_the_model_barely_pays():
    controller = controller_on(MEASURED_INT4, draft_ms_per_token=22.0, alpha=0.8)
    for _ in range(30):  # long matches copy: accepted
        controller.observe(lookup_round(4, 4, match=12))
    plan = controller.plan(ngram((5, 6, 7, 8, 9), 12), limit=100)
    assert plan[NGRAM] >= 3 and plan[MODEL] == 0, plan
    # Free drafts are worth more than the model's: a lookup of one match alone is not.
    assert controller.plan(ngram((5,), 1), limit=100)[NGRAM] == 0


def test_where_rows_are_nearly_free_the_model_drafts_after_a_lookup_in_the_same_round():
    controller = controller_on(BF16_CURVE, draft_ms_per_token=6.0, alpha=0.9)
    for _ in range(30):
        controller.observe(lookup_round(2, 2, match=6))
    plan = controller.plan(ngram((5, 6), 6), limit=100)
    assert plan[NGRAM] == 2 and plan[MODEL] > 0, plan
    assert plan.sources[0][0] == NGRAM  # the lookup's tokens come first


def test_a_lookup_bucket_judged_bad_is_skipped_but_tried_now_and_then():
    controller = controller_on(MEASURED_INT4, draft_ms_per_token=22.0, alpha=0.8)
    for _ in range(40):
        controller.observe(lookup_round(2, 0, match=1))
    plans = []
    for _ in range(32):
        plans.append(controller.plan(ngram((5, 6, 7), 1), limit=100))
        controller.begin(plans[-1])
    taken = [p for p in plans if p[NGRAM]]
    assert len(taken) == 2 and all(p[NGRAM] <= controller.probe_gamma and p[MODEL] == 0 and p.lookup_probe
                                   for p in taken)


def test_planning_decides_only_and_begin_moves_the_exploration_state():
    controller = controller_on(MEASURED_INT4, draft_ms_per_token=22.0, alpha=0.8)
    for _ in range(40):
        controller.observe(lookup_round(2, 0, match=1))
    controller.gamma, controller.rounds_at_zero = 0, controller.probe_every   # a model probe is due
    skips = dict(controller.lookup_skips)
    first = controller.plan(ngram((5, 6, 7), 1), limit=100)
    assert controller.plan(ngram((5, 6, 7), 1), limit=100) == first   # the same state, the same plan
    assert controller.lookup_skips == skips and not controller.probing
    (key,) = first.considered
    assert first[MODEL] == controller.probe_gamma and first.probe
    controller.begin(first)
    assert controller.probing and controller.lookup_skips[key] == skips.get(key, 0) + 1


def test_each_source_learns_only_from_the_drafts_it_made_and_the_verifier_judged():
    controller = GammaController(GAMMA_MAX)
    model_before = controller.state.acceptance.alpha
    lookup_before = controller.state.lookups(NGRAM)[match_bucket(6)].alpha
    controller.observe(lookup_round(2, 1, match=6, model=3))  # the second lookup token rejected: the model's unjudged
    assert controller.state.lookups(NGRAM)[match_bucket(6)].alpha < lookup_before
    assert controller.state.acceptance.alpha == model_before
    controller.observe(lookup_round(2, 2, match=6, model=3))  # both kept, then the model's first rejected
    assert controller.state.acceptance.alpha < model_before
    # A lookup's draft costs no draft step: the draft line learns from rounds with model tokens only.
    fresh = GammaController(GAMMA_MAX)
    fresh.observe(lookup_round(3, 3, match=6))
    assert fresh.state.cost.draft.sw == 0 and fresh.state.cost.verify.sw == 1


def test_without_a_model_only_lookups_draft():
    controller = controller_on(BF16_CURVE, draft_ms_per_token=6.0, alpha=0.9)
    controller.without_model()
    assert controller.best() == 0
    assert controller.plan(ngram(), limit=100).drafted == 0
    assert controller.plan(ngram((5, 6), 9), limit=100)[MODEL] == 0


def steps_after(controller: GammaController, round: RoundRecord, times: int = 60) -> int:
    """What a round that drafts nothing decodes, after `times` such lookup rounds."""
    for _ in range(times):
        controller.observe(round)
    controller.rounds_at_zero = 0
    return controller.decode_steps(16)


def decode_calls(cost: CostModel, overhead_ms: float, step_ms: float, times: int = 20) -> None:
    """Decode calls of 1 and of 16 tokens that cost `overhead_ms` a call beyond their steps."""
    for _ in range(times):
        cost.observe_decode(1, overhead_ms + step_ms)
        cost.observe_decode(16, overhead_ms + 16 * step_ms)


def test_a_calls_overhead_is_told_from_decode_calls_of_different_lengths():
    cost = CostModel.from_curves([22.0], MEASURED_INT4)
    assert cost.call_overhead_ms() == pytest.approx(0.05 * MEASURED_INT4[0], rel=0.05)  # before any call
    decode_calls(cost, 3.0, 36.0)
    assert cost.call_overhead_ms() == pytest.approx(3.0, abs=0.3)
    # A curve measured high at warm-up (a busy neighbour) does not make calls look free.
    high = CostModel.from_curves([22.0], [60.0, 70.0])
    decode_calls(high, 3.0, 36.0)
    assert high.call_overhead_ms() == pytest.approx(3.0, abs=0.3)
    # Calls of one length alone cannot split a from b: the prior's share of the call.
    ones = CostModel.from_curves([22.0], [40.0])
    for _ in range(40):
        ones.observe_decode(1, 40.0)
    assert 0 < ones.call_overhead_ms() < 0.1 * 40.0
    frozen = CostModel.from_curves([22.0], [40.0])
    frozen.frozen = True
    decode_calls(frozen, 10.0, 30.0)
    assert frozen.decode_calls.sw == 0


def test_with_nothing_drafted_one_token_is_decoded_where_lookups_pay_for_the_call():
    controller = GammaController(16, ControllerState(cost=CostModel.from_curves([22.0], MEASURED_INT4)))
    decode_calls(controller.state.cost, 4.0, MEASURED_INT4[0])  # ms a call costs beyond its forward
    controller.gamma, controller.rounds_at_zero = 0, 0
    assert controller.decode_steps(16) == 1      # optimistic until lookups are measured
    without = GammaController(16, copy.deepcopy(controller.state), free_sources=())
    without.gamma, without.rounds_at_zero = 0, 0
    assert without.decode_steps(16) == 8                        # no free sources: to the next probe in one call
    # Lookups that keep nothing, then lookups that keep a token a round.
    assert steps_after(controller, lookup_round(1, 0, match=1, verify_ms=MEASURED_INT4[1] + 4.0)) == 8
    assert steps_after(controller, lookup_round(2, 1, match=6, verify_ms=MEASURED_INT4[2] + 4.0)) == 1


def test_lookups_whose_rows_cost_what_they_keep_do_not_make_rounds_decode_one_token():
    # Every row costs a step (a kernel whose cost grows with the rows): a lookup of 2 tokens
    # keeping 1 costs as much verify time as it saves, so decoding a token a round for the
    # next lookup only adds calls.
    controller = GammaController(16, ControllerState(cost=CostModel.from_curves([22.0], FP32_CURVE)))
    decode_calls(controller.state.cost, 4.0, FP32_CURVE[0])
    controller.gamma, controller.rounds_at_zero = 0, 0
    # A whole chunk: on these curves the model cannot pay at any acceptance, so no probe is
    # coming to stop for.
    assert steps_after(controller, lookup_round(2, 1, match=6, verify_ms=FP32_CURVE[2] + 4.0)) == 16
    # The same lookups keeping both tokens pay.
    assert steps_after(controller, lookup_round(2, 2, match=6, verify_ms=FP32_CURVE[2] + 4.0)) == 1


def test_rounds_without_lookups_end_decoding_a_token_a_call_and_the_next_request_starts_there():
    priors = GammaPriors(cost=CostModel.from_curves([22.0], MEASURED_INT4))
    decode_calls(priors.cost, 2.0, MEASURED_INT4[0])
    first = GammaController(16, priors.start(SamplingConfig()))
    first.gamma, first.rounds_at_zero = 0, 0
    assert first.decode_steps(16) == 1             # optimistic: a lookup may come next token
    nothing = RoundRecord(0, 0, 0, 0, False, 0.0, MEASURED_INT4[0] + 2.0)
    calls = 0
    while first.decode_steps(16) == 1:
        first.observe(nothing)
        first.rounds_at_zero, calls = 0, calls + 1
    assert 10 < calls < 60                                         # a token a call while the yield lasts
    priors.finish(SamplingConfig(), first.state)
    second = GammaController(16, priors.start(SamplingConfig()))
    second.gamma, second.rounds_at_zero = 0, 0
    assert second.decode_steps(16) > 1             # what the first learned, the second starts from
    assert GammaController(16, priors.start(SamplingConfig(temperature=0.7))).state.lookup_yield == {}  # per regime
    # A lookup that keeps its tokens brings a token a call back.
    second.observe(lookup_round(4, 4, match=8, verify_ms=MEASURED_INT4[4] + 2.0))
    assert second.decode_steps(16) == 1


def test_plans_follow_the_curves_the_services_publish_again():
    priors = GammaPriors(cost=CostModel.from_curves([80.0], [160.0, 164.0, 168.0], 8.0))  # a busy warm-up
    running = priors.start(SamplingConfig())
    priors.follow(draft_ms=[20.0], verify_ms=[40.0, 41.0, 42.0], draft_prefill_ms_per_token=2.0)
    fresh = priors.start(SamplingConfig())
    assert fresh.cost.verify_ms(0) == pytest.approx(40.0) and fresh.cost.draft(1) == pytest.approx(22.0 * 1.0, rel=0.1)
    assert fresh.cost.draft_prefill_ms(100) == pytest.approx(20.0 + 200.0)
    # A request that started before, ending now, does not put the old curve back.
    priors.finish(SamplingConfig(), running)
    assert priors.start(SamplingConfig()).cost.verify_ms(1) == pytest.approx(41.0)
    # What rounds measured stays, on the new curve: a row count seen keeps what its rounds took
    # over its published forward (47 against 42), one not seen the offset the seen ones show.
    cost = CostModel.from_curves([20.0], [40.0, 42.0])
    cost.observe(1, 20.0, 47.0)   # γ = 1: 2 rows, 47 ms measured
    assert cost.verify_ms(1) == pytest.approx(47.0) and cost.verify_ms(0) == pytest.approx(45.0)
    cost.follow(verify_ms=[30.0, 31.0])
    assert cost.verify_ms(1) == pytest.approx(31.0 * 47.0 / 42.0) and cost.verify_curve.measured == [30.0, 31.0]
    assert cost.verify_ms(0) == pytest.approx(35.0)
    # Pinned (frozen) costs never move: tests and policy comparisons plan on what they were given.
    frozen = CostModel.from_curves([20.0], [40.0, 42.0])
    frozen.frozen = True
    frozen.follow(draft_ms=[5.0], verify_ms=[10.0, 11.0])
    assert frozen.verify_ms(0) == 40.0 and frozen.draft_curve.measured == [20.0]


def test_now_and_then_a_request_refused_for_its_prefill_drafts_all_the_same_but_never_under_load():
    # A draft cost measured high once (a warm-up on a slow start) keeps every request off
    # the draft model, and only requests that draft measure it again: now and then a short one does.
    from coordinator.gamma.priors import PREFILL_PROBE_EVERY, PREFILL_PROBE_MAX_TOKENS
    priors = GammaPriors()
    alone = [priors.probe_prefill(calls=1.0, prompt_tokens=80) for _ in range(3 * PREFILL_PROBE_EVERY)]
    assert alone.count(True) == 3 and alone[PREFILL_PROBE_EVERY - 1] and not any(alone[:PREFILL_PROBE_EVERY - 1])
    many = 3 * PREFILL_PROBE_EVERY
    assert not any(priors.probe_prefill(calls=8.0, prompt_tokens=80) for _ in range(many))    # loaded: never
    assert not any(priors.probe_prefill(calls=1.0, prompt_tokens=PREFILL_PROBE_MAX_TOKENS + 1)  # a long prefill:
                   for _ in range(many))                                                       # never probed


def test_a_one_row_cost_measured_on_a_busy_machine_does_not_keep_the_model_drafting_once_it_is_quiet():
    # The default pair's curves on the 2-core EPYC. For the first seconds of a stack the
    # standbys' imports took the cores: the verifier published forwards twice as slow and
    # requests decoded at 72 ms a token. Once they were done, a request at γ = 1 (2 rows, 62 ms;
    # its draft step 25 ms, 0.83 of them kept: 1.83 tokens in 87 ms) never measured one-row
    # rounds again, and planned on the busy 72 ms against 47 ms a token drafting.
    draft, quiet = [12.8, 22.0, 29.3], [34.9, 59.9, 79.7, 120.7]
    state = ControllerState(cost=CostModel.from_curves(draft, quiet))
    controller = GammaController(3, state)
    state.cost.follow(verify_ms=[2 * ms for ms in quiet])                 # the busy seconds
    for _ in range(6):                                                   # target-only chunks of 16
        controller.observe(RoundRecord(0, 0, 0, 0, False, 0.0, 16 * 72.0, steps=16))
    state.cost.follow(verify_ms=quiet)                                   # quiet again
    rng = random.Random(0)
    for _ in range(40):
        accepted = int(rng.random() < 0.83)
        controller.observe(round_record(1, accepted, 25.0, 62.0))
    one_row = state.cost.verify_ms(0)
    assert one_row == pytest.approx(34.9 * 72.0 / 69.8, rel=0.01)        # the quiet forward and its rounds' share
    assert controller.goodput(0) > controller.goodput(1) and controller.best() == 0
