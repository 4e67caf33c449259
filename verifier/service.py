"""The Verifier gRPC servicer: proto -> domain -> proto, nothing more."""
from __future__ import annotations

import functools
import logging

from specdec.rpc.errors import InvalidArgument
from specdec.service.model_service import ModelServiceBase, serve_model
from specdec.spec.limits import MAX_PROPOSE_TOKENS, MAX_TOP_LOGPROBS, validate_token_ids
from specdec.runtime.models import LoadedModel
from specdec.rpc.serving import RunningServer
from specdec.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc
from specdec.spec.wire import draft_probs_from_proto, logprobs_to_proto, sampling_from_proto
from specdec.spec.draft_probs import draft_probs_tensor

from verifier.target_session import TargetSession

log = logging.getLogger("verifier")
SERVICE_NAME = verifier_pb2.DESCRIPTOR.services_by_name["Verifier"].full_name
MAX_DECODE_TOKENS = 4096


class VerifierServicer(ModelServiceBase[TargetSession], verifier_pb2_grpc.VerifierServicer):
    def __init__(self, *args, synthetic_acceptance: float = 0.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.synthetic_acceptance = synthetic_acceptance  # the benchmark setting (0: off, lossless)

    def Info(self, request, context) -> common_pb2.ModelInfo:
        info = super().Info(request, context)
        info.synthetic_acceptance = self.synthetic_acceptance
        return info

    # Each call's torch work (decoding the draft's probabilities included) runs on
    # the torch thread as steps of the scheduler, its forward batched with other sessions'.
    def Verify(self, request, context) -> verifier_pb2.VerifyResponse:
        sampling = sampling_from_proto(request.sampling)
        draft = list(request.draft_token_ids)
        if len(draft) > MAX_PROPOSE_TOKENS:
            raise InvalidArgument(f"{len(draft)} draft tokens is over the limit of {MAX_PROPOSE_TOKENS}")
        validate_token_ids(draft, self.loaded.vocab_size, "draft_token_ids")
        if sampling.greedy and request.draft_probs:
            raise InvalidArgument("draft_probs must be empty when temperature is 0 (greedy)")
        entries = draft_probs_from_proto(request.draft_probs)
        if request.free_tokens > len(draft):
            raise InvalidArgument(f"free_tokens={request.free_tokens} is more than the {len(draft)} draft tokens")

        def steps(session: TargetSession):
            # Per token after the free ones (sparse, dense or one-hot), validated.
            draft_probs = None if sampling.greedy else draft_probs_tensor(entries, draft, self.loaded.vocab_size,
                                                                          request.free_tokens, self.loaded.device)
            return (yield from session.verify_steps(draft, draft_probs, sampling, self.synthetic_acceptance,
                                                    logprobs))

        logprobs = asked_logprobs(request)
        with self.session(request.session_id) as session:
            out, batch = self.run_call(steps(session))
        return verifier_pb2.VerifyResponse(num_accepted=out.num_accepted, next_token_id=out.next_token_id,
                                           bonus=out.bonus, batch=batch, logprobs=logprobs_to_proto(out.logprobs))

    def Decode(self, request, context) -> verifier_pb2.DecodeResponse:
        if not 0 < request.num_tokens <= MAX_DECODE_TOKENS:
            raise InvalidArgument(f"num_tokens must be in 1..{MAX_DECODE_TOKENS}, got {request.num_tokens}")
        sampling = sampling_from_proto(request.sampling)
        logprobs, entries = asked_logprobs(request), []
        with self.session(request.session_id) as session:
            tokens, batch = self.run_call(session.decode_steps(request.num_tokens, sampling, logprobs, entries))
        return verifier_pb2.DecodeResponse(token_ids=tokens, batch=batch, logprobs=logprobs_to_proto(entries))


def asked_logprobs(request) -> int | None:
    """A Verify's or Decode's `logprobs`: None when not asked, else the top tokens wanted."""
    if not request.HasField("logprobs"):
        return None
    if request.logprobs > MAX_TOP_LOGPROBS:
        raise InvalidArgument(f"logprobs={request.logprobs}: at most {MAX_TOP_LOGPROBS} top tokens")
    return request.logprobs


def serve(loaded: LoadedModel, synthetic_acceptance: float = 0.0, **kwargs) -> RunningServer:
    if not 0.0 <= synthetic_acceptance <= 1.0:
        raise ValueError(f"--synthetic-acceptance must be in (0, 1] (0: off), got {synthetic_acceptance}")
    if synthetic_acceptance:
        log.warning("BENCHMARK SETTING --synthetic-acceptance %.2f: every draft token is accepted with this "
                    "probability whatever the models say; output is NOT the target's, and every response's "
                    "stats say so", synthetic_acceptance)
    return serve_model(functools.partial(VerifierServicer, synthetic_acceptance=synthetic_acceptance), TargetSession, verifier_pb2_grpc.add_VerifierServicer_to_server, SERVICE_NAME,
                       loaded, **kwargs)
