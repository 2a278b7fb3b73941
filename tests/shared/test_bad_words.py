"""Bad words to token sequences, as vLLM tokenizes them (the default model's tokenizer)."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from shared.bad_words import bad_words_token_ids
from shared.errors import InvalidRequestError


def test_a_word_is_banned_at_the_start_and_after_a_space(default_model_dir: Path) -> None:
    hf = AutoTokenizer.from_pretrained(default_model_dir)

    def encode(text: str) -> tuple[int, ...]:
        return tuple(hf.encode(text, add_special_tokens=False))

    # "hello" and " hello" are one token each, different ones: both banned.
    assert bad_words_token_ids(encode, ["hello"]) == (encode("hello"), encode(" hello"))
    assert encode("hello") != encode(" hello") and len(encode(" hello")) == 1
    # A leading space is the word's own no more: the same two.
    assert bad_words_token_ids(encode, ["  hello"]) == (encode("hello"), encode(" hello"))
    # After a space the phrase tokenizes to fewer tokens (2 against 3): only as it begins a
    # text, as vLLM keeps it.
    phrase = "quantum entanglement"
    assert len(encode(" " + phrase)) != len(encode(phrase))
    assert bad_words_token_ids(encode, [phrase]) == (encode(phrase),)
    with pytest.raises(InvalidRequestError) as raised:
        bad_words_token_ids(encode, ["ok", "   "], "sampling_params.bad_words")
    assert raised.value.field == "sampling_params.bad_words"
