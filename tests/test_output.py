"""Output assembly: EOS, length, stop strings, and safe text deltas."""
from __future__ import annotations

from specdec.weights import tiny
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
    # The ids cover the text and nothing wholly inside the stop string.
    assert TOK.decode(out.token_ids) == "Hello "
    assert first.token_ids + second.token_ids == out.token_ids


def covers(token_ids: list[int], text: str) -> bool:
    """The rule: the fewest tokens whose decoded text covers `text`."""
    decoded = TOK.decode(token_ids)
    return decoded.startswith(text) and (not token_ids or len(TOK.decode(token_ids[:-1])) < len(text))


def test_a_stop_string_in_the_first_token_leaves_no_text_and_no_ids():
    first = TOK.encode(" v")
    assert len(first) == 1  # the probe's case: one token that is the stop string
    out = OutputAccumulator(TOK, EOS, 100, stop=[" v"])
    delta = out.add(first + ids(" more"))
    assert delta.finish_reason == FinishReason.STOP and delta.text == "" and delta.token_ids == []


def test_a_token_straddling_the_stop_string_is_kept_and_covers_the_text():
    # Stop strings that begin inside a token, at every offset of a word.
    text = "Hello world again"
    tokens = ids(text)
    for cut in range(1, len(text)):
        stop = text[cut:]
        out = OutputAccumulator(TOK, EOS, 100, stop=[stop])
        delta = out.add(tokens)
        assert delta.finish_reason == FinishReason.STOP and delta.text == text[:cut], stop
        assert covers(delta.token_ids, delta.text), (stop, delta.token_ids)


def test_streamed_ids_follow_the_text_they_cover():
    text = "The quick brown fox jumps over the lazy dog"
    tokens = ids(text)
    for stop in ("lazy", "fox j", "e q", "dog"):
        out = OutputAccumulator(TOK, EOS, 100, stop=[stop])
        sent_text, sent_ids = "", []
        for token in tokens:
            delta = out.add([token])
            sent_text += delta.text
            sent_ids += delta.token_ids
            assert covers(sent_ids, sent_text), (stop, sent_text, sent_ids)  # after every message
            if delta.finish_reason is not None:
                break
        assert sent_text == text[:text.index(stop)] and covers(sent_ids, sent_text), stop


def test_deltas_concatenate_to_the_whole_text():
    out = OutputAccumulator(TOK, EOS, 100)
    pieces = [out.add(ids(chunk)).text for chunk in ("The quick", " brown fox", " jumps")]
    assert "".join(pieces) == "The quick brown fox jumps"
