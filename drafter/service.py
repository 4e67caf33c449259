"""The Drafter gRPC servicer: proto -> domain -> proto, nothing more."""
from __future__ import annotations

import logging

from specdec.rpc.errors import InvalidArgument
from specdec.service.model_service import ModelServiceBase, serve_model
from specdec.spec.limits import MAX_PROPOSE_TOKENS, validate_token_ids
from specdec.runtime.models import LoadedModel
from specdec.spec.types import Commit
from specdec.rpc.serving import RunningServer
from specdec.v1 import drafter_pb2, drafter_pb2_grpc
from specdec.spec.wire import Truncation, draft_probs_to_proto, sampling_from_proto

from drafter.draft_session import DraftSession

log = logging.getLogger("drafter")
SERVICE_NAME = drafter_pb2.DESCRIPTOR.services_by_name["Drafter"].full_name


class DrafterServicer(ModelServiceBase[DraftSession], drafter_pb2_grpc.DrafterServicer):
    # The call's torch work (encoding the probabilities included) runs on the torch
    # thread as steps of the scheduler, each draft step batched with other sessions'.
    def Propose(self, request, context) -> drafter_pb2.ProposeResponse:
        if request.num_tokens > MAX_PROPOSE_TOKENS:
            raise InvalidArgument(f"num_tokens={request.num_tokens} is over the limit of {MAX_PROPOSE_TOKENS}")
        if not 0.0 <= request.min_confidence <= 1.0:  # NaN fails this too
            raise InvalidArgument(f"min_confidence must be in [0, 1], got {request.min_confidence}")
        sampling = sampling_from_proto(request.sampling)
        commit = (Commit(request.commit.num_accepted, tuple(request.commit.target_token_ids))
                  if request.HasField("commit") else None)
        if commit is not None:
            validate_token_ids(commit.target_token_ids, self.loaded.vocab_size, "commit.target_token_ids")

        prefix = list(request.draft_prefix_ids)
        validate_token_ids(prefix, self.loaded.vocab_size, "draft_prefix_ids")
        if len(prefix) + request.num_tokens > MAX_PROPOSE_TOKENS:
            raise InvalidArgument(f"{len(prefix)} prefix + {request.num_tokens} tokens is over the limit of "
                                  f"{MAX_PROPOSE_TOKENS} drafted tokens a round")
        truncation = Truncation(request.truncation_top_k, request.truncation_top_p
                                if request.HasField("truncation_top_p") else 1.0).validate()

        def steps(session: DraftSession):
            session.check_room(session.length_after(commit), len(prefix) + request.num_tokens)  # before any change
            session.commit(commit)
            return (yield from session.propose_steps(request.num_tokens, sampling, request.min_confidence, prefix,
                                                     truncation))

        with self.session(request.session_id) as session:
            draft, batch = self.run_call(steps(session))
        return drafter_pb2.ProposeResponse(draft_token_ids=draft.token_ids, draft_probs=draft_probs_to_proto(
            draft.draft_probs), draft_confidences=draft.confidences, batch=batch)


def serve(loaded: LoadedModel, **kwargs) -> RunningServer:
    return serve_model(DrafterServicer, DraftSession, drafter_pb2_grpc.add_DrafterServicer_to_server, SERVICE_NAME,
                       loaded, **kwargs)
