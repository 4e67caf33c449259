"""The whole pipeline over real gRPC on loopback: lossless, end to end (fp32)."""
from __future__ import annotations

import collections
import concurrent.futures
import time

import pytest

import drafter.service
import verifier.service
from specdec.runtime.models import load_model
from specdec.spec.sampling import SamplingConfig
from specdec.v1 import common_pb2, coordinator_pb2 as pb
from specdec_tools.distribution import chi_square_p, exact_first_two_token_distribution, observed_outcome
from coordinator.service import seeded_gamma
from tests.conftest import (CHEAP_DRAFT_MS, TARGET_MS, coordinator_stub, model_draft_tokens, pair_stub, pinned_services,
                            wait_for)

PROMPTS = [
    "Write a function that returns the sum of two numbers.",
    "Hello, world! How are you today?",
    "The weather today is sunny",
    "def fibonacci(n):",
    "Once upon a time there was",
    "What is the capital of France?",
    "Translate the following sentence into French.",
    "for i in range(10):",
    "A list is mutable, which means",
    "The quick brown fox",
    "Speculative decoding makes",
    "class Stack:",
]


def generate(stub, prompt: str, *, speculate: bool, gamma: int = 4, max_new_tokens: int = 40,
             temperature: float = 0.0, seed: int | None = None, **sampling) -> pb.GenerateResponse:
    params = common_pb2.SamplingParams(temperature=temperature, **sampling)
    if seed is not None:
        params.seed = seed
    return stub.Generate(pb.GenerateRequest(
        prompt=prompt, max_new_tokens=max_new_tokens, sampling=params,
        speculation=pb.Speculation(enabled=speculate, gamma=gamma)), timeout=60)


def assert_greedy_equal(reference_stub, speculative_stub, prompts, gamma: int, max_new_tokens: int = 40) -> None:
    """Speculative ids equal target-only ids on every prompt, and drafts were both
    accepted and rejected along the way (so both paths were exercised)."""
    drafted = accepted = 0
    for prompt in prompts:
        reference = generate(reference_stub, prompt, speculate=False, max_new_tokens=max_new_tokens)
        speculative = generate(speculative_stub, prompt, speculate=True, gamma=gamma, max_new_tokens=max_new_tokens)
        assert list(speculative.token_ids) == list(reference.token_ids), prompt
        assert speculative.text == reference.text
        drafted += speculative.stats.draft_tokens
        accepted += speculative.stats.accepted_tokens
    assert 0 < accepted < drafted


@pytest.mark.parametrize("gamma", [1, 3, 5])
def test_greedy_speculative_output_equals_target_only(stack, gamma):
    assert len(PROMPTS) >= 10
    assert_greedy_equal(stack.coordinator_stub, stack.coordinator_stub, PROMPTS, gamma)


def test_the_calls_rpc_cost_is_their_time_less_the_services_own(tiny_draft, tiny_target, monkeypatch):
    """stats.rpc_ms is what the calls cost as calls: a verifier slow in its forwards makes the
    rounds slow, not their calls (their time in the service is taken off)."""
    with pair_stub(tiny_draft, tiny_target, gamma=3) as stub:
        fast = tiny_target.lean.batch

        def slow(items):
            time.sleep(0.05)
            return fast(items)
        monkeypatch.setattr(tiny_target.lean, "batch", slow)   # after the warm-up: its curves stay
        spec = generate(stub, PROMPTS[0], speculate=True, gamma=3, max_new_tokens=12).stats
        target_only = generate(stub, PROMPTS[1], speculate=False, max_new_tokens=12).stats
    for s in (spec, target_only):
        assert s.verify_ms >= 50 * s.rounds, s     # every verify and decode call waited for a slow forward
        assert 0 < s.rpc_ms < 10 * s.rounds, s     # ... which is the service's time, not the calls'
    assert spec.rpc_ms < spec.draft_ms + spec.verify_ms - 50 * spec.rounds


