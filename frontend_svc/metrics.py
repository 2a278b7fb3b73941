"""The frontend's Prometheus metrics (--metrics-port, 8000): vLLM's per-request metrics as a
client sees them (time to first token, the gap before each later update, end-to-end latency,
prompt and completion lengths, finished requests by reason) and the gRPC server's. The queue,
prefill and decode phases come from the engines (shared.metrics has the definitions)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator

from prometheus_client import CollectorRegistry

from frontend_svc.messages import GenerationUpdate, ModelInfo
from shared.errors import DeadlinePassedError
from shared.metrics.grpc_server import GrpcServerMetrics
from shared.metrics.requests import RequestMetrics, RequestTimer

# A request's choices may run on several engines: the frontend's series carry no engine.
ENGINE_LABEL = ""


class FrontendMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.grpc_interceptor = GrpcServerMetrics(registry)
        self._requests: RequestMetrics | None = None

    def track(
        self,
        model: ModelInfo,
        num_prompt_tokens: int,
        updates: AsyncGenerator[GenerationUpdate, None],
    ) -> AsyncGenerator[GenerationUpdate, None]:
        """`updates`, timed as one request (its n choices together)."""
        if self._requests is None:  # the model is known once an engine has reported it
            self._requests = RequestMetrics(
                self.registry, model.model_name, model.max_model_len, phases=False
            )
        return _timed(self._requests.start_request(ENGINE_LABEL, num_prompt_tokens), updates)


async def _timed(
    timer: RequestTimer, updates: AsyncGenerator[GenerationUpdate, None]
) -> AsyncGenerator[GenerationUpdate, None]:
    """`updates`, timed. The request ends as its first choice finished where the stream ran
    to its end; else as an abort (the client went away, its deadline passed: gRPC cancelled
    the call, or the engine call's own deadline raised DeadlinePassedError, whichever came first;
    and so with n > 1 where the first choice had finished and another had not), or an error.
    A request refused before anything came back (overload, no engine) is not counted."""
    finish_reason = "abort"
    started, record, ended, failed = False, True, False, False
    try:
        async with contextlib.aclosing(updates):
            async for update in updates:
                started = True
                timer.on_tokens(sum(len(choice.token_ids) for choice in update.choices))
                finish_reason = _first_choice_finish(update) or finish_reason
                yield update
        ended = True
    except DeadlinePassedError:
        raise
    except Exception:
        record, failed = started, True
        raise
    finally:
        if record:
            timer.finish(finish_reason if ended else "error" if failed else "abort")


def _first_choice_finish(update: GenerationUpdate) -> str | None:
    for choice in update.choices:
        if choice.index == 0 and choice.finish_reason is not None:
            return choice.finish_reason.name.lower()
    return None
