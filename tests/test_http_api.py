"""The OpenAI-compatible HTTP front (coordinator.http_server), through the official
`openai` client and plain HTTP (httpx), against real services on loopback: the
same output as `Generate` and as target-only, the stream adding up to the unary
response, errors raised as the client's own exception types, logprobs equal
whether speculating or not, and a client that goes away freeing its sessions."""
from __future__ import annotations

import json
import re
import time
from typing import Literal

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

import drafter.service
import verifier.service
from specdec.rpc.serving import channel
from specdec.v1 import common_pb2, coordinator_pb2 as pb, verifier_pb2_grpc
from tests.conftest import served_coordinator, wait_for

MESSAGES = [{"role": "user", "content": "Write a short story about a robot."}]
TARGET_ONLY = {"speculation": {"enabled": False}}


@pytest.fixture(scope="module")
def front(tiny_draft, tiny_target):
    servers = [drafter.service.serve(tiny_draft), verifier.service.serve(tiny_target)]
    try:
        with served_coordinator(drafter=f"127.0.0.1:{servers[0].port}", verifier=f"127.0.0.1:{servers[1].port}",
                                gamma=4, http_port=0) as served:
            served.verifier_port = servers[1].port
            served.base_url = f"http://127.0.0.1:{served.running.http_port}/v1"
            yield served
    finally:
        for server in servers:
            server.stop(0)


@pytest.fixture(scope="module")
def client(front):
    with openai.OpenAI(base_url=front.base_url, api_key="unused", max_retries=0) as c:
        yield c


def model_name(client) -> str:
    (model,) = client.models.list().data
    return model.id


def test_models_name_the_target_and_health_answers(front, client):
    assert model_name(client) == "tiny-target"
    health = httpx.get(front.base_url.removesuffix("/v1") + "/health")
    assert health.status_code == 200 and health.json() == {"status": "ok"}


def test_greedy_chat_is_generates_output_and_target_onlys(front, client):
    model = model_name(client)
    chat = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=24, temperature=0,
                                          extra_body={"ignore_eos": True})
    plain = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=24, temperature=0,
                                           extra_body={"ignore_eos": True, **TARGET_ONLY})
    grpc_reply = front.stub.Generate(pb.GenerateRequest(
        messages=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=MESSAGES[0]["content"])]),
        max_new_tokens=24, ignore_eos=True, sampling=common_pb2.SamplingParams(temperature=0)), timeout=60)
    (choice,) = chat.choices
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert choice.message.content == grpc_reply.text == plain.choices[0].message.content
    assert chat.usage.completion_tokens == len(grpc_reply.token_ids) == 24
    assert chat.usage.prompt_tokens == grpc_reply.stats.prompt_tokens
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + 24
    stats = chat.model_extra["specdec"]                # the extension field passes through the client
    assert stats["rounds"] == grpc_reply.stats.rounds and stats["gamma"] == 4
    assert stats["accepted_tokens"] + stats["rounds"] + 1 == 24
    assert plain.model_extra["specdec"]["draft_tokens"] == 0


def test_penalties_map_to_the_sampling_config(front, client):
    """OpenAI's frequency and presence penalties are the gRPC API's: the same greedy
    output either way, and not the output without them."""
    penalized = client.completions.create(model=model_name(client), prompt="the the the", max_tokens=24,
                                          temperature=0, frequency_penalty=-1.5, presence_penalty=-1.0,
                                          extra_body={"ignore_eos": True})
    sampling = common_pb2.SamplingParams(temperature=0, frequency_penalty=-1.5, presence_penalty=-1.0)
    grpc_reply = front.stub.Generate(pb.GenerateRequest(prompt="the the the", max_new_tokens=24, ignore_eos=True,
                                                        sampling=sampling), timeout=60)
    plain = client.completions.create(model=model_name(client), prompt="the the the", max_tokens=24, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert penalized.choices[0].text == grpc_reply.text != plain.choices[0].text


def test_completions_take_text_or_token_ids(front, client):
    model = model_name(client)
    text = client.completions.create(model=model, prompt="def fibonacci(n):", max_tokens=16, temperature=0)
    grpc_reply = front.stub.Generate(pb.GenerateRequest(prompt="def fibonacci(n):", max_new_tokens=16,
                                                        sampling=common_pb2.SamplingParams(temperature=0)), timeout=60)
    assert text.object == "text_completion" and text.choices[0].text == grpc_reply.text
    ids = client.completions.create(model=model, prompt=[5, 17, 99, 3], max_tokens=8, temperature=0)
    by_ids = front.stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 17, 99, 3]), max_new_tokens=8,
                                                    sampling=common_pb2.SamplingParams(temperature=0)), timeout=60)
    assert ids.choices[0].text == by_ids.text


