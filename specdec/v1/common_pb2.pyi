from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "repetition_penalty", "seed", "frequency_penalty", "presence_penalty", "penalty_start", "constraint", "constraint_fingerprint")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PENALTY_START_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    repetition_penalty: float
    seed: int
    frequency_penalty: float
    presence_penalty: float
    penalty_start: int
    constraint: Constraint
    constraint_fingerprint: str
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., seed: _Optional[int] = ..., frequency_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., penalty_start: _Optional[int] = ..., constraint: _Optional[_Union[Constraint, _Mapping]] = ..., constraint_fingerprint: _Optional[str] = ...) -> None: ...

class Constraint(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "choice", "grammar")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    regex: str
    choice: ChoiceList
    grammar: str
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., choice: _Optional[_Union[ChoiceList, _Mapping]] = ..., grammar: _Optional[str] = ...) -> None: ...

class ChoiceList(_message.Message):
    __slots__ = ("choices",)
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    choices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, choices: _Optional[_Iterable[str]] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model", "dtype", "device", "quantization", "vocab_size", "model_vocab_size", "max_context", "eos_token_ids", "tokenizer_fingerprint", "active_sessions", "max_propose_tokens", "forward_ms", "prefill_ms_per_token", "forwards", "forward_rows", "pending_calls", "kv_tokens_used", "kv_tokens_budget", "session_ttl_s", "kernel_choices", "prefix_cache_blocks", "prefix_cache_tokens", "prefix_cache_query_tokens", "prefix_cache_hit_tokens", "synthetic_acceptance", "sessions_ended_by_lease", "sessions_reaped_idle", "kernels_pending")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MODEL_VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_PROPOSE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    FORWARDS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_ROWS_FIELD_NUMBER: _ClassVar[int]
    PENDING_CALLS_FIELD_NUMBER: _ClassVar[int]
    KV_TOKENS_USED_FIELD_NUMBER: _ClassVar[int]
    KV_TOKENS_BUDGET_FIELD_NUMBER: _ClassVar[int]
    SESSION_TTL_S_FIELD_NUMBER: _ClassVar[int]
    KERNEL_CHOICES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SYNTHETIC_ACCEPTANCE_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_ENDED_BY_LEASE_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_REAPED_IDLE_FIELD_NUMBER: _ClassVar[int]
    KERNELS_PENDING_FIELD_NUMBER: _ClassVar[int]
    model: str
    dtype: str
    device: str
    quantization: str
    vocab_size: int
    model_vocab_size: int
    max_context: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    tokenizer_fingerprint: str
    active_sessions: int
    max_propose_tokens: int
    forward_ms: _containers.RepeatedScalarFieldContainer[float]
    prefill_ms_per_token: float
    forwards: int
    forward_rows: int
    pending_calls: int
    kv_tokens_used: int
    kv_tokens_budget: int
    session_ttl_s: float
    kernel_choices: _containers.RepeatedScalarFieldContainer[str]
    prefix_cache_blocks: int
    prefix_cache_tokens: int
    prefix_cache_query_tokens: int
    prefix_cache_hit_tokens: int
    synthetic_acceptance: float
    sessions_ended_by_lease: int
    sessions_reaped_idle: int
    kernels_pending: int
    def __init__(self, model: _Optional[str] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., quantization: _Optional[str] = ..., vocab_size: _Optional[int] = ..., model_vocab_size: _Optional[int] = ..., max_context: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., tokenizer_fingerprint: _Optional[str] = ..., active_sessions: _Optional[int] = ..., max_propose_tokens: _Optional[int] = ..., forward_ms: _Optional[_Iterable[float]] = ..., prefill_ms_per_token: _Optional[float] = ..., forwards: _Optional[int] = ..., forward_rows: _Optional[int] = ..., pending_calls: _Optional[int] = ..., kv_tokens_used: _Optional[int] = ..., kv_tokens_budget: _Optional[int] = ..., session_ttl_s: _Optional[float] = ..., kernel_choices: _Optional[_Iterable[str]] = ..., prefix_cache_blocks: _Optional[int] = ..., prefix_cache_tokens: _Optional[int] = ..., prefix_cache_query_tokens: _Optional[int] = ..., prefix_cache_hit_tokens: _Optional[int] = ..., synthetic_acceptance: _Optional[float] = ..., sessions_ended_by_lease: _Optional[int] = ..., sessions_reaped_idle: _Optional[int] = ..., kernels_pending: _Optional[int] = ...) -> None: ...

