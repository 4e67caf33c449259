"""OpenAI's request bodies, validated before anything reaches a proto.

An allowlist: a request names only fields this server honours, or fields that
change nothing here (`user`, `metadata`, `store`, `service_tier`); every other
field is refused with a 400 that names it, so a parameter that would change the
output is never silently dropped (vLLM's `min_p`, `guided_regex`, ... included).
Fields the service does not do are taken at their no-op value (`NO_OP`:
`logit_bias: {}`, `response_format: {"type": "text"}`, `tool_choice: "none"`, ...)
and refused at any other.

Types are strict (`"stream": "yes"` is not true, `"max_tokens": "5"` not 5);
integers are bounded by the proto fields they go to (a value over uint32 used to
raise inside the mapping: a 500); strings must be UTF-8 text (a lone surrogate
cannot be encoded); floats finite. Semantic ranges (temperature, top_p, the
context window, the vocabulary) are the gRPC API's own checks, run by the same
servicer; their `param` comes back with them (`InvalidArgument.param`).
"""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr,
                      ValidationError, field_validator)

from google.protobuf.descriptor import FieldDescriptor

from specdec.rpc.errors import InvalidArgument, clip
from specdec.spec.limits import MAX_PROPOSE_TOKENS, MAX_TOP_LOGPROBS
from specdec.v1 import common_pb2, coordinator_pb2 as pb



def _proto_max(message, name: str) -> int:
    """The largest value the proto field takes (assigning more raises: it was a 500)."""
    kind = message.DESCRIPTOR.fields_by_name[name].type
    return {FieldDescriptor.TYPE_INT32: 2**31 - 1, FieldDescriptor.TYPE_UINT32: 2**32 - 1,
            FieldDescriptor.TYPE_INT64: 2**63 - 1, FieldDescriptor.TYPE_UINT64: 2**64 - 1}[kind]


MAX_NEW_TOKENS = _proto_max(pb.GenerateRequest, "max_new_tokens")
MAX_SEED, MAX_TOP_K = _proto_max(common_pb2.SamplingParams, "seed"), _proto_max(common_pb2.SamplingParams, "top_k")
MAX_TOKEN_ID = _proto_max(pb.TokenIds, "ids")
MAX_COMPLETION_LOGPROBS = 5    # completions' `logprobs` (chat's top_logprobs: Generate's bound, up to 20)
MAX_NAME_CHARS = 256           # a model's or a draft source's name
# Fields the service does not do, and the values at which they change nothing: taken there, refused elsewhere.
NO_OP: dict[str, tuple] = {
    "logit_bias": ({},), "tools": ([],), "functions": ([],),
    "tool_choice": ("none", "auto"), "function_call": ("none", "auto"), "parallel_tool_calls": (True, False),
    "modalities": (["text"],), "suffix": ("",), "echo": (False,), "best_of": (1,), "n": (1,),
    "min_p": (0, 0.0), "stop_token_ids": ([],), "min_tokens": (0,),
}
# What the gRPC API calls a field where OpenAI's name differs.
HTTP_NAMES = {"max_new_tokens": "max_tokens", "token_ids": "prompt"}


def _utf8(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"is not UTF-8 text (a lone surrogate at character {exc.start})") from None
    return text


Text = Annotated[StrictStr, AfterValidator(_utf8)]
Name = Annotated[StrictStr, Field(max_length=MAX_NAME_CHARS), AfterValidator(_utf8)]
Float = Annotated[StrictFloat, Field(allow_inf_nan=False)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Speculation(_Strict):
    enabled: StrictBool | None = None
    gamma: Annotated[StrictInt, Field(ge=0, le=MAX_PROPOSE_TOKENS)] | None = None
    proposer: Literal["hybrid", "model", "ngram"] | None = None
    sources: Annotated[list[Name], Field(max_length=16)] | None = None   # by name (checked by Generate)


class StreamOptions(_Strict):
    include_usage: StrictBool = False


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]   # developer: OpenAI's newer system
    content: Any = None   # a string, or a list of text parts

    @field_validator("content")
    @classmethod
    def _content(cls, content: Any) -> str:
        """The content as one string (text parts joined)."""
        if content is None:
            return ""
        if isinstance(content, str):
            return _utf8(content)
        if not isinstance(content, list):
            raise ValueError("must be a string or a list of text parts")
        texts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or set(part) != {"type", "text"}:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(f"part {i} is not a text part ({{\"type\": \"text\", \"text\": ...}}): only text "
                                 f"is taken, not {clip(kind)}")
            if not isinstance(part["text"], str):
                raise ValueError(f"part {i}'s text must be a string")
            texts.append(_utf8(part["text"]))
        return "".join(texts)


class TextFormat(_Strict):
    type: Literal["text"]


class JsonObjectFormat(_Strict):
    type: Literal["json_object"]


class JsonSchemaSpec(_Strict):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: Name
    description: Text | None = None
    schema_: dict[str, Any] | StrictBool = Field(alias="schema")
    strict: StrictBool | None = None   # taken either way: the schema is always enforced (a grammar)


class JsonSchemaFormat(_Strict):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaFormat, Field(discriminator="type")]


class StructuredOutputs(_Strict):
    """vLLM's `structured_outputs`: one of its constraints (its backend options are not taken)."""
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    json_: dict[str, Any] | Text | StrictBool | None = Field(default=None, alias="json")
    json_object: StrictBool | None = None
    regex: Text | None = None
    choice: Annotated[list[Text], Field(min_length=1)] | None = None
    grammar: Text | None = None


