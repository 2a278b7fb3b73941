"""Engine options, as users pass them to `LLM(...)` or the engine service's flags."""

from __future__ import annotations

import dataclasses
from typing import Literal

from shared.errors import InvalidRequestError

SchedulingPolicy = Literal["fcfs", "priority"]
GRAMMAR_CACHE_BYTES = 512 << 20


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig:
    model: str
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "auto"
    device: str = "auto"  # "auto": CUDA when available, else CPU
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # None: 2048, or max_model_len w/o chunking
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    scheduling_policy: SchedulingPolicy = "fcfs"
    num_kv_blocks: int | None = None  # overrides the sizing from the memory budget
    kv_cache_memory_bytes: int | None = None  # budget for weights+activations+KV
    gpu_memory_utilization: float = 0.9
    max_concurrent_batches: int = 1  # >1: the executor pipelines batches (batch queue)
    # Worker processes: tensor_parallel_size x pipeline_parallel_size (1 x 1: one worker,
    # in the engine-core process), spread evenly over nnodes machines. They join over
    # torch.distributed at master_addr:master_port (0: a free one; one machine only); workers
    # on other machines reach the executor on node 0 at the next ports (executor_ports).
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    num_threads: int | None = None  # torch intra-op threads on CPU; None: torch's default
    # Served streams wake their consumer every this many tokens (the first and the last at
    # once): fewer, larger messages (engine_svc/client/output_stream.py).
    stream_interval: int = 1
    # Compiled structured-output grammars kept for requests that repeat a constraint, at most
    # this many bytes, the least recently asked for dropped first (vLLM keeps 512 MiB:
    # VLLM_XGRAMMAR_CACHE_MB). 0: none kept between requests.
    grammar_cache_bytes: int = GRAMMAR_CACHE_BYTES
    cpu_kernels: bool = True  # C++ decode attention on CPU (engine_svc/kernels) when it builds
    # vLLM's name: every step through the model's Python loop over its layers, never the
    # C++ loop of decode steps (engine_svc/models/decode_layers.py), as vLLM skips its
    # captured graphs.
    enforce_eager: bool = False
    fail_after_steps: int | None = None  # test hook: the forward raises after N steps
    # Benchmarks of the engine's own cost: no model runs, tokens follow a fixed cycle
    # (executor/null.py).
    null_executor: bool = False

    def __post_init__(self) -> None:
        _check(self.block_size in (8, 16, 32, 64, 128), "block_size", "one of 8..128")
        _check(self.max_num_seqs >= 1, "max_num_seqs", "must be >= 1")
        _check(self.scheduling_policy in ("fcfs", "priority"), "scheduling_policy", "fcfs|priority")
        if self.max_model_len is not None:
            _check(self.max_model_len >= 2, "max_model_len", "must be >= 2")
        if self.max_num_batched_tokens is not None:
            _check(self.max_num_batched_tokens >= 1, "max_num_batched_tokens", "must be >= 1")
        if self.num_kv_blocks is not None:
            _check(self.num_kv_blocks >= 1, "num_kv_blocks", "must be >= 1")
        _check(0.0 < self.gpu_memory_utilization <= 1.0, "gpu_memory_utilization", "in (0, 1]")
        _check(self.stream_interval >= 1, "stream_interval", "must be >= 1")
        _check(self.grammar_cache_bytes >= 0, "grammar_cache_bytes", "must be >= 0")
        _check(self.max_concurrent_batches >= 1, "max_concurrent_batches", "must be >= 1")
        _check(self.tensor_parallel_size >= 1, "tensor_parallel_size", "must be >= 1")
        _check(self.pipeline_parallel_size >= 1, "pipeline_parallel_size", "must be >= 1")
        _check(0 <= self.master_port < 65536, "master_port", "must be a port number or 0")
        _check(self.nnodes >= 1, "nnodes", "must be >= 1")
        _check(0 <= self.node_rank < self.nnodes, "node_rank", "must be in [0, nnodes)")
        if self.nnodes > 1:
            _check(self.world_size % self.nnodes == 0, "nnodes", "must divide the worker ranks")
            _check(self.master_port > 0, "master_port", "must be given with nnodes > 1")
            _check(self.master_port + 2 < 65536, "master_port", "needs the next two ports too")

    @property
    def world_size(self) -> int:
        """Worker ranks: tensor_parallel_size x pipeline_parallel_size."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def node_ranks(self, node: int) -> range:
        """The worker ranks machine `node` runs."""
        per_node = self.world_size // self.nnodes
        return range(node * per_node, (node + 1) * per_node)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """What the scheduler needs, resolved against the model at start-up."""

    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    num_kv_blocks: int
    enable_prefix_caching: bool
    enable_chunked_prefill: bool
    policy: SchedulingPolicy = "fcfs"
    vocab_size: int = 0  # 0: token ids are not checked
    eos_token_ids: frozenset[int] = frozenset()
    # The most tokens back any layer attends over (every layer windowed): older KV blocks
    # are released as a sequence grows. None: every layer reads the whole sequence.
    attention_span: int | None = None


def _check(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise InvalidRequestError(field, message)
