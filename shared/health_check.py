"""`python -m shared.health_check`: ask a server's grpc.health.v1 once and exit 0 if SERVING.

The Kubernetes probe for servers that speak TLS: the kubelet's own gRPC probe has no TLS, so a
pod under TLS runs this as an exec probe, with the pod's own certificate for mutual TLS.

    python -m shared.health_check --address localhost:50061 --service engine.v1.EngineCoreService \\
        --tls-ca-file /etc/duoserve/tls/ca.crt \\
        --tls-cert-file /etc/duoserve/tls/tls.crt --tls-key-file /etc/duoserve/tls/tls.key
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shared.grpc_tls import ClientTLS, TLSConfigError, add_client_arguments, client_tls

SERVING = health_pb2.HealthCheckResponse.SERVING


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m shared.health_check", description=__doc__)
    add = parser.add_argument
    add("--address", default="localhost:50051", help="HOST:PORT (default: %(default)s)")
    add("--service", default="", help="the service to ask about (default: the whole server)")
    add("--timeout", type=float, default=4.0, help="seconds (default: %(default)s)")
    add_client_arguments(parser, "--tls", "the server")
    return parser


def check(address: str, service: str, timeout_s: float, tls: ClientTLS | None) -> str:
    """The server's status name for `service`, or why it could not be asked."""
    channel = (
        grpc.insecure_channel(address)
        if tls is None
        else grpc.secure_channel(address, tls.credentials(), tls.channel_options())
    )
    with channel:
        try:
            response = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
            )
        except grpc.RpcError as error:
            return f"{error.code().name}: {error.details()}"
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(response.status))


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        tls = client_tls(args, "--tls")
    except (OSError, TLSConfigError) as error:
        parser.error(str(error))
    status = check(args.address, args.service, args.timeout, tls)
    print(f"{args.address} {args.service or '(server)'}: {status}")
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main())
