"""Draft distributions as tensors: the fp16 rounding both sides agree on, the
drafter's truncated or dense form, and the verifier's [gamma, V] rebuild,
validated. torch, on the model services only (see specdec.spec.wire)."""
from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np
import torch

from specdec.rpc.errors import InvalidArgument
from specdec.spec.transform import sample_at
from specdec.spec.wire import DraftProbs, Truncation


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


def decode_probs(data: bytes, n: int, vocab_size: int, where: str = "draft_probs") -> torch.Tensor:
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


class Drawn(NamedTuple):
    """One sampled draft token and the proposal it was drawn from, still on the model's device."""
    token: torch.Tensor                # int64 scalar
    confidence: torch.Tensor           # float32 scalar: the proposal's probability of the token
    support: torch.Tensor | None       # [k] a truncated proposal's ids, most likely first; None: dense
    probs: torch.Tensor                # fp16 [k] (zeros past the kept support) or [V]: what travels
    size: torch.Tensor                 # int64 scalar: the nonzero entries (of a truncated one, a prefix)


def proposal(probs: torch.Tensor, truncation: Truncation) -> tuple[torch.Tensor | None, torch.Tensor]:
    """[V] probabilities -> (support ids [k] or None, fp16 probabilities [k] or [V]): the proposal
    the drafter samples from and sends. Truncated: the `top_k` most likely (descending), cut to the
    fewest holding `top_p` of the mass (at least one) by zeroing the rest, renormalized, rounded.
    Fixed shapes and no host read, so a GPU drafter queues its next step before this one ends."""
    assert probs.dim() == 1, probs.shape
    probs = probs.float()
    if truncation.off:
        return None, probs.to(torch.float16)
    k = min(truncation.top_k or probs.shape[0], probs.shape[0])
    values, support = probs.topk(k)                                                 # descending
    if truncation.top_p < 1.0:
        keep = (values.cumsum(0) < truncation.top_p * probs.sum()).sum() + 1       # on the device
        values = values.masked_fill(torch.arange(k, device=values.device) >= keep, 0.0)
    return support, (values / values.sum()).to(torch.float16)


def draw(probs: torch.Tensor, truncation: Truncation, uniform: torch.Tensor) -> Drawn:
    """[V] probabilities -> the proposal (`proposal`) and a token drawn from it with `uniform`
    (a float64 scalar), on probs' device. fp16 values are whole multiples of 2^-24, so a
    vocabulary of them sums exactly in float64: drawn from the fp16 values as they travel
    (`sample_at`'s float64 running sums), each id's chance is its value over their total,
    which is the distribution the verifier rebuilds from the bytes."""
    support, sent = proposal(probs, truncation)
    index = sample_at(sent[None], uniform.reshape(1))                          # [1]: a tensor index
    weights = sent.float()                                                      # reads nothing back
    confidence = (weights.gather(0, index) / weights.sum())[0]
    token = (index if support is None else support.gather(0, index))[0]
    return Drawn(token, confidence, support, sent, (sent > 0).sum())


def proposals_for_wire(supports: Sequence[torch.Tensor | None], probs: Sequence[torch.Tensor],
                       sizes: Sequence[int]) -> list[DraftProbs]:
    """`proposal`s as they travel, copied from the device once for all their probabilities and
    once for all their supports, after the read of `sizes` (their nonzero counts), so nothing
    is waited for then. A truncated proposal keeps the support fp16 did not round to 0 (a 0 is
    never drawn): its first `size` entries."""
    if not probs:
        return []
    if supports[0] is None:
        rows = torch.stack(list(probs)).cpu().numpy()
        return [DraftProbs((), row.astype("<f2", copy=False).tobytes()) for row in rows]
    width = max(sizes)
    values = torch.stack([p[:width] for p in probs]).cpu().numpy()
    ids = torch.stack([s[:width] for s in supports]).cpu().numpy()
    return [DraftProbs(tuple(row_ids[:n].tolist()), row[:n].astype("<f2", copy=False).tobytes())
            for row_ids, row, n in zip(ids, values, sizes)]


