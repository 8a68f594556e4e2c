"""TLS to NATS and Redis (SF_NATS_TLS_*, SF_REDIS_TLS_*): real servers that require TLS and verify
clients, with the certificates `seamlessflow up --tls` makes. A client with the CA and a client
certificate gets through (NATS request/reply; Redis through every client the services build); a
plain-text client, one that does not trust the CA and one without a client certificate are refused.

    .venv/bin/pytest tests/integration/test_tls.py
"""

from __future__ import annotations

import asyncio
import ssl
import stat

import nats
import pytest
import redis
from nats.aio.msg import Msg
from redis.backoff import NoBackoff
from redis.retry import Retry

from services.gateway.store import KeyStore
from services.scheduler.store import Store as SchedulerStore
from services.trajectory.store import Store
from seamlessflow.stack import client_env, servers, tls
from seamlessflow.stack.servers import RedisSentinels
from shared import bus
from shared.config import Connections, connections
from shared.redisline import RedisLine
from shared.redissentinel import client_from_url, pool_from_url
from shared.tls import client_context, redis_kwargs
from tests.integration.stack_fixture import make_stack, one_turn

pytestmark = pytest.mark.integration
NO_RETRY = dict(connect_timeout=2, allow_reconnect=False, max_reconnect_attempts=0)


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return tls.ensure(tmp_path_factory.mktemp("tls") / "tls")


@pytest.fixture(scope="module")
def servers_tls(tmp_path_factory, certs):
    root = tmp_path_factory.mktemp("tls-servers")
    pn, pr = servers.free_port(), servers.free_port()
    n = servers.start_nats(pn, root / "nats", log_file=root / "nats.log", tls=certs)
    r = servers.start_redis(pr, root / "redis", tls=certs)
    yield pn, pr, root / "nats.log"
    servers.stop(n)
    servers.stop(r)


def conn_for(certs, pn: int, pr: int, client_cert: bool = True) -> Connections:
    env = {"SF_NATS_URL": f"tls://127.0.0.1:{pn}", "SF_REDIS_URL": f"redis://127.0.0.1:{pr}/0",
           **certs.settings()}
    if not client_cert:
        env = {k: v for k, v in env.items() if not k.endswith(("_CERT", "_KEY"))}
    return connections(env)


def test_the_stack_makes_its_certificates_once_with_private_keys(certs):
    for key in (certs.server_key, certs.client_key, certs.dir / "ca.key"):
        assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert stat.S_IMODE(certs.dir.stat().st_mode) == 0o700
    before = {p.name: p.read_bytes() for p in certs.dir.iterdir()}
    assert tls.ensure(certs.dir) == certs
    assert {p.name: p.read_bytes() for p in certs.dir.iterdir()} == before  # reused, not made again
    certs.client_cert.unlink()
    tls.ensure(certs.dir)
    assert certs.client_cert.exists() and certs.ca.read_bytes() == before["ca.crt"]


async def test_nats_over_tls_round_trips_and_refuses_what_it_must(servers_tls, certs):
    pn, pr, nats_log = servers_tls
    nc = await bus.connect(conn_for(certs, pn, pr), "tls-test", connect_timeout=3)
    try:
        async def echo(msg: Msg) -> None:  # nats-py awaits its callbacks: a coroutine function
            await msg.respond(b"echo:" + msg.data)

        await nc.subscribe("sf.test.tls", cb=echo)
        reply = await nc.request("sf.test.tls", b"hello", timeout=3)
        assert reply.data == b"echo:hello"
        got: asyncio.Queue[bytes] = asyncio.Queue()

        async def keep(msg: Msg) -> None:
            await got.put(msg.data)

        await nc.subscribe("sf.test.tls.pub", cb=keep)
        await nc.publish("sf.test.tls.pub", b"one")
        assert await asyncio.wait_for(got.get(), 3) == b"one"
    finally:
        await nc.close()

    # refused, each on its first try (bus.connect would try again for ever, as for a NATS that is down)
    # plain text: the server asks for TLS, and nats-py's own context does not trust the stack's CA
    with pytest.raises(ssl.SSLCertVerificationError):
        await nats.connect(f"nats://127.0.0.1:{pn}", **NO_RETRY)
    # the CA but no client certificate: the server (--tlsverify) ends the handshake; the client hears
    # of it as TLS 1.3's alert or as the connection closed, whichever its next read or write meets first
    with pytest.raises((ssl.SSLError, ConnectionError)):
        nc = await nats.connect(f"tls://127.0.0.1:{pn}",
                                tls=client_context(conn_for(certs, pn, pr, client_cert=False).nats_tls), **NO_RETRY)
        await nc.flush(timeout=2)
    assert "client didn't provide a certificate" in nats_log.read_text()


