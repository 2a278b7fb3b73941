"""Per step: the token bitmask of the constrained requests about to sample, built while the
forward runs (the seed's `get_grammar_bitmask`)."""

from __future__ import annotations

from typing import Any

from engine_svc.core.request import Request
from engine_svc.core.sched.output import SchedulerOutput
from engine_svc.sampling_params import SamplingParams
from engine_svc.structured.compiler import GrammarCompiler
from engine_svc.structured.request_state import StructuredRequestState
from engine_svc.worker.outputs import GrammarBitmask


class StructuredOutputManager:
    def __init__(self, compiler: GrammarCompiler) -> None:
        self.vocab_size = compiler.vocab_size
        self.compiler = compiler
        self._bitmask: Any = None

    def start(self, params: SamplingParams) -> StructuredRequestState:
        return StructuredRequestState(self.compiler.compile(params))

    def grammar_bitmask(
        self, scheduler_output: SchedulerOutput, requests: dict[str, Request]
    ) -> GrammarBitmask | None:
        rows: list[tuple[str, StructuredRequestState]] = []
        for entry in scheduler_output.scheduled:
            request = requests.get(entry.request_id)
            if request is None or not isinstance(request.structured, StructuredRequestState):
                continue
            # Only a chunk that reaches the end of the known tokens samples.
            if entry.num_computed_tokens + len(entry.token_ids) == request.num_tokens:
                rows.append((entry.request_id, request.structured))
        if not rows:
            return None
        bitmask = self._bitmask_rows(len(rows))
        for row, (_, state) in enumerate(rows):
            state.fill_bitmask(bitmask, row)
        _release_dead_ends(bitmask, [state for _, state in rows])
        return GrammarBitmask([request_id for request_id, _ in rows], bitmask)

    def _bitmask_rows(self, count: int) -> Any:
        import xgrammar as xgr

        # Reused across steps: allocating per step would cost more than filling.
        if self._bitmask is None or self._bitmask.shape[0] < count:
            self._bitmask = xgr.allocate_token_bitmask(max(count, 64), self.vocab_size)
        return self._bitmask[:count]

    def shutdown(self) -> None:
        self.compiler.shutdown()


def _release_dead_ends(bitmask: Any, states: list[StructuredRequestState]) -> None:
    """Rows whose grammar allows no token at all (a regex whose language is empty, a schema
    that can never close): each such state is marked, for the scheduler to end its request
    naming the constraint, and its row allows every token, so the sampler draws from a
    normal distribution rather than from all -inf (the draw is then dropped)."""
    blocked = ~bitmask.any(dim=1)
    if not bool(blocked.any()):
        return
    for row in blocked.nonzero().flatten().tolist():
        states[row].allows_no_token = True
        bitmask[row] = -1  # all 32 bits of every word set
