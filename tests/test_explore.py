"""Exploration with a price and a ceiling (coordinator/gamma/explore.py), on pinned
cost curves: no probe of a source its curves say cannot pay at an acceptance this
pair has not ruled out, probes within a request's budget, and probes back by
themselves where the curves change. Through the engine, every request's stats
count the probes it took and their cost."""
from __future__ import annotations

import random

import pytest

import drafter.service
import verifier.service
from coordinator.gamma import Acceptance, ControllerState, CostModel, GammaController, GammaPriors
from coordinator.gamma.bound import describe
from coordinator.gamma.explore import (BUDGET_SHARE, LOOKUP_ROUND, MODEL_ROUND, PREFILL, Exploration, break_even,
                                       upper_acceptance, within_reach)
from specdec.runtime.cost_curve import CostCurve
from specdec.spec.proposers import MODEL
from specdec.spec.proposers.ngram import NGRAM
from specdec.spec.types import Lookup
from tests.conftest import coordinator_stub
from tests.test_end_to_end import generate
from tests.test_gamma import round_record

# A 2-core CPU's shape: every verified row costs half a step, a draft step a third of one: the
# model pays from an acceptance of about 0.89.
CPU_VERIFY = [36.0, 54.0, 72.0, 90.0, 108.0]
CPU_DRAFT = [12.0]
# A GPU's shape: rows nearly free, a draft step a tenth of a target step.
FLAT_VERIFY = [10.0 + 0.05 * i for i in range(17)]
FLAT_DRAFT = [1.0]


def controller(verify=CPU_VERIFY, draft=CPU_DRAFT, alpha=0.8, evidence=200.0, budget_ms=None,
               gamma_max=8) -> GammaController:
    state = ControllerState(cost=CostModel.from_curves(draft, verify), acceptance=Acceptance(alpha=alpha, count=5.0),
                            reach=Acceptance(alpha=alpha, count=evidence))
    return GammaController(gamma_max, state, exploration=Exploration(budget_ms), initial_gamma=0)


def run_at_zero(c: GammaController, rounds: int, alpha: float = 0.8, seed: int = 0) -> list[int]:
    """Rounds of the model alone whose drafts are kept at `alpha`; the γ of each."""
    rng, gammas = random.Random(seed), []
    for _ in range(rounds):
        g = c.next_gamma()
        accepted = 0
        while accepted < g and rng.random() < alpha:
            accepted += 1
        cost = c.state.cost
        c.observe(round_record(g, accepted, cost.draft_ms(g) if g else 0.0, cost.verify_ms(g)))
        gammas.append(g)
    return gammas


def test_the_break_even_acceptance_is_where_some_gamma_first_beats_target_only():
    cost = CostModel.from_curves(CPU_DRAFT, CPU_VERIFY)
    needed = break_even(cost, gamma_max=4)
    # Just above it γ = 1 (the cheapest round) beats a target step, just below nothing does.
    def gain(alpha: float, g: int) -> float:
        tokens = sum(alpha ** i for i in range(g + 1))
        return tokens / (cost.draft_ms(g) + cost.verify_ms(g)) * cost.verify_ms(0)
    assert max(gain(needed + 0.01, g) for g in range(1, 5)) > 1.0 > max(gain(needed - 0.01, g) for g in range(1, 5))
    assert break_even(CostModel.from_curves([200.0], CPU_VERIFY), gamma_max=4) is None   # no acceptance pays
    assert break_even(cost, gamma_max=4, drafts_cost=False) < needed                   # free drafts need less


def test_the_reach_narrows_with_evidence_and_widens_as_it_ages():
    weak, strong = Acceptance(alpha=0.8, count=5.0), Acceptance(alpha=0.8, count=500.0)
    assert upper_acceptance(weak) > 0.9 and upper_acceptance(strong) < 0.84
    assert within_reach(weak, 0.9) and not within_reach(strong, 0.9) and not within_reach(weak, None)
    for _ in range(30):
        strong.age(0.8)
    assert within_reach(strong, 0.9)


