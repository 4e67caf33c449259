"""KV rollback: caches are cropped to the accepted length, never recomputed."""
from __future__ import annotations

import torch

from specdec.runtime.sequence import SequenceCache

PROMPT = [57, 84, 275, 71, 261, 276, 371]


def full_logits(loaded, tokens) -> torch.Tensor:
    with torch.inference_mode():
        return loaded.model(input_ids=torch.tensor([tokens])).logits[0, -1].float()


def test_truncate_then_forward_matches_a_fresh_pass(tiny_target):
    seq = SequenceCache(tiny_target, PROMPT)
    seq.prefill()
    assert seq.cached == len(PROMPT) - 1
    seq.forward([10, 11, 12, 13], keep_last=5)
    assert seq.cached == len(PROMPT) + 4
    seq.truncate(len(PROMPT) + 1)          # keep one of the four
    assert seq.cached == len(PROMPT) + 1 and seq.tokens == PROMPT + [10]
    logits = seq.forward([99], keep_last=1)[0]
    assert torch.allclose(logits, full_logits(tiny_target, PROMPT + [10, 99]), atol=1e-5)


def test_forward_after_everything_is_cached_refeeds_the_last_token(tiny_target):
    seq = SequenceCache(tiny_target, PROMPT)
    seq.forward([5, 6], keep_last=1)
    seq.truncate(len(PROMPT) + 2)           # nothing uncached left
    logits = seq.forward([], keep_last=1)[0]
    assert torch.allclose(logits, full_logits(tiny_target, PROMPT + [5, 6]), atol=1e-5)


def test_prefill_leaves_only_the_last_prompt_token_to_feed(tiny_target):
    seq = SequenceCache(tiny_target, PROMPT)
    seq.prefill()
    logits = seq.forward([], keep_last=1)[0]
    assert torch.allclose(logits, full_logits(tiny_target, PROMPT), atol=1e-5)
