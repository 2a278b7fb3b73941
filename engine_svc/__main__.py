"""`python -m engine_svc`: the engine service (engine.v1.EngineCoreService over gRPC)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from pathlib import Path

from engine_svc.config import GRAMMAR_CACHE_BYTES, EngineConfig
from engine_svc.distributed.layout import ParallelLayout
from engine_svc.models.model_spec import load_model_spec
from engine_svc.models.sharding import check_divisible
from engine_svc.server.app import DEFAULT_MAX_MESSAGE_BYTES
from engine_svc.server.serve import ServiceOptions, serve
from shared.errors import InvalidRequestError
from shared.grpc_auth import AuthConfigError, TokenSet
from shared.grpc_tls import TLSConfigError, add_server_arguments, server_tls

GiB = 1 << 30
MiB = 1 << 20


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m engine_svc", description=__doc__)
    add = parser.add_argument
    add("--model", help="Hugging Face model directory (default: the default model)")
    add("--served-model-name", help="name GetModelInfo reports (default: the folder's name)")
    add("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    add("--port", type=int, default=50061, help="gRPC port (default: %(default)s)")
    add(
        "--metrics-port",
        type=int,
        default=8001,
        help="Prometheus metrics on http://HOST:PORT/metrics (default: %(default)s)",
    )
    add(
        "--request-metrics",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also export each request's time to first token, inter-token and end-to-end "
        "latency, lengths and finish reason (turn off where the frontend exports them)",
    )
    add("--data-parallel-size", type=int, default=1, help="engine processes, one per rank")
    add(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        help="worker processes that split each layer (attention heads, MLP columns)",
    )
    add(
        "--pipeline-parallel-size",
        "-pp",
        type=int,
        default=1,
        help="worker processes that each run a contiguous stage of the layers",
    )
    add(
        "--master-addr",
        default="127.0.0.1",
        help="where the workers meet (torch.distributed rendezvous) (default: %(default)s)",
    )
    add(
        "--master-port",
        type=int,
        default=0,
        help="the rendezvous port; node 0 also takes the next two for the other nodes' "
        "workers (default: a free one, on one machine only)",
    )
    add("--nnodes", type=int, default=1, help="machines the worker ranks spread over")
    add(
        "--node-rank",
        type=int,
        default=0,
        help="this machine's place: 0 serves the API and schedules; the others run workers "
        "only (default: %(default)s)",
    )
    add(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM, seconds to let "
        "in-flight requests finish (0: abort them at once) (default: %(default)s)",
    )
    add("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    add("--device", default="auto", help="auto, cpu, cuda or cuda:N (default: %(default)s)")
    add("--max-model-len", type=int, help="default: the model's max_position_embeddings")
    add("--max-num-seqs", type=int, default=256, help="requests running at once, per rank")
    add("--max-num-batched-tokens", type=int, help="tokens per step (default: 2048)")
    add("--block-size", type=int, default=16, help="tokens per KV block")
    add(
        "--kv-cache-memory-gib",
        type=float,
        help="memory budget for weights, activations and the KV cache, in GiB, per GPU or on "
        "CPU for all workers together (default: 90%% of the GPU, or a quarter of RAM up to "
        "4 GiB on CPU)",
    )
    add("--gpu-memory-utilization", type=float, default=0.9)
    add("--num-kv-blocks", type=int, help="KV blocks per rank, overriding the memory budget")
    add("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    add("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
    add("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"])
    add(
        "--stream-interval",
        type=int,
        default=1,
        help="a streamed request's tokens go out every this many (the first and the last at "
        "once): fewer, larger messages, less CPU per token (default: %(default)s)",
    )
    add(
        "--grammar-cache-mib",
        type=float,
        default=GRAMMAR_CACHE_BYTES / MiB,
        help="compiled structured-output grammars kept for requests that repeat a constraint, "
        "in MiB, the least recently used dropped first (default: %(default)g)",
    )
    add(
        "--cpu-kernels",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="decode attention in C++ on CPU, built on first start (default: %(default)s)",
    )
    add(
        "--enforce-eager",
        action="store_true",
        help="run decode steps through the model's Python loop over its layers, not the "
        "C++ one (the kernels stay on)",
    )
    add(
        "--max-message-bytes",
        type=int,
        default=DEFAULT_MAX_MESSAGE_BYTES,
        help="largest gRPC message accepted or sent (default: %(default)s)",
    )
    add(
        "--auth-token-file",
        type=Path,
        help="require `authorization: Bearer TOKEN` on every call but health and reflection, "
        "TOKEN one of this file's lines (re-read when it changes) (default: none)",
    )
    add_server_arguments(parser)
    add("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    add(
        "--null-executor",
        action="store_true",
        help="benchmarks only: run no model, answer every request with a fixed cycle of "
        "tokens at no cost (what is left is the engine's and the frontend's own cost)",
    )
    # Test hook: the forward pass raises after this many steps.
    add("--fail-after-steps", type=int, help=argparse.SUPPRESS)
    return parser


def engine_config(args: argparse.Namespace, model_dir: str) -> EngineConfig:
    memory = args.kv_cache_memory_gib
    if args.grammar_cache_mib < 0:  # named as the flag is, not as the config's bytes
        raise InvalidRequestError("grammar_cache_mib", "must be >= 0")
    return EngineConfig(
        model=model_dir,
        dtype=args.dtype,
        device=args.device,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=args.enable_prefix_caching,
        enable_chunked_prefill=args.enable_chunked_prefill,
        scheduling_policy=args.scheduling_policy,
        stream_interval=args.stream_interval,
        grammar_cache_bytes=int(args.grammar_cache_mib * MiB),
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory_bytes=None if memory is None else int(memory * GiB),
        gpu_memory_utilization=args.gpu_memory_utilization,
        cpu_kernels=args.cpu_kernels,
        enforce_eager=args.enforce_eager,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        master_addr=args.master_addr,
        master_port=args.master_port,
        fail_after_steps=args.fail_after_steps,
        null_executor=args.null_executor,
    )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.data_parallel_size < 1:
        parser.error("--data-parallel-size must be >= 1")
    if args.shutdown_timeout < 0:
        parser.error("--shutdown-timeout must be >= 0")
    if args.model is None:
        from shared.model_store import ensure_default_model

        args.model = str(ensure_default_model())
    from shared.model_store import resolve_model

    if not Path(args.model).exists():
        parser.error(f"--model: no such file or directory: {args.model}")
    model_dir = str(resolve_model(args.model))  # a GGUF file: its converted directory
    try:
        spec = load_model_spec(model_dir)
    except (FileNotFoundError, ValueError) as error:  # not a model directory, or not one we run
        parser.error(f"--model: {error}")
    try:
        config = engine_config(args, model_dir)
        check_divisible(
            spec, ParallelLayout(config.tensor_parallel_size, config.pipeline_parallel_size)
        )
    except InvalidRequestError as error:
        parser.error(f"--{error.field.replace('_', '-')}: {error.message}")
    if config.node_rank > 0:
        from engine_svc.executor.worker_node import run_worker_node

        return run_worker_node(config)
    try:
        auth_tokens = None if args.auth_token_file is None else TokenSet(args.auth_token_file)
        tls = server_tls(args)
    except (OSError, AuthConfigError, TLSConfigError) as error:
        parser.error(str(error))
    options = ServiceOptions(
        model_name=args.served_model_name or Path(model_dir).name,
        host=args.host,
        port=args.port,
        metrics_port=args.metrics_port,
        request_metrics=args.request_metrics,
        data_parallel_size=args.data_parallel_size,
        shutdown_timeout_s=args.shutdown_timeout,
        max_message_bytes=args.max_message_bytes,
        log_level=args.log_level,
        auth_tokens=auth_tokens,
        tls=tls,
    )
    return asyncio.run(serve(config, options))


if __name__ == "__main__":
    sys.exit(main())
