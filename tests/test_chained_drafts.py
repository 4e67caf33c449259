"""Drafts chained on the device (a GPU drafter's loop, forced here on the CPU in fp32), greedy
and sampled: each draft step is fed its token from the device and the round's tokens are read
once, and the drafts, their proposals, their confidences, the generator and the session they
leave are the step-by-step loop's."""
from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

from drafter.draft_session import DraftSession
from specdec.runtime import torch_thread
from specdec.runtime.batching import Scheduler, lean_batch_forward
from specdec.runtime.models import load_model
from specdec.runtime.sequence import PENDING
from specdec.spec.sampling import SamplingConfig
from specdec.spec.types import Commit
from specdec.spec.wire import Truncation
from tests.test_batching import run_concurrently
from tests.test_sequence import PROMPT

GREEDY = SamplingConfig()


@pytest.fixture(scope="module", params=["lean", "paged"])
def draft(request):
    return load_model("tiny-draft", forward=request.param)


class HostReads(TorchFunctionMode):
    """Counts the reads of a tensor's values into Python (what waits for a GPU's queue). A mode
    is the thread's: `reads` runs its call on the torch thread, where the forwards run."""
    READS = {torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__int__, torch.Tensor.__float__,
             torch.Tensor.__bool__, torch.Tensor.__index__}

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.count += func in self.READS
        return func(*args, **(kwargs or {}))


def reads(call) -> tuple[object, int]:
    """call()'s result and the host reads it made."""
    def counted():
        with HostReads() as mode:
            return call(), mode.count
    return torch_thread.run(counted)


def rounds(session: DraftSession, plan, sampling: SamplingConfig = GREEDY, truncation: Truncation = Truncation()):
    """Each round: propose (γ, min_confidence, lookup prefix), then commit `accepted` of them and
    a target token; the drafts, their proposals and the session's state after each step (the
    generator's too, where it samples)."""
    seen = []
    for gamma, threshold, prefix, accepted in plan:
        ids, probs, confidences = session.propose(gamma, sampling, min_confidence=threshold, prefix=prefix,
                                                  truncation=truncation)
        rng = None if session.generator is None else session.generator.get_state().tolist()
        seen.append((ids, probs, session.seq.tokens[:], session.seq.cached, session.round_drafted, rng))
        assert PENDING not in session.seq.tokens
        session.commit(Commit(min(accepted, session.round_drafted), (100 + len(seen),)))
        seen.append((session.seq.tokens[:], session.seq.cached, confidences))
    return seen


def assert_same_rounds(chained, step_by_step):
    for want, got in zip(step_by_step, chained, strict=True):
        assert got[:-1] == want[:-1]
        if isinstance(want[-1], list):                # confidences: computed alike, read alike
            assert got[-1] == pytest.approx(want[-1], rel=1e-5)


def test_chained_greedy_drafts_leave_what_the_step_by_step_loop_leaves(draft):
    reference = DraftSession(draft, PROMPT, chain=False)
    first, _, confidences = reference.propose(6, GREEDY)
    cut = sorted(confidences)[2]                      # a threshold some of these tokens fall below
    plan = [(4, 0.0, (), 4), (6, cut, (), 1), (3, 0.0, (7, 8), 2), (5, cut, (9,), 0), (1, 0.0, (), 1),
            (0, 0.0, (11, 12), 2), (6, 1.0, (), 3), (4, 0.0, (), 4)]
    step_by_step = rounds(DraftSession(draft, PROMPT, chain=False), plan)
    assert_same_rounds(rounds(DraftSession(draft, PROMPT, chain=True), plan), step_by_step)
    assert any(len(r[0]) < plan[i][0] for i, r in enumerate(step_by_step[::2])), "no round was cut"


@pytest.mark.parametrize("truncation", [Truncation(), Truncation(top_k=8), Truncation(top_p=0.6),
                                        Truncation(top_k=64, top_p=0.5)], ids=["dense", "top_k", "top_p", "both"])
