"""Tokenizer identity: the fingerprint, and the first difference in words."""
from __future__ import annotations

import copy
import json

import pytest
from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast

from specdec.weights import tiny
from specdec.weights.tokenizer_fingerprint import (
    describe, first_difference, load_tokenizer_files, tokenizer_fingerprint, tokenizer_files)


def variant(edit) -> PreTrainedTokenizerFast:
    """The tiny tokenizer with its tokenizer.json edited by `edit`."""
    spec = json.loads(tiny.build_tokenizer().backend_tokenizer.to_str())
    edit(spec)
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
                                   eos_token="<|im_end|>", pad_token="<|endoftext|>")


def test_identical_tokenizers_have_the_same_fingerprint():
    a, b = tiny.build_tokenizer(), tiny.build_tokenizer()
    assert tokenizer_fingerprint(a) == tokenizer_fingerprint(b)
    assert first_difference(describe(a), describe(b)) is None


def test_fingerprint_survives_the_wire():
    tokenizer = tiny.build_tokenizer()
    loaded = load_tokenizer_files(tokenizer_files(tokenizer))
    assert tokenizer_fingerprint(loaded) == tokenizer_fingerprint(tokenizer)
    assert loaded.chat_template == tokenizer.chat_template


def test_same_tokens_in_another_order_is_reported_as_such():
    message = first_difference(describe(tiny.build_tokenizer(mismatch=True)), describe(tiny.build_tokenizer()))
    assert message == "same tokens in a different id order; id 0: draft '<|im_end|>' vs target '<|endoftext|>'"


def _drop_last_merge_and_token(spec):
    vocab = spec["model"]["vocab"]
    last = max(vocab, key=vocab.get)
    del vocab[last]
    spec["model"]["merges"] = spec["model"]["merges"][:-1]


def _rename_token(spec):
    spec["model"]["vocab"]["<tool_call>"] = spec["model"]["vocab"].pop("<|im_start|>")
    spec["added_tokens"][1]["content"] = "<tool_call>"


def _swap_merges(spec):
    merges = spec["model"]["merges"]
    merges[3], merges[4] = merges[4], merges[3]


def _added_token_not_special(spec):
    spec["added_tokens"][1]["special"] = False


def _normalizer(spec):
    spec["normalizer"] = {"type": "NFKC"}


@pytest.mark.parametrize("edit, expected", [
    (_drop_last_merge_and_token, "vocab size: draft 511 vs target 512"),
    (_rename_token, "id 1: draft '<tool_call>' vs target '<|im_start|>'"),
    (_swap_merges, "merge 3: draft"),
    (_added_token_not_special, "added token 1 [id, content, special]: draft [1, '<|im_start|>', False]"),
    (_normalizer, "normalizer: draft {\"type\": \"NFKC\"} vs target null"),
])
def test_first_difference_names_it(edit, expected):
    draft, target = variant(edit), tiny.build_tokenizer()
    assert tokenizer_fingerprint(draft) != tokenizer_fingerprint(target)
    assert first_difference(describe(draft), describe(target)).startswith(expected)


def test_special_ids_are_compared():
    draft = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(tiny.build_tokenizer().backend_tokenizer.to_str()),
                                    eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    assert first_difference(describe(draft), describe(tiny.build_tokenizer())) == "eos_token_id: draft 0 vs target 2"


def test_vocab_size_difference_names_the_first_differing_id_too():
    draft, target = describe(tiny.build_tokenizer()), describe(tiny.build_tokenizer())
    draft = copy.deepcopy(draft)
    draft["vocab"] = draft["vocab"][:100] + ["x"] + draft["vocab"][101:200]
    assert first_difference(draft, target) == f"vocab size: draft 200 vs target 512; first differing id 100: " \
                                              f"draft 'x' vs target {target['vocab'][100]!r}"
