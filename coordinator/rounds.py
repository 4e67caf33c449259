"""One record per round. The loop writes it once; `Stats`, `Metrics`, the γ
controller and the round's span all read the same record, so what a round
drafted and had accepted is counted in one place."""
from __future__ import annotations

import functools
from dataclasses import dataclass

from specdec.spec.proposers import MODEL
from specdec.spec.types import Runs, judged, runs


@dataclass(frozen=True)
class RoundRecord:
    index: int                  # 0-based, within the request
    gamma: int                  # draft tokens asked for (0: a target-only step)
    drafted: int                # draft tokens proposed: a proposer may stop short of gamma
    accepted: int               # of them, kept by the rejection sampler
    bonus: bool                 # every draft accepted, and the target added one more
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    min_confidence: float = 0.0             # the drafter stopped after a token below this
    confidences: tuple[float, ...] = ()     # [drafted] what the draft gave each of its tokens
    steps: int = 1                          # verifier forwards it took: a γ = 0 round decodes several tokens
    # The model services' batching: rows per forward this round's calls shared, and their queue waits.
    draft_batch_rows: float = 0.0
    draft_batch_calls: float = 0.0
    draft_queue_ms: float = 0.0
    verify_batch_rows: float = 0.0
    verify_batch_calls: float = 0.0
    verify_queue_ms: float = 0.0
    # Who drafted which, in draft order (e.g. a lookup's tokens, then the model's
    # after them); empty: the draft model drafted them all. `lookup_match`: how many
    # context tokens backed the free source's candidate (a lookup's match length).
    sources: Runs = ()
    lookup_match: int = 0
    draft_bytes: int = 0        # draft data sent to the verifier: token ids and probabilities
    rpc_ms: float = 0.0         # the round's calls at the coordinator less their time in the services

    def __post_init__(self):
        assert not self.sources or sum(n for _, n in self.sources) == self.drafted, (self.sources, self.drafted)

    def by_source(self) -> list[tuple[str, int, int]]:
        """(source, drafted, accepted) for each source that drafted, in draft order."""
        return self._judged

    @functools.cached_property
    def _judged(self) -> list[tuple[str, int, int]]:
        # Worked out once: the stats, the metrics, the controller and the span each read it every round.
        return judged(self.sources or runs((MODEL, self.drafted)), self.accepted)

    def drafted_by(self, source: str) -> int:
        return sum(drafted for name, drafted, _ in self.by_source() if name == source)

    def accepted_by(self, source: str) -> int:
        return sum(accepted for name, _, accepted in self.by_source() if name == source)

    def judged_from(self, source: str) -> bool:
        """Whether the verifier judged any of `source`'s drafts: every draft before its first was kept."""
        offset = 0
        for name, drafted, _ in self.by_source():
            if name == source:
                return self.accepted >= offset
            offset += drafted
        return False

    @property
    def free_source(self) -> str:
        """The free source whose tokens led this round ("": none)."""
        return next((name for name, _, _ in self.by_source() if name != MODEL), "")

    @property
    def source(self) -> str:
        """What drafted this round: "ngram", "model", "ngram+model", or "" (nothing)."""
        return "+".join(name for name, _, _ in self.by_source())

    @property
    def accepted_by_position(self) -> list[bool]:
        """[drafted]: was the draft at each position accepted."""
        return [position < self.accepted for position in range(self.drafted)]

    @property
    def first_rejected_position(self) -> int:
        """-1 when nothing was rejected (all accepted, or nothing drafted)."""
        return self.accepted if self.accepted < self.drafted else -1

    def span_attributes(self) -> dict:
        return {"specdec.round.index": self.index, "specdec.gamma": self.gamma,
                "specdec.draft_tokens": self.drafted, "specdec.accepted_tokens": self.accepted,
                "specdec.first_rejected_position": self.first_rejected_position, "specdec.bonus": self.bonus,
                "specdec.draft_ms": self.draft_ms, "specdec.verify_ms": self.verify_ms,
                "specdec.min_confidence": self.min_confidence,
                "specdec.draft.batch_rows": self.draft_batch_rows, "specdec.draft.batch_calls": self.draft_batch_calls,
                "specdec.draft.queue_ms": self.draft_queue_ms,
                "specdec.verify.batch_rows": self.verify_batch_rows,
                "specdec.verify.batch_calls": self.verify_batch_calls,
                "specdec.verify.queue_ms": self.verify_queue_ms,
                "specdec.draft.source": self.source, "specdec.draft_bytes": self.draft_bytes,
                "specdec.lookup.match_length": self.lookup_match, "specdec.rpc_ms": self.rpc_ms,
                **{f"specdec.draft.{name}.{key}": value for name, drafted, accepted in self.by_source()
                   for key, value in (("draft_tokens", drafted), ("accepted_tokens", accepted))}}