def test_chained_sampled_drafts_leave_what_the_step_by_step_loop_leaves(draft, truncation):
    """The same draws, proposals (their bytes), generator and session, round after round,
    rounds cut by the confidence rule included: a cut round's draws past its cut are undone."""
    sampling = SamplingConfig(temperature=1.3, seed=11)
    plan = [(4, 0.0, (), 4), (6, 0.3, (), 1), (3, 0.0, (7, 8), 2), (5, 0.5, (9,), 0), (1, 0.0, (), 1),
            (0, 0.0, (11, 12), 2), (6, 0.2, (), 3), (4, 0.0, (), 4)]
    step_by_step = rounds(DraftSession(draft, PROMPT, chain=False), plan, sampling, truncation)
    assert_same_rounds(rounds(DraftSession(draft, PROMPT, chain=True), plan, sampling, truncation), step_by_step)
    drafted = step_by_step[::2]
    assert any(len(r[0]) < plan[i][0] for i, r in enumerate(drafted)), "no round was cut"
    assert len({t for r in drafted for t in r[0]}) > 5                   # draws, not one token again
    entries = [e for r in drafted for e in r[1]]
    assert len(entries) == sum(len(r[0]) for r in drafted)               # a proposal a drafted token
    if not truncation.off:
        sizes = {len(e.token_ids) for e in entries}
        assert max(sizes) <= (truncation.top_k or draft.vocab_size) and (truncation.top_p == 1 or len(sizes) > 1)


def test_a_chained_round_reads_the_device_once(draft):
    counts = {}
    for chain in (False, True):
        session = DraftSession(draft, PROMPT, chain=chain)
        session.propose(4, GREEDY)
        session.commit(Commit(4, (5,)))
        (ids, _, _), counts[chain] = reads(lambda: session.propose(4, GREEDY))
        assert len(ids) == 4
    assert counts[False] >= 4                          # the counter sees the step-by-step loop's reads
    assert counts[True] == 1, counts


@pytest.mark.parametrize("truncation", [Truncation(), Truncation(top_k=8, top_p=0.9)], ids=["dense", "sparse"])
def test_a_chained_sampled_round_reads_the_device_once(draft, truncation):
    """Its tokens, confidences and support sizes in one read; the proposals are then copied
    (work already done: nothing is waited for)."""
    sampling = SamplingConfig(temperature=0.8, seed=3)
    counts = {}
    for chain in (False, True):
        session = DraftSession(draft, PROMPT, chain=chain)
        (ids, entries, _), counts[chain] = reads(lambda: session.propose(4, sampling, truncation=truncation))
        assert len(ids) == len(entries) == 4
    assert counts[False] >= 4 and counts[True] == 1, counts


def test_penalized_drafts_keep_the_step_by_step_loop(draft):
    """Their scores need the tokens before them, which the chain holds only on the device."""
    for sampling in (SamplingConfig(repetition_penalty=1.3), SamplingConfig(temperature=0.8, seed=1,
                                                                          presence_penalty=0.5)):
        results = []
        for chain in (False, True):
            session = DraftSession(draft, PROMPT, chain=chain)
            (ids, probs, _), count = reads(lambda: session.propose(4, sampling))
            results.append((ids, probs, count >= 4))
        assert results[0] == results[1] and results[1][2], sampling


def test_concurrent_chained_sessions_share_forwards_and_draft_what_they_draft_alone():
    draft = load_model("tiny-draft", forward="paged")
    prompts = [PROMPT, PROMPT[:5] + [3, 4, 5], PROMPT[2:] + [9] * 6]
    alone = [DraftSession(draft, p, chain=False).propose(5, GREEDY).token_ids for p in prompts]
    sessions = [DraftSession(draft, p, chain=True) for p in prompts]
    seen: list[int] = []
    scheduler = Scheduler(lean_batch_forward(draft.lean),
                          on_forward=lambda rows, calls, ms, prefill_rows: seen.append(calls))
    results = run_concurrently(scheduler, [lambda s=s: s.propose_steps(5, GREEDY) for s in sessions])
    assert [draft_.token_ids for draft_, _ in results] == alone
    assert max(seen) > 1                               # forwards gathered several sessions' device-fed rows
