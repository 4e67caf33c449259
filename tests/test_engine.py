"""coordinator.engine alone: the speculative loop against a scripted target and
proposer standing in for the two model services (the clients' interface is the
boundary). The target is a deterministic function of the context, so greedy
output must equal it token for token whatever the proposer drafts."""
from __future__ import annotations

import pytest

from coordinator.engine import GenerationRequest, SpeculativeEngine
from specdec.rpc.errors import Cancelled
from specdec.spec.proposers import MODEL
from specdec.spec.proposers.drafts import Drafts
from specdec.spec.proposers.model import ModelProposer, ProposerUnavailable
from specdec.spec.types import Commit, Decoded, Proposal, RejectionOutput, runs
from specdec.spec.sampling import SamplingConfig

VOCAB, EOS = 50, 49
GREEDY = SamplingConfig()


def target_next(context: list[int]) -> int:
    """The target model: its greedy token after `context` (never EOS unless asked)."""
    return (sum(context) * 31 + 7 * len(context)) % (VOCAB - 1)


def target_only(prompt: list[int], n: int) -> list[int]:
    context, out = list(prompt), []
    for _ in range(n):
        out.append(target_next(context))
        context.append(out[-1])
    return out


class ScriptedVerifier:
    """The verifier service's client, as the engine calls it: sessions of the
    target above, greedy rejection (the longest agreeing prefix, then the
    target's own token)."""

    def __init__(self):
        self.sessions: dict[str, list[int]] = {}
        self.ended: list[str] = []
        self.drafted_rows: list[int] = []

    def start_session(self, session_id, prompt_ids, timeout=None, cache_salt=b""):
        self.sessions[session_id] = list(prompt_ids)
        return 0

    def decode(self, session_id, num_tokens, sampling, timeout=None, logprobs=None) -> Decoded:
        context = self.sessions[session_id]
        out = []
        for _ in range(num_tokens):
            out.append(target_next(context))
            context.append(out[-1])
        return Decoded(out)

    def verify(self, session_id, proposal: Proposal, sampling, timeout=None, logprobs=None) -> RejectionOutput:
        context = self.sessions[session_id]
        self.drafted_rows.append(len(proposal.token_ids))
        accepted = 0
        for token in proposal.token_ids:
            if token != target_next(context):
                break
            context.append(token)
            accepted += 1
        context.append(target_next(context))
        return RejectionOutput(accepted, context[-1], accepted == len(proposal.token_ids))

    def end_session(self, session_id):
        self.ended.append(session_id)
        self.sessions.pop(session_id, None)


class ScriptedProposer(ModelProposer):
    """A draft model that agrees with the target except at every `wrong_every`-th
    draft it makes; it fails (as a dead drafter would) at its `fail_at`-th call."""

    def __init__(self, wrong_every: int = 3, fail_at: int = 0):
        self.wrong_every, self.fail_at = wrong_every, fail_at
        self.context: list[int] = []
        self.pending: tuple[int, ...] = ()   # the last proposal, until its commit comes
        self.calls = self.drafts = 0
        self.asked: list[int] = []
        self.ended = 0

    def start(self, session_id, prompt_ids):
        self.context = list(prompt_ids)

    def propose(self, num_tokens, sampling, commit: Commit | None, min_confidence=0.0, prefix=()) -> Proposal:
        self.calls += 1
        if self.fail_at and self.calls >= self.fail_at:
            raise ProposerUnavailable("the drafter became unavailable (UNAVAILABLE)")
        if commit is not None:
            self.context += [*self.pending[: commit.num_accepted], *commit.target_token_ids]
        self.asked.append(num_tokens)
        scratch, out = list(self.context), []
        for _ in range(num_tokens):
            self.drafts += 1
            token = target_next(scratch)
            if self.wrong_every and self.drafts % self.wrong_every == 0:
                token = (token + 1) % (VOCAB - 1)
            out.append(token)
            scratch.append(token)
        self.pending = tuple(out)
        return Proposal(tuple(out), sources=runs((MODEL, len(out))))

    def end(self):
        self.ended += 1


