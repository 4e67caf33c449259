"""Candidate generation behind one small interface.

The coordinator's loop only sees a `Proposer`: the remote drafter model is one,
and the hybrid (specdec.spec.hybrid) is another: n-gram lookups (specdec.spec.ngram),
free, and the draft model where they find nothing or beyond them. The verifier
never knows which produced a draft; it only needs the drafted ids and the
distributions they were sampled from.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Sequence

from specdec.spec.sampling import SamplingConfig
from specdec.spec.wire import DraftProbs

MODEL, NGRAM = "model", "ngram"  # the draft sources this package has: the draft model, n-gram lookups

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


class ProposerUnavailable(Exception):
    """The proposer cannot go on with this generation (its service died, lost
    the session, refused it). Drafting only ever saves time, so the loop goes on
    with the proposer's free drafts (`free_only`), or target-only decoding: the
    output is the same."""

    def __init__(self, reason: str, code=None):
        super().__init__(reason)
        self.code = code  # the grpc.StatusCode behind it, when there is one


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

    @classmethod
    def from_proto(cls, batch) -> "BatchLoad":
        n = batch.forwards
        return cls(n, batch.rows / n, batch.calls / n, batch.queue_ms) if n else cls()


@dataclass(frozen=True)
class Lookup:
    """A free draft candidate: what followed the latest earlier occurrence of the
    context's suffix, and how many tokens of the context that occurrence matches."""
    token_ids: tuple[int, ...] = ()
    match_length: int = 0


@dataclass(frozen=True)
class Proposal:
    token_ids: tuple[int, ...]                 # [n]: the n-gram prefix, then the model's drafts
    # [n] when temperature > 0: the exact distribution each token was sampled
    # from, as it travels (sparse, dense, or one-hot for a lookup's; specdec.spec.wire).
    draft_probs: tuple[DraftProbs, ...] = ()
    confidences: tuple[float, ...] = ()        # the model's, one per token it drafted
    batch: BatchLoad = BatchLoad()             # a model proposer's service: its batching
    sources: Runs = ()                         # who drafted which: runs summing to n

    def __post_init__(self):
        assert sum(n for _, n in self.sources) == len(self.token_ids), (self.sources, len(self.token_ids))

    def tokens_from(self, source: str) -> int:
        return sum(n for name, n in self.sources if name == source)


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

    def output_token_ids(self, draft_token_ids: Sequence[int]) -> list[int]:
        """[num_accepted + 1]: the accepted drafts, then the recovered or bonus token."""
        return [*(int(t) for t in draft_token_ids[: self.num_accepted]), self.next_token_id]


@dataclass(frozen=True)
class Decoded:
    """Target-only tokens from one Decode call."""
    token_ids: list[int]
    batch: BatchLoad = BatchLoad()


class Proposer(abc.ABC):
    """Proposes draft tokens for one generation (one session)."""

    drafts_with_model = True  # propose(n > 0) runs a draft model (costs forwards)
    looks_up = False          # `lookup` may find free drafts
    prefix_cached_tokens = 0  # after ready(): prompt tokens its model took from a prefix cache, not prefilled

    @abc.abstractmethod
    def start(self, session_id: str, prompt_ids: Sequence[int]) -> None: ...

    def ready(self) -> None:
        """Block until the session `start` opened is usable; raise if it is not.
        (Called before the first round, whatever γ that round gets.)"""

    def cached_prefix(self, prompt_ids: Sequence[int]) -> int:
        """Leading tokens of `prompt_ids` that `start` would not have to prefill
        (its model's prefix cache holds them); 0 where unknown."""
        return 0

    def lookup(self, context: Sequence[int], max_tokens: int) -> Lookup:
        """A free draft for the round after `context` (the prompt and every token
        decided so far), if this proposer has a free source."""
        return Lookup()

    def keep_alive(self) -> None:
        """Between rounds: keep what the proposer holds remotely alive while the
        request runs; raise ProposerUnavailable if it cannot go on."""

    def free_only(self) -> "Proposer | None":
        """This proposer without its draft model (whose prefill does not pay, or
        which failed): its free sources alone, or None if it has none."""
        return None

    @abc.abstractmethod
    def propose(self, num_tokens: int, sampling: SamplingConfig, commit: Commit | None,
                min_confidence: float = 0.0, prefix: Sequence[int] = ()) -> Proposal:
        """Apply `commit` (absent on the first call), then propose `prefix` (tokens
        from a lookup) followed by up to `num_tokens` tokens, stopping after one
        the proposer gives less than `min_confidence` (a proposer without
        probabilities may ignore it)."""

    @abc.abstractmethod
    def end(self) -> None: ...
