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
    whose language is empty, a schema that can never close), or only tokens the request's
    other masks take away (min_tokens holding back a finished choice's one continuation, EOS;
    allowed_token_ids; its bad words). Each such state records why, for the scheduler to end
    its request naming the constraint, and its row allows every token, so the sampler draws
    from a normal distribution rather than from all -inf (the draw is then dropped)."""
    blocked = (~bitmask.any(dim=1)).tolist()
    for row, (request, state) in enumerate(rows):
        if blocked[row]:
            state.dead_end = "the constraint cannot be completed"
        elif _only_masked_tokens_allowed(bitmask[row], request):
            state.dead_end = (
                "the constraint allows no token that min_tokens, allowed_token_ids and the bad "
                "words leave"
            )
        else:
            continue
        bitmask[row] = -1  # all 32 bits of every word set


def _only_masked_tokens_allowed(words: Any, request: Request) -> bool:
    """Whether every token the row allows is one the sampler masks out besides the grammar:
    held back by min_tokens (the stop token ids, and EOS unless ignored), outside
    allowed_token_ids, or banned by a bad word. Rare (constrained rows with those), so plain
    Python on the row's words."""
    params = request.sampling_params
    holding = request.num_output_tokens < params.min_tokens
    if not holding and not params.restricts_tokens:
        return False
    allowed = [word & 0xFFFFFFFF for word in words.tolist()]
    if params.allowed_token_ids is not None:
        kept = [0] * len(allowed)
        for token_id in params.allowed_token_ids:
            if token_id >> 5 < len(kept):
                kept[token_id >> 5] |= 1 << (token_id & 31)
        allowed = [word & keep for word, keep in zip(allowed, kept, strict=True)]
    masked = params.bad_word_bans(request.output_tail(params.bad_word_span))
    if holding:
        masked |= params.ending_token_ids(request.eos_token_ids)
    for token_id in masked:
        if token_id >> 5 < len(allowed):
            allowed[token_id >> 5] &= ~(1 << (token_id & 31))
    return not any(allowed)
