"""Proto <-> domain conversions shared by the services (kept out of servicers),
and how a draft distribution travels: no torch, so the coordinator can use them
(the tensor side is specdec.spec.draft_probs)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from specdec.rpc.errors import InvalidArgument
from specdec.spec.sampling import SamplingConfig
from specdec.v1 import common_pb2


def sampling_from_proto(msg: common_pb2.SamplingParams) -> SamplingConfig:
    """Unset optional fields mean "off"; an explicit value is validated as given."""
    return SamplingConfig(
        temperature=float(msg.temperature),
        top_k=int(msg.top_k),
        top_p=float(msg.top_p) if msg.HasField("top_p") else 1.0,
        repetition_penalty=float(msg.repetition_penalty) if msg.HasField("repetition_penalty") else 1.0,
        seed=int(msg.seed) if msg.HasField("seed") else None,
        frequency_penalty=float(msg.frequency_penalty) if msg.HasField("frequency_penalty") else 0.0,
        presence_penalty=float(msg.presence_penalty) if msg.HasField("presence_penalty") else 0.0,
        penalty_start=int(msg.penalty_start),
        constraint=msg.constraint_fingerprint,
    ).validate()


def sampling_to_proto(config: SamplingConfig) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(
        temperature=config.temperature, top_k=config.top_k, top_p=config.top_p,
        repetition_penalty=config.repetition_penalty)
    if config.seed is not None:
        msg.seed = config.seed
    if config.frequency_penalty:
        msg.frequency_penalty = config.frequency_penalty
    if config.presence_penalty:
        msg.presence_penalty = config.presence_penalty
    msg.penalty_start = config.penalty_start
    msg.constraint_fingerprint = config.constraint
    return msg


# --- one drafted position's proposal distribution (common.proto DraftProbs) ---

@dataclass(frozen=True)
class DraftProbs:
    """How one drafted token's proposal distribution travels: sparse (the support
    and its fp16 probabilities), dense (fp16 over the whole vocabulary, no ids),
    or one-hot on the drafted token (both empty: a deterministic proposal, such
    as an n-gram lookup's, needs no probabilities)."""
    token_ids: tuple[int, ...] = ()
    probs_fp16: bytes = b""

    @property
    def one_hot(self) -> bool:
        return not self.token_ids and not self.probs_fp16


ONE_HOT = DraftProbs()


@dataclass(frozen=True)
class Truncation:
    """The drafter samples from its distribution cut to its `top_k` most likely
    tokens and to the fewest of them holding `top_p` of the mass, renormalized;
    only that support goes on the wire. Any proposal distribution is lossless
    as long as the verifier knows it exactly; a narrower one only changes what
    gets accepted (Leviathan et al.: acceptance = sum min(target, draft))."""
    top_k: int = 0      # 0: no cap on the support
    top_p: float = 1.0  # 1: no mass cut

    @property
    def off(self) -> bool:
        return self.top_k == 0 and self.top_p >= 1.0

    def validate(self) -> "Truncation":
        if self.top_k < 0:
            raise InvalidArgument(f"truncation_top_k must be >= 0 (0 = off), got {self.top_k}")
        if not (math.isfinite(self.top_p) and 0.0 < self.top_p <= 1.0):
            raise InvalidArgument(f"truncation_top_p must be in (0, 1] (1 = off), got {self.top_p}")
        return self


def draft_probs_to_proto(entries: Sequence[DraftProbs]) -> list[common_pb2.DraftProbs]:
    return [common_pb2.DraftProbs(token_ids=e.token_ids, probs_fp16=e.probs_fp16) for e in entries]


def draft_probs_from_proto(messages) -> tuple[DraftProbs, ...]:
    return tuple(DraftProbs(tuple(m.token_ids), m.probs_fp16) for m in messages)


def logprobs_to_proto(entries: Sequence[tuple]) -> list[common_pb2.TokenLogprob]:
    """transform.token_logprobs' rows as they travel."""
    return [common_pb2.TokenLogprob(token_id=token, logprob=logprob, top_logprobs=[
        common_pb2.TopLogprob(token_id=t, logprob=lp) for t, lp in top]) for token, logprob, top in entries]
