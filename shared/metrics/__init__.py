"""Prometheus metrics both services export: vLLM's metric names (so vLLM dashboards work),
go-grpc-prometheus's gRPC server metrics, and the /metrics HTTP endpoint. Each service builds
them on a CollectorRegistry of its own; nothing here is global."""
