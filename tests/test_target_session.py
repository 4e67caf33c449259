"""The verifier's session: one forward pass per round, rollback to the accepted prefix."""
from __future__ import annotations

import torch

from specdec.spec.sampling import SamplingConfig
from verifier.target_session import TargetSession
from tests.test_draft_session import greedy_continuation
from tests.test_sequence import PROMPT, full_logits


def count_fed_tokens(loaded) -> tuple[list[int], object]:
    """Tokens per forward, seen at the embedding (which every forward path calls once)."""
    fed: list[int] = []
    handle = loaded.model.get_input_embeddings().register_forward_hook(
        lambda module, inputs, output: fed.append(inputs[0].numel()))
    return fed, handle


def test_verify_scores_the_draft_in_one_pass_and_rolls_back(tiny_target):
    session = TargetSession(tiny_target, PROMPT)
    truth = greedy_continuation(tiny_target, PROMPT, 3)
    draft = [truth[0], (truth[1] + 1) % tiny_target.vocab_size, 7, 8]   # second one is wrong
    fed, handle = count_fed_tokens(tiny_target)
    try:
        out = session.verify(draft, None, SamplingConfig())
    finally:
        handle.remove()
    assert fed == [1 + len(draft)]                 # the pending prompt token and the whole draft, once
    assert out.num_accepted == 1 and out.next_token_id == truth[1] and not out.bonus
    assert session.seq.tokens == PROMPT + truth[:2]
    assert session.seq.cached == len(PROMPT) + 1   # cropped, not recomputed; truth[1] is fed next round


def test_fully_accepted_draft_gets_the_bonus_token(tiny_target):
    session = TargetSession(tiny_target, PROMPT)
    truth = greedy_continuation(tiny_target, PROMPT, 4)
    out = session.verify(truth[:3], None, SamplingConfig())
    assert out.num_accepted == 3 and out.bonus and out.next_token_id == truth[3]


def test_decode_equals_greedy_continuation(tiny_target):
    session = TargetSession(tiny_target, PROMPT)
    tokens = session.decode(6, SamplingConfig())
    assert tokens == greedy_continuation(tiny_target, PROMPT, 6)[: len(tokens)]
    logits = session.seq.forward([], keep_last=1)[0]
    assert torch.allclose(logits, full_logits(tiny_target, PROMPT + tokens), atol=1e-5)
