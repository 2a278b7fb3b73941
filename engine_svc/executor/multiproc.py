"""Workers in processes of their own, one per rank, joined by torch.distributed: tensor and
pipeline parallelism (engine_svc/models/sharding.py).

The engine-core process holds no model. Each call goes to every worker over its own ZMQ
socket in a private folder, encoded once; the workers answer on one socket that a reader
thread drains, completing the call's future. A step is answered by the rank that samples
(tensor rank 0 of the last stage); the others answer only when they fail. Under pipeline
parallelism the executor accepts one batch per stage at once: while the last stage runs
batch n, the first already runs batch n+1.

A worker that reports an error or dies (kill -9) fails every call in flight and reaches the
engine through the failure callback; the engine then shuts the executor down, which kills
what is left. Workers started here also exit on their own once this process is gone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import shutil
import subprocess
import tempfile
import threading
import time
from concurrent.futures import Future
from typing import Any

import zmq
from torch.distributed import TCPStore

from engine_svc.config import EngineConfig
from engine_svc.core.sched.output import SchedulerOutput
from engine_svc.distributed.collectives import host_rendezvous
from engine_svc.executor.base import Executor, FailureCallback, RunnerResult, WorkerMemory
from engine_svc.executor.worker_spawn import executor_ports, spawn_workers, tcp_bind_host
from engine_svc.executor.worker_wire import (
    READY,
    AllocateKVCache,
    ExecuteModel,
    ProfileMemory,
    SampleTokens,
    Shutdown,
    WorkerCall,
    WorkerReply,
    decode_reply,
    encode_call,
)
from engine_svc.worker.outputs import GrammarBitmask, ModelRunnerOutput, PendingSample

logger = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.1  # how often the reader and the monitor look at their stop flag
SHUTDOWN_GRACE_S = 5.0  # for workers to leave on their own before they are killed


@dataclasses.dataclass
class _Call:
    future: Future[Any]
    expected: set[int]  # the ranks whose answer completes it
    replies: dict[int, WorkerReply] = dataclasses.field(default_factory=dict)
    kind: type = ExecuteModel


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig, startup_timeout_s: float = 600.0) -> None:
        tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
        self.world_size = tp * pp
        self.sampling_rank = (pp - 1) * tp
        self.max_concurrent_batches = max(config.max_concurrent_batches, pp)
        self._failure: BaseException | None = None
        self._failure_callback: FailureCallback | None = None
        self._closing = threading.Event()
        self._lock = threading.Lock()
        self._calls: dict[int, _Call] = {}
        self._call_ids = itertools.count()
        # mkdtemp makes the folder 0700: only this user reaches the sockets.
        self._socket_dir = tempfile.mkdtemp(prefix="duoserve-workers-")
        self._zmq = zmq.Context()
        # Nothing outlives the executor: were it collected without shutdown(), the context's
        # destructor would otherwise wait forever for unsent calls.
        self._zmq.setsockopt(zmq.LINGER, 0)
        # Every call goes to every worker: one broadcast socket. XPUB reports each worker's
        # subscription, so the executor knows when all can hear it; no high-water mark, as
        # a PUB socket drops what exceeds it.
        self._call_socket = self._zmq.socket(zmq.XPUB)
        self._call_socket.setsockopt(zmq.XPUB_VERBOSE, 1)
        self._call_socket.setsockopt(zmq.SNDHWM, 0)
        self._reply_socket = self._zmq.socket(zmq.PULL)
        local_calls = f"ipc://{self._socket_dir}/calls"
        local_replies = f"ipc://{self._socket_dir}/replies"
        self._call_socket.bind(local_calls)
        self._reply_socket.bind(local_replies)
        if config.nnodes > 1:  # workers on the other machines connect over TCP
            calls_port, replies_port = executor_ports(config)
            host = tcp_bind_host(config)
            self._call_socket.bind(f"tcp://{host}:{calls_port}")
            self._reply_socket.bind(f"tcp://{host}:{replies_port}")
        # One machine: this process serves the ranks' rendezvous on a port it keeps. Several:
        # rank 0 serves it at the given port, where the other machines' ranks find it.
        self._rendezvous: TCPStore | None = None
        master_port = config.master_port
        if master_port == 0:
            self._rendezvous = host_rendezvous(config.master_addr, self.world_size)
            master_port = self._rendezvous.port
        self.processes = spawn_workers(config, master_port, local_calls, local_replies)
        try:
            self._wait_until_ready(startup_timeout_s)
        except BaseException:
            self.shutdown()
            raise
        self._threads = [
            threading.Thread(target=self._read_replies, name="worker-replies", daemon=True),
            threading.Thread(target=self._watch_workers, name="worker-monitor", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    # ---- start-up --------------------------------------------------------------------

    def _wait_until_ready(self, timeout_s: float) -> None:
        """Until every worker, here and on the other machines, has loaded its share and
        subscribed to the calls."""
        deadline = time.monotonic() + timeout_s
        ready: set[int] = set()
        subscribed = 0
        poller = zmq.Poller()
        poller.register(self._reply_socket, zmq.POLLIN)
        poller.register(self._call_socket, zmq.POLLIN)
        while len(ready) < self.world_size or subscribed < self.world_size:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{len(ready)} of {self.world_size} workers ready after {timeout_s:.0f} s"
                )
            for process in self.processes:
                if process.poll() is not None:
                    raise RuntimeError(f"worker pid {process.pid} exited with {process.returncode}")
            events = dict(poller.poll(int(POLL_INTERVAL_S * 1000)))
            if self._call_socket in events:
                subscribed += self._call_socket.recv()[:1] == b"\x01"
            if self._reply_socket in events:
                reply = decode_reply(self._reply_socket.recv())
                if reply.error is not None:
                    raise RuntimeError(reply.error)
                if reply.call_id == READY:
                    ready.add(reply.rank)
        logger.info("%d workers ready", self.world_size)

    # ---- calls -----------------------------------------------------------------------

    def _call(self, call: WorkerCall, expected: set[int]) -> Future[Any]:
        future: Future[Any] = Future()
        with self._lock:
            if self._failure is not None:
                future.set_exception(self._failure)
                return future
            call_id = next(self._call_ids)
            self._calls[call_id] = _Call(future, expected, kind=type(call))
        self._call_socket.send(encode_call(call_id, call))
        return future

    def _everyone(self) -> set[int]:
        return set(range(self.world_size))

    def profile_memory(
        self, max_batched_tokens: int, max_num_seqs: int, measure: bool
    ) -> list[WorkerMemory]:
        call = ProfileMemory(max_batched_tokens, max_num_seqs, measure)
        result: list[WorkerMemory] = self._call(call, self._everyone()).result()
        return result

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self._call(AllocateKVCache(num_blocks), self._everyone()).result()

    def execute_model(self, scheduler_output: SchedulerOutput) -> Future[RunnerResult]:
        return self._call(ExecuteModel(scheduler_output), {self.sampling_rank})

    def sample_tokens(
        self, pending: PendingSample, grammar: GrammarBitmask | None
    ) -> Future[ModelRunnerOutput]:
        call = SampleTokens(pending.step)
        if grammar is not None:
            call.grammar_request_ids = grammar.request_ids
            call.bitmask = grammar.bitmask.contiguous().numpy().tobytes()
        return self._call(call, {self.sampling_rank})

    def register_failure_callback(self, callback: FailureCallback) -> None:
        self._failure_callback = callback

    # ---- replies and failures --------------------------------------------------------

    def _read_replies(self) -> None:
        try:
            self._read_replies_until_closed()
        except BaseException as error:  # the futures would never complete: fail them
            logger.exception("reading the workers' replies failed")
            self._fail(error)

    def _read_replies_until_closed(self) -> None:
        while not self._closing.is_set():
            if not self._reply_socket.poll(int(POLL_INTERVAL_S * 1000)):
                continue
            reply = decode_reply(self._reply_socket.recv())
            if reply.error is not None:
                self._fail(RuntimeError(reply.error))
                continue
            with self._lock:
                call = self._calls.get(reply.call_id)
                if call is None:
                    continue
                call.replies[reply.rank] = reply
                if not call.expected <= call.replies.keys():
                    continue
                del self._calls[reply.call_id]
            call.future.set_result(_result(call, reply.call_id))

    def _watch_workers(self) -> None:
        while not self._closing.wait(POLL_INTERVAL_S):
            for process in self.processes:
                code = process.poll()
                if code is not None and not self._closing.is_set():
                    self._fail(RuntimeError(f"worker pid {process.pid} exited with {code}"))
                    return

    def _fail(self, error: BaseException) -> None:
        with self._lock:
            if self._failure is not None:
                return
            self._failure = error
            calls, self._calls = self._calls, {}
        logger.error("executor failed: %s", error)
        for call in calls.values():
            call.future.set_exception(error)
        if self._failure_callback is not None:
            self._failure_callback(error)

    # ---- shutdown --------------------------------------------------------------------

    def shutdown(self) -> None:
        """Ask the workers to leave, kill those that do not in time, free the sockets."""
        if self._closing.is_set():
            return
        self._closing.set()
        if self._failure is None:
            with contextlib.suppress(zmq.ZMQError):
                self._call_socket.send(encode_call(next(self._call_ids), Shutdown()), zmq.NOBLOCK)
        deadline = time.monotonic() + (0.0 if self._failure is not None else SHUTDOWN_GRACE_S)
        for process in self.processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=max(deadline - time.monotonic(), 0.0))
        for process in self.processes:
            if process.poll() is None:
                process.kill()
            process.wait()
        for thread in getattr(self, "_threads", []):
            thread.join()
        for sock in (self._call_socket, self._reply_socket):
            sock.close(linger=0)
        self._zmq.term()
        shutil.rmtree(self._socket_dir, ignore_errors=True)
        self._rendezvous = None  # its port closes with it


def _result(call: _Call, call_id: int) -> Any:
    replies = call.replies
    if call.kind is ProfileMemory:
        return [replies[rank].memory for rank in sorted(replies)]
    if call.kind in (ExecuteModel, SampleTokens):
        (reply,) = (replies[rank] for rank in call.expected)
        if reply.pending_request_ids is not None:
            return PendingSample(None, reply.pending_request_ids, step=call_id)
        return reply.output
    return None
