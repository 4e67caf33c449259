"""Draft sources as data: a source is its module plus one registration, and the
kinds (named sets of sources), the request mapping, the flags and the controller
take them from the registry. A toy source registered here runs end to end."""
from __future__ import annotations

from typing import Sequence

import grpc
import pytest

from coordinator.proposers import KINDS, build, checked_sources
from coordinator.requests import PROPOSER_KINDS
from coordinator.settings import SETTINGS
from specdec.rpc.errors import InvalidArgument
from specdec.spec import proposers
from specdec.spec.proposers.grammar import GRAMMAR
from specdec.spec.proposers import MODEL, SourceSpec
from specdec.spec.proposers.ngram import NGRAM, NgramSource, RecentOutputs
from specdec.spec.types import Lookup
from specdec.v1 import common_pb2
from specdec.v1 import coordinator_pb2 as pb
from specdec_tools.cli import parser as cli_parser
from tests.conftest import coordinator_stub, rpc_error


class RepeatLast:
    """A toy free source: "the next tokens repeat the last one"."""

    def __init__(self, recent):
        self.ended: list[int] | None = None

    def propose(self, context: Sequence[int], max_tokens: int) -> Lookup:
        return Lookup((context[-1],) * max_tokens, match_length=1)

    def end(self, output_ids: Sequence[int]) -> None:
        self.ended = list(output_ids)


@pytest.fixture
def repeat_source():
    spec = proposers.register(SourceSpec("repeat", RepeatLast, help="the last token again"))
    yield spec
    del proposers.SOURCES[spec.name]


def test_the_registered_kinds_are_what_the_api_and_the_flags_offer():
    # The API's contract (the proto enum) and the registry agree both ways: a kind
    # registered without its enum value, or a value with no kind behind it, fails here.
    offered = {name.removeprefix("PROPOSER_KIND_").lower() for name in pb.ProposerKind.keys()} - {"unspecified"}
    assert offered == set(KINDS)
    assert {pb.ProposerKind.Name(v) for v in PROPOSER_KINDS} == set(pb.ProposerKind.keys())
    (proposer,) = [s for s in SETTINGS if s.flag == "--proposer"]
    assert set(proposer.options["choices"]) == set(KINDS) and all(k in proposer.options["help"] for k in KINDS)
    args = cli_parser().parse_args(["generate", "--prompt", "x", "--proposer", "ngram"])
    assert args.proposer == "ngram"


def test_each_kind_builds_its_drafts_from_what_the_coordinator_has(repeat_source):
    recent, model = RecentOutputs(64), object()
    hybrid = build(KINDS["hybrid"].sources(), model, recent)
    # Every registered free source, the one registered after the kinds were declared too.
    assert hybrid.model is model and set(hybrid.sources) == {NGRAM, GRAMMAR, "repeat"}
    assert isinstance(hybrid.sources[NGRAM], NgramSource) and hybrid.sources[NGRAM].recent is recent
    assert build(KINDS["model"].sources(), model, recent).sources == {}
    assert build(KINDS["model"].sources(), None, recent) is None           # nothing left: target-only
    assert KINDS["model"].needs_drafter and not KINDS["ngram"].uses_drafter
    lookups = build(KINDS["ngram"].sources(), None, recent)
    assert lookups.model is None and set(lookups.sources) == {NGRAM}
    # Without the drafter: the hybrid keeps its free sources.
    assert build(KINDS["hybrid"].sources(), None, recent).model is None


def test_a_request_names_its_sources_from_the_registry(repeat_source):
    assert checked_sources(["repeat", MODEL]) == ("repeat", MODEL)
    for wrong in (["suffix_tree"], [NGRAM, NGRAM]):
        with pytest.raises(InvalidArgument, match="name each source once, from ngram, grammar, repeat, model"):
            checked_sources(wrong)
    with pytest.raises(ValueError, match="a name of its own"):
        proposers.register(SourceSpec(MODEL, RepeatLast))


def sourced(stub, prompt: str, sources: list[str], temperature: float = 0.0) -> pb.GenerateResponse:
    sampling = common_pb2.SamplingParams(temperature=temperature)
    if temperature:
        sampling.seed = 5
    return stub.Generate(pb.GenerateRequest(prompt=prompt, max_new_tokens=32, sampling=sampling, ignore_eos=True,
                                            speculation=pb.Speculation(gamma=3, sources=sources)), timeout=60)


def test_a_registered_toy_source_drafts_end_to_end_losslessly(stack, repeat_source):
    """Registered in this process, the toy source drafts in the coordinator's rounds,
    alone and before the model's tokens; greedy output stays the target's."""
    prompts = ["aaaa aaaa aaaa", "The quick brown fox", "1 1 1 1 1 1", "def f(x):"]
    by_source: dict[str, list[int]] = {}
    for prompt in prompts:
        reference = stack.coordinator_stub.Generate(pb.GenerateRequest(prompt=prompt, max_new_tokens=32, ignore_eos=True,
                                                           speculation=pb.Speculation(enabled=False)), timeout=60)
        for sources in (["repeat"], ["repeat", MODEL]):
            response = sourced(stack.coordinator_stub, prompt, sources)
            assert list(response.token_ids) == list(reference.token_ids), (prompt, sources)
            for entry in response.stats.draft_sources:
                counts = by_source.setdefault(entry.source, [0, 0])
                counts[0] += entry.draft_tokens
                counts[1] += entry.accepted_tokens
    drafted, accepted = by_source["repeat"]
    assert 0 < accepted < drafted, by_source   # kept and rejected: both paths taken
    assert by_source[MODEL][0] > 0
    # Sampled: the free tokens travel without probability rows, and the verifier takes them.
    response = sourced(stack.coordinator_stub, prompts[0], ["repeat"], temperature=0.8)
    assert len(response.token_ids) == 32 and response.stats.draft_sources[0].source == "repeat"


def test_an_unknown_source_is_refused_with_the_registrys_names(stack):
    error = rpc_error(stack.coordinator_stub.Generate, pb.GenerateRequest(
        prompt="hi", max_new_tokens=4, speculation=pb.Speculation(sources=["eagle"])), timeout=30)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "from ngram, grammar, model" in error.details()


def test_a_kind_that_needs_the_drafter_is_refused_where_there_is_none(stack):
    with coordinator_stub(drafter=None, verifier=stack.address(stack.verifier), proposer="ngram") as stub:
        request = pb.GenerateRequest(prompt="hi", max_new_tokens=4,
                                     speculation=pb.Speculation(proposer=pb.PROPOSER_KIND_MODEL))
        error = rpc_error(stub.Generate, request, timeout=30)
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION and "the model proposer needs one" in error.details()
        request.speculation.proposer = pb.PROPOSER_KIND_HYBRID  # its lookups need no drafter
        assert len(stub.Generate(request, timeout=30).token_ids) > 0
