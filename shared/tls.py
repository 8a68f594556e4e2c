"""TLS for the services' clients of NATS and Redis, from SF_NATS_TLS_* / SF_REDIS_TLS_* (shared/config.py).

    ctx = client_context(conn.nats_tls)           # nats.connect(tls=ctx): bus.connect does it
    kwargs = redis_kwargs(conn.redis_tls)         # redis-py's ssl_* arguments: shared/redissentinel.py

A CA file turns TLS on: the server's certificate must be signed by it and name the host the client
dials (the URL's host; `seamlessflow up --tls` signs for localhost, 127.0.0.1 and this machine's
name). A client certificate and key are sent to servers that verify clients. This module knows
nothing about where the files come from; it never reads or logs their contents beyond loading them.
"""

from __future__ import annotations

import ssl
from typing import Any

from shared.config import ConfigError, TlsFiles


def client_context(files: TlsFiles) -> ssl.SSLContext:
    """A client context that verifies the server against `files.ca` (and its host name), with the
    client certificate loaded if one is given. A file that is not PEM is a ConfigError naming it."""
    try:
        ctx = ssl.create_default_context(cafile=files.ca)
    except (ssl.SSLError, OSError) as e:
        raise ConfigError(f"{files.setting}_CA={files.ca}: not a readable PEM CA file ({e})") from None
    if files.cert:
        try:
            ctx.load_cert_chain(files.cert, files.key)
        except (ssl.SSLError, OSError) as e:
            raise ConfigError(f"{files.setting}_CERT/{files.setting}_KEY: the certificate {files.cert} and its key "
                              f"do not load as a PEM pair ({e.__class__.__name__})") from None
    return ctx


def redis_kwargs(files: TlsFiles | None) -> dict[str, Any]:
    """redis-py's connection arguments for TLS ({} when off); its SSLConnection verifies the host name."""
    if files is None:
        return {}
    client_context(files)  # the same errors, at construction, as NATS gives: not at the first command
    return {"ssl_ca_certs": files.ca, "ssl_certfile": files.cert or None, "ssl_keyfile": files.key or None,
            "ssl_cert_reqs": "required", "ssl_check_hostname": True}
