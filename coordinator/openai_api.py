"""OpenAI's request and response shapes, mapped to and from the public gRPC API.

Pure mapping, no I/O: a chat or completions request becomes one
`GenerateRequest` (what `Generate` takes), and each update the engine yields
becomes a response, a stream chunk or the usage at the end. The HTTP front
(coordinator.http_server) calls the same servicer as `Generate` with them.

Parameters that would change what is generated and that the service does not
do are refused with a 400 naming them, never ignored; the ones that change
nothing here (`user`, `metadata`, `store`, `service_tier`) are accepted.
Extensions, as vLLM names them where it has them: `top_k`, `repetition_penalty`,
`ignore_eos`, `cache_salt`, and `speculation` ({enabled, gamma, proposer}, as on
gRPC). Speculation's stats come back in a `specdec` field beside `usage`.
"""
from __future__ import annotations

import time
import uuid
from typing import Any, Literal

import grpc
from google.protobuf.json_format import MessageToDict
from pydantic import BaseModel, ConfigDict, Field

from specdec.rpc.errors import InvalidArgument, NotFound
from specdec.spec.sampling import SamplingConfig
from specdec.spec.wire import sampling_to_proto
from specdec.v1 import common_pb2, coordinator_pb2 as pb

MAX_COMPLETION_LOGPROBS = 5    # completions' `logprobs` (chat's top_logprobs: Generate's bound, up to 20)
# Set to anything but their "off" value, these change the output in ways this service does not do.
REFUSED = {
    "tools": None, "tool_choice": None, "functions": None, "function_call": None, "response_format": None,
    "logit_bias": None, "audio": None, "prediction": None, "parallel_tool_calls": None, "suffix": None,
    "best_of": 1, "echo": False, "modalities": None, "reasoning_effort": None, "web_search_options": None,
}
FINISH_REASONS = {pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_EOS: "stop"}
PROPOSERS = {"hybrid": pb.PROPOSER_KIND_HYBRID, "model": pb.PROPOSER_KIND_MODEL, "ngram": pb.PROPOSER_KIND_NGRAM}

# gRPC's codes as HTTP statuses and OpenAI's error types: the one mapping both fronts share.
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.CANCELLED: (499, "cancelled"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
}


def error_body(code: grpc.StatusCode, message: str, param: str | None = None) -> tuple[int, dict]:
    status, kind = HTTP_STATUS.get(code, (500, "internal_error"))
    return status, {"error": {"message": message, "type": kind, "param": param, "code": code.name.lower()}}


class Speculation(BaseModel):
    model_config = ConfigDict(extra="forbid")
    enabled: bool | None = None
    gamma: int | None = Field(default=None, ge=0)
    proposer: Literal["hybrid", "model", "ngram"] | None = None
    sources: list[str] | None = Field(default=None, max_length=16)   # draft sources by name (checked by Generate)


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    """What chat and completions requests share."""
    model_config = ConfigDict(extra="allow")   # other clients' fields: checked against REFUSED, else ignored
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    n: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    cache_salt: str | None = None
    speculation: Speculation | None = None


class ChatRequest(_Common):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0)   # the bound and logprobs' need: Generate's checks


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None


def _refuse_unsupported(request: _Common) -> None:
    for name, off in REFUSED.items():
        value = (request.model_extra or {}).get(name, getattr(request, name, off))
        if value is not None and value != off and value != []:
            raise InvalidArgument(f"'{name}' is not supported by this server")
    if request.n not in (None, 1):
        raise InvalidArgument(f"n={request.n}: this server returns one choice per request (n=1)")


def _content(message: dict[str, Any], index: int) -> str:
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise InvalidArgument(f"messages[{index}].content: only text parts are supported")
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise InvalidArgument(f"messages[{index}].content must be a string or a list of text parts")


def _sampling(request: _Common) -> common_pb2.SamplingParams:
    """OpenAI's sampling fields as the one SamplingConfig (validated where Generate's are)."""
    if request.seed is not None and request.seed < 0:
        raise InvalidArgument(f"seed={request.seed} must be >= 0")
    return sampling_to_proto(SamplingConfig(
        temperature=1.0 if request.temperature is None else request.temperature,   # OpenAI's default
        top_k=max(request.top_k or 0, 0),                                          # vLLM's -1 and 0: off
        top_p=1.0 if request.top_p is None else request.top_p,
        repetition_penalty=1.0 if request.repetition_penalty is None else request.repetition_penalty,
        seed=request.seed, frequency_penalty=request.frequency_penalty or 0.0,
        presence_penalty=request.presence_penalty or 0.0))


