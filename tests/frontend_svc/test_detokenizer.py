"""Incremental detokenization: joined deltas equal decoding the whole output, and no delta
ever ends inside a character, whatever the tokens (random ones included)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from frontend_svc.detokenizer import MAX_HELD_TOKENS, REPLACEMENT_CHAR, IncrementalDetokenizer
from frontend_svc.tokenizer import Tokenizer

VOCAB_SIZE = 49152
SPECIAL_IDS = list(range(0, 20))  # <|endoftext|>, <|im_start|>, <|im_end|>, <file_sep>, ...


def stream(tokenizer: Tokenizer, token_ids: list[int], skip_special_tokens: bool) -> list[str]:
    detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens)
    deltas = [detokenizer.add(token_id) for token_id in token_ids]
    return [*deltas, detokenizer.flush()]


@pytest.mark.parametrize(
    "text",
    [
        "Hello, world! How are you today?",
        "Emoji: 😀🎉👍🏽 and flags 🇫🇷🇯🇵, family 👨‍👩‍👧",
        "中文测试：你好，世界。日本語のテキスト、한국어 텍스트",  # noqa: RUF001
        "Mixed: café naïve Ωmega — “quotes” … tabs\tand\nnewlines  double  spaces",
        "def f(x):\n    return {'a': [1, 2, 3]}  # code",
    ],
)
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_text_round_trips_with_no_broken_characters(
    tokenizer: Tokenizer, text: str, skip_special_tokens: bool
) -> None:
    deltas = stream(tokenizer, tokenizer.encode(text), skip_special_tokens)
    assert "".join(deltas) == text
    assert not any(REPLACEMENT_CHAR in delta for delta in deltas)


def test_a_character_split_over_tokens_is_held_until_complete(tokenizer: Tokenizer) -> None:
    token_ids = tokenizer.encode("世")
    assert len(token_ids) > 1  # byte-level pieces
    deltas = stream(tokenizer, token_ids, True)
    assert deltas[:-2] == [""] * (len(token_ids) - 1)
    assert deltas[-2:] == ["世", ""]


def test_text_before_a_begun_character_is_not_held_with_it(tokenizer: Tokenizer) -> None:
    # 40303 is a space and the first bytes of the emoji: the space is final at once.
    token_ids = tokenizer.encode("a 😀b")
    assert token_ids == [81, 40303, 218, 82]
    assert stream(tokenizer, token_ids, True) == ["a", " ", "😀", "b", ""]


def test_special_tokens_follow_skip_special_tokens(tokenizer: Tokenizer) -> None:
    token_ids = [*tokenizer.encode("Hi"), 2]  # 2 is <|im_end|>, the EOS
    assert "".join(stream(tokenizer, token_ids, True)) == "Hi"
    assert "".join(stream(tokenizer, token_ids, False)) == "Hi<|im_end|>"


def test_an_output_ending_inside_a_character_flushes_what_decode_gives(
    tokenizer: Tokenizer,
) -> None:
    token_ids = tokenizer.encode("a世")[:-1]
    deltas = stream(tokenizer, token_ids, True)
    assert "".join(deltas) == tokenizer.decode(token_ids, True)
    assert deltas[-1].endswith(REPLACEMENT_CHAR)  # only the flush may


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), skip_special_tokens=st.booleans())
def test_joined_deltas_equal_decoding_the_whole_output(
    tokenizer: Tokenizer, byte_token_ids: list[int], data: st.DataObject, skip_special_tokens: bool
) -> None:
    # Byte pieces of multi-byte characters and special tokens are the hard cases: draw them
    # often, mixed with anything from the vocabulary.
    token = st.one_of(
        st.integers(0, VOCAB_SIZE - 1),
        st.sampled_from(byte_token_ids),
        st.sampled_from(SPECIAL_IDS),
    )
    # Runs of byte pieces longer than MAX_HELD_TOKENS: the window moves on inside them.
    run = st.lists(st.sampled_from(byte_token_ids), min_size=1, max_size=3 * MAX_HELD_TOKENS)
    pieces = data.draw(st.lists(st.one_of(token.map(lambda t: [t]), run), max_size=24))
    token_ids = [token_id for piece in pieces for token_id in piece]
    deltas = stream(tokenizer, token_ids, skip_special_tokens)
    whole = tokenizer.decode(token_ids, skip_special_tokens)
    assert "".join(deltas) == whole
    # Mid-stream, nothing that later changes: never the first bytes of a character the next
    # tokens complete (as a replacement character), so every joined prefix is the whole's.
    emitted = ""
    for delta in deltas:
        emitted += delta
        assert whole.startswith(emitted)


class CountingDecoder:
    """The tokenizer, counting the token ids each decode is given."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.special_token_ids = tokenizer.special_token_ids
        self.tokens_decoded = 0

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool) -> str:
        self.tokens_decoded += len(token_ids)
        return self.tokenizer.decode(token_ids, skip_special_tokens)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_a_long_run_of_special_tokens_costs_no_more_than_other_tokens(
    tokenizer: Tokenizer, skip_special_tokens: bool
) -> None:
    # A model repeating its end token under ignore_eos: with skip_special_tokens, each used
    # to re-decode a window that grew with every one of them (quadratic in the run).
    token_ids = [*tokenizer.encode("Hi"), *[2] * 2000, *tokenizer.encode(" there")]
    decoder = CountingDecoder(tokenizer)
    detokenizer = IncrementalDetokenizer(decoder, skip_special_tokens)
    text = "".join([*(detokenizer.add(t) for t in token_ids), detokenizer.flush()])
    assert text == tokenizer.decode(token_ids, skip_special_tokens)
    assert decoder.tokens_decoded <= 8 * len(token_ids)


