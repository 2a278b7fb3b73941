"""Protobuf <-> engine structs, for the servicer: the only place that knows both."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Iterator, Mapping
from typing import Any

from engine_svc.control_messages import EngineInfo
from engine_svc.messages import EngineCoreOutput, EngineCoreRequest, TokenLogprobs
from engine_svc.sampling_params import SamplingParams
from shared.engine_load import RankLoad
from shared.errors import InvalidRequestError
from shared.protos import engine_pb2 as pb
from shared.sampling_fields import OPTIONAL_SAMPLING_FIELDS, PLAIN_SAMPLING_FIELDS

# Bounds on list and string fields, far below the transport's message limit, so an oversized
# request is refused naming its field rather than by the transport.
MAX_REQUEST_ID_CHARS = 256
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_ALLOWED_TOKEN_IDS = 262_144  # more than any supported model's vocabulary
MAX_BAD_WORDS, MAX_BAD_WORD_TOKENS = 1024, 64
MAX_ABORT_IDS = 10_000


def to_engine_request(request: pb.GenerateRequest) -> EngineCoreRequest:
    request_id = request.request_id or uuid.uuid4().hex
    _check_size("request_id", len(request_id), MAX_REQUEST_ID_CHARS, "characters")
    return EngineCoreRequest(
        request_id=request_id,
        prompt_token_ids=list(request.prompt_token_ids),
        sampling_params=to_sampling_params(request.sampling_params),
        arrival_time=time.monotonic(),
        priority=request.priority,
    )


def to_sampling_params(params: pb.SamplingParams) -> SamplingParams:
    """Unset optional fields keep the engine's defaults; an unset max_tokens means up to the
    model length. The engine client checks the values (engine_svc/admission.py)."""
    _check_size("sampling_params.stop_token_ids", len(params.stop_token_ids), MAX_STOP_TOKEN_IDS)
    options: dict[str, Any] = {name: getattr(params, name) for name in PLAIN_SAMPLING_FIELDS}
    options.update(
        {name: getattr(params, name) for name in OPTIONAL_SAMPLING_FIELDS if params.HasField(name)}
    )
    options["max_tokens"] = params.max_tokens if params.HasField("max_tokens") else None
    options["stop_token_ids"] = list(params.stop_token_ids)
    if params.logit_bias:
        _check_size(
            "sampling_params.logit_bias", len(params.logit_bias), MAX_LOGIT_BIAS_ENTRIES, "entries"
        )
        options["logit_bias"] = dict(params.logit_bias)
    if params.allowed_token_ids:
        _check_size(
            "sampling_params.allowed_token_ids",
            len(params.allowed_token_ids),
            MAX_ALLOWED_TOKEN_IDS,
        )
        options["allowed_token_ids"] = list(params.allowed_token_ids)
    if params.bad_words_token_ids:
        words = params.bad_words_token_ids
        _check_size("sampling_params.bad_words_token_ids", len(words), MAX_BAD_WORDS, "words")
        longest = max(len(word.token_ids) for word in words)
        _check_size(
            "sampling_params.bad_words_token_ids", longest, MAX_BAD_WORD_TOKENS, "tokens a word"
        )
        options["bad_words_token_ids"] = [list(word.token_ids) for word in words]
    options.update(_constraint_options(params))
    # Checked by the engine client that takes the request (engine_svc/admission.py), in this
    # process: a bad value, schema or regex never reaches the engine's busy loop.
    return SamplingParams(**options)


def _constraint_options(params: pb.SamplingParams) -> dict[str, Any]:
    kind = params.WhichOneof("constraint")
    if kind is None:
        return {}
    if kind == "choice":
        return {"choice": list(params.choice.choices)}
    return {kind: getattr(params, kind)}


@contextlib.contextmanager
def proto_field_names(renames: Mapping[str, str] | None = None) -> Iterator[None]:
    """The engine names sampling fields bare (`max_tokens`); a gRPC client knows them as
    `sampling_params.max_tokens`. `renames`: other engine fields a contract names its own way
    (vLLM's `tokenized.input_ids` for `prompt_token_ids`)."""
    try:
        yield
    except InvalidRequestError as error:
        renamed = proto_named(error)
        if renames and error.field in renames:
            renamed = InvalidRequestError(renames[error.field], error.message)
        if renamed is not error:
            raise renamed from error
        raise


def proto_named(error: Exception) -> Exception:
    """`error`, with a sampling field named as the proto names it."""
    if isinstance(error, InvalidRequestError) and error.field in SamplingParams.__struct_fields__:
        return InvalidRequestError(f"sampling_params.{error.field}", error.message)
    return error


def to_abort_ids(request: pb.AbortRequest) -> list[str]:
    _check_size("request_ids", len(request.request_ids), MAX_ABORT_IDS)
    return list(request.request_ids)


def to_max_steps(request: pb.ResumeGenerationRequest) -> int | None:
    """ResumeGeneration's bound on the steps before pausing again; None: unbounded."""
    if not request.HasField("max_steps"):
        return None
    if request.max_steps < 1:
        raise InvalidRequestError("max_steps", "must be at least 1 when set")
    return request.max_steps


def to_generate_response(output: EngineCoreOutput) -> pb.GenerateResponse:
    if output.invalid_field is not None:  # the request's own input: INVALID_ARGUMENT
        raise InvalidRequestError(output.invalid_field, output.error or "cannot be served")
    response = pb.GenerateResponse(
        request_id=output.request_id,
        token_ids=output.new_token_ids,
        # FinishReason is numbered as the proto's enum; None is its UNSPECIFIED (0).
        finish_reason=pb.FinishReason.ValueType(output.finish_reason or 0),
        num_cached_tokens=output.num_cached_tokens,
        error=output.error or "",
    )
    if output.stop_reason is not None:
        response.stop_token_id = output.stop_reason
    if output.new_logprobs:
        response.logprobs.extend(_to_token_logprobs(lp) for lp in output.new_logprobs)
    if output.prompt_logprobs:
        response.prompt_logprobs.extend(_to_token_logprobs(lp) for lp in output.prompt_logprobs)
    return response


def _to_token_logprobs(logprobs: TokenLogprobs) -> pb.TokenLogprobs:
    return pb.TokenLogprobs(
        token_id=logprobs.token_id,
        logprob=logprobs.logprob,
        rank=logprobs.rank,
        top_token_ids=logprobs.top_token_ids,
        top_logprobs=logprobs.top_logprobs,
    )


def to_model_info(model_name: str, infos: list[EngineInfo]) -> pb.GetModelInfoResponse:
    first = infos[0]
    return pb.GetModelInfoResponse(
        model_name=model_name,
        max_model_len=first.max_model_len,
        vocab_size=first.vocab_size,
        eos_token_ids=first.eos_token_ids,
        block_size=first.block_size,
        # Ranks size their caches alike; the smallest is what a request can count on.
        num_kv_blocks=min(info.num_kv_blocks for info in infos),
        data_parallel_size=len(infos),
        max_num_seqs=first.max_num_seqs,
        architecture=first.architecture,
    )


def to_loads_response(loads: list[RankLoad]) -> pb.GetLoadsResponse:
    return pb.GetLoadsResponse(
        loads=[
            pb.RankLoad(
                rank=rank,
                num_running=load.num_running,
                num_waiting=load.num_waiting,
                kv_cache_usage=load.kv_cache_usage,
                num_free_kv_blocks=load.num_free_kv_blocks,
                num_batches_in_flight=load.num_batches_in_flight,
                max_batches_in_flight=load.max_batches_in_flight,
            )
            for rank, load in enumerate(loads)
        ]
    )


def _check_size(field: str, size: int, limit: int, unit: str = "entries") -> None:
    if size > limit:
        raise InvalidRequestError(field, f"{size} {unit} is over the limit of {limit}")
