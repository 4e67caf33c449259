"""The model services on the static step (`--forward paged`: one KV arena, the CUDA
path's step), on the CPU in fp32, as real gRPC servers: greedy speculative output
equal to target-only's and to the lean services', concurrent sessions batched into
one step, the prefix cache's pages, and a pool that refuses what it cannot hold."""
from __future__ import annotations

import concurrent.futures
import gc

import pytest
import torch

from specdec.runtime.models import load_model
from specdec.runtime.paged_forward import PagedCache, PagedForward
from specdec.v1 import coordinator_pb2 as pb
from tests.conftest import pair_stub
from tests.test_end_to_end import PROMPTS, generate


@pytest.fixture(scope="module")
def paged_stack():
    draft, target = load_model("tiny-draft", forward="paged"), load_model("tiny-target", forward="paged")
    assert isinstance(target.lean, PagedForward) and isinstance(draft.lean, PagedForward)
    with pair_stub(draft, target, gamma=4) as stub:
        yield stub, target


def test_greedy_output_on_the_static_step_is_target_onlys_and_the_lean_services(paged_stack, stack):
    stub, target = paged_stack
    drafted = accepted = 0
    for prompt in PROMPTS[:8]:
        lean = generate(stack.coordinator_stub, prompt, speculate=False)
        reference = generate(stub, prompt, speculate=False)
        speculative = generate(stub, prompt, speculate=True, gamma=4)
        assert list(reference.token_ids) == list(lean.token_ids), prompt
        assert list(speculative.token_ids) == list(reference.token_ids), prompt
        drafted += speculative.stats.draft_tokens
        accepted += speculative.stats.accepted_tokens
    assert 0 < accepted < drafted                               # drafts kept and rejected: rollbacks ran
    assert target.lean.arena is not None and target.lean.runner.step is not None


def test_concurrent_sessions_share_steps_and_keep_their_own_tokens(paged_stack):
    stub, _ = paged_stack
    alone = {p: list(generate(stub, p, speculate=True, gamma=3).token_ids) for p in PROMPTS[:6]}
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        together = dict(zip(PROMPTS[:6], pool.map(
            lambda p: list(generate(stub, p, speculate=True, gamma=3).token_ids), PROMPTS[:6])))
    assert together == alone


def test_a_cached_prefix_is_loaded_into_pages_and_gives_the_same_tokens(paged_stack):
    stub, target = paged_stack
    system = " ".join(f"rule {i}: be brief." for i in range(12))   # several 16-token blocks
    requests = [pb.GenerateRequest(prompt=f"{system} {q}", max_new_tokens=12, cache_salt="paged")
                for q in ("first?", "second?")]
    first = stub.Generate(requests[0], timeout=60)
    cold = stub.Generate(pb.GenerateRequest(prompt=f"{system} second?", max_new_tokens=12, cache_salt="other"),
                         timeout=60)
    warm = stub.Generate(requests[1], timeout=60)
    assert first.stats.prompt_tokens > 32
    assert warm.stats.prefix_cached_tokens >= 32 and cold.stats.prefix_cached_tokens == 0
    assert list(warm.token_ids) == list(cold.token_ids)


def test_a_cache_rolls_back_by_its_length_and_copies_blocks_through_the_arena():
    forward = load_model("tiny-target", forward="paged").lean
    cache = forward.new_cache()
    ids = torch.arange(5, 45)
    forward.batch([(ids, cache, 1)])
    block = cache.block(16, 32)
    assert block.shape == (len(forward.layers), 2, forward.kv_heads, 16, forward.head_dim)
    other = forward.new_cache()
    other.load_blocks([cache.block(0, 16), block], 16)
    assert torch.equal(other.block(0, 32), cache.block(0, 32))
    cache.crop(-8)
    assert cache.get_seq_length() == 32
    got = forward.batch([(ids[32:], cache, 8), (ids[32:], other, 8)])
    assert isinstance(cache, PagedCache) and torch.allclose(got[0], got[1], atol=1e-5)
    free = forward.arena.free_pages
    del cache, other
    gc.collect()
    assert forward.arena.free_pages == free + 2 * 3              # both sessions' three pages back


def test_the_compiled_step_serves_the_same_tokens(stack):
    # --compile aot_eager: the whole step traced (fullgraph: a graph break raises), once a bucket
    # (on the CPU at first use: here the decode's and a verification's).
    target = load_model("tiny-target", forward="paged", compile="aot_eager")
    with pair_stub(load_model("tiny-draft", forward="paged"), target, gamma=3) as stub:
        lean = generate(stack.coordinator_stub, PROMPTS[0], speculate=False, max_new_tokens=12)
        speculative = generate(stub, PROMPTS[0], speculate=True, gamma=3, max_new_tokens=12)
        assert list(speculative.token_ids) == list(lean.token_ids)
        assert speculative.stats.accepted_tokens < speculative.stats.draft_tokens   # a rollback ran too
    assert target.lean.runner._bucket_step is not target.lean.runner.step   # compiled, not the eager step


def test_compile_without_the_paged_forward_is_refused_with_what_to_add():
    from specdec.rpc.errors import InvalidArgument
    with pytest.raises(InvalidArgument, match="--forward paged"):
        load_model("tiny-target", compile="inductor")


def test_inductor_without_its_compiler_is_refused_at_load_with_what_to_install(monkeypatch, tmp_path):
    """Inductor builds what it writes (C++ on the CPU, Triton's launcher on a GPU): a service
    lacking the compiler must say so before its model loads, not fail in its first warm-up."""
    from specdec.rpc.errors import FailedPrecondition
    from specdec.runtime.paged_step import toolchain_missing
    monkeypatch.setenv("PATH", str(tmp_path))          # an empty PATH: no g++, no gcc, no clang
    monkeypatch.delenv("CC", raising=False)
    with pytest.raises(FailedPrecondition, match=r"--compile inductor on cpu needs a C\+\+ compiler .*--compile off"):
        load_model("tiny-target", forward="paged", compile="inductor")
    load_model("tiny-target", forward="paged", compile="aot_eager")    # builds nothing: needs none
    cuda = torch.device("cuda")
    assert any("a C compiler for Triton's launcher" in need for need in toolchain_missing("inductor", cuda))
    monkeypatch.setenv("CC", "/usr/bin/cc")                # Triton's own override
    assert not any("C compiler" in need for need in toolchain_missing("inductor", cuda))
