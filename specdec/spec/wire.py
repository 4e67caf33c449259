"""Proto <-> domain conversions shared by the services (kept out of servicers)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

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
    ).validate()


def sampling_to_proto(config: SamplingConfig) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(
        temperature=config.temperature, top_k=config.top_k, top_p=config.top_p,
        repetition_penalty=config.repetition_penalty)
    if config.seed is not None:
        msg.seed = config.seed
    return msg


def round_probs_for_wire(probs: torch.Tensor) -> torch.Tensor:
    """The distribution actually sent: fp16-rounded, renormalized in float32.

    The drafter samples from exactly this tensor and the verifier rebuilds exactly
    this tensor from the bytes, so the rejection sampler sees the true proposal
    distribution despite the compact fp16 encoding.
    """
    rounded = probs.to(torch.float16).float()
    return rounded / rounded.sum(dim=-1, keepdim=True)


def encode_probs(probs: torch.Tensor) -> bytes:
    """[n, V] float probs -> little-endian fp16 bytes."""
    return probs.detach().to("cpu", torch.float16).numpy().astype("<f2", copy=False).tobytes()


def decode_probs(data: bytes, n: int, vocab_size: int, where: str = "draft_probs_fp16") -> torch.Tensor:
    """fp16 bytes -> [n, V] float32, validated, renormalized as the drafter did."""
    expected = n * vocab_size * 2
    if len(data) != expected:
        raise InvalidArgument(
            f"{where} has {len(data)} bytes; expected {expected} for "
            f"{n} draft tokens x vocab {vocab_size} x 2 bytes")
    array = np.frombuffer(data, dtype="<f2").reshape(n, vocab_size)
    probs = torch.from_numpy(array.astype(np.float32))
    if not torch.isfinite(probs).all():
        raise InvalidArgument(f"{where} contains NaN or infinity")
    if (probs < 0).any():
        raise InvalidArgument(f"{where} contains negative probabilities")
    sums = probs.sum(dim=-1, keepdim=True, dtype=torch.float64)
    off = (sums - 1.0).abs()
    tolerance = fp16_sum_tolerance(vocab_size)
    if (off > tolerance).any():
        row = int(off.argmax())
        raise InvalidArgument(
            f"{where} row {row} sums to {float(sums[row]):.6g}; each row must be a probability "
            f"distribution summing to 1 (within {tolerance:.2g}, what fp16 rounding allows)")
    return (probs / sums).float()


def fp16_sum_tolerance(vocab_size: int) -> float:
    """How far from 1 an fp16-rounded distribution may sum: every entry rounds by at
    most half an ulp, relatively 2^-11 for normal values (2^-11 of the sum, in all)
    and absolutely 2^-25 below fp16's smallest normal (each of the vocab_size
    entries). Doubled for the float32 renormalization before rounding."""
    return 2 * (2.0 ** -11 + vocab_size * 2.0 ** -25)


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


def truncate_for_wire(probs: torch.Tensor, truncation: Truncation) -> DraftProbs:
    """[V] float probabilities -> the sparse proposal the drafter samples from and sends."""
    assert probs.dim() == 1, probs.shape
    probs = probs.float()
    k = truncation.top_k or probs.shape[0]
    values, ids = probs.topk(min(k, probs.shape[0]))  # descending
    if truncation.top_p < 1.0:
        # The fewest top tokens holding top_p of the whole mass (at least one; at most top_k).
        keep = int((values.cumsum(0) < truncation.top_p * probs.sum()).sum()) + 1
        values, ids = values[:keep], ids[:keep]
    rounded = (values / values.sum()).to(torch.float16)  # the support renormalized, then rounded
    kept = rounded > 0  # a probability fp16 rounds to 0 could never be drawn: leave it out
    return DraftProbs(tuple(ids[kept].tolist()), encode_probs(rounded[kept]))


def _fp16_values(entry: DraftProbs) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(entry.probs_fp16, dtype="<f2").astype(np.float32))


def sparse_probs(entry: DraftProbs, values: torch.Tensor | None = None) -> torch.Tensor:
    """A sparse entry's probabilities [m] in float32, renormalized: what the
    drafter samples from and the verifier scores with, computed identically
    (`values`: the entry's, already decoded)."""
    values = _fp16_values(entry) if values is None else values
    return values / values.sum()


def dense_for_wire(probs: torch.Tensor) -> DraftProbs:
    """[V] -> the untruncated proposal (2 bytes per vocabulary entry)."""
    return DraftProbs((), encode_probs(probs))


def draft_probs_tensor(entries: Sequence[DraftProbs], draft_token_ids: Sequence[int],
                       vocab_size: int) -> torch.Tensor:
    """The verifier's [gamma, V] float32 draft_probs from one entry per drafted
    token, validated: each must be a distribution that gives its token a chance."""
    if len(entries) != len(draft_token_ids):
        raise InvalidArgument(f"draft_probs has {len(entries)} entries for {len(draft_token_ids)} draft tokens; "
                              "send one per drafted token (an empty entry is a one-hot proposal)")
    out = torch.zeros(len(entries), vocab_size)
    for i, (entry, token) in enumerate(zip(entries, draft_token_ids)):
        where = f"draft_probs[{i}]"
        if entry.one_hot:
            out[i, token] = 1.0
            continue
        if not entry.token_ids:
            out[i] = decode_probs(entry.probs_fp16, 1, vocab_size, where)[0]
        else:
            out[i, _support(entry, vocab_size, where)] = _sparse_values(entry, where)
        if out[i, token] <= 0:
            raise InvalidArgument(f"{where} gives its drafted token {token} probability 0; each token must be "
                                  "sampled from the distribution sent with it")
    return out


def _support(entry: DraftProbs, vocab_size: int, where: str) -> torch.Tensor:
    ids = torch.tensor(entry.token_ids, dtype=torch.long)
    if int(ids.max()) >= vocab_size:
        raise InvalidArgument(f"{where}.token_ids has id {int(ids.max())}, outside the vocabulary ({vocab_size})")
    if ids.unique().numel() != ids.numel():
        raise InvalidArgument(f"{where}.token_ids repeats an id; each support token must appear once")
    return ids


def _sparse_values(entry: DraftProbs, where: str) -> torch.Tensor:
    m = len(entry.token_ids)
    if len(entry.probs_fp16) != 2 * m:
        raise InvalidArgument(f"{where}.probs_fp16 has {len(entry.probs_fp16)} bytes; expected {2 * m} "
                              f"for {m} support tokens x 2 bytes")
    values = _fp16_values(entry)
    if not torch.isfinite(values).all() or (values < 0).any() or float(values.sum()) <= 0:
        raise InvalidArgument(f"{where}.probs_fp16 must be finite, non-negative probabilities with a positive sum")
    total = float(values.double().sum())
    tolerance = fp16_sum_tolerance(m)
    # A truncated distribution's kept mass is below 1 before renormalizing; the
    # drafter sends it renormalized only by fp16 rounding, so it sums to ~1 too.
    if abs(total - 1.0) > max(tolerance, 1e-3):
        raise InvalidArgument(f"{where}.probs_fp16 sums to {total:.6g}; a sparse distribution must sum to 1 "
                              "(renormalize the truncated support before encoding)")
    return sparse_probs(entry, values)


def draft_probs_to_proto(entries: Sequence[DraftProbs]) -> list[common_pb2.DraftProbs]:
    return [common_pb2.DraftProbs(token_ids=e.token_ids, probs_fp16=e.probs_fp16) for e in entries]


def draft_probs_from_proto(messages) -> tuple[DraftProbs, ...]:
    return tuple(DraftProbs(tuple(m.token_ids), m.probs_fp16) for m in messages)
