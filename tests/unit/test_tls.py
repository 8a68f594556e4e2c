"""SF_NATS_TLS_* / SF_REDIS_TLS_*: parsed into Connections, refused at load with the setting named,
turned into redis-py's TLS connections by the shared helpers, and what `up --tls` gives its services.
No server here: tests/integration/test_tls.py connects to real ones."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from redis.asyncio.connection import SSLConnection
from redis.asyncio.sentinel import SentinelManagedSSLConnection

from seamlessflow.stack import Stack, StackOptions, client_env, servers
from seamlessflow.stack.tls import TlsFiles as StackTls
from shared.config import ConfigError, TlsFiles, connections
from shared.redisline import RedisLine
from shared.redissentinel import pool_from_url, sentinel_for, parse
from shared.tls import client_context, redis_kwargs


@pytest.fixture
def files(tmp_path) -> dict[str, str]:
    out = {}
    for name in ("ca.crt", "client.crt", "client.key"):
        (tmp_path / name).write_text("not checked at load: only that it is there\n")
        out[name] = str(tmp_path / name)
    return out


def test_no_tls_settings_mean_no_tls():
    conn = connections({})
    assert conn.nats_tls is None and conn.redis_tls is None
    assert redis_kwargs(None) == {}


def test_a_ca_turns_tls_on_and_a_client_certificate_is_optional(files):
    conn = connections({"SF_NATS_TLS_CA": files["ca.crt"], "SF_REDIS_TLS_CA": files["ca.crt"],
                        "SF_REDIS_TLS_CERT": files["client.crt"], "SF_REDIS_TLS_KEY": files["client.key"]})
    assert conn.nats_tls == TlsFiles("SF_NATS_TLS", files["ca.crt"])
    assert conn.redis_tls == TlsFiles("SF_REDIS_TLS", files["ca.crt"], files["client.crt"], files["client.key"])


@pytest.mark.parametrize("env, message", [
    ({"SF_NATS_TLS_CA": "ca.crt", "SF_NATS_TLS_CERT": "client.crt"}, "SF_NATS_TLS_CERT is set without SF_NATS_TLS_KEY"),
    ({"SF_REDIS_TLS_CA": "ca.crt", "SF_REDIS_TLS_KEY": "client.key"}, "SF_REDIS_TLS_KEY is set without SF_REDIS_TLS_CERT"),
    ({"SF_NATS_TLS_CERT": "client.crt", "SF_NATS_TLS_KEY": "client.key"}, "SF_NATS_TLS_CERT is set without SF_NATS_TLS_CA"),
    ({"SF_REDIS_TLS_CA": "missing.crt"}, r"SF_REDIS_TLS_CA=\S*missing.crt: no such file"),
    ({"SF_NATS_TLS_CA": "ca.crt", "SF_NATS_TLS_CERT": "client.crt", "SF_NATS_TLS_KEY": "gone.key"},
     r"SF_NATS_TLS_KEY=\S*gone.key: no such file"),
    ({"SF_REDIS_TLS_CA": "ca.crt", "SF_REDIS_URL": "unix:///run/redis.sock"}, "TLS needs a TCP URL"),
])
def test_settings_that_cannot_work_are_refused_at_load_by_name(files, tmp_path, env, message):
    env = {k: v if v.startswith("unix:") else str(tmp_path / v) for k, v in env.items()}
    with pytest.raises(ConfigError, match=message):
        connections(env)


def test_a_file_that_is_not_pem_is_refused_with_its_setting(files):
    with pytest.raises(ConfigError, match="SF_NATS_TLS_CA=.*not a readable PEM CA file"):
        client_context(TlsFiles("SF_NATS_TLS", files["ca.crt"]))
    with pytest.raises(ConfigError, match="SF_REDIS_TLS_CA"):
        redis_kwargs(TlsFiles("SF_REDIS_TLS", files["ca.crt"]))  # at construction, not at the first command


def test_the_redis_helpers_make_tls_connections(tmp_path):
    certs = _certs(tmp_path)
    tls = connections(certs.settings()).redis_tls
    plain = pool_from_url("redis://127.0.0.1:1/0")
    assert not issubclass(plain.connection_class, SSLConnection)
    pool = pool_from_url("redis://127.0.0.1:1/0", tls=tls)
    assert issubclass(pool.connection_class, SSLConnection)
    kw = pool.connection_kwargs
    assert (kw["ssl_ca_certs"], kw["ssl_certfile"], kw["ssl_keyfile"]) == (str(certs.ca), str(certs.client_cert),
                                                                           str(certs.client_key))
    url = "redis+sentinel://127.0.0.1:1,127.0.0.1:2/sf"
    sentinel_pool = pool_from_url(url, tls=tls)
    assert issubclass(sentinel_pool.connection_class, SentinelManagedSSLConnection)
    assert sentinel_for(parse(url), tls=tls).sentinel_kwargs["ssl_ca_certs"] == str(certs.ca)
    assert RedisLine.from_url("rediss://127.0.0.1:1/0") is None  # redis-py's, with the system's CAs
    assert RedisLine.from_url("rediss://127.0.0.1:1/0", tls=tls) is not None


def test_the_servers_of_up_tls_speak_only_tls_and_verify_clients(tmp_path):
    certs = StackTls(tmp_path)
    nats = servers.nats_argv(4222, tmp_path / "n", tls=certs)
    assert {"--tls", "--tlsverify"} <= set(nats) and nats[nats.index("--tlscacert") + 1] == str(certs.ca)
    redis = servers.redis_argv(6379, tmp_path / "r", tls=certs)
    assert redis[redis.index("--port") + 1] == "0" and redis[redis.index("--tls-port") + 1] == "6379"
    assert redis[redis.index("--tls-auth-clients") + 1] == "yes"
    assert "--tls-port" not in servers.redis_argv(6379, tmp_path / "r")


def test_up_tls_gives_its_services_and_the_cli_the_settings(tmp_path):
    stack = Stack(StackOptions(model=tmp_path / "model", data_dir=tmp_path, tls=True))
    stack._certificates()
    got = stack.client_settings()
    assert got["SF_NATS_URL"].startswith("tls://") and got["SF_REDIS_URL"].startswith("rediss://")
    assert got["SF_REDIS_TLS_KEY"] == str(tmp_path / "tls" / "client.key")
    assert connections(got).nats_tls is not None
    (tmp_path / "stack.json").write_text(json.dumps(stack.public_urls()))
    assert client_env(tmp_path) == got  # no logins: none were made here
    # a Redis of your own: --tls is for the NATS the stack starts; yours keeps your settings
    mixed = Stack(StackOptions(model=tmp_path / "model", data_dir=tmp_path, tls=True, external_redis="redis://r:6379/0"))
    mixed._certificates()
    assert "SF_REDIS_TLS_CA" not in mixed.client_settings() and "SF_NATS_TLS_CA" in mixed.client_settings()
    neither = Stack(StackOptions(model=Path("m"), data_dir=tmp_path, tls=True, external_nats="nats://n:4222",
                                 external_redis="redis://r:6379/0"))
    with pytest.raises(Exception, match="--tls secures the NATS and Redis the stack starts"):
        neither._certificates()


def _certs(tmp_path: Path) -> StackTls:
    from seamlessflow.stack.tls import ensure

    return ensure(tmp_path / "tls")


def test_up_takes_tls(tmp_path):
    import argparse

    from seamlessflow import cli

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    p = argparse.ArgumentParser()
    cli._up_args(p)
    base = ["--model", str(tmp_path / "m"), "--data-dir", str(tmp_path / "var")]
    assert cli._stack_options(p.parse_args([*base, "--tls"])).tls is True
    assert cli._stack_options(p.parse_args(base)).tls is False


def test_tls_certs_makes_a_server_certificate_for_the_hosts_named(tmp_path, capsys):
    import shutil
    import subprocess

    from seamlessflow.cli import main

    if shutil.which("openssl") is None:
        pytest.skip("no openssl command")
    main(["tls-certs", str(tmp_path / "certs"), "--host", "nats", "--host", "10.0.0.7"])
    files = StackTls(tmp_path / "certs")
    san = subprocess.run(["openssl", "x509", "-in", str(files.server_cert), "-noout", "-ext", "subjectAltName"],
                         capture_output=True, text=True, check=True).stdout
    assert "DNS:nats" in san and "IP Address:10.0.0.7" in san and "DNS:localhost" in san
    assert files.client_key.stat().st_mode & 0o777 == 0o600
    assert "nats" in capsys.readouterr().out
