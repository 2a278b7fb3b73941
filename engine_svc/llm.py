"""The offline batch API, in the shape vLLM users know: `LLM(model).generate(prompts, params)`."""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Sequence
from typing import Any

import msgspec

from engine_svc.client.inproc import InprocClient
from engine_svc.config import EngineConfig
from engine_svc.messages import EngineCoreOutput, EngineCoreRequest, TokenLogprobs
from engine_svc.sampling_params import SamplingParams
from shared.bad_words import bad_words_token_ids
from shared.errors import InvalidRequestError
from shared.model_store import ensure_default_model, resolve_model

Prompt = str | list[int]


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int] = dataclasses.field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # "stop", "length", "abort" or "error"
    stop_reason: int | None = None
    error: str | None = None  # why, when finish_reason is "error"
    logprobs: list[TokenLogprobs] | None = None
    # With SamplingParams.prompt_logprobs: for prompt tokens 1 to n - 1 (the first has none).
    prompt_logprobs: list[TokenLogprobs] | None = None
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class LLM:
    def __init__(self, model: str | None = None, **engine_options: Any) -> None:
        from transformers import AutoTokenizer  # text is this class's business only

        # A GGUF file serves as its converted directory (shared/model_store.py).
        model_dir = str(resolve_model(model)) if model else str(ensure_default_model())
        self.config = EngineConfig(model=model_dir, **engine_options)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.client = InprocClient(self.config)
        self._ids = itertools.count()

    @property
    def engine_core(self):  # type: ignore[no-untyped-def]
        return self.client.engine_core

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        prompt_list = _as_prompt_list(prompts)
        params_list = _as_params_list(sampling_params, len(prompt_list))
        results: dict[str, RequestOutput] = {}
        order: list[str] = []
        try:
            for prompt, params in zip(prompt_list, params_list, strict=True):
                result = self._add(prompt, params)
                results[result.request_id] = result
                order.append(result.request_id)
            while any(not r.finished for r in results.values()):
                for output in self.client.get_output().outputs:
                    if output.request_id in results:
                        _apply(results[output.request_id], output)
        except BaseException:
            unfinished = [rid for rid, r in results.items() if not r.finished]
            self.client.abort_requests(unfinished)
            while self.client.has_unfinished_requests():
                self.client.get_output()
            raise
        for result in results.values():
            result.text = str(self.tokenizer.decode(result.token_ids, skip_special_tokens=True))
        return [results[rid] for rid in order]

    def _add(self, prompt: Prompt, params: SamplingParams) -> RequestOutput:
        if params.bad_words:
            params = self._tokenize_bad_words(params)
        if isinstance(prompt, str):
            token_ids = self.tokenizer.encode(prompt)
            text: str | None = prompt
        else:
            token_ids, text = list(prompt), None
        request_id = str(next(self._ids))
        self.client.add_request(
            EngineCoreRequest(
                request_id=request_id,
                prompt_token_ids=token_ids,
                sampling_params=params,
                arrival_time=time.monotonic(),
            )
        )
        return RequestOutput(request_id=request_id, prompt=text, prompt_token_ids=token_ids)

    def _tokenize_bad_words(self, params: SamplingParams) -> SamplingParams:
        """`bad_words` (text) as the engine takes them, beside any given as token ids."""
        if isinstance(params.bad_words, str):  # each of its characters would be a word
            raise InvalidRequestError("bad_words", "must be a list of words, not one string")
        words = bad_words_token_ids(
            lambda text: self.tokenizer.encode(text, add_special_tokens=False),
            params.bad_words or (),
        )
        given = params.bad_words_token_ids or []
        return msgspec.structs.replace(
            params, bad_words=None, bad_words_token_ids=[*given, *map(list, words)]
        )

    def shutdown(self) -> None:
        self.client.shutdown()


def _apply(result: RequestOutput, output: EngineCoreOutput) -> None:
    result.token_ids.extend(output.new_token_ids)
    if output.new_logprobs:
        result.logprobs = (result.logprobs or []) + list(output.new_logprobs)
    if output.prompt_logprobs is not None:
        result.prompt_logprobs = list(output.prompt_logprobs)
    result.num_cached_tokens = output.num_cached_tokens
    if output.finish_reason is not None:
        result.finish_reason = str(output.finish_reason)
        result.stop_reason = output.stop_reason
        result.error = output.error


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    items = list(prompts)
    if items and all(isinstance(t, int) for t in items):
        return [[int(t) for t in items]]  # type: ignore[arg-type]  # one prompt as token ids
    return items  # type: ignore[return-value]


def _as_params_list(
    params: SamplingParams | Sequence[SamplingParams] | None, count: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    params = list(params)
    if len(params) != count:
        raise InvalidRequestError("sampling_params", f"{len(params)} given for {count} prompts")
    return params
