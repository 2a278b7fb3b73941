"""A worker process of the multiprocessing executor: one rank's share of the model.

It joins the other ranks over torch.distributed, loads its share, tells the executor it is
ready, then runs each call it receives, in order. It answers a step only if it samples; a
failure it answers always, then exits 1. It exits as soon as the engine-core process that
started it is gone, however that died: no worker outlives its engine.
"""

from __future__ import annotations

import logging
import os
import sys
import threading

import zmq
import zmq.utils.monitor

from engine_svc.executor.worker_spawn import LOOPBACK
from engine_svc.executor.worker_wire import (
    READY,
    AllocateKVCache,
    ExecuteModel,
    ProfileMemory,
    SampleTokens,
    Shutdown,
    WorkerCall,
    WorkerProcArgs,
    WorkerReply,
    decode_call,
    decode_proc_args,
    encode_reply,
)
from engine_svc.worker.outputs import PendingSample
from shared.gc_heap import startup_heap
from shared.parent_watch import wait_until_gone

logger = logging.getLogger(__name__)


def main() -> None:
    """`python -m engine_svc.executor.worker_proc`, its arguments msgpack on stdin."""
    run_worker(sys.stdin.buffer.read())


def run_worker(encoded_args: bytes) -> None:
    args = decode_proc_args(encoded_args)
    logging.basicConfig(
        level=args.log_level,
        format=f"%(asctime)s %(levelname)s worker-{args.rank} %(name)s: %(message)s",
    )
    _exit_with_parent(args.parent_pid)
    context = zmq.Context()
    calls = context.socket(zmq.SUB)
    calls.setsockopt(zmq.SUBSCRIBE, b"")
    calls.setsockopt(zmq.RCVHWM, 0)
    link = _ExecutorLink(calls) if args.call_address.startswith("tcp://") else None
    calls.connect(args.call_address)
    replies = context.socket(zmq.PUSH)
    replies.connect(args.reply_address)
    exit_code = 0
    try:
        with startup_heap(f"worker {args.rank}"):
            worker = _Worker(args)
        replies.send(encode_reply(WorkerReply(call_id=READY, rank=args.rank)))
        poller = zmq.Poller()
        poller.register(calls, zmq.POLLIN)
        if link is not None:
            poller.register(link.monitor, zmq.POLLIN)
        while True:
            events = dict(poller.poll())
            if link is not None and link.monitor in events:
                link.check()
            if calls not in events:
                continue
            envelope = decode_call(calls.recv())
            logger.debug("call %d: %s", envelope.call_id, type(envelope.call).__name__)
            if isinstance(envelope.call, Shutdown):
                replies.send(encode_reply(WorkerReply(call_id=envelope.call_id, rank=args.rank)))
                break
            reply = worker.run(envelope.call_id, envelope.call)
            if reply is not None:
                replies.send(encode_reply(reply))
    except BaseException as error:
        logger.exception("worker %d failed", args.rank)
        message = f"worker {args.rank}: {type(error).__name__}: {error}"
        replies.send(encode_reply(WorkerReply(call_id=READY, rank=args.rank, error=message)))
        exit_code = 1
    finally:
        # Every socket, the connection monitor's too; the last reply gets 5 s to leave.
        context.destroy(linger=5000)
    sys.exit(exit_code)


