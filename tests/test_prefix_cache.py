"""The prefix cache: keys that name whole prefixes, sessions built on cached blocks
giving a cold prefill's logits, salts that keep callers apart, eviction within the
KV pool's budget; and through the services, the same greedy output with it on
and off, alone and with eight clients sharing a system prompt."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import threading

import pytest
import torch

import drafter.service
import verifier.service
from specdec.rpc.errors import ResourceExhausted
from specdec.runtime import kv_cache
from specdec.runtime.sequence import SequenceCache
from specdec.runtime.kv_pool import KVPool
from specdec.runtime.prefix_cache import BLOCK_TOKENS, PrefixCache, block_keys
from specdec.v1 import common_pb2, coordinator_pb2
from tests.conftest import coordinator_stub

B = BLOCK_TOKENS


def prompt(n: int, seed: int = 0) -> list[int]:
    return [(37 * i + 11 * seed + 5) % 480 + 3 for i in range(n)]


def test_a_key_names_its_whole_prefix_under_its_salt():
    a, b = prompt(3 * B), prompt(3 * B)
    b[B + 2] += 1  # differs in the second block
    ka, kb = block_keys(a, b"", 3), block_keys(b, b"", 3)
    assert ka[0] == kb[0] and ka[1] != kb[1] and ka[2] != kb[2]  # the third block's ids agree; its prefix does not
    assert not set(block_keys(a, b"other", 3)) & set(ka)
    assert block_keys(a, b"", 2) == ka[:2]


def cold_logits(model, ids: list[int]) -> torch.Tensor:
    seq = SequenceCache(model, ids[:-1])
    seq.prefill()
    return seq.forward(ids[-1:], keep_last=1)


def stored(model, ids: list[int], cache: PrefixCache, salt: bytes = b"") -> SequenceCache:
    """A session prefilled over `ids`, its blocks kept under `salt`."""
    seq = SequenceCache(model, ids, cache.pool)
    seq.prefill()
    cache.store(seq, salt)
    return seq


def test_a_session_on_cached_blocks_gives_a_cold_prefills_logits(tiny_target):
    pool = KVPool(4096, tiny_target.lean.token_bytes())
    cache = PrefixCache(pool)
    system = prompt(5 * B + 7)
    first = SequenceCache(tiny_target, system + prompt(9, seed=1), pool)
    assert cache.attach(first, b"") == 0
    first.prefill()
    assert cache.store(first, b"") == (len(first) - 1) // B
    follow_up = system + prompt(30, seed=2)                  # the same system prompt, another question
    second = SequenceCache(tiny_target, follow_up[:-1], pool)
    assert cache.match(follow_up[:-1], b"") == 5 * B and cache.attach(second, b"") == 5 * B
    second.prefill()
    got = second.forward(follow_up[-1:], keep_last=1)
    # fp32; the cached positions were computed in another chunk of rows than a cold prefill's.
    assert torch.allclose(got, cold_logits(tiny_target, follow_up), atol=1e-4)
    assert got.argmax() == cold_logits(tiny_target, follow_up).argmax()
    stats = cache.stats()
    assert stats.hit_tokens == 5 * B and stats.blocks * B == stats.tokens


def test_another_salt_finds_nothing(tiny_target):
    pool = KVPool(4096, tiny_target.lean.token_bytes())
    cache = PrefixCache(pool)
    stored(tiny_target, prompt(4 * B + 1), cache, b"alice")
    assert cache.match(prompt(4 * B + 1), b"alice") == 4 * B
    assert cache.match(prompt(4 * B + 1), b"bob") == 0 and cache.match(prompt(4 * B + 1), b"") == 0


def test_blocks_stay_within_the_pool_and_make_room_for_sessions_least_recently_used_first(tiny_target):
    chunk = kv_cache.CHUNK
    pool = KVPool(2 * chunk, tiny_target.lean.token_bytes())
    cache = PrefixCache(pool)
    kept = []
    for seed in range(2):  # two prompts' blocks, then the sessions end
        kept.append(prompt(4 * B + 1, seed=10 + seed))
        stored(tiny_target, kept[-1], cache)
    assert cache.stats().blocks == 8 and pool.used_tokens == 8 * B
    cache.match(kept[0], b"")  # a lookup alone does not count as a use
    live = SequenceCache(tiny_target, prompt(4 * B + 1, seed=10), pool)
    assert cache.attach(live, b"") == 4 * B                       # the first prompt is now the most recent
    # A session growing to the whole pool takes every block no session is copying.
    live.cache.reserve(2 * chunk)
    assert pool.used_tokens <= pool.budget_tokens and cache.stats().blocks == 0
    assert cache.stats().evicted_blocks == 8
    # The live session's copy is its own: what it attached is still there.
    assert live.cached == 4 * B
    with pytest.raises(ResourceExhausted):
        SequenceCache(tiny_target, prompt(8), pool).cache.reserve(1)


def test_a_full_pool_keeps_the_earlier_blocks_of_a_prefix_and_evicts_later_ones_first(tiny_target):
    pool = KVPool(kv_cache.CHUNK + 3 * B, tiny_target.lean.token_bytes())
    cache = PrefixCache(pool)
    seq = SequenceCache(tiny_target, prompt(6 * B + 1), pool)   # holds a page of CHUNK tokens
    seq.prefill()
    assert cache.store(seq, b"") == 3                              # room for three of its six blocks
    assert cache.match(prompt(6 * B + 1), b"") == 3 * B
    assert cache.evict(B) == B and cache.match(prompt(6 * B + 1), b"") == 2 * B  # the third went first


def test_blocks_being_copied_are_never_given_back(tiny_target):
    pool = KVPool(4096, tiny_target.lean.token_bytes())
    cache = PrefixCache(pool)
    stored(tiny_target, prompt(2 * B + 1), cache)
    copying, release = threading.Event(), threading.Event()
    target = SequenceCache(tiny_target, prompt(2 * B + 1), pool)
    load = target.cache.load_blocks

    def slow_load(blocks, block_tokens):
        copying.set()
        release.wait(5)
        load(blocks, block_tokens)
    target.cache.load_blocks = slow_load
    worker = threading.Thread(target=cache.attach, args=(target, b""))
    worker.start()
    assert copying.wait(5)
    assert cache.evict(10 * B) == 0  # both blocks are referenced while they are copied
    release.set()
    worker.join(5)
    assert target.cached == 2 * B and cache.evict(10 * B) == 2 * B


def generate(stub, ids, **extra):
    return stub.Generate(coordinator_pb2.GenerateRequest(
        token_ids=coordinator_pb2.TokenIds(ids=ids), max_new_tokens=12, **extra))


@pytest.fixture(scope="module")
def cached_and_cold(tiny_draft, tiny_target):
    """Two drafter-verifier pairs, one with prefix caching, one without."""
    servers = {mode: (drafter.service.serve(tiny_draft, prefix_cache=mode),
                      verifier.service.serve(tiny_target, prefix_cache=mode)) for mode in ("on", "off")}
    yield {mode: {"drafter": f"127.0.0.1:{d.port}", "verifier": f"127.0.0.1:{v.port}"}
           for mode, (d, v) in servers.items()}
    for pair in servers.values():
        for server in pair:
            server.stop(0)


def test_greedy_speculation_is_the_same_with_the_cache_on_and_off_and_a_second_turn_reuses_the_first(cached_and_cold):
    system = prompt(6 * B)
    first_turn = system + prompt(20, seed=3)
    outputs = {}
    for mode, backends in cached_and_cold.items():
        with coordinator_stub(**backends, gamma=3) as stub:
            one = generate(stub, first_turn)
            second_turn = [*first_turn, *one.token_ids, *prompt(10, seed=4)]
            two = generate(stub, second_turn)
            target_only = generate(stub, second_turn, speculation=coordinator_pb2.Speculation(enabled=False))
            outputs[mode] = (list(one.token_ids), list(two.token_ids))
            assert list(two.token_ids) == list(target_only.token_ids)
            if mode == "on":  # the first turn's prompt, at least (its answer is kept when its sessions end)
                assert two.stats.prefix_cached_tokens >= (len(first_turn) - 1) // B * B
                assert two.stats.draft_prefix_cached_tokens >= (len(first_turn) - 1) // B * B
            else:
                assert two.stats.prefix_cached_tokens == 0 == two.stats.draft_prefix_cached_tokens
    assert outputs["on"] == outputs["off"]


def test_a_cache_salt_keeps_requests_apart(cached_and_cold):
    ids = prompt(5 * B, seed=7)
    with coordinator_stub(**cached_and_cold["on"], gamma=2) as stub:
        generate(stub, ids, cache_salt="tenant-a")
        assert generate(stub, ids, cache_salt="tenant-b").stats.prefix_cached_tokens == 0
        assert generate(stub, ids, cache_salt="tenant-a").stats.prefix_cached_tokens >= 4 * B


def test_eight_clients_sharing_a_system_prompt_get_target_only_greedy_output(cached_and_cold):
    system = prompt(8 * B, seed=5)
    questions = [system + prompt(6 + i, seed=20 + i) for i in range(8)]
    with coordinator_stub(**cached_and_cold["on"], gamma=3) as stub:
        expected = [list(generate(stub, q, speculation=coordinator_pb2.Speculation(enabled=False)).token_ids)
                    for q in questions]
        results: list = [None] * 8

        def run(i):
            results[i] = generate(stub, questions[i])
        threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert [list(r.token_ids) for r in results] == expected
    assert all(r.stats.prefix_cached_tokens >= len(system) - B for r in results)


def test_info_reports_the_cache_and_an_ended_session_leaves_what_it_generated(cached_and_cold):
    import grpc
    from specdec.v1 import verifier_pb2, verifier_pb2_grpc
    with grpc.insecure_channel(cached_and_cold["on"]["verifier"]) as ch:
        stub = verifier_pb2_grpc.VerifierStub(ch)
        ids = prompt(3 * B + 1, seed=9)
        started = stub.StartSession(common_pb2.StartSessionRequest(session_id="info-1", prompt_token_ids=ids))
        assert started.prefix_cached_tokens == 0 and started.cached_tokens == 3 * B
        before = stub.Info(common_pb2.InfoRequest())
        assert before.prefix_cache_blocks >= 3 and before.prefix_cache_tokens == before.prefix_cache_blocks * B
        match = stub.MatchPrefix(common_pb2.MatchPrefixRequest(prompt_token_ids=ids))
        assert match.cached_tokens == 3 * B
        assert stub.Info(common_pb2.InfoRequest()).prefix_cache_hit_tokens == before.prefix_cache_hit_tokens
        decoded = stub.Decode(verifier_pb2.DecodeRequest(session_id="info-1", num_tokens=2 * B))
        stub.EndSession(common_pb2.EndSessionRequest(session_id="info-1"))
        conversation = [*ids, *decoded.token_ids, 7]
        # The session cached the prompt and all but its last decoded token: five full blocks.
        assert stub.MatchPrefix(common_pb2.MatchPrefixRequest(prompt_token_ids=conversation)).cached_tokens == 5 * B
        again = stub.StartSession(common_pb2.StartSessionRequest(session_id="info-2", prompt_token_ids=conversation))
        assert again.prefix_cached_tokens == 5 * B and again.cached_tokens == len(conversation) - 1
        stub.EndSession(common_pb2.EndSessionRequest(session_id="info-2"))


def test_a_hit_with_no_room_beside_its_blocks_prefills_cold_and_the_pool_takes_them_back(tiny_target):
    chunk = kv_cache.CHUNK
    pool = KVPool(2 * chunk, tiny_target.lean.token_bytes())
    cache = PrefixCache(pool)
    ids = prompt(chunk - 1)
    first = stored(tiny_target, ids, cache)
    assert pool.used_tokens > chunk + chunk // 2              # a page and most of a page of blocks
    second = SequenceCache(tiny_target, ids, pool)
    assert cache.attach(second, b"") == 0 and second.cached == 0  # its page does not fit beside its blocks
    second.prefill()                                             # the blocks make room for the cold prefill
    assert pool.used_tokens == 2 * chunk and cache.stats().blocks == 0
    assert torch.equal(second.forward(ids[-1:], keep_last=1), first.forward(ids[-1:], keep_last=1))


def test_keys_kept_between_stores_follow_a_rollback_and_new_tokens(tiny_target):
    pool = KVPool(4096, tiny_target.lean.token_bytes())
    cache = PrefixCache(pool)
    seq = stored(tiny_target, prompt(3 * B + 1), cache)
    seq.forward(prompt(2 * B, seed=4), keep_last=1)             # drafts filling two more blocks
    cache.store(seq, b"")
    seq.truncate(3 * B + 4)                                       # rejected: back into the fourth block
    seq.forward(prompt(2 * B, seed=5), keep_last=1)               # other tokens there
    cache.store(seq, b"")
    blocks = seq.cached // B
    assert seq.block_keys[2] == block_keys(seq.tokens, b"", blocks)  # the same keys as hashed afresh
    again = SequenceCache(tiny_target, seq.tokens[:blocks * B + 1], pool)
    assert cache.attach(again, b"") == blocks * B
    assert torch.allclose(again.forward([], keep_last=1),
                          cold_logits(tiny_target, seq.tokens[:blocks * B + 1]), atol=1e-4)


# Run in a process of its own, so no other test's threads come or go meanwhile.
_COPY_ON_A_CALLS_THREAD = """
import os, threading, torch
from specdec.runtime import kv_cache
B = 16
if torch.get_num_threads() < 2:
    print("one-core"); raise SystemExit
