"""The frontend's gRPC face: frontend.v1.GenerationService, health and reflection."""
