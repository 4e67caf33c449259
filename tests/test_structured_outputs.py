"""Structured outputs through the real services on loopback (tiny pair, fp32):
output under a constraint is target-only's under it, greedy token for token and
sampled in distribution, whatever drafted (the model, lookups, the grammar's
forced tokens); bad constraints are refused in milliseconds and leak nothing."""
from __future__ import annotations

import collections
import json
import re
import time

import grpc
import jsonschema
import pytest

from specdec.spec.grammar import MAX_CONSTRAINT_BYTES, Constraint, GrammarCompiler
from specdec.spec.proposers.grammar import GRAMMAR
from specdec.spec.sampling import SamplingConfig
from specdec.v1 import common_pb2, coordinator_pb2 as pb
from specdec_tools.distribution import chi_square_p, exact_first_two_token_distribution, observed_outcome
from tests.conftest import rpc_error, wait_for

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
          "required": ["name", "age", "tags"], "additionalProperties": False}
CHOICES = ["yes, certainly", "no, never", "maybe later"]
CONSTRAINTS = {
    "json_schema": common_pb2.Constraint(json_schema=json.dumps(PERSON)),
    "json_object": common_pb2.Constraint(json_object=True),
    "regex": common_pb2.Constraint(regex=r"[a-d]{2}( [a-d]{2}){0,5}"),
    "choice": common_pb2.Constraint(choice=common_pb2.ChoiceList(choices=CHOICES)),
    "grammar": common_pb2.Constraint(grammar='start: item ("," item)*\nitem: "red" | "green" | "blue"'),
}
PROMPTS = ["Hello, world! Tell me about", "The quick brown fox", "def fibonacci(n):", "ab cd ab cd ab"]


def satisfies(kind: str, text: str) -> bool:
    if kind == "json_schema":
        jsonschema.validate(json.loads(text), PERSON)
        return True
    if kind == "json_object":
        return isinstance(json.loads(text), dict)
    if kind == "regex":
        return re.fullmatch(r"[a-d]{2}( [a-d]{2}){0,5}", text) is not None
    if kind == "choice":
        return text in CHOICES
    return re.fullmatch(r"(red|green|blue)(,(red|green|blue))*", text) is not None


def generate(stub, prompt: str, constraint, *, speculate: bool, gamma: int = 4, temperature: float = 0.0,
             seed: int | None = None, max_new_tokens: int = 60, sources=()) -> pb.GenerateResponse:
    sampling = common_pb2.SamplingParams(temperature=temperature, constraint=constraint)
    if seed is not None:
        sampling.seed = seed
    return stub.Generate(pb.GenerateRequest(prompt=prompt, max_new_tokens=max_new_tokens, sampling=sampling,
                                            speculation=pb.Speculation(enabled=speculate, gamma=gamma,
                                                                       sources=sources)), timeout=60)


def by_source(response) -> dict[str, tuple[int, int]]:
    return {s.source: (s.draft_tokens, s.accepted_tokens) for s in response.stats.draft_sources}


@pytest.mark.fixed_policy     # γ pinned, one client: no curve decides anything (conftest)
@pytest.mark.parametrize("kind", list(CONSTRAINTS))
def test_greedy_constrained_output_is_target_onlys_and_satisfies_the_constraint(stack, kind):
    drafted = collections.Counter()
    for prompt in PROMPTS:
        reference = generate(stack.coordinator_stub, prompt, CONSTRAINTS[kind], speculate=False)
        speculative = generate(stack.coordinator_stub, prompt, CONSTRAINTS[kind], speculate=True)
        assert list(speculative.token_ids) == list(reference.token_ids), (prompt, reference.text, speculative.text)
        if reference.finish_reason != pb.FINISH_REASON_LENGTH:
            assert satisfies(kind, reference.text), reference.text
        for source, (n, kept) in by_source(speculative).items():
            drafted[source, "drafted"] += n
            drafted[source, "kept"] += kept
    if kind in ("json_schema", "choice"):
        # Keys, braces and the rest of a choice are forced: drafted by the grammar, and kept.
        assert drafted[GRAMMAR, "drafted"] >= 4 and drafted[GRAMMAR, "kept"] >= drafted[GRAMMAR, "drafted"] // 2


