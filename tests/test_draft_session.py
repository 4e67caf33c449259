"""The drafter's session: commit, rollback, and the fully-accepted case."""
from __future__ import annotations

import pytest
import torch

from drafter.draft_session import DraftSession, greedy_draft
from specdec.rpc.errors import FailedPrecondition, InvalidArgument
from specdec.spec.types import Commit
from specdec.spec.sampling import SamplingConfig
from specdec.spec.wire import Truncation
from specdec.spec.draft_probs import draft_probs_tensor
from tests.conftest import NoHostReads
from tests.test_sequence import PROMPT, full_logits

GREEDY = SamplingConfig()


def greedy_continuation(loaded, tokens, n):
    out = list(tokens)
    for _ in range(n):
        out.append(int(full_logits(loaded, out)[: loaded.vocab_size].argmax()))
    return out[len(tokens):]


def test_greedy_proposal_is_the_draft_models_greedy_continuation(tiny_draft):
    session = DraftSession(tiny_draft, PROMPT)
    ids, probs, _ = session.propose(4, GREEDY)
    assert probs == [] and ids == greedy_continuation(tiny_draft, PROMPT, 4)


def test_a_greedy_draft_step_is_decided_on_the_device_and_read_once():
    scores = torch.randn(151_936, generator=torch.Generator().manual_seed(0))
    scores[[7, 151_935]] = scores.max() + 1.0         # a tie: the first maximum, as argmax
    with NoHostReads():                                # no int()/float(): one .tolist() of both
        token, confidence = greedy_draft(scores)
    assert token == 7 == int(scores.argmax())
    assert confidence == pytest.approx(float(torch.softmax(scores, -1)[7]), rel=1e-6)


@pytest.mark.parametrize("accepted", [0, 2, 4])
def test_commit_rolls_back_to_the_accepted_prefix(tiny_draft, accepted):
    session = DraftSession(tiny_draft, PROMPT)
    ids, _, _ = session.propose(4, GREEDY)
    target_token = 123
    session.commit(Commit(accepted, (target_token,)))
    history = PROMPT + ids[:accepted] + [target_token]
    assert session.seq.tokens == history
    # Cache kept, not recomputed: only the rejected tail was cropped. After a
    # fully accepted round the last draft (never fed) and the bonus token are fed next.
    assert session.seq.cached == len(PROMPT) + min(accepted, 3)
    next_ids, _, _ = session.propose(2, GREEDY)
    assert next_ids == greedy_continuation(tiny_draft, history, 2)


def test_sampled_proposal_returns_the_distributions_it_sampled_from(tiny_draft):
    session = DraftSession(tiny_draft, PROMPT)
    ids, entries, _ = session.propose(3, SamplingConfig(temperature=0.8, seed=1))
    probs = draft_probs_tensor(entries, ids, tiny_draft.vocab_size)
    assert all(len(e.probs_fp16) == 2 * tiny_draft.vocab_size and not e.token_ids for e in entries)  # dense
    assert torch.allclose(probs.sum(-1), torch.ones(3), atol=1e-4)
    assert all(probs[i, t] > 0 for i, t in enumerate(ids))


def test_commit_errors(tiny_draft):
    session = DraftSession(tiny_draft, PROMPT)
    session.propose(2, GREEDY)
    with pytest.raises(InvalidArgument, match="only 2 tokens were drafted"):
        session.commit(Commit(3, (1,)))
    with pytest.raises(FailedPrecondition, match="commit"):
        session.commit(None)


def greedy_confidence(loaded, tokens) -> float:
    """The draft model's softmax probability of its own greedy next token."""
    probs = torch.softmax(full_logits(loaded, tokens)[: loaded.vocab_size].float(), dim=-1)
    return float(probs.max())


