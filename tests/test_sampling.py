"""The one sampling transform and its validation."""
from __future__ import annotations

import math
import warnings

import pytest
import torch
from scipy import stats

from specdec.rpc.errors import InvalidArgument
from specdec.spec.sampling import SamplingConfig
from specdec.spec.transform import make_generator, sample_at, sample_from, scores_to_probs, transform_logits
from specdec.spec.wire import Truncation, sampling_from_proto, sampling_to_proto
from specdec.spec.draft_probs import (decode_probs, draft_probs_tensor, draw, encode_probs, proposals_for_wire,
                                      round_probs_for_wire)
from specdec.v1 import common_pb2
from tests.conftest import NoHostReads


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=math.nan), "temperature"),
    (dict(temperature=math.inf), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-1), "top_k"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(temperature=1e-39), "below the smallest one taken"),
    (dict(temperature=1e-300), "below the smallest one taken"),
    (dict(temperature=0.7, repetition_penalty=1e-40), "below the smallest one taken"),
    (dict(frequency_penalty=2.5), "frequency_penalty must be in"),
    (dict(presence_penalty=-2.01), "presence_penalty must be in"),
    (dict(presence_penalty=math.nan), "presence_penalty"),
    (dict(penalty_start=-1), "penalty_start"),
])
def test_invalid_configs_are_refused_with_the_field_named(kwargs, message):
    with pytest.raises(InvalidArgument, match=message):
        SamplingConfig(**kwargs).validate()


def test_proto_round_trip_and_unset_means_off():
    config = SamplingConfig(temperature=0.75, top_k=5, top_p=0.875, repetition_penalty=1.25, seed=3,
                            frequency_penalty=0.5, presence_penalty=-1.25, penalty_start=7)  # float32-exact
    assert sampling_from_proto(sampling_to_proto(config)) == config
    assert sampling_from_proto(common_pb2.SamplingParams()) == SamplingConfig()
    with pytest.raises(InvalidArgument, match="top_p"):
        sampling_from_proto(common_pb2.SamplingParams(temperature=1.0, top_p=0.0))


def test_padded_vocab_is_masked():
    logits = torch.zeros(1, 12)
    logits[0, 10] = 100.0  # a padded id the tokenizer does not have
    probs = scores_to_probs(transform_logits(logits, [], [], SamplingConfig(temperature=1.0), vocab_size=10))
    assert probs.shape == (1, 10) and torch.allclose(probs.sum(), torch.tensor(1.0))


def test_top_k_and_top_p_truncate():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    k2 = scores_to_probs(transform_logits(logits, [], [], SamplingConfig(temperature=1.0, top_k=2), 5))
    assert (k2[0, 2:] == 0).all() and (k2[0, :2] > 0).all()
    p = scores_to_probs(transform_logits(logits, [], [], SamplingConfig(temperature=1.0, top_p=0.5), 5))
    assert (p[0] > 0).sum() == 1


def test_rows_see_their_own_history_for_repetition_penalty():
    """Row i of a verify pass must be penalized exactly as the drafter's step i was."""
    torch.manual_seed(0)
    logits = torch.randn(3, 20)
    config = SamplingConfig(temperature=0.8, repetition_penalty=1.5)
    history, drafts = [1, 2, 3], [7, 9]
    batched = transform_logits(logits, history, drafts, config, 20)
    for i in range(3):
        one = transform_logits(logits[i : i + 1], history + drafts[:i], [], config, 20)
        assert torch.equal(batched[i], one[0])
    assert not torch.equal(batched[1], transform_logits(logits[1:2], history, [], config, 20)[0])


def test_drafter_and_verifier_generators_differ_but_are_seeded():
    config = SamplingConfig(temperature=1.0, seed=9)
    a = torch.rand(3, generator=make_generator(config, "drafter"))
    b = torch.rand(3, generator=make_generator(config, "drafter"))
    c = torch.rand(3, generator=make_generator(config, "verifier"))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_wire_probs_are_exactly_what_the_drafter_sampled_from():
    probs = torch.softmax(torch.randn(3, 50), dim=-1)
    sent = round_probs_for_wire(probs)
    received = decode_probs(encode_probs(probs), 3, 50)
    assert torch.equal(sent, received)


@pytest.mark.parametrize("truncation", [Truncation(), Truncation(top_k=12), Truncation(top_p=0.8),
                                        Truncation(top_k=40, top_p=0.9)], ids=["dense", "top_k", "top_p", "both"])
