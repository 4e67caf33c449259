"""Expected output lengths (coordinator/gamma/lengths.py): what a request's drafter
prefill and probes are priced against, learned from the requests that finished
before it; and, through the services, the price a request was given in its stats."""
from __future__ import annotations

from coordinator.gamma import Acceptance, ControllerState, CostModel, GammaController
from coordinator.gamma.explore import Exploration
from coordinator.gamma.lengths import WINDOW, OutputLengths
from specdec.v1 import common_pb2, coordinator_pb2 as pb


def test_with_no_history_a_request_is_expected_to_run_to_its_limit():
    assert OutputLengths().expected(63) == 63


def test_short_answers_lower_the_expectation_and_requests_cut_by_their_limit_do_not():
    lengths = OutputLengths()
    for _ in range(4):
        lengths.observe(20, ended=False)   # cut at a limit of 20: they might have gone on
    assert lengths.expected(63) == 63
    lengths.observe(6, ended=True)
    lengths.observe(14, ended=True)
    assert 14 < lengths.expected(63) < 63
    assert lengths.expected(5) == 5        # answers of 6 and 14 run past a new limit of 5: the limit is all they cost
    assert lengths.expected(0) == 0


def test_the_window_follows_the_workload():
    lengths = OutputLengths()
    for _ in range(WINDOW):
        lengths.observe(3, ended=True)
    short = lengths.expected(63)
    for _ in range(WINDOW):
        lengths.observe(63, ended=True)
    assert short < 10 and lengths.expected(63) == 63


def test_a_drafter_prefill_probe_affordable_at_the_limit_is_refused_for_a_request_expected_to_be_short():
    # The dev half's qa at 1e3fc2d: a 180 ms drafter prefill probe fits 5% of 63 tokens at a 63 ms
    # step (198 ms), and a 7-token answer paid it. Priced on recent lengths, it does not fit.
    cost = CostModel.from_curves([20.0], [63.0, 95.0], draft_prefill_ms_per_token=1.6)
    lengths = OutputLengths()
    for tokens in (6, 14, 63, 63):
        lengths.observe(tokens, ended=tokens < 63)

    def allowed(new_tokens: float) -> bool:
        state = ControllerState(cost=cost, acceptance=Acceptance(alpha=0.8, count=1.0),
                                reach=Acceptance(alpha=0.8, count=1.0))
        controller = GammaController(4, state, exploration=Exploration.for_request(cost, new_tokens, {}))
        return controller.prefill_probe_allowed(100)

    assert cost.draft_prefill_ms(100) > 150
    assert allowed(63) and not allowed(lengths.expected(63))


def test_a_requests_stats_say_what_it_was_priced_against(tiny_draft, tiny_target):
    from tests.conftest import pair_stub
    prompt = "The weather today is sunny and"

    def generate(stub, stop=()):
        return stub.Generate(pb.GenerateRequest(
            prompt=prompt, max_new_tokens=24, stop=list(stop), sampling=common_pb2.SamplingParams(temperature=0.0),
            speculation=pb.Speculation(enabled=True, gamma=0)), timeout=60)

    with pair_stub(tiny_draft, tiny_target) as stub:
        first = generate(stub)
        assert first.finish_reason == pb.FINISH_REASON_LENGTH and first.stats.expected_output_tokens == 23
        assert generate(stub).stats.expected_output_tokens == 23   # a request its limit cut lowers nothing
        stop = first.text[len(first.text) // 4:][:4]
        short = [generate(stub, stop=[stop]) for _ in range(3)]
        assert all(r.finish_reason == pb.FINISH_REASON_STOP and len(r.token_ids) < 20 for r in short)
        expected = [r.stats.expected_output_tokens for r in short]
        assert expected[0] == 23 and expected[0] > expected[1] > expected[2]
