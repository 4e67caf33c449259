"""Sampling penalties through the real services stay lossless: a repetition
penalty over a round mixing a lookup token and a model token, and OpenAI's
frequency and presence penalties (greedy equality and the exact distribution)."""
from __future__ import annotations

import collections
import concurrent.futures

import torch

from specdec.spec.sampling import SamplingConfig
from specdec.spec.transform import scores_to_probs, transform_logits
from specdec.spec.wire import sampling_to_proto
from specdec.v1 import common_pb2, drafter_pb2, verifier_pb2
from specdec_tools.distribution import chi_square_p, exact_first_two_token_distribution, observed_outcome
from tests.test_end_to_end import PROMPTS, SAMPLING, generate


def test_a_round_mixing_a_lookup_token_and_a_model_token_under_a_repetition_penalty_is_lossless(stack, tiny_target):
    """Through the real drafter and verifier: a lookup's token first (one-hot, no
    probabilities sent), then the model's draft after it (sparse), both sides
    penalizing repetition over the same history, which the lookup's token joins.
    The first output token is distributed as the target's after the prompt; the
    second, where the lookup's token was kept, as the target's after prompt + it."""
    sampling = SamplingConfig(temperature=0.8, top_k=40, repetition_penalty=1.4)
    params = sampling_to_proto(sampling)
    prompt_ids = tiny_target.tokenizer.encode("Hello, world! How are you")
    with torch.inference_mode():
        def probs_after(ids):
            logits = tiny_target.model(input_ids=torch.tensor([ids])).logits[0, -1:]
            return scores_to_probs(transform_logits(logits, ids, [], sampling, tiny_target.vocab_size))[0]
        p1 = probs_after(prompt_ids)
        lookup = int(p1.argmax())            # the lookup proposes the target's favourite: often kept
        p2 = probs_after(prompt_ids + [lookup])
    def one(seed: int) -> tuple[list[int], int]:
        session = f"mixed-{seed}"
        start = common_pb2.StartSessionRequest(session_id=session, prompt_token_ids=prompt_ids)
        stack.drafter_stub.StartSession(start, timeout=10)
        stack.verifier_stub.StartSession(start, timeout=10)
        seeded = common_pb2.SamplingParams()
        seeded.CopyFrom(params)
        seeded.seed = seed
        proposal = stack.drafter_stub.Propose(drafter_pb2.ProposeRequest(
            session_id=session, num_tokens=1, sampling=seeded, draft_prefix_ids=[lookup], truncation_top_k=64),
            timeout=10)
        assert len(proposal.draft_token_ids) == 1 and proposal.draft_probs[0].token_ids  # sparse
        verdict = stack.verifier_stub.Verify(verifier_pb2.VerifyRequest(
            session_id=session, draft_token_ids=[lookup, *proposal.draft_token_ids], sampling=seeded,
            draft_probs=[common_pb2.DraftProbs(), *proposal.draft_probs]), timeout=10)
        for stub in (stack.drafter_stub, stack.verifier_stub):
            stub.EndSession(common_pb2.EndSessionRequest(session_id=session), timeout=10)
        return [lookup, *proposal.draft_token_ids][: verdict.num_accepted] + [verdict.next_token_id], \
            verdict.num_accepted

    first, second, runs = collections.Counter(), collections.Counter(), 1500
    with concurrent.futures.ThreadPoolExecutor(8) as pool:   # independent sessions: the services batch them
        for out, accepted in pool.map(one, range(runs)):
            first[out[0]] += 1
            if accepted >= 1:
                second[out[1]] += 1
    n2 = sum(second.values())
    assert 0.2 * runs < n2 < runs  # the lookup's token was kept, and rejected, often
    as_dict = lambda p: {i: float(v) for i, v in enumerate(p.tolist()) if v > 0}  # noqa: E731
    assert chi_square_p(first, as_dict(p1), runs) > 1e-3
    assert chi_square_p(second, as_dict(p2), n2) > 1e-3


def test_frequency_and_presence_penalties_stay_lossless(stack, tiny_target):
    """OpenAI's additive penalties through the coordinator: greedy speculative output
    is target-only's, and sampled pairs of tokens follow the target's exact
    distribution with the penalties applied to the output (the second token's
    distribution is moved by the first; the prompt's ids are not counted)."""
    # Negative: the tiny model's greedy text repeats no token, so only penalties that
    # favour repetition change it (and make a second token equal to the first likely).
    penalties = dict(frequency_penalty=-1.5, presence_penalty=-1.0)
    for prompt in PROMPTS[:4]:
        greedy = [generate(stack.coordinator_stub, prompt, speculate=s, max_new_tokens=30, **penalties).token_ids
                  for s in (True, False)]
        assert greedy[0] == greedy[1]
        assert len(set(greedy[0])) < len(greedy[0])   # the penalties did act: tokens repeat
    prompt = "Hello, world! How are"
    prompt_ids = tiny_target.tokenizer.encode(prompt)
    sampling = SamplingConfig(temperature=0.8, top_k=40, penalty_start=len(prompt_ids), **penalties)
    p1, joint = exact_first_two_token_distribution(tiny_target, prompt_ids, sampling)
    plain_p1, plain_joint = exact_first_two_token_distribution(tiny_target, prompt_ids, SAMPLING)
    assert p1 == plain_p1 and joint != plain_joint   # only the second token is moved
    first, pairs, runs = collections.Counter(), collections.Counter(), 1500
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(lambda seed: generate(stack.coordinator_stub, prompt, speculate=True, gamma=3,
                                                        max_new_tokens=3, temperature=0.8, top_k=40, seed=seed,
                                                        **penalties), range(runs)))
    for r in responses:
        x1, pair = observed_outcome(r)
        first[x1] += 1
        pairs[pair] += 1
    assert chi_square_p(first, p1, runs) > 1e-3
    assert chi_square_p(pairs, joint, runs) > 1e-3
    # Power: how often the second token repeats the first, what the penalties move most,
    # is the penalized distribution's and far from the plain one's.
    def repeats(dist: dict) -> float:
        return sum(p for (a, b), p in dist.items() if a == b)
    seen = sum(n for (a, b), n in pairs.items() if a == b) / runs
    sigma = (repeats(joint) * (1 - repeats(joint)) / runs) ** 0.5
    assert abs(seen - repeats(joint)) < 4 * sigma and abs(seen - repeats(plain_joint)) > 10 * sigma, (
        seen, repeats(joint), repeats(plain_joint))
