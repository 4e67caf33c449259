"""One record per round. The loop writes it once; `Stats`, `Metrics`, the γ
controller and the round's span all read the same record, so what a round
drafted and had accepted is counted in one place."""
from __future__ import annotations

from dataclasses import dataclass

from specdec.spec.proposer import MODEL, NGRAM


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
    # Where the drafts came from: the first `ngram_drafted` from a lookup (free),
    # whose match was `ngram_match` tokens long; the rest from the draft model.
    ngram_drafted: int = 0
    ngram_match: int = 0
    draft_bytes: int = 0        # draft data sent to the verifier: token ids and probabilities

    @property
    def ngram_accepted(self) -> int:
        return min(self.accepted, self.ngram_drafted)

    @property
    def model_drafted(self) -> int:
        return self.drafted - self.ngram_drafted

    @property
    def model_accepted(self) -> int:
        return max(0, self.accepted - self.ngram_drafted)

    def by_source(self) -> list[tuple[str, int, int]]:
        """(source, drafted, accepted) for each source that drafted, in draft order."""
        return [(name, drafted, accepted) for name, drafted, accepted in (
            (NGRAM, self.ngram_drafted, self.ngram_accepted), (MODEL, self.model_drafted, self.model_accepted))
            if drafted]

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
                "specdec.spec.ngram.draft_tokens": self.ngram_drafted, "specdec.spec.ngram.accepted_tokens": self.ngram_accepted,
                "specdec.spec.ngram.match_length": self.ngram_match,
                "specdec.model.draft_tokens": self.model_drafted, "specdec.model.accepted_tokens": self.model_accepted}