def test_stats_agree_with_the_tokens_and_the_time_the_client_saw(stack):
    started = time.perf_counter()
    r = generate(stack.coordinator_stub, PROMPTS[0], speculate=True, gamma=4, max_new_tokens=30)
    wall_ms = (time.perf_counter() - started) * 1e3
    s = r.stats
    assert r.finish_reason == pb.FINISH_REASON_LENGTH and len(r.token_ids) == 30
    # Every token is the prefill's first, an accepted draft, or one the target added per round
    # (recovered or bonus): the counts must add up to what the client received.
    assert 1 + s.accepted_tokens + s.rounds == len(r.token_ids)
    assert s.accepted_tokens <= s.draft_tokens <= 4 * s.rounds and s.gamma == 4
    # Per position, a draft is checked only after the one before it was accepted.
    assert all(a >= b for a, b in zip(s.acceptance_by_position, s.acceptance_by_position[1:]))
    # The parts fit inside the request, and the request inside what the client waited.
    parts = s.prefill_ms + s.draft_ms + s.verify_ms
    assert 0 < s.prefill_ms and parts <= s.total_ms + 0.05 <= wall_ms + 0.05
    assert s.overhead_ms >= -0.05 and s.tokens_per_second >= 30 / (wall_ms / 1e3) * 0.999
    assert s.prompt_tokens > 0
    # Target-only reads the same way: the prefill (with its first token) apart, then its
    # Decode calls (16 tokens each) as rounds: 1 + 16 + 13 tokens.
    t = generate(stack.coordinator_stub, PROMPTS[0], speculate=False, max_new_tokens=30).stats
    assert t.rounds == 2 and t.prefill_ms <= t.first_token_ms and t.prefill_ms + t.verify_ms <= t.total_ms + 0.05


def test_seeded_sampling_is_reproducible(stack):
    runs = [generate(stack.coordinator_stub, PROMPTS[1], speculate=True, temperature=0.9, seed=1234)
            for _ in range(2)]
    other = generate(stack.coordinator_stub, PROMPTS[1], speculate=True, temperature=0.9, seed=99)
    assert list(runs[0].token_ids) == list(runs[1].token_ids)
    assert list(other.token_ids) != list(runs[0].token_ids)


def test_stream_matches_unary(stack):
    request = pb.GenerateRequest(prompt=PROMPTS[3], max_new_tokens=25, speculation=pb.Speculation(gamma=3))
    unary = stack.coordinator_stub.Generate(request, timeout=60)
    messages = list(stack.coordinator_stub.GenerateStream(request, timeout=60))
    final = messages[-1]
    assert final.finish_reason == unary.finish_reason and final.stats.rounds == unary.stats.rounds
    # The target's first token alone (it streams once the prefill is done), one message per round, the final.
    assert len(messages[0].token_ids) == 1 and not final.token_ids and len(messages) - 2 == unary.stats.rounds
    assert [t for m in messages for t in m.token_ids] == list(unary.token_ids)
    assert "".join(m.text for m in messages) == unary.text


def test_the_first_token_comes_before_the_drafter_prefills_and_the_drafter_then_knows_it(tiny_target):
    # The target drafting for itself: every draft must be accepted, from the first
    # round on, which holds only if the drafter's session starts from the prompt
    # and the target's first token (one token behind, its first draft would be off).
    servers = [drafter.service.serve(tiny_target), verifier.service.serve(tiny_target)]
    try:
        with coordinator_stub(drafter=f"127.0.0.1:{servers[0].port}", verifier=f"127.0.0.1:{servers[1].port}") as stub:
            for speculation in (pb.Speculation(gamma=3), pb.Speculation(enabled=False)):
                request = pb.GenerateRequest(prompt=PROMPTS[4], max_new_tokens=25, ignore_eos=True,
                                             speculation=speculation)
                messages = list(stub.GenerateStream(request, timeout=60))
                s = messages[-1].stats
                assert len(messages[0].token_ids) == 1  # streamed once decided, speculating or not
                assert 0 < s.first_token_ms <= s.total_ms
                if speculation.gamma:
                    assert 0 < s.accepted_tokens == s.draft_tokens
                    assert s.first_token_ms <= s.prefill_ms  # the drafter's prefill came after it
    finally:
        for server in servers:
            server.stop(0)


