"""The frontend's side of the engine services: one gRPC channel per engine address, health
and load tracking, least-loaded routing with retries, and the protobuf conversion."""