def test_a_draft_is_drawn_on_the_device_from_the_distribution_the_verifier_rebuilds(truncation):
    """`draw` (a drafter's step, no host read) against the verifier's rebuild of what was sent:
    20,000 draws, each with its own uniform, follow the rebuilt distribution; none falls outside
    the support or on a zero; each draw's confidence is its rebuilt probability."""
    probs = torch.softmax(torch.randn(64, generator=torch.Generator().manual_seed(5)) * 2.5, dim=0)
    probs[[3, 17]] = 0.0                              # ids the model gives nothing: never drawn, never sent
    probs /= probs.sum()
    uniforms = torch.rand(20_000, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    with NoHostReads():
        drawn = [draw(probs, truncation, u) for u in uniforms[:50]]
    sizes = [int(d.size) for d in drawn]
    entries = proposals_for_wire([d.support for d in drawn], [d.probs for d in drawn], sizes)
    assert len(set(entries)) == 1                     # one distribution, sent alike each time
    rebuilt = draft_probs_tensor(entries[:1], [int(drawn[0].token)], 64)[0].double()
    for d in drawn:
        assert float(d.confidence) == pytest.approx(float(rebuilt[int(d.token)]), rel=1e-6)
    tokens = torch.tensor([int(draw(probs, truncation, u).token) for u in uniforms])
    counts = torch.bincount(tokens, minlength=64).double()
    support = rebuilt > 0
    assert counts[~support].sum() == 0 and rebuilt[[3, 17]].sum() == 0
    assert stats.chisquare(counts[support], counts.sum() * rebuilt[support] / rebuilt.sum()).pvalue > 1e-3
    if not truncation.off:                            # the support is the most likely ids, as many as asked
        assert support.sum() == sizes[0] < 62 and probs[support].min() >= probs[~support].max()
        # ...and the draws are the cut distribution's, not the full one's
        full = probs[probs > 0].double()
        assert stats.chisquare(counts[probs > 0], 20_000 * full / full.sum()).pvalue < 1e-6


@pytest.mark.parametrize("data, message", [
    (b"\x00" * 10, "bytes"),
    (torch.full((2, 5), float("nan")).half().numpy().tobytes(), "NaN"),
    (torch.full((2, 5), -0.2).half().numpy().tobytes(), "negative"),
    (torch.zeros(2, 5).half().numpy().tobytes(), "row 0 sums to 0; each row must be a probability"),
    (torch.ones(2, 5).half().numpy().tobytes(), "row 0 sums to 5;"),
    (torch.tensor([[0.2] * 5, [0.2, 0.2, 0.2, 0.2, 0.21]]).half().numpy().tobytes(), "row 1 sums to 1.009"),
])
def test_bad_draft_probs_are_refused(data, message):
    """Rows must be distributions: a sum off by more than fp16 rounding is refused."""
    with pytest.raises(InvalidArgument, match=message):
        decode_probs(data, 2, 5)


def test_fp16_rounding_of_a_large_vocabulary_stays_within_the_tolerance():
    generator = torch.Generator().manual_seed(0)
    for scale in (0.5, 4.0, 30.0):  # flat to very peaked: many entries round to zero or subnormals
        logits = torch.randn(4, 151_936, generator=generator) * scale
        probs = torch.softmax(logits, dim=-1)
        received = decode_probs(encode_probs(probs), 4, 151_936)
        assert torch.allclose(received.sum(dim=-1), torch.ones(4), atol=1e-5)


def test_sample_from_draws_the_distribution_and_never_a_zero():
    probs = torch.tensor([0.0, 0.5, 0.0, 0.2, 0.25, 0.05, 0.0])  # zeros first, inside and last
    generator = torch.Generator().manual_seed(3)
    draws = [sample_from(probs * 3.0, generator) for _ in range(20_000)]  # unnormalized is fine
    counts = torch.bincount(torch.tensor(draws), minlength=probs.numel()).double()
    assert counts[probs == 0].sum() == 0
    support = probs > 0
    assert stats.chisquare(counts[support], 20_000 * probs[support].double()).pvalue > 1e-3
    # A lopsided distribution is still sampled, not collapsed to its mode.
    assert stats.chisquare(counts[support], 20_000 * torch.tensor([0.25, 0.25, 0.25, 0.25])).pvalue < 1e-6


def test_sample_from_is_reproducible_for_a_seed_and_finds_a_lone_last_id():
    probs = torch.softmax(torch.randn(151_936, generator=torch.Generator().manual_seed(0)), dim=0)
    first = [sample_from(probs, torch.Generator().manual_seed(7)) for _ in range(2)]
    assert first[0] == first[1]
    last = torch.zeros(10)
    last[-1] = 1e-30  # all the mass on the last id, and a tiny one
    assert all(sample_from(last, torch.Generator().manual_seed(s)) == 9 for s in range(20))


def test_a_point_at_a_rows_total_takes_its_last_id_of_positive_probability():
    # A uniform times the total can round to the total itself: past every id. The row's last
    # id with probability then, not one with none (trailing zeros: a truncated distribution's).
    probs = torch.tensor([[0.2, 0.3, 0.5, 0.0, 0.0], [0.0, 0.6, 0.0, 0.4, 0.0]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # no copy of a non-contiguous operand (torch warns of it once)
        assert sample_at(probs, torch.tensor([1.0, 1.0], dtype=torch.float64)).tolist() == [2, 3]
    assert sample_at(probs, torch.tensor([0.25, 0.7], dtype=torch.float64)).tolist() == [1, 3]


@pytest.mark.parametrize("temperature", [2.0 ** -126, 1e-30, 3e-38])
def test_a_tiny_temperature_gives_the_greedy_limit_not_nan(temperature):
    torch.manual_seed(0)
    logits = torch.randn(3, 50) * 4
    scores = transform_logits(logits, [1, 2], [7, 8], SamplingConfig(temperature=temperature), 50)
    probs = scores_to_probs(scores)
    assert torch.isfinite(probs).all()
    assert torch.equal(probs.argmax(dim=-1), logits.argmax(dim=-1))
    assert torch.allclose(probs.max(dim=-1).values, torch.ones(3))  # one-hot on the argmax


@pytest.mark.parametrize("penalty", [2.0 ** -126, 1e-37, 1e30])
def test_an_extreme_repetition_penalty_stays_a_distribution(penalty):
    torch.manual_seed(1)
    logits = torch.randn(2, 40) * 4
    history = [3, 5, 9]
    config = SamplingConfig(temperature=0.7, repetition_penalty=penalty, top_p=0.9)
    probs = scores_to_probs(transform_logits(logits, history, [11], config, 40))
    assert torch.isfinite(probs).all() and torch.allclose(probs.sum(dim=-1), torch.ones(2))
    if penalty < 1:  # a penalty below 1 favours what was seen: in the limit, the best of those positive
        seen = [t for t in history if logits[0, t] > 0]
        assert int(probs[0].argmax()) == max(seen, key=lambda t: float(logits[0, t]))


def test_every_bit_of_the_seed_counts_and_each_role_draws_its_own_stream():
    def draws(seed: int, role: str) -> list[float]:
        g = make_generator(SamplingConfig(temperature=1.0, seed=seed), role)
        return torch.rand(4, generator=g).tolist()
    assert draws(7, "drafter") == draws(7, "drafter")                 # reproducible
    assert draws(7, "drafter") != draws(7 + 2**32, "drafter")         # the high 32 bits count
    assert draws(7, "drafter") != draws(7 + 2**63, "drafter")
    assert draws(7, "drafter") != draws(7, "verifier")
    assert SamplingConfig(temperature=1.0, seed=2**64 - 1).validate().seed == 2**64 - 1


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_frequency_and_presence_penalties_count_the_output_only(temperature):
    """OpenAI's rule, worked by hand: each id minus 0.5 per time it occurs in the
    output (from penalty_start on) and 0.25 if it occurs at all; the prompt's ids
    (before penalty_start) are not counted, and row i counts the row tokens before it."""
    config = SamplingConfig(temperature=temperature, frequency_penalty=0.5, presence_penalty=0.25, penalty_start=2)
    history, drafts = [3, 3, 1, 2, 2], [4]         # output so far: 1 once, 2 twice; 3 only in the prompt
    scores = transform_logits(torch.zeros(2, 5), history, drafts, config, 5)
    want = torch.tensor([[0.0, -0.75, -1.25, 0.0, 0.0],
                         [0.0, -0.75, -1.25, 0.0, -0.75]])   # row 1 also counts the draft before it
    if temperature:                                  # the sampled path subtracts each row's maximum first
        want = want - want.amax(dim=-1, keepdim=True)
    assert torch.equal(scores, want)
    alone = transform_logits(torch.zeros(1, 5), history + drafts, [], config, 5)
    assert torch.equal(scores[1], alone[0])           # a verify row is the decode step's