def test_adaptive_gamma_skips_the_drafter_where_its_prefill_costs_more_than_drafting_saves(tiny_draft, tiny_target):
    # Pinned costs (a drafter prefill of 1 ms a token, a 10 ms target step): a 600-token
    # prompt for 4 new tokens costs the drafter far more to read than drafting can save.
    with pinned_services(tiny_draft, tiny_target, target_ms=[10.0, 10.5, 11.0], draft_prefill_ms=1.0) as addresses, \
            coordinator_stub(**addresses, learn_costs=False) as stub:
        long_prompt = pb.TokenIds(ids=[(11 * i + 5) % 500 for i in range(600)])
        request = pb.GenerateRequest(token_ids=long_prompt, max_new_tokens=4, ignore_eos=True)
        skipped = stub.Generate(request, timeout=60)
        # The model drafted nothing (lookups, which need no prefill, may have).
        assert model_draft_tokens(skipped.stats) == 0 and "prefill" in skipped.stats.fallback
        request.speculation.enabled = False
        assert list(skipped.token_ids) == list(stub.Generate(request, timeout=60).token_ids)
        # A short prompt is drafted as before (its prefill is within one target step).
        short = stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 17]), max_new_tokens=30,
                                                 ignore_eos=True), timeout=60)
        assert model_draft_tokens(short.stats) > 0 and not short.stats.fallback


def test_chat_messages_apply_the_template(stack, tiny_target):
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    request = pb.GenerateRequest(messages=pb.ChatMessages(messages=[pb.ChatMessage(**m) for m in chat]),
                                 max_new_tokens=5)
    response = stack.coordinator_stub.Generate(request, timeout=60)
    text = tiny_target.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n")
    assert response.stats.prompt_tokens == len(tiny_target.tokenizer.encode(text, add_special_tokens=False))


def test_stop_string_ends_generation(stack):
    reference = generate(stack.coordinator_stub, PROMPTS[0], speculate=True, max_new_tokens=40)
    stop = reference.text[10:13]
    request = pb.GenerateRequest(prompt=PROMPTS[0], max_new_tokens=40, stop=[stop])
    response = stack.coordinator_stub.Generate(request, timeout=60)
    assert response.finish_reason == pb.FINISH_REASON_STOP
    assert response.text == reference.text[: reference.text.find(stop)]


# --- sampled output is distributed as the target's ------------------------------------------

RUNS = 2000
SAMPLING = SamplingConfig(temperature=0.8, top_k=40)


def total_variation(counts: collections.Counter, probs: dict, n: int) -> float:
    keys = set(counts) | set(probs)
    return 0.5 * sum(abs(counts.get(k, 0) / n - probs.get(k, 0.0)) for k in keys)


# One client: γ pinned and nothing batched, so no curve decides anything (fixed_policy); with
# eight, the services size their batches on their curves, and the --slow-draft-curves pass runs it.
@pytest.mark.parametrize("clients", [pytest.param(1, marks=pytest.mark.fixed_policy), 8])
def test_sampled_first_two_tokens_follow_the_target_distribution(stack, tiny_target, tiny_draft, clients):
    # With 8 clients at once the verifier and the drafter batch their calls: the
    # rejection sampler must still see exactly each session's own logits.
    prompt = "Hello, world! How are"
    prompt_ids = tiny_target.tokenizer.encode(prompt)
    p1, joint = exact_first_two_token_distribution(tiny_target, prompt_ids, SAMPLING)
    first, pairs = collections.Counter(), collections.Counter()

    def one(seed: int):
        # gamma 3 over 3 new tokens drafts 2: acceptance, rejection at either position, and bonus all occur.
        return generate(stack.coordinator_stub, prompt, speculate=True, gamma=3, max_new_tokens=3,
                        temperature=SAMPLING.temperature, top_k=SAMPLING.top_k, seed=seed)

    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        responses = list(pool.map(one, range(RUNS)))
    for r in responses:
        x1, pair = observed_outcome(r)
        first[x1] += 1
        pairs[pair] += 1
    drafted = sum(r.stats.draft_tokens for r in responses)
    accepted = sum(r.stats.accepted_tokens for r in responses)
    assert 0.2 < accepted / drafted < 0.98      # both acceptance and rejection happened, often
    # The drafter sent its top-64 support (the default truncation), not the whole vocabulary's 2 bytes an entry.
    assert sum(r.stats.draft_bytes for r in responses) / drafted < 2 * tiny_target.vocab_size
    if clients > 1:
        assert max(r.stats.verify_batch_rows for r in responses) > 3  # verify calls did share forwards
    assert chi_square_p(first, p1, RUNS) > 1e-3
    assert chi_square_p(pairs, joint, RUNS) > 1e-3
    # Power: the samples sit much closer to the target's distribution than to the
    # draft's, so a sampler that leaked draft tokens would be noticed.
    draft_p1, _ = exact_first_two_token_distribution(tiny_draft, prompt_ids, SAMPLING)
    tv_target, tv_draft = total_variation(first, p1, RUNS), total_variation(first, draft_p1, RUNS)
    assert tv_target < 0.06 and tv_draft > 2 * tv_target, (tv_target, tv_draft)


