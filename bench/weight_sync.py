"""Weight sync over an emulated network link: the trainer-to-worker transfer (shared/weightxfer.py,
gloo over TCP, bucketed by layer group) beside today's shared-disk path (write safetensors, read them).

    sudo .venv/bin/python bench/weight_sync.py                          # 10M, 100M, 500M over 1 and 10 Gbit/s
    .venv/bin/python bench/weight_sync.py --sizes 10M --links 1 --repeat 1 --tcp-mb 16   # the smoke run
    sudo .venv/bin/python bench/weight_sync.py --sizes "" --links 0,10   # only the box's TCP ceiling

Two network namespaces joined by a veth pair (10.77.0.1 sends, 10.77.0.2 receives); the sending
end's egress is shaped by `tc tbf` to the link rate. The namespaces are deleted in a `finally`,
whatever happens. Needs root (ip netns); without it the script says so and exits 2.

The model is Llama-shaped (embeddings, layers of attention + MLP + norms, final norm, LM head)
with random bf16 weights: the wire dtype a GPU trainer publishes. Per size and link it reports
the network round (sender side: from the closed join to the last bucket, gathered per layer
group, packed and broadcast) in seconds and GB/s, that time over the line-rate time (goal <= 1.5
for 500M), and the disk path: the sender writing one safetensors file, the receiver reading it
into its tensors (a local disk with a warm page cache here: a lower bound for NFS, which would
cross the same link twice). Result lines start with "RESULT".

The receiver copies each bucket into its own tensors (as a `load_weights` does) and keeps one pool of
two receive buffers, each the largest bucket's size, for all its rounds (`RecvBuffers(min_bytes=...)`):
a copying consumer that stays up. vLLM's layerwise reload keeps the views it is given, so its buffers
are new every bucket, each page faulted in (services/rollout/vllm_ext.py); that is not measured here.

Before the weights, per link, the box's own ceiling: a plain TCP socket across the same veth
pair (`sendall` of a preallocated `--tcp-mb` buffer, `recv_into` a preallocated one, a one-byte
ack at the end; best of 3), "RESULT tcp ...". Link 0 is the veth pair unshaped (no `tc`). On a
2-core box the kernel's copies on both ends share the cores with the transfer, so this is the
fastest any transfer over this link can be here.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

NS_SEND, NS_RECV = "sfws-send", "sfws-recv"
ADDR_SEND, ADDR_RECV = "10.77.0.1", "10.77.0.2"
PORT = 29611  # the sender's store; PORT + 1 the TCP probe's receiver
TCP_TRIES = 3
SIZES = {"10M": (256, 8, 8192), "100M": (768, 8, 32000), "500M": (1536, 14, 32000)}  # hidden, layers, vocab


# -- the model ----------------------------------------------------------------------------------

def llama_shapes(hidden: int, layers: int, vocab: int) -> list[tuple[str, tuple[int, ...]]]:
    ffn = hidden * 8 // 3 // 64 * 64
    out = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (hidden,)), (p + "post_attention_layernorm.weight", (hidden,))]
        out += [(p + f"self_attn.{n}_proj.weight", (hidden, hidden)) for n in "qkvo"]
        out += [(p + "mlp.gate_proj.weight", (ffn, hidden)), (p + "mlp.up_proj.weight", (ffn, hidden)),
                (p + "mlp.down_proj.weight", (hidden, ffn))]
    return out + [("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]


def params_of(size: str) -> int:
    n = 0
    for _, shape in llama_shapes(*SIZES[size]):
        k = 1
        for d in shape:
            k *= d
        n += k
    return n


# -- the two ends (each runs in its namespace) --------------------------------------------------

def run_sender(size: str, repeat: int, bucket_mb: int, workdir: Path) -> None:
    import torch
    from safetensors.torch import save_file

    from shared.weightwire import ParamSpec, make_plan
    from shared.weightxfer import WeightSender

    torch.manual_seed(0)
    shapes = llama_shapes(*SIZES[size])
    tensors = {i: torch.randn(s, dtype=torch.bfloat16) for i, (_, s) in enumerate(shapes)}
    plan = make_plan(1, [ParamSpec(n, "bfloat16", s) for n, s in shapes], bucket_mb << 20)
    sender = WeightSender(ADDR_SEND, PORT, timeout=300)
    rounds, stages = [], []
    for r in range(repeat):
        group = f"{size}-{r}"
        sender.open(plan, group)
        rnd = sender.close_joins(group, expected=1, window=120)
        timings: dict[str, float] = {}
        t0 = time.perf_counter()
        sent = sender.send(rnd, plan, lambda idx: {i: tensors[i] for i in idx}, timings=timings)
        rounds.append(time.perf_counter() - t0)
        stages.append(timings)
        assert rnd.receivers == 1 and sent == plan.nbytes, (rnd, sent)
    path = workdir / f"{size}.safetensors"
    t0 = time.perf_counter()
    save_file({shapes[i][0]: t for i, t in tensors.items()}, str(path))
    os.sync()
    write_s = time.perf_counter() - t0
    sender.store.set("disk/path", str(path))
    read_s = float(sender.store.get("disk/read_s"))
    recv_stages = json.loads(sender.store.get("recv/stages"))
    path.unlink()
    print(json.dumps({"bytes": plan.nbytes, "buckets": len(plan.buckets), "groups": len(plan.groups),
                      "rounds_s": rounds, "stages": stages, "recv_stages": recv_stages,
                      "write_s": write_s, "read_s": read_s}), flush=True)


def run_receiver(size: str, repeat: int) -> None:
    import datetime

    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file

    from shared.weightxfer import RecvBuffers, join, receive

    dest = {n: torch.empty(s, dtype=torch.bfloat16) for n, s in llama_shapes(*SIZES[size])}

    def load(pairs):
        for name, t in pairs:
            dest[name].copy_(t)

    stages = []
    pool: RecvBuffers | None = None  # a copying consumer's one pool for every round
    for r in range(repeat):
        timings: dict[str, float] = {}
        joined = join(ADDR_SEND, PORT, f"{size}-{r}", timeout=300)
        pool = pool or RecvBuffers(2, max((b.nbytes for b in joined.plan.buckets), default=0))
        receive(joined, load, buffers=pool, timings=timings)
        stages.append(timings)
    store = dist.TCPStore(ADDR_SEND, PORT, is_master=False, timeout=datetime.timedelta(seconds=300))
    store.set("recv/stages", json.dumps(stages))
    path = store.get("disk/path").decode()
    t0 = time.perf_counter()
    load(load_file(path).items())
    store.set("disk/read_s", str(time.perf_counter() - t0))


# -- the box's ceiling: a plain TCP socket over the same link -------------------------------------

def tcp_recv(mb: int) -> None:
    import socket

    n = mb << 20
    buf = bytearray(b"\0") * n  # touched: no page faults inside the timing
    view = memoryview(buf)
    with socket.create_server((ADDR_RECV, PORT + 1)) as srv:
        for _ in range(TCP_TRIES):
            conn, _ = srv.accept()
            with conn:
                got = 0
                while got < n:
                    k = conn.recv_into(view[got:], n - got)
                    if not k:
                        raise RuntimeError(f"tcp probe: the sender closed at {got} of {n} bytes")
                    got += k
                conn.sendall(b"k")


def tcp_send(mb: int) -> None:
    import socket

    buf = bytearray(b"Z") * (mb << 20)
    times = []
    for _ in range(TCP_TRIES):
        deadline = time.monotonic() + 30
        while True:
            try:
                sock = socket.create_connection((ADDR_RECV, PORT + 1))
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        with sock:
            t0 = time.perf_counter()
            sock.sendall(buf)
            if sock.recv(1) != b"k":
                raise RuntimeError("tcp probe: no ack")
            times.append(time.perf_counter() - t0)
    print(json.dumps({"bytes": len(buf), "times_s": times}), flush=True)


# -- the orchestration (root, outside the namespaces) -------------------------------------------

def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True)


def make_link(gbit: int) -> None:
    """The veth pair between the two namespaces, the sending end shaped to `gbit` (0: unshaped)."""
    sh("ip", "netns", "add", NS_SEND)
    sh("ip", "netns", "add", NS_RECV)
    sh("ip", "link", "add", "sfws-a", "netns", NS_SEND, "type", "veth", "peer", "name", "sfws-b", "netns", NS_RECV)
    for ns, dev, addr in ((NS_SEND, "sfws-a", ADDR_SEND), (NS_RECV, "sfws-b", ADDR_RECV)):
        sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
        sh("ip", "-n", ns, "link", "set", dev, "up")
        sh("ip", "-n", ns, "link", "set", "lo", "up")
    if not gbit:
        return
    burst = max(1, gbit) * 1_250_000 // 100  # 10 ms of the rate: tbf needs at least rate/HZ
    sh("ip", "netns", "exec", NS_SEND, "tc", "qdisc", "add", "dev", "sfws-a", "root", "tbf",
       "rate", f"{gbit}gbit", "burst", str(max(burst, 200_000)), "latency", "50ms")


def drop_link() -> None:
    for ns in (NS_SEND, NS_RECV):
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def measure(gbit: int, me: list[str], timeout: float, roles: str = "") -> dict:
    """Run `me --role {roles}send` and `me --role {roles}recv` in the two namespaces over a fresh link; the sender's
    last stdout line, parsed."""
    me = [sys.executable, __file__, *me]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    send = recv = None
    drop_link()
    try:
        make_link(gbit)
        send = subprocess.Popen(["ip", "netns", "exec", NS_SEND, *me, "--role", roles + "send"], env=env,
                                stdout=subprocess.PIPE, text=True)
        time.sleep(1.0)  # the store listens before the receiver connects (it also retries)
        recv = subprocess.Popen(["ip", "netns", "exec", NS_RECV, *me, "--role", roles + "recv"], env=env)
        out, _ = send.communicate(timeout=timeout)
        recv.wait(timeout=60)
        if send.returncode or recv.returncode:
            raise RuntimeError(f"sender exited {send.returncode}, receiver {recv.returncode}")
        return json.loads(out.strip().splitlines()[-1])
    finally:
        for proc in (send, recv):
            if proc is not None and proc.poll() is None:
                proc.kill()
        drop_link()


def report_tcp(gbit: int, r: dict) -> str:
    best = min(r["times_s"])
    line = f"line_s={r['bytes'] * 8 / (gbit * 1e9):.2f} " if gbit else ""
    return (f"RESULT tcp link={f'{gbit}Gbit' if gbit else 'unshaped'} bytes={r['bytes'] / 1e9:.3f}GB "
            f"tcp_s={best:.3f} tcp_GBps={r['bytes'] / best / 1e9:.3f} {line}"
            f"tries_s={','.join(f'{t:.3f}' for t in r['times_s'])}")


def report(size: str, gbit: int, r: dict) -> str:
    rounds = sorted(r["rounds_s"])
    net_s = rounds[len(rounds) // 2]
    mid = r["rounds_s"].index(net_s)  # the median round's stages, each end's (they overlap)
    send, recv = r["stages"][mid], r["recv_stages"][mid]
    line = ""
    if gbit:
        line_s = r["bytes"] * 8 / (gbit * 1e9)
        line = f"line_s={line_s:.2f} x_line={net_s / line_s:.2f} "
    disk_s = r["write_s"] + r["read_s"]
    return (f"RESULT size={size} params={params_of(size) / 1e6:.0f}M bytes={r['bytes'] / 1e9:.3f}GB "
            f"link={f'{gbit}Gbit' if gbit else 'unshaped'} "
            f"net_s={net_s:.2f} net_GBps={r['bytes'] / net_s / 1e9:.3f} {line}disk_write_s={r['write_s']:.2f} disk_read_s={r['read_s']:.2f} "
            f"disk_s={disk_s:.2f} disk_GBps={r['bytes'] / disk_s / 1e9:.3f} buckets={r['buckets']} "
            f"groups={r['groups']} rounds={len(rounds)} send_pack_s={send.get('pack', 0):.2f} "
            f"send_wait_s={send.get('wait', 0):.2f} recv_wait_s={recv.get('wait', 0):.2f} "
            f"recv_copy_s={recv.get('consume', 0):.2f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="10M,100M,500M")
    ap.add_argument("--links", default="1,10", help="Gbit/s, comma-separated; 0: the veth pair unshaped")
    ap.add_argument("--repeat", type=int, default=3, help="rounds per size and link (the median is reported)")
    ap.add_argument("--bucket-mb", type=int, default=256)
    ap.add_argument("--workdir", default="/tmp/sf-weight-sync", help="the 'shared disk' of the disk path")
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--tcp-mb", type=int, default=1024, help="the plain-TCP probe's buffer per link (0: no probe)")
    ap.add_argument("--role", choices=["send", "recv", "tcp-send", "tcp-recv"], help=argparse.SUPPRESS)
    ap.add_argument("--size-one", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.role == "send":
        run_sender(a.size_one, a.repeat, a.bucket_mb, Path(a.workdir))
        return 0
    if a.role == "recv":
        run_receiver(a.size_one, a.repeat)
        return 0
    if a.role in ("tcp-send", "tcp-recv"):
        (tcp_send if a.role == "tcp-send" else tcp_recv)(a.tcp_mb)
        return 0
    if os.geteuid() != 0:
        print("weight_sync: needs root for network namespaces (ip netns); not run", file=sys.stderr)
        return 2
    workdir = Path(a.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    links = [int(x) for x in a.links.split(",")]
    if a.tcp_mb > 0:
        for gbit in links:
            print(report_tcp(gbit, measure(gbit, ["--tcp-mb", str(a.tcp_mb)], a.timeout, "tcp-")), flush=True)
    for size in filter(None, a.sizes.split(",")):
        me = ["--size-one", size, "--repeat", str(a.repeat), "--bucket-mb", str(a.bucket_mb), "--workdir", str(workdir)]
        for gbit in links:
            print(report(size, gbit, measure(gbit, me, a.timeout)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
