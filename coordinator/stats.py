"""A request's statistics: what the engine counts as its rounds go (`Stats`, one
`RoundRecord` at a time), and their wire form (`stats_to_proto`, the public API's
GenerationStats: every field but the per-source and probe lists is the Stats
attribute of its name)."""
from __future__ import annotations

from dataclasses import dataclass, field

from specdec.v1 import coordinator_pb2

from coordinator.gamma.explore import ProbeCount
from coordinator.rounds import RoundRecord


@dataclass
class Stats:
    prompt_tokens: int = 0
    gamma: int = 0
    rounds: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    drafted_at: list[int] = field(default_factory=list)   # [position] rounds that drafted this far
    accepted_at: list[int] = field(default_factory=list)  # [position] ... and had it accepted
    prefill_ms: float = 0.0      # the verifier's prefill (with the first token when speculating), the proposer's
    prefix_cached_tokens: int = 0        # prompt tokens the verifier took from its prefix cache
    draft_prefix_cached_tokens: int = 0  # ... and the drafter, of the prompt and first token
    first_token_ms: float = 0.0  # from the start until the first token was decided
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    total_ms: float = 0.0
    output_tokens: int = 0
    fallback: str = ""  # why this request went target-only: the proposer failed, or was down from the start
    verify_queue_ms: float = 0.0   # the verifier's batching: waits for a forward, summed
    draft_queue_ms: float = 0.0
    verify_rows: float = 0.0       # rows of the forwards each verifier call shared, summed over calls
    verify_calls: int = 0          # verifier calls that reported their batching
    sources: dict[str, "SourceCount"] = field(default_factory=dict)  # per draft source, those that drafted
    draft_bytes: int = 0           # draft data sent to the verifier
    drafting_rounds: int = 0
    synthetic_acceptance: float = 0.0  # the verifier's benchmark setting: this output is not the target's
    probes: dict[str, ProbeCount] = field(default_factory=dict)  # exploration taken, per kind (explore.py)
    logprob_bytes: int = 0         # the TokenLogprobs the verifier sent, when the request asked
    expected_output_tokens: float = 0.0  # adaptive γ: what its drafter prefill and probes were priced against
    rpc_ms: float = 0.0            # the calls' time at the coordinator less their time in the services

    def record(self, round: RoundRecord) -> None:
        self.rounds += 1
        self.draft_bytes += round.draft_bytes
        self.drafting_rounds += round.drafted > 0
        for name, drafted, accepted in round.by_source():
            self.sources.setdefault(name, SourceCount()).add(drafted, accepted)
        self.draft_tokens += round.drafted
        self.accepted_tokens += round.accepted
        self.draft_ms += round.draft_ms
        self.verify_ms += round.verify_ms
        self.rpc_ms += round.rpc_ms
        self.verify_queue_ms += round.verify_queue_ms
        self.draft_queue_ms += round.draft_queue_ms
        if round.verify_batch_rows:
            self.verify_rows += round.verify_batch_rows
            self.verify_calls += 1
        grow = round.drafted - len(self.drafted_at)
        if grow > 0:
            self.drafted_at += [0] * grow
            self.accepted_at += [0] * grow
        for position, accepted in enumerate(round.accepted_by_position):
            self.drafted_at[position] += 1
            self.accepted_at[position] += accepted

    @property
    def draft_bytes_per_round(self) -> float:
        return self.draft_bytes / self.drafting_rounds if self.drafting_rounds else 0.0

    @property
    def verify_batch_rows(self) -> float:
        return self.verify_rows / self.verify_calls if self.verify_calls else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return (self.accepted_tokens + self.rounds) / self.rounds if self.rounds else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at)]

    @property
    def overhead_ms(self) -> float:
        return max(0.0, self.total_ms - self.prefill_ms - self.draft_ms - self.verify_ms)

    @property
    def tokens_per_second(self) -> float:
        return self.output_tokens / (self.total_ms / 1e3) if self.total_ms else 0.0


@dataclass
class SourceCount:
    rounds: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0

    def add(self, drafted: int, accepted: int) -> None:
        self.rounds += 1
        self.draft_tokens += drafted
        self.accepted_tokens += accepted

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0


def stats_to_proto(stats: Stats) -> coordinator_pb2.GenerationStats:
    # Every field but the per-source list is the Stats attribute of its name: a new
    # statistic is its proto field and its attribute (test_requests holds them together).
    out = coordinator_pb2.GenerationStats()
    for field in out.DESCRIPTOR.fields:
        if field.name in ("draft_sources", "probes"):
            continue
        value = getattr(stats, field.name)
        if isinstance(value, (list, tuple)):
            getattr(out, field.name).extend(value)
        else:
            setattr(out, field.name, value)
    out.draft_sources.extend(coordinator_pb2.DraftSourceStats(
        source=name, rounds=c.rounds, draft_tokens=c.draft_tokens, accepted_tokens=c.accepted_tokens,
        acceptance_rate=c.acceptance_rate) for name, c in sorted(stats.sources.items()))
    out.probes.extend(coordinator_pb2.ProbeStats(kind=kind, count=p.count, ms=p.ms)
                      for kind, p in sorted(stats.probes.items()))
    return out
