"""A request's Drafts (free sources and the model) over the real drafter service:
lookup tokens drafted alone make no drafter call, mixed rounds draft after the lookup's tokens, and
the drafter's session always ends up where a fresh one on the same text would."""
from __future__ import annotations

import uuid

import pytest

from tests.conftest import wait_for

from coordinator.clients import DrafterClient, RemoteDraftProposer
from specdec.spec.proposers import MODEL
from specdec.spec.proposers.drafts import Drafts
from specdec.spec.proposers.ngram import NGRAM, NgramSource, RecentOutputs
from specdec.spec.types import Commit, Lookup
from specdec.spec.sampling import SamplingConfig
from specdec.v1 import common_pb2
from specdec.spec.wire import Truncation

GREEDY = SamplingConfig()
PROMPT = [11, 12, 13, 14, 15, 11, 12, 13]  # ends in "11 12 13": the lookup proposes "14 15 11 ..."


@pytest.fixture
def drafter_client(stack):
    client = DrafterClient(stack.address(stack.drafter))
    yield client
    client.close()


def model_proposer(client, stack, truncation=Truncation()) -> RemoteDraftProposer:
    fingerprint = stack.drafter_stub.Info(common_pb2.InfoRequest()).tokenizer_fingerprint
    return RemoteDraftProposer(client, fingerprint, truncation=truncation)


def fresh_greedy_draft(client, tokens, n) -> tuple[int, ...]:
    """What a new drafter session on exactly `tokens` drafts, greedily."""
    session = uuid.uuid4().hex
    client.start_session_async(session, tokens, 30).result()
    try:
        return client.propose(session, n, GREEDY, None, 0.0, 30).token_ids
    finally:
        client.end_session(session)


def active_sessions(stack) -> int:
    return stack.drafter_stub.Info(common_pb2.InfoRequest()).active_sessions


def test_lookup_rounds_skip_the_model_which_then_catches_up_through_its_commit(stack, drafter_client):
    hybrid = Drafts(model_proposer(drafter_client, stack), {NGRAM: NgramSource()})
    hybrid.start(uuid.uuid4().hex, PROMPT)
    hybrid.ready()
    try:
        (lookup,) = hybrid.candidates(PROMPT, 3)
        assert (lookup.token_ids, lookup.match_length, lookup.source) == ((14, 15, 11), 3, NGRAM)
        free = hybrid.propose(0, GREEDY, None, prefix=Lookup(lookup.token_ids[:2], source=NGRAM))
        assert free.token_ids == (14, 15) and free.sources == ((NGRAM, 2),) and free.batch.forwards == 0  # no drafter call
        assert free.free_tokens == 2
        # The verifier kept 14 and added 99; another lookup round kept nothing and added 98.
        hybrid.propose(0, GREEDY, Commit(1, (99,)), prefix=Lookup((5,), source=NGRAM))
        mixed = hybrid.propose(2, GREEDY, Commit(0, (98,)), prefix=Lookup((7,), source=NGRAM))
        context = PROMPT + [14, 99, 98]
        assert mixed.sources == ((NGRAM, 1), (MODEL, 2)) and mixed.token_ids[:1] == (7,) and mixed.batch.forwards > 0
        assert mixed.token_ids[1:] == fresh_greedy_draft(drafter_client, context + [7], 2)
        # The model's own round: one of its drafts kept (the lookup's 7), then the target's 97.
        after = hybrid.propose(3, GREEDY, Commit(1, (97,)))
        assert after.sources == ((MODEL, 3),)
        assert after.token_ids == fresh_greedy_draft(drafter_client, context + [7, 97], 3)
    finally:
        hybrid.end()


def test_sampled_mixed_rounds_send_no_rows_for_lookups_and_the_models_truncated_support(stack, drafter_client):
    hybrid = Drafts(model_proposer(drafter_client, stack, Truncation(top_k=16)), {NGRAM: NgramSource()})
    hybrid.start(uuid.uuid4().hex, PROMPT)
    try:
        proposal = hybrid.propose(2, SamplingConfig(temperature=0.9, seed=1), None, prefix=Lookup((14,), source=NGRAM))
        assert proposal.free_tokens == 1 and len(proposal.token_ids) == 3 and len(proposal.draft_probs) == 2
        for token, entry in zip(proposal.token_ids[1:], proposal.draft_probs):
            assert len(entry.token_ids) == 16 and token in entry.token_ids
            assert len(entry.probs_fp16) == 32
    finally:
        hybrid.end()


def test_without_its_model_the_hybrid_keeps_its_lookups_and_ends_the_drafter_session_with_the_request(stack, drafter_client):
    before = active_sessions(stack)
    recent = RecentOutputs()
    hybrid = Drafts(model_proposer(drafter_client, stack), {NGRAM: NgramSource(recent)})
    hybrid.start(uuid.uuid4().hex, PROMPT)
    hybrid.ready()
    assert active_sessions(stack) == before + 1
    assert hybrid.free_only() is hybrid and not hybrid.drafts_with_model
    assert hybrid.propose(4, GREEDY, None, prefix=Lookup((14, 15), source=NGRAM)).token_ids == (14, 15)  # no model
    hybrid.candidates(PROMPT + [14, 15, 40, 41], 2)
    hybrid.end()  # the drafter's session ends with the request (off its path: at once, not waited for)
    assert wait_for(lambda: active_sessions(stack) == before, 5)
    # Its output (after the prompt) is what later requests' lookups may find.
    assert recent.tokens == 4 and recent.match([15, 40], 1).token_ids == (41,)
