"""A Prometheus endpoint for services that have no HTTP server of their own (trajectory manager,
rollout worker, scheduler): `GET http://<host>:<port>/metrics` on a background thread.

Each service owns its CollectorRegistry (two services in one test process must not collide);
what it holds is the service's business (today the bus counters of shared/deadletter.py).
"""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, start_http_server

log = logging.getLogger(__name__)


class Endpoint:
    """`serve`'s server: `port` (0 when off), `close()` (idempotent)."""

    def __init__(self, server=None):
        self.server = server
        self.port = server.server_port if server is not None else 0

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None


def serve(registry: CollectorRegistry, port: int, host: str = "127.0.0.1") -> Endpoint:
    """Serve `registry` on `port` (0 = off). A busy port must not stop the service: it is logged,
    and the endpoint is off."""
    if not port:
        return Endpoint()
    try:
        server, _ = start_http_server(port, addr=host, registry=registry)
    except OSError as e:
        log.warning("Prometheus metrics off: cannot listen on %s:%d: %s", host, port, e)
        return Endpoint()
    return Endpoint(server)
