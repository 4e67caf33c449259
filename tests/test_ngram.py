"""N-gram lookups: what followed the latest earlier occurrence of the context's
suffix, in the request's own tokens and in recent outputs; and the lookups alone
as a coordinator's proposer, lossless with no change to the verifier."""
from __future__ import annotations

import pytest

from specdec.spec.proposers.ngram import MAX_MATCH, NgramIndex, RecentOutputs
from specdec.v1 import common_pb2, coordinator_pb2
from tests.conftest import coordinator_stub, pinned_services
from tests.test_end_to_end import PROMPTS, assert_greedy_equal, generate


def test_proposes_what_followed_the_latest_longest_match():
    index = NgramIndex([1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3])
    found = index.match(index.tokens, 3)
    # "2 3" last occurred before "7 8 5"; "1 2 3" would be longer but does not end the context.
    assert found.token_ids == (7, 8, 5) and found.match_length == 2
    index.extend([7])  # now "2 3 7" ends it: the earlier "3 7" continues with 8
    found = index.match(index.tokens, 2)
    assert found.token_ids == (8, 5) and found.match_length == 3


def test_a_context_never_matches_its_own_suffix():
    index = NgramIndex([4, 5, 6])
    assert index.match(index.tokens, 4).token_ids == ()
    index.extend([4, 5])
    assert index.match(index.tokens, 4).token_ids == (6, 4, 5)


def test_the_match_length_is_measured_past_the_longest_ngram_up_to_a_cap():
    span = list(range(100, 100 + MAX_MATCH + 10))
    index = NgramIndex([*span, 1, *span[:-1]])
    found = index.match(index.tokens, 2)
    assert found.token_ids == (span[-1], 1) and found.match_length == MAX_MATCH


def test_recent_outputs_are_searched_bounded_and_newest_first_on_ties():
    recent = RecentOutputs(max_tokens=10)
    recent.add([1, 2, 3, 4])
    recent.add([7, 2, 3, 5])
    assert recent.match([9, 2, 3], 1).token_ids == (5,)     # both match "2 3": the newest wins
    assert recent.match([9, 1, 2, 3], 1).token_ids == (4,)  # the longer match wins
    recent.add([8, 8, 8, 8])                                 # 12 tokens: the oldest output goes
    assert recent.tokens == 8 and recent.match([9, 1, 2, 3], 1).token_ids == (5,)
    off = RecentOutputs(max_tokens=0)
    off.add([1, 2, 3])
    assert off.tokens == 0 and off.match([1, 2], 1).token_ids == ()


@pytest.fixture(scope="module")
def ngram_stub(stack):
    with coordinator_stub(drafter=None, verifier=stack.address(stack.verifier), proposer="ngram") as stub:
        yield stub


def test_greedy_ngram_speculation_equals_target_only(stack, ngram_stub):
    assert_greedy_equal(stack.coordinator_stub, ngram_stub, PROMPTS, gamma=4, max_new_tokens=60)





# Penalties that favour what the output already holds: the tiny model's text then repeats, and
# lookups (which find their drafts in it) are kept often enough to test both verdicts.
REPEATING = dict(frequency_penalty=-2.0, presence_penalty=-2.0)


def test_a_seeded_sample_drafted_by_lookups_is_target_onlys_token_for_token(stack, ngram_stub):
    """Lookups are one-hot proposals: the rejection sampler keeps one where the
    target's own sample at its position, from the uniform target-only decoding
    draws there, is that token (rejection.py). So a seeded request gets the same
    tokens whether lookups drafted it or not, not just the same distribution."""
    kept = rejected = 0
    for prompt in PROMPTS:
        for seed in (5, 6):
            speculative = generate(ngram_stub, prompt, speculate=True, temperature=0.8, seed=seed, max_new_tokens=40,
                                   **REPEATING)
            plain = generate(stack.coordinator_stub, prompt, speculate=False, temperature=0.8, seed=seed,
                             max_new_tokens=40, **REPEATING)
            assert list(speculative.token_ids) == list(plain.token_ids), (prompt, seed)
            kept += speculative.stats.accepted_tokens
            rejected += speculative.stats.draft_tokens - speculative.stats.accepted_tokens
    assert kept > 10 and rejected > 10   # both verdicts were reached, many times
    other = generate(stack.coordinator_stub, PROMPTS[0], speculate=False, temperature=1.0, seed=7, max_new_tokens=40)
    assert list(other.token_ids) != list(generate(stack.coordinator_stub, PROMPTS[0], speculate=False,
                                                  temperature=1.0, seed=5, max_new_tokens=40).token_ids)


def test_a_seeded_sample_where_the_model_cannot_pay_drafts_lookups_adaptively_and_is_target_onlys(
        stack, tiny_draft, tiny_target):
    """A seeded sampled request keeps a fixed γ where the model drafts (its sample depends
    on where it drafted), but lookups never move a sample: where the start curves leave
    the model nothing (a draft step 90% of a target's: the seeded γ is 0), the request's
    lookups draft adaptively, and its tokens are target-only's. Pinned curves, costs not
    learned: it decides alike on every machine."""
    request = lambda prompt, seed: coordinator_pb2.GenerateRequest(  # noqa: E731
        prompt=prompt, max_new_tokens=40, sampling=common_pb2.SamplingParams(temperature=0.8, seed=seed, **REPEATING))
    with pinned_services(tiny_draft, tiny_target, draft_ms=[9.0, 9.5]) as addresses, \
            coordinator_stub(**addresses, learn_costs=False) as auto:
        drafted = 0
        for prompt in PROMPTS[:6]:
            speculative = auto.Generate(request(prompt, 11), timeout=60)
            plain = generate(stack.coordinator_stub, prompt, speculate=False, temperature=0.8, seed=11,
                             max_new_tokens=40, **REPEATING)
            assert list(speculative.token_ids) == list(plain.token_ids), prompt
            assert {s.source for s in speculative.stats.draft_sources} <= {"ngram"}
            drafted += speculative.stats.draft_tokens
        assert drafted > 20


def test_sampled_ngram_speculation_is_seeded_and_sends_no_probabilities(ngram_stub):
    a = generate(ngram_stub, PROMPTS[0], speculate=True, temperature=0.7, seed=5, max_new_tokens=30)
    b = generate(ngram_stub, PROMPTS[0], speculate=True, temperature=0.7, seed=5, max_new_tokens=30)
    assert list(a.token_ids) == list(b.token_ids) and len(a.token_ids) == 30
    sources = {s.source: s for s in a.stats.draft_sources}
    assert set(sources) <= {"ngram"}
    # A seeded sample keeps a fixed γ, so what the lookups find is the seed's, not this machine's timing's.
    assert a.stats.draft_tokens > 0
    assert sources["ngram"].draft_tokens == a.stats.draft_tokens
    assert a.stats.draft_bytes <= 8 * a.stats.draft_tokens  # one-hot proposals: ids only, a few bytes each