async def test_a_client_that_does_not_trust_the_ca_is_refused(servers_tls, certs, tmp_path):
    pn, pr, _ = servers_tls
    other = tls.ensure(tmp_path / "other")  # another stack's CA: the server's certificate is not its
    env = {"SF_NATS_URL": f"nats://127.0.0.1:{pn}", "SF_REDIS_URL": f"redis://127.0.0.1:{pr}/0",
           **{k: v for k, v in other.settings().items() if k.endswith("_CA")},
           **{k: v for k, v in certs.settings().items() if not k.endswith("_CA")}}
    conn = connections(env)
    with pytest.raises(ssl.SSLCertVerificationError):
        await nats.connect(f"tls://127.0.0.1:{pn}", tls=client_context(conn.nats_tls), **NO_RETRY)
    client = client_from_url(conn.redis_url, conn.redis_tls, socket_connect_timeout=2)
    with pytest.raises(redis.ConnectionError, match="certificate verify failed|CERTIFICATE_VERIFY_FAILED"):
        await client.ping()
    await client.aclose()


async def test_a_tls_client_refuses_a_nats_that_does_not_ask_for_tls(tmp_path, certs):
    port = servers.free_port()
    plain = servers.start_nats(port, tmp_path / "nats")
    try:
        with pytest.raises(bus.BusUnavailable, match="does not use TLS"):
            await bus.connect(conn_for(certs, port, 1), "tls-test", connect_timeout=2)
    finally:
        servers.stop(plain)


def test_redis_refuses_plain_text_and_clients_without_a_certificate(servers_tls, certs):
    _, pr, _ = servers_tls
    once = dict(socket_timeout=1, socket_connect_timeout=1, retry=Retry(NoBackoff(), 0))
    with pytest.raises(redis.ConnectionError):  # it waits for a handshake that never comes: a timeout
        redis.Redis(port=pr, **once).ping()
    no_cert = redis.Redis(port=pr, ssl=True, ssl_ca_certs=str(certs.ca), **once)
    with pytest.raises(redis.ConnectionError):
        no_cert.ping()
    ok = redis.Redis(port=pr, ssl=True, ssl_ca_certs=str(certs.ca), ssl_certfile=str(certs.client_cert),
                     ssl_keyfile=str(certs.client_key), socket_timeout=2)
    assert ok.ping()


