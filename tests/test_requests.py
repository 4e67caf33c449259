"""GenerateRequest -> GenerationRequest: defaults and the speculation switch."""
from __future__ import annotations

import pytest

from coordinator.requests import Limits, max_token_chars, to_domain
from specdec import tiny
from specdec.errors import InvalidArgument
from specdec.v1 import coordinator_pb2 as pb

TOK = tiny.build_tokenizer()
LIMITS = Limits(vocab_size=512, max_context=1024, default_max_new_tokens=128, default_gamma=4,
                proposer_max_tokens=32, max_token_chars=max_token_chars(TOK))


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
