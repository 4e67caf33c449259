"""The "ngram" draft source: n-gram lookups in the tokens a request has seen (prompt lookup
decoding) and in recent requests' outputs (as SuffixDecoding searches its
global suffix tree). What followed the latest earlier occurrence of the
context's suffix is proposed as a draft; no model runs, so a draft token costs
only its row in the verifier's forward. Text that copies from its input (rag,
summarization, code edits) repeats long spans, and those spans come for free.

The index only ever grows: it holds the accepted context, never drafts (the
caller passes the context as it stands, and the index takes the new tail)."""
from __future__ import annotations

import threading
from collections import deque
from typing import Sequence

from specdec.spec.proposers import SourceSpec, register
from specdec.spec.types import Lookup

NGRAM = "ngram"  # the source's name
NGRAM_SIZES = (8, 4, 2, 1)  # tried longest first; a hit's match is then measured exactly, up to MAX_MATCH
MAX_MATCH = 32


class NgramIndex:
    """Where each n-gram (n in NGRAM_SIZES) of a growing token sequence last
    occurred: per n, a dict from the n-gram to the position right after it.
    An n-gram is entered once a token follows it, so the sequence's own suffix
    is never its own match."""

    def __init__(self, tokens: Sequence[int] = ()):
        self.tokens: list[int] = []
        self.after: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in NGRAM_SIZES}
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            p = len(self.tokens)
            for n in NGRAM_SIZES:
                if n <= p:
                    self.after[n][tuple(self.tokens[p - n : p])] = p
            self.tokens.append(int(token))

    def match(self, context: Sequence[int], max_tokens: int,
              keys: dict[int, tuple[int, ...]] | None = None) -> Lookup:
        """The continuation (up to `max_tokens`) of the latest occurrence of the
        longest n-gram that ends `context`, and how many tokens of `context`
        that occurrence matches (up to MAX_MATCH): the evidence behind it.
        `keys`: `suffix_keys(context)`, when many indexes are searched for one context."""
        if max_tokens <= 0:
            return Lookup()
        keys = suffix_keys(context) if keys is None else keys
        for n, key in keys.items():
            at = self.after[n].get(key)
            if at is None:
                continue
            length = n
            while (length < MAX_MATCH and at - length - 1 >= 0 and len(context) - length - 1 >= 0
                   and self.tokens[at - length - 1] == context[len(context) - length - 1]):
                length += 1
            return Lookup(tuple(self.tokens[at : at + max_tokens]), length)
        return Lookup()


def suffix_keys(context: Sequence[int]) -> dict[int, tuple[int, ...]]:
    """The n-grams ending `context`, longest first: what an index is asked for."""
    return {n: tuple(context[len(context) - n :]) for n in NGRAM_SIZES if n <= len(context)}


class RecentOutputs:
    """Recent requests' outputs, each indexed, searchable by any request: text a
    service writes again and again (templates, boilerplate, agents' tool calls)
    is drafted for free. Bounded in tokens, the oldest dropped first; 0 keeps
    none (an operator who wants no output of one request to shape the timing of
    another's; the output itself never depends on it)."""

    def __init__(self, max_tokens: int = 16384):
        self.max_tokens = max_tokens
        self._outputs: deque[NgramIndex] = deque()
        self._tokens = 0
        self._lock = threading.Lock()

    @property
    def tokens(self) -> int:
        return self._tokens

    def add(self, tokens: Sequence[int]) -> None:
        if self.max_tokens <= 0 or len(tokens) < 2:
            return
        index = NgramIndex(tokens[-self.max_tokens :])  # built outside the lock
        with self._lock:
            self._outputs.append(index)
            self._tokens += len(index)
            while self._tokens > self.max_tokens:
                self._tokens -= len(self._outputs.popleft())

    def match(self, context: Sequence[int], max_tokens: int) -> Lookup:
        """The longest match over the stored outputs (the newest on ties)."""
        with self._lock:
            outputs = list(self._outputs)
        best = Lookup()
        tail = context[-MAX_MATCH - 1 :]
        keys = suffix_keys(tail)  # once, not per output
        for index in reversed(outputs):
            found = index.match(tail, max_tokens, keys)
            if found.match_length > best.match_length:
                best = found
        return best


class NgramSource:
    """The lookups of one request: in its own tokens, then in the caller's recent
    outputs (`recent`, shared by the caller's requests under one cache_salt; None:
    its own tokens only); the longer match wins."""

    def __init__(self, recent: RecentOutputs | None = None):
        self.recent = recent
        self.index = NgramIndex()

    def propose(self, context: Sequence[int], max_tokens: int) -> Lookup:
        self.index.extend(context[len(self.index) :])
        own = self.index.match(self.index.tokens, max_tokens)
        if self.recent is None or own.match_length >= MAX_MATCH:  # nothing elsewhere can match longer
            return own
        other = self.recent.match(self.index.tokens, max_tokens)
        return other if other.match_length > own.match_length else own

    def end(self, output_ids: Sequence[int]) -> None:
        if self.recent is not None:
            self.recent.add(output_ids)


register(SourceSpec(NGRAM, lambda inputs: NgramSource(inputs.recent), help="n-gram lookups in the prompt, the output and the caller's recent "
                                               "outputs"))
