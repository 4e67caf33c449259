"""A session's token ids and the KV cache over a prefix of them.

`tokens` is everything the session has seen; the cache holds keys and values for
`tokens[:cached]`. The uncached tail (usually the one token the other side
added last round) is fed on the next forward. Rejected tokens are removed by
`truncate`, which crops the cache; nothing is ever recomputed from scratch.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch
from transformers import DynamicCache

from specdec import torch_thread

if TYPE_CHECKING:
    from specdec.models import LoadedModel


class SequenceCache:
    def __init__(self, loaded: "LoadedModel", prompt_ids: Sequence[int]):
        self.loaded = loaded
        self.tokens: list[int] = [int(t) for t in prompt_ids]
        # The lean forward's static buffer where the model has one; transformers' cache otherwise.
        self.cache = loaded.lean.new_cache() if loaded.lean else DynamicCache(config=loaded.model.config)

    @property
    def cached(self) -> int:
        return self.cache.get_seq_length()

    def __len__(self) -> int:
        return len(self.tokens)

    @torch.inference_mode()
    def prefill(self) -> None:
        """Cache all but the last token, so the first round only feeds one token."""
        if len(self.tokens) - self.cached > 1:
            self._run(self.tokens[self.cached : -1], keep_last=1)

    @torch.inference_mode()
    def forward(self, extra: Sequence[int], keep_last: int) -> torch.Tensor:
        """Append `extra`, run the model over every uncached token, and return the
        logits of the last `keep_last` positions: [keep_last, model_vocab] float32."""
        self.tokens.extend(int(t) for t in extra)
        if self.cached >= len(self.tokens):
            # Every token is cached (e.g. a commit only dropped drafts): re-feed
            # the last one to get its logits again.
            self.cache.crop(-(self.cached - len(self.tokens) + 1))
        feed = self.tokens[self.cached :]
        assert 0 < keep_last <= len(feed), (keep_last, len(feed))
        return self._run(feed, keep_last)

    def _run(self, feed: Sequence[int], keep_last: int) -> torch.Tensor:
        # On the process's torch thread (specdec.torch_thread), which also makes
        # forwards one at a time: on the CPU, concurrent ones only fight over the cores.
        return torch_thread.run(self._forward, feed, keep_last)

    def _forward(self, feed: Sequence[int], keep_last: int) -> torch.Tensor:
        ids = torch.tensor(list(feed), dtype=torch.long, device=self.loaded.device)
        if self.loaded.lean:
            return self.loaded.lean(ids, self.cache, keep_last)
        out = self.loaded.model(input_ids=ids[None], cache=self.cache, use_cache=True, logits_to_keep=keep_last)
        return out.logits[0].float()

    def append(self, ids: Sequence[int]) -> None:
        """Add tokens without running the model; the next forward feeds them."""
        self.tokens.extend(int(t) for t in ids)

    def snapshot(self) -> tuple[int, ...]:
        """What `restore` needs to undo any later append, truncate or forward."""
        return tuple(self.tokens)

    def restore(self, tokens: tuple[int, ...]) -> None:
        """Back to the tokens of a snapshot. The cache keeps what still matches them
        (a failed call that only appended keeps its whole cache); anything past the
        first difference is cropped and fed again on the next forward."""
        same = 0
        limit = min(len(tokens), len(self.tokens), self.cached)
        while same < limit and tokens[same] == self.tokens[same]:
            same += 1
        self.tokens = list(tokens)
        if self.cached > same:
            self.cache.crop(-(self.cached - same))

    def truncate(self, length: int) -> None:
        """Keep `tokens[:length]`, cropping the cache past it (the KV rollback)."""
        assert 0 <= length <= len(self.tokens), (length, len(self.tokens))
        del self.tokens[length:]
        excess = self.cached - length
        if excess > 0:
            self.cache.crop(-excess)
