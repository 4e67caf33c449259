"""The draft model as a source: one session of a model that drafts a token per
forward (the drafter service's, coordinator.clients.RemoteDraftProposer). Unlike a
free source it holds state remotely, learns each round's outcome (`Commit`), and
sends the distribution each token was sampled from."""
from __future__ import annotations

import abc
from typing import Sequence

from specdec.spec.sampling import SamplingConfig
from specdec.spec.types import Commit, Proposal


class ProposerUnavailable(Exception):
    """The model cannot go on with this generation (its service died, lost the
    session, refused it). Drafting only ever saves time, so the loop goes on with
    the request's free sources, or target-only decoding: the output is the same."""

    def __init__(self, reason: str, code=None):
        super().__init__(reason)
        self.code = code  # the grpc.StatusCode behind it, when there is one


class ModelProposer(abc.ABC):
    """A draft model's session for one generation."""

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

    def keep_alive(self) -> None:
        """Between rounds: keep the remote session alive while the request runs;
        raise ProposerUnavailable if it cannot go on."""

    @abc.abstractmethod
    def propose(self, num_tokens: int, sampling: SamplingConfig, commit: Commit | None,
                min_confidence: float = 0.0, prefix: Sequence[int] = ()) -> Proposal:
        """Apply `commit` (absent on the first call), take `prefix` (a free source's
        tokens, drafted before the model's) as drafted, then draft up to `num_tokens`
        tokens after it, stopping after one it gives less than `min_confidence`.
        The proposal holds the model's tokens alone."""

    @abc.abstractmethod
    def end(self) -> None: ...
