"""Prompt-lookup (n-gram) proposer: drafts by copying what followed the latest
earlier occurrence of the current suffix. No model, no service; it plugs into
the coordinator's loop through the same Proposer interface as the drafter."""
from __future__ import annotations

from typing import Sequence

import torch

from specdec.proposer import Commit, Proposal, Proposer
from specdec.sampling import SamplingConfig
from specdec.wire import encode_probs


class NgramProposer(Proposer):
    def __init__(self, vocab_size: int, max_ngram: int = 3, min_ngram: int = 1):
        self.vocab_size = vocab_size
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.tokens: list[int] = []
        self.round_base = 0

    def start(self, session_id: str, prompt_ids: Sequence[int]) -> None:
        self.tokens = list(prompt_ids)
        self.round_base = len(self.tokens)

    def _lookup(self, n: int) -> list[int]:
        for size in range(min(self.max_ngram, len(self.tokens) - 1), self.min_ngram - 1, -1):
            suffix = self.tokens[-size:]
            # Latest earlier occurrence wins: recent context predicts best.
            for start in range(len(self.tokens) - size - 1, -1, -1):
                if self.tokens[start : start + size] == suffix:
                    return self.tokens[start + size : start + size + n]
        return []

    def propose(self, num_tokens: int, sampling: SamplingConfig, commit: Commit | None,
                min_confidence: float = 0.0) -> Proposal:
        if commit is not None:
            del self.tokens[self.round_base + commit.num_accepted :]
            self.tokens += commit.target_token_ids
        self.round_base = len(self.tokens)
        draft = self._lookup(num_tokens)
        self.tokens += draft
        if sampling.greedy or not draft:
            return Proposal(tuple(draft))
        # A deterministic proposal: draft_probs is one-hot, so the rejection
        # sampler accepts token x with probability target_probs[x] — still lossless.
        one_hot = torch.zeros(len(draft), self.vocab_size)
        one_hot[torch.arange(len(draft)), torch.tensor(draft)] = 1.0
        return Proposal(tuple(draft), encode_probs(one_hot))

    def end(self) -> None:
        self.tokens = []
