"""One KV arena for a service: every session's keys and values in a buffer
allocated once, at a fixed address, handed out in pages (the static step's
cache: specdec.runtime.paged_step).

A session holds a list of pages (its block table) and a length. Rolling back
rejected drafts moves the length, nothing else; a prefix shared by two
sessions is the same full pages in both tables, counted by reference, never
copied (a session writes only past its own length, so a shared page, full, is
never written again). Page 0 is scratch: the padding rows of a static step
write there, and no session holds it.

As vLLM sizes its cache, the arena is sized from what the device has free
(`torch.cuda.mem_get_info`), not from host RAM; on the CPU from a byte budget.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from specdec.rpc.errors import ResourceExhausted
from specdec.runtime.device import policy

PAGE_TOKENS = 16   # positions a page holds: the prefix cache's block size, so its blocks are pages
SCRATCH_PAGE = 0   # the padding rows' page


def device_budget_bytes(device: torch.device, fraction: float = 0.9, cpu_bytes: int = 1 << 30) -> int:
    """Bytes the arena may take: `fraction` of what the GPU has free now (after the weights
    were loaded), or `cpu_bytes` on the CPU."""
    on = policy(device)
    return int(on.free_bytes() * fraction) if on.on_gpu else cpu_bytes


@dataclass
class PagedSequence:
    """One session's place in the arena: its pages, in order, and the positions filled."""
    pages: list[int] = field(default_factory=list)
    length: int = 0

    def crop(self, length: int) -> None:
        """Keep the first `length` positions (rejected drafts: only the length moves)."""
        assert 0 <= length <= self.length, (length, self.length)
        self.length = length


class KVArena:
    """keys, values: [layers, pages × PAGE_TOKENS, kv_heads, head_dim] each, allocated once."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, pages: int, dtype: torch.dtype,
                 device: torch.device | str, page_tokens: int = PAGE_TOKENS):
        assert pages >= 2, "the scratch page and at least one to hand out"
        self.page_tokens, self.pages = page_tokens, pages
        shape = (layers, pages * page_tokens, kv_heads, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self._free = list(range(pages - 1, SCRATCH_PAGE, -1))   # popped from the end: page 1 first
        self._refs = [0] * pages
        self._lock = threading.Lock()

    @classmethod
    def sized(cls, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
              budget_bytes: int, page_tokens: int = PAGE_TOKENS) -> "KVArena":
        page_bytes = 2 * layers * page_tokens * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
        return cls(layers, kv_heads, head_dim, max(2, budget_bytes // page_bytes), dtype, device, page_tokens)

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def new_sequence(self) -> PagedSequence:
        return PagedSequence()

    def reserve(self, sequence: PagedSequence, length: int) -> None:
        """Pages for positions up to `length`; RESOURCE_EXHAUSTED where the arena has too few."""
        wanted = -(-length // self.page_tokens) - len(sequence.pages)
        if wanted <= 0:
            return
        with self._lock:
            if wanted > len(self._free):
                raise ResourceExhausted(f"the KV arena has {len(self._free)} free pages of {self.page_tokens} "
                                        f"tokens, and this sequence needs {wanted} more: end idle sessions, "
                                        "or give the service more device memory")
            for _ in range(wanted):
                page = self._free.pop()
                self._refs[page] = 1
                sequence.pages.append(page)

    def fork(self, sequence: PagedSequence, tokens: int) -> PagedSequence:
        """A new sequence starting with `sequence`'s first `tokens` positions (whole pages:
        a prefix cache's blocks), sharing its pages."""
        assert tokens % self.page_tokens == 0 and tokens <= sequence.length, (tokens, sequence.length)
        shared = sequence.pages[:tokens // self.page_tokens]
        with self._lock:
            for page in shared:
                self._refs[page] += 1
        return PagedSequence(list(shared), tokens)

    def release(self, sequence: PagedSequence) -> None:
        """The sequence's pages back; a shared page only when its last holder lets go."""
        with self._lock:
            for page in sequence.pages:
                self._refs[page] -= 1
                if self._refs[page] == 0:
                    self._free.append(page)
        sequence.pages, sequence.length = [], 0
