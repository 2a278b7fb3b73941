"""The engine process's two I/O threads: socket -> decode -> input queue, and output queue ->
encode -> socket, so (de)serialization overlaps the forward pass instead of delaying it."""

from __future__ import annotations

import logging
import queue
import threading

import msgspec
import zmq

from engine_svc.control_messages import RequestRejected
from engine_svc.proc.wire import (
    EngineInput,
    EngineOutput,
    OutputType,
    RequestType,
    decode_request,
    encode_output,
    request_id_of,
)

logger = logging.getLogger(__name__)

# How long closing waits for queued outputs (the last ones, ENGINE_CORE_DEAD among them)
# to reach the client before the process exits anyway.
CLOSE_LINGER_MS = 2000
CLOSE_TIMEOUT_S = 5.0

OutputItem = tuple[OutputType, EngineOutput]


class EngineIO:
    """Owns the ZMQ sockets; each socket lives on the one thread that uses it."""

    def __init__(self, input_address: str, output_address: str, engine_index: int) -> None:
        self.engine_index = engine_index
        self.input_queue: queue.Queue[tuple[RequestType, EngineInput]] = queue.Queue()
        self._output_queue: queue.Queue[OutputItem | None] = queue.Queue()
        self._context = zmq.Context()
        self._input_thread = threading.Thread(
            target=self._receive_loop, args=(input_address,), name="engine-input", daemon=True
        )
        self._output_thread = threading.Thread(
            target=self._send_loop, args=(output_address,), name="engine-output", daemon=True
        )

    def start(self) -> None:
        self._input_thread.start()
        self._output_thread.start()

    def send(self, output_type: OutputType, payload: EngineOutput) -> None:
        self._output_queue.put((output_type, payload))

    def close(self) -> None:
        """Send what is queued, then stop both threads."""
        self._output_queue.put(None)
        self._output_thread.join(CLOSE_TIMEOUT_S)
        # Terminating the context makes the input thread's blocking recv return ETERM, and
        # waits (up to the linger) for the output socket's last messages to leave.
        self._context.term()
        self._input_thread.join(CLOSE_TIMEOUT_S)

    def _receive_loop(self, address: str) -> None:
        socket = self._context.socket(zmq.PULL)
        socket.connect(address)
        try:
            while True:
                self._enqueue(socket.recv_multipart())
        except zmq.ContextTerminated:
            pass
        finally:
            socket.close(linger=0)

    def _enqueue(self, frames: list[bytes]) -> None:
        try:
            self.input_queue.put(decode_request(frames))
        except (msgspec.DecodeError, ValueError, IndexError, KeyError) as error:
            # A request that does not decode is that request's problem, not the engine's.
            request_id = request_id_of(frames[1]) if len(frames) > 1 else None
            is_add = bool(frames and frames[0] == bytes([RequestType.ADD]))
            if is_add and request_id is not None:
                self.send(OutputType.REJECTED, RequestRejected(request_id, "request", str(error)))
            else:
                logger.warning("dropped a message that does not decode: %s", error)

    def _send_loop(self, address: str) -> None:
        socket = self._context.socket(zmq.PUSH)
        socket.connect(address)
        try:
            while (item := self._output_queue.get()) is not None:
                output_type, payload = item
                socket.send_multipart(encode_output(output_type, self.engine_index, payload))
        except zmq.ContextTerminated:
            pass
        finally:
            socket.close(linger=CLOSE_LINGER_MS)
