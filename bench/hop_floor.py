"""The floor under a turn's control-plane CPU: the same hops with nothing done at each.

    .venv/bin/python bench/hop_floor.py                          # 1 and 64 concurrent, side by side
    .venv/bin/python bench/hop_floor.py --concurrency 1 --requests 1000

A turn through SeamlessFlow crosses, at the gateway and the trajectory manager, a fixed chain of
messages: the agent's HTTP POST, NATS to the trajectory manager, a Redis call (lookup), NATS to a
rollout worker and its GenerateDone back, a Redis call (save), NATS back to the gateway, the HTTP
response. This bench runs that chain with the same libraries and settings (uvicorn with httptools
on uvloop, nats-py through shared/bus.py, the pipelined Redis line, msgspec) and no work between the
hops: its "gateway" is a bare ASGI function that forwards the body and returns the reply; its
"trajectory manager" does one Redis script call, sends a fixed Generate to the worker, does a
second call and answers. No auth, validation, chat template, tokenizer, prefix tree, recording,
metrics or leases. What a hop costs the operating system and the event loop, it costs here too.

It runs beside the real stack of this checkout (bench/gateway_overhead.py's side), each side with
its own NATS, Redis and SIMULATED engine (services/rollout/simulated.py, never real inference), started
the same way, and alternates between them round by round, so both see the same machine (a third
path, NATS straight to the worker as in gateway_overhead.py, gives the latency each adds). The
table gives CPU ms per turn for each process and the floor's share of the real figure: what is
left above the floor is what the services do per turn; the floor itself moves only with fewer
hops or a cheaper runtime.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FLOOR_CHAT = "floor.chat"
WORKER = "rollout-0"


# -- the floor's two processes ----------------------------------------------------------------------

def gateway_role(nats_url: str, port: int) -> None:
    """A bare ASGI app on uvicorn (httptools, uvloop): POST body -> NATS request -> response."""
    import uvicorn

    from shared import bus
    from shared.config import Connections

    state: dict = {}

    async def app(scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    state["nc"] = await bus.connect(Connections(nats_url=nats_url), name="floor-gateway")
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await state["nc"].close()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        async with bus.stream_request(state["nc"], FLOOR_CHAT, body, 60, 60) as replies:
            reply = await anext(replies)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(reply)).encode())]})
        await send({"type": "http.response.body", "body": reply})

    print("floor gateway ready", flush=True)
    uvicorn.run(app, host="127.0.0.1", port=port, http="httptools", loop="uvloop", log_level="warning",
                access_log=False)


def trajectory_role(nats_url: str, redis_url: str, prompt_ids: list[int], max_tokens: int) -> None:
    """NATS request -> Redis call -> Generate to the worker, until its GenerateDone -> Redis call -> reply."""
    import uvloop

    from shared import bus
    from shared.codec import decode, encode
    from shared.config import Connections
    from shared.messages import Generate, GenerateDone, RolloutReply, Sampling
    from shared.redisline import RedisLine

    async def main() -> None:
        nc = await bus.connect(Connections(nats_url=nats_url), name="floor-trajectory")
        line = RedisLine.from_url(redis_url)
        lookup = line.script("return redis.call('INCR', KEYS[1])")
        save = line.script("return redis.call('SET', KEYS[1], ARGV[1])")
        tasks: set[asyncio.Task] = set()

        async def turn(reply_to: str) -> None:
            n = await lookup(keys=["floor:n"])
            cmd = Generate(uuid.uuid4().hex, prompt_ids, Sampling(max_tokens=max_tokens, temperature=0.0))
            async with bus.stream_request(nc, f"sf.rollout.gen.{WORKER}", encode(cmd), 60, 60) as replies:
                async for data in replies:
                    if isinstance(done := decode(data, RolloutReply), GenerateDone):
                        break
            await save(keys=[f"floor:t:{n}"], args=[encode(done)])
            await nc.publish(reply_to, b'{"ok":true,"n":%d}' % n)

        async def on_chat(msg) -> None:
            task = asyncio.create_task(turn(msg.reply))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

        await nc.subscribe(FLOOR_CHAT, cb=on_chat)
        print("floor trajectory ready", flush=True)
        await asyncio.Event().wait()

    uvloop.run(main())


# -- the run --------------------------------------------------------------------------------------

async def run(args) -> list[dict]:
    import httpx
    from transformers import AutoTokenizer

    import gateway_overhead as go
    from seamlessflow.modelgen import init_model

    tmp = Path(tempfile.mkdtemp(prefix="sf-floor-"))
    model = args.model or init_model(tmp / "model")
    tok = AutoTokenizer.from_pretrained(model)
    messages = [{"role": "user", "content": "hello world, please reverse 12345"}]
    prompt_ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                            add_special_tokens=False)
    go_args = argparse.Namespace(engine="simulated", concurrency=args.concurrency, turns=0, profile=None)
    real = go.start_side("services", None, model, tmp, go_args)
    floor_stack = go.start_side("floor", None, model, tmp, go_args)  # its NATS, Redis and engine; services unused
    port = _spawn_floor(floor_stack, prompt_ids, args.max_tokens)
    rows: list[dict] = []
    try:
        await go.connect(real, max(args.concurrency), go_args)
        limits = httpx.Limits(max_connections=max(args.concurrency) + 8)
        floor_http = httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=120, limits=limits)

        async def floor_turn() -> float:
            t0 = time.perf_counter()
            r = await floor_http.post("/v1/chat/completions", json={"model": go.MODEL_NAME, "messages": messages,
                                                                   "max_tokens": args.max_tokens})
            r.raise_for_status()
            return time.perf_counter() - t0

        async def real_turn(i: int) -> float:
            return (await real.chat(real.keys[i], messages, args.max_tokens))[0]

        for _ in range(3):
            await floor_turn()
            await real_turn(0)
        sides = {"services": (real, real_turn), "floor": (floor_stack, lambda i: floor_turn()),
                 "direct": (real, lambda i: real.direct(prompt_ids, args.max_tokens))}  # no control plane
        for conc in args.concurrency:
            lat, cpu = await _measure(sides, conc, max(conc, args.requests // args.rounds), args.rounds)
            for name in ("services", "floor"):
                turns = len(lat[name])
                row = {"side": name, "concurrency": conc, "turns": turns,
                       "p50_ms": round(1000 * statistics.median(lat[name]), 2),
                       "added_p50_ms": round(1000 * (statistics.median(lat[name]) - statistics.median(lat["direct"])), 2),
                       **{f"{n}_cpu_ms_per_turn": round(1000 * cpu[name, n] / turns, 3) for n in ("gateway", "trajectory")}}
                rows.append(row)
                print(json.dumps(row), flush=True)
        await floor_http.aclose()
        await real.http.aclose()
        await real.nc.close()
    finally:
        real.stack.stop()
        floor_stack.stack.stop()
    return rows


def _spawn_floor(floor_stack, prompt_ids: list[int], max_tokens: int) -> int:
    """The floor's gateway and trajectory processes on the floor side's NATS and Redis; their gateway's port."""
    from seamlessflow.stack import servers

    me = Path(__file__).resolve()
    port = servers.free_port()
    s = floor_stack.stack
    gw = s.spawn("floor-gateway", [sys.executable, str(me), "--role", "gateway", "--nats", s.nats_url,
                                   "--port", str(port)], ready="floor gateway ready")
    tr = s.spawn("floor-trajectory", [sys.executable, str(me), "--role", "trajectory", "--nats", s.nats_url,
                                      "--redis", s.redis_url, "--prompt", json.dumps(prompt_ids),
                                      "--max-tokens", str(max_tokens)], ready="floor trajectory ready")
    s.wait_ready(gw)
    s.wait_ready(tr)
    floor_stack.pids = {"gateway": gw.popen.pid, "trajectory": tr.popen.pid}
    return port


