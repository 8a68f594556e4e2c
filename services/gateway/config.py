"""Gateway settings, read from `SF_GATEWAY_*` (connections come from `SF_NATS_*`/`SF_REDIS_*`).

    SF_GATEWAY_API_KEYS=sk-a,sk-b SF_GATEWAY_ADMIN_KEY=... python -m services.gateway
"""

from __future__ import annotations

from typing import Literal

import msgspec

from shared import timeouts
from shared.config import load


class GatewayConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    host: str = "127.0.0.1"
    port: int = 8000  # the agent API (OpenAI formats, sessions)
    admin_port: int = 8001  # admin API and /metrics; never expose it to agents
    # Idle HTTP keep-alive. Longer than clients' own pool expiry (httpx, so the openai SDK: 5 s),
    # so a client never reuses a connection the gateway is closing at that moment.
    keepalive_timeout: float = 75.0
    model: str = "seamlessflow-tiny"  # the one served model name
    api_keys: str = ""  # comma-separated static user keys (may be empty: keys then come from /admin/keys)
    admin_key: str = ""  # empty: every admin endpoint but /healthz answers 401
    max_body_bytes: int = 1024 * 1024
    # Longer than the trajectory manager's own waits (shared/timeouts.py), so that it times out
    # first and the agent hears the real cause.
    first_token_timeout: float = timeouts.AGENT_FIRST_TOKEN  # seconds from the request to its first generated text
    idle_timeout: float = timeouts.AGENT_IDLE  # seconds between two pieces of generated text
    # The trajectory manager sends a keepalive (an empty ChatDelta) every second while it
    # serves a turn. Silence this long means that replica died: the gateway re-sends the same
    # request_id, and another replica resumes it from Redis, at most `resend_attempts` times.
    silence_timeout: float = 5.0
    resend_attempts: int = 2
    worker_stale_after: float = timeouts.HEARTBEAT_STALE_AFTER  # /admin/workers lists workers heard from this recently
    session_timeout: float = 10.0  # seconds for one session request/reply
    max_tokens_default: int = 256  # chat completions without max_tokens
    max_context: int = 2048  # quick check only; the trajectory manager does the exact one
    # Limits per tenant (a user key with the session keys it minted), per gateway process; 0 = off;
    # a key minted with its own (POST /admin/keys) overrides them. One training job is one tenant of
    # up to thousands of agents, each with at most one turn in flight. The defaults admit 8,192 turns
    # in flight (4,096 agents twice over) and 20,000 requests/s (4,096 agents each with a turn every
    # half second and their sessions' share send ~11,000/s); one gateway process on a 2-core box
    # serves ~1,200 requests/s (bench/load.py, 500 agents of one key: ~880 turns/s, no 429), so they
    # stop only a runaway client (429 with Retry-After past them).
    rate_limit: float = 20000.0  # requests per second (a token bucket)
    rate_burst: int = 40000  # requests at once after a quiet spell
    max_concurrent: int = 8192  # turns (chat, completions, responses) in flight
    # The size of one turn; 0 = off. A larger one is a 400 naming the field.
    max_messages: int = 2048  # messages (or input items) in one request
    max_tools: int = 128  # tools in one request (OpenAI's own limit)
    max_tokens_limit: int = 32768  # the largest max_tokens / max_completion_tokens / max_output_tokens
    # the longest prompt in tokens, checked by the trajectory manager (which tokenizes); 0 = the
    # model's context window only
    max_prompt_tokens: int = 0
    redis_timeout: float = 2.0  # socket timeout per Redis call, so an outage answers 503 fast
    # under load, how long a Redis call waits in line for one of the pool's connections; past it, 503
    # `overloaded` (2 s, the socket timeout, failed 25 key lookups at 1,000 agents: BENCHMARKS.md)
    redis_pool_wait: float = 5.0
    key_cache_seconds: float = 2.0  # a key found in Redis is trusted this long without asking again (0: never)
    session_key_ttl: int = 7 * 24 * 3600  # seconds a session API key (and a stored response) stays valid
    # the status page (/ui) shows the trainer's reward and staleness from its Prometheus metrics
    # (SF_TRAINER_METRICS_PORT, 9401 by default); "" = don't scrape
    trainer_metrics_url: str = "http://127.0.0.1:9401/metrics"
    # uvicorn's HTTP/1.1 parser: httptools (C, llhttp) or h11 (pure Python; BENCHMARKS.md compares them)
    http: Literal["httptools", "h11"] = "httptools"

    def static_keys(self) -> list[str]:
        return [k.strip() for k in self.api_keys.split(",") if k.strip()]


def load_config(**overrides) -> GatewayConfig:
    return load(GatewayConfig, "SF_GATEWAY_", **overrides)
