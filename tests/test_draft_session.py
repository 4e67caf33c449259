"""The drafter's session: commit, rollback, and the fully-accepted case."""
from __future__ import annotations

import pytest
import torch

from drafter.draft_session import DraftSession
from specdec.errors import FailedPrecondition, InvalidArgument
from specdec.proposer import Commit
from specdec.sampling import SamplingConfig
from tests.test_kv_cache import PROMPT, full_logits

GREEDY = SamplingConfig()


def greedy_continuation(loaded, tokens, n):
    out = list(tokens)
    for _ in range(n):
        out.append(int(full_logits(loaded, out)[: loaded.vocab_size].argmax()))
    return out[len(tokens):]


def test_greedy_proposal_is_the_draft_models_greedy_continuation(tiny_draft):
    session = DraftSession(tiny_draft, PROMPT)
    ids, probs = session.propose(4, GREEDY)
    assert probs is None and ids == greedy_continuation(tiny_draft, PROMPT, 4)


@pytest.mark.parametrize("accepted", [0, 2, 4])
def test_commit_rolls_back_to_the_accepted_prefix(tiny_draft, accepted):
    session = DraftSession(tiny_draft, PROMPT)
    ids, _ = session.propose(4, GREEDY)
    target_token = 123
    session.commit(Commit(accepted, (target_token,)))
    history = PROMPT + ids[:accepted] + [target_token]
    assert session.seq.tokens == history
    # Cache kept, not recomputed: only the rejected tail was cropped. After a
    # fully accepted round the last draft (never fed) and the bonus token are fed next.
    assert session.seq.cached == len(PROMPT) + min(accepted, 3)
    next_ids, _ = session.propose(2, GREEDY)
    assert next_ids == greedy_continuation(tiny_draft, history, 2)


def test_sampled_proposal_returns_the_distributions_it_sampled_from(tiny_draft):
    session = DraftSession(tiny_draft, PROMPT)
    ids, probs = session.propose(3, SamplingConfig(temperature=0.8, seed=1))
    assert probs.shape == (3, tiny_draft.vocab_size)
    assert torch.allclose(probs.sum(-1), torch.ones(3), atol=1e-4)
    assert all(probs[i, t] > 0 for i, t in enumerate(ids))


def test_commit_errors(tiny_draft):
    session = DraftSession(tiny_draft, PROMPT)
    session.propose(2, GREEDY)
    with pytest.raises(InvalidArgument, match="only 2 tokens were drafted"):
        session.commit(Commit(3, (1,)))
    with pytest.raises(FailedPrecondition, match="commit"):
        session.commit(None)
