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
TURN_ROUTES = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses"})


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
        self.turns = Counter("sf_gateway_turns_total", "Agent turns answered with HTTP 200 (chat, completions, responses)",
                             registry=r)
        self.sessions = Counter("sf_gateway_sessions_total", "Sessions created and finished through this gateway",
                                ["event"], registry=r)  # created | finished
        self.rewards = Histogram("sf_gateway_session_reward", "Rewards agents reported (reward and finish)",
                                 buckets=(-1, -0.5, 0, 0.25, 0.5, 0.75, 1, 2, 5), registry=r)
        for event in ("created", "finished"):
            self.sessions.labels(event)
        # the TRAJECTORIES stream (read at each scrape): back-pressure closes admission at its high-water mark
        self.stream_fill_ratio = Gauge("sf_trajectories_fill_ratio",
                                       "TRAJECTORIES stream fill: the fuller of bytes and messages over its limit",
                                       registry=r)
        self.stream_bytes = Gauge("sf_trajectories_bytes", "Bytes in the TRAJECTORIES stream", registry=r)
        self.stream_messages = Gauge("sf_trajectories_messages", "Messages in the TRAJECTORIES stream", registry=r)
        self.trainer_lag = Gauge("sf_trainer_consumer_lag", "Trajectories the trainer has not acknowledged "
                                 "(undelivered + held until a checkpoint); -1 without a trainer consumer",
                                 ["part"], registry=r)  # pending | ack_pending | total

        self._children: dict[tuple, object] = {}

    def child(self, metric, *labels: str):
        """`metric.labels(*labels)`, resolved once per label values: prometheus-client validates the values
        and takes a lock at every `labels` call (~5 of them per turn were 2-3% of the gateway's CPU)."""
        try:
            return self._children[metric, labels]
        except KeyError:
            child = self._children[metric, labels] = metric.labels(*labels)
            return child

    def stream_fill(self, fill) -> None:
        self.stream_fill_ratio.set(fill.fraction)
        self.stream_bytes.set(fill.bytes)
        self.stream_messages.set(fill.msgs)
        for part, value in (("pending", fill.pending), ("ack_pending", fill.ack_pending), ("total", fill.lag)):
            self.trainer_lag.labels(part).set(value)

    def value(self, name: str, labels: dict[str, str] | None = None) -> float:
        """One sample's current value (0 if never set), e.g. for the status page's rates. Collects only
        the metric that has the sample: the whole registry (histograms and all) cost the gateway ~6 ms
        a second at each heartbeat-driven read."""
        collector = getattr(self.registry, "_names_to_collectors", {}).get(name)  # prometheus-client's own index
        if collector is None:
            return self.registry.get_sample_value(name, labels or {}) or 0.0
        for family in collector.collect():
            for sample in family.samples:
                if sample.name == name and sample.labels == (labels or {}):
                    return sample.value
        return 0.0

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
            m.child(m.requests, scope["method"], route, str(status)).inc()
            if status == 200 and route in TURN_ROUTES:
                m.turns.inc()
            m.child(m.latency, scope["method"], route).observe(time.perf_counter() - start)
