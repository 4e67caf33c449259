"""Token ids ranked by how often a target writes them, for cutting a draft's LM
head to the ids that matter (FR-Spec, VocabTrim): a draft whose head holds the
top N ids proposes only those, and stays lossless, since every other id gets
probability zero in exactly the distribution it samples from and sends.

One ranking per tokenizer, named by its fingerprint, in specdec/weights/vocab/
(`benchmarks/vocab_rank.py` makes one from a target's own outputs). Where a
tokenizer has none, or its ranking runs out, the lowest ids come next: BPE
gives them to the merges it made first, the most frequent in its corpus."""
from __future__ import annotations

import hashlib
import pathlib
from typing import Iterable, Sequence

import numpy as np

DIR = pathlib.Path(__file__).resolve().parent / "vocab"


def path(fingerprint: str) -> pathlib.Path:
    digest = fingerprint.split(":", 1)[-1]   # "sha256:<hex>": the hex names the file
    return DIR / f"{digest[:16]}.npy"


def load(fingerprint: str) -> np.ndarray | None:
    """[n] uint32 ids, the most frequent first; None where this tokenizer has no ranking."""
    file = path(fingerprint)
    return np.load(file) if file.is_file() else None


def digest(ranking: np.ndarray | None) -> str:
    """Names a ranking in cache keys: a head cut by another ranking is another model."""
    return "ids" if ranking is None else hashlib.sha256(np.ascontiguousarray(ranking).tobytes()).hexdigest()[:16]


def save(fingerprint: str, ranked: Sequence[int]) -> pathlib.Path:
    DIR.mkdir(parents=True, exist_ok=True)
    file = path(fingerprint)
    np.save(file, np.asarray(ranked, dtype=np.uint32))
    return file


def rank(output_counts: dict[int, int], prompt_counts: dict[int, int] | None = None) -> list[int]:
    """Ids by how often the target wrote them, then by how often its prompts held
    them, then by id; only ids seen at all (the rest come by id in `head_ids`)."""
    prompt_counts = prompt_counts or {}
    seen = set(output_counts) | set(prompt_counts)
    return sorted(seen, key=lambda i: (-output_counts.get(i, 0), -prompt_counts.get(i, 0), i))


def head_ids(vocab_size: int, head_vocab: int, always: Iterable[int], ranking: np.ndarray | None = None) -> list[int]:
    """The ids a head cut to `head_vocab` keeps, sorted: the ranking's first
    `head_vocab`, then the lowest ids where it runs out, and `always` (special
    and EOS ids) on top."""
    keep: list[int] = []
    chosen: set[int] = set()
    for i in (int(v) for v in (ranking if ranking is not None else ())):
        if len(keep) >= head_vocab:
            break
        if i < vocab_size and i not in chosen:
            keep.append(i)
            chosen.add(i)
    next_id = 0
    while len(keep) < min(head_vocab, vocab_size):
        if next_id not in chosen:
            keep.append(next_id)
            chosen.add(next_id)
        next_id += 1
    return sorted(chosen | {i for i in always if 0 <= i < vocab_size})