class BatchStats(_message.Message):
    __slots__ = ("forwards", "rows", "max_rows", "queue_ms", "pending_calls", "calls", "service_ms")
    FORWARDS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    MAX_ROWS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    PENDING_CALLS_FIELD_NUMBER: _ClassVar[int]
    CALLS_FIELD_NUMBER: _ClassVar[int]
    SERVICE_MS_FIELD_NUMBER: _ClassVar[int]
    forwards: int
    rows: int
    max_rows: int
    queue_ms: float
    pending_calls: int
    calls: int
    service_ms: float
    def __init__(self, forwards: _Optional[int] = ..., rows: _Optional[int] = ..., max_rows: _Optional[int] = ..., queue_ms: _Optional[float] = ..., pending_calls: _Optional[int] = ..., calls: _Optional[int] = ..., service_ms: _Optional[float] = ...) -> None: ...

class DraftProbs(_message.Message):
    __slots__ = ("token_ids", "probs_fp16")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FP16_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    probs_fp16: bytes
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., probs_fp16: _Optional[bytes] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TokenizerFiles(_message.Message):
    __slots__ = ("files",)
    class FilesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: bytes
        def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...
    FILES_FIELD_NUMBER: _ClassVar[int]
    files: _containers.ScalarMap[str, bytes]
    def __init__(self, files: _Optional[_Mapping[str, bytes]] = ...) -> None: ...

class GetTokenizerRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StartSessionRequest(_message.Message):
    __slots__ = ("session_id", "prompt_token_ids", "cache_salt", "owner", "lease_s", "grammar", "grammar_start")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_START_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    cache_salt: bytes
    owner: str
    lease_s: float
    grammar: str
    grammar_start: int
    def __init__(self, session_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., cache_salt: _Optional[bytes] = ..., owner: _Optional[str] = ..., lease_s: _Optional[float] = ..., grammar: _Optional[str] = ..., grammar_start: _Optional[int] = ...) -> None: ...

class StartSessionResponse(_message.Message):
    __slots__ = ("session_id", "cached_tokens", "tokenizer_fingerprint", "prefix_cached_tokens")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    cached_tokens: int
    tokenizer_fingerprint: str
    prefix_cached_tokens: int
    def __init__(self, session_id: _Optional[str] = ..., cached_tokens: _Optional[int] = ..., tokenizer_fingerprint: _Optional[str] = ..., prefix_cached_tokens: _Optional[int] = ...) -> None: ...

class MatchPrefixRequest(_message.Message):
    __slots__ = ("prompt_token_ids", "cache_salt")
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    cache_salt: bytes
    def __init__(self, prompt_token_ids: _Optional[_Iterable[int]] = ..., cache_salt: _Optional[bytes] = ...) -> None: ...

class MatchPrefixResponse(_message.Message):
    __slots__ = ("cached_tokens",)
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    cached_tokens: int
    def __init__(self, cached_tokens: _Optional[int] = ...) -> None: ...

class KeepAliveRequest(_message.Message):
    __slots__ = ("session_id", "owner", "lease_s")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    owner: str
    lease_s: float
    def __init__(self, session_id: _Optional[str] = ..., owner: _Optional[str] = ..., lease_s: _Optional[float] = ...) -> None: ...

class KeepAliveResponse(_message.Message):
    __slots__ = ("existed", "owned_sessions")
    EXISTED_FIELD_NUMBER: _ClassVar[int]
    OWNED_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    existed: bool
    owned_sessions: int
    def __init__(self, existed: _Optional[bool] = ..., owned_sessions: _Optional[int] = ...) -> None: ...

class EndSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class EndSessionResponse(_message.Message):
    __slots__ = ("existed",)
    EXISTED_FIELD_NUMBER: _ClassVar[int]
    existed: bool
    def __init__(self, existed: _Optional[bool] = ...) -> None: ...
