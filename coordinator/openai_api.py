"""OpenAI's request and response shapes, mapped to and from the public gRPC API.

Pure mapping, no I/O: a chat or completions request becomes one
`GenerateRequest` (what `Generate` takes), and each update the engine yields
becomes a response, a stream chunk or the usage at the end. The HTTP front
(coordinator.http_server) calls the same servicer as `Generate` with them.

What a request may hold, and how each field is checked, is openai_schema's: fields
that would change the output and that the service does not do are refused with a
400 naming them, never ignored. Extensions, as vLLM names them where it has them:
`top_k`, `repetition_penalty`, `ignore_eos`, `cache_salt`, and `speculation`
({enabled, gamma, proposer, sources}, as on gRPC). Speculation's stats come back
in a `specdec` field beside `usage`.
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict
from specdec.rpc.errors import InvalidArgument, NotFound, clip
from specdec.spec.sampling import SamplingConfig
from specdec.spec.wire import sampling_to_proto
from specdec.v1 import common_pb2, coordinator_pb2 as pb

from coordinator.openai_schema import ChatRequest, OpenAIRequest

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


def error_dict(message: str, kind: str, code: str, param: str | None = None) -> dict:
    """OpenAI's error body."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_body(code: grpc.StatusCode, message: str, param: str | None = None) -> tuple[int, dict]:
    status, kind = HTTP_STATUS.get(code, (500, "internal_error"))
    return status, error_dict(message, kind, code.name.lower(), param)


def _sampling(request: OpenAIRequest) -> common_pb2.SamplingParams:
    """OpenAI's sampling fields as the one SamplingConfig (validated by Generate's own checks)."""
    return sampling_to_proto(SamplingConfig(
        temperature=1.0 if request.temperature is None else request.temperature,   # OpenAI's default
        top_k=max(request.top_k or 0, 0),                                          # vLLM's -1 and 0: off
        top_p=1.0 if request.top_p is None else request.top_p,
        repetition_penalty=1.0 if request.repetition_penalty is None else request.repetition_penalty,
        seed=request.seed, frequency_penalty=request.frequency_penalty or 0.0,
        presence_penalty=request.presence_penalty or 0.0))


def constraint_of(request: OpenAIRequest) -> tuple[str, common_pb2.Constraint] | None:
    """The one constraint a request's structured-output fields ask for, and the field
    that asked (what an error in it names); None: free text."""
    asked: list[tuple[str, common_pb2.Constraint]] = []

    def json_schema(param: str, schema) -> None:
        text = schema if isinstance(schema, str) else json.dumps(schema)
        asked.append((param, common_pb2.Constraint(json_schema=text)))

    fmt = request.response_format
    if fmt is not None and fmt.type == "json_object":
        asked.append(("response_format", common_pb2.Constraint(json_object=True)))
    elif fmt is not None and fmt.type == "json_schema":
        json_schema("response_format.json_schema.schema", fmt.json_schema.schema_)
    so = request.structured_outputs
    if so is not None:
        for name in ("json_", "json_object", "regex", "choice", "grammar"):
            value = getattr(so, name)
            if value is None or value is False and name == "json_object":
                continue
            param = f"structured_outputs.{name.rstrip('_')}"
            if name == "json_":
                json_schema(param, value)
            elif name == "json_object":
                asked.append((param, common_pb2.Constraint(json_object=True)))
            elif name == "choice":
                asked.append((param, common_pb2.Constraint(choice=common_pb2.ChoiceList(choices=value))))
            else:
                asked.append((param, common_pb2.Constraint(**{name: value})))
        if not any(param.startswith("structured_outputs") for param, _ in asked):
            raise InvalidArgument("structured_outputs: set one of json, json_object, regex, choice or grammar",
                                  "structured_outputs")
    if request.guided_json is not None:
        json_schema("guided_json", request.guided_json)
    if request.guided_regex is not None:
        asked.append(("guided_regex", common_pb2.Constraint(regex=request.guided_regex)))
    if request.guided_choice is not None:
        asked.append(("guided_choice", common_pb2.Constraint(choice=common_pb2.ChoiceList(
            choices=request.guided_choice))))
    if request.guided_grammar is not None:
        asked.append(("guided_grammar", common_pb2.Constraint(grammar=request.guided_grammar)))
    if len(asked) > 1:
        raise InvalidArgument(f"{' and '.join(param for param, _ in asked)} each ask for a structured output; "
                              "send one", asked[1][0])
    return asked[0] if asked else None


def to_generate(request: OpenAIRequest, served_model: str) -> pb.GenerateRequest:
    """The GenerateRequest that asks for what `request` (validated by openai_schema.parse)
    asks: every value within its proto field's range (InvalidArgument, NotFound otherwise)."""
    if request.model and request.model != served_model:
        raise NotFound(f"The model {clip(request.model)} does not exist; this server serves '{served_model}'",
                       "model")
    out = pb.GenerateRequest(sampling=_sampling(request), ignore_eos=request.ignore_eos,
                             cache_salt=request.cache_salt or "")
    constraint = constraint_of(request)
    if constraint is not None:
        out.sampling.constraint.CopyFrom(constraint[1])
    max_tokens = request.max_completion_tokens if isinstance(request, ChatRequest) and \
        request.max_completion_tokens is not None else request.max_tokens
    if max_tokens is not None:
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
        # OpenAI's developer role is the system prompt of models trained before it.
        out.messages.messages.extend(pb.ChatMessage(role="system" if m.role == "developer" else m.role,
                                                    content=m.content) for m in request.messages)
        out.logprobs, out.top_logprobs = request.logprobs, request.top_logprobs or 0
    else:
        if isinstance(request.prompt, str):
            out.prompt = request.prompt
        else:
            out.token_ids.ids.extend(request.prompt)
        if request.logprobs is not None:
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
                                 "top_logprobs": [item(t.token_id, t.logprob) for t in e.top_logprobs]}
                                for e in entries]}
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
