"""The rejection sampler: pure tensor math, no I/O.

Leviathan et al. 2022 (Algorithm 1) and Chen et al. 2023: a drafted token x at
position i is accepted with probability min(1, target_probs[i, x] / draft_probs[i, x]).
At the first rejection the recovered token is drawn from
norm(max(0, target_probs[i] - draft_probs[i])) and the round ends; when every
drafted token is accepted, a bonus token is drawn from target_probs[gamma].
The tokens that come out are distributed exactly as the target's own samples.

A free source's draft (a lookup's) is deterministic: its proposal is one-hot, so
it is accepted with probability target_probs[i, x] and its residual is the target
row without x. Such tokens lead the draft and carry no draft_probs row.
"""
from __future__ import annotations


import torch

from specdec.spec.types import RejectionOutput
from specdec.spec.transform import sample_from


def rejection_sample(
    draft_token_ids: torch.Tensor,  # [gamma] long
    draft_probs: torch.Tensor,      # [gamma - free, V] the distributions the last drafts were sampled from
    target_probs: torch.Tensor,     # [gamma + 1, V] row i scores draft position i; the last row the bonus
    generator: torch.Generator,
) -> RejectionOutput:
    """The first `free = gamma - len(draft_probs)` drafts are a free source's (one-hot)."""
    gamma = draft_token_ids.shape[0]
    free = gamma - draft_probs.shape[0]
    assert draft_token_ids.dim() == 1, draft_token_ids.shape
    assert 0 <= free and draft_probs.shape[-1] == target_probs.shape[-1], (draft_probs.shape, target_probs.shape)
    assert target_probs.shape[0] == gamma + 1, (target_probs.shape, gamma)

    # One uniform per position, drawn up front: the stream of draws (and so a
    # seeded result) does not depend on where the first rejection falls.
    # (On the generator's device, which draws only there; then the probabilities'.)
    uniforms = torch.rand(gamma, generator=generator, device=generator.device).to(target_probs.device)
    positions = torch.arange(gamma, device=target_probs.device)
    target_at_draft = target_probs[positions, draft_token_ids]   # [gamma]
    draft_at_draft = torch.ones(gamma, device=target_probs.device, dtype=target_probs.dtype)
    draft_at_draft[free:] = draft_probs[positions[free:] - free, draft_token_ids[free:]]  # [gamma]
    # u < p/q  <=>  u * q < p  (no division; q > 0 for any token the drafter could sample)
    accepted = uniforms * draft_at_draft < target_at_draft         # [gamma] bool
    rejected = (~accepted).nonzero()
    num_accepted = int(rejected[0]) if rejected.numel() else gamma

    if num_accepted < gamma:
        if num_accepted < free:  # the residual of a one-hot proposal: the target without its token
            residual = target_probs[num_accepted].clone()
            residual[draft_token_ids[num_accepted]] = 0
        else:
            residual = (target_probs[num_accepted] - draft_probs[num_accepted - free]).clamp_min(0)
        total = residual.sum()
        # A rejection needs p(x) < q(x) somewhere, so p - q has positive mass; the
        # guard only covers float round-off when p and q are (almost) equal.
        next_token = sample_from(residual / total if total > 0 else target_probs[num_accepted], generator)
    else:
        next_token = sample_from(target_probs[gamma], generator)
    return RejectionOutput(num_accepted, int(next_token), bonus=num_accepted == gamma)


def greedy_accept(
    draft_token_ids: torch.Tensor,   # [gamma] long
    target_token_ids: torch.Tensor,  # [gamma + 1] the target's argmax at each position
) -> RejectionOutput:
    """Temperature 0: accept while the draft equals the target's argmax."""
    gamma = draft_token_ids.shape[0]
    assert draft_token_ids.dim() == 1 and target_token_ids.shape == (gamma + 1,), (
        draft_token_ids.shape, target_token_ids.shape)
    mismatch = (draft_token_ids.cpu() != target_token_ids[:gamma].cpu()).nonzero()
    num_accepted = int(mismatch[0]) if mismatch.numel() else gamma
    return RejectionOutput(num_accepted, int(target_token_ids[num_accepted]), bonus=num_accepted == gamma)


def synthetic_num_accepted(gamma: int, acceptance: float, generator: torch.Generator) -> int:
    """A benchmark's verdict, not a lossless one (vLLM's `synthetic` rejection
    method): each draft is kept with probability `acceptance` given the ones before
    it, whatever the models say, so a pair of random-weight models, which agree on
    nothing, can be timed at the acceptance a real pair shows. The caller draws the
    next token from the target's own row at that position."""
    assert 0.0 < acceptance <= 1.0 and gamma >= 0, (acceptance, gamma)
    uniforms = torch.rand(gamma, generator=generator, device=generator.device)
    rejected = (uniforms >= acceptance).nonzero()
    return int(rejected[0]) if rejected.numel() else gamma
