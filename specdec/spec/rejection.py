"""The rejection sampler: pure tensor math, no I/O.

Leviathan et al. 2022 (Algorithm 1) and Chen et al. 2023: a drafted token x at
position i is accepted with probability min(1, target_probs[i, x] / draft_probs[i, x]).
At the first rejection the recovered token is drawn from
norm(max(0, target_probs[i] - draft_probs[i])) and the round ends; when every
drafted token is accepted, a bonus token is drawn from target_probs[gamma].
The tokens that come out are distributed exactly as the target's own samples.

A free source's draft (a lookup's) is deterministic: its proposal is one-hot, so
it is accepted with probability target_probs[i, x] and its residual is the target
row without x. Such tokens lead the draft and carry no draft_probs row. The
sampler draws both at once: the target's own sample at that position, from the
uniform target-only decoding draws there (sampling.position_uniforms), is the
token kept if it is the draft's, and the recovered token if not. So a seeded
request whose drafts are all lookups gets target-only's tokens, not just their
distribution.
"""
from __future__ import annotations

import random

import torch

from specdec.spec.types import RejectionOutput
from specdec.spec.transform import sample_at


def rejection_sample(
    draft_token_ids: torch.Tensor,  # [gamma] long
    draft_probs: torch.Tensor,      # [gamma - free, V] the distributions the last drafts were sampled from
    target_probs: torch.Tensor,     # [gamma + 1, V] row i scores draft position i; the last row the bonus
    uniforms: torch.Tensor | torch.Generator,   # [gamma + 1, 2] float64: each position's pair; or a generator
) -> RejectionOutput:
    """The first `free = gamma - len(draft_probs)` drafts are a free source's (one-hot).
    Position i decides with uniforms[i, 0] and draws a model draft's recovered token
    with uniforms[i, 1]; the bonus token is drawn with uniforms[gamma, 0]."""
    gamma = draft_token_ids.shape[0]
    free = gamma - draft_probs.shape[0]
    assert draft_token_ids.dim() == 1, draft_token_ids.shape
    assert 0 <= free and draft_probs.shape[-1] == target_probs.shape[-1], (draft_probs.shape, target_probs.shape)
    assert target_probs.shape[0] == gamma + 1, (target_probs.shape, gamma)
    if isinstance(uniforms, torch.Generator):   # drawn where the generator lives, then moved
        uniforms = torch.rand(gamma + 1, 2, generator=uniforms, device=uniforms.device, dtype=torch.float64)
    uniforms = uniforms.to(target_probs.device)
    assert uniforms.shape == (gamma + 1, 2), uniforms.shape
    draft_token_ids = draft_token_ids.to(target_probs.device)

    # 1. Free drafts: the target's own sample at the position, kept where it is the draft.
    samples = sample_at(target_probs[:free], uniforms[:free, 0]) if free else draft_token_ids[:0]   # [free]
    # 2. Model drafts: x kept where u < p(x) / q(x), i.e. u * q < p (q > 0 for any token
    #    the drafter could sample).
    model = torch.arange(free, gamma, device=target_probs.device)
    ids = draft_token_ids[free:]
    kept = uniforms[free:gamma, 0] * draft_probs[model - free, ids].double() < target_probs[model, ids].double()
    accepted = torch.cat([samples == draft_token_ids[:free], kept])               # [gamma] bool

    # 3. Every position's next token, drawn where it is (on a GPU, with no value read back):
    #    a free draft's position its own sample, a model draft's its recovered token, from
    #    norm(max(0, p - q)); the bonus token after all. A rejection needs p(x) < q(x), so
    #    p - q has positive mass; the fallback to p covers float round-off where p ~ q.
    residual = (target_probs[free:gamma] - draft_probs).clamp_min(0)                        # [gamma - free, V]
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, target_probs[free:gamma])
    nexts = torch.cat([samples, sample_at(residual, uniforms[free:gamma, 1]),
                       sample_at(target_probs[gamma:], uniforms[gamma, :1])])                # [gamma + 1]
    # 4. The drafts kept (the leading run of accepted) and the token after them: one copy to the host.
    num_accepted = accepted.long().cumprod(0).sum()
    num_accepted, *nexts = torch.cat([num_accepted[None], nexts]).tolist()
    return RejectionOutput(num_accepted, nexts[num_accepted], bonus=num_accepted == gamma)


def greedy_accept(
    draft_token_ids: torch.Tensor,   # [gamma] long, on the host (as they came over the wire)
    target_token_ids: torch.Tensor,  # [gamma + 1] the target's argmax at each position, where it was computed
) -> RejectionOutput:
    """Temperature 0: accept while the draft equals the target's argmax. The argmax stays on
    the device; its gamma + 1 ids are the one copy to the host a round makes."""
    gamma = draft_token_ids.shape[0]
    assert draft_token_ids.dim() == 1 and target_token_ids.shape == (gamma + 1,), (
        draft_token_ids.shape, target_token_ids.shape)
    target = target_token_ids.tolist()
    num_accepted = next((i for i, (d, t) in enumerate(zip(draft_token_ids.tolist(), target)) if d != t), gamma)
    return RejectionOutput(num_accepted, target[num_accepted], bonus=num_accepted == gamma)


def synthetic_num_accepted(gamma: int, acceptance: float, rng: random.Random) -> int:
    """A benchmark's verdict, not a lossless one (vLLM's `synthetic` rejection
    method): each draft is kept with probability `acceptance` given the ones before
    it, whatever the models say, so a pair of random-weight models, which agree on
    nothing, can be timed at the acceptance a real pair shows. The caller draws the
    next token from the target's own row at that position. Drawn on the host, from
    a Python generator: the verdict reads nothing from the device."""
    assert 0.0 < acceptance <= 1.0 and gamma >= 0, (acceptance, gamma)
    return next((k for k in range(gamma) if rng.random() >= acceptance), gamma)
