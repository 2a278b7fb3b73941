"""Owns the model, its KV cache and the sampler; runs one scheduled step at a time."""

from __future__ import annotations

import logging
import resource
import sys

import torch

from engine_svc.core.sched.output import SchedulerOutput
from engine_svc.distributed.collectives import SINGLE, Collectives
from engine_svc.kernels import cpu_kernels_available, describe, prefill_attention_available
from engine_svc.messages import TokenLogprobs
from engine_svc.models.fast_paths import tensor_bytes, use_fused_ops
from engine_svc.models.llama import KVCache, LlamaForCausalLM
from engine_svc.models.loader import load_model
from engine_svc.models.model_spec import ModelSpec
from engine_svc.worker.host_memory import populate_in_background, zeroed_host_tensor
from engine_svc.worker.input_batch import RunnerRequestState, prepare_inputs
from engine_svc.worker.outputs import (
    GrammarBitmask,
    ModelRunnerOutput,
    PendingSample,
    PromptLogprobsChunk,
)
from engine_svc.worker.prompt_logprobs import BLOCK_ROWS as PROMPT_LOGPROB_ROWS
from engine_svc.worker.prompt_logprobs import compute_prompt_logprobs
from engine_svc.worker.sampler import Sampler

logger = logging.getLogger(__name__)

PROFILE_CHUNK_TOKENS = 512
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, spec: ModelSpec, device: torch.device) -> torch.dtype:
    if name == "auto":
        # float32 on CPU keeps outputs exact against Hugging Face; the checkpoint's
        # dtype on an accelerator.
        if device.type == "cpu":
            return torch.float32
        return _DTYPES.get(spec.torch_dtype, torch.bfloat16)
    return _DTYPES[name]