def test_where_the_model_cannot_pay_at_the_pairs_acceptance_no_model_round_is_probed():
    c = controller(alpha=0.8)
    needed = break_even(c.state.cost, c.gamma_max)
    assert needed is not None and needed > upper_acceptance(c.state.reach) > 0.8
    assert run_at_zero(c, 200) == [0] * 200 and c.exploration.ledger == {}


def test_where_the_models_acceptance_is_not_known_probes_are_taken_within_the_budget():
    budget = 150.0
    c = controller(alpha=0.8, evidence=3.0, budget_ms=budget)
    gammas = run_at_zero(c, 200, alpha=0.95)
    probes = c.exploration.ledger[MODEL_ROUND]
    assert probes.count >= 1 and sum(g > 0 for g in gammas) >= probes.count
    # Each is charged at what it cost beyond target-only; none starts past the budget.
    assert c.exploration.spent_ms <= budget + c.state.cost.round_ms(c.probe_gamma)


def test_a_spent_budget_stops_the_probes():
    c = controller(alpha=0.8, evidence=3.0, budget_ms=0.0)
    assert run_at_zero(c, 100, alpha=0.95) == [0] * 100 and c.exploration.ledger == {}


def test_where_the_curves_change_probes_come_back_by_themselves():
    c = controller(alpha=0.8, evidence=200.0)
    assert run_at_zero(c, 60) == [0] * 60
    c.state.cost.follow(draft_ms=FLAT_DRAFT, verify_ms=FLAT_VERIFY)   # a quieter machine, or a GPU
    later = run_at_zero(c, 60)
    assert any(g > 0 for g in later[:3 * c.probe_every]) and MODEL_ROUND in c.exploration.ledger
    assert later[-10:].count(0) <= 2, later   # and the model drafts: it pays on these curves


def test_on_flat_curves_the_model_drafts_at_the_pairs_acceptance_and_the_bound_is_the_curves():
    state = ControllerState(cost=CostModel.from_curves(FLAT_DRAFT, FLAT_VERIFY),
                            acceptance=Acceptance(alpha=0.8, count=200.0), reach=Acceptance(alpha=0.8, count=200.0))
    c = GammaController(16, state)
    plan = c.plan([], limit=100)
    assert plan[MODEL] >= 3, plan
    # The bound's ceiling, from the curve alone: γ + 1 rows verified in T(γ + 1) against one in T(1).
    ceiling, gamma = max(((g + 1) * FLAT_VERIFY[0] / FLAT_VERIFY[g], g) for g in range(1, len(FLAT_VERIFY)))
    line = describe(FLAT_VERIFY, FLAT_DRAFT[0])
    assert f"at most {ceiling:.2f}x" in line and f"γ={gamma}:" in line


def test_lookup_probes_need_reach_too():
    c = controller(verify=[36.0, 80.0, 120.0, 160.0, 200.0], alpha=0.8)   # each row dearer than a step
    assert break_even(c.state.cost, c.gamma_max, drafts_cost=False) is None
    plans = []
    for _ in range(40):
        plans.append(c.plan([Lookup((5, 6, 7), 1, NGRAM)], limit=100))
        c.begin(plans[-1])
    assert not any(p.lookup_probe for p in plans) and LOOKUP_ROUND not in c.exploration.ledger


# --- through the services: the probes a request took are in its stats -------------------------------------

SLOW_DRAFT, CHEAP_TARGET = [200.0, 210.0, 220.0, 230.0, 240.0], [20.0, 21.0, 22.0, 23.0, 24.0, 25.0, 26.0, 27.0, 28.0]


@pytest.fixture(scope="module")
def unpaying(tiny_draft, tiny_target):
    """Services whose curves say the draft model pays at no acceptance (a step dearer than ten target steps)."""
    servers = [drafter.service.serve(tiny_draft, cost_curve=CostCurve(SLOW_DRAFT, 50.0)),
               verifier.service.serve(tiny_target, cost_curve=CostCurve(CHEAP_TARGET, 2.0))]
    try:
        with coordinator_stub(drafter=f"127.0.0.1:{servers[0].port}", verifier=f"127.0.0.1:{servers[1].port}",
                              learn_costs=False) as stub:
            yield stub
    finally:
        for server in servers:
            server.stop(0)


