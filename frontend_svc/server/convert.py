"""frontend.v1 protobuf <-> the frontend's messages, for the servicer: the only place that
knows both. Structure only; the checks live in frontend_svc.validation."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

from frontend_svc.messages import (
    ChatMessage,
    ChoiceDelta,
    GenerationRequest,
    GenerationUpdate,
    SamplingOptions,
    TokenLogprobs,
)
from frontend_svc.service import ServiceInfo
from shared.frontend_protos import frontend_pb2 as pb
from shared.sampling_fields import (
    OPTIONAL_SAMPLING_FIELDS,
    PLAIN_SAMPLING_FIELDS,
    OptionalSamplingField,
)

_OPTIONAL_FIELDS: tuple[Literal["max_tokens"] | OptionalSamplingField, ...] = (
    "max_tokens",
    *OPTIONAL_SAMPLING_FIELDS,
)
_PLAIN_FIELDS = (*PLAIN_SAMPLING_FIELDS, "include_stop_str_in_output")


def to_generation_request(request: pb.GenerateRequest) -> GenerationRequest:
    return GenerationRequest(
        request_id=request.request_id,
        prompt=request.prompt if request.HasField("prompt") else None,
        # Repeated fields cannot be told unset from empty: empty means not given.
        prompt_token_ids=tuple(request.prompt_token_ids) or None,
        messages=to_chat_messages(request.messages) or None,
        sampling=to_sampling_options(request.sampling_params),
        priority=request.priority,
    )


def to_chat_messages(messages: Iterable[pb.ChatMessage]) -> tuple[ChatMessage, ...]:
    return tuple(ChatMessage(role=m.role, content=m.content) for m in messages)


def to_sampling_options(params: pb.SamplingParams) -> SamplingOptions:
    options: dict[str, object] = {name: getattr(params, name) for name in _PLAIN_FIELDS}
    options.update(
        {name: getattr(params, name) for name in _OPTIONAL_FIELDS if params.HasField(name)}
    )
    return SamplingOptions(
        **options,  # type: ignore[arg-type]
        stop_token_ids=tuple(params.stop_token_ids),
        logit_bias=tuple(params.logit_bias.items()),
        allowed_token_ids=tuple(params.allowed_token_ids),
        bad_words=tuple(params.bad_words),
        n=params.n if params.HasField("n") else 1,
        stop=tuple(params.stop),
        skip_special_tokens=(
            params.skip_special_tokens if params.HasField("skip_special_tokens") else True
        ),
        truncate_prompt_tokens=(
            params.truncate_prompt_tokens if params.HasField("truncate_prompt_tokens") else None
        ),
        **_constraint_options(params),
    )


def _constraint_options(params: pb.SamplingParams) -> dict[str, Any]:
    kind = params.WhichOneof("constraint")
    if kind is None:
        return {}
    if kind == "choice":
        return {"choice": tuple(params.choice.choices)}
    return {kind: getattr(params, kind)}


def to_generate_response(update: GenerationUpdate) -> pb.GenerateResponse:
    response = pb.GenerateResponse(
        request_id=update.request_id, choices=[_to_choice(c) for c in update.choices]
    )
    if update.usage is not None:
        response.usage.CopyFrom(
            pb.Usage(
                prompt_tokens=update.usage.prompt_tokens,
                completion_tokens=update.usage.completion_tokens,
                cached_tokens=update.usage.cached_tokens,
            )
        )
    if update.prompt_logprobs:
        response.prompt_logprobs.extend(_to_token_logprobs(lp) for lp in update.prompt_logprobs)
    return response


def _to_choice(delta: ChoiceDelta) -> pb.Choice:
    choice = pb.Choice(
        index=delta.index,
        text=delta.text,
        token_ids=delta.token_ids,
        logprobs=[_to_token_logprobs(lp) for lp in delta.logprobs],
        finish_reason=int(delta.finish_reason or pb.FINISH_REASON_UNSPECIFIED),  # type: ignore[arg-type]
    )
    if isinstance(delta.stop_reason, str):
        choice.stop_string = delta.stop_reason
    elif isinstance(delta.stop_reason, int):
        choice.stop_token_id = delta.stop_reason
    return choice


def _to_token_logprobs(logprobs: TokenLogprobs) -> pb.TokenLogprobs:
    return pb.TokenLogprobs(
        token_id=logprobs.token_id,
        logprob=logprobs.logprob,
        rank=logprobs.rank,
        top_token_ids=logprobs.top_token_ids,
        top_logprobs=logprobs.top_logprobs,
    )


def to_model_info_response(info: ServiceInfo) -> pb.GetModelInfoResponse:
    return pb.GetModelInfoResponse(
        model_name=info.model.model_name,
        max_model_len=info.model.max_model_len,
        vocab_size=info.model.vocab_size,
        eos_token_ids=info.model.eos_token_ids,
        has_chat_template=info.has_chat_template,
        num_engines=info.num_engines,
        num_healthy_engines=info.num_healthy_engines,
        architecture=info.model.architecture,
    )
