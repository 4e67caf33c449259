"""KV of prompt prefixes kept for later sessions: a chat's next turn, or a system
prompt many requests share, is not prefilled again.

What is kept are full blocks of BLOCK_TOKENS positions of one sequence's KV
cache. A block's key is the hash of the salt, of its own token ids and of every
block before it, so a key names a whole prefix (as vLLM's block hashes do): two
prompts share a block only where they agree from their first token. A session
starting looks up its prompt's keys in order and stops at the first miss; the
blocks it found are copied into its own cache, and it prefills the rest. Copying
beats attending over shared blocks in place here: 700 tokens of the 1.5B's KV
(57 KB a token in fp32) are 40 MB, a few ms, against seconds of prefill, and a
session's cache stays one buffer that speculative rollback crops freely. So no
session ever writes into a kept block: rejected drafts and rollbacks touch the
session's copy only.

Blocks live under the KV pool's budget. The cache takes only tokens the pool has
free, and gives blocks back, least recently used first, whenever a session
needs room the pool lacks (`KVPool.reclaim`); a block being copied into a
session is referenced and never given back under it. A lookup touches the
blocks it found from the last to the first, so a prefix's later blocks are
given back before the earlier ones that other prompts may share.

The salt keeps callers apart: a hit is observable through timing, so blocks
are reused only under the same salt (the coordinator derives it from the
request's cache_salt and, with authentication on, the caller).
"""
from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch

from specdec.rpc.errors import ResourceExhausted

if TYPE_CHECKING:
    from specdec.runtime.sequence import SequenceCache
    from specdec.runtime.kv_pool import KVPool

BLOCK_TOKENS = 16


def block_keys(tokens: Sequence[int], salt: bytes, blocks: int, block_tokens: int = BLOCK_TOKENS,
               known: Sequence[bytes] = ()) -> list[bytes]:
    """The keys of the first `blocks` full blocks of `tokens`, each naming its whole
    prefix; `known`: those of its first blocks already worked out (under this salt)."""
    assert blocks * block_tokens <= len(tokens), (blocks, len(tokens))
    keys = list(known[:blocks])
    parent = keys[-1] if keys else hashlib.blake2b(b"specdec-prefix\0" + salt, digest_size=16).digest()
    for b in range(len(keys), blocks):
        ids = tokens[b * block_tokens:(b + 1) * block_tokens]
        parent = hashlib.blake2b(parent + b"".join(int(t).to_bytes(4, "little") for t in ids),
                                 digest_size=16).digest()
        keys.append(parent)
    return keys


@dataclass
class _Block:
    kv: torch.Tensor          # [layers, 2, kv_heads, block_tokens, head_dim]
    refs: int = 0             # sessions copying it now


@dataclass
class PrefixStats:
    blocks: int = 0
    tokens: int = 0
    query_tokens: int = 0     # prompt tokens StartSession looked up
    hit_tokens: int = 0       # of them, found cached
    evicted_blocks: int = 0