class Characters:
    """A tokenizer: id i is one letter."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + i % 26) for i in ids if not (skip_special_tokens and i == EOS))


PROMPT = (3, 1, 4, 1, 5)


def generate(engine, proposer, request, **kw):
    updates = list(engine.generate(request, proposer and Drafts(proposer), **kw))
    tokens = [t for u in updates for t in u.delta.token_ids]
    return tokens, updates[-1]


@pytest.mark.parametrize("gamma", [1, 2, 4, 7])
def test_greedy_output_is_the_targets_whatever_the_draft_gets_wrong(gamma):
    verifier, proposer = ScriptedVerifier(), ScriptedProposer(wrong_every=3)
    engine = SpeculativeEngine(verifier, Characters(), (EOS,))
    tokens, last = generate(engine, proposer, GenerationRequest(PROMPT, 40, GREEDY, gamma, ignore_eos=True))
    assert tokens == target_only(list(PROMPT), 40)
    stats = last.stats
    assert stats.output_tokens == 40 and last.delta.finish_reason.name == "LENGTH"
    assert 0 < stats.accepted_tokens < stats.draft_tokens == sum(verifier.drafted_rows)
    assert stats.sources["model"].draft_tokens == stats.draft_tokens
    # No round drafts past what is left to generate (the verifier always adds one).
    assert max(proposer.asked) <= gamma and sum(verifier.drafted_rows) <= 40 * gamma
    assert verifier.ended and proposer.ended == 1 and not verifier.sessions


def test_a_proposer_that_fails_mid_request_leaves_the_output_unchanged_and_says_why():
    verifier, proposer = ScriptedVerifier(), ScriptedProposer(wrong_every=4, fail_at=4)
    engine = SpeculativeEngine(verifier, Characters(), (EOS,))
    failures = []
    engine.on_proposer_failure = failures.append
    tokens, last = generate(engine, proposer, GenerationRequest(PROMPT, 30, GREEDY, 3, ignore_eos=True))
    assert tokens == target_only(list(PROMPT), 30)
    assert len(failures) == 1 and "unavailable" in last.stats.fallback and "target-only" in last.stats.fallback
    assert engine.metrics.fallbacks._value.get() == 1
    assert proposer.ended == 1 and verifier.ended and not verifier.sessions


def test_eos_ends_the_output_and_is_not_part_of_it():
    prompt = list(PROMPT)
    expected = target_only(prompt, 20)
    eos_at = 6
    verifier = ScriptedVerifier()
    engine = SpeculativeEngine(verifier, Characters(), (expected[eos_at],))
    tokens, last = generate(engine, ScriptedProposer(wrong_every=0), GenerationRequest(PROMPT, 20, GREEDY, 4))
    assert tokens == expected[: expected.index(expected[eos_at])] and last.delta.finish_reason.name == "EOS"


def test_a_cancelled_request_stops_between_rounds_and_ends_both_sessions():
    verifier, proposer = ScriptedVerifier(), ScriptedProposer()
    engine = SpeculativeEngine(verifier, Characters(), (EOS,))
    seen = []
    with pytest.raises(Cancelled, match="cancelled by the client"):
        for update in engine.generate(GenerationRequest(PROMPT, 100, GREEDY, 2, ignore_eos=True), Drafts(proposer),
                                      cancelled=lambda: len(seen) >= 3):
            seen.append(update)
    assert len(seen) == 3 and proposer.ended == 1 and verifier.ended and not verifier.sessions


def test_target_only_decodes_in_chunks_with_no_proposer():
    verifier = ScriptedVerifier()
    engine = SpeculativeEngine(verifier, Characters(), (EOS,))
    tokens, last = generate(engine, None, GenerationRequest(PROMPT, 37, GREEDY, 0, ignore_eos=True))
    assert tokens == target_only(list(PROMPT), 37)
    assert last.stats.draft_tokens == 0 and verifier.drafted_rows == [] and last.stats.gamma == 0


class ConfidenceRecorder(ScriptedProposer):
    """The scripted draft, recording the early-stop threshold each Propose carries."""

    def __init__(self):
        super().__init__(wrong_every=5)
        self.thresholds: list[float] = []

    def propose(self, num_tokens, sampling, commit, min_confidence=0.0, prefix=()) -> Proposal:
        self.thresholds.append(min_confidence)
        return super().propose(num_tokens, sampling, commit, min_confidence, prefix)


@pytest.mark.parametrize("synthetic", [0.0, 0.8])
def test_under_synthetic_acceptance_the_drafter_is_never_asked_to_stop_early(synthetic):
    # A draft's probability says how likely the target keeps it; a verifier keeping drafts
    # at a set rate ignores it, so the early stop has nothing to read: with random weights
    # every token was unsure, and the check's rounds were cut to one token until the
    # calibration had learned. Curves where drafting pays (a cheap draft, flat verification).
    from coordinator.gamma import CostModel
    cost = CostModel.from_curves([1.0] * 9, [10.0] * 9)
    cost.frozen = True
    proposer = ConfidenceRecorder()
    engine = SpeculativeEngine(ScriptedVerifier(), Characters(), (EOS,), cost=cost, synthetic_acceptance=synthetic)
    request = GenerationRequest(PROMPT, 40, GREEDY, 8, adaptive=True, ignore_eos=True, confidence_stop=True,
                                proposer="model")
    tokens, last = generate(engine, proposer, request)
    assert tokens == target_only(list(PROMPT), 40) and proposer.thresholds
    assert last.stats.synthetic_acceptance == pytest.approx(synthetic)
    if synthetic:
        assert set(proposer.thresholds) == {0.0}
    else:   # the controller's threshold, as on a real pair
        assert max(proposer.thresholds) > 0.0
