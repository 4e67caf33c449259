"""The rejection sampler's output is distributed as the target's, whatever the draft."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from scipy import stats

from specdec.spec.rejection import greedy_accept, rejection_sample
from specdec.spec.sampling import SamplingConfig
from specdec.spec.transform import sample_at, scores_to_probs, transform_logits, uniform
from specdec.spec.wire import ONE_HOT, DraftProbs, Truncation
from tests.conftest import NoHostReads
from specdec.spec.draft_probs import dense_for_wire, draft_probs_tensor, draw, read_drawn

V = 8
N = 10_000
ALPHA = 1e-3


def _empirical_first_token(target: torch.Tensor, draft: torch.Tensor, gamma: int, seed: int, sampler=rejection_sample):
    """Sample gamma drafts from `draft`, run the sampler, count the first output token."""
    generator = torch.Generator().manual_seed(seed)
    counts = np.zeros(V)
    draft_probs = draft.expand(gamma, V)
    target_probs = target.expand(gamma + 1, V)
    accepted = 0
    for _ in range(N):
        draft_ids = torch.multinomial(draft_probs, 1, generator=generator)[:, 0]
        out = sampler(draft_ids, draft_probs, target_probs, generator)
        counts[out.output_token_ids(draft_ids)[0]] += 1
        accepted += out.num_accepted
    return counts, accepted / (N * gamma)


def _chi_square_p(counts: np.ndarray, probs: torch.Tensor) -> float:
    p = probs.double().numpy()
    expected = p / p.sum() * counts.sum()
    support = expected > 0
    assert counts[~support].sum() == 0, "sampled a token the target gives zero probability"
    return stats.chisquare(counts[support], expected[support]).pvalue


def _dist(values) -> torch.Tensor:
    t = torch.tensor(values, dtype=torch.float32)
    return t / t.sum()


def _truncated(logits: torch.Tensor, **kw) -> torch.Tensor:
    config = SamplingConfig(temperature=1.0, **kw)
    return scores_to_probs(transform_logits(logits[None], [], [], config, V))[0]


LOGITS_T = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0])
LOGITS_D = torch.tensor([-1.0, 0.0, 2.0, 1.0, 1.5, 0.5, -2.0, 0.0])
PAIRS = {
    "close": (_dist([8, 7, 6, 5, 4, 3, 2, 1]), _dist([7, 8, 5, 6, 3, 4, 1, 2])),
    "far": (_dist([20, 5, 1, 1, 1, 1, 1, 1]), _dist([1, 1, 1, 1, 1, 1, 5, 20])),
    "disjoint supports": (_dist([1, 1, 1, 1, 0, 0, 0, 0]), _dist([0, 0, 0, 0, 1, 2, 3, 4])),
    "draft narrower": (_dist([1, 2, 3, 4, 5, 6, 7, 8]), _dist([0, 0, 0, 0, 0, 0, 1, 1])),
    "one-hot draft (n-gram)": (_dist([1, 2, 3, 4, 5, 6, 7, 8]), _dist([0, 0, 0, 0, 0, 1, 0, 0])),
    "top-k target, full draft": (_truncated(LOGITS_T, top_k=3), _truncated(LOGITS_D)),
    "top-p both": (_truncated(LOGITS_T, top_p=0.8), _truncated(LOGITS_D, top_p=0.7)),
    "top-k draft, top-p target": (_truncated(LOGITS_T, top_p=0.9), _truncated(LOGITS_D, top_k=2)),
}


@pytest.mark.parametrize("name", list(PAIRS))
def test_output_distribution_equals_target(name):
    target, draft = PAIRS[name]
    counts, acceptance = _empirical_first_token(target, draft, gamma=2, seed=7)
    assert _chi_square_p(counts, target) > ALPHA, (name, counts)
    # And the total-variation distance is small in absolute terms.
    assert 0.5 * np.abs(counts / N - target.numpy()).sum() < 0.03


def test_acceptance_rate_is_the_overlap_of_the_distributions():
    # Leviathan et al.: P(accept) = sum_x min(p(x), q(x)) = 1 - TV(p, q).
    target, draft = PAIRS["far"]
    _, acceptance = _empirical_first_token(target, draft, gamma=1, seed=3)
    assert acceptance == pytest.approx(float(torch.minimum(target, draft).sum()), abs=0.02)


def test_later_positions_and_bonus_follow_the_target():
    """With gamma=3 every output position must still be target-distributed."""
    target, draft = PAIRS["close"]
    generator = torch.Generator().manual_seed(11)
    gamma = 3
    counts = np.zeros((gamma + 1, V))
    for _ in range(N):
        draft_ids = torch.multinomial(draft.expand(gamma, V), 1, generator=generator)[:, 0]
        out = rejection_sample(draft_ids, draft.expand(gamma, V), target.expand(gamma + 1, V), generator)
        counts[out.num_accepted, out.next_token_id] += 1
    # Given the first rejection at position i, tokens there come from the residual;
    # overall the last position's token sampled fresh (bonus) must be target-distributed.
    assert counts[gamma].sum() > 500
    assert _chi_square_p(counts[gamma], target) > ALPHA


def _always_accept(draft_ids, draft_probs, target_probs, generator):
    return greedy_accept(draft_ids, torch.cat([draft_ids, draft_ids[-1:]]))


def _resample_from_target_on_rejection(draft_ids, draft_probs, target_probs, generator):
    # The classic bug: sampling the recovered token from p instead of norm(max(0, p - q)).
    out = rejection_sample(draft_ids, draft_probs, target_probs, generator)
    if out.bonus:
        return out
    fresh = torch.multinomial(target_probs[out.num_accepted], 1, generator=generator)
    return type(out)(out.num_accepted, int(fresh), False)


@pytest.mark.parametrize("sampler", [_always_accept, _resample_from_target_on_rejection])
def test_the_test_has_power_broken_samplers_fail(sampler):
    target, draft = PAIRS["far"]
    counts, _ = _empirical_first_token(target, draft, gamma=2, seed=5, sampler=sampler)
    assert _chi_square_p(counts, target) < 1e-6


def test_greedy_accept_stops_at_first_mismatch():
    out = greedy_accept(torch.tensor([5, 6, 7, 8]), torch.tensor([5, 6, 1, 8, 9]))
    assert out.num_accepted == 2 and out.output_token_ids([5, 6, 7, 8]) == [5, 6, 1] and not out.bonus
    out = greedy_accept(torch.tensor([5, 6]), torch.tensor([5, 6, 4]))
    assert out.num_accepted == 2 and out.output_token_ids([5, 6]) == [5, 6, 4] and out.bonus


def test_empty_draft_samples_one_target_token():
    generator = torch.Generator().manual_seed(0)
    target = PAIRS["far"][0]
    out = rejection_sample(torch.zeros(0, dtype=torch.long), torch.zeros(0, V), target[None], generator)
    assert out.num_accepted == 0 and out.bonus and len(out.output_token_ids([])) == 1


def test_seeded_generator_gives_the_same_result():
    target, draft = PAIRS["close"]
    runs = []
    for _ in range(2):
        generator = torch.Generator().manual_seed(42)
        draft_ids = torch.tensor([1, 0, 3])
        runs.append(rejection_sample(draft_ids, draft.expand(3, V), target.expand(4, V), generator))
    assert runs[0] == runs[1]


def test_shapes_are_asserted():
    with pytest.raises(AssertionError):
        rejection_sample(torch.tensor([1, 2]), torch.ones(3, V) / V, torch.ones(3, V) / V, torch.Generator())


def test_a_draft_cut_short_by_its_own_confidence_stays_lossless():
    """The drafter may stop after a token it gives low probability (draft
    confidence): the draft's length then depends on what was drafted. The output
    is still distributed as the target's, first and second token alike."""
    target, draft = PAIRS["close"]
    generator = torch.Generator().manual_seed(11)
    threshold = float(draft.median())
    first, second, lengths = np.zeros(V), np.zeros(V), []
    target_probs = target.expand(3, V)
    for _ in range(N):
        ids = [int(torch.multinomial(draft, 1, generator=generator))]
        if float(draft[ids[0]]) >= threshold:  # confident: draft a second token
            ids.append(int(torch.multinomial(draft, 1, generator=generator)))
        lengths.append(len(ids))
        out = rejection_sample(torch.tensor(ids), draft.expand(len(ids), V), target_probs[: len(ids) + 1], generator)
        first[out.output_token_ids(ids)[0]] += 1
        if out.num_accepted >= 1:  # the second output token comes from this round
            second[out.output_token_ids(ids)[1]] += 1
    assert 1 < np.mean(lengths) < 2  # both lengths occurred
    assert _chi_square_p(first, target) > ALPHA
    assert _chi_square_p(second, target) > ALPHA


