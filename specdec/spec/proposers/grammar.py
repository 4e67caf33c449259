"""The grammar's forced tokens as drafts: where a request's constraint admits one
continuation (a key, `": "`, a closing brace, the rest of a choice), its tokens
are known before any model runs. They join the round's draft like a lookup's,
one-hot, with no draft-model call.

They are not always kept: the grammar forces text, and llguidance's forced
tokens are that text's canonical tokenization, while the target may write it in
other tokens. The verifier judges them as any draft (a greedy target keeps what
it would have written itself), so the output is the target's under the
constraint; the controller learns this source's acceptance by its name.
"""
from __future__ import annotations

from typing import Sequence

from specdec.spec.proposers import SourceInputs, SourceSpec, register
from specdec.spec.types import Lookup

GRAMMAR = "grammar"  # the source's name


class GrammarSource:
    def __init__(self, grammar=None):
        self.grammar = grammar   # the request's GrammarCursor (None: free text, nothing is forced)

    def propose(self, context: Sequence[int], max_tokens: int) -> Lookup:
        if self.grammar is None or max_tokens <= 0:
            return Lookup()
        self.grammar.follow(context)
        return Lookup(tuple(self.grammar.forced()[:max_tokens]), forced=True)

    def end(self, output_ids: Sequence[int]) -> None:
        pass


def _build(inputs: SourceInputs) -> GrammarSource:
    return GrammarSource(inputs.grammar)


# Planned as nearly always kept before any round says otherwise: only a tokenization the
# target does not share rejects them (a lookup's prior, by match length, starts at 0.15,
# so the controller would seldom try them on outputs as short as a JSON argument list).
FORCED_PRIOR = 0.9

register(SourceSpec(GRAMMAR, _build, help="the tokens a structured output's grammar forces (a key, a brace, "
                                          "the rest of a choice); nothing without a constraint",
                    prior=FORCED_PRIOR))
