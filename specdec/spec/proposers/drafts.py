"""A request's draft sources together: its free sources (each asked for a
candidate every round) and the draft model, drafting after a free source's
tokens in the same round or alone.

Each round the coordinator's controller sees the candidates and picks one (or
none), how many of its tokens to take, and how many model tokens to draft after
them (`candidates`, then `propose(n, prefix=...)`). The model drafts after the
prefix in the same call, so a round can mix sources; a round of a free source's
tokens alone makes no model call at all. The model's session then falls behind:
what was kept of those rounds reaches it as target text with its next commit,
fed in its next forward (a few more rows, not a step per token).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Mapping, Sequence

from specdec.spec.proposers import MODEL, DraftSource
from specdec.spec.proposers.model import ModelProposer
from specdec.spec.sampling import SamplingConfig
from specdec.spec.types import Commit, Lookup, Proposal, runs


class Drafts:
    def __init__(self, model: ModelProposer | None, sources: Mapping[str, DraftSource] = {}, grammar=None):
        self.model = model                    # None: free sources alone
        self.sources = dict(sources)          # name -> this request's free source
        self.grammar = grammar                # a structured output's GrammarCursor: lookups are cut by it
        self.prompt_length = 0
        self._context: Sequence[int] = ()     # the context of the latest round (it only grows)
        self._model_commit: Commit | None = None  # what the model has not been told yet
        self._model_drafted_last = False          # the previous proposal went through the model
        self._last_prefix: tuple[int, ...] = ()
        self._dropped: ModelProposer | None = None  # the model, once the request went on without it

    @property
    def drafts_with_model(self) -> bool:
        return self.model is not None

    def start(self, session_id: str, prompt_ids: Sequence[int]) -> None:
        self.prompt_length, self._context = len(prompt_ids), prompt_ids
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

    def candidates(self, context: Sequence[int], max_tokens: int) -> list[Lookup]:
        """Each free source's candidate for the round after `context`, named by source;
        under a grammar, each cut before the first token it forbids (such a token
        would be rejected, and the drafter could not draft after it)."""
        self._context = context
        if self.grammar is not None:
            self.grammar.follow(context)
        found = []
        for name, source in self.sources.items():
            lookup = source.propose(context, max_tokens)
            tokens = tuple(lookup.token_ids[:max_tokens])
            if self.grammar is not None and not lookup.forced:
                tokens = tokens[:self.grammar.valid_prefix(tokens)]
            if tokens:
                found.append(replace(lookup, token_ids=tokens, source=name))
        return found

    def free_only(self) -> "Drafts | None":
        """Go on without the model: the free sources stay (None: there are none).
        Its session is ended with the request (`end`), not here: a hung drafter
        would hold this round up."""
        self._dropped, self.model = self.model or self._dropped, None
        return self if self.sources else None

    def _model_commit_for(self, commit: Commit | None) -> Commit | None:
        """`commit` (relative to the previous proposal) as the model must learn it."""
        if commit is None or self._model_drafted_last:
            return commit if commit is not None else self._model_commit
        # The previous round's drafts were a free source's alone: to the model,
        # what was kept of them is text like the target's own tokens.
        tokens = self._last_prefix[: commit.num_accepted] + commit.target_token_ids
        pending = self._model_commit
        return Commit(pending.num_accepted, pending.target_token_ids + tokens) if pending else Commit(0, tokens)

    def propose(self, num_tokens: int, sampling: SamplingConfig, commit: Commit | None,
                min_confidence: float = 0.0, prefix: Lookup = Lookup()) -> Proposal:
        """`prefix`: the free source's tokens taken (its candidate, cut to the plan),
        then up to `num_tokens` of the model's; `commit`: the previous round's outcome."""
        model_commit = self._model_commit_for(commit)
        self._last_prefix = free = tuple(prefix.token_ids)
        drafted = Proposal(())
        if num_tokens > 0 and self.model is not None:
            drafted = self.model.propose(num_tokens, sampling, model_commit, min_confidence, free)
            self._model_commit, self._model_drafted_last = None, True
        else:
            self._model_commit, self._model_drafted_last = model_commit, False
        return Proposal((*free, *drafted.token_ids), drafted.draft_probs, drafted.confidences, drafted.batch,
                        runs((prefix.source, len(free)), (MODEL, len(drafted.token_ids))), free_tokens=len(free))

    def end(self) -> None:
        output = self._context[self.prompt_length :]
        for source in self.sources.values():
            source.end(output)
        for model in (self.model, self._dropped):
            if model is not None:
                model.end()
