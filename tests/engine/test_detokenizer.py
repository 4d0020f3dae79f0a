"""Incremental detokenisation and stop strings, on SmolLM2's real tokenizer."""

import pytest

from jaxllm.engine.detokenizer import IncrementalDetokenizer
from jaxllm.loading import load_tokenizer


@pytest.fixture(scope="module")
def tok(smollm2_path):
    return load_tokenizer(smollm2_path)


def feed(tok, text, stop=(), include=False):
    detok = IncrementalDetokenizer(tok, tok.encode("Hi"), skip_special_tokens=True, stop=stop,
                                   include_stop_str_in_output=include)
    visible, hit = [], None
    for token in tok.encode(text):
        hit = detok.add_token(token)
        visible.append(detok.visible_text(finished=hit is not None))
        if hit:
            break
    return detok.text, visible, hit


def test_incremental_text_equals_full_decode_and_never_splits_characters(tok):
    text = "Grüße, 東京タワー! Emoji: 🙂👍🏽 ∑x² — done."
    final, visible, _ = feed(tok, text)
    assert final == text
    assert all("\ufffd" not in v for v in visible)
    assert all(text.startswith(v) for v in visible)


@pytest.mark.parametrize(("stop", "include", "expected"), [
    (("\n\n",), False, "First line.\nSecond"),
    (("Second",), False, "First line.\n"),
    (("Second",), True, "First line.\nSecond"),
    (("ne.\nSe", "xyz"), False, "First li"),
])
def test_stop_strings_cut_exactly(tok, stop, include, expected):
    final, visible, hit = feed(tok, "First line.\nSecond\n\nThird part", stop=stop, include=include)
    assert hit in stop
    assert final == expected
    # While streaming, no prefix of the stop string ever showed beyond the cut.
    assert all(expected.startswith(v) or v == expected for v in visible)


def test_stop_string_spanning_tokens_is_not_leaked(tok):
    _, visible, hit = feed(tok, "The answer is STOPWORD and more", stop=("STOPWORD",))
    assert hit == "STOPWORD"
    assert all("STOP" not in v for v in visible)
