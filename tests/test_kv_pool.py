"""The KV cache pool: growth past the budget is refused with RESOURCE_EXHAUSTED,
and a dropped cache's pages come back."""
from __future__ import annotations

import gc

import pytest
import torch

from specdec.runtime import kv_cache
from specdec.rpc.errors import ResourceExhausted
from specdec.runtime.sequence import SequenceCache
from specdec.runtime.kv_pool import KVPool


def test_caches_take_pages_from_the_pool_and_give_them_back(tiny_target):
    pool = KVPool(budget_tokens=3 * kv_cache.CHUNK, token_bytes=tiny_target.lean.token_bytes())
    first = SequenceCache(tiny_target, list(range(3, 300)), pool)      # 297 tokens: 2 pages
    first.prefill()
    assert pool.used_tokens == 2 * kv_cache.CHUNK and pool.holders == 1
    second = SequenceCache(tiny_target, list(range(3, 200)), pool)
    with pytest.raises(ResourceExhausted, match="KV cache pool is full"):
        second.forward([], keep_last=1)                                # 1 page left, its 197 fit...
        second.forward(list(range(100)), keep_last=1)                  # ...297 do not
    del first
    gc.collect()
    assert pool.used_tokens <= kv_cache.CHUNK and pool.holders == 1       # the first one's pages came back
    second.forward(list(range(100)), keep_last=1)
    assert pool.used_tokens == 2 * kv_cache.CHUNK


class Holder:
    pass


def test_growth_takes_what_is_free_when_doubling_would_not_fit():
    pool = KVPool(budget_tokens=5, token_bytes=4)
    holder = Holder()
    holding = pool.hold(holder)
    assert pool.grow(holding, needed=2, wanted=4) == 4
    assert pool.grow(holding, needed=5, wanted=8) == 5                 # all that is left
    with pytest.raises(ResourceExhausted):
        pool.grow(holding, needed=6, wanted=6)
    assert pool.used_tokens == 5


def test_a_pooled_cache_computes_what_an_unpooled_one_does(tiny_target):
    ids = list(range(7, 40))
    pooled = SequenceCache(tiny_target, ids, KVPool(4 * kv_cache.CHUNK, tiny_target.lean.token_bytes()))
    plain = SequenceCache(tiny_target, ids)
    assert torch.equal(pooled.forward([1], keep_last=1), plain.forward([1], keep_last=1))


def test_the_default_budget_is_a_share_of_the_gpus_free_memory_on_a_gpu_and_of_ram_on_the_cpu(monkeypatch):
    # The GPU's driver is the boundary here: no GPU on this machine.
    import psutil

    from specdec.runtime.device import policy
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (3 << 30, 80 << 30))
    assert policy("cuda:0").free_bytes() == 3 << 30
    on_cpu = policy("cpu").free_bytes()
    assert on_cpu != 3 << 30 and on_cpu <= psutil.virtual_memory().available
