"""Continuous batching with chunked prefill and preemption by recompute (vLLM v1 style).

There are no separate prefill and decode phases: each request has `num_computed_tokens`
and `num_tokens`, and every step gives each scheduled request some of the difference,
within a token budget. Running requests go first; waiting ones join while budget, KV
blocks and `max_num_seqs` allow. When a running request cannot get a block, the lowest
priority (then latest) running request is preempted: its blocks are freed and it will be
recomputed from the start, usually hitting its own blocks in the prefix cache.
"""

from __future__ import annotations

import time

import msgspec

from engine_svc.config import SchedulerConfig
from engine_svc.core.kv_cache.manager import KVCacheManager
from engine_svc.core.request import Request, RequestStatus
from engine_svc.core.sched.dead_ends import (
    DeadEnd,
    constraint_field,
    grammar_dead_end,
    restriction_dead_end,
)
from engine_svc.core.sched.output import NewRequestData, ScheduledRequest, SchedulerOutput
from engine_svc.core.sched.request_queue import make_request_queue
from engine_svc.messages import EngineCoreOutput, FinishReason, RequestTimes, SchedulerStats
from engine_svc.sampling_params import SamplingParams
from engine_svc.worker.outputs import ModelRunnerOutput
from shared.errors import InvalidRequestError


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.kv_cache = KVCacheManager(
            config.num_kv_blocks,
            config.block_size,
            config.enable_prefix_caching,
            attention_span=config.attention_span,
        )
        self.requests: dict[str, Request] = {}
        self.waiting = make_request_queue(config.policy)
        self.running: list[Request] = []
        self._freed_request_ids: list[str] = []
        self._failed_outputs: list[EngineCoreOutput] = []
        self.num_preemptions = 0
        self._num_prompt_tokens_step = 0

    # ---- admission -------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request checked where it entered the engine (engine_svc/admission.py).
        A request id still running is refused: its state would be overwritten."""
        if request.request_id in self.requests:
            raise InvalidRequestError("request_id", f"{request.request_id!r} is already running")
        request.queued_time = time.monotonic()
        self.requests[request.request_id] = request
        self.waiting.add(request)

    # ---- scheduling ------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: dict[str, ScheduledRequest] = {}
        preempted_this_step = False

        for request in list(self.running):
            if budget <= 0:
                break
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if num_new <= 0:
                continue  # its previous batch is still in flight (batch queue)
            new_block_ids, num_reclaimed = self._allocate_or_preempt(request, num_new, scheduled)
            budget += num_reclaimed
            if new_block_ids is None:
                preempted_this_step = True
                continue
            scheduled[request.request_id] = self._schedule_tokens(request, num_new, new_block_ids)
            budget -= num_new
        preempted_this_step |= any(r.status != RequestStatus.RUNNING for r in self.running)
        self.running = [r for r in self.running if r.status == RequestStatus.RUNNING]

        if not preempted_this_step:
            budget = self._schedule_waiting(budget, scheduled)

        freed, self._freed_request_ids = self._freed_request_ids, []
        return SchedulerOutput(scheduled=list(scheduled.values()), freed_request_ids=freed)

    def _allocate_or_preempt(
        self, request: Request, num_new: int, scheduled: dict[str, ScheduledRequest]
    ) -> tuple[list[int] | None, int]:
        """Blocks for `request`, preempting others while needed (None if it was itself
        preempted), and the token budget given back by victims already scheduled this step."""
        num_reclaimed = 0
        while True:
            new_block_ids = self.kv_cache.allocate_slots(request, num_new)
            if new_block_ids is not None:
                return new_block_ids, num_reclaimed
            victim = self._pick_victim()
            withdrawn = scheduled.pop(victim.request_id, None)
            if withdrawn is not None:
                # Its blocks for this step were published to the prefix cache but will
                # never be computed: unpublish them before they are freed.
                self.kv_cache.discard_uncomputed(victim, withdrawn.num_computed_tokens)
                num_reclaimed += withdrawn.num_scheduled_tokens
                self._num_prompt_tokens_step -= _num_prompt_tokens_in(
                    victim, withdrawn.num_computed_tokens, withdrawn.num_scheduled_tokens
                )
            self._preempt(victim)
            if victim is request:
                return None, num_reclaimed

    def _pick_victim(self) -> Request:
        candidates = [r for r in self.running if r.status == RequestStatus.RUNNING]
        if self.config.policy == "priority":
            return max(candidates, key=lambda r: (r.priority, r.arrival_time))
        return candidates[-1]

    def _preempt(self, request: Request) -> None:
        self.kv_cache.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._freed_request_ids.append(request.request_id)
        self.waiting.add_preempted(request)

    def _schedule_waiting(self, budget: int, scheduled: dict[str, ScheduledRequest]) -> int:
        config = self.config
        waiting_for_grammar: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < config.max_num_seqs:
            request = self.waiting.peek()
            if request.structured is not None:
                if not request.structured.is_ready():
                    # Its grammar is still compiling: let the requests behind it run.
                    waiting_for_grammar.append(self.waiting.pop())
                    continue
                if request.structured.error is not None:
                    # The constraint's own fault (parsed, but would not compile against the
                    # vocabulary): no other engine would do better.
                    self.waiting.pop()
                    self._fail(request, request.structured.error, constraint_field(request))
                    continue
            # A prompt whose logprobs are asked for runs whole: they come from its logits.
            skip_cache = request.needs_prompt_logprobs
            hits = [] if skip_cache else self.kv_cache.get_computed_blocks(request)
            num_hit_tokens = len(hits) * config.block_size
            num_new = request.num_tokens - num_hit_tokens
            if num_new > budget:
                if not config.enable_chunked_prefill:
                    break
                num_new = budget
            new_block_ids = self.kv_cache.allocate_slots(request, num_new, hits)
            if new_block_ids is None:
                break
            self.waiting.pop()
            if not skip_cache:
                self.kv_cache.record_prefix_query(request.num_tokens, num_hit_tokens)
            if request.num_cached_tokens < 0:  # its first scheduling
                request.num_cached_tokens = num_hit_tokens
                request.scheduled_time = time.monotonic()
            request.num_computed_tokens = num_hit_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            entry = self._schedule_tokens(request, num_new, new_block_ids)
            entry.new_block_ids = self.kv_cache.block_ids(request.request_id)
            entry.new_request = NewRequestData(
                sampling_params=_runner_params(request),
                num_prompt_tokens=request.num_prompt_tokens,
                # A snapshot as of this step, which the runner keeps as its own.
                all_token_ids=list(request.all_token_ids),
            )
            scheduled[request.request_id] = entry
            budget -= num_new
        for request in reversed(waiting_for_grammar):
            self.waiting.add_preempted(request)  # back at the front, in their order
        return budget

    def _schedule_tokens(
        self, request: Request, num_new: int, new_block_ids: list[int]
    ) -> ScheduledRequest:
        start = request.num_computed_tokens
        entry = ScheduledRequest(
            request_id=request.request_id,
            token_ids=request.all_token_ids[start : start + num_new],
            num_computed_tokens=start,
            new_block_ids=new_block_ids,
            num_preemptions=request.num_preemptions,
        )
        # Advanced now, not after the forward, so a pipelined next batch sees it.
        request.num_computed_tokens += num_new
        self._num_prompt_tokens_step += _num_prompt_tokens_in(request, start, num_new)
        return entry

    def prepare_waiting(self) -> None:
        """Compute the block hashes of waiting prompts ahead of their prefix-cache lookup."""
        if self.config.enable_prefix_caching:
            for request in self.waiting:
                self.kv_cache.hash_request(request)

    # ---- results ---------------------------------------------------------------------

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        outputs: list[EngineCoreOutput] = []
        max_model_len = self.config.max_model_len
        for entry in scheduler_output.scheduled:
            request = self.requests.get(entry.request_id)
            if (
                request is None
                or request.status != RequestStatus.RUNNING
                or entry.num_preemptions != request.num_preemptions
            ):
                continue  # aborted, or preempted while this batch ran: it runs again
            chunk = runner_output.prompt_logprobs.get(entry.request_id)
            if chunk is not None:
                request.add_prompt_logprobs(chunk)
            token_id = runner_output.sampled_token_ids.get(entry.request_id)
            if token_id is None:
                continue  # a prefill chunk short of the end of the request's tokens
            if request.structured is not None:
                dead_end = grammar_dead_end(request, token_id)
                if dead_end is not None:
                    # The token drawn, which the constraint forbids, is not the request's.
                    outputs.append(self._end_dead_end(request, dead_end))
                    continue
            request.append_output_token(token_id)
            finished = request.check_stop(max_model_len)
            if request.structured is not None and not finished and request.structured.is_terminated:
                request.finish(FinishReason.STOP)
                finished = True
            dead_end = None
            if not finished and request.sampling_params.restricts_tokens:
                dead_end = restriction_dead_end(request, self.config.vocab_size)
                if dead_end is not None:  # the token drawn stays the request's
                    request.error = dead_end.error
                    request.finish(FinishReason.ERROR)
                    finished = True
            outputs.append(
                EngineCoreOutput(
                    request_id=request.request_id,
                    new_token_ids=[token_id],
                    new_logprobs=(
                        [runner_output.logprobs[request.request_id]]
                        if request.request_id in runner_output.logprobs
                        else None
                    ),
                    prompt_logprobs=request.take_prompt_logprobs(),
                    finish_reason=request.finish_reason,
                    stop_reason=request.stop_reason,
                    num_cached_tokens=max(request.num_cached_tokens, 0),
                    error=request.error,
                    times=_times_with_first_token(request),
                    invalid_field=None if dead_end is None else dead_end.field,
                )
            )
            if finished:
                self._free_request(request)
        if any(r.is_finished for r in self.running):
            self.running = [r for r in self.running if not r.is_finished]
        return outputs

    def take_failed_outputs(self) -> list[EngineCoreOutput]:
        """Outputs of requests that schedule() ended with an error (their grammar failed)."""
        outputs, self._failed_outputs = self._failed_outputs, []
        return outputs

    def _end_dead_end(self, request: Request, dead_end: DeadEnd) -> EngineCoreOutput:
        request.error = dead_end.error
        request.finish(FinishReason.ERROR)
        self._free_request(request)
        return EngineCoreOutput(
            request_id=request.request_id,
            new_token_ids=[],
            finish_reason=FinishReason.ERROR,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            error=request.error,
            times=_times_with_first_token(request),
            invalid_field=dead_end.field,
        )

    def _fail(self, request: Request, error: str, invalid_field: str | None = None) -> None:
        """End a waiting request that can never run; its output goes with the next results.
        `invalid_field`: the request's own field at fault, if it is (EngineCoreOutput's)."""
        request.error = error
        request.finish(FinishReason.ERROR)
        self._free_request(request)
        self._failed_outputs.append(
            EngineCoreOutput(
                request_id=request.request_id,
                new_token_ids=[],
                finish_reason=FinishReason.ERROR,
                error=error,
                invalid_field=invalid_field,
            )
        )

    def finish_requests(
        self, request_ids: list[str], reason: FinishReason
    ) -> list[EngineCoreOutput]:
        """End requests from outside (abort, shutdown, error); unknown ids are ignored."""
        outputs: list[EngineCoreOutput] = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.finish(reason)
            self._free_request(request)
            outputs.append(
                EngineCoreOutput(
                    request_id=request_id,
                    new_token_ids=[],
                    finish_reason=reason,
                    num_cached_tokens=max(request.num_cached_tokens, 0),
                )
            )
        return outputs

    def _free_request(self, request: Request) -> None:
        self.kv_cache.free(request)
        del self.requests[request.request_id]
        self._freed_request_ids.append(request.request_id)

    # ---- state -----------------------------------------------------------------------

    def has_requests(self) -> bool:
        return bool(self.requests)

    @property
    def has_freed_requests(self) -> bool:
        return bool(self._freed_request_ids)

    def make_stats(self, num_generation_tokens: int = 0) -> SchedulerStats:
        stats = SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=self.kv_cache.usage,
            prefix_cache_queries=self.kv_cache.num_queried_tokens,
            prefix_cache_hits=self.kv_cache.num_hit_tokens,
            num_preemptions=self.num_preemptions,
            num_prompt_tokens=self._num_prompt_tokens_step,
            num_generation_tokens=num_generation_tokens,
        )
        self._num_prompt_tokens_step = 0
        return stats

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache.reset_prefix_cache()


def _runner_params(request: Request) -> SamplingParams:
    """The parameters the runner gets: without prompt_logprobs once they were sent (a prompt
    recomputed after a preemption needs them no more)."""
    params = request.sampling_params
    if params.prompt_logprobs is not None and not request.needs_prompt_logprobs:
        return msgspec.structs.replace(params, prompt_logprobs=None)
    return params


def _num_prompt_tokens_in(request: Request, start: int, count: int) -> int:
    """How many of the tokens [start, start + count) belong to the prompt."""
    return max(0, min(start + count, request.num_prompt_tokens) - start)


def _times_with_first_token(request: Request) -> RequestTimes | None:
    """The request's queue and schedule times, on its first output token only."""
    if request.num_output_tokens != 1:
        return None
    return RequestTimes(queued=request.queued_time, scheduled=request.scheduled_time)
