"""One choice's output as it streams in: token ids and logprobs from its engine request, text
through the incremental detokenizer and the stop-string matcher, and how it finished."""

from __future__ import annotations

from frontend_svc.detokenizer import Decoder, IncrementalDetokenizer
from frontend_svc.messages import (
    ChoiceDelta,
    EngineOutput,
    FinishReason,
    SamplingOptions,
    TokenLogprobs,
)
from frontend_svc.stop_strings import StopStringMatcher


class ChoiceState:
    """Tokens go in one at a time, so a stop string cuts the token ids at the token that
    completed it even when the engine sent several tokens in one message."""

    def __init__(self, index: int, decoder: Decoder, sampling: SamplingOptions) -> None:
        self.index = index
        self.detokenizer = IncrementalDetokenizer(decoder, sampling.skip_special_tokens)
        self.stop_matcher = StopStringMatcher(sampling.stop, sampling.include_stop_str_in_output)
        self.num_tokens = 0
        self.num_cached_tokens = 0
        self.finish_reason: FinishReason | None = None
        self.stop_reason: str | int | None = None
        self.pending = ChoiceDelta(index=index)

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, output: EngineOutput) -> bool:
        """Apply one engine message. True when a stop string ended the choice here: the
        engine request is still running and must be aborted."""
        if self.is_finished:
            return False
        self.num_cached_tokens = max(self.num_cached_tokens, output.num_cached_tokens)
        logprobs: list[TokenLogprobs | None] = list(output.new_logprobs)
        logprobs += [None] * (len(output.new_token_ids) - len(logprobs))
        for token_id, token_logprobs in zip(output.new_token_ids, logprobs, strict=True):
            self._append_token(token_id, token_logprobs)
            if self._match_stop(self.detokenizer.add(token_id)):
                return True
        if output.finish_reason is not None:
            self._finish_from_engine(output.finish_reason, output.stop_token_id)
        return False

    def take_delta(self) -> ChoiceDelta | None:
        """What accumulated since the previous call, or None if nothing did."""
        delta = self.pending
        if delta.is_empty:
            return None
        self.pending = ChoiceDelta(index=self.index)
        return delta

    def _append_token(self, token_id: int, logprobs: TokenLogprobs | None) -> None:
        self.num_tokens += 1
        self.pending.token_ids.append(token_id)
        if logprobs is not None:
            self.pending.logprobs.append(logprobs)

    def _match_stop(self, text: str) -> bool:
        released, stop = self.stop_matcher.feed(text)
        self.pending.text += released
        if stop is None:
            return False
        self._set_finished(FinishReason.STOP, stop)
        return True

    def _finish_from_engine(self, reason: FinishReason, stop_token_id: int | None) -> None:
        # The output is complete: text held back as a possible partial character or stop
        # string is final now (and may still complete a stop string).
        if self._match_stop(self.detokenizer.flush()):
            return
        self.pending.text += self.stop_matcher.flush()
        self._set_finished(reason, stop_token_id)

    def _set_finished(self, reason: FinishReason, stop_reason: str | int | None) -> None:
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.pending.finish_reason = reason
        self.pending.stop_reason = stop_reason
