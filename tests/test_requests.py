"""GenerateRequest -> GenerationRequest: defaults and the speculation switch."""
from __future__ import annotations

import dataclasses

import pytest

from coordinator.requests import PROBE_CHARS_PER_TOKEN, Limits, max_token_chars, to_domain
from specdec.weights import tiny
from specdec.rpc.errors import InvalidArgument
from specdec.v1 import coordinator_pb2 as pb

TOK = tiny.build_tokenizer()
LIMITS = Limits(vocab_size=512, max_context=1024, default_max_new_tokens=128, default_gamma=4,
                max_propose_tokens=32, max_token_chars=max_token_chars(TOK))


def test_defaults():
    domain = to_domain(pb.GenerateRequest(prompt="hello"), TOK, LIMITS, speculation_available=True)
    assert domain.gamma_max == 4 and domain.max_new_tokens == 128 and domain.sampling.greedy
    assert list(domain.prompt_ids) == TOK.encode("hello")


def test_speculation_can_be_switched_off_or_be_unavailable():
    off = pb.GenerateRequest(prompt="hi", speculation=pb.Speculation(enabled=False, gamma=1000))
    assert to_domain(off, TOK, LIMITS, speculation_available=True).gamma_max == 0
    # Without a proposer the coordinator serves target-only; a gamma is not an error then.
    asked = pb.GenerateRequest(prompt="hi", speculation=pb.Speculation(gamma=1000))
    assert to_domain(asked, TOK, LIMITS, speculation_available=False).gamma_max == 0
    with pytest.raises(InvalidArgument, match="over the proposer's limit of 32"):
        to_domain(asked, TOK, LIMITS, speculation_available=True)


class CountingTokenizer:
    """The tiny tokenizer, recording the length of every text it is asked to encode."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self.encoded: list[int] = []

    def encode(self, text, **kwargs):
        self.encoded.append(len(text))
        return self._tokenizer.encode(text, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


def test_a_prompt_that_cannot_fit_is_refused_before_it_is_tokenized():
    tokenizer = CountingTokenizer(TOK)
    huge = "the cat sat on the mat. " * 150_000  # 3.6 MB, the probe's size
    with pytest.raises(InvalidArgument, match="does not fit the 896 tokens"):
        to_domain(pb.GenerateRequest(prompt=huge), tokenizer, LIMITS, speculation_available=True)
    assert tokenizer.encoded == []  # by its length alone: 13 characters a token at most
    chat = pb.GenerateRequest(messages=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=huge)]))
    with pytest.raises(InvalidArgument, match="contents .* do not fit the 896 tokens"):  # before templating, too
        to_domain(chat, tokenizer, LIMITS, speculation_available=True)
    assert tokenizer.encoded == []


def test_a_long_prompt_is_refused_from_a_prefix_when_its_length_alone_cannot_tell():
    # As if the vocabulary had a 1,000-character token: the length bound lets 500 kB through.
    loose = dataclasses.replace(LIMITS, max_token_chars=1000)
    tokenizer = CountingTokenizer(TOK)
    with pytest.raises(InvalidArgument, match="does not fit the 896 tokens"):
        to_domain(pb.GenerateRequest(prompt="the cat sat on the mat. " * 20_000), tokenizer, loose,
                  speculation_available=True)
    assert max(tokenizer.encoded) <= 896 * PROBE_CHARS_PER_TOKEN
    # A prompt that fits is tokenized whole, as before.
    fits = "the cat sat on the mat. " * 20
    domain = to_domain(pb.GenerateRequest(prompt=fits), tokenizer, loose, speculation_available=True)
    assert list(domain.prompt_ids) == TOK.encode(fits)


def test_the_proposer_is_the_requests_choice_or_the_servers():
    assert to_domain(pb.GenerateRequest(prompt="hi"), TOK, LIMITS, True).proposer == ""
    for kind, name in ((pb.PROPOSER_KIND_HYBRID, "hybrid"), (pb.PROPOSER_KIND_MODEL, "model"),
                       (pb.PROPOSER_KIND_NGRAM, "ngram")):
        request = pb.GenerateRequest(prompt="hi", speculation=pb.Speculation(proposer=kind))
        assert to_domain(request, TOK, LIMITS, True).proposer == name
    with pytest.raises(InvalidArgument, match="not a ProposerKind"):
        to_domain(pb.GenerateRequest(prompt="hi", speculation=pb.Speculation(proposer=9)), TOK, LIMITS, True)


def test_every_generation_stat_is_the_engines_attribute_of_its_name():
    """A new statistic is its GenerationStats field and its Stats attribute: the
    mapping, the bench and `specdec load` take it by name."""
    from coordinator.stats import SourceCount, Stats, stats_to_proto
    from coordinator.rounds import RoundRecord
    from specdec.spec.proposers import MODEL
    from specdec.spec.proposers.ngram import NGRAM
    from specdec.spec.types import runs
    stats = Stats(prompt_tokens=7, gamma=3, fallback="why")
    stats.record(RoundRecord(0, 3, 3, 2, False, draft_ms=4.0, verify_ms=9.0, sources=runs((NGRAM, 1), (MODEL, 2)),
                             draft_bytes=12, verify_batch_rows=4.0))
    stats.output_tokens, stats.total_ms, stats.first_token_ms = 3, 20.0, 5.0
    from coordinator.gamma.explore import Exploration
    Exploration(ledger=stats.probes).charge("model_round", 12.5)
    proto = stats_to_proto(stats)
    for field in proto.DESCRIPTOR.fields:
        if field.name in ("draft_sources", "probes"):
            continue
        assert hasattr(stats, field.name), f"GenerationStats.{field.name} has no Stats attribute"
        mine = getattr(stats, field.name)
        theirs = getattr(proto, field.name)
        assert (list(theirs) == pytest.approx(list(mine)) if isinstance(mine, list) else
                theirs == (pytest.approx(mine) if isinstance(mine, float) else mine)), field.name
    assert proto.accepted_tokens == 2 and proto.fallback == "why" and proto.draft_bytes == 12
    assert {s.source: (s.draft_tokens, s.accepted_tokens) for s in proto.draft_sources} == {"ngram": (1, 1),
                                                                                           "model": (2, 1)}
    assert isinstance(stats.sources["model"], SourceCount)
    assert [(p.kind, p.count, p.ms) for p in proto.probes] == [("model_round", 1, 12.5)]
