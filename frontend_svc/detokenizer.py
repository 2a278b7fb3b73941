"""Incremental detokenization: text deltas, token by token, that never end inside a UTF-8
character and whose concatenation equals decoding the whole output at once.

Decoding one token at a time is wrong twice over: a character may span several byte-level
tokens, and decoders treat the start of a sequence specially (SentencePiece drops a leading
space). So each step decodes a small window twice, with and without the new tokens, and
emits the difference; the window starts at the last point where text was emitted, which is
on a character boundary. Text before a character the tokens have only begun is final, and
goes out at once: a stop string that ends there ends at the token that completed it.

Special tokens that decoding skips never enter the window: the tokenizer drops them before
its decoder runs, so the text is the same, and a long run of them (a model repeating its end
token under ignore_eos) costs a set lookup each instead of re-decoding a growing window.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"  # what decoders write for bytes that are not (yet) valid UTF-8


class Decoder(Protocol):
    # The ids decode(..., skip_special_tokens=True) leaves out.
    special_token_ids: frozenset[int]

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool) -> str: ...


class IncrementalDetokenizer:
    """One choice's output text. `add` returns the text that became final with a token;
    `flush` returns what is left once the output is complete."""

    def __init__(self, decoder: Decoder, skip_special_tokens: bool = True) -> None:
        self.decoder = decoder
        self.skip_special_tokens = skip_special_tokens
        self.skipped_ids = decoder.special_token_ids if skip_special_tokens else frozenset()
        self.token_ids: list[int] = []  # the output's, less those decoding skips
        # token_ids[prefix_offset:read_offset] decode to the text emitted last; tokens from
        # read_offset on have not been emitted yet, except the first `emitted` characters
        # of their text: those before a character they have only begun.
        self.prefix_offset = 0
        self.read_offset = 0
        self.emitted = 0

    def add(self, token_id: int) -> str:
        if token_id in self.skipped_ids:
            return ""
        self.token_ids.append(token_id)
        prefix_text, new_text = self._decode_window()
        if len(new_text) <= len(prefix_text):
            return ""
        start = len(prefix_text) + self.emitted
        # A trailing replacement character may be the first bytes of a character the next
        # token completes: hold it back until then (or until flush). The text before it is
        # final already, so a stop string ending there ends at this token.
        if new_text.endswith(REPLACEMENT_CHAR):
            end = len(new_text.rstrip(REPLACEMENT_CHAR))
            if end <= start:
                return ""
            self.emitted = end - len(prefix_text)
            return new_text[start:end]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        self.emitted = 0
        return new_text[start:]

    def flush(self) -> str:
        """The held-back rest, as decoding the whole output gives it (replacement characters
        included when the output really ends inside a character)."""
        prefix_text, new_text = self._decode_window()
        start = len(prefix_text) + self.emitted
        self.prefix_offset = self.read_offset = len(self.token_ids)
        self.emitted = 0
        return new_text[start:]

    def _decode_window(self) -> tuple[str, str]:
        skip = self.skip_special_tokens
        window = self.token_ids[self.prefix_offset :]
        prefix_text = self.decoder.decode(window[: self.read_offset - self.prefix_offset], skip)
        return prefix_text, self.decoder.decode(window, skip)
