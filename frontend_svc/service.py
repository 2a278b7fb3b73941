"""What the public API does, free of protobuf: validate, tokenize, admit, and generate over
the engine pool. The gRPC servicer only converts around these calls."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import AsyncGenerator, Sequence

from frontend_svc.engines.pool import EnginePool
from frontend_svc.engines.router import EngineRouter
from frontend_svc.generation import Generation, collect
from frontend_svc.messages import (
    ChatMessage,
    EngineRequest,
    GenerationRequest,
    GenerationUpdate,
    ModelInfo,
)
from frontend_svc.metrics import FrontendMetrics
from frontend_svc.tokenizer import Tokenizer
from frontend_svc.validation import validate_prompt, validate_request, validate_tokenize_input
from shared.bad_words import bad_words_token_ids
from shared.errors import EngineUnavailableError


@dataclasses.dataclass(frozen=True)
class ServiceInfo:
    model: ModelInfo
    has_chat_template: bool
    num_engines: int
    num_healthy_engines: int


class Frontend:
    def __init__(
        self,
        pool: EnginePool,
        tokenizer: Tokenizer | None = None,
        metrics: FrontendMetrics | None = None,
    ) -> None:
        self.pool = pool
        self.router = EngineRouter(pool)
        self.tokenizer = tokenizer  # None until loaded (possibly from an engine) at start-up
        self.metrics = metrics

    @property
    def is_ready(self) -> bool:
        return (
            self.tokenizer is not None
            and bool(self.pool.available)
            and (self.pool.model_info is not None)
        )

    def stream(
        self, request: GenerationRequest, deadline: float | None
    ) -> AsyncGenerator[GenerationUpdate, None]:
        """Updates as the choices advance. Bad input raises at once; overload and no engine
        on the first iteration; both before anything is sent."""
        prepared = self.prepare(request)
        updates = Generation(prepared, self.router, self._tokenizer()).updates(deadline)
        if self.metrics is None:
            return updates
        num_prompt_tokens = len(prepared.prompt_token_ids)
        return self.metrics.track(self.model_info(), num_prompt_tokens, updates)

    async def generate(
        self, request: GenerationRequest, deadline: float | None
    ) -> GenerationUpdate:
        return await collect(self.stream(request, deadline))

    def prepare(self, request: GenerationRequest) -> EngineRequest:
        """The request validated and tokenized; its choices' engine calls derive from it."""
        validate_request(request)
        field, prompt_token_ids = self._prompt_token_ids(request)
        keep = request.sampling.truncate_prompt_tokens
        length_field = field
        if keep is not None and len(prompt_token_ids) > keep:
            prompt_token_ids = prompt_token_ids[-keep:]
            length_field = "sampling_params.truncate_prompt_tokens"  # set the length
        validate_prompt(field, prompt_token_ids, self.model_info(), length_field)
        sampling = request.sampling
        if sampling.bad_words:
            tokenizer = self._tokenizer()
            words = bad_words_token_ids(
                lambda text: tokenizer.encode(text, add_special_tokens=False),
                sampling.bad_words,
                "sampling_params.bad_words",
            )
            sampling = dataclasses.replace(sampling, bad_words_token_ids=words)
        return EngineRequest(
            request_id=request.request_id or uuid.uuid4().hex,
            prompt_token_ids=tuple(prompt_token_ids),
            sampling=sampling,
            priority=request.priority,
        )

    def tokenize(
        self,
        text: str | None,
        messages: Sequence[ChatMessage],
        add_special_tokens: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        validate_tokenize_input(text, messages)
        if text is not None:
            return self._tokenizer().encode(text, add_special_tokens)
        return self._tokenizer().render_chat(messages, add_generation_prompt)

    def model_info(self) -> ModelInfo:
        info = self.pool.model_info
        if info is None:
            raise EngineUnavailableError("no engine has reported its model yet")
        return info

    def describe(self) -> ServiceInfo:
        return ServiceInfo(
            model=self.model_info(),
            has_chat_template=self._tokenizer().has_chat_template,
            num_engines=len(self.pool.endpoints),
            num_healthy_engines=len(self.pool.available),
        )

    def _prompt_token_ids(self, request: GenerationRequest) -> tuple[str, list[int]]:
        """The prompt's tokens, and the input field they came from."""
        if request.prompt is not None:
            return "prompt", self._tokenizer().encode(request.prompt)
        if request.messages is not None:
            return "messages", self._tokenizer().render_chat(request.messages)
        return "prompt_token_ids", list(request.prompt_token_ids or ())

    def _tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise EngineUnavailableError("starting: the tokenizer is not loaded yet")
        return self.tokenizer
