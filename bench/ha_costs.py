"""What no single point of failure costs per operation (issue 30), side by side in one run:

1. a durable publish on TRAJECTORIES (the trajectory manager's finish) with the stream at R1 and at
   R3, on one local 3-server JetStream cluster (the R1 stream on the same cluster);
2. a trajectory turn's save (session create + save_turn, the trajectory store's real code) without
   WAIT and with WAIT for 1 replica, on a local primary + replica + 3 sentinels.

Rounds alternate the two sides so a busy machine's drift falls on both. Sequential calls: latency,
not throughput. Local processes on one machine (no network between replicas): the floor of the
cost, not a cluster's.

    python -m bench.ha_costs [--n 400] [--rounds 4]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from seamlessflow.stack.servers import NatsCluster, RedisSentinels
from services.trajectory.store import Store
from services.trajectory.turns import Segment, Turn
from shared import bus, subjects
from shared.config import Connections


def summary(name: str, ms: list[float]) -> str:
    q = statistics.quantiles(ms, n=100)
    return f"{name:<22} median {statistics.median(ms):6.2f} ms  p99 {q[98]:7.2f} ms  ({len(ms)} calls)"


async def nats_side(root: Path, n: int, rounds: int) -> dict[str, list[float]]:
    cluster = NatsCluster(root / "nats", 3).start()
    nc = await bus.connect(Connections(nats_url=cluster.url), "bench")
    js = nc.jetstream()
    out: dict[str, list[float]] = {"publish R1": [], "publish R3": []}
    try:
        base = next(s for s in subjects.streams(replicas=1) if s.name == subjects.TRAJECTORIES_STREAM)
        for r in (1, 3):
            cfg = replace(base, name=f"BENCH_R{r}", subjects=[f"bench.r{r}"], num_replicas=r)
            for _ in range(100):
                try:
                    await js.add_stream(cfg)
                    break
                except Exception:  # the cluster is still electing its meta leader
                    await asyncio.sleep(0.2)
        payload = random.Random(0).randbytes(16_000)  # ~ one finished session's TrajectoryCompleted
        for k in range(rounds):
            for r in (1, 3):
                for i in range(n):
                    t = time.perf_counter()
                    await bus.publish_durable(js, f"bench.r{r}", payload, f"{k}-{i}", retry_for=10)
                    out[f"publish R{r}"].append((time.perf_counter() - t) * 1000)
    finally:
        await bus.wait_closed(nc)
        cluster.stop()
    return out


async def redis_side(root: Path, n: int, rounds: int) -> dict[str, list[float]]:
    group = RedisSentinels(root / "redis").start()
    stores = {"turn, no WAIT": Store.connect(group.url, 3600),
              "turn, WAIT 1": Store.connect(group.url, 3600, wait=(1, 1000))}
    out: dict[str, list[float]] = {k: [] for k in stores}
    rng = random.Random(0)
    try:
        while not (await stores["turn, WAIT 1"].r.info("replication")).get("connected_slaves"):
            await asyncio.sleep(0.2)
        for k in range(rounds):
            for name, store in stores.items():
                for i in range(n):
                    ids = [rng.randrange(5, 500) for _ in range(300)]
                    turn = Turn(turn_id=0, parent=-1, prefix_ids=ids[:100],
                                segments=[Segment(ids[100:], [-1.0] * 200, 0, "w0")], finish_reason="length",
                                request_id=f"{name}-{k}-{i}", created=time.time())
                    t = time.perf_counter()
                    sid = await store.create_session(f"g{k}-{i}", {})
                    await store.save_turn(sid, turn, "w0")
                    out[name].append((time.perf_counter() - t) * 1000)
        out["WAIT timed out"] = [float(stores["turn, WAIT 1"].under_replicated)]
    finally:
        for s in stores.values():
            await s.close()
        group.stop()
    return out


async def main(n: int, rounds: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        nats = await nats_side(Path(tmp), n, rounds)
        redis = await redis_side(Path(tmp), n, rounds)
    for name, ms in {**nats, **redis}.items():
        if name == "WAIT timed out":
            print(f"WAIT timed out short of its replica: {int(ms[0])} times")
        else:
            print(summary(name, ms))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=400, help="calls per side per round")
    ap.add_argument("--rounds", type=int, default=4)
    a = ap.parse_args()
    asyncio.run(main(a.n, a.rounds))
