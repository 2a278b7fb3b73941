"""vllm.grpc.engine protobuf -> engine structs (Generate's request), and engine state ->
protobuf (model, server and load info). Generate's responses are built in responses.py.

The engine holds no text: it takes `tokenized.input_ids` only, and leaves stop strings to
the caller (smg matches them on its side, then drops the stream, which aborts the request).
Fields that would change what is generated and that the engine cannot honour are refused
with INVALID_ARGUMENT naming the field, never silently ignored."""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

from smg_grpc_proto.generated import vllm_engine_pb2 as vpb

from engine_svc.control_messages import EngineInfo
from engine_svc.messages import EngineCoreRequest
from engine_svc.sampling_params import SamplingParams
from engine_svc.server.convert import MAX_ABORT_IDS, MAX_LOGIT_BIAS_ENTRIES, MAX_REQUEST_ID_CHARS
from shared.engine_load import RankLoad
from shared.errors import InvalidRequestError

SERVER_TYPE = "duoserve"
_SUPPORTED_CONSTRAINTS = (
    "json_schema",
    "json_object",
    "regex",
    "choice",
    "grammar",
    "structural_tag",
)


# ---- Generate's request ------------------------------------------------------------------


def to_engine_request(request: vpb.GenerateRequest) -> EngineCoreRequest:
    request_id = request.request_id or uuid.uuid4().hex
    _check_at_most("request_id", len(request_id), MAX_REQUEST_ID_CHARS, "characters")
    _refuse_unsupported_inputs(request)
    return EngineCoreRequest(
        request_id=request_id,
        prompt_token_ids=_prompt_token_ids(request),
        sampling_params=to_sampling_params(request.sampling_params),
        arrival_time=time.monotonic(),
    )


def _prompt_token_ids(request: vpb.GenerateRequest) -> list[int]:
    if request.WhichOneof("input") != "tokenized":
        raise InvalidRequestError("tokenized", "this engine takes token ids only")
    token_ids = list(request.tokenized.input_ids)
    if not token_ids:
        raise InvalidRequestError("tokenized.input_ids", "must not be empty")
    params = request.sampling_params
    if params.HasField("truncate_prompt_tokens"):
        keep = params.truncate_prompt_tokens
        if keep < 1:
            raise InvalidRequestError(
                "sampling_params.truncate_prompt_tokens", "only a positive count is supported"
            )
        token_ids = token_ids[-keep:]  # vLLM's meaning: keep the last `keep` tokens
    return token_ids


def _refuse_unsupported_inputs(request: vpb.GenerateRequest) -> None:
    # data_parallel_rank is only a hint: the engine client picks the least-loaded rank.
    unsupported = {
        "mm_inputs": request.HasField("mm_inputs") or len(request.extra_mm_inputs) > 0,
        "media_refs": request.HasField("media_refs"),
        "kv_transfer_params": request.HasField("kv_transfer_params")
        or request.HasField("kv_transfer_params_json"),
    }
    for field, given in unsupported.items():
        if given:
            raise InvalidRequestError(field, "not supported by this engine (text only, no PD)")


def to_sampling_params(params: vpb.SamplingParams) -> SamplingParams:
    """vLLM's defaults for unset fields (proto3 zeros for top_p and repetition_penalty mean
    unset); skip_special_tokens, spaces_between_special_tokens, include_stop_str_in_output
    and stop are about text, which is the caller's."""
    _refuse_unsupported_sampling(params)
    options: dict[str, Any] = {
        "temperature": params.temperature if params.HasField("temperature") else 1.0,
        "top_p": params.top_p or 1.0,
        "top_k": params.top_k,
        "min_p": params.min_p,
        "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
        "repetition_penalty": params.repetition_penalty or 1.0,
        "max_tokens": params.max_tokens if params.HasField("max_tokens") else None,
        "min_tokens": params.min_tokens,
        "stop_token_ids": list(params.stop_token_ids),
        "ignore_eos": params.ignore_eos,
        "logprobs": params.logprobs if params.HasField("logprobs") else None,
        "prompt_logprobs": (params.prompt_logprobs if params.HasField("prompt_logprobs") else None),
        "seed": params.seed if params.HasField("seed") else None,
    }
    if params.logit_bias:
        _check_at_most(
            "sampling_params.logit_bias", len(params.logit_bias), MAX_LOGIT_BIAS_ENTRIES, "entries"
        )
        options["logit_bias"] = dict(params.logit_bias)
    options.update(_constraint_options(params))
    return SamplingParams(**options)  # checked by the engine client (engine_svc/admission.py)


def _refuse_unsupported_sampling(params: vpb.SamplingParams) -> None:
    kind = params.WhichOneof("constraint")
    if kind is not None and kind not in _SUPPORTED_CONSTRAINTS:
        raise InvalidRequestError(
            f"sampling_params.{kind}",
            f"not supported; use one of {', '.join(_SUPPORTED_CONSTRAINTS)}",
        )