def test_drafting_stops_after_a_token_below_min_confidence(tiny_draft):
    full, _, _ = DraftSession(tiny_draft, PROMPT).propose(8, GREEDY)
    confidences = [greedy_confidence(tiny_draft, PROMPT + full[:i]) for i in range(8)]
    stopped_early = 0
    for threshold in sorted(set(confidences))[1:4]:  # thresholds that some token falls below
        session = DraftSession(tiny_draft, PROMPT)
        ids, _, _ = session.propose(8, GREEDY, min_confidence=threshold)
        # The first token below the threshold is the last one drafted.
        expected = next(i for i, c in enumerate(confidences) if c < threshold) + 1
        assert ids == full[:expected], (threshold, confidences)
        assert session.round_drafted == len(ids)
        stopped_early += len(ids) < 8
        # The shorter round commits and continues like any other.
        session.commit(Commit(len(ids), (full[len(ids)] if len(ids) < 8 else 5,)))
    assert stopped_early > 0
    session = DraftSession(tiny_draft, PROMPT)
    assert len(session.propose(8, GREEDY, min_confidence=1.0)[0]) >= 1  # never fewer than one


def test_sampled_drafting_stops_on_the_sampled_tokens_probability(tiny_draft):
    sampling = SamplingConfig(temperature=1.0, seed=3)
    for seed in range(5):
        session = DraftSession(tiny_draft, PROMPT)
        session.generator = torch.Generator().manual_seed(seed)
        ids, entries, _ = session.propose(6, sampling, min_confidence=0.5)
        probs = draft_probs_tensor(entries, ids, tiny_draft.vocab_size)
        below = [float(probs[i, t]) < 0.5 for i, t in enumerate(ids)]
        # Every token but the last was confident; the last was not, or the draft ran its length.
        assert not any(below[:-1]) and (below[-1] or len(ids) == 6)


def test_truncated_proposal_samples_from_and_sends_only_the_top_k(tiny_draft):
    sampling = SamplingConfig(temperature=1.0, seed=4)
    session = DraftSession(tiny_draft, PROMPT)
    ids, entries, confidences = session.propose(4, sampling, truncation=Truncation(top_k=8))
    history = list(PROMPT)
    for token, entry, confidence in zip(ids, entries, confidences):
        probs = torch.softmax(full_logits(tiny_draft, history)[: tiny_draft.vocab_size].float(), dim=-1)
        top = probs.topk(8)
        # The model's own top 8, renormalized, fp16-rounded: and the token was drawn from them.
        assert set(entry.token_ids) == set(top.indices.tolist()) and token in entry.token_ids
        sent = draft_probs_tensor([entry], [token], tiny_draft.vocab_size)[0]
        assert torch.allclose(sent[top.indices], top.values / top.values.sum(), rtol=2e-3, atol=1e-4)
        assert confidence == pytest.approx(float(sent[token]))
        history.append(token)


def test_top_p_keeps_the_fewest_tokens_holding_that_mass(tiny_draft):
    session = DraftSession(tiny_draft, PROMPT)
    ids, entries, _ = session.propose(1, SamplingConfig(temperature=1.0, seed=2), truncation=Truncation(top_p=0.5))
    probs = torch.softmax(full_logits(tiny_draft, PROMPT)[: tiny_draft.vocab_size].float(), dim=-1)
    ranked = probs.sort(descending=True).values
    needed = int((ranked.cumsum(0) < 0.5).sum()) + 1
    assert len(entries[0].token_ids) == needed and ids[0] in entries[0].token_ids


def test_a_prefix_is_drafted_first_and_commits_like_the_models_own_drafts(tiny_draft):
    """Lookup tokens in front: the model drafts after them, and a commit counts
    them as drafts (kept ones stay in the cache, rejected ones are cropped)."""
    session = DraftSession(tiny_draft, PROMPT)
    prefix = [7, 8]
    ids, _, _ = session.propose(3, GREEDY, prefix=prefix)
    assert ids == greedy_continuation(tiny_draft, PROMPT + prefix, 3) and session.round_drafted == 5
    session.commit(Commit(1, (9,)))  # kept the first lookup token, then the target's 9
    assert session.seq.tokens == PROMPT + [7, 9]
    assert session.propose(2, GREEDY)[0] == greedy_continuation(tiny_draft, PROMPT + [7, 9], 2)