def test_bytes_that_never_make_a_character_cost_no_more_than_other_tokens(
    tokenizer: Tokenizer,
) -> None:
    # A model emitting a UTF-8 lead byte over and over (174 decodes to the byte 0xE3): no
    # character ever completes, and each token used to re-decode all of them.
    assert tokenizer.decode([174], False) == REPLACEMENT_CHAR
    token_ids = [*tokenizer.encode("Hi"), *[174] * 2000, *tokenizer.encode(" 世 there")]
    decoder = CountingDecoder(tokenizer)
    detokenizer = IncrementalDetokenizer(decoder)
    deltas = []
    for token_id in token_ids:
        deltas.append(detokenizer.add(token_id))
        assert len(detokenizer.token_ids) - detokenizer.prefix_offset <= 3 * MAX_HELD_TOKENS
    text = "".join([*deltas, detokenizer.flush()])
    assert text == tokenizer.decode(token_ids, True)
    assert decoder.tokens_decoded <= 32 * len(token_ids)  # about 21; 1,000 before the bound
    # The replacement characters go out as they become final, not all at the end.
    assert sum(delta.count(REPLACEMENT_CHAR) for delta in deltas[:1000]) >= 900


def test_a_character_begun_after_a_long_run_of_stray_bytes_is_held_until_complete(
    tokenizer: Tokenizer,
) -> None:
    character = tokenizer.encode("世")  # three byte pieces
    token_ids = [*[174] * (3 * MAX_HELD_TOKENS), *character]
    deltas = stream(tokenizer, token_ids, True)
    assert deltas[-2].endswith("世") and not any("世" in d for d in deltas[:-2])
    assert "".join(deltas) == tokenizer.decode(token_ids, True)


@pytest.mark.parametrize("stray", range(2 * MAX_HELD_TOKENS))
def test_stray_bytes_that_decode_together_are_never_split(tokenizer: Tokenizer, stray: int) -> None:
    # 174 then 219 (the bytes 0xE3 0x81: a character begun, then broken) decode together to
    # one replacement character, apart to two: wherever the window would move on, the text
    # out so far is always the start of the whole output's.
    assert tokenizer.decode([174, 219], False) == REPLACEMENT_CHAR
    token_ids = [*[174] * (MAX_HELD_TOKENS + stray), 174, 219, *[174] * (3 * MAX_HELD_TOKENS)]
    deltas = stream(tokenizer, token_ids, True)
    whole = tokenizer.decode(token_ids, True)
    for end in range(1, len(deltas) + 1):
        assert whole.startswith("".join(deltas[:end]))
    assert "".join(deltas) == whole


@pytest.mark.parametrize("character", ["世", "😀"])
@pytest.mark.parametrize("stray", range(2 * MAX_HELD_TOKENS))
def test_a_character_after_stray_bytes_is_never_released_half_done(
    tokenizer: Tokenizer, character: str, stray: int
) -> None:
    # Its bytes one token each (the longest a character can span), after any number of
    # stray lead bytes: wherever the window moves on, never inside the character.
    pieces = [byte_token(tokenizer, byte) for byte in character.encode()]
    token_ids = [*[174] * stray, *pieces, *tokenizer.encode("a")]
    deltas = stream(tokenizer, token_ids, True)
    whole = tokenizer.decode(token_ids, True)
    assert whole.endswith(character + "a")
    for end in range(1, len(deltas) + 1):
        assert whole.startswith("".join(deltas[:end]))


class ByteRunDecoder:
    """SentencePiece's byte fallback, in small: ids below 256 are bytes, a run of them
    decoded as a whole, one replacement character a byte where the run is not valid UTF-8;
    256 and up are the letters a, b, ... Such decoding is not local: a byte can change the
    text of every byte before it in its run."""

    special_token_ids: frozenset[int] = frozenset()

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool) -> str:
        text, run = [], bytearray()
        for token_id in [*token_ids, -1]:
            if 0 <= token_id < 256:
                run.append(token_id)
                continue
            try:
                text.append(run.decode())
            except UnicodeDecodeError:
                text.append(REPLACEMENT_CHAR * len(run))
            run.clear()
            if token_id >= 256:
                text.append(chr(ord("a") + token_id - 256))
        return "".join(text)


def test_the_window_moves_on_only_where_the_moved_window_decodes_the_same() -> None:
    # A run of bytes invalid from its first: all replacement characters, one a byte, the
    # window's and the whole's alike; but the window moved on past the first byte would
    # decode its valid 3-byte character (E4 B8 96) as a character.
    token_ids = [0x96, *[0x41] * 7, 0xE4, 0xB8, 0x96, *[0x41] * 3, 0xE3]
    decoder = ByteRunDecoder()
    detokenizer = IncrementalDetokenizer(decoder)
    text = "".join([*(detokenizer.add(t) for t in token_ids), detokenizer.flush()])
    assert text == decoder.decode(token_ids, True) == REPLACEMENT_CHAR * len(token_ids)


def byte_token(tokenizer: Tokenizer, byte: int) -> int:
    """The byte-level BPE token of one byte (GPT-2's map of bytes to printable characters)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    character = chr(byte) if byte in printable else chr(256 + others.index(byte))
    token_id = tokenizer.backend.token_to_id(character)
    assert token_id is not None, byte
    return token_id


def test_the_special_ids_are_those_decoding_skips(tokenizer: Tokenizer) -> None:
    assert tokenizer.special_token_ids == frozenset(range(17))  # <|endoftext|> .. <empty_output>
    for token_id in range(tokenizer.vocab_size):
        skipped = tokenizer.decode([token_id], skip_special_tokens=True) == ""
        kept = tokenizer.decode([token_id], skip_special_tokens=False) != ""
        assert (skipped and kept) == (token_id in tokenizer.special_token_ids), token_id
