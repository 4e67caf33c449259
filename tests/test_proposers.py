"""coordinator.proposers: a proposer kind is one registration, which the
servicer, the flags, the request mapping and the CLI all take from the table."""
from __future__ import annotations

from coordinator.proposers import KINDS
from coordinator.requests import PROPOSER_KINDS
from coordinator.settings import SETTINGS
from specdec.spec.hybrid import HybridProposer
from specdec.spec.ngram import RecentOutputs
from specdec_tools.cli import parser as cli_parser


def test_the_registered_kinds_are_what_the_api_and_the_flags_offer():
    # The API's contract (the proto enum) and the registry agree both ways: a kind
    # registered without its enum value, or a value with no kind behind it, fails here.
    from specdec.v1 import coordinator_pb2 as pb
    offered = {name.removeprefix("PROPOSER_KIND_").lower() for name in pb.ProposerKind.keys()} - {"unspecified"}
    assert offered == set(KINDS)
    assert {pb.ProposerKind.Name(v) for v in PROPOSER_KINDS} == set(pb.ProposerKind.keys())
    (proposer,) = [s for s in SETTINGS if s.flag == "--proposer"]
    assert set(proposer.options["choices"]) == set(KINDS) and all(k in proposer.options["help"] for k in KINDS)
    args = cli_parser().parse_args(["generate", "--prompt", "x", "--proposer", "ngram"])
    assert args.proposer == "ngram"


def test_each_kind_builds_its_proposer_from_what_the_coordinator_has():
    recent, model = RecentOutputs(64), object()
    hybrid = KINDS["hybrid"].build(model, recent)
    assert isinstance(hybrid, HybridProposer) and hybrid.model is model and hybrid.recent is recent
    assert KINDS["model"].build(model, recent) is model and KINDS["model"].build(None, recent) is None
    lookups = KINDS["ngram"].build(None, recent)
    assert isinstance(lookups, HybridProposer) and lookups.model is None and not KINDS["ngram"].uses_drafter
    # Without the drafter: the hybrid keeps its lookups, the model alone has nothing (target-only).
    assert KINDS["hybrid"].build(None, recent).model is None


def test_a_kind_that_needs_the_drafter_is_refused_where_there_is_none(stack):
    import grpc

    from specdec.v1 import coordinator_pb2 as pb
    from tests.conftest import coordinator_stub, rpc_error
    with coordinator_stub(drafter=None, verifier=stack.address(stack.verifier), proposer="ngram") as stub:
        request = pb.GenerateRequest(prompt="hi", max_new_tokens=4,
                                     speculation=pb.Speculation(proposer=pb.PROPOSER_KIND_MODEL))
        error = rpc_error(stub.Generate, request, timeout=30)
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION and "the model proposer needs one" in error.details()
        request.speculation.proposer = pb.PROPOSER_KIND_HYBRID  # its lookups need no drafter
        assert len(stub.Generate(request, timeout=30).token_ids) > 0