class _Worker:
    """The model runner of one rank, and the logits it keeps for grammar-bound sampling."""

    def __init__(self, args: WorkerProcArgs) -> None:
        import torch

        from engine_svc.core.kv_cache.sizing import cpu_worker_budget_bytes
        from engine_svc.distributed.collectives import init_distributed
        from engine_svc.distributed.layout import ParallelLayout
        from engine_svc.models.model_spec import load_model_spec
        from engine_svc.worker.model_runner import ModelRunner, resolve_device, resolve_dtype

        config = args.config
        torch.set_num_threads(args.num_threads)
        layout = ParallelLayout.of_rank(
            args.rank, config.tensor_parallel_size, config.pipeline_parallel_size
        )
        device = resolve_device(config.device)
        if device.type == "cuda":
            device = torch.device("cuda", args.rank % torch.cuda.device_count())
            torch.cuda.set_device(device)
        backend = "nccl" if device.type == "cuda" else "gloo"
        if config.master_addr in LOOPBACK:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # stay on loopback
        # No --master-port: the executor serves the rendezvous (MultiprocExecutor).
        hosted = config.master_port == 0
        collectives = init_distributed(
            layout, config.master_addr, args.master_port, backend, rendezvous_hosted=hosted
        )
        spec = load_model_spec(config.model)
        self.layout = layout
        self.runner = ModelRunner(
            config.model,
            spec,
            resolve_dtype(config.dtype, spec, device),
            device,
            config.block_size,
            config.fail_after_steps,
            config.cpu_kernels,
            collectives,
            memory_budget_bytes=cpu_worker_budget_bytes(config) if device.type == "cpu" else None,
            enforce_eager=config.enforce_eager,
        )
        self.pending: dict[int, PendingSample] = {}

    def run(self, call_id: int, call: WorkerCall) -> WorkerReply | None:
        from engine_svc.executor.memory import profile_worker_memory

        rank = self.layout.rank
        if isinstance(call, ExecuteModel):
            result = self.runner.execute_model(call.scheduler_output)
            if result is None or not self.layout.samples:
                return None
            if isinstance(result, PendingSample):  # wait for the grammar bitmask
                self.pending[call_id] = result
                return WorkerReply(
                    call_id=call_id, rank=rank, pending_request_ids=result.request_ids
                )
            return WorkerReply(call_id=call_id, rank=rank, output=result)
        if isinstance(call, SampleTokens):
            pending = self.pending.pop(call.step, None)
            if pending is None:
                return None  # kept by the rank that samples
            output = self.runner.sample_tokens(pending, _grammar(call))
            return WorkerReply(call_id=call_id, rank=rank, output=output)
        if isinstance(call, ProfileMemory):
            memory = profile_worker_memory(
                self.runner, call.max_batched_tokens, call.max_num_seqs, call.measure
            )
            return WorkerReply(call_id=call_id, rank=rank, memory=memory)
        if isinstance(call, AllocateKVCache):
            self.runner.allocate_kv_cache(call.num_blocks)
            return WorkerReply(call_id=call_id, rank=rank)
        raise TypeError(f"unknown call {type(call).__name__}")


def _grammar(call: SampleTokens):  # type: ignore[no-untyped-def]
    if call.grammar_request_ids is None:
        return None
    import torch

    from engine_svc.worker.outputs import GrammarBitmask

    rows = len(call.grammar_request_ids)
    bitmask = torch.frombuffer(bytearray(call.bitmask), dtype=torch.int32).view(rows, -1)
    return GrammarBitmask(call.grammar_request_ids, bitmask)


def _exit_with_parent(parent_pid: int) -> None:
    """A worker stuck in a collective cannot notice anything: leave at once."""

    def watch() -> None:
        wait_until_gone(parent_pid)
        logger.warning("the engine-core process (pid %d) is gone: exiting", parent_pid)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


class _ExecutorLink:
    """The connection of a worker on another machine than the executor. Once the executor's
    end is gone (its process died; heartbeats catch a machine that vanished), the worker
    leaves instead of waiting for calls that never come. Read on the worker's own thread:
    ZMQ sockets are not shared between threads."""

    def __init__(self, calls: zmq.Socket[bytes]) -> None:
        calls.setsockopt(zmq.HEARTBEAT_IVL, 1000)
        calls.setsockopt(zmq.HEARTBEAT_TIMEOUT, 10_000)
        self.monitor = calls.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self.connected = False

    def check(self) -> None:
        event = zmq.utils.monitor.recv_monitor_message(self.monitor)
        if event["event"] == zmq.EVENT_CONNECTED:
            self.connected = True
        elif self.connected and event["event"] == zmq.EVENT_DISCONNECTED:
            raise ConnectionError("the executor's connection is gone")


if __name__ == "__main__":
    main()
