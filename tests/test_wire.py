"""specdec.spec.wire and draft_probs: proto <-> domain, and draft distributions as
they travel (one-hot, sparse, dense), validated where they arrive."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from specdec.rpc.errors import InvalidArgument
from specdec.spec.draft_probs import dense_for_wire, draft_probs_tensor, sparse_probs, truncate_for_wire
from specdec.spec.sampling import SamplingConfig
from specdec.spec.wire import (ONE_HOT, DraftProbs, Truncation, draft_probs_from_proto, draft_probs_to_proto,
                               sampling_from_proto, sampling_to_proto)
from specdec.v1 import common_pb2

V = 16


def test_a_config_survives_the_wire_with_all_64_bits_of_its_seed():
    config = SamplingConfig(temperature=0.5, top_k=3, top_p=0.75, repetition_penalty=1.5, seed=2**64 - 1)
    assert sampling_from_proto(sampling_to_proto(config)) == config


def test_entries_survive_the_wire_and_each_form_rebuilds_its_distribution():
    probs = torch.softmax(torch.arange(V, dtype=torch.float32) / 3, dim=0)
    sparse = truncate_for_wire(probs, Truncation(top_k=4))
    dense = dense_for_wire(probs)
    entries = (ONE_HOT, sparse, dense)
    assert draft_probs_from_proto(draft_probs_to_proto(entries)) == entries
    ids = [5, sparse.token_ids[0], 2]
    rebuilt = draft_probs_tensor(entries, ids, V)
    assert rebuilt.shape == (3, V) and torch.allclose(rebuilt.sum(dim=1), torch.ones(3), atol=1e-3)
    assert rebuilt[0, 5] == 1.0 and rebuilt[0].sum() == 1.0                      # one-hot on its token
    assert torch.equal(rebuilt[1, list(sparse.token_ids)], sparse_probs(sparse))  # what the drafter drew from
    assert (rebuilt[1] > 0).sum() == 4 and sparse.token_ids[0] == int(probs.argmax())


def test_a_proposal_is_validated_on_the_host_and_built_where_the_target_scores_it():
    """Built on the target's device, with nothing there read back (a meta tensor has no values:
    a read would raise), the support's ids and values sent rather than rows of the vocabulary."""
    probs = torch.softmax(torch.arange(V, dtype=torch.float32) / 3, dim=0)
    sparse = truncate_for_wire(probs, Truncation(top_k=4))
    entries, ids = (ONE_HOT, sparse, dense_for_wire(probs)), [5, sparse.token_ids[0], 2]
    rebuilt = draft_probs_tensor(entries, ids, V, device="meta")
    assert rebuilt.device.type == "meta" and rebuilt.shape == (3, V)
    with pytest.raises(InvalidArgument, match="gives its drafted token 7 probability 0"):
        draft_probs_tensor([sparse], [7], V, device="meta")


@pytest.mark.parametrize("entry, token, message", [
    (DraftProbs((3, 4), np.array([0.5, 0.5], dtype="<f2").tobytes()), 7, "gives its drafted token 7 probability 0"),
    (DraftProbs((3, 3), np.array([0.5, 0.5], dtype="<f2").tobytes()), 3, "repeats an id"),
    (DraftProbs((3, 99), np.array([0.5, 0.5], dtype="<f2").tobytes()), 3, "outside the vocabulary"),
    (DraftProbs((3, 4), np.array([0.5], dtype="<f2").tobytes()), 3, "expected 4"),
    (DraftProbs((3, 4), np.array([0.9, 0.9], dtype="<f2").tobytes()), 3, "must sum to 1"),
    (DraftProbs((), np.zeros(V, dtype="<f2").tobytes()), 3, "sums to 0"),
])
def test_a_proposal_that_could_not_have_drawn_its_token_is_refused(entry, token, message):
    with pytest.raises(InvalidArgument, match=message):
        draft_probs_tensor([entry], [token], V)


def test_one_entry_per_drafted_token():
    with pytest.raises(InvalidArgument, match="2 entries for 1 draft tokens"):
        draft_probs_tensor([ONE_HOT, ONE_HOT], [1], V)


def test_a_proto_entry_has_the_fields_it_travels_in():
    message = draft_probs_to_proto([DraftProbs((1, 2), b"\x00\x38\x00\x38")])[0]
    assert isinstance(message, common_pb2.DraftProbs) and list(message.token_ids) == [1, 2]
