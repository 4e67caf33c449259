"""A drafter that comes back with another tokenizer is caught on the next
session: that request goes on without it (the client sees no error), and
drafting stays off, with the first difference logged, until the right drafter
is back."""
from __future__ import annotations

import drafter.service
from specdec.runtime.models import load_model
from specdec.v1 import coordinator_pb2 as pb
from tests.conftest import model_draft_tokens, served_coordinator, free_port, wait_for


def test_swapped_drafter_is_not_used_and_the_right_one_is_taken_back(stack):
    port = free_port()
    servers = [drafter.service.serve(load_model("tiny-draft"), port=port)]
    try:
        with served_coordinator(drafter=f"127.0.0.1:{port}", verifier=stack.address(stack.verifier)) as c:
            stub, backends = c.stub, c.backends
            request = pb.GenerateRequest(prompt="The quick brown fox", max_new_tokens=12,
                                         speculation=pb.Speculation(gamma=3))
            reference = stub.Generate(request, timeout=30)
            assert model_draft_tokens(reference.stats) > 0 and not reference.stats.fallback
            servers[0].stop(0)
            servers.append(drafter.service.serve(load_model("tiny-mismatch-draft"), port=port))
            # The gap may be noticed by the watcher or by the request itself: either way no error, same output.
            swapped = stub.Generate(request, timeout=30)
            assert list(swapped.token_ids) == list(reference.token_ids)
            assert wait_for(lambda: not backends.drafter_up)
            assert wait_for(lambda: "tokenizers differ: same tokens in a different id order"
                            in backends.drafter_watch.reason)
            later = stub.Generate(request, timeout=30)
            assert model_draft_tokens(later.stats) == 0 and list(later.token_ids) == list(reference.token_ids)
            # The right drafter returns: speculation resumes.
            servers[-1].stop(0)
            servers.append(drafter.service.serve(load_model("tiny-draft"), port=port))
            assert wait_for(lambda: backends.drafter_up)
            resumed = stub.Generate(request, timeout=30)
            assert model_draft_tokens(resumed.stats) > 0 and list(resumed.token_ids) == list(reference.token_ids)
    finally:
        for server in servers:
            server.stop(0)
