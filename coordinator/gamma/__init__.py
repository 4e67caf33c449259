"""Choosing γ, the number of draft tokens per round, per request.

Goodput is E[tokens per round] / E[round time]. With conditional acceptance
a_i (draft i accepted, given drafts before it were),

    E[tokens | γ] = 1 + sum_{k=1..γ} prod_{i=1..k} a_i,

which is Leviathan et al.'s (1 - α^(γ+1)) / (1 - α) when every a_i = α. Round
time is draft(γ) + verify(γ): drafting a line in the model tokens drafted,
fitted online from measured rounds; verifying γ tokens the verifier's published
cost curve at γ + 1 rows, learned per row count (rows are not free in every
precision: int4 takes them 4 a kernel pass). γ = 0 is plain target decoding: no drafter call.

* acceptance is an EWMA over per-position observations; per-position estimates
  are shrunk toward the pooled one until they have data of their own;
* hysteresis: γ moves only when the best γ beats the current one by a margin;
* at γ = 0 nothing is observed, so a probe round drafts `probe_gamma` tokens
  after `probe_every` rounds, with the interval doubling while probes fail;
* a prior shared across requests, one per sampling regime (greedy, or a
  temperature bucket): a request starts from the recent average, worth a few
  rounds of its own, and returns what it learned when it ends;
* positions a round did not reach lose weight, so a stretch at small γ does
  not freeze the estimates of the deeper positions;
* within a round, γ is an upper bound: the drafter stops after a token it is
  unsure of (`min_confidence`), so easy stretches get long drafts and hard ones
  short drafts, which no fixed γ can do;
* under load, the model services batch the rows of many requests into one
  forward (continuous batching), and the drafter's forwards take the cores the
  verifier's need. A round's cost is then its share of the work when all n
  requests in flight draft as this one does: γ·draft_curve(n)/n for its draft
  steps and verify_curve(n·(γ+1))/n for its verify (`ServiceLoad`: the
  coordinator's requests in flight, or the calls per forward the verifier
  reports, whichever is more). A forward's fixed cost is shared, its rows are
  not: as n grows, rejected drafts cost more than they save and γ falls to 0;
  it rises again as n falls;
* free drafts (n-gram lookups or any free source, `plan`): a free token costs
  only its verify row, a model token a draft step too. Acceptance of free tokens
  is learned per source name and match length (how many tokens of context back
  the candidate), and each round takes the candidate, the number of its tokens,
  then of model tokens after them, that maximizes goodput; a candidate that does
  not pay is still tried now and then.
"""
from coordinator.gamma.acceptance import (LOOKUP_PRIORS, MATCH_BUCKETS, Acceptance, Calibration,


                                          lookup_acceptances, match_bucket)
from coordinator.gamma.cost import LOAD_ALONE, CostModel, EwLinearFit, RowCurve, prefill_line
from coordinator.gamma.load import ServiceLoad
from coordinator.gamma.policy import ControllerState, GammaController, Plan
from coordinator.gamma.priors import GammaPriors, regime

__all__ = ["Acceptance", "Calibration", "ControllerState", "CostModel", "EwLinearFit", "GammaController", "GammaPriors",
           "LOAD_ALONE", "LOOKUP_PRIORS", "MATCH_BUCKETS", "Plan", "RowCurve", "ServiceLoad", "lookup_acceptances",
           "match_bucket", "prefill_line", "regime"]