class PrefixCache:
    def __init__(self, pool: "KVPool", block_tokens: int = BLOCK_TOKENS):
        assert block_tokens > 0, block_tokens
        self.pool = pool
        self.block_tokens = block_tokens
        self._blocks: OrderedDict[bytes, _Block] = OrderedDict()   # least recently used first
        self._lock = threading.Lock()
        self._stats = PrefixStats()
        pool.reclaim = self.evict

    def stats(self) -> PrefixStats:
        with self._lock:
            return PrefixStats(**{**vars(self._stats), "blocks": len(self._blocks),
                                  "tokens": len(self._blocks) * self.block_tokens})

    def _usable_blocks(self, tokens: Sequence[int]) -> int:
        # All but the prompt's last token are cached by a prefill: its forward is the first step's.
        return max(len(tokens) - 1, 0) // self.block_tokens

    def match(self, tokens: Sequence[int], salt: bytes) -> int:
        """Leading tokens of a prompt held under `salt`, as `attach` would find them (changes nothing)."""
        keys = block_keys(tokens, salt, self._usable_blocks(tokens), self.block_tokens)
        with self._lock:
            return self._found(keys) * self.block_tokens

    def _found(self, keys: list[bytes]) -> int:
        found = 0
        while found < len(keys) and keys[found] in self._blocks:
            found += 1
        return found

    def attach(self, seq: "SequenceCache", salt: bytes) -> int:
        """Copy the longest cached prefix of an empty session's prompt into its KV
        cache; returns the tokens copied (its prefill then starts past them)."""
        assert seq.cached == 0, seq.cached
        keys = self._session_keys(seq, salt, self._usable_blocks(seq.tokens))
        with self._lock:
            blocks = [self._blocks[k] for k in keys[:self._found(keys)]]
            for key in reversed(keys[:len(blocks)]):       # the first block ends most recently used
                self._blocks.move_to_end(key)
            for block in blocks:
                block.refs += 1
            self._stats.query_tokens += len(keys) * self.block_tokens
            self._stats.hit_tokens += len(blocks) * self.block_tokens
        try:
            if blocks:
                seq.cache.load_blocks([b.kv for b in blocks], self.block_tokens)
        except ResourceExhausted:
            # No room for the session beside the blocks it would copy (they are held
            # while it does): it prefills cold instead, and the pool may take them back.
            with self._lock:
                self._stats.hit_tokens -= len(blocks) * self.block_tokens
            return 0
        finally:
            with self._lock:
                for block in blocks:
                    block.refs -= 1
        return seq.cached

    def _session_keys(self, seq: "SequenceCache", salt: bytes, blocks: int) -> list[bytes]:
        """block_keys of a session's first blocks. A session is stored after every
        call, so the keys of the blocks whose tokens have not changed since (rollback
        only moves the end) are taken from the last time instead of hashed again."""
        known_salt, known_tokens, known = seq.block_keys
        same = 0
        if known_salt == salt:
            step = self.block_tokens
            while same < len(known) and seq.tokens[same * step:(same + 1) * step] == \
                    known_tokens[same * step:(same + 1) * step]:
                same += 1
        keys = block_keys(seq.tokens, salt, blocks, self.block_tokens, known[:same])
        seq.block_keys = (salt, seq.tokens[:blocks * self.block_tokens], keys)
        return keys

    def store(self, seq: "SequenceCache", salt: bytes) -> int:
        """Keep the full blocks of a session's cached tokens that are not kept yet
        (as far as the pool has room); returns how many blocks were added."""
        keys = self._session_keys(seq, salt, seq.cached // self.block_tokens)
        keep, added = set(keys), 0
        with self._lock:
            for b, key in enumerate(keys):
                if key in self._blocks:
                    continue
                if not self._room(keep):
                    break
                start = b * self.block_tokens
                self._blocks[key] = _Block(seq.cache.block(start, start + self.block_tokens))
                added += 1
            if added:
                for key in reversed(keys):                   # the first block ends most recently used
                    if key in self._blocks:
                        self._blocks.move_to_end(key)
        return added

    def _room(self, keep: set[bytes]) -> bool:
        """Room for one more block: the pool's free tokens, else this cache's least
        recently used block that is not in `keep` (the prefix being stored)."""
        while not self.pool.take(self.block_tokens):
            victim = next((k for k, b in self._blocks.items() if b.refs == 0 and k not in keep), None)
            if victim is None:
                return False
            self._drop(victim)
        return True

    def _drop(self, key: bytes) -> None:
        del self._blocks[key]
        self._stats.evicted_blocks += 1
        self.pool.give(self.block_tokens)

    def evict(self, tokens: int) -> int:
        """Give back at least `tokens` of the pool (if this cache holds that many that
        no session is copying), least recently used first; returns the tokens given."""
        freed = 0
        with self._lock:
            for key in [k for k, b in self._blocks.items() if b.refs == 0]:
                if freed >= tokens:
                    break
                self._drop(key)
                freed += self.block_tokens
        return freed