def test_where_the_model_cannot_pay_no_request_probes_the_drafters_prefill(unpaying):
    # Short prompts, run alone: one in four of them probed the drafter's prefill before.
    for i in range(8):
        response = generate(unpaying, f"The weather today is sunny {i}", speculate=True, gamma=0, max_new_tokens=24)
        kinds = {p.kind for p in response.stats.probes}
        assert PREFILL not in kinds and MODEL_ROUND not in kinds, response.stats
        assert response.stats.fallback and "model" not in {s.source for s in response.stats.draft_sources}


def test_a_long_prompts_probes_stay_within_its_budget(unpaying):
    prompt = " ".join(f"item {i} costs {i * 3} coins;" for i in range(45))   # several hundred tokens
    response = generate(unpaying, prompt, speculate=True, gamma=0, max_new_tokens=48)
    budget = BUDGET_SHARE * 47 * CHEAP_TARGET[0]
    assert sum(p.ms for p in response.stats.probes) <= budget + CHEAP_TARGET[4]
    assert PREFILL not in {p.kind for p in response.stats.probes}


def test_a_priors_reach_keeps_all_of_the_regimes_evidence():
    from specdec.spec.sampling import SamplingConfig
    priors, greedy = GammaPriors(), SamplingConfig(temperature=0.0).validate()
    state = priors.start(greedy)
    for _ in range(300):
        state.acceptance.observe(1, 0)
    priors.finish(greedy, state)
    later = priors.start(greedy)
    assert later.acceptance.count <= priors.prior_weight < later.reach.count   # planning leans on its own rounds
    assert upper_acceptance(later.reach) < 0.2                                 # the reach does not forget


def test_a_token_a_call_for_lookups_that_keep_nothing_is_charged_until_the_budget_is_spent():
    # A lookups-only request whose history never matches: each one-token Decode call is a
    # wager on the next lookup, charged what it took beyond the verifier's own 36 ms step
    # (5 ms here, where the Decode line still prices a call at a twentieth of a step) until
    # the budget (4 such calls) is spent; then the round decodes its whole chunk in one
    # call, a model probe neither possible (no model) nor waited for.
    from coordinator.gamma.explore import LOOKUP_WAIT
    from coordinator.rounds import RoundRecord

    c = controller(budget_ms=4 * 5.0 + 0.1)
    c.without_model()
    assert c.state.cost.call_overhead_ms() == pytest.approx(1.8)
    steps = []
    for _ in range(8):
        steps.append(c.decode_steps(16))
        c.observe(RoundRecord(0, 0, 0, 0, False, 0.0, 36.0 * steps[-1] + 5.0, steps=steps[-1]))  # a call: 5 ms
    assert steps == [1, 1, 1, 1, 16, 16, 16, 16], steps
    assert c.exploration.ledger[LOOKUP_WAIT].count == 4
    assert c.exploration.ledger[LOOKUP_WAIT].ms == pytest.approx(20.0)
    # A lookup that kept its tokens pays for the next call a token: nothing charged.
    c.observe(RoundRecord(0, 2, 2, 2, True, 0.0, 40.0, sources=((NGRAM, 2),), lookup_match=3))
    assert c.decode_steps(16) == 1 and c.exploration.ledger[LOOKUP_WAIT].count == 4
    # Without lookups in the request nothing is wagered, budget or not.
    without = controller(budget_ms=None)
    without.free_sources = ()
    assert without.decode_steps(16) == 16


