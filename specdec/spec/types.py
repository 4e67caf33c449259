"""The round's types: what a draft is made of (runs of (source, tokens)), what the
proposer learns of the round before (`Commit`), what it proposes (`Proposal`),
what the rejection sampler decides (`RejectionOutput`) and what a target-only
call returns (`Decoded`); and how full the forwards a call shared were (`BatchLoad`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

# A draft by source: (source name, tokens) runs in draft order, e.g. a lookup's
# tokens and then the model's after them. Every count per source is keyed so.
Runs = tuple[tuple[str, int], ...]


def runs(*pairs: tuple[str, int]) -> Runs:
    """The (source, tokens) pairs that drafted anything, in order."""
    return tuple((source, n) for source, n in pairs if n > 0)


def judged(draft: Runs, accepted: int) -> list[tuple[str, int, int]]:
    """(source, drafted, accepted) per run: the rejection sampler keeps a prefix,
    so a run is accepted up to where the first rejection fell."""
    out, offset = [], 0
    for source, n in draft:
        out.append((source, n, max(0, min(n, accepted - offset))))
        offset += n
    return out


@dataclass(frozen=True)
class Commit:
    """The outcome of the previous round, as the proposer must learn it."""
    num_accepted: int                          # drafted tokens the verifier kept
    target_token_ids: tuple[int, ...] = ()     # recovered/bonus token, and any target-only tokens since


@dataclass(frozen=True)
class BatchLoad:
    """What a model service's batching scheduler did for one call: how full the
    forwards it shared were, and how long it waited for them."""
    forwards: int = 0
    mean_rows: float = 0.0     # rows per forward, every call's
    mean_calls: float = 0.0    # calls per forward, itself included (1: it ran alone)
    queue_ms: float = 0.0
    service_ms: float = 0.0    # the call's time in the service (0: no call reached one)

    @classmethod
    def from_proto(cls, batch) -> "BatchLoad":
        n = batch.forwards
        return cls(n, batch.rows / n, batch.calls / n, batch.queue_ms, batch.service_ms) if n else \
            cls(service_ms=batch.service_ms)

    def rpc_ms(self, call_ms: float) -> float:
        """Of a call that took `call_ms` at its client, the part outside the service (0 where no
        service answered it: a free source's proposal)."""
        return max(call_ms - self.service_ms, 0.0) if self.service_ms else 0.0


@dataclass(frozen=True)
class Lookup:
    """A free source's draft candidate (for a lookup: what followed the latest earlier
    occurrence of the context's suffix, and how many tokens of the context that
    occurrence matches), and the name of the source that found it."""
    token_ids: tuple[int, ...] = ()
    match_length: int = 0
    source: str = ""
    # The grammar admits these tokens' text alone (proposers/grammar.py): kept unless the
    # target writes the same text in other tokens.
    forced: bool = False


@dataclass(frozen=True)
class Proposal:
    token_ids: tuple[int, ...]                 # [n]: a free source's tokens, then the model's drafts
    # [n - free_tokens] when temperature > 0: the exact distribution each model token was
    # sampled from, as it travels (common.proto DraftProbs, sparse or dense), untouched.
    draft_probs: tuple = ()
    confidences: tuple[float, ...] = ()        # the model's, one per token it drafted
    batch: BatchLoad = BatchLoad()             # a model proposer's service: its batching
    sources: Runs = ()                         # who drafted which: runs summing to n
    free_tokens: int = 0                       # the leading tokens from a free source: one-hot, no draft_probs

    def __post_init__(self):
        assert sum(n for _, n in self.sources) == len(self.token_ids), (self.sources, len(self.token_ids))
        assert 0 <= self.free_tokens <= len(self.token_ids), (self.free_tokens, len(self.token_ids))


@dataclass(frozen=True)
class RejectionOutput:
    """The rejection sampler's outcome for one proposal: made in the verifier
    (specdec.spec.rejection), and as the coordinator receives it (with the batching
    the call shared, and what its draft weighed on the wire)."""
    num_accepted: int     # draft tokens kept, a prefix of the proposal (0..gamma)
    next_token_id: int    # the target's own token after them: recovered, or bonus when all were accepted
    bonus: bool           # every draft was accepted
    batch: BatchLoad = BatchLoad()
    draft_bytes: int = 0  # the draft data sent to the verifier: token ids and probabilities, serialized
    # When asked: the target's TokenLogprob of each output token (the accepted drafts', then
    # next_token_id's): (id, logprob, top) rows in the verifier, their protos in the coordinator.
    logprobs: tuple = ()

    def output_token_ids(self, draft_token_ids: Sequence[int]) -> list[int]:
        """[num_accepted + 1]: the accepted drafts, then the recovered or bonus token."""
        return [*(int(t) for t in draft_token_ids[: self.num_accepted]), self.next_token_id]


@dataclass(frozen=True)
class Decoded:
    """Target-only tokens from one Decode call."""
    token_ids: list[int]
    batch: BatchLoad = BatchLoad()
    logprobs: tuple = ()   # when asked: one TokenLogprob per token