async def test_every_redis_client_of_the_services_speaks_tls(servers_tls, certs):
    pn, pr, _ = servers_tls
    conn = conn_for(certs, pn, pr)
    # the shared helpers, as a `redis://` URL with SF_REDIS_TLS_* and as a `rediss://` one
    for url in (conn.redis_url, conn.redis_url.replace("redis://", "rediss://")):
        client = client_from_url(url, conn.redis_tls, socket_timeout=3)
        await client.set("sf:test:tls", url)
        assert (await client.get("sf:test:tls")).decode() == url
        await client.aclose()
        pooled = redis.asyncio.Redis.from_pool(pool_from_url(url, tls=conn.redis_tls, max_connections=2, timeout=3))
        assert (await pooled.get("sf:test:tls")).decode() == url
        await pooled.aclose()
        line = RedisLine.from_url(url, timeout=3, connect_timeout=3, tls=conn.redis_tls)
        assert line is not None
        assert await line.execute("SET", "sf:test:line", "v") == b"OK"
        assert await line.execute("GET", "sf:test:line") == b"v"
        await line.close()
    # the services' stores, as the services build them
    store = Store.connect(conn.redis_url, ttl=60, tls=conn.redis_tls)
    assert store.line is not None
    assert await store.r.ping()
    await store.close()
    sched = SchedulerStore.connect(conn.redis_url, tls=conn.redis_tls)
    assert await sched.r.ping()
    await sched.close()
    keys = KeyStore(conn.redis_url, [], timeout=2.0, session_ttl=60, tls=conn.redis_tls)
    assert await keys.redis.ping()
    await keys.redis.aclose()
    # without the settings the same URL is plain text, which the server refuses
    plain = client_from_url(conn.redis_url, socket_timeout=2, socket_connect_timeout=2)
    with pytest.raises(redis.ConnectionError):
        await plain.ping()
    await plain.aclose()


@pytest.fixture(scope="module")
def tls_stack(tmp_path_factory, tiny_model):
    s = make_stack(tmp_path_factory.mktemp("tls-stack"), tiny_model, "", "", workers=1, simulated=True,
                   nats_port=servers.free_port(), redis_port=servers.free_port(), tls=True)
    yield s
    s.stop()


def test_up_with_tls_runs_every_service_over_tls(tls_stack):
    """`seamlessflow up --tls`: its NATS and Redis speak only TLS, every service it starts gets the
    settings (a turn goes through gateway, trajectory manager and worker), the CLI's way in
    (client_env) carries them, and no key appears in stack.json, a process title or a log."""
    stack = tls_stack
    one_turn(stack)

    env = client_env(stack.data)
    assert env["SF_NATS_URL"].startswith("tls://") and env["SF_REDIS_URL"].startswith("rediss://")
    assert env["SF_NATS_TLS_CA"] == str(stack.data / "tls" / "ca.crt")
    conn = connections(env)

    async def nats_round_trip() -> None:
        nc = await bus.connect(conn, "tls-cli", connect_timeout=3)
        await nc.flush(timeout=3)
        await nc.close()

    asyncio.run(nats_round_trip())
    assert redis.Redis.from_url(conn.redis_url, **redis_kwargs(conn.redis_tls), socket_timeout=3).ping()
    with pytest.raises(redis.ConnectionError):
        redis.Redis(port=stack.o.redis_port, socket_timeout=1, socket_connect_timeout=1,
                    retry=Retry(NoBackoff(), 0)).ping()

    keys = [f.read_text() for f in (stack.data / "tls").glob("*.key")]
    assert len(keys) == 4  # CA, server, route, client: no key of them may appear in a log
    texts = {"stack.json": (stack.data / "stack.json").read_text()}
    for p in stack.procs:
        if p.popen.poll() is None:
            texts[f"cmdline of {p.name}"] = open(f"/proc/{p.popen.pid}/cmdline", "rb").read().decode(errors="replace")
    for log in stack.logs.rglob("*.log"):
        texts[str(log)] = log.read_text(errors="replace")
    body = [k.split("-----")[2].strip().splitlines()[0] for k in keys]  # the first line of each key's base64
    assert not [(where, b[:6]) for where, text in texts.items() for b in body if b in text]


