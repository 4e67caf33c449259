"""Output assembly: EOS, length, stop strings, and safe text deltas."""
from __future__ import annotations

from specdec import tiny
from coordinator.output import FinishReason, OutputAccumulator

TOK = tiny.build_tokenizer()
EOS = (TOK.convert_tokens_to_ids("<|im_end|>"),)


def ids(text: str) -> list[int]:
    return TOK.encode(text)


def test_eos_ends_and_is_not_output():
    out = OutputAccumulator(TOK, EOS, 100)
    delta = out.add(ids("Hello") + [EOS[0]] + ids(" world"))
    assert delta.finish_reason == FinishReason.EOS and delta.text == "Hello" and delta.token_ids == ids("Hello")


def test_length_cuts_a_round_short():
    out = OutputAccumulator(TOK, EOS, 3)
    delta = out.add(ids("one two three four five"))
    assert delta.finish_reason == FinishReason.LENGTH and len(out.token_ids) == 3


def test_stop_string_across_rounds_is_never_half_shown():
    out = OutputAccumulator(TOK, EOS, 100, stop=["STOP"])
    first = out.add(ids("Hello ST"))
    assert "ST" not in first.text and first.finish_reason is None
    second = out.add(ids("OP and more"))
    assert second.finish_reason == FinishReason.STOP
    assert first.text + second.text == "Hello "
    assert "STOP" in TOK.decode(out.token_ids) and "more" not in TOK.decode(out.token_ids)


def test_deltas_concatenate_to_the_whole_text():
    out = OutputAccumulator(TOK, EOS, 100)
    pieces = [out.add(ids(chunk)).text for chunk in ("The quick", " brown fox", " jumps")]
    assert "".join(pieces) == "The quick brown fox jumps"
