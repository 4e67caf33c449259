"""Candidate generation behind one small interface.

The coordinator's loop only sees a `Proposer`: the remote drafter model is one,
and the hybrid (specdec.spec.hybrid) is another: n-gram lookups (specdec.spec.ngram),
free, and the draft model where they find nothing or beyond them. The verifier
never knows which produced a draft; it only needs the drafted ids and the
distributions they were sampled from.
"""
from __future__ import annotations

import abc
from typing import Sequence

from specdec.spec.sampling import SamplingConfig
from specdec.spec.types import Commit, Lookup, Proposal

MODEL, NGRAM = "model", "ngram"  # the draft sources this package has: the draft model, n-gram lookups

class ProposerUnavailable(Exception):
    """The proposer cannot go on with this generation (its service died, lost
    the session, refused it). Drafting only ever saves time, so the loop goes on
    with the proposer's free drafts (`free_only`), or target-only decoding: the
    output is the same."""

    def __init__(self, reason: str, code=None):
        super().__init__(reason)
        self.code = code  # the grpc.StatusCode behind it, when there is one


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
