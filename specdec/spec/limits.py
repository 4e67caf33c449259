"""Bounds every side checks alike, torch-free (the coordinator checks them too)."""
from __future__ import annotations

from typing import Sequence

from specdec.rpc.errors import InvalidArgument

MAX_TOP_LOGPROBS = 20   # the most likely tokens sent beside each output token's logprob (OpenAI's bound)
MAX_PROPOSE_TOKENS = 32  # draft tokens one round may carry (a lookup's and the model's together)


def validate_token_ids(ids: Sequence[int], vocab_size: int, what: str) -> None:
    bad = next((t for t in ids if t >= vocab_size), None)
    if bad is not None:
        raise InvalidArgument(f"{what} contains token id {bad}, outside the vocabulary (0..{vocab_size - 1})", what)
