"""Bad words as the engine takes them: token id sequences (vLLM's rule for bad_words), for
the frontend and the offline API, which hold the tokenizer.

A word is tokenized as it would begin a text and, where the tokenizer gives a word-initial
token of the same length after a space (" word" as one token where "word" is another), as
it would follow a space in mid-text; the engine bans the last token of each sequence
wherever the output ends with the rest of it."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from shared.errors import InvalidRequestError

# Text to token ids, without special tokens.
Encode = Callable[[str], Sequence[int]]


def bad_words_token_ids(
    encode: Encode, words: Sequence[str], field: str = "bad_words"
) -> tuple[tuple[int, ...], ...]:
    """Raises InvalidRequestError naming `field` for a word with no tokens."""
    sequences: list[tuple[int, ...]] = []
    for word in words:
        bare = tuple(encode(word.lstrip()))
        if not bare:  # spaces alone, or characters the tokenizer's normalizer drops
            raise InvalidRequestError(field, f"{word!r} has no tokens")
        sequences.append(bare)
        spaced = tuple(encode(" " + word.lstrip()))
        if len(spaced) == len(bare) and spaced[0] != bare[0]:
            sequences.append(spaced)
    return tuple(sequences)