cache = kv_cache.StaticKVCache(8, 4, 128, torch.float32, torch.device("cpu"))  # blocks of 131,072 values
cache.reserve(4 * B); cache.buffer.normal_(); cache.length = 4 * B
copied, blocks = kv_cache.StaticKVCache(8, 4, 128, torch.float32, torch.device("cpu")), []
done, go_on = threading.Event(), threading.Event()
def call():
    blocks.extend(cache.block(b * B, (b + 1) * B) for b in range(4))   # what store does
    copied.load_blocks(blocks, B)                                      # what attach does
    done.set(); go_on.wait(30)
before = len(os.listdir("/proc/self/task"))
thread = threading.Thread(target=call); thread.start(); done.wait(30)
during = len(os.listdir("/proc/self/task"))
go_on.set(); thread.join()
print(before, during, torch.equal(copied.buffer[:, :, :, :4 * B], cache.buffer[:, :, :, :4 * B]))
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc")
def test_storing_and_attaching_blocks_on_a_calls_thread_starts_no_openmp_team():
    # The prefix cache copies on the RPC thread of the call that stores or attaches.
    # A torch copy there starts an OpenMP team for that thread (a worker per extra
    # core, alive while the thread is), and a second team in the process slows every
    # forward of the torch thread (specdec.runtime.torch_thread).
    out = subprocess.run([sys.executable, "-c", _COPY_ON_A_CALLS_THREAD], capture_output=True, text=True,
                         timeout=120, cwd=pathlib.Path(__file__).resolve().parent.parent)
    assert out.returncode == 0, out.stderr[-2000:]
    if out.stdout.strip() == "one-core":
        pytest.skip("one core: OpenMP starts no worker, so a copy cannot show one")
    before, during, same = out.stdout.split()
    assert int(during) == int(before) + 1, "the copies started threads beside the calling one"
    assert same == "True"
