"""An n-gram proposer plugs into the same loop, with no change to the verifier."""
from __future__ import annotations

import pytest
import torch

from specdec.ngram import NgramProposer
from specdec.proposer import Commit
from specdec.sampling import SamplingConfig
from specdec.wire import decode_probs
from tests.conftest import coordinator_stub
from tests.test_end_to_end import PROMPTS, assert_greedy_equal, generate


def test_proposes_what_followed_the_latest_match():
    proposer = NgramProposer(vocab_size=50)
    proposer.start("s", [1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2])
    assert proposer.propose(3, SamplingConfig(), None).token_ids == (3, 7, 8)
    # The verifier kept one draft and added 4: the history follows the commit.
    proposal = proposer.propose(2, SamplingConfig(temperature=1.0), Commit(1, (4,)))
    assert proposer.tokens[:13] == [1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3, 4]
    probs = decode_probs(proposal.draft_probs_fp16, len(proposal.token_ids), 50)
    assert torch.equal(probs.argmax(-1), torch.tensor(proposal.token_ids)) and torch.all(probs.max(-1).values == 1)


def test_no_match_proposes_nothing():
    proposer = NgramProposer(vocab_size=50)
    proposer.start("s", [1, 2, 3])
    assert proposer.propose(4, SamplingConfig(), None).token_ids == ()


@pytest.fixture(scope="module")
def ngram_stub(stack):
    with coordinator_stub(drafter=None, verifier=stack.address(stack.verifier), proposer="ngram") as stub:
        yield stub


def test_greedy_ngram_speculation_equals_target_only(stack, ngram_stub):
    assert_greedy_equal(stack.coordinator_stub, ngram_stub, PROMPTS, gamma=4, max_new_tokens=60)


def test_sampled_ngram_speculation_runs_and_is_seeded(ngram_stub):
    a = generate(ngram_stub, PROMPTS[0], speculate=True, temperature=0.7, seed=5, max_new_tokens=30)
    b = generate(ngram_stub, PROMPTS[0], speculate=True, temperature=0.7, seed=5, max_new_tokens=30)
    assert list(a.token_ids) == list(b.token_ids) and len(a.token_ids) == 30
