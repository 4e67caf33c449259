"""A session's keys and values for the lean forward: one preallocated buffer.

[layers, 2, kv_heads, capacity, head_dim], grown in CHUNK-token pages taken from a
KVPool (which bounds what all of a service's sessions hold together). Rolling
back rejected drafts is moving its length back, so nothing is copied or
recomputed: the same `crop`/`get_seq_length` contract as transformers'
DynamicCache, which `specdec.runtime.sequence.SequenceCache` uses for models the
lean forward does not cover. The prefix cache copies blocks in and out
(`block`, `load_blocks`).
"""
from __future__ import annotations

import torch

from specdec.runtime.kv_pool import KVPool

CHUNK = 256  # cache growth step, in tokens


class StaticKVCache:
    """Keys and values of every layer for one sequence: [layers, 2, kv_heads, capacity, head_dim].

    Its capacity grows in CHUNK-token pages taken from a KVPool, which bounds what
    all of a service's sessions hold together; the pages go back when the cache
    is dropped (the session ended or was reaped)."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 pool: KVPool | None = None):
        self.shape = (layers, 2, kv_heads, 0, head_dim)
        self.buffer = torch.empty(self.shape, dtype=dtype, device=device)
        self.length = 0
        self.pool = pool
        self.page_tokens = pool.hold(self) if pool is not None else None  # [tokens held], shared with the pool

    def get_seq_length(self) -> int:
        return self.length

    def crop(self, max_length: int) -> None:
        """Keep the first `max_length` positions (negative: drop that many), as DynamicCache.crop."""
        self.length = max(self.length + max_length, 0) if max_length < 0 else min(self.length, max_length)

    def block(self, start: int, end: int) -> torch.Tensor:
        """A copy of positions start..end: [layers, 2, kv_heads, end - start, head_dim]."""
        assert 0 <= start < end <= self.length, (start, end, self.length)
        positions = self.buffer[:, :, :, start:end]
        out = torch.empty_like(positions, memory_format=torch.contiguous_format)
        _copy_outside_openmp(out, positions)
        return out

    def load_blocks(self, blocks: list[torch.Tensor], block_tokens: int) -> None:
        """Fill an empty cache with these blocks' positions, in order (a cached prefix)."""
        assert self.length == 0, self.length
        self.reserve(len(blocks) * block_tokens)
        for b, kv in enumerate(blocks):
            assert kv.shape == (*self.shape[:3], block_tokens, self.shape[4]), (kv.shape, self.shape)
            _copy_outside_openmp(self.buffer[:, :, :, b * block_tokens:(b + 1) * block_tokens], kv)
        self.length = len(blocks) * block_tokens

    def reserve(self, length: int) -> None:
        capacity = self.buffer.shape[3]
        if length <= capacity:
            return
        grown = max(length, 2 * capacity)
        grown = -(-grown // CHUNK) * CHUNK
        if self.pool is not None:
            grown = self.pool.grow(self.page_tokens, -(-length // CHUNK) * CHUNK, grown)
        buffer = torch.empty((*self.shape[:3], grown, self.shape[4]), dtype=self.buffer.dtype,
                             device=self.buffer.device)
        buffer[:, :, :, :self.length] = self.buffer[:, :, :, :self.length]
        self.buffer = buffer


def _copy_outside_openmp(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst[...] = src, for the prefix cache's copies, which run on the RPC thread of
    the call that stores or attaches blocks. A torch copy there would start an
    OpenMP thread team for that thread, and with a second team alive every forward
    on the torch thread runs slower (specdec.runtime.torch_thread): through the
    verifier service a decoded token took 99 ms against 91 with the prefix cache
    off. numpy copies on the calling thread alone."""
    if dst.device.type == "cpu" and src.device.type == "cpu" and dst.dtype == src.dtype != torch.bfloat16:
        numpy_dst = dst.numpy()
        numpy_dst[...] = src.numpy()
    else:
        dst.copy_(src)