def to_generate(request: _Common, served_model: str) -> pb.GenerateRequest:
    """The GenerateRequest that asks for what `request` asks (InvalidArgument, NotFound otherwise)."""
    if request.model and request.model != served_model:
        raise NotFound(f"The model '{request.model}' does not exist; this server serves '{served_model}'")
    _refuse_unsupported(request)
    out = pb.GenerateRequest(sampling=_sampling(request), ignore_eos=request.ignore_eos,
                             cache_salt=request.cache_salt or "")
    max_tokens = request.max_completion_tokens if isinstance(request, ChatRequest) and \
        request.max_completion_tokens is not None else request.max_tokens
    if max_tokens is not None:
        if max_tokens < 1:
            raise InvalidArgument(f"max_tokens={max_tokens} must be at least 1")
        out.max_new_tokens = max_tokens
    if request.stop is not None:
        out.stop.extend([request.stop] if isinstance(request.stop, str) else request.stop)
    if request.speculation is not None:
        spec = request.speculation
        if spec.enabled is not None:
            out.speculation.enabled = spec.enabled
        out.speculation.gamma = spec.gamma or 0
        out.speculation.proposer = PROPOSERS[spec.proposer] if spec.proposer else pb.PROPOSER_KIND_UNSPECIFIED
        out.speculation.sources.extend(spec.sources or ())
    if isinstance(request, ChatRequest):
        if not request.messages:
            raise InvalidArgument("'messages' must hold at least one message")
        out.messages.messages.extend(pb.ChatMessage(role=str(m.get("role", "")), content=_content(m, i))
                                     for i, m in enumerate(request.messages))
        out.logprobs, out.top_logprobs = request.logprobs, request.top_logprobs or 0
    else:
        prompt = request.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise InvalidArgument(f"'prompt' holds {len(prompt)} prompts; this server takes one per request")
            prompt = prompt[0]
        if isinstance(prompt, str):
            out.prompt = prompt
        else:
            out.token_ids.ids.extend(prompt)
        if request.logprobs is not None:
            if not 0 <= request.logprobs <= MAX_COMPLETION_LOGPROBS:
                raise InvalidArgument(f"logprobs={request.logprobs} must be in [0, {MAX_COMPLETION_LOGPROBS}]")
            out.logprobs, out.top_logprobs = True, request.logprobs
    return out


class Reply:
    """One request's responses in OpenAI's shapes: ids, timestamps and the model are
    fixed at the start, and every chunk of a stream carries the same."""

    def __init__(self, chat: bool, model: str, decode_token) -> None:
        self.chat, self.model, self.decode_token = chat, model, decode_token
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.offset = 0   # completions' text_offset of the next token

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def logprobs(self, entries) -> dict | None:
        """A response's logprobs field for these TokenLogprob entries (None: not asked)."""
        if entries is None:
            return None
        if self.chat:
            def item(token_id: int, logprob: float) -> dict:
                text = self.decode_token(token_id)
                return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
            return {"content": [{**item(e.token_id, e.logprob),
                                 "top_logprobs": [item(t.token_id, t.logprob) for t in e.top_logprobs]} for e in entries]}
        tokens = [self.decode_token(e.token_id) for e in entries]
        offsets = []
        for text in tokens:
            offsets.append(self.offset)
            self.offset += len(text)
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{self.decode_token(t.token_id): t.logprob for t in e.top_logprobs} for e in entries],
                "text_offset": offsets}

    def whole(self, text: str, tokens: int, finish_reason: int, stats: pb.GenerationStats, logprobs) -> dict:
        choice: dict[str, Any] = {"index": 0, "finish_reason": FINISH_REASONS.get(finish_reason),
                                  "logprobs": self.logprobs(logprobs)}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {**self._head("chat.completion" if self.chat else "text_completion"), "choices": [choice],
                "usage": usage(stats, tokens), "specdec": speculation_stats(stats)}

    def chunk(self, text: str, first: bool, finish_reason: int | None, logprobs) -> dict:
        choice: dict[str, Any] = {"index": 0, "finish_reason": FINISH_REASONS.get(finish_reason),
                                  "logprobs": self.logprobs(logprobs)}
        if self.chat:
            choice["delta"] = ({"role": "assistant"} if first else {}) | ({"content": text} if text or first else {})
        else:
            choice["text"] = text
        return {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [choice]}

    def usage_chunk(self, stats: pb.GenerationStats, tokens: int) -> dict:
        return {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [],
                "usage": usage(stats, tokens), "specdec": speculation_stats(stats)}


def usage(stats: pb.GenerationStats, completion: int) -> dict:
    prompt = int(stats.prompt_tokens)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def speculation_stats(stats: pb.GenerationStats) -> dict:
    """Every GenerationStats field, as the proto names them (acceptance, mean accepted
    length, rounds, draft sources, ...): what `Generate` returns beside the text."""
    return MessageToDict(stats, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
