"""The in-process client: no threads, no sockets; `get_output()` runs one step in place."""

from __future__ import annotations

from engine_svc.admission import check_request
from engine_svc.config import EngineConfig
from engine_svc.core.engine_core import EngineCore
from engine_svc.messages import EngineCoreOutputs, EngineCoreRequest


class InprocClient:
    def __init__(self, config: EngineConfig) -> None:
        self.engine_core = EngineCore(config)
        self.limits = self.engine_core.info()

    def add_request(self, request: EngineCoreRequest) -> None:
        """Raises InvalidRequestError, naming the field, for a request that cannot run."""
        check_request(request, self.limits)
        self.engine_core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.engine_core.abort_requests(request_ids)

    def get_output(self) -> EngineCoreOutputs:
        outputs, _ = self.engine_core.step_fn()
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.engine_core.has_work() or bool(self.engine_core.batch_queue)

    def reset_prefix_cache(self) -> bool:
        return self.engine_core.reset_prefix_cache()

    def shutdown(self) -> None:
        self.engine_core.shutdown()
