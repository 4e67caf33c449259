from specdec.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ProposerKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PROPOSER_KIND_UNSPECIFIED: _ClassVar[ProposerKind]
    PROPOSER_KIND_HYBRID: _ClassVar[ProposerKind]
    PROPOSER_KIND_MODEL: _ClassVar[ProposerKind]
    PROPOSER_KIND_NGRAM: _ClassVar[ProposerKind]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_EOS: _ClassVar[FinishReason]
PROPOSER_KIND_UNSPECIFIED: ProposerKind
PROPOSER_KIND_HYBRID: ProposerKind
PROPOSER_KIND_MODEL: ProposerKind
PROPOSER_KIND_NGRAM: ProposerKind
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_EOS: FinishReason

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Speculation(_message.Message):
    __slots__ = ("enabled", "gamma", "confidence_stop", "proposer", "sources")
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    GAMMA_FIELD_NUMBER: _ClassVar[int]
    CONFIDENCE_STOP_FIELD_NUMBER: _ClassVar[int]
    PROPOSER_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    gamma: int
    confidence_stop: bool
    proposer: ProposerKind
    sources: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, enabled: _Optional[bool] = ..., gamma: _Optional[int] = ..., confidence_stop: _Optional[bool] = ..., proposer: _Optional[_Union[ProposerKind, str]] = ..., sources: _Optional[_Iterable[str]] = ...) -> None: ...

class DraftSourceStats(_message.Message):
    __slots__ = ("source", "rounds", "draft_tokens", "accepted_tokens", "acceptance_rate")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_RATE_FIELD_NUMBER: _ClassVar[int]
    source: str
    rounds: int
    draft_tokens: int
    accepted_tokens: int
    acceptance_rate: float
    def __init__(self, source: _Optional[str] = ..., rounds: _Optional[int] = ..., draft_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., acceptance_rate: _Optional[float] = ...) -> None: ...

class ProbeStats(_message.Message):
    __slots__ = ("kind", "count", "ms")
    KIND_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    MS_FIELD_NUMBER: _ClassVar[int]
    kind: str
    count: int
    ms: float
    def __init__(self, kind: _Optional[str] = ..., count: _Optional[int] = ..., ms: _Optional[float] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "messages", "token_ids", "max_new_tokens", "stop", "sampling", "speculation", "ignore_eos", "cache_salt", "logprobs", "top_logprobs")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    messages: ChatMessages
    token_ids: TokenIds
    max_new_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    sampling: _common_pb2.SamplingParams
    speculation: Speculation
    ignore_eos: bool
    cache_salt: str
    logprobs: bool
    top_logprobs: int
    def __init__(self, prompt: _Optional[str] = ..., messages: _Optional[_Union[ChatMessages, _Mapping]] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., max_new_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., speculation: _Optional[_Union[Speculation, _Mapping]] = ..., ignore_eos: _Optional[bool] = ..., cache_salt: _Optional[str] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ...) -> None: ...

class GenerationStats(_message.Message):
    __slots__ = ("rounds", "draft_tokens", "accepted_tokens", "acceptance_rate", "mean_accepted_length", "acceptance_by_position", "draft_ms", "verify_ms", "overhead_ms", "total_ms", "tokens_per_second", "prompt_tokens", "gamma", "prefill_ms", "fallback", "first_token_ms", "verify_batch_rows", "verify_queue_ms", "draft_queue_ms", "draft_sources", "draft_bytes", "draft_bytes_per_round", "prefix_cached_tokens", "draft_prefix_cached_tokens", "synthetic_acceptance", "probes", "logprob_bytes", "expected_output_tokens", "rpc_ms")
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_RATE_FIELD_NUMBER: _ClassVar[int]
    MEAN_ACCEPTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_BY_POSITION_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_MS_FIELD_NUMBER: _ClassVar[int]
    OVERHEAD_MS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GAMMA_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_MS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_BATCH_ROWS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_SOURCES_FIELD_NUMBER: _ClassVar[int]
    DRAFT_BYTES_FIELD_NUMBER: _ClassVar[int]
    DRAFT_BYTES_PER_ROUND_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PREFIX_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SYNTHETIC_ACCEPTANCE_FIELD_NUMBER: _ClassVar[int]
    PROBES_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_BYTES_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RPC_MS_FIELD_NUMBER: _ClassVar[int]
    rounds: int
    draft_tokens: int
    accepted_tokens: int
    acceptance_rate: float
    mean_accepted_length: float
    acceptance_by_position: _containers.RepeatedScalarFieldContainer[float]
    draft_ms: float
    verify_ms: float
    overhead_ms: float
    total_ms: float
    tokens_per_second: float
    prompt_tokens: int
    gamma: int
    prefill_ms: float
    fallback: str
    first_token_ms: float
    verify_batch_rows: float
    verify_queue_ms: float
    draft_queue_ms: float
    draft_sources: _containers.RepeatedCompositeFieldContainer[DraftSourceStats]
    draft_bytes: int
    draft_bytes_per_round: float
    prefix_cached_tokens: int
    draft_prefix_cached_tokens: int
    synthetic_acceptance: float
    probes: _containers.RepeatedCompositeFieldContainer[ProbeStats]
    logprob_bytes: int
    expected_output_tokens: float
    rpc_ms: float
    def __init__(self, rounds: _Optional[int] = ..., draft_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., acceptance_rate: _Optional[float] = ..., mean_accepted_length: _Optional[float] = ..., acceptance_by_position: _Optional[_Iterable[float]] = ..., draft_ms: _Optional[float] = ..., verify_ms: _Optional[float] = ..., overhead_ms: _Optional[float] = ..., total_ms: _Optional[float] = ..., tokens_per_second: _Optional[float] = ..., prompt_tokens: _Optional[int] = ..., gamma: _Optional[int] = ..., prefill_ms: _Optional[float] = ..., fallback: _Optional[str] = ..., first_token_ms: _Optional[float] = ..., verify_batch_rows: _Optional[float] = ..., verify_queue_ms: _Optional[float] = ..., draft_queue_ms: _Optional[float] = ..., draft_sources: _Optional[_Iterable[_Union[DraftSourceStats, _Mapping]]] = ..., draft_bytes: _Optional[int] = ..., draft_bytes_per_round: _Optional[float] = ..., prefix_cached_tokens: _Optional[int] = ..., draft_prefix_cached_tokens: _Optional[int] = ..., synthetic_acceptance: _Optional[float] = ..., probes: _Optional[_Iterable[_Union[ProbeStats, _Mapping]]] = ..., logprob_bytes: _Optional[int] = ..., expected_output_tokens: _Optional[float] = ..., rpc_ms: _Optional[float] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("text", "token_ids", "finish_reason", "stats", "logprobs")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: FinishReason
    stats: GenerationStats
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., stats: _Optional[_Union[GenerationStats, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...
