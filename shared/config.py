"""Env-driven configuration: a frozen msgspec Struct filled from `SF_*` variables.

    class GatewayConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
        port: int = 8000

    cfg = load(GatewayConfig, prefix="SF_GATEWAY_")   # reads SF_GATEWAY_PORT

Every field has a default that runs on one laptop. Unknown `SF_<PREFIX>*` variables
are an error, so a typo does not silently fall back to a default.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, TypeVar

import msgspec

T = TypeVar("T", bound=msgspec.Struct)


class ConfigError(ValueError):
    pass


def load(tp: type[T], prefix: str, env: Mapping[str, str] | None = None, **overrides: Any) -> T:
    env = os.environ if env is None else env
    fields = {f.name: f for f in msgspec.structs.fields(tp)}
    raw: dict[str, Any] = {}
    for key, value in env.items():
        if not key.startswith(prefix):
            continue
        name = key[len(prefix):].lower()
        if name not in fields:
            known = ", ".join(prefix + n.upper() for n in fields)
            raise ConfigError(f"unknown setting {key}; known: {known}")
        raw[name] = value
    raw.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return msgspec.convert(raw, tp, strict=False)
    except msgspec.ValidationError as e:
        raise ConfigError(f"bad {prefix}* setting: {e}") from None


class Connections(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Where NATS and Redis are, with optional credentials. Read from SF_NATS_*/SF_REDIS_*."""

    nats_url: str = "nats://127.0.0.1:4222"
    nats_user: str = ""
    nats_password: str = ""
    nats_token: str = ""
    nats_creds: str = ""  # path to a .creds file
    redis_url: str = "redis://127.0.0.1:6379/0"

    def redacted(self) -> dict[str, str]:
        """For logs: never prints a password or token."""
        return {"nats_url": _redact_url(self.nats_url), "redis_url": _redact_url(self.redis_url)}


def _redact_url(url: str) -> str:
    if "@" not in url:
        return url
    scheme, _, rest = url.partition("://")
    return f"{scheme}://***@{rest.rsplit('@', 1)[1]}"


def connections(env: Mapping[str, str] | None = None) -> Connections:
    env = os.environ if env is None else env
    picked = {k: v for k, v in env.items() if k.startswith(("SF_NATS_", "SF_REDIS_"))}
    mapped = {k.replace("SF_", "SF_CONN_", 1): v for k, v in picked.items()}
    return load(Connections, prefix="SF_CONN_", env=mapped)


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def log_level(default: str = "INFO", env: Mapping[str, str] | None = None) -> str:
    """SF_LOG_LEVEL (DEBUG, INFO, WARNING, ERROR) for every service's root logger."""
    level = (os.environ if env is None else env).get("SF_LOG_LEVEL", default).upper()
    if level not in LOG_LEVELS:
        raise ConfigError(f"SF_LOG_LEVEL={level!r}: choose one of {', '.join(LOG_LEVELS)}")
    return level