def _constraint_options(params: vpb.SamplingParams) -> dict[str, Any]:
    kind = params.WhichOneof("constraint")
    if kind is None or (kind == "json_object" and not params.json_object):
        return {}
    if kind == "choice":
        return {"choice": list(params.choice.choices)}
    return {kind: getattr(params, kind)}


def to_abort_ids(request: vpb.AbortRequest) -> list[str]:
    _check_at_most("request_ids", len(request.request_ids), MAX_ABORT_IDS)
    return list(request.request_ids)


# ---- model, server and load info ---------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ModelMetadata:
    """What GetModelInfo reports from the model's config.json, read once at start-up."""

    model_type: str = ""
    architectures: tuple[str, ...] = ()
    bos_token_id: int = 0
    pad_token_id: int = 0

    @classmethod
    def read(cls, model_dir: Path) -> ModelMetadata:
        try:
            config = json.loads((model_dir / "config.json").read_text())
        except (OSError, ValueError):
            return cls()
        return cls(
            model_type=str(config.get("model_type") or ""),
            architectures=tuple(config.get("architectures") or ()),
            bos_token_id=_first_id(config.get("bos_token_id")),
            pad_token_id=_first_id(config.get("pad_token_id")),
        )


def _first_id(value: object) -> int:
    if isinstance(value, list):
        value = value[0] if value else None
    return value if isinstance(value, int) else 0


def to_model_info(
    model_dir: Path, model_name: str, infos: list[EngineInfo], model: ModelMetadata
) -> vpb.GetModelInfoResponse:
    first = infos[0]
    return vpb.GetModelInfoResponse(
        model_path=str(model_dir),
        is_generation=True,
        max_context_length=first.max_model_len,
        vocab_size=first.vocab_size,
        supports_vision=False,
        served_model_name=model_name,
        # A local directory: a gateway on this machine loads the tokenizer and chat template
        # from it; one elsewhere takes them from GetTokenizer.
        tokenizer_path=str(model_dir),
        model_type=model.model_type,
        architectures=list(model.architectures),
        eos_token_ids=first.eos_token_ids,
        pad_token_id=model.pad_token_id,
        bos_token_id=model.bos_token_id,
        # A prompt must leave room for at least one new token.
        max_req_input_len=first.max_model_len - 1,
    )


@dataclasses.dataclass(frozen=True)
class ServerState:
    num_active_requests: int
    started_at: float  # time.time()
    last_request_at: float  # time.time(); 0 before the first request


def to_server_info(state: ServerState, infos: list[EngineInfo]) -> vpb.GetServerInfoResponse:
    return vpb.GetServerInfoResponse(
        active_requests=state.num_active_requests,
        is_paused=False,
        last_receive_timestamp=state.last_request_at,
        uptime_seconds=max(0.0, time.time() - state.started_at),
        server_type=SERVER_TYPE,
        data_parallel_size=len(infos),
        block_size=infos[0].block_size,
        max_num_seqs=infos[0].max_num_seqs,
    )


def to_loads_response(
    request: vpb.GetLoadsRequest, loads: list[RankLoad], infos: list[EngineInfo]
) -> vpb.GetLoadsResponse:
    ranks = list(range(len(loads)))
    if request.HasField("dp_rank"):
        if request.dp_rank not in ranks:
            raise InvalidRequestError("dp_rank", f"must be in [0, {len(loads)})")
        ranks = [request.dp_rank]
    return vpb.GetLoadsResponse(
        timestamp=datetime.now(UTC).isoformat(),
        version=_version(),
        dp_rank_count=len(ranks),
        loads=[_scheduler_load(rank, loads[rank], infos[rank]) for rank in ranks],
    )


def _scheduler_load(rank: int, load: RankLoad, info: EngineInfo) -> vpb.SchedulerLoad:
    num_used_blocks = info.num_kv_blocks - load.num_free_kv_blocks
    return vpb.SchedulerLoad(
        dp_rank=rank,
        num_running_reqs=load.num_running,
        num_waiting_reqs=load.num_waiting,
        num_total_reqs=load.num_running + load.num_waiting,
        num_used_tokens=num_used_blocks * info.block_size,
        max_total_num_tokens=info.num_kv_blocks * info.block_size,
        token_usage=load.kv_cache_usage,
        max_running_requests=info.max_num_seqs,
    )


def _version() -> str:
    try:
        return f"{SERVER_TYPE} {metadata.version('duoserve')}"
    except metadata.PackageNotFoundError:
        return SERVER_TYPE


def _check_at_most(field: str, size: int, limit: int, unit: str = "entries") -> None:
    if size > limit:
        raise InvalidRequestError(field, f"{size} {unit} is over the limit of {limit}")
