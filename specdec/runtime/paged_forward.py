"""The services' forward over one KV arena (`--forward paged`): the lean forward's
interface (`new_cache`, `batch`), run by the static step (specdec.runtime.paged_step).

A session's cache is its pages in the arena (`PagedCache`), with StaticKVCache's
contract: `length`, `crop` (a rollback moves the length), and `block` /
`load_blocks`, which the prefix cache copies through (on the device). The arena
is allocated at the first session, for what the service's KVPool allows (its
--kv-cache-mb), and never moves; the pool still counts each session's pages, so
sessions are refused with the same RESOURCE_EXHAUSTED as on the lean path. On
CUDA every row bucket's graph is captured at that first session, at the smallest
context bucket (the others when first needed).
"""
from __future__ import annotations

import logging
import threading
import weakref
from typing import Sequence

import torch
from torch import nn

from specdec.runtime.kv_arena import PAGE_TOKENS, KVArena, device_budget_bytes
from specdec.runtime.kv_pool import KVPool
from specdec.runtime.lean import LeanForward
from specdec.runtime.paged_step import PagedRunner

log = logging.getLogger(__name__)


class PagedCache:
    """One session's keys and values: its pages in the arena and the positions filled."""

    def __init__(self, forward: "PagedForward", pool: KVPool | None):
        self.forward = forward
        self.arena = forward.arena
        self.sequence = self.arena.new_sequence()
        self.pool = pool
        self.page_tokens = pool.hold(self) if pool is not None else None   # [tokens held], shared with the pool
        weakref.finalize(self, self.arena.release, self.sequence)          # its pages back when it is dropped
        self.shape = (len(forward.layers), 2, forward.kv_heads, 0, forward.head_dim)

    @property
    def length(self) -> int:
        return self.sequence.length

    @length.setter
    def length(self, value: int) -> None:
        self.sequence.length = value

    def get_seq_length(self) -> int:
        return self.sequence.length

    def crop(self, max_length: int) -> None:
        """As StaticKVCache.crop: keep the first `max_length` positions (negative: drop that many)."""
        length = self.sequence.length
        self.sequence.length = max(length + max_length, 0) if max_length < 0 else min(length, max_length)

    def reserve(self, length: int) -> None:
        if self.pool is not None:
            pages = -(-length // PAGE_TOKENS) * PAGE_TOKENS
            if pages > self.page_tokens[0]:
                self.pool.grow(self.page_tokens, pages, pages)
        self.arena.reserve(self.sequence, length)

    def _slots(self, start: int, end: int) -> torch.Tensor:
        positions = torch.arange(start, end)
        pages = torch.tensor(self.sequence.pages)[positions // PAGE_TOKENS]
        return (pages * PAGE_TOKENS + positions % PAGE_TOKENS).to(self.arena.keys.device)

    def block(self, start: int, end: int) -> torch.Tensor:
        """A copy of positions start..end: [layers, 2, kv_heads, end - start, head_dim]."""
        assert 0 <= start < end <= self.length, (start, end, self.length)
        slots = self._slots(start, end)
        return torch.stack([self.arena.keys[:, slots], self.arena.values[:, slots]], dim=1).transpose(2, 3)

    def load_blocks(self, blocks: list[torch.Tensor], block_tokens: int) -> None:
        """Fill an empty cache with these blocks' positions, in order (a cached prefix)."""
        assert self.length == 0, self.length
        self.reserve(len(blocks) * block_tokens)
        for b, kv in enumerate(blocks):
            assert kv.shape == (*self.shape[:3], block_tokens, self.shape[4]), (kv.shape, self.shape)
            slots = self._slots(b * block_tokens, (b + 1) * block_tokens)
            self.arena.keys[:, slots] = kv[:, 0].transpose(1, 2).to(self.arena.keys.dtype)
            self.arena.values[:, slots] = kv[:, 1].transpose(1, 2).to(self.arena.values.dtype)
        self.length = len(blocks) * block_tokens


class PagedForward(LeanForward):
    """The lean forward's arithmetic and interface, its calls run by the static step."""

    def __init__(self, model: nn.Module, max_context: int | None = None, compile: str | None = None):
        super().__init__(model)
        self.compile = compile   # the static step's torch.compile backend (PagedRunner); None: eager
        self.max_context = max_context or int(getattr(self.config, "max_position_embeddings", 4096))
        self.arena: KVArena | None = None
        self.runner: PagedRunner | None = None
        self._lock = threading.Lock()

    def _cache_dtype(self) -> torch.dtype:
        return self.dtype   # the step attends in the weights' dtype; fp32 models (the CPU's tests) in fp32

    def new_cache(self, pool: KVPool | None = None) -> PagedCache:
        with self._lock:
            if self.arena is None:
                self._allocate(pool)
        return PagedCache(self, pool)

    def _allocate(self, pool: KVPool | None) -> None:
        device = self.embed.weight.device
        budget = device_budget_bytes(device)
        if pool is not None:   # the pool's tokens and the scratch page; never past what the device has free
            budget = min(budget, (pool.budget_tokens + PAGE_TOKENS) * self.token_bytes())
        self.arena = KVArena.sized(len(self.layers), self.kv_heads, self.head_dim, self._cache_dtype(), device,
                                   budget)
        self.runner = PagedRunner(self, self.arena, self.max_context, compile=self.compile)
        self.runner.capture()
        log.info("KV arena of %d pages of %d tokens (%.0f MiB) at a fixed address; %s%s", self.arena.pages,
                 PAGE_TOKENS, 2 * self.arena.keys.numel() * self.arena.keys.element_size() / 2**20,
                 f"CUDA graphs for {len(self.runner.buckets)} row buckets" if self.runner.graphs else "no graphs (CPU)",
                 f"; the step compiled ({self.compile})" if self.compile else "")

    def feed_ids(self, feed: Sequence[int], ids: torch.Tensor | None = None) -> Sequence[int] | torch.Tensor:
        """The host's ids stay there (the runner stages them for the step's buffers); ids the
        device decided stay on the device, copied into those buffers there."""
        return ids if ids is not None else tuple(feed)

    @torch.inference_mode()
    def batch(self, items: list[tuple[Sequence[int] | torch.Tensor, PagedCache, int]]) -> list[torch.Tensor]:
        """As LeanForward.batch: [(ids [T_i], cache_i, keep_last_i)] -> [logits [keep_last_i, vocab] fp32],
        each ids the host's (a sequence of ints) or the device's (a tensor there, never read back)."""
        lengths = [cache.length for _, cache, _ in items]
        try:
            for ids, cache, _ in items:
                cache.reserve(cache.length + len(ids))
            return self.runner.forward([(ids, cache.sequence, keep) for ids, cache, keep in items])
        except BaseException:
            for (_, cache, _), length in zip(items, lengths):   # as before the call: a rerun writes it again
                cache.length = length
            raise
