"""Prometheus metrics for the agent API, served on the admin port at /metrics.

Each Gateway owns its own CollectorRegistry (two gateways in one test process
must not collide). Routes are labelled by their template ("/v1/sessions/{id}"),
never by the raw path, so label cardinality stays bounded.
"""

from __future__ import annotations

import time

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60)


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("sf_gateway_requests_total", "HTTP requests answered",
                                ["method", "route", "status"], registry=r)
        self.latency = Histogram("sf_gateway_request_seconds", "Time to the end of the response",
                                 ["method", "route"], buckets=_LATENCY_BUCKETS, registry=r)
        self.in_flight = Gauge("sf_gateway_in_flight_requests", "Requests being served", registry=r)
        self.ttft = Histogram("sf_gateway_time_to_first_token_seconds",
                              "Request start to the first generated text (or the whole answer)",
                              ["kind"], buckets=_TTFT_BUCKETS, registry=r)
        self.tokens = Counter("sf_gateway_tokens_total", "Tokens in answered turns", ["type"], registry=r)
        self.cancels = Counter("sf_gateway_cancels_total", "Turns the gateway cancelled upstream",
                               ["reason"], registry=r)  # disconnect | timeout | shutdown | error

    def render(self) -> bytes:
        return generate_latest(self.registry)


class MetricsMiddleware:
    """Counts, times and gauges every HTTP request, streaming ones until their last byte."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        m = self.metrics
        status = 500  # if the app raises before answering
        start = time.perf_counter()

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        m.in_flight.inc()
        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            m.in_flight.dec()
            route = getattr(scope.get("route"), "path", None) or "unmatched"
            m.requests.labels(scope["method"], route, str(status)).inc()
            m.latency.labels(scope["method"], route).observe(time.perf_counter() - start)
