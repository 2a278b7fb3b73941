"""Frontend messages <-> engine.v1 protobuf: the only module that knows both."""

from __future__ import annotations

from frontend_svc.messages import (
    EngineOutput,
    EngineRequest,
    FinishReason,
    ModelInfo,
    SamplingOptions,
    TokenLogprobs,
)
from shared.engine_load import EngineLoad, RankLoad
from shared.protos import engine_pb2 as pb
from shared.sampling_fields import OPTIONAL_SAMPLING_FIELDS, PLAIN_SAMPLING_FIELDS


def to_generate_request(request: EngineRequest) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=request.request_id,
        prompt_token_ids=request.prompt_token_ids,
        sampling_params=to_sampling_params(request.sampling),
        priority=request.priority,
    )


def to_sampling_params(sampling: SamplingOptions) -> pb.SamplingParams:
    params = pb.SamplingParams(
        stop_token_ids=sampling.stop_token_ids,
        logit_bias=dict(sampling.logit_bias),
        allowed_token_ids=sampling.allowed_token_ids,
        bad_words_token_ids=[pb.TokenIds(token_ids=w) for w in sampling.bad_words_token_ids],
    )
    for name in PLAIN_SAMPLING_FIELDS:
        setattr(params, name, getattr(sampling, name))
    # Set only when given, so unset ones keep the engine's defaults.
    for name in ("max_tokens", *OPTIONAL_SAMPLING_FIELDS):
        value = getattr(sampling, name)
        if value is not None:
            setattr(params, name, value)
    _set_constraint(params, sampling)
    return params


# The constraint oneof's members, named alike in SamplingOptions; the first given is sent.
_CONSTRAINTS = ("json_schema", "json_object", "regex", "choice", "grammar", "structural_tag")


def _set_constraint(params: pb.SamplingParams, sampling: SamplingOptions) -> None:
    for kind in _CONSTRAINTS:
        value = getattr(sampling, kind)
        if value is None or value is False:
            continue
        if kind == "choice":
            params.choice.choices.extend(value)
        else:
            setattr(params, kind, value)
        return


def to_engine_output(response: pb.GenerateResponse) -> EngineOutput:
    reason = response.finish_reason
    return EngineOutput(
        new_token_ids=tuple(response.token_ids),
        new_logprobs=tuple(_to_token_logprobs(lp) for lp in response.logprobs),
        # Sent only when asked for, and then at least one (a one-token prompt has none).
        prompt_logprobs=(
            tuple(_to_token_logprobs(lp) for lp in response.prompt_logprobs)
            if response.prompt_logprobs
            else None
        ),
        finish_reason=None if reason == pb.FINISH_REASON_UNSPECIFIED else FinishReason(reason),
        stop_token_id=response.stop_token_id if response.HasField("stop_token_id") else None,
        num_cached_tokens=response.num_cached_tokens,
        error=response.error,
    )


def _to_token_logprobs(logprobs: pb.TokenLogprobs) -> TokenLogprobs:
    return TokenLogprobs(
        token_id=logprobs.token_id,
        logprob=logprobs.logprob,
        rank=logprobs.rank,
        top_token_ids=tuple(logprobs.top_token_ids),
        top_logprobs=tuple(logprobs.top_logprobs),
    )


def to_model_info(response: pb.GetModelInfoResponse) -> ModelInfo:
    return ModelInfo(
        model_name=response.model_name,
        max_model_len=response.max_model_len,
        vocab_size=response.vocab_size,
        eos_token_ids=tuple(response.eos_token_ids),
        architecture=response.architecture,
    )


def to_engine_load(response: pb.GetLoadsResponse) -> EngineLoad:
    return EngineLoad(
        tuple(
            RankLoad(
                rank.num_running,
                rank.num_waiting,
                rank.kv_cache_usage,
                rank.num_free_kv_blocks,
                rank.num_batches_in_flight,
                rank.max_batches_in_flight,
            )
            for rank in response.loads
        )
    )