def test_a_token_a_call_is_charged_against_a_chunks_token_once_chunks_have_been_timed():
    # On a 2-core CPU a one-token Decode call took some 40 ms where a 16-token chunk took 28 a
    # token and the published forward said 31: charged against the forward, each call cost
    # 9 ms on the ledger and 12 in fact, so a request spent past its budget on them.
    from coordinator.gamma.explore import LOOKUP_WAIT
    from coordinator.rounds import RoundRecord

    c = controller(verify=[31.0, 51.0, 65.0], budget_ms=1e9)
    c.without_model()
    for _ in range(20):                     # earlier requests' calls: chunks and single tokens
        c.state.cost.observe_decode(16, 2.0 + 16 * 28.0)
        c.state.cost.observe_decode(1, 40.0)
    assert c.state.cost.decode_token_ms() == pytest.approx(28.0, abs=1.0)
    assert c.decode_steps(16) == 1
    c.observe(RoundRecord(0, 0, 0, 0, False, 0.0, 40.0, steps=1))
    assert c.exploration.ledger[LOOKUP_WAIT].ms == pytest.approx(12.0, abs=1.0)
    # Before any chunk, the forward as published bounds what a token is taken to cost.
    fresh = CostModel.from_curves([8.0], [31.0, 51.0])
    for _ in range(20):
        fresh.observe_decode(1, 40.0)
    assert fresh.decode_token_ms() == pytest.approx(31.0)


def test_a_token_a_call_is_never_free_where_the_decode_line_puts_a_calls_cost_at_0():
    # On a noisy 2-core CPU the Decode calls' line can fit a fixed part under 0 (one-token
    # calls measured faster a token than chunks): a call a token then looked free whatever the
    # lookups kept, and was charged nothing, so requests whose lookups never matched decoded a
    # token a call to the end. Each call still spends its RPC outside the verifier (1.5 ms
    # here): priced at that, the wager ends once the lookups' fading yield no longer pays for
    # it, and each call is charged at least its RPC.
    from coordinator.gamma.explore import LOOKUP_WAIT
    from coordinator.rounds import RoundRecord

    def call_ms(steps: int) -> float:
        return 35.0 if steps == 1 else 36.0 * steps

    c = controller(verify=[36.0, 56.0, 70.0], budget_ms=1e9)
    c.without_model()
    for _ in range(20):
        c.state.cost.observe_decode(16, call_ms(16), rpc_ms=1.5)
        c.state.cost.observe_decode(1, call_ms(1), rpc_ms=1.5)
    assert c.state.cost.decode_calls.coefficients()[0] < 0
    assert c.state.cost.call_overhead_ms() == pytest.approx(1.5)
    steps = []
    for _ in range(60):    # lookups that find nothing: their yield fades from its prior, 0.9 a round
        steps.append(c.decode_steps(16))
        c.observe(RoundRecord(0, 0, 0, 0, False, 0.0, call_ms(steps[-1]), steps=steps[-1], rpc_ms=1.5))
    waits = c.exploration.ledger[LOOKUP_WAIT]
    # While the yield (0.9^n) times a step (35-36 ms) is above the call's 1.5 ms: 30 rounds or so.
    n = steps.index(16) if 16 in steps else len(steps)
    assert 25 <= n <= 35 and steps == [1] * n + [16] * (len(steps) - n), steps
    assert waits.count == n and waits.ms == pytest.approx(n * 1.5)


def test_a_seeded_sampled_requests_fixed_gamma_is_0_where_the_start_curves_say_drafting_cannot_pay():
    # Chosen once from the curves the services published at start, at the prior acceptance
    # (0.6): on a 2-core CPU's shape the model pays only from about 0.89, so seeded samples
    # decode target-only; where rows are nearly free they draft, up to 4.
    from coordinator.gamma.bound import best_speedup
    from coordinator.service import seeded_gamma
    assert seeded_gamma(CPU_VERIFY, CPU_DRAFT, 8) == 0
    flat = seeded_gamma(FLAT_VERIFY, FLAT_DRAFT, 8)
    assert flat == best_speedup(FLAT_VERIFY, FLAT_DRAFT[0], 0.6, 4)[1] and 1 <= flat <= 4
    assert seeded_gamma(FLAT_VERIFY, FLAT_DRAFT, 2) <= 2          # never past what the proposer drafts
    assert seeded_gamma([], [], 8) == 4 and seeded_gamma(CPU_VERIFY, [], 3) == 3   # no curves: as before
