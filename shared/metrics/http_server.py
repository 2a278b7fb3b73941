"""The Prometheus endpoint: a service's registry on http://HOST:PORT/metrics, served from a
daemon thread so a slow scrape never holds up the asyncio loop.

Always the classic text format (0.0.4), whatever the scraper's Accept header asks: under
OpenMetrics negotiation prometheus_client (0.26) writes `vllm:x` samples as `vllm_x`
(prometheus/client_python#1177), and vLLM's dashboards query the names with colons."""

from __future__ import annotations

import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest

logger = logging.getLogger(__name__)

METRICS_PATH = "/metrics"


class MetricsServer:
    """Started on construction; `close()` stops it. Port 0 takes a free port (see `port`)."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int) -> None:
        handler = type("Handler", (_MetricsHandler,), {"registry": registry})
        self._server = ThreadingHTTPServer((host, port), handler)
        self._server.daemon_threads = True
        self.host = host
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="metrics-http", daemon=True
        )
        self._thread.start()
        logger.info("Prometheus metrics on %s", self.url)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}{METRICS_PATH}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5.0)


def start_metrics_server(registry: CollectorRegistry, host: str, port: int) -> MetricsServer | None:
    """The endpoint, or None (logged as an error) when the port cannot be bound: a service
    still serves without metrics, and Prometheus reports the target down."""
    try:
        return MetricsServer(registry, host, port)
    except OSError as error:
        logger.error("no metrics: cannot serve them on %s:%d: %s", host, port, error)
        return None


class _MetricsHandler(BaseHTTPRequestHandler):
    registry: CollectorRegistry  # set on the subclass each server makes

    def do_GET(self) -> None:
        if self.path.split("?", 1)[0] != METRICS_PATH:
            self.send_error(404, f"metrics are on {METRICS_PATH}")
            return
        body = generate_latest(self.registry)
        self.send_response(200)
        self.send_header("Content-Type", CONTENT_TYPE_PLAIN_0_0_4)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        logger.debug("metrics request: " + format, *args)