def read_drawn(drawn: Sequence[Drawn]) -> tuple[list[int], list[float], list[DraftProbs]]:
    """Drawn drafts on the host: their tokens, confidences and support sizes in one read (the
    only wait for the device), then their proposals as they travel (`proposals_for_wire`)."""
    ids, confidences, sizes = torch.stack([torch.stack([getattr(d, field) for d in drawn]).double()
                                           for field in ("token", "confidence", "size")]).tolist()
    entries = proposals_for_wire([d.support for d in drawn], [d.probs for d in drawn], [int(n) for n in sizes])
    return [int(t) for t in ids], confidences, entries


def truncate_for_wire(probs: torch.Tensor, truncation: Truncation) -> DraftProbs:
    """[V] float probabilities -> the sparse proposal the drafter samples from and sends."""
    support, sent = proposal(probs, truncation)
    return proposals_for_wire([support], [sent], [int((sent > 0).sum())])[0]


def _fp16_values(entry: DraftProbs) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(entry.probs_fp16, dtype="<f2").astype(np.float32))


def sparse_probs(entry: DraftProbs, values: torch.Tensor | None = None) -> torch.Tensor:
    """A sparse entry's probabilities [m] in float32, renormalized: what the
    verifier scores with (`values`: the entry's, already decoded)."""
    values = _fp16_values(entry) if values is None else values
    return values / values.sum()


def dense_for_wire(probs: torch.Tensor) -> DraftProbs:
    """[V] -> the untruncated proposal (2 bytes per vocabulary entry)."""
    return DraftProbs((), encode_probs(probs))


def draft_probs_tensor(entries: Sequence[DraftProbs], draft_token_ids: Sequence[int],
                       vocab_size: int, free_tokens: int = 0, device: torch.device | str = "cpu") -> torch.Tensor:
    """The verifier's [gamma - free_tokens, V] float32 draft_probs from one entry per
    drafted token after the free sources' leading ones (which have none), validated:
    each must be a distribution that gives its token a chance. Validated on the host and
    built on `device` (the target's probabilities'): a truncated or one-hot proposal goes
    there as its support's ids and values, not as rows of the vocabulary (on a GPU, four
    dense fp32 rows over Qwen's vocabulary are 2.4 MB copied from pageable memory)."""
    if not 0 <= free_tokens <= len(draft_token_ids):
        raise InvalidArgument(f"free_tokens={free_tokens} is more than the {len(draft_token_ids)} draft tokens")
    drafted = draft_token_ids[free_tokens:]
    if len(entries) != len(drafted):
        raise InvalidArgument(f"draft_probs has {len(entries)} entries for {len(drafted)} draft tokens after the "
                              f"{free_tokens} free ones; send one per such token (an empty entry is a one-hot proposal)")
    sparse: list[tuple[int, torch.Tensor, torch.Tensor]] = []   # (row, support ids, their probabilities)
    dense: list[tuple[int, torch.Tensor]] = []                  # (row, [V]): an untruncated proposal
    for i, (entry, token) in enumerate(zip(entries, drafted)):
        where = f"draft_probs[{i}]"
        if entry.one_hot or entry.token_ids:
            support, probs = (torch.tensor([token]), torch.ones(1)) if entry.one_hot else \
                (_support(entry, vocab_size, where), _sparse_values(entry, where))
            chance = float(probs[support == token].sum())
            sparse.append((i, support, probs))
        else:
            row = decode_probs(entry.probs_fp16, 1, vocab_size, where)[0]
            chance = float(row[token])
            dense.append((i, row))
        if not chance > 0:
            raise InvalidArgument(f"{where} gives its drafted token {token} probability 0; each token must be "
                                  "sampled from the distribution sent with it")
    out = torch.zeros(len(entries), vocab_size, device=device)
    if sparse:
        rows = torch.cat([torch.full_like(ids, i) for i, ids, _ in sparse])
        out.index_put_((rows.to(device), torch.cat([ids for _, ids, _ in sparse]).to(device)),
                       torch.cat([probs for _, _, probs in sparse]).to(device))
    if dense:
        out[torch.tensor([i for i, _ in dense], device=device)] = torch.stack([row for _, row in dense]).to(device)
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
