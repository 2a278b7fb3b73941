"""The engine core: request state, KV-cache manager, scheduler and the step loop."""
