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
        rows: list[tuple[Request, StructuredRequestState]] = []
        for entry in scheduler_output.scheduled:
            request = requests.get(entry.request_id)
            if request is None or not isinstance(request.structured, StructuredRequestState):
                continue
            # Only a chunk that reaches the end of the known tokens samples.
            if entry.num_computed_tokens + len(entry.token_ids) == request.num_tokens:
                rows.append((request, request.structured))
        if not rows:
            return None
        bitmask = self._bitmask_rows(len(rows))
        for row, (_, state) in enumerate(rows):
            state.fill_bitmask(bitmask, row)
        _release_dead_ends(bitmask, rows)
        return GrammarBitmask([request.request_id for request, _ in rows], bitmask)

    def _bitmask_rows(self, count: int) -> Any:
        import xgrammar as xgr

        # Reused across steps: allocating per step would cost more than filling.
        if self._bitmask is None or self._bitmask.shape[0] < count:
            self._bitmask = xgr.allocate_token_bitmask(max(count, 64), self.vocab_size)
        return self._bitmask[:count]

    def shutdown(self) -> None:
        self.compiler.shutdown()


def _release_dead_ends(bitmask: Any, rows: list[tuple[Request, StructuredRequestState]]) -> None:
    """Rows that leave their request no token to draw: the grammar allows none (a regex
    whose language is empty, a schema that can never close), or only tokens min_tokens holds
    back (a finished choice whose one continuation is EOS). Each such state records why, for
    the scheduler to end its request naming the constraint, and its row allows every token,
    so the sampler draws from a normal distribution rather than from all -inf (the draw is
    then dropped)."""
    blocked = (~bitmask.any(dim=1)).tolist()
    for row, (request, state) in enumerate(rows):
        if blocked[row]:
            state.dead_end = "the constraint cannot be completed"
        elif _only_held_back_allowed(bitmask[row], request):
            state.dead_end = "the constraint allows no token that min_tokens does not hold back"
        else:
            continue
        bitmask[row] = -1  # all 32 bits of every word set


def _only_held_back_allowed(words: Any, request: Request) -> bool:
    """Whether every token the row allows is one min_tokens still holds back (the stop
    token ids, and EOS unless ignored). Rare (constrained rows before min_tokens), so plain
    Python on the row's words."""
    params = request.sampling_params
    if request.num_output_tokens >= params.min_tokens:
        return False
    allowed = [word & 0xFFFFFFFF for word in words.tolist()]
    for token_id in params.ending_token_ids(request.eos_token_ids):
        if token_id >> 5 < len(allowed):
            allowed[token_id >> 5] &= ~(1 << (token_id & 31))
    return not any(allowed)