def test_int8_drafter_output_is_still_the_targets(stack):
    """However the draft is quantized, the verifier decides: output is unchanged."""
    draft = drafter.service.serve(load_model("tiny-draft", quantize="int8"))
    try:
        with coordinator_stub(drafter=f"127.0.0.1:{draft.port}", verifier=stack.address(stack.verifier)) as stub:
            assert_greedy_equal(stack.coordinator_stub, stub, PROMPTS[:6], gamma=3)
    finally:
        draft.stop(0)


def test_eight_concurrent_clients_batched_get_target_only_greedy_output(stack):
    # Different prompt lengths (so different positions in one batch), speculative
    # and target-only requests mixed: each output is its target-only output alone.
    prompts = [p * (1 + i % 3) for i, p in enumerate(PROMPTS[:8])]
    references = [list(generate(stack.coordinator_stub, p, speculate=False, max_new_tokens=24).token_ids)
                  for p in prompts]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(lambda ip: generate(stack.coordinator_stub, ip[1], speculate=ip[0] % 4 != 3,
                                                      max_new_tokens=24), enumerate(prompts * 2)))
    assert [list(r.token_ids) for r in responses] == references * 2
    assert max(r.stats.verify_batch_rows for r in responses) > 1  # the verifier batched them


def test_concurrent_requests_stay_exact_and_leave_no_sessions(stack):
    references = [list(generate(stack.coordinator_stub, p, speculate=False, max_new_tokens=24).token_ids)
                  for p in PROMPTS[:6]]
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        outputs = list(pool.map(lambda p: list(generate(stack.coordinator_stub, p, speculate=True,
                                                        max_new_tokens=24).token_ids), PROMPTS[:6] * 2))
    assert outputs == references * 2
    for stub in (stack.drafter_stub, stack.verifier_stub):  # sessions end right after the answers
        assert wait_for(lambda: stub.Info(common_pb2.InfoRequest(), timeout=5).active_sessions == 0, 5)


def test_adaptive_gamma_is_lossless_and_seeded_samples_stay_reproducible(stack, tiny_draft, tiny_target):
    """The default coordinator γ is auto: greedy output still equals target-only,
    and a seeded sample does not depend on timing (it runs at a fixed γ, chosen at start). The
    costs are pinned (drafting pays), so that it drafts on any machine."""
    with pinned_services(tiny_draft, tiny_target) as addresses, \
            coordinator_stub(**addresses, learn_costs=False) as auto:
        drafted, deepest = 0, 0
        for prompt in PROMPTS[:6]:
            request = pb.GenerateRequest(prompt=prompt, max_new_tokens=40,
                                         sampling=common_pb2.SamplingParams(temperature=0))
            speculative = auto.Generate(request, timeout=60)
            reference = generate(stack.coordinator_stub, prompt, speculate=False)
            assert list(speculative.token_ids) == list(reference.token_ids), prompt
            drafted += speculative.stats.draft_tokens
            deepest = max(deepest, len(speculative.stats.acceptance_by_position))
        # It did speculate, and never drafted deeper than the bound (8: the verifier's curve has 9 rows).
        assert drafted > 0 and 1 <= deepest <= 8
        seeded = pb.GenerateRequest(prompt=PROMPTS[1], max_new_tokens=30,
                                    sampling=common_pb2.SamplingParams(temperature=0.9, seed=77))
        runs = [auto.Generate(seeded, timeout=60) for _ in range(2)]
        assert list(runs[0].token_ids) == list(runs[1].token_ids)
        # The fixed γ is the best on the curves published at start (at the prior acceptance).
        assert runs[0].stats.gamma == seeded_gamma(TARGET_MS, CHEAP_DRAFT_MS, 8) > 0
        assert runs[0].stats.draft_tokens > 0


