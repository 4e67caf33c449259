"""A session's token ids and the KV cache over a prefix of them.

`tokens` is everything the session has seen; the cache holds keys and values for
`tokens[:cached]`. The uncached tail (usually the one token the other side
added last round) is fed on the next forward. Rejected tokens are removed by
`truncate`, which crops the cache; nothing is ever recomputed from scratch.

Forwards are steps: `step` and `prefill_steps` are generators that yield a
`Forward` (the rows to run) and receive its logits, so a model service's
scheduler (specdec.runtime.batching) can run the pending forwards of many sessions as
one batch. `forward` and `prefill` run them alone, for callers without one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Generator, Sequence, TypeVar

import torch
from transformers import DynamicCache

from specdec.runtime import torch_thread

if TYPE_CHECKING:
    from specdec.runtime.kv_pool import KVPool
    from specdec.runtime.models import LoadedModel

T = TypeVar("T")
PREFILL_CHUNK = 256  # prompt tokens per prefill forward, when not set by the service


PENDING = -1  # in `tokens`: a token the device decided and the host has not read yet (a chained step's)


@dataclass(frozen=True)
class Forward:
    """One step of a session: run the model over `feed` (its uncached tokens, in
    order) and give back the logits of the last `keep_last` of them."""
    seq: "SequenceCache"
    feed: tuple[int, ...]      # [T]; PENDING where `ids` holds the token
    keep_last: int             # 0..T; 0 for a prefill chunk, whose logits nobody reads
    ids: torch.Tensor | None = None   # [T] on the model's device: the feed as the device decided it

    def run(self) -> torch.Tensor:
        """Alone: [keep_last, model_vocab] float32."""
        return self.seq._forward(self.feed, self.keep_last, self.ids)


Steps = Generator[Forward, torch.Tensor, T]  # yields forwards, receives their logits, returns T


def drive(steps: Steps[T]) -> T:
    """Run a generator's forwards one at a time, on the torch thread; its result."""
    return torch_thread.run(run_steps, steps)


def run_steps(steps: Steps[T]) -> T:
    try:
        forward = next(steps)
        while True:
            forward = steps.send(forward.run())
    except StopIteration as done:
        return done.value


class SequenceCache:
    def __init__(self, loaded: "LoadedModel", prompt_ids: Sequence[int], pool: "KVPool | None" = None):
        self.loaded = loaded
        self.tokens: list[int] = [int(t) for t in prompt_ids]
        self.cache_salt = b""  # what the prefix cache keys this session's blocks under
        # The prefix cache's keys of its first full blocks, with their salt and tokens (prefix_cache).
        self.block_keys: tuple[bytes | None, list[int], list[bytes]] = (None, [], [])
        # The lean forward's static buffer where the model has one; transformers' cache otherwise.
        self.cache = loaded.lean.new_cache(pool) if loaded.lean else DynamicCache(config=loaded.model.config)

    @property
    def cached(self) -> int:
        return self.cache.get_seq_length()

    def __len__(self) -> int:
        return len(self.tokens)

    def prefill(self) -> None:
        """Cache all but the last token, so the first round only feeds one token."""
        drive(self.prefill_steps())

    def prefill_steps(self, chunk: int = PREFILL_CHUNK) -> Steps[None]:
        """The prefill as forwards of at most `chunk` tokens: a long prompt then
        holds up the other sessions of a batching scheduler by one chunk at a time."""
        assert chunk > 0, chunk
        while len(self.tokens) - self.cached > 1:
            end = min(self.cached + chunk, len(self.tokens) - 1)
            yield Forward(self, tuple(self.tokens[self.cached:end]), 0)

    def forward(self, extra: Sequence[int], keep_last: int) -> torch.Tensor:
        """Append `extra`, run the model over every uncached token, and return the
        logits of the last `keep_last` positions: [keep_last, model_vocab] float32."""
        return drive(self.step(extra, keep_last))

    def step(self, extra: Sequence[int], keep_last: int) -> Steps[torch.Tensor]:
        """`forward` as a step: yields its Forward, returns the logits sent back."""
        self.tokens.extend(int(t) for t in extra)
        assert 0 < keep_last <= len(self.tokens), (keep_last, len(self.tokens))
        if self.cached > len(self.tokens) - keep_last:
            # Rows asked for are cached (a commit only dropped drafts; a call that failed
            # after its forward, restored, kept the cache of its first token): feed them
            # again for their logits.
            self.cache.crop(len(self.tokens) - keep_last)
        feed = self.tokens[self.cached :]
        return (yield Forward(self, tuple(feed), keep_last))

    def step_on_device(self, ids: torch.Tensor, keep_last: int) -> Steps[torch.Tensor]:
        """`step` of tokens the device decided, `ids` [T] there (a chained draft's or decode step's): fed
        from the device, so the host queues this step without waiting for the last one to end.
        `tokens` holds PENDING for them until `resolve`."""
        assert self.cached == len(self.tokens), (self.cached, len(self.tokens))
        self.tokens.extend([PENDING] * ids.shape[0])
        return (yield Forward(self, (PENDING,) * ids.shape[0], keep_last, ids))

    def resolve(self, start: int, values: Sequence[int]) -> None:
        """The tokens step_on_device fed from `start` on, once read back."""
        assert all(t == PENDING for t in self.tokens[start:start + len(values)]), start
        self.tokens[start:start + len(values)] = [int(v) for v in values]

    def settle(self, start: int, tokens: Sequence[int]) -> None:
        """After steps fed from the device from `start` on, their `tokens` read back: the session
        as the step-by-step loops leave it, `tokens` kept and all but the last cached; the cache
        of any step fed past them (after a cut draft or an EOS) dropped, as a rollback."""
        self.resolve(start, tokens[:len(self.tokens) - start])
        self.truncate(start + len(tokens) - 1)
        self.append(tokens[-1:])

    @torch.inference_mode()
    def _forward(self, feed: Sequence[int], keep_last: int, ids: torch.Tensor | None = None) -> torch.Tensor:
        if self.loaded.lean:
            return self.loaded.lean.batch([(self.loaded.lean.feed_ids(feed, ids), self.cache, keep_last)])[0]
        if ids is None:
            ids = torch.tensor(list(feed), dtype=torch.long, device=self.loaded.device)
        # transformers' forward keeps at least one row (logits_to_keep=0 means all of them).
        out = self.loaded.model(input_ids=ids[None], cache=self.cache, use_cache=True,
                                logits_to_keep=max(keep_last, 1))
        return out.logits[0, out.logits.shape[1] - keep_last:].float()

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
