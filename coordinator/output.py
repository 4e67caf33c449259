"""Turning each round's new tokens into output: EOS, length and stop strings,
and text deltas that never split a UTF-8 character or half-show a stop string.

The rule for `token_ids` and `text` (also in coordinator.proto): `token_ids` are
the fewest tokens whose decoded text covers `text`. Without a stop string that is
every generated token (EOS excluded) and `text` is their decoding. On a stop
string, `text` ends just before it, and the last token may run past that cut when
the stop string begins inside it; a token that lies wholly in or after the stop
string is never included. With stop strings, a stream sends a token id once the
text it covers has been sent, so its ids always add up to the unary response's.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Sequence

from transformers import PreTrainedTokenizerBase


class FinishReason(enum.IntEnum):  # values match specdec.v1.FinishReason
    LENGTH = 1
    STOP = 2
    EOS = 3


@dataclass
class Delta:
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None
    logprobs: list = field(default_factory=list)   # one per token id, when the request asked


class OutputAccumulator:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, eos_token_ids: Sequence[int], max_new_tokens: int,
                 stop: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.eos = frozenset(eos_token_ids)
        self.max_new_tokens = max_new_tokens
        self.stop = tuple(stop)
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.token_ids: list[int] = []
        self.logprobs: list = []   # the token ids', when each round brings them
        self.text = ""
        self.finish_reason: FinishReason | None = None
        self._sent_tokens = 0
        self._sent_chars = 0

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, new_ids: Sequence[int], logprobs: Sequence = ()) -> Delta:
        """`logprobs`: one per id of `new_ids`, or none; they follow their ids out."""
        assert self.finish_reason is None, "generation already finished"
        for i, token in enumerate(new_ids):
            if token in self.eos:                   # EOS ends it and is not part of the output
                self.finish_reason = FinishReason.EOS
                break
            self.token_ids.append(int(token))
            if logprobs:
                self.logprobs.append(logprobs[i])
            if len(self.token_ids) >= self.max_new_tokens:
                self.finish_reason = FinishReason.LENGTH
                break
        self.text = self._decode(self.token_ids)
        if self.stop:
            self._apply_stop()
        return self._delta()

    def _apply_stop(self) -> None:
        search_from = max(0, self._sent_chars - self.holdback)
        hits = [i for s in self.stop if (i := self.text.find(s, search_from)) >= 0]
        if not hits:
            return
        self.text = self.text[:min(hits)]
        del self.token_ids[self._covering(len(self.text)):]
        del self.logprobs[len(self.token_ids):]
        self.finish_reason = FinishReason.STOP

    def _covering(self, chars: int) -> int:
        """The fewest tokens whose text is at least `chars` long (never fewer than were sent)."""
        k = self._sent_tokens
        while k < len(self.token_ids) and len(self._decode(self.token_ids[:k])) < chars:
            k += 1
        return k

    def _delta(self) -> Delta:
        if self.finish_reason is not None:
            safe = len(self.text)
            tokens = len(self.token_ids)
        else:
            safe = len(self.text) - self.holdback
            while safe > 0 and self.text[safe - 1] == "\ufffd":  # an incomplete UTF-8 sequence
                safe -= 1
            safe = max(safe, self._sent_chars)
            # Only a stop string can take ids back: without one, every id goes out at once.
            tokens = self._covering(safe) if self.stop else len(self.token_ids)
        delta = Delta(self.token_ids[self._sent_tokens : tokens], self.text[self._sent_chars : safe],
                      self.finish_reason, self.logprobs[self._sent_tokens : tokens])
        self._sent_tokens, self._sent_chars = tokens, safe
        return delta