def test_the_adaptive_gamma_bound_follows_the_verifiers_cost_curve(tiny_target, tiny_draft):
    # 1..4 rows published: γ at most 3 (pinned costs on which drafting pays, so it drafts).
    with pinned_services(tiny_draft, tiny_target, target_ms=[10.0, 10.5, 11.0, 11.5]) as addresses, \
            coordinator_stub(**addresses, learn_costs=False) as auto:
        deepest = 0
        for prompt in PROMPTS[:4]:
            response = auto.Generate(pb.GenerateRequest(prompt=prompt, max_new_tokens=30), timeout=60)
            deepest = max(deepest, len(response.stats.acceptance_by_position))
        assert 1 <= deepest <= 3


def test_the_hybrid_proposer_drafts_from_lookups_and_the_model_and_stays_exact(stack):
    """The default proposer: lookups (free) where the text repeats (the tiny
    random target falls into loops of its own output), the model elsewhere;
    greedy output is target-only's, whichever drafted, at adaptive γ (whose
    choices follow timings) and at a fixed γ (whose do not: both sources drafted).
    Recent outputs are searched too: the fixed γ's lookups find the adaptive run's."""
    with coordinator_stub(drafter=stack.address(stack.drafter), verifier=stack.address(stack.verifier),
                          lookup_history_tokens=16384) as auto:
        sources = collections.Counter()
        for prompt in PROMPTS[:4]:
            request = pb.GenerateRequest(prompt=prompt, max_new_tokens=160, ignore_eos=True)
            request.speculation.enabled = False
            reference = auto.Generate(request, timeout=60)
            request.speculation.enabled = True
            assert list(auto.Generate(request, timeout=60).token_ids) == list(reference.token_ids), prompt
            request.speculation.gamma = 4
            response = auto.Generate(request, timeout=60)
            assert list(response.token_ids) == list(reference.token_ids), prompt
            for source in response.stats.draft_sources:
                sources[source.source, "drafted"] += source.draft_tokens
                sources[source.source, "accepted"] += source.accepted_tokens
            assert sum(s.draft_tokens for s in response.stats.draft_sources) == response.stats.draft_tokens
            # The model alone, asked for: no lookups.
            request.speculation.proposer = pb.PROPOSER_KIND_MODEL
            alone = auto.Generate(request, timeout=60)
            assert list(alone.token_ids) == list(reference.token_ids)
            assert {s.source for s in alone.stats.draft_sources} <= {"model"}
        assert sources["ngram", "accepted"] > 0 and sources["model", "drafted"] > 0, sources


def test_the_smallest_temperatures_sample_the_greedy_output(stack):
    """A temperature at the bottom of float32's normal range is the greedy limit
    through both services (the drafter's proposals and the verifier's rejection
    sampler agree), not NaN probabilities and a run of the last vocabulary id."""
    greedy = generate(stack.coordinator_stub, "Once upon a time", speculate=False, max_new_tokens=24)
    for temperature in (1.2e-38, 1e-20):
        for speculate in (False, True):
            sampled = generate(stack.coordinator_stub, "Once upon a time", speculate=speculate,
                               temperature=temperature, seed=3, max_new_tokens=24)
            assert list(sampled.token_ids) == list(greedy.token_ids), (temperature, speculate)
            if speculate:  # the drafter proposed the greedy tokens too, and they were kept
                assert 0 < sampled.stats.accepted_tokens <= sampled.stats.draft_tokens
