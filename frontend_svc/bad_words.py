"""Bad words as the engine takes them: token id sequences (vLLM's rule for bad_words).

A word is tokenized as it would begin a text and, where the tokenizer gives a word-initial
token of the same length after a space (" word" as one token where "word" is another), as
it would follow a space in mid-text; the engine bans the last token of each sequence
wherever the output ends with the rest of it."""

from __future__ import annotations

from collections.abc import Sequence

from frontend_svc.tokenizer import Tokenizer
from shared.errors import InvalidRequestError


def bad_words_token_ids(tokenizer: Tokenizer, words: Sequence[str]) -> tuple[tuple[int, ...], ...]:
    sequences: list[tuple[int, ...]] = []
    for word in words:
        bare = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        if not bare:  # characters the tokenizer's normalizer drops
            raise InvalidRequestError("sampling_params.bad_words", f"{word!r} has no tokens")
        sequences.append(bare)
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if len(spaced) == len(bare) and spaced[0] != bare[0]:
            sequences.append(spaced)
    return tuple(sequences)