class OpenAIRequest(_Strict):
    """What chat and completions requests share."""
    model: Name | None = None
    max_tokens: Annotated[StrictInt, Field(ge=1, le=MAX_NEW_TOKENS)] | None = None
    temperature: Float | None = None
    top_p: Float | None = None
    top_k: Annotated[StrictInt, Field(ge=-1, le=MAX_TOP_K)] | None = None    # vLLM's -1 and 0: off
    seed: Annotated[StrictInt, Field(ge=0, le=MAX_SEED)] | None = None
    stop: Text | list[Text] | None = None
    frequency_penalty: Float | None = None
    presence_penalty: Float | None = None
    repetition_penalty: Float | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    ignore_eos: StrictBool = False
    cache_salt: Text | None = None
    speculation: Speculation | None = None
    # Structured outputs (one of them): OpenAI's response_format, vLLM's structured_outputs
    # and its older guided_* fields.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | Text | StrictBool | None = None
    guided_regex: Text | None = None
    guided_choice: Annotated[list[Text], Field(min_length=1)] | None = None
    guided_grammar: Text | None = None
    # Accepted, changing nothing here.
    user: Text | None = None
    metadata: dict[str, Text] | None = None
    store: StrictBool | None = None
    service_tier: Text | None = None
    # NO_OP's: taken at their no-op value only.
    logit_bias: Any = None
    n: Any = None
    best_of: Any = None
    min_p: Any = None
    stop_token_ids: Any = None
    min_tokens: Any = None

    @field_validator(*NO_OP, mode="after", check_fields=False)
    @classmethod
    def _no_op(cls, value: Any, info) -> Any:
        taken = NO_OP[info.field_name]
        if value is not None and not any(value == v and type(value) is type(v) for v in taken):
            raise ValueError(f"is not supported by this server (only {' or '.join(json.dumps(v) for v in taken)}, "
                             "which changes nothing, is taken)")
        return value


class ChatRequest(OpenAIRequest):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Annotated[StrictInt, Field(ge=1, le=MAX_NEW_TOKENS)] | None = None
    logprobs: StrictBool = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    functions: Any = None
    function_call: Any = None
    modalities: Any = None


class CompletionRequest(OpenAIRequest):
    prompt: Any   # text, token ids, or a list of one of either

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, prompt: Any) -> str | list[int]:
        """One prompt: its text or its token ids (this server takes one prompt a request)."""
        if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
            if len(prompt) != 1:
                raise ValueError(f"holds {len(prompt)} prompts; this server takes one per request")
            prompt = prompt[0]
        if isinstance(prompt, str):
            return _utf8(prompt)
        if not isinstance(prompt, list):
            raise ValueError("must be a string, a list of token ids, or a list holding one of either")
        if not prompt:
            raise ValueError("is empty")
        bad = next((t for t in prompt if type(t) is not int or not 0 <= t <= MAX_TOKEN_ID), None)
        if bad is not None:
            raise ValueError(f"token ids are integers from 0 to the vocabulary's size, not {clip(bad)}")
        return prompt
    logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_COMPLETION_LOGPROBS)] | None = None
    suffix: Any = None
    echo: Any = None


def _path(error: dict, data: Any) -> str:
    """A validation error's location as a field path into the request as sent
    ("messages[0].content"): pydantic's own also names union members ("str",
    "list[str]"), which are left out."""
    parts: list[str] = []
    loc = error["loc"]
    for i, key in enumerate(loc):
        if isinstance(key, int) and isinstance(data, list) and 0 <= key < len(data):
            parts.append(f"[{key}]")
            data = data[key]
        elif isinstance(key, str) and isinstance(data, dict) and (key in data or (
                error["type"] == "missing" and i == len(loc) - 1)):
            parts.append(("." if parts else "") + key)
            data = data.get(key)
        elif not isinstance(key, str):
            break
        # else: a union member's name, not a key of what was sent
    return "".join(parts)


def parse(model: type[OpenAIRequest], data: Any) -> OpenAIRequest:
    """`data` (parsed JSON) as `model`; InvalidArgument naming the first field at fault."""
    if not isinstance(data, dict):
        raise InvalidArgument(f"the request body must be a JSON object, not {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        # Of a union's errors, the one reaching deepest into what was sent: a list of stop
        # strings holding a lone surrogate is told that, not that it is not one string.
        errors = exc.errors(include_url=False)
        error = max(errors, key=lambda e: len(_path(e, data)))
        where = _path(error, data) or None
        if error["type"] == "extra_forbidden":
            raise InvalidArgument(f"'{clip(where, 64)[1:-1]}' is not supported by this server; docs/api.md lists the "
                                  "fields it takes", where) from None
        message = error["msg"].removeprefix("Value error, ")
        given = "" if error["type"] == "missing" else f" (got {clip(error.get('input'))})"
        raise InvalidArgument(f"{where or 'the request'}: {message}{given}", where) from None


def http_param(param: str | None, constraint: str | None = None) -> str | None:
    """The gRPC API's name of a field as OpenAI's request calls it; `constraint`: the
    field the request's structured output came from (sampling.constraint's name here)."""
    if param is None:
        return None
    if constraint and param.startswith("sampling.constraint"):
        return constraint
    head, dot, rest = param.partition(".")
    return HTTP_NAMES.get(head, head) + dot + rest
