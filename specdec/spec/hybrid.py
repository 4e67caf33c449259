"""The hybrid proposer: n-gram lookups first (free), the draft model where they
find nothing, or after them in the same round.

Each round the coordinator's controller sees the lookup's candidate and picks
how many of its tokens to take and how many model tokens to draft after them
(specdec.spec.proposer: `lookup`, then `propose(n, prefix=...)`). The model drafts
after the prefix in the same call, so a round can mix sources; a round of
lookup tokens alone makes no model call at all. The model's session then falls
behind: what was kept of those rounds reaches it as target text with its next
commit, fed in its next forward (a few more rows, not a step per token).
"""
from __future__ import annotations

from typing import Sequence

from specdec.spec.ngram import MAX_MATCH, NgramIndex, RecentOutputs
from specdec.spec.proposer import NGRAM, Proposer
from specdec.spec.types import Commit, Lookup, Proposal, runs
from specdec.spec.sampling import SamplingConfig
from specdec.spec.wire import ONE_HOT


class HybridProposer(Proposer):
    looks_up = True

    def __init__(self, model: Proposer | None, recent: RecentOutputs | None = None):
        self.model = model            # None: lookups alone
        self.recent = recent          # shared by the coordinator's requests; None: own context only
        self.index = NgramIndex()
        self.prompt_length = 0
        self._model_commit: Commit | None = None  # what the model has not been told yet
        self._model_drafted_last = False          # the previous proposal went through the model
        self._last_prefix: tuple[int, ...] = ()
        self._dropped: Proposer | None = None     # the model, once the request went on without it

    @property
    def drafts_with_model(self) -> bool:
        return self.model is not None

    def start(self, session_id: str, prompt_ids: Sequence[int]) -> None:
        self.index = NgramIndex(prompt_ids)
        self.prompt_length = len(prompt_ids)
        if self.model is not None:
            self.model.start(session_id, prompt_ids)

    def ready(self) -> None:
        if self.model is not None:
            self.model.ready()

    @property
    def prefix_cached_tokens(self) -> int:
        return self.model.prefix_cached_tokens if self.model is not None else 0

    def cached_prefix(self, prompt_ids: Sequence[int]) -> int:
        return self.model.cached_prefix(prompt_ids) if self.model is not None else 0

    def keep_alive(self) -> None:
        if self.model is not None:
            self.model.keep_alive()

    def lookup(self, context: Sequence[int], max_tokens: int) -> Lookup:
        self.index.extend(context[len(self.index) :])
        own = self.index.match(self.index.tokens, max_tokens)
        if self.recent is None or own.match_length >= MAX_MATCH:  # nothing elsewhere can match longer
            return own
        other = self.recent.match(self.index.tokens, max_tokens)
        return other if other.match_length > own.match_length else own

    def free_only(self) -> "HybridProposer":
        """Go on without the model: the lookups stay. Its session is ended with the
        request (`end`), not here: a hung drafter would hold this round up."""
        self._dropped, self.model = self.model or self._dropped, None
        return self

    def _model_commit_for(self, commit: Commit | None) -> Commit | None:
        """`commit` (relative to the previous proposal) as the model must learn it."""
        if commit is None or self._model_drafted_last:
            return commit if commit is not None else self._model_commit
        # The previous round's drafts were the lookup's alone: to the model,
        # what was kept of them is text like the target's own tokens.
        tokens = self._last_prefix[: commit.num_accepted] + commit.target_token_ids
        pending = self._model_commit
        return Commit(pending.num_accepted, pending.target_token_ids + tokens) if pending else Commit(0, tokens)

    def propose(self, num_tokens: int, sampling: SamplingConfig, commit: Commit | None,
                min_confidence: float = 0.0, prefix: Sequence[int] = ()) -> Proposal:
        model_commit = self._model_commit_for(commit)
        self._last_prefix = tuple(prefix)
        if num_tokens > 0 and self.model is not None:
            proposal = self.model.propose(num_tokens, sampling, model_commit, min_confidence, prefix)
            self._model_commit, self._model_drafted_last = None, True
            return proposal
        self._model_commit, self._model_drafted_last = model_commit, False
        # A lookup's draft is deterministic: one-hot proposals, no probabilities to send.
        return Proposal(tuple(prefix), () if sampling.greedy else (ONE_HOT,) * len(prefix),
                        sources=runs((NGRAM, len(prefix))))

    def end(self) -> None:
        if self.recent is not None:
            self.recent.add(self.index.tokens[self.prompt_length :])
        for model in (self.model, self._dropped):
            if model is not None:
                model.end()