class ModelRunner:
    def __init__(
        self,
        model_dir: str,
        spec: ModelSpec,
        dtype: torch.dtype,
        device: torch.device,
        block_size: int,
        fail_after_steps: int | None = None,
        cpu_kernels: bool = True,
        collectives: Collectives = SINGLE,
        memory_budget_bytes: int | None = None,
        enforce_eager: bool = False,
    ) -> None:
        self.spec = spec
        self.dtype = dtype
        self.device = device
        self.block_size = block_size
        self.collectives = collectives
        self.layout = collectives.layout
        self.model: LlamaForCausalLM = load_model(model_dir, spec, dtype, device, collectives)
        self.num_layers = len(self.model.model.local_layers())
        self.num_kv_heads = self.model.shards.num_kv_heads
        self.kv_caches: list[KVCache] = []
        self.states: dict[str, RunnerRequestState] = {}
        self.num_steps = 0
        self.fail_after_steps = fail_after_steps
        # Decode attention in C++ on CPU, built on first use (engine_svc/kernels).
        self.cpu_kernels = cpu_kernels and device.type == "cpu" and cpu_kernels_available()
        # The attention kernels do not soft-cap scores (Gemma 2): those models attend in torch.
        self.decode_kernel = self.cpu_kernels and spec.attn_logit_softcapping is None
        self.prefill_kernel = self.decode_kernel and prefill_attention_available(
            dtype, spec.head_dim
        )
        # The budget this worker's weights, activations and KV cache share (None: it does
        # not size the KV cache): a second copy of the weights must leave the cache room.
        use_fused_ops(
            self.model, self.cpu_kernels, dtype, memory_budget_bytes, decode_loop=not enforce_eager
        )
        self.sampler = Sampler(device, kernels=self.cpu_kernels)
        if device.type == "cpu":
            logger.info(
                "%s", describe(dtype, spec.head_dim) if self.cpu_kernels else "CPU kernels off"
            )

    @property
    def weight_bytes(self) -> int:
        # The fused, transposed weights are buffers (the rotary tables too): count both.
        return tensor_bytes(self.model)

    def kv_bytes_per_block(self) -> int:
        """This worker's share: its layers, its K/V heads."""
        element = torch.tensor([], dtype=self.dtype).element_size()
        per_token = 2 * self.num_layers * self.num_kv_heads * self.spec.head_dim
        return per_token * self.block_size * element

    def allocate_kv_cache(self, num_blocks: int, warm: bool = True) -> None:
        """The KV cache of every layer; on CPU its pages are faulted in by a background
        thread (`warm`), so the engine can serve before they all are."""
        shape = (num_blocks, self.block_size, self.num_kv_heads, self.spec.head_dim)
        self.kv_caches = [(self._zeros(shape), self._zeros(shape)) for _ in range(self.num_layers)]
        if warm and self.device.type == "cpu":
            populate_in_background([t for pair in self.kv_caches for t in pair])

    def _zeros(self, shape: tuple[int, ...]) -> torch.Tensor:
        """A zeroed KV tensor. Zeros matter: masked-out slots still meet the attention
        product, and uninitialized memory could hold NaN."""
        if self.device.type != "cpu":
            return torch.zeros(shape, dtype=self.dtype, device=self.device)
        return zeroed_host_tensor(shape, self.dtype)

    @torch.inference_mode()
    def execute_model(
        self, scheduler_output: SchedulerOutput
    ) -> ModelRunnerOutput | PendingSample | None:
        """Run the forward. When a constrained request samples this step, return the logits
        as a PendingSample: sampling waits for the grammar bitmask (`sample_tokens`). A rank
        that does not sample (parallel layouts) returns None once its share is done."""
        self._update_states(scheduler_output)
        if not scheduler_output.scheduled:
            return ModelRunnerOutput(sampled_token_ids={}, logprobs={})
        self.num_steps += 1
        if self.fail_after_steps is not None and self.num_steps > self.fail_after_steps:
            raise RuntimeError(f"injected failure after {self.fail_after_steps} steps")
        inputs = prepare_inputs(
            scheduler_output.scheduled,
            self.states,
            self.block_size,
            self.spec.is_causal,
            self.device,
            self.dtype,
            self.decode_kernel,
            self.prefill_kernel,
        )
        intermediate = None
        if not self.layout.is_first_stage:
            shape = (2, inputs.input_ids.shape[0], self.spec.hidden_size)
            buffer = torch.empty(shape, dtype=self.dtype, device=self.device)
            intermediate = self.collectives.recv_from_previous_stage(buffer)
        hidden = self.model(
            inputs.input_ids, inputs.positions, self.kv_caches, inputs.attention, intermediate
        )
        if not self.layout.is_last_stage:
            self.collectives.send_to_next_stage(hidden)
            return None
        prompt_logprobs: dict[str, PromptLogprobsChunk] = {}
        if inputs.prompt_logprob_rows:
            prompt_logprobs = compute_prompt_logprobs(
                self.model,
                hidden,
                inputs.prompt_logprob_rows,
                self.states,
                self.cpu_kernels,
                self.layout.samples,
            )
        if not inputs.sample_request_ids:
            return ModelRunnerOutput(
                sampled_token_ids={}, logprobs={}, prompt_logprobs=prompt_logprobs
            )
        # Every tensor rank takes part in gathering the logits; one samples.
        logits = self.model.compute_logits(hidden.index_select(0, inputs.sample_indices))
        if not self.layout.samples:
            return None
        pending = PendingSample(logits, inputs.sample_request_ids, prompt_logprobs=prompt_logprobs)
        if any(self.states[r].sampling_params.constraint for r in pending.request_ids):
            return pending
        return self.sample_tokens(pending, None)

    @torch.inference_mode()
    def sample_tokens(
        self, pending: PendingSample, grammar: GrammarBitmask | None
    ) -> ModelRunnerOutput:
        logits = pending.logits
        assert logits is not None, "the logits are this runner's own"
        if grammar is not None:
            logits = _apply_grammar(logits, pending.request_ids, grammar)
        states = [self.states[request_id] for request_id in pending.request_ids]
        tokens, logprobs = self.sampler(logits, [s.sampling_row() for s in states])
        sampled: dict[str, int] = {}
        sampled_logprobs: dict[str, TokenLogprobs] = {}
        for request_id, state, token, token_logprobs in zip(
            pending.request_ids, states, tokens, logprobs, strict=True
        ):
            state.token_ids.append(token)
            sampled[request_id] = token
            if token_logprobs is not None:
                sampled_logprobs[request_id] = token_logprobs
        return ModelRunnerOutput(
            sampled_token_ids=sampled,
            logprobs=sampled_logprobs,
            prompt_logprobs=pending.prompt_logprobs,
        )

    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        for request_id in scheduler_output.freed_request_ids:
            self.states.pop(request_id, None)
        for entry in scheduler_output.scheduled:
            new = entry.new_request
            if new is not None:
                self.states[entry.request_id] = RunnerRequestState.new(
                    sampling_params=new.sampling_params,
                    num_prompt_tokens=new.num_prompt_tokens,
                    token_ids=new.all_token_ids,  # the scheduler's snapshot, now ours
                    block_ids=list(entry.new_block_ids),
                    eos_token_ids=self.spec.eos_token_ids,
                )
            else:
                state = self.states[entry.request_id]
                state.block_ids.extend(entry.new_block_ids)
                # A rank that does not sample learns the sampled tokens from the step that
                # computes them (on the rank that samples, they are known already).
                missing = entry.num_computed_tokens + len(entry.token_ids) - len(state.token_ids)
                if missing > 0:
                    state.token_ids.extend(entry.token_ids[-missing:])

    @torch.inference_mode()
    def profile_activation_bytes(self, num_tokens: int, num_seqs: int) -> int:
        """Peak memory of a forward over the largest step, on a throwaway KV cache."""
        from engine_svc.layers.attention import AttentionMetadata, PrefillChunk

        num_seqs = max(1, min(num_seqs, num_tokens))
        saved = self.kv_caches
        self.allocate_kv_cache(-(-num_tokens // self.block_size) + 1, warm=False)
        # The forward's peak does not depend on how the tokens split into prompts, but one
        # SDPA call per tiny prompt would cost seconds: use chunks of up to 512 tokens.
        num_chunks = -(-num_tokens // PROFILE_CHUNK_TOKENS)
        chunk_len = -(-num_tokens // num_chunks)
        chunks = [
            PrefillChunk(start, min(chunk_len, num_tokens - start), None, None)
            for start in range(0, num_tokens, chunk_len)
        ]
        meta = AttentionMetadata(
            slot_mapping=torch.arange(num_tokens, device=self.device),
            num_decodes=0,
            decode_block_tables=None,
            decode_mask=None,
            prefills=chunks,
        )
        ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        before = _memory_mark(self.device)
        # A later pipeline stage profiles on zeros instead of its predecessor's output.
        intermediate = None
        if not self.layout.is_first_stage:
            shape = (2, num_tokens, self.spec.hidden_size)
            intermediate = torch.zeros(shape, dtype=self.dtype, device=self.device)
        positions = torch.arange(num_tokens, device=self.device) % 2
        hidden = self.model(ids, positions, self.kv_caches, meta, intermediate)
        if self.layout.is_last_stage:
            # Logits and softmax for one sampled row per sequence, as a full step has them,
            # or for a block of prompt positions whose logprobs are asked, if more.
            num_rows = max(num_seqs, min(PROMPT_LOGPROB_ROWS, num_tokens))
            rows = torch.arange(num_rows, device=self.device) % num_tokens
            logits = self.model.compute_logits(hidden.index_select(0, rows)).float()
            torch.softmax(logits, dim=-1)
        peak = _memory_peak(self.device) - before
        self.kv_caches = saved
        return max(peak, 0)

    def estimate_activation_bytes(self, num_tokens: int, num_seqs: int) -> int:
        """The big live tensors of a forward over `num_tokens`: the widest layer's inputs and
        outputs for every token, plus float32 logits and softmax for the sampled rows (or a
        block of prompt-logprob rows)."""
        spec = self.spec
        element = torch.tensor([], dtype=self.dtype).element_size()
        per_token = (
            3 * spec.hidden_size
            + 3 * spec.intermediate_size
            + (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim
        )
        num_rows = max(num_seqs, min(PROMPT_LOGPROB_ROWS, num_tokens))
        return num_tokens * per_token * element + 3 * num_rows * spec.vocab_size * 4


def _apply_grammar(
    logits: torch.Tensor, request_ids: list[str], grammar: GrammarBitmask
) -> torch.Tensor:
    """Forbidden tokens get -inf, in place: the logits are this step's own, and logprobs
    are those of the masked distribution, as in vLLM."""
    import xgrammar as xgr

    rows = {request_id: row for row, request_id in enumerate(request_ids)}
    indices = [rows[request_id] for request_id in grammar.request_ids]
    masked = logits.float()  # no copy for float32 logits
    # xgrammar pairs bitmask row i with logits row i: lay the grammar rows out that way
    # (-1: every bit set, nothing masked) and mask only the constrained rows.
    bitmask = torch.full((len(request_ids), grammar.bitmask.shape[1]), -1, dtype=torch.int32)
    bitmask[indices] = grammar.bitmask
    xgr.apply_token_bitmask_inplace(masked, bitmask.to(logits.device), indices=indices)
    return masked


def _memory_mark(device: torch.device) -> int:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device)
    return _max_rss_bytes()


def _memory_peak(device: torch.device) -> int:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device)
    # Peak resident set growth: an undercount when an earlier peak was higher, which the
    # analytic floor in the caller covers.
    return _max_rss_bytes()


def _max_rss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024