async def _measure(sides: dict, conc: int, per_round: int, rounds: int) -> tuple[dict, dict]:
    """Each side's turn latencies and its gateway's and trajectory manager's CPU seconds: `rounds`
    rounds of `per_round` turns at `conc` at once, the sides taking turns."""
    lat = {k: [] for k in sides}
    cpu = {(k, n): 0.0 for k in sides for n in ("gateway", "trajectory")}
    for _ in range(rounds):
        for name, (side, turn) in sides.items():
            queue = list(range(per_round))

            async def loop(i: int, turn=turn, queue=queue, name=name) -> None:
                while queue:
                    queue.pop()
                    lat[name].append(await turn(i))

            c0 = side.cpu()
            await asyncio.gather(*(loop(i) for i in range(conc)))
            for n, c in side.cpu().items():
                cpu[name, n] += c - c0[n]
    return lat, cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--role", choices=["gateway", "trajectory"], help=argparse.SUPPRESS)
    ap.add_argument("--nats", help=argparse.SUPPRESS)
    ap.add_argument("--redis", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--prompt", help=argparse.SUPPRESS)
    ap.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 64])
    ap.add_argument("--requests", type=int, default=512, help="turns per side per concurrency level")
    ap.add_argument("--rounds", type=int, default=4, help="alternating rounds")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--model", type=lambda s: Path(s).resolve(), help="a checkpoint directory (default: the tiny model, built in a temp dir)")
    args = ap.parse_args()
    if args.role == "gateway":
        return gateway_role(args.nats, args.port)
    if args.role == "trajectory":
        return trajectory_role(args.nats, args.redis, json.loads(args.prompt), args.max_tokens)
    sys.path.insert(0, str(ROOT / "bench"))
    os.chdir(tempfile.mkdtemp(prefix="sf-floor-cwd-"))
    rows = asyncio.run(run(args))
    print("\n| side | concurrency | p50 ms (added to direct) | CPU ms per turn: gateway + trajectory = total "
          "| of the services' |")
    print("|---|---|---|---|---|")
    by = {(r["side"], r["concurrency"]): r for r in rows}
    for r in rows:
        total = r["gateway_cpu_ms_per_turn"] + r["trajectory_cpu_ms_per_turn"]
        real = by["services", r["concurrency"]]
        share = total / (real["gateway_cpu_ms_per_turn"] + real["trajectory_cpu_ms_per_turn"])
        print(f"| {r['side']} | {r['concurrency']} | {r['p50_ms']} ({r['added_p50_ms']}) | {r['gateway_cpu_ms_per_turn']} + "
              f"{r['trajectory_cpu_ms_per_turn']} = {total:.3f} | {share:.2f} |")


if __name__ == "__main__":
    main()
