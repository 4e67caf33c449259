"""Tokenizer identity: a fingerprint over everything that decides token ids.

Speculative decoding is only lossless if the drafter and the verifier mean the
same thing by every id. Comparing vocabulary sizes is not enough (Qwen2 and a
re-ordered copy have the same size), so the fingerprint covers the full
vocabulary (id -> token), the merges, added and special tokens, BOS/EOS/PAD/UNK
ids, the normalizer, pre-tokenizer and decoder. When two fingerprints differ,
`first_difference` names the first thing that differs, in words.
"""
from __future__ import annotations

import hashlib
import json
import pathlib
import tempfile
from typing import Any

import transformers
from transformers import PreTrainedTokenizerBase

from specdec.rpc.errors import FailedPrecondition


def describe(tokenizer: PreTrainedTokenizerBase) -> dict[str, Any]:
    """The canonical, JSON-able description that the fingerprint hashes."""
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    token_to_id = tokenizer.get_vocab()
    size = max(token_to_id.values()) + 1 if token_to_id else 0
    id_to_token: list[str | None] = [None] * size
    for token, index in token_to_id.items():
        id_to_token[index] = token
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec.get("model", {}).get("merges", [])]
    added = sorted((t["id"], t["content"], bool(t.get("special"))) for t in spec.get("added_tokens", []))
    special_ids = {name: getattr(tokenizer, f"{name}_token_id", None) for name in ("bos", "eos", "pad", "unk")}
    return {
        "vocab": id_to_token,
        "merges": merges,
        "added_tokens": [list(a) for a in added],
        "special_ids": special_ids,
        "normalizer": spec.get("normalizer"),
        "pre_tokenizer": spec.get("pre_tokenizer"),
        "decoder": spec.get("decoder"),
    }


def fingerprint(description: dict[str, Any]) -> str:
    canonical = json.dumps(description, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    return fingerprint(describe(tokenizer))


def _first_index(a: list, b: list) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _at(items: list, i: int):
    return items[i] if i < len(items) else "<none>"


def first_difference(draft: dict[str, Any], target: dict[str, Any]) -> str | None:
    """The first difference between two descriptions, or None if identical."""
    dv, tv = draft["vocab"], target["vocab"]
    if len(dv) != len(tv):
        i = _first_index(dv, tv)
        where = f"; first differing id {i}: draft {dv[i]!r} vs target {tv[i]!r}" if i is not None and i < min(
            len(dv), len(tv)) else ""
        return f"vocab size: draft {len(dv)} vs target {len(tv)}{where}"
    i = _first_index(dv, tv)
    if i is not None:
        reordered = sorted(t for t in dv if t is not None) == sorted(t for t in tv if t is not None)
        prefix = "same tokens in a different id order; " if reordered else ""
        return f"{prefix}id {i}: draft {dv[i]!r} vs target {tv[i]!r}"
    i = _first_index(draft["merges"], target["merges"])
    if i is not None:
        dm, tm = _at(draft["merges"], i), _at(target["merges"], i)
        return f"merge {i}: draft {dm!r} vs target {tm!r} ({len(draft['merges'])} vs {len(target['merges'])} merges)"
    i = _first_index(draft["added_tokens"], target["added_tokens"])
    if i is not None:
        da, ta = _at(draft["added_tokens"], i), _at(target["added_tokens"], i)
        return f"added token {i} [id, content, special]: draft {da} vs target {ta}"
    for name in ("bos", "eos", "pad", "unk"):
        d, t = draft["special_ids"].get(name), target["special_ids"].get(name)
        if d != t:
            return f"{name}_token_id: draft {d} vs target {t}"
    for part in ("normalizer", "pre_tokenizer", "decoder"):
        if draft[part] != target[part]:
            return f"{part}: draft {json.dumps(draft[part])[:200]} vs target {json.dumps(target[part])[:200]}"
    return None


def tokenizer_files(tokenizer: PreTrainedTokenizerBase) -> dict[str, bytes]:
    """The tokenizer's saved files, to ship it over the wire."""
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        return {p.name: p.read_bytes() for p in pathlib.Path(tmp).iterdir() if p.is_file()}


def load_tokenizer_files(files: dict[str, bytes], expected_fingerprint: str | None = None) -> PreTrainedTokenizerBase:
    """A tokenizer from its saved files, as the class they name (tokenizer_config.json):
    transformers' AutoTokenizer would import torch, which the coordinator's process
    does without. Where that class's fingerprint is not `expected_fingerprint`,
    AutoTokenizer decides after all, and FailedPrecondition is raised where its
    fingerprint is not either (the files changed in transfer)."""
    with tempfile.TemporaryDirectory() as tmp:
        for name, data in files.items():
            if "/" in name or name.startswith("."):
                raise ValueError(f"unsafe tokenizer file name {name!r}")
            (pathlib.Path(tmp) / name).write_bytes(data)
        try:
            named = json.loads(files.get("tokenizer_config.json", b"{}")).get("tokenizer_class") or ""
        except ValueError:
            named = ""
        cls = getattr(transformers, named, None) if named.isidentifier() else None
        if isinstance(cls, type) and issubclass(cls, PreTrainedTokenizerBase):
            tokenizer = cls.from_pretrained(tmp)
            if expected_fingerprint is None or tokenizer_fingerprint(tokenizer) == expected_fingerprint:
                return tokenizer
        from transformers import AutoTokenizer  # imports torch
        tokenizer = AutoTokenizer.from_pretrained(tmp)
    if expected_fingerprint is not None and tokenizer_fingerprint(tokenizer) != expected_fingerprint:
        raise FailedPrecondition("the tokenizer changed in transfer: its fingerprint is not the one its service "
                                 "reported")
    return tokenizer