async def test_redis_behind_sentinel_over_tls(tmp_path, certs):
    """The sentinels and the primary are reached over TLS (SentinelManagedSSLConnection, the
    sentinels' own TLS client): every client the services build, to a redis+sentinel:// URL."""
    group = RedisSentinels(tmp_path, replicas=1, sentinels=1, tls=certs).start()
    try:
        conn = connections({"SF_REDIS_URL": group.url, **certs.settings()})
        assert group.primary()[1] == group.data_ports[0]
        client = client_from_url(conn.redis_url, conn.redis_tls, socket_timeout=3, socket_connect_timeout=3)
        await client.set("sf:test:sentinel", "tls")
        await client.aclose()
        pooled = redis.asyncio.Redis.from_pool(pool_from_url(conn.redis_url, tls=conn.redis_tls, max_connections=2,
                                                             timeout=3, socket_connect_timeout=3))
        assert await pooled.get("sf:test:sentinel") == b"tls"
        await pooled.aclose()
        line = RedisLine.from_url(conn.redis_url, timeout=3, connect_timeout=3, tls=conn.redis_tls)
        assert await line.execute("GET", "sf:test:sentinel") == b"tls"
        await line.close()
        replica = redis.Redis(port=group.data_ports[1], socket_timeout=3, **redis_kwargs(conn.redis_tls), ssl=True)
        for _ in range(50):  # replication runs over TLS too (a replica dials its primary with the client cert)
            if replica.get("sf:test:sentinel") == b"tls":
                break
            await asyncio.sleep(0.1)
        assert replica.get("sf:test:sentinel") == b"tls"
        with pytest.raises(redis.ConnectionError):  # a sentinel speaks only TLS too
            redis.Redis(port=group.sentinel_ports[0], socket_timeout=1, socket_connect_timeout=1,
                        retry=Retry(NoBackoff(), 0)).ping()
    finally:
        group.stop()


async def route_hello(port: int, certs, cert=None) -> bytes:
    """A TLS connection to a route port presenting `cert` (a TlsFiles certificate; None: none); its first line."""
    ctx = ssl.create_default_context(cafile=str(certs.ca))
    if cert is not None:
        ctx.load_cert_chain(str(cert), str(cert.with_suffix(".key")))
    reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port, ssl=ctx), 3)
    try:
        return await asyncio.wait_for(reader.readline(), 3)
    finally:
        writer.close()


async def test_a_nats_cluster_speaks_tls_between_its_members_too(tmp_path, certs):
    """Three nats-servers (NatsCluster(tls=...)): a route port speaks TLS only and verifies the peer,
    which must present a certificate for client use signed by the CA (the route certificate; the
    server certificate, serverAuth only, is refused); the members still form one JetStream cluster
    over those routes (a stream at 3 replicas, every replica current, read back through another member)."""
    cluster = servers.NatsCluster(tmp_path / "nats", 3, log_dir=tmp_path, tls=certs).start()
    try:
        port = cluster.cluster_ports[0]
        assert (await route_hello(port, certs, certs.route_cert)).startswith(b"INFO ")
        for cert in (None, certs.server_cert):
            with pytest.raises((ssl.SSLError, ConnectionError)):
                await route_hello(port, certs, cert)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        assert await asyncio.wait_for(reader.read(100), 5) == b""  # plain text: closed, not a byte in the clear
        writer.close()
        urls = cluster.url.split(",")
        assert all(u.startswith("tls://") for u in urls)
        nc = await bus.connect(connections({"SF_NATS_URL": urls[0], **certs.settings(redis=False)}), "tls-r", connect_timeout=3)
        try:
            js = nc.jetstream(timeout=5)
            await js.add_stream(name="TLSR3", subjects=["sf.test.r3"], num_replicas=3)
            for _ in range(100):  # every replica current: the routes carry the stream's raft traffic
                info = await js.stream_info("TLSR3")
                if info.cluster and len(info.cluster.replicas or []) == 2 and all(
                        r.current for r in info.cluster.replicas):
                    break
                await asyncio.sleep(0.1)
            assert [r.current for r in info.cluster.replicas] == [True, True], info.cluster
            await js.publish("sf.test.r3", b"over tls routes")
        finally:
            await nc.close()
        nc = await bus.connect(connections({"SF_NATS_URL": urls[2], **certs.settings(redis=False)}), "tls-r2", connect_timeout=3)
        try:
            assert (await nc.jetstream(timeout=5).get_msg("TLSR3", seq=1)).data == b"over tls routes"
        finally:
            await nc.close()
    finally:
        cluster.stop()
