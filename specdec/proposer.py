"""Candidate generation behind one small interface.

The coordinator's loop only sees a `Proposer`: the remote drafter model is one,
and a prompt-lookup n-gram proposer is another (specdec.ngram). The verifier
never knows which produced a draft; it only needs the drafted ids and the
distributions they were sampled from.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Sequence

from specdec.sampling import SamplingConfig


class ProposerUnavailable(Exception):
    """The proposer cannot go on with this generation (its service died, lost
    the session, refused it). Drafting only ever saves time, so the loop goes on
    with target-only decoding: the output is the same."""

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
class Proposal:
    token_ids: tuple[int, ...]                 # [n]
    # [n, vocab] float16 little-endian bytes when temperature > 0: the exact
    # distributions the tokens were sampled from (see specdec.wire).
    draft_probs_fp16: bytes = b""
    confidences: tuple[float, ...] = ()        # [n] when the proposer has them
    batch: BatchLoad = BatchLoad()             # a model proposer's service: its batching


@dataclass(frozen=True)
class Verdict:
    """The rejection sampler's outcome for one proposal, as the coordinator sees it."""
    num_accepted: int     # draft tokens kept, a prefix of the proposal
    next_token_id: int    # the target's own token after them: recovered, or bonus when all were accepted
    bonus: bool
    batch: BatchLoad = BatchLoad()


@dataclass(frozen=True)
class Decoded:
    """Target-only tokens from one Decode call."""
    token_ids: list[int]
    batch: BatchLoad = BatchLoad()


class Proposer(abc.ABC):
    """Proposes draft tokens for one generation (one session)."""

    @abc.abstractmethod
    def start(self, session_id: str, prompt_ids: Sequence[int]) -> None: ...

    def ready(self) -> None:
        """Block until the session `start` opened is usable; raise if it is not.
        (Called before the first round, whatever γ that round gets.)"""

    @abc.abstractmethod
    def propose(self, num_tokens: int, sampling: SamplingConfig, commit: Commit | None,
                min_confidence: float = 0.0) -> Proposal:
        """Apply `commit` (absent on the first call), then propose up to `num_tokens`
        tokens, stopping after one the proposer gives less than `min_confidence`
        (a proposer without probabilities may ignore it)."""

    @abc.abstractmethod
    def end(self) -> None: ...
