"""One request's engine outputs as VllmEngine Generate responses, in the shape vLLM's own
servicer sends and smg reads.

Streamed (`stream: true`): a chunk per output that brings tokens (the new token ids, their
logprobs, the count of new tokens; the first also the prompt logprobs, when asked), then,
when the request finishes, one complete message with every output token, the finish reason
as a string and the totals. Not streamed: the complete message only."""

from __future__ import annotations

from smg_grpc_proto.generated import vllm_engine_pb2 as vpb

from engine_svc.messages import EngineCoreOutput, FinishReason, TokenLogprobs
from shared.errors import InvalidRequestError

FINISH_REASONS = {
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.ABORT: "abort",
}


class EngineRequestError(RuntimeError):
    """The engine finished the request with FINISH_REASON_ERROR (INTERNAL to the caller:
    a gateway must not mistake it for an empty completion)."""


class GenerateResponses:
    """One output sequence's responses; `index` is its place among a request's n (vLLM's
    chunk and complete `index`)."""

    def __init__(self, prompt_token_ids: list[int], stream: bool, index: int = 0) -> None:
        self.prompt_token_ids = prompt_token_ids
        self.num_prompt_tokens = len(prompt_token_ids)
        self.stream = stream
        self.index = index
        self.output_ids: list[int] = []
        self.logprobs: list[TokenLogprobs] = []
        self.input_logprobs: vpb.InputLogProbs | None = None
        self.num_cached_tokens = 0

    def on_output(self, output: EngineCoreOutput) -> list[vpb.GenerateResponse]:
        """The responses to send for one output (merged outputs are fine: tokens append)."""
        if output.invalid_field is not None:
            raise InvalidRequestError(output.invalid_field, output.error or "cannot be served")
        if output.finish_reason == FinishReason.ERROR:
            raise EngineRequestError(f"the request failed in the engine: {output.error}")
        self.output_ids.extend(output.new_token_ids)
        self.logprobs.extend(output.new_logprobs or ())
        self.num_cached_tokens = max(self.num_cached_tokens, output.num_cached_tokens)
        if output.prompt_logprobs is not None:
            self.input_logprobs = to_input_logprobs(self.prompt_token_ids, output.prompt_logprobs)
        responses = []
        if self.stream and output.new_token_ids:
            responses.append(vpb.GenerateResponse(chunk=self._chunk(output)))
        if output.finish_reason is not None:
            complete = self._complete(output.finish_reason, output.stop_reason)
            responses.append(vpb.GenerateResponse(complete=complete))
        return responses

    def _chunk(self, output: EngineCoreOutput) -> vpb.GenerateStreamChunk:
        chunk = vpb.GenerateStreamChunk(
            token_ids=output.new_token_ids,
            prompt_tokens=self.num_prompt_tokens,
            completion_tokens=len(output.new_token_ids),  # this chunk's, as vLLM counts
            cached_tokens=self.num_cached_tokens,
            index=self.index,
        )
        if output.new_logprobs:
            chunk.output_logprobs.CopyFrom(to_output_logprobs(output.new_logprobs))
        if output.prompt_logprobs is not None and self.input_logprobs is not None:
            chunk.input_logprobs.CopyFrom(self.input_logprobs)
        return chunk

    def _complete(self, reason: FinishReason, stop_token_id: int | None) -> vpb.GenerateComplete:
        complete = vpb.GenerateComplete(
            output_ids=self.output_ids,
            finish_reason=FINISH_REASONS[reason],
            prompt_tokens=self.num_prompt_tokens,
            completion_tokens=len(self.output_ids),
            cached_tokens=self.num_cached_tokens,
            index=self.index,
        )
        if self.logprobs:
            complete.output_logprobs.CopyFrom(to_output_logprobs(self.logprobs))
        if self.input_logprobs is not None:
            complete.input_logprobs.CopyFrom(self.input_logprobs)
        if stop_token_id is not None:
            complete.matched_token_id = stop_token_id
        return complete


def to_output_logprobs(logprobs: list[TokenLogprobs]) -> vpb.OutputLogProbs:
    """Per token: the sampled token's logprob, and its top alternatives, most likely first."""
    return vpb.OutputLogProbs(
        token_logprobs=[lp.logprob for lp in logprobs],
        token_ids=[lp.token_id for lp in logprobs],
        top_logprobs=[_top(lp) for lp in logprobs],
    )


def to_input_logprobs(
    prompt_token_ids: list[int], prompt_logprobs: list[TokenLogprobs]
) -> vpb.InputLogProbs:
    """Per prompt token, as vLLM's servicer sends them: the first has no logprob (an unset
    value) and no alternatives; each other its own logprob and its top alternatives."""
    return vpb.InputLogProbs(
        token_logprobs=[vpb.InputTokenLogProb()]
        + [vpb.InputTokenLogProb(value=lp.logprob) for lp in prompt_logprobs],
        token_ids=prompt_token_ids,
        top_logprobs=[vpb.TopLogProbs()] + [_top(lp) for lp in prompt_logprobs],
    )


def _top(logprobs: TokenLogprobs) -> vpb.TopLogProbs:
    return vpb.TopLogProbs(values=logprobs.top_logprobs, token_ids=logprobs.top_token_ids)
