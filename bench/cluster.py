"""The namespace cluster on one machine (tests/cluster/netns.py): what its links carry, and a shell on it.

    sudo .venv/bin/python bench/cluster.py --hosts 2 --rate-mbit 1000 --mb 64      # measure
    sudo .venv/bin/python bench/cluster.py --hosts 4 --hold                          # keep it up

Measure (the default): N hosts, each in its own network namespace with its own data root, links shaped
to `--rate-mbit` (and `--delay-ms` where the kernel has netem); NATS on host-0 at its address. Then
- TCP throughput host-1 -> host-0 over the shaped link, timed at the receiver, beside the line rate;
- NATS request round trip host-1 -> a responder on host-0 (p50, p99 over `--requests`), the hop every
  cross-host message pays.
Prints a markdown table and one JSON line. `--hold` prints each host's address, root and the command
prefix that runs a process on it (ip netns exec ... unshare --mount ...), then waits for Ctrl-C; the
namespaces go when it exits, whatever the reason.

Needs root and iproute2; elsewhere it says why and exits 2. SIMULATED nothing: real sockets, real
nats-server, the kernel's own queueing disciplines (tbf for rate where this kernel has no netem).
"""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import sys
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.cluster.netns import Cluster, ShapingUnavailable, unavailable_reason  # noqa: E402
from tests.cluster.servers import start_nats, wait_port  # noqa: E402

PY = sys.executable

RECEIVER = """
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind((sys.argv[1], 5555)); s.listen(1)
conn, _ = s.accept(); b = conn.recv(1 << 20); t0 = time.perf_counter(); n = len(b)
while (b := conn.recv(1 << 20)): n += len(b)
print(n, time.perf_counter() - t0, flush=True)
"""

SENDER = """
import socket, sys, time
for _ in range(100):
    try: s = socket.create_connection((sys.argv[1], 5555), 1); break
    except OSError: time.sleep(0.1)
chunk = b"x" * (1 << 20)
for _ in range(int(sys.argv[2])): s.sendall(chunk)
s.close()
"""

RESPONDER = """
import asyncio, sys, nats
async def main():
    nc = await nats.connect(sys.argv[1])
    async def echo(m): await m.respond(m.data)
    await nc.subscribe("sfc.echo", cb=echo); await nc.flush(); print("ready", flush=True)
    await asyncio.Event().wait()
asyncio.run(main())
"""

REQUESTER = """
import asyncio, json, sys, time, nats
async def main():
    nc = await nats.connect(sys.argv[1]); n = int(sys.argv[2]); rtt = []
    for _ in range(20): await nc.request("sfc.echo", b"x" * 256, timeout=5)
    for _ in range(n):
        t0 = time.perf_counter(); await nc.request("sfc.echo", b"x" * 256, timeout=5); rtt.append(time.perf_counter() - t0)
    rtt.sort(); print(json.dumps({"p50_ms": rtt[n // 2] * 1e3, "p99_ms": rtt[min(n - 1, int(n * 0.99))] * 1e3}))
    await nc.close()
asyncio.run(main())
"""


def measure(c: Cluster, mb: int, requests: int) -> dict:
    h0, h1 = c.hosts[0], c.hosts[1]
    env = {"PYTHONPATH": str(ROOT)}
    recv = h0.popen([PY, "-c", RECEIVER, h0.addr], env=env, stdout=-1, text=True)
    send = h1.run([PY, "-c", SENDER, h0.addr, str(mb)], env=env, timeout=600)
    if send.returncode != 0:
        raise RuntimeError(f"sender failed: {send.stderr[-2000:]}")
    n, secs = recv.communicate(timeout=600)[0].split()
    gbit = int(n) * 8 / float(secs) / 1e9

    url = start_nats(h0)
    responder = h0.popen([PY, "-c", textwrap.dedent(RESPONDER), url], env=env, stdout=-1, stderr=-3, text=True)
    if responder.stdout.readline().strip() != "ready":
        raise RuntimeError("the NATS responder on host-0 did not start")
    r = h1.run([PY, "-c", textwrap.dedent(REQUESTER), url, str(requests)], env=env, timeout=300)
    if r.returncode != 0:
        raise RuntimeError(f"requester failed: {r.stderr[-2000:]}")
    rtt = json.loads(r.stdout.strip().splitlines()[-1])
    return {"hosts": c.n, "rate_mbit": c.rate_mbit, "delay_ms": c.delay_ms, "shaping": c.shaping or "none",
            "mb": mb, "tcp_gbit_s": round(gbit, 4), "tcp_s": round(float(secs), 3),
            "line_share": round(gbit * 1000 / c.rate_mbit, 3) if c.rate_mbit else None,
            "nats_rtt_p50_ms": round(rtt["p50_ms"], 3), "nats_rtt_p99_ms": round(rtt["p99_ms"], 3)}


def hold(c: Cluster) -> None:
    url = start_nats(c.hosts[0])
    wait_port(c.hosts[0].addr, 4222)
    print(f"cluster {c.tag}: NATS at {url}; links: {c.shaping or 'unshaped'}")
    for h in c.hosts:
        print(f"  {h.name}: {h.addr}  root {h.root}")
        print(f"    run on it: {shlex.join(h.argv(['bash']))}")
    print("Ctrl-C removes it.", flush=True)
    signal.sigwait({signal.SIGINT, signal.SIGTERM})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", type=int, default=2)
    ap.add_argument("--rate-mbit", type=float, default=1000.0, help="each host's outgoing link; 0 = unshaped")
    ap.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay (needs sch_netem in the kernel)")
    ap.add_argument("--mb", type=int, default=64, help="MiB sent host-1 -> host-0")
    ap.add_argument("--requests", type=int, default=200, help="NATS round trips timed")
    ap.add_argument("--hold", action="store_true", help="keep the cluster up until Ctrl-C")
    args = ap.parse_args()
    if args.hosts < 2:
        ap.error("--hosts must be at least 2")
    if why := unavailable_reason():
        print(f"no namespace cluster here: {why}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the with-block's exit removes the cluster
    try:
        with Cluster(args.hosts, rate_mbit=args.rate_mbit, delay_ms=args.delay_ms) as c:
            if args.hold:
                signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
                hold(c)
                return 0
            t0 = time.perf_counter()
            row = measure(c, args.mb, args.requests)
    except ShapingUnavailable as e:
        print(f"cannot shape the links as asked: {e}", file=sys.stderr)
        return 2
    print("| hosts | link | TCP host-1 -> host-0 | share of line rate | NATS request RTT p50 / p99 |")
    print("|---|---|---|---|---|")
    share = f"{row['line_share']:.2f}" if row["line_share"] is not None else "-"
    print(f"| {row['hosts']} | {row['shaping']} | {row['tcp_gbit_s']:.3f} Gbit/s ({row['mb']} MiB in "
          f"{row['tcp_s']:.2f} s) | {share} | {row['nats_rtt_p50_ms']:.3f} / {row['nats_rtt_p99_ms']:.3f} ms |")
    print(json.dumps(row | {"wall_s": round(time.perf_counter() - t0, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
