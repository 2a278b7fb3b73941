"""The engine's gRPC face: engine.v1.EngineCoreService over the asyncio engine client."""