def test_a_stream_adds_up_to_the_unary_response_and_ends_with_usage(client):
    model = model_name(client)
    unary = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=20, temperature=0,
                                           stop=["\n\n"])
    chunks = list(client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=20, temperature=0,
                                                 stop=["\n\n"], stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == unary.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [unary.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == unary.usage.completion_tokens
    assert len({c.id for c in chunks}) == 1


def test_plain_http_streams_server_sent_events_to_done(front):
    with httpx.stream("POST", front.base_url + "/completions", timeout=60,
                      json={"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0, "stream": True,
                            "ignore_eos": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"
    assert all(line.isascii() for line in lines)   # escaped: no line splitter may cut an event
    events = [json.loads(line[6:]) for line in lines[:-1]]
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert all(e["object"] == "text_completion" for e in events)


@pytest.mark.parametrize("kwargs, error, says, param", [
    (dict(n=2), openai.BadRequestError, "n: is not supported by this server (only 1", "n"),
    (dict(model="gpt-4o"), openai.NotFoundError, "gpt-4o", "model"),
    (dict(frequency_penalty=2.5), openai.BadRequestError, "frequency_penalty must be in", "frequency_penalty"),
    (dict(max_tokens=0), openai.BadRequestError, "max_tokens: Input should be greater than or equal to 1",
     "max_tokens"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}]), openai.BadRequestError,
     "tools: is not supported", "tools"),
    (dict(top_logprobs=21, logprobs=True), openai.BadRequestError, "top_logprobs", "top_logprobs"),
    (dict(extra_body={"speculation": {"proposer": "oracle"}}), openai.BadRequestError, "proposer",
     "speculation.proposer"),
    (dict(extra_body={"speculation": {"sources": ["eagle"]}}), openai.BadRequestError, "from ngram, grammar, model",
     "speculation.sources"),
    (dict(messages=[]), openai.BadRequestError, "messages", "messages"),
    (dict(extra_body={"min_p": 0.05}), openai.BadRequestError, "min_p", "min_p"),
])
def test_bad_requests_raise_the_clients_exception_with_the_reason(client, kwargs, error, says, param):
    request = dict(model=model_name(client), messages=MESSAGES, max_tokens=4) | kwargs
    with pytest.raises(error) as raised:
        client.chat.completions.create(**request)
    body = raised.value.body
    assert says in body["message"] and body["type"] in ("invalid_request_error", "not_found_error"), body
    assert body["param"] == param, body


def test_while_not_serving_new_requests_get_503_and_health_says_so(front, client):
    """What SIGTERM's drain (RunningServer.stop) and a verifier going down do to the
    gRPC health status, the HTTP front follows: no new generation, /health 503."""
    health = front.base_url.removesuffix("/v1") + "/health"
    front.running.set_serving(False)
    try:
        assert httpx.get(health).status_code == 503
        with pytest.raises(openai.APIStatusError) as raised:
            client.completions.create(model=model_name(client), prompt="hi", max_tokens=2)
        assert raised.value.status_code == 503 and "retry shortly" in raised.value.body["message"]
    finally:
        front.running.set_serving(True)
    assert httpx.get(health).status_code == 200
    # Greedy: an unseeded sample of the tiny model could end at EOS before its first token.
    assert client.completions.create(model=model_name(client), prompt="hi", max_tokens=2,
                                     temperature=0).usage.completion_tokens


def test_the_bearer_token_is_the_grpc_apis(tiny_target, monkeypatch):
    v = verifier.service.serve(tiny_target)
    try:
        with served_coordinator(drafter=None, verifier=f"127.0.0.1:{v.port}", proposer="ngram", http_port=0,
                                auth_token="s3cret") as served:
            url = f"http://127.0.0.1:{served.running.http_port}/v1"
            with openai.OpenAI(base_url=url, api_key="wrong", max_retries=0) as wrong:
                with pytest.raises(openai.AuthenticationError):
                    wrong.models.list()
            with openai.OpenAI(base_url=url, api_key="s3cret", max_retries=0) as right:
                reply = right.completions.create(model="tiny-target", prompt="hi", max_tokens=3, temperature=0)
                assert reply.usage.completion_tokens == 3
    finally:
        v.stop(0)


def test_logprobs_are_the_targets_whether_speculating_or_not(client):
    model = model_name(client)
    asked = dict(model=model, messages=MESSAGES, max_tokens=20, logprobs=True, top_logprobs=3)
    for temperature in (0.0, 0.8):
        spec = client.chat.completions.create(**asked, temperature=temperature, seed=7,
                                              extra_body={"ignore_eos": True})
        plain = client.chat.completions.create(**asked, temperature=temperature, seed=7,
                                               extra_body={"ignore_eos": True, **TARGET_ONLY})
        mine, theirs = spec.choices[0].logprobs.content, plain.choices[0].logprobs.content
        assert len(mine) == 20 and spec.model_extra["specdec"]["accepted_tokens"] > 0
        for a, b in zip(mine, theirs):     # where the outputs agree, so do the target's logprobs
            if a.token != b.token:
                break
            assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
            assert [t.token for t in a.top_logprobs] == [t.token for t in b.top_logprobs]
        for entry in mine:
            tops = [t.logprob for t in entry.top_logprobs]
            assert len(tops) == 3 and tops == sorted(tops, reverse=True) and entry.logprob <= tops[0] + 1e-6
            if temperature == 0:             # greedy: the token is the most likely one
                assert entry.logprob == pytest.approx(tops[0], abs=1e-6)


def test_a_client_that_goes_away_frees_its_sessions(front):
    def active() -> int:
        with channel(f"127.0.0.1:{front.verifier_port}") as ch:
            return verifier_pb2_grpc.VerifierStub(ch).Info(common_pb2.InfoRequest(), timeout=10).active_sessions
    # Target-only, a verifier step a token: the stream must not be over before the client's
    # first line (the server writes ahead into the socket's buffers).
    request = {"messages": MESSAGES, "max_tokens": 900, "temperature": 0, "ignore_eos": True, **TARGET_ONLY}
    started = time.monotonic()
    httpx.post(front.base_url + "/chat/completions", json=request, timeout=120).raise_for_status()
    whole_s = time.monotonic() - started          # what the request takes when the client stays
    assert wait_for(lambda: active() == 0, 5)      # sessions end off the answer's path, soon after it
    with httpx.stream("POST", front.base_url + "/chat/completions", json=request | {"stream": True},
                      timeout=60) as r:
        next(r.iter_lines())          # the first token is out: the sessions are open
        assert active() == 1
        left = time.monotonic()
    while active() and time.monotonic() - left < 10:
        time.sleep(0.01)
    assert active() == 0 and time.monotonic() - left < whole_s / 2, (time.monotonic() - left, whole_s)


class Verdict(BaseModel):
    verdict: Literal["yes", "no"]
    confidence: int = Field(ge=0, le=9)
    reasons: list[Literal["cost", "speed", "risk"]] = Field(max_length=2)


@pytest.mark.parametrize("speculate", [False, True])
def test_the_openai_clients_parse_returns_the_pydantic_object(client, speculate):
    extra = {} if speculate else TARGET_ONLY
    for seed in range(3):
        completion = client.beta.chat.completions.parse(
            model=model_name(client), messages=MESSAGES, response_format=Verdict, max_tokens=64, temperature=0.8,
            seed=seed, extra_body=extra)
        choice = completion.choices[0]
        assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Verdict), choice
        assert Verdict.model_validate_json(choice.message.content) == choice.message.parsed


