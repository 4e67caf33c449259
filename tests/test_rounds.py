"""coordinator.rounds: one record per round, split by draft source in one place."""
from __future__ import annotations

from coordinator.rounds import RoundRecord


def test_a_mixed_round_splits_into_its_lookup_and_model_parts():
    # 3 lookup tokens, then 2 model tokens; 4 kept: every lookup token and one model token.
    r = RoundRecord(0, gamma=5, drafted=5, accepted=4, bonus=False, ngram_drafted=3, ngram_match=6)
    assert (r.ngram_accepted, r.model_drafted, r.model_accepted) == (3, 2, 1)
    assert r.by_source() == [("ngram", 3, 3), ("model", 2, 1)] and r.source == "ngram+model"
    assert r.accepted_by_position == [True, True, True, True, False] and r.first_rejected_position == 4


def test_a_lookup_rejected_early_leaves_the_model_tokens_unjudged():
    r = RoundRecord(0, gamma=4, drafted=4, accepted=1, bonus=False, ngram_drafted=2)
    assert (r.ngram_accepted, r.model_accepted) == (1, 0)
    assert r.by_source() == [("ngram", 2, 1), ("model", 2, 0)]


def test_rounds_with_one_source_or_none():
    model = RoundRecord(1, gamma=3, drafted=3, accepted=3, bonus=True)
    assert model.source == "model" and model.first_rejected_position == -1
    nothing = RoundRecord(2, gamma=0, drafted=0, accepted=0, bonus=False, steps=16)
    assert nothing.by_source() == [] and nothing.source == "" and nothing.first_rejected_position == -1
    attributes = model.span_attributes()
    assert attributes["specdec.draft.source"] == "model" and attributes["specdec.model.accepted_tokens"] == 3
