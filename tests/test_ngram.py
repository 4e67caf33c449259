"""An n-gram proposer plugs into the same loop, with no change to the verifier."""
from __future__ import annotations

import pytest
import torch

from coordinator.service import CoordinatorConfig, serve
from specdec.ngram import NgramProposer
from specdec.proposer import Commit
from specdec.sampling import SamplingConfig
from specdec.serving import channel
from specdec.v1 import coordinator_pb2_grpc
from specdec.wire import decode_probs
from tests.test_end_to_end import PROMPTS, generate


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
    running, backends = serve(CoordinatorConfig(drafter=None, verifier=stack.address(stack.verifier),
                                                proposer="ngram", connect_timeout_s=30))
    with channel(f"127.0.0.1:{running.port}") as ch:
        yield coordinator_pb2_grpc.CoordinatorStub(ch)
    backends.close()
    running.stop(0)


def test_greedy_ngram_speculation_equals_target_only(stack, ngram_stub):
    drafted = accepted = 0
    for prompt in PROMPTS:
        reference = generate(stack.coordinator_stub, prompt, speculate=False, max_new_tokens=60)
        speculative = generate(ngram_stub, prompt, speculate=True, gamma=4, max_new_tokens=60)
        assert list(speculative.token_ids) == list(reference.token_ids), prompt
        drafted += speculative.stats.draft_tokens
        accepted += speculative.stats.accepted_tokens
    assert 0 < accepted < drafted


def test_sampled_ngram_speculation_runs_and_is_seeded(ngram_stub):
    a = generate(ngram_stub, PROMPTS[0], speculate=True, temperature=0.7, seed=5, max_new_tokens=30)
    b = generate(ngram_stub, PROMPTS[0], speculate=True, temperature=0.7, seed=5, max_new_tokens=30)
    assert list(a.token_ids) == list(b.token_ids) and len(a.token_ids) == 30
