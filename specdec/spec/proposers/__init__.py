"""Draft sources, by name: who may draft a round's tokens.

Two kinds of source feed a round, in this order:
- free sources (`DraftSource`): tokens found in what the request has seen (an
  n-gram lookup) or made up by a rule; no model runs, so a token costs only its
  row in the verifier's forward, and its proposal is one-hot (no probabilities
  travel). Each is one module here with one `register(...)`;
- the draft model (`MODEL`, model.py): a forward per token, and the distribution
  each token was sampled from.

A request's `Drafts` (drafts.py) asks each of its free sources for a candidate
every round; the coordinator's controller picks one (or none) and how many model
tokens follow it, from the acceptance it learned per source name.

Adding a source: a module with its `DraftSource`, plus its registration (the
module's name in BUILT_IN below). Requests name sources in `Speculation.sources`.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

from specdec.spec.types import Lookup

MODEL = "model"  # the draft model's name as a source (model.py): the one that costs forwards


class DraftSource(Protocol):
    """A free draft source, for one request."""

    def propose(self, context: Sequence[int], max_tokens: int) -> Lookup:
        """A candidate for the round after `context` (the prompt and every token decided
        so far; it only grows): up to `max_tokens` tokens, with `match_length`, how many
        context tokens back it (what its acceptance is learned by: 0 for a rule)."""

    def end(self, output_ids: Sequence[int]) -> None:
        """The request is over; `output_ids` is what it generated."""


@dataclass(frozen=True)
class SourceInputs:
    """What a request gives its free sources."""
    recent: object = None     # the caller's recent outputs under its cache_salt (None: not shared)
    grammar: object = None    # its structured output's GrammarCursor (None: free text)


@dataclass(frozen=True)
class SourceSpec:
    name: str
    build: Callable[[SourceInputs], DraftSource]   # per request
    help: str = ""
    # The acceptance its tokens are planned with before any is measured (None: a lookup's,
    # by how many context tokens back it); learned per source from the rounds after.
    prior: float | None = None


SOURCES: dict[str, SourceSpec] = {}


def register(spec: SourceSpec) -> SourceSpec:
    if spec.name == MODEL or not spec.name.isidentifier():
        raise ValueError(f"a draft source needs a name of its own (an identifier, not {MODEL!r}): {spec.name!r}")
    SOURCES[spec.name] = spec
    return spec


def names() -> tuple[str, ...]:
    """Every source a request may name: the free ones, then the model."""
    return (*SOURCES, MODEL)


BUILT_IN = ("ngram", "grammar")  # the modules that register this package's sources
for _module in BUILT_IN:
    importlib.import_module(f"{__name__}.{_module}")
