"""Proto <-> domain conversions shared by the services (kept out of servicers)."""
from __future__ import annotations

import numpy as np
import torch

from specdec.errors import InvalidArgument
from specdec.sampling import SamplingConfig
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


def decode_probs(data: bytes, n: int, vocab_size: int) -> torch.Tensor:
    """fp16 bytes -> [n, V] float32, validated, renormalized as the drafter did."""
    expected = n * vocab_size * 2
    if len(data) != expected:
        raise InvalidArgument(
            f"draft_probs_fp16 has {len(data)} bytes; expected {expected} for "
            f"{n} draft tokens x vocab {vocab_size} x 2 bytes")
    array = np.frombuffer(data, dtype="<f2").reshape(n, vocab_size)
    probs = torch.from_numpy(array.astype(np.float32))
    if not torch.isfinite(probs).all():
        raise InvalidArgument("draft_probs_fp16 contains NaN or infinity")
    if (probs < 0).any():
        raise InvalidArgument("draft_probs_fp16 contains negative probabilities")
    sums = probs.sum(dim=-1, keepdim=True, dtype=torch.float64)
    off = (sums - 1.0).abs()
    tolerance = fp16_sum_tolerance(vocab_size)
    if (off > tolerance).any():
        row = int(off.argmax())
        raise InvalidArgument(
            f"draft_probs_fp16 row {row} sums to {float(sums[row]):.6g}; each row must be a probability "
            f"distribution summing to 1 (within {tolerance:.2g}, what fp16 rounding allows)")
    return (probs / sums).float()


def fp16_sum_tolerance(vocab_size: int) -> float:
    """How far from 1 an fp16-rounded distribution may sum: every entry rounds by at
    most half an ulp, relatively 2^-11 for normal values (2^-11 of the sum, in all)
    and absolutely 2^-25 below fp16's smallest normal (each of the vocab_size
    entries). Doubled for the float32 renormalization before rounding."""
    return 2 * (2.0 ** -11 + vocab_size * 2.0 ** -25)