def test_the_unconstrained_tiny_target_breaks_each_constraint(stack):
    # Power: without the constraint the same prompts satisfy none of them.
    for prompt in PROMPTS:
        free = stack.coordinator_stub.Generate(pb.GenerateRequest(prompt=prompt, max_new_tokens=20), timeout=60)
        for kind in CONSTRAINTS:
            try:
                assert not satisfies(kind, free.text), (kind, free.text)
            except (ValueError, jsonschema.ValidationError):
                pass


RUNS = 900
SAMPLED = SamplingConfig(temperature=1.0)


@pytest.mark.fixed_policy
@pytest.mark.parametrize("sources,prompt", [
    (("model",), "Hello, world! Tell me about"),
    (("ngram",), "ab cd ab cd ab cd ab cd ab"),       # the lookups find the constrained text in the prompt
    ((GRAMMAR,), "The quick brown fox"),
])
def test_sampled_constrained_output_follows_the_targets_constrained_distribution(stack, tiny_target, sources,
                                                                                 prompt):
    constraint = CONSTRAINTS["regex"] if sources != (GRAMMAR,) else CONSTRAINTS["choice"]
    compiler = GrammarCompiler(tiny_target.tokenizer, tiny_target.eos_token_ids)
    prompt_ids = tiny_target.tokenizer.encode(prompt)
    compiled = compiler.compile(Constraint("regex", constraint.regex) if constraint.regex else
                                Constraint("choice", choices=tuple(constraint.choice.choices)))
    p1, joint = exact_first_two_token_distribution(tiny_target, prompt_ids, SAMPLED,
                                                   compiler.cursor(compiled.grammar, len(prompt_ids)))
    first, pairs, drafted, kept = collections.Counter(), collections.Counter(), 0, 0
    for seed in range(RUNS):
        r = generate(stack.coordinator_stub, prompt, constraint, speculate=True, gamma=3, temperature=1.0,
                     seed=seed, max_new_tokens=3, sources=sources)
        x1, pair = observed_outcome(r)
        first[x1] += 1
        pairs[pair] += 1
        drafted += r.stats.draft_tokens
        kept += r.stats.accepted_tokens
    assert drafted >= RUNS // 4 and kept > 0, (drafted, kept)       # the source drafted, and was judged
    if sources != (GRAMMAR,):       # a forced token is rejected only where the target tokenizes it otherwise
        assert kept < drafted, (drafted, kept)
    assert chi_square_p(first, p1, RUNS) > 1e-3
    assert chi_square_p(pairs, joint, RUNS) > 1e-3
    # Power: against the target's unconstrained distribution the same samples fail.
    free_p1, _ = exact_first_two_token_distribution(tiny_target, prompt_ids, SAMPLED)
    assert chi_square_p(first, free_p1, RUNS) < 1e-6


BAD = [
    (common_pb2.Constraint(json_schema='{"type": "strin"}'), "invalid JSON schema at type"),
    (common_pb2.Constraint(json_schema="{not json"), "is not JSON"),
    (common_pb2.Constraint(json_schema='{"type": "string", "format": "hostnamex"}'), "Unknown format"),
    (common_pb2.Constraint(regex="[a-"), "does not compile"),
    (common_pb2.Constraint(regex=""), "is empty"),
    (common_pb2.Constraint(grammar="start: "), "admits no output"),
    (common_pb2.Constraint(regex=r"[^\s\S]"), "admits no output (nothing but the empty string): 'NoExtensionBias'"),
    (common_pb2.Constraint(grammar="start: foo"), "does not compile"),
    (common_pb2.Constraint(choice=common_pb2.ChoiceList()), "a choice needs 1"),
    (common_pb2.Constraint(json_object=False), "json_object must be true"),
    (common_pb2.Constraint(regex="a" * (MAX_CONSTRAINT_BYTES + 1)), "over the"),
]


