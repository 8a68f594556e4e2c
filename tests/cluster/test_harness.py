"""The namespace cluster itself: isolation, reachability, link shaping, and clean-up after a failure."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.cluster.netns import PREFIX, Cluster, ShapingUnavailable, sweep_stale, unavailable_reason
from tests.cluster.servers import start_nats, start_redis

pytestmark = pytest.mark.cluster

PY = sys.executable
ROOT = Path(__file__).resolve().parents[2]


def _leftovers(tag: str) -> list[str]:
    """Namespaces, links and base dirs whose name carries this cluster's tag."""
    ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    dirs = [str(p) for p in Path("/var/tmp").glob(f"{PREFIX}-{tag[len(PREFIX):]}")]
    return [line for line in (ns + links).splitlines() if tag in line] + dirs


def test_nats_and_redis_on_host0_are_reached_by_address_not_loopback(cluster):
    c = cluster(2)
    h0, h1 = c.hosts
    nats_url, redis_url = start_nats(h0), start_redis(h0)
    probe = textwrap.dedent(f"""
        import asyncio, socket, nats, redis
        async def main():
            nc = await nats.connect("{nats_url}", connect_timeout=3, max_reconnect_attempts=0)
            await nc.publish("sfc.probe", b"x"); await nc.flush(); await nc.close()
        asyncio.run(main())
        assert redis.Redis.from_url("{redis_url}", socket_timeout=3).ping()
        print("by address: ok")
        for port in (4222, 6379):
            try:
                socket.create_connection(("127.0.0.1", port), 2)
                print("loopback", port, "REACHED")
            except OSError:
                print("loopback", port, "refused")
    """)
    r = h1.run([PY, "-c", probe], env={"PYTHONPATH": str(ROOT)}, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "by address: ok" in r.stdout
    assert "loopback 4222 refused" in r.stdout and "loopback 6379 refused" in r.stdout, r.stdout


def test_hosts_share_no_data_path(cluster):
    c = cluster(2)
    h0, h1 = c.hosts
    r0 = h0.run(["sh", "-c", f"echo secret > {h0.root}/var/own && echo t > /tmp/mine && ls /tmp"])
    assert r0.returncode == 0, r0.stderr
    r1 = h1.run(["sh", "-c", f"cat {h0.root}/var/own; ls -A {h0.root}; ls -A /tmp; touch {h0.root}/x"])
    assert "secret" not in r1.stdout and "mine" not in r1.stdout, r1.stdout
    assert "Read-only file system" in r1.stderr, r1.stderr  # nothing can be written there either
    assert (h0.root / "var" / "own").read_text() == "secret\n"  # the driver sees every root


def test_link_shape_limits_bandwidth(cluster):
    c = cluster(2)
    try:
        applied = c.shape(rate_mbit=8)
    except ShapingUnavailable as e:
        pytest.skip(str(e))
    h0, h1 = c.hosts
    server = h0.popen([PY, "-c", textwrap.dedent(f"""
        import socket, time
        s = socket.socket(); s.bind(("{h0.addr}", 5555)); s.listen(1)
        conn, _ = s.accept(); b = conn.recv(65536); t0 = time.perf_counter(); n = len(b)
        while (b := conn.recv(65536)): n += len(b)
        print(n, time.perf_counter() - t0)
    """)], stdout=subprocess.PIPE, text=True)
    time.sleep(0.5)
    r = h1.run([PY, "-c", textwrap.dedent(f"""
        import socket, time
        for _ in range(50):
            try: s = socket.create_connection(("{h0.addr}", 5555), 1); break
            except OSError: time.sleep(0.1)
        s.sendall(b"x" * 1_500_000); s.close()
    """)], timeout=60)
    assert r.returncode == 0, r.stderr
    n, secs = server.communicate(timeout=30)[0].split()
    # received over the link: 1.5 MB at 8 Mbit/s is 1.5 s; unshaped, the same transfer takes milliseconds
    assert int(n) == 1_500_000
    assert float(secs) > 1.0, (applied, secs)


def test_cleans_up_after_a_failure():
    if why := unavailable_reason():
        pytest.skip(f"no namespace cluster here: {why}")
    # 1. an exception inside the block: processes, namespaces, links and roots all go
    c = Cluster(2)
    with pytest.raises(RuntimeError, match="boom"):
        with c:
            p = c.hosts[1].popen(["sleep", "300"])
            assert _leftovers(c.tag)
            raise RuntimeError("boom")
    assert _leftovers(c.tag) == []
    assert p.poll() is not None

    # 2. a driver killed outright (no finally runs): the next cluster's creation sweeps its leftovers
    script = textwrap.dedent("""
        import sys, time
        from tests.cluster.netns import Cluster
        c = Cluster(2); c.__enter__(); c.hosts[0].popen(["sleep", "300"])
        print(c.tag, flush=True); time.sleep(300)
    """)
    driver = subprocess.Popen([PY, "-c", script], cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                              stdout=subprocess.PIPE, text=True)
    tag = driver.stdout.readline().strip()
    assert tag and _leftovers(tag), "the driver made no cluster"
    driver.send_signal(signal.SIGKILL)
    driver.wait(10)
    assert _leftovers(tag), "leftovers expected until the sweep"
    removed = sweep_stale()
    assert any(tag in r for r in removed), removed
    assert _leftovers(tag) == []


def test_a_partition_cuts_one_host_off_and_heal_brings_it_back(cluster):
    c = cluster(3)
    h0, h1, h2 = c.hosts
    start_nats(h0)
    probe = [PY, "-c", f"import socket; socket.create_connection(({h0.addr!r}, 4222), 2).close(); print('reached')"]

    def reaches(h) -> bool:
        r = h.run(probe, timeout=30)
        return r.returncode == 0 and "reached" in r.stdout

    assert reaches(h1) and reaches(h2)
    with c.partitioned(1):
        assert not reaches(h1)  # cut off: the connection attempt times out
        assert reaches(h2)  # the other hosts keep their links
    assert reaches(h1)
    c.cut(2)
    try:
        assert not reaches(h2) and reaches(h1)
    finally:
        c.heal(2)
    assert reaches(h2)