# --- proposals as they travel: truncated (sparse), one-hot (lookups), mixed ----

def _sample_truncated(draft: torch.Tensor, truncation: Truncation, generator) -> tuple[int, DraftProbs]:
    """The drafter's draw (`draft_probs.draw`): from its distribution cut to `truncation`, as sent."""
    (token,), _, (entry,) = read_drawn([draw(draft, truncation, uniform(generator))])
    return token, entry


def _first_two_tokens(target: torch.Tensor, propose, seed: int, free: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """N rounds of a 2-token proposal (`propose(generator)` -> ids, entries; the first
    `free` ids a free source's, with no entry) scored through the verifier's own
    rebuild of the draft_probs; counts of the first output token, and of the second
    where the round reached it."""
    generator = torch.Generator().manual_seed(seed)
    first, second = np.zeros(V), np.zeros(V)
    for _ in range(N):
        ids, entries = propose(generator)
        draft_probs = draft_probs_tensor(entries, ids, V, free)
        out = rejection_sample(torch.tensor(ids), draft_probs, target.expand(len(ids) + 1, V), generator)
        first[out.output_token_ids(ids)[0]] += 1
        if out.num_accepted >= 1:
            second[out.output_token_ids(ids)[1]] += 1
    return first, second


@pytest.mark.parametrize("truncation", [Truncation(top_k=3), Truncation(top_p=0.6), Truncation(top_k=1)],
                         ids=["top-k 3", "top-p 0.6", "top-k 1 (greedy-like)"])
def test_truncated_proposals_are_lossless(truncation):
    target, draft = PAIRS["close"]

    def propose(generator):
        drawn = [_sample_truncated(draft, truncation, generator) for _ in range(2)]
        return [t for t, _ in drawn], [e for _, e in drawn]
    first, second = _first_two_tokens(target, propose, seed=21)
    assert _chi_square_p(first, target) > ALPHA and _chi_square_p(second, target) > ALPHA
    assert second.sum() > 1000


def test_proposals_mixing_a_lookup_and_the_model_in_one_round_are_lossless():
    """A lookup's token first (one-hot: no probabilities sent), then the model's
    truncated draft after it; or the other way round."""
    target, draft = PAIRS["far"]
    lookup_token = 0  # the target's favourite: accepted often, so the model's token is judged often

    def lookup_then_model(generator):
        token, entry = _sample_truncated(draft, Truncation(top_k=3), generator)
        return [lookup_token, token], [ONE_HOT, entry]

    def model_then_lookup(generator):
        token, entry = _sample_truncated(PAIRS["close"][1], Truncation(top_p=0.7), generator)
        return [token, 5], [entry, ONE_HOT]
    for propose in (lookup_then_model, model_then_lookup):
        first, second = _first_two_tokens(target, propose, seed=22)
        assert _chi_square_p(first, target) > ALPHA and _chi_square_p(second, target) > ALPHA, propose.__name__
        assert second.sum() > 1000


def test_free_tokens_without_probability_rows_are_lossless():
    """As Verify gets them: a free source's leading tokens carry no draft_probs row
    (free_tokens), the model's after them do; or the round is free tokens alone."""
    target, draft = PAIRS["far"]

    def free_then_model(generator):
        token, entry = _sample_truncated(draft, Truncation(top_k=3), generator)
        return [0, token], [entry]

    def free_alone(generator):
        return [0, 5], []
    for propose, free in ((free_then_model, 1), (free_alone, 2)):
        first, second = _first_two_tokens(target, propose, seed=24, free=free)
        assert _chi_square_p(first, target) > ALPHA and _chi_square_p(second, target) > ALPHA, propose.__name__
        assert second.sum() > 1000


def test_the_test_has_power_a_free_token_scored_as_a_sample_fails():
    """The same free-then-model round, the free token (always 0) scored as if it had
    been drawn from the draft model's distribution: no longer the target's."""
    target, draft = PAIRS["far"]
    assert draft[0] > 0

    def lying(generator):
        token, entry = _sample_truncated(draft, Truncation(top_k=3), generator)
        return [0, token], [dense_for_wire(draft), entry]
    first, _ = _first_two_tokens(target, lying, seed=25, free=0)
    assert _chi_square_p(first, target) < 1e-6


def test_the_test_has_power_a_wrong_truncation_fails():
    """The drafter samples from its top-2, but the verifier is told the whole
    distribution: the output is no longer the target's, and the same test says so."""
    target, draft = PAIRS["far"]

    def lying(generator):
        drawn = [_sample_truncated(draft, Truncation(top_k=2), generator) for _ in range(2)]
        return [t for t, _ in drawn], [dense_for_wire(draft)] * 2
    first, _ = _first_two_tokens(target, lying, seed=23)
    assert _chi_square_p(first, target) < 1e-6


# --- a different distribution at every position --------------------------------

TARGETS = torch.stack([PAIRS["close"][0], PAIRS["far"][0], _dist([1, 1, 4, 1, 1, 1, 1, 6]), PAIRS["top-p both"][0]])
DRAFTS = torch.stack([PAIRS["close"][1], _dist([3, 1, 1, 1, 1, 1, 1, 1]), PAIRS["far"][1]])


def _tokens_by_position(sampler, seed: int) -> np.ndarray:
    """[gamma + 1, V]: how often each token came out at each output position, over
    N rounds of γ = 3 whose draft and target distributions differ at every position."""
    generator = torch.Generator().manual_seed(seed)
    counts = np.zeros((len(TARGETS), V))
    for _ in range(N):
        draft_ids = torch.multinomial(DRAFTS, 1, generator=generator)[:, 0]   # row i from DRAFTS[i]
        out = sampler(draft_ids, DRAFTS, TARGETS, generator)
        for position, token in enumerate(out.output_token_ids(draft_ids)):
            counts[position, token] += 1
    return counts


def test_each_output_position_follows_its_own_target_row():
    """Draft i is judged against target row i, and the bonus comes from row γ: an
    off-by-one between them passes a test whose rows are all alike, not this one."""
    counts = _tokens_by_position(rejection_sample, seed=31)
    for position in range(len(TARGETS)):
        assert counts[position].sum() > 1000, position
        assert _chi_square_p(counts[position], TARGETS[position]) > ALPHA, position


def _judged_one_row_late(draft_ids, draft_probs, target_probs, generator):
    # The off-by-one: draft i scored against target row i + 1 (the bonus row dropped).
    shifted = torch.cat([target_probs[1:], target_probs[-1:]])
    return rejection_sample(draft_ids, draft_probs, shifted, generator)


def test_the_test_has_power_an_off_by_one_fails():
    counts = _tokens_by_position(_judged_one_row_late, seed=31)
    assert min(_chi_square_p(counts[p], TARGETS[p]) for p in range(len(TARGETS))) < 1e-6


@pytest.mark.parametrize("acceptance", [0.6, 0.9])
def test_synthetic_acceptance_keeps_each_draft_at_its_rate(acceptance):
    """The benchmark verdict's accepted count is geometric, cut at gamma: P(k) =
    a^k (1 - a) for k < gamma, and a^gamma when every draft is kept."""
    from specdec.spec.rejection import synthetic_num_accepted
    gamma, runs = 4, 20_000
    generator = random.Random(7)
    counts = np.bincount([synthetic_num_accepted(gamma, acceptance, generator) for _ in range(runs)],
                         minlength=gamma + 1)
    expected = np.array([acceptance ** k * (1 - acceptance) for k in range(gamma)] + [acceptance ** gamma])
    assert stats.chisquare(counts, expected * runs).pvalue > ALPHA
    assert synthetic_num_accepted(0, acceptance, generator) == 0
    with pytest.raises(AssertionError):
        synthetic_num_accepted(gamma, 0.0, generator)


def test_a_lookup_is_kept_where_the_targets_own_sample_at_its_position_is_it_and_is_that_sample_if_not():
    """With the same uniforms, the sampler's output is what target-only sampling
    draws at each position (`sample_at` on the first uniform) for as long as the
    free drafts agree with it: the verdict and the recovered or bonus token alike."""
    generator = torch.Generator().manual_seed(3)
    V, gamma = 50, 4
    for trial in range(200):
        target = torch.softmax(torch.randn(gamma + 1, V, generator=generator) * 2, dim=-1)
        uniforms = torch.rand(gamma + 1, 2, generator=generator, dtype=torch.float64)
        own = sample_at(target, uniforms[:, 0])                     # target-only's tokens, position by position
        agree = trial % (gamma + 1)                                 # the drafts match this many, then differ
        drafts = own[:gamma].clone()
        if agree < gamma:
            drafts[agree] = (own[agree] + 1 + trial % (V - 1)) % V  # any other token
        out = rejection_sample(drafts, torch.zeros(0, V), target, uniforms)
        assert out.num_accepted == agree and out.next_token_id == int(own[agree]), trial
        assert out.bonus == (agree == gamma)


def test_a_round_reads_no_value_back_to_the_host_before_its_one_copy_of_token_ids():
    # The samplers decide on the device and copy gamma + 1 ids (and the count) once, by .tolist().
    target, draft = PAIRS["close"]
    generator = torch.Generator().manual_seed(3)
    for free in (0, 1, 3):        # lookups' one-hot drafts first, then the model's
        draft_ids = torch.tensor([0, 1, 2])
        with NoHostReads():
            out = rejection_sample(draft_ids, draft.expand(3 - free, V), target.expand(4, V), generator)
        assert 0 <= out.num_accepted <= 3
    with NoHostReads():
        assert greedy_accept(torch.tensor([5, 6, 7]), torch.tensor([5, 6, 1, 3])).num_accepted == 2
