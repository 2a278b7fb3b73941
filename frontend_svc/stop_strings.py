"""Stop strings over streamed text: matched across token (and delta) boundaries, with the tail
that might still grow into a stop string held back, so no text past a stop is ever sent."""

from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    """Feed text deltas in order; `feed` returns the text safe to release and the stop string
    that matched, if one did. The first stop string to be completed wins (the longest, when
    several end at the same character), so the result does not depend on how the text was cut
    into deltas."""

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        self.stop = tuple(s for s in stop if s)
        self.include_stop_str_in_output = include_stop_str_in_output
        self.held = ""
        self.matched: str | None = None

    def feed(self, text: str) -> tuple[str, str | None]:
        if self.matched is not None:
            return "", None
        if not self.stop:
            return text, None
        buffer = self.held + text
        match = self._first_completed(buffer)
        if match is not None:
            start, stop = match
            self.held, self.matched = "", stop
            end = start + len(stop) if self.include_stop_str_in_output else start
            return buffer[:end], stop
        num_held = self._num_chars_to_hold(buffer)
        self.held = buffer[len(buffer) - num_held :]
        return buffer[: len(buffer) - num_held], None

    def flush(self) -> str:
        """The held-back tail, once no more text can come."""
        held, self.held = self.held, ""
        return held

    def _first_completed(self, buffer: str) -> tuple[int, str] | None:
        best: tuple[int, int, str] | None = None  # (end, start, stop string)
        for stop in self.stop:
            start = buffer.find(stop)
            if start == -1:
                continue
            candidate = (start + len(stop), start, stop)
            if best is None or candidate[:2] < best[:2]:
                best = candidate
        return None if best is None else (best[1], best[2])

    def _num_chars_to_hold(self, buffer: str) -> int:
        """The longest tail of `buffer` that a stop string starts with (no stop string is in
        `buffer` whole)."""
        longest = 0
        for stop in self.stop:
            start = max(0, len(buffer) - len(stop) + 1)
            index = buffer.find(stop[0], start)
            while index != -1 and len(buffer) - index > longest:
                if stop.startswith(buffer[index:]):
                    longest = len(buffer) - index
                    break
                index = buffer.find(stop[0], index + 1)
        return longest