@pytest.mark.parametrize("extra, matches", [
    ({"guided_regex": "[a-d]{2}"}, lambda text: re.fullmatch("[a-d]{2}", text)),
    ({"guided_choice": ["red", "green"]}, lambda text: text in ("red", "green")),
    ({"structured_outputs": {"choice": ["up", "down"]}}, lambda text: text in ("up", "down")),
    ({"structured_outputs": {"regex": "[0-9]{3}"}}, lambda text: re.fullmatch("[0-9]{3}", text)),
    ({"guided_grammar": 'root ::= "a" | "b" "c"'}, lambda text: text in ("a", "bc")),
    ({"guided_json": {"type": "object", "properties": {"n": {"type": "integer", "maximum": 99}}, "required": ["n"],
                      "additionalProperties": False}}, lambda text: set(json.loads(text)) == {"n"}),
])
def test_vllms_structured_output_fields_constrain_chat_and_completions_streamed_or_not(client, extra, matches):
    model = model_name(client)
    for stream in (False, True):
        chat = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=40, temperature=0,
                                              extra_body=extra, stream=stream)
        text = "".join(c.choices[0].delta.content or "" for c in chat) if stream else chat.choices[0].message.content
        assert matches(text), (extra, text)
        completion = client.completions.create(model=model, prompt="Once upon a time", max_tokens=40, temperature=0,
                                               extra_body=extra, stream=stream)
        text = "".join(c.choices[0].text for c in completion) if stream else completion.choices[0].text
        assert matches(text), (extra, text)


def test_a_constraints_error_names_the_field_it_came_in(client):
    for extra, param, says in (
            ({"guided_regex": "[a-"}, "guided_regex", "does not compile"),
            ({"structured_outputs": {"json": {"type": "strin"}}}, "structured_outputs.json", "invalid JSON schema"),
            ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
                "type": "object", "properties": {"a": {"type": "string", "format": "nope"}}}}}},
             "response_format.json_schema.schema", "Unknown format"),
            ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "send one")):
        with pytest.raises(openai.BadRequestError) as raised:
            client.chat.completions.create(model=model_name(client), messages=MESSAGES, max_tokens=4,
                                           extra_body=extra)
        body = raised.value.body
        assert body["param"] == param and says in body["message"], body
