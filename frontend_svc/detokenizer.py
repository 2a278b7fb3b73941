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

Bytes that never become a character (a model emitting stray UTF-8 lead bytes) would keep
the window growing the same way, each token re-decoding all of them: 4,000 such tokens took
1.7 s of the frontend's event loop. A character still open at the end of the output has at
most 3 bytes, at least one in each of its tokens, so once more than MAX_HELD_TOKENS tokens are
held, the text before the last OPEN_TOKENS of them is final, and goes out with its replacement
characters where decoding splits there (`_final_text_length`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"  # what decoders write for bytes that are not (yet) valid UTF-8
OPEN_TOKENS = 3  # the most tokens a character still open at the end can span (3 bytes)
MAX_HELD_TOKENS = 8  # held past this many, the text before the last OPEN_TOKENS is final


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
            end = max(len(new_text.rstrip(REPLACEMENT_CHAR)), start)
            final = self._final_text_length(new_text)
            if final is None:
                self.emitted = end - len(prefix_text)
            else:  # the window moves on to the tokens that may still be open
                end = max(end, final)
                self.prefix_offset = self.read_offset
                self.read_offset = len(self.token_ids) - OPEN_TOKENS
                self.emitted = end - final
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

    def _final_text_length(self, new_text: str) -> int | None:
        """Where more than MAX_HELD_TOKENS tokens are held: how much of the window's text all
        but the last OPEN_TOKENS tokens give. In UTF-8 that text is final, replacement
        characters and all: no character can still be open that far back. Decoders that
        decode a run of byte tokens as a whole (SentencePiece's byte fallback: one replacement
        character a byte where the run is not valid UTF-8) are not local like that, so the
        text must also split there in the window as it will be once moved on: both windows'
        parts decoded apart give the window's text. None where fewer are held or either
        split differs (the next token tries again, one further on)."""
        if len(self.token_ids) - self.read_offset <= MAX_HELD_TOKENS:
            return None
        split = len(self.token_ids) - OPEN_TOKENS
        skip = self.skip_special_tokens
        decode = self.decoder.decode
        head = decode(self.token_ids[self.prefix_offset : split], skip)
        tail = decode(self.token_ids[split:], skip)
        if new_text != head + tail:
            return None
        if self.read_offset != self.prefix_offset:  # else the moved window is this one
            moved = self.token_ids[self.read_offset :]
            if decode(moved, skip) != decode(moved[: split - self.read_offset], skip) + tail:
                return None
        return len(head)

    def _decode_window(self) -> tuple[str, str]:
        skip = self.skip_special_tokens
        window = self.token_ids[self.prefix_offset :]
        prefix_text = self.decoder.decode(window[: self.read_offset - self.prefix_offset], skip)
        return prefix_text, self.decoder.decode(window, skip)
