"""The engine core in its own process: ZMQ sockets on two threads around the busy loop."""
