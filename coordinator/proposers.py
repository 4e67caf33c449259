"""Proposer kinds, by name: who drafts a request's tokens. A new kind is one
module with its Proposer plus one `register(...)` here (and its ProposerKind value
in coordinator.proto, PROPOSER_KIND_<NAME>, for requests to ask for it by name);
the servicer, the flags and the request mapping take the kinds from this table.

A kind is built per request from what the coordinator has: the drafter (as a
model proposer, when it is up) and the caller's recent outputs. One that needs
the drafter and cannot have it says what it falls back to."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from specdec.spec.hybrid import HybridProposer
from specdec.spec.ngram import RecentOutputs
from specdec.spec.proposer import Proposer


@dataclass(frozen=True)
class ProposerKind:
    name: str
    # (the drafter as a proposer, or None where there is none; recent outputs) -> the request's proposer
    build: Callable[[Proposer | None, RecentOutputs | None], Proposer | None]
    needs_drafter: bool = False    # useless without it: refused where the coordinator runs without one
    uses_drafter: bool = True      # asks for the drafter (so the coordinator connects to one)
    help: str = ""


KINDS: dict[str, ProposerKind] = {}


def register(kind: ProposerKind) -> ProposerKind:
    KINDS[kind.name] = kind
    return kind


register(ProposerKind(
    "hybrid", lambda model, recent: HybridProposer(model, recent),
    help="n-gram lookups in the prompt, the output and recent outputs, free, then the drafter where they find "
         "nothing or beyond them"))
register(ProposerKind("model", lambda model, recent: model, needs_drafter=True, help="the drafter alone"))
register(ProposerKind("ngram", lambda model, recent: HybridProposer(None, recent), uses_drafter=False,
                      help="the lookups alone, no drafter"))
