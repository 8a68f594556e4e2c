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
    # TLS: a CA file turns it on (the server's certificate must be signed by it); a client certificate
    # and its key are for servers that verify clients (nats-server --tlsverify, Redis tls-auth-clients)
    nats_tls_ca: str = ""
    nats_tls_cert: str = ""
    nats_tls_key: str = ""
    redis_tls_ca: str = ""
    redis_tls_cert: str = ""
    redis_tls_key: str = ""

    @property
    def nats_tls(self) -> TlsFiles | None:
        """SF_NATS_TLS_*: None when TLS to NATS is off (no CA given)."""
        return _tls_files("SF_NATS_TLS", self.nats_tls_ca, self.nats_tls_cert, self.nats_tls_key)

    @property
    def redis_tls(self) -> TlsFiles | None:
        """SF_REDIS_TLS_*: None when TLS to Redis is off (no CA given)."""
        return _tls_files("SF_REDIS_TLS", self.redis_tls_ca, self.redis_tls_cert, self.redis_tls_key)

    @property
    def nats_servers(self) -> list[str]:
        """SF_NATS_URL as nats-py's `servers`: one URL, or a comma-separated list of a cluster's seeds."""
        return nats_servers(self.nats_url)

    def redacted(self) -> dict[str, str]:
        """For logs: never prints a password or token."""
        return {"nats_url": _redact_url(self.nats_url), "redis_url": _redact_url(self.redis_url)}


class TlsFiles(msgspec.Struct, frozen=True):
    """A client's TLS files (paths), checked at load (`check_tls`); `shared/tls.py` makes the context."""

    setting: str  # the variables' prefix, e.g. SF_NATS_TLS: errors name SF_NATS_TLS_CA, ..._CERT, ..._KEY
    ca: str
    cert: str = ""  # "" = no client certificate: the server is verified, the client is not
    key: str = ""


def _tls_files(setting: str, ca: str, cert: str, key: str) -> TlsFiles | None:
    return TlsFiles(setting, ca, cert, key) if ca else None


def check_tls(conn: Connections) -> None:
    """A clear error, naming the setting, for TLS settings that cannot work: a certificate without its
    key (or a key without its certificate), either without a CA, a file that is not there."""
    for setting, ca, cert, key in (("SF_NATS_TLS", conn.nats_tls_ca, conn.nats_tls_cert, conn.nats_tls_key),
                                   ("SF_REDIS_TLS", conn.redis_tls_ca, conn.redis_tls_cert, conn.redis_tls_key)):
        if cert and not key:
            raise ConfigError(f"{setting}_CERT is set without {setting}_KEY: give the client certificate's key")
        if key and not cert:
            raise ConfigError(f"{setting}_KEY is set without {setting}_CERT: give the client certificate")
        if cert and not ca:
            raise ConfigError(f"{setting}_CERT is set without {setting}_CA: the CA file turns TLS on")
        for name, path in (("CA", ca), ("CERT", cert), ("KEY", key)):
            if path and not os.path.isfile(path):
                raise ConfigError(f"{setting}_{name}={path}: no such file")
    if conn.redis_tls_ca and conn.redis_url.startswith("unix://"):
        raise ConfigError("SF_REDIS_TLS_CA is set but SF_REDIS_URL is a unix:// socket: TLS needs a TCP URL")


def nats_servers(url: str) -> list[str]:
    """`nats://a:4222,nats://b:4222` -> ["nats://a:4222", "nats://b:4222"] (blanks dropped)."""
    servers = [u.strip() for u in url.split(",") if u.strip()]
    if not servers:
        raise ConfigError("SF_NATS_URL is empty")
    return servers


def jetstream_replicas(env: Mapping[str, str] | None = None) -> int:
    """SF_JETSTREAM_REPLICAS: how many servers keep each stream (1 by default; 3 on a 3-node cluster).
    Used when a stream is created; an existing stream keeps its own (bus.ensure_streams)."""
    raw = (os.environ if env is None else env).get("SF_JETSTREAM_REPLICAS", "1").strip()
    if not raw.isdigit() or not 1 <= int(raw) <= 5:
        raise ConfigError(f"SF_JETSTREAM_REPLICAS={raw!r}: a whole number from 1 to 5 (JetStream's limit)")
    return int(raw)


def _redact_url(url: str) -> str:
    if "," in url:
        return ",".join(_redact_url(u) for u in url.split(","))
    if "@" not in url:
        return url
    scheme, _, rest = url.partition("://")
    return f"{scheme}://***@{rest.rsplit('@', 1)[1]}"


def connections(env: Mapping[str, str] | None = None) -> Connections:
    env = os.environ if env is None else env
    picked = {k: v for k, v in env.items() if k.startswith(("SF_NATS_", "SF_REDIS_"))}
    mapped = {k.replace("SF_", "SF_CONN_", 1): v for k, v in picked.items()}
    conn = load(Connections, prefix="SF_CONN_", env=mapped)
    check_tls(conn)
    return conn


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def log_level(default: str = "INFO", env: Mapping[str, str] | None = None) -> str:
    """SF_LOG_LEVEL (DEBUG, INFO, WARNING, ERROR) for every service's root logger."""
    level = (os.environ if env is None else env).get("SF_LOG_LEVEL", default).upper()
    if level not in LOG_LEVELS:
        raise ConfigError(f"SF_LOG_LEVEL={level!r}: choose one of {', '.join(LOG_LEVELS)}")
    return level
