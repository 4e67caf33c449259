from specdec.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Commit(_message.Message):
    __slots__ = ("num_accepted", "target_token_ids")
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    TARGET_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    num_accepted: int
    target_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, num_accepted: _Optional[int] = ..., target_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ProposeRequest(_message.Message):
    __slots__ = ("session_id", "num_tokens", "sampling", "commit", "min_confidence", "draft_prefix_ids", "truncation_top_k", "truncation_top_p")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    MIN_CONFIDENCE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PREFIX_IDS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATION_TOP_K_FIELD_NUMBER: _ClassVar[int]
    TRUNCATION_TOP_P_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    num_tokens: int
    sampling: _common_pb2.SamplingParams
    commit: Commit
    min_confidence: float
    draft_prefix_ids: _containers.RepeatedScalarFieldContainer[int]
    truncation_top_k: int
    truncation_top_p: float
    def __init__(self, session_id: _Optional[str] = ..., num_tokens: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., commit: _Optional[_Union[Commit, _Mapping]] = ..., min_confidence: _Optional[float] = ..., draft_prefix_ids: _Optional[_Iterable[int]] = ..., truncation_top_k: _Optional[int] = ..., truncation_top_p: _Optional[float] = ...) -> None: ...

class ProposeResponse(_message.Message):
    __slots__ = ("draft_token_ids", "draft_confidences", "batch", "draft_probs")
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_CONFIDENCES_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROBS_FIELD_NUMBER: _ClassVar[int]
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_confidences: _containers.RepeatedScalarFieldContainer[float]
    batch: _common_pb2.BatchStats
    draft_probs: _containers.RepeatedCompositeFieldContainer[_common_pb2.DraftProbs]
    def __init__(self, draft_token_ids: _Optional[_Iterable[int]] = ..., draft_confidences: _Optional[_Iterable[float]] = ..., batch: _Optional[_Union[_common_pb2.BatchStats, _Mapping]] = ..., draft_probs: _Optional[_Iterable[_Union[_common_pb2.DraftProbs, _Mapping]]] = ...) -> None: ...
