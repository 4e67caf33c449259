"""coordinator.rounds: one record per round, split by draft source in one place."""
from __future__ import annotations

import pytest

from coordinator.rounds import RoundRecord
from specdec.spec.proposers import MODEL
from specdec.spec.proposers.ngram import NGRAM
from specdec.spec.types import judged, runs


def test_a_mixed_round_splits_into_its_lookup_and_model_parts():
    # 3 lookup tokens, then 2 model tokens; 4 kept: every lookup token and one model token.
    r = RoundRecord(0, gamma=5, drafted=5, accepted=4, bonus=False, sources=runs((NGRAM, 3), (MODEL, 2)),
                    lookup_match=6)
    assert (r.accepted_by(NGRAM), r.drafted_by(MODEL), r.accepted_by(MODEL)) == (3, 2, 1)
    assert r.by_source() == [("ngram", 3, 3), ("model", 2, 1)] and r.source == "ngram+model"
    assert r.judged_from(MODEL) and r.judged_from(NGRAM)
    assert r.accepted_by_position == [True, True, True, True, False] and r.first_rejected_position == 4
    attributes = r.span_attributes()
    assert (attributes["specdec.draft.ngram.draft_tokens"], attributes["specdec.draft.ngram.accepted_tokens"],
            attributes["specdec.draft.model.draft_tokens"], attributes["specdec.draft.model.accepted_tokens"],
            attributes["specdec.lookup.match_length"]) == (3, 3, 2, 1, 6)


def test_a_lookup_rejected_early_leaves_the_model_tokens_unjudged():
    r = RoundRecord(0, gamma=4, drafted=4, accepted=1, bonus=False, sources=runs((NGRAM, 2), (MODEL, 2)))
    assert (r.accepted_by(NGRAM), r.accepted_by(MODEL)) == (1, 0)
    assert r.by_source() == [("ngram", 2, 1), ("model", 2, 0)]
    assert not r.judged_from(MODEL) and r.judged_from(NGRAM)


def test_rounds_with_one_source_or_none():
    model = RoundRecord(1, gamma=3, drafted=3, accepted=3, bonus=True)
    assert model.source == "model" and model.first_rejected_position == -1
    nothing = RoundRecord(2, gamma=0, drafted=0, accepted=0, bonus=False, steps=16)
    assert nothing.by_source() == [] and nothing.source == "" and nothing.first_rejected_position == -1
    assert not nothing.judged_from(MODEL)
    attributes = model.span_attributes()
    assert attributes["specdec.draft.source"] == "model" and attributes["specdec.draft.model.accepted_tokens"] == 3
    assert "specdec.draft.ngram.draft_tokens" not in attributes


def test_any_source_name_is_counted_in_draft_order():
    # A third kind of proposer needs no new field: its name keys every count.
    r = RoundRecord(0, gamma=6, drafted=6, accepted=3, bonus=False, sources=(("ngram", 1), ("eagle", 4), ("model", 1)))
    assert r.by_source() == [("ngram", 1, 1), ("eagle", 4, 2), ("model", 1, 0)] and r.source == "ngram+eagle+model"
    assert judged((("a", 2), ("b", 2)), 4) == [("a", 2, 2), ("b", 2, 2)] and runs(("a", 0), ("b", 1)) == (("b", 1),)


def test_sources_must_add_up_to_what_was_drafted():
    with pytest.raises(AssertionError):
        RoundRecord(0, gamma=3, drafted=3, accepted=0, bonus=False, sources=runs((NGRAM, 2)))
