"""Proposer kinds: named sets of draft sources (specdec.spec.proposers), which
requests ask for by their ProposerKind value (PROPOSER_KIND_<NAME>) and the
server's --proposer names; a request may instead name its sources
(`Speculation.sources`). A kind is data: adding a draft source adds nothing here
(the hybrid takes every registered free source).

A request's `Drafts` is built from its sources and what the coordinator has:
the drafter (as the model, when it is up) and the caller's recent outputs."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from specdec.rpc.errors import InvalidArgument, clip
from specdec.spec.proposers import MODEL, SOURCES, SourceInputs, names
from specdec.spec.proposers.drafts import Drafts
from specdec.spec.proposers.model import ModelProposer


@dataclass(frozen=True)
class ProposerKind:
    name: str
    sources: Callable[[], tuple[str, ...]]   # read when used: a source registered later is included
    help: str = ""

    @property
    def uses_drafter(self) -> bool:          # asks for the drafter (so the coordinator connects to one)
        return MODEL in self.sources()

    @property
    def needs_drafter(self) -> bool:
        return needs_drafter(self.sources())


KINDS: dict[str, ProposerKind] = {kind.name: kind for kind in (
    ProposerKind("hybrid", names, help="every free source (n-gram lookups in the prompt, the output and recent "
                                       "outputs; a structured output's forced tokens), then the drafter where they "
                                       "find nothing or beyond them"),
    ProposerKind("model", lambda: (MODEL,), help="the drafter alone"),
    ProposerKind("ngram", lambda: ("ngram",), help="the lookups alone, no drafter"),
)}


def needs_drafter(sources: tuple[str, ...]) -> bool:
    """Useless without the drafter: refused where the coordinator runs without one."""
    return tuple(sources) == (MODEL,)


def checked_sources(asked) -> tuple[str, ...]:
    """A request's `Speculation.sources`, each known and named once."""
    asked = tuple(asked)
    unknown = [name for name in asked if name not in names()]
    if unknown or len(set(asked)) != len(asked):
        raise InvalidArgument(f"speculation.sources={clip(list(asked))}: name each source once, from "
                              f"{', '.join(names())}", "speculation.sources")
    return asked


def build(sources: tuple[str, ...], model: ModelProposer | None, recent, grammar=None) -> Drafts | None:
    """The request's drafts from its sources: the model where it is asked for and
    there is one; None where nothing is left to draft with (target-only).
    `grammar`: a structured output's GrammarCursor, which its sources draft under."""
    inputs = SourceInputs(recent, grammar)
    free = {name: SOURCES[name].build(inputs) for name in sources if name != MODEL}
    model = model if MODEL in sources else None
    return Drafts(model, free, grammar) if model is not None or free else None
