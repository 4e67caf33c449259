"""Target-only decoding chained on the device (a GPU verifier's loop, forced here on the CPU in
fp32): each step is fed its token from the device and each token is read a step behind, after
the next step is queued, and the tokens and the session they leave are the step-by-step loop's."""
from __future__ import annotations

import dataclasses

import pytest

from specdec.runtime import torch_thread
from specdec.runtime.batching import Scheduler, lean_batch_forward
from specdec.runtime.models import load_model
from specdec.runtime.sequence import PENDING
from specdec.spec.sampling import SamplingConfig
from tests.test_batching import run_concurrently
from tests.test_chained_drafts import HostReads, reads
from tests.test_sequence import PROMPT
from verifier.target_session import TargetSession

GREEDY = SamplingConfig()
SAMPLED = SamplingConfig(temperature=0.9, top_p=0.95, seed=7)


@pytest.fixture(scope="module", params=["lean", "paged"])
def target(request):
    """The tiny target with no EOS: every call decodes all it is asked (the EOS test names one)."""
    return dataclasses.replace(load_model("tiny-target", forward=request.param), eos_token_ids=())


def calls(session: TargetSession, sizes, sampling: SamplingConfig):
    """Decode calls of these sizes: each one's tokens and the session's state after it."""
    seen = []
    for size in sizes:
        tokens = session.decode(size, sampling)
        assert PENDING not in session.seq.tokens
        seen.append((tokens, session.seq.tokens[:], session.seq.cached))
    return seen


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_chained_decoding_leaves_what_the_step_by_step_loop_leaves(target, sampling):
    sizes = [1, 5, 0, 16, 3]
    step_by_step = calls(TargetSession(target, PROMPT, chain=False), sizes, sampling)
    assert calls(TargetSession(target, PROMPT, chain=True), sizes, sampling) == step_by_step
    assert sum(len(tokens) for tokens, _, _ in step_by_step) == sum(sizes)


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_an_eos_read_a_step_late_costs_its_step_and_leaves_the_session_as_the_loop_does(target, sampling):
    """The step queued after an EOS fed it; its cache entry is dropped, the EOS kept unfed."""
    tokens = TargetSession(target, PROMPT, chain=False).decode(12, sampling)
    eos = next(t for t in tokens[3:] if t not in tokens[:3])     # a token first decoded mid-call
    ending = dataclasses.replace(target, eos_token_ids=(eos,))
    step_by_step = calls(TargetSession(ending, PROMPT, chain=False), [12, 4], sampling)
    assert step_by_step[0][0][-1] == eos and len(step_by_step[0][0]) < 12
    assert calls(TargetSession(ending, PROMPT, chain=True), [12, 4], sampling) == step_by_step


def reads_by_step(session: TargetSession, num_tokens: int, sampling: SamplingConfig, logprobs=None):
    """The decode call's tokens, and the host reads made before each of its steps was queued."""
    def run():
        before = []
        with HostReads() as mode:
            steps = session.decode_steps(num_tokens, sampling, logprobs, [])
            try:
                forward = next(steps)
                while True:
                    before.append(mode.count)
                    forward = steps.send(forward.run())
            except StopIteration as done:
                return done.value, before
    return torch_thread.run(run)


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_each_token_is_read_after_the_next_step_is_queued(target, sampling):
    tokens, before = reads_by_step(TargetSession(target, PROMPT, chain=True), 6, sampling)
    assert len(tokens) == 6
    assert before == [0, 0, 1, 2, 3, 4]          # step i queued with tokens ..i-2 read, not i-1
    tokens_alone, before_alone = reads_by_step(TargetSession(target, PROMPT, chain=False), 6, sampling)
    assert tokens_alone == tokens
    assert before_alone[:3] == [0, 1, 2]          # the counter sees the step-by-step loop wait


def test_penalized_and_logprob_decoding_keep_the_step_by_step_loop(target):
    """A penalty's scores need the tokens before them on the host, and logprobs their scores."""
    for sampling, logprobs in ((SamplingConfig(repetition_penalty=1.3), None), (GREEDY, 2)):
        runs = [reads_by_step(TargetSession(target, PROMPT, chain=chain), 4, sampling, logprobs)
                for chain in (False, True)]
        assert runs[0] == runs[1] and runs[1][1][1] >= 1, sampling


def test_a_chained_call_reads_each_token_once(target):
    session = TargetSession(target, PROMPT, chain=True)
    tokens, count = reads(lambda: session.decode(8, GREEDY))
    assert len(tokens) == 8 and count == 8


def test_concurrent_chained_sessions_share_forwards_and_decode_what_they_decode_alone():
    target = dataclasses.replace(load_model("tiny-target", forward="paged"), eos_token_ids=())
    prompts = [PROMPT, PROMPT[:5] + [3, 4, 5], PROMPT[2:] + [9] * 6]
    alone = [TargetSession(target, p, chain=False).decode(6, SAMPLED) for p in prompts]
    sessions = [TargetSession(target, p, chain=True) for p in prompts]
    seen: list[int] = []
    scheduler = Scheduler(lean_batch_forward(target.lean),
                          on_forward=lambda rows, calls, ms, prefill_rows: seen.append(calls))
    results = run_concurrently(scheduler, [lambda s=s: s.decode_steps(6, SAMPLED) for s in sessions])
    assert [tokens for tokens, _ in results] == alone
    assert max(seen) > 1                               # forwards gathered several sessions' device-fed rows