@pytest.mark.parametrize("constraint,message", BAD)
def test_a_bad_constraint_is_refused_fast_naming_the_problem(stack, constraint, message):
    started = time.perf_counter()
    error = rpc_error(stack.coordinator_stub.Generate, pb.GenerateRequest(
        prompt="hi", max_new_tokens=8, sampling=common_pb2.SamplingParams(constraint=constraint)))
    assert time.perf_counter() - started < 1.0
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and message in error.details(), error.details()
    assert stack.verifier_stub.Info(common_pb2.InfoRequest()).active_sessions == 0


def test_constraint_fields_a_client_cannot_set(stack):
    for request, message in (
            (pb.GenerateRequest(prompt="hi", ignore_eos=True, sampling=common_pb2.SamplingParams(
                constraint=CONSTRAINTS["regex"])), "ignore_eos cannot be combined"),
            (pb.GenerateRequest(prompt="hi", sampling=common_pb2.SamplingParams(constraint_fingerprint="ab")),
             "the coordinator's own")):
        error = rpc_error(stack.coordinator_stub.Generate, request)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and message in error.details()


def test_a_service_refuses_a_call_under_another_constraint_than_its_sessions(stack, tiny_target):
    compiler = GrammarCompiler(tiny_target.tokenizer, tiny_target.eos_token_ids)
    compiled = compiler.compile(Constraint("regex", "[a-d]{2}"))
    prompt = tiny_target.tokenizer.encode("hello")
    stack.verifier_stub.StartSession(common_pb2.StartSessionRequest(
        session_id="s1", prompt_token_ids=prompt, grammar=compiled.grammar, grammar_start=len(prompt)))
    try:
        from specdec.v1 import verifier_pb2
        for fingerprint in ("", "0" * 32):
            error = rpc_error(stack.verifier_stub.Decode, verifier_pb2.DecodeRequest(
                session_id="s1", num_tokens=2, sampling=common_pb2.SamplingParams(constraint_fingerprint=fingerprint)))
            assert error.code() == grpc.StatusCode.FAILED_PRECONDITION and "constraint" in error.details()
        ok = stack.verifier_stub.Decode(verifier_pb2.DecodeRequest(
            session_id="s1", num_tokens=3, sampling=common_pb2.SamplingParams(
                constraint_fingerprint=compiled.fingerprint)))
        text = tiny_target.tokenizer.decode([t for t in ok.token_ids if t not in tiny_target.eos_token_ids])
        assert re.fullmatch("[a-d]{1,2}", text), text      # the refused calls changed nothing
    finally:
        stack.verifier_stub.EndSession(common_pb2.EndSessionRequest(session_id="s1"))
    assert wait_for(lambda: stack.verifier_stub.Info(common_pb2.InfoRequest()).active_sessions == 0, 5)


def test_the_cursor_follows_any_rollback_and_masks_rows_after_each_draft_token(tiny_target):
    compiler = GrammarCompiler(tiny_target.tokenizer, tiny_target.eos_token_ids)
    grammar = compiler.compile(Constraint("choice", choices=("abab", "abcd", "dddd"))).grammar
    encode = lambda text: tiny_target.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    prompt = encode("q:")
    cursor, fresh = compiler.cursor(grammar, len(prompt)), compiler.cursor(grammar, len(prompt))
    for output in ("ab", "abc", "a", "dd", "abab", ""):       # forward, back, sideways: as KV rollbacks go
        cursor.follow(prompt + encode(output))
        fresh.matcher.reset()
        fresh.consumed.clear()
        fresh.follow(prompt + encode(output))
        assert cursor.consumed == fresh.consumed and cursor.mask() == fresh.mask(), output
    cursor.follow(prompt)
    draft = encode("abcd")
    masks = cursor.row_masks(draft + encode("x"), len(draft) + 2)
    assert cursor.consumed == [] and cursor.mask() == masks[0]       # the matcher is left where it was
    for i in range(1, len(draft) + 1):                                # row i: after draft[:i]
        fresh.follow(prompt + draft[:i])
        assert masks[i] == fresh.mask(), i
    assert masks[-1] is None        # x, drafted where the grammar allows EOS alone, is forbidden
    bad = cursor.row_masks(encode("zz"), 3)
    assert bad[0] is not None and bad[1:] == [None, None]            # a forbidden draft: no row after it is read
