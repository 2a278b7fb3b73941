"""One constrained request's grammar: a compile future, then a matcher that follows its tokens."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any


class StructuredRequestState:
    def __init__(self, grammar: Future[Any]) -> None:
        self._grammar = grammar
        self._matcher: Any = None
        # Why the step left no token to draw (set with the step's bitmask), or None.
        self.dead_end: str | None = None

    def is_ready(self) -> bool:
        return self._grammar.done()

    @property
    def error(self) -> str | None:
        """Why the grammar could not be compiled, once that is known."""
        if not self._grammar.done() or self._grammar.exception() is None:
            return None
        return f"grammar compilation failed: {self._grammar.exception()}"

    @property
    def matcher(self) -> Any:
        if self._matcher is None:
            import xgrammar as xgr

            self._matcher = xgr.GrammarMatcher(self._grammar.result())
        return self._matcher

    def accept(self, token_id: int) -> bool:
        """Advance with a sampled token; False if the grammar forbids it."""
        return bool(self.matcher.accept_token(token_id))

    @property
    def is_terminated(self) -> bool:
        return bool(self.matcher.is_terminated())

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)
