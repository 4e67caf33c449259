"""A drafter that comes back with another tokenizer is caught on the next session."""
from __future__ import annotations

import grpc

import drafter.service
from specdec.models import load_model
from specdec.v1 import coordinator_pb2 as pb
from tests.conftest import coordinator_stub, free_port, rpc_error


def test_swapped_drafter_is_refused_with_failed_precondition(stack):
    port = free_port()
    first = drafter.service.serve(load_model("tiny-draft"), port=port)
    swapped = None
    try:
        with coordinator_stub(drafter=f"127.0.0.1:{port}", verifier=stack.address(stack.verifier)) as stub:
            request = pb.GenerateRequest(prompt="The quick brown fox", max_new_tokens=8)
            assert len(stub.Generate(request, timeout=30).token_ids) == 8
            first.stop(0)
            swapped = drafter.service.serve(load_model("tiny-mismatch-draft"), port=port)
            error = rpc_error(stub.Generate, request, timeout=30)
            assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "now has tokenizer" in error.details() and "not the target's" in error.details()
            # Target-only requests do not need the drafter and still work.
            request.speculation.enabled = False
            assert len(stub.Generate(request, timeout=30).token_ids) == 8
    finally:
        for server in (first, swapped):
            if server:
                server.stop(0)
